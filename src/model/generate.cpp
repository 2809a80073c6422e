// Chunked prefill, the decode loop, and the caches' memory summary (see generate.h).
//
// Batch 1: tokens [1, S] per forward call. Timings use std::chrono::steady_clock; prefill time
// covers the prefill forward calls, decode time the single-token forward calls and their sampling.
#include "veloxquant/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "veloxquant/error.h"

namespace vq {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

namespace {

int64_t resident_bytes(const std::vector<std::unique_ptr<KVCache>>& caches) {
  int64_t b = 0;
  for (const auto& c : caches) b += c->stats().bytes_resident;
  return b;
}

// True when at least one of logits [n] is finite.
bool any_finite(const float* logits, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isfinite(logits[i])) return true;
  return false;
}

// prefill() that also returns the caches' resident bytes before end_prompt.
int64_t prefill_impl(const Model& model, const int32_t* prompt, int64_t n,
                     const std::vector<std::unique_ptr<KVCache>>& caches, int64_t step,
                     DType kv_dtype, std::vector<float>* last_logits, ForwardScratch* scratch,
                     const std::function<void(int64_t, int64_t)>& on_progress,
                     MatmulPrecision matmul, bool measure) {
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
  const int64_t before_end = measure ? resident_bytes(caches) : 0;
  for (const auto& c : caches) c->end_prompt();
  return before_end;
}

}  // namespace

void prefill(const Model& model, const int32_t* prompt, int64_t n,
             const std::vector<std::unique_ptr<KVCache>>& caches, int64_t step, DType kv_dtype,
             std::vector<float>* last_logits, ForwardScratch* scratch,
             const std::function<void(int64_t, int64_t)>& on_progress, MatmulPrecision matmul) {
  prefill_impl(model, prompt, n, caches, step, kv_dtype, last_logits, scratch, on_progress, matmul,
               /*measure=*/false);
}

GenerateResult generate(const Model& model, std::span<const int32_t> prompt,
                        const std::vector<std::unique_ptr<KVCache>>& caches,
                        const GenerateOptions& opts) {
  VQ_CHECK(!prompt.empty(), "[generate] expected a prompt of at least one token but got none");
  VQ_CHECK(opts.max_tokens >= 0,
           "[generate] max_tokens: expected >= 0 but got " + std::to_string(opts.max_tokens));
  const ModelConfig& cfg = model.config();
  VQ_CHECK(opts.sample_vocab >= 0 && opts.sample_vocab <= cfg.vocab_size,
           "[generate] sample_vocab: expected a value in [0, " + std::to_string(cfg.vocab_size) +
               "] (the model's vocab_size; 0 = all) but got " + std::to_string(opts.sample_vocab));
  const int64_t n_sample = opts.sample_vocab > 0 ? opts.sample_vocab : cfg.vocab_size;
  // Positions: the prompt takes [offset, offset + n), generated token i position offset + n + i.
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  const int64_t offset = caches.empty() || !caches[0] ? 0 : caches[0]->offset();
  const int64_t max_pos = cfg.max_position_embeddings;
  if (max_pos > 0)
    VQ_CHECK(offset + n_prompt <= max_pos,
             "[generate] expected the prompt to fit the model's max_position_embeddings " +
                 std::to_string(max_pos) + " but it takes positions [" + std::to_string(offset) +
                 ", " + std::to_string(offset + n_prompt) + ") (" + std::to_string(n_prompt) +
                 " prompt tokens" +
                 (offset > 0 ? " after " + std::to_string(offset) + " cached" : std::string()) +
                 ")");
  const std::vector<int32_t>& stop = opts.stop_ids.empty() ? cfg.eos_token_ids : opts.stop_ids;
  Sampler sampler(opts.sampling);
  GenerateResult r;
  r.prompt_tokens = n_prompt;
  r.stop_reason = "max_tokens";
  ForwardScratch scratch;
  std::vector<float> logits;
  // Samples generated token i from logits, refusing logits without one finite value.
  auto sample = [&](int64_t i) {
    VQ_CHECK(any_finite(logits.data(), cfg.vocab_size),
             "[generate] expected finite logits but all " + std::to_string(cfg.vocab_size) +
                 " logits for generated token " + std::to_string(i) + " (position " +
                 std::to_string(offset + n_prompt + i) +
                 ") are NaN or infinite: NaN/Inf weights or activations (Model::load checks the "
                 "weights unless LoadOptions::check_finite is false)");
    return sampler.sample(logits.data(), n_sample);
  };

  auto t0 = std::chrono::steady_clock::now();
  r.cache_bytes_prompt =
      prefill_impl(model, prompt.data(), n_prompt, caches, opts.prefill_step_size, opts.kv_dtype,
                   &logits, &scratch, opts.on_prefill_progress, opts.matmul, /*measure=*/true);
  r.prefill_seconds = seconds_since(t0);
  auto finish = [&] {
    r.activation_bytes = static_cast<int64_t>(scratch_bytes(scratch));
    r.cache_bytes_end = resident_bytes(caches);
    return r;
  };
  if (opts.max_tokens == 0) return finish();

  ForwardOptions fo;
  fo.kv_dtype = opts.kv_dtype;
  fo.matmul = opts.matmul;
  fo.logits = ForwardOptions::Logits::kLast;
  t0 = std::chrono::steady_clock::now();
  while (true) {
    const int64_t i = static_cast<int64_t>(r.tokens.size());
    if (max_pos > 0 && offset + n_prompt + i >= max_pos) {  // token i would not fit
      r.stop_reason = "max_position";
      break;
    }
    if (i > 0) {  // forward the previous token (at position offset + n_prompt + i - 1)
      const int32_t prev = r.tokens.back();
      model.forward(&prev, 1, 1, caches, fo, &logits, &scratch);
      ++r.decode_steps;
    }
    const int32_t token = sample(i);
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
  }
  r.decode_seconds = seconds_since(t0);
  return finish();
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
