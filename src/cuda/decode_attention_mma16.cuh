// Internal: the tensor-core split kernel's block for a GQA group of 16 query heads with the heads
// in the mma's M dimension (FlashAttention's layout): one block reads each KV head's rows once for
// all 16 heads, where two blocks of 8 would each read (and decode) them
// (decode_attention_mma.cuh's layout puts the heads in N, at most 8). Views of f16 (BF: bf16)
// rows alone (PK 0) and views whose packed segments are fixed group-32 records with f16 metadata
// (PK 3, KB = 2 or 4 bits) beside f16 / bf16 rows. Included by decode_attention_mma.cuh, whose
// kernel calls it for G = 16; the same parameters, pipeline (3 stages of cp.async tiles, 16-byte
// chunks swizzled by swz, for rows; 2 or 3 stages of bulk-copied byte ranges for packed records),
// block merge and partials.
//
// Per warp-tile of 16 rows, on mma.m16n8k16 (fp16 or bf16 operands, fp32 accumulation):
//  (1) logits S = Q K^T: A = the 16 heads' queries (fp16 rounding of q * sigma_h, sigma_h = 2^e
//      with max |q_h| in [2^11, 2^12)), row m = head, held in registers for the whole split; B =
//      8 key rows (n) x 16 channels (k); two n-tiles per warp-tile. C: lane (g, t) holds heads g
//      and g + 8 at rows 2 t, 2 t + 1 of each n-tile. Rows: B by ldmatrix from the swizzled
//      tile, the natural channel order. Packed keys: B is the lane's row's codes masked in place
//      as fp16 subnormals (decode_attention_mma.cuh's K-index map and in-place factors, which
//      the queries carry), one mma chain per 32-channel chunk, whose C gains scale * C + lo *
//      sum q with the metadata of the C element's own row.
//  (2) online softmax per head: a lane's 4 rows per head, then the 4 lanes t of its g.
//  (3) values O += P V: A = P (16 heads x 16 rows), which is the logits' C fragments of the two
//      n-tiles rounded to the operand type, lane for lane (no shuffle); B = V (16 rows x 8
//      channels). Rows: ldmatrix.trans, n-tile j = channels 8 j .. + 7, C: heads g, g + 8 at
//      channels 8 j + 2 t, + 1. Packed values: the dequantized fp16 pairs of
//      decode_attention_mma.cuh (c * scale + lo, rows 2 t, 2 t + 1 and + 8 of one channel), four
//      n-tiles per code unit c of its lane-unit map, n-tile 4 c + o holding channel
//      4 (NCH n + c) + o at column n (LaneCodes).
// Numerics: FlashAttention's (docs/design.md section 4), as decode_attention_mma.cuh: q and p
// rounded once to the operand type, packed values rounded once to fp16 as dequantized values,
// fp32 accumulation, softmax max and sum in fp32 from the unrounded p. Rows past the split end
// are zero-filled in shared memory (p = 0 never meets a stale NaN); invisible rows get logit -inf.
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

template <int D, int PK, int KB, bool BF>
__device__ __forceinline__ void decode_mma16_block(const DecodeParams& p, const int b,
                                                   uint64_t* bars) {
  static_assert(PK == 0 || PK == 3, "rows alone, or fixed group-32 records with f16 metadata");
  constexpr int G = 16, kStages = mma_stages<PK, KB>(), RB = 2 * D;
  constexpr int KS = D / 16;                         // k-steps of the logits (16 channels each)
  constexpr int NT = D / 8;                          // n-tiles of the values (8 channels each)
  constexpr int NCH = D / 32;                        // 32-channel chunks
  constexpr int CB = D * KB / 8, KREC = CB + D / 8;  // code bytes, record bytes (PK 3)
  extern __shared__ __align__(16) uint8_t smem[];
  const int SH = p.stage_half_bytes;
  uint8_t* stages = smem;
  float* qs = reinterpret_cast<float*>(smem + kStages * 2 * SH);  // [G][D]
  float* qtmp = qs + G * D;                                       // [G][D]
  float* ssig = qtmp + G * D;                                     // [G]
  float* sqsum = ssig + G;                                        // [G][NCH]

  decode_impl::grid_dependency_trigger();
  int kvh = 0;
  const int split = decode_impl::block_split(p, kvh);
  if (split >= p.n_splits) return;  // batched: past this sequence's splits
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  int si = 0;
  while (si + 1 < p.n_segments && split >= p.seg[si + 1].split_begin) ++si;
  const DecodeSegmentParams& sg = p.seg[si];
  const bool packed = PK > 0 && sg.packed != 0;
  const int64_t r_begin = static_cast<int64_t>(split - sg.split_begin) * sg.rows_per_split;
  const int64_t r_end = min64(sg.n_rows, r_begin + sg.rows_per_split);
  const int64_t bh = static_cast<int64_t>(b) * p.n_kv_heads + kvh;
  const int64_t kbh = decode_impl::kv_bh(p, b, kvh);
  const int TR = sg.tile_rows;
  const int rbytes = packed ? KREC : RB;  // a row's (record's) bytes, keys and values alike
  const int32_t* pos = sg.positions ? sg.positions + kbh * sg.capacity : nullptr;
  const int n_split = static_cast<int>(r_end - r_begin);
  const int n_tiles = (n_split + TR - 1) / TR;
  int vis_lo = 0, vis_hi = 0;  // implicit positions: the visible rows of the split, [lo, hi)
  visible_rows(p, sg, r_begin, n_split, vis_lo, vis_hi);
  asm volatile("" : "+r"(vis_lo), "+r"(vis_hi));
  const uint8_t* kb0 = sg.k + (kbh * sg.capacity + r_begin) * rbytes;
  const uint8_t* vb0 = sg.v + (kbh * sg.capacity + r_begin) * rbytes;
  const int32_t* pos0 = pos ? pos + r_begin : nullptr;
  auto issue = [&](int tt, int st) {
    const int r0 = tt * TR;
    uint8_t* sk = stages + st * 2 * SH;
    stage_tile<D>(packed, sk, sk + SH, kb0 + r0 * rbytes, vb0 + r0 * rbytes, min(TR, n_split - r0),
                  KREC, KREC, &bars[st], tid);
  };
#pragma unroll
  for (int tt = 0; tt < kStages - 1; ++tt) {
    if (tt < n_tiles) issue(tt, tt);
    cp_async_commit();
  }

  // ---- queries: q * scale * log2 e (transformed for packed keys), sigma_h per head, each value
  // rounded to the operand it will be (packed keys: times its in-place code factor, undone), the
  // chunk sums of the rounded values (packed), the A fragments in registers
  load_queries<D, G>(p, bh, kvh, packed, qs, qtmp, ssig, tid);
  // the in-place factor of channel d's code (1 for rows): 2-bit 4^-(d % 4), 4-bit 1/16 (odd d)
  const auto code_fac = [&](int d) {
    if (!packed) return 1.0f;
    return KB == 2 ? __int_as_float((127 - 2 * (d & 3)) << 23) : ((d & 1) ? 0.0625f : 1.0f);
  };
  if (packed) {
    for (int i = tid; i < G * D; i += kThreads) {
      const float fac = ssig[i / D] * code_fac(i % D);
      qs[i] = __half2float(__float2half_rn(qs[i] * fac)) * (1.0f / fac);
    }
    __syncthreads();
    for (int i = tid; i < G * NCH; i += kThreads) sqsum[i] = decode_impl::chunk_sum(qs, D, i);
    __syncthreads();
  }
  // A of k-step s: (head g | g + 8) x (K index 2 t, 2 t + 1 | 2 t + 8, 2 t + 9). Rows: channel
  // 16 s + k. Packed: K pair i = 2 (s % 2) + (k >= 8) of chunk s / 2 holds channels 8 t + i and
  // 8 t + i + 4 of it (decode_attention_mma.cuh's map), times the pair's in-place factor.
  uint32_t qa[KS][4];
  {
    const float s0 = ssig[g], s1 = ssig[g + 8];
    const float* q0 = qs + g * D;
    const float* q1 = qs + (g + 8) * D;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {  // K index 2 t (+ 8 hi)
        int c0, c1;
        if (packed) {
          c0 = 32 * (s / 2) + 8 * t + 2 * (s % 2) + hi;
          c1 = c0 + 4;
        } else {
          c0 = 16 * s + 2 * t + 8 * hi;
          c1 = c0 + 1;
        }
        const float f0 = s0 * code_fac(c0), f1 = s1 * code_fac(c0);
        // packed blocks multiply fp16 operands (the codes are fp16 subnormals); rows their type
        qa[s][2 * hi] = BF && !packed ? pack_part<true>(q0[c0] * f0, q0[c1] * f0, 0)
                                      : pack_part(q0[c0] * f0, q0[c1] * f0, 0);
        qa[s][2 * hi + 1] = BF && !packed ? pack_part<true>(q1[c0] * f1, q1[c1] * f1, 0)
                                          : pack_part(q1[c0] * f1, q1[c1] * f1, 0);
      }
    }
  }
  // 1 / sigma per lane head (packed: times 2^24, the codes' subnormal scale); packed chunk sums
  // times sigma 2^-24, so that both terms of a packed logit share the scale (exact powers of two)
  constexpr float kSub = 16777216.0f;
  const float sinv[2] = {(packed ? kSub : 1.0f) / ssig[g], (packed ? kSub : 1.0f) / ssig[g + 8]};
  float qsum[2][NCH];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int c = 0; c < NCH; ++c)
      qsum[hh][c] =
          packed ? sqsum[(g + 8 * hh) * NCH + c] * ssig[g + 8 * hh] * (1.0f / kSub) : 0.0f;

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // heads g, g + 8
  // rows: n-tile j = channels 8 j .. + 7 (column n: 8 j + n); packed: n-tile 4 c + o = channels
  // LaneCodes::channel(n, c, o). Elements e, 2 + e: heads g, g + 8 at column 2 t + e.
  float vacc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) vacc[j][i] = 0.0f;

  const int kmis0 = packed ? decode_impl::misalign16(kb0) : 0;
  const int vmis0 = packed ? decode_impl::misalign16(vb0) : 0;
  int stage = 0;
  uint32_t phase = 0;
  for (int tt = 0; tt < n_tiles; ++tt) {
    if (tt + kStages - 1 < n_tiles) issue(tt + kStages - 1, stage == 0 ? kStages - 1 : stage - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    if (decode_impl::kBulkCopy && packed) decode_impl::mbar_wait(&bars[stage], phase);
    __syncthreads();
    const int row_rel = tt * TR;
    const int nr = min(TR, n_split - row_rel);
    const uint8_t* sk = stages + stage * 2 * SH;
    const uint8_t* sv = sk + SH;
    const int kmis = (kmis0 + row_rel * KREC) & 15;
    const int vmis = (vmis0 + row_rel * KREC) & 15;
    if (++stage == kStages) stage = 0, phase ^= 1u;
    const int n_wt = (nr + 15) / 16;
    if (packed && nr < 16 * n_wt)  // a partial last tile
      zero_missing_records(const_cast<uint8_t*>(sk), SH, kmis, vmis, nr, n_wt, KREC, KREC, tid);
    const bool all_vis = !pos && row_rel >= vis_lo && row_rel + 16 * n_wt <= vis_hi;
    for (int wt = warp; wt < n_wt; wt += kWarps) {
      const int rb = 16 * wt;
      // ---- (1) logits lg[hh][n][e]: head g + 8 hh, row rb + 8 n + 2 t + e
      float lg[2][2][2];
      if (!packed) {
        // n-tile n holds rows rb + 8 n .. + 7; lane l addresses row l % 8 of matrix l / 8 =
        // chunk 2 s + l / 8 of the k-step pair s, s + 1
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          const uint8_t* rowp = sk + (rb + 8 * n + (lane & 7)) * RB;
          const int sw = swz(lane & 7);
#pragma unroll
          for (int s = 0; s < KS; s += 2) {
            uint32_t k0, k1, k2, k3;
            ldsm_x4(rowp + 16 * ((2 * s + (lane >> 3)) ^ sw), k0, k1, k2, k3);
            mma_rows<BF>(acc, qa[s][0], qa[s][1], qa[s][2], qa[s][3], k0, k1);
            mma_rows<BF>(acc, qa[s + 1][0], qa[s + 1][1], qa[s + 1][2], qa[s + 1][3], k2, k3);
          }
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            lg[0][n][e] = acc[e] * sinv[0];
            lg[1][n][e] = acc[2 + e] * sinv[1];
          }
        }
      } else if constexpr (PK > 0) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const uint8_t* rg = sk + kmis + (rb + 8 * n + g) * KREC;           // the lane's B row
          const uint8_t* rm = sk + kmis + (rb + 8 * n + 2 * t) * KREC + CB;  // C rows' metadata
          float l0[2] = {0.0f, 0.0f}, l1[2] = {0.0f, 0.0f};
#pragma unroll
          for (int c = 0; c < NCH; ++c) {
            uint32_t kb[4];
            key_code_pairs<KB>(rg, c, t, kb);
            float cc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_16816(cc, qa[2 * c][0], qa[2 * c][1], qa[2 * c][2], qa[2 * c][3], kb[0], kb[1]);
            mma_16816(cc, qa[2 * c + 1][0], qa[2 * c + 1][1], qa[2 * c + 1][2], qa[2 * c + 1][3],
                      kb[2], kb[3]);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const uint32_t m = lds32(rm + e * KREC + 4 * c);  // (lo, scale) of row 2 t + e
              const __half2 h = *reinterpret_cast<const __half2*>(&m);
              const float lo = __low2float(h), sc = __high2float(h);
              l0[e] = fmaf(sc, cc[e], fmaf(lo, qsum[0][c], l0[e]));
              l1[e] = fmaf(sc, cc[2 + e], fmaf(lo, qsum[1][c], l1[e]));
            }
          }
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            lg[0][n][e] = l0[e] * sinv[0];  // exact (a power of two)
            lg[1][n][e] = l1[e] * sinv[1];
          }
        }
      }
      if (!all_vis) {
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (!row_visible(p, pos0, row_rel, rb + 8 * n + 2 * t + e, nr, vis_lo, vis_hi))
              lg[0][n][e] = lg[1][n][e] = -INFINITY;
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
      // ---- (3) values: A = P of the lane's own C fragments (rows rb + 2 t + e | + 8)
      const bool pbf = BF && !packed;  // packed values are fp16 operands
      const uint32_t pa0 = pbf ? pack_part<true>(pr[0][0][0], pr[0][0][1], 0)
                               : pack_part(pr[0][0][0], pr[0][0][1], 0);
      const uint32_t pa1 = pbf ? pack_part<true>(pr[1][0][0], pr[1][0][1], 0)
                               : pack_part(pr[1][0][0], pr[1][0][1], 0);
      const uint32_t pa2 = pbf ? pack_part<true>(pr[0][1][0], pr[0][1][1], 0)
                               : pack_part(pr[0][1][0], pr[0][1][1], 0);
      const uint32_t pa3 = pbf ? pack_part<true>(pr[1][1][0], pr[1][1][1], 0)
                               : pack_part(pr[1][1][0], pr[1][1][1], 0);
      if (!packed) {
        // B = V by ldmatrix.trans, lane l addressing row rb + l % 8 + 8 ((l / 8) % 2) of chunk
        // j + l / 16
        const uint8_t* vrow = sv + (rb + (lane & 7) + 8 * ((lane >> 3) & 1)) * RB;
        const int vsw = swz(lane & 7), vhi = lane >> 4;
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_trans(vrow + 16 * ((j + vhi) ^ vsw), b0, b1, b2, b3);
          mma_rows<BF>(vacc[j], pa0, pa1, pa2, pa3, b0, b1);
          mma_rows<BF>(vacc[j + 1], pa0, pa1, pa2, pa3, b2, b3);
        }
      } else if constexpr (PK > 0) {
        // B = the dequantized pairs of rows (2 t, 2 t + 1) and (2 t + 8, 2 t + 9) of channel
        // LaneCodes::channel(g, c, o) (decode_attention_mma.cuh's value decoding under the
        // lane-unit map: lane g's unit c of each row, its (lo, scale) once per warp-tile)
        const uint8_t* r0 = sv + vmis + (rb + 2 * t) * KREC;
        const uint8_t* const rec[4] = {r0, r0 + KREC, r0 + 8 * KREC, r0 + 9 * KREC};
        LaneValues<D, KB> lv;
        lv.load(rec, g, CB + 4 * LaneCodes<D, KB>::group(g, 32));
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
          uint32_t e[4], f[4];  // channel + 0, + 1 (e) and + 2, + 3 (f): rows 2 t.. | 2 t + 8..
          lv.unit(c, e, f);
          mma_16816(vacc[4 * c], pa0, pa1, pa2, pa3, e[0], e[2]);
          mma_16816(vacc[4 * c + 1], pa0, pa1, pa2, pa3, e[1], e[3]);
          mma_16816(vacc[4 * c + 2], pa0, pa1, pa2, pa3, f[0], f[2]);
          mma_16816(vacc[4 * c + 3], pa0, pa1, pa2, pa3, f[1], f[3]);
        }
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
    float* dst = wacc + (warp * G + h) * D;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // the element's channel: rows 8 j + 2 t + e; packed n-tile j = 4 c + o: column 2 t + e's
        // unit c, code o (LaneCodes)
        const int ch =
            packed ? LaneCodes<D, KB>::channel(2 * t + e, j >> 2, j & 3) : 8 * j + 2 * t + e;
        dst[merge_slot(h, ch)] = vacc[j][2 * hh + e];
      }
  }
  __syncthreads();
  write_partials<D, G, true>(p, bh, split, wm, wl, wacc, nullptr, tid);
}

}  // namespace vq::cuda::decode_mma
