// SKVQ flush kernels (see skvq_flush.cuh), bit-identical to the CPU reference: every floating
// operation is an explicit IEEE intrinsic (__fadd_rn, __fmul_rn, __fdiv_rn, ...) in the order of
// group_quantize_reference / fwht_normalized, so nvcc can neither contract a multiply-add into an
// FMA nor reorder anything; comparisons replicate the CPU's ternaries (NaN behaviour included).
//
// Quantize: a block stages R rows in shared memory as fp32 [R][D + 1], rotates them
// (signs, butterflies of span 1, 2, 4, ... within each rot_block, then * norm), gathers the
// permutation into a second buffer, quantizes one (row, group) per thread (clip search over the
// alpha grid with metadata rounded as stored; every alpha in one pass over the group, the
// division by the scale replaced by a reciprocal product except near rounding ties, which gives
// the same codes: see quant_code_fast), then writes each record byte by one thread (codes
// packed little-endian, or five ternary codes per byte, then (lo, scale) per group).
// Permutations: a block per head, thread c scans channel c over the B*n pooled rows (min/max as
// std::min/std::max, range NaN -> +inf), then ranks channels for a stable ascending sort.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "cuda/check.h"
#include "cuda/skvq_flush.cuh"
#include "veloxquant/packed.h"

namespace vq::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxAlpha = 5;  // SkvqQuantParams::alpha
static_assert(sizeof(SkvqQuantParams{}.alpha) == kMaxAlpha * sizeof(float), "alpha grid size");

__device__ __forceinline__ float load_elem(const void* base, int dtype, int64_t i) {
  if (dtype == 1) return __half2float(static_cast<const __half*>(base)[i]);
  if (dtype == 2) {
    const uint32_t b = static_cast<const uint16_t*>(base)[i];
    return __uint_as_float(b << 16);
  }
  return static_cast<const float*>(base)[i];
}

// quant_code without the division in the common case: t' = (x - lo) * rcp_rn(scale) differs from
// the IEEE quotient t = (x - lo) / scale by at most 3 * 2^-24 * |t| (two roundings of the
// reciprocal-product path, one of the quotient). Clamping to [0, levels] and rounding to an integer
// can only differ when a clamped value lies within that distance of a half-integer (the clamp
// bounds are integers, and |t| > levels + 1 clamps both alike); every |t| that matters is
// <= levels + 1 <= 256, so the distance is < 2^-14. Within 2^-12 of a half-integer the exact
// quant_code decides. NaN, +-inf and overflow behave as in quant_code (NaN -> 0, both clamp to
// the same bound). Hence the code equals quant_code(x, lo, scale, levels) (packed.h, the CPU
// quantizer's) bit for bit.
// Cheaper forms of the same steps: fmaxf(t, 0) equals `t > 0 ? t : 0` up to the sign of a zero
// (NaN gives 0 either way) and the clamped t is never NaN, so fminf(t, levels) equals the second
// ternary; rintf (ties to even) equals the 2^23 round trip on [0, levels]; both zeros give code 0.
__device__ __forceinline__ float quant_code_fast(float x, float lo, float scale, float rcp,
                                                 float levels) {
  const float t = fminf(fmaxf(__fmul_rn(__fsub_rn(x, lo), rcp), 0.0f), levels);
  const float c = rintf(t);
  if (fabsf(__fsub_rn(t, c)) > 0.5f - 0x1p-12f) return quant_code(x, lo, scale, levels);
  return c;
}

__global__ void __launch_bounds__(kThreads)
    skvq_quantize_kernel(const __grid_constant__ SkvqQuantParams p, int rows_per_block) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int D = p.head_dim, NG = p.n_groups, R = rows_per_block;
  const MetaType mt = static_cast<MetaType>(p.meta);
  const int DP = D + 1;  // padded rows: threads on consecutive rows hit consecutive banks
  const bool rot = p.signs != nullptr;
  float* x = reinterpret_cast<float*>(smem);  // [R][DP] original order, then rotated (rot only)
  float* t = rot ? x + R * DP : x;            // [R][DP] stored order
  float* mlo = t + R * DP;                    // [R][NG]
  float* msc = mlo + R * NG;                  // [R][NG]
  uint8_t* codes = reinterpret_cast<uint8_t*>(msc + R * NG);  // [R][D]
  const int tid = threadIdx.x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * R;
  const int nr = static_cast<int>(p.n_rows_total - row0 < R ? p.n_rows_total - row0 : R);

  // Element loops run a warp per row (no index division); the head of each row once per row.
  const int lane = tid & 31, warp = tid >> 5;
  int* shead = reinterpret_cast<int*>(codes + ((R * D + 3) & ~3));  // [R]
  for (int r = tid; r < nr; r += kThreads)
    shead[r] = static_cast<int>(((row0 + r) / p.rows_per_head) % p.n_heads);
  __syncthreads();
  const bool vec16 = p.dtype == 1 && D % 8 == 0 && reinterpret_cast<uintptr_t>(p.rows) % 16 == 0;
  if (!rot && p.perm) {  // no rotation: gather straight into stored order (one buffer less)
    for (int r = warp; r < nr; r += kThreads / 32) {
      const int32_t* pm = p.perm + static_cast<int64_t>(shead[r]) * D;
      for (int c = lane; c < D; c += 32)
        t[r * DP + c] = load_elem(p.rows, p.dtype, (row0 + r) * D + pm[c]);
    }
  } else if (vec16) {
    const int D8 = D / 8;  // f16 rows: 8 elements per 16-byte load
    const uint4* src =
        reinterpret_cast<const uint4*>(static_cast<const __half*>(p.rows) + row0 * D);
    for (int r = warp; r < nr; r += kThreads / 32)
      for (int c8 = lane; c8 < D8; c8 += 32) {
        const uint4 u = src[r * D8 + c8];
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
        float* dst = x + r * DP + 8 * c8;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
          dst[2 * k] = f.x;
          dst[2 * k + 1] = f.y;
        }
      }
  } else {
    for (int r = warp; r < nr; r += kThreads / 32)
      for (int c = lane; c < D; c += 32)
        x[r * DP + c] = load_elem(p.rows, p.dtype, (row0 + r) * D + c);
  }
  __syncthreads();
  if (rot) {  // hadamard_rotate: x *= signs, then fwht_normalized
    for (int r = warp; r < nr; r += kThreads / 32)
      for (int c = lane; c < D; c += 32)
        x[r * DP + c] = __fmul_rn(x[r * DP + c], p.signs[static_cast<int64_t>(shead[r]) * D + c]);
    __syncthreads();
    for (int span = 1; span < p.rot_block; span *= 2) {
      for (int i = tid; i < nr * D / 2; i += kThreads) {
        const int r = i / (D / 2), jj = i % (D / 2);
        const int lo = (jj / span) * 2 * span + (jj % span);
        float* v = x + r * DP;
        const float a = v[lo], c = v[lo + span];
        v[lo] = __fadd_rn(a, c);
        v[lo + span] = __fsub_rn(a, c);
      }
      __syncthreads();
    }
    for (int r = warp; r < nr; r += kThreads / 32)
      for (int c = lane; c < D; c += 32) x[r * DP + c] = __fmul_rn(x[r * DP + c], p.rot_norm);
    __syncthreads();
  }
  if (rot) {  // stored order of the rotated rows (without rotation t is x, already in order)
    for (int r = warp; r < nr; r += kThreads / 32)
      for (int c = lane; c < D; c += 32)
        t[r * DP + c] =
            p.perm ? x[r * DP + p.perm[static_cast<int64_t>(shead[r]) * D + c]] : x[r * DP + c];
    __syncthreads();
  }

  // One (row, group) per thread: group_quantize_reference.
  const int g = p.group_size;
  const float levels = p.levels;
  for (int item = tid; item < nr * NG; item += kThreads) {
    const int gi = item / nr, r = item % nr;  // group-major: a warp reads 32 different rows
    const float* row = t + r * DP;
    const int c0 = gi * g;
    auto elem = [&](int i) { return row[c0 + i < D ? c0 + i : D - 1]; };  // ragged pad
    float gmin = elem(0), gmax = elem(0);
    for (int i = 1; i < g; ++i) {
      const float v = elem(i);
      if (v < gmin) gmin = v;
      if (v > gmax) gmax = v;
    }
    const float mid = __fdiv_rn(__fadd_rn(gmax, gmin), 2.0f);
    const float rng = __fsub_rn(gmax, gmin);
    // The alpha grid's (lo, scale) and error sums side by side: one pass over the group feeds
    // every alpha (independent chains; each error is still summed in element order).
    float al[kMaxAlpha], as[kMaxAlpha], ar_[kMaxAlpha], ae[kMaxAlpha];
#pragma unroll
    for (int k = 0; k < kMaxAlpha; ++k) {
      al[k] = 0.0f;
      as[k] = 1.0f;
      ar_[k] = 1.0f;
      ae[k] = 0.0f;
      if (k < p.n_alpha) {
        const float ar = __fmul_rn(p.alpha[k], rng);
        al[k] = meta_round(__fsub_rn(mid, __fdiv_rn(ar, 2.0f)), mt);
        float sc = __fdiv_rn(ar, levels);
        sc = sc < 1e-8f ? 1e-8f : sc;
        as[k] = meta_round_scale(sc, mt);
        ar_[k] = __frcp_rn(as[k]);
      }
    }
    for (int i = 0; i < g; ++i) {
      const float v = elem(i);
#pragma unroll
      for (int k = 0; k < kMaxAlpha; ++k) {
        if (k < p.n_alpha) {
          const float c = quant_code_fast(v, al[k], as[k], ar_[k], levels);
          const float rec = __fadd_rn(__fmul_rn(c, as[k]), al[k]);
          const float e = __fsub_rn(rec, v);
          ae[k] = __fadd_rn(ae[k], __fmul_rn(e, e));
        }
      }
    }
    float best_err = 0.0f, best_lo = 0.0f, best_sc = 1.0f, best_r = 1.0f;
#pragma unroll
    for (int k = 0; k < kMaxAlpha; ++k) {
      if (k < p.n_alpha) {
        const float err = __fdiv_rn(ae[k], static_cast<float>(g));
        if (k == 0 || err < best_err) {
          best_err = err;
          best_lo = al[k];
          best_sc = as[k];
          best_r = ar_[k];
        }
      }
    }
    mlo[r * NG + gi] = best_lo;
    msc[r * NG + gi] = best_sc;
    const int c1 = c0 + g < D ? c0 + g : D;
    for (int c = c0; c < c1; ++c)
      codes[r * D + c] =
          static_cast<uint8_t>(quant_code_fast(row[c], best_lo, best_sc, best_r, levels));
  }
  __syncthreads();

  // One record byte per thread.
  const int ms = meta_size(mt);
  const int rsb = p.row_stride;
  for (int r = warp; r < nr; r += kThreads / 32)
    for (int byte = lane; byte < rsb; byte += 32) {
      const uint8_t* cr = codes + r * D;
      uint32_t v = 0;
      if (byte < p.packed_bytes) {
        if (p.ternary) {
          for (int m = 4; m >= 0; --m) {
            const int j = 5 * byte + m;
            v = v * 3u + (j < D ? cr[j] : 0u);
          }
        } else {
          const int b = p.bits;
          const int j0 = (8 * byte) / b, j1 = (8 * byte + 7) / b;
          for (int j = j0; j <= j1 && j < D; ++j) {
            const int shift = j * b - 8 * byte;
            v |= shift >= 0 ? (static_cast<uint32_t>(cr[j]) << shift)
                            : (static_cast<uint32_t>(cr[j]) >> (-shift));
          }
        }
      } else if (byte >= p.code_bytes) {
        const int m = byte - p.code_bytes;
        const int e = m / ms, eb = m % ms;
        const float val = (e % 2 == 0) ? mlo[r * NG + e / 2] : msc[r * NG + e / 2];
        const uint32_t bits = meta_encode(val, mt);
        v = bits >> (8 * eb);
      }
      p.records[(row0 + r) * rsb + byte] = static_cast<uint8_t>(v & 0xffu);
    }
}

__global__ void skvq_perm_kernel(const __grid_constant__ SkvqPermParams p) {
  extern __shared__ float range[];  // [D]
  const int h = blockIdx.x, c = threadIdx.x, D = p.head_dim;
  if (c < D) {
    // starts from the first pooled row and then folds every row in order (the first again: a
    // no-op for these min/max, NaN included), so the loads can be issued ahead
    float mn = 0.0f, mx = 0.0f;
    if (p.n > 0 && p.batch > 0)
      mn = mx = load_elem(p.rows, p.dtype, (static_cast<int64_t>(h) * p.n) * D + c);
    for (int b = 0; b < p.batch; ++b) {
      const int64_t base = ((static_cast<int64_t>(b) * p.n_heads + h) * p.n) * D + c;
#pragma unroll 8
      for (int64_t i = 0; i < p.n; ++i) {
        const float v = load_elem(p.rows, p.dtype, base + i * D);
        mn = (v < mn) ? v : mn;  // std::min(mn, v)
        mx = (mx < v) ? v : mx;  // std::max(mx, v)
      }
    }
    const float r = __fsub_rn(mx, mn);
    range[c] = (p.n > 0 && p.batch > 0) ? (isnan(r) ? INFINITY : r) : 0.0f;
  }
  __syncthreads();
  if (c < D) {
    const float rc = range[c];
    int rank = 0;
    for (int j = 0; j < D; ++j) rank += (range[j] < rc) || (range[j] == rc && j < c);
    p.perm[static_cast<int64_t>(h) * D + rank] = c;
  }
}

}  // namespace

void skvq_quantize_launch(const SkvqQuantParams& p, cudaStream_t s) {
  if (p.n_rows_total == 0) return;
  const int D = p.head_dim, NG = p.n_groups;
  // About one (row, group) item per thread, 16..128 rows per block.
  const int rows = std::min(128, std::max(16, kThreads / NG));
  const size_t smem = static_cast<size_t>(rows) * ((p.signs ? 2 : 1) * (D + 1) + 2 * NG) * 4 +
                      static_cast<size_t>(rows) * D + 3 +
                      static_cast<size_t>(rows) * 4;  // + the head of each row
  VQ_CHECK(smem <= 200 * 1024,
           "[skvq_quantize_rows] expected head_dim <= 256 but got " + std::to_string(D));
  VQ_CUDA_CHECK(cudaFuncSetAttribute(
      skvq_quantize_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t blocks = (p.n_rows_total + rows - 1) / rows;
  VQ_CHECK(blocks < (int64_t{1} << 31), "[skvq_quantize_rows] expected fewer rows");
  skvq_quantize_kernel<<<static_cast<unsigned>(blocks), kThreads, smem, s>>>(p, rows);
  VQ_CUDA_LAUNCH_CHECK(skvq_quantize_kernel);
}

void skvq_channel_perms_launch(const SkvqPermParams& p, cudaStream_t s) {
  VQ_CHECK(
      p.head_dim >= 1 && p.head_dim <= 1024,
      "[skvq_channel_perms] expected head_dim in 1..1024 but got " + std::to_string(p.head_dim));
  const int threads = (p.head_dim + 31) / 32 * 32;
  skvq_perm_kernel<<<static_cast<unsigned>(p.n_heads), threads, static_cast<size_t>(p.head_dim) * 4,
                     s>>>(p);
  VQ_CUDA_LAUNCH_CHECK(skvq_perm_kernel);
}

}  // namespace vq::cuda
