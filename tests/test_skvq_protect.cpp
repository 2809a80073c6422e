// Tests of the skvq cache's protected rows (skvq_protect, veloxquant/skvq_cache.h): the protected
// rows are exactly the top-scored packed rows under SnapKV's tie rule, the byte figures are the
// plain cache's plus the copies, attention over the view equals attention over the plain cache's
// rows with the protected ones replaced by their originals, save/load round trips and refusals,
// and the metamorphic relation: skvq_protect = 0 is the plain cache bit for bit (and the prompt's
// own attention is the plain cache's whatever the fraction). Blocks are [B, H, S, D].
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <vector>

#include "util/test_util.h"
#include "veloxquant/attention.h"
#include "veloxquant/error.h"
#include "veloxquant/memory_plan.h"
#include "veloxquant/packed.h"
#include "veloxquant/skvq_cache.h"
#include "veloxquant/snapkv.h"

namespace vq {
namespace {

constexpr int64_t kB = 1, kH = 2, kD = 32, kS = 45;

// Channel-axis keys in runs of 4 rows, window 8, 2 sinks: 45 rows leave 40 flushed (38 packed
// candidates) and a 5-row tail.
CacheConfig cfg(double protect, SnapScoring scoring = SnapScoring::kExternal) {
  CacheConfig c;
  c.method = "skvq";
  c.head_dim = kD;
  c.skvq_window = 8;
  c.skvq_n_sink = 2;
  c.skvq_group_size = 16;
  c.skvq_key_axis = QuantAxis::kChannel;
  c.skvq_key_rows = 4;
  c.skvq_protect = protect;
  c.skvq_protect_scoring = scoring;
  return c;
}

std::string state_of(const KVCache& c) {
  std::ostringstream os;
  c.save(os);
  return os.str();
}

// Positions of every row of head h of a view, segment by segment.
std::vector<int32_t> view_positions(const CacheView& v, int64_t h) {
  std::vector<int32_t> out;
  for (const ViewSegment& seg : v.segments)
    for (int64_t i = 0; i < seg.n_rows; ++i) out.push_back(seg.position(0, h, i, kH));
  return out;
}

// Scores with many ties: (p * 7 + 3 h) mod 5 per row p of head h.
std::vector<float> tied_scores() {
  std::vector<float> s(static_cast<size_t>(kB * kH * kS));
  for (int64_t h = 0; h < kH; ++h)
    for (int64_t p = 0; p < kS; ++p) s[h * kS + p] = static_cast<float>((p * 7 + 3 * h) % 5);
  return s;
}

// The prompt in two calls, its scores, end_prompt.
void prompt(SkvqCache& c, const Tensor& k, const Tensor& v, const std::vector<float>* scores) {
  c.update_and_fetch(k.view().slice_tokens(0, 20), v.view().slice_tokens(0, 20));
  c.update_and_fetch(k.view().slice_tokens(20, kS), v.view().slice_tokens(20, kS));
  if (scores) c.set_external_scores(scores->data(), kB, kH, kS);
  c.end_prompt();
}

// The oracle: rows 2..39 (packed) sorted by descending pooled score, ties to the lower position;
// the first k, ascending.
std::vector<int32_t> top_rows(const std::vector<float>& s, int64_t h, int64_t k, int64_t kernel) {
  std::vector<float> pooled(static_cast<size_t>(kS));
  for (int64_t p = 0; p < kS; ++p) {
    float m = -INFINITY;
    for (int64_t j = std::max<int64_t>(0, p - kernel / 2); j <= std::min(kS - 1, p + kernel / 2);
         ++j)
      m = std::max(m, s[h * kS + j]);
    pooled[p] = m;
  }
  std::vector<int32_t> cand(38);
  std::iota(cand.begin(), cand.end(), 2);
  std::stable_sort(cand.begin(), cand.end(),
                   [&](int32_t a, int32_t b) { return pooled[a] > pooled[b]; });
  cand.resize(static_cast<size_t>(k));
  std::sort(cand.begin(), cand.end());
  return cand;
}

TEST(SkvqProtect, ProtectedRowsAreTheTopScoredPackedRows) {
  const Tensor k = test::random_tensor(DType::kF16, kB, kH, kS, kD, 1);
  const Tensor v = test::random_tensor(DType::kF16, kB, kH, kS, kD, 2);
  const std::vector<float> s = tied_scores();
  for (const int64_t kernel : {1, 3}) {
    CacheConfig c = cfg(0.2);  // round(0.2 * 45) = 9 rows
    c.skvq_protect_pool_kernel = kernel;
    SkvqCache cache(c);
    prompt(cache, k, v, &s);
    ASSERT_EQ(cache.protected_rows(), 9);
    for (int64_t h = 0; h < kH; ++h)
      EXPECT_EQ(cache.protected_positions(0, h), top_rows(s, h, 9, kernel)) << kernel << " " << h;
  }
  // The count: at least one row, at most the packed candidates.
  SkvqCache tiny(cfg(0.001));
  prompt(tiny, k, v, &s);
  EXPECT_EQ(tiny.protected_rows(), 1);
  SkvqCache most(cfg(0.99));
  prompt(most, k, v, &s);
  EXPECT_EQ(most.protected_rows(), 38);
}

TEST(SkvqProtect, QueryScoringMatchesSnapKVScores) {
  const int64_t hq = 4;  // two query heads per KV head
  const Tensor k = test::random_tensor(DType::kF16, kB, kH, kS, kD, 3);
  const Tensor v = test::random_tensor(DType::kF16, kB, kH, kS, kD, 4);
  const Tensor q = test::random_tensor(DType::kF32, kB, hq, kS, kD, 5);
  CacheConfig c = cfg(0.2, SnapScoring::kQuery);
  c.skvq_protect_obs_window = 6;
  SkvqCache cache(c);
  const TensorView q1 = q.view().slice_tokens(0, 20), q2 = q.view().slice_tokens(20, kS);
  UpdateOptions o1, o2;
  o1.queries = &q1;
  o2.queries = &q2;
  cache.update_and_fetch(k.view().slice_tokens(0, 20), v.view().slice_tokens(0, 20), o1);
  cache.update_and_fetch(k.view().slice_tokens(20, kS), v.view().slice_tokens(20, kS), o2);
  EXPECT_TRUE(cache.protection_pending());
  cache.end_prompt();
  EXPECT_FALSE(cache.protection_pending());
  // The oracle: snap_query_scores over the prompt's keys with the last 6 queries (causal).
  std::vector<float> scores(static_cast<size_t>(kH * kS));
  for (int64_t h = 0; h < kH; ++h) {
    std::vector<float> kf(static_cast<size_t>(kS * kD)), qf(static_cast<size_t>(2 * 6 * kD));
    std::vector<int32_t> kp(static_cast<size_t>(kS)), qp(6);
    for (int64_t p = 0; p < kS; ++p) {
      kp[p] = static_cast<int32_t>(p);
      for (int64_t d = 0; d < kD; ++d) kf[p * kD + d] = k.at(0, h, p, d);
    }
    for (int64_t g = 0; g < 2; ++g)
      for (int64_t i = 0; i < 6; ++i)
        for (int64_t d = 0; d < kD; ++d)
          qf[(g * 6 + i) * kD + d] = q.at(0, h * 2 + g, kS - 6 + i, d);
    for (int64_t i = 0; i < 6; ++i) qp[i] = static_cast<int32_t>(kS - 6 + i);
    snap_query_scores(kf.data(), kp.data(), kS, kD, qf.data(), qp.data(), 2, 6,
                      scores.data() + h * kS);
  }
  for (int64_t h = 0; h < kH; ++h)
    EXPECT_EQ(cache.protected_positions(0, h), top_rows(scores, h, 9, 1)) << h;
}

// Attention over the protected view == attention over the plain cache's rows (dequantized) with
// the protected rows' keys and values replaced by the originals.
TEST(SkvqProtect, AttentionReadsTheOriginalsInsteadOfTheCodes) {
  const Tensor k = test::random_tensor(DType::kF16, kB, kH, kS + 3, kD, 6);
  const Tensor v = test::random_tensor(DType::kF16, kB, kH, kS + 3, kD, 7);
  const std::vector<float> s = tied_scores();
  SkvqCache prot(cfg(0.2)), plain(cfg(0));
  prompt(prot, k, v, &s);
  prompt(plain, k, v, nullptr);
  for (int64_t t = kS; t < kS + 3; ++t) {  // decode steps after the prompt
    prot.update_and_fetch(k.view().slice_tokens(t, t + 1), v.view().slice_tokens(t, t + 1));
    plain.update_and_fetch(k.view().slice_tokens(t, t + 1), v.view().slice_tokens(t, t + 1));
  }
  DenseView want = dequantize_view(plain.stored_view(), DType::kF32);
  for (size_t i = 0; i < want.view.segments.size(); ++i) {
    ViewSegment& seg = want.view.segments[i];
    if (seg.keys.dtype != DType::kF32) continue;  // full-precision rows are never protected
    for (int64_t h = 0; h < kH; ++h) {
      const std::vector<int32_t> pp = prot.protected_positions(0, h);
      for (int64_t r = 0; r < seg.n_rows; ++r) {
        const int32_t p = seg.position(0, h, r, kH);
        if (!std::binary_search(pp.begin(), pp.end(), p)) continue;
        for (int64_t d = 0; d < kD; ++d) {
          static_cast<float*>(seg.keys.data)[(h * seg.keys.shape[2] + r) * kD + d] =
              k.at(0, h, p, d);
          static_cast<float*>(seg.values.data)[(h * seg.values.shape[2] + r) * kD + d] =
              v.at(0, h, p, d);
        }
      }
    }
  }
  const int64_t hq = 4;
  const Tensor q = test::random_tensor(DType::kF32, kB, hq, 1, kD, 8, 2.0f);
  AttentionParams ap;
  ap.q_pos0 = prot.offset();
  std::vector<float> got_ref(static_cast<size_t>(hq * kD)), want_ref(got_ref.size()),
      got_fused(got_ref.size());
  const DenseView got = dequantize_view(prot.stored_view(), DType::kF32);
  attention_reference(q.view(), got.view, ap, got_ref.data());
  attention_reference(q.view(), want.view, ap, want_ref.data());
  attention(q.view(), prot.stored_view(), ap, got_fused.data());
  // Both references sum the same terms in double, in another row order, and round once to fp32:
  // they differ by at most one fp32 rounding of outputs below 4 in magnitude (2^-22).
  // The fused path accumulates ~50 rows in fp32 (relative error per product and addition 2^-24)
  // over weights summing to 1 and values below ~5: well within 1e-4.
  for (size_t i = 0; i < got_ref.size(); ++i) {
    EXPECT_NEAR(got_ref[i], want_ref[i], 2.5e-7) << i;
    EXPECT_NEAR(got_fused[i], want_ref[i], 1e-4) << i;
  }
  // And the codes alone give something else (the protected rows matter).
  std::vector<float> plain_ref(got_ref.size());
  const DenseView pl = dequantize_view(plain.stored_view(), DType::kF32);
  attention_reference(q.view(), pl.view, ap, plain_ref.data());
  double diff = 0;
  for (size_t i = 0; i < got_ref.size(); ++i) diff += std::fabs(plain_ref[i] - want_ref[i]);
  EXPECT_GT(diff, 1e-3);
}

TEST(SkvqProtect, BytesAreThePlainCachesPlusTheCopies) {
  const Tensor k = test::random_tensor(DType::kF16, kB, kH, kS, kD, 9);
  const Tensor v = test::random_tensor(DType::kF16, kB, kH, kS, kD, 10);
  const std::vector<float> s = tied_scores();
  SkvqCache plain(cfg(0));
  prompt(plain, k, v, nullptr);
  for (const bool values : {true, false}) {
    CacheConfig c = cfg(0.2);
    c.skvq_protect_values = values;
    SkvqCache prot(c);
    prompt(prot, k, v, &s);
    // 9 rows per (b, h): an fp16 key (64 bytes), an fp16 value (64) when protected, a position.
    const int64_t extra = 9 * (kD * 2 * (values ? 2 : 1) + 4) * kB * kH;
    EXPECT_EQ(prot.stats().bytes_accounted, plain.stats().bytes_accounted + extra) << values;
    EXPECT_EQ(prot.stats().figure("protected_bytes"), static_cast<double>(extra));
    EXPECT_EQ(prot.stats().figure("protected_rows"), 9.0);
  }
}

TEST(SkvqProtect, ValuesOfTheCodesWhenOnlyKeysAreProtected) {
  const Tensor k = test::random_tensor(DType::kF16, kB, kH, kS, kD, 11);
  const Tensor v = test::random_tensor(DType::kF16, kB, kH, kS, kD, 12);
  const std::vector<float> s = tied_scores();
  CacheConfig c = cfg(0.2);
  c.skvq_protect_values = false;
  SkvqCache prot(c), plain(cfg(0));
  prompt(prot, k, v, &s);
  prompt(plain, k, v, nullptr);
  const CacheView pv = prot.stored_view();
  const ViewSegment& ps = pv.segments.front();  // the protected rows
  const DenseView pl = dequantize_view(plain.stored_view(), DType::kF32);
  for (int64_t h = 0; h < kH; ++h)
    for (int64_t i = 0; i < ps.n_rows; ++i) {
      const int32_t p = ps.position(0, h, i, kH);
      for (const ViewSegment& seg : pl.view.segments)
        for (int64_t r = 0; r < seg.n_rows; ++r)
          if (seg.position(0, h, r, kH) == p)
            for (int64_t d = 0; d < kD; ++d) {
              EXPECT_EQ(ps.keys.at(0, h, i, d), k.at(0, h, p, d));
              // The dequantized value rounded to the fp16 storage: within half an fp16 ulp
              // (2^-11 relative) of the code's value.
              const float want = seg.values.at(0, h, r, d);
              EXPECT_NEAR(ps.values.at(0, h, i, d), want, std::fabs(want) * 4.9e-4 + 1e-7);
            }
    }
}

TEST(SkvqProtect, SaveLoadRoundTripsAndRefusals) {
  const Tensor k = test::random_tensor(DType::kF16, kB, kH, kS + 2, kD, 13);
  const Tensor v = test::random_tensor(DType::kF16, kB, kH, kS + 2, kD, 14);
  const std::vector<float> s = tied_scores();
  SkvqCache a(cfg(0.2));
  a.update_and_fetch(k.view().slice_tokens(0, kS), v.view().slice_tokens(0, kS));
  // A pending selection is not saved.
  EXPECT_NE(test::error_of([&] { state_of(a); }).find("end_prompt() first"), std::string::npos);
  a.set_external_scores(s.data(), kB, kH, kS);
  a.update_and_fetch(k.view().slice_tokens(kS, kS + 1), v.view().slice_tokens(kS, kS + 1));
  ASSERT_EQ(a.protected_rows(), 9);
  const std::string st = state_of(a);
  SkvqCache b(cfg(0.2));
  std::istringstream in(st);
  b.load(in);
  EXPECT_EQ(state_of(b), st);
  for (int64_t h = 0; h < kH; ++h)
    EXPECT_EQ(b.protected_positions(0, h), a.protected_positions(0, h));
  for (int64_t h = 0; h < kH; ++h)
    EXPECT_EQ(view_positions(b.stored_view(), h), view_positions(a.stored_view(), h));
  // Both go on identically.
  a.update_and_fetch(k.view().slice_tokens(kS + 1, kS + 2), v.view().slice_tokens(kS + 1, kS + 2));
  b.update_and_fetch(k.view().slice_tokens(kS + 1, kS + 2), v.view().slice_tokens(kS + 1, kS + 2));
  EXPECT_EQ(state_of(b), state_of(a));
  // Another fraction, or none, is refused naming the field; a flipped byte by the checksum.
  for (const double other : {0.0, 0.3}) {
    SkvqCache c(cfg(other));
    std::istringstream in2(st);
    EXPECT_NE(test::error_of([&] { c.load(in2); }).find("skvq_protect"), std::string::npos)
        << other;
  }
  std::string bad = st;
  bad[bad.size() - 20] ^= 1;
  SkvqCache d(cfg(0.2));
  std::istringstream in3(bad);
  EXPECT_THROW(d.load(in3), Error);
  EXPECT_EQ(d.protected_rows(), 0);
}

TEST(SkvqProtect, ZeroIsThePlainCacheBitForBit) {
  const Tensor k = test::random_tensor(DType::kF16, kB, kH, kS + 2, kD, 15);
  const Tensor v = test::random_tensor(DType::kF16, kB, kH, kS + 2, kD, 16);
  CacheConfig zero = cfg(0);  // every other protect field off its default
  zero.skvq_protect_scoring = SnapScoring::kKeyProxy;
  zero.skvq_protect_obs_window = 3;
  zero.skvq_protect_pool_kernel = 5;
  zero.skvq_protect_values = false;
  CacheConfig base = cfg(0);
  base.skvq_protect_scoring = SnapScoring::kQuery;
  SkvqCache a(zero), b(base);
  EXPECT_FALSE(a.takes_external_scores());
  for (const auto& [s0, s1] : std::vector<std::pair<int64_t, int64_t>>{{0, 20}, {20, kS}}) {
    const CacheView va =
        a.update_and_fetch(k.view().slice_tokens(s0, s1), v.view().slice_tokens(s0, s1));
    const CacheView vb =
        b.update_and_fetch(k.view().slice_tokens(s0, s1), v.view().slice_tokens(s0, s1));
    EXPECT_EQ(va.segments.size(), vb.segments.size());
  }
  a.end_prompt();
  b.end_prompt();
  a.update_and_fetch(k.view().slice_tokens(kS, kS + 2), v.view().slice_tokens(kS, kS + 2));
  b.update_and_fetch(k.view().slice_tokens(kS, kS + 2), v.view().slice_tokens(kS, kS + 2));
  EXPECT_EQ(state_of(a), state_of(b));
  EXPECT_EQ(a.stats().bytes_accounted, b.stats().bytes_accounted);

  // With a fraction, the prompt's own attention is the plain cache's, bit for bit (protection
  // starts at end_prompt).
  const std::vector<float> s = tied_scores();
  SkvqCache p(cfg(0.3)), q(cfg(0));
  const int64_t hq = 2;
  const Tensor qq = test::random_tensor(DType::kF32, kB, hq, 25, kD, 17);
  AttentionParams ap;
  ap.q_pos0 = 20;
  p.update_and_fetch(k.view().slice_tokens(0, 20), v.view().slice_tokens(0, 20));
  q.update_and_fetch(k.view().slice_tokens(0, 20), v.view().slice_tokens(0, 20));
  const CacheView vp =
      p.update_and_fetch(k.view().slice_tokens(20, kS), v.view().slice_tokens(20, kS));
  const CacheView vq =
      q.update_and_fetch(k.view().slice_tokens(20, kS), v.view().slice_tokens(20, kS));
  std::vector<float> op(static_cast<size_t>(hq * 25 * kD)), oq(op.size());
  attention(qq.view(), vp, ap, op.data());
  attention(qq.view(), vq, ap, oq.data());
  EXPECT_EQ(op, oq);
}

TEST(SkvqProtect, ClearRefusals) {
  const Tensor k = test::random_tensor(DType::kF16, kB, kH, kS, kD, 18);
  // External scoring without scores: end_prompt names what is missing.
  SkvqCache a(cfg(0.2));
  a.update_and_fetch(k.view().slice_tokens(0, kS), k.view().slice_tokens(0, kS));
  EXPECT_NE(test::error_of([&] { a.end_prompt(); }).find("set_external_scores"), std::string::npos);
  // Scores of the wrong shape.
  const std::vector<float> s(static_cast<size_t>(kH * (kS - 1)), 1.0f);
  EXPECT_NE(test::error_of([&] {
              a.set_external_scores(s.data(), kB, kH, kS - 1);
            }).find("expected scores [1, 2, 45]"),
            std::string::npos);
  // Other methods refuse the option by name.
  CacheConfig c = cfg(0.1);
  c.method = "snapkv+skvq";
  c.snap_evict_at = SnapEvictAt::kPromptEnd;
  EXPECT_NE(test::error_of([&] { validate(c); }).find("skvq_protect"), std::string::npos);
}

TEST(SkvqProtect, MemoryPlanCountsTheCopies) {
  ModelConfig m;
  m.n_layers = 1;
  m.n_heads = 4;
  m.n_kv_heads = kH;
  m.head_dim = kD;
  m.hidden_size = 128;
  m.intermediate_size = 256;
  m.vocab_size = 100;
  MemoryPlanRequest r;
  r.prompt_tokens = kS;
  r.max_new_tokens = 1;
  r.prefill_step = 20;
  CacheConfig plain = cfg(0);
  plain.skvq_key_axis = QuantAxis::kToken;  // the planner's formulas are token-axis ones
  plain.skvq_key_rows = 0;
  CacheConfig prot = plain;
  prot.skvq_protect = 0.2;
  r.model = m;
  r.cache = plain;
  const MemoryPlan a = plan_memory(r);
  r.cache = prot;
  const MemoryPlan b = plan_memory(r);
  EXPECT_EQ(a.cache_bytes_exact, b.cache_bytes_exact);
  EXPECT_EQ(b.cache_bytes_peak - a.cache_bytes_peak, 9 * kH * (kD * 2 * 2 + 4));
}

}  // namespace
}  // namespace vq
