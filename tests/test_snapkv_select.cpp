// Tests of the SnapKV primitives (veloxquant/snapkv.h): window scores against the double
// reference with a tolerance derived from fp32 rounding, the causal mask and GQA averaging of
// query scores, pooling, the seed's selection rule (NaN/inf/±0 order, 1000 random tie-heavy cases
// against a stable sort written here, awkward lengths), the keep-window rule and the per-head
// pipeline.
// Layouts: keys [n, D] fp32, queries [n_rep, w, D] fp32, scores [n].
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "veloxquant/error.h"
#include "veloxquant/snapkv.h"

namespace vq {
namespace {

constexpr double kU = 0x1p-24;   // fp32 unit roundoff
constexpr double kUd = 0x1p-53;  // double unit roundoff

std::vector<float> randn(size_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

double gamma(double n, double u) {
  return n * u / (1.0 - n * u);
}

// Per-element bound on |fast - reference| for window scores, from the rounding of the fast path:
//  * a logit q.k/sqrt(D) is a D-term fp32 dot product (any summation order) times an fp32 scale:
//    |dl| <= gamma_{D+2} * A with A = sum_c |q_c k_c| / sqrt(D)   (worst case over the row: dmax);
//  * p_j = exp(l_j - m) / Z: the subtraction adds u |l_j - m| <= u R (R = logit range of the row),
//    expf <= 1 ulp (u), Z is an n-term fp32 sum (gamma_n), 1/Z and the product two more u; a logit
//    error moves p_j by a factor exp(dl_j) and Z by at most exp(dmax), so
//    |dp_j| / p_j <= exp(2 dmax + u R) - 1 + gamma_n + 4u;
//  * scores are means of p_j over the window rows (and heads) in double, rounded once to fp32 (u);
//  * the reference itself is double: (D + n + 8) * 2^-53 relative;
//  * fp32 exp underflows below 2^-126 where the double reference does not: 2^-120 absolute.
// So |ds_j| <= s_j * (max over rows of the relative bound + u + ref) + 2^-120.
std::vector<double> score_tolerance(const std::vector<float>& keys, const int32_t* key_pos,
                                    int64_t n, int64_t d, const float* queries,
                                    const int32_t* query_pos, int64_t nq_rows, int64_t w,
                                    const std::vector<float>& ref) {
  double rel = 0.0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t i = 0; i < nq_rows; ++i) {
    const float* q = queries + i * d;
    double amax = 0.0, lmax = -1e300, lmin = 1e300;
    for (int64_t j = 0; j < n; ++j) {
      if (key_pos && key_pos[j] > query_pos[i % w]) continue;
      double a = 0.0, l = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        a += std::fabs(static_cast<double>(q[c]) * keys[j * d + c]);
        l += static_cast<double>(q[c]) * keys[j * d + c];
      }
      amax = std::max(amax, a * scale);
      lmax = std::max(lmax, l * scale);
      lmin = std::min(lmin, l * scale);
    }
    if (lmax < lmin) continue;
    const double dmax = gamma(static_cast<double>(d + 2), kU) * amax;
    const double r =
        std::expm1(2 * dmax + kU * (lmax - lmin)) + gamma(static_cast<double>(n), kU) + 4 * kU;
    rel = std::max(rel, r);
  }
  std::vector<double> tol(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j)
    tol[j] = std::fabs(ref[j]) * (rel + kU + (d + n + 8) * kUd) + 0x1p-120;
  return tol;
}

// ---- scores
// --------------------------------------------------------------------------------------

TEST(SnapScores, KeyProxyMatchesReferenceOverShapes) {
  uint64_t seed = 1;
  double used = 0.0;  // largest fraction of the tolerance used
  for (int64_t d : {8, 13, 64, 128}) {
    for (int64_t n : {1, 2, 3, 17, 31, 127, 129, 1000}) {
      for (int64_t obs : {-3, 0, 1, 8, 32, 999}) {
        const auto keys = randn(static_cast<size_t>(n * d), seed++, 1.5f);
        std::vector<float> fast(n), ref(n);
        snap_key_proxy_scores(keys.data(), n, d, obs, fast.data());
        snap_key_proxy_scores_reference(keys.data(), n, d, obs, ref.data());
        const int64_t w = std::clamp<int64_t>(obs, 1, n);
        const auto tol =
            score_tolerance(keys, nullptr, n, d, keys.data() + (n - w) * d, nullptr, w, w, ref);
        double sum = 0.0;
        for (int64_t j = 0; j < n; ++j) {
          ASSERT_NEAR(fast[j], ref[j], tol[j])
              << "d=" << d << " n=" << n << " obs=" << obs << " j=" << j;
          used = std::max(used, std::fabs(fast[j] - ref[j]) / tol[j]);
          ASSERT_GE(fast[j], 0.0f);
          ASSERT_LE(fast[j], 1.0f);
          sum += ref[j];
        }
        // Each softmax row sums to 1, so the mean of w rows does too (double reference, n terms).
        EXPECT_NEAR(sum, 1.0, (2 * n + d + 8) * kUd + n * kU) << "d=" << d << " n=" << n;
      }
    }
  }
  std::printf("key-proxy scores: max error = %.1f%% of the derived tolerance\n", 100 * used);
}

TEST(SnapScores, SingleRowScoresOne) {
  const std::vector<float> k = {0.5f, -1.0f, 2.0f};
  float s = -1.0f;
  snap_key_proxy_scores(k.data(), 1, 3, 32, &s);
  EXPECT_EQ(s, 1.0f);
}

TEST(SnapScores, KeyProxyHasNoCausalMask) {
  // Window rows see later window rows: with obs = n every row votes for every row, so the first
  // row receives a positive score from the last row's softmax even though the last row is newer.
  const int64_t n = 6, d = 4;
  const auto keys = randn(n * d, 7);
  std::vector<float> s(n);
  snap_key_proxy_scores(keys.data(), n, d, n, s.data());
  // Score of the last row from the first query row is positive (no mask), so the last row's score
  // exceeds what it would get if only the last query could see it (1/n * p_last,last).
  std::vector<float> last_only(n);
  snap_key_proxy_scores(keys.data(), n, d, 1, last_only.data());
  EXPECT_GT(s[n - 1], last_only[n - 1] / n);
}

TEST(SnapScores, QueryScoresMatchReferenceWithAndWithoutMask) {
  uint64_t seed = 100;
  for (int64_t d : {16, 64}) {
    for (int64_t n : {3, 40, 257}) {
      for (int64_t n_rep : {1, 2, 4}) {
        for (bool causal : {false, true}) {
          const int64_t w = std::min<int64_t>(8, n);
          const auto keys = randn(static_cast<size_t>(n * d), seed++);
          const auto q = randn(static_cast<size_t>(n_rep * w * d), seed++);
          std::vector<int32_t> kpos(n), qpos(w);
          for (int64_t j = 0; j < n; ++j) kpos[j] = static_cast<int32_t>(3 * j);  // gaps
          for (int64_t i = 0; i < w; ++i) qpos[i] = kpos[n - w + i];
          const int32_t* kp = causal ? kpos.data() : nullptr;
          const int32_t* qp = causal ? qpos.data() : nullptr;
          std::vector<float> fast(n), ref(n);
          snap_query_scores(keys.data(), kp, n, d, q.data(), qp, n_rep, w, fast.data());
          snap_query_scores_reference(keys.data(), kp, n, d, q.data(), qp, n_rep, w, ref.data());
          const auto tol = score_tolerance(keys, kp, n, d, q.data(), qp, n_rep * w, w, ref);
          for (int64_t j = 0; j < n; ++j)
            ASSERT_NEAR(fast[j], ref[j], tol[j])
                << "d=" << d << " n=" << n << " n_rep=" << n_rep << " causal=" << causal;
        }
      }
    }
  }
}

TEST(SnapScores, CausalMaskHidesLaterKeysExactly) {
  // Window queries at positions 10..13 over keys at 0..15: keys 14, 15 are after every query and
  // must score exactly 0; key 13 is only seen by the last query.
  const int64_t n = 16, d = 8, w = 4, n_rep = 2;
  const auto keys = randn(n * d, 11);
  const auto q = randn(n_rep * w * d, 12);
  std::vector<int32_t> kpos(n), qpos = {10, 11, 12, 13};
  std::iota(kpos.begin(), kpos.end(), 0);
  std::vector<float> s(n);
  snap_query_scores(keys.data(), kpos.data(), n, d, q.data(), qpos.data(), n_rep, w, s.data());
  EXPECT_EQ(s[14], 0.0f);
  EXPECT_EQ(s[15], 0.0f);
  EXPECT_GT(s[13], 0.0f);
  for (int64_t j = 0; j < 14; ++j) EXPECT_GT(s[j], 0.0f) << j;
}

TEST(SnapScores, GqaAverageIsMeanOfPerHeadScores) {
  // Query scores of n_rep heads equal the mean of the single-head scores (reference level; the
  // fast path is checked against the reference above).
  const int64_t n = 50, d = 16, w = 5, n_rep = 4;
  const auto keys = randn(n * d, 21);
  const auto q = randn(n_rep * w * d, 22);
  std::vector<float> all(n);
  snap_query_scores_reference(keys.data(), nullptr, n, d, q.data(), nullptr, n_rep, w, all.data());
  std::vector<double> mean(n, 0.0);
  for (int64_t r = 0; r < n_rep; ++r) {
    std::vector<float> one(n);
    snap_query_scores_reference(keys.data(), nullptr, n, d, q.data() + r * w * d, nullptr, 1, w,
                                one.data());
    for (int64_t j = 0; j < n; ++j) mean[j] += one[j] / static_cast<double>(n_rep);
  }
  // Both sides are double computations rounded to fp32 once per score (one u each, relative),
  // and the mean adds n_rep more fp32-rounded terms: (2 + n_rep) u relative.
  for (int64_t j = 0; j < n; ++j) EXPECT_NEAR(all[j], mean[j], mean[j] * (2 + n_rep) * kU) << j;
}

TEST(SnapScores, DuplicatedQueryHeadsEqualOneHeadBitForBit) {
  // Two identical query heads: the head average (x + x) / 2 is exactly x.
  const int64_t n = 300, d = 32, w = 7;
  const auto keys = randn(n * d, 31);
  const auto q1 = randn(w * d, 32);
  std::vector<float> q2(q1);
  q2.insert(q2.end(), q1.begin(), q1.end());
  std::vector<int32_t> kpos(n), qpos(w);
  std::iota(kpos.begin(), kpos.end(), 0);
  std::iota(qpos.begin(), qpos.end(), static_cast<int32_t>(n - w));
  std::vector<float> one(n), two(n);
  snap_query_scores(keys.data(), kpos.data(), n, d, q1.data(), qpos.data(), 1, w, one.data());
  snap_query_scores(keys.data(), kpos.data(), n, d, q2.data(), qpos.data(), 2, w, two.data());
  for (int64_t j = 0; j < n; ++j) ASSERT_EQ(one[j], two[j]) << j;
}

TEST(SnapScores, KeyProxyIsQueryScoringWithTheLastKeys) {
  const int64_t n = 77, d = 24, obs = 9;
  const auto keys = randn(n * d, 41);
  std::vector<float> a(n), b(n);
  snap_key_proxy_scores(keys.data(), n, d, obs, a.data());
  snap_query_scores(keys.data(), nullptr, n, d, keys.data() + (n - obs) * d, nullptr, 1, obs,
                    b.data());
  for (int64_t j = 0; j < n; ++j) ASSERT_EQ(a[j], b[j]) << j;
}

TEST(SnapScores, BadArgumentsRefused) {
  const std::vector<float> k(16, 1.0f), q(16, 1.0f);
  std::vector<float> s(4);
  const int32_t pos[4] = {0, 1, 2, 3};
  EXPECT_THROW(snap_key_proxy_scores(k.data(), 4, 0, 2, s.data()), Error);
  EXPECT_THROW(snap_query_scores(k.data(), pos, 4, 4, q.data(), nullptr, 1, 2, s.data()), Error);
  EXPECT_THROW(snap_query_scores(k.data(), nullptr, 4, 4, q.data(), nullptr, 0, 2, s.data()),
               Error);
  EXPECT_THROW(snap_query_scores(k.data(), nullptr, 4, 4, q.data(), nullptr, 1, 0, s.data()),
               Error);
}

// ---- pooling ----------------------------------------------------------------------------------

TEST(SnapPool, MaxAndAvgWithEdges) {
  const std::vector<float> in = {1, 5, 2, 0, 3, 4};
  std::vector<float> out(6);
  snap_pool_scores(in.data(), 6, 3, PoolKind::kMax, out.data());
  EXPECT_EQ(out, (std::vector<float>{5, 5, 5, 3, 4, 4}));
  snap_pool_scores(in.data(), 6, 3, PoolKind::kAvg, out.data());
  // Edges average over the neighbours that exist: (1+5)/2, ..., (3+4)/2.
  const std::vector<double> want = {3.0, 8.0 / 3, 7.0 / 3, 5.0 / 3, 7.0 / 3, 3.5};
  for (int j = 0; j < 6; ++j) EXPECT_EQ(out[j], static_cast<float>(want[j])) << j;
  snap_pool_scores(in.data(), 6, 5, PoolKind::kMax, out.data());
  EXPECT_EQ(out, (std::vector<float>{5, 5, 5, 5, 4, 4}));
  snap_pool_scores(in.data(), 6, 1, PoolKind::kAvg, out.data());
  EXPECT_EQ(out, in);
  snap_pool_scores(in.data(), 6, 13, PoolKind::kMax, out.data());  // kernel wider than n
  EXPECT_EQ(out, (std::vector<float>(6, 5.0f)));
}

TEST(SnapPool, NanRules) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> in = {nan, nan, 1.0f, nan};
  std::vector<float> out(4);
  snap_pool_scores(in.data(), 4, 1, PoolKind::kMax, out.data());
  EXPECT_TRUE(std::isnan(out[0]));  // every neighbour NaN
  snap_pool_scores(in.data(), 4, 3, PoolKind::kMax, out.data());
  EXPECT_TRUE(std::isnan(out[0]));
  EXPECT_EQ(out[1], 1.0f);
  EXPECT_EQ(out[2], 1.0f);
  EXPECT_EQ(out[3], 1.0f);
  snap_pool_scores(in.data(), 4, 3, PoolKind::kAvg, out.data());
  for (float x : out) EXPECT_TRUE(std::isnan(x));
}

TEST(SnapPool, BadKernelRefused) {
  std::vector<float> in(4, 1.0f), out(4);
  EXPECT_THROW(snap_pool_scores(in.data(), 4, 2, PoolKind::kMax, out.data()), Error);
  EXPECT_THROW(snap_pool_scores(in.data(), 4, 0, PoolKind::kAvg, out.data()), Error);
}

// ---- selection ----------------------------------------------------------------------------------

// The rule of docs/design.md §C3, written independently of the library: a stable
// sort of the candidates on a key where NaN is -inf and -0 is +0.
std::vector<int64_t> plain_select(const std::vector<float>& s, int64_t budget, int64_t n_sink) {
  const int64_t n = static_cast<int64_t>(s.size());
  std::vector<int64_t> out;
  if (n == 0) return out;
  const int64_t count = std::min<int64_t>(std::max<int64_t>(budget, 1), n);
  const int64_t sinks = std::min<int64_t>(std::max<int64_t>(n_sink, 0), count);
  for (int64_t j = 0; j < sinks; ++j) out.push_back(j);
  if (count >= n || sinks == count) {
    for (int64_t j = sinks; j < count; ++j) out.push_back(j);
    return out;
  }
  auto key = [&](int64_t j) {
    const double v = s[j];
    return std::isnan(v) ? -std::numeric_limits<double>::infinity() : v + 0.0;
  };
  std::vector<int64_t> cand;
  for (int64_t j = sinks; j < n; ++j) cand.push_back(j);
  std::stable_sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) { return key(a) > key(b); });
  cand.resize(count - sinks);
  std::sort(cand.begin(), cand.end());
  out.insert(out.end(), cand.begin(), cand.end());
  return out;
}

std::vector<int64_t> fast_select(const std::vector<float>& s, int64_t budget, int64_t n_sink) {
  std::vector<int64_t> out(s.size() + 1, -7);
  const int64_t got =
      snap_select(s.data(), static_cast<int64_t>(s.size()), budget, n_sink, out.data());
  EXPECT_EQ(out[got], -7) << "wrote past count";
  out.resize(static_cast<size_t>(got));
  return out;
}

TEST(SnapSelect, NonFiniteOrder) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> s = {nan, inf, -inf, 0.0f, -0.0f, nan};
  const std::vector<int64_t> order = {1, 3, 4, 0, 2, 5};
  for (int64_t k = 1; k <= 6; ++k) {
    std::vector<int64_t> want(order.begin(), order.begin() + k);
    std::sort(want.begin(), want.end());
    EXPECT_EQ(fast_select(s, k, 0), want) << "k=" << k;
    EXPECT_EQ(snap_select_reference(s.data(), 6, k, 0), want) << "k=" << k;
    EXPECT_EQ(plain_select(s, k, 0), want) << "k=" << k;
  }
}

TEST(SnapSelect, RandomTieHeavyCasesMatchStableSort) {
  std::mt19937_64 rng(2024);
  for (int t = 0; t < 1000; ++t) {
    const int64_t n = std::uniform_int_distribution<int64_t>(0, 299)(rng);
    std::uniform_int_distribution<int64_t> bd(-1, n + 4);
    const int64_t budget = bd(rng), n_sink = bd(rng);
    std::vector<float> s(static_cast<size_t>(n));
    std::uniform_int_distribution<int> sd(-4, 4);
    for (auto& x : s) x = static_cast<float>(sd(rng));
    const auto want = plain_select(s, budget, n_sink);
    ASSERT_EQ(fast_select(s, budget, n_sink), want)
        << "case " << t << " n=" << n << " budget=" << budget << " sinks=" << n_sink;
    ASSERT_EQ(snap_select_reference(s.data(), n, budget, n_sink), want) << "case " << t;
    ASSERT_EQ(snap_select_count(n, budget), static_cast<int64_t>(want.size()));
  }
}

TEST(SnapSelect, NearTiesAndNonFiniteMixMatchStableSort) {
  // Adjacent floats (1 ulp apart), signed zeros, infinities and NaN in random mixes: the
  // threshold path must order them exactly like the stable sort.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> pool = {nan,
                                   -inf,
                                   inf,
                                   -0.0f,
                                   0.0f,
                                   1.0f,
                                   std::nextafter(1.0f, 2.0f),
                                   std::nextafter(1.0f, 0.0f),
                                   0x1p-149f,
                                   -0x1p-149f};
  std::mt19937_64 rng(99);
  for (int t = 0; t < 1000; ++t) {
    const int64_t n = std::uniform_int_distribution<int64_t>(0, 299)(rng);
    std::uniform_int_distribution<int64_t> bd(-1, n + 4);
    const int64_t budget = bd(rng), n_sink = bd(rng);
    std::vector<float> s(static_cast<size_t>(n));
    std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
    for (auto& x : s) x = pool[pick(rng)];
    ASSERT_EQ(fast_select(s, budget, n_sink), plain_select(s, budget, n_sink)) << "case " << t;
  }
}

TEST(SnapSelect, AwkwardLengthsWithStridedZeros) {
  for (int64_t n : {0, 1, 2, 255, 256, 257, 511, 512, 513, 8193}) {
    for (int64_t stride : {1, 3, 7}) {
      std::vector<float> s(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j)
        s[j] = j % stride == 0 ? 0.0f : static_cast<float>((j * 37) % 11) * 0.25f;
      for (int64_t budget : {int64_t{1}, n / 3, n / 2, n - 1, n}) {
        for (int64_t sinks : {0, 4}) {
          const auto want = plain_select(s, budget, sinks);
          ASSERT_EQ(fast_select(s, budget, sinks), want)
              << "n=" << n << " stride=" << stride << " budget=" << budget;
          ASSERT_EQ(snap_select_reference(s.data(), n, budget, sinks), want);
        }
      }
    }
  }
}

TEST(SnapSelect, SeedExamples) {
  // High scores preferred (with one sink).
  const std::vector<float> s = {.01f, .02f, .03f, .90f, .85f, .04f, .05f};
  EXPECT_EQ(fast_select(s, 3, 1), (std::vector<int64_t>{0, 3, 4}));
  // All-zero scores keep the sinks and then the lowest indices.
  const std::vector<float> z(10, 0.0f);
  EXPECT_EQ(fast_select(z, 5, 3), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  // Budget larger than n keeps everything; budget <= n_sink keeps the first budget rows.
  EXPECT_EQ(fast_select({3, 1, 2}, 10, 0), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(fast_select({0, 0, 9, 9, 9}, 2, 4), (std::vector<int64_t>{0, 1}));
  // Budget <= 0 keeps one row: position 0 with a sink, else the best row.
  EXPECT_EQ(fast_select({0, 0, 9, 1}, 0, 1), (std::vector<int64_t>{0}));
  EXPECT_EQ(fast_select({0, 0, 9, 1}, -5, 0), (std::vector<int64_t>{2}));
  EXPECT_TRUE(fast_select({}, 4, 2).empty());
}

TEST(SnapSelect, NoScoringWhenSelectionIsFixed) {
  // count >= n or sinks == count never reads the scores (nullptr is fine).
  std::vector<int64_t> out(8);
  EXPECT_EQ(snap_select(nullptr, 5, 9, 0, out.data()), 5);
  EXPECT_EQ(snap_select(nullptr, 5, 2, 3, out.data()), 2);
  EXPECT_EQ(out[0], 0);
  EXPECT_EQ(out[1], 1);
}

// ---- keep-window selection
// ------------------------------------------------------------------------

// The documented keep-window rule written out plainly.
std::vector<int64_t> plain_keep_window(const std::vector<float>& s, int64_t budget, int64_t n_sink,
                                       int64_t window) {
  const int64_t n = static_cast<int64_t>(s.size());
  std::vector<int64_t> out;
  if (n == 0) return out;
  const int64_t count = std::min<int64_t>(std::max<int64_t>(budget, 1), n);
  if (count >= n) {
    for (int64_t j = 0; j < n; ++j) out.push_back(j);
    return out;
  }
  const int64_t sinks = std::min<int64_t>(std::max<int64_t>(n_sink, 0), count);
  const int64_t w = std::clamp<int64_t>(window, 0, n);
  std::vector<char> keep(static_cast<size_t>(n), 0);
  for (int64_t j = 0; j < sinks; ++j) keep[j] = 1;
  int64_t left = count - sinks;
  for (int64_t j = n - 1; j >= n - w && left > 0; --j)  // newest window rows first
    if (!keep[j]) {
      keep[j] = 1;
      --left;
    }
  // Prefix rows compete for the rest with the seed's ordering.
  std::vector<int64_t> cand;
  for (int64_t j = sinks; j < n - w; ++j) cand.push_back(j);
  auto key = [&](int64_t j) {
    return std::isnan(s[j]) ? -std::numeric_limits<double>::infinity() : s[j] + 0.0;
  };
  std::stable_sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) { return key(a) > key(b); });
  for (int64_t i = 0; i < left; ++i) keep[cand[i]] = 1;
  for (int64_t j = 0; j < n; ++j)
    if (keep[j]) out.push_back(j);
  return out;
}

TEST(SnapKeepWindow, RandomCasesMatchPlainRule) {
  std::mt19937_64 rng(77);
  for (int t = 0; t < 1000; ++t) {
    const int64_t n = std::uniform_int_distribution<int64_t>(0, 120)(rng);
    std::uniform_int_distribution<int64_t> bd(-1, n + 4);
    const int64_t budget = bd(rng), n_sink = bd(rng), window = bd(rng);
    std::vector<float> s(static_cast<size_t>(n));
    std::uniform_int_distribution<int> sd(-3, 3);
    for (auto& x : s) x = static_cast<float>(sd(rng));
    const auto want = plain_keep_window(s, budget, n_sink, window);
    std::vector<int64_t> got(static_cast<size_t>(n) + 1);
    got.resize(static_cast<size_t>(
        snap_select_keep_window(s.data(), n, budget, n_sink, window, got.data())));
    ASSERT_EQ(got, want) << "case " << t << " n=" << n << " budget=" << budget
                         << " sinks=" << n_sink << " window=" << window;
    ASSERT_EQ(snap_select_keep_window_reference(s.data(), n, budget, n_sink, window), want);
  }
}

TEST(SnapKeepWindow, SmallBudgetKeepsSinksThenNewestWindowRows) {
  const std::vector<float> s = {9, 9, 9, 9, 9, 0, 0, 0, 0, 0};
  std::vector<int64_t> out(10);
  // budget 4 < 2 sinks + window 4: sinks 0, 1 and the two newest rows.
  out.resize(static_cast<size_t>(snap_select_keep_window(s.data(), 10, 4, 2, 4, out.data())));
  EXPECT_EQ(out, (std::vector<int64_t>{0, 1, 8, 9}));
  // budget 7: sinks, whole window (6..9), and the best prefix row (2: ties to the lower index).
  out.resize(10);
  out.resize(static_cast<size_t>(snap_select_keep_window(s.data(), 10, 7, 2, 4, out.data())));
  EXPECT_EQ(out, (std::vector<int64_t>{0, 1, 2, 6, 7, 8, 9}));
}

// ---- per-head pipeline
// ----------------------------------------------------------------------------

TEST(SnapSelectHead, ComposesScoresPoolAndSelect) {
  const int64_t n = 200, d = 32;
  const auto keys = randn(n * d, 51);
  for (bool keep_window : {false, true}) {
    for (int64_t kernel : {1, 5, 7}) {
      for (PoolKind kind : {PoolKind::kMax, PoolKind::kAvg}) {
        SnapSelectParams p;
        p.budget = 40;
        p.obs_window = 16;
        p.n_sink = 3;
        p.pool_kernel = kernel;
        p.pool = kind;
        p.keep_window = keep_window;
        std::vector<float> s(n);
        snap_key_proxy_scores(keys.data(), n, d, p.obs_window, s.data());
        const int64_t lo = p.n_sink, hi = keep_window ? n - p.obs_window : n;
        std::vector<float> pooled(n, 0.0f);
        snap_pool_scores(s.data() + lo, hi - lo, kernel, kind, pooled.data() + lo);
        const auto want = keep_window ? snap_select_keep_window_reference(
                                            pooled.data(), n, p.budget, p.n_sink, p.obs_window)
                                      : snap_select_reference(pooled.data(), n, p.budget, p.n_sink);
        std::vector<int64_t> got(static_cast<size_t>(snap_keep_count(n, p)));
        SnapScratch scratch;
        ASSERT_EQ(snap_select_head(keys.data(), nullptr, n, d, nullptr, p, got.data(), scratch),
                  p.budget);
        ASSERT_EQ(got, want) << "keep_window=" << keep_window << " kernel=" << kernel;
      }
    }
  }
}

TEST(SnapSelectHead, QueryWindowUsesCausalScores) {
  const int64_t n = 90, d = 16, w = 6, n_rep = 2;
  const auto keys = randn(n * d, 61);
  const auto q = randn(n_rep * w * d, 62);
  std::vector<int32_t> kpos(n), qpos(w);
  for (int64_t j = 0; j < n; ++j) kpos[j] = static_cast<int32_t>(j * 2);
  for (int64_t i = 0; i < w; ++i) qpos[i] = kpos[n - w + i];
  std::vector<float> s(n);
  snap_query_scores(keys.data(), kpos.data(), n, d, q.data(), qpos.data(), n_rep, w, s.data());
  SnapSelectParams p;
  p.budget = 20;
  p.n_sink = 2;
  SnapQueryWindow qw{q.data(), n_rep, w, qpos.data()};
  std::vector<int64_t> got(20);
  SnapScratch scratch;
  snap_select_head(keys.data(), kpos.data(), n, d, &qw, p, got.data(), scratch);
  EXPECT_EQ(got, snap_select_reference(s.data(), n, 20, 2));
}

TEST(SnapSelectHead, SkipsScoringWhenFixed) {
  SnapSelectParams p;
  p.budget = 3;
  p.n_sink = 5;
  std::vector<int64_t> got(3);
  SnapScratch scratch;
  // keys nullptr: scoring must not happen when sinks == count.
  EXPECT_EQ(snap_select_head(nullptr, nullptr, 10, 8, nullptr, p, got.data(), scratch), 3);
  EXPECT_EQ(got, (std::vector<int64_t>{0, 1, 2}));
  p.budget = 50;
  got.resize(10);
  EXPECT_EQ(snap_select_head(nullptr, nullptr, 10, 8, nullptr, p, got.data(), scratch), 10);
}

}  // namespace
}  // namespace vq
