// Prefill attention (prefill_attention.cuh), two paths:
// * Tensor cores (views whose full-precision segments are all f16 or all bf16 rows, beside any
//   packed records; D 64/128), on the 16-bit operand type T of the rows (fp16, or bf16 when the
//   view's rows are bf16; FlashAttention numerics, docs/design.md section 4): the kernel is
//   prefill_fa.cu's (16 or 32 query rows per warp, 6 or 4 warps per block). This file prepares its
//   input: packed segments are first dequantized once per call (prefill_dequant_kernel: code *
//   scale + lo, the CPU's two fp32 roundings, inverse channel permutation) and rounded once to
//   T into one plane of K and one of V in stream-ordered scratch (4 bytes per row and channel,
//   freed after the kernel), which the kernel streams like rows of T (one MMA per product; the
//   rounding is a term of tests/ops_harness/attention_bounds.h's kPrefillTc bound);
//   re-dequantizing every tile in each query block cost 4.5x the f16 time.
//   Packed segments with a Hadamard rotation, 1.5-bit codes or channel-axis keys are dequantized
//   by the device caches' dequant_rows (fp32 rows bit-identical to the CPU's dequantize_row, the
//   un-rotation and the run metadata of channel-axis keys included) and then rounded to the same
//   planes. Limits (fp16 planes): dequantized values must lie within fp16's range (|x| < 65520).
// * CUDA cores (every other view: f32 rows, or f16 beside bf16 rows; rotated or 1.5-bit packed
// rows refused): one block of 4 warps per (tile of 16 query rows, KV head, batch); the rows of a
// tile are (query i, head r of the GQA group) pairs ordered t = i * n_rep + r, so the n_rep query
// heads sharing a KV head read each key tile once. Keys and values are staged 32 rows at a time in
// shared memory as fp32 ([32][D + 1]: the pad makes lane j's reads of row j conflict-free); packed
// records are dequantized there (code * scale + lo, one rounding each, no FMA: the CPU's
// dequantize_record values; channel-axis keys with their run's (lo, scale) per channel, the run
// of each tile row found once per tile) and put back in original channel order. A tile no query
// row of the block can see (by position and window) is skipped before its rows are read. Each
// warp owns 4 query rows: lane j scores key j (fp32 dot product), then an online softmax (running
// max, expf, fp32 sums) accumulates p * v into D/32 outputs per lane. A query that sees no key
// gets zeros.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/device_cache_dequant.cuh"
#include "cuda/prefill_attention.cuh"
#include "cuda/tc_common.cuh"
#include "veloxquant/packed.h"

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

// Metadata element i of type `type` (a vq::MetaType value): packed.h's host/device codec.
__device__ __forceinline__ float meta_at(const uint8_t* meta, int i, int type) {
  return meta_load(meta, i, static_cast<MetaType>(type));
}

// Stored channel c of channel-axis record rec whose run starts at record chunk0 (packed.h's
// channel_meta): code * scale_c + lo_c in fp32 (two roundings).
__device__ __forceinline__ float dequant_channel(const uint8_t* rec, const uint8_t* chunk0, int c,
                                                 const PrefillTensor& t) {
  CodeSpec spec;
  spec.bits_x2 = static_cast<uint8_t>(t.ternary ? 3 : 2 * t.bits);
  const uint32_t code = code_at(rec, c, spec);
  const int el = 2 * c, es = 2 * c + 1, ns = t.meta_slots;
  const float lo = meta_at(chunk0 + (el / ns) * t.row_stride + t.code_bytes, el % ns, t.meta);
  const float scale = meta_at(chunk0 + (es / ns) * t.row_stride + t.code_bytes, es % ns, t.meta);
  return dequantize_code(code, scale, lo);
}

// Stored channel c of a record, dequantized: code * scale + lo in fp32 (two roundings).
__device__ __forceinline__ float dequant(const uint8_t* rec, int c, const PrefillTensor& t) {
  CodeSpec spec;
  spec.bits_x2 = static_cast<uint8_t>(2 * t.bits);
  const uint32_t code = code_at(rec, c, spec);
  const int g = c / t.group_size;
  const uint8_t* meta = rec + t.code_bytes;
  const float lo = meta_at(meta, 2 * g, t.meta);
  const float scale = meta_at(meta, 2 * g + 1, t.meta);
  return dequantize_code(code, scale, lo);
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
  __shared__ int64_t run0[kKT];  // channel-axis keys: the first row of each tile row's run

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
        if (seg.packed && seg.pk.channel)
          run0[tid] = channel_run_start(seg.pk.runs, seg.pk.n_runs, tid < nt ? j0 + tid : j0);
      }
      if (!__syncthreads_or(flag)) continue;  // no row of this block sees this tile

      const int64_t row0 = frame * cap + j0;
      for (int e = tid; e < kKT * D; e += kWarps * 32) {
        const int r = e / D, c = e % D;
        float kx = 0.0f, vx = 0.0f;
        int kc = c, vc = c;
        if (r < nt) {
          if (seg.packed) {
            const uint8_t* krec = seg.pk.data + (row0 + r) * seg.pk.row_stride;
            kx = seg.pk.channel
                     ? dequant_channel(krec,
                                       seg.pk.data + (frame * cap + run0[r]) * seg.pk.row_stride, c,
                                       seg.pk)
                     : dequant(krec, c, seg.pk);
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

// ---- tensor-core path ---------------------------------------------------------------------------

// Stored channels c0 .. c0 + 7 (c0 a multiple of 8, so the codes start on a byte) of a record,
// dequantized like dequant(): code * scale + lo in fp32, two roundings.
__device__ __forceinline__ void dequant8(const uint8_t* rec, int c0, const PrefillTensor& t,
                                         float (&x)[8]) {
  const int b = t.bits;
  const uint8_t* cp = rec + (c0 * b) / 8;
  uint64_t w = 0;
  for (int i = 0; i < b; ++i) w |= static_cast<uint64_t>(cp[i]) << (8 * i);
  const uint32_t mask = (1u << b) - 1u;
  const uint8_t* meta = rec + t.code_bytes;
  int gp = -1;
  float lo = 0.0f, scale = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int g = (c0 + i) / t.group_size;
    if (g != gp) {
      lo = meta_at(meta, 2 * g, t.meta);
      scale = meta_at(meta, 2 * g + 1, t.meta);
      gp = g;
    }
    const uint32_t code = static_cast<uint32_t>(w >> (i * b)) & mask;
    x[i] = __fadd_rn(__fmul_rn(static_cast<float>(code), scale), lo);
  }
}

// Packed segment -> T rows [F, n_rows, D] in original channel order, each value rounded once
// (the tensor-core kernel's input): thread per (frame, row, run of 8 stored channels).
template <class T>
__global__ void prefill_dequant_kernel(const PrefillSeg seg, int kv_heads, int D, T* kt, T* vt) {
  const int64_t f = blockIdx.y;
  const int h = static_cast<int>(f % kv_heads);
  const int oct = D / 8;
  const int64_t n = seg.n_rows * oct;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / oct;
    const int c0 = 8 * static_cast<int>(e % oct);
    const int64_t src = f * seg.capacity + r, dst = (f * seg.n_rows + r) * D;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      const PrefillTensor& pt = kv ? seg.pv : seg.pk;
      T* out = (kv ? vt : kt) + dst;
      float x[8];
      dequant8(pt.data + src * pt.row_stride, c0, pt, x);
      if (pt.perm == nullptr) {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = tc_pack2<T>(x[2 * i], x[2 * i + 1]);
        *reinterpret_cast<uint4*>(out + c0) = make_uint4(w[0], w[1], w[2], w[3]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          out[pt.perm[static_cast<int64_t>(h) * D + c0 + i]] = tc_round<T>(x[i]);
      }
    }
  }
}

// fp32 rows -> T rows (each value rounded once), for packed segments dequantized by
// dequant_rows_launch (rotated or 1.5-bit codes).
template <class T>
__global__ void prefill_round_kernel(const float* x, int64_t n, T* y) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[e] = tc_round<T>(x[e]);
}

// A packed tensor the dequant8 path cannot take: 1.5-bit codes, a Hadamard rotation or
// channel-axis keys (metadata in the run's first records). Such
// segments are dequantized by the device caches' dequant_rows (the CPU's dequantize_row
// operations, un-rotation included) into fp32 scratch, then split.
bool needs_general_dequant(const PrefillTensor& t) {
  return t.ternary != 0 || t.signs != nullptr || t.channel != 0;
}

// The tensor-core path over a view whose full-precision rows (if any) are all of type T
// (__half or __nv_bfloat16): packed segments dequantized into T planes, then prefill_fa.cu's
// kernel.
template <class T>
void prefill_tc_launch(const PrefillParams& p, cudaStream_t s) {
  // Packed segments are dequantized once per call into stream-ordered scratch (one T plane of K
  // and one of V: 4 bytes per row and channel), which the kernel streams like rows of T.
  // Rotated or 1.5-bit ones go through fp32 rows first (one scratch reused, stream-ordered).
  PrefillParams q = p;
  const int64_t F = static_cast<int64_t>(p.batch) * p.kv_heads, D = p.head_dim;
  size_t bytes = 0, f32_bytes = 0;
  for (int i = 0; i < p.n_segs; ++i)
    if (p.segs[i].packed) {
      bytes += static_cast<size_t>(2 * F * p.segs[i].n_rows * D) * 2;
      if (needs_general_dequant(p.segs[i].pk) || needs_general_dequant(p.segs[i].pv))
        f32_bytes = std::max(f32_bytes, static_cast<size_t>(F * p.segs[i].n_rows * D) * 4);
    }
  void* ws = nullptr;
  if (bytes > 0) VQ_CUDA_CHECK(cudaMallocAsync(&ws, bytes + f32_bytes, s));
  float* f32 = reinterpret_cast<float*>(static_cast<uint8_t*>(ws) + bytes);
  size_t used = 0;
  for (int i = 0; i < q.n_segs; ++i) {
    PrefillSeg& g = q.segs[i];
    if (!g.packed) {
      g.rows_cap = g.capacity;
      continue;
    }
    const size_t plane = static_cast<size_t>(F * g.n_rows * D) * 2;
    T* kt = reinterpret_cast<T*>(static_cast<uint8_t*>(ws) + used);
    T* vt = kt + plane / 2;
    used += 2 * plane;
    if (needs_general_dequant(g.pk) || needs_general_dequant(g.pv)) {
      const int64_t n = F * g.n_rows * D;
      const unsigned sg = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65536));
      for (int kv = 0; kv < 2; ++kv) {
        const PrefillTensor& t = kv ? g.pv : g.pk;
        DequantRowsParams d;
        d.records = t.data;
        d.src_cap = g.capacity;
        d.row_stride = t.row_stride;
        d.code_bytes = t.code_bytes;
        d.bits = t.bits;
        d.ternary = t.ternary;
        d.group_size = t.group_size;
        d.meta = t.meta;
        d.head_dim = p.head_dim;
        d.perm = t.perm;
        d.n_frames = F;
        d.heads = p.kv_heads;
        d.n = g.n_rows;
        d.dst = f32;
        d.dst_cap = g.n_rows;
        d.signs = t.signs;
        d.rot_block = t.rot_block;
        d.rot_norm = t.rot_norm;
        d.channel = t.channel;
        d.meta_slots = t.meta_slots;
        d.runs = t.runs;
        d.n_runs = t.n_runs;
        dequant_rows_launch(d, s);
        prefill_round_kernel<T><<<sg, 256, 0, s>>>(f32, n, kv ? vt : kt);
        VQ_CUDA_LAUNCH_CHECK("prefill_round");
      }
    } else {
      const int64_t items = g.n_rows * (D / 8);
      const dim3 dg(static_cast<unsigned>(std::min<int64_t>((items + 255) / 256, 4096)),
                    static_cast<unsigned>(F));
      prefill_dequant_kernel<T><<<dg, 256, 0, s>>>(g, p.kv_heads, p.head_dim, kt, vt);
      VQ_CUDA_LAUNCH_CHECK("prefill_dequant");
    }
    g.rows_cap = g.n_rows;
    g.keys = kt;
    g.values = vt;
  }
  prefill_fa_launch(q, std::is_same_v<T, __nv_bfloat16>, s);
  if (ws) VQ_CUDA_CHECK(cudaFreeAsync(ws, s));
}

}  // namespace

void prefill_attention_launch(const PrefillParams& p, cudaStream_t s) {
  const int64_t T = static_cast<int64_t>(p.n_rep) * p.n_queries;
  if (T <= 0) return;
  // The tensor-core path takes views whose full-precision segments are all f16 or all bf16 rows
  // (16-byte aligned; the operand type T of the kernel), beside any packed segments (q and out
  // 8-byte aligned: float2 accesses). Views of packed segments alone take fp16.
  bool tc =
      reinterpret_cast<uintptr_t>(p.q) % 8 == 0 && reinterpret_cast<uintptr_t>(p.out) % 8 == 0;
  int rows_dtype = -1;  // the vq::DType of the full-precision segments (-1: none)
  for (int i = 0; i < p.n_segs; ++i) {
    const PrefillSeg& g = p.segs[i];
    if (g.packed) continue;
    if ((g.dtype != 1 && g.dtype != 2) || (rows_dtype >= 0 && g.dtype != rows_dtype) ||
        reinterpret_cast<uintptr_t>(g.keys) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(g.values) % 16 != 0)
      tc = false;
    rows_dtype = g.dtype;
  }
  const bool bf16 = rows_dtype == 2;
  // Some packed segment the CUDA-core kernel cannot read (rotation or 1.5-bit codes; it reads
  // channel-axis keys tile by tile).
  bool general = false;
  for (int i = 0; i < p.n_segs; ++i) {
    const PrefillTensor &k = p.segs[i].pk, &v = p.segs[i].pv;
    if (p.segs[i].packed && (k.ternary || k.signs || v.ternary || v.signs)) general = true;
  }
  VQ_CHECK(tc || !general,
           "[prefill_attention] expected a view for the tensor-core path (full-precision rows "
           "all f16 or all bf16 and 16-byte aligned, q and out 8-byte aligned) with "
           "Hadamard-rotated or 1.5-bit packed segments, but the view has other rows or "
           "alignment");
  if (tc) {
    if (bf16)
      prefill_tc_launch<__nv_bfloat16>(p, s);
    else
      prefill_tc_launch<__half>(p, s);
    return;
  }
  const dim3 grid(static_cast<unsigned>((T + kBQ - 1) / kBQ), static_cast<unsigned>(p.kv_heads),
                  static_cast<unsigned>(p.batch));
  if (p.head_dim == 64)
    prefill_kernel<64><<<grid, kWarps * 32, 0, s>>>(p);
  else
    prefill_kernel<128><<<grid, kWarps * 32, 0, s>>>(p);
  VQ_CUDA_LAUNCH_CHECK("prefill_attention");
}

}  // namespace vq::cuda
