// AVX2 packed decode kernels (packed_decode_simd.h with 8 lanes): compiled for AVX2 + FMA +
// F16C whatever the build's -march, chosen at run time by packed_kernel (packed_decode.cpp).
// Codes of 8 channels: the B bytes broadcast, lane j shifted right by j B, masked, converted.
#include "ops/packed_decode.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC takes the target as a pragma; clang as an attribute on every function that follows.
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#endif

namespace vq::detail {
namespace {

constexpr int32_t kSimdMaxGroups = 128;

inline float simd_fp8(uint32_t c) {  // packed.h's fp8 e4m3 decoding, compiled here
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

struct V256 {
  using reg = __m256;
  static constexpr int L = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce(reg v) {
    const __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
  }
  static float half(uint16_t h) { return _cvtsh_ss(h); }
  template <int B>
  static reg codes(const uint8_t* rec, int64_t i) {
    const uint8_t* src = rec + i * B / 8;
    if constexpr (B == 8) {
      return _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
    } else {
      uint32_t w = 0;
      __builtin_memcpy(&w, src, B);
      const __m256i c = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)),
                            _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B)),
          _mm256_set1_epi32((1 << B) - 1));
      return _mm256_cvtepi32_ps(c);
    }
  }
};

#include "ops/packed_decode_simd.h"

}  // namespace

PackedKernel packed_kernel_avx2(const PackedRowFormat& f) {
  return simd_kernel<V256>(f, CpuIsa::kAvx2);
}

}  // namespace vq::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else

namespace vq::detail {
PackedKernel packed_kernel_avx2(const PackedRowFormat&) {
  return {};
}
}  // namespace vq::detail

#endif
