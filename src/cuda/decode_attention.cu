// Fused decode attention: the combine kernel (exact log-sum-exp merge of the splits of each
// (b, query head), un-permute / un-rotate of the packed-value accumulator) and the dispatcher
// that picks the split kernel instance for the view's (key bits, value bits). The split kernel
// is in decode_attention_kernel.cuh, instantiated by decode_attention_k*.cu.
//
// Combine: M = max_s m_s, w_s = 2^(m_s - M), out = (sum_s w_s acc_s) / (sum_s w_s l_s), where the
// accumulators of splits over packed, transformed values are summed apart (stored channel order),
// mapped back once (y[perm[j]] = x[j], then y <- signs .* H_norm y) and added. L == 0 (no visible
// key) gives zeros.
#include "cuda/decode_attention.cuh"
#include "cuda/decode_attention_kernel.cuh"

namespace vq::cuda {

namespace decode_impl {

template <int D>
__global__ void __launch_bounds__(D) decode_combine_kernel(const __grid_constant__ DecodeParams p) {
  __shared__ float x[D];
  __shared__ float y[D];
  const int qh = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int n_q_heads = p.n_kv_heads * p.group;
  const int kvh = qh / p.group;
  const int64_t row0 = (static_cast<int64_t>(b) * n_q_heads + qh) * p.n_splits;
  float mx = -INFINITY;
  for (int s = 0; s < p.n_splits; ++s) mx = fmaxf(mx, p.part_ml[2 * (row0 + s)]);
  const bool v_transformed = p.v_bits > 0 && (p.pk.v_perm != nullptr || p.pk.v_signs != nullptr);
  float l = 0.0f, a_orig = 0.0f, a_stored = 0.0f;
  if (mx != -INFINITY) {
    for (int si = 0; si < p.n_segments; ++si) {
      const DecodeSegmentParams& sg = p.seg[si];
      const bool stored = v_transformed && sg.packed != 0;
      for (int s = sg.split_begin; s < sg.split_begin + sg.n_splits; ++s) {
        const float m = p.part_ml[2 * (row0 + s)];
        if (m == -INFINITY) continue;
        const float w = exp2f(m - mx);
        l += p.part_ml[2 * (row0 + s) + 1] * w;
        const float a = p.part_acc[(row0 + s) * D + d] * w;
        if (stored) {
          a_stored += a;
        } else {
          a_orig += a;
        }
      }
    }
  }
  if (v_transformed) {  // uniform over the block
    x[d] = a_stored;
    __syncthreads();
    if (p.pk.v_perm) {
      y[p.pk.v_perm[static_cast<int64_t>(kvh) * D + d]] = x[d];
    } else {
      y[d] = x[d];
    }
    __syncthreads();
    if (p.pk.v_signs) {
      for (int span = 1; span < p.pk.v_rot_block; span *= 2) {
        if ((d & span) == 0) {
          const float u = y[d], v = y[d + span];
          y[d] = u + v;
          y[d + span] = u - v;
        }
        __syncthreads();
      }
      y[d] = y[d] * p.pk.v_rot_norm * p.pk.v_signs[static_cast<int64_t>(kvh) * D + d];
    }
    a_orig += y[d];
  }
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

void decode_attention_launch(const DecodeParams& p, cudaStream_t s) {
  using namespace decode_impl;
  const int kb = p.k_bits, vb = p.v_bits;
  if (kb == 0 && vb == 0) {
    launch_split<0, 0>(p, s);
  } else if (kb == 2 && vb == 2) {
    launch_split<2, 2>(p, s);
  } else if (kb == 4 && vb == 4) {
    launch_split<4, 4>(p, s);
  } else if (kb == 8 && vb == 8) {
    launch_split<8, 8>(p, s);
  } else if (kb == 4 && vb == 2) {
    launch_split<4, 2>(p, s);
  } else if (kb == 2 && vb == 4) {
    launch_split<2, 4>(p, s);
  } else {
    throw Error(
        "[decode_attention] expected packed key/value bits (2,2), (4,4), (8,8), (4,2) or "
        "(2,4) but got (" +
        std::to_string(kb) + "," + std::to_string(vb) + ")");
  }
  const dim3 grid(static_cast<unsigned>(p.n_kv_heads * p.group), static_cast<unsigned>(p.batch));
  if (p.head_dim == 64) {
    decode_combine_kernel<64><<<grid, 64, 0, s>>>(p);
  } else {
    decode_combine_kernel<128><<<grid, 128, 0, s>>>(p);
  }
  VQ_CUDA_LAUNCH_CHECK(decode_combine_kernel);
}

}  // namespace vq::cuda
