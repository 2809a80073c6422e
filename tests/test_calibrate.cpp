// SKVQ calibration from a text through the model (veloxquant/calibrate.h), on a tiny random
// Llama: one valid permutation per layer and head, equal to the stable channel-range sort of the
// layer's recorded keys/values, and a skvq cache built with the file uses exactly those.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>

#include "util/test_util.h"
#include "util/tiny_model.h"
#include "veloxquant/builder.h"
#include "veloxquant/calibrate.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/generate.h"
#include "veloxquant/skvq_cache.h"

namespace vq {
namespace {

TEST(Calibrate, PermutationsFollowTheRecordedChannelRanges) {
  test::TinyModelSpec spec;
  const std::string dir = test::write_tiny_model(test::make_temp_dir("calib"), spec);
  const auto model = Model::load(dir);
  std::vector<int32_t> ids(100);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37 + 5) % 300);
  const SkvqPermSet set = calibrate_skvq_perms(*model, ids, 32);
  const int64_t H = model->config().n_kv_heads, D = model->config().head_dim;
  ASSERT_EQ(set.key.size(), static_cast<size_t>(model->config().n_layers));
  ASSERT_EQ(set.n_kv_heads, H);
  ASSERT_EQ(set.head_dim, D);

  // Independent check: record the keys with the same fp32 chunked prefill (bit-identical keys)
  // and sort the channel ranges with a plain stable sort.
  CacheConfig full;
  const auto caches = model->make_caches(full);
  prefill(*model, ids.data(), static_cast<int64_t>(ids.size()), caches, 32, DType::kF32, nullptr);
  for (size_t l = 0; l < caches.size(); ++l) {
    const TensorView k = dynamic_cast<const FullCache&>(*caches[l]).keys();
    for (int64_t h = 0; h < H; ++h) {
      std::vector<float> range(static_cast<size_t>(D));
      for (int64_t d = 0; d < D; ++d) {
        float lo = k.at(0, h, 0, d), hi = lo;
        for (int64_t s = 1; s < k.shape[2]; ++s) {
          lo = std::min(lo, k.at(0, h, s, d));
          hi = std::max(hi, k.at(0, h, s, d));
        }
        range[static_cast<size_t>(d)] = hi - lo;
      }
      std::vector<int32_t> expect(static_cast<size_t>(D));
      std::iota(expect.begin(), expect.end(), 0);
      std::stable_sort(expect.begin(), expect.end(),
                       [&](int32_t a, int32_t b) { return range[a] < range[b]; });
      const std::vector<int32_t> got(set.key[l].begin() + h * D, set.key[l].begin() + (h + 1) * D);
      EXPECT_EQ(got, expect) << "layer " << l << " head " << h;
    }
  }

  // A cache built with the file uses the calibrated permutation of its layer.
  const std::string path = dir + "/perms.json";
  save_skvq_perm_file(path, set);
  CacheConfig cfg;
  cfg.method = "skvq";
  cfg.skvq_window = 16;
  cfg.skvq_group_size = 8;
  cfg.skvq_perm_file = path;
  const auto qcaches = model->make_caches(cfg);
  prefill(*model, ids.data(), 40, qcaches, 40, DType::kF16, nullptr);
  for (size_t l = 0; l < qcaches.size(); ++l) {
    const auto& sc = dynamic_cast<const SkvqCache&>(*qcaches[l]);
    EXPECT_EQ(sc.key_perms(), set.key[l]) << "layer " << l;
    EXPECT_EQ(sc.value_perms(), set.value[l]) << "layer " << l;
  }
}

TEST(Calibrate, EmptyTextRefused) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("calib"), {});
  const auto model = Model::load(dir);
  EXPECT_THROW(calibrate_skvq_perms(*model, {}), Error);
  EXPECT_THROW(calibrate_query_moments(*model, {}), Error);
}

// A full cache that keeps a copy of every query it is handed: [token][query head][D].
class QueryCapture final : public KVCache {
 public:
  std::vector<std::vector<std::vector<double>>> q;
  std::string method() const override { return "full"; }
  CacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                             const UpdateOptions& opts) override {
    const TensorView& x = *opts.queries;
    for (int64_t t = 0; t < x.shape[2]; ++t) {
      auto& tok = q.emplace_back();
      for (int64_t h = 0; h < x.shape[1]; ++h) {
        auto& row = tok.emplace_back();
        for (int64_t c = 0; c < x.shape[3]; ++c) row.push_back(x.at(0, h, t, c));
      }
    }
    return full.update_and_fetch(keys, values, opts);
  }
  int64_t offset() const override { return full.offset(); }
  int64_t stored_rows() const override { return full.stored_rows(); }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override {
    return full.stored_positions(b, h);
  }
  Mask make_mask(int64_t n, int64_t window) const override { return full.make_mask(n, window); }
  CacheStats stats() const override { return full.stats(); }
  void save(std::ostream& out) const override { full.save(out); }
  void load(std::istream& in) override { full.load(in); }
  FullCache full;
};

TEST(Calibrate, QueryMomentsAreTheMeanOuterProductsOfTheGroupsQueries) {
  test::TinyModelSpec spec;
  spec.n_heads = 4;
  spec.n_kv_heads = 2;
  const std::string dir = test::write_tiny_model(test::make_temp_dir("calibq"), spec);
  const auto model = Model::load(dir);
  std::vector<int32_t> ids(70);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 53 + 7) % 300);
  const QueryMomentSet set = calibrate_query_moments(*model, ids, 32);
  const int64_t H = model->config().n_kv_heads, D = model->config().head_dim;
  const int64_t rep = model->config().n_heads / H;
  ASSERT_EQ(set.layers.size(), static_cast<size_t>(model->config().n_layers));
  EXPECT_EQ(set.n_kv_heads, H);
  EXPECT_EQ(set.head_dim, D);
  EXPECT_EQ(set.n_tokens, 70);

  // Independently: capture the queries of the same fp32 prefill and average in long double.
  std::vector<std::unique_ptr<KVCache>> caches;
  std::vector<QueryCapture*> cap;
  for (int64_t l = 0; l < model->config().n_layers; ++l) {
    auto c = std::make_unique<QueryCapture>();
    cap.push_back(c.get());
    caches.push_back(std::move(c));
  }
  prefill(*model, ids.data(), 70, caches, 32, DType::kF32, nullptr);
  for (size_t l = 0; l < cap.size(); ++l) {
    ASSERT_EQ(cap[l]->q.size(), 70u);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < D; ++i)
        for (int64_t j = 0; j < D; ++j) {
          long double sum = 0, mag = 0;
          for (const auto& tok : cap[l]->q)
            for (int64_t r = 0; r < rep; ++r) {
              const auto& v = tok[static_cast<size_t>(h * rep + r)];
              sum += static_cast<long double>(v[i]) * v[j];
              mag += std::abs(static_cast<long double>(v[i]) * v[j]);
            }
          const double want = static_cast<double>(sum / (70 * rep));
          const double got = set.layers[l][static_cast<size_t>((h * D + i) * D + j)];
          // fp64 sums of 140 products (each exact to 2^-53) in another order, then one division:
          // within (140 + 2) 2^-53 < 1.6e-14 of the mean magnitude.
          EXPECT_NEAR(got, want, 1.6e-14 * static_cast<double>(mag / (70 * rep)))
              << "layer " << l << " head " << h << " (" << i << ", " << j << ")";
        }
  }
}

}  // namespace
}  // namespace vq
