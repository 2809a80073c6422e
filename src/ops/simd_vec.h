// fp32 vector wrappers for code written once over a vector type V: Avx2Vec (8 lanes) and
// Avx512Vec (16 lanes) give reg, L (lanes), zero(), load(p), store(p, v), set1(x) and
// fma(a, b, c) = a*b + c (one rounding), plus the scalar pieces the packed decode kernels share
// (simd_fp8, simd_hsum4). Used by packed_decode_simd.h (through packed_decode_avx2.cpp and
// packed_decode_avx512.cpp) and by fused_attention.cpp's dot_many / accumulate_tile.
// Include after <immintrin.h>, inside an anonymous namespace, where the instruction set is
// enabled (`#pragma GCC target` or -march): each including file compiles its own copy for its
// own target and nothing is shared between files. Avx512Vec is there only when the including
// file defines VQ_SIMD_AVX512 first (its functions pass __m512 by value, an ABI change where
// AVX-512 is not enabled, which -Wpsabi reports even for functions that are never called).
#pragma once

struct Avx2Vec {
  using reg = __m256;
  static constexpr int L = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
};

#if defined(VQ_SIMD_AVX512)
struct Avx512Vec {
  using reg = __m512;
  static constexpr int L = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
};
#endif

// packed.h's fp8 e4m3 decoding, compiled for the including file's instruction set.
inline float simd_fp8(uint32_t c) {
  const uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
  if (e == 15u && m == 7u) return __builtin_nanf("");
  float v;
  if (e == 0u) {
    v = static_cast<float>(m) * 0x1p-9f;
  } else {
    const uint32_t u = ((e + 120u) << 23) | (m << 20);
    __builtin_memcpy(&v, &u, 4);
  }
  return (c & 0x80u) ? -v : v;
}

// (x0 + x2) + (x1 + x3): the last steps of the packed kernels' lane reductions.
inline float simd_hsum4(__m128 x) {
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}
