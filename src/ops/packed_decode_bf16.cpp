// AVX-512 BF16 packed value kernel (packed_decode.h) for 2- and 4-bit codes with fp16 metadata:
// acc_i += (p s_g) c_i as bf16 dot products (vdpbf16ps), two rows per instruction; compiled for
// AVX-512 BF16 whatever the build's -march, chosen at run time by packed_kernel
// (packed_decode.cpp) where the CPU has it (CpuIsa::kAvx512Bf16). The key kernels and the
// offsets' sums acc_lo are those of CpuIsa::kAvx512Vnni (fp32).
//
// Layout: as packed_decode_avx512.cpp's row kernel (packed_decode_values512.h: per 16-byte code
// block, 16 fp32 lanes per code j, lane k code j = channel 16 P blk + P k + j, P = 8 / B), with
// the tile's rows taken in pairs (r, r + 1): one vpermb spreads the two rows' blocks so that
// 32-bit lane k holds [byte k of row r, byte k of row r + 1] as two 16-bit words, and a vpermw
// of the table {bf16(i mod 2^B)} turns each word's low bits (after a shift by j B) into its code
// as bf16, exact (codes below 2^8). The weights w = p s_g of a group's 32 rows are one vector of
// 32 bf16 in row order (vcvtne2ps2bf16), so the pair (r, r + 1) is its 32-bit word r / 2,
// broadcast. vdpbf16ps adds w_r c_{r,i} + w_{r+1} c_{r+1,i} to the fp32 lane of channel i. A
// lone last row pairs with itself at weight 0 (the masked lanes of p and s are 0).
// Where each 16 P-channel block holds whole groups of 16 P / G channels (at most 4 groups per
// row: group 32 at D 64 and 128), values_bf16_exact keeps the metadata in registers, forms each
// block of queries' weights just before its passes, and the weights' offsets are constants; a
// tile of consecutive records is walked with one pointer. Same operations, same bits.
//
// Error (docs/design.md §4: bf16 operands, fp32 accumulation, as FlashAttention's bf16 path).
// u = 2^-24 (fp32), u_b = 2^-8 (bf16: 8 significand bits with the implicit one, so a spacing of
// 2^-7 in [1, 2) and half of it under round to nearest even; not 2^-9). Per term:
// fl32(p s_g) = p s_g (1 + d1), |d1| <= u, then rounded to bf16: (1 + d2), |d2| <= u_b; the code
// c is exact and the product of two bf16 is exact in fp32. So each term is t (1 + e),
// |e| <= u_b + u + u_b u, t = p s_g c. The fp32 sum of acc0 and the n terms of a channel (one or
// two roundings per instruction, each term passing at most n + 1 of them) adds gamma_{n+1}
// (|acc0| + sum |t| (1 + |e|)), gamma_k = k u / (1 - k u). vcvtne2ps2bf16 and vdpbf16ps treat
// denormals as zero and flush tiny results: a weight below 2^-126 may become 0 (|t| <= 2^-126
// |c|) and a sum below 2^-126 may be flushed (2^-126 per step): at most n 2^-126 (max c + 1).
//   |acc - (acc0 + sum_t t)| <= (u_b + u + u_b u) sum |t| + gamma_{n+1} (|acc0| + (1 + u_b +
//                               2 u) sum |t|) + n 2^-126 (2^B)
// i.e. about u_b sum_t |p s_g c_i| beyond the fp32 kernel's gamma_{n+1} term. Checked against
// the scalar reference by BackendOps.PackedDecodeBf16Values (tests/test_backend_ops.cpp), and
// through vq::attention by BackendOps.AttentionPackedDecodePaths with packed_decode_bound
// (tests/ops_harness/attention_bounds.cpp).
#include "ops/packed_decode.h"

#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC takes the target as a pragma; clang as an attribute on every function that follows.
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(                                                               \
    __attribute__((                                                                         \
        target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,avx2,fma,f16c")
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

#include "ops/packed_decode_qblocks.h"
#include "ops/packed_decode_values512.h"

inline __m512bh as_bh(__m512i x) {
  return reinterpret_cast<__m512bh&>(x);
}

// Words i < 32: bf16(i mod 2^B) (exact).
template <int B>
inline __m512i code_table() {
  const __m512 t = B == 4 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                          : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  const __m512bh h = _mm512_cvtne2ps_pbh(t, t);
  return reinterpret_cast<const __m512i&>(h);
}

// out[i] += the sum of v[i]'s 16 lanes for i < k <= 16 (v[k ..] are overwritten): a tree of
// 128-bit and 32-bit lane shuffles over the 16 vectors at once (15 pairwise steps) in place of
// one horizontal sum per vector; each lane sum adds its 16 lanes in four rounds.
inline void add_lane_sums(__m512* v, int64_t k, float* out) {
  for (int64_t i = k; i < 16; ++i) v[i] = _mm512_setzero_ps();
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // halves: [v[2i] lanes j + j + 8 | v[2i + 1] likewise]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: 4 partial sums of v[4i + L]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lane L: 2 partials of v[8i + L], then 2 of v[8i + 4 + L]
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  // float 4L + j: the sum of v[4 j + L]
  const __m512 z =
      _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512 sums = _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
  const __mmask16 km = static_cast<__mmask16>((1u << k) - 1u);
  _mm512_mask_storeu_ps(out, km, _mm512_add_ps(_mm512_maskz_loadu_ps(km, out), sums));
}

// Rows of the tile, in pairs, into the accumulators of queries m0 .. m0 + QB over NB blocks of
// each row from block b0 on (a block touching G groups: lanes [16 i / G, 16 (i + 1) / G) are
// group g0 + i). wsb: [n_q][ng][32] bf16 weights (16 floats' room each). NG: f.n_groups when
// every block holds exactly G groups (g G = 16 P), so the weights' offsets are constants; 0
// otherwise. contiguous: the tile's rows are consecutive records (one pointer steps over them).
template <int B, int NB, int G, int QB, int NG>
void pairs_block(const PackedRowFormat& f, const PackedTile& tile, const float* wsb, int64_t m0,
                 int64_t b0, float* acc, bool contiguous) {
  constexpr int P = 8 / B;
  const int64_t d = f.head_dim, gs = f.group_size, ng = NG > 0 ? NG : f.n_groups;
  const __m512i table = code_table<B>();
  // vpermb indices: byte 4k <- byte k (row r), byte 4k + 2 <- byte 16 + k (row r + 1); the
  // other bytes are zeroed by the mask 0x55..55
  const __m512i spread_idx =
      _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                        0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001a000a, 0x001b000b,
                        0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f);
  // weights of (query q, block blk) at w0 + off(q, blk) + pair
  const float* w0 = wsb + (m0 * ng + b0 * 16 * P / gs) * 16;
  int64_t offr[QB][NB];
  for (int q = 0; q < QB; ++q)
    for (int blk = 0; blk < NB; ++blk)
      offr[q][blk] = (q * ng + ((b0 + blk) * 16 * P / gs - b0 * 16 * P / gs)) * 16;
  const auto off = [&](int q, int blk) -> int64_t {
    return NG > 0 ? (q * NG + blk * G) * 16 : offr[q][blk];
  };
  __m512 a[QB][NB][P];
  for (int q = 0; q < QB; ++q)
    for (int blk = 0; blk < NB; ++blk)
      deinterleave<P>(acc + (m0 + q) * d + (b0 + blk) * 16 * P, a[q][blk]);
  // one pair of rows (ra, rb) at pair index pr (its weights at w0 + pr)
  const auto pair = [&](const uint8_t* ra, const uint8_t* rb, const float* w)
      __attribute__((always_inline)) {
#pragma GCC unroll 4
    for (int blk = 0; blk < NB; ++blk) {
      const __m256i ab = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ra + blk * 16))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rb + blk * 16)), 1);
      const __m512i x = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, spread_idx,
                                                      _mm512_zextsi256_si512(ab));
      __m512 wv[QB];
#pragma GCC unroll 4
      for (int q = 0; q < QB; ++q) {
        wv[q] = _mm512_set1_ps(w[off(q, blk)]);
        if constexpr (G == 2)
          wv[q] = _mm512_mask_mov_ps(wv[q], 0xFF00, _mm512_set1_ps(w[off(q, blk) + 16]));
      }
#pragma GCC unroll 4
      for (int j = 0; j < P; ++j) {
        const __m512bh c =
            as_bh(_mm512_permutexvar_epi16(j == 0 ? x : _mm512_srli_epi16(x, j * B), table));
#pragma GCC unroll 4
        for (int q = 0; q < QB; ++q)
          a[q][blk][j] = _mm512_dpbf16_ps(a[q][blk][j], c, as_bh(_mm512_castps_si512(wv[q])));
      }
    }
  };
  const int64_t n = tile.n_rows;
  if (contiguous) {
    const int64_t st = tile.stride;
    const uint8_t* ra = tile.rec0 + tile.rows[0] * st + b0 * 16;
    const float* w = w0;
    int64_t r = 0;
    for (; r + 1 < n; r += 2, ra += 2 * st, ++w) pair(ra, ra + st, w);
    if (r < n) pair(ra, ra, w);
  } else {
    for (int64_t r = 0; r < n; r += 2) {
      const uint8_t* ra = tile.rec0 + tile.rows[r] * tile.stride + b0 * 16;
      const uint8_t* rb = r + 1 < n ? tile.rec0 + tile.rows[r + 1] * tile.stride + b0 * 16 : ra;
      pair(ra, rb, w0 + r / 2);
    }
  }
  for (int q = 0; q < QB; ++q)
    for (int blk = 0; blk < NB; ++blk)
      interleave<P>(a[q][blk], acc + (m0 + q) * d + (b0 + blk) * 16 * P);
}

// pairs_block over all NB blocks for QB queries, as many blocks per pass as keep the QB NH P
// accumulators within 16 registers (as packed_decode_avx512.cpp's rows_passes).
template <int B, int NB, int G, int QB>
void pairs_passes(const PackedRowFormat& f, const PackedTile& tile, const float* wsb, int64_t m0,
                  float* acc, bool contiguous) {
  constexpr int cap = 16 / (QB * (8 / B)), NH = NB <= cap ? NB : (cap >= 2 ? 2 : 1);
  const bool exact = f.group_size * G == 16 * (8 / B);
  for (int64_t b0 = 0; b0 < NB; b0 += NH)
    if (exact)
      pairs_block<B, NH, G, QB, NB * G>(f, tile, wsb, m0, b0, acc, contiguous);
    else
      pairs_block<B, NH, G, QB, 0>(f, tile, wsb, m0, b0, acc, contiguous);
}

// Weights and offset sums of queries m0 .. m0 + QB (QB NG <= 16) from metadata in registers:
// wsb[m][g] = bf16(fl32(p_r s_{r,g})) for rows r < 32 in order, acc_lo[m][g] += the lane sums
// of p_r lo_r + p_{r+16} lo_{r+16} (the general path's arithmetic, in registers).
template <int NG, int QB>
inline void weights_block(const PackedTile& tile, const float* p, int64_t ld, int64_t m0,
                          int64_t n_blk, const __mmask16* kb, const bool* contiguous,
                          const __m512 (*lo)[4], const __m512 (*sg)[4], float* wsb, float* acc_lo) {
  static_assert(QB * NG <= 16, "one lane-sum batch");
  __m512 los[16];
#pragma GCC unroll 4
  for (int q = 0; q < QB; ++q) {
    __m512 pm[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    tile_p16(tile, p + (m0 + q) * ld, n_blk, kb, contiguous, pm);
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      const __m512 w0 = _mm512_mul_ps(pm[0], sg[0][g]);
      const __m512 w1 = n_blk == 2 ? _mm512_mul_ps(pm[1], sg[1][g]) : _mm512_setzero_ps();
      const __m512bh wh = _mm512_cvtne2ps_pbh(w1, w0);  // words 0-15: w0, 16-31: w1
      _mm512_storeu_ps(wsb + ((m0 + q) * NG + g) * 16, reinterpret_cast<const __m512&>(wh));
      los[q * NG + g] = n_blk == 2
                            ? _mm512_fmadd_ps(pm[1], lo[1][g], _mm512_mul_ps(pm[0], lo[0][g]))
                            : _mm512_mul_ps(pm[0], lo[0][g]);
    }
  }
  add_lane_sums(los, QB * NG, acc_lo + m0 * NG);
}

// values_bf16 where every block holds exactly G groups (g G = 16 P, so NG = NB G <= 4 groups): the
// metadata stays in registers, and each block of QB queries forms its weights just before its
// passes over the rows.
template <int B, int NB, int G>
void values_bf16_exact(const PackedRowFormat& f, const PackedTile& tile, const float* p, int64_t ld,
                       int64_t n_q, float* acc, float* acc_lo, float* scratch) {
  constexpr int NG = NB * G;
  static_assert(NG <= 4, "rows16_words<4> holds the metadata words");
  __m512 lo[2][4], sg[2][4];
  __mmask16 kb[2] = {0, 0};
  bool contiguous[2] = {true, true};
  const int64_t n_blk = tile_meta16<4>(f, tile, lo, sg, kb, contiguous);
  const bool all_contiguous = tile.n_rows > 0 && one_run(tile.rows, tile.n_rows);
  for_query_blocks(n_q, [&](auto qb, int64_t m0) {
    constexpr int QB = decltype(qb)::value;
    weights_block<NG, QB>(tile, p, ld, m0, n_blk, kb, contiguous, lo, sg, scratch, acc_lo);
    pairs_passes<B, NB, G, QB>(f, tile, scratch, m0, acc, all_contiguous);
  });
}

template <int B, int NB, int G>
void values_bf16(const PackedRowFormat& f, const PackedTile& tile, const float* p, int64_t ld,
                 int64_t n_q, float* acc, float* acc_lo, float* scratch) {
  const int64_t ng = f.n_groups;
  float* wsb = scratch;  // [n_q][ng][32 bf16]
  __m512 lov[2][64], sgv[2][64];
  __mmask16 kb[2] = {0, 0};
  bool contiguous[2] = {true, true};
  const int64_t n_blk = tile_meta16<64>(f, tile, lov, sgv, kb, contiguous);
  // wsb[m][g] = bf16(fl32(p_r s_{r,g})) for rows r < 32 in order (0 past the tile's rows);
  // acc_lo[m][g] += the 16 lanes' sum of p_r lo_r + p_{r+16} lo_{r+16} (fp32), the lane sums of
  // 16 (m, g) at a time by add_lane_sums.
  __m512 los[16];
  int64_t n_lo = 0, lo0 = 0;  // los holds acc_lo[lo0 .. lo0 + n_lo) (index m ng + g)
  for (int64_t m = 0; m < n_q; ++m) {
    __m512 pm[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    tile_p16(tile, p + m * ld, n_blk, kb, contiguous, pm);
    float* wm = wsb + m * ng * 16;
    for (int64_t g = 0; g < ng; ++g) {
      const __m512 w0 = _mm512_mul_ps(pm[0], sgv[0][g]);
      const __m512 w1 = n_blk == 2 ? _mm512_mul_ps(pm[1], sgv[1][g]) : _mm512_setzero_ps();
      const __m512bh wh = _mm512_cvtne2ps_pbh(w1, w0);  // words 0-15: w0, 16-31: w1
      _mm512_storeu_ps(wm + g * 16, reinterpret_cast<const __m512&>(wh));
      los[n_lo++] = n_blk == 2 ? _mm512_fmadd_ps(pm[1], lov[1][g], _mm512_mul_ps(pm[0], lov[0][g]))
                               : _mm512_mul_ps(pm[0], lov[0][g]);
      if (n_lo == 16) {
        add_lane_sums(los, n_lo, acc_lo + lo0);
        lo0 += 16;
        n_lo = 0;
      }
    }
  }
  if (n_lo > 0) add_lane_sums(los, n_lo, acc_lo + lo0);
  const bool all_contiguous = tile.n_rows > 0 && one_run(tile.rows, tile.n_rows);
  for_query_blocks(n_q, [&](auto qb, int64_t m0) {
    pairs_passes<B, NB, G, decltype(qb)::value>(f, tile, wsb, m0, acc, all_contiguous);
  });
}

}  // namespace

// The formats of packed_decode_avx512.cpp's row kernel with 2- or 4-bit codes: fp16 metadata,
// token axis, 1, 2 or 4 blocks of 16 P channels per row, groups of whole blocks or half of one,
// at most 64 groups.
PackedValuesFn packed_values_bf16(const PackedRowFormat& f) {
  if (f.meta != MetaType::kF16 || f.axis != QuantAxis::kToken || f.spec.ternary()) return nullptr;
  const int b = f.spec.bits();
  if (b != 2 && b != 4) return nullptr;
  const int64_t blk = 16 * (8 / b), nb = f.head_dim / blk, gs = f.group_size;
  if (f.head_dim % blk != 0 || (nb != 1 && nb != 2 && nb != 4) || f.n_groups > 64) return nullptr;
  const bool g1 = gs % blk == 0, g2 = 2 * gs == blk;
  if (!g1 && !g2) return nullptr;
  const auto pick = [nb](auto v1, auto v2, auto v4) -> PackedValuesFn {
    return nb == 1 ? v1 : (nb == 2 ? v2 : v4);
  };
  // groups of exactly one block (g = 16 P) or half of one, at most 4 per row: values_bf16_exact
  const bool exact = gs == blk || g2;
  if (exact && nb * (g2 ? 2 : 1) <= 4) {
    if (b == 4)
      return g2 ? pick(values_bf16_exact<4, 1, 2>, values_bf16_exact<4, 2, 2>, nullptr)
                : pick(values_bf16_exact<4, 1, 1>, values_bf16_exact<4, 2, 1>,
                       values_bf16_exact<4, 4, 1>);
    return g2 ? pick(values_bf16_exact<2, 1, 2>, values_bf16_exact<2, 2, 2>, nullptr)
              : pick(values_bf16_exact<2, 1, 1>, values_bf16_exact<2, 2, 1>,
                     values_bf16_exact<2, 4, 1>);
  }
  if (b == 4)
    return g1 ? pick(values_bf16<4, 1, 1>, values_bf16<4, 2, 1>, values_bf16<4, 4, 1>)
              : pick(values_bf16<4, 1, 2>, values_bf16<4, 2, 2>, values_bf16<4, 4, 2>);
  return g1 ? pick(values_bf16<2, 1, 1>, values_bf16<2, 2, 1>, values_bf16<2, 4, 1>)
            : pick(values_bf16<2, 1, 2>, values_bf16<2, 2, 2>, values_bf16<2, 4, 2>);
}

}  // namespace vq::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else

namespace vq::detail {
PackedValuesFn packed_values_bf16(const PackedRowFormat&) {
  return nullptr;
}
}  // namespace vq::detail

#endif
