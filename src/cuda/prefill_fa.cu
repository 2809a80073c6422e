// Prefill attention on tensor cores over views of f16 or bf16 rows (D 64/128; packed segments
// arrive as such rows, dequantized and rounded once per call by prefill_attention.cu),
// FlashAttention-2's schedule on mma.sync: one block of NW warps per (16 MT NW query rows, KV head,
// batch), rows t = i * n_rep + r so the n_rep query heads of a KV head share each key tile, each
// warp owning 16 MT rows as MT m16 tiles (MT = 2: every K and V fragment loaded by ldmatrix feeds
// two mma.m16n8k16, two independent accumulator chains; MT = 1: half the registers, so more warps
// per multiprocessor hide the latency of each; fa_launch's shapes: D 128 6 x MT 1, D 64 4 x MT 2).
// The queries are staged once per block in shared memory as E (fp16, or bf16 for bf16 rows) rounded
// once from q * 2^sigma (sigma puts the row's max |q| in [2^11, 2^12), clear of fp16 subnormals:
// tc_common.cuh's tc_sigma) and read per k-step by ldmatrix; tiles of BK keys stream through 2
// cp.async stages (prefill_tc.cuh's schedule and staging: tiles no row of the block sees are never
// loaded, masks only on tiles some row sees partly); logits in log2 units (scale * log2 e *
// 2^-sigma, folded into the exponent's fma), online softmax with ex2.approx in fp32 (sums of the
// unrounded p; the outputs' rescale skipped when no row of the warp raised its max), P kept in
// registers and rounded once to E as the A operand of P V, fp32 accumulation. FlashAttention
// numerics (docs/design.md section 4), held to the bounds of tests/ops_harness/attention_bounds.h
// (kPrefillTc of the operand type). Heaviest (latest) query blocks run first. Measured in
// docs/results/gpu/run9_prefill. At D 128 on an sm_90 device with sm_90a code in the build,
// prefill_fa_launch hands the view to the wgmma kernel (prefill_wg.cu) instead.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/prefill_attention.cuh"
#include "cuda/prefill_tc.cuh"
#include "cuda/tc_common.cuh"

namespace vq::cuda {

namespace {

// Shared memory of a block of BM query rows: the queries [BM][D] (E, swizzled), their logit
// multipliers (fp32), then 2 stages of the K and V planes [BK][D] and the tile's key positions.
__host__ __device__ constexpr int fa_q_bytes(int D, int BM) {
  return BM * (2 * D + 4);
}
__host__ __device__ constexpr int fa_stage_bytes(int D, int BK) {
  return 2 * BK * 2 * D + BK * 8;
}

// d += a * b on mma.m16n8k16 as tc_common.cuh's tc_mma, without volatile: the product touches
// registers alone, so the compiler may interleave it with the loads and the softmax.
template <class T>
__device__ __forceinline__ void fa_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int D, int MT, int NW, int BK, int MINB, class E>
__global__ void __launch_bounds__(32 * NW, MINB)
    prefill_fa_kernel(const __grid_constant__ PrefillParams p) {
  constexpr int KS = D / 16;                 // k-steps of the logits, n-tile pairs of the outputs
  constexpr int NB = BK / 8;                 // n-tiles of a key tile
  constexpr int RW = 16 * MT, BM = RW * NW;  // query rows per warp and per block
  constexpr int PB = BK * 2 * D, SB = fa_stage_bytes(D, BK), NT = 32 * NW;
  static_assert(NT >= BK, "prefill_seek and prefill_stage need a thread per key of a tile");
  extern __shared__ __align__(128) uint8_t fsm[];
  uint8_t* qsm = fsm;
  float* csm = reinterpret_cast<float*>(fsm + BM * 2 * D);
  uint8_t* stages = fsm + fa_q_bytes(D, BM);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3, lr = lane & 7, lm = lane >> 3;
  const PrefillRows rows(p, BM);
  const int64_t n_rep = rows.n_rep, T = rows.T, t0 = rows.t0, frame = rows.frame;
  const int64_t qmin = rows.qmin, qmax = rows.qmax;
  const int64_t win = p.window;

  // ---- queries: warp w stages its rows RW w .. RW w + RW - 1 (one row per step, D / 32
  // channels per lane), each rounded once to E as q * 2^sigma, and the row's multiplier
  // scale * log2 e * 2^-sigma; rows past the end are zeros.
  {
    constexpr int CPL = D / 32;
    const float sl2e = p.scale * 1.4426950408889634f;
    for (int rr = 0; rr < RW; ++rr) {
      const int r = RW * warp + rr;
      const int64_t t = t0 + r;
      float x[CPL];
#pragma unroll
      for (int i = 0; i < CPL; ++i) x[i] = 0.0f;
      if (t < T) {
        const float* q = p.q + rows.offset(t, D) + CPL * lane;
#pragma unroll
        for (int i = 0; i < CPL; i += 2) {
          const float2 v = *reinterpret_cast<const float2*>(q + i);
          x[i] = v.x;
          x[i + 1] = v.y;
        }
      }
      float m = 0.0f;
#pragma unroll
      for (int i = 0; i < CPL; ++i) m = fmaxf(m, fabsf(x[i]));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const int sigma = tc_sigma(m);
#pragma unroll
      for (int i = 0; i < CPL; i += 2)
        *reinterpret_cast<uint32_t*>(qsm + tc_off<D>(r, CPL * lane + i)) =
            tc_pack2<E>(ldexpf(x[i], sigma), ldexpf(x[i + 1], sigma));
      if (lane == 0) csm[r] = ldexpf(sl2e, -sigma);
    }
    __syncwarp();
  }
  // This lane's 2 MT rows: m-tile mt (rows RW warp + 16 mt ..), half hf (row g or g + 8); their
  // positions and multipliers.
  int64_t qp[MT][2];
  float cm[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = RW * warp + 16 * mt + 8 * hf + g;
      qp[mt][hf] = p.q_pos0 + (t0 + r) / n_rep;
      cm[mt][hf] = csm[r];
    }

  auto issue = [&](int sg, int64_t j0, int st) {
    const PrefillSeg& seg = p.segs[sg];
    uint8_t* base = stages + st * SB;
    int64_t* spos = reinterpret_cast<int64_t*>(base + 2 * PB);
    const void* const src[2] = {seg.keys, seg.values};
    prefill_stage<D, BK, NT, 2>(seg, frame, j0, tid, src, base, spos);
  };

  float o[MT][2 * KS][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < 2 * KS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.0f;
  float mx[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      mx[mt][hf] = -INFINITY;
      l[mt][hf] = 0.0f;
    }

  int sg = 0;
  int64_t j0 = 0;
  bool full = false;
  bool have = prefill_seek<BK>(p, frame, qmin, qmax, tid, sg, j0, full);
  int st = 0;
  if (have) issue(sg, j0, 0);
  tc_commit();
  while (have) {
    int nsg = sg;
    int64_t nj0 = j0 + BK;
    bool nfull = false;
    const bool next = prefill_seek<BK>(p, frame, qmin, qmax, tid, nsg, nj0, nfull);
    if (next) issue(nsg, nj0, st ^ 1);
    tc_commit();
    if (next)
      tc_wait<1>();
    else
      tc_wait<0>();
    __syncthreads();

    const uint8_t* kb = stages + st * SB;
    const uint8_t* vb = kb + PB;
    const int64_t* spos = reinterpret_cast<const int64_t*>(kb + 2 * PB);
    // ---- logits of RW rows x BK keys: s[mt][n] is m-tile mt, n-tile n (keys 8n .. 8n + 7)
    float s[MT][NB][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        tc_ldsm(qsm + tc_off<D>(RW * warp + 16 * mt + 8 * (lm & 1) + lr, 16 * ks + 8 * (lm >> 1)),
                a[mt]);
#pragma unroll
      for (int np = 0; np < NB / 2; ++np) {
        uint32_t r[4];
        tc_ldsm(kb + tc_off<D>(16 * np + 8 * (lm >> 1) + lr, 16 * ks + 8 * (lm & 1)), r);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          fa_mma<E>(s[mt][2 * np], a[mt], r[0], r[1]);
          fa_mma<E>(s[mt][2 * np + 1], a[mt], r[2], r[3]);
        }
      }
    }
    // ---- mask, online softmax per row in log2 units: the row max of the raw logits times the
    // row's multiplier c > 0 is the max of the scaled ones (rounding is monotonic), and each
    // weight is 2^(fma(s, c, -z)) (one rounding of the exponent, where s * c - z had two)
    float corr[MT][2];
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float xm[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hf = e >> 1;
          if (!full) {
            const int64_t kp = spos[8 * n + 2 * t4 + (e & 1)];
            if (!(kp <= qp[mt][hf] && (win <= 0 || qp[mt][hf] < kp + win))) s[mt][n][e] = -INFINITY;
          }
          xm[hf] = fmaxf(xm[hf], s[mt][n][e]);
        }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
        for (int of = 1; of <= 2; of <<= 1)
          xm[hf] = fmaxf(xm[hf], __shfl_xor_sync(0xffffffffu, xm[hf], of));
        const float c = cm[mt][hf];
        const float nm = fmaxf(mx[mt][hf], xm[hf] * c);
        const float z = nm == -INFINITY ? 0.0f : nm;
        corr[mt][hf] = tc_exp2(mx[mt][hf] - z);
        moved = moved || corr[mt][hf] != 1.0f;
        mx[mt][hf] = nm;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < NB; ++n) {
          s[mt][n][2 * hf] = tc_exp2(fmaf(s[mt][n][2 * hf], c, -z));
          s[mt][n][2 * hf + 1] = tc_exp2(fmaf(s[mt][n][2 * hf + 1], c, -z));
          sum += s[mt][n][2 * hf] + s[mt][n][2 * hf + 1];
        }
        l[mt][hf] = l[mt][hf] * corr[mt][hf] + sum;
      }
    }
    // the outputs' rescale, skipped when no row of the warp moved its max (every factor is 1)
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < 2 * KS; ++n) {
          o[mt][n][0] *= corr[mt][0];
          o[mt][n][1] *= corr[mt][0];
          o[mt][n][2] *= corr[mt][1];
          o[mt][n][3] *= corr[mt][1];
        }
    }
    // ---- outputs += P V (P rounded once to E, V through ldmatrix.trans)
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) {
      uint32_t ah[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        ah[mt][0] = tc_pack2<E>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        ah[mt][1] = tc_pack2<E>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        ah[mt][2] = tc_pack2<E>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        ah[mt][3] = tc_pack2<E>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
      const int key = 16 * kk + 8 * (lm & 1) + lr;
#pragma unroll
      for (int cp = 0; cp < KS; ++cp) {
        uint32_t r[4];
        tc_ldsm_t(vb + tc_off<D>(key, 16 * cp + 8 * (lm >> 1)), r);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          fa_mma<E>(o[mt][2 * cp], ah[mt], r[0], r[1]);
          fa_mma<E>(o[mt][2 * cp + 1], ah[mt], r[2], r[3]);
        }
      }
    }
    __syncthreads();  // stage st is free for the next issue
    sg = nsg;
    j0 = nj0;
    full = nfull;
    have = next;
    st ^= 1;
  }

  // ---- outputs: o / l per row (zeros for a row that saw no key), fp32
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float lt = l[mt][hf];
#pragma unroll
      for (int of = 1; of <= 2; of <<= 1) lt += __shfl_xor_sync(0xffffffffu, lt, of);
      const int64_t t = t0 + RW * warp + 16 * mt + 8 * hf + g;
      if (t >= T) continue;
      float* out = p.out + rows.offset(t, D);
      const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
#pragma unroll
      for (int n = 0; n < 2 * KS; ++n)
        *reinterpret_cast<float2*>(out + 8 * n + 2 * t4) =
            lt > 0.0f ? make_float2(o[mt][n][2 * hf] * inv, o[mt][n][2 * hf + 1] * inv)
                      : make_float2(0.0f, 0.0f);
    }
}

template <int D, int MT, int NW, int BK, int MINB, class E>
void fa_run(const PrefillParams& p, cudaStream_t s) {
  constexpr int BM = 16 * MT * NW;
  const int64_t rows = static_cast<int64_t>(p.n_rep) * p.n_queries;
  const dim3 grid(static_cast<unsigned>((rows + BM - 1) / BM), static_cast<unsigned>(p.kv_heads),
                  static_cast<unsigned>(p.batch));
  constexpr int smem = fa_q_bytes(D, BM) + 2 * fa_stage_bytes(D, BK);
  auto kernel = prefill_fa_kernel<D, MT, NW, BK, MINB, E>;
  VQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, 32 * NW, static_cast<size_t>(smem), s>>>(p);
}

// D 128: 6 warps of 16 rows (MT 1), 64-key tiles, 2 blocks per multiprocessor (<= 168
// registers, 91.5 KB): the fastest of five shapes timed in one call (H200, 32K f16 rows: 35.58
// ms against 35.89 for session 8's 4 warps of 32 rows (255 registers), 38.98 for 8 x 16 rows,
// 41.26 for 8 x 16 rows over 32-key tiles, 41.67 for 4 x 16 rows over 32-key tiles at 4 blocks;
// 4K: 0.765 against 0.831 ms; docs/results/gpu/run9_prefill). D 64 keeps 4 warps of 32 rows.
template <class E>
void fa_launch(const PrefillParams& p, cudaStream_t s) {
  if (p.head_dim == 64)
    fa_run<64, 2, 4, 64, 2, E>(p, s);
  else
    fa_run<128, 1, 6, 64, 2, E>(p, s);
  VQ_CUDA_LAUNCH_CHECK("prefill_attention (fa)");
}

}  // namespace

void prefill_fa_launch(const PrefillParams& p, bool bf16, cudaStream_t s) {
  if (prefill_wg_usable(p.head_dim)) {
    prefill_wg_launch(p, bf16, s);
    return;
  }
  if (bf16)
    fa_launch<__nv_bfloat16>(p, s);
  else
    fa_launch<__half>(p, s);
}

}  // namespace vq::cuda
