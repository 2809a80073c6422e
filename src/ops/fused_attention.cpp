// vq::attention: fused CPU attention over a CacheView that mixes full-precision and packed
// segments, and dequantize_view (packed.h) for callers that want dense rows.
//
// q [B, H_q, N, D] (any strides, f32/f16/bf16), out [B, H_q, N, D] fp32 contiguous. Work items
// are (b, kv head, block of queries), spread over the worker pool (thread_pool.h); each item holds
// the M = n_rep * n_queries query vectors that share one KV head, so every KV row is read and
// unpacked once for all of them (GQA). Per tile of 32 rows: logits, an online-softmax update
// (running max and sum, fp32), then the value accumulation.
// Packed rows are never dequantized to a dense cache: row j of group g has x_i = c_i*s_g + lo_g
// in the stored (rotated/permuted) channel order, so
//   logit = (q'.(c*s)) + sum_g lo_g * sum_{i in g} q'_i         q' = P R q, computed once
//   acc'  += p * (c*s),  acc_lo[g] += p * lo_g                   out = R^T P^T (acc' + acc_lo)
// with the un-transform applied once per query at the end. Full-precision rows are converted to
// fp32 row by row. A query that sees no key gets zeros, and one whose visible keys give a NaN
// or +inf logit gets NaN (both as attention_reference).
// Decode-sized calls (fewer than kManyQueries queries per head) over packed rows compute on the
// codes: the kernels of packed_decode.h (portable, AVX2, AVX-512, chosen at run time, once per
// segment) give the tile's logits and value sums, the online softmax runs here.
// Variants (AVX-512): prefill-sized calls (>= kManyQueries queries per head, D a multiple of 16
// up to 128) run full-precision tiles with vector lanes over queries (many_tile below); smaller
// calls (decode) read contiguous full-precision rows in place, D a multiple of 32 up to 128
// (few_tile_logits / few_tile_values below); prefill-sized calls over packed rows, D a multiple
// of 32 up to 128, run lanes over queries too (many_packed_tile). AVX2 + FMA builds have the
// same three with 8 lanes (their many_tile and many_packed_tile take D a multiple of 16; the
// in-place rows are attend_fp_few8). The results meet the fused bound of docs/design.md §4, not
// one summation order.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>

#include "ops/exp_nonpos16.h"
#endif

#include "ops/packed_decode.h"
#include "ops/thread_pool.h"
#include "veloxquant/attention.h"
#include "veloxquant/error.h"
#include "veloxquant/hadamard.h"
#include "veloxquant/packed.h"

// GCC 12's AVX-512 intrinsic headers trip -W(maybe-)uninitialized on their own internal
// "undefined" vectors (_mm512_reduce_add_ps, _mm512_setr_epi32, _mm512_cvtph_ps, ...; GCC bug
// 105593): the warning is about the headers, so it is off for this file's kernels.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace vq {
namespace {

constexpr int64_t kTile = 32;         // rows per online-softmax step
constexpr int64_t kMaxQueries = 256;  // query vectors per work item
constexpr int64_t kManyQueries = 8;   // queries per head from which the many-query paths run
// Decode-sized calls (fewer than kManyQueries queries per head) split each (batch, KV head)
// item's rows into parts of at least kSplitRows rows (rounded up to whole tiles), at most
// kMaxParts, merged after the parallel loop (merge_parts): the split depends on the view's length
// only, never on the thread count, so every thread count gives the same bits.
constexpr int64_t kSplitRows = 2048;
constexpr int64_t kMaxParts = 16;
// Prefill-sized calls (>= kManyQueries queries per head) over full-precision rows run with vector
// lanes over queries where the build has AVX-512 (16 lanes) or AVX2 + FMA (8 lanes): many_tile.
#if defined(__AVX512F__)
#define VQ_MANY_FP 1
constexpr int64_t kManyLanes = 16;
#elif defined(__AVX2__) && defined(__FMA__)
#define VQ_MANY_FP 1
constexpr int64_t kManyLanes = 8;
#endif

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
#define VQ_SIMD_AVX512
#endif
#include "ops/simd_vec.h"
#endif

// ---- small vector kernels (lane accumulators so the loops vectorise without -ffast-math) -----

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int l = 0; l < 16; ++l) s += acc[l];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
// The four lane totals of dot_many's queries: AVX-512 through the compiler's add tree
// (_mm512_reduce_add_ps), AVX2 through horizontal adds.
#if defined(__AVX512F__)
inline void reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float* r) {
  r[0] = _mm512_reduce_add_ps(a0);
  r[1] = _mm512_reduce_add_ps(a1);
  r[2] = _mm512_reduce_add_ps(a2);
  r[3] = _mm512_reduce_add_ps(a3);
}
#endif
inline void reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float* r) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(r, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// dot_many with V (simd_vec.h) lanes, n a multiple of V::L. Queries past n_q repeat the last
// one, so every query gets the same arithmetic whatever n_q is (GQA and MHA with repeated heads
// agree bit for bit).
template <class V>
void dot_many_lanes(const float* __restrict q, int64_t n_q, const float* __restrict x, int64_t n,
                    float* __restrict out) {
  for (int64_t m = 0; m < n_q; m += 4) {
    const float* q0 = q + m * n;
    const float* q1 = q + std::min(m + 1, n_q - 1) * n;
    const float* q2 = q + std::min(m + 2, n_q - 1) * n;
    const float* q3 = q + std::min(m + 3, n_q - 1) * n;
    typename V::reg a0 = V::zero(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n; i += V::L) {
      const typename V::reg xv = V::load(x + i);
      a0 = V::fma(V::load(q0 + i), xv, a0);
      a1 = V::fma(V::load(q1 + i), xv, a1);
      a2 = V::fma(V::load(q2 + i), xv, a2);
      a3 = V::fma(V::load(q3 + i), xv, a3);
    }
    float r[4];
    reduce4(a0, a1, a2, a3, r);
    for (int64_t j = 0; j < 4 && m + j < n_q; ++j) out[m + j] = r[j];
  }
}

// accumulate_tile's blocks of 4 V::L channels from channel c on; returns the first channel left.
template <class V>
int64_t accumulate_blocks(float* __restrict acc, const float* __restrict p,
                          const float* __restrict v, const int32_t* rows, int64_t n_rows, int64_t d,
                          int64_t c) {
  constexpr int64_t L = V::L;
  for (; c + 4 * L <= d; c += 4 * L) {
    typename V::reg a0 = V::load(acc + c), a1 = V::load(acc + c + L);
    typename V::reg a2 = V::load(acc + c + 2 * L), a3 = V::load(acc + c + 3 * L);
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t t = rows[r];
      const float* vr = v + t * d + c;
      const typename V::reg pv = V::set1(p[t]);
      a0 = V::fma(pv, V::load(vr), a0);
      a1 = V::fma(pv, V::load(vr + L), a1);
      a2 = V::fma(pv, V::load(vr + 2 * L), a2);
      a3 = V::fma(pv, V::load(vr + 3 * L), a3);
    }
    V::store(acc + c, a0);
    V::store(acc + c + L, a1);
    V::store(acc + c + 2 * L, a2);
    V::store(acc + c + 3 * L, a3);
  }
  return c;
}
#endif

// out[m] = q[m] . x for m < n_q (q: [n_q, n] rows). Four queries at a time share each load of
// x, 16 (AVX-512) or 8 (AVX2) lanes per accumulator.
void dot_many(const float* __restrict q, int64_t n_q, const float* __restrict x, int64_t n,
              float* __restrict out) {
#if defined(__AVX512F__)
  if (n % 16 == 0) return dot_many_lanes<Avx512Vec>(q, n_q, x, n, out);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) return dot_many_lanes<Avx2Vec>(q, n_q, x, n, out);
#endif
  for (int64_t m = 0; m < n_q; ++m) out[m] = dot(q + m * n, x, n);
}

// acc[0..d) += sum over the listed rows t of p[t] * v[t*d ..]: the accumulator stays in
// registers across the tile's rows (64 channels at a time on AVX-512, then 32 on AVX2).
void accumulate_tile(float* __restrict acc, const float* __restrict p, const float* __restrict v,
                     const int32_t* rows, int64_t n_rows, int64_t d) {
  int64_t c = 0;
#if defined(__AVX512F__)
  c = accumulate_blocks<Avx512Vec>(acc, p, v, rows, n_rows, d, c);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  c = accumulate_blocks<Avx2Vec>(acc, p, v, rows, n_rows, d, c);
#endif
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t t = rows[r];
    for (int64_t i = c; i < d; ++i) acc[i] += p[t] * v[t * d + i];
  }
}

// y = exp(x) for x <= 0 (x = -inf gives 0), vectorisable: Cody-Waite reduction by ln 2 and the
// Cephes degree-6 polynomial. Measured max relative error 1.41 u (u = 2^-24) over 17M points
// of [-87, 0]; x < -87 (weights below 2^-125 of the largest) flushes to 0.
// (Used by the scalar softmax_tile only: AVX-512 builds run exp_nonpos16_exact, the same steps.)
[[maybe_unused]] inline void exp_nonpos(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i];
    const bool tiny = !(v >= -87.0f);
    v = tiny ? -87.0f : v;
    const float k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // rint(v / ln 2)
    float r = v - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float q = 1.9875691500E-4f;
    q = q * r + 1.3981999507E-3f;
    q = q * r + 8.3334519073E-3f;
    q = q * r + 4.1665795894E-2f;
    q = q * r + 1.6666665459E-1f;
    q = q * r + 5.0000001201E-1f;
    q = q * (r * r) + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k, k in [-126, 0]
    float two_k;
    std::memcpy(&two_k, &bits, 4);
    y[i] = tiny ? 0.0f : q * two_k;
  }
}

inline void scal(float* y, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// fp16 / bf16 -> fp32 (hardware conversion where the build has F16C).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return fp16_to_f32(h);
#endif
}

inline float meta_value(const void* meta, int64_t i, MetaType t) {
  switch (t) {
    case MetaType::kF16:
      return half_to_float(static_cast<const uint16_t*>(meta)[i]);
    case MetaType::kF32:
      return static_cast<const float*>(meta)[i];
    case MetaType::kFP8E4M3:
      return fp8_e4m3_decode(static_cast<const uint8_t*>(meta)[i]);
  }
  return 0.0f;
}

// A contiguous row of n elements of type t as fp32.
void row_to_f32(const void* src, DType t, float* __restrict dst, int64_t n) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i,
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
      for (; i < n; ++i) dst[i] = half_to_float(s[i]);
      return;
    }
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
        std::memcpy(dst + i, &u, 4);
      }
      return;
    }
  }
}

// Lookup table: byte -> its five ternary codes as floats.
struct Luts {
  alignas(64) float t5[256][5];
  Luts() {
    for (int v = 0; v < 256; ++v) {
      int t = v;
      for (int j = 0; j < 5; ++j) {
        t5[v][j] = static_cast<float>(t % 3);
        t /= 3;
      }
    }
  }
};
const Luts& luts() {
  static const Luts l;
  return l;
}

#if defined(__AVX512F__)
// B-bit codes (B in 1, 2, 4, 8), 16 per step: broadcast the 2B bytes, shift each lane to its
// code, mask, convert, scale. Groups of g (a multiple of 16) share one scale.
template <int B>
inline void unpack_pow2_512(const uint8_t* rec, int32_t n_groups, int64_t g, int64_t d,
                            const float* sc, float* __restrict out) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // B <= 4: lane j of the table holds (j mod 2^B) * s, so a permute by the shifted word (whose
  // low 4 bits start with the lane's code) yields code * s without masking or converting.
  __m512 lane_code = iota;
  if constexpr (B < 4) {
    alignas(64) float t[16];
    for (int j = 0; j < 16; ++j) t[j] = static_cast<float>(j & ((1 << B) - 1));
    lane_code = _mm512_load_ps(t);
  }
  const __m512i sh = B == 4
                         ? _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4)
                         : _mm512_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B, 8 * B,
                                             9 * B, 10 * B, 11 * B, 12 * B, 13 * B, 14 * B, 15 * B);
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int32_t gi = 0; gi < n_groups; ++gi) {
    const __m512 s = _mm512_set1_ps(sc[gi]);
    const __m512 table = _mm512_mul_ps(lane_code, s);  // exact: (code as float) * s, as below
    const int64_t i1 = std::min(d, (gi + 1) * g);      // a ragged last group ends at d
    for (int64_t i = gi * g; i < i1; i += 16) {
      const uint8_t* src = rec + i * B / 8;
      if constexpr (B == 8) {
        const __m512i c =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(c), s));
      } else {
        __m512i wv;
        if constexpr (B == 4) {  // 8 bytes -> each byte twice -> lanes, shifted by 0 / 4
          const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
          wv = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(bytes, dup)), sh);
        } else if constexpr (B == 2) {
          uint32_t w;
          std::memcpy(&w, src, 4);
          wv = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(w)), sh);
        } else {
          uint16_t w;
          std::memcpy(&w, src, 2);
          wv = _mm512_srlv_epi32(_mm512_set1_epi32(w), sh);
        }
        _mm512_storeu_ps(out + i, _mm512_permutexvar_ps(wv, table));
      }
    }
  }
}
#elif defined(__AVX2__)
// The same with 8 codes per step (B bytes).
template <int B>
inline void unpack_pow2_256(const uint8_t* rec, int32_t n_groups, int64_t g, int64_t d,
                            const float* sc, float* __restrict out) {
  const __m256i mask = _mm256_set1_epi32((1 << B) - 1);
  const __m256i sh = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B);
  for (int32_t gi = 0; gi < n_groups; ++gi) {
    const __m256 s = _mm256_set1_ps(sc[gi]);
    const int64_t i1 = std::min(d, (gi + 1) * g);  // a ragged last group ends at d
    for (int64_t i = gi * g; i < i1; i += 8) {
      const uint8_t* src = rec + i * B / 8;
      __m256i c;
      if constexpr (B == 8) {
        c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
      } else {
        uint32_t w = 0;
        if constexpr (B == 4) std::memcpy(&w, src, 4);
        if constexpr (B == 2) {
          uint16_t h;
          std::memcpy(&h, src, 2);
          w = h;
        }
        if constexpr (B == 1) w = *src;
        c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), sh), mask);
      }
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(c), s));
    }
  }
}
#endif

// f(std::integral_constant<int, NV>{}) for NV = nv 16-float vectors per row: 1 .. 8
// (with_vecs) or 2, 4, 6, 8 (with_even_vecs); larger nv gets 8 (callers check D <= 128).
template <typename F>
void with_even_vecs(int64_t nv, F&& f) {
  switch (nv) {
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 6:
      return f(std::integral_constant<int, 6>{});
    default:
      return f(std::integral_constant<int, 8>{});
  }
}

template <typename F>
void with_vecs(int64_t nv, F&& f) {
  switch (nv) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 7:
      return f(std::integral_constant<int, 7>{});
  }
  with_even_vecs(nv, f);
}

// f(std::integral_constant<int, B>{}) for the power-of-two code width B = bx2 / 2 (1, 2, 4, 8).
template <typename F>
void with_pow2_bits(int bx2, F&& f) {
  switch (bx2) {
    case 2:
      return f(std::integral_constant<int, 1>{});
    case 4:
      return f(std::integral_constant<int, 2>{});
    case 8:
      return f(std::integral_constant<int, 4>{});
    default:
      return f(std::integral_constant<int, 8>{});
  }
}

// Codes of one record as floats, multiplied by their group scale: out[i] = c_i * s_g(i);
// lo receives the n_groups offsets. The scale is applied as the codes are produced (a second
// pass would reload what was just stored in narrower pieces: a store-forwarding stall).
void unpack_scaled(const uint8_t* rec, const PackedRowFormat& f, float* __restrict out,
                   float* __restrict lo) {
  const int64_t d = f.head_dim, g = f.group_size;
  const void* meta = rec + f.code_bytes;
  alignas(64) float sc[1024];  // scales (more than 1024 groups take the generic loop below)
  const bool small = f.n_groups <= 1024;
  int32_t gi = 0;
#if defined(__F16C__) && defined(__AVX__)
  if (f.meta == MetaType::kF16 && small) {  // 4 (lo, scale) pairs per conversion
    const uint16_t* mh = static_cast<const uint16_t*>(meta);
    for (; gi + 4 <= f.n_groups; gi += 4) {
      alignas(32) float pair[8];
      _mm256_store_ps(
          pair, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mh + 2 * gi))));
      for (int j = 0; j < 4; ++j) {
        lo[gi + j] = pair[2 * j];
        sc[gi + j] = pair[2 * j + 1];
      }
    }
  }
#endif
  for (; gi < f.n_groups; ++gi) {
    lo[gi] = meta_value(meta, 2 * gi, f.meta);
    if (small) sc[gi] = meta_value(meta, 2 * gi + 1, f.meta);
  }
  const int bx2 = f.spec.bits_x2;
  [[maybe_unused]] const bool pow2 = bx2 == 2 || bx2 == 4 || bx2 == 8 || bx2 == 16;
#if defined(__AVX512F__)
  if (small && pow2 && g % 16 == 0 && d % 16 == 0)
    return with_pow2_bits(bx2, [&](auto bits) {
      unpack_pow2_512<decltype(bits)::value>(rec, f.n_groups, g, d, sc, out);
    });
#elif defined(__AVX2__)
  if (small && pow2 && g % 8 == 0 && d % 8 == 0)
    return with_pow2_bits(bx2, [&](auto bits) {
      unpack_pow2_256<decltype(bits)::value>(rec, f.n_groups, g, d, sc, out);
    });
#endif
  // Portable path: one code at a time, scaled as it is produced.
  const Luts& L = luts();
  for (int64_t i = 0; i < d; ++i) {
    const int64_t gi = i / g;
    const float s = small ? sc[gi] : meta_value(meta, 2 * gi + 1, f.meta);
    float c;
    if (f.spec.ternary()) {
      c = L.t5[rec[i / 5]][i % 5];
    } else {
      const int b = f.spec.bits();
      const int64_t bit = i * b;
      uint32_t wv = rec[bit >> 3];
      if ((bit & 7) + b > 8) wv |= static_cast<uint32_t>(rec[(bit >> 3) + 1]) << 8;
      c = static_cast<float>((wv >> (bit & 7)) & ((1u << b) - 1u));
    }
    out[i] = c * s;
  }
}

// Codes of one channel-axis record (packed.h) as floats, unscaled: out[i] = c_i (exact).
void unpack_codes_f32(const uint8_t* rec, const PackedRowFormat& f, float* __restrict out) {
  const int64_t d = f.head_dim;
  const int bx2 = f.spec.bits_x2;
  [[maybe_unused]] const bool pow2 = bx2 == 2 || bx2 == 4 || bx2 == 8 || bx2 == 16;
  [[maybe_unused]] const float one = 1.0f;
#if defined(__AVX512F__)
  if (pow2 && d % 16 == 0)
    return with_pow2_bits(
        bx2, [&](auto bits) { unpack_pow2_512<decltype(bits)::value>(rec, 1, d, d, &one, out); });
#elif defined(__AVX2__)
  if (pow2 && d % 8 == 0)
    return with_pow2_bits(
        bx2, [&](auto bits) { unpack_pow2_256<decltype(bits)::value>(rec, 1, d, d, &one, out); });
#endif
  const Luts& L = luts();
  for (int64_t i = 0; i < d; ++i)
    out[i] =
        f.spec.ternary() ? L.t5[rec[i / 5]][i % 5] : static_cast<float>(code_at(rec, i, f.spec));
}

// ---- transform classes -----------------------------------------------------------------------

// Queries mapped into one stored channel order (P R q) and their per-group sums.
struct KeyClass {
  const int32_t* perm = nullptr;
  const float* signs = nullptr;
  int32_t rot_block = 0;
  int32_t group_size = 0, n_groups = 0;
  std::vector<float> q;     // [M, D]
  std::vector<float> qsum;  // [M, n_groups]
  std::vector<float> qt;    // many-query path: q transposed [D, Mp] (padding lanes 0)
  std::vector<float> qst;   // many-query path: qsum transposed [n_groups, Mp]
  // Packed decode: the key kernel's prepared queries for records of prep_fmt (made by prep_fn),
  // shared by every segment of that format (SKVQ's CPU store has one segment per chunk).
  std::vector<uint64_t> qprep;
  detail::PackedPrepFn prep_fn = nullptr;
  PackedRowFormat prep_fmt{};
};

// Value accumulators in one stored channel order.
struct ValClass {
  const int32_t* perm = nullptr;
  const float* signs = nullptr;
  int32_t rot_block = 0;
  int32_t group_size = 0, n_groups = 0;
  std::vector<float> acc;     // [M, D]
  std::vector<float> acc_lo;  // [M, n_groups]
};

struct Work {
  int64_t m = 0, d = 0;
  std::vector<float> q;       // [M, D] scaled queries, original order
  std::vector<int64_t> qpos;  // [M]
  std::vector<float> acc;     // [M, D] full-precision rows' sum
  std::vector<float> mx, l;   // [M] running max and sum
  // [M, 16] the AVX-512 softmax_tile's lane partials of l, folded into l by fold_lanes when the
  // item (or part) ends; zeros on the other paths.
  std::vector<float> lv;
  // [M + 16] 1 when a key visible to the query gave a NaN or +inf logit (a NaN/Inf key or
  // query): the query's output is NaN, as attention_reference's softmax gives, instead of the
  // online softmax silently dropping the row.
  std::vector<uint8_t> bad;
  std::vector<KeyClass> kcls;
  std::vector<ValClass> vcls;
  std::vector<float> logits, probs;  // [M, kTile]
  std::vector<float> kt, vt;         // [kTile, D] fp32 tiles of keys / values
  std::vector<float> klo, vlo;       // [n_groups, kTile] offsets of packed tiles (transposed)
  std::vector<float> tmp, dots;
  std::vector<float> qch, qbias;  // channel-axis keys: [M, D] q'_c s_c, [M] sum_c q'_c lo_c
  std::vector<float> pscratch;    // packed value kernels' weights (packed_decode.h)
  std::vector<int32_t> pos, vis;  // [kTile] positions; indices of visible rows
  // Many-query path (full-precision segments, see many_tile): lanes run over queries.
  int64_t mp = 0;               // M rounded up to kManyLanes
  std::vector<float> qt;        // [D, Mp] scaled queries transposed (padding lanes 0)
  std::vector<int32_t> qpos32;  // [Mp] query positions
  std::vector<float> st;        // [kTile, Mp] logits, then weights, of one tile
  std::vector<float> alpha;     // [Mp] this tile's rescale factor of each query's sums
};

KeyClass& key_class(Work& w, const PackedTensor& t) {
  for (KeyClass& k : w.kcls)
    if (k.perm == t.perm && k.signs == t.signs && k.group_size == t.fmt.group_size) return k;
  KeyClass k;
  k.perm = t.perm;
  k.signs = t.signs;
  k.rot_block = t.rot_block;
  k.group_size = t.fmt.group_size;
  k.n_groups = t.fmt.n_groups;
  k.q = w.q;
  k.qsum.assign(static_cast<size_t>(w.m * k.n_groups), 0.0f);
  std::vector<float> tmp(static_cast<size_t>(w.d));
  for (int64_t m = 0; m < w.m; ++m) {
    float* qm = k.q.data() + m * w.d;
    if (t.transformed()) {
      // The signs/perm of head h were bound by the caller into t (already offset).
      if (k.signs) hadamard_rotate(qm, k.signs, w.d, k.rot_block);
      if (k.perm) {
        for (int64_t j = 0; j < w.d; ++j) tmp[static_cast<size_t>(j)] = qm[k.perm[j]];
        std::copy(tmp.begin(), tmp.end(), qm);
      }
    }
    for (int64_t i = 0; i < w.d; ++i)
      k.qsum[static_cast<size_t>(m * k.n_groups + i / k.group_size)] += qm[i];
  }
  w.kcls.push_back(std::move(k));
  return w.kcls.back();
}

ValClass& val_class(Work& w, const PackedTensor& t) {
  for (ValClass& v : w.vcls)
    if (v.perm == t.perm && v.signs == t.signs && v.group_size == t.fmt.group_size) return v;
  ValClass v;
  v.perm = t.perm;
  v.signs = t.signs;
  v.rot_block = t.rot_block;
  v.group_size = t.fmt.group_size;
  v.n_groups = t.fmt.n_groups;
  v.acc.assign(static_cast<size_t>(w.m * w.d), 0.0f);
  v.acc_lo.assign(static_cast<size_t>(w.m * v.n_groups), 0.0f);
  w.vcls.push_back(std::move(v));
  return w.vcls.back();
}

// Rescales every accumulator of query m by f.
void rescale(Work& w, int64_t m, float f) {
  scal(w.acc.data() + m * w.d, f, w.d);
  for (ValClass& v : w.vcls) {
    scal(v.acc.data() + m * w.d, f, w.d);
    scal(v.acc_lo.data() + m * v.n_groups, f, v.n_groups);
  }
  w.l[static_cast<size_t>(m)] *= f;
  for (int i = 0; i < 16; ++i) w.lv[static_cast<size_t>(m * 16 + i)] *= f;
}

// l[m] += the sum of the lane partials lv[m] (which are then zero).
void fold_lanes(Work& w) {
  for (int64_t m = 0; m < w.m; ++m) {
    float* v = w.lv.data() + m * 16;
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += v[i];
    w.l[static_cast<size_t>(m)] += s;
    std::fill(v, v + 16, 0.0f);
  }
}

#if defined(VQ_MANY_FP)
bool many_supported(int64_t d) {
  return d % 16 == 0 && d >= 16 && d <= 128;
}

// Queries of the item transposed into lanes: qt[c][m] = q[m][c], padding lanes 0.
void build_many(Work& w) {
  const int64_t M = w.m, d = w.d;
  w.mp = (M + kManyLanes - 1) / kManyLanes * kManyLanes;
  w.qt.assign(static_cast<size_t>(d * w.mp), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < d; ++c) w.qt[static_cast<size_t>(c * w.mp + m)] = w.q[m * d + c];
  w.qpos32.assign(static_cast<size_t>(w.mp), 0);
  for (int64_t m = 0; m < M; ++m)
    w.qpos32[static_cast<size_t>(m)] = static_cast<int32_t>(w.qpos[static_cast<size_t>(m)]);
  w.st.resize(static_cast<size_t>(kTile * w.mp));
  w.alpha.resize(static_cast<size_t>(w.mp));
  w.mx.resize(static_cast<size_t>(w.mp), -std::numeric_limits<float>::infinity());
  w.l.resize(static_cast<size_t>(w.mp), 0.0f);
  w.lv.resize(static_cast<size_t>(w.mp * 16), 0.0f);  // rescale reaches every lane's query
}

// The transposed class queries and group sums of the many-query packed path.
void build_class_lanes(const Work& w, KeyClass& kc) {
  const int64_t M = w.m, d = w.d, mp = w.mp;
  kc.qt.assign(static_cast<size_t>(d * mp), 0.0f);
  kc.qst.assign(static_cast<size_t>(kc.n_groups * mp), 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < d; ++c) kc.qt[static_cast<size_t>(c * mp + m)] = kc.q[m * d + c];
    for (int32_t g = 0; g < kc.n_groups; ++g)
      kc.qst[static_cast<size_t>(g * mp + m)] = kc.qsum[static_cast<size_t>(m * kc.n_groups + g)];
  }
}

// The many-query paths' rescale where a lane's running max rises over a finite one: for each
// lane i set in resc, al[i] = exp(mx_i - tmax_i) (std::exp, as the general path) and the packed
// accumulators of query l0 + i (with scale_acc the full-precision ones too) scaled by it.
void rescale_lanes(Work& w, int64_t l0, uint32_t resc, const float* mxa, const float* tma,
                   float* al, bool scale_acc) {
  const int64_t d = w.d;
  for (int i = 0; resc >> i; ++i)
    if (resc & (1u << i)) {
      al[i] = std::exp(mxa[i] - tma[i]);
      if (scale_acc) scal(w.acc.data() + (l0 + i) * d, al[i], d);
      for (ValClass& v : w.vcls) {
        scal(v.acc.data() + (l0 + i) * d, al[i], d);
        scal(v.acc_lo.data() + (l0 + i) * v.n_groups, al[i], v.n_groups);
      }
    }
}
#endif

#if defined(__AVX512F__)
// ---- many-query path: full-precision rows, lanes over queries --------------------------------
//
// For prefill (n_q >= kManyQueries queries per head) a tile of kTile full-precision rows meets
// all M queries of the item at once, with 16 queries per vector lane group:
//   st[t][m] = sum_c k_t[c] * qt[c][m]        (key elements broadcast, 8 rows x 48 queries per
//                                              register block: no horizontal sums)
//   online softmax per lane (max, exp, sum down the tile's rows: vertical operations only)
//   acc[m] = acc[m] * alpha_m + sum_t st[t][m] v_t   (5 queries x 64 channels per block)
// Each query's arithmetic is independent of its lane mates and of the item's query block: its
// logits are sequential fp32 FMA sums over the D channels, its weights come from exp_nonpos16
// (exp_nonpos's polynomial with FMAs), its sum and accumulators run over the tile's rows in
// order as in the general path. GQA and MHA with repeated heads therefore agree bit for bit
// here too; the logits' summation order and the exp's last bits differ from the general path.

// exp(x) for x <= 0 on 16 lanes (x < -87, -inf and NaN give 0): the same reduction by ln 2 and
// degree-6 polynomial as exp_nonpos, evaluated with FMAs and scalef. Measured over every float
// in [-87, 0]: max relative error 1.41 u (as the scalar version; the bound allows 3 u).
inline __m512 exp_nonpos16(__m512 v) {
  const __m512 lim = _mm512_set1_ps(-87.0f);
  const __mmask16 ok = _mm512_cmp_ps_mask(v, lim, _CMP_GE_OQ);
  v = _mm512_max_ps(v, lim);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 q = _mm512_set1_ps(1.9875691500E-4f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.3981999507E-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.3334519073E-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1665795894E-2f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.6666665459E-1f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(5.0000001201E-1f));
  q = _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(ok, q, k);  // q 2^k
}

// st[r][lanes of groups g0 .. g0 + QB) = kt[r] . qt for the 8 rows r of kt (row stride d).
template <int QB>
inline void qk_block(const float* __restrict qt, int64_t mp, const float* __restrict kt, int64_t d,
                     float* __restrict st, int64_t g0) {
  __m512 acc[8][QB];
  for (int r = 0; r < 8; ++r)
    for (int j = 0; j < QB; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* qg = qt + g0 * 16;
  for (int64_t c = 0; c < d; ++c) {
    __m512 qv[QB];
    for (int j = 0; j < QB; ++j) qv[j] = _mm512_loadu_ps(qg + c * mp + 16 * j);
    for (int r = 0; r < 8; ++r) {
      const __m512 kb = _mm512_set1_ps(kt[r * d + c]);
      for (int j = 0; j < QB; ++j) acc[r][j] = _mm512_fmadd_ps(kb, qv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < 8; ++r)
    for (int j = 0; j < QB; ++j) _mm512_storeu_ps(st + r * mp + (g0 + j) * 16, acc[r][j]);
}

// acc[m] = acc[m] * alpha[m] + sum over the listed rows t of st[t][m] * vt[t] for the QP
// queries m0 .. m0 + QP; NV = D / 16 vectors per row.
template <int NV, int QP>
inline void pv_block(float* __restrict acc, const float* __restrict st, int64_t mp,
                     const float* __restrict alpha, const float* __restrict vt, const int32_t* rows,
                     int64_t n_rows, int64_t m0) {
  constexpr int64_t d = NV * 16;
  __m512 a[QP][NV];
  for (int i = 0; i < QP; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[m0 + i]);
    for (int j = 0; j < NV; ++j)
      a[i][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + (m0 + i) * d + 16 * j), al);
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t t = rows[r];
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = _mm512_loadu_ps(vt + t * d + 16 * j);
    for (int i = 0; i < QP; ++i) {
      const __m512 pb = _mm512_set1_ps(st[t * mp + m0 + i]);
      for (int j = 0; j < NV; ++j) a[i][j] = _mm512_fmadd_ps(pb, vv[j], a[i][j]);
    }
  }
  for (int i = 0; i < QP; ++i)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + (m0 + i) * d + 16 * j, a[i][j]);
}

template <int NV>
void pv_all(float* acc, const float* st, int64_t mp, const float* alpha, const float* vt,
            const int32_t* rows, int64_t n_rows, int64_t M) {
  constexpr int QP = NV <= 2 ? 8 : NV <= 4 ? 5 : NV <= 6 ? 3 : 2;  // <= 24 accumulators
  int64_t m0 = 0;
  for (; m0 + QP <= M; m0 += QP) pv_block<NV, QP>(acc, st, mp, alpha, vt, rows, n_rows, m0);
  for (; m0 < M; ++m0) pv_block<NV, 1>(acc, st, mp, alpha, vt, rows, n_rows, m0);
}

// Marks the queries l0 + i of the lanes i set in bad (see Work::bad).
inline void note_bad(Work& w, int64_t l0, __mmask16 bad) {
  for (int i = 0; bad && i < 16; ++i)
    if (bad & (1u << i)) w.bad[static_cast<size_t>(l0 + i)] = 1;
}

// One tile of nt full-precision rows (keys/values already in w.kt / w.vt for the n_vis visible
// rows w.vis, positions in w.pos) against every query of the item.
// every: each of the nt rows is visible to every query of the item.
void many_tile(Work& w, int64_t nt, int64_t n_vis, bool every, int64_t window) {
  const int64_t M = w.m, d = w.d, mp = w.mp, n_groups = mp / 16;
  float* st = w.st.data();
  // ---- logits st[t][m] for the 8-row blocks that hold rows < nt
  for (int64_t r0 = 0; r0 < nt; r0 += 8) {
    const float* kt = w.kt.data() + r0 * d;
    float* s = st + r0 * mp;
    int64_t g = 0;
    for (; g + 3 <= n_groups; g += 3) qk_block<3>(w.qt.data(), mp, kt, d, s, g);
    if (n_groups - g == 2) qk_block<2>(w.qt.data(), mp, kt, d, s, g);
    if (n_groups - g == 1) qk_block<1>(w.qt.data(), mp, kt, d, s, g);
  }
  // ---- masks and the online softmax, 16 queries per step
  alignas(64) uint8_t row_vis[kTile] = {};
  for (int64_t vi = 0; vi < n_vis; ++vi) row_vis[w.vis[static_cast<size_t>(vi)]] = 1;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i win = _mm512_set1_epi32(
      static_cast<int32_t>(std::min<int64_t>(window, std::numeric_limits<int32_t>::max())));
  for (int64_t g = 0; g < n_groups; ++g) {
    const int64_t l0 = g * 16;
    const __mmask16 lanes =
        M - l0 >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (M - l0)) - 1u);
    const __m512i qp = _mm512_loadu_si512(w.qpos32.data() + l0);
    __m512 tmax = neg_inf;
    const __m512 pos_inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    __mmask16 bad = 0;               // lanes with a NaN or +inf logit of a visible row
    if (every && lanes == 0xFFFF) {  // nothing to mask: the tile's max only
      for (int64_t t = 0; t < nt; ++t) {
        const __m512 x = _mm512_loadu_ps(st + t * mp + l0);
        bad |= _mm512_cmp_ps_mask(x, pos_inf, _CMP_NLT_UQ);
        tmax = _mm512_max_ps(tmax, x);
      }
    } else {
      for (int64_t t = 0; t < nt; ++t) {
        float* s = st + t * mp + l0;
        __mmask16 m = 0;
        if (row_vis[t]) {
          const __m512i pt = _mm512_set1_epi32(w.pos[static_cast<size_t>(t)]);
          m = _mm512_mask_cmp_epi32_mask(lanes, pt, qp, _MM_CMPINT_LE);  // pos_t <= q_pos
          if (window > 0)  // q_pos - pos_t < window (the difference is >= 0 on these lanes)
            m = _mm512_mask_cmp_epi32_mask(m, _mm512_sub_epi32(qp, pt), win, _MM_CMPINT_LT);
        }
        const __m512 x = _mm512_mask_blend_ps(m, neg_inf, _mm512_loadu_ps(s));
        _mm512_storeu_ps(s, x);
        bad |= _mm512_cmp_ps_mask(x, pos_inf, _CMP_NLT_UQ);
        tmax = _mm512_max_ps(tmax, x);
      }
    }
    note_bad(w, l0, bad & lanes);
    __m512 mx = _mm512_loadu_ps(w.mx.data() + l0);
    const __mmask16 up = _mm512_cmp_ps_mask(tmax, mx, _CMP_GT_OQ);
    // Rescale where the max rises over a finite one: std::exp per lane as the general path.
    const __mmask16 resc = _mm512_mask_cmp_ps_mask(up & lanes, mx, neg_inf, _CMP_NEQ_OQ);
    alignas(64) float al[16];
    _mm512_store_ps(al, _mm512_set1_ps(1.0f));
    alignas(64) float mxa[16], tma[16];
    _mm512_store_ps(mxa, mx);
    _mm512_store_ps(tma, tmax);
    rescale_lanes(w, l0, resc, mxa, tma, al, false);  // packed accumulators of earlier segments
    const __m512 alpha = _mm512_load_ps(al);
    _mm512_storeu_ps(w.alpha.data() + l0, alpha);
    mx = _mm512_mask_blend_ps(up, mx, tmax);
    _mm512_storeu_ps(w.mx.data() + l0, mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < nt; ++t) {  // -inf (masked) - mx, or -inf - -inf = NaN, give 0
      float* s = st + t * mp + l0;
      const __m512 p = exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(s), mx));
      _mm512_storeu_ps(s, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(w.l.data() + l0,
                     _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(w.l.data() + l0), alpha), sum));
  }
  // ---- acc[m] = acc[m] * alpha_m + sum over visible rows of p v
  const float* a = w.alpha.data();
  with_vecs(d / 16, [&](auto nv) {
    pv_all<decltype(nv)::value>(w.acc.data(), st, mp, a, w.vt.data(), w.vis.data(), n_vis, M);
  });
}
#endif

#if defined(__AVX512F__)
// ---- many-query path over packed rows: lanes over queries, the general path's arithmetic -----
//
// Prefill-sized calls over packed segments (SKVQ's quantized rows), D a multiple of 32 up to 128:
// a tile's rows meet 16 queries per vector, with the operations of the general path per query:
//  * logit: the 16 lane partial sums of dot_many (an fmadd chain over the D / 16 blocks) are 16
//    vectors over queries here, added in _mm512_reduce_add_ps's tree (i + 8, i + 4, i + 2,
//    i + 1), then + lo_g * qsum_g for g in order;
//  * softmax: the loop's max per query, std::exp rescale where the max rises (rescale()),
//    exp_nonpos's operations (exp_nonpos16_exact), the weights summed over the rows in order;
//  * acc' += p (c s) as accumulate_tile (an fmadd chain over the visible rows per channel) and
//    acc_lo[g] += dot(p, lo_g) with dot's 16-lane split and sequential lane sum.
// So every logit, weight and accumulator is bit-identical to the general path's (not the weights'
// sum l: softmax_tile sums in lanes on AVX-512, a different order within the same bound).

// dot_many's logit of row k for the 16 queries at qt (qt[c * mp + lane]).
template <int NV>
inline __m512 dot_lanes(const float* __restrict qt, int64_t mp, const float* __restrict k) {
  __m512 s1[8];
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      a = _mm512_fmadd_ps(_mm512_loadu_ps(qt + (16 * j + l) * mp), _mm512_set1_ps(k[16 * j + l]),
                          a);
      b = _mm512_fmadd_ps(_mm512_loadu_ps(qt + (16 * j + l + 8) * mp),
                          _mm512_set1_ps(k[16 * j + l + 8]), b);
    }
    s1[l] = _mm512_add_ps(b, a);  // lane l + 8 and lane l
  }
  __m512 s2[4];
#pragma GCC unroll 4
  for (int l = 0; l < 4; ++l) s2[l] = _mm512_add_ps(s1[l + 4], s1[l]);
  const __m512 s30 = _mm512_add_ps(s2[2], s2[0]), s31 = _mm512_add_ps(s2[3], s2[1]);
  return _mm512_add_ps(s30, s31);
}

// One tile of nt packed rows (keys and values unpacked in w.kt / w.vt, offsets in w.klo / w.vlo
// as [group][kTile], zeros for hidden rows) against every query of the item.
template <int NV>
void many_packed_tile(Work& w, KeyClass& kc, ValClass& vc, int64_t nt, int64_t n_vis, bool every,
                      int64_t window) {
  const int64_t M = w.m, d = NV * 16, mp = w.mp, n_lg = mp / 16;
  const int32_t kg = kc.n_groups, vg = vc.n_groups;
  float* st = w.st.data();
  alignas(64) uint8_t row_vis[kTile] = {};
  for (int64_t vi = 0; vi < n_vis; ++vi) row_vis[w.vis[static_cast<size_t>(vi)]] = 1;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // ---- logits st[t][m]: hidden rows -inf
  // (query groups outside: a group's transposed queries, D x 64 bytes, stay in L1 over the rows)
  for (int64_t g = 0; g < n_lg; ++g)
    for (int64_t t = 0; t < nt; ++t) {
      float* s = st + t * mp;
      if (!row_vis[t]) {
        _mm512_storeu_ps(s + g * 16, neg_inf);
        continue;
      }
      const float* kt = w.kt.data() + t * d;
      __m512 l = dot_lanes<NV>(kc.qt.data() + g * 16, mp, kt);
      for (int32_t gi = 0; gi < kg; ++gi)
        l = _mm512_add_ps(l,
                          _mm512_mul_ps(_mm512_set1_ps(w.klo[static_cast<size_t>(gi * kTile + t)]),
                                        _mm512_loadu_ps(kc.qst.data() + gi * mp + g * 16)));
      _mm512_storeu_ps(s + g * 16, l);
    }
  // ---- masks, online softmax, 16 queries per step
  const __m512i win = _mm512_set1_epi32(
      static_cast<int32_t>(std::min<int64_t>(window, std::numeric_limits<int32_t>::max())));
  for (int64_t g = 0; g < n_lg; ++g) {
    const int64_t l0 = g * 16;
    const __mmask16 lanes =
        M - l0 >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (M - l0)) - 1u);
    const __m512i qp = _mm512_loadu_si512(w.qpos32.data() + l0);
    __m512 tmax = neg_inf;
    const __m512 pos_inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    __mmask16 bad = 0;  // lanes with a NaN or +inf logit of a visible row
    for (int64_t t = 0; t < nt; ++t) {
      float* s = st + t * mp + l0;
      __m512 x = _mm512_loadu_ps(s);
      if (!every && row_vis[t]) {  // per-query causal / window test of a visible row
        const __m512i pt = _mm512_set1_epi32(w.pos[static_cast<size_t>(t)]);
        __mmask16 m = _mm512_cmp_epi32_mask(pt, qp, _MM_CMPINT_LE);  // pos_t <= q_pos
        if (window > 0)
          m = _mm512_mask_cmp_epi32_mask(m, _mm512_sub_epi32(qp, pt), win, _MM_CMPINT_LT);
        x = _mm512_mask_blend_ps(m, neg_inf, x);
        _mm512_storeu_ps(s, x);
      }
      bad |= _mm512_cmp_ps_mask(x, pos_inf, _CMP_NLT_UQ);
      tmax = _mm512_max_ps(x, tmax);  // x > tmax ? x : tmax, as the general path's loop
    }
    note_bad(w, l0, bad & lanes);
    __m512 mx = _mm512_loadu_ps(w.mx.data() + l0);
    const __mmask16 up = _mm512_cmp_ps_mask(tmax, mx, _CMP_GT_OQ);
    const __mmask16 resc = _mm512_mask_cmp_ps_mask(up & lanes, mx, neg_inf, _CMP_NEQ_OQ);
    if (resc) {
      alignas(64) float mxa[16], tma[16];
      _mm512_store_ps(mxa, mx);
      _mm512_store_ps(tma, tmax);
      for (int i = 0; i < 16; ++i)
        if (resc & (1u << i)) rescale(w, l0 + i, std::exp(mxa[i] - tma[i]));
    }
    mx = _mm512_mask_blend_ps(up, mx, tmax);
    _mm512_storeu_ps(w.mx.data() + l0, mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < nt; ++t) {  // -inf - mx (or -inf - -inf = NaN) gives 0
      float* s = st + t * mp + l0;
      const __m512 p = simd::exp_nonpos16_exact(_mm512_sub_ps(_mm512_loadu_ps(s), mx));
      _mm512_storeu_ps(s, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(w.l.data() + l0, _mm512_add_ps(_mm512_loadu_ps(w.l.data() + l0), sum));
    // ---- acc_lo[m][gv] += dot(p[m], lo_gv, nt): 16 lane sums over steps of 16 rows, then the
    // rows past the last full step, then the 16 lane sums in order
    alignas(64) float res[16];
    for (int32_t gv = 0; gv < vg; ++gv) {
      const float* lo = w.vlo.data() + gv * kTile;
      __m512 a[16];
      for (int l = 0; l < 16; ++l) a[l] = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= nt; i += 16)
        for (int l = 0; l < 16; ++l)
          a[l] = _mm512_add_ps(a[l], _mm512_mul_ps(_mm512_loadu_ps(st + (i + l) * mp + l0),
                                                   _mm512_set1_ps(lo[i + l])));
      __m512 sv = _mm512_setzero_ps();
      for (; i < nt; ++i)
        sv = _mm512_add_ps(sv,
                           _mm512_mul_ps(_mm512_loadu_ps(st + i * mp + l0), _mm512_set1_ps(lo[i])));
      for (int l = 0; l < 16; ++l) sv = _mm512_add_ps(sv, a[l]);
      _mm512_store_ps(res, sv);
      for (int64_t li = 0; li < 16 && l0 + li < M; ++li)
        vc.acc_lo[static_cast<size_t>((l0 + li) * vg + gv)] += res[li];
    }
  }
  // ---- acc'[m] += sum over visible rows of p v (alpha 1: the rescales were applied above)
  std::fill(w.alpha.begin(), w.alpha.end(), 1.0f);
  pv_all<NV>(vc.acc.data(), st, mp, w.alpha.data(), w.vt.data(), w.vis.data(), n_vis, M);
}

void many_packed_dispatch(Work& w, KeyClass& kc, ValClass& vc, int64_t nt, int64_t n_vis,
                          bool every, int64_t window) {
  with_even_vecs(w.d / 16, [&](auto nv) {
    many_packed_tile<decltype(nv)::value>(w, kc, vc, nt, n_vis, every, window);
  });
}

// ---- few-query path: full-precision rows read in place (fp16/bf16/fp32), no fp32 tile -------
//
// For calls with fewer than kManyQueries queries per head (decode), full-precision segments with
// contiguous rows and D a multiple of 32 up to 128 skip the row-by-row conversion to fp32 tiles:
// keys and values are converted in registers (vcvtph2ps) as the dot products and the value
// accumulation read them. The arithmetic is the general path's, operation for operation:
//  * logit m of row t: one 16-lane accumulator, fmadd over the D / 16 blocks in order, then the
//    horizontal sum of _mm512_reduce_add_ps (lanes i + 8, then i + 4, i + 2, i + 1). Sixteen
//    rows are reduced together by a transposed tree (qk_16rows) that adds the same pairs of
//    partial sums, so every logit is bit-identical to dot_many's (fp32 addition commutes).
//  * acc[m] += p[m][t] v_t: an fmadd per channel over the visible rows in order (as
//    accumulate_tile's 64- and 32-channel blocks), the accumulators in registers over the tile.
// Converting fp16/bf16 to fp32 is exact, so reading the rows in place changes nothing.
constexpr int64_t kFewBlock = 16;  // rows per transposed reduction

bool few_supported(const ViewSegment& seg, int64_t d) {
  return d % 32 == 0 && d <= 128 && seg.keys.stride[3] == 1 && seg.values.stride[3] == 1 &&
         seg.keys.dtype == seg.values.dtype;
}

template <DType T>
inline __m512 load_row16(const char* row, int64_t i) {
  if constexpr (T == DType::kF32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (T == DType::kBF16) {
    const __m256i raw = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(row) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(row) + i)));
  }
}

// lg[q][s] = q_q . k_s for the QB queries qm[q] and the rows s < n (<= 16) at krow0 + s * ks
// (rows past n repeat row n - 1; their sums are not stored). Row s's 16 lane sums a_s are
// folded with their neighbours as they are produced: pairs of rows -> lanes i + (i + 8),
// quadruples -> i + (i + 4), then i + (i + 2) and i + (i + 1) across the four quadruples. The
// tree leaves row s in lane 4 (s % 4) + s / 4, put back in order by one permute.
template <DType T, int QB, int NV>
inline void qk_16rows(const float* const* qm, const char* krow0, int64_t ks, int64_t n,
                      float* const* lg) {
  __m512 c[QB][4];
#pragma GCC unroll 16
  for (int r = 0; r < 4; ++r) {
    __m512 bq[QB][2];
#pragma GCC unroll 16
    for (int h = 0; h < 2; ++h) {
      __m512 a[QB][2];
#pragma GCC unroll 16
      for (int e = 0; e < 2; ++e) {
        const int64_t s = std::min<int64_t>(4 * r + 2 * h + e, n - 1);
        const char* krow = krow0 + s * ks;
#pragma GCC unroll 16
        for (int q = 0; q < QB; ++q) a[q][e] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) {
          const __m512 x = load_row16<T>(krow, 16 * j);
#pragma GCC unroll 4
          for (int q = 0; q < QB; ++q)
            a[q][e] = _mm512_fmadd_ps(_mm512_loadu_ps(qm[q] + 16 * j), x, a[q][e]);
        }
      }
#pragma GCC unroll 16
      for (int q = 0; q < QB; ++q)  // lanes 0-7: row 2p's i + (i + 8); lanes 8-15: row 2p + 1's
        bq[q][h] = _mm512_add_ps(_mm512_shuffle_f32x4(a[q][0], a[q][1], 0x44),
                                 _mm512_shuffle_f32x4(a[q][0], a[q][1], 0xEE));
    }
#pragma GCC unroll 16
    for (int q = 0; q < QB; ++q)  // 128-bit lane k: row 4r + k's i + (i + 4), i < 4
      c[q][r] = _mm512_add_ps(_mm512_shuffle_f32x4(bq[q][0], bq[q][1], 0x88),
                              _mm512_shuffle_f32x4(bq[q][0], bq[q][1], 0xDD));
  }
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __mmask16 keep = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1u);
#pragma GCC unroll 16
  for (int q = 0; q < QB; ++q) {
    // lane k: rows k and k + 4 (c0, c1) / k + 8 and k + 12 (c2, c3), elements i + (i + 2)
    const __m512d c0 = _mm512_castps_pd(c[q][0]), c1 = _mm512_castps_pd(c[q][1]);
    const __m512d c2 = _mm512_castps_pd(c[q][2]), c3 = _mm512_castps_pd(c[q][3]);
    const __m512 d0 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c0, c1)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(c0, c1)));
    const __m512 d1 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c2, c3)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(c2, c3)));
    const __m512 sums =
        _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x88), _mm512_shuffle_ps(d0, d1, 0xDD));
    _mm512_mask_storeu_ps(lg[q], keep, _mm512_permutexvar_ps(order, sums));
  }
}

// w.logits[m][t] for every query m and row t < nt of the tile starting at row j0.
template <DType T, int NV>
void few_logits(Work& w, const float* qs, const char* k0, int64_t ks, int64_t nt) {
  const int64_t M = w.m, d = NV * 16;
  for (int64_t s0 = 0; s0 < nt; s0 += kFewBlock) {
    const int64_t n = std::min(kFewBlock, nt - s0);
    const char* kr = k0 + s0 * ks;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const float* qm[4];
      float* lg[4];
      const int64_t qb = std::min<int64_t>(4, M - m0);
      for (int64_t q = 0; q < qb; ++q) {
        qm[q] = qs + (m0 + q) * d;
        lg[q] = w.logits.data() + (m0 + q) * kTile + s0;
      }
      switch (qb) {
        case 1:
          qk_16rows<T, 1, NV>(qm, kr, ks, n, lg);
          break;
        case 2:
          qk_16rows<T, 2, NV>(qm, kr, ks, n, lg);
          break;
        case 3:
          qk_16rows<T, 3, NV>(qm, kr, ks, n, lg);
          break;
        default:
          qk_16rows<T, 4, NV>(qm, kr, ks, n, lg);
          break;
      }
    }
  }
}

// acc[m] += sum over the listed rows t of probs[m][t] * v_t for the QP queries m0 .. m0 + QP,
// NV = D / 16 vectors per row, rows at v0 + t * vs.
template <DType T, int NV, int QP>
inline void pv_rows(float* __restrict acc, const float* __restrict probs, const char* v0,
                    int64_t vs, const int32_t* rows, int64_t n_rows, int64_t m0) {
  constexpr int64_t d = NV * 16;
  __m512 a[QP][NV];
#pragma GCC unroll 16
  for (int i = 0; i < QP; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) a[i][j] = _mm512_loadu_ps(acc + (m0 + i) * d + 16 * j);
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t t = rows[r];
    const char* vr = v0 + t * vs;
    __m512 vv[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) vv[j] = load_row16<T>(vr, 16 * j);
#pragma GCC unroll 16
    for (int i = 0; i < QP; ++i) {
      const __m512 pb = _mm512_set1_ps(probs[(m0 + i) * kTile + t]);
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) a[i][j] = _mm512_fmadd_ps(pb, vv[j], a[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < QP; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + (m0 + i) * d + 16 * j, a[i][j]);
}

template <DType T, int NV>
void pv_few(float* acc, const float* probs, const char* v0, int64_t vs, const int32_t* rows,
            int64_t n_rows, int64_t M) {
  constexpr int QP = NV <= 2 ? 8 : NV <= 4 ? 4 : 2;  // <= 16 accumulators
  int64_t m0 = 0;
  for (; m0 + QP <= M; m0 += QP) pv_rows<T, NV, QP>(acc, probs, v0, vs, rows, n_rows, m0);
  switch (M - m0) {  // the rest in one pass (fewer than QP queries)
    case 0:
      break;
    case 1:
      pv_rows<T, NV, 1>(acc, probs, v0, vs, rows, n_rows, m0);
      break;
    case 2:
      pv_rows<T, NV, 2>(acc, probs, v0, vs, rows, n_rows, m0);
      break;
    case 3:
      pv_rows<T, NV, 3>(acc, probs, v0, vs, rows, n_rows, m0);
      break;
    default:
      for (; m0 < M; ++m0) pv_rows<T, NV, 1>(acc, probs, v0, vs, rows, n_rows, m0);
      break;
  }
}

// acc[m] += sum over the tile's visible rows of w.probs[m][t] v_t, rows at v0 + t * vs.
template <DType T>
void few_values(Work& w, float* acc, const char* v0, int64_t vs, int64_t n_vis) {
  const int32_t* rows = w.vis.data();
  const float* pr = w.probs.data();
  with_even_vecs(w.d / 16, [&](auto nv) {
    pv_few<T, decltype(nv)::value>(acc, pr, v0, vs, rows, n_vis, w.m);
  });
}

// Logits of the rows at k0 + t * ks (t < nt) for the queries qs [M, D].
template <DType T>
void few_logits_d(Work& w, const float* qs, const char* k0, int64_t ks, int64_t nt) {
  with_even_vecs(w.d / 16, [&](auto nv) { few_logits<T, decltype(nv)::value>(w, qs, k0, ks, nt); });
}

// Calls f(std::integral_constant<DType, T>{}) for the row dtype t (f16, bf16 or f32).
template <typename F>
void with_row_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kF16:
      f(std::integral_constant<DType, DType::kF16>{});
      return;
    case DType::kBF16:
      f(std::integral_constant<DType, DType::kBF16>{});
      return;
    case DType::kF32:
      f(std::integral_constant<DType, DType::kF32>{});
      return;
  }
}

void few_tile_logits(Work& w, const ViewSegment& seg, int64_t b, int64_t kh, int64_t j0,
                     int64_t nt) {
  const char* k0 = static_cast<const char*>(seg.keys.row(b, kh, j0));
  const int64_t ks = seg.keys.stride[2] * static_cast<int64_t>(dtype_size(seg.keys.dtype));
  with_row_dtype(seg.keys.dtype,
                 [&](auto t) { few_logits_d<decltype(t)::value>(w, w.q.data(), k0, ks, nt); });
}

void few_tile_values(Work& w, const ViewSegment& seg, int64_t b, int64_t kh, int64_t j0,
                     int64_t n_vis) {
  const char* v0 = static_cast<const char*>(seg.values.row(b, kh, j0));
  const int64_t vs = seg.values.stride[2] * static_cast<int64_t>(dtype_size(seg.values.dtype));
  with_row_dtype(seg.values.dtype,
                 [&](auto t) { few_values<decltype(t)::value>(w, w.acc.data(), v0, vs, n_vis); });
}
#endif

// PackedTensor of segment rows for head h: perm/signs offset to head h.
PackedTensor head_tensor(const PackedTensor& t, int64_t h, int64_t d) {
  PackedTensor r = t;
  if (r.perm) r.perm += h * d;
  if (r.signs) r.signs += h * d;
  return r;
}

void check(const TensorView& q, const CacheView& view, const AttentionParams& p, const float* out) {
  VQ_CHECK(
      view.batch >= 1 && view.n_kv_heads >= 1 && view.head_dim >= 1,
      "[attention] expected a view with B, H_kv, D >= 1 but got B=" + std::to_string(view.batch) +
          ", H_kv=" + std::to_string(view.n_kv_heads) + ", D=" + std::to_string(view.head_dim));
  VQ_CHECK(
      q.shape[0] == view.batch && q.shape[1] >= 1 && q.shape[2] >= 0 && q.shape[3] == view.head_dim,
      "[attention] expected q [" + std::to_string(view.batch) + ", H_q, N, " +
          std::to_string(view.head_dim) + "] but got [" + std::to_string(q.shape[0]) + ", " +
          std::to_string(q.shape[1]) + ", " + std::to_string(q.shape[2]) + ", " +
          std::to_string(q.shape[3]) + "]");
  VQ_CHECK(q.shape[1] % view.n_kv_heads == 0,
           "[attention] expected H_q a multiple of H_kv = " + std::to_string(view.n_kv_heads) +
               " but got H_q = " + std::to_string(q.shape[1]));
  VQ_CHECK(q.numel() == 0 || (q.data != nullptr && out != nullptr),
           "[attention] expected q data and an output buffer but got a null pointer");
  VQ_CHECK(p.window >= 0, "[attention] expected window >= 0 but got " + std::to_string(p.window));
  for (size_t s = 0; s < view.segments.size(); ++s) {
    const ViewSegment& seg = view.segments[s];
    VQ_CHECK(seg.n_rows >= 0, "[attention] expected segment rows >= 0");
    if (seg.n_rows == 0) continue;
    if (seg.packed) {
      const PackedSegment& ps = *seg.packed;
      VQ_CHECK(ps.batch == view.batch && ps.n_heads == view.n_kv_heads && ps.n_rows == seg.n_rows &&
                   ps.head_dim == view.head_dim && ps.keys.fmt.head_dim == view.head_dim &&
                   ps.values.fmt.head_dim == view.head_dim && ps.keys.data && ps.values.data,
               "[attention] expected packed segment " + std::to_string(s) +
                   " to match the view's [B, H_kv, n, D]");
    } else {
      const std::array<int64_t, 4> want{view.batch, view.n_kv_heads, seg.n_rows, view.head_dim};
      VQ_CHECK(
          seg.keys.shape == want && seg.values.shape == want && seg.keys.data && seg.values.data,
          "[attention] expected segment " + std::to_string(s) +
              " keys/values of shape [B, H_kv, n_rows, D] with data");
    }
  }
}

// ---- one work item: shared bookkeeping, the paths, and the driver -----------------------------
//
// A work item walks the view's segments in order. Per segment, choose_path picks ONE of the
// paths below; per tile of kTile rows, visible_rows does the position / causal / window
// bookkeeping every path shares, then the chosen path updates the item's online-softmax state
// (Work: mx, l, the accumulators) with the tile's visible rows.

// One segment's rows as one work item (batch b, KV head kh) sees them.
struct SegmentCtx {
  const ViewSegment* seg = nullptr;
  int64_t b = 0, kh = 0, window = 0;
  bool packed = false;
  PackedTensor pk, pv;          // packed: keys / values bound to head kh
  KeyClass* kc = nullptr;       // packed: the queries in the keys' channel order
  ValClass* vc = nullptr;       // packed: the value accumulators in the values' channel order
  int32_t kg = 0, vg = 0;       // packed: groups per key / value row
  const float* qsrc = nullptr;  // the queries in the keys' channel order
  detail::PackedKernel kk, vk;  // packed decode: the kernels (packed_decode.h)
  const void* prep = nullptr;   // packed decode: the key kernel's prepared queries
};

// One tile: rows j0 .. j0 + nt of the segment; w.vis[0 .. n_vis) are the rows visible to some
// query of the item, w.pos their positions; every: each visible row is visible to every query.
struct TileRows {
  int64_t j0 = 0, nt = 0, n_vis = 0;
  bool every = true;
};

// Work::logits of the visible rows a query may not see (causal / window) set to -inf.
void mask_logits(Work& w, const TileRows& t, int64_t window) {
  if (t.every) return;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t m = 0; m < w.m; ++m) {
    const int64_t qp = w.qpos[static_cast<size_t>(m)];
    for (int64_t vi = 0; vi < t.n_vis; ++vi) {
      const int64_t r = w.vis[static_cast<size_t>(vi)];
      const int64_t pj = w.pos[static_cast<size_t>(r)];
      if (pj > qp || (window > 0 && qp >= pj + window))
        w.logits[static_cast<size_t>(m * kTile + r)] = neg_inf;
    }
  }
}

// Online-softmax update from the tile's logits [M, kTile] (hidden rows -inf): running max (the
// accumulators rescaled when it grows), the weights into Work::probs, and their sums into l.
#if defined(__AVX512F__)
// AVX-512: a query's (at most 32) logits in two vectors; the max as the scalar loop's (NaN
// lanes only matter to a query flagged bad, whose output is NaN), the weights from exp_nonpos16
// (exp_nonpos's polynomial with FMAs, 1.41 u at most as the scalar's), their sum as rows t and
// t + 16 added into 16 lane partials that run over the item's tiles (Work::lv, scaled by rescale
// as l is), summed once when the item ends (fold_lanes). The sum stays a tree over the item's
// weights (zero lanes add exactly), so a weight still passes at most n - 1 roundings, within the
// bound's (n + n_tiles + 8) u, as the scalar path's row-order sum.
static_assert(kTile == 32, "softmax_tile holds a tile in two 16-lane vectors");
void softmax_tile(Work& w, int64_t nt) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 pinf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __mmask16 k0 = static_cast<__mmask16>(nt >= 16 ? 0xFFFFu : (1u << nt) - 1u);
  const __mmask16 k1 = static_cast<__mmask16>(nt > 16 ? (1u << (nt - 16)) - 1u : 0u);
  for (int64_t m = 0; m < w.m; ++m) {
    const float* lr = w.logits.data() + m * kTile;
    float* pr = w.probs.data() + m * kTile;
    // full loads and stores where the masks are full (a masked store's data is not forwarded to
    // a later load: the kernels' loads of these weights would wait for it to reach the cache)
    const __m512 v0 = k0 == 0xFFFF ? _mm512_loadu_ps(lr) : _mm512_mask_loadu_ps(ninf, k0, lr);
    const __m512 v1 =
        k1 == 0xFFFF ? _mm512_loadu_ps(lr + 16) : _mm512_mask_loadu_ps(ninf, k1, lr + 16);
    // a visible row's logit is NaN or +inf (hidden rows hold -inf)
    if ((_mm512_cmp_ps_mask(v0, pinf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(v1, pinf, _CMP_NLT_UQ)) !=
        0)
      w.bad[static_cast<size_t>(m)] = 1;
    // The tile's max is reduced across lanes only when a lane exceeds the running max (rare
    // once the max has settled); the result is the same max. A tile of hidden rows before any
    // visible one (max -inf) gets weights exp(NaN) = 0, as the zeros it was given before.
    const __m512 vm = _mm512_max_ps(v0, v1);
    float& mxm = w.mx[static_cast<size_t>(m)];
    if (_mm512_cmp_ps_mask(vm, _mm512_set1_ps(mxm), _CMP_GT_OQ) != 0) {
      const float tmax = _mm512_reduce_max_ps(vm);
      if (mxm != -std::numeric_limits<float>::infinity()) rescale(w, m, std::exp(mxm - tmax));
      mxm = tmax;
    }
    const __m512 mv = _mm512_set1_ps(mxm);  // -inf - mx stays -inf -> weight 0
    const __m512 p0 = exp_nonpos16(_mm512_sub_ps(v0, mv));
    const __m512 p1 = exp_nonpos16(_mm512_sub_ps(v1, mv));
    if (k0 == 0xFFFF)
      _mm512_storeu_ps(pr, p0);
    else
      _mm512_mask_storeu_ps(pr, k0, p0);
    if (k1 == 0xFFFF)
      _mm512_storeu_ps(pr + 16, p1);
    else
      _mm512_mask_storeu_ps(pr + 16, k1, p1);
    float* lv = w.lv.data() + m * 16;
    _mm512_storeu_ps(lv, _mm512_add_ps(_mm512_loadu_ps(lv), _mm512_add_ps(p0, p1)));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp(x) for x <= 0 on 8 AVX2 lanes (x < -87, -inf and NaN give 0): exp_nonpos16's reduction and
// polynomial with FMAs, 2^k built from its exponent bits (k in [-126, 0] after the clamp, a
// normal number, so q 2^k is the one rounding scalef would make). Within the same 3 u bound.
inline __m256 exp_nonpos8(__m256 v) {
  const __m256 lim = _mm256_set1_ps(-87.0f);
  const __m256 ok = _mm256_cmp_ps(v, lim, _CMP_GE_OQ);
  v = _mm256_max_ps(v, lim);  // NaN -> lim (the second operand), masked off below
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 q = _mm256_set1_ps(1.9875691500E-4f);
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.3981999507E-3f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(8.3334519073E-3f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(4.1665795894E-2f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.6666665459E-1f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(5.0000001201E-1f));
  q = _mm256_add_ps(_mm256_fmadd_ps(q, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i two_k =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(q, _mm256_castsi256_ps(two_k)), ok);
}

// AVX2: the AVX-512 version's steps with a query's (at most 32) logits in four 8-lane vectors
// (lanes past nt read as -inf, weight 0); the weights' sum as (p0 + p1) + (p2 + p3) added into
// lanes 0-7 of Work::lv (lanes 8-15 stay zero): a tree over the item's weights, as there.
static_assert(kTile == 32, "softmax_tile holds a tile in four 8-lane vectors");
void softmax_tile(Work& w, int64_t nt) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 pinf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i keep[4];
  for (int j = 0; j < 4; ++j)
    keep[j] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nt - 8 * j)), iota);
  for (int64_t m = 0; m < w.m; ++m) {
    const float* lr = w.logits.data() + m * kTile;
    float* pr = w.probs.data() + m * kTile;
    __m256 v[4];
    int bad = 0;
    for (int j = 0; j < 4; ++j) {
      v[j] = nt >= 8 * (j + 1) ? _mm256_loadu_ps(lr + 8 * j)
                               : _mm256_blendv_ps(ninf, _mm256_maskload_ps(lr + 8 * j, keep[j]),
                                                  _mm256_castsi256_ps(keep[j]));
      bad |= _mm256_movemask_ps(_mm256_cmp_ps(v[j], pinf, _CMP_NLT_UQ));
    }
    if (bad != 0) w.bad[static_cast<size_t>(m)] = 1;
    const __m256 vm = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
    float& mxm = w.mx[static_cast<size_t>(m)];
    if (_mm256_movemask_ps(_mm256_cmp_ps(vm, _mm256_set1_ps(mxm), _CMP_GT_OQ)) != 0) {
      __m128 x = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
      x = _mm_max_ps(x, _mm_movehl_ps(x, x));
      x = _mm_max_ss(x, _mm_movehdup_ps(x));
      const float tmax = _mm_cvtss_f32(x);
      if (mxm != -std::numeric_limits<float>::infinity()) rescale(w, m, std::exp(mxm - tmax));
      mxm = tmax;
    }
    const __m256 mv = _mm256_set1_ps(mxm);  // -inf - mx stays -inf -> weight 0
    __m256 p[4];
    for (int j = 0; j < 4; ++j) {
      p[j] = exp_nonpos8(_mm256_sub_ps(v[j], mv));
      if (nt >= 8 * (j + 1))
        _mm256_storeu_ps(pr + 8 * j, p[j]);
      else
        _mm256_maskstore_ps(pr + 8 * j, keep[j], p[j]);
    }
    float* lv = w.lv.data() + m * 16;
    _mm256_storeu_ps(
        lv, _mm256_add_ps(_mm256_loadu_ps(lv),
                          _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]))));
  }
}
#else
void softmax_tile(Work& w, int64_t nt) {
  const int64_t M = w.m;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t m = 0; m < M; ++m) {
    const float* lr = w.logits.data() + m * kTile;
    float* pr = w.probs.data() + m * kTile;
    float tmax = neg_inf;
    bool bad = false;  // a visible row's logit is NaN or +inf (hidden rows hold -inf)
    for (int64_t t = 0; t < nt; ++t) {
      tmax = lr[t] > tmax ? lr[t] : tmax;
      bad |= !(lr[t] < std::numeric_limits<float>::infinity());
    }
    if (bad) w.bad[static_cast<size_t>(m)] = 1;
    if (tmax == neg_inf) {
      std::fill(pr, pr + nt, 0.0f);
      continue;
    }
    float& mxm = w.mx[static_cast<size_t>(m)];
    if (tmax > mxm) {
      if (mxm != neg_inf) rescale(w, m, std::exp(mxm - tmax));
      mxm = tmax;
    }
    for (int64_t t = 0; t < nt; ++t) pr[t] = lr[t] - mxm;  // -inf stays -inf -> weight 0
    exp_nonpos(pr, pr, nt);
  }
  // Each query's weights summed over t in order, four queries' sums interleaved (their
  // dependency chains overlap). A query whose tile is all hidden adds zeros: l + 0 = l.
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const float* pr[4];
    for (int64_t j = 0; j < 4; ++j) pr[j] = w.probs.data() + std::min(m0 + j, M - 1) * kTile;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t t = 0; t < nt; ++t)
      for (int j = 0; j < 4; ++j) sum[j] += pr[j][t];
    for (int64_t j = 0; j < 4 && m0 + j < M; ++j) w.l[static_cast<size_t>(m0 + j)] += sum[j];
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// ---- many-query path on AVX2: full-precision rows, lanes over queries -----------------------
//
// The AVX-512 many_tile's plan and arithmetic with 8 query lanes per vector: each logit is the
// sequential fp32 FMA sum over the D channels from zero (6 rows x 16 queries per register block),
// the masks, the running max and the rescale per lane as there, the weights from exp_nonpos8,
// and acc[m] = acc[m] * alpha_m + the visible rows' p v in row order (6 queries x 16 channels
// per block). Each query's arithmetic is independent of its lane mates and of the item's query
// block, so GQA equals MHA with repeated heads here too; it is the AVX-512 path's sequence of
// operations (no test compares the two: no machine runs both builds).

// st[r][lanes of the 8-lane groups g0 .. g0 + QB) = kt[r] . qt for the R rows r of kt.
// (qk_block8 and pv_block8 are always inlined: GCC 12 kept their accumulator arrays on the
// stack when it compiled them on their own, and prefill at 8K tokens ran 25 % slower.)
template <int R, int QB>
__attribute__((always_inline)) inline void qk_block8(const float* __restrict qt, int64_t mp,
                                                     const float* __restrict kt, int64_t d,
                                                     float* __restrict st, int64_t g0) {
  __m256 acc[R][QB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < QB; ++j) acc[r][j] = _mm256_setzero_ps();
  const float* qg = qt + g0 * 8;
  for (int64_t c = 0; c < d; ++c) {
    __m256 qv[QB];
    for (int j = 0; j < QB; ++j) qv[j] = _mm256_loadu_ps(qg + c * mp + 8 * j);
    for (int r = 0; r < R; ++r) {
      const __m256 kb = _mm256_broadcast_ss(kt + r * d + c);
      for (int j = 0; j < QB; ++j) acc[r][j] = _mm256_fmadd_ps(kb, qv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < QB; ++j) _mm256_storeu_ps(st + r * mp + (g0 + j) * 8, acc[r][j]);
}

// acc[m][c0, c0 + 8 NC) = acc * alpha[m] + sum over the listed rows t of st[t][m] * vt[t] for
// the QP queries m0 .. m0 + QP.
template <int NC, int QP>
__attribute__((always_inline)) inline void pv_block8(float* __restrict acc,
                                                     const float* __restrict st, int64_t mp,
                                                     const float* __restrict alpha,
                                                     const float* __restrict vt, int64_t d,
                                                     int64_t c0, const int32_t* rows,
                                                     int64_t n_rows, int64_t m0) {
  __m256 a[QP][NC];
  for (int i = 0; i < QP; ++i) {
    const __m256 al = _mm256_set1_ps(alpha[m0 + i]);
    for (int j = 0; j < NC; ++j)
      a[i][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + (m0 + i) * d + c0 + 8 * j), al);
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* v = vt + rows[r] * d + c0;
    const float* p = st + rows[r] * mp + m0;
    __m256 vv[NC];
    for (int j = 0; j < NC; ++j) vv[j] = _mm256_loadu_ps(v + 8 * j);
#pragma GCC unroll 8
    for (int i = 0; i < QP; ++i) {
      const __m256 pb = _mm256_broadcast_ss(p + i);
#pragma GCC unroll 4
      for (int j = 0; j < NC; ++j) a[i][j] = _mm256_fmadd_ps(pb, vv[j], a[i][j]);
    }
  }
  for (int i = 0; i < QP; ++i)
    for (int j = 0; j < NC; ++j) _mm256_storeu_ps(acc + (m0 + i) * d + c0 + 8 * j, a[i][j]);
}

template <int NC>
void pv_chunk8(float* acc, const float* st, int64_t mp, const float* alpha, const float* vt,
               int64_t d, int64_t c0, const int32_t* rows, int64_t n_rows, int64_t M) {
  int64_t m0 = 0;
  for (; m0 + 6 <= M; m0 += 6) pv_block8<NC, 6>(acc, st, mp, alpha, vt, d, c0, rows, n_rows, m0);
  for (; m0 + 2 <= M; m0 += 2) pv_block8<NC, 2>(acc, st, mp, alpha, vt, d, c0, rows, n_rows, m0);
  if (m0 < M) pv_block8<NC, 1>(acc, st, mp, alpha, vt, d, c0, rows, n_rows, m0);
}

// qk_block8 over every 8-lane group of the queries qt for the R rows of kt from row r0.
template <int R>
void qk_rows8(const float* qt, int64_t mp, const float* kt, int64_t d, int64_t r0, float* st) {
  const int64_t n_groups = mp / 8;
  kt += r0 * d;
  st += r0 * mp;
  int64_t g = 0;
  for (; g + 2 <= n_groups; g += 2) qk_block8<R, 2>(qt, mp, kt, d, st, g);
  if (g < n_groups) qk_block8<R, 1>(qt, mp, kt, d, st, g);
}

// Logits st[t][m] = kt[t] . q_m for the blocks of 6 rows (the tile's last 2 rows: one block of
// 2) that hold rows < nt.
void qk_tile8(const float* qt, int64_t mp, const float* kt, int64_t d, int64_t nt, float* st) {
  static_assert(kTile == 32, "qk_tile8 takes 5 blocks of 6 rows and one of 2");
  for (int64_t r0 = 0; r0 < nt; r0 += 6) {
    if (r0 + 6 <= kTile)
      qk_rows8<6>(qt, mp, kt, d, r0, st);
    else
      qk_rows8<2>(qt, mp, kt, d, r0, st);
  }
}

// The tile's masks and online-softmax step, 8 queries per step: logits of hidden rows (and of
// rows a query may not see) set to -inf, the running max, each query's rescale factor into
// w.alpha (std::exp where the max rises over a finite one, else 1), applied here to the packed
// accumulators (and, with scale_acc, to the full-precision ones; else the caller's pv_chunk8
// applies it) and to l; the weights into st and their sum (in row order) added to l. every:
// every visible row is seen by every query (TileRows::every); the masks are skipped only when
// the tile also leaves no row out (left-out rows' slots hold stale data).
void softmax_lanes8(Work& w, int64_t nt, int64_t n_vis, bool every, int64_t window,
                    bool scale_acc) {
  every = every && n_vis == nt;
  const int64_t M = w.m, mp = w.mp, n_groups = mp / 8;
  float* st = w.st.data();
  alignas(32) uint8_t row_vis[kTile] = {};
  for (int64_t vi = 0; vi < n_vis; ++vi) row_vis[w.vis[static_cast<size_t>(vi)]] = 1;
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 pos_inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256i win = _mm256_set1_epi32(
      static_cast<int32_t>(std::min<int64_t>(window, std::numeric_limits<int32_t>::max())));
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t g = 0; g < n_groups; ++g) {
    const int64_t l0 = g * 8;
    const __m256i lanes = _mm256_cmpgt_epi32(
        _mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(M - l0, 8))), iota);
    const int lane_bits = _mm256_movemask_ps(_mm256_castsi256_ps(lanes));
    const __m256i qp = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qpos32.data() + l0));
    __m256 tmax = neg_inf;
    int bad = 0;                       // lanes with a NaN or +inf logit of a visible row
    if (every && lane_bits == 0xFF) {  // nothing to mask: the tile's max only
      for (int64_t t = 0; t < nt; ++t) {
        const __m256 x = _mm256_loadu_ps(st + t * mp + l0);
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(x, pos_inf, _CMP_NLT_UQ));
        tmax = _mm256_max_ps(tmax, x);
      }
    } else {
      for (int64_t t = 0; t < nt; ++t) {
        float* s = st + t * mp + l0;
        __m256i m = _mm256_setzero_si256();
        if (row_vis[t]) {
          const __m256i pt = _mm256_set1_epi32(w.pos[static_cast<size_t>(t)]);
          m = _mm256_andnot_si256(_mm256_cmpgt_epi32(pt, qp), lanes);  // pos_t <= q_pos
          if (window > 0)  // q_pos - pos_t < window (the difference is >= 0 on these lanes)
            m = _mm256_and_si256(m, _mm256_cmpgt_epi32(win, _mm256_sub_epi32(qp, pt)));
        }
        const __m256 x = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s), _mm256_castsi256_ps(m));
        _mm256_storeu_ps(s, x);
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(x, pos_inf, _CMP_NLT_UQ));
        tmax = _mm256_max_ps(tmax, x);
      }
    }
    bad &= lane_bits;
    for (int i = 0; bad != 0 && i < 8; ++i)
      if (bad & (1 << i)) w.bad[static_cast<size_t>(l0 + i)] = 1;
    __m256 mx = _mm256_loadu_ps(w.mx.data() + l0);
    const __m256 up = _mm256_cmp_ps(tmax, mx, _CMP_GT_OQ);
    // Rescale where the max rises over a finite one: std::exp per lane as the general path.
    const int resc =
        _mm256_movemask_ps(_mm256_and_ps(up, _mm256_cmp_ps(mx, neg_inf, _CMP_NEQ_OQ))) & lane_bits;
    alignas(32) float al[8], mxa[8], tma[8];
    _mm256_store_ps(al, _mm256_set1_ps(1.0f));
    _mm256_store_ps(mxa, mx);
    _mm256_store_ps(tma, tmax);
    rescale_lanes(w, l0, static_cast<uint32_t>(resc), mxa, tma, al, scale_acc);
    const __m256 alpha = _mm256_load_ps(al);
    _mm256_storeu_ps(w.alpha.data() + l0, alpha);
    mx = _mm256_blendv_ps(mx, tmax, up);
    _mm256_storeu_ps(w.mx.data() + l0, mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < nt; ++t) {  // -inf (masked) - mx, or -inf - -inf = NaN, give 0
      float* s = st + t * mp + l0;
      const __m256 p = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(s), mx));
      _mm256_storeu_ps(s, p);
      sum = _mm256_add_ps(sum, p);
    }
    _mm256_storeu_ps(w.l.data() + l0,
                     _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(w.l.data() + l0), alpha), sum));
  }
}

// acc[m] = acc[m] * alpha_m + sum over the visible rows of st[t][m] vt[t], 16 channels per pass.
void pv_tile8(Work& w, float* acc, int64_t n_vis) {
  const int64_t d = w.d;
  for (int64_t c0 = 0; c0 < d; c0 += 16)  // d is a multiple of 16 (many_supported)
    pv_chunk8<2>(acc, w.st.data(), w.mp, w.alpha.data(), w.vt.data(), d, c0, w.vis.data(), n_vis,
                 w.m);
}

// One tile of nt full-precision rows (w.kt / w.vt hold the n_vis visible rows w.vis, positions
// in w.pos) against every query of the item; every: each of the nt rows is visible to every
// query of the item.
void many_tile(Work& w, int64_t nt, int64_t n_vis, bool every, int64_t window) {
  qk_tile8(w.qt.data(), w.mp, w.kt.data(), w.d, nt, w.st.data());
  softmax_lanes8(w, nt, n_vis, every, window, false);
  pv_tile8(w, w.acc.data(), n_vis);
}

// One tile of nt packed rows (keys and values unpacked to c s in w.kt / w.vt, offsets in w.klo /
// w.vlo as [group][kTile], zeros for hidden rows) against every query of the item, as
// many_tile with the packed path's terms: logit = (q' . c s) + (sum_g lo_g qsum_g) (the offsets'
// terms an fmadd chain over the groups in order, added once: a term of either sum passes at most
// D + 2 or n_groups + 1 roundings after its own, inside the fused bound's D + 8),
// acc_lo[m][g] += sum_t p_t lo_g,t (an fmadd chain over the tile's rows in order) and
// acc'[m] += sum_t p_t (c s)_t, after the rescale (alpha applied in softmax_lanes8).
void many_packed_tile(Work& w, KeyClass& kc, ValClass& vc, int64_t nt, int64_t n_vis, bool every,
                      int64_t window) {
  const int64_t M = w.m, mp = w.mp, n_groups = mp / 8;
  const int32_t kg = kc.n_groups, vg = vc.n_groups;
  float* st = w.st.data();
  qk_tile8(kc.qt.data(), mp, w.kt.data(), w.d, nt, st);
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t g = 0; g < n_groups; ++g) {
      const float* lo = w.klo.data() + t;
      const float* qs = kc.qst.data() + 8 * g;
      __m256 b = _mm256_mul_ps(_mm256_set1_ps(lo[0]), _mm256_loadu_ps(qs));
      for (int32_t gi = 1; gi < kg; ++gi)
        b = _mm256_fmadd_ps(_mm256_set1_ps(lo[gi * kTile]), _mm256_loadu_ps(qs + gi * mp), b);
      float* s = st + t * mp + 8 * g;
      _mm256_storeu_ps(s, _mm256_add_ps(_mm256_loadu_ps(s), b));
    }
  softmax_lanes8(w, nt, n_vis, every, window, true);
  alignas(32) float res[8];
  for (int64_t g = 0; g < n_groups; ++g) {
    const int64_t l0 = g * 8;
    for (int32_t gv = 0; gv < vg; ++gv) {
      const float* lo = w.vlo.data() + gv * kTile;
      __m256 a = _mm256_setzero_ps();
      for (int64_t t = 0; t < nt; ++t)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(st + t * mp + l0), _mm256_set1_ps(lo[t]), a);
      _mm256_store_ps(res, a);
      for (int64_t li = 0; li < 8 && l0 + li < M; ++li)
        vc.acc_lo[static_cast<size_t>((l0 + li) * vg + gv)] += res[li];
    }
  }
  std::fill(w.alpha.begin(), w.alpha.end(), 1.0f);  // the rescale is applied above
  pv_tile8(w, vc.acc.data(), n_vis);
}

void many_packed_dispatch(Work& w, KeyClass& kc, ValClass& vc, int64_t nt, int64_t n_vis,
                          bool every, int64_t window) {
  many_packed_tile(w, kc, vc, nt, n_vis, every, window);
}
#endif

// Logits of every query and listed row set to -inf (the paths then fill the visible ones).
void clear_logits(Work& w, int64_t nt) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t m = 0; m < w.m; ++m)
    std::fill(w.logits.begin() + m * kTile, w.logits.begin() + m * kTile + nt, neg_inf);
}

// Full-precision row j of a [B, H_kv, n, D] tensor as fp32 into dst.
void fp_row(const TensorView& x, int64_t b, int64_t kh, int64_t j, float* dst, int64_t d) {
  if (x.stride[3] == 1)
    row_to_f32(x.row(b, kh, j), x.dtype, dst, d);
  else
    for (int64_t c = 0; c < d; ++c) dst[c] = x.at(b, kh, j, c);
}

// Packed row j of t unpacked (scaled codes) into dst, its group offsets into column r of the
// transposed [n_groups, kTile] table lo.
void packed_row(Work& w, const PackedTensor& t, int64_t b, int64_t kh, int64_t j, int64_t r,
                float* dst, std::vector<float>& lo) {
  unpack_scaled(t.record(b, kh, j), t.fmt, dst, w.tmp.data());
  for (int32_t g = 0; g < t.fmt.n_groups; ++g) lo[static_cast<size_t>(g * kTile + r)] = w.tmp[g];
}

// Row r of the tile (segment row j) of the segment's keys (key) or values as fp32 into dst:
// converted (full precision) or unpacked, its offsets into w.klo / w.vlo (packed).
void tile_row(Work& w, const SegmentCtx& s, bool key, int64_t j, int64_t r, float* dst) {
  if (s.packed)
    packed_row(w, key ? s.pk : s.pv, s.b, s.kh, j, r, dst, key ? w.klo : w.vlo);
  else
    fp_row(key ? s.seg->keys : s.seg->values, s.b, s.kh, j, dst, w.d);
}

// Offsets of rows a tile skips must be finite zeros (the lo terms read every row).
void clear_hidden_offsets(Work& w, const TileRows& t) {
  if (t.n_vis == t.nt) return;
  std::fill(w.klo.begin(), w.klo.end(), 0.0f);
  std::fill(w.vlo.begin(), w.vlo.end(), 0.0f);
}

using AttendFn = void (*)(Work& w, const SegmentCtx& s, const TileRows& t);

// General path (any ISA, any D, full-precision or packed rows): the visible rows converted or
// unpacked to fp32 tiles, logits by dot_many, values by accumulate_tile.
void attend_general(Work& w, const SegmentCtx& s, const TileRows& t) {
  const int64_t M = w.m, d = w.d;
  if (s.packed) clear_hidden_offsets(w, t);
  clear_logits(w, t.nt);
  for (int64_t vi = 0; vi < t.n_vis; ++vi) {
    const int64_t r = w.vis[static_cast<size_t>(vi)];
    float* kt = w.kt.data() + r * d;
    tile_row(w, s, true, t.j0 + r, r, kt);
    dot_many(s.qsrc, M, kt, d, w.dots.data());
    for (int64_t m = 0; m < M; ++m)
      w.logits[static_cast<size_t>(m * kTile + r)] = w.dots[static_cast<size_t>(m)];
  }
  if (s.packed)  // + sum_g lo_g * qsum_g, vectorised over the tile's rows
    for (int64_t m = 0; m < M; ++m) {
      float* lr = w.logits.data() + m * kTile;
      const float* qs = s.kc->qsum.data() + m * s.kg;
      for (int32_t g = 0; g < s.kg; ++g) {
        const float* lo = w.klo.data() + g * kTile;
        for (int64_t r = 0; r < t.nt; ++r) lr[r] += lo[r] * qs[g];
      }
    }
  mask_logits(w, t, s.window);
  softmax_tile(w, t.nt);
  for (int64_t vi = 0; vi < t.n_vis; ++vi) {
    const int64_t r = w.vis[static_cast<size_t>(vi)];
    tile_row(w, s, false, t.j0 + r, r, w.vt.data() + r * d);
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* pr = w.probs.data() + m * kTile;
    float* acc = s.packed ? s.vc->acc.data() + m * d : w.acc.data() + m * d;
    accumulate_tile(acc, pr, w.vt.data(), w.vis.data(), t.n_vis, d);
    if (s.packed) {
      float* al = s.vc->acc_lo.data() + m * s.vg;
      for (int32_t g = 0; g < s.vg; ++g) al[g] += dot(pr, w.vlo.data() + g * kTile, t.nt);
    }
  }
}

// Channel-axis keys (skvq_key_axis=channel, one segment = one chunk, packed.h): with the
// chunk's per-channel (lo_c, s_c) folded into the query once per segment (begin_segment:
// w.qch = q' * s, w.qbias = sum_c q'_c lo_c), a row's logit is w.qch . c_t + w.qbias, read from
// its codes alone. Values (per token) as the packed decode path (its kernels) or, for
// prefill-sized calls, as the general path.
void attend_channel(Work& w, const SegmentCtx& s, const TileRows& t) {
  const int64_t M = w.m, d = w.d;
  clear_hidden_offsets(w, t);
  clear_logits(w, t.nt);
  for (int64_t vi = 0; vi < t.n_vis; ++vi) {
    const int64_t r = w.vis[static_cast<size_t>(vi)];
    float* kt = w.kt.data() + r * d;
    unpack_codes_f32(s.pk.record(s.b, s.kh, t.j0 + r), s.pk.fmt, kt);
    dot_many(w.qch.data(), M, kt, d, w.dots.data());
    for (int64_t m = 0; m < M; ++m)
      w.logits[static_cast<size_t>(m * kTile + r)] =
          w.dots[static_cast<size_t>(m)] + w.qbias[static_cast<size_t>(m)];
  }
  mask_logits(w, t, s.window);
  softmax_tile(w, t.nt);
  if (s.vk.values) {
    const detail::PackedTile vals{s.pv.record(s.b, s.kh, t.j0), s.pv.fmt.row_stride, w.vis.data(),
                                  t.n_vis};
    s.vk.values(s.pv.fmt, vals, w.probs.data(), kTile, M, s.vc->acc.data(), s.vc->acc_lo.data(),
                w.pscratch.data());
    return;
  }
  for (int64_t vi = 0; vi < t.n_vis; ++vi) {
    const int64_t r = w.vis[static_cast<size_t>(vi)];
    tile_row(w, s, false, t.j0 + r, r, w.vt.data() + r * d);
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* pr = w.probs.data() + m * kTile;
    accumulate_tile(s.vc->acc.data() + m * d, pr, w.vt.data(), w.vis.data(), t.n_vis, d);
    float* al = s.vc->acc_lo.data() + m * s.vg;
    for (int32_t g = 0; g < s.vg; ++g) al[g] += dot(pr, w.vlo.data() + g * kTile, t.nt);
  }
}

// Packed decode path: logits and value sums computed on the codes by the segment's kernels
// (packed_decode.h), the online softmax here.
void attend_packed_decode(Work& w, const SegmentCtx& s, const TileRows& t) {
  clear_logits(w, t.nt);
  const detail::PackedTile keys{s.pk.record(s.b, s.kh, t.j0), s.pk.fmt.row_stride, w.vis.data(),
                                t.n_vis};
  s.kk.keys(s.pk.fmt, keys, s.qsrc, s.kc->qsum.data(), w.m, w.logits.data(), kTile, s.prep);
  mask_logits(w, t, s.window);
  softmax_tile(w, t.nt);
  const detail::PackedTile vals{s.pv.record(s.b, s.kh, t.j0), s.pv.fmt.row_stride, w.vis.data(),
                                t.n_vis};
  s.vk.values(s.pv.fmt, vals, w.probs.data(), kTile, w.m, s.vc->acc.data(), s.vc->acc_lo.data(),
              w.pscratch.data());
}

#if defined(VQ_MANY_FP)
// Many-query path over full-precision rows: the visible rows to fp32 tiles, then many_tile.
void attend_fp_many(Work& w, const SegmentCtx& s, const TileRows& t) {
  const int64_t d = w.d;
  for (int64_t vi = 0; vi < t.n_vis; ++vi) {
    const int64_t r = w.vis[static_cast<size_t>(vi)];
    tile_row(w, s, true, t.j0 + r, r, w.kt.data() + r * d);
    tile_row(w, s, false, t.j0 + r, r, w.vt.data() + r * d);
  }
  many_tile(w, t.nt, t.n_vis, t.every && t.n_vis == t.nt, s.window);
}

// Many-query path over packed rows: the visible rows unpacked, then many_packed_tile.
void attend_packed_many(Work& w, const SegmentCtx& s, const TileRows& t) {
  const int64_t d = w.d;
  clear_hidden_offsets(w, t);
  if (s.kc->qt.empty()) build_class_lanes(w, *s.kc);
  for (int64_t vi = 0; vi < t.n_vis; ++vi) {
    const int64_t r = w.vis[static_cast<size_t>(vi)];
    tile_row(w, s, true, t.j0 + r, r, w.kt.data() + r * d);
    tile_row(w, s, false, t.j0 + r, r, w.vt.data() + r * d);
  }
  many_packed_dispatch(w, *s.kc, *s.vc, t.nt, t.n_vis, t.every, s.window);
}
#endif

#if defined(__AVX512F__)

// Few-query path over full-precision rows read in place: every row's logits, the hidden rows'
// set to -inf, then the values.
void attend_fp_few(Work& w, const SegmentCtx& s, const TileRows& t) {
  few_tile_logits(w, *s.seg, s.b, s.kh, t.j0, t.nt);
  if (t.n_vis < t.nt) {
    alignas(64) uint8_t shown[kTile] = {};
    for (int64_t vi = 0; vi < t.n_vis; ++vi) shown[w.vis[static_cast<size_t>(vi)]] = 1;
    for (int64_t m = 0; m < w.m; ++m)
      for (int64_t r = 0; r < t.nt; ++r)
        if (!shown[r])
          w.logits[static_cast<size_t>(m * kTile + r)] = -std::numeric_limits<float>::infinity();
  }
  mask_logits(w, t, s.window);
  softmax_tile(w, t.nt);
  few_tile_values(w, *s.seg, s.b, s.kh, t.j0, t.n_vis);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// ---- few-query path on AVX2: full-precision rows read in place ------------------------------
//
// attend_general's arithmetic without its fp32 tiles: each visible key row meets four queries at
// a time as in dot_many_lanes<Avx2Vec> (one 8-lane fmadd chain per query over the D / 8 blocks,
// then reduce4) and each value row is accumulated as in accumulate_blocks<Avx2Vec> (32 channels
// per block, an fmadd per channel over the visible rows in order), the fp16 / bf16 elements
// converted in registers as they are read. The conversions are exact, so every logit, weight and
// accumulator is the general path's, bit for bit.
bool few8_supported(const ViewSegment& seg, int64_t d) {
  return d % 32 == 0 && seg.keys.stride[3] == 1 && seg.values.stride[3] == 1;
}

template <DType T>
inline __m256 load_row8(const char* row, int64_t i) {
  if constexpr (T == DType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else {
    const __m128i raw = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(row) + i));
    if constexpr (T == DType::kBF16)
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    else
      return _mm256_cvtph_ps(raw);
  }
}

template <DType T>
void few8_logits(Work& w, const float* qs, const char* k0, int64_t ks, const TileRows& t) {
  const int64_t M = w.m, d = w.d;
  for (int64_t vi = 0; vi < t.n_vis; ++vi) {
    const int64_t r = w.vis[static_cast<size_t>(vi)];
    const char* kr = k0 + r * ks;
    for (int64_t m = 0; m < M; m += 4) {
      const float* q0 = qs + m * d;
      const float* q1 = qs + std::min(m + 1, M - 1) * d;
      const float* q2 = qs + std::min(m + 2, M - 1) * d;
      const float* q3 = qs + std::min(m + 3, M - 1) * d;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 xv = load_row8<T>(kr, i);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + i), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + i), xv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + i), xv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + i), xv, a3);
      }
      float res[4];
      reduce4(a0, a1, a2, a3, res);
      for (int64_t j = 0; j < 4 && m + j < M; ++j)
        w.logits[static_cast<size_t>((m + j) * kTile + r)] = res[j];
    }
  }
}

template <DType T>
void few8_values(Work& w, const char* v0, int64_t vs, int64_t n_vis) {
  const int64_t d = w.d;
  const int32_t* rows = w.vis.data();
  for (int64_t m = 0; m < w.m; ++m) {
    const float* p = w.probs.data() + m * kTile;
    float* acc = w.acc.data() + m * d;
    for (int64_t c = 0; c < d; c += 32) {
      __m256 a0 = _mm256_loadu_ps(acc + c), a1 = _mm256_loadu_ps(acc + c + 8);
      __m256 a2 = _mm256_loadu_ps(acc + c + 16), a3 = _mm256_loadu_ps(acc + c + 24);
      for (int64_t r = 0; r < n_vis; ++r) {
        const int64_t t = rows[r];
        const char* vr = v0 + t * vs;
        const __m256 pv = _mm256_set1_ps(p[t]);
        a0 = _mm256_fmadd_ps(pv, load_row8<T>(vr, c), a0);
        a1 = _mm256_fmadd_ps(pv, load_row8<T>(vr, c + 8), a1);
        a2 = _mm256_fmadd_ps(pv, load_row8<T>(vr, c + 16), a2);
        a3 = _mm256_fmadd_ps(pv, load_row8<T>(vr, c + 24), a3);
      }
      _mm256_storeu_ps(acc + c, a0);
      _mm256_storeu_ps(acc + c + 8, a1);
      _mm256_storeu_ps(acc + c + 16, a2);
      _mm256_storeu_ps(acc + c + 24, a3);
    }
  }
}

template <DType T>
void few8_tile(Work& w, const SegmentCtx& s, const TileRows& t) {
  const ViewSegment& seg = *s.seg;
  const char* k0 = static_cast<const char*>(seg.keys.row(s.b, s.kh, t.j0));
  const int64_t ks = seg.keys.stride[2] * static_cast<int64_t>(dtype_size(seg.keys.dtype));
  const char* v0 = static_cast<const char*>(seg.values.row(s.b, s.kh, t.j0));
  const int64_t vs = seg.values.stride[2] * static_cast<int64_t>(dtype_size(seg.values.dtype));
  clear_logits(w, t.nt);
  few8_logits<T>(w, w.q.data(), k0, ks, t);
  mask_logits(w, t, s.window);
  softmax_tile(w, t.nt);
  few8_values<T>(w, v0, vs, t.n_vis);
}

// One instantiation per row dtype: begin_segment takes this path only where a segment's keys
// and values share their dtype (else the general path).
void attend_fp_few8(Work& w, const SegmentCtx& s, const TileRows& t) {
  switch (s.seg->keys.dtype) {
    case DType::kF16:
      return few8_tile<DType::kF16>(w, s, t);
    case DType::kBF16:
      return few8_tile<DType::kBF16>(w, s, t);
    case DType::kF32:
      return few8_tile<DType::kF32>(w, s, t);
  }
}
#endif

// Binds segment seg to head kh of batch b and sets up what its path needs (the packed
// transform classes, the packed decode kernels and their prepared queries); returns the path,
// chosen once for the whole segment. many: a prefill-sized call (see run_item).
AttendFn begin_segment(Work& w, const ViewSegment& seg, int64_t b, int64_t kh, int64_t window,
                       bool many, detail::CpuIsa isa, SegmentCtx& s) {
  const int64_t d = w.d, M = w.m;
  s.seg = &seg;
  s.b = b;
  s.kh = kh;
  s.window = window;
  s.packed = seg.packed != nullptr;
  if (s.packed) {
    s.pk = head_tensor(seg.packed->keys, kh, d);
    s.pv = head_tensor(seg.packed->values, kh, d);
    s.kc = &key_class(w, s.pk);
    s.vc = &val_class(w, s.pv);
    s.kg = s.pk.fmt.n_groups;
    s.vg = s.pv.fmt.n_groups;
  }
  w.klo.assign(static_cast<size_t>(kTile * std::max(s.kg, 1)), 0.0f);
  w.vlo.assign(static_cast<size_t>(kTile * std::max(s.vg, 1)), 0.0f);
  w.tmp.resize(static_cast<size_t>(std::max<int64_t>({d, s.kg, s.vg})));
  s.qsrc = s.packed ? s.kc->q.data() : w.q.data();
  if (s.packed && s.pk.fmt.axis == QuantAxis::kChannel) {
    // The chunk's per-channel metadata folded into the queries (fp32: one rounding per product,
    // the offsets' sum in channel order).
    // One chunk per segment: the CPU backend's layout (a one-run view lists several, for the
    // CUDA attention: decode_attention_channel.cu).
    VQ_CHECK(s.pk.runs == nullptr || s.pk.n_runs == 1,
             "[attention] expected one chunk per channel-axis key segment (the CPU layout) but "
             "got a segment of " +
                 std::to_string(s.pk.n_runs) + " runs");
    const uint8_t* chunk0 = s.pk.record(b, kh, 0);
    const int64_t st = s.pk.fmt.row_stride;
    w.qch.resize(static_cast<size_t>(M * d));
    w.qbias.assign(static_cast<size_t>(M), 0.0f);
    for (int64_t c = 0; c < d; ++c) {
      const float lo = channel_meta(chunk0, st, s.pk.fmt, 2 * c);
      const float sc = channel_meta(chunk0, st, s.pk.fmt, 2 * c + 1);
      for (int64_t m = 0; m < M; ++m) {
        const float qc = s.qsrc[m * d + c];
        w.qch[static_cast<size_t>(m * d + c)] = qc * sc;
        w.qbias[static_cast<size_t>(m)] += qc * lo;
      }
    }
    s.vk = many ? detail::PackedKernel{} : detail::packed_kernel(s.pv.fmt, isa);
    if (s.vk.values) w.pscratch.resize(static_cast<size_t>(detail::packed_values_scratch(s.vg, M)));
    return attend_channel;
  }
#if defined(__AVX512F__)
  if (!s.packed) {
    if (many) return attend_fp_many;
    return few_supported(seg, d) ? attend_fp_few : attend_general;
  }
  if (many) return d % 32 == 0 ? attend_packed_many : attend_general;
#else
  if (!s.packed) {
#if defined(__AVX2__) && defined(__FMA__)
    if (many && many_supported(d)) return attend_fp_many;  // run_item built the lanes
    if (!many && few8_supported(seg, d) && seg.keys.dtype == seg.values.dtype)
      return attend_fp_few8;
#endif
    return attend_general;
  }
#if defined(__AVX2__) && defined(__FMA__)
  if (many && many_supported(d)) return attend_packed_many;
#endif
#endif
  s.kk = detail::packed_kernel(s.pk.fmt, isa);
  // Prefill-sized calls keep fp32 queries (they are held to the general path's bound, not the
  // int8 one): AVX2's int8 key kernel gives way to its fp32 one there.
  if (many && s.kk.int8_query) s.kk = detail::packed_kernel_avx2(s.pk.fmt);
  s.vk = detail::packed_kernel(s.pv.fmt, isa);
  if (s.kk.keys == nullptr || s.vk.values == nullptr) return attend_general;
  w.pscratch.resize(static_cast<size_t>(detail::packed_values_scratch(s.vg, M)));
  if (s.kk.prepare) {  // the queries in the key kernel's form, once per class and format
    KeyClass& kc = *s.kc;
    if (kc.prep_fn != s.kk.prepare || std::memcmp(&kc.prep_fmt, &s.pk.fmt, sizeof(s.pk.fmt)) != 0) {
      kc.qprep.resize(static_cast<size_t>((s.kk.prep_bytes(s.pk.fmt, M) + 7) / 8));
      s.kk.prepare(s.pk.fmt, s.qsrc, kc.qsum.data(), M, kc.qprep.data());
      kc.prep_fn = s.kk.prepare;
      kc.prep_fmt = s.pk.fmt;
    }
    s.prep = kc.qprep.data();
  }
  return attend_packed_decode;
}

// The next segment's set-up taken from the previous one's: when both are packed rows on the
// packed decode path with the same key and value formats and transforms (perm / signs), only the
// records are re-bound; the key and value classes, kernels and prepared queries stay (the same
// bits as begin_segment). SKVQ's CPU store lists one segment per flushed chunk (128 rows by
// default, all alike), so a decode step walks many such segments per head. Returns false, s
// untouched, when seg needs its own begin_segment.
bool rebind_packed_decode(const ViewSegment& seg, int64_t kh, int64_t d, AttendFn prev,
                          SegmentCtx& s) {
  if (prev != attend_packed_decode || seg.packed == nullptr) return false;
  const PackedTensor pk = head_tensor(seg.packed->keys, kh, d);
  const PackedTensor pv = head_tensor(seg.packed->values, kh, d);
  const auto same = [](const PackedTensor& a, const PackedTensor& b) {
    return a.perm == b.perm && a.signs == b.signs && a.rot_block == b.rot_block &&
           std::memcmp(&a.fmt, &b.fmt, sizeof(a.fmt)) == 0;
  };
  if (!same(pk, s.pk) || !same(pv, s.pv)) return false;
  s.seg = &seg;
  s.pk = pk;
  s.pv = pv;
  return true;
}

// Rows j0 .. j0 + nt of seg (nt <= kTile, j0 + nt <= end): their positions into w.pos, the ones
// some query with a position in [qpos_min, qpos_max] can see (causal, window) into w.vis; rows
// none can see are skipped.
TileRows visible_rows(Work& w, const ViewSegment& seg, int64_t b, int64_t kh, int64_t n_hkv,
                      int64_t j0, int64_t end, int64_t window, int64_t qpos_min, int64_t qpos_max) {
  TileRows t;
  t.j0 = j0;
  t.nt = std::min(kTile, end - j0);
  const int64_t nt = t.nt;
  int64_t n_vis = 0;
  bool every = true;     // every listed row is visible to every query of the item
  if (!seg.positions) {  // consecutive positions p0 + t: the visible rows are one run
    const int64_t p0 = seg.first_pos + j0;
    for (int64_t r = 0; r < nt; ++r) w.pos[static_cast<size_t>(r)] = static_cast<int32_t>(p0 + r);
    // visible: p0 + r <= qpos_max and (no window or qpos_min < p0 + r + window)
    const int64_t lo = window == 0 ? 0 : std::max<int64_t>(0, qpos_min - window + 1 - p0);
    const int64_t hi = std::min(nt, qpos_max - p0 + 1);
    for (int64_t r = lo; r < hi; ++r) w.vis[static_cast<size_t>(n_vis++)] = static_cast<int32_t>(r);
    // every visible row also <= qpos_min and within the window of qpos_max
    every = n_vis == 0 || (p0 + hi - 1 <= qpos_min && (window == 0 || qpos_max < p0 + lo + window));
  }
  for (int64_t r = 0; r < nt && seg.positions; ++r) {
    const int64_t pj = seg.position(b, kh, j0 + r, n_hkv);
    w.pos[static_cast<size_t>(r)] = static_cast<int32_t>(pj);
    if (pj <= qpos_max && (window == 0 || qpos_min < pj + window)) {
      w.vis[static_cast<size_t>(n_vis++)] = static_cast<int32_t>(r);
      every = every && pj <= qpos_min && (window == 0 || qpos_max < pj + window);
    }
  }
  t.n_vis = n_vis;
  t.every = every;
  return t;
}

// The item's scaled queries and positions into w, its softmax state and scratch reset.
void begin_item(const TensorView& q, const AttentionParams& p, float scale, int64_t b, int64_t kh,
                int64_t n_rep, int64_t h0, int64_t h1, int64_t i0, int64_t i1, int64_t d, Work& w) {
  const int64_t nq = i1 - i0, M = (h1 - h0) * nq;
  w.m = M;
  w.d = d;
  w.q.resize(static_cast<size_t>(M * d));
  w.qpos.resize(static_cast<size_t>(M));
  for (int64_t r = h0; r < h1; ++r)
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t m = (r - h0) * nq + i;
      float* qm = w.q.data() + m * d;
      const TensorView qv = q;
      if (qv.dtype == DType::kF32 && qv.stride[3] == 1)
        std::memcpy(qm, qv.row(b, kh * n_rep + r, i0 + i), static_cast<size_t>(d) * 4);
      else
        for (int64_t c = 0; c < d; ++c) qm[c] = qv.at(b, kh * n_rep + r, i0 + i, c);
      scal(qm, scale, d);
      w.qpos[static_cast<size_t>(m)] = p.q_pos0 + i0 + i;
    }
  w.acc.assign(static_cast<size_t>(M * d), 0.0f);
  w.mx.assign(static_cast<size_t>(M), -std::numeric_limits<float>::infinity());
  w.l.assign(static_cast<size_t>(M), 0.0f);
  w.lv.assign(static_cast<size_t>(M * 16), 0.0f);
  w.bad.assign(static_cast<size_t>(M + 16), 0);
  w.kcls.clear();
  w.vcls.clear();
  w.logits.resize(static_cast<size_t>(M * kTile));
  w.probs.resize(static_cast<size_t>(M * kTile));
  w.kt.resize(static_cast<size_t>(kTile * d));
  w.vt.resize(static_cast<size_t>(kTile * d));
  w.dots.resize(static_cast<size_t>(M));
  w.tmp.resize(static_cast<size_t>(d));
  w.pos.resize(static_cast<size_t>(kTile));
  w.vis.resize(static_cast<size_t>(kTile));
}

// Query m's unnormalised output into o: the full-precision rows' sum plus each value class
// un-transformed once.
void item_sum(Work& w, int64_t m, float* o) {
  const int64_t d = w.d;
  std::copy(w.acc.begin() + m * d, w.acc.begin() + (m + 1) * d, o);
  for (ValClass& v : w.vcls) {
    float* a = v.acc.data() + m * d;
    const float* al = v.acc_lo.data() + m * v.n_groups;
    for (int64_t g = 0; g < v.n_groups; ++g)  // (the last group may be ragged)
      for (int64_t c = g * v.group_size; c < std::min(d, (g + 1) * v.group_size); ++c)
        a[c] += al[g];
    if (v.perm) {
      for (int64_t j = 0; j < d; ++j) w.tmp[static_cast<size_t>(v.perm[j])] = a[j];
      std::copy(w.tmp.begin(), w.tmp.end(), a);
    }
    if (v.signs) hadamard_unrotate(a, v.signs, d, v.rot_block);
    for (int64_t c = 0; c < d; ++c) o[c] += a[c];
  }
}

// Output row of query m = (r - h0) * nq + i of an item whose query heads start at h0 of the KV
// head's n_rep (query head kh * n_rep + r, query i0 + i).
float* out_row(const TensorView& q, float* out, int64_t b, int64_t kh, int64_t n_rep, int64_t h0,
               int64_t i0, int64_t nq, int64_t m, int64_t d) {
  const int64_t r = h0 + m / nq, i = m % nq;
  return out + ((b * q.shape[1] + kh * n_rep + r) * q.shape[2] + i0 + i) * d;
}

// The item's outputs: each value class un-transformed once and added, then normalised (NaN for
// a query that saw a NaN/+inf logit, zeros for one that saw no key).
void finish_item(const TensorView& q, int64_t b, int64_t kh, int64_t n_rep, int64_t h0, int64_t i0,
                 int64_t i1, float* out, Work& w) {
  const int64_t d = w.d, nq = i1 - i0;
  fold_lanes(w);
  for (int64_t m = 0; m < w.m; ++m) {
    float* o = out_row(q, out, b, kh, n_rep, h0, i0, nq, m, d);
    const float lm = w.l[static_cast<size_t>(m)];
    if (w.bad[static_cast<size_t>(m)]) {
      std::fill(o, o + d, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    if (lm == 0.0f) {
      std::fill(o, o + d, 0.0f);
      continue;
    }
    item_sum(w, m, o);
    scal(o, 1.0f / lm, d);
  }
}

// One part of a split item (see kSplitRows): per query [bad, max, sum, D unnormalised output].
int64_t part_floats(int64_t d) {
  return d + 3;
}
void finish_part(float* part, Work& w) {
  const int64_t d = w.d;
  fold_lanes(w);
  for (int64_t m = 0; m < w.m; ++m) {
    float* pm = part + m * part_floats(d);
    pm[0] = w.bad[static_cast<size_t>(m)] ? 1.0f : 0.0f;
    pm[1] = w.mx[static_cast<size_t>(m)];
    pm[2] = w.l[static_cast<size_t>(m)];
    if (pm[2] != 0.0f && pm[0] == 0.0f) item_sum(w, m, pm + 3);
  }
}

// The parts of one item merged in part order, as the online softmax merges tiles: with
// M = max_p mx_p, out = sum_p e_p o_p / sum_p e_p l_p, e_p = exp(mx_p - M) (std::exp). Each
// term of the value sum passes one more product (e_p) and the n_parts - 1 additions of the
// parts instead of as many of its own chain's additions (a part holds at least one row), so
// the fused bound's (n + n_tiles + 8) u covers the split (docs/design.md §4).
void merge_parts(const TensorView& q, int64_t b, int64_t kh, int64_t n_rep, int64_t i0, int64_t nq,
                 const float* parts, int64_t n_parts, int64_t stride, int64_t d, float* out) {
  for (int64_t m = 0; m < n_rep * nq; ++m) {
    float* o = out_row(q, out, b, kh, n_rep, 0, i0, nq, m, d);
    float mx = -std::numeric_limits<float>::infinity();
    bool bad = false;
    for (int64_t p = 0; p < n_parts; ++p) {
      const float* pm = parts + p * stride + m * part_floats(d);
      bad = bad || pm[0] != 0.0f;
      if (pm[2] != 0.0f) mx = std::max(mx, pm[1]);
    }
    if (bad) {
      std::fill(o, o + d, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    std::fill(o, o + d, 0.0f);
    float l = 0.0f;
    for (int64_t p = 0; p < n_parts; ++p) {
      const float* pm = parts + p * stride + m * part_floats(d);
      if (pm[2] == 0.0f) continue;  // the part saw no key of this query
      const float e = std::exp(pm[1] - mx);
      l += e * pm[2];
      for (int64_t c = 0; c < d; ++c) o[c] += e * pm[3 + c];
    }
    if (l == 0.0f) continue;  // no key at all: zeros
    scal(o, 1.0f / l, d);
  }
}

// One work item: batch b, KV head kh, queries [i0, i1) of its query heads h0 .. h1 - 1 (of the
// n_rep reading kh), the view's rows [r0, r1) (counted over its segments in order). part null:
// the outputs into out; else the item's part (finish_part) into part.
void run_item(const TensorView& q, const CacheView& view, const AttentionParams& p, float scale,
              int64_t b, int64_t kh, int64_t h0, int64_t h1, int64_t i0, int64_t i1, int64_t r0,
              int64_t r1, float* out, float* part, Work& w) {
  const int64_t d = view.head_dim, n_hkv = view.n_kv_heads, n_rep = q.shape[1] / n_hkv;
  begin_item(q, p, scale, b, kh, n_rep, h0, h1, i0, i1, d, w);
  const int64_t qpos_min = p.q_pos0 + i0, qpos_max = p.q_pos0 + i1 - 1;
  const detail::CpuIsa isa = detail::attention_isa();
  bool many = false;
#if defined(VQ_MANY_FP)
  // Decided by the call's queries per head (not the item's), so a query's arithmetic does not
  // depend on how the queries were cut into items.
  many = q.shape[2] >= kManyQueries && many_supported(d);
  if (many) build_many(w);
#endif
#if defined(__AVX512F__)
  const bool seg_many = many;
#else
  // No many-query paths over packed rows: prefill-sized calls take the decode ones there, told
  // apart by begin_segment (their packed keys keep fp32 queries, held to the general bound).
  const bool seg_many = q.shape[2] >= kManyQueries;
#endif
  int64_t base = 0;  // the segment's first row in the view
  SegmentCtx s;
  AttendFn attend = nullptr;
  for (const ViewSegment& seg : view.segments) {
    const int64_t lo = std::max<int64_t>(r0 - base, 0), hi = std::min(r1 - base, seg.n_rows);
    base += seg.n_rows;
    if (lo >= hi) continue;
    if (!rebind_packed_decode(seg, kh, d, attend, s)) {
      s = SegmentCtx{};
      attend = begin_segment(w, seg, b, kh, p.window, seg_many, isa, s);
    }
    for (int64_t j0 = lo; j0 < hi; j0 += kTile) {
      const TileRows t = visible_rows(w, seg, b, kh, n_hkv, j0, hi, p.window, qpos_min, qpos_max);
      if (t.n_vis > 0) attend(w, s, t);
    }
    // The many-query paths rescale l itself (not the lane partials): fold them first.
    if (many) fold_lanes(w);
  }
  if (part != nullptr)
    finish_part(part, w);
  else
    finish_item(q, b, kh, n_rep, h0, i0, i1, out, w);
}

}  // namespace

void attention(const TensorView& q, const CacheView& view, const AttentionParams& p, float* out) {
  check(q, view, p, out);
  const int64_t n_b = q.shape[0], n_hq = q.shape[1], n_q = q.shape[2], d = q.shape[3];
  const int64_t n_hkv = view.n_kv_heads, n_rep = n_hq / n_hkv;
  if (n_q == 0) return;
  const float scale =
      p.scale != 0.0f ? p.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  // Query blocks of near-equal size (at most kMaxQueries / n_rep queries); with causal masks
  // later blocks see more rows, so items are handed out latest block first (largest first
  // balances the threads' finishing times).
  const int64_t max_block = std::max<int64_t>(1, kMaxQueries / n_rep);
  const int64_t n_qb = (n_q + max_block - 1) / max_block;
  const int64_t q_block = (n_q + n_qb - 1) / n_qb;
  // Decode-sized calls: each item's rows in n_parts parts of part_rows rows (the last shorter),
  // so a few KV heads still spread over many threads (see kSplitRows).
  int64_t n_rows = 0;
  for (const ViewSegment& seg : view.segments) n_rows += seg.n_rows;
  const int64_t n_parts =
      n_q < kManyQueries ? std::clamp<int64_t>(n_rows / kSplitRows, 1, kMaxParts) : 1;
  const int64_t part_rows = ((n_rows + n_parts - 1) / n_parts + kTile - 1) / kTile * kTile;
  const int64_t items = n_b * n_hkv * n_qb;
  const int64_t m_all = n_rep * q_block;  // queries of an item (at most)
  // Decode-sized calls with more threads than items times parts: each (item, part) unit's query
  // heads in n_hs groups of hs (a KV head's rows read once per group), so the spare threads take
  // some. A query's arithmetic does not depend on the other queries of its unit, so the bits do
  // not depend on the thread count (FusedAttention.DecodeSplitRowsSameBitsAtAnyThreadCount).
  const int64_t slots = items * n_parts, threads = ops::pool_threads();
  const int64_t groups =
      n_q < kManyQueries && threads > slots ? std::min(n_rep, (threads + slots - 1) / slots) : 1;
  const int64_t hs = (n_rep + groups - 1) / groups, n_hs = (n_rep + hs - 1) / hs;
  std::vector<float> parts(
      n_parts > 1 ? static_cast<size_t>(items * n_parts * m_all * part_floats(d)) : 0);
  std::exception_ptr failure;
  std::mutex failure_mu;
  // Items (times parts, times head groups) on the worker pool (ops/thread_pool.h), each thread
  // with its own scratch, one at a time (items are large, and handed out largest first).
  const auto unit = [&](int64_t u) {
    thread_local Work w;
    try {
      const int64_t slot = u / n_hs, h0 = (u % n_hs) * hs, h1 = std::min(n_rep, h0 + hs);
      const int64_t it = slot / n_parts, pt = slot % n_parts;
      const int64_t qb = n_qb - 1 - it / (n_b * n_hkv), kh = it % n_hkv, b = (it / n_hkv) % n_b;
      const int64_t i0 = qb * q_block, i1 = std::min(n_q, i0 + q_block);
      const int64_t r0 = pt * part_rows, r1 = std::min(n_rows, r0 + part_rows);
      // the slot's queries m = r * nq + i; this group's from h0 * nq on
      float* part =
          n_parts > 1 ? parts.data() + (slot * m_all + h0 * (i1 - i0)) * part_floats(d) : nullptr;
      run_item(q, view, p, scale, b, kh, h0, h1, i0, i1, r0, r1, out, part, w);
    } catch (...) {
      std::lock_guard<std::mutex> lk(failure_mu);
      if (!failure) failure = std::current_exception();
    }
  };
  ops::parallel_for(slots * n_hs, unit, ops::Claim::kOne);
  if (failure) std::rethrow_exception(failure);
  if (n_parts == 1) return;
  for (int64_t it = 0; it < items; ++it) {
    const int64_t qb = n_qb - 1 - it / (n_b * n_hkv), kh = it % n_hkv, b = (it / n_hkv) % n_b;
    const int64_t i0 = qb * q_block, nq = std::min(n_q, i0 + q_block) - i0;
    merge_parts(q, b, kh, n_rep, i0, nq, parts.data() + it * n_parts * m_all * part_floats(d),
                n_parts, m_all * part_floats(d), d, out);
  }
}

DenseView dequantize_view(const CacheView& v, DType dtype) {
  DenseView dv;
  dv.view.batch = v.batch;
  dv.view.n_kv_heads = v.n_kv_heads;
  dv.view.head_dim = v.head_dim;
  const int64_t d = v.head_dim;
  std::vector<float> row(static_cast<size_t>(d));
  for (const ViewSegment& seg : v.segments) {
    if (!seg.packed) {
      dv.view.segments.push_back(seg);
      continue;
    }
    const PackedSegment& ps = *seg.packed;
    auto k = std::make_unique<Tensor>(dtype, v.batch, v.n_kv_heads, seg.n_rows, d);
    auto val = std::make_unique<Tensor>(dtype, v.batch, v.n_kv_heads, seg.n_rows, d);
    const TensorView kv = k->view(), vv = val->view();
    for (int64_t b = 0; b < v.batch; ++b)
      for (int64_t h = 0; h < v.n_kv_heads; ++h)
        for (int64_t i = 0; i < seg.n_rows; ++i) {
          dequantize_row(ps.keys, b, h, i, row.data());
          from_f32(row.data(), kv.row(b, h, i), dtype, static_cast<size_t>(d));
          dequantize_row(ps.values, b, h, i, row.data());
          from_f32(row.data(), vv.row(b, h, i), dtype, static_cast<size_t>(d));
        }
    ViewSegment out = seg;
    out.packed = nullptr;
    out.keys = kv;
    out.values = vv;
    dv.view.segments.push_back(out);
    dv.owned.push_back(std::move(k));
    dv.owned.push_back(std::move(val));
  }
  return dv;
}

}  // namespace vq
