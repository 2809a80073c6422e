// Instances of the tensor-core decode split kernel (decode_attention_mma.cuh), bf16 rows (BF), for
// PK = 0 (KB is unused, 2): views of bf16 segments only, every head_dim and GQA group.
#include "cuda/decode_attention_mma.cuh"

namespace vq::cuda::decode_mma {

VQ_DECODE_MMA_INSTANTIATE(0, 2, true)

}  // namespace vq::cuda::decode_mma
