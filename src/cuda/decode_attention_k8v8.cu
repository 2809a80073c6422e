// Instance of the decode split kernel for key bits 8, value bits 8 (0/0: full-precision
// segments only), every supported head_dim and GQA group (see decode_attention_kernel.cuh).
#include "cuda/decode_attention_kernel.cuh"

namespace vq::cuda::decode_impl {

VQ_DECODE_INSTANTIATE(8, 8)

}  // namespace vq::cuda::decode_impl
