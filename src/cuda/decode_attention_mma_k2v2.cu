// Instances of the tensor-core decode split kernel (decode_attention_mma.cuh) for PK = 2, KB = 2:
// views mixing f16 segments and 2-bit packed segments with f16 metadata, every head_dim and GQA
// group.
#include "cuda/decode_attention_mma.cuh"

namespace vq::cuda::decode_mma {

VQ_DECODE_MMA_INSTANTIATE(2, 2, false)

}  // namespace vq::cuda::decode_mma
