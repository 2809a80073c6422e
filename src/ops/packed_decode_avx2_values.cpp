// AVX2 packed value kernel over rows of 8-byte code blocks (packed_decode.h): the AVX-512
// row-major kernel's plan (packed_decode_avx512.cpp, values_rows) with 8 lanes, for CPUs without
// AVX-512. Chosen at run time by packed_kernel on kAvx2 and kAvx2Int8 for 2- and 4-bit codes,
// fp16 metadata, token axis, groups of whole blocks (a multiple of 8 P channels, P = 8 / B codes
// per byte), at most 16 groups.
//
// A block's 8 code bytes are widened to 8 lanes; for j < P, lane k's code j ((byte >> jB) masked,
// converted; 2-bit codes by a lane permute of the table {i mod 4}) is channel 8 P blk + P k + j.
// The accumulators of a pass are held in that order (vector j of each block), deinterleaved from
// acc when the pass starts and interleaved back when it ends, while the tile's rows go by in
// order: acc_i = fma(w, c_i, acc_i) per channel, w = p s_g (one fp32 product, as the fp32 SIMD
// kernel's: the same bits). Weights are formed per tile in ws[m][g][32] (rows past the tile's
// count hold zero); acc_lo[m][g] += p lo_g in 8 row lanes over the tile, lane-summed once at
// its end (another order than the fp32 SIMD kernel's row loop, within n_rows u sum |p lo|).
#include "ops/packed_decode.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
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

constexpr int64_t kTileRows = 32;  // rows per tile at most (packed_decode.h)
constexpr int32_t kMaxGroups = 16;

inline __m256 even8(__m256 a, __m256 b) {  // [a0 a2 a4 a6 b0 b2 b4 b6]
  return _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
}
inline __m256 odd8(__m256 a, __m256 b) {  // [a1 a3 a5 a7 b1 b3 b5 b7]
  return _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
}
inline void zip8(__m256 e, __m256 o, __m256* a, __m256* b) {  // the inverse of even8 / odd8
  const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
  *a = _mm256_permute2f128_ps(lo, hi, 0x20);
  *b = _mm256_permute2f128_ps(lo, hi, 0x31);
}

// v[j] lane k = src[P k + j] for the 8 P floats at src.
template <int P>
inline void deinterleave(const float* src, __m256* v) {
  const __m256 a0 = _mm256_loadu_ps(src), a1 = _mm256_loadu_ps(src + 8);
  if constexpr (P == 2) {
    v[0] = even8(a0, a1);
    v[1] = odd8(a0, a1);
  } else {
    const __m256 a2 = _mm256_loadu_ps(src + 16), a3 = _mm256_loadu_ps(src + 24);
    const __m256 e01 = even8(a0, a1), o01 = odd8(a0, a1);
    const __m256 e23 = even8(a2, a3), o23 = odd8(a2, a3);
    v[0] = even8(e01, e23);
    v[1] = even8(o01, o23);
    v[2] = odd8(e01, e23);
    v[3] = odd8(o01, o23);
  }
}

template <int P>
inline void interleave(const __m256* v, float* dst) {
  __m256 a0, a1;
  if constexpr (P == 2) {
    zip8(v[0], v[1], &a0, &a1);
    _mm256_storeu_ps(dst, a0);
    _mm256_storeu_ps(dst + 8, a1);
  } else {
    __m256 e01, e23, o01, o23, a2, a3;
    zip8(v[0], v[2], &e01, &e23);
    zip8(v[1], v[3], &o01, &o23);
    zip8(e01, o01, &a0, &a1);
    zip8(e23, o23, &a2, &a3);
    _mm256_storeu_ps(dst, a0);
    _mm256_storeu_ps(dst + 8, a1);
    _mm256_storeu_ps(dst + 16, a2);
    _mm256_storeu_ps(dst + 24, a3);
  }
}

template <int B>
inline __m256 code_lanes(__m256i x, int j) {
  const __m256i sh = j == 0 ? x : _mm256_srli_epi32(x, j * B);
  if constexpr (B == 2) {
    return _mm256_permutevar8x32_ps(_mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3), sh);  // low 3 bits
  } else {
    return _mm256_cvtepi32_ps(_mm256_and_si256(sh, _mm256_set1_epi32(15)));
  }
}

// The tile's rows into the accumulators of queries m0 .. m0 + QB over NH blocks from block b0.
template <int B, int NH, int QB>
void rows_pass(const PackedRowFormat& f, const PackedTile& tile, const float* ws, int64_t m0,
               int64_t b0, float* acc) {
  constexpr int P = 8 / B;
  const int64_t d = f.head_dim, gs = f.group_size, ng = f.n_groups;
  const float* wb[QB][NH];
  __m256 a[QB][NH][P];
  for (int q = 0; q < QB; ++q)
    for (int h = 0; h < NH; ++h) {
      wb[q][h] = ws + ((m0 + q) * ng + (b0 + h) * 8 * P / gs) * kTileRows;
      deinterleave<P>(acc + (m0 + q) * d + (b0 + h) * 8 * P, a[q][h]);
    }
  for (int64_t r = 0; r < tile.n_rows; ++r) {
    const uint8_t* rec = tile.rec0 + tile.rows[r] * tile.stride + b0 * 8;
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const __m256i x =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 8 * h)));
#pragma GCC unroll 4
      for (int j = 0; j < P; ++j) {
        const __m256 c = code_lanes<B>(x, j);
#pragma GCC unroll 4
        for (int q = 0; q < QB; ++q)
          a[q][h][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(wb[q][h] + r), c, a[q][h][j]);
      }
    }
  }
  for (int q = 0; q < QB; ++q)
    for (int h = 0; h < NH; ++h) interleave<P>(a[q][h], acc + (m0 + q) * d + (b0 + h) * 8 * P);
}

// Every block of the row for queries m0 .. m0 + QB, NH blocks per pass (at most 12
// accumulators; NH divides nb).
template <int B, int QB>
void rows_passes(const PackedRowFormat& f, const PackedTile& tile, const float* ws, int64_t m0,
                 float* acc) {
  constexpr int P = 8 / B, cap = 12 / (QB * P);
  const int64_t nb = f.code_bytes / 8;
  if (cap >= 4 && nb % 4 == 0) {
    for (int64_t b0 = 0; b0 < nb; b0 += 4) rows_pass<B, 4, QB>(f, tile, ws, m0, b0, acc);
  } else if (cap >= 2 && nb % 2 == 0) {
    for (int64_t b0 = 0; b0 < nb; b0 += 2) rows_pass<B, 2, QB>(f, tile, ws, m0, b0, acc);
  } else {
    for (int64_t b0 = 0; b0 < nb; ++b0) rows_pass<B, 1, QB>(f, tile, ws, m0, b0, acc);
  }
}

template <int B>
void values_rows(const PackedRowFormat& f, const PackedTile& tile, const float* p, int64_t ld,
                 int64_t n_q, float* acc, float* acc_lo, float* scratch) {
  const int64_t ng = f.n_groups, n = tile.n_rows;
  alignas(32) float lo[kMaxGroups][kTileRows], sg[kMaxGroups][kTileRows];
  for (int64_t r = 0; r < kTileRows; ++r) {
    const uint16_t* mh = r < n ? reinterpret_cast<const uint16_t*>(
                                     tile.rec0 + tile.rows[r] * tile.stride + f.code_bytes)
                               : nullptr;
    for (int64_t g = 0; g < ng; ++g) {
      lo[g][r] = mh ? _cvtsh_ss(mh[2 * g]) : 0.0f;
      sg[g][r] = mh ? _cvtsh_ss(mh[2 * g + 1]) : 0.0f;
    }
  }
  float* ws = scratch;  // [n_q][ng][32]
  const bool run = one_run(tile.rows, n);
  for (int64_t m = 0; m < n_q; ++m) {
    const float* pr = p + m * ld;
    alignas(32) float pt[kTileRows];
    for (int64_t r = 0; r < kTileRows; ++r)
      pt[r] = r < n ? pr[run ? tile.rows[0] + r : tile.rows[r]] : 0.0f;
    for (int64_t g = 0; g < ng; ++g) {
      __m256 la = _mm256_setzero_ps();
      for (int64_t r0 = 0; r0 < n; r0 += 8) {
        const __m256 pm = _mm256_load_ps(pt + r0);
        _mm256_storeu_ps(ws + (m * ng + g) * kTileRows + r0,
                         _mm256_mul_ps(pm, _mm256_load_ps(sg[g] + r0)));
        la = _mm256_fmadd_ps(pm, _mm256_load_ps(lo[g] + r0), la);
      }
      __m128 x = _mm_add_ps(_mm256_castps256_ps128(la), _mm256_extractf128_ps(la, 1));
      x = _mm_add_ps(x, _mm_movehl_ps(x, x));
      x = _mm_add_ss(x, _mm_movehdup_ps(x));
      acc_lo[m * ng + g] += _mm_cvtss_f32(x);
    }
  }
  constexpr int QM = 3;  // queries per pass (at most 12 accumulators: P QM <= 12)
  int64_t m0 = 0;
  for (; m0 + QM <= n_q; m0 += QM) rows_passes<B, QM>(f, tile, ws, m0, acc);
  switch (n_q - m0) {
    case 2:
      rows_passes<B, 2>(f, tile, ws, m0, acc);
      break;
    case 1:
      rows_passes<B, 1>(f, tile, ws, m0, acc);
      break;
    default:
      break;
  }
}

}  // namespace

PackedValuesFn packed_values_avx2_rows(const PackedRowFormat& f) {
  if (f.meta != MetaType::kF16 || f.axis != QuantAxis::kToken || f.spec.ternary() ||
      f.n_groups > kMaxGroups)
    return nullptr;
  const int b = f.spec.bits();
  if (b != 2 && b != 4) return nullptr;
  const int64_t blk = 8 * (8 / b);  // channels per 8-byte block
  if (f.head_dim % blk != 0 || f.group_size % blk != 0 || f.code_bytes != f.head_dim * b / 8 ||
      int64_t{f.n_groups} * f.group_size < f.head_dim)
    return nullptr;
  return b == 2 ? values_rows<2> : values_rows<4>;
}

}  // namespace vq::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else

namespace vq::detail {
PackedValuesFn packed_values_avx2_rows(const PackedRowFormat&) {
  return nullptr;
}
}  // namespace vq::detail

#endif
