// Prefill attention on Hopper's warpgroup products (wgmma, sm_90a) over views of f16 or bf16
// rows at D 128 (packed segments arrive as such rows, dequantized and rounded once per call by
// prefill_attention.cu), FlashAttention-3's plan on the schedule of prefill_fa.cu: one block per
// 128 query rows (rows t = i * n_rep + r, so the n_rep query heads of a KV head share each key
// tile) and KV head; a producer warpgroup stages key tiles of 128 rows (prefill_tc.cuh's schedule
// and staging, in wgmma.cuh's 128-byte-swizzled layout) behind mbarriers, two consumer
// warpgroups of 64 rows each compute S = Q K^T as 8 products m64n128k16 from shared memory (the
// queries staged once per block), the online softmax in registers, and O += P V as 8 products
// m64n128k16 with P from registers (rounded once to the rows' type) and V read transposed from
// shared memory, each overlapping its softmax with its own P V and, by turns, with the other
// warpgroup's products. Numerics as prefill_fa.cu's (q * 2^sigma and p rounded once to E, fp32
// accumulation and softmax; tests/ops_harness/attention_bounds.h's kPrefillTc). Heaviest
// (latest) query blocks run first. Measured in docs/results/gpu/run15_s16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/prefill_attention.cuh"
#include "cuda/prefill_tc.cuh"
#include "cuda/tc_common.cuh"
#include "cuda/wgmma.cuh"

namespace vq::cuda {

namespace {

constexpr int kWgD = 128, kWgBM = 128, kWgThreads = 384;  // 2 consumer warpgroups + 1 producer

// Shared memory (offsets from a 1024-byte aligned base): the queries [BM][D] (E, wg_off layout),
// 2 key planes and 2 value planes [BK][D] (each 1024-byte aligned), the key positions of each
// key plane, the positions the value staging writes (unread), the queries' multipliers, each key
// plane's tile word (kTileFull, kTileEnd) and the 8 mbarriers.
constexpr int wg_plane_bytes(int BK) {
  return BK * 2 * kWgD;
}
constexpr int wg_smem_bytes(int BK) {
  return 1024 + kWgBM * 2 * kWgD + 4 * wg_plane_bytes(BK) + 3 * BK * 8 + kWgBM * 4 + 16 + 64;
}
template <int BK>
struct WgPlane {
  __device__ __forceinline__ int operator()(int r, int c) const { return wg_off<BK>(r, c); }
};

// Warp specialised: warps 0-7 are 2 consumer warpgroups of 64 query rows each (224 registers
// per thread by setmaxnreg), warps 8-11 the producer warpgroup (56). The producer walks the tile
// schedule (each of its warps alike) and stages planes in the order K0 V0 K1 V1 ...
// into 2 key and 2 value planes, each plane published on its "full" mbarrier once its copies
// landed (cp.async wait, proxy fence, arrive) and reused after the consumers' arrivals on its
// "empty" mbarrier; a key plane's word says whether its tile needs masks, or that the schedule
// ended. Each consumer warpgroup runs its own software pipeline with no block barrier: it issues
// S(j + 1) = Q K(j + 1)^T and O += P(j) V(j) back to back, waits for S(j + 1) and runs its
// softmax while P(j) V(j) is still on the tensor cores, then waits for it, rescales O and packs
// P(j + 1). Freeing a plane never needs the plane staged just before it (K(t) waits for S(t - 2),
// which needs K(t - 2) and V(t - 3); V(t) for P(t - 2) V(t - 2), which needs K(t - 1)), so the
// producer publishes each plane one staging later without deadlock.
template <int BK, class E>
__global__ void __launch_bounds__(kWgThreads, 1)
    prefill_wg_kernel(const __grid_constant__ PrefillParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = kWgD, BM = kWgBM;
  constexpr int KS = D / 16, NB = BK / 8, PB = wg_plane_bytes(BK);
  static_assert(BK == 128, "prefill_wg: the products are m64n128k16 (128-key tiles)");
  constexpr bool BF16 = std::is_same_v<E, __nv_bfloat16>;
  constexpr int kTileFull = 1, kTileEnd = 2, PT = 128;  // tile words; producer threads
  extern __shared__ uint8_t wsm_raw[];
  uint8_t* wsm =
      wsm_raw + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(wsm_raw)) & 1023)) & 1023);
  uint8_t* qsm = wsm;
  uint8_t* kpl = wsm + BM * 2 * D;                           // key planes 0, 1
  uint8_t* vpl = kpl + 2 * PB;                               // value planes 0, 1
  int64_t* kpos = reinterpret_cast<int64_t*>(vpl + 2 * PB);  // [2][BK], then [BK] unread
  float* csm = reinterpret_cast<float*>(kpos + 3 * BK);
  int* tword = reinterpret_cast<int*>(csm + BM);            // [2] (+2 spare)
  uint64_t* bars = reinterpret_cast<uint64_t*>(tword + 4);  // 8 mbarriers
  uint64_t *full_k = bars, *full_v = bars + 2, *empty_k = bars + 4, *empty_v = bars + 6;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const PrefillRows rows(p, BM);
  const int64_t n_rep = rows.n_rep, T = rows.T, t0 = rows.t0, frame = rows.frame;
  const int64_t qmin = rows.qmin, qmax = rows.qmax;
  const int64_t win = p.window;

  if (tid == 0) {
    for (int i = 0; i < 4; ++i) mbar_init(bars + i, PT);  // full: every producer thread
    for (int i = 4; i < 8; ++i) mbar_init(bars + i, 8);   // empty: lane 0 of each consumer warp
  }
  __syncthreads();

  if (warp >= 8) {
    // ---- producer warpgroup (each warp walks the schedule alike; 128 threads stage)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    const int ptid = tid - 256;
    const auto stage = [&](int sg, int64_t j0, const void* src, uint8_t* plane, int64_t* spos) {
      const void* const s1[1] = {src};
      prefill_stage<D, BK, PT, 1, WgPlane<BK>>(p.segs[sg], frame, j0, ptid, s1, plane, spos);
      tc_commit();
    };
    const auto publish = [&](uint64_t* bar) {  // every copy but the latest group landed
      tc_wait<1>();
      wg_fence_smem();
      mbar_arrive(bar);
    };
    int sg = 0;
    int64_t j0 = 0;
    bool full = false;
    bool have = prefill_seek<BK, true>(p, frame, qmin, qmax, lane, sg, j0, full);
    uint64_t* pending = nullptr;  // the plane staged last, not yet published
    for (int t = 0;; ++t) {
      const int pb = t & 1, ph = ((t - 2) >> 1) & 1;
      if (t >= 2) mbar_wait(empty_k + pb, ph);
      if (have) stage(sg, j0, p.segs[sg].keys, kpl + pb * PB, kpos + pb * BK);
      if (ptid == 0) tword[pb] = have ? (full ? kTileFull : 0) : kTileEnd;
      if (!have) tc_commit();
      if (pending) publish(pending);
      pending = full_k + pb;
      if (!have) break;
      if (t >= 2) mbar_wait(empty_v + pb, ph);
      stage(sg, j0, p.segs[sg].values, vpl + pb * PB, kpos + 2 * BK);
      publish(pending);
      pending = full_v + pb;
      j0 += BK;
      have = prefill_seek<BK, true>(p, frame, qmin, qmax, lane, sg, j0, full);
    }
    tc_wait<0>();
    wg_fence_smem();
    mbar_arrive(pending);
    return;
  }

  // ---- consumers: warpgroup wg owns rows 64 wg .. 64 wg + 63; warp w stages rows 16 w ..
  // 16 w + 15 of the queries (4 channels per lane), each rounded once to E as q * 2^sigma, and
  // the row's multiplier scale * log2 e * 2^-sigma; rows past the end are zeros.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
  const int wg = warp >> 2, g = lane >> 2, t4 = lane & 3;
  {
    const float sl2e = p.scale * 1.4426950408889634f;
    for (int rr = 0; rr < 16; ++rr) {
      const int r = 16 * warp + rr;
      const int64_t t = t0 + r;
      float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (t < T) {
        const float* q = p.q + rows.offset(t, D) + 4 * lane;
        const float2 v0 = *reinterpret_cast<const float2*>(q);
        const float2 v1 = *reinterpret_cast<const float2*>(q + 2);
        x = make_float4(v0.x, v0.y, v1.x, v1.y);
      }
      float m = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const int sigma = tc_sigma(m);
      *reinterpret_cast<uint32_t*>(qsm + wg_off<BM>(r, 4 * lane)) =
          tc_pack2<E>(ldexpf(x.x, sigma), ldexpf(x.y, sigma));
      *reinterpret_cast<uint32_t*>(qsm + wg_off<BM>(r, 4 * lane + 2)) =
          tc_pack2<E>(ldexpf(x.z, sigma), ldexpf(x.w, sigma));
      if (lane == 0) csm[r] = ldexpf(sl2e, -sigma);
    }
    wg_fence_smem();
    if (wg == 0)  // this warpgroup's rows
      asm volatile("bar.sync 1, 128;\n" ::: "memory");
    else
      asm volatile("bar.sync 2, 128;\n" ::: "memory");
  }

  // This thread's 2 rows (half hf: row g or g + 8 of its warp's 16), their positions and
  // multipliers.
  int64_t qp[2];
  float cm[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = 16 * warp + 8 * hf + g;
    qp[hf] = p.q_pos0 + (t0 + r) / n_rep;
    cm[hf] = csm[r];
  }
  float o[D / 2], s[BK / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < BK / 2; ++i) s[i] = 0.0f;
  float mx[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const uint8_t* qw = qsm + wg * 64 * 128;  // this warpgroup's 64 rows of each column block

  // Descriptors of this warpgroup's queries and of key and value plane 0; an operand at byte
  // offset x from one of them is its descriptor plus x / 16 (the address field, 14 bits of
  // address / 16, does not carry: shared memory is below 256 KB).
  const uint64_t dq = wg_desc(qw, 16, 1024), dk = wg_desc(kpl, 16, 1024),
                 dv = wg_desc(vpl, BK * 128, 1024);
  // S = Q K^T over key plane i (64 rows x BK keys per warpgroup), issued and committed.
  const auto logits = [&](int i) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      wg_mma_ss<BF16>(s, dq + (((ks >> 2) * (BM * 128) + (ks & 3) * 32) >> 4),
                      dk + ((i * PB + (ks >> 2) * (BK * 128) + (ks & 3) * 32) >> 4), ks);
    wg_commit();
  };
  // Mask (by key plane i's positions unless its tile is full: a key is visible to a row at
  // position q when 0 <= q - kp < wl, wl the window or the largest int64, as one unsigned
  // compare) and online softmax per row in log2 units (as prefill_fa.cu): s becomes the tile's
  // weights, corr the rows' rescale factors; true when some row of the warp moved its max. Maxima
  // and sums run in 4 independent chains per row.
  const uint64_t wl = win > 0 ? static_cast<uint64_t>(win) : static_cast<uint64_t>(INT64_MAX);
  const auto softmax = [&](int i, bool tile_full, float(&corr)[2]) -> bool {
    if (!tile_full) {
      const int64_t* spos = kpos + i * BK;
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t kp = spos[8 * n + 2 * t4 + (e & 1)];
          const uint64_t d = static_cast<uint64_t>(qp[e >> 1] - kp);
          s[4 * n + e] = d < wl ? s[4 * n + e] : -INFINITY;
        }
    }
    bool moved = false;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float xa[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < NB; ++n)
        xa[n & 3] = fmaxf(xa[n & 3], fmaxf(s[4 * n + 2 * hf], s[4 * n + 2 * hf + 1]));
      float xm = fmaxf(fmaxf(xa[0], xa[1]), fmaxf(xa[2], xa[3]));
#pragma unroll
      for (int of = 1; of <= 2; of <<= 1) xm = fmaxf(xm, __shfl_xor_sync(0xffffffffu, xm, of));
      const float c = cm[hf];
      const float nm = fmaxf(mx[hf], xm * c);
      const float z = nm == -INFINITY ? 0.0f : nm;
      corr[hf] = tc_exp2(mx[hf] - z);
      moved = moved || corr[hf] != 1.0f;
      mx[hf] = nm;
      float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int n = 0; n < NB; ++n) {
        s[4 * n + 2 * hf] = tc_exp2(fmaf(s[4 * n + 2 * hf], c, -z));
        s[4 * n + 2 * hf + 1] = tc_exp2(fmaf(s[4 * n + 2 * hf + 1], c, -z));
        sa[n & 3] += s[4 * n + 2 * hf] + s[4 * n + 2 * hf + 1];
      }
      l[hf] = l[hf] * corr[hf] + ((sa[0] + sa[1]) + (sa[2] + sa[3]));
    }
    return __any_sync(0xffffffffu, moved);
  };
  const auto release = [&](uint64_t* bar) {
    if (lane == 0) mbar_arrive(bar);
  };

  // Turns (named barriers 3 and 4, both warpgroups' 256 threads): a warpgroup issues its
  // products of a tile only in its turn and passes the turn on once they are issued, so one
  // warpgroup's softmax runs while the other's products hold the tensor cores. Warpgroup 1 passes
  // the first turn to warpgroup 0 and none after its last tile.
  const auto turn_wait = [&] {
    if (wg == 0)
      asm volatile("bar.sync 3, 256;\n" ::: "memory");
    else
      asm volatile("bar.sync 4, 256;\n" ::: "memory");
  };
  const auto turn_pass = [&] {
    if (wg == 0)
      asm volatile("bar.arrive 4, 256;\n" ::: "memory");
    else
      asm volatile("bar.arrive 3, 256;\n" ::: "memory");
  };

  float corr[2];
  mbar_wait(full_k, 0);
  int word = tword[0];
  if (word != kTileEnd) {
    wg_fence();
    logits(0);
    wg_wait<0>();
    wg_pin(s);
    (void)softmax(0, word == kTileFull, corr);  // O is zero: nothing to rescale
    release(empty_k);
  }
  if (word != kTileEnd && wg == 1) turn_pass();
  for (int j = 0; word != kTileEnd; ++j) {
    const int kc = j & 1, kn = kc ^ 1;
    mbar_wait(full_k + kn, ((j + 1) >> 1) & 1);  // K(j + 1) or the end
    word = tword[kn];
    mbar_wait(full_v + kc, (j >> 1) & 1);  // V(j)
    // P(j), rounded once to E (mma.m16n8k16's A layout per 16 keys)
    uint32_t pa[BK / 16][4];
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      pa[kk][0] = tc_pack2<E>(s[8 * kk], s[8 * kk + 1]);
      pa[kk][1] = tc_pack2<E>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = tc_pack2<E>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = tc_pack2<E>(s[8 * kk + 6], s[8 * kk + 7]);
    }
    wg_pin(s);
    wg_pin(o);
    wg_fence();
    const auto pv = [&] {  // O += P(j) V(j), issued and committed
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wg_mma_rs<BF16>(o, pa[kk], dv + ((kc * PB + kk * 2048) >> 4), 1);
      wg_commit();
    };
    bool moved = false;
    if (word != kTileEnd) {  // (each branch issues its own products: no join between them)
      turn_wait();
      logits(kn);
      pv();
      turn_pass();
      wg_wait<1>();
      wg_pin(s);
      moved = softmax(kn, word == kTileFull, corr);
      release(empty_k + kn);
    } else {
      turn_wait();
      pv();
      if (wg == 0) turn_pass();  // the other warpgroup's last turn (it passes none back)
    }
    wg_wait<0>();
    wg_pin(o);
    release(empty_v + kc);
    if (moved) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[4 * n] *= corr[0];
        o[4 * n + 1] *= corr[0];
        o[4 * n + 2] *= corr[1];
        o[4 * n + 3] *= corr[1];
      }
    }
  }

  // ---- outputs: o / l per row (zeros for a row that saw no key), fp32
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float lt = l[hf];
#pragma unroll
    for (int of = 1; of <= 2; of <<= 1) lt += __shfl_xor_sync(0xffffffffu, lt, of);
    const int64_t t = t0 + 16 * warp + 8 * hf + g;
    if (t >= T) continue;
    float* out = p.out + rows.offset(t, D);
    const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<float2*>(out + 8 * n + 2 * t4) =
          lt > 0.0f ? make_float2(o[4 * n + 2 * hf] * inv, o[4 * n + 2 * hf + 1] * inv)
                    : make_float2(0.0f, 0.0f);
  }
#else
  __trap();  // prefill_wg_usable() keeps launches to sm_90a builds on sm_90 devices
#endif
}

template <int BK, class E>
void wg_run(const PrefillParams& p, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(p.n_rep) * p.n_queries;
  const dim3 grid(static_cast<unsigned>((rows + kWgBM - 1) / kWgBM),
                  static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.batch));
  constexpr int smem = wg_smem_bytes(BK);
  auto kernel = prefill_wg_kernel<BK, E>;
  VQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kWgThreads, static_cast<size_t>(smem), s>>>(p);
  VQ_CUDA_LAUNCH_CHECK("prefill_attention (wgmma)");
}

}  // namespace

bool prefill_wg_usable(int head_dim) {
#if defined(VQ_CUDA_SM90A)
  if (head_dim != kWgD || std::getenv("VQ_PREFILL_MMA_SYNC") != nullptr) return false;
  static const bool sm90 = [] {  // the first device asked for: nodes are alike
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
      return false;
    return major == 9 && minor == 0;
  }();
  return sm90;
#else
  (void)head_dim;
  return false;
#endif
}

void prefill_wg_launch(const PrefillParams& p, bool bf16, cudaStream_t s) {
  if (bf16)
    wg_run<128, __nv_bfloat16>(p, s);
  else
    wg_run<128, __half>(p, s);
}

}  // namespace vq::cuda
