// Attention over a cache view: the scalar reference (the oracle for every other kernel) and the
// dispatching entry point the runtime uses.
//
// q   : [B, H_q, N, D] fp32, contiguous; query i of batch b has position q_pos0 + i.
// view: the CacheView an update_and_fetch returned (H_kv heads; H_q % H_kv == 0; query head
//       qh reads KV head qh / (H_q / H_kv)).
// out : [B, H_q, N, D] fp32, contiguous.
// Key j is visible to query i when pos_j <= pos_i and, with window > 0, pos_i < pos_j + window,
// each row using its own position (heads keep different positions after eviction).
#pragma once

#include <cstdint>

#include "veloxquant/cache.h"

namespace vq {

struct AttentionParams {
  float scale = 0.0f;  // 0 = 1/sqrt(D)
  int64_t window = 0;  // 0 = no sliding window
  int64_t q_pos0 = 0;  // position of query 0
};

// Scalar reference: fp32 products, double accumulation of the softmax sums. Full-precision
// segments only (throws vq::Error for packed segments: dequantize the view first).
void attention_reference(const TensorView& q, const CacheView& view, const AttentionParams& p,
                         float* out);

// Fast path used by the runtime: fused over packed rows, multi-threaded over heads.
// Implemented in src/ops (fused_attention.cpp).
void attention(const TensorView& q, const CacheView& view, const AttentionParams& p, float* out);

}  // namespace vq
