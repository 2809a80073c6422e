// Error bounds of the attention kernels against attention_reference (attention.h), in one place
// for the op harness and every test that checks attention (tests/test_fused_attention.cpp, the
// GPU tests through tests/cuda/attention_check.h); each is derived in attention_bounds.cpp (and
// below) from the kernel's arithmetic: the fused CPU path, the CPU packed decode kernels, the
// CUDA decode and prefill kernels.
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

// The fp16 operands of the CUDA tensor-core paths (FlashAttention numerics, docs/design.md
// section 4): the decode kernels (f16 rows, 2-/4-bit codes; the generic kernel's logits of f16
// rows and 2-bit codes) and the tensor-core prefill round q and p once to fp16 and multiply them
// with exact fp16 keys, values and codes, accumulating in fp32. Their two terms, added to the
// fp32 bound of kDecode below:
//  * logit: q' = q * sigma (* 4^-i for 2-bit packed keys; sigma = 2^e puts max |q| in
//    [2^11, 2^12)) rounds to fp16 with |dq_d| <= 2^-11 |q_d| where normal, and <= 2^-25 / sigma /
//    4^-i <= 2^-30 max |q| where subnormal; the zero-point chunk sums are taken over the rounded
//    q, so a logit errs by sum_d |dq_d| |k_d| <= 2^-11 ||q|| ||k|| + 2^-30 sqrt(D) ||q|| ||k||
//    (Cauchy-Schwarz; the same under the orthonormal key transforms), i.e. at most
//    kGpuLogitRel * scale * ||q|| ||k|| for D <= 256;
//  * values: p (fp32, in [0, 1]; the softmax sum l adds the unrounded p) enters P V as its fp16
//    rounding (or that of p * scale * 2^S for packed values): relative 2^-11 of p |v - lo| per
//    term (f16 rows: lo = 0), so the output errs by at most 2^-11 max |v - lo| (the p sum to l);
//    |lo| <= V (lo is the group's clipped minimum, rounded to its metadata type, which the
//    group's dequantized values reach to within a step; 1.07 V with fp8 metadata) gives
//    max |v - lo| < 4 V: kGpuValueRel * V = 2^-9 V. Subnormal p (< 2^-14) err by at most 2^-25 |v|
//    each, inside the accumulation term 2 gamma(9 n / 8 + 64) V as before.
constexpr double kGpuLogitRel = 0x1p-11 + 0x1p-26;
constexpr double kGpuValueRel = 0x1p-9;

// CUDA kernels: decode_attention and the tensor-core prefill (kDecode: the fp32 bound plus the
// fp16-operand terms above), the CUDA-core prefill (kPrefill). ref is attention_ref's output.
enum class GpuAttnKernel { kDecode, kPrefill };
std::vector<double> gpu_attention_bound(const CacheView& dense, const std::vector<float>& q,
                                        int64_t hq, int64_t n_q, const AttentionParams& ap,
                                        GpuAttnKernel kern, const std::vector<double>& ref);

}  // namespace vq::harness
