// Tests of question-agnostic eviction by external scores: the max-attention op
// (snap_max_attention, veloxquant/snapkv.h (7)) against its double reference with a bound from its
// arithmetic, selection from given scores ((6)), SnapKV's snap_scoring = external (refusals, the
// selection, budget >= length, save/load), and prefill_reconstruct (veloxquant/reconstruct.h) on
// a tiny model: deterministic, no eviction at budget >= length, the selection follows its scores.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <sstream>
#include <vector>

#include "util/test_util.h"
#include "util/tiny_model.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/generate.h"
#include "veloxquant/model.h"
#include "veloxquant/reconstruct.h"
#include "veloxquant/snapkv.h"
#include "veloxquant/snapkv_cache.h"
#include "veloxquant/snapkv_skvq_cache.h"

namespace vq {
namespace {

// Small integers: every dot product (|.| <= 64 * 9) and logit (x 1/8 with D = 64) is exact in fp32.
std::vector<float> small_ints(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> u(-3, 3);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(u(rng));
  return v;
}

TEST(SnapMaxAttention, MatchesDoubleReferenceWithinTheArithmeticBound) {
  const int64_t d = 64;  // scale 1/8: exact
  for (int64_t n : {1, 2, 3, 17, 31, 130})
    for (int64_t n_rep : {1, 3})
      for (int64_t w : {1, 5}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " n_rep=" + std::to_string(n_rep) +
                     " w=" + std::to_string(w));
        const auto keys = small_ints(n * d, 1 + n);
        const auto q = small_ints(n_rep * w * d, 100 + n * w);
        std::vector<int32_t> kpos(static_cast<size_t>(n)), qpos(static_cast<size_t>(w));
        for (int64_t j = 0; j < n; ++j) kpos[j] = static_cast<int32_t>(j);
        // Queries at the last positions (some rows of the window see fewer keys).
        for (int64_t i = 0; i < w; ++i) qpos[i] = static_cast<int32_t>(n - w + i);
        const int64_t n_score = std::max<int64_t>(1, n - 1);
        std::vector<float> fast(static_cast<size_t>(n_score), 0.0f), ref = fast;
        snap_max_attention(keys.data(), kpos.data(), n, d, q.data(), qpos.data(), n_rep, w, n_score,
                           fast.data());
        snap_max_attention_reference(keys.data(), kpos.data(), n, d, q.data(), qpos.data(), n_rep,
                                     w, n_score, ref.data());
        // Logits and (logit - max) are exact; expf < 1 ulp (2^-23 relative), the fp32 sum of n
        // terms <= (n - 1) 2^-24, reciprocal and product 2^-24 each, the reference's rounding to
        // fp32 2^-24: |fast - ref| <= ref (n + 6) 2^-24.
        const double rel = static_cast<double>(n + 6) * std::ldexp(1.0, -24);
        double worst = 0, any = 0;
        for (int64_t j = 0; j < n_score; ++j) {
          const double tol = ref[j] * rel;
          EXPECT_LE(std::fabs(fast[j] - ref[j]), tol) << "row " << j;
          if (tol > 0) worst = std::max(worst, std::fabs(fast[j] - ref[j]) / tol);
          any += ref[j];
        }
        EXPECT_GT(any, 0.0);  // the reference is not all zeros
        RecordProperty("tolerance_used", std::to_string(worst));
      }
}

TEST(SnapMaxAttention, RunningMaxOverCallsEqualsOneCallBitForBit) {
  const int64_t n = 40, d = 64, n_rep = 2;
  const auto keys = small_ints(n * d, 7);
  std::vector<int32_t> kpos(n);
  for (int64_t j = 0; j < n; ++j) kpos[j] = static_cast<int32_t>(j);
  // 6 query rows of each head at positions 34..39: once, and as two calls of 3 rows.
  const auto q = small_ints(n_rep * 6 * d, 8);
  std::vector<int32_t> qpos = {34, 35, 36, 37, 38, 39};
  std::vector<float> once(n, 0.0f), split(n, 0.0f), again(n, 0.0f);
  snap_max_attention(keys.data(), kpos.data(), n, d, q.data(), qpos.data(), n_rep, 6, n,
                     once.data());
  snap_max_attention(keys.data(), kpos.data(), n, d, q.data(), qpos.data(), n_rep, 6, n,
                     again.data());
  EXPECT_EQ(once, again);  // deterministic
  for (int64_t part = 0; part < 2; ++part) {
    std::vector<float> qs;
    for (int64_t g = 0; g < n_rep; ++g)
      qs.insert(qs.end(), q.begin() + (g * 6 + part * 3) * d,
                q.begin() + (g * 6 + part * 3 + 3) * d);
    snap_max_attention(keys.data(), kpos.data(), n, d, qs.data(), qpos.data() + part * 3, n_rep, 3,
                       n, split.data());
  }
  EXPECT_EQ(once, split);
  // Keys after every query contribute nothing; a query that sees no key leaves the scores alone.
  std::vector<int32_t> early = {-1};
  std::vector<float> none(n, 0.0f);
  snap_max_attention(keys.data(), kpos.data(), n, d, q.data(), early.data(), 1, 1, n, none.data());
  EXPECT_EQ(none, std::vector<float>(n, 0.0f));
  EXPECT_THROW(snap_max_attention(keys.data(), kpos.data(), n, d, q.data(), qpos.data(), 1, 1,
                                  n + 1, none.data()),
               Error);
}

TEST(SnapSelectFromScores, MatchesTheReferencesAndTheTieRule) {
  SnapSelectParams p;
  p.budget = 10;
  p.n_sink = 2;
  p.obs_window = 4;
  SnapScratch scratch;
  std::mt19937_64 rng(3);
  std::vector<float> s(50);
  for (auto& x : s) x = std::uniform_real_distribution<float>(0, 1)(rng);
  std::vector<int64_t> out(50);
  int64_t got = snap_select_from_scores(s.data(), 50, p, out.data(), scratch);
  out.resize(static_cast<size_t>(got));
  EXPECT_EQ(out, snap_select_reference(s.data(), 50, 10, 2));
  // Ties: equal scores keep the lowest positions.
  std::vector<float> flat(50, 0.5f);
  out.assign(50, 0);
  got = snap_select_from_scores(flat.data(), 50, p, out.data(), scratch);
  out.resize(static_cast<size_t>(got));
  EXPECT_EQ(out, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  // Pooling and keep-window: the composition of the primitives.
  p.pool_kernel = 5;
  p.keep_window = true;
  out.assign(50, 0);
  got = snap_select_from_scores(s.data(), 50, p, out.data(), scratch);
  out.resize(static_cast<size_t>(got));
  std::vector<float> pooled(50, 0.0f);
  snap_pool_scores(s.data() + 2, 50 - 4 - 2, 5, PoolKind::kMax, pooled.data() + 2);
  EXPECT_EQ(out, snap_select_keep_window_reference(pooled.data(), 50, 10, 2, 4));
  // budget >= n keeps every row without reading the scores.
  p.budget = 60;
  out.assign(50, 0);
  EXPECT_EQ(snap_select_from_scores(nullptr, 50, p, out.data(), scratch), 50);
}

CacheConfig external_cfg(int64_t budget) {
  CacheConfig c;
  c.method = "snapkv";
  c.snap_budget = budget;
  c.snap_n_sink = 2;
  c.snap_obs_window = 4;
  c.snap_scoring = SnapScoring::kExternal;
  c.snap_evict_at = SnapEvictAt::kPromptEnd;
  return c;
}

using test::error_of;

TEST(SnapKVExternal, ConfigRules) {
  CacheConfig c = external_cfg(8);
  EXPECT_NO_THROW(validate(c));
  c.snap_evict_at = SnapEvictAt::kPrefillCall;
  EXPECT_NE(error_of([&] { validate(c); }).find("prompt_end"), std::string::npos);
  c = external_cfg(8);
  c.method = "snapkv+skvq";  // the kept rows then packed (session 22)
  EXPECT_NO_THROW(validate(c));
  EXPECT_EQ(parse_cache_arg("snapkv:scoring=external:evict_at=prompt_end").snap_scoring,
            SnapScoring::kExternal);
}

TEST(SnapKVExternal, SelectsTheTopScoredRowsAndRefusesWrongShapes) {
  SnapKVCache cache(external_cfg(8));
  const Tensor k = test::random_tensor(DType::kF16, 1, 2, 40, 16, 5);
  const Tensor v = test::random_tensor(DType::kF16, 1, 2, 40, 16, 6);
  cache.update_and_fetch(k.view(), v.view());
  ASSERT_TRUE(cache.eviction_pending());
  // No scores yet: end_prompt is refused and nothing changes.
  EXPECT_NE(error_of([&] { cache.end_prompt(); }).find("expected external scores"),
            std::string::npos);
  EXPECT_TRUE(cache.eviction_pending());
  EXPECT_EQ(cache.stored_rows(), 40);
  // Wrong shapes: named expected vs got, nothing stored.
  std::vector<float> sc(2 * 40);
  const std::string msg = error_of([&] { cache.set_external_scores(sc.data(), 1, 2, 39); });
  EXPECT_NE(msg.find("expected scores [1, 2, 40]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got [1, 2, 39]"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { cache.set_external_scores(sc.data(), 1, 1, 40); }), "");
  EXPECT_NE(error_of([&] { cache.end_prompt(); }), "");  // still none
  // Head 0 favours rows 30.., head 1 rows 10..; ties broken by the lower position.
  for (int64_t j = 0; j < 40; ++j) {
    sc[j] = j >= 30 ? 1.0f : 0.0f;
    sc[40 + j] = (j >= 10 && j < 14) ? 2.0f : 0.25f;
  }
  cache.set_external_scores(sc.data(), 1, 2, 40);
  cache.end_prompt();
  EXPECT_FALSE(cache.eviction_pending());
  EXPECT_EQ(cache.stored_positions(0, 0), (std::vector<int32_t>{0, 1, 30, 31, 32, 33, 34, 35}));
  EXPECT_EQ(cache.stored_positions(0, 1), (std::vector<int32_t>{0, 1, 2, 3, 10, 11, 12, 13}));
  // Other caches refuse external scores, naming their method.
  SnapKVCache query(parse_cache_arg("snapkv:scoring=query"));
  EXPECT_NE(error_of([&] { query.set_external_scores(sc.data(), 1, 2, 40); }).find("external"),
            std::string::npos);
  const auto full = make_full_cache(CacheConfig{});
  EXPECT_NE(error_of([&] { full->set_external_scores(sc.data(), 1, 2, 40); }).find("full"),
            std::string::npos);
}

TEST(SnapKVExternal, BudgetAtLeastLengthKeepsEverythingWithoutScores) {
  SnapKVCache cache(external_cfg(64));
  const Tensor k = test::random_tensor(DType::kF16, 1, 2, 40, 16, 9);
  const Tensor v = test::random_tensor(DType::kF16, 1, 2, 40, 16, 10);
  cache.update_and_fetch(k.view(), v.view());
  cache.end_prompt();
  EXPECT_EQ(cache.stored_rows(), 40);
  const CacheView view = cache.stored_view();
  ASSERT_EQ(view.segments.size(), 1u);
  EXPECT_TRUE(test::bit_equal(view.segments[0].keys, k.view()));
}

TEST(SnapKVExternal, PendingScoresSurviveSaveLoad) {
  SnapKVCache a(external_cfg(8)), b(external_cfg(8));
  const Tensor k = test::random_tensor(DType::kF16, 1, 2, 40, 16, 11);
  const Tensor v = test::random_tensor(DType::kF16, 1, 2, 40, 16, 12);
  a.update_and_fetch(k.view(), v.view());
  std::vector<float> sc(2 * 40);
  for (size_t j = 0; j < sc.size(); ++j) sc[j] = static_cast<float>((j * 7919) % 97);
  a.set_external_scores(sc.data(), 1, 2, 40);
  std::stringstream file;
  a.save(file);
  b.load(file);
  a.end_prompt();
  b.end_prompt();
  for (int64_t h = 0; h < 2; ++h) EXPECT_EQ(a.stored_positions(0, h), b.stored_positions(0, h));
  EXPECT_TRUE(test::bit_equal(a.stored_view().segments[0].keys, b.stored_view().segments[0].keys));
  // A file of another scoring mode is refused.
  std::stringstream again;
  SnapKVCache c(external_cfg(8));
  c.update_and_fetch(k.view(), v.view());
  c.save(again);
  SnapKVCache q(parse_cache_arg("snapkv:budget=8:n_sink=2:obs_window=4:evict_at=prompt_end"));
  EXPECT_THROW(q.load(again), Error);
}

class ReconstructTiny : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(test::write_tiny_model(test::make_temp_dir("vq-recon")));
    model_ = Model::load(*dir_).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete dir_;
  }
  static std::vector<int32_t> prompt(int64_t n) {
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 37 + 11) % 300);
    return ids;
  }
  static std::vector<std::unique_ptr<KVCache>> caches(const std::string& spec) {
    return model_->make_caches(parse_cache_arg(spec));
  }
  static ReconstructOptions opts() {
    ReconstructOptions o;
    o.repeat_ids = {5, 6, 7};
    o.chunk = 16;
    o.prefill_step = 24;
    return o;
  }
  static std::string* dir_;
  static Model* model_;
};
std::string* ReconstructTiny::dir_ = nullptr;
Model* ReconstructTiny::model_ = nullptr;

TEST_F(ReconstructTiny, BudgetAtLeastLengthEqualsAFullPrefillAndScoresAreDeterministic) {
  const auto ids = prompt(57);
  const auto snap = caches("snapkv:budget=100:scoring=external:evict_at=prompt_end");
  const auto full = caches("full");
  std::vector<float> la, lf;
  const auto s1 = prefill_reconstruct(*model_, ids.data(), 57, snap, opts(), &la);
  prefill(*model_, ids.data(), 57, full, 24, DType::kF16, &lf);
  EXPECT_EQ(la, lf);  // the prompt's logits are the full cache's, bit for bit
  for (size_t l = 0; l < snap.size(); ++l) {
    EXPECT_EQ(snap[l]->offset(), 57);  // the reconstruction rows are not kept
    EXPECT_EQ(snap[l]->stored_rows(), 57);
    const auto* sc = dynamic_cast<const SnapKVCache*>(snap[l].get());
    const auto* fc = dynamic_cast<const FullCache*>(full[l].get());
    ASSERT_TRUE(sc && fc);
    EXPECT_TRUE(
        test::bit_equal(sc->stored_view().segments[0].keys, fc->stored_view().segments[0].keys));
  }
  // Scores [H_kv, n] per layer, in [0, 1], the same on a second run.
  const auto again = caches("snapkv:budget=100:scoring=external:evict_at=prompt_end");
  const auto s2 = prefill_reconstruct(*model_, ids.data(), 57, again, opts(), nullptr);
  EXPECT_EQ(s1, s2);
  ASSERT_EQ(s1.size(), static_cast<size_t>(model_->config().n_layers));
  for (const auto& layer : s1) {
    ASSERT_EQ(layer.size(), static_cast<size_t>(model_->config().n_kv_heads * 57));
    for (float x : layer) EXPECT_TRUE(x >= 0.0f && x <= 1.0f);
  }
}

TEST_F(ReconstructTiny, TheCacheKeepsWhatItsScoresSelect) {
  const auto ids = prompt(70);
  const auto snap = caches("snapkv:budget=20:scoring=external:evict_at=prompt_end:pool_kernel=3");
  const auto scores = prefill_reconstruct(*model_, ids.data(), 70, snap, opts(), nullptr);
  SnapSelectParams p = SnapSelectParams::from_config(
      parse_cache_arg("snapkv:budget=20:scoring=external:evict_at=prompt_end:pool_kernel=3"));
  SnapScratch scratch;
  for (size_t l = 0; l < snap.size(); ++l)
    for (int64_t h = 0; h < model_->config().n_kv_heads; ++h) {
      std::vector<int64_t> out(70);
      const int64_t got =
          snap_select_from_scores(scores[l].data() + h * 70, 70, p, out.data(), scratch);
      std::vector<int32_t> want(out.begin(), out.begin() + got);
      EXPECT_EQ(snap[l]->stored_positions(0, h), want) << "layer " << l << " head " << h;
    }
  // A cache that is not fresh is refused before anything changes.
  EXPECT_THROW(prefill_reconstruct(*model_, ids.data(), 70, snap, opts(), nullptr), Error);
}

// snapkv+skvq with snap_scoring = external: SnapKV's selection from the scores it was handed
// (as the snapkv cache's, TheCacheKeepsWhatItsScoresSelect), then the kept rows packed as with
// any scoring (token-axis and channel-axis keys). (Its scores are close to, not bit-equal with,
// the snapkv cache's: the prompt's later chunks attend over a view of other segments, whose
// online softmax rounds in another order.)
TEST_F(ReconstructTiny, SnapkvSkvqKeepsWhatItsScoresSelectAndPacksIt) {
  const auto ids = prompt(90);
  for (const char* keys : {"", ":key_axis=channel:rotation=hadamard:meta=fp8_e4m3"}) {
    const std::string spec = std::string(
                                 "snapkv+skvq:budget=40:scoring=external:evict_at="
                                 "prompt_end:pool_kernel=3:keep_window=true:"
                                 "skvq_window=8:snap_n_sink=2") +
                             keys;
    const auto both = caches(spec);
    const auto scores = prefill_reconstruct(*model_, ids.data(), 90, both, opts(), nullptr);
    const SnapSelectParams p = SnapSelectParams::from_config(parse_cache_arg(spec));
    SnapScratch scratch;
    for (size_t l = 0; l < both.size(); ++l) {
      const auto* c = dynamic_cast<const SnapkvSkvqCache*>(both[l].get());
      ASSERT_NE(c, nullptr);
      EXPECT_FALSE(c->eviction_pending());
      EXPECT_GT(c->packed_rows(), 0) << keys;
      EXPECT_EQ(c->stored_rows(), 40);
      for (int64_t h = 0; h < model_->config().n_kv_heads; ++h) {
        std::vector<int64_t> out(90);
        const int64_t got =
            snap_select_from_scores(scores[l].data() + h * 90, 90, p, out.data(), scratch);
        const std::vector<int32_t> want(out.begin(), out.begin() + got);
        EXPECT_EQ(c->stored_positions(0, h), want) << keys << " layer " << l << " head " << h;
      }
    }
  }
}

TEST(SnapkvSkvqExternal, RefusesMissingOrMisshapenScoresAndKeepsThemAcrossSaveLoad) {
  CacheConfig c = external_cfg(12);
  c.method = "snapkv+skvq";
  c.head_dim = 16;
  c.skvq_window = 4;
  c.skvq_n_sink = 2;
  c.skvq_group_size = 8;
  SnapkvSkvqCache a(c), b(c);
  const Tensor k = test::random_tensor(DType::kF16, 1, 2, 40, 16, 21);
  const Tensor v = test::random_tensor(DType::kF16, 1, 2, 40, 16, 22);
  a.update_and_fetch(k.view(), v.view());
  ASSERT_TRUE(a.eviction_pending());
  EXPECT_NE(error_of([&] { a.end_prompt(); }).find("expected external scores"), std::string::npos);
  EXPECT_TRUE(a.eviction_pending());
  EXPECT_EQ(a.stored_rows(), 40);
  std::vector<float> sc(2 * 40);
  const std::string msg = error_of([&] { a.set_external_scores(sc.data(), 1, 2, 39); });
  EXPECT_NE(msg.find("expected scores [1, 2, 40]"), std::string::npos) << msg;
  // A single-token call owes the selection: refused too, nothing changed.
  const Tensor k1 = test::random_tensor(DType::kF16, 1, 2, 1, 16, 23);
  EXPECT_NE(error_of([&] { a.update_and_fetch(k1.view(), k1.view()); }).find("external scores"),
            std::string::npos);
  EXPECT_EQ(a.offset(), 40);
  for (size_t j = 0; j < sc.size(); ++j) sc[j] = static_cast<float>((j * 7919) % 97);
  a.set_external_scores(sc.data(), 1, 2, 40);
  std::stringstream file;
  a.save(file);
  b.load(file);
  a.end_prompt();
  b.end_prompt();
  EXPECT_GT(a.packed_rows(), 0);
  EXPECT_EQ(a.stored_rows(), 12);
  std::stringstream sa, sb;
  a.save(sa);
  b.save(sb);
  EXPECT_EQ(sa.str(), sb.str());
  SnapKVCache alone(external_cfg(12));
  alone.update_and_fetch(k.view(), v.view());
  alone.set_external_scores(sc.data(), 1, 2, 40);
  alone.end_prompt();
  for (int64_t h = 0; h < 2; ++h) EXPECT_EQ(a.stored_positions(0, h), alone.stored_positions(0, h));
}

}  // namespace
}  // namespace vq
