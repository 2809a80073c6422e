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
#include "ops/packed_decode_values512.h"

// ---- values of 2-, 4- and 8-bit codes, fp16 metadata ------------------------------------------
//
// A row's codes are read 16 bytes (one block: 16 P channels, P = 8 / B codes per byte) at a
// time, widened to 16 lanes; for j < P, lane k's code j (its byte shifted by jB; a lane permute
// of a table {i mod 2^B} keeps the code, 8-bit codes convert directly) is channel
// 16 P blk + P k + j. The accumulators of a tile are held in that order (vector j of block blk),
// deinterleaved from acc when the tile starts and interleaved back when it ends, all D channels
// of up to QB queries in registers while the tile's rows pass in order. Weights w = p s_g are
// formed for 16 rows at once (the rows' metadata gathered, p loaded once per query and block of
// 16 rows) into
// ws[m][g][32]; a lane's weight is its group's (one broadcast per group the block touches).
// acc += w c per channel, rows in order (one FMA each); acc_lo[m][g] += p lo_g: 16 row lanes
// (lane r: p_r lo_r, then + p_{r+16} lo_{r+16} by one FMA), summed by _mm512_reduce_add_ps at
// the tile's end. Scratch: ws [n_q][ng][32].

// Code j of the 16 widened bytes x, as floats.
template <int B>
inline __m512 code_lanes(__m512i x, int j) {
  if constexpr (B == 8) {
    return _mm512_cvtepi32_ps(x);
  } else {
    const __m512 table = B == 4
                             ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                             : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    return _mm512_permutexvar_ps(j == 0 ? x : _mm512_srli_epi32(x, j * B), table);
  }
}

// Rows of the tile into the accumulators of queries m0 .. m0 + QB over NB blocks of each row from
// block b0 on (a block touching G groups: lanes [16 i / G, 16 (i + 1) / G) are group g0 + i).
// Every loop bound is a template constant, so the QB NB P accumulators stay in registers.
template <int B, int NB, int G, int QB>
void rows_block(const PackedRowFormat& f, const PackedTile& tile, const float* ws, int64_t m0,
                int64_t b0, float* acc) {
  constexpr int P = 8 / B;
  const int64_t d = f.head_dim, gs = f.group_size, ng = f.n_groups;
  const float* wb[QB][NB];  // ws of (query, the block's first group)
  __m512 a[QB][NB][P];
  for (int q = 0; q < QB; ++q)
    for (int blk = 0; blk < NB; ++blk) {
      wb[q][blk] = ws + ((m0 + q) * ng + (b0 + blk) * 16 * P / gs) * 32;
      deinterleave<P>(acc + (m0 + q) * d + (b0 + blk) * 16 * P, a[q][blk]);
    }
  for (int64_t r = 0; r < tile.n_rows; ++r) {
    const uint8_t* rec = tile.rec0 + tile.rows[r] * tile.stride + b0 * 16;
#pragma GCC unroll 4
    for (int blk = 0; blk < NB; ++blk) {
      const __m512i x =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + blk * 16)));
      // (code j widened and used at once: an array of the P codes was kept on the stack by
      // GCC 12, a store and reload of 64 bytes per code and row)
#pragma GCC unroll 4
      for (int j = 0; j < P; ++j) {
        const __m512 c = code_lanes<B>(x, j);
#pragma GCC unroll 4
        for (int q = 0; q < QB; ++q) {
          __m512 wv = _mm512_set1_ps(wb[q][blk][r]);
          if constexpr (G == 2)
            wv = _mm512_mask_mov_ps(wv, 0xFF00, _mm512_set1_ps(wb[q][blk][32 + r]));
          a[q][blk][j] = _mm512_fmadd_ps(wv, c, a[q][blk][j]);
        }
      }
    }
  }
  for (int q = 0; q < QB; ++q)
    for (int blk = 0; blk < NB; ++blk)
      interleave<P>(a[q][blk], acc + (m0 + q) * d + (b0 + blk) * 16 * P);
}

// rows_block over all NB blocks of the row for QB queries: as many blocks per pass as keep the
// QB NH P accumulators within 16 registers (NB, 2 or 1: NB is 1, 2 or 4). A row wider than that
// passes the tile twice (or four times) over parts of its channels, all QB queries at once: each
// row's codes are widened once per block, not once per query pair; the FMAs of a channel meet
// the rows in the same order (the same bits as one pass).
template <int B, int NB, int G, int QB>
void rows_passes(const PackedRowFormat& f, const PackedTile& tile, const float* ws, int64_t m0,
                 float* acc) {
  constexpr int cap = 16 / (QB * (8 / B)), NH = NB <= cap ? NB : (cap >= 2 ? 2 : 1);
  for (int64_t b0 = 0; b0 < NB; b0 += NH) rows_block<B, NH, G, QB>(f, tile, ws, m0, b0, acc);
}

template <int B, int NB, int G>
void values_rows(const PackedRowFormat& f, const PackedTile& tile, const float* p, int64_t ld,
                 int64_t n_q, float* acc, float* acc_lo, float* scratch) {
  const int64_t ng = f.n_groups;
  float* ws = scratch;  // [n_q][ng][32]
  __m512 lov[2][64], sgv[2][64];
  __mmask16 kb[2] = {0, 0};
  bool contiguous[2] = {true, true};
  const int64_t n_blk = tile_meta16(f, tile, lov, sgv, kb, contiguous);
  // ws[m][g][r] = p s_g; acc_lo[m][g] += the 16 lanes' sum of p_r lo_r + p_{r+16} lo_{r+16}.
  for (int64_t m = 0; m < n_q; ++m) {
    const float* pr = p + m * ld;
    __m512 pm[2];
    tile_p16(tile, pr, n_blk, kb, contiguous, pm);
    float* wm = ws + m * ng * 32;
    float* am = acc_lo + m * ng;
    if (n_blk == 2)
      for (int64_t g = 0; g < ng; ++g) {
        _mm512_storeu_ps(wm + g * 32, _mm512_mul_ps(pm[0], sgv[0][g]));
        _mm512_storeu_ps(wm + g * 32 + 16, _mm512_mul_ps(pm[1], sgv[1][g]));
        am[g] += _mm512_reduce_add_ps(
            _mm512_fmadd_ps(pm[1], lov[1][g], _mm512_mul_ps(pm[0], lov[0][g])));
      }
    else if (n_blk == 1)
      for (int64_t g = 0; g < ng; ++g) {
        _mm512_storeu_ps(wm + g * 32, _mm512_mul_ps(pm[0], sgv[0][g]));
        am[g] += _mm512_reduce_add_ps(_mm512_mul_ps(pm[0], lov[0][g]));
      }
  }
  int64_t m0 = 0;
  for (; m0 + 4 <= n_q; m0 += 4) rows_passes<B, NB, G, 4>(f, tile, ws, m0, acc);
  switch (n_q - m0) {
    case 3:
      rows_passes<B, NB, G, 3>(f, tile, ws, m0, acc);
      break;
    case 2:
      rows_passes<B, NB, G, 2>(f, tile, ws, m0, acc);
      break;
    case 1:
      rows_passes<B, NB, G, 1>(f, tile, ws, m0, acc);
      break;
    default:
      break;
  }
}

// The row-major values kernel for f, or null: fp16 metadata, token axis, whole blocks of 16 P
// channels (1, 2 or 4 per row), a group covering whole blocks or half of one (G = 2, 8 lanes
// each), at most 64 groups (scratch).
PackedValuesFn values_rows_kernel(const PackedRowFormat& f) {
  if (f.meta != MetaType::kF16 || f.axis != QuantAxis::kToken || f.spec.ternary()) return nullptr;
  const int b = f.spec.bits();
  if (b != 2 && b != 4 && b != 8) return nullptr;
  const int64_t blk = 16 * (8 / b), nb = f.head_dim / blk, gs = f.group_size;
  if (f.head_dim % blk != 0 || (nb != 1 && nb != 2 && nb != 4) || f.n_groups > 64) return nullptr;
  const bool g1 = gs % blk == 0, g2 = 2 * gs == blk;
  if (!g1 && !(g2 && b != 8)) return nullptr;
  const auto pick = [nb](auto v1, auto v2, auto v4) -> PackedValuesFn {
    return nb == 1 ? v1 : (nb == 2 ? v2 : v4);
  };
  if (b == 8) return pick(values_rows<8, 1, 1>, values_rows<8, 2, 1>, values_rows<8, 4, 1>);
  if (b == 4)
    return g1 ? pick(values_rows<4, 1, 1>, values_rows<4, 2, 1>, values_rows<4, 4, 1>)
              : pick(values_rows<4, 1, 2>, values_rows<4, 2, 2>, values_rows<4, 4, 2>);
  return g1 ? pick(values_rows<2, 1, 1>, values_rows<2, 2, 1>, values_rows<2, 4, 1>)
            : pick(values_rows<2, 1, 2>, values_rows<2, 2, 2>, values_rows<2, 4, 2>);
}

}  // namespace

PackedKernel packed_kernel_avx512(const PackedRowFormat& f) {
  PackedKernel k = simd_kernel<V512>(f, CpuIsa::kAvx512);
  if (k.values)
    if (PackedValuesFn v = values_rows_kernel(f)) k.values = v;
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
