// Instance of the decode split kernel for key bits 2, value bits 4 (0/0: full-precision
// segments only), every supported head_dim and GQA group (see decode_attention_kernel.cuh).
#include "cuda/decode_attention_kernel.cuh"

namespace vq::cuda::decode_impl {

VQ_DECODE_INSTANTIATE(2, 4)

}  // namespace vq::cuda::decode_impl
