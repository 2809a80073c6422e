// Internal: the tensor-core split kernel's block for a GQA group of 16 query heads over f16 (BF:
// bf16) rows only, with the heads in the mma's M dimension (FlashAttention's layout): one block
// reads each KV head's rows once for all 16 heads, where two blocks of 8 heads would each read
// them (decode_attention_mma.cuh's layout puts the heads in N, at most 8). Included by
// decode_attention_mma.cuh, whose kernel calls it for G = 16 and PK = 0; the same parameters,
// pipeline (3 stages of cp.async tiles, 16-byte chunks swizzled by swz), block merge and partials.
//
// Per warp-tile of 16 rows, on mma.m16n8k16 (fp16 or bf16 operands, fp32 accumulation):
//  (1) logits S = Q K^T: A = the 16 heads' queries (fp16 rounding of q * sigma_h, sigma_h = 2^e
//      with max |q_h| in [2^11, 2^12)), row m = head, held in registers for the whole split; B =
//      8 key rows (n) x 16 channels (k), by ldmatrix from the swizzled tile; two n-tiles per
//      warp-tile. C: lane (g, t) holds heads g and g + 8 at rows 2 t, 2 t + 1 of each n-tile.
//  (2) online softmax per head: a lane's 4 rows per head, then the 4 lanes t of its g.
//  (3) values O += P V: A = P (16 heads x 16 rows), which is the logits' C fragments of the two
//      n-tiles rounded to the operand type, lane for lane (no shuffle); B = V (16 rows x 8
//      channels) by ldmatrix.trans; D / 8 n-tiles of channels, C: heads g, g + 8 at channels
//      8 j + 2 t, + 1.
// Numerics: FlashAttention's (docs/design.md section 4), as decode_attention_mma.cuh for f16 rows:
// q and p rounded once to the operand type, fp32 accumulation, softmax max and sum in fp32 from
// the unrounded p. Rows past the split end are zero-filled in shared memory (p = 0 never meets
// a stale NaN); invisible rows get logit -inf.
#pragma once

namespace vq::cuda::decode_mma {

// ldmatrix x4 (non-transposed) of four 8 x 8 b16 matrices: r_i holds lane (g, t)'s elements
// (row g, columns 2 t, 2 t + 1) of matrix i, whose row addresses lanes 8 i .. 8 i + 7 supply.
__device__ __forceinline__ void ldsm_x4(const uint8_t* addr, uint32_t& r0, uint32_t& r1,
                                        uint32_t& r2, uint32_t& r3) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
}

template <int D, bool BF>
__device__ __forceinline__ void decode_mma16_block(const DecodeParams& p, const int b) {
  constexpr int G = 16, kStages = 3, RB = 2 * D, CPR = D / 8;
  constexpr int KS = D / 16;  // k-steps of the logits (16 channels each)
  constexpr int NT = D / 8;   // n-tiles of the values (8 channels each)
  extern __shared__ __align__(16) uint8_t smem[];
  const int SH = p.stage_half_bytes;
  uint8_t* stages = smem;
  float* qs = reinterpret_cast<float*>(smem + kStages * 2 * SH);  // [G][D]
  float* ssig = qs + G * D;                                       // [G]

  decode_impl::grid_dependency_trigger();
  int kvh = 0;
  const int split = decode_impl::block_split(p, kvh);
  if (split >= p.n_splits) return;  // batched: past this sequence's splits
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  int si = 0;
  while (si + 1 < p.n_segments && split >= p.seg[si + 1].split_begin) ++si;
  const DecodeSegmentParams& sg = p.seg[si];
  const int64_t r_begin = static_cast<int64_t>(split - sg.split_begin) * sg.rows_per_split;
  const int64_t r_end = min64(sg.n_rows, r_begin + sg.rows_per_split);
  const int64_t bh = static_cast<int64_t>(b) * p.n_kv_heads + kvh;
  const int64_t kbh = decode_impl::kv_bh(p, b, kvh);
  const int TR = sg.tile_rows;
  const int32_t* pos = sg.positions ? sg.positions + kbh * sg.capacity : nullptr;
  const int n_split = static_cast<int>(r_end - r_begin);
  const int n_tiles = (n_split + TR - 1) / TR;
  int vis_lo = 0, vis_hi = 0;  // implicit positions: the visible rows of the split, [lo, hi)
  {
    const int64_t q_rel = p.q_pos - sg.first_pos - r_begin;
    const int64_t lo = p.window > 0 ? q_rel - p.window + 1 : 0;
    vis_lo = static_cast<int>(lo < 0 ? 0 : (lo > n_split ? n_split : lo));
    const int64_t hi = q_rel + 1;
    vis_hi = static_cast<int>(hi < 0 ? 0 : (hi > n_split ? n_split : hi));
  }
  asm volatile("" : "+r"(vis_lo), "+r"(vis_hi));
  const uint8_t* kb0 = sg.k + (kbh * sg.capacity + r_begin) * RB;
  const uint8_t* vb0 = sg.v + (kbh * sg.capacity + r_begin) * RB;
  const int32_t* pos0 = pos ? pos + r_begin : nullptr;
  auto issue = [&](int tt, int st) {
    const int r0 = tt * TR;
    const int nr = min(TR, n_split - r0);
    uint8_t* sk = stages + st * 2 * SH;
    uint8_t* sv = sk + SH;
    const uint8_t* gk = kb0 + r0 * RB;
    const uint8_t* gv = vb0 + r0 * RB;
    for (int i = tid; i < nr * CPR; i += kThreads) {
      const int r = i / CPR, c = i % CPR;
      const int o = r * RB + 16 * (c ^ swz(r & 7));
      cp_async16(sk + o, gk + 16 * i);
      cp_async16(sv + o, gv + 16 * i);
    }
    const int nr16 = (nr + 15) & ~15;  // zero the rest of the last warp-tile
    for (int i = nr * CPR + tid; i < nr16 * CPR; i += kThreads) {
      *reinterpret_cast<uint4*>(sk + 16 * i) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(sv + 16 * i) = make_uint4(0u, 0u, 0u, 0u);
    }
  };
#pragma unroll
  for (int tt = 0; tt < kStages - 1; ++tt) {
    if (tt < n_tiles) issue(tt, tt);
    cp_async_commit();
  }

  // ---- queries: q * scale * log2 e, sigma_h per head, the A fragments in registers
  const float* qg = p.q + (bh * G) * D;
  for (int i = tid; i < G * D; i += kThreads) qs[i] = qg[i] * p.scale_log2;
  __syncthreads();
  for (int h = warp; h < G; h += kWarps) {
    float mx = 0.0f;
    for (int d = lane; d < D; d += 32) mx = fmaxf(mx, fabsf(qs[h * D + d]));
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    if (lane == 0) {
      float sgm = 1.0f;
      if (mx > 0.0f && mx < INFINITY) {
        int e = 0;
        frexpf(mx, &e);  // mx = f 2^e, f in [0.5, 1)
        sgm = ldexpf(1.0f, max(-100, min(100, 12 - e)));
      }
      ssig[h] = sgm;
    }
  }
  __syncthreads();
  uint32_t qa[KS][4];  // A of k-step s: (head g | g + 8) x (channels 16 s + 2 t, + 1 | + 8, + 9)
  {
    const float s0 = ssig[g], s1 = ssig[g + 8];
    const float* q0 = qs + g * D;
    const float* q1 = qs + (g + 8) * D;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const int c = 16 * s + 2 * t;
      qa[s][0] = pack_part<BF>(q0[c] * s0, q0[c + 1] * s0, 0);
      qa[s][1] = pack_part<BF>(q1[c] * s1, q1[c + 1] * s1, 0);
      qa[s][2] = pack_part<BF>(q0[c + 8] * s0, q0[c + 9] * s0, 0);
      qa[s][3] = pack_part<BF>(q1[c + 8] * s1, q1[c + 9] * s1, 0);
    }
  }
  const float sinv[2] = {1.0f / ssig[g], 1.0f / ssig[g + 8]};  // exact (powers of two)

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // heads g, g + 8
  float vacc[NT][4];  // n-tile j: (head g | g + 8) x channels 8 j + 2 t, + 1
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) vacc[j][i] = 0.0f;

  int stage = 0;
  for (int tt = 0; tt < n_tiles; ++tt) {
    if (tt + kStages - 1 < n_tiles) issue(tt + kStages - 1, stage == 0 ? kStages - 1 : stage - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncthreads();
    const int row_rel = tt * TR;
    const int nr = min(TR, n_split - row_rel);
    const uint8_t* sk = stages + stage * 2 * SH;
    const uint8_t* sv = sk + SH;
    if (++stage == kStages) stage = 0;
    const int n_wt = (nr + 15) / 16;
    const bool all_vis = !pos && row_rel >= vis_lo && row_rel + 16 * n_wt <= vis_hi;
    for (int wt = warp; wt < n_wt; wt += kWarps) {
      const int rb = 16 * wt;
      // ---- (1) logits: n-tile n holds rows rb + 8 n .. + 7; lane l addresses row l % 8 of
      // matrix l / 8 = chunk 2 c' + l / 8 of the k-step pair c'
      float acc[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;
        const int r = rb + 8 * n + (lane & 7);
        const uint8_t* rowp = sk + r * RB;
        const int sw = swz(lane & 7);
#pragma unroll
        for (int s = 0; s < KS; s += 2) {
          uint32_t k0, k1, k2, k3;
          ldsm_x4(rowp + 16 * ((2 * s + (lane >> 3)) ^ sw), k0, k1, k2, k3);
          mma_rows<BF>(acc[n], qa[s][0], qa[s][1], qa[s][2], qa[s][3], k0, k1);
          mma_rows<BF>(acc[n], qa[s + 1][0], qa[s + 1][1], qa[s + 1][2], qa[s + 1][3], k2, k3);
        }
      }
      // lg[hh][n][e]: head g + 8 hh, row rb + 8 n + 2 t + e
      float lg[2][2][2];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          lg[0][n][e] = acc[n][e] * sinv[0];
          lg[1][n][e] = acc[n][2 + e] * sinv[1];
        }
      if (!all_vis) {
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int rl = rb + 8 * n + 2 * t + e;
            bool vis;
            if (!pos) {
              const int rel = row_rel + rl;
              vis = rel >= vis_lo && rel < vis_hi;
            } else {
              vis = false;
              if (rl < nr) {
                const int64_t pj = pos0[row_rel + rl];
                vis = pj <= p.q_pos && (p.window <= 0 || p.q_pos < pj + p.window);
              }
            }
            if (!vis) lg[0][n][e] = lg[1][n][e] = -INFINITY;
          }
      }
      // ---- (2) online softmax per head (the lanes t of a g share it)
      float pr[2][2][2], al[2];
      bool grow = false;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float tmax = fmaxf(fmaxf(lg[hh][0][0], lg[hh][0][1]), fmaxf(lg[hh][1][0], lg[hh][1][1]));
        tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, 2));
        const float m_new = fmaxf(m_run[hh], tmax);
        float psum = 0.0f;
        if (m_new == -INFINITY) {
          al[hh] = 1.0f;
#pragma unroll
          for (int n = 0; n < 2; ++n) pr[hh][n][0] = pr[hh][n][1] = 0.0f;
        } else {
          al[hh] = ex2_ftz(m_run[hh] - m_new);
#pragma unroll
          for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              pr[hh][n][e] = ex2_ftz(lg[hh][n][e] - m_new);
              psum += pr[hh][n][e];
            }
        }
        l_run[hh] = fmaf(l_run[hh], al[hh], psum);
        m_run[hh] = m_new;
        grow |= al[hh] != 1.0f;
      }
      if (__any_sync(kFull, grow)) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          vacc[j][0] *= al[0];
          vacc[j][1] *= al[0];
          vacc[j][2] *= al[1];
          vacc[j][3] *= al[1];
        }
      }
      // ---- (3) values: A = P of the lane's own C fragments; B = V by ldmatrix.trans, lane l
      // addressing row rb + l % 8 + 8 ((l / 8) % 2) of chunk j + l / 16
      const uint32_t pa0 = pack_part<BF>(pr[0][0][0], pr[0][0][1], 0);
      const uint32_t pa1 = pack_part<BF>(pr[1][0][0], pr[1][0][1], 0);
      const uint32_t pa2 = pack_part<BF>(pr[0][1][0], pr[0][1][1], 0);
      const uint32_t pa3 = pack_part<BF>(pr[1][1][0], pr[1][1][1], 0);
      const uint8_t* vrow = sv + (rb + (lane & 7) + 8 * ((lane >> 3) & 1)) * RB;
      const int vsw = swz(lane & 7), vhi = lane >> 4;
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_trans(vrow + 16 * ((j + vhi) ^ vsw), b0, b1, b2, b3);
        mma_rows<BF>(vacc[j], pa0, pa1, pa2, pa3, b0, b1);
        mma_rows<BF>(vacc[j + 1], pa0, pa1, pa2, pa3, b2, b3);
      }
    }
    __syncthreads();  // the stage is refilled next iteration
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- merge the warps: [warps][G] max and sum, [warps][G][D] accumulators (in the stages)
  float* wm = reinterpret_cast<float*>(stages);
  float* wl = wm + kWarps * G;
  float* wacc = wl + kWarps * G;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float l = l_run[hh];
    l += __shfl_xor_sync(kFull, l, 1);
    l += __shfl_xor_sync(kFull, l, 2);
    const int h = g + 8 * hh;
    if (t == 0) {
      wm[warp * G + h] = m_run[hh];
      wl[warp * G + h] = l;
    }
    float* dst = wacc + (warp * G + h) * D + 2 * t;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      dst[8 * j] = vacc[j][2 * hh];
      dst[8 * j + 1] = vacc[j][2 * hh + 1];
    }
  }
  __syncthreads();
  write_partials<D, G>(p, bh, split, wm, wl, wacc, nullptr, tid);
}

}  // namespace vq::cuda::decode_mma
