// The split kernel of fused decode attention for packed segments with channel-axis keys
// (decode_attention_channel.cuh), templated on D (64, 128) and the query heads per block G (1, 2,
// 4, 8; DecodePlan::kv_rep blocks per KV head take larger or odd groups).
//
// A block of 128 threads reads rows [begin, end) of one split of one (b, kv head) for its G query
// heads. Inside a run of key rows sharing (lo_c, scale_c) per stored channel c (run r = rows
// [k_runs[r], k_runs[r + 1]) of DecodeChannelParams, its metadata list in its first records):
//   q . k_t = sum_c (q'_c * scale_c) * code_{t,c} + sum_c q'_c * lo_c      (q' = P R q *
//   scale_log2)
// so each run folds the scales into the query once (qs, [G][D] in shared memory) and adds one
// bias per head to every logit of the run. Rows go in steps of 64: (1) logits, a warp per row,
// lane l owning stored channels l, l + 32, ... (codes by packed.h's code_at: every width, the
// three-level format too), a shuffle reduction per head; (2) an online-softmax step per head in
// the log2 domain (running max m and sum l, exp2); (3) the value accumulation, thread (d, phase)
// owning stored value channel d of every 128/D-th row (code * scale + lo of its token-axis group),
// kept in stored channel order like the split kernel's packed values (the combine un-transforms
// it once). Everything is fp32 (FMA contraction allowed: attention meets a bound, not bits).
// Partials: acc [B, H_q, n_splits, D], (m, l) [B, H_q, n_splits, 2], m = -inf and zeros for a
// split that sees no key.
#include <cuda_fp16.h>

#include <string>

#include "cuda/check.h"
#include "cuda/decode_attention_channel.cuh"
#include "cuda/decode_attention_kernel.cuh"
#include "veloxquant/packed.h"

namespace vq::cuda {

namespace {

constexpr int kChThreads = decode_impl::kThreads;  // 128: transform_queries' stride
constexpr int kChWarps = kChThreads / 32;
constexpr int kChTile = 64;  // rows per online-softmax step

template <int D, int G>
__global__ void __launch_bounds__(kChThreads)
    decode_channel_kernel(const __grid_constant__ DecodeParams p,
                          const __grid_constant__ DecodeChannelParams ch, int si) {
  constexpr int PH = kChThreads / D;  // row phases of the value accumulation
  constexpr int CPL = D / 32;         // key channels per lane
  static_assert(PH >= 1 && kChThreads % D == 0 && D % 32 == 0, "D 64 or 128");
  __shared__ float q0[G * D];         // q' * scale_log2, stored key channel order
  __shared__ float qs[G * D];         // q0 * scale_c of the current run
  __shared__ float tmp[PH * G * D];   // transform scratch, then the phases' accumulators
  __shared__ float lg[kChTile][G];    // logits, then probabilities, of one step
  __shared__ float red[kChWarps][G];  // bias reduction
  __shared__ float bias[G], m_s[G], l_s[G], corr_s[G];

  const DecodeSegmentParams& sg = p.seg[si];
  const DecodePackedParams& pk = p.pk;
  int kvh = 0;
  const int seg_split = decode_impl::block_split(p, kvh);  // the split within the segment
  const int split = sg.split_begin + seg_split, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r_begin = static_cast<int64_t>(seg_split) * sg.rows_per_split;
  const int64_t r_end = decode_impl::min64(sg.n_rows, r_begin + sg.rows_per_split);
  const int64_t bh = static_cast<int64_t>(b) * p.n_kv_heads + kvh;
  const int64_t kbh = decode_impl::kv_bh(p, b, kvh);  // the stored head's rows
  const int krb = sg.k_row_bytes, vrb = sg.v_row_bytes;
  const uint8_t* kbase = sg.k + kbh * sg.capacity * krb;
  const uint8_t* vbase = sg.v + kbh * sg.capacity * vrb;
  const int32_t* pos = sg.positions ? sg.positions + kbh * sg.capacity : nullptr;
  CodeSpec kspec, vspec;
  kspec.bits_x2 = static_cast<uint8_t>(ch.k_bits_x2);
  vspec.bits_x2 = static_cast<uint8_t>(ch.v_bits_x2);
  const MetaType kmt = static_cast<MetaType>(pk.k_meta), vmt = static_cast<MetaType>(pk.v_meta);
  const int slots = ch.k_meta_slots;
  const int32_t* runs = ch.k_runs[si];
  const int32_t n_runs = ch.k_n_runs[si];

  // ---- queries of the G heads, scaled and transformed like the keys (P R q)
  const float* qg = p.q + (bh * G) * D;
  for (int i = tid; i < G * D; i += kChThreads) q0[i] = qg[i] * p.scale_log2;
  if (tid < G) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  __syncthreads();
  if (pk.k_signs || pk.k_perm)
    decode_impl::transform_queries<D, G>(q0, tmp, pk, kvh / p.kv_rep, tid);

  const int d = tid % D, ph = tid / D;  // value channel and row phase of this thread
  float acc[G];
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g] = 0.0f;

  // the run holding r_begin: the last r with k_runs[r] <= r_begin
  int32_t run = 0;
  if (runs) {
    int32_t lo = 0, hi = n_runs - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (runs[mid] <= r_begin) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    run = lo;
  }
  for (int64_t r = r_begin; r < r_end; ++run) {
    const int64_t run0 = runs ? runs[run] : 0;
    const int64_t run1 = runs ? runs[run + 1] : sg.n_rows;
    const int64_t seg_end = run1 < r_end ? run1 : r_end;
    // ---- fold the run's scales into the query, its zero points into one bias per head
    const uint8_t* chunk0 = kbase + run0 * krb;
    float bp[G];
#pragma unroll
    for (int g = 0; g < G; ++g) bp[g] = 0.0f;
    __syncthreads();  // qs, bias of the previous run no longer read
    for (int c = tid; c < D; c += kChThreads) {
      const int el = 2 * c, es = 2 * c + 1;
      const float lo = meta_load(chunk0 + (el / slots) * krb + pk.k_code_bytes, el % slots, kmt);
      const float sc = meta_load(chunk0 + (es / slots) * krb + pk.k_code_bytes, es % slots, kmt);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        qs[g * D + c] = q0[g * D + c] * sc;
        bp[g] = fmaf(q0[g * D + c], lo, bp[g]);
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) bp[g] += __shfl_xor_sync(0xffffffffu, bp[g], o);
      if (lane == 0) red[warp][g] = bp[g];
    }
    __syncthreads();
    if (tid < G) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kChWarps; ++w) s += red[w][tid];
      bias[tid] = s;
    }
    __syncthreads();

    for (int64_t t0 = r; t0 < seg_end; t0 += kChTile) {
      const int nt = static_cast<int>(seg_end - t0 < kChTile ? seg_end - t0 : kChTile);
      // ---- (1) logits of the step's rows, a warp per row
      for (int rr = warp; rr < nt; rr += kChWarps) {
        const int64_t row = t0 + rr;
        const uint8_t* rec = kbase + row * krb;
        float part[G];
#pragma unroll
        for (int g = 0; g < G; ++g) part[g] = 0.0f;
#pragma unroll
        for (int k = 0; k < CPL; ++k) {
          const int c = lane + 32 * k;
          const float code = static_cast<float>(code_at(rec, c, kspec));
#pragma unroll
          for (int g = 0; g < G; ++g) part[g] = fmaf(qs[g * D + c], code, part[g]);
        }
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int o = 16; o >= 1; o >>= 1) part[g] += __shfl_xor_sync(0xffffffffu, part[g], o);
        if (lane == 0) {
          const int64_t pj = pos ? pos[row] : sg.first_pos + row;
          const bool vis = pj <= p.q_pos && (p.window <= 0 || p.q_pos < pj + p.window);
#pragma unroll
          for (int g = 0; g < G; ++g) lg[rr][g] = vis ? part[g] + bias[g] : -INFINITY;
        }
      }
      __syncthreads();
      // ---- (2) online softmax per head (log2 domain)
      if (tid < G) {
        const int g = tid;
        float mx = -INFINITY;
        for (int rr = 0; rr < nt; ++rr) mx = fmaxf(mx, lg[rr][g]);
        const float m_new = fmaxf(m_s[g], mx);
        const bool none = m_new == -INFINITY;  // nothing visible yet: keep zeros
        const float corr = none ? 1.0f : exp2f(m_s[g] - m_new);
        float l = l_s[g] * corr;
        for (int rr = 0; rr < nt; ++rr) {
          const float pr = none ? 0.0f : exp2f(lg[rr][g] - m_new);
          lg[rr][g] = pr;
          l += pr;
        }
        m_s[g] = m_new;
        l_s[g] = l;
        corr_s[g] = corr;
      }
      __syncthreads();
      // ---- (3) values: stored channel d of rows ph, ph + PH, ... of the step
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] *= corr_s[g];
      const int vg = d / pk.group_size;
      for (int rr = ph; rr < nt; rr += PH) {
        const uint8_t* rec = vbase + (t0 + rr) * vrb;
        const uint8_t* meta = rec + pk.v_code_bytes;
        const float v = dequantize_code(code_at(rec, d, vspec), meta_load(meta, 2 * vg + 1, vmt),
                                        meta_load(meta, 2 * vg, vmt));
#pragma unroll
        for (int g = 0; g < G; ++g) acc[g] = fmaf(lg[rr][g], v, acc[g]);
      }
      __syncthreads();  // lg is rewritten by the next step
    }
    r = seg_end;
  }

  // ---- partials: the phases' accumulators summed (one running max per head)
#pragma unroll
  for (int g = 0; g < G; ++g) tmp[(ph * G + g) * D + d] = acc[g];
  __syncthreads();
  for (int i = tid; i < G * D; i += kChThreads) {
    const int g = i / D, c = i % D;
    float a = 0.0f;
#pragma unroll
    for (int k = 0; k < PH; ++k) a += tmp[(k * G + g) * D + c];
    const int64_t row = (bh * G + g) * p.n_splits + split;
    p.part_acc[row * D + c] = m_s[g] == -INFINITY ? 0.0f : a;
    if (c == 0) {
      p.part_ml[2 * row] = m_s[g];
      p.part_ml[2 * row + 1] = l_s[g];
    }
  }
}

template <int D, int G>
void launch_dg(const DecodeParams& p, const DecodeChannelParams& ch, int si, cudaStream_t s) {
  const DecodeSegmentParams& sg = p.seg[si];
  const dim3 grid = decode_impl::split_grid(p, sg.n_splits, p.batch);
  decode_channel_kernel<D, G><<<grid, kChThreads, 0, s>>>(p, ch, si);
  VQ_CUDA_LAUNCH_CHECK(decode_channel_kernel);
}

template <int D>
void launch_d(const DecodeParams& p, const DecodeChannelParams& ch, int si, cudaStream_t s) {
  switch (p.group) {
    case 1:
      return launch_dg<D, 1>(p, ch, si, s);
    case 2:
      return launch_dg<D, 2>(p, ch, si, s);
    case 4:
      return launch_dg<D, 4>(p, ch, si, s);
    case 8:
      return launch_dg<D, 8>(p, ch, si, s);
    default:
      throw Error("[decode_attention] internal: expected 1, 2, 4 or 8 query heads per block, got " +
                  std::to_string(p.group));
  }
}

}  // namespace

void decode_channel_launch(const DecodeParams& p, const DecodeChannelParams& ch, cudaStream_t s) {
  VQ_CHECK(p.seqs == nullptr, "[decode_attention] expected an unbatched run for channel-axis keys");
  VQ_CHECK(ch.k_meta_slots >= 1 && p.pk.group_size >= 1,
           "[decode_attention] expected channel-axis key metadata slots and a value group size");
  for (int si = 0; si < p.n_segments; ++si) {
    if (p.seg[si].packed != 2 || p.seg[si].n_splits == 0) continue;
    switch (p.head_dim) {
      case 64:
        launch_d<64>(p, ch, si, s);
        break;
      case 128:
        launch_d<128>(p, ch, si, s);
        break;
      default:
        throw Error("[decode_attention] expected head_dim in {64, 128} but got " +
                    std::to_string(p.head_dim));
    }
  }
}

}  // namespace vq::cuda
