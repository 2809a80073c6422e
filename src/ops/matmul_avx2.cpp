// AVX2 + FMA matrix products (matmul_avx2.h): compiled for AVX2, FMA and F16C whatever the
// build's -march, chosen at run time by kernels.cpp where the build has no AVX-512 kernels or a
// test caps the instruction set.
#include "ops/matmul_avx2.h"

#include "ops/cpu_features.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC takes the target as a pragma; clang as an attribute on every function that follows.
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#endif

namespace vq::kernels::detail {
namespace {

constexpr int64_t kMR = 6;         // tokens per micro-kernel call (12 accumulators)
constexpr int64_t kKBlock = 2048;  // K per panel block: 16 x 2048 fp32 = 128 KiB
constexpr int64_t kP = kAvx2PanelRows;

// 8 weights w[i, i + 8) as fp32 (exact conversions).
template <DType WT>
inline __m256 load_w8(const void* w, int64_t i) {
  if constexpr (WT == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(w) + i);
  } else {
    const __m128i raw =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    if constexpr (WT == DType::kBF16)
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    else
      return _mm256_cvtph_ps(raw);
  }
}

// The n < 8 weights w[i, i + n), zero beyond: copied into a zeroed block first (AVX2 has no
// 16-bit masked load).
template <DType WT>
inline __m256 load_w8_part(const void* w, int64_t i, int64_t n) {
  constexpr size_t es = WT == DType::kF32 ? 4 : 2;
  alignas(32) unsigned char buf[32] = {};
  std::memcpy(buf, static_cast<const char*>(w) + static_cast<size_t>(i) * es,
              static_cast<size_t>(n) * es);
  return load_w8<WT>(buf, 0);
}

// Lanes j < n all ones, the rest zero: the mask of the AVX2 masked loads and stores.
inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

template <DType WT, int C>
inline void row_dot(const float* x, int64_t ldx, const void* wrow, int64_t k, float bias, float* y,
                    int64_t ldy) {
  __m256 acc[C][4];
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < 4; ++j) acc[c][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    __m256 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = load_w8<WT>(wrow, i + 8 * j);
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < 4; ++j)
        acc[c][j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + c * ldx + i + 8 * j), acc[c][j]);
  }
  for (; i + 8 <= k; i += 8) {
    const __m256 wv = load_w8<WT>(wrow, i);
    for (int c = 0; c < C; ++c)
      acc[c][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + c * ldx + i), acc[c][0]);
  }
  if (i < k) {
    const __m256i m = lanes_below(k - i);
    const __m256 wv = load_w8_part<WT>(wrow, i, k - i);
    for (int c = 0; c < C; ++c)
      acc[c][1] = _mm256_fmadd_ps(wv, _mm256_maskload_ps(x + c * ldx + i, m), acc[c][1]);
  }
  for (int c = 0; c < C; ++c)
    y[c * ldy] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[c][0], acc[c][1]),
                                     _mm256_add_ps(acc[c][2], acc[c][3]))) +
                 bias;
}

template <DType WT>
void dot_rows(const float* x, int64_t n_tokens, int64_t ldx, const void* w, int64_t k, int64_t n0,
              int64_t rows, const float* bias, float* y, int64_t ldy) {
  const size_t row_bytes = static_cast<size_t>(k) * dtype_size(WT);
  for (int64_t r = n0; r < n0 + rows; ++r) {
    const void* wrow = static_cast<const char*>(w) + static_cast<size_t>(r) * row_bytes;
    const float b = bias ? bias[r] : 0.0f;
    prefetch_row_ahead(wrow, row_bytes);  // kPrefetchRows ahead (matmul_avx2.h)
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

// In-register transpose of an 8 x 8 fp32 block: r[i] (row i) becomes column i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // per 128-bit lane: pairs of rows interleaved
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int h = 0; h < 8; h += 4) {  // u[h + c], lane l: rows h..h+3 of column 4 l + c
    u[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
    u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xee);
    u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
    u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xee);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// P[k][j] = W[n0 + j][k0 + k] as fp32 for j < rows, zero for j >= rows, k < kc: 8 rows x 8
// columns at a time, converted in registers and transposed there.
template <DType WT>
void pack_panel(const void* w, int64_t k_total, int64_t n0, int64_t rows, int64_t k0, int64_t kc,
                float* P) {
  const size_t es = dtype_size(WT);
  for (int64_t jh = 0; jh < kP; jh += 8) {
    const int64_t vr = std::clamp<int64_t>(rows - jh, 0, 8);  // rows of this half
    const char* base = static_cast<const char*>(w) + static_cast<size_t>((n0 + jh) * k_total) * es;
    for (int64_t k = 0; k < kc; k += 8) {
      const int64_t kn = std::min<int64_t>(8, kc - k);
      __m256 r[8];
      for (int64_t j = 0; j < 8; ++j) {
        const void* row = base + static_cast<size_t>(j * k_total) * es;
        r[j] = j >= vr   ? _mm256_setzero_ps()
               : kn == 8 ? load_w8<WT>(row, k0 + k)
                         : load_w8_part<WT>(row, k0 + k, kn);
      }
      transpose8(r);
      for (int64_t kk = 0; kk < kn; ++kk) _mm256_storeu_ps(P + (k + kk) * kP + jh, r[kk]);
    }
  }
}

// y[m][0:16] (+)= sum_k x[m][k] P[k][0:16] for MR tokens; lanes off in m0 / m1 (rows 0-7 /
// 8-15) are neither read nor stored. first: start from the bias (or 0), else from y.
template <int MR>
void micro(const float* P, int64_t kc, const float* x, int64_t ldx, float* y, int64_t ldy,
           __m256i m0, __m256i m1, bool first, const float* bias) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) {
    if (first) {
      acc[m][0] = bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
      acc[m][1] = bias ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps();
    } else {
      acc[m][0] = _mm256_maskload_ps(y + m * ldy, m0);
      acc[m][1] = _mm256_maskload_ps(y + m * ldy + 8, m1);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_loadu_ps(P + k * kP);
    const __m256 w1 = _mm256_loadu_ps(P + k * kP + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
      acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_maskstore_ps(y + m * ldy, m0, acc[m][0]);
    _mm256_maskstore_ps(y + m * ldy + 8, m1, acc[m][1]);
  }
}

template <int MR>
void micro_dispatch(int64_t mr, const float* P, int64_t kc, const float* x, int64_t ldx, float* y,
                    int64_t ldy, __m256i m0, __m256i m1, bool first, const float* bias) {
  if constexpr (MR > 1) {
    if (mr < MR) {
      micro_dispatch<MR - 1>(mr, P, kc, x, ldx, y, ldy, m0, m1, first, bias);
      return;
    }
  }
  micro<MR>(P, kc, x, ldx, y, ldy, m0, m1, first, bias);
}

template <DType WT>
void panel(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w, int64_t n0,
           int64_t rows, const float* bias, float* y, int64_t ldy) {
  const int64_t kb = std::min(k, kKBlock);
  thread_local std::vector<float> panel_buf;
  if (panel_buf.size() < static_cast<size_t>(kb * kP))
    panel_buf.resize(static_cast<size_t>(kb * kP));
  float* P = panel_buf.data();
  const __m256i m0 = lanes_below(rows), m1 = lanes_below(rows - 8);
  for (int64_t k0 = 0; k0 < k; k0 += kb) {
    const int64_t kc = std::min(kb, k - k0);
    pack_panel<WT>(w, k, n0, rows, k0, kc, P);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += kMR)
      micro_dispatch<kMR>(std::min(kMR, n_tokens - t0), P, kc, x + t0 * ldx + k0, ldx,
                          y + t0 * ldy + n0, ldy, m0, m1, k0 == 0, bias ? bias + n0 : nullptr);
  }
}

}  // namespace

bool avx2_matmul_ok() {
  static const bool ok = vq::detail::cpu_has_avx2_fma_f16c();
  return ok;
}

void dot_rows_avx2(DType wt, const float* x, int64_t n_tokens, int64_t ldx, const void* w,
                   int64_t k, int64_t n0, int64_t rows, const float* bias, float* y, int64_t ldy) {
  switch (wt) {
    case DType::kF32:
      return dot_rows<DType::kF32>(x, n_tokens, ldx, w, k, n0, rows, bias, y, ldy);
    case DType::kF16:
      return dot_rows<DType::kF16>(x, n_tokens, ldx, w, k, n0, rows, bias, y, ldy);
    case DType::kBF16:
      return dot_rows<DType::kBF16>(x, n_tokens, ldx, w, k, n0, rows, bias, y, ldy);
  }
}

void panel_avx2(DType wt, const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w,
                int64_t n0, int64_t rows, const float* bias, float* y, int64_t ldy) {
  switch (wt) {
    case DType::kF32:
      return panel<DType::kF32>(x, n_tokens, k, ldx, w, n0, rows, bias, y, ldy);
    case DType::kF16:
      return panel<DType::kF16>(x, n_tokens, k, ldx, w, n0, rows, bias, y, ldy);
    case DType::kBF16:
      return panel<DType::kBF16>(x, n_tokens, k, ldx, w, n0, rows, bias, y, ldy);
  }
}

}  // namespace vq::kernels::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else

namespace vq::kernels::detail {
bool avx2_matmul_ok() {
  return false;
}
void dot_rows_avx2(DType, const float*, int64_t, int64_t, const void*, int64_t, int64_t, int64_t,
                   const float*, float*, int64_t) {}
void panel_avx2(DType, const float*, int64_t, int64_t, int64_t, const void*, int64_t, int64_t,
                const float*, float*, int64_t) {}
}  // namespace vq::kernels::detail

#endif
