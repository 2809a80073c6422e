// calibrate_skvq_perms and calibrate_query_moments (see veloxquant/calibrate.h): full-precision
// prefill of the calibration ids, then one permutation set per layer from the stored keys and
// values, or the query moments the caches were handed.
#include "veloxquant/calibrate.h"

#include <memory>
#include <string>
#include <vector>

#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/generate.h"

namespace vq {

namespace {

void check_ids(const Model& model, const std::vector<int32_t>& tokens, const char* op) {
  VQ_CHECK(!tokens.empty(),
           std::string("[") + op + "] expected at least 1 calibration token but got 0");
  const ModelConfig& mc = model.config();
  VQ_CHECK(static_cast<int64_t>(tokens.size()) <= mc.max_position_embeddings ||
               mc.max_position_embeddings <= 0,
           std::string("[") + op + "] expected at most " +
               std::to_string(mc.max_position_embeddings) +
               " tokens (the model's context) but got " + std::to_string(tokens.size()));
}

// A full cache that also sums q q^T of the queries it is handed, per KV head (fp64, token order,
// the group's query heads in order within a token).
class MomentRecorder final : public KVCache {
 public:
  MomentRecorder(int64_t heads, int64_t d)
      : heads_(heads), d_(d), sum_(static_cast<size_t>(heads * d * d), 0.0) {}
  std::string method() const override { return "full"; }
  CacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                             const UpdateOptions& opts) override {
    VQ_CHECK(opts.queries != nullptr,
             "[calibrate_query_moments] internal: the forward pass handed no queries");
    const TensorView& q = *opts.queries;
    VQ_CHECK(q.shape[0] == 1 && q.shape[1] % heads_ == 0 && q.shape[3] == d_,
             "[calibrate_query_moments] internal: unexpected query shape");
    const int64_t rep = q.shape[1] / heads_;
    std::vector<double> v(static_cast<size_t>(d_));
    for (int64_t t = 0; t < q.shape[2]; ++t)
      for (int64_t h = 0; h < heads_; ++h) {
        double* m = sum_.data() + h * d_ * d_;
        for (int64_t r = 0; r < rep; ++r) {
          for (int64_t c = 0; c < d_; ++c) v[static_cast<size_t>(c)] = q.at(0, h * rep + r, t, c);
          for (int64_t i = 0; i < d_; ++i)
            for (int64_t j = i; j < d_; ++j) m[i * d_ + j] += v[i] * v[j];
        }
      }
    count_ += q.shape[2] * rep;
    return full_.update_and_fetch(keys, values, opts);
  }
  int64_t offset() const override { return full_.offset(); }
  int64_t batch() const override { return full_.batch(); }
  int64_t n_kv_heads() const override { return full_.n_kv_heads(); }
  int64_t stored_rows() const override { return full_.stored_rows(); }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override {
    return full_.stored_positions(b, h);
  }
  Mask make_mask(int64_t n_queries, int64_t window) const override {
    return full_.make_mask(n_queries, window);
  }
  CacheStats stats() const override { return full_.stats(); }
  void save(std::ostream& out) const override { full_.save(out); }
  void load(std::istream& in) override { full_.load(in); }

  // The mean moments [heads * d * d], symmetric.
  std::vector<double> moments() const {
    std::vector<double> m(sum_.size());
    const auto n = static_cast<double>(count_);
    for (int64_t h = 0; h < heads_; ++h)
      for (int64_t i = 0; i < d_; ++i)
        for (int64_t j = i; j < d_; ++j) {
          const double v = sum_[static_cast<size_t>((h * d_ + i) * d_ + j)] / n;
          m[static_cast<size_t>((h * d_ + i) * d_ + j)] = v;
          m[static_cast<size_t>((h * d_ + j) * d_ + i)] = v;
        }
    return m;
  }

 private:
  int64_t heads_, d_;
  std::vector<double> sum_;
  int64_t count_ = 0;
  FullCache full_;
};

}  // namespace

QueryMomentSet calibrate_query_moments(const Model& model, const std::vector<int32_t>& tokens,
                                       int64_t prefill_step) {
  check_ids(model, tokens, "calibrate_query_moments");
  const ModelConfig& mc = model.config();
  std::vector<std::unique_ptr<KVCache>> caches;
  std::vector<const MomentRecorder*> rec;
  for (int64_t l = 0; l < mc.n_layers; ++l) {
    auto c = std::make_unique<MomentRecorder>(mc.n_kv_heads, mc.head_dim);
    rec.push_back(c.get());
    caches.push_back(std::move(c));
  }
  prefill(model, tokens.data(), static_cast<int64_t>(tokens.size()), caches, prefill_step,
          DType::kF32, nullptr);
  QueryMomentSet set;
  set.n_kv_heads = mc.n_kv_heads;
  set.head_dim = mc.head_dim;
  set.n_tokens = static_cast<int64_t>(tokens.size());
  for (const MomentRecorder* r : rec) set.layers.push_back(r->moments());
  return set;
}

SkvqPermSet calibrate_skvq_perms(const Model& model, const std::vector<int32_t>& tokens,
                                 int64_t prefill_step) {
  check_ids(model, tokens, "calibrate_skvq_perms");
  const ModelConfig& mc = model.config();
  CacheConfig full;
  full.method = "full";
  const auto caches = model.make_caches(full);
  // fp32 keys and values: the permutation is computed from the model's own values, not from
  // their fp16 rounding.
  prefill(model, tokens.data(), static_cast<int64_t>(tokens.size()), caches, prefill_step,
          DType::kF32, nullptr);
  SkvqPermSet set;
  set.n_kv_heads = mc.n_kv_heads;
  set.head_dim = mc.head_dim;
  for (const auto& c : caches) {
    const auto* fc = dynamic_cast<const FullCache*>(c.get());
    VQ_CHECK(fc != nullptr, "[calibrate_skvq_perms] expected full caches from the builder");
    set.key.push_back(skvq_channel_perms(fc->keys()));
    set.value.push_back(skvq_channel_perms(fc->values()));
  }
  return set;
}

}  // namespace vq
