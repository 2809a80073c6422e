// AVX-512 VNNI packed key kernels (packed_decode.h): key logits from integer dot products of the
// codes with the query rounded to int8 per group. Chosen at run time where the CPU has
// avx512_vnni, for 1/2/4/8-bit codes with fp16 or fp8 metadata; values use the AVX-512 fp32
// kernel.
//
// Vector lanes run over 16 rows of the tile (not over channels), so a logit never needs a
// horizontal sum: one 32-bit word (4 bytes = 4P channels, P = 8 / B codes per byte) of each of
// the 16 rows in one register (rows16_any, packed_decode_rows16.h: plain loads of the rows and a
// transpose), and for each j < P the j-th code of every byte,
// (word >> jB) & (2^B - 1) per byte, meets the query's 4 int8 values of those channels
// (broadcast) in one vpdpbusd: lane r accumulates the exact integer sum of q8_i c_i of row r
// over the words of one group (a word never crosses a group: the group size is a multiple of
// 4P). At the group's end, per query, in fp32:
//   tot_r += float(acc_r) * (s_{r,g} * sq_g);   tot_r += lo_{r,g} * qsum_g
// with (lo, s) of every row from the group's fp16 pair (fp8 pair: two bytes of a 32-bit word of
// the transposed metadata, decoded exactly in the lanes). The 16 totals are the
// logits of the 16 rows. float(acc) is exact: |acc| <= 127 (2^B - 1) g < 2^24 (checked).
// Query rounding (packed_decode.h, PackedKernel::int8_query): sq_g = max_{i in g} |q'_i| / 127,
// q8_i = rne(q'_i / sq_g); a group with a NaN or infinite q' gets sq_g = NaN (the logit is NaN,
// as the reference's).
#include "ops/packed_decode.h"

#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC takes the target as a pragma; clang as an attribute on every function that follows.
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(                                                               \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>
#endif

#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace vq::detail {
namespace {

constexpr int64_t kMaxWords = 64;   // code words per row (D B <= 2048)
constexpr int64_t kMaxGroups = 64;  // groups per row

#include "ops/packed_decode_qblocks.h"
#include "ops/packed_decode_rows16.h"

// Prepared query m: int32 qw[nw][P] (4 int8 query values per word and code index j), then
// float sq[ng], float qs[ng].
int64_t words(const PackedRowFormat& f) {
  return f.head_dim * f.spec.bits() / 32;
}

template <int B>
int64_t qblock_bytes(const PackedRowFormat& f) {
  return words(f) * (8 / B) * 4 + 8 * int64_t{f.n_groups};
}

template <int B>
int64_t prep_bytes(const PackedRowFormat& f, int64_t n_q) {
  return n_q * qblock_bytes<B>(f);
}

// Round to nearest even for |x| < 2^22 (default rounding mode; the build does not contract).
inline float rne_small(float x) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return x >= 0.0f ? (x + magic) - magic : (x - magic) + magic;
}

template <int B>
void prepare(const PackedRowFormat& f, const float* q, const float* qsum, int64_t n_q, void* out) {
  constexpr int P = 8 / B;
  const int64_t d = f.head_dim, gs = f.group_size, ng = f.n_groups, nw = words(f);
  for (int64_t m = 0; m < n_q; ++m) {
    uint8_t* blk = static_cast<uint8_t*>(out) + m * qblock_bytes<B>(f);
    int32_t* qw = reinterpret_cast<int32_t*>(blk);
    float* sq = reinterpret_cast<float*>(blk + nw * P * 4);
    float* qs = sq + ng;
    const float* qm = q + m * d;
    for (int64_t g = 0; g < ng; ++g) {
      float mx = 0.0f;
      bool finite = true;
      const int64_t i1 = (g + 1) * gs < d ? (g + 1) * gs : d;
      for (int64_t i = g * gs; i < i1; ++i) {
        const float a = __builtin_fabsf(qm[i]);
        finite = finite && a <= 3.4028234663852886e38f;
        mx = a > mx ? a : mx;
      }
      sq[g] = finite ? mx / 127.0f : __builtin_nanf("");
      qs[g] = qsum[m * ng + g];
    }
    for (int64_t k = 0; k < nw; ++k)
      for (int j = 0; j < P; ++j) {
        uint32_t word = 0;
        for (int b = 0; b < 4; ++b) {
          const int64_t ch = 4 * P * k + b * P + j;
          const float s = sq[ch / gs];
          int v = 0;
          if (s > 0.0f) {  // false for 0 and NaN
            const float r = rne_small(qm[ch] / s);
            v = static_cast<int>(r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r));
          }
          word |= static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(v))) << (8 * b);
        }
        qw[k * P + j] = static_cast<int32_t>(word);
      }
  }
}

// The 16 logits of one block of rows for queries m0 .. m0 + QB. xw: [nw][16] the rows' code
// words, lo / s: [ng][16] their metadata.
template <int B, int QB>
inline void block_logits(const PackedRowFormat& f, const int32_t* xw, const float* lo,
                         const float* s, const uint8_t* prep, int64_t m0, __m512* tot) {
  constexpr int P = 8 / B;
  const int64_t nw = words(f), ng = f.n_groups, wpg = f.group_size / (4 * P);
  const int64_t qbb = qblock_bytes<B>(f);
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << B) - 1));
  const int32_t* qw[QB];
  const float* sq[QB];
  for (int q = 0; q < QB; ++q) {
    qw[q] = reinterpret_cast<const int32_t*>(prep + (m0 + q) * qbb);
    sq[q] = reinterpret_cast<const float*>(prep + (m0 + q) * qbb + nw * P * 4);
    tot[q] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < ng; ++g) {
    __m512i acc[QB];
    for (int q = 0; q < QB; ++q) acc[q] = _mm512_setzero_si512();
    const int64_t k1 = (g + 1) * wpg < nw ? (g + 1) * wpg : nw;
    for (int64_t k = g * wpg; k < k1; ++k) {
      const __m512i x = _mm512_loadu_si512(xw + 16 * k);
      for (int j = 0; j < P; ++j) {
        const __m512i sub =
            B == 8 ? x : _mm512_and_si512(j == 0 ? x : _mm512_srli_epi32(x, j * B), mask);
        for (int q = 0; q < QB; ++q)
          acc[q] = _mm512_dpbusd_epi32(acc[q], sub, _mm512_set1_epi32(qw[q][k * P + j]));
      }
    }
    const __m512 sg = _mm512_loadu_ps(s + 16 * g), lg = _mm512_loadu_ps(lo + 16 * g);
    for (int q = 0; q < QB; ++q) {
      const __m512 sc = _mm512_mul_ps(sg, _mm512_set1_ps(sq[q][g]));
      tot[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[q]), sc, tot[q]);
      tot[q] = _mm512_fmadd_ps(lg, _mm512_set1_ps(sq[q][ng + g]), tot[q]);
    }
  }
}

// The logits tot[q] of queries m0 + q (q < QB) at the n listed rows: one masked store per query
// when the rows are consecutive, else one store per row.
template <int QB>
inline void store_logits(const __m512* tot, int64_t m0, float* logits, int64_t ld,
                         const int32_t* rows, int64_t n, bool contiguous) {
  const __mmask16 km = static_cast<__mmask16>((1u << n) - 1u);
  for (int q = 0; q < QB; ++q) {
    float* lr = logits + (m0 + q) * ld;
    if (contiguous) {
      _mm512_mask_storeu_ps(lr + rows[0], km, tot[q]);
    } else {
      alignas(64) float t[16];
      _mm512_store_ps(t, tot[q]);
      for (int64_t r = 0; r < n; ++r) lr[rows[r]] = t[r];
    }
  }
}

// The records 32 rows past row r (the block after next, or the next tile's: a segment's rows
// are consecutive records) into L1: the loads would otherwise wait on each first touch (a
// decode step streams the weights through the caches between two layers' attention). A
// prefetch never faults, so addresses past the segment are harmless.
inline void prefetch_ahead(const PackedTile& tile, int64_t r) {
  const char* p = reinterpret_cast<const char*>(tile.rec0 + (r + 32) * tile.stride);
  for (int64_t i = 0; i < 16 * tile.stride; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// The fp8 e4m3 bytes in the low 8 bits of each lane (higher bits ignored) as fp32, exactly as
// packed.h's fp8_e4m3_decode: normal (1 + m/8) 2^(e-7) built from its bits, subnormal
// m 2^-9 (an exact product), 0x7f / 0xff a positive quiet NaN.
inline __m512 fp8_e4m3_16(__m512i c) {
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(c, 3), _mm512_set1_epi32(0xf));
  const __m512i m = _mm512_and_si512(c, _mm512_set1_epi32(7));
  const __m512 normal = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23),
                      _mm512_slli_epi32(m, 20)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0x1p-9f));
  const __mmask16 is_sub = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
  const __m512 v = _mm512_mask_blend_ps(is_sub, normal, sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
  const __m512 sv = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(c, _mm512_set1_epi32(0x7f)),
                                                _mm512_set1_epi32(0x7f));
  return _mm512_mask_blend_ps(nan, sv, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

template <int B>
void keys_vnni(const PackedRowFormat& f, const PackedTile& tile, const float* /*q*/,
               const float* /*qsum*/, int64_t n_q, float* logits, int64_t ld, const void* prep) {
  const int64_t nw = words(f), ng = f.n_groups;
  const uint8_t* pb = static_cast<const uint8_t*>(prep);
  alignas(64) int32_t xw[kMaxWords * 16];
  alignas(64) float lo[kMaxGroups * 16], s[kMaxGroups * 16];
  __m512i mw[kMaxGroups];  // the metadata words, lanes over rows (rows16_any)
  const int64_t meta_bytes = f.meta == MetaType::kF16 ? 4 * ng : 2 * ng;
  for (int64_t r0 = 0; r0 < tile.n_rows; r0 += 16) {
    const int64_t n = tile.n_rows - r0 < 16 ? tile.n_rows - r0 : 16;
    const int32_t* rows = tile.rows + r0;
    prefetch_ahead(tile, rows[0]);
    const uint8_t* rec[16];
    for (int64_t r = 0; r < 16; ++r) rec[r] = tile.rec0 + rows[r < n ? r : 0] * tile.stride;
    rows16_any(rec, n, 4 * nw, reinterpret_cast<__m512i*>(xw));
    for (int64_t r = 0; r < 16; ++r) rec[r] += f.code_bytes;
    rows16_any(rec, n, meta_bytes, mw);
    if (f.meta == MetaType::kF16)
      for (int64_t g = 0; g < ng; ++g) {
        _mm512_store_ps(lo + 16 * g, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(mw[g])));
        _mm512_store_ps(s + 16 * g,
                        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(mw[g], 16))));
      }
    else  // fp8: word g / 2 holds (lo, s) of group g in bytes 2 (g mod 2) and 2 (g mod 2) + 1
      for (int64_t g = 0; g < ng; ++g) {
        const __m512i w = _mm512_srli_epi32(mw[g / 2], 16 * static_cast<int>(g % 2));
        _mm512_store_ps(lo + 16 * g, fp8_e4m3_16(w));
        _mm512_store_ps(s + 16 * g, fp8_e4m3_16(_mm512_srli_epi32(w, 8)));
      }
    const bool contiguous = one_run(rows, n);
    for_query_blocks(n_q, [&](auto qb, int64_t m0) {
      constexpr int QB = decltype(qb)::value;
      __m512 tot[QB];
      block_logits<B, QB>(f, xw, lo, s, pb, m0, tot);
      store_logits<QB>(tot, m0, logits, ld, rows, n, contiguous);
    });
  }
}

// ---- fixed shapes: fp16 metadata, group 32, D 64 or 128, 2- or 4-bit codes ----------------
//
// keys_vnni with the row's sizes as template constants (NW code words, NW / B groups of B words):
// the transposed code words stay in registers (no xw array on the stack, no rows16_any chunk
// loop), the (lo, s) pairs come by one gather per group straight into registers (no lo / s
// arrays), and all queries of a block of 16 rows meet its words in one pass (QB <= 4 at a time).
// The arithmetic per row, group and query is keys_vnni's, in its order:
//   tot = fma(float(acc), s_g * sq_g, tot);   tot = fma(lo_g, qsum_g, tot)
// so the logits are the same bits (BackendOps.PackedDecodeRowTilesExact checks both paths).

template <int B, int NW, int QB>
inline void fixed_logits(const __m512i* xw, const __m512* lo, const __m512* s, const uint8_t* prep,
                         int64_t qbb, int64_t m0, __m512* tot) {
  constexpr int P = 8 / B, WPG = B, NG = NW / WPG;  // group 32 = B words of 32 / B codes each
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << B) - 1));
  const int32_t* qw[QB];
  const float* sq[QB];
  for (int q = 0; q < QB; ++q) {
    qw[q] = reinterpret_cast<const int32_t*>(prep + (m0 + q) * qbb);
    sq[q] = reinterpret_cast<const float*>(prep + (m0 + q) * qbb + NW * P * 4);
    tot[q] = _mm512_setzero_ps();
  }
#pragma GCC unroll 16
  for (int g = 0; g < NG; ++g) {
    __m512i acc[QB];
    for (int q = 0; q < QB; ++q) acc[q] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = g * WPG; k < (g + 1) * WPG; ++k)
#pragma GCC unroll 4
      for (int j = 0; j < P; ++j) {
        const __m512i sub =
            _mm512_and_si512(j == 0 ? xw[k] : _mm512_srli_epi32(xw[k], j * B), mask);
#pragma GCC unroll 4
        for (int q = 0; q < QB; ++q)
          acc[q] = _mm512_dpbusd_epi32(acc[q], sub, _mm512_set1_epi32(qw[q][k * P + j]));
      }
    for (int q = 0; q < QB; ++q) {
      const __m512 sc = _mm512_mul_ps(s[g], _mm512_set1_ps(sq[q][g]));
      tot[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[q]), sc, tot[q]);
      tot[q] = _mm512_fmadd_ps(lo[g], _mm512_set1_ps(sq[q][NG + g]), tot[q]);
    }
  }
}

template <int B, int NW>
void keys_fixed(const PackedRowFormat& f, const PackedTile& tile, const float* /*q*/,
                const float* /*qsum*/, int64_t n_q, float* logits, int64_t ld, const void* prep) {
  constexpr int NG = NW / B;
  const uint8_t* pb = static_cast<const uint8_t*>(prep);
  const int64_t qbb = qblock_bytes<B>(f);
  const uint8_t* meta0 = tile.rec0 + f.code_bytes;
  for (int64_t r0 = 0; r0 < tile.n_rows; r0 += 16) {
    const int64_t n = tile.n_rows - r0 < 16 ? tile.n_rows - r0 : 16;
    const int32_t* rows = tile.rows + r0;
    const __mmask16 km = static_cast<__mmask16>((1u << n) - 1u);
    prefetch_ahead(tile, rows[0]);
    const uint8_t* rec[16];
    for (int64_t r = 0; r < 16; ++r) rec[r] = tile.rec0 + rows[r < n ? r : 0] * tile.stride;
    __m512i xw[NW];
    rows16_words<NW>(rec, n, 4 * NW, xw);
    const __m512i off = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(km, rows),
                                           _mm512_set1_epi32(static_cast<int>(tile.stride)));
    __m512 lo[NG], s[NG];
    for (int g = 0; g < NG; ++g) {
      const __m512i mw =
          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), km, off, meta0 + 4 * g, 1);
      lo[g] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(mw));
      s[g] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(mw, 16)));
    }
    const bool contiguous = one_run(rows, n);
    for_query_blocks(n_q, [&](auto qb, int64_t m0) {
      constexpr int QB = decltype(qb)::value;
      __m512 tot[QB];
      fixed_logits<B, NW, QB>(xw, lo, s, pb, qbb, m0, tot);
      store_logits<QB>(tot, m0, logits, ld, rows, n, contiguous);
    });
  }
}

// keys_fixed for f, or null: fp16 metadata, group 32, 2- or 4-bit codes, D 64 or 128 (NW = D B /
// 32 code words: 4, 8 or 16, each a rows16_words width).
PackedKeysFn fixed_keys(const PackedRowFormat& f) {
  if (f.meta != MetaType::kF16 || f.group_size != 32 || f.n_groups * 32 != f.head_dim ||
      f.code_bytes != f.head_dim * f.spec.bits() / 8)
    return nullptr;
  const int b = f.spec.bits();
  if (f.head_dim == 64) return b == 4 ? keys_fixed<4, 8> : (b == 2 ? keys_fixed<2, 4> : nullptr);
  if (f.head_dim == 128) return b == 4 ? keys_fixed<4, 16> : (b == 2 ? keys_fixed<2, 8> : nullptr);
  return nullptr;
}

template <int B>
PackedKernel kernel() {
  PackedKernel k;
  k.keys = keys_vnni<B>;
  k.prepare = prepare<B>;
  k.prep_bytes = prep_bytes<B>;
  k.isa = CpuIsa::kAvx512Vnni;
  k.int8_query = true;
  return k;
}

}  // namespace

PackedKernel packed_kernel_vnni(const PackedRowFormat& f) {
  if (f.spec.ternary() || (f.meta != MetaType::kF16 && f.meta != MetaType::kFP8E4M3) ||
      f.axis != QuantAxis::kToken || f.code_bytes < 2)
    return {};
  const int b = f.spec.bits();
  if (b != 1 && b != 2 && b != 4 && b != 8) return {};
  const int64_t word_ch = 4 * (8 / b);  // channels per 32-bit word
  if (f.group_size % word_ch != 0 || f.head_dim % word_ch != 0 || words(f) > kMaxWords ||
      f.n_groups > kMaxGroups)
    return {};
  // float(acc) exact: 127 (2^b - 1) g < 2^24; the record offsets fit int32 gathers.
  if (int64_t{127} * ((1 << b) - 1) * f.group_size >= (int64_t{1} << 24) ||
      f.row_stride > (int64_t{1} << 24))
    return {};
  PackedKernel k =
      b == 1 ? kernel<1>() : (b == 2 ? kernel<2>() : (b == 4 ? kernel<4>() : kernel<8>()));
  if (PackedKeysFn fk = fixed_keys(f)) k.keys = fk;
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
PackedKernel packed_kernel_vnni(const PackedRowFormat&) {
  return {};
}
}  // namespace vq::detail

#endif
