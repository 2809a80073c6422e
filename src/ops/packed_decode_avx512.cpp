// AVX-512 packed decode kernels (packed_decode_simd.h with 16 lanes): compiled for AVX-512
// whatever the build's -march, chosen at run time by packed_kernel (packed_decode.cpp).
// Codes of 16 channels come from one small load: the bytes are spread so that each lane's code
// starts at bit 0 after a variable shift, and a lane permute of a table {j mod 2^B} turns the low
// bits into the code as a float (B <= 4; 8-bit codes convert directly).
#include "ops/packed_decode.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

// GCC 12's AVX-512 headers trip -W(maybe-)uninitialized on their own undefined vectors (GCC bug
// 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace vq::detail {
namespace {

constexpr int32_t kSimdMaxGroups = 64;

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

struct V512 {
  using reg = __m512;
  static constexpr int L = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce(reg v) {
    const __m256 h =
        _mm256_add_ps(_mm512_castps512_ps256(v),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
  }
  static float half(uint16_t h) { return _cvtsh_ss(h); }
  template <int B>
  static reg codes(const uint8_t* rec, int64_t i) {
    const uint8_t* src = rec + i * B / 8;
    if constexpr (B == 8) {
      return _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
    } else {
      const __m512 table =
          B == 4   ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
          : B == 2 ? _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)
                   : _mm512_setr_ps(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1);
      __m512i wv;
      if constexpr (B == 4) {  // 8 bytes, each twice, shifted by 0 / 4
        const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
        wv = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(bytes, dup)),
                               _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
      } else {  // 2 or 4 bytes broadcast, lane j shifted by j B
        uint32_t w = 0;
        __builtin_memcpy(&w, src, 2 * B);
        wv = _mm512_srlv_epi32(
            _mm512_set1_epi32(static_cast<int>(w)),
            _mm512_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B, 8 * B, 9 * B, 10 * B,
                              11 * B, 12 * B, 13 * B, 14 * B, 15 * B));
      }
      return _mm512_permutexvar_ps(wv, table);  // lane's low 4 bits (its code mod 2^B index)
    }
  }
};

#include "ops/packed_decode_simd.h"

}  // namespace

PackedKernel packed_kernel_avx512(const PackedRowFormat& f) {
  return simd_kernel<V512>(f, CpuIsa::kAvx512);
}

}  // namespace vq::detail

#pragma GCC pop_options

#else

namespace vq::detail {
PackedKernel packed_kernel_avx512(const PackedRowFormat&) {
  return {};
}
}  // namespace vq::detail

#endif
