// Shared evaluation helpers (see eval/eval_internal.h): chunked prefill (generate.h's, with the
// one schedule of veloxquant/prefill_schedule.h) and decode steps through Model::forward,
// log-softmax in double, progress lines, and the attention-error tap cache.
// Attention in the tap uses vq::attention (fused over packed rows) for both views, with the
// forward pass's parameters (scale 1/sqrt(D), the model's sliding window, q_pos0 = offset before
// the call), so the full-precision side reproduces what the runtime computes for a full cache.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "eval/eval_internal.h"
#include "veloxquant/attention.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/generate.h"
#include "veloxquant/prefill_schedule.h"
#include "veloxquant/reconstruct.h"

namespace vq::eval_detail {

void prefill(const Model& model, const int32_t* ids, int64_t n, const Caches& caches, int64_t step,
             const EvalSettings& st, ForwardScratch& scratch, std::vector<float>* logits) {
  VQ_CHECK(step >= 1, "[eval] expected prefill_step >= 1 but got " + std::to_string(step));
  if (n == 0) {  // P = 1: nothing before the first decode step
    VQ_CHECK(logits == nullptr, "[eval] expected a prompt of at least one token for its logits");
    for (const auto& c : caches) c->end_prompt();
    return;
  }
  if (!caches.empty() && caches[0]->takes_external_scores()) {
    // Question-agnostic scores from the model re-reading the prompt (about 2x prefill).
    ReconstructOptions ro;
    ro.repeat_ids = st.recon_repeat_ids;
    ro.chunk = st.recon_chunk;
    ro.prefill_step = step;
    ro.kv_dtype = st.kv_dtype;
    ro.matmul = st.matmul;
    prefill_reconstruct(model, ids, n, caches, ro, logits, &scratch);
    return;
  }
  // generate()'s prefill: the same chunks (veloxquant/prefill_schedule.h) and end_prompt().
  vq::prefill(model, ids, n, caches, step, st.kv_dtype, logits, &scratch, {}, st.matmul);
}

void decode_step(const Model& model, int32_t id, const Caches& caches, const EvalSettings& st,
                 ForwardScratch& scratch, std::vector<float>* logits) {
  ForwardOptions fo;
  fo.kv_dtype = st.kv_dtype;
  fo.matmul = st.matmul;
  fo.logits = ForwardOptions::Logits::kLast;
  model.forward(&id, 1, 1, caches, fo, logits, &scratch);
}

namespace {

bool external_scores(const CacheConfig& cfg) {
  return ((cfg.method == "snapkv" || cfg.method == "snapkv+skvq") &&
          cfg.snap_scoring == SnapScoring::kExternal) ||
         (cfg.method == "skvq" && cfg.skvq_protect > 0.0 &&
          cfg.skvq_protect_scoring == SnapScoring::kExternal);
}

// "device cuda" or "tensor_parallel N" (the CPU engine): what put the sequences on an engine.
std::string engine_reason(const Engine& engine) {
  if (engine.device() == Device::kCpu)
    return "tensor_parallel " + std::to_string(engine.options().tensor_parallel);
  return std::string("device ") + device_name(engine.device());
}

// scoring=external on an engine: the scores come from the CPU's reconstruction prefill
// (veloxquant/reconstruct.h, Model::forward over one set of per-layer caches of the method) and go
// to the engine's caches through Engine::set_external_scores, which the CUDA engine has (snapkv's
// selection and skvq's protected rows: tests/cuda/test_cuda_eval.cpp, test_cuda_caches.cpp).
// Refused: the CPU engine (tensor_parallel N > 1: no hook; N = 1 runs without an engine).
void check_engine_method(const CacheConfig& cfg, const std::string& label, const Engine& engine) {
  if (!external_scores(cfg) || engine.device() != Device::kCpu) return;
  const std::string got = label.empty() ? std::string() : " but got " + label;
  throw Error("[eval] " + engine_reason(engine) + ": expected a method without scoring=external" +
              got +
              " (the CPU engine's ranks take no external scores: Engine::set_external_scores); "
              "use --tensor-parallel 1 for it");
}

}  // namespace

std::unique_ptr<Engine> make_eval_engine(const Model& model, const EvalSettings& st,
                                         const std::vector<EvalMethod>& methods) {
  VQ_CHECK(st.device == Device::kCuda || !st.tp_simulate,
           "[eval] tp_simulate: expected device cuda (the CPU engine's ranks are always "
           "simulated) but got device cpu");
  if (st.device == Device::kCpu && st.tensor_parallel == 1) return nullptr;
  EngineOptions eo;
  eo.cache.method = "full";  // each sequence names its own config (add_sequence)
  eo.kv_dtype = st.kv_dtype;
  eo.matmul = st.matmul;  // the CPU engine's forward passes; the CUDA engine ignores it
  eo.tensor_parallel = st.tensor_parallel;
  eo.tp_simulate = st.tp_simulate;
  // The engine refuses N not dividing the KV heads (make_shard_plan), and on CUDA N beyond the
  // visible devices or a build without NCCL (check_cuda_tensor_parallel).
  std::unique_ptr<Engine> engine = make_engine(st.device, model, eo);
  for (const EvalMethod& m : methods) check_engine_method(m.cfg, m.label, *engine);
  return engine;
}

EvalSeq::EvalSeq(const Model& model, Engine* engine, const CacheConfig& cfg, const EvalSettings& st,
                 ForwardScratch& scratch)
    : model_(model), engine_(engine), st_(st), scratch_(scratch), cfg_(cfg) {
  if (!engine_) {
    caches_ = model.make_caches(cfg);
    return;
  }
  check_engine_method(cfg, "", *engine_);
  seq_ = engine_->add_sequence(cfg);
}

EvalSeq::~EvalSeq() {
  if (engine_ && seq_ >= 0) engine_->remove_sequence(seq_);
}

void EvalSeq::prefill(const int32_t* ids, int64_t n, std::vector<float>* logits) {
  if (!engine_) {
    eval_detail::prefill(model_, ids, n, caches_, st_.prefill_step, st_, scratch_, logits);
    return;
  }
  VQ_CHECK(n >= 1, "[eval] " + engine_reason(*engine_) +
                       ": expected a prompt of at least one token (P >= 2: an engine step takes "
                       "at least one token) but got none");
  if (external_scores(cfg_)) {
    // The CPU path's scores (prefill() above: prefill_reconstruct over caches of the same config,
    // the same options), handed to the engine's caches at the prompt's end; the engine's own
    // prefill below then gives the K/V and the logits.
    const Caches cpu = model_.make_caches(cfg_);
    ReconstructOptions ro;
    ro.repeat_ids = st_.recon_repeat_ids;
    ro.chunk = st_.recon_chunk;
    ro.prefill_step = st_.prefill_step;
    ro.kv_dtype = st_.kv_dtype;
    ro.matmul = st_.matmul;
    engine_->set_external_scores(seq_,
                                 prefill_reconstruct(model_, ids, n, cpu, ro, nullptr, &scratch_));
  }
  const std::vector<int64_t> chunks = prefill_chunks(n, st_.prefill_step);
  int64_t at = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const bool last = i + 1 == chunks.size();
    SeqChunk ch;
    ch.seq = seq_;
    ch.tokens = std::span<const int32_t>(ids + at, static_cast<size_t>(chunks[i]));
    ch.logits = last && logits != nullptr;
    ch.end_prompt = last;
    engine_->step(std::span<const SeqChunk>(&ch, 1), logits);
    at += chunks[i];
  }
}

void EvalSeq::decode(int32_t id, std::vector<float>* logits) {
  if (!engine_) {
    decode_step(model_, id, caches_, st_, scratch_, logits);
    return;
  }
  SeqChunk ch;
  ch.seq = seq_;
  ch.tokens = std::span<const int32_t>(&id, 1);
  ch.logits = logits != nullptr;
  engine_->step(std::span<const SeqChunk>(&ch, 1), logits);
}

void EvalSeq::set_attention_tap(AttentionTap* tap) {
  VQ_CHECK(engine_ != nullptr,
           "[attn-error] internal: the attention tap of an engine sequence "
           "was asked for the CPU's caches (wrap them in TapCache)");
  engine_->set_attention_tap(seq_, tap);
}

MemoryFigures EvalSeq::memory() const {
  if (!engine_) return memory_of(caches_);
  const CacheMemory cm = engine_->memory(seq_);
  MemoryFigures m;
  m.context = cm.tokens_seen;
  // CacheMemory::rows_kept sums over layers and kv heads (batch 1); memory_of's rows_kept is the
  // mean over layers of the rows per (b, h)
  const int64_t per = cm.n_layers * n_kv_heads();
  m.rows_kept = per ? static_cast<double>(cm.rows_kept) / static_cast<double>(per) : 0.0;
  m.bytes_accounted = cm.bytes_accounted;
  m.bytes_resident = cm.bytes_resident;
  m.fp16_bytes = cm.fp16_bytes;
  return m;
}

int64_t EvalSeq::n_layers() const {
  return model_.config().n_layers;
}

int64_t EvalSeq::n_kv_heads() const {
  return model_.config().n_kv_heads;
}

std::vector<int32_t> EvalSeq::stored_positions(int64_t layer, int64_t head) const {
  if (engine_) return engine_->stored_positions(seq_, layer, head);
  return caches_[static_cast<size_t>(layer)]->stored_positions(0, head);
}

void log_softmax(const float* logits, int64_t n, std::vector<double>& out) {
  out.resize(static_cast<size_t>(n));
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double lz = mx + std::log(sum);
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = logits[i] - lz;
}

int64_t argmax(const float* logits, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

Progress::Progress(bool enabled, std::string what)
    : enabled_(enabled),
      what_(std::move(what)),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

void Progress::line(const std::string& text, bool force) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (!force && std::chrono::duration<double>(now - last_).count() < 2.0) return;
  last_ = now;
  const double t = std::chrono::duration<double>(now - start_).count();
  std::fprintf(stderr, "[eval %s %7.1fs] %s\n", what_.c_str(), t, text.c_str());
  std::fflush(stderr);
}

TapCache::TapCache(std::unique_ptr<KVCache> inner, AttnErrorSums* sums, int64_t window)
    : inner_(std::move(inner)),
      shadow_(std::make_unique<FullCache>()),
      sums_(sums),
      window_(window) {}

CacheView TapCache::update_and_fetch(const TensorView& keys, const TensorView& values,
                                     const UpdateOptions& opts) {
  const int64_t q_pos0 = inner_->offset();
  CacheView view = inner_->update_and_fetch(keys, values, opts);
  const CacheView full = shadow_->update_and_fetch(keys, values);
  if (!active) return view;
  VQ_CHECK(opts.queries != nullptr,
           "[attn-error] expected the forward pass to hand queries to the caches but got none");
  const TensorView& q = *opts.queries;
  const int64_t B = q.shape[0], Hq = q.shape[1], S = q.shape[2], D = q.shape[3];
  const size_t n = static_cast<size_t>(B * Hq * S * D);
  out_c_.resize(n);
  out_f_.resize(n);
  AttentionParams p;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  p.window = window_;
  p.q_pos0 = q_pos0;
  attention(q, view, p, out_c_.data());
  attention(q, full, p, out_f_.data());
  if (sums_->err2.empty()) {
    sums_->err2.assign(static_cast<size_t>(Hq), 0.0);
    sums_->ref2.assign(static_cast<size_t>(Hq), 0.0);
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < S * D; ++i) {
        const size_t k = static_cast<size_t>((b * Hq + h) * S * D + i);
        const double d = static_cast<double>(out_c_[k]) - static_cast<double>(out_f_[k]);
        sums_->err2[static_cast<size_t>(h)] += d * d;
        sums_->ref2[static_cast<size_t>(h)] +=
            static_cast<double>(out_f_[k]) * static_cast<double>(out_f_[k]);
      }
  return view;
}

}  // namespace vq::eval_detail
