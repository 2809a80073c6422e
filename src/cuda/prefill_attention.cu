// Prefill attention kernel (prefill_attention.cuh): one block of 4 warps per (tile of 16 query
// rows, KV head, batch); the rows of a tile are (query i, head r of the GQA group) pairs ordered
// t = i * n_rep + r, so the n_rep query heads sharing a KV head read each key tile once.
// Keys and values are staged 32 rows at a time in shared memory as fp32 ([32][D + 1]: the pad
// makes lane j's reads of row j conflict-free); packed records are dequantized there
// (code * scale + lo, one rounding each, no FMA: the CPU's dequantize_record values) and put
// back in original channel order. A tile no query row of the block can see (by position and
// window) is skipped before its rows are read. Each warp owns 4 query rows: lane j scores key j
// (fp32 dot product), then an online softmax (running max, expf, fp32 sums) accumulates
// p * v into D/32 outputs per lane. A query that sees no key gets zeros.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>

#include "cuda/check.h"
#include "cuda/prefill_attention.cuh"

namespace vq::cuda {

namespace {

constexpr int kBQ = 16;  // query rows per block
constexpr int kKT = 32;  // key rows per tile
constexpr int kWarps = 4;
constexpr int kRowsPerWarp = kBQ / kWarps;

__device__ __forceinline__ float load_elem(const void* base, int64_t i, int dtype) {
  if (dtype == 0) return static_cast<const float*>(base)[i];
  if (dtype == 1) return __half2float(static_cast<const __half*>(base)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
}

__device__ __forceinline__ float fp8_decode(uint8_t c) {
  const float sign = (c & 0x80u) ? -1.0f : 1.0f;
  const int e = (c >> 3) & 0xf;
  const int m = c & 7;
  if (e == 15 && m == 7) return __int_as_float(0x7fc00000);
  if (e == 0) return sign * ldexpf(static_cast<float>(m), -9);
  return sign * ldexpf(static_cast<float>(8 + m), e - 10);
}

__device__ __forceinline__ float meta_at(const uint8_t* meta, int i, int type) {
  if (type == 0) return __half2float(reinterpret_cast<const __half*>(meta)[i]);
  if (type == 1) return reinterpret_cast<const float*>(meta)[i];
  return fp8_decode(meta[i]);
}

// Stored channel c of a record, dequantized: code * scale + lo in fp32 (two roundings).
__device__ __forceinline__ float dequant(const uint8_t* rec, int c, const PrefillTensor& t) {
  const int b = t.bits;
  const int bit = c * b;
  uint32_t w = rec[bit >> 3];
  if ((bit & 7) + b > 8) w |= static_cast<uint32_t>(rec[(bit >> 3) + 1]) << 8;
  const uint32_t code = (w >> (bit & 7)) & ((1u << b) - 1u);
  const int g = c / t.group_size;
  const uint8_t* meta = rec + t.code_bytes;
  const float lo = meta_at(meta, 2 * g, t.meta);
  const float scale = meta_at(meta, 2 * g + 1, t.meta);
  return __fadd_rn(__fmul_rn(static_cast<float>(code), scale), lo);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32) prefill_kernel(const PrefillParams p) {
  constexpr int DPL = D / 32;  // outputs per lane
  __shared__ float qs[kBQ][D];
  __shared__ float ks[kKT][D + 1];
  __shared__ float vs[kKT][D + 1];
  __shared__ int64_t ps[kKT];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t n_rep = p.n_rep, N = p.n_queries;
  const int64_t T = n_rep * N;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kBQ;
  const int64_t hq = static_cast<int64_t>(p.kv_heads) * n_rep;
  const int64_t frame = static_cast<int64_t>(b) * p.kv_heads + h;

  for (int e = tid; e < kBQ * D; e += kWarps * 32) {
    const int r = e / D, d = e % D;
    const int64_t t = t0 + r;
    float x = 0.0f;
    if (t < T) {
      const int64_t i = t / n_rep, qh = static_cast<int64_t>(h) * n_rep + t % n_rep;
      x = p.q[((static_cast<int64_t>(b) * hq + qh) * N + i) * D + d];
    }
    qs[r][d] = x;
  }
  const int64_t t_last = (t0 + kBQ < T ? t0 + kBQ : T) - 1;
  const int64_t qmin = p.q_pos0 + t0 / n_rep, qmax = p.q_pos0 + t_last / n_rep;

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][DPL];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    m[k] = -INFINITY;
    l[k] = 0.0f;
#pragma unroll
    for (int c = 0; c < DPL; ++c) acc[k][c] = 0.0f;
  }

  for (int sg = 0; sg < p.n_segs; ++sg) {
    const PrefillSeg& seg = p.segs[sg];
    const int64_t cap = seg.capacity;
    for (int64_t j0 = 0; j0 < seg.n_rows; j0 += kKT) {
      const int nt = static_cast<int>(seg.n_rows - j0 < kKT ? seg.n_rows - j0 : kKT);
      int flag = 0;
      if (tid < kKT) {
        int64_t kp = LLONG_MAX;
        if (tid < nt)
          kp = seg.positions ? seg.positions[frame * cap + j0 + tid] : seg.first_pos + j0 + tid;
        ps[tid] = kp;
        flag = kp <= qmax && (p.window <= 0 || qmin < kp + p.window);
      }
      if (!__syncthreads_or(flag)) continue;  // no row of this block sees this tile

      const int64_t row0 = frame * cap + j0;
      for (int e = tid; e < kKT * D; e += kWarps * 32) {
        const int r = e / D, c = e % D;
        float kx = 0.0f, vx = 0.0f;
        int kc = c, vc = c;
        if (r < nt) {
          if (seg.packed) {
            kx = dequant(seg.pk.data + (row0 + r) * seg.pk.row_stride, c, seg.pk);
            vx = dequant(seg.pv.data + (row0 + r) * seg.pv.row_stride, c, seg.pv);
            if (seg.pk.perm) kc = seg.pk.perm[h * D + c];
            if (seg.pv.perm) vc = seg.pv.perm[h * D + c];
          } else {
            kx = load_elem(seg.keys, (row0 + r) * D + c, seg.dtype);
            vx = load_elem(seg.values, (row0 + r) * D + c, seg.dtype);
          }
        }
        ks[r][kc] = kx;
        vs[r][vc] = vx;
      }
      __syncthreads();

#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) {
        const int r = warp * kRowsPerWarp + k;
        const int64_t t = t0 + r;
        if (t >= T) continue;  // warp-uniform
        const int64_t qp = p.q_pos0 + t / n_rep;
        const int64_t kp = ps[lane];
        const bool vis = kp <= qp && (p.window <= 0 || qp < kp + p.window);
        float dot = 0.0f;
#pragma unroll 16
        for (int d = 0; d < D; ++d) dot = fmaf(qs[r][d], ks[lane][d], dot);
        const float s = vis ? dot * p.scale : -INFINITY;
        const float mx = warp_max(s);
        if (mx == -INFINITY) continue;  // nothing visible to this row in this tile
        const float m_new = fmaxf(m[k], mx);
        const float corr = expf(m[k] - m_new);
        const float pj = vis ? expf(s - m_new) : 0.0f;
        l[k] = l[k] * corr + warp_sum(pj);
#pragma unroll
        for (int c = 0; c < DPL; ++c) acc[k][c] *= corr;
        for (int j = 0; j < nt; ++j) {
          const float pjj = __shfl_sync(0xffffffffu, pj, j);
#pragma unroll
          for (int c = 0; c < DPL; ++c) acc[k][c] = fmaf(pjj, vs[j][lane + 32 * c], acc[k][c]);
        }
        m[k] = m_new;
      }
      __syncthreads();
    }
  }

#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int r = warp * kRowsPerWarp + k;
    const int64_t t = t0 + r;
    if (t >= T) continue;
    const int64_t i = t / n_rep, qh = static_cast<int64_t>(h) * n_rep + t % n_rep;
    float* o = p.out + ((static_cast<int64_t>(b) * hq + qh) * N + i) * D;
    const float inv = l[k] > 0.0f ? 1.0f / l[k] : 0.0f;
#pragma unroll
    for (int c = 0; c < DPL; ++c) o[lane + 32 * c] = l[k] > 0.0f ? acc[k][c] * inv : 0.0f;
  }
}

}  // namespace

void prefill_attention_launch(const PrefillParams& p, cudaStream_t s) {
  const int64_t T = static_cast<int64_t>(p.n_rep) * p.n_queries;
  if (T <= 0) return;
  const dim3 grid(static_cast<unsigned>((T + kBQ - 1) / kBQ), static_cast<unsigned>(p.kv_heads),
                  static_cast<unsigned>(p.batch));
  if (p.head_dim == 64)
    prefill_kernel<64><<<grid, kWarps * 32, 0, s>>>(p);
  else
    prefill_kernel<128><<<grid, kWarps * 32, 0, s>>>(p);
  VQ_CUDA_LAUNCH_CHECK("prefill_attention");
}

}  // namespace vq::cuda
