// Error bounds of the attention kernels against attention_reference (attention.h), in one place
// for the op harness; each is derived in attention_bounds.cpp from the kernel's arithmetic
// (restating the derivations of tests/test_fused_attention.cpp for the fused CPU path and of
// tests/cuda/attention_check.h for the CUDA decode and prefill kernels).
//
// q: [B, Hq, N, D] fp32, query i at ap.q_pos0 + i. view: the cache view the kernel read (packed
// segments allowed); dense: dequantize_view(view, kF32) (same segments, full precision).
// Every function returns one bound per output element, laid out like the output [B, Hq, N, D].
#pragma once

#include <cstdint>
#include <vector>

#include "ops/packed_decode.h"
#include "veloxquant/attention.h"
#include "veloxquant/cache.h"

namespace vq::harness {

// The reference output (attention_reference over dense) widened to double.
std::vector<double> attention_ref(const CacheView& dense, const std::vector<float>& q, int64_t hq,
                                  int64_t n_q, const AttentionParams& ap);

// vq::attention (the fused CPU path) over view.
std::vector<double> fused_cpu_bound(const CacheView& view, const CacheView& dense,
                                    const std::vector<float>& q, int64_t hq, int64_t n_q,
                                    const AttentionParams& ap);

// vq::attention in decode over packed rows (the packed decode kernels, src/ops/packed_decode.h:
// fewer than 8 queries per head) with the kernels of instruction set isa (the call's
// detail::attention_isa()): the logit depth of packed rows is g + 2 n_groups + 7 roundings
// instead of D + 8, plus the int8 query rounding where isa's key kernel has it (derived in
// attention_bounds.cpp; fused_cpu_bound adds that term too for decode-sized calls).
std::vector<double> packed_decode_bound(const CacheView& view, const CacheView& dense,
                                        const std::vector<float>& q, int64_t hq, int64_t n_q,
                                        const AttentionParams& ap, detail::CpuIsa isa);

// CUDA kernels: decode_attention and the tensor-core prefill (kDecode), the CUDA-core prefill
// (kPrefill). ref is attention_ref's output.
enum class GpuAttnKernel { kDecode, kPrefill };
std::vector<double> gpu_attention_bound(const CacheView& dense, const std::vector<float>& q,
                                        int64_t hq, int64_t n_q, const AttentionParams& ap,
                                        GpuAttnKernel kern, const std::vector<double>& ref);

}  // namespace vq::harness
