// Text generation over a Model and one KV cache per layer: chunked prefill, then decode with
// greedy / temperature / top-k / top-p sampling, stop on EOS or a token budget, streaming and
// progress callbacks, timings, and the caches' memory summed over layers.
//
// Prefill: the prompt goes through the model in the chunks of veloxquant/prefill_schedule.h
// (prefill_step_size tokens each, then the remainder), the schedule the evaluation engine and
// the benchmarks use too. The whole prompt is
// prefilled (the last prompt token is not held back for the first decode step, unlike mlx_lm's
// generate_step), so the first generated token sees the prompt before any eviction.
//
// Positions are bounded by the model (ModelConfig::max_position_embeddings, when > 0): a prompt
// that does not fit (cache offset + prompt length > max_position_embeddings) is refused before
// any forward call; generation stops (stop_reason "max_position") before a token would take a
// position >= max_position_embeddings, so at most max_position_embeddings - prompt tokens are
// generated. Logits of which not one is finite (NaN/Inf weights or activations) are refused
// with vq::Error naming the step instead of sampling token 0.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/model.h"
#include "veloxquant/prefill_schedule.h"

namespace vq {

struct SamplingParams {
  float temperature = 0.0f;  // <= 0: greedy (argmax)
  int64_t top_k = 0;         // keep the k most likely tokens; 0 = all
  float top_p = 1.0f;        // nucleus: smallest set with probability >= top_p; 1 = all
  uint64_t seed = 0;
};

// Index of the largest logit; NaN counts as -inf, ties go to the lower index.
int32_t argmax(const float* logits, int64_t n);

// Seeded sampler. Order as in Hugging Face: temperature, then top-k, then top-p, then a draw
// from the renormalised distribution (softmax in double). Deterministic for a seed.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  int32_t sample(const float* logits, int64_t n);
  // The distribution sample() draws from: probabilities of every token (0 for filtered ones).
  std::vector<double> distribution(const float* logits, int64_t n) const;
  const SamplingParams& params() const { return p_; }

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
};

struct GenerateOptions {
  int64_t max_tokens = 128;         // generated tokens at most (the stop token included)
  int64_t prefill_step_size = 512;  // tokens per prefill chunk at most
  SamplingParams sampling;
  // Generation stops after producing one of these; empty = the model's eos_token_ids.
  std::vector<int32_t> stop_ids;
  bool stop_at_eos = true;
  DType kv_dtype = DType::kF16;  // K/V handed to the caches (ForwardOptions::kv_dtype)
  // Arithmetic of the matrix products, prefill and decode (ForwardOptions::matmul).
  MatmulPrecision matmul = MatmulPrecision::kExact;
  // Tokens are sampled among ids [0, sample_vocab) only; 0 = the model's vocab_size. A
  // tokenizer smaller than the model's (padded) vocabulary sets its own size here, so no id it
  // cannot decode is generated. Must be <= vocab_size.
  int64_t sample_vocab = 0;
  // Called with each generated token; return false to stop.
  std::function<bool(int32_t)> on_token;
  // Called after each prefill chunk with (prompt tokens done, prompt tokens in all).
  std::function<void(int64_t, int64_t)> on_prefill_progress;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (a stop token included)
  int64_t prompt_tokens = 0;
  std::string stop_reason;  // "eos", "max_tokens", "max_position" or "callback"
  double prefill_seconds = 0;
  double decode_seconds = 0;  // the single-token forward steps and their sampling
  int64_t decode_steps = 0;   // single-token forward calls (tokens.size() - 1 at most)
  // Memory parts (bytes) for the peak-memory breakdown: the forward pass's activation buffers
  // (scratch_bytes after the run: sized by the largest call, the prefill chunk) and the caches'
  // resident bytes summed over layers after the last prefill chunk, before end_prompt (the
  // prompt held in full: the most an evicting cache holds) and at the end of the run.
  int64_t activation_bytes = 0;
  int64_t cache_bytes_prompt = 0;
  int64_t cache_bytes_end = 0;
  int64_t cache_bytes_peak() const { return std::max(cache_bytes_prompt, cache_bytes_end); }

  double prefill_tokens_per_s() const {
    return prefill_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_seconds : 0.0;
  }
  double decode_tokens_per_s() const {
    return decode_seconds > 0 ? static_cast<double>(decode_steps) / decode_seconds : 0.0;
  }
};

// Runs prompt[0, n) through the model in prefill_chunks(n, step), then tells every cache the
// prompt is complete (KVCache::end_prompt: SnapKV with snap_evict_at = prompt_end compresses
// there); returns the logits of the last position [vocab] in *last_logits (if non-null).
void prefill(const Model& model, const int32_t* prompt, int64_t n,
             const std::vector<std::unique_ptr<KVCache>>& caches, int64_t step, DType kv_dtype,
             std::vector<float>* last_logits, ForwardScratch* scratch = nullptr,
             const std::function<void(int64_t, int64_t)>& on_progress = {},
             MatmulPrecision matmul = MatmulPrecision::kExact);

// Batch 1 generation. The caches must be fresh (offset 0) or hold a context the prompt continues.
GenerateResult generate(const Model& model, std::span<const int32_t> prompt,
                        const std::vector<std::unique_ptr<KVCache>>& caches,
                        const GenerateOptions& opts);

// Memory of one cache per layer, summed over layers.
struct CacheMemory {
  std::string method;
  int64_t n_layers = 0;
  int64_t tokens_seen = 0;         // offset() of layer 0
  int64_t rows_kept = 0;           // stored rows, summed over layers and (b, kv head)
  int64_t rows_kept_per_head = 0;  // stored rows of one (b, h) in layer 0
  int64_t bytes_accounted = 0;     // sum of CacheStats::bytes_accounted
  int64_t bytes_resident = 0;      // sum of CacheStats::bytes_resident
  int64_t fp16_bytes = 0;          // sum of CacheStats::fp16_bytes
  double ratio_to_fp16() const {
    return fp16_bytes ? static_cast<double>(bytes_accounted) / static_cast<double>(fp16_bytes)
                      : 1.0;
  }
};
// rows_per_layer_factor = batch * n_kv_heads (rows of one layer = stored_rows() times it).
CacheMemory cache_memory(const std::vector<std::unique_ptr<KVCache>>& caches,
                         int64_t rows_per_layer_factor);

}  // namespace vq
