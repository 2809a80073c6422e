// decode_attention_typed (veloxquant/cuda.h): decode attention for callers whose queries and
// outputs are in the model's dtype (the Python package's CUDA layers). The conversions are the
// row stores' own (detail::convert_block: widening exact, narrowing to nearest even), so the
// values are decode_attention's on the widened query, rounded once at the end.
#include <string>

#include "cuda/device_cache_util.h"
#include "veloxquant/cuda.h"
#include "veloxquant/error.h"

namespace vq::cuda {

size_t decode_typed_staging_bytes(int64_t batch, int64_t n_q_heads, int64_t head_dim) {
  // q and out in fp32, each rounded up to 256 bytes so the second starts aligned.
  const size_t one = (static_cast<size_t>(batch * n_q_heads * head_dim) * 4 + 255) / 256 * 256;
  return 2 * one;
}

void decode_attention_typed(const TensorView& q, const DeviceCacheView& view,
                            const AttentionParams& p, const TensorView& out, void* staging,
                            DecodeWorkspace& ws, Stream s) {
  const char* op = "[decode_attention_typed] ";
  const int64_t B = q.shape[0], Hq = q.shape[1], D = q.shape[3];
  VQ_CHECK(q.data && out.data && staging,
           std::string(op) + "expected device q, out and staging but got a null pointer");
  VQ_CHECK(q.shape[2] == 1, std::string(op) +
                                "expected one query per sequence ([B, H_q, 1, D]) "
                                "but got " +
                                std::to_string(q.shape[2]));
  VQ_CHECK(out.shape == q.shape && out.is_contiguous(),
           std::string(op) + "expected out contiguous of q's shape [" + std::to_string(B) + ", " +
               std::to_string(Hq) + ", 1, " + std::to_string(D) + "]");
  const size_t one = decode_typed_staging_bytes(B, Hq, D) / 2;
  auto* stage = static_cast<uint8_t*>(staging);
  const float* q32 = static_cast<const float*>(q.data);
  if (q.dtype != DType::kF32 || !q.is_contiguous()) {
    detail::convert_block(q, 0, 1, stage, DType::kF32, 1, 0, s);  // [B, H_q, 1, D] rows of 1
    q32 = reinterpret_cast<const float*>(stage);
  }
  const bool direct = out.dtype == DType::kF32;
  float* o32 = direct ? static_cast<float*>(out.data) : reinterpret_cast<float*>(stage + one);
  decode_attention(q32, Hq, view, p, o32, ws, s);
  if (!direct)
    detail::convert_block(TensorView::contiguous(o32, DType::kF32, B, Hq, 1, D), 0, 1, out.data,
                          out.dtype, 1, 0, s);
}

}  // namespace vq::cuda
