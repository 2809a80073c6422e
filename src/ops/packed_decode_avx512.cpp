// AVX-512 packed decode kernels (packed_decode_simd.h with 16 lanes): compiled for AVX-512
// whatever the build's -march, chosen at run time by packed_kernel (packed_decode.cpp).
// Codes of 16 channels come from one small load: the bytes are spread so that each lane's code
// starts at bit 0 after a variable shift, and a lane permute of a table {j mod 2^B} turns the low
// bits into the code as a float (B <= 4; 8-bit codes convert directly).
#include "ops/packed_decode.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC takes the target as a pragma; clang as an attribute on every function that follows.
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(                                                    \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>
#endif

// GCC 12's AVX-512 headers trip -W(maybe-)uninitialized on their own undefined vectors (GCC bug
// 105593).
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace vq::detail {
namespace {

constexpr int32_t kSimdMaxGroups = 64;

#define VQ_SIMD_AVX512
#include "ops/simd_vec.h"

struct V512 : Avx512Vec {
  static float reduce(reg v) {
    const __m256 h =
        _mm256_add_ps(_mm512_castps512_ps256(v),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return simd_hsum4(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
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

// ---- values of 4-bit codes, fp16 metadata, groups and D multiples of 32 ----------------------
//
// 32 channels (16 bytes) per step: the bytes widened to 16 lanes, whose low and high nibbles
// (a lane permute of {0..15}) are the even and odd channels. The accumulators are held in that
// even / odd order over a tile's rows (deinterleaved once when loaded, interleaved when stored),
// so a row costs one widening, two permutes and a shift per 32 channels plus the FMAs. Weights
// w = p s_g are formed once per (row, group) for 4 queries at a time (queries padded to Mp, a
// multiple of 4, with zero probabilities); acc += w c per channel, rows in order;
// acc_lo += p lo_g per group. Scratch: pt [32][Mp], w [rows][ng][Mp], alo [ng][Mp].

template <int QB>
void b4_block(const PackedTile& tile, int64_t d, const float* w, int64_t ng, int64_t mp, float* acc,
              int64_t m0, int64_t blk, int64_t g) {
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i lo16 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi16 =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 ae[QB], ao[QB];
  for (int k = 0; k < QB; ++k) {
    const float* a = acc + (m0 + k) * d + blk * 32;
    const __m512 a0 = _mm512_loadu_ps(a), a1 = _mm512_loadu_ps(a + 16);
    ae[k] = _mm512_permutex2var_ps(a0, ev, a1);
    ao[k] = _mm512_permutex2var_ps(a0, od, a1);
  }
  for (int64_t r = 0; r < tile.n_rows; ++r) {
    const uint8_t* rec = tile.rec0 + tile.rows[r] * tile.stride;
    const __m512i x =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + blk * 16)));
    const __m512 ce = _mm512_permutexvar_ps(x, iota);
    const __m512 co = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), iota);
    const float* wr = w + (r * ng + g) * mp + m0;
    for (int k = 0; k < QB; ++k) {
      const __m512 wk = _mm512_set1_ps(wr[k]);
      ae[k] = _mm512_fmadd_ps(wk, ce, ae[k]);
      ao[k] = _mm512_fmadd_ps(wk, co, ao[k]);
    }
  }
  for (int k = 0; k < QB; ++k) {
    float* a = acc + (m0 + k) * d + blk * 32;
    _mm512_storeu_ps(a, _mm512_permutex2var_ps(ae[k], lo16, ao[k]));
    _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(ae[k], hi16, ao[k]));
  }
}

void values_b4(const PackedRowFormat& f, const PackedTile& tile, const float* p, int64_t ld,
               int64_t n_q, float* acc, float* acc_lo, float* scratch) {
  const int64_t d = f.head_dim, gs = f.group_size, ng = f.n_groups, mp = (n_q + 3) / 4 * 4;
  const int64_t nr = tile.n_rows;
  float* pt = scratch;            // [nr][mp] probabilities of the listed rows, transposed
  float* w = pt + 32 * mp;        // [nr][ng][mp]
  float* alo = w + 32 * ng * mp;  // [ng][mp]
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t t = tile.rows[r];
    for (int64_t m = 0; m < mp; ++m) pt[r * mp + m] = m < n_q ? p[m * ld + t] : 0.0f;
  }
  for (int64_t i = 0; i < ng * mp; ++i) alo[i] = 0.0f;
  for (int64_t r = 0; r < nr; ++r) {
    const uint16_t* meta =
        reinterpret_cast<const uint16_t*>(tile.rec0 + tile.rows[r] * tile.stride + f.code_bytes);
    for (int64_t g = 0; g < ng; ++g) {
      const __m128 lo = _mm_set1_ps(_cvtsh_ss(meta[2 * g]));
      const __m128 sg = _mm_set1_ps(_cvtsh_ss(meta[2 * g + 1]));
      for (int64_t m = 0; m < mp; m += 4) {
        const __m128 pv = _mm_loadu_ps(pt + r * mp + m);
        _mm_storeu_ps(w + (r * ng + g) * mp + m, _mm_mul_ps(pv, sg));
        _mm_storeu_ps(alo + g * mp + m, _mm_fmadd_ps(pv, lo, _mm_loadu_ps(alo + g * mp + m)));
      }
    }
  }
  for (int64_t m = 0; m < n_q; ++m)
    for (int64_t g = 0; g < ng; ++g) acc_lo[m * ng + g] += alo[g * mp + m];
  for (int64_t blk = 0; blk < d / 32; ++blk) {
    const int64_t g = blk * 32 / gs;
    int64_t m0 = 0;
    for (; m0 + 4 <= n_q; m0 += 4) b4_block<4>(tile, d, w, ng, mp, acc, m0, blk, g);
    switch (n_q - m0) {
      case 3:
        b4_block<3>(tile, d, w, ng, mp, acc, m0, blk, g);
        break;
      case 2:
        b4_block<2>(tile, d, w, ng, mp, acc, m0, blk, g);
        break;
      case 1:
        b4_block<1>(tile, d, w, ng, mp, acc, m0, blk, g);
        break;
      default:
        break;
    }
  }
}

}  // namespace

PackedKernel packed_kernel_avx512(const PackedRowFormat& f) {
  PackedKernel k = simd_kernel<V512>(f, CpuIsa::kAvx512);
  if (k.values && f.spec.bits_x2 == 8 && f.meta == MetaType::kF16 && f.group_size % 32 == 0 &&
      f.head_dim % 32 == 0)
    k.values = values_b4;
  return k;
}

}  // namespace vq::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else

namespace vq::detail {
PackedKernel packed_kernel_avx512(const PackedRowFormat&) {
  return {};
}
}  // namespace vq::detail

#endif
