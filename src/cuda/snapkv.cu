// SnapKV kernels (see snapkv.cuh).
//
// Scores of f16 keys (D 64/128, W = n_rep * w <= 128 window rows): snap_tc_kernel, the same two
// passes and combine as below with the logits on tensor cores (mma.m16n8k16, queries as fp16
// hi + lo of q * 2^sigma: exact products, fp32 accumulation), one block of ceil(W / 16) warps per
// 8 key tiles of 64 rows streamed by cp.async (swizzled fp16 rows, ldmatrix), the query
// fragments loaded once per block; pass 2 sums every window row's probability of a key in double
// (shuffles across the warp, then the warps) and divides by W once. Its query fragments and
// logits are tc_common.cuh's helpers (shared with the prefill kernel).
// Scores of other keys (CUDA cores), two passes over (key tile of 64 rows) x (query chunk of 32
// rows) logit tiles staged in shared memory (fp32, rows padded to D + 4 floats so 16-byte reads of
// 8 consecutive rows hit distinct banks), each thread a 2 x 4 (query x key) block with sequential
// fp32 dot products:
//   pass 1: per query row and key tile, max and sum of exp (fp32; 8 threads per row, joined by
//           shuffles; the logit tile's rows padded to 72 floats), and a NaN flag;
//   combine: a block per (query row, frame): M = max, Z = sum_t z_t exp(m_t - M) (double, strided
//            over the threads, then warp and block sums), 1/Z; +inf max or a NaN logit poisons the
//            frame (the CPU gives NaN scores then);
//   pass 2: per key, p = exp(l - M) * (1/Z), summed per query head in double, then the mean of
//           the per-head means, rounded once to fp32 (the CPU's order of operations).
// Selection: one block of 1024 threads per frame: radix select of the k-th largest ranking key
// (NaN -> -inf, -0 -> +0, mapped to an order-preserving uint32) in four 8-bit passes (lanes of a
// warp with the same digit add to the shared histogram once, __match_any_sync; the digit is found
// by one warp's scan of the 256 bins), then an ascending compaction (block scans) of the rows
// above it plus the first rows equal to it.
#include <cub/block/block_scan.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "cuda/check.h"
#include "cuda/snapkv.cuh"
#include "cuda/tc_common.cuh"

namespace vq::cuda {

namespace {

constexpr int kKT = 64;  // keys per tile
constexpr int kQT = 32;  // query rows per chunk
// Row stride of the logit tile: 72 = 8 (mod 32) banks, so 4 rows x 8 consecutive keys (the stats
// pass) and 2 rows x 16 keys (the logit writes) each hit 32 distinct banks.
constexpr int kLS = 72;
constexpr int kScoreThreads = 256;
constexpr int kSelThreads = 1024;
static_assert(kScoreThreads == 8 * kQT, "the stats pass uses 8 threads per query row");

__device__ __forceinline__ float load_key(const void* base, int dtype, int64_t i) {
  if (dtype == 1) return __half2float(static_cast<const __half*>(base)[i]);
  if (dtype == 2)
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16);
  return static_cast<const float*>(base)[i];
}

// Query row i (0..W-1) of frame f.
__device__ __forceinline__ float load_query(const SnapScoreParams& p, int f, int i, int d) {
  if (p.queries) return p.queries[(static_cast<int64_t>(f) * p.n_rep * p.w + i) * p.head_dim + d];
  const int64_t row = p.n - p.w + i;  // key proxy: the last w key rows
  return load_key(p.keys, p.dtype, (static_cast<int64_t>(f) * p.n + row) * p.head_dim + d);
}

// Fills L[kQT][kKT] with the scaled, masked logits of query chunk qc and key tile j0 of frame f.
__device__ void logit_tile(const SnapScoreParams& p, int f, int qc, int64_t j0, float* Ks,
                           float* Qs, float* L) {
  const int D = p.head_dim, DP = D + 4, W = p.n_rep * p.w;
  const int tid = threadIdx.x;
  const int nk = static_cast<int>(p.n - j0 < kKT ? p.n - j0 : kKT);
  const int nq = W - qc * kQT < kQT ? W - qc * kQT : kQT;
  if (p.dtype == 1 && D % 8 == 0 && reinterpret_cast<uintptr_t>(p.keys) % 16 == 0) {
    // f16 keys: 8 per 16-byte load (every row starts 16-byte aligned)
    const int D8 = D / 8;
    const uint4* src =
        reinterpret_cast<const uint4*>(static_cast<const __half*>(p.keys) + (f * p.n + j0) * D);
    for (int i = tid; i < kKT * D8; i += kScoreThreads) {
      const int r = i / D8, c = 8 * (i % D8);
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if (r < nk) u = src[i];
      const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
      const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
      const float2 c2 = __half22float2(*reinterpret_cast<const __half2*>(&u.z));
      const float2 d2 = __half22float2(*reinterpret_cast<const __half2*>(&u.w));
      float4* dst = reinterpret_cast<float4*>(Ks + r * DP + c);
      dst[0] = make_float4(a.x, a.y, b.x, b.y);
      dst[1] = make_float4(c2.x, c2.y, d2.x, d2.y);
    }
  } else {
    for (int i = tid; i < kKT * D; i += kScoreThreads) {
      const int r = i / D, c = i % D;
      Ks[r * DP + c] =
          r < nk ? load_key(p.keys, p.dtype, (static_cast<int64_t>(f) * p.n + j0 + r) * D + c)
                 : 0.0f;
    }
  }
  for (int i = tid; i < kQT * D; i += kScoreThreads) {
    const int r = i / D, c = i % D;
    Qs[r * DP + c] = r < nq ? load_query(p, f, qc * kQT + r, c) : 0.0f;
  }
  __syncthreads();
  const int tq = tid / 16, tk = tid % 16;  // queries 2tq, 2tq+1; keys tk + 16m
  float acc[2][4] = {};
  const float* q0 = Qs + (2 * tq) * DP;
  const float* q1 = q0 + DP;
  for (int d = 0; d < D; d += 4) {
    const float4 a = *reinterpret_cast<const float4*>(q0 + d);
    const float4 b = *reinterpret_cast<const float4*>(q1 + d);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const float4 k = *reinterpret_cast<const float4*>(Ks + (tk + 16 * m) * DP + d);
      acc[0][m] = fmaf(a.x, k.x, acc[0][m]);
      acc[0][m] = fmaf(a.y, k.y, acc[0][m]);
      acc[0][m] = fmaf(a.z, k.z, acc[0][m]);
      acc[0][m] = fmaf(a.w, k.w, acc[0][m]);
      acc[1][m] = fmaf(b.x, k.x, acc[1][m]);
      acc[1][m] = fmaf(b.y, k.y, acc[1][m]);
      acc[1][m] = fmaf(b.z, k.z, acc[1][m]);
      acc[1][m] = fmaf(b.w, k.w, acc[1][m]);
    }
  }
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int qi = 2 * tq + a, kj = tk + 16 * m;
      float l = acc[a][m] * p.scale;
      if (kj >= nk || qi >= nq) {
        l = -INFINITY;
      } else if (p.key_pos) {
        const int qrow = (qc * kQT + qi) % p.w;
        if (p.key_pos[static_cast<int64_t>(f) * p.n + j0 + kj] > p.query_pos[qrow]) l = -INFINITY;
      }
      L[qi * kLS + kj] = l;
    }
  __syncthreads();
}

__global__ void __launch_bounds__(kScoreThreads)
    snap_pass1_kernel(const __grid_constant__ SnapScoreParams p) {
  extern __shared__ __align__(16) float sm[];
  const int DP = p.head_dim + 4, W = p.n_rep * p.w;
  float* Ks = sm;
  float* Qs = Ks + kKT * DP;
  float* L = Qs + kQT * DP;
  const int tile = blockIdx.x, f = blockIdx.y;
  const int n_tiles = gridDim.x;
  const int64_t j0 = static_cast<int64_t>(tile) * kKT;
  for (int qc = 0; qc * kQT < W; ++qc) {
    logit_tile(p, f, qc, j0, Ks, Qs, L);
    // 8 threads per query row, each over keys sub, sub + 8, ...; a 3-step butterfly joins them
    const int row = threadIdx.x >> 3, sub = threadIdx.x & 7;
    float m = -INFINITY;
    int nan = 0;
    for (int j = sub; j < kKT; j += 8) {
      const float l = L[row * kLS + j];
      nan |= isnan(l) ? 1 : 0;
      m = fmaxf(m, l);
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    float z = 0.0f;
    if (m != -INFINITY && !isinf(m))
      for (int j = sub; j < kKT; j += 8) z += expf(L[row * kLS + j] - m);
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
    if (sub == 0 && qc * kQT + row < W) {
      float* st =
          p.tile_stats + ((static_cast<int64_t>(f) * n_tiles + tile) * W + qc * kQT + row) * 3;
      st[0] = m;
      st[1] = z;
      st[2] = nan ? 1.0f : 0.0f;
    }
    __syncthreads();
  }
}

// One block per (query row i, frame f): max, NaN flag and the double sum over the tiles,
// strided over the threads and joined by warp and block reductions.
constexpr int kCombineThreads = 256;
__global__ void __launch_bounds__(kCombineThreads)
    snap_combine_kernel(const __grid_constant__ SnapScoreParams p, int n_tiles) {
  __shared__ float s_mx[kCombineThreads / 32];
  __shared__ int s_nan[kCombineThreads / 32];
  __shared__ double s_z[kCombineThreads / 32];
  const int W = p.n_rep * p.w;
  const int i = blockIdx.x, f = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* st = p.tile_stats + (static_cast<int64_t>(f) * n_tiles * W + i) * 3;
  const int64_t stride = static_cast<int64_t>(W) * 3;
  float mx = -INFINITY;
  int nan = 0;
  for (int t = tid; t < n_tiles; t += kCombineThreads) {
    mx = fmaxf(mx, st[t * stride]);
    nan |= st[t * stride + 2] != 0.0f ? 1 : 0;
  }
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    nan |= __shfl_xor_sync(0xffffffffu, nan, o);
  }
  if (lane == 0) {
    s_mx[warp] = mx;
    s_nan[warp] = nan;
  }
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kCombineThreads / 32; ++w) {
    mx = fmaxf(mx, s_mx[w]);
    nan |= s_nan[w];
  }
  double z = 0.0;
  if (mx != -INFINITY && !isinf(mx))
    for (int t = tid; t < n_tiles; t += kCombineThreads) {
      const float m = st[t * stride];
      if (m == -INFINITY) continue;
      z += static_cast<double>(st[t * stride + 1]) * static_cast<double>(expf(m - mx));
    }
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
  if (lane == 0) s_z[warp] = z;
  __syncthreads();
  if (tid == 0) {
    z = 0.0;
#pragma unroll
    for (int w = 0; w < kCombineThreads / 32; ++w) z += s_z[w];
    if (nan || mx == INFINITY) atomicOr(p.poisoned + f, 1);
    p.row_stats[(static_cast<int64_t>(f) * W + i) * 2] = mx;
    p.row_stats[(static_cast<int64_t>(f) * W + i) * 2 + 1] =
        z > 0.0 ? static_cast<float>(1.0 / z) : 0.0f;
  }
}

__global__ void __launch_bounds__(kScoreThreads)
    snap_pass2_kernel(const __grid_constant__ SnapScoreParams p) {
  extern __shared__ __align__(16) float sm[];
  const int DP = p.head_dim + 4, W = p.n_rep * p.w;
  float* Ks = sm;
  float* Qs = Ks + kKT * DP;
  float* L = Qs + kQT * DP;
  const int tile = blockIdx.x, f = blockIdx.y;
  const int64_t j0 = static_cast<int64_t>(tile) * kKT;
  const int j = threadIdx.x;
  double total = 0.0, head = 0.0;  // thread j < kKT: key j0 + j
  int cur_head = 0;
  for (int qc = 0; qc * kQT < W; ++qc) {
    logit_tile(p, f, qc, j0, Ks, Qs, L);
    if (j < kKT) {
      for (int i = 0; i < kQT && qc * kQT + i < W; ++i) {
        const int qi = qc * kQT + i;
        const int r = qi / p.w;
        if (r != cur_head) {  // query rows are head-major: close the previous head's mean
          total += head / static_cast<double>(p.w);
          head = 0.0;
          cur_head = r;
        }
        const float mx = p.row_stats[(static_cast<int64_t>(f) * W + qi) * 2];
        if (mx == -INFINITY) continue;  // a query that sees no key adds nothing
        const float inv_z = p.row_stats[(static_cast<int64_t>(f) * W + qi) * 2 + 1];
        head += static_cast<double>(expf(L[i * kLS + j] - mx) * inv_z);
      }
    }
    __syncthreads();
  }
  if (j < kKT && j0 + j < p.n) {
    float score;
    if (p.poisoned[f]) {
      score = __uint_as_float(0x7fc00000u);
    } else if (p.n_rep > 1) {
      total += head / static_cast<double>(p.w);
      score = static_cast<float>(total / static_cast<double>(p.n_rep));
    } else {
      score = static_cast<float>(head / static_cast<double>(p.w));
    }
    p.scores[static_cast<int64_t>(f) * p.n + j0 + j] = score;
  }
}

// ---- tensor-core scores (f16 keys, D 64/128, at most 128 window rows) ---------------------------

constexpr int kTcTiles = 8;  // 64-key tiles per block

// Both passes. Block = ceil(W / 16) warps over kTcTiles key tiles of frame f; warp w owns window
// rows 16 w .. 16 w + 15 (lane rows A = g, B = g + 8), its queries held as fp16 hi + lo
// fragments of q * 2^sigma (sigma puts the row's max |q| in [2^11, 2^12): exact products, q
// carried to 2^-22 relative). Logits of 16 rows x 64 keys on mma.m16n8k16 (fp32 accumulation),
// times scale * 2^-sigma (exactly the fp32 product acc * scale), masked by position.
//   PASS2 = false: per (tile, row) max, sum of expf(l - max) (fp32, 64 terms) and a NaN flag;
//   PASS2 = true: per key, the double sum over all W rows of expf(l - M_i) * (1 / Z_i), divided
//   by W (= the mean over heads of the per-head means: every head has w rows), rounded once.
template <int D, bool PASS2>
__global__ void __launch_bounds__(256) snap_tc_kernel(const __grid_constant__ SnapScoreParams p) {
  constexpr int KS = D / 16;
  constexpr int SB = kKT * D * 2;  // bytes of a staged tile
  extern __shared__ __align__(128) uint8_t tsm[];
  double* red = reinterpret_cast<double*>(tsm + 2 * SB);  // [warps][kKT]
  const int W = p.n_rep * p.w;
  const int nthr = blockDim.x, nw = nthr >> 5;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int f = blockIdx.y;
  const int n_tiles = static_cast<int>((p.n + kKT - 1) / kKT);
  const int tile0 = blockIdx.x * kTcTiles;
  const int my_tiles = n_tiles - tile0 < kTcTiles ? n_tiles - tile0 : kTcTiles;
  const int rA = warp * 16 + g, rB = rA + 8;
  const bool vA = rA < W, vB = rB < W;

  uint32_t qh[KS][4], ql[KS][4];
  float cA, cB;
  {
    const auto load = [&](int row, int c) {
      const int r = row ? rB : rA;
      return (row ? vB : vA) ? make_float2(load_query(p, f, r, c), load_query(p, f, r, c + 1))
                             : make_float2(0.0f, 0.0f);
    };
    int eA, eB;
    tc_query_frags<D, true>(load, t4, qh, ql, eA, eB);
    cA = ldexpf(p.scale, -eA);
    cB = ldexpf(p.scale, -eB);
  }
  const int32_t qpA = (p.key_pos && vA) ? p.query_pos[rA % p.w] : 0;
  const int32_t qpB = (p.key_pos && vB) ? p.query_pos[rB % p.w] : 0;
  float MA = -INFINITY, MB = -INFINITY, zA = 0.0f, zB = 0.0f;
  if (PASS2) {
    if (vA) {
      MA = p.row_stats[(static_cast<int64_t>(f) * W + rA) * 2];
      zA = p.row_stats[(static_cast<int64_t>(f) * W + rA) * 2 + 1];
    }
    if (vB) {
      MB = p.row_stats[(static_cast<int64_t>(f) * W + rB) * 2];
      zB = p.row_stats[(static_cast<int64_t>(f) * W + rB) * 2 + 1];
    }
  }
  const bool poisoned = PASS2 && p.poisoned[f] != 0;

  const __half* keys = static_cast<const __half*>(p.keys) + static_cast<int64_t>(f) * p.n * D;
  auto issue = [&](int tt, int st) {
    const int64_t j0 = static_cast<int64_t>(tile0 + tt) * kKT;
    const int nk = static_cast<int>(p.n - j0 < kKT ? p.n - j0 : kKT);
    constexpr int CPR = D / 8;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(keys + j0 * D);
    for (int i = tid; i < nk * CPR; i += nthr)
      tc_cp16(tsm + st * SB + tc_off<D>(i / CPR, 8 * (i % CPR)), src + 16 * i);
  };
  if (my_tiles > 0) issue(0, 0);
  tc_commit();
  for (int tt = 0; tt < my_tiles; ++tt) {
    const int st = tt & 1;
    if (tt + 1 < my_tiles) issue(tt + 1, st ^ 1);
    tc_commit();
    if (tt + 1 < my_tiles)
      tc_wait<1>();
    else
      tc_wait<0>();
    __syncthreads();
    const int tile = tile0 + tt;
    const int64_t j0 = static_cast<int64_t>(tile) * kKT;
    const int nk = static_cast<int>(p.n - j0 < kKT ? p.n - j0 : kKT);
    const uint8_t* base = tsm + st * SB;
    float s[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
    if (warp * 16 < W) tc_logits64<D, true>(base, nullptr, qh, ql, lane, s);  // warp-uniform
    // scaled, masked logits; NaN flags per row
    int nanA = 0, nanB = 0;
    float xA = -INFINITY, xB = -INFINITY;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kj = 8 * n + 2 * t4 + (e & 1);
        const bool rowB = e >= 2;
        float l = s[n][e] * (rowB ? cB : cA);
        if (kj >= nk || !(rowB ? vB : vA)) {
          l = -INFINITY;
        } else if (p.key_pos) {
          if (p.key_pos[static_cast<int64_t>(f) * p.n + j0 + kj] > (rowB ? qpB : qpA))
            l = -INFINITY;
        }
        s[n][e] = l;
        if (rowB) {
          nanB |= isnan(l) ? 1 : 0;
          xB = fmaxf(xB, l);
        } else {
          nanA |= isnan(l) ? 1 : 0;
          xA = fmaxf(xA, l);
        }
      }
    if (!PASS2) {
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        xA = fmaxf(xA, __shfl_xor_sync(0xffffffffu, xA, o));
        xB = fmaxf(xB, __shfl_xor_sync(0xffffffffu, xB, o));
        nanA |= __shfl_xor_sync(0xffffffffu, nanA, o);
        nanB |= __shfl_xor_sync(0xffffffffu, nanB, o);
      }
      float sA = 0.0f, sB = 0.0f;
      const bool okA = !isinf(xA), okB = !isinf(xB);
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        if (okA) sA += expf(s[n][0] - xA) + expf(s[n][1] - xA);
        if (okB) sB += expf(s[n][2] - xB) + expf(s[n][3] - xB);
      }
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        sA += __shfl_xor_sync(0xffffffffu, sA, o);
        sB += __shfl_xor_sync(0xffffffffu, sB, o);
      }
      if (t4 == 0) {
        float* sa = p.tile_stats + ((static_cast<int64_t>(f) * n_tiles + tile) * W + rA) * 3;
        if (vA) {
          sa[0] = xA;
          sa[1] = sA;
          sa[2] = nanA ? 1.0f : 0.0f;
        }
        if (vB) {
          sa[24] = xB;  // row rB = rA + 8: 8 rows of 3 floats further
          sa[25] = sB;
          sa[26] = nanB ? 1.0f : 0.0f;
        }
      }
    } else {
      double acc[8][2];
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pa = MA == -INFINITY ? 0.0f : expf(s[n][e] - MA) * zA;
          const float pb = MB == -INFINITY ? 0.0f : expf(s[n][2 + e] - MB) * zB;
          acc[n][e] = static_cast<double>(pa) + static_cast<double>(pb);
        }
#pragma unroll
      for (int o = 4; o <= 16; o <<= 1)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) acc[n][e] += __shfl_xor_sync(0xffffffffu, acc[n][e], o);
      if (g == 0)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) red[warp * kKT + 8 * n + 2 * t4 + e] = acc[n][e];
      __syncthreads();
      for (int k = tid; k < nk; k += nthr) {
        double tot = 0.0;
        for (int w = 0; w < nw; ++w) tot += red[w * kKT + k];
        p.scores[static_cast<int64_t>(f) * p.n + j0 + k] =
            poisoned ? __uint_as_float(0x7fc00000u) : static_cast<float>(tot / W);
      }
    }
    __syncthreads();  // the stage and red are free again
  }
}

bool snap_tc_eligible(const SnapScoreParams& p) {
  const int W = p.n_rep * p.w;
  return p.dtype == 1 && (p.head_dim == 64 || p.head_dim == 128) && W >= 1 && W <= 128 &&
         reinterpret_cast<uintptr_t>(p.keys) % 16 == 0;
}

template <int D>
void snap_tc_scores(const SnapScoreParams& p, cudaStream_t s) {
  const int n_tiles = static_cast<int>((p.n + kKT - 1) / kKT);
  const int W = p.n_rep * p.w;
  const int threads = 32 * ((W + 15) / 16);
  const int smem = 2 * kKT * D * 2 + (threads / 32) * kKT * 8;
  VQ_CUDA_CHECK(cudaFuncSetAttribute(snap_tc_kernel<D, false>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  VQ_CUDA_CHECK(cudaFuncSetAttribute(snap_tc_kernel<D, true>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  VQ_CUDA_CHECK(cudaMemsetAsync(p.poisoned, 0, static_cast<size_t>(p.n_frames) * 4, s));
  const dim3 grid(static_cast<unsigned>((n_tiles + kTcTiles - 1) / kTcTiles),
                  static_cast<unsigned>(p.n_frames));
  snap_tc_kernel<D, false><<<grid, threads, smem, s>>>(p);
  VQ_CUDA_LAUNCH_CHECK(snap_tc_kernel);
  snap_combine_kernel<<<dim3(static_cast<unsigned>(W), static_cast<unsigned>(p.n_frames)),
                        kCombineThreads, 0, s>>>(p, n_tiles);
  VQ_CUDA_LAUNCH_CHECK(snap_combine_kernel);
  snap_tc_kernel<D, true><<<grid, threads, smem, s>>>(p);
  VQ_CUDA_LAUNCH_CHECK(snap_tc_kernel);
}

// Order-preserving uint32 of the ranking key (NaN -> -inf, -0 -> +0).
__device__ __forceinline__ uint32_t rank_bits(float s) {
  if (isnan(s)) s = -INFINITY;
  if (s == 0.0f) s = 0.0f;
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kSelThreads)
    snap_select_kernel(const __grid_constant__ SnapSelectParams_ p) {
  using Scan = cub::BlockScan<int, kSelThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_krem;
  const int f = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
  const float* sc = p.scores + static_cast<int64_t>(f) * p.n;
  int32_t* out = p.out + static_cast<int64_t>(f) * p.count;
  for (int64_t j = tid; j < p.n_prefix; j += kSelThreads) out[j] = static_cast<int32_t>(j);
  const int64_t n_tail = p.n - p.tail0;
  for (int64_t j = tid; j < n_tail; j += kSelThreads)
    out[p.n_prefix + p.k + j] = static_cast<int32_t>(p.tail0 + j);
  if (p.k <= 0) return;

  uint32_t prefix = 0, mask = 0;
  if (tid == 0) s_krem = static_cast<int>(p.k);
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = tid; i < 256; i += kSelThreads) hist[i] = 0;
    __syncthreads();
    // every thread runs every chunk (uniform trip count): lanes with the same digit add once
    for (int64_t c = p.lo; c < p.hi; c += kSelThreads) {
      const int64_t j = c + tid;
      const uint32_t key = j < p.hi ? rank_bits(sc[j]) : 0u;
      const bool in = j < p.hi && (key & mask) == prefix;
      const int bin = in ? static_cast<int>((key >> shift) & 255u) : 256;
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (in && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
    }
    __syncthreads();
    if (tid < 32) {  // the digit holding the krem-th largest: lane l owns bins 255-8l .. 248-8l
      int loc[8], sum = 0;
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        loc[q] = hist[255 - 8 * lane - q];
        sum += loc[q];
      }
      int incl = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const int total = __shfl_sync(0xffffffffu, incl, 31);
      const int krem = s_krem, excl = incl - sum;
      const unsigned hit = __ballot_sync(0xffffffffu, excl < krem && incl >= krem);
      if (hit == 0u) {  // cannot happen (krem <= matching keys); the serial scan's fallback
        if (lane == 0) {
          s_krem = krem - total;
          s_prefix = prefix;
        }
      } else if (lane == __ffs(hit) - 1) {
        int cum = excl, digit = 0;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          if (cum + loc[q] >= krem) {
            digit = 255 - 8 * lane - q;
            break;
          }
          cum += loc[q];
        }
        s_krem = krem - cum;
        s_prefix = prefix | (static_cast<uint32_t>(digit) << shift);
      }
    }
    __syncthreads();
    prefix = s_prefix;
    mask |= 255u << shift;
  }
  const uint32_t thr = prefix;
  const int quota = s_krem;  // rows equal to the threshold to take, lowest index first
  int base = 0, eq_seen = 0;
  for (int64_t c = p.lo; c < p.hi; c += kSelThreads) {
    const int64_t j = c + tid;
    const uint32_t key = j < p.hi ? rank_bits(sc[j]) : 0u;
    const int above = (j < p.hi && key > thr) ? 1 : 0;
    const int eq = (j < p.hi && key == thr) ? 1 : 0;
    int eq_rank, eq_total;
    Scan(scan_tmp).ExclusiveSum(eq, eq_rank, eq_total);
    __syncthreads();
    const int take = (above || (eq && eq_seen + eq_rank < quota)) ? 1 : 0;
    int pos, take_total;
    Scan(scan_tmp).ExclusiveSum(take, pos, take_total);
    __syncthreads();
    if (take) out[p.n_prefix + base + pos] = static_cast<int32_t>(j);
    base += take_total;
    eq_seen += eq_total;
  }
}

__global__ void snap_pool_kernel(const float* in, int64_t n, int64_t lo, int64_t hi, int64_t kernel,
                                 int kind, float* out) {
  const int f = blockIdx.y;
  const int64_t j = lo + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= hi) return;
  const float* x = in + static_cast<int64_t>(f) * n;
  const int64_t half = kernel / 2;
  const int64_t a = j - half > lo ? j - half : lo;
  const int64_t b = j + half + 1 < hi ? j + half + 1 : hi;
  if (kind == 0) {  // max, NaN ranked -inf (NaN only if every neighbour is NaN)
    float m = __uint_as_float(0x7fc00000u);
    for (int64_t t = a; t < b; ++t)
      if (!isnan(x[t]) && (isnan(m) || x[t] > m)) m = x[t];
    out[static_cast<int64_t>(f) * n + j] = m;
  } else {
    double s = 0.0;
    for (int64_t t = a; t < b; ++t) s += static_cast<double>(x[t]);
    out[static_cast<int64_t>(f) * n + j] = static_cast<float>(s / static_cast<double>(b - a));
  }
}

__global__ void gather_kernel(const uint8_t* src, int64_t n, int64_t row_bytes, const int32_t* idx,
                              int64_t count, uint8_t* dst, const int32_t* src_pos,
                              int32_t first_pos, int32_t* dst_pos, bool vec16) {
  const int f = blockIdx.y;
  const int64_t i = blockIdx.x;  // output row
  const int64_t j = idx[static_cast<int64_t>(f) * count + i];
  const uint8_t* s = src + (static_cast<int64_t>(f) * n + j) * row_bytes;
  uint8_t* d = dst + (static_cast<int64_t>(f) * count + i) * row_bytes;
  if (vec16) {
    for (int64_t b = threadIdx.x; b < row_bytes / 16; b += blockDim.x)
      reinterpret_cast<uint4*>(d)[b] = reinterpret_cast<const uint4*>(s)[b];
  } else {
    for (int64_t b = threadIdx.x; b < row_bytes; b += blockDim.x) d[b] = s[b];
  }
  if (dst_pos && threadIdx.x == 0)
    dst_pos[static_cast<int64_t>(f) * count + i] =
        src_pos ? src_pos[static_cast<int64_t>(f) * n + j] : first_pos + static_cast<int32_t>(j);
}

}  // namespace

int64_t snap_score_tile_stats_floats(int64_t n_frames, int64_t n, int64_t W) {
  return n_frames * ((n + kKT - 1) / kKT) * W * 3;
}

void snap_scores_launch(const SnapScoreParams& p, cudaStream_t s) {
  if (p.n == 0 || p.n_frames == 0) return;
  if (snap_tc_eligible(p)) {
    if (p.head_dim == 64)
      snap_tc_scores<64>(p, s);
    else
      snap_tc_scores<128>(p, s);
    return;
  }
  const int n_tiles = static_cast<int>((p.n + kKT - 1) / kKT);
  const size_t smem = static_cast<size_t>((kKT + kQT) * (p.head_dim + 4) + kQT * kLS) * 4;
  VQ_CHECK(p.head_dim % 4 == 0 && smem <= 200 * 1024,
           "[snap_scores] expected head_dim a multiple of 4 and at most 256 but got " +
               std::to_string(p.head_dim));
  VQ_CUDA_CHECK(cudaFuncSetAttribute(snap_pass1_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
  VQ_CUDA_CHECK(cudaFuncSetAttribute(snap_pass2_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
  VQ_CUDA_CHECK(cudaMemsetAsync(p.poisoned, 0, static_cast<size_t>(p.n_frames) * 4, s));
  const dim3 grid(static_cast<unsigned>(n_tiles), static_cast<unsigned>(p.n_frames));
  snap_pass1_kernel<<<grid, kScoreThreads, smem, s>>>(p);
  VQ_CUDA_LAUNCH_CHECK(snap_pass1_kernel);
  const int W = p.n_rep * p.w;
  snap_combine_kernel<<<dim3(static_cast<unsigned>(W), static_cast<unsigned>(p.n_frames)),
                        kCombineThreads, 0, s>>>(p, n_tiles);
  VQ_CUDA_LAUNCH_CHECK(snap_combine_kernel);
  snap_pass2_kernel<<<grid, kScoreThreads, smem, s>>>(p);
  VQ_CUDA_LAUNCH_CHECK(snap_pass2_kernel);
}

void snap_select_launch(const SnapSelectParams_& p, cudaStream_t s) {
  if (p.n_frames == 0 || p.count == 0) return;
  VQ_CHECK(p.hi - p.lo < (int64_t{1} << 31), "[snap_select] expected fewer than 2^31 rows");
  snap_select_kernel<<<static_cast<unsigned>(p.n_frames), kSelThreads, 0, s>>>(p);
  VQ_CUDA_LAUNCH_CHECK(snap_select_kernel);
}

void snap_pool_launch(const float* in, int64_t n_frames, int64_t n, int64_t lo, int64_t hi,
                      int64_t kernel, int kind, float* out, cudaStream_t s) {
  if (hi <= lo || n_frames == 0) return;
  const dim3 grid(static_cast<unsigned>((hi - lo + 255) / 256), static_cast<unsigned>(n_frames));
  snap_pool_kernel<<<grid, 256, 0, s>>>(in, n, lo, hi, kernel, kind, out);
  VQ_CUDA_LAUNCH_CHECK(snap_pool_kernel);
}

void gather_rows_launch(const void* src, int64_t n_frames, int64_t n, int64_t row_bytes,
                        const int32_t* idx, int64_t count, void* dst, const int32_t* src_pos,
                        int32_t first_pos, int32_t* dst_pos, cudaStream_t s) {
  if (n_frames == 0 || count == 0) return;
  const bool vec16 = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(count), static_cast<unsigned>(n_frames));
  gather_kernel<<<grid, 64, 0, s>>>(static_cast<const uint8_t*>(src), n, row_bytes, idx, count,
                                    static_cast<uint8_t*>(dst), src_pos, first_pos, dst_pos, vec16);
  VQ_CUDA_LAUNCH_CHECK(gather_kernel);
}

}  // namespace vq::cuda
