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
// with fp16 keys, values and codes (exact for rows and codes; prefill's rounded packed rows add
// the kPrefillTc terms below), accumulating in fp32. Their two terms, added to the fp32 bound
// of kDecode below:
//  * logit: q' = q * sigma (* 4^-i for 2-bit packed keys; sigma = 2^e puts max |q| in
//    [2^11, 2^12)) rounds to fp16 with |dq_d| <= 2^-11 |q_d| where normal, and <= 2^-25 / sigma /
//    4^-i <= 2^-30 max |q| where subnormal; the zero-point chunk sums are taken over the rounded
//    q, so a logit errs by sum_d |dq_d| |k_d| <= 2^-11 ||q|| ||k|| + 2^-30 sqrt(D) ||q|| ||k||
//    (Cauchy-Schwarz; the same under the orthonormal key transforms), i.e. at most
//    kGpuLogitRel * scale * ||q|| ||k|| for D <= 256;
//  * values: p (fp32, in [0, 1]; the softmax sum l adds the unrounded p) enters P V as its fp16
//    rounding. f16 rows: relative 2^-11 of p |v| per term. Packed values with f16 metadata are
//    dequantized in fp16 first, v' = fl16(c * scale + lo) (one fma, one rounding: |v' - v| <=
//    2^-11 |v|, or <= 2^-25 where v' is subnormal), then meet fp16(p): |p' v' - p v| <=
//    (2^-10 + 2^-22) p |v| + (1 + 2^-11) p 2^-25. Packed values with other metadata types take
//    their codes exactly and p * scale * 2^S rounded to fp16 (2^-11 of p |v - lo|) plus the
//    zero-points in fp32 with the unrounded p (exact). So the output errs by at most
//    max(2^-10 + 2^-22, 2^-11 * 3.14) V (the p sum to l; |lo| <= 1.07 V, lo being the group's
//    clipped minimum rounded to its metadata type, which the group's dequantized values reach to
//    within a step, gives |v - lo| <= 2.07 V) < kGpuValueRel * V = 2^-9 V, plus the subnormal
//    values' absolute (1 + 2^-10) 2^-25 < kGpuValueAbs = 2^-24. Subnormal p (< 2^-14) err by at
//    most 2^-25 |v| each, inside the accumulation term 2 gamma(9 n / 8 + 64) V as before.
constexpr double kGpuLogitRel = 0x1p-11 + 0x1p-26;
constexpr double kGpuValueRel = 0x1p-9;
constexpr double kGpuValueAbs = 0x1p-24;

// The same two terms for the bf16 operands of views whose full-precision rows are bf16 (the
// bf16-row decode instances, prefill's bf16 tensor-core kernel; FlashAttention's bf16
// numerics), derived the same way with bf16's unit roundoff 2^-8 in place of fp16's 2^-11:
//  * logit: blocks of bf16 rows round q' = q * sigma to bf16, |dq_d| <= 2^-8 |q_d| (bf16 has
//    fp32's exponent range: subnormal only below 2^-126, i.e. below 2^-137 of max |q'|, an
//    absolute error far under fp16's 2^-26 term, kept as it is); bf16 keys are exact operands:
//    2^-8 ||q|| ||k||. Packed rows beside bf16 rows: decode keeps their fp16 operands
//    (kGpuLogitRel, smaller); prefill rounds them to bf16 (the kPrefillTc terms below). In all,
//    2^-8 + 2^-26 <= kGpuBf16LogitRel = 2^-8 + 2^-24 (times scale ||q|| ||k||).
//  * values: p (fp32, in [0, 1]) enters P V as its bf16 rounding: 2^-8 p |v| per term over
//    bf16 operands (prefill's rounded packed values: the kPrefillTc terms); decode's packed
//    values keep fp16's 2^-9 V. The output errs by at most 2^-8 V (the p sum to l) <=
//    kGpuBf16ValueRel V = (2^-8 + 2^-24) V. Subnormal p (below 2^-126) err by at most
//    2^-134 |v| each, inside the accumulation term.
constexpr double kGpuBf16LogitRel = 0x1p-8 + 0x1p-24;
constexpr double kGpuBf16ValueRel = 0x1p-8 + 0x1p-24;

// The 16-bit operand type of the tensor-core paths over view: kBF16 when a non-empty
// full-precision segment holds bf16 rows, else kF16 (f16 rows, packed rows alone, and the
// f32 views of the CUDA-core kernels, whose kDecode bound keeps the fp16 terms).
DType tc_operands(const CacheView& view);

// The tensor-core prefill (kPrefillTc) takes packed segments as their dequantized fp32 values
// rounded once to the operand type E (prefill_attention.cu; one plane, one MMA per product, as
// f16/bf16 rows): such a key element k_d becomes k_d + dk_d with dk_d = 0 where k_d is exact in
// E (every element of f16/bf16 rows; the dense twin holds the kernel's fp32 values: the kernel's
// dequantization is the CPU's, prefill_attention.cu) and otherwise |dk_d| <= u_E |k_d| + s_E
// (u_E = 2^-11, s_E = 2^-25 for fp16: half the spacing of its subnormals; u_E = 2^-8 and
// s_E = 2^-134 for bf16); values likewise dv. On top of kDecode's terms:
//  * logit: the rounded query q'' (within (1 + u_E) |q_d| of q after the multiplier, the
//    subnormal term folded in as 2^-10) meets dk: scale (1 + 2^-10) sum_d |q_d| |dk_d| per key,
//    evaluated per key and added to that key's logit error (kDecode's q-rounding term
//    u_E ||q|| ||k|| is taken over the exact k; its product with dk is inside the 2^-10);
//  * values: sum_j fl(p_j) |dv_jd| / l <= (1 + 2^-10) max_j |dv_jd| per output channel d (the
//    rounded weights sum to l within u_E, the same slack); the rounding of p itself then meets
//    v + dv, |v + dv| <= (1 + u_E) |v|, inside kGpuValueRel's slack (3.14 V against 4 V).
// Where every operand is exact in E (f16 or bf16 rows alone) kPrefillTc equals kDecode.
//
// CUDA kernels: decode_attention (kDecode: the fp32 bound plus the 16-bit-operand terms above,
// fp16's or, with operands kBF16, bf16's), the tensor-core prefill (kPrefillTc: kDecode's terms
// plus the rounding of inexact operands above), the CUDA-core prefill (kPrefill; operands
// unused). ref is attention_ref's output.
enum class GpuAttnKernel { kDecode, kPrefill, kPrefillTc };
std::vector<double> gpu_attention_bound(const CacheView& dense, const std::vector<float>& q,
                                        int64_t hq, int64_t n_q, const AttentionParams& ap,
                                        GpuAttnKernel kern, DType operands,
                                        const std::vector<double>& ref);

}  // namespace vq::harness
