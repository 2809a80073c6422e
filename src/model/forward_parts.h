// The stages of Model::forward (src/model/forward.cpp) as functions over one slice of a layer's
// heads and MLP columns, so the single-device pass and the tensor-parallel pass
// (src/model/tensor_parallel.cpp, one slice per rank) run the same arithmetic. A slice with every
// head and column is the whole layer.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/kernels.h"
#include "veloxquant/attention.h"
#include "veloxquant/model.h"

namespace vq::fwd {

// What every layer of one forward call shares.
struct Step {
  const ModelConfig* cfg = nullptr;
  int64_t batch = 0, seq = 0, tokens = 0, offset = 0;
  bool par = false;  // per-token loops on the worker pool (prefill-sized calls)
  kernels::Precision mp = kernels::Precision::kExact;
  DType kv_dtype = DType::kF16;
  bool pass_queries = true;
  AttentionParams ap;
  const float* cos_t = nullptr;  // [seq, head_dim / 2] RoPE tables of this call's positions
  const float* sin_t = nullptr;
};

// One rank's share of a layer: its query and KV heads' q/k/v rows, o_proj's matching input
// columns, its MLP columns (gate/up rows, down's input columns). Biases of o and down are
// added by one slice only.
struct LayerSlice {
  const std::vector<float>* attn_norm = nullptr;
  const std::vector<float>* mlp_norm = nullptr;
  const Linear *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  const Linear *gate = nullptr, *up = nullptr, *down = nullptr;
  int64_t n_heads = 0, n_kv_heads = 0;
};

// Every weight of L (a whole layer, or a rank's sliced copy) with the heads it computes.
LayerSlice layer_slice(const Model::Layer& L, int64_t n_heads, int64_t n_kv_heads);

// Checks the call (batch, seq, token ids, one cache per layer at one offset) and returns the
// caches' offset; vq::Error "[forward] ..." otherwise.
int64_t check_call(const ModelConfig& c, const int32_t* tokens, int64_t batch, int64_t seq,
                   const std::vector<std::unique_ptr<KVCache>>& caches);

// Embeds the tokens into s.x and fills the RoPE tables; returns the step.
Step begin(const Model& m, const int32_t* tokens, int64_t batch, int64_t seq, int64_t offset,
           const ForwardOptions& opts, ForwardScratch& s);

// x += h when add (the previous block's output), then s.h = RMSNorm(x) * w.
void norm_in(const Step& st, ForwardScratch& s, bool add, const std::vector<float>& w);
// s.h (normed) -> s.h = this slice's o_proj output (a partial sum when sliced): q/k/v, RoPE,
// the cache's update_and_fetch with the slice's KV heads, attention.
void attention(const Step& st, const LayerSlice& L, KVCache& cache, ForwardScratch& s);
// s.h (normed) -> s.h = this slice's down_proj output (a partial sum when sliced).
void mlp(const Step& st, const LayerSlice& L, ForwardScratch& s);
// x += h (the last layer's output), the final norm and the requested logits (ForwardOptions).
void finish(const Model& m, const Step& st, const ForwardOptions& opts, ForwardScratch& s,
            std::vector<float>* logits);

}  // namespace vq::fwd
