// Tile schedule and tile staging of the tensor-core prefill kernels (prefill_fa.cu,
// prefill_wg.cu), device code only. A tile is BK consecutive rows (keys) of one
// segment of frame f = b * H_kv + h; staged as swizzled 16-bit planes of D channels
// (tc_common.cuh's tc_off, or the layout a kernel names) and the tile's key positions (int64).
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/prefill_attention.cuh"
#include "cuda/tc_common.cuh"

namespace vq::cuda {

// The query rows of this block: BM rows t0 .. t0 + BM - 1 of the T = n_rep * N rows of KV head
// blockIdx.y of batch blockIdx.z (row t: query head h * n_rep + t % n_rep, query t / n_rep at
// position q_pos0 + t / n_rep), blocks taken from the last (the heaviest under a causal mask) to
// the first; frame = b * H_kv + h, qmin and qmax the positions of its first and last row.
struct PrefillRows {
  int64_t n_rep, N, T, t0, frame, qmin, qmax, head0;
  __device__ __forceinline__ PrefillRows(const PrefillParams& p, int BM)
      : n_rep(p.n_rep), N(p.n_queries), T(n_rep * N) {
    t0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * BM;
    frame = static_cast<int64_t>(blockIdx.z) * p.kv_heads + blockIdx.y;
    head0 = frame * n_rep;
    const int64_t t_last = (t0 + BM < T ? t0 + BM : T) - 1;
    qmin = p.q_pos0 + t0 / n_rep;
    qmax = p.q_pos0 + t_last / n_rep;
  }
  // Offset of row t's D channels in q and out ([B, H_q, N, D]).
  __device__ __forceinline__ int64_t offset(int64_t t, int D) const {
    return ((head0 + t % n_rep) * N + t / n_rep) * D;
  }
};

// The next tile (segment sg, first row j0) at or after (sg, j0) that some query of the block
// (positions qmin .. qmax) sees, by position and window win; false when none is left. full: every
// key of the tile is visible to every query of the block (no masking needed). Called by every
// thread of the block (NT threads, NT >= BK) alike: explicit positions are joined with
// __syncthreads_or/and; WARP: called by the 32 lanes of one warp alone (tid = lane), each lane
// reading keys lane, lane + 32, ..., joined with __any_sync/__all_sync.
template <int BK, bool WARP = false>
__device__ __forceinline__ bool prefill_seek(const PrefillParams& p, int64_t frame, int64_t qmin,
                                             int64_t qmax, int tid, int& sg, int64_t& j0,
                                             bool& full) {
  const int64_t win = p.window;
  while (sg < p.n_segs) {
    const PrefillSeg& seg = p.segs[sg];
    if (j0 >= seg.n_rows) {
      ++sg;
      j0 = 0;
      continue;
    }
    const int nt = static_cast<int>(seg.n_rows - j0 < BK ? seg.n_rows - j0 : BK);
    if (!seg.positions) {  // implicit positions first_pos + j, increasing
      const int64_t k0 = seg.first_pos + j0, k1 = k0 + nt - 1;
      if (k0 > qmax) {  // this and every later row of the segment is in every query's future
        ++sg;
        j0 = 0;
        continue;
      }
      if (win > 0 && qmin >= k1 + win) {  // out of every query's window: jump to the first row in
        const int64_t jv = qmin - win + 1 - seg.first_pos;
        const int64_t jt = (jv / BK) * BK;
        j0 = jt > j0 + BK ? jt : j0 + BK;
        continue;
      }
      full = nt == BK && k1 <= qmin && (win <= 0 || qmax < k0 + win);
      return true;
    }
    int any = 0, all = 1;
    for (int k = tid; k < BK; k += WARP ? 32 : BK) {
      if (k < nt) {
        const int64_t kp = seg.positions[frame * seg.capacity + j0 + k];
        any |= kp <= qmax && (win <= 0 || qmin < kp + win);
        all &= kp <= qmin && (win <= 0 || qmax < kp + win);
      } else {
        all = 0;
      }
    }
    if constexpr (WARP) {
      any = __any_sync(0xffffffffu, any);
      all = __all_sync(0xffffffffu, all);
    } else {
      any = __syncthreads_or(any);
      all = __syncthreads_and(all);
    }
    if (any) {
      full = all != 0;
      return true;
    }
    j0 += BK;
  }
  return false;
}

// tc_off's layout of a staged plane (the mma.sync kernel's).
template <int D>
struct TcPlane {
  __device__ __forceinline__ int operator()(int r, int c) const { return tc_off<D>(r, c); }
};

// Stages tile (sg, j0) at base: NP planes [BK][D] of 16-bit rows by cp.async, plane i from
// src[i] (rows of frame f at f * rows_cap; rows past the segment's end zeroed), laid out as Off
// places channel c of row r, and the key positions (past the end: INT64_MAX, never visible) at
// spos. NT threads.
template <int D, int BK, int NT, int NP, class Off = TcPlane<D>>
__device__ __forceinline__ void prefill_stage(const PrefillSeg& seg, int64_t frame, int64_t j0,
                                              int tid, const void* const (&src)[NP], uint8_t* base,
                                              int64_t* spos) {
  constexpr int RB = 2 * D, PB = BK * RB, CPR = D / 8;
  const int nt = static_cast<int>(seg.n_rows - j0 < BK ? seg.n_rows - j0 : BK);
  for (int k = tid; k < BK; k += NT)
    spos[k] =
        k < nt ? (seg.positions ? static_cast<int64_t>(seg.positions[frame * seg.capacity + j0 + k])
                                : seg.first_pos + j0 + k)
               : LLONG_MAX;
  const int64_t off = (frame * seg.rows_cap + j0) * RB;
  for (int i = tid; i < BK * CPR; i += NT) {
    const int r = i / CPR, c = i % CPR;
    const int o = Off{}(r, 8 * c);
#pragma unroll
    for (int pl = 0; pl < NP; ++pl) {
      if (r < nt)
        tc_cp16(base + pl * PB + o, static_cast<const uint8_t*>(src[pl]) + off + 16 * i);
      else
        *reinterpret_cast<uint4*>(base + pl * PB + o) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

}  // namespace vq::cuda
