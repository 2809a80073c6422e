// Tensor-core helpers shared by the prefill kernels (prefill_fa.cu, prefill_wg.cu) and the SnapKV
// scores of f16 keys (snapkv.cu), device code only (sm_80+ PTX). Staged tiles are fp16 rows of D
// channels (2 * D bytes) whose 16-byte chunk c of row r lies at chunk c ^ (r & 7) (tc_off), so the
// 8 rows of an ldmatrix hit 8 distinct bank groups. Fragments follow mma.m16n8k16's layout: lane =
// 4 g + t4 holds rows g (A) and g + 8 (B), channels 16 ks + 2 t4 (+1, +8, +9) of k-step ks. Queries
// go in as fp16 hi + lo parts of q * 2^sigma (tc_query_frags, QLO): every product with an fp16 key
// is exact and fp32 accumulation carries q to 2^-22 relative (the SnapKV scores, whose selections
// must match the CPU's); without QLO (prefill attention: FlashAttention numerics, docs/design.md
// section 4) as the fp16 rounding hi alone, 2^-11 relative. Every operand helper is templated on
// the 16-bit element type T: __half (fp16, the default) or __nv_bfloat16 (bf16: planes of bf16
// rows, mma.m16n8k16 .bf16, the query rounded to bf16, 2^-8 relative); same layouts, same
// fragments (both are 16-bit elements, ldmatrix moves them alike).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace vq::cuda {

// Byte offset of channel c (a multiple of 8 for whole chunks) of row r in a swizzled plane of
// fp16 rows [.][D].
template <int D>
__device__ __forceinline__ int tc_off(int r, int c) {
  return r * (2 * D) + 16 * ((c >> 3) ^ (r & 7)) + 2 * (c & 7);
}

// 16 bytes global -> shared, asynchronously (cp.async.cg), and its group commit / wait.
__device__ __forceinline__ void tc_cp16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void tc_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void tc_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 fp16 matrices from shared memory (lane l gives the address of row l & 7 of matrix
// l >> 3); tc_ldsm_t transposed.
__device__ __forceinline__ void tc_ldsm(const uint8_t* a, uint32_t (&r)[4]) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(a));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void tc_ldsm_t(const uint8_t* a, uint32_t (&r)[4]) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(a));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// d += a * b on mma.m16n8k16 (T inputs: fp16 or bf16; fp32 accumulation).
template <class T = __half>
__device__ __forceinline__ void tc_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The T roundings of (x0, x1) as one 32-bit pair (x0 in the low half), and back to fp32.
template <class T = __half>
__device__ __forceinline__ uint32_t tc_pack2(float x0, float x1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(x0, x1);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}
template <class T = __half>
__device__ __forceinline__ float2 tc_unpack2(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
  else
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

// x rounded to T.
template <class T = __half>
__device__ __forceinline__ T tc_round(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(x);
  else
    return __float2half_rn(x);
}

// hi = T rounding of (x0, x1), lo = T rounding of the remainders (exact in fp32).
template <class T = __half>
__device__ __forceinline__ void tc_split(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = tc_pack2<T>(x0, x1);
  const float2 f = tc_unpack2<T>(hi);
  lo = tc_pack2<T>(x0 - f.x, x1 - f.y);
}

// 2^x in fp32 by ex2.approx.ftz (within 2 ulp, as exp2f, whose non-ftz form only adds the
// scaling of subnormal results): a weight below 2^-126 becomes 0, an error under 2^-126 |v| per
// term, far inside the accumulation term of the bounds (tests/ops_harness/attention_bounds.cpp).
__device__ __forceinline__ float tc_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// sigma of a row whose max |q| is m: 12 - e with m in [2^(e-1), 2^e), so the scaled row's largest
// |value| lies in [2^11, 2^12), far inside fp16's range, and its lo parts stay clear of fp16
// subnormals; 0 for an all-zero or non-finite row.
__device__ __forceinline__ int tc_sigma(float m) {
  int e = 0;
  if (m > 0.0f && isfinite(m)) {
    frexpf(m, &e);
    e = 12 - e;
  }
  return e;
}

// This lane's query fragments qh + ql (hi + lo of q * 2^sigma, per row A = g and B = g + 8) and
// the rows' sigmas sA, sB. load(row, c) gives channels c, c + 1 of row A (row 0) or B (row 1),
// zeros for a row that does not exist; the row max |q| is joined over the 4 lanes of a row.
// T: the operands' type (the split or rounding is to T).
template <int D, bool QLO, class T = __half, class Load>
__device__ __forceinline__ void tc_query_frags(const Load& load, int t4, uint32_t (&qh)[D / 16][4],
                                               uint32_t (&ql)[D / 16][4], int& sA, int& sB) {
  // fn(ks, hf, x, y) for each of this lane's channel pairs c, c + 1 (k-step ks, half hf), x and y
  // rows A's and B's values: the query is read twice (max, then split), not held in registers.
  const auto pairs = [&](const auto& fn) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int c = 16 * ks + 2 * t4 + 8 * hf;
        fn(ks, hf, load(0, c), load(1, c));
      }
  };
  float mA = 0.0f, mB = 0.0f;
  pairs([&](int, int, float2 x, float2 y) {
    mA = fmaxf(mA, fmaxf(fabsf(x.x), fabsf(x.y)));
    mB = fmaxf(mB, fmaxf(fabsf(y.x), fabsf(y.y)));
  });
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    mA = fmaxf(mA, __shfl_xor_sync(0xffffffffu, mA, o));
    mB = fmaxf(mB, __shfl_xor_sync(0xffffffffu, mB, o));
  }
  sA = tc_sigma(mA);
  sB = tc_sigma(mB);
  pairs([&](int ks, int hf, float2 x, float2 y) {
    if constexpr (QLO) {
      tc_split<T>(ldexpf(x.x, sA), ldexpf(x.y, sA), qh[ks][2 * hf], ql[ks][2 * hf]);
      tc_split<T>(ldexpf(y.x, sB), ldexpf(y.y, sB), qh[ks][2 * hf + 1], ql[ks][2 * hf + 1]);
    } else {
      qh[ks][2 * hf] = tc_pack2<T>(ldexpf(x.x, sA), ldexpf(x.y, sA));
      qh[ks][2 * hf + 1] = tc_pack2<T>(ldexpf(y.x, sB), ldexpf(y.y, sB));
      ql[ks][2 * hf] = ql[ks][2 * hf + 1] = 0u;
    }
  });
}

// s[n] += logits of this warp's 16 query rows x keys 8n .. 8n + 7 of a staged 64-row tile k_hi
// (swizzled rows of T): q_hi k (+ q_lo k with QLO) per k-step, then q_hi k_lo when k_lo (the
// keys' lo plane) is given.
template <int D, bool QLO, class T = __half>
__device__ __forceinline__ void tc_logits64(const uint8_t* k_hi, const uint8_t* k_lo,
                                            const uint32_t (&qh)[D / 16][4],
                                            const uint32_t (&ql)[D / 16][4], int lane,
                                            float (&s)[8][4]) {
  const int lr = lane & 7, lm = lane >> 3;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      const int off = tc_off<D>(16 * np + 8 * (lm >> 1) + lr, 16 * ks + 8 * (lm & 1));
      uint32_t r[4];
      tc_ldsm(k_hi + off, r);
      tc_mma<T>(s[2 * np], qh[ks], r[0], r[1]);
      if constexpr (QLO) tc_mma<T>(s[2 * np], ql[ks], r[0], r[1]);
      tc_mma<T>(s[2 * np + 1], qh[ks], r[2], r[3]);
      if constexpr (QLO) tc_mma<T>(s[2 * np + 1], ql[ks], r[2], r[3]);
      if (k_lo) {
        tc_ldsm(k_lo + off, r);
        tc_mma<T>(s[2 * np], qh[ks], r[0], r[1]);
        tc_mma<T>(s[2 * np + 1], qh[ks], r[2], r[3]);
      }
    }
}

}  // namespace vq::cuda
