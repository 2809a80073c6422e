// exp(x) for x <= 0 on 16 AVX-512 lanes with the scalar exp_nonpos's operations in order (internal
// header of the CPU kernels: fused attention's many-query softmax over packed rows, the runtime's
// SwiGLU). Cody-Waite reduction by ln 2 and the Cephes degree-6 polynomial, each step a separate
// multiply and add (built with -ffp-contract=off, so no FMA contraction: the lanes reproduce the
// scalar function bit for bit); x < -87 and NaN give 0. Measured max relative error 1.41 u,
// u = 2^-24, over every float in [-87, 0]. Only with AVX-512F.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace vq::simd {

inline __m512 exp_nonpos16_exact(__m512 v) {
  const __m512 lim = _mm512_set1_ps(-87.0f);
  const __mmask16 ok = _mm512_cmp_ps_mask(v, lim, _CMP_GE_OQ);
  v = _mm512_mask_blend_ps(ok, lim, v);
  const __m512 shift = _mm512_set1_ps(12582912.0f);
  const __m512 k = _mm512_sub_ps(
      _mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)), shift), shift);
  __m512 r = _mm512_sub_ps(v, _mm512_mul_ps(k, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(k, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 q = _mm512_set1_ps(1.9875691500E-4f);
  q = _mm512_add_ps(_mm512_mul_ps(q, r), _mm512_set1_ps(1.3981999507E-3f));
  q = _mm512_add_ps(_mm512_mul_ps(q, r), _mm512_set1_ps(8.3334519073E-3f));
  q = _mm512_add_ps(_mm512_mul_ps(q, r), _mm512_set1_ps(4.1665795894E-2f));
  q = _mm512_add_ps(_mm512_mul_ps(q, r), _mm512_set1_ps(1.6666665459E-1f));
  q = _mm512_add_ps(_mm512_mul_ps(q, r), _mm512_set1_ps(5.0000001201E-1f));
  q = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(q, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(ok, q, _mm512_castsi512_ps(bits));
}

}  // namespace vq::simd
#endif
