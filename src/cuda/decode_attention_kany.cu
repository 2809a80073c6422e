// Instance of the decode split kernel for codes of any spec (kAnyBits: 1..8 bits or three
// levels, keys and values each their own, read at run time), every supported head_dim and GQA
// group (see decode_attention_kernel.cuh): the fused path of the bit pairs without an instance of
// their own, instead of dequantizing them first.
#include "cuda/decode_attention_kernel.cuh"

namespace vq::cuda::decode_impl {

VQ_DECODE_INSTANTIATE(kAnyBits, kAnyBits)

}  // namespace vq::cuda::decode_impl
