// Chunked prefill, the decode loop, and the caches' memory summary (see generate.h).
//
// Batch 1: tokens [1, S] per forward call. Timings use std::chrono::steady_clock; prefill time
// covers the prefill forward calls, decode time the single-token forward calls and their sampling.
#include "veloxquant/generate.h"

#include <algorithm>
#include <chrono>

#include "veloxquant/error.h"

namespace vq {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void prefill(const Model& model, const int32_t* prompt, int64_t n,
             const std::vector<std::unique_ptr<KVCache>>& caches, int64_t step, DType kv_dtype,
             std::vector<float>* last_logits, ForwardScratch* scratch,
             const std::function<void(int64_t, int64_t)>& on_progress, MatmulPrecision matmul) {
  VQ_CHECK(n >= 1,
           "[prefill] expected a prompt of at least one token but got " + std::to_string(n));
  const std::vector<int64_t> chunks = prefill_chunks(n, step);
  ForwardScratch local;
  ForwardScratch& s = scratch ? *scratch : local;
  ForwardOptions fo;
  fo.kv_dtype = kv_dtype;
  fo.matmul = matmul;
  int64_t done = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const bool last = i + 1 == chunks.size();
    fo.logits = last && last_logits ? ForwardOptions::Logits::kLast : ForwardOptions::Logits::kNone;
    model.forward(prompt + done, 1, chunks[i], caches, fo, last ? last_logits : nullptr, &s);
    done += chunks[i];
    if (on_progress) on_progress(done, n);
  }
  for (const auto& c : caches) c->end_prompt();
}

GenerateResult generate(const Model& model, std::span<const int32_t> prompt,
                        const std::vector<std::unique_ptr<KVCache>>& caches,
                        const GenerateOptions& opts) {
  VQ_CHECK(!prompt.empty(), "[generate] expected a prompt of at least one token but got none");
  VQ_CHECK(opts.max_tokens >= 0,
           "[generate] max_tokens: expected >= 0 but got " + std::to_string(opts.max_tokens));
  const ModelConfig& cfg = model.config();
  const std::vector<int32_t>& stop = opts.stop_ids.empty() ? cfg.eos_token_ids : opts.stop_ids;
  Sampler sampler(opts.sampling);
  GenerateResult r;
  r.prompt_tokens = static_cast<int64_t>(prompt.size());
  r.stop_reason = "max_tokens";
  ForwardScratch scratch;
  std::vector<float> logits;

  auto t0 = std::chrono::steady_clock::now();
  prefill(model, prompt.data(), static_cast<int64_t>(prompt.size()), caches, opts.prefill_step_size,
          opts.kv_dtype, &logits, &scratch, opts.on_prefill_progress, opts.matmul);
  r.prefill_seconds = seconds_since(t0);
  if (opts.max_tokens == 0) return r;

  ForwardOptions fo;
  fo.kv_dtype = opts.kv_dtype;
  fo.matmul = opts.matmul;
  fo.logits = ForwardOptions::Logits::kLast;
  t0 = std::chrono::steady_clock::now();
  int32_t token = sampler.sample(logits.data(), cfg.vocab_size);
  while (true) {
    r.tokens.push_back(token);
    const bool keep_going = !opts.on_token || opts.on_token(token);
    if (opts.stop_at_eos && std::find(stop.begin(), stop.end(), token) != stop.end()) {
      r.stop_reason = "eos";
      break;
    }
    if (!keep_going) {
      r.stop_reason = "callback";
      break;
    }
    if (static_cast<int64_t>(r.tokens.size()) >= opts.max_tokens) break;
    model.forward(&token, 1, 1, caches, fo, &logits, &scratch);
    ++r.decode_steps;
    token = sampler.sample(logits.data(), cfg.vocab_size);
  }
  r.decode_seconds = seconds_since(t0);
  return r;
}

CacheMemory cache_memory(const std::vector<std::unique_ptr<KVCache>>& caches,
                         int64_t rows_per_layer_factor) {
  CacheMemory m;
  m.n_layers = static_cast<int64_t>(caches.size());
  for (size_t i = 0; i < caches.size(); ++i) {
    const CacheStats s = caches[i]->stats();
    if (i == 0) {
      m.method = s.method;
      m.tokens_seen = s.tokens_seen;
      m.rows_kept_per_head = s.rows_stored;
    }
    m.rows_kept += s.rows_stored * rows_per_layer_factor;
    m.bytes_accounted += s.bytes_accounted;
    m.bytes_resident += s.bytes_resident;
    m.fp16_bytes += s.fp16_bytes;
  }
  return m;
}

}  // namespace vq
