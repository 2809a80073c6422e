// The words of up to 16 packed records with lanes over the records (lane r = record r), from one
// plain load per record and an in-register transpose instead of one gather per word: the VNNI
// key kernels' reads of codes, and of metadata in keys_vnni (packed_decode_vnni.cpp; keys_fixed
// gathers its 2-4 fp16 metadata words: loads and a transpose measured slower end to end, session
// 25), and the AVX-512 value kernels' reads of up to 4 fp16 metadata words
// (packed_decode_values512.h).
// Meant to be included inside an anonymous namespace after the AVX-512 target pragmas and
// <immintrin.h>.
//
// A gather of 16 lanes issues one load per lane (docs/results/cpu/packed_profile_s10_issue19.txt
// found the key kernel's hottest instructions after its gathers); a record's words are
// contiguous, so R = 16 / W records of W words fill one register with plain loads (W = 16, 8 or
// 4), and the W registers, read as one array of 16 W words in record order (flat index
// x = r W + k), are transposed to word order (x' = k 16 + r) by log2(W) unzip steps: each step
// moves the even words of every register pair to the first half and the odd ones to the second
// half (x' = x rotated right by one bit), two vpermt2d per pair. The words are moved, never
// changed: the kernels see the same bits as the gathers gave them.

// out[k] lane r = 32-bit word k of the n_bytes (at most 4 W) bytes at rec[r] (r < n; 0 for
// r >= n and for bytes past n_bytes), k < W. Reads no byte past n_bytes of any record.
template <int W>
inline void rows16_words(const uint8_t* const* rec, int64_t n, int64_t n_bytes, __m512i* out) {
  static_assert(W == 4 || W == 8 || W == 16, "4, 8 or 16 words per record");
  constexpr int R = 16 / W;  // records per register
  const uint64_t bm = n_bytes >= 64 ? ~uint64_t{0} : (uint64_t{1} << n_bytes) - 1u;
  for (int i = 0; i < W; ++i) {
    if constexpr (W == 16) {
      out[i] = _mm512_maskz_loadu_epi8(i < n ? bm : 0, rec[i]);
    } else if constexpr (W == 8) {
      const int r = R * i;
      const __m256i lo = _mm256_maskz_loadu_epi8(static_cast<__mmask32>(r < n ? bm : 0), rec[r]);
      const __m256i hi =
          _mm256_maskz_loadu_epi8(static_cast<__mmask32>(r + 1 < n ? bm : 0), rec[r + 1]);
      out[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    } else {
      const int r = R * i;
      __m512i v = _mm512_castsi128_si512(
          _mm_maskz_loadu_epi8(static_cast<__mmask16>(r < n ? bm : 0), rec[r]));
      v = _mm512_inserti32x4(
          v, _mm_maskz_loadu_epi8(static_cast<__mmask16>(r + 1 < n ? bm : 0), rec[r + 1]), 1);
      v = _mm512_inserti32x4(
          v, _mm_maskz_loadu_epi8(static_cast<__mmask16>(r + 2 < n ? bm : 0), rec[r + 2]), 2);
      out[i] = _mm512_inserti32x4(
          v, _mm_maskz_loadu_epi8(static_cast<__mmask16>(r + 3 < n ? bm : 0), rec[r + 3]), 3);
    }
  }
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int step = W; step > 1; step /= 2) {  // log2(W) unzip steps
    __m512i t[W];
    for (int j = 0; j < W / 2; ++j) {
      t[j] = _mm512_permutex2var_epi32(out[2 * j], ev, out[2 * j + 1]);
      t[j + W / 2] = _mm512_permutex2var_epi32(out[2 * j], od, out[2 * j + 1]);
    }
    for (int j = 0; j < W; ++j) out[j] = t[j];
  }
}

// rows16_words for any n_words <= 4 * 16 words per record (n_bytes <= 4 n_words): chunks of 16
// words, the last one 4, 8 or 16 wide; out[k] for k < n_words (out has room for them rounded up
// to the last chunk's width).
inline void rows16_any(const uint8_t* const* rec, int64_t n, int64_t n_bytes, __m512i* out) {
  int64_t b0 = 0;
  const uint8_t* r[16];
  for (int i = 0; i < 16; ++i) r[i] = rec[i];
  for (; n_bytes - b0 > 32; b0 += 64, out += 16) {
    rows16_words<16>(r, n, n_bytes - b0, out);
    for (int i = 0; i < 16; ++i) r[i] += 64;
  }
  if (n_bytes - b0 > 16)
    rows16_words<8>(r, n, n_bytes - b0, out);
  else if (n_bytes - b0 > 0)
    rows16_words<4>(r, n, n_bytes - b0, out);
}
