// Helpers shared by the evaluation engine's files (not public): memory figures of a set of
// per-layer caches, chunked prefill and decode steps through Model::forward, log-softmax in
// double, progress lines, and the attention-error tap (a cache wrapper that also feeds a
// full-precision shadow cache and compares the attention outputs on the same queries).
// Token rows are int32 ids; logits rows are [vocab] fp32.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/engine.h"
#include "veloxquant/eval.h"
#include "veloxquant/model.h"

namespace vq::eval_detail {

using Caches = std::vector<std::unique_ptr<KVCache>>;

MemoryFigures memory_of(const Caches& caches);

// Feeds ids[0, n) through vq::prefill (the chunks of veloxquant/prefill_schedule.h, then
// end_prompt; K/V dtype and matrix-product mode from st); n == 0 only calls end_prompt. With
// logits != nullptr the last chunk's last position's logits are written to *logits, else no
// logits are computed.
void prefill(const Model& model, const int32_t* ids, int64_t n, const Caches& caches, int64_t step,
             const EvalSettings& st, ForwardScratch& scratch, std::vector<float>* logits);

// One decode step (S == 1); *logits = [vocab].
void decode_step(const Model& model, int32_t id, const Caches& caches, const EvalSettings& st,
                 ForwardScratch& scratch, std::vector<float>* logits);

// The engine an evaluation runs its sequences on: null for st.device == kCpu with
// tensor_parallel 1 (the caches are driven through prefill/decode_step above), else an engine of
// the model on st.device with st's tensor_parallel, tp_simulate, kv_dtype and matmul (vq::Error
// from make_engine without a CUDA build or device, or for N not dividing the KV heads).
// tp_simulate on the CPU and, on the CPU engine, any of `methods` with scoring=external (on the
// CUDA engine: skvq_protect_scoring=external) are refused with vq::Error before anything runs.
std::unique_ptr<Engine> make_eval_engine(const Model& model, const EvalSettings& st,
                                         const std::vector<EvalMethod>& methods);

// One sequence of an evaluation with one cache config: per-layer caches through prefill and
// decode_step above (engine == nullptr), or a sequence of `engine` fed the same chunks
// (prefill_chunks of st.prefill_step, end_prompt after the last) and decode steps, so both
// devices (and N ranks) run one protocol. The engine's sequence is removed with the object.
class EvalSeq {
 public:
  EvalSeq(const Model& model, Engine* engine, const CacheConfig& cfg, const EvalSettings& st,
          ForwardScratch& scratch);
  ~EvalSeq();
  EvalSeq(const EvalSeq&) = delete;
  EvalSeq& operator=(const EvalSeq&) = delete;

  // prefill(ids, n, ...) as above (n == 0 only ends the prompt; on an engine it is refused). On an
  // engine, a config with scoring=external first runs the CPU's reconstruction prefill for the
  // scores (as prefill() above does) and hands them over (Engine::set_external_scores).
  void prefill(const int32_t* ids, int64_t n, std::vector<float>* logits);
  // Engine sequences only, before the first prefill: Engine::set_attention_tap(seq, tap).
  void set_attention_tap(AttentionTap* tap);
  bool on_engine() const { return engine_ != nullptr; }
  void decode(int32_t id, std::vector<float>* logits);
  MemoryFigures memory() const;
  int64_t n_layers() const;
  int64_t n_kv_heads() const;
  // Positions stored for (layer, kv head) of batch row 0, ascending.
  std::vector<int32_t> stored_positions(int64_t layer, int64_t head) const;

 private:
  const Model& model_;
  Engine* engine_;
  const EvalSettings& st_;
  ForwardScratch& scratch_;
  CacheConfig cfg_;
  Caches caches_;     // CPU
  int64_t seq_ = -1;  // engine
};

// log-softmax of logits[0, n) in double: out[i] = x[i] - logsumexp(x).
void log_softmax(const float* logits, int64_t n, std::vector<double>& out);
// Index of the largest logit, the lowest index on ties.
int64_t argmax(const float* logits, int64_t n);

// Progress on stderr, at most one line per `min_interval_s` unless forced.
class Progress {
 public:
  Progress(bool enabled, std::string what);
  void line(const std::string& text, bool force = false);

 private:
  bool enabled_;
  std::string what_;
  std::chrono::steady_clock::time_point start_, last_;
};

// Sums for the attention-output error of one layer, per query head.
struct AttnErrorSums {
  std::vector<double> err2, ref2;  // [H_q]: sum ||o_c - o_f||^2, sum ||o_f||^2
};

// Wraps a layer's cache: every call goes to the inner cache (its view is returned) and to a
// full-precision shadow cache; while `active`, attention over both views with the call's queries
// (UpdateOptions::queries, the model's rotated queries) is accumulated into `sums`.
class TapCache final : public KVCache {
 public:
  TapCache(std::unique_ptr<KVCache> inner, AttnErrorSums* sums, int64_t window);
  std::string method() const override { return inner_->method(); }
  CacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                             const UpdateOptions& opts = {}) override;
  int64_t offset() const override { return inner_->offset(); }
  int64_t stored_rows() const override { return inner_->stored_rows(); }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override {
    return inner_->stored_positions(b, h);
  }
  int64_t batch() const override { return inner_->batch(); }
  int64_t n_kv_heads() const override { return inner_->n_kv_heads(); }
  Mask make_mask(int64_t n_queries, int64_t window = 0) const override {
    return inner_->make_mask(n_queries, window);
  }
  CacheStats stats() const override { return inner_->stats(); }
  void save(std::ostream& out) const override { inner_->save(out); }
  void load(std::istream& in) override { inner_->load(in); }

  bool active = false;

 private:
  std::unique_ptr<KVCache> inner_;
  std::unique_ptr<KVCache> shadow_;
  AttnErrorSums* sums_;
  int64_t window_;
  std::vector<float> out_c_, out_f_;
};

}  // namespace vq::eval_detail
