// Pieces shared by the AVX-512 value kernels over rows of 16-byte code blocks (fp32 FMAs in
// packed_decode_avx512.cpp, bf16 dot products in packed_decode_bf16.cpp): the accumulators'
// lane order per block and the rows' metadata and weights as 16 row lanes. Meant to be included
// inside an anonymous namespace after the AVX-512 target pragmas and <immintrin.h>.

#include "ops/packed_decode_rows16.h"

// v[j] lane k = src[P k + j] for the 16 P floats at src.
template <int P>
inline void deinterleave(const float* src, __m512* v) {
  if constexpr (P == 1) {
    v[0] = _mm512_loadu_ps(src);
  } else {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512 a0 = _mm512_loadu_ps(src), a1 = _mm512_loadu_ps(src + 16);
    if constexpr (P == 2) {
      v[0] = _mm512_permutex2var_ps(a0, ev, a1);
      v[1] = _mm512_permutex2var_ps(a0, od, a1);
    } else {  // P == 4: even / odd of each half, then even / odd again
      const __m512 a2 = _mm512_loadu_ps(src + 32), a3 = _mm512_loadu_ps(src + 48);
      const __m512 e01 = _mm512_permutex2var_ps(a0, ev, a1),
                   o01 = _mm512_permutex2var_ps(a0, od, a1);
      const __m512 e23 = _mm512_permutex2var_ps(a2, ev, a3),
                   o23 = _mm512_permutex2var_ps(a2, od, a3);
      v[0] = _mm512_permutex2var_ps(e01, ev, e23);
      v[1] = _mm512_permutex2var_ps(o01, ev, o23);
      v[2] = _mm512_permutex2var_ps(e01, od, e23);
      v[3] = _mm512_permutex2var_ps(o01, od, o23);
    }
  }
}

// The inverse of deinterleave.
template <int P>
inline void interleave(const __m512* v, float* dst) {
  if constexpr (P == 1) {
    _mm512_storeu_ps(dst, v[0]);
  } else {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi =
        _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    if constexpr (P == 2) {
      _mm512_storeu_ps(dst, _mm512_permutex2var_ps(v[0], lo, v[1]));
      _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(v[0], hi, v[1]));
    } else {
      const __m512 e01 = _mm512_permutex2var_ps(v[0], lo, v[2]),
                   e23 = _mm512_permutex2var_ps(v[0], hi, v[2]);
      const __m512 o01 = _mm512_permutex2var_ps(v[1], lo, v[3]),
                   o23 = _mm512_permutex2var_ps(v[1], hi, v[3]);
      _mm512_storeu_ps(dst, _mm512_permutex2var_ps(e01, lo, o01));
      _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(e01, hi, o01));
      _mm512_storeu_ps(dst + 32, _mm512_permutex2var_ps(e23, lo, o23));
      _mm512_storeu_ps(dst + 48, _mm512_permutex2var_ps(e23, hi, o23));
    }
  }
}

// The 16 records 32 rows past row r into L1 (as packed_decode_vnni.cpp's prefetch_ahead): the
// next tile's, whose loads would otherwise wait on each first touch. A prefetch never faults.
inline void prefetch_rows_ahead(const PackedTile& tile, int64_t r) {
  const char* ahead = reinterpret_cast<const char*>(tile.rec0 + (r + 32) * tile.stride);
  for (int64_t i = 0; i < 16 * tile.stride; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
}

// The rows' (lo, s) per block of 16 rows (a tile has at most 32: packed_decode.h) and group g <
// f.n_groups <= 64, lanes over rows (0 past the tile's rows); kb[b]: the block's row lanes;
// contiguous[b]: its rows are one run. Returns the number of blocks (1 or 2). Fp16 metadata;
// NGMAX (>= f.n_groups): the arrays' room per block.
template <int NGMAX>
inline int64_t tile_meta16(const PackedRowFormat& f, const PackedTile& tile, __m512 (*lov)[NGMAX],
                           __m512 (*sgv)[NGMAX], __mmask16* kb, bool* contiguous) {
  const int64_t ng = f.n_groups;
  const int64_t n_blk = (tile.n_rows + 15) / 16;
  for (int64_t b = 0; b < n_blk; ++b) {
    const int64_t r0 = 16 * b, n = tile.n_rows - r0 < 16 ? tile.n_rows - r0 : 16;
    const int32_t* rows = tile.rows + r0;
    kb[b] = static_cast<__mmask16>((1u << n) - 1u);
    prefetch_rows_ahead(tile, rows[0]);
    contiguous[b] = one_run(rows, n);
    // (lo, s) of the 16 rows: up to 4 groups by one 16-byte load per record and a transpose
    // (packed_decode_rows16.h; 0.93x the time of one gather per group at D 128, session 25),
    // more by one gather per group.
    if (ng <= 4) {
      const uint8_t* rec[16];
      for (int64_t r = 0; r < 16; ++r)
        rec[r] = tile.rec0 + rows[r < n ? r : 0] * tile.stride + f.code_bytes;
      __m512i mw[4];
      rows16_words<4>(rec, n, 4 * ng, mw);
      for (int64_t g = 0; g < ng; ++g) {
        lov[b][g] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(mw[g]));
        sgv[b][g] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(mw[g], 16)));
      }
      continue;
    }
    const __m512i off = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(kb[b], rows),
                                           _mm512_set1_epi32(static_cast<int>(tile.stride)));
    for (int64_t g = 0; g < ng; ++g) {
      const __m512i mw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), kb[b], off,
                                                     tile.rec0 + f.code_bytes + 4 * g, 1);
      lov[b][g] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(mw));
      sgv[b][g] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(mw, 16)));
    }
  }
  return n_blk;
}

// The weights p of the tile's rows for one query (pr: its row of p), 16 row lanes per block
// (0 past the tile's rows).
inline void tile_p16(const PackedTile& tile, const float* pr, int64_t n_blk, const __mmask16* kb,
                     const bool* contiguous, __m512* pm) {
  for (int64_t b = 0; b < n_blk; ++b) {
    const int32_t* rows = tile.rows + 16 * b;
    pm[b] = contiguous[b] ? (kb[b] == 0xFFFF ? _mm512_loadu_ps(pr + rows[0])
                                             : _mm512_maskz_loadu_ps(kb[b], pr + rows[0]))
                          : _mm512_mask_i32gather_ps(_mm512_setzero_ps(), kb[b],
                                                     _mm512_maskz_loadu_epi32(kb[b], rows), pr, 4);
  }
}
