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
// Channel-axis records (quantize_chunk_to_records): three kernels over stream-ordered scratch.
// (1) a block per row writes the row in stored order as fp32 (the rotation and gather above, in
// the same operations); (2) a thread per (frame, stored channel) quantizes the channel's n values
// as one group of group_quantize_reference (min/max scan in row order, every alpha's error summed
// in row order, exact quant_code), writing the n codes and (lo, scale); (3) a thread per record
// byte packs row t's codes and metadata elements t*n_groups .. of the chunk's list (zero past 2D).
// With key_u, (2b) a warp per row rechooses its codes by error feedback on those grids.
// Permutations: a block per head, thread c scans channel c over the B*n pooled rows (min/max as
// std::min/std::max, range NaN -> +inf), then ranks channels for a stable ascending sort.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "cuda/check.h"
#include "cuda/skvq_flush.cuh"
#include "veloxquant/group_quant.h"
#include "veloxquant/packed.h"

namespace vq::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kAlphaChunk = 5;  // alphas per pass over a group: the seed's grid in one
static_assert(sizeof(SkvqQuantParams{}.alpha) == kMaxClipAlphas * sizeof(float),
              "SkvqQuantParams::alpha holds every alpha of clip_alphas");

__device__ __forceinline__ float load_elem(const void* base, int dtype, int64_t i) {
  if (dtype == 1) return __half2float(static_cast<const __half*>(base)[i]);
  if (dtype == 2) {
    const uint32_t b = static_cast<const uint16_t*>(base)[i];
    return __uint_as_float(b << 16);
  }
  return static_cast<const float*>(base)[i];
}

// Byte `byte` (< the packed code bytes) of a record whose D codes are cr[0..D): five ternary codes
// in base 3, or the bits of the b-bit codes straddling it (packed.h's code layout).
__device__ __forceinline__ uint32_t packed_code_byte(const uint8_t* cr, int byte, int D, int bits,
                                                     bool ternary) {
  uint32_t v = 0;
  if (ternary) {
    for (int m = 4; m >= 0; --m) {
      const int j = 5 * byte + m;
      v = v * 3u + (j < D ? cr[j] : 0u);
    }
    return v;
  }
  const int j0 = (8 * byte) / bits, j1 = (8 * byte + 7) / bits;
  for (int j = j0; j <= j1 && j < D; ++j) {
    const int shift = j * bits - 8 * byte;
    v |= shift >= 0 ? (static_cast<uint32_t>(cr[j]) << shift)
                    : (static_cast<uint32_t>(cr[j]) >> (-shift));
  }
  return v;
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
    // The alphas in chunks of kAlphaChunk (the seed's five are the first): one pass over the
    // group feeds a chunk's (lo, scale) and error sums side by side (independent chains; each
    // error still summed in element order); the least error wins across chunks, the earlier
    // alpha on ties, as group_quantize_reference picks.
    float best_err = 0.0f, best_lo = 0.0f, best_sc = 1.0f, best_r = 1.0f;
    for (int k0 = 0; k0 < p.n_alpha; k0 += kAlphaChunk) {
      float al[kAlphaChunk], as[kAlphaChunk], ar_[kAlphaChunk], ae[kAlphaChunk];
#pragma unroll
      for (int j = 0; j < kAlphaChunk; ++j) {
        al[j] = 0.0f;
        as[j] = 1.0f;
        ar_[j] = 1.0f;
        ae[j] = 0.0f;
        if (k0 + j < p.n_alpha) {
          const float ar = __fmul_rn(p.alpha[k0 + j], rng);
          al[j] = meta_round(__fsub_rn(mid, __fdiv_rn(ar, 2.0f)), mt);
          float sc = __fdiv_rn(ar, levels);
          sc = sc < 1e-8f ? 1e-8f : sc;
          as[j] = meta_round_scale(sc, mt);
          ar_[j] = __frcp_rn(as[j]);
        }
      }
      for (int i = 0; i < g; ++i) {
        const float v = elem(i);
#pragma unroll
        for (int j = 0; j < kAlphaChunk; ++j) {
          if (k0 + j < p.n_alpha) {
            const float c = quant_code_fast(v, al[j], as[j], ar_[j], levels);
            const float rec = __fadd_rn(__fmul_rn(c, as[j]), al[j]);
            const float e = __fsub_rn(rec, v);
            ae[j] = __fadd_rn(ae[j], __fmul_rn(e, e));
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kAlphaChunk; ++j) {
        if (k0 + j < p.n_alpha) {
          const float err = __fdiv_rn(ae[j], static_cast<float>(g));
          if (k0 + j == 0 || err < best_err) {
            best_err = err;
            best_lo = al[j];
            best_sc = as[j];
            best_r = ar_[j];
          }
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
        v = packed_code_byte(cr, byte, D, p.bits, p.ternary != 0);
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

// ---- channel-axis records

// Row r of p.rows in stored order (rotated, then permuted) as fp32 into t [n_rows_total, D]: one
// block per row, the token kernel's operations (x *= signs, butterflies of span 1, 2, 4, ...
// within each rot_block, * norm, gather). Dynamic shared memory: D floats.
__global__ void skvq_channel_rows_kernel(const __grid_constant__ SkvqQuantParams p, float* t) {
  extern __shared__ float xr[];  // [D]
  const int D = p.head_dim;
  const int64_t r = blockIdx.x;
  const int64_t h = (r / p.rows_per_head) % p.n_heads;
  const bool rot = p.signs != nullptr;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    const float x = load_elem(p.rows, p.dtype, r * D + c);
    xr[c] = rot ? __fmul_rn(x, p.signs[h * D + c]) : x;
  }
  __syncthreads();
  if (rot) {
    for (int span = 1; span < p.rot_block; span *= 2) {
      for (int jj = threadIdx.x; jj < D / 2; jj += blockDim.x) {
        const int lo = (jj / span) * 2 * span + (jj % span);
        const float a = xr[lo], c = xr[lo + span];
        xr[lo] = __fadd_rn(a, c);
        xr[lo + span] = __fsub_rn(a, c);
      }
      __syncthreads();
    }
    for (int c = threadIdx.x; c < D; c += blockDim.x) xr[c] = __fmul_rn(xr[c], p.rot_norm);
    __syncthreads();
  }
  for (int c = threadIdx.x; c < D; c += blockDim.x)
    t[r * D + c] = p.perm ? xr[p.perm[h * D + c]] : xr[c];
}

// One thread per (frame f, stored channel c): the channel's n = rows_per_head values
// t[(f*n + i)*D + c] are one group of group_quantize_reference (group_size n, no pad). Writes
// codes [n_rows_total, D] and lo, scale [frames, D].
__global__ void skvq_channel_quant_kernel(const __grid_constant__ SkvqQuantParams p, const float* t,
                                          uint8_t* codes, float* lo_out, float* sc_out) {
  const int D = p.head_dim;
  const int64_t n = p.rows_per_head, frames = p.n_rows_total / n;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= frames * D) return;
  const int64_t f = item / D;
  const int c = static_cast<int>(item % D);
  const float* x = t + f * n * D + c;  // value i at x[i * D]
  const MetaType mt = static_cast<MetaType>(p.meta);
  const float levels = p.levels;
  float gmin = x[0], gmax = x[0];
  for (int64_t i = 1; i < n; ++i) {
    const float v = x[i * D];
    if (v < gmin) gmin = v;
    if (v > gmax) gmax = v;
  }
  const float mid = __fdiv_rn(__fadd_rn(gmax, gmin), 2.0f);
  const float rng = __fsub_rn(gmax, gmin);
  float best_err = 0.0f, best_lo = 0.0f, best_sc = 1.0f;
  for (int k = 0; k < p.n_alpha; ++k) {
    const float ar = __fmul_rn(p.alpha[k], rng);
    const float l = meta_round(__fsub_rn(mid, __fdiv_rn(ar, 2.0f)), mt);
    float sc = __fdiv_rn(ar, levels);
    sc = sc < 1e-8f ? 1e-8f : sc;  // kScaleFloor
    const float s = meta_round_scale(sc, mt);
    float err = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i * D];
      const float rec = __fadd_rn(__fmul_rn(quant_code(v, l, s, levels), s), l);
      const float e = __fsub_rn(rec, v);
      err = __fadd_rn(err, __fmul_rn(e, e));
    }
    err = __fdiv_rn(err, static_cast<float>(n));
    if (k == 0 || err < best_err) {
      best_err = err;
      best_lo = l;
      best_sc = s;
    }
  }
  lo_out[f * D + c] = best_lo;
  sc_out[f * D + c] = best_sc;
  uint8_t* cd = codes + f * n * D + c;
  for (int64_t i = 0; i < n; ++i)
    cd[i * D] = static_cast<uint8_t>(quant_code(x[i * D], best_lo, best_sc, levels));
}

// Error-feedback codes of channel-axis key rows (key_feedback_codes, veloxquant/key_rounding.h,
// in its fp64 operations and order): one warp per row r = f * n + i of head h = f % H, on frame
// f's grids lo, sc. The row w (fp64) lives in shared memory; every lane computes channel i's step
// alike from one broadcast read, lane 0 writes the code, then each lane updates its own w_j,
// j > i. Codes whose quotient is not finite keep the round-to-nearest code already in codes.
constexpr int kFeedbackWarps = 4;
__global__ void __launch_bounds__(32 * kFeedbackWarps)
    skvq_channel_feedback_kernel(const __grid_constant__ SkvqQuantParams p, const float* t,
                                 const float* lo, const float* sc, uint8_t* codes) {
  extern __shared__ double wsm[];  // [kFeedbackWarps][D]
  const int D = p.head_dim, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kFeedbackWarps + warp;
  if (r >= p.n_rows_total) return;  // a whole warp; the kernel has no block barrier
  const int64_t f = r / p.rows_per_head;
  const double* u = p.key_u + (f % p.n_heads) * D * D;
  const float* lof = lo + f * D;
  const float* scf = sc + f * D;
  double* w = wsm + warp * D;
  for (int c = lane; c < D; c += 32) w[c] = t[r * D + c];
  __syncwarp();
  const double top = p.levels;
  for (int i = 0; i < D; ++i) {
    const double wi = w[i], l = lof[i], s = scf[i];
    const double q = __ddiv_rn(__dsub_rn(wi, l), s);
    if (!isfinite(q)) continue;  // warp-uniform
    double c = rint(q);          // std::nearbyint: ties to even
    c = c < 0.0 ? 0.0 : (c > top ? top : c);
    if (lane == 0) codes[r * D + i] = static_cast<uint8_t>(c);
    const double e = __ddiv_rn(__dsub_rn(wi, __dadd_rn(__dmul_rn(c, s), l)), u[i * D + i]);
    for (int j = i + 1 + lane; j < D; j += 32) w[j] = __dsub_rn(w[j], __dmul_rn(e, u[i * D + j]));
    __syncwarp();
  }
}

// One thread per record byte: record r = f*n + i holds row i's codes (packed as the token
// kernel packs them), zeros up to code_bytes, then metadata slots e = i*n_groups + slot of frame
// f's list (element 2c: lo of channel c, 2c + 1: its scale; zero from 2D on).
__global__ void skvq_channel_pack_kernel(const __grid_constant__ SkvqQuantParams p,
                                         const uint8_t* codes, const float* lo, const float* sc) {
  const int D = p.head_dim, rsb = p.row_stride;
  const int64_t n = p.rows_per_head;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= p.n_rows_total * rsb) return;
  const int64_t r = item / rsb;
  const int byte = static_cast<int>(item % rsb);
  const int64_t f = r / n, i = r % n;
  const MetaType mt = static_cast<MetaType>(p.meta);
  const uint8_t* cr = codes + r * D;
  uint32_t v = 0;
  if (byte < p.packed_bytes) {
    v = packed_code_byte(cr, byte, D, p.bits, p.ternary != 0);
  } else if (byte >= p.code_bytes) {
    const int ms = meta_size(mt);
    const int m = byte - p.code_bytes;
    const int64_t e = i * p.n_groups + m / ms;
    if (e < 2 * static_cast<int64_t>(D)) {
      const float val = (e % 2 == 0) ? lo[f * D + e / 2] : sc[f * D + e / 2];
      v = meta_encode(val, mt) >> (8 * (m % ms));
    }
  }
  p.records[item] = static_cast<uint8_t>(v & 0xffu);
}

void skvq_quantize_channel_launch(const SkvqQuantParams& p, cudaStream_t s) {
  const int64_t D = p.head_dim, rows = p.n_rows_total, n = p.rows_per_head;
  VQ_CHECK(D >= 1 && D <= 1024 && n >= 1 && rows % n == 0,
           "[skvq_quantize_rows] expected head_dim in 1..1024 and whole chunks but got head_dim " +
               std::to_string(D) + ", " + std::to_string(rows) + " rows of chunks of " +
               std::to_string(n));
  const int64_t frames = rows / n;
  // stream-ordered scratch: fp32 rows in stored order, codes, then lo and scale per channel
  const size_t t_bytes = static_cast<size_t>(rows * D) * 4;
  const size_t c_bytes = (static_cast<size_t>(rows * D) + 15) / 16 * 16;
  const size_t m_bytes = static_cast<size_t>(frames * D) * 4;
  void* ws = nullptr;
  VQ_CUDA_CHECK(cudaMallocAsync(&ws, t_bytes + c_bytes + 2 * m_bytes, s));
  float* t = static_cast<float*>(ws);
  uint8_t* codes = static_cast<uint8_t*>(ws) + t_bytes;
  float* lo = reinterpret_cast<float*>(codes + c_bytes);
  float* sc = lo + frames * D;
  VQ_CHECK(rows < (int64_t{1} << 31), "[skvq_quantize_rows] expected fewer rows");
  const int threads = static_cast<int>(std::min<int64_t>(256, (D + 31) / 32 * 32));
  skvq_channel_rows_kernel<<<static_cast<unsigned>(rows), threads, static_cast<size_t>(D) * 4, s>>>(
      p, t);
  VQ_CUDA_LAUNCH_CHECK(skvq_channel_rows_kernel);
  const int64_t items = frames * D;
  skvq_channel_quant_kernel<<<static_cast<unsigned>((items + 127) / 128), 128, 0, s>>>(p, t, codes,
                                                                                       lo, sc);
  VQ_CUDA_LAUNCH_CHECK(skvq_channel_quant_kernel);
  if (p.key_u) {
    const size_t smem = static_cast<size_t>(kFeedbackWarps * D) * sizeof(double);  // <= 32 KB
    skvq_channel_feedback_kernel<<<static_cast<unsigned>((rows + kFeedbackWarps - 1) /
                                                         kFeedbackWarps),
                                   32 * kFeedbackWarps, smem, s>>>(p, t, lo, sc, codes);
    VQ_CUDA_LAUNCH_CHECK(skvq_channel_feedback_kernel);
  }
  const int64_t bytes = rows * p.row_stride;
  VQ_CHECK(bytes / 256 < (int64_t{1} << 31), "[skvq_quantize_rows] expected fewer records");
  skvq_channel_pack_kernel<<<static_cast<unsigned>((bytes + 255) / 256), 256, 0, s>>>(p, codes, lo,
                                                                                      sc);
  VQ_CUDA_LAUNCH_CHECK(skvq_channel_pack_kernel);
  VQ_CUDA_CHECK(cudaFreeAsync(ws, s));
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
  if (p.channel) return skvq_quantize_channel_launch(p, s);
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
