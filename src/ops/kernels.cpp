// Matrix products, RMSNorm and SwiGLU for the forward pass (see kernels.h for the layouts).
//
// matmul has two formulations:
// - few tokens (decode; fewer than kPackedMinTokens): dot products, X and W rows both contiguous
//   along K. Each weight row is streamed front to back once for all (<= 3) tokens, converted
//   from bf16/fp16 to fp32 in registers into 4 x 16-lane accumulators per token, reduced once
//   at the end (a bandwidth-bound matrix-vector product for one token).
// - many tokens (prefill; AVX-512 builds, or AVX2 CPUs through matmul_avx2.h with 16-row panels
//   and 6 x 16 tiles): outer products on packed panels. Each thread takes
//   panels of kPanel = 32 weight rows, converts and transposes a panel's K-block into an fp32
//   buffer P[k][32] once (bf16/fp16 -> fp32 in place of a full weight copy), then sweeps every
//   token: the micro-kernel keeps MR = 12 tokens x 32 rows in 24 accumulators and adds
//   x[t][k] * P[k][0:32] per k (no horizontal sums). Each weight is read and converted once per
//   call, and a panel (<= 256 KiB) stays in L2 while all tokens pass over it.
// Units of output rows are claimed one at a time by the worker pool's threads (thread_pool.h) in
// both. Precision::kBF16 with bf16 weights (avx512_bf16 CPUs): X is first rounded to bf16 pairs
// Xp[T][Kp/2] (uint32: k even in the low half, Kp = K rounded up to 32, zero padded); the same
// two formulations then run vdpbf16ps on the raw weight bits: dot products of 32 bf16 per step
// into 4 x 16 lanes per token, or panels P[k/2][32] of weight pairs (a 16 x 16 transpose of
// 32-bit words, no conversion) swept by MR = 12 tokens x 32 rows with a broadcast x pair.
// Summation orders (for the tests' bounds): packed, each output is one fp32 chain starting at
// the bias; dot, each lane is a chain of ceil(K/32) pair steps at most, then 2 + 4 tree levels
// and the bias. Without avx512_bf16, kBF16 runs the exact kernels on bf16-rounded X.
#include "ops/kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/matmul_avx2.h"
#include "ops/thread_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm*_undefined_* helpers
// (GCC bug 105593, a false positive); silence it for this file only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include "ops/exp_nonpos16.h"
#define VQ_KERNELS_AVX512 1
#endif

namespace vq::kernels {

namespace {

constexpr int64_t kPackedMinTokens = 4;  // from this many tokens on, the packed-panel path

#if VQ_KERNELS_AVX512

constexpr int64_t kPanel = 32;     // weight rows per packed panel (two zmm)
constexpr int64_t kMR = 12;        // tokens per packed micro-kernel call
constexpr int64_t kKBlock = 2048;  // K per packed block: a panel is <= 256 KiB of fp32

template <DType WT>
inline __m512 load_w16(const void* w, int64_t i) {
  if constexpr (WT == DType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(w) + i);
  } else if constexpr (WT == DType::kBF16) {
    const __m256i raw =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    const __m256i raw =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    return _mm512_cvtph_ps(raw);
  }
}

template <DType WT>
inline __m512 load_w16_masked(const void* w, int64_t i, __mmask16 m) {
  if constexpr (WT == DType::kF32) {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(w) + i);
  } else if constexpr (WT == DType::kBF16) {
    const __m256i raw = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(w) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    const __m256i raw = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(w) + i);
    return _mm512_cvtph_ps(raw);
  }
}

// Horizontal sum of 16 lanes (written out: GCC 12 warns inside _mm512_reduce_add_ps).
inline float hsum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));  // swap 256-bit halves
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));  // swap 128-bit lanes
  __m128 x = _mm512_castps512_ps128(v);
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// y[c * ldy] = sum_k x[c * ldx + k] * wrow[k] (+ bias) for C tokens and one weight row. The row
// is streamed front to back in 64-element steps into 4 accumulators per token: one sequential
// stream per call is what the hardware prefetcher follows best (interleaving 8 rows ran 2-3x
// slower on a decode-sized working set that does not stay in cache). The summation order is
// the same for every C, so a token's result does not depend on its call-mates.
template <DType WT, int C>
inline void row_dot(const float* x, int64_t ldx, const void* wrow, int64_t k, float bias, float* y,
                    int64_t ldy) {
  __m512 acc[C][4];
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < 4; ++j) acc[c][j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = load_w16<WT>(wrow, i + 16 * j);
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < 4; ++j)
        acc[c][j] = _mm512_fmadd_ps(wv[j], _mm512_loadu_ps(x + c * ldx + i + 16 * j), acc[c][j]);
  }
  for (; i + 16 <= k; i += 16) {
    const __m512 wv = load_w16<WT>(wrow, i);
    for (int c = 0; c < C; ++c)
      acc[c][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + c * ldx + i), acc[c][0]);
  }
  if (i < k) {
    const __mmask16 m = static_cast<__mmask16>((1u << (k - i)) - 1u);
    const __m512 wv = load_w16_masked<WT>(wrow, i, m);
    for (int c = 0; c < C; ++c)
      acc[c][1] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + c * ldx + i), acc[c][1]);
  }
  for (int c = 0; c < C; ++c)
    y[c * ldy] = hsum(_mm512_add_ps(_mm512_add_ps(acc[c][0], acc[c][1]),
                                    _mm512_add_ps(acc[c][2], acc[c][3]))) +
                 bias;
}

// Rows [n0, n0 + rows) for tokens [0, n_tokens), n_tokens <= 3 (more take the packed path).
template <DType WT>
void dot_rows(const float* x, int64_t n_tokens, int64_t ldx, const void* w, int64_t k, int64_t n0,
              int64_t rows, const float* bias, float* y, int64_t ldy) {
  const size_t es = dtype_size(WT);
  for (int64_t r = n0; r < n0 + rows; ++r) {
    const void* wrow = static_cast<const char*>(w) + static_cast<size_t>(r * k) * es;
    const float b = bias ? bias[r] : 0.0f;
    detail::prefetch_row_ahead(wrow, static_cast<size_t>(k) * es);  // matmul_avx2.h
    switch (n_tokens) {
      case 1:
        row_dot<WT, 1>(x, ldx, wrow, k, b, y + r, ldy);
        break;
      case 2:
        row_dot<WT, 2>(x, ldx, wrow, k, b, y + r, ldy);
        break;
      default:
        row_dot<WT, 3>(x, ldx, wrow, k, b, y + r, ldy);
        break;
    }
  }
}

// ---- packed-panel path ----

// In-register transpose of a 16 x 16 fp32 block: r[i] (row i) becomes column i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved per 32-bit element
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + c], 128-bit lane l: rows g..g+3 of column 4l + c
    const __m512d a = _mm512_castps_pd(t[g]), b = _mm512_castps_pd(t[g + 1]);
    const __m512d c = _mm512_castps_pd(t[g + 2]), d = _mm512_castps_pd(t[g + 3]);
    u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {  // gather the four row groups' 128-bit lanes per column
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
    const __m512 v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(v0, v2, 0xdd);
    r[4 + c] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(v1, v3, 0xdd);
  }
}

// P[k][j] = W[n0 + j][k0 + k] as fp32 for j < rows (rows <= kPanel), zero for j >= rows:
// 16 rows x 16 columns at a time, converted in registers and transposed there.
template <DType WT>
void pack_panel(const void* w, int64_t k_total, int64_t n0, int64_t rows, int64_t k0, int64_t kc,
                float* P) {
  const size_t es = dtype_size(WT);
  for (int64_t jh = 0; jh < kPanel; jh += 16) {
    const int64_t vr = std::clamp<int64_t>(rows - jh, 0, 16);  // rows of this half
    const char* base = static_cast<const char*>(w) + static_cast<size_t>((n0 + jh) * k_total) * es;
    for (int64_t k = 0; k < kc; k += 16) {
      const int64_t kn = std::min<int64_t>(16, kc - k);
      const __mmask16 m = static_cast<__mmask16>(kn == 16 ? 0xFFFF : (1u << kn) - 1u);
      __m512 r[16];
      for (int64_t j = 0; j < 16; ++j) {
        const void* row = base + static_cast<size_t>(j * k_total) * es;
        r[j] = j >= vr    ? _mm512_setzero_ps()
               : kn == 16 ? load_w16<WT>(row, k0 + k)
                          : load_w16_masked<WT>(row, k0 + k, m);
      }
      transpose16(r);
      for (int64_t kk = 0; kk < kn; ++kk) _mm512_storeu_ps(P + (k + kk) * kPanel + jh, r[kk]);
    }
  }
}

// The MR x 32 accumulators of a micro-kernel: the bias (or 0) on the first K block, else the
// partial sums already in y; lanes masked off by m0 / m1 start at 0.
template <int MR>
inline void load_acc(__m512 (&acc)[MR][2], bool first, const float* bias, const float* y,
                     int64_t ldy, __mmask16 m0, __mmask16 m1) {
  for (int m = 0; m < MR; ++m) {
    if (first) {
      acc[m][0] = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
      acc[m][1] = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    } else {
      acc[m][0] = _mm512_maskz_loadu_ps(m0, y + m * ldy);
      acc[m][1] = _mm512_maskz_loadu_ps(m1, y + m * ldy + 16);
    }
  }
}

// y[m][0:32] (+)= sum_k x[m][k] * P[k][0:32] for MR tokens; lanes >= `valid` are not stored.
// first: start from the bias (or 0) instead of the partial sums already in y.
template <int MR>
void packed_micro(const float* P, int64_t kc, const float* x, int64_t ldx, float* y, int64_t ldy,
                  __mmask16 m0, __mmask16 m1, bool first, const float* bias) {
  __m512 acc[MR][2];
  load_acc<MR>(acc, first, bias, y, ldy, m0, m1);
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 w0 = _mm512_loadu_ps(P + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(P + k * kPanel + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(y + m * ldy, m0, acc[m][0]);
    _mm512_mask_storeu_ps(y + m * ldy + 16, m1, acc[m][1]);
  }
}

template <int MR>
void packed_micro_dispatch(int64_t mr, const float* P, int64_t kc, const float* x, int64_t ldx,
                           float* y, int64_t ldy, __mmask16 m0, __mmask16 m1, bool first,
                           const float* bias) {
  if constexpr (MR > 1) {
    if (mr < MR) {
      packed_micro_dispatch<MR - 1>(mr, P, kc, x, ldx, y, ldy, m0, m1, first, bias);
      return;
    }
  }
  packed_micro<MR>(P, kc, x, ldx, y, ldy, m0, m1, first, bias);
}

// One 32-row panel of output o for every token: pack K-block by K-block, sweep the tokens.
template <DType WT>
void run_panel(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const MatmulOut& o,
               int64_t n0, int64_t rows) {
  const int64_t kb = std::min(k, kKBlock);
  thread_local std::vector<float> panel_buf;
  if (panel_buf.size() < static_cast<size_t>(kb * kPanel))
    panel_buf.resize(static_cast<size_t>(kb * kPanel));
  float* P = panel_buf.data();
  const __mmask16 m0 = static_cast<__mmask16>(rows >= 16 ? 0xFFFF : (1u << rows) - 1u);
  const __mmask16 m1 = static_cast<__mmask16>(rows >= 32  ? 0xFFFF
                                              : rows > 16 ? (1u << (rows - 16)) - 1u
                                                          : 0u);
  for (int64_t k0 = 0; k0 < k; k0 += kb) {
    const int64_t kc = std::min(kb, k - k0);
    pack_panel<WT>(o.w, k, n0, rows, k0, kc, P);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += kMR)
      packed_micro_dispatch<kMR>(std::min(kMR, n_tokens - t0), P, kc, x + t0 * ldx + k0, ldx,
                                 o.y + t0 * o.ldy + n0, o.ldy, m0, m1, k0 == 0,
                                 o.bias ? o.bias + n0 : nullptr);
  }
}

// ---- bf16 dot-product path (vdpbf16ps; compiled for avx512_bf16 per function) ----

#define VQ_BF16_TARGET __attribute__((target("avx512bf16")))

constexpr int64_t kKBlockBF16 = 4096;  // K per packed block: a panel is 4096 / 2 * 128 B = 256 KiB

inline __mmask32 mask32(int64_t n) {  // the low n bits (n <= 32)
  return n >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << n) - 1u);
}

// 32 weights w[i, i + 32) (elements >= k read as zero) as 16 pairs.
inline __m512i load_w32_bf16(const uint16_t* w, int64_t i, int64_t k) {
  if (i + 32 <= k) return _mm512_loadu_si512(w + i);
  return _mm512_maskz_loadu_epi16(mask32(k - i), w + i);
}

VQ_BF16_TARGET inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// Rows [t0, t1) of X rounded into Xp[t][Kp / 2] (Kp multiple of 32; zero beyond k).
VQ_BF16_TARGET void round_rows_bf16(const float* x, int64_t k, int64_t ldx, int64_t t0, int64_t t1,
                                    uint32_t* xp, int64_t kp) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* xr = x + t * ldx;
    uint32_t* out = xp + t * (kp / 2);
    for (int64_t i = 0; i < kp; i += 32) {
      const __mmask16 m0 = static_cast<__mmask16>(mask32(std::clamp<int64_t>(k - i, 0, 16)));
      const __mmask16 m1 = static_cast<__mmask16>(mask32(std::clamp<int64_t>(k - i - 16, 0, 16)));
      const __m512 lo = _mm512_maskz_loadu_ps(m0, xr + i);
      const __m512 hi = _mm512_maskz_loadu_ps(m1, xr + i + 16);
      _mm512_storeu_si512(out + i / 2, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

VQ_BF16_TARGET void round_bf16_vec(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
                                     _mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i))));
  for (; i < n; i += 16) {
    const __mmask16 m = static_cast<__mmask16>(mask32(std::min<int64_t>(16, n - i)));
    const __m256i r =
        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i)));
    _mm256_mask_storeu_epi16(out + i, m, r);
  }
}

// y[c * ldy] = sum over k of Xp[c] . wrow (+ bias) for C tokens and one weight row: 128 weights
// per step into 4 accumulators per token, then 32 per step into the first one.
template <int C>
VQ_BF16_TARGET void row_dot_bf16(const uint32_t* xp, int64_t ldxp, const uint16_t* wrow, int64_t k,
                                 float bias, float* y, int64_t ldy) {
  __m512 acc[C][4];
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < 4; ++j) acc[c][j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 128 <= k; i += 128) {
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512(wrow + i + 32 * j);
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < 4; ++j)
        acc[c][j] = dp(acc[c][j], wv[j], _mm512_loadu_si512(xp + c * ldxp + (i + 32 * j) / 2));
  }
  for (; i < k; i += 32) {
    const __m512i wv = load_w32_bf16(wrow, i, k);
    for (int c = 0; c < C; ++c)
      acc[c][0] = dp(acc[c][0], wv, _mm512_loadu_si512(xp + c * ldxp + i / 2));
  }
  for (int c = 0; c < C; ++c)
    y[c * ldy] = hsum(_mm512_add_ps(_mm512_add_ps(acc[c][0], acc[c][1]),
                                    _mm512_add_ps(acc[c][2], acc[c][3]))) +
                 bias;
}

VQ_BF16_TARGET void dot_rows_bf16(const uint32_t* xp, int64_t ldxp, int64_t n_tokens,
                                  const MatmulOut& o, int64_t k, int64_t n0, int64_t rows) {
  for (int64_t r = n0; r < n0 + rows; ++r) {
    const uint16_t* wrow = static_cast<const uint16_t*>(o.w) + r * k;
    const float b = o.bias ? o.bias[r] : 0.0f;
    detail::prefetch_row_ahead(wrow, static_cast<size_t>(k) * 2);
    switch (n_tokens) {
      case 1:
        row_dot_bf16<1>(xp, ldxp, wrow, k, b, o.y + r, o.ldy);
        break;
      case 2:
        row_dot_bf16<2>(xp, ldxp, wrow, k, b, o.y + r, o.ldy);
        break;
      default:
        row_dot_bf16<3>(xp, ldxp, wrow, k, b, o.y + r, o.ldy);
        break;
    }
  }
}

// P[p][j] = the weight pair W[n0 + j][k0 + 2p, k0 + 2p + 2) (zero beyond k and for j >= rows),
// p < kc / 2 (kc a multiple of 32): 16 rows x 16 pairs at a time, transposed as 32-bit words.
VQ_BF16_TARGET void pack_panel_bf16(const uint16_t* w, int64_t k, int64_t n0, int64_t rows,
                                    int64_t k0, int64_t kc, uint32_t* P) {
  for (int64_t jh = 0; jh < kPanel; jh += 16) {
    const int64_t vr = std::clamp<int64_t>(rows - jh, 0, 16);
    for (int64_t kk = 0; kk < kc; kk += 32) {
      __m512 r[16];
      for (int64_t j = 0; j < 16; ++j)
        r[j] = j >= vr ? _mm512_setzero_ps()
                       : _mm512_castsi512_ps(load_w32_bf16(w + (n0 + jh + j) * k, k0 + kk, k));
      transpose16(r);
      for (int64_t p = 0; p < 16; ++p)
        _mm512_storeu_ps(reinterpret_cast<float*>(P + (kk / 2 + p) * kPanel + jh), r[p]);
    }
  }
}

template <int MR>
VQ_BF16_TARGET void packed_micro_bf16(const uint32_t* P, int64_t npairs, const uint32_t* xp,
                                      int64_t ldxp, float* y, int64_t ldy, __mmask16 m0,
                                      __mmask16 m1, bool first, const float* bias) {
  __m512 acc[MR][2];
  load_acc<MR>(acc, first, bias, y, ldy, m0, m1);
  for (int64_t p = 0; p < npairs; ++p) {
    const __m512i w0 = _mm512_loadu_si512(P + p * kPanel);
    const __m512i w1 = _mm512_loadu_si512(P + p * kPanel + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(xp[m * ldxp + p]));
      acc[m][0] = dp(acc[m][0], w0, xb);
      acc[m][1] = dp(acc[m][1], w1, xb);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(y + m * ldy, m0, acc[m][0]);
    _mm512_mask_storeu_ps(y + m * ldy + 16, m1, acc[m][1]);
  }
}

template <int MR>
VQ_BF16_TARGET void packed_micro_bf16_dispatch(int64_t mr, const uint32_t* P, int64_t npairs,
                                               const uint32_t* xp, int64_t ldxp, float* y,
                                               int64_t ldy, __mmask16 m0, __mmask16 m1, bool first,
                                               const float* bias) {
  if constexpr (MR > 1) {
    if (mr < MR) {
      packed_micro_bf16_dispatch<MR - 1>(mr, P, npairs, xp, ldxp, y, ldy, m0, m1, first, bias);
      return;
    }
  }
  packed_micro_bf16<MR>(P, npairs, xp, ldxp, y, ldy, m0, m1, first, bias);
}

VQ_BF16_TARGET void run_panel_bf16(const uint32_t* xp, int64_t ldxp, int64_t n_tokens, int64_t k,
                                   const MatmulOut& o, int64_t n0, int64_t rows) {
  const int64_t kp = (k + 31) / 32 * 32;
  const int64_t kb = std::min(kp, kKBlockBF16);
  thread_local std::vector<uint32_t> panel_buf;
  if (panel_buf.size() < static_cast<size_t>(kb / 2 * kPanel))
    panel_buf.resize(static_cast<size_t>(kb / 2 * kPanel));
  uint32_t* P = panel_buf.data();
  const __mmask16 m0 = static_cast<__mmask16>(rows >= 16 ? 0xFFFF : (1u << rows) - 1u);
  const __mmask16 m1 = static_cast<__mmask16>(rows >= 32  ? 0xFFFF
                                              : rows > 16 ? (1u << (rows - 16)) - 1u
                                                          : 0u);
  const uint16_t* w = static_cast<const uint16_t*>(o.w);
  for (int64_t k0 = 0; k0 < kp; k0 += kb) {
    const int64_t kc = std::min(kb, kp - k0);
    pack_panel_bf16(w, k, n0, rows, k0, kc, P);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += kMR)
      packed_micro_bf16_dispatch<kMR>(std::min(kMR, n_tokens - t0), P, kc / 2,
                                      xp + t0 * ldxp + k0 / 2, ldxp, o.y + t0 * o.ldy + n0, o.ldy,
                                      m0, m1, k0 == 0, o.bias ? o.bias + n0 : nullptr);
  }
}

#endif

// ---- portable version: the compiler vectorises the inner K loop ----

template <DType WT>
inline float load_w(const void* w, int64_t i) {
  return load_f32(w, WT, static_cast<size_t>(i));
}

template <DType WT, int R, int C>
inline void portable_dot(const float* x, int64_t ldx, const void* w, int64_t k, int64_t n0,
                         const float* bias, float* y, int64_t ldy) {
  const size_t es = dtype_size(WT);
  for (int r = 0; r < R; ++r) {
    const void* wr = static_cast<const char*>(w) + (n0 + r) * k * es;
    for (int c = 0; c < C; ++c) {
      const float* xr = x + c * ldx;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= k; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += load_w<WT>(wr, i + j) * xr[i + j];
      float s = 0.0f;
      for (int j = 0; j < 8; ++j) s += acc[j];
      for (; i < k; ++i) s += load_w<WT>(wr, i) * xr[i];
      y[c * ldy + n0 + r] = s + (bias ? bias[n0 + r] : 0.0f);
    }
  }
}

// Rows [n0, n0 + rows) for every token, one row at a time.
template <DType WT>
void portable_rows(const float* x, int64_t n_tokens, int64_t ldx, const void* w, int64_t k,
                   int64_t n0, int64_t rows, const float* bias, float* y, int64_t ldy) {
  for (int64_t r = n0; r < n0 + rows; ++r)
    for (int64_t t = 0; t < n_tokens; ++t)
      portable_dot<WT, 1, 1>(x + t * ldx, ldx, w, k, r, bias, y + t * ldy, ldy);
}

std::atomic<int> g_matmul_cap{static_cast<int>(MatmulIsa::kAvx512)};

MatmulIsa best_matmul_isa() {
#if VQ_KERNELS_AVX512
  return MatmulIsa::kAvx512;
#else
  return detail::avx2_matmul_ok() ? MatmulIsa::kAvx2 : MatmulIsa::kPortable;
#endif
}

// How a call is cut into units of work (one unit = some output rows of one output, all tokens).
enum class Path : uint8_t {
  kVector,  // 1 token: dot products, 8 rows per unit
  kSmall,   // a few tokens (or any count on the portable loop): dot products, 4 rows per unit
  kPacked,  // AVX-512 or AVX2, >= kPackedMinTokens tokens: 32-row packed panels
};

Path choose_path(MatmulIsa isa, int64_t n_tokens) {
  if (isa != MatmulIsa::kPortable && n_tokens >= kPackedMinTokens) return Path::kPacked;
  return n_tokens == 1 ? Path::kVector : Path::kSmall;
}

int64_t unit_rows(Path p) {
  return p == Path::kVector ? 8 : p == Path::kSmall ? 4 : 32;
}

template <DType WT>
void run_unit(MatmulIsa isa, Path path, const float* x, int64_t n_tokens, int64_t k, int64_t ldx,
              const MatmulOut& o, int64_t n0) {
  const int64_t rows = std::min(unit_rows(path), o.n - n0);
  const bool packed = path == Path::kPacked;
#if VQ_KERNELS_AVX512
  if (isa == MatmulIsa::kAvx512) {
    if (packed)
      run_panel<WT>(x, n_tokens, k, ldx, o, n0, rows);
    else
      dot_rows<WT>(x, n_tokens, ldx, o.w, k, n0, rows, o.bias, o.y, o.ldy);
    return;
  }
#endif
  if (isa == MatmulIsa::kAvx2) {
    if (packed)
      for (int64_t h = 0; h < rows; h += detail::kAvx2PanelRows)
        detail::panel_avx2(WT, x, n_tokens, k, ldx, o.w, n0 + h,
                           std::min(detail::kAvx2PanelRows, rows - h), o.bias, o.y, o.ldy);
    else
      detail::dot_rows_avx2(WT, x, n_tokens, ldx, o.w, k, n0, rows, o.bias, o.y, o.ldy);
    return;
  }
  portable_rows<WT>(x, n_tokens, ldx, o.w, k, n0, rows, o.bias, o.y, o.ldy);
}

// Every unit of every output: exact kernels on x, except bf16 outputs when xp (X rounded to bf16
// pairs, row stride ldxp) is given, which run the vdpbf16ps kernels.
void run_outputs(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const MatmulOut* outs,
                 int n_outs, const uint32_t* xp, int64_t ldxp) {
  const MatmulIsa isa = matmul_isa();
  const Path path = choose_path(isa, n_tokens);
  const int64_t ur = unit_rows(path);
  std::vector<int64_t> first_unit(static_cast<size_t>(n_outs) + 1, 0);
  for (int i = 0; i < n_outs; ++i)
    first_unit[static_cast<size_t>(i) + 1] =
        first_unit[static_cast<size_t>(i)] + (std::max<int64_t>(outs[i].n, 0) + ur - 1) / ur;
  const int64_t n_units = first_unit.back();
  // One pool loop for every output (thread_pool.h): units of equal size, claimed one at a time.
  ops::parallel_for(n_units, [&](int64_t u) {
    int i = 0;
    while (u >= first_unit[static_cast<size_t>(i) + 1]) ++i;
    const MatmulOut& o = outs[i];
    const int64_t n0 = (u - first_unit[static_cast<size_t>(i)]) * ur;
#if VQ_KERNELS_AVX512
    if (xp != nullptr && o.dtype == DType::kBF16) {
      const int64_t rows = std::min(ur, o.n - n0);
      if (path == Path::kPacked)
        run_panel_bf16(xp, ldxp, n_tokens, k, o, n0, rows);
      else
        dot_rows_bf16(xp, ldxp, n_tokens, o, k, n0, rows);
      return;
    }
#else
    (void)xp;
    (void)ldxp;
#endif
    switch (o.dtype) {
      case DType::kF32:
        run_unit<DType::kF32>(isa, path, x, n_tokens, k, ldx, o, n0);
        break;
      case DType::kF16:
        run_unit<DType::kF16>(isa, path, x, n_tokens, k, ldx, o, n0);
        break;
      case DType::kBF16:
        run_unit<DType::kBF16>(isa, path, x, n_tokens, k, ldx, o, n0);
        break;
    }
  });
}

std::atomic<bool> g_force_portable_bf16{false};

bool cpu_has_bf16() {
#if VQ_KERNELS_AVX512 && defined(__GNUC__)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

constexpr int64_t kParallelRoundTokens = 16;  // round X on every thread from this many tokens

}  // namespace

MatmulIsa matmul_isa() {
  const MatmulIsa best = best_matmul_isa();
  const int cap = g_matmul_cap.load(std::memory_order_relaxed);
  return cap < static_cast<int>(best) ? static_cast<MatmulIsa>(cap) : best;
}

void cap_matmul_isa(MatmulIsa cap) {
  g_matmul_cap.store(static_cast<int>(cap), std::memory_order_relaxed);
}

const char* matmul_isa_name(MatmulIsa isa) {
  switch (isa) {
    case MatmulIsa::kPortable:
      return "portable";
    case MatmulIsa::kAvx2:
      return "avx2";
    case MatmulIsa::kAvx512:
      return "avx512";
  }
  return "?";
}

bool bf16_dot_active() {
  return cpu_has_bf16() && !g_force_portable_bf16.load() && matmul_isa() == MatmulIsa::kAvx512;
}

void force_portable_bf16(bool on) {
  g_force_portable_bf16.store(on);
}

uint16_t bf16_round(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  if ((b & 0x7F800000u) == 0) return static_cast<uint16_t>((b >> 16) & 0x8000u);  // 0, subnormal
  if ((b & 0x7F800000u) == 0x7F800000u) {
    if ((b & 0x007FFFFFu) != 0) return static_cast<uint16_t>((b >> 16) | 0x0040u);  // quiet NaN
    return static_cast<uint16_t>(b >> 16);                                          // +-inf
  }
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

void round_to_bf16(const float* x, int64_t n, uint16_t* out) {
#if VQ_KERNELS_AVX512
  if (bf16_dot_active()) {
    round_bf16_vec(x, n, out);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_round(x[i]);
}

void matmul_multi(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const MatmulOut* outs,
                  int n_outs, Precision prec) {
  if (n_tokens <= 0 || n_outs <= 0) return;
  if (k == 0) {
    for (int i = 0; i < n_outs; ++i)
      for (int64_t t = 0; t < n_tokens; ++t)
        for (int64_t r = 0; r < outs[i].n; ++r)
          outs[i].y[t * outs[i].ldy + r] = outs[i].bias ? outs[i].bias[r] : 0.0f;
    return;
  }
  bool any_bf16 = false;
  for (int i = 0; i < n_outs; ++i) any_bf16 = any_bf16 || outs[i].dtype == DType::kBF16;
  if (prec == Precision::kExact || !any_bf16) {
    run_outputs(x, n_tokens, k, ldx, outs, n_outs, nullptr, 0);
    return;
  }
  const bool par = n_tokens >= kParallelRoundTokens;
#if VQ_KERNELS_AVX512
  if (bf16_dot_active()) {
    const int64_t kp = (k + 31) / 32 * 32;
    thread_local std::vector<uint32_t> xp_buf;
    if (xp_buf.size() < static_cast<size_t>(n_tokens * kp / 2))
      xp_buf.resize(static_cast<size_t>(n_tokens * kp / 2));
    uint32_t* xp = xp_buf.data();
    const auto round = [&](int64_t t) { round_rows_bf16(x, k, ldx, t, t + 1, xp, kp); };
    if (par)
      ops::parallel_for(n_tokens, round);
    else
      for (int64_t t = 0; t < n_tokens; ++t) round(t);
    run_outputs(x, n_tokens, k, ldx, outs, n_outs, xp, kp / 2);
    return;
  }
#endif
  // Portable: the exact kernels on X rounded to bf16 values (products of two bf16 values are
  // exact in fp32, so this is exact products summed in fp32); other dtypes see the original X.
  thread_local std::vector<float> xr_buf;
  if (xr_buf.size() < static_cast<size_t>(n_tokens * k))
    xr_buf.resize(static_cast<size_t>(n_tokens * k));
  float* xr = xr_buf.data();
  const auto round = [&](int64_t t) {
    for (int64_t i = 0; i < k; ++i) {
      const uint32_t b = static_cast<uint32_t>(bf16_round(x[t * ldx + i])) << 16;
      std::memcpy(xr + t * k + i, &b, sizeof b);
    }
  };
  if (par)
    ops::parallel_for(n_tokens, round);
  else
    for (int64_t t = 0; t < n_tokens; ++t) round(t);
  std::vector<MatmulOut> rounded, other;
  for (int i = 0; i < n_outs; ++i)
    (outs[i].dtype == DType::kBF16 ? rounded : other).push_back(outs[i]);
  run_outputs(xr, n_tokens, k, k, rounded.data(), static_cast<int>(rounded.size()), nullptr, 0);
  if (!other.empty())
    run_outputs(x, n_tokens, k, ldx, other.data(), static_cast<int>(other.size()), nullptr, 0);
}

void matmul(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w, DType w_dtype,
            int64_t n, const float* bias, float* y, int64_t ldy, Precision prec) {
  const MatmulOut o{w, w_dtype, n, bias, y, ldy};
  matmul_multi(x, n_tokens, k, ldx, &o, 1, prec);
}

void matmul_bf16_reference(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w,
                           DType w_dtype, int64_t n, const float* bias, float* y, int64_t ldy) {
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t r = 0; r < n; ++r) {
      double s = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        const uint32_t b = static_cast<uint32_t>(bf16_round(x[t * ldx + i])) << 16;
        float xb;
        std::memcpy(&xb, &b, sizeof xb);
        s += static_cast<double>(xb) *
             static_cast<double>(load_f32(w, w_dtype, static_cast<size_t>(r * k + i)));
      }
      if (bias) s += bias[r];
      y[t * ldy + r] = static_cast<float>(s);
    }
}

void matmul_reference(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w,
                      DType w_dtype, int64_t n, const float* bias, float* y, int64_t ldy) {
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t r = 0; r < n; ++r) {
      double s = 0.0;
      for (int64_t i = 0; i < k; ++i)
        s += static_cast<double>(x[t * ldx + i]) *
             static_cast<double>(load_f32(w, w_dtype, static_cast<size_t>(r * k + i)));
      if (bias) s += bias[r];
      y[t * ldy + r] = static_cast<float>(s);
    }
}

#if VQ_KERNELS_AVX512
namespace {

// silu(g) * u with e = exp(-|g|) in (0, 1]: g / (1 + e) for g >= 0, g e / (1 + e) for g < 0
// (the same value as g / (1 + exp(-g)), without overflow).
inline __m512 swiglu16(__m512 g, __m512 u) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 e = simd::exp_nonpos16_exact(_mm512_or_ps(g, sign));  // -|g|
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 num = _mm512_mask_mul_ps(g, neg, g, e);
  return _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

}  // namespace
#endif

void rmsnorm(const float* x, const float* weight, int64_t n, double eps, float* out) {
  double ss = 0.0;
  int64_t i = 0;
#if VQ_KERNELS_AVX512
  // Double lanes (products exact in double, 8-lane partial sums): the sum differs from the
  // sequential one by ~n 2^-53 relative, far below the fp32 result's rounding.
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    const __m512d x0 = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    const __m512d x1 = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
    a0 = _mm512_add_pd(a0, _mm512_mul_pd(x0, x0));
    a1 = _mm512_add_pd(a1, _mm512_mul_pd(x1, x1));
  }
  alignas(64) double lanes[8];
  _mm512_store_pd(lanes, _mm512_add_pd(a0, a1));
  for (double l : lanes) ss += l;
#endif
  for (; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  for (int64_t j = 0; j < n; ++j) out[j] = weight[j] * (x[j] * inv);
}

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
#if VQ_KERNELS_AVX512
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, swiglu16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
  if (i < n) {  // the same arithmetic on the masked tail
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(
        out + i, m, swiglu16(_mm512_maskz_loadu_ps(m, gate + i), _mm512_maskz_loadu_ps(m, up + i)));
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
#endif
}

}  // namespace vq::kernels
