// SKVQ calibration from a text through the model (veloxquant/calibrate.h), on a tiny random
// Llama: one valid permutation per layer and head, equal to the stable channel-range sort of the
// layer's recorded keys/values, and a skvq cache built with the file uses exactly those.
#include <gtest/gtest.h>

#include <algorithm>
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
}

}  // namespace
}  // namespace vq
