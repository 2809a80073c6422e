// Context-reconstruction scoring (see veloxquant/reconstruct.h): the prompt's prefill through a
// tap per layer that also keeps a full-precision copy of the layer's rows, then the
// reconstruction passes over the copies only, the tap turning each pass's queries into the
// running max attention weight of every prompt row (snap_max_attention), per KV head.
#include "veloxquant/reconstruct.h"

#include <algorithm>
#include <string>

#include "ops/thread_pool.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/generate.h"
#include "veloxquant/snapkv.h"

namespace vq {
namespace {

// One layer's tap. While prefilling: every block goes to the layer's cache (whose view is
// returned, so the prompt's activations are the ones the cache alone would give) and to the copy.
// While scoring: blocks go to the copy only, and the call's queries score the first n_score rows.
class ReconTap final : public KVCache {
 public:
  ReconTap(KVCache* inner, std::unique_ptr<KVCache> copy) : inner_(inner), copy_(std::move(copy)) {}

  std::string method() const override { return inner_->method(); }
  CacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                             const UpdateOptions& opts = {}) override {
    if (!scoring_) {
      CacheView view = inner_->update_and_fetch(keys, values, opts);
      copy_->update_and_fetch(keys, values);
      return view;
    }
    VQ_CHECK(opts.queries != nullptr,
             "[reconstruct] expected the forward pass's queries but got none");
    const int64_t q_first = copy_->offset();
    CacheView view = copy_->update_and_fetch(keys, values);
    score(view, *opts.queries, q_first);
    return view;
  }
  int64_t offset() const override { return scoring_ ? copy_->offset() : inner_->offset(); }
  int64_t stored_rows() const override { return inner_->stored_rows(); }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override {
    return inner_->stored_positions(b, h);
  }
  int64_t batch() const override { return inner_->batch(); }
  int64_t n_kv_heads() const override { return inner_->n_kv_heads(); }
  CacheStats stats() const override { return inner_->stats(); }
  void save(std::ostream& out) const override { inner_->save(out); }
  void load(std::istream& in) override { inner_->load(in); }
  // end_prompt is the driver's (after the scores are handed over): a no-op here.

  void start_scoring(int64_t n_score) {
    scoring_ = true;
    n_score_ = n_score;
    heads_ = copy_->n_kv_heads();
    scores_.assign(static_cast<size_t>(heads_ * n_score), 0.0f);
  }
  void drop_pass(int64_t rows) { copy_->trim(rows); }
  std::vector<float>& scores() { return scores_; }

 private:
  // Running max over this call's queries [1, H_q, S, D] of the weights of rows [0, n_score).
  void score(const CacheView& view, const TensorView& q, int64_t q_first) {
    const int64_t n = view.n_rows(), d = view.head_dim, hq = q.shape[1], s = q.shape[2];
    const int64_t n_rep = hq / heads_;
    ops::parallel_for(heads_, [&](int64_t h) {
      std::vector<float> k(static_cast<size_t>(n * d));
      std::vector<int32_t> kpos(static_cast<size_t>(n));
      int64_t r = 0;
      for (const ViewSegment& seg : view.segments)
        for (int64_t i = 0; i < seg.n_rows; ++i, ++r) {
          convert_view_row(seg.keys, 0, h, i, k.data() + r * d, DType::kF32);
          kpos[r] = seg.position(0, h, i, heads_);
        }
      std::vector<float> qs(static_cast<size_t>(n_rep * s * d));
      for (int64_t g = 0; g < n_rep; ++g)
        for (int64_t i = 0; i < s; ++i)
          convert_view_row(q, 0, h * n_rep + g, i, qs.data() + (g * s + i) * d, DType::kF32);
      std::vector<int32_t> qpos(static_cast<size_t>(s));
      for (int64_t i = 0; i < s; ++i) qpos[i] = static_cast<int32_t>(q_first + i);
      std::vector<float> scratch;
      snap_max_attention(k.data(), kpos.data(), n, d, qs.data(), qpos.data(), n_rep, s, n_score_,
                         scores_.data() + h * n_score_, &scratch);
    });
  }

  KVCache* inner_;
  std::unique_ptr<KVCache> copy_;
  bool scoring_ = false;
  int64_t n_score_ = 0, heads_ = 0;
  std::vector<float> scores_;  // [H, n_score]
};

}  // namespace

std::vector<std::vector<float>> prefill_reconstruct(
    const Model& model, const int32_t* prompt, int64_t n,
    const std::vector<std::unique_ptr<KVCache>>& caches, const ReconstructOptions& opts,
    std::vector<float>* last_logits, ForwardScratch* scratch) {
  const ModelConfig& c = model.config();
  VQ_CHECK(n >= 1,
           "[reconstruct] expected a prompt of at least one token but got " + std::to_string(n));
  VQ_CHECK(opts.chunk >= 1,
           "[reconstruct] chunk: expected >= 1 but got " + std::to_string(opts.chunk));
  VQ_CHECK(c.sliding_window == 0,
           "[reconstruct] expected a model without a sliding window but got sliding_window " +
               std::to_string(c.sliding_window));
  VQ_CHECK(static_cast<int64_t>(caches.size()) == c.n_layers,
           "[reconstruct] expected one cache per layer (" + std::to_string(c.n_layers) +
               ") but got " + std::to_string(caches.size()));
  for (size_t l = 0; l < caches.size(); ++l)
    VQ_CHECK(caches[l] && caches[l]->offset() == 0,
             "[reconstruct] expected fresh caches (offset 0) but layer " + std::to_string(l) +
                 (caches[l] ? " is at " + std::to_string(caches[l]->offset()) : " is null"));
  for (int32_t id : opts.repeat_ids)
    VQ_CHECK(id >= 0 && id < c.vocab_size, "[reconstruct] repeat_ids: expected ids in [0, " +
                                               std::to_string(c.vocab_size) + ") but got " +
                                               std::to_string(id));

  std::vector<std::unique_ptr<KVCache>> taps;
  std::vector<ReconTap*> tap;
  for (const auto& cache : caches) {
    auto t = std::make_unique<ReconTap>(cache.get(), make_full_cache(CacheConfig{}));
    tap.push_back(t.get());
    taps.push_back(std::move(t));
  }
  ForwardScratch local;
  ForwardScratch& s = scratch ? *scratch : local;
  // The prompt, into the caches and the copies (the taps' end_prompt does nothing).
  prefill(model, prompt, n, taps, opts.prefill_step, opts.kv_dtype, last_logits, &s, {},
          opts.matmul);

  for (ReconTap* t : tap) t->start_scoring(n);
  ForwardOptions fo;
  fo.kv_dtype = opts.kv_dtype;
  fo.matmul = opts.matmul;
  fo.logits = ForwardOptions::Logits::kNone;
  fo.pass_queries = true;
  std::vector<int32_t> ids;
  for (int64_t c0 = opts.include_first ? 0 : 1; c0 < n; c0 += opts.chunk) {
    const int64_t c1 = std::min(n, c0 + opts.chunk);
    ids = opts.repeat_ids;
    ids.insert(ids.end(), prompt + c0, prompt + c1);
    const int64_t len = static_cast<int64_t>(ids.size());
    model.forward(ids.data(), 1, len, taps, fo, nullptr, &s);
    for (ReconTap* t : tap) t->drop_pass(len);
  }

  std::vector<std::vector<float>> out;
  for (size_t l = 0; l < caches.size(); ++l) {
    out.push_back(std::move(tap[l]->scores()));
    if (caches[l]->takes_external_scores()) {
      const int64_t heads = caches[l]->n_kv_heads();
      caches[l]->set_external_scores(out.back().data(), 1, heads, n);
    }
  }
  for (const auto& cache : caches) cache->end_prompt();
  return out;
}

}  // namespace vq
