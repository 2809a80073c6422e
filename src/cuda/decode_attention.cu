// Fused decode attention: the combine kernel (exact log-sum-exp merge of the splits of each
// (b, query head), un-permute / un-rotate of the packed-value accumulator) and the dispatcher
// that picks the split kernel instance for the view's (key bits, value bits). The split kernel
// is in decode_attention_kernel.cuh, instantiated by decode_attention_k*.cu; views with
// channel-axis keys add decode_attention_channel.cu's kernel.
//
// The combine is launched as a programmatic dependent of the split kernel (see the launcher).
// Combine (one block of 512 threads per (b, query head): the max by a block reduction, then
// 512 / D slices per channel summing interleaved splits, added in shared memory):
// M = max_s m_s, w_s = 2^(m_s - M), out = (sum_s w_s acc_s) / (sum_s w_s l_s), where the
// accumulators of splits over packed, transformed values are summed apart (stored channel order),
// mapped back once (y[perm[j]] = x[j], then y <- signs .* H_norm y) and added. L == 0 (no visible
// key) gives zeros.
#include "cuda/decode_attention.cuh"
#include "cuda/decode_attention_channel.cuh"
#include "cuda/decode_attention_kernel.cuh"

namespace vq::cuda {

namespace decode_impl {

// Slices of the combine block: D * kCombineSlices = 512 threads, slice s of a channel d sums the
// splits s, s + S, s + 2S, ... (independent loads, no serial chain over the splits).
template <int D>
constexpr int combine_slices() {
  return 512 / D;
}

template <int D>
__global__ void __launch_bounds__(512)
    decode_combine_kernel(const __grid_constant__ DecodeParams P) {
  __shared__ __align__(16) DecodeParams sp;  // batched: sequence blockIdx.y's parameters
  decode_impl::stage_params(P, blockIdx.y, sp);
  const DecodeParams& p = sp;
  constexpr int S = combine_slices<D>();
  constexpr int kNT = D * S;
  __shared__ float red_o[S][D];
  __shared__ float red_s[S][D];
  __shared__ float red_l[S];
  __shared__ float wmax[kNT / 32];
  __shared__ float y[D];
  decode_impl::grid_dependency_wait();  // launched early (PDL): wait for the split kernel
  const int qh = blockIdx.x, b = P.seqs ? 0 : blockIdx.y, tid = threadIdx.x;
  const int d = tid % D, slice = tid / D;
  const int n_q_heads = p.n_kv_heads * p.group;
  const int kvh = qh / (p.group * p.kv_rep);  // the stored KV head (its value transforms)
  const int64_t row0 = (static_cast<int64_t>(b) * n_q_heads + qh) * p.n_splits;
  const float* ml = p.part_ml + 2 * row0;
  const float* pa = p.part_acc + row0 * D + d;

  // ---- M = max over the splits, block-wide
  float mx = -INFINITY;
  for (int s = tid; s < p.n_splits; s += kNT) mx = fmaxf(mx, ml[2 * s]);
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((tid & 31) == 0) wmax[tid >> 5] = mx;
  __syncthreads();
  mx = wmax[0];
#pragma unroll
  for (int w = 1; w < kNT / 32; ++w) mx = fmaxf(mx, wmax[w]);

  // ---- this slice's weighted sums; w_s = 2^(m_s - M) is 0 for an empty split (m_s = -inf)
  const bool v_transformed = p.v_bits > 0 && (p.pk.v_perm != nullptr || p.pk.v_signs != nullptr);
  float l = 0.0f, a_orig = 0.0f, a_stored = 0.0f;
  if (mx != -INFINITY) {
    for (int si = 0; si < p.n_segments; ++si) {
      const DecodeSegmentParams& sg = p.seg[si];
      const bool stored = v_transformed && sg.packed != 0;
      const int end = sg.split_begin + sg.n_splits;
      float a = 0.0f;
#pragma unroll 4
      for (int s = sg.split_begin + slice; s < end; s += S) {
        const float w = exp2f(ml[2 * s] - mx);
        l = fmaf(ml[2 * s + 1], w, l);
        a = fmaf(pa[static_cast<int64_t>(s) * D], w, a);
      }
      if (stored) {
        a_stored += a;
      } else {
        a_orig += a;
      }
    }
  }
  red_o[slice][d] = a_orig;
  red_s[slice][d] = a_stored;
  if (d == 0) red_l[slice] = l;
  __syncthreads();
  const bool lead = slice == 0;  // the first D threads finish channel d
  if (lead) {
    l = 0.0f;
    a_orig = 0.0f;
    a_stored = 0.0f;
#pragma unroll
    for (int k = 0; k < S; ++k) {
      l += red_l[k];
      a_orig += red_o[k][d];
      a_stored += red_s[k][d];
    }
  }
  if (v_transformed) {  // uniform over the block; red_s[0] is free again after this barrier
    __syncthreads();
    float* x = red_s[0];
    if (lead) x[d] = a_stored;
    __syncthreads();
    if (lead) {
      if (p.pk.v_perm) {
        y[p.pk.v_perm[static_cast<int64_t>(kvh) * D + d]] = x[d];
      } else {
        y[d] = x[d];
      }
    }
    __syncthreads();
    if (p.pk.v_signs) {
      for (int span = 1; span < p.pk.v_rot_block; span *= 2) {
        if (lead && (d & span) == 0) {
          const float u = y[d], v = y[d + span];
          y[d] = u + v;
          y[d + span] = u - v;
        }
        __syncthreads();
      }
      if (lead) y[d] = y[d] * p.pk.v_rot_norm * p.pk.v_signs[static_cast<int64_t>(kvh) * D + d];
    }
    if (lead) a_orig += y[d];
  }
  if (lead)
    p.out[(static_cast<int64_t>(b) * n_q_heads + qh) * D + d] = l > 0.0f ? a_orig / l : 0.0f;
}

template <>
void launch_split<0, 0>(const DecodeParams&, cudaStream_t);
template <>
void launch_split<2, 2>(const DecodeParams&, cudaStream_t);
template <>
void launch_split<4, 4>(const DecodeParams&, cudaStream_t);
template <>
void launch_split<8, 8>(const DecodeParams&, cudaStream_t);
template <>
void launch_split<4, 2>(const DecodeParams&, cudaStream_t);
template <>
void launch_split<2, 4>(const DecodeParams&, cudaStream_t);

}  // namespace decode_impl

namespace decode_mma {
template <int PK, int KB, bool BF>
int mma_dispatch(const DecodeParams& p, const DecodeBatchArg* batch, cudaStream_t s, bool query);
template <>
int mma_dispatch<0, 2, false>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<1, 2, false>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<2, 2, false>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<1, 4, false>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<2, 4, false>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<3, 2, false>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<3, 4, false>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<0, 2, true>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<1, 2, true>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<2, 2, true>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<1, 4, true>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<2, 4, true>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<3, 2, true>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
template <>
int mma_dispatch<3, 4, true>(const DecodeParams&, const DecodeBatchArg*, cudaStream_t, bool);
}  // namespace decode_mma

namespace {
// The tensor-core instance of p.kernel: launch, or with query the resident blocks per SM.
int mma_run(const DecodeParams& p, const DecodeBatchArg* batch, cudaStream_t s, bool query) {
  switch (p.kernel) {
    case DecodeKernel::kMmaF16:
      return decode_mma::mma_dispatch<0, 2, false>(p, batch, s, query);
    case DecodeKernel::kMmaPacked2:
      return decode_mma::mma_dispatch<1, 2, false>(p, batch, s, query);
    case DecodeKernel::kMmaPacked2F16Meta:
      return decode_mma::mma_dispatch<2, 2, false>(p, batch, s, query);
    case DecodeKernel::kMmaPacked4:
      return decode_mma::mma_dispatch<1, 4, false>(p, batch, s, query);
    case DecodeKernel::kMmaPacked4F16Meta:
      return decode_mma::mma_dispatch<2, 4, false>(p, batch, s, query);
    case DecodeKernel::kMmaPacked2G32:
      return decode_mma::mma_dispatch<3, 2, false>(p, batch, s, query);
    case DecodeKernel::kMmaPacked4G32:
      return decode_mma::mma_dispatch<3, 4, false>(p, batch, s, query);
    case DecodeKernel::kMmaBF16:
      return decode_mma::mma_dispatch<0, 2, true>(p, batch, s, query);
    case DecodeKernel::kMmaPacked2BF16:
      return decode_mma::mma_dispatch<1, 2, true>(p, batch, s, query);
    case DecodeKernel::kMmaPacked2F16MetaBF16:
      return decode_mma::mma_dispatch<2, 2, true>(p, batch, s, query);
    case DecodeKernel::kMmaPacked4BF16:
      return decode_mma::mma_dispatch<1, 4, true>(p, batch, s, query);
    case DecodeKernel::kMmaPacked4F16MetaBF16:
      return decode_mma::mma_dispatch<2, 4, true>(p, batch, s, query);
    case DecodeKernel::kMmaPacked2G32BF16:
      return decode_mma::mma_dispatch<3, 2, true>(p, batch, s, query);
    case DecodeKernel::kMmaPacked4G32BF16:
      return decode_mma::mma_dispatch<3, 4, true>(p, batch, s, query);
    case DecodeKernel::kCudaCore:
      break;
  }
  throw Error(std::string("[decode_attention] expected a tensor-core kernel but got ") +
              decode_kernel_name(p.kernel));
}

// Programmatic dependent launch: the combine grid is launched while the split kernel runs (its
// blocks trigger at entry) and waits in griddepcontrol.wait for its completion and memory, which
// hides the second launch's latency (batch-1 decode is latency-bound).
void launch_combine(const DecodeParams& p, cudaStream_t s) {
  using namespace decode_impl;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(p.n_kv_heads * p.group), static_cast<unsigned>(p.batch));
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (p.head_dim == 64) {
    cfg.blockDim = dim3(64 * combine_slices<64>());
    VQ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, decode_combine_kernel<64>, p));
  } else {
    cfg.blockDim = dim3(128 * combine_slices<128>());
    VQ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, decode_combine_kernel<128>, p));
  }
  VQ_CUDA_LAUNCH_CHECK(decode_combine_kernel);
}

}  // namespace

int decode_mma_blocks_per_sm(const DecodeParams& p) {
  return mma_run(p, nullptr, nullptr, true);
}

void decode_attention_launch(const DecodeParams& p, cudaStream_t s, const DecodeBatchArg* batch) {
  using namespace decode_impl;
  // the instance of the view's code specs (CodeSpec::bits_x2, 0 without packed segments read in
  // place): bits (2,2), (4,4), (8,8), (4,2), (2,4) their own, every other pair the any-bits one
  const int kx2 = p.pk.k_bits_x2, vx2 = p.pk.v_bits_x2;
  for (int i = 0; i < p.n_segments; ++i)
    VQ_CHECK(p.seg[i].packed != 2,
             "[decode_attention] internal: channel-axis keys take decode_attention_launch_channel");
  if (p.kernel != DecodeKernel::kCudaCore) {
    mma_run(p, batch, s, false);
  } else if (kx2 == 0 && vx2 == 0) {
    launch_split<0, 0>(p, s);
  } else if (kx2 == 4 && vx2 == 4) {
    launch_split<2, 2>(p, s);
  } else if (kx2 == 8 && vx2 == 8) {
    launch_split<4, 4>(p, s);
  } else if (kx2 == 16 && vx2 == 16) {
    launch_split<8, 8>(p, s);
  } else if (kx2 == 8 && vx2 == 4) {
    launch_split<4, 2>(p, s);
  } else if (kx2 == 4 && vx2 == 8) {
    launch_split<2, 4>(p, s);
  } else {  // every other pair of code specs (1..8 bits, three levels): codes read at run time
    launch_split<kAnyBits, kAnyBits>(p, s);
  }
  launch_combine(p, s);
}

void decode_attention_launch_channel(const DecodeParams& p, const DecodeChannelParams& ch,
                                     cudaStream_t s) {
  using namespace decode_impl;
  VQ_CHECK(p.kernel == DecodeKernel::kCudaCore && p.seqs == nullptr,
           "[decode_attention] expected a CUDA-core, unbatched run for channel-axis keys");
  // The full-precision split kernel over the other segments (the channel-axis ones emptied:
  // their splits write empty partials), then the channel kernel over those splits' partials;
  // plain launches in stream order, so the combine (launched as a programmatic dependent of the
  // channel kernel, which never triggers early) starts after both.
  DecodeParams fp = p;
  for (int i = 0; i < fp.n_segments; ++i)
    if (fp.seg[i].packed == 2) {
      fp.seg[i].packed = 0;
      fp.seg[i].n_rows = 0;
    }
  launch_split<0, 0>(fp, s);
  decode_channel_launch(p, ch, s);
  launch_combine(p, s);
}

}  // namespace vq::cuda
