// Tests of the SnapKV cache (veloxquant/snapkv_cache.h): the deferred-eviction call sequence
// checked against a row-by-row model of the contract, the seed's behaviours of
// the original SnapKV tests (docs/design.md §C7) (chunked prefill, masks, sinks, long decode,
// bytes, edge cases), metamorphic checks (no-eviction == full cache, GQA == MHA with repeated KV
// heads, attention over the view == attention over the full cache restricted to the kept rows), the
// options (query scoring, pooling, keep-window, dtypes) and save/load. Blocks are [B, H, S, D];
// queries [B, H_q, S, D].
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <sstream>
#include <vector>

#include "util/test_util.h"
#include "veloxquant/attention.h"
#include "veloxquant/builder.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/snapkv.h"
#include "veloxquant/snapkv_cache.h"

namespace vq {
namespace {

CacheConfig snap_cfg(int64_t budget, int64_t obs, int64_t sinks) {
  CacheConfig c;
  c.method = "snapkv";
  c.snap_budget = budget;
  c.snap_obs_window = obs;
  c.snap_n_sink = sinks;
  return c;
}

std::unique_ptr<SnapKVCache> make(const CacheConfig& c) {
  return std::make_unique<SnapKVCache>(c);
}

Tensor rnd(int64_t b, int64_t h, int64_t s, int64_t d, uint64_t seed, DType t = DType::kF16) {
  return test::random_tensor(t, b, h, s, d, seed);
}

using test::bits_at;
using test::HeadRows;
using test::view_head;

// ---- a row-by-row model of the deferred-eviction contract ---------------------------------------
//
// Holds, per (b, h), the stored rows (position, storage bits). step() appends a block, returns
// what the view must hold (stored ++ new) and, when S > 1, evicts with an independent route
// (key-proxy scores + the stable-sort oracle) or, for the options, the per-head pipeline.
struct Model {
  int64_t B = 0, H = 0, D = 0;
  DType dt = DType::kF16;
  CacheConfig cfg;
  bool use_pipeline = false;  // options on: select through snap_select_head
  int64_t offset = 0;
  std::vector<HeadRows> heads;

  Model(const CacheConfig& c, int64_t b, int64_t h, int64_t d, DType t)
      : B(b), H(h), D(d), dt(t), cfg(c), heads(static_cast<size_t>(b * h)) {
    use_pipeline =
        c.snap_pool_kernel > 1 || c.snap_keep_window || c.snap_scoring == SnapScoring::kQuery;
  }

  std::vector<HeadRows> step(const TensorView& k, const TensorView& v, const TensorView* q) {
    const int64_t s = k.shape[2];
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        HeadRows& r = heads[b * H + h];
        for (int64_t i = 0; i < s; ++i) {
          r.pos.push_back(static_cast<int32_t>(offset + i));
          for (int64_t c = 0; c < D; ++c) {
            uint16_t kb, vb;
            const float kx = k.at(b, h, i, c), vx = v.at(b, h, i, c);
            from_f32(&kx, &kb, dt, 1);
            from_f32(&vx, &vb, dt, 1);
            r.k.push_back(kb);
            r.v.push_back(vb);
          }
        }
      }
    offset += s;
    std::vector<HeadRows> expect = heads;
    if (s > 1) evict(s, q);
    return expect;
  }

  void evict(int64_t s, const TensorView* q) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        HeadRows& r = heads[b * H + h];
        const int64_t n = static_cast<int64_t>(r.pos.size());
        std::vector<float> frame(static_cast<size_t>(n * D));
        to_f32(r.k.data(), dt, frame.data(), frame.size());
        std::vector<int64_t> idx;
        if (!use_pipeline) {
          std::vector<float> scores(static_cast<size_t>(n));
          snap_key_proxy_scores(frame.data(), n, D, cfg.snap_obs_window, scores.data());
          idx = snap_select_reference(scores.data(), n, cfg.snap_budget, cfg.snap_n_sink);
        } else {
          SnapSelectParams p = SnapSelectParams::from_config(cfg);
          idx.resize(static_cast<size_t>(snap_keep_count(n, p)));
          SnapScratch scratch;
          std::vector<float> qw;
          std::vector<int32_t> qpos;
          SnapQueryWindow win;
          const bool use_q = q != nullptr && cfg.snap_scoring == SnapScoring::kQuery;
          if (use_q) {
            const int64_t n_rep = q->shape[1] / H;
            const int64_t w = std::min(std::clamp<int64_t>(cfg.snap_obs_window, 1, n), s);
            for (int64_t rr = 0; rr < n_rep; ++rr)
              for (int64_t i = 0; i < w; ++i)
                for (int64_t c = 0; c < D; ++c)
                  qw.push_back(q->at(b, h * n_rep + rr, s - w + i, c));
            for (int64_t i = 0; i < w; ++i) qpos.push_back(static_cast<int32_t>(offset - w + i));
            win = SnapQueryWindow{qw.data(), n_rep, w, qpos.data()};
          }
          snap_select_head(frame.data(), r.pos.data(), n, D, use_q ? &win : nullptr, p, idx.data(),
                           scratch);
        }
        HeadRows kept;
        for (int64_t j : idx) {
          kept.pos.push_back(r.pos[j]);
          kept.k.insert(kept.k.end(), r.k.begin() + j * D, r.k.begin() + (j + 1) * D);
          kept.v.insert(kept.v.end(), r.v.begin() + j * D, r.v.begin() + (j + 1) * D);
        }
        r = kept;
      }
  }
};

// Runs a call sequence on a cache and the model side by side, checking every view, the stored
// positions and offset after every call.
void run_against_model(const CacheConfig& cfg, int64_t B, int64_t H, int64_t D,
                       const std::vector<int64_t>& steps, uint64_t seed, int64_t n_rep = 0) {
  auto cache = make(cfg);
  Model model(cfg, B, H, D, DType::kF16);
  for (size_t t = 0; t < steps.size(); ++t) {
    const int64_t s = steps[t];
    Tensor k = rnd(B, H, s, D, seed + 2 * t), v = rnd(B, H, s, D, seed + 2 * t + 1);
    Tensor q;
    UpdateOptions opts;
    TensorView qv;
    if (n_rep > 0) {
      q = rnd(B, H * n_rep, s, D, seed + 1000 + t, DType::kF32);
      qv = q.view();
      opts.queries = &qv;
    }
    const CacheView view = cache->update_and_fetch(k.view(), v.view(), opts);
    const auto expect = model.step(k.view(), v.view(), n_rep > 0 ? &qv : nullptr);
    ASSERT_EQ(cache->offset(), model.offset) << "step " << t;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        ASSERT_EQ(view_head(view, b, h), expect[b * H + h])
            << "view, step " << t << " b=" << b << " h=" << h;
        ASSERT_EQ(cache->stored_positions(b, h), model.heads[b * H + h].pos)
            << "stored, step " << t << " b=" << b << " h=" << h;
      }
    // The eviction after the step did not touch what the view shows.
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(view_head(view, b, h), expect[b * H + h]);
  }
}

// ---- the call sequence --------------------------------------------------------------------------

TEST(SnapKVCache, ChunkedPrefillReturnsUnevictedAndStoresBudget) {
  auto cache = make(snap_cfg(10, 2, 1));
  const std::vector<int64_t> want_rows = {50, 60, 60};
  for (int t = 0; t < 3; ++t) {
    Tensor k = rnd(1, 1, 50, 8, 10 + t), v = rnd(1, 1, 50, 8, 20 + t);
    const CacheView view = cache->update_and_fetch(k.view(), v.view());
    EXPECT_EQ(view.n_rows(), want_rows[t]) << "chunk " << t;
    EXPECT_EQ(cache->stored_rows(), 10) << "chunk " << t;
  }
  EXPECT_EQ(cache->offset(), 150);
  for (int t = 1; t <= 5; ++t) {
    Tensor k = rnd(1, 1, 1, 8, 40 + t), v = rnd(1, 1, 1, 8, 50 + t);
    EXPECT_EQ(cache->update_and_fetch(k.view(), v.view()).n_rows(), 10 + t);
  }
  EXPECT_EQ(cache->stored_rows(), 15);
  EXPECT_EQ(cache->offset(), 155);
}

TEST(SnapKVCache, CallSequencesMatchTheModel) {
  run_against_model(snap_cfg(10, 2, 1), 1, 1, 8, {50, 50, 50, 1, 1, 1, 1, 1}, 100);
  run_against_model(snap_cfg(9, 4, 2), 1, 2, 16, {13, 7, 21, 1, 1, 3, 1}, 200);
  run_against_model(snap_cfg(64, 4, 1), 1, 2, 8, {48, 48, 48, 48, 1, 1, 1}, 300);
  run_against_model(snap_cfg(16, 8, 2), 2, 3, 32, {1, 1, 40, 1, 2, 1, 30}, 400);  // B > 1
  run_against_model(snap_cfg(5, 32, 0), 1, 2, 8, {2, 2, 2, 9, 1}, 500);           // no sinks
}

TEST(SnapKVCache, ChunkedSequenceFiguresStayConsistent) {
  // [13, 7, 21, 1, 1, 3, 1] with budget 9 and 2 sinks: rows, offset, tokens and bytes per step.
  const int64_t B = 1, H = 2, D = 16;
  auto cache = make(snap_cfg(9, 4, 2));
  int64_t stored = 0, offset = 0;
  uint64_t seed = 900;
  for (int64_t s : {13, 7, 21, 1, 1, 3, 1}) {
    Tensor k = rnd(B, H, s, D, seed++), v = rnd(B, H, s, D, seed++);
    EXPECT_EQ(cache->update_and_fetch(k.view(), v.view()).n_rows(), stored + s);
    offset += s;
    stored = s > 1 ? std::min<int64_t>(9, stored + s) : stored + 1;
    ASSERT_EQ(cache->stored_rows(), stored);
    ASSERT_EQ(cache->offset(), offset);
    const CacheStats st = cache->stats();
    EXPECT_EQ(st.figure("tokens_kept"), B * H * stored);
    EXPECT_EQ(st.figure("tokens_total"), B * H * offset);
    EXPECT_EQ(st.figure("evicted_key_bytes"), B * H * stored * D * 2);
    EXPECT_EQ(st.figure("full_value_bytes"), B * H * offset * D * 2);
    for (int64_t h = 0; h < H; ++h) {
      const auto p = cache->stored_positions(0, h);
      EXPECT_TRUE(std::is_sorted(p.begin(), p.end()));
      EXPECT_EQ(std::set<int32_t>(p.begin(), p.end()).size(), p.size());
      EXPECT_EQ(p[0], 0);
      EXPECT_EQ(p[1], 1);
    }
  }
}

TEST(SnapKVCache, FirstCallWithOneTokenAppends) {
  auto cache = make(snap_cfg(16, 8, 2));
  Tensor k = rnd(1, 2, 1, 8, 1), v = rnd(1, 2, 1, 8, 2);
  EXPECT_EQ(cache->update_and_fetch(k.view(), v.view()).n_rows(), 1);
  EXPECT_EQ(cache->stats().figure("keep_rate"), 1.0);
  EXPECT_EQ(cache->offset(), 1);
  // A later S > 1 call evicts over the earlier decode row and the new chunk together.
  Tensor k2 = rnd(1, 2, 30, 8, 3), v2 = rnd(1, 2, 30, 8, 4);
  EXPECT_EQ(cache->update_and_fetch(k2.view(), v2.view()).n_rows(), 31);
  EXPECT_EQ(cache->stored_rows(), 16);
  EXPECT_EQ(cache->stored_positions(0, 0)[0], 0);  // the sink is the decode row at position 0
}

TEST(SnapKVCache, BudgetAtLeastLengthKeepsEverything) {
  auto cache = make(snap_cfg(200, 8, 2));
  Tensor k = rnd(1, 2, 10, 8, 1), v = rnd(1, 2, 10, 8, 2);
  EXPECT_EQ(cache->update_and_fetch(k.view(), v.view()).n_rows(), 10);
  EXPECT_EQ(cache->stored_rows(), 10);
  EXPECT_EQ(cache->stats().figure("keep_rate"), 1.0);
  EXPECT_EQ(cache->stats().figure("eviction_ratio"), 1.0);
}

TEST(SnapKVCache, BudgetAtMostSinksKeepsFirstRows) {
  auto cache = make(snap_cfg(3, 8, 4));
  Tensor k = rnd(2, 2, 10, 8, 1), v = rnd(2, 2, 10, 8, 2);
  cache->update_and_fetch(k.view(), v.view());
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 2; ++h)
      EXPECT_EQ(cache->stored_positions(b, h), (std::vector<int32_t>{0, 1, 2}));
}

TEST(SnapKVCache, LargeSinkAtTruePositionZeroSurvivesChunks) {
  // The sink is the sequence's true position 0 (not the first row of each chunk): after later
  // chunks the first stored row is still position 0 with its large-valued key.
  auto cache = make(snap_cfg(10, 2, 1));
  Tensor k = rnd(1, 1, 50, 8, 1), v = rnd(1, 1, 50, 8, 2);
  for (int64_t c = 0; c < 8; ++c) k.set(0, 0, 0, c, 50.0f);
  cache->update_and_fetch(k.view(), v.view());
  for (int t = 0; t < 2; ++t) {
    Tensor k2 = rnd(1, 1, 50, 8, 10 + t), v2 = rnd(1, 1, 50, 8, 20 + t);
    const CacheView view = cache->update_and_fetch(k2.view(), v2.view());
    EXPECT_EQ(cache->stored_positions(0, 0)[0], 0) << "chunk " << t + 1;
    EXPECT_EQ(view.segments[0].position(0, 0, 0, 1), 0);
    for (int64_t c = 0; c < 8; ++c) EXPECT_EQ(view.segments[0].keys.at(0, 0, 0, c), 50.0f);
  }
}

TEST(SnapKVCache, LongDecodeIsAppendOnly) {
  auto cache = make(snap_cfg(4, 4, 1));
  Tensor k = rnd(1, 2, 8, 16, 1);
  Tensor v(DType::kF16, 1, 2, 8, 16);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t s = 0; s < 8; ++s)
      for (int64_t c = 0; c < 16; ++c) v.set(0, h, s, c, -k.at(0, h, s, c));
  cache->update_and_fetch(k.view(), v.view());
  std::set<int64_t> capacities;
  CacheView view;
  for (int i = 0; i < 2000; ++i) {
    Tensor kd = rnd(1, 2, 1, 16, 100 + i);
    Tensor vd(DType::kF16, 1, 2, 1, 16);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t c = 0; c < 16; ++c) vd.set(0, h, 0, c, -kd.at(0, h, 0, c));
    view = cache->update_and_fetch(kd.view(), vd.view());
    ASSERT_EQ(view.n_rows(), 4 + i + 1);
    capacities.insert(cache->capacity());
  }
  EXPECT_EQ(cache->offset(), 2008);
  EXPECT_EQ(cache->stored_rows(), 2004);
  // Geometric growth: the store was reallocated O(log n) times, not once per step. x1.25 in
  // steps of 64 rows (as the full cache) from 64 rows to 2004 gives 13 capacities: 64, 128, 192,
  // 256, 320, 448, 576, 768, 960, 1216, 1536, 1920, 2432 (x1.5 gave 10).
  EXPECT_LE(capacities.size(), 13u);
  for (int64_t h = 0; h < 2; ++h) {
    const HeadRows r = view_head(view, 0, h);
    for (size_t e = 0; e < r.k.size(); ++e)
      ASSERT_EQ(r.v[e], static_cast<uint16_t>(r.k[e] ^ 0x8000u)) << "V = -K, element " << e;
  }
}

TEST(SnapKVCache, Deterministic) {
  auto a = make(snap_cfg(12, 4, 2)), b = make(snap_cfg(12, 4, 2));
  for (int64_t s : {40, 1, 25, 1}) {
    Tensor k = rnd(2, 2, s, 16, 7 * s), v = rnd(2, 2, s, 16, 7 * s + 1);
    const CacheView va = a->update_and_fetch(k.view(), v.view());
    const CacheView vb = b->update_and_fetch(k.view(), v.view());
    for (int64_t bb = 0; bb < 2; ++bb)
      for (int64_t h = 0; h < 2; ++h) ASSERT_EQ(view_head(va, bb, h), view_head(vb, bb, h));
  }
}

// ---- figures ------------------------------------------------------------------------------------

TEST(SnapKVCache, WorkedByteExample) {
  auto cache = make(snap_cfg(16, 8, 2));
  Tensor k = rnd(1, 2, 64, 128, 1), v = rnd(1, 2, 64, 128, 2);
  cache->update_and_fetch(k.view(), v.view());
  CacheStats st = cache->stats();
  EXPECT_EQ(st.figure("evicted_key_bytes"), 8192);
  EXPECT_EQ(st.figure("evicted_value_bytes"), 8192);
  EXPECT_EQ(st.figure("full_key_bytes"), 32768);
  EXPECT_EQ(st.figure("full_value_bytes"), 32768);
  EXPECT_EQ(st.figure("eviction_ratio"), 4.0);
  EXPECT_EQ(st.figure("keep_rate"), 0.25);
  EXPECT_EQ(st.bytes_accounted, 16384);
  EXPECT_EQ(st.fp16_bytes, 65536);
  EXPECT_EQ(st.ratio_to_fp16(), 0.25);
  for (int i = 1; i <= 3; ++i) {
    Tensor kd = rnd(1, 2, 1, 128, 10 + i), vd = rnd(1, 2, 1, 128, 20 + i);
    cache->update_and_fetch(kd.view(), vd.view());
    st = cache->stats();
    EXPECT_EQ(st.figure("evicted_key_bytes"), 8192 + 512 * i);
    EXPECT_EQ(st.figure("full_key_bytes"), 32768 + 512 * i);
  }
  // Resident: after a decode the pre-eviction store is gone; what is left is the store (K and V,
  // capacity rows of 2 bytes per element for every (b, h)) and a position (int32) per capacity
  // row of every (b, h).
  EXPECT_EQ(st.bytes_resident,
            2 * (1 * 2 * cache->capacity() * 128 * 2) + 1 * 2 * cache->capacity() * 4);
  EXPECT_GE(st.bytes_resident, st.bytes_accounted);
}

// ---- masks
// ----------------------------------------------------------------------------------------

// Attention from an explicit reading of the mask (double accumulation): the oracle for "the mask
// matches the view".
std::vector<float> masked_attention(const TensorView& q, const CacheView& view, const Mask& m) {
  const int64_t B = q.shape[0], HQ = q.shape[1], N = q.shape[2], D = q.shape[3];
  const int64_t HK = view.n_kv_heads, T = view.n_rows();
  std::vector<float> out(static_cast<size_t>(B * HQ * N * D), 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t qh = 0; qh < HQ; ++qh) {
      const int64_t kh = qh / (HQ / HK);
      // Flatten the view's rows for this head.
      std::vector<std::vector<double>> ks, vs;
      for (const auto& seg : view.segments)
        for (int64_t j = 0; j < seg.n_rows; ++j) {
          std::vector<double> kr(D), vr(D);
          for (int64_t c = 0; c < D; ++c) {
            kr[c] = seg.keys.at(b, kh, j, c);
            vr[c] = seg.values.at(b, kh, j, c);
          }
          ks.push_back(kr);
          vs.push_back(vr);
        }
      for (int64_t i = 0; i < N; ++i) {
        std::vector<double> logit(T);
        std::vector<char> vis(T);
        double mx = -1e300;
        for (int64_t j = 0; j < T; ++j) {
          switch (m.kind) {
            case Mask::Kind::kNone:
              vis[j] = 1;
              break;
            case Mask::Kind::kCausal:
              vis[j] = j <= T - N + i;
              break;
            case Mask::Kind::kExplicit:
              vis[j] = m.visible(b, kh, i, j);
              break;
          }
          if (!vis[j]) continue;
          // Products in fp32 as the reference does (attention.h), sums in double.
          double dot = 0.0;
          for (int64_t c = 0; c < D; ++c)
            dot += static_cast<double>(q.at(b, qh, i, c) * static_cast<float>(ks[j][c]));
          logit[j] = dot / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, logit[j]);
        }
        double z = 0.0;
        std::vector<double> acc(D, 0.0);
        for (int64_t j = 0; j < T; ++j) {
          if (!vis[j]) continue;
          const double e = std::exp(logit[j] - mx);
          z += e;
          for (int64_t c = 0; c < D; ++c) acc[c] += e * vs[j][c];
        }
        for (int64_t c = 0; c < D; ++c)
          out[((b * HQ + qh) * N + i) * D + c] = static_cast<float>(acc[c] / z);
      }
    }
  return out;
}

TEST(SnapKVCache, MaskMatchesViewThroughChunksAndDecode) {
  // budget 64, obs 4, 1 sink, H_q 4 over H_kv 2, D 8, steps [48, 48, 48, 48, 1, 1, 1].
  for (int64_t window : {0, 64}) {
    auto cache = make(snap_cfg(64, 4, 1));
    int64_t step = 0;
    uint64_t seed = 77;
    for (int64_t s : {48, 48, 48, 48, 1, 1, 1}) {
      const int64_t pos0 = cache->offset();
      const Mask m = cache->make_mask(s, window);
      Tensor k = rnd(1, 2, s, 8, seed++), v = rnd(1, 2, s, 8, seed++);
      Tensor q = rnd(1, 4, s, 8, seed++, DType::kF32);
      const CacheView view = cache->update_and_fetch(k.view(), v.view());
      ASSERT_EQ(m.n_keys, view.n_rows()) << "window " << window << " step " << step;
      ASSERT_EQ(m.n_queries, s);
      if (m.kind == Mask::Kind::kExplicit) {
        ASSERT_EQ(static_cast<int64_t>(m.data.size()), m.batch * m.n_heads * s * view.n_rows());
      }
      AttentionParams p;
      p.window = window;
      p.q_pos0 = pos0;
      std::vector<float> ref(static_cast<size_t>(q.numel()));
      attention_reference(q.view(), view, p, ref.data());
      const auto got = masked_attention(q.view(), view, m);
      // Both are the same computation (fp32 products, double sums) up to summation order ((T + D +
      // 16) 2^-52 relative to the sum of |weights x values| <= max |v| since the weights sum to 1),
      // each rounded once to fp32 (2^-24 of the result each).
      double vmax = 0.0;
      for (const auto& seg : view.segments)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t j = 0; j < seg.n_rows; ++j)
            for (int64_t c = 0; c < 8; ++c)
              vmax = std::max(vmax, std::fabs(static_cast<double>(seg.values.at(0, h, j, c))));
      for (size_t e = 0; e < ref.size(); ++e)
        ASSERT_NEAR(got[e], ref[e],
                    0x1p-23 * std::fabs(ref[e]) + (view.n_rows() + 8 + 16) * 0x1p-52 * vmax)
            << "window " << window << " step " << step << " element " << e;
      ASSERT_LE(cache->stored_rows(), 64 + std::max<int64_t>(0, step - 3));
      ++step;
    }
  }
}

TEST(SnapKVCache, MaskKinds) {
  auto cache = make(snap_cfg(5, 4, 1));
  EXPECT_EQ(cache->make_mask(20).kind, Mask::Kind::kCausal);  // nothing stored yet
  EXPECT_EQ(cache->make_mask(1).kind, Mask::Kind::kNone);
  Tensor k = rnd(1, 1, 20, 8, 1), v = rnd(1, 1, 20, 8, 2);
  cache->update_and_fetch(k.view(), v.view());
  EXPECT_EQ(cache->make_mask(1).kind, Mask::Kind::kNone);
  EXPECT_EQ(cache->make_mask(1).n_keys, 6);
  const Mask m = cache->make_mask(3);
  ASSERT_EQ(m.kind, Mask::Kind::kExplicit);
  ASSERT_EQ(m.n_keys, 8);
  auto keypos = cache->stored_positions(0, 0);
  for (int32_t p = 20; p < 23; ++p) keypos.push_back(p);
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 8; ++j)
      EXPECT_EQ(m.visible(0, 0, i, j), keypos[j] <= 20 + i) << i << "," << j;
}

// ---- metamorphic
// ------------------------------------------------------------------------------------

TEST(SnapKVCache, BudgetAboveLengthEqualsFullCacheBitForBit) {
  for (DType t : {DType::kF16, DType::kBF16}) {
    auto snap = make(snap_cfg(1000, 4, 2));
    CacheConfig fc;
    auto full = make_full_cache(fc);
    uint64_t seed = 5;
    for (int64_t s : {5, 3, 1, 1, 7, 40, 1}) {
      Tensor k = rnd(2, 3, s, 16, seed++, t), v = rnd(2, 3, s, 16, seed++, t);
      const CacheView a = snap->update_and_fetch(k.view(), v.view());
      const CacheView b = full->update_and_fetch(k.view(), v.view());
      ASSERT_EQ(a.n_rows(), b.n_rows());
      for (const auto& seg : a.segments) ASSERT_EQ(seg.keys.dtype, t);
      for (int64_t bb = 0; bb < 2; ++bb)
        for (int64_t h = 0; h < 3; ++h) ASSERT_EQ(view_head(a, bb, h), view_head(b, bb, h));
    }
    EXPECT_EQ(snap->stats().figure("keep_rate"), 1.0);
  }
}

TEST(SnapKVCache, AttentionOverViewEqualsFullCacheRestrictedToKeptRows) {
  const int64_t B = 2, H = 2, HQ = 4, D = 16;
  auto snap = make(snap_cfg(12, 4, 2));
  CacheConfig fc;
  auto full = make_full_cache(fc);
  uint64_t seed = 31;
  for (int64_t s : {30, 1, 20, 1, 1, 5}) {
    Tensor k = rnd(B, H, s, D, seed++), v = rnd(B, H, s, D, seed++);
    Tensor q = rnd(B, HQ, s, D, seed++, DType::kF32);
    std::vector<std::vector<int32_t>> kept(B * H);
    for (int64_t b = 0; b < B && snap->stored_rows() > 0; ++b)
      for (int64_t h = 0; h < H; ++h) kept[b * H + h] = snap->stored_positions(b, h);
    const int64_t pos0 = snap->offset();
    const CacheView sv = snap->update_and_fetch(k.view(), v.view());
    const CacheView fv = full->update_and_fetch(k.view(), v.view());
    // The full cache's rows restricted per head to the kept positions (plus this call's rows).
    const int64_t n = sv.n_rows();
    Tensor rk(DType::kF16, B, H, n, D), rv(DType::kF16, B, H, n, D);
    std::vector<int32_t> rpos(static_cast<size_t>(B * H * n));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        auto pos = kept[b * H + h];
        for (int64_t i = 0; i < s; ++i) pos.push_back(static_cast<int32_t>(pos0 + i));
        ASSERT_EQ(static_cast<int64_t>(pos.size()), n);
        for (int64_t j = 0; j < n; ++j) {
          rpos[(b * H + h) * n + j] = pos[j];
          std::memcpy(rk.view().row(b, h, j), fv.segments[0].keys.row(b, h, pos[j]), D * 2);
          std::memcpy(rv.view().row(b, h, j), fv.segments[0].values.row(b, h, pos[j]), D * 2);
        }
      }
    CacheView restricted;
    restricted.batch = B;
    restricted.n_kv_heads = H;
    restricted.head_dim = D;
    ViewSegment seg;
    seg.n_rows = n;
    seg.positions = rpos.data();
    seg.keys = rk.view();
    seg.values = rv.view();
    restricted.segments.push_back(seg);
    AttentionParams p;
    p.q_pos0 = pos0;
    std::vector<float> a(static_cast<size_t>(q.numel())), r(a.size());
    attention_reference(q.view(), sv, p, a.data());
    attention_reference(q.view(), restricted, p, r.data());
    // Same rows with the same positions in the same order through the same deterministic
    // oracle: identical bits.
    for (size_t e = 0; e < a.size(); ++e) ASSERT_EQ(a[e], r[e]) << "s=" << s << " e=" << e;
  }
}

TEST(SnapKVCache, QueryScoringGqaEqualsMhaWithRepeatedKvHeads) {
  // GQA: H_kv 2, H_q 4 (n_rep 2), the two query heads of a group identical. MHA: H_kv 4 where KV
  // head h' is a copy of GQA head h' / 2, same queries (n_rep 1). Then the MHA score of head h'
  // is one head's softmax mean, and the GQA score of head g is the average of two identical
  // means, which is exactly that mean ((x + x) / 2 == x): both caches keep the same rows.
  CacheConfig c = snap_cfg(10, 6, 1);
  c.snap_scoring = SnapScoring::kQuery;
  auto gqa = make(c), mha = make(c);
  const int64_t D = 16;
  uint64_t seed = 61;
  for (int64_t s : {40, 1, 3, 25, 1}) {
    Tensor k = rnd(1, 2, s, D, seed++), v = rnd(1, 2, s, D, seed++);
    Tensor qg = rnd(1, 2, s, D, seed++, DType::kF32);
    Tensor q(DType::kF32, 1, 4, s, D), k4(DType::kF16, 1, 4, s, D), v4(DType::kF16, 1, 4, s, D);
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < s; ++i)
        for (int64_t d = 0; d < D; ++d) {
          q.set(0, h, i, d, qg.at(0, h / 2, i, d));
          k4.set(0, h, i, d, k.at(0, h / 2, i, d));
          v4.set(0, h, i, d, v.at(0, h / 2, i, d));
        }
    const TensorView qv = q.view();
    UpdateOptions opts;
    opts.queries = &qv;
    gqa->update_and_fetch(k.view(), v.view(), opts);
    mha->update_and_fetch(k4.view(), v4.view(), opts);
    for (int64_t h = 0; h < 4; ++h)
      ASSERT_EQ(mha->stored_positions(0, h), gqa->stored_positions(0, h / 2)) << "s=" << s;
  }
  // The queries mattered: a key-proxy cache keeps other rows on this data.
  auto proxy = make(snap_cfg(10, 6, 1));
  seed = 61;
  bool differs = false;
  for (int64_t s : {40, 1, 3, 25, 1}) {
    Tensor k = rnd(1, 2, s, D, seed++), v = rnd(1, 2, s, D, seed++);
    seed++;
    proxy->update_and_fetch(k.view(), v.view());
  }
  for (int64_t h = 0; h < 2; ++h)
    differs |= proxy->stored_positions(0, h) != gqa->stored_positions(0, h);
  EXPECT_TRUE(differs);
}

// ---- options
// ----------------------------------------------------------------------------------------

TEST(SnapKVCache, OptionsMatchTheModel) {
  CacheConfig q = snap_cfg(12, 8, 2);
  q.snap_scoring = SnapScoring::kQuery;
  run_against_model(q, 1, 2, 16, {30, 1, 4, 20, 1, 1, 2}, 700, /*n_rep=*/4);
  run_against_model(q, 2, 2, 16, {30, 1, 25}, 710, /*n_rep=*/1);
  CacheConfig pool = snap_cfg(12, 8, 2);
  pool.snap_pool_kernel = 5;
  run_against_model(pool, 1, 2, 16, {30, 1, 20, 1}, 720);
  pool.snap_pool = PoolKind::kAvg;
  run_against_model(pool, 1, 2, 16, {30, 1, 20, 1}, 730);
  CacheConfig kw = snap_cfg(12, 8, 2);
  kw.snap_keep_window = true;
  run_against_model(kw, 1, 2, 16, {30, 1, 20, 1, 3}, 740);
  kw.snap_scoring = SnapScoring::kQuery;
  kw.snap_pool_kernel = 3;
  run_against_model(kw, 1, 2, 16, {30, 1, 20, 1, 3}, 750, /*n_rep=*/2);
}

TEST(SnapKVCache, KeepWindowAlwaysKeepsTheNewestRows) {
  CacheConfig c = snap_cfg(12, 8, 2);
  c.snap_keep_window = true;
  auto cache = make(c);
  uint64_t seed = 3;
  for (int64_t s : {40, 1, 30}) {
    Tensor k = rnd(1, 2, s, 16, seed++), v = rnd(1, 2, s, 16, seed++);
    cache->update_and_fetch(k.view(), v.view());
    for (int64_t h = 0; h < 2; ++h) {
      const auto p = cache->stored_positions(0, h);
      for (int64_t i = 0; i < 8 && s > 1; ++i)
        EXPECT_EQ(p[p.size() - 8 + i], cache->offset() - 8 + i) << "s=" << s;
      EXPECT_EQ(p[0], 0);
      EXPECT_EQ(p[1], 1);
    }
  }
}

TEST(SnapKVCache, QueryModeWithoutQueriesUsesKeyProxy) {
  CacheConfig c = snap_cfg(12, 8, 2);
  c.snap_scoring = SnapScoring::kQuery;
  auto a = make(c), b = make(snap_cfg(12, 8, 2));
  for (int64_t s : {30, 1, 20}) {
    Tensor k = rnd(1, 2, s, 16, s), v = rnd(1, 2, s, 16, s + 1);
    a->update_and_fetch(k.view(), v.view());
    b->update_and_fetch(k.view(), v.view());
  }
  for (int64_t h = 0; h < 2; ++h) EXPECT_EQ(a->stored_positions(0, h), b->stored_positions(0, h));
}

TEST(SnapKVCache, StorageDtypes) {
  struct Case {
    SnapDType mode;
    DType in, want;
  };
  for (const Case& cs : {Case{SnapDType::kAuto, DType::kBF16, DType::kBF16},
                         Case{SnapDType::kAuto, DType::kF16, DType::kF16},
                         Case{SnapDType::kAuto, DType::kF32, DType::kF16},
                         Case{SnapDType::kFloat16, DType::kBF16, DType::kF16},
                         Case{SnapDType::kBFloat16, DType::kF16, DType::kBF16}}) {
    CacheConfig c = snap_cfg(8, 4, 1);
    c.snap_dtype = cs.mode;
    auto cache = make(c);
    Tensor k = rnd(1, 2, 5, 8, 1, cs.in), v = rnd(1, 2, 5, 8, 2, cs.in);
    const CacheView view = cache->update_and_fetch(k.view(), v.view());
    EXPECT_EQ(cache->storage_dtype(), cs.want);
    for (const auto& seg : view.segments) EXPECT_EQ(seg.keys.dtype, cs.want);
    if (cs.in == cs.want) {
      EXPECT_TRUE(test::bit_equal(view.segments[0].keys, k.view()));
    }
    // Later blocks of another dtype are converted to the fixed storage dtype.
    Tensor k2 = rnd(1, 2, 1, 8, 3, DType::kF32), v2 = rnd(1, 2, 1, 8, 4, DType::kF32);
    const CacheView v2w = cache->update_and_fetch(k2.view(), v2.view());
    for (const auto& seg : v2w.segments) EXPECT_EQ(seg.keys.dtype, cs.want);
  }
}

// ---- refusals -----------------------------------------------------------------------------------

std::string saved(const KVCache& c) {
  std::ostringstream out;
  c.save(out);
  return out.str();
}

TEST(SnapKVCache, TrimAndMergeRefusedNothingChanged) {
  auto cache = make(snap_cfg(4, 4, 1));
  Tensor k = rnd(1, 2, 20, 8, 1), v = rnd(1, 2, 20, 8, 2);
  cache->update_and_fetch(k.view(), v.view());
  const std::string before = saved(*cache);
  EXPECT_FALSE(cache->is_trimmable());
  EXPECT_THROW(cache->trim(3), Error);
  EXPECT_EQ(saved(*cache), before);
  EXPECT_EQ(cache->offset(), 20);
  EXPECT_EQ(cache->stored_rows(), 4);
  EXPECT_THROW(merge_batch({cache.get(), cache.get()}), Error);
  EXPECT_EQ(saved(*cache), before);
}

TEST(SnapKVCache, BadInputRefusedNothingChanged) {
  CacheConfig c = snap_cfg(6, 4, 1);
  c.snap_scoring = SnapScoring::kQuery;
  auto cache = make(c);
  Tensor k = rnd(1, 2, 10, 8, 1), v = rnd(1, 2, 10, 8, 2);
  cache->update_and_fetch(k.view(), v.view());
  const std::string before = saved(*cache);
  Tensor k3 = rnd(1, 3, 2, 8, 3), v3 = rnd(1, 3, 2, 8, 4);   // H changes
  Tensor kd = rnd(1, 2, 2, 4, 5), vd = rnd(1, 2, 2, 4, 6);   // D changes
  Tensor kb = rnd(2, 2, 2, 8, 7), vb = rnd(2, 2, 2, 8, 8);   // B changes
  Tensor ko = rnd(1, 2, 2, 8, 9), vo = rnd(1, 2, 3, 8, 10);  // K/V shapes differ
  EXPECT_THROW(cache->update_and_fetch(k3.view(), v3.view()), Error);
  EXPECT_THROW(cache->update_and_fetch(kd.view(), vd.view()), Error);
  EXPECT_THROW(cache->update_and_fetch(kb.view(), vb.view()), Error);
  EXPECT_THROW(cache->update_and_fetch(ko.view(), vo.view()), Error);
  Tensor ok = rnd(1, 2, 2, 8, 11), okv = rnd(1, 2, 2, 8, 12);
  for (const auto& shape : std::vector<std::array<int64_t, 4>>{
           {1, 3, 2, 8}, {1, 4, 3, 8}, {1, 4, 2, 4}, {2, 4, 2, 8}}) {
    Tensor q(DType::kF32, shape[0], shape[1], shape[2], shape[3]);
    const TensorView qv = q.view();
    UpdateOptions opts;
    opts.queries = &qv;
    EXPECT_THROW(cache->update_and_fetch(ok.view(), okv.view(), opts), Error)
        << shape[1] << " query heads";
  }
  EXPECT_EQ(saved(*cache), before);
  CacheConfig bad = snap_cfg(0, 4, 1);
  EXPECT_THROW(make_snapkv_cache(bad), Error);
  bad = snap_cfg(4, 4, 1);
  bad.snap_pool_kernel = 4;
  EXPECT_THROW(make_snapkv_cache(bad), Error);
}

TEST(SnapKVCache, BuilderDispatch) {
  CacheConfig c = snap_cfg(32, 16, 3);
  ModelCacheShape shape;
  shape.n_kv_heads = {2, 2};
  shape.head_dim = {128, 128};
  const auto caches = build_caches(shape, c);
  ASSERT_EQ(caches.size(), 2u);
  for (const auto& cache : caches) EXPECT_EQ(cache->method(), "snapkv");
}

// ---- save / load
// ------------------------------------------------------------------------------------

TEST(SnapKVCache, SaveLoadContinuesBitIdentically) {
  CacheConfig c = snap_cfg(10, 4, 2);
  auto a = make(c);
  uint64_t seed = 11;
  for (int64_t s : {30, 1, 1}) {  // explicit-position rows and an implicit tail
    Tensor k = rnd(2, 2, s, 16, seed++), v = rnd(2, 2, s, 16, seed++);
    a->update_and_fetch(k.view(), v.view());
  }
  std::stringstream file;
  a->save(file);
  auto b = make(c);
  b->load(file);
  EXPECT_EQ(b->offset(), a->offset());
  EXPECT_EQ(b->stored_rows(), a->stored_rows());
  EXPECT_EQ(b->stats().figures, a->stats().figures);
  for (int64_t s : {1, 20, 1, 5, 1}) {
    Tensor k = rnd(2, 2, s, 16, seed++), v = rnd(2, 2, s, 16, seed++);
    const CacheView va = a->update_and_fetch(k.view(), v.view());
    const CacheView vb = b->update_and_fetch(k.view(), v.view());
    for (int64_t bb = 0; bb < 2; ++bb)
      for (int64_t h = 0; h < 2; ++h) ASSERT_EQ(view_head(va, bb, h), view_head(vb, bb, h));
  }
  EXPECT_EQ(saved(*a), saved(*b));
  // An empty cache round-trips too.
  auto e = make(c), f = make(c);
  std::stringstream ef;
  e->save(ef);
  f->load(ef);
  EXPECT_EQ(f->offset(), 0);
}

TEST(SnapKVCache, CorruptTruncatedOrForeignFilesRefused) {
  CacheConfig c = snap_cfg(10, 4, 2);
  auto src = make(c);
  Tensor k = rnd(1, 2, 30, 8, 1), v = rnd(1, 2, 30, 8, 2);
  src->update_and_fetch(k.view(), v.view());
  const std::string good = saved(*src);

  auto target = make(c);
  Tensor k2 = rnd(1, 2, 3, 8, 3), v2 = rnd(1, 2, 3, 8, 4);
  target->update_and_fetch(k2.view(), v2.view());
  const std::string before = saved(*target);
  auto refuse = [&](const std::string& bytes, const char* what) {
    std::istringstream in(bytes);
    EXPECT_THROW(target->load(in), Error) << what;
    EXPECT_EQ(saved(*target), before) << what;
  };
  for (size_t at : {size_t{9}, good.size() / 2, good.size() - 20, good.size() - 1}) {
    std::string flipped = good;
    flipped[at] = static_cast<char>(flipped[at] ^ 0x10);
    refuse(flipped, "flipped byte");
  }
  refuse(good.substr(0, good.size() - 1), "truncated by one byte");
  refuse(good.substr(0, good.size() / 2), "truncated by half");
  refuse(std::string(), "empty");
  // A full cache's state file.
  CacheConfig fc;
  auto full = make_full_cache(fc);
  full->update_and_fetch(k.view(), v.view());
  refuse(saved(*full), "full cache file");
  // A snapkv file written under other settings.
  auto other = make(snap_cfg(16, 4, 2));
  other->update_and_fetch(k.view(), v.view());
  refuse(saved(*other), "other snap_budget");
  // The good file still loads.
  std::istringstream in(good);
  target->load(in);
  EXPECT_EQ(saved(*target), good);
}

// ---- snap_evict_at = prompt_end (one selection per prompt, the paper's schedule) ---------------

// Feeds blocks (random K/V and queries from `seed`) to a cache; S == 1 blocks are decode steps.
void feed(KVCache& c, const std::vector<int64_t>& blocks, uint64_t seed, int64_t h_q,
          std::vector<CacheView>* views = nullptr) {
  for (int64_t s : blocks) {
    Tensor k = rnd(2, 2, s, 16, seed++), v = rnd(2, 2, s, 16, seed++);
    Tensor q = rnd(2, h_q, s, 16, seed++, DType::kF32);
    const TensorView qv = q.view();
    UpdateOptions o;
    o.queries = &qv;
    CacheView view = c.update_and_fetch(k.view(), v.view(), o);
    if (views) views->push_back(view);
  }
}

// The same prompt as one block, and as chunks: rows of chunk i of `chunks` are rows of the one
// block, so both caches see identical K/V/queries.
void feed_chunked(KVCache& c, int64_t n, const std::vector<int64_t>& chunks, uint64_t seed,
                  int64_t h_q) {
  Tensor k = rnd(2, 2, n, 16, seed), v = rnd(2, 2, n, 16, seed + 1);
  Tensor q = rnd(2, h_q, n, 16, seed + 2, DType::kF32);
  int64_t at = 0;
  for (int64_t s : chunks) {
    auto part = [&](const Tensor& t) {
      TensorView tv = t.view();
      tv.data = static_cast<char*>(tv.data) + at * tv.stride[2] * dtype_size(tv.dtype);
      tv.shape[2] = s;
      return tv;
    };
    const TensorView kv = part(k), vv = part(v), qv = part(q);
    UpdateOptions o;
    o.queries = &qv;
    c.update_and_fetch(kv, vv, o);
    at += s;
  }
}

// Every (b, h) of two views holds the same positions and K/V bits.
void expect_same_rows(const CacheView& a, const CacheView& b, const std::string& what) {
  ASSERT_EQ(a.batch, b.batch) << what;
  ASSERT_EQ(a.n_kv_heads, b.n_kv_heads) << what;
  for (int64_t bb = 0; bb < a.batch; ++bb)
    for (int64_t h = 0; h < a.n_kv_heads; ++h)
      EXPECT_TRUE(view_head(a, bb, h) == view_head(b, bb, h))
          << what << " (b, h) = (" << bb << ", " << h << ")";
}

TEST(SnapKVCache, PromptEndChunkedEqualsOneShotBitForBit) {
  // Metamorphic: with snap_evict_at = prompt_end, a prompt of 170 rows in chunks 50 + 60 + 60
  // stores exactly what the default schedule stores after the same 170 rows in one call (the
  // last chunk is longer than the observation window, so both score with the same queries).
  for (int variant = 0; variant < 4; ++variant) {
    CacheConfig c = snap_cfg(40, 16, 3);
    if (variant >= 1) c.snap_scoring = SnapScoring::kQuery;
    if (variant >= 2) c.snap_pool_kernel = 5;
    if (variant == 3) c.snap_keep_window = true;
    CacheConfig pe = c;
    pe.snap_evict_at = SnapEvictAt::kPromptEnd;
    auto one = make(c), chunked = make(pe);
    feed_chunked(*one, 170, {170}, 900 + variant, 4);
    feed_chunked(*chunked, 170, {50, 60, 60}, 900 + variant, 4);
    EXPECT_TRUE(chunked->eviction_pending());
    EXPECT_EQ(chunked->stored_rows(), 170);  // nothing evicted before the prompt ends
    chunked->end_prompt();
    EXPECT_FALSE(chunked->eviction_pending());
    ASSERT_EQ(chunked->stored_rows(), one->stored_rows()) << "variant " << variant;
    EXPECT_EQ(chunked->stats().bytes_accounted, one->stats().bytes_accounted);
    // Decode steps after the prompt see identical views.
    std::vector<CacheView> va, vb;
    feed(*one, {1, 1}, 77, 4, &va);
    feed(*chunked, {1, 1}, 77, 4, &vb);
    expect_same_rows(va.back(), vb.back(), "variant " + std::to_string(variant));
  }
}

TEST(SnapKVCache, PromptEndRunsAtTheFirstDecodeStepWithoutEndPrompt) {
  CacheConfig c = snap_cfg(20, 8, 2);
  c.snap_scoring = SnapScoring::kQuery;
  c.snap_evict_at = SnapEvictAt::kPromptEnd;
  auto a = make(c), b = make(c);
  feed(*a, {30, 25}, 5, 2);
  feed(*b, {30, 25}, 5, 2);
  a->end_prompt();
  // b: the mask of the coming single-token call already counts the rows that will stay.
  const Mask m = b->make_mask(1);
  EXPECT_EQ(m.n_keys, 21);
  EXPECT_THROW(b->make_mask(1, 16), Error);   // windowed: positions not chosen yet
  EXPECT_EQ(b->make_mask(3).n_keys, 55 + 3);  // more prompt: nothing is evicted by it
  std::vector<CacheView> va, vb;
  feed(*a, {1}, 40, 2, &va);
  feed(*b, {1}, 40, 2, &vb);
  EXPECT_FALSE(b->eviction_pending());
  EXPECT_EQ(vb[0].n_rows(), 21);
  expect_same_rows(va[0], vb[0], "explicit vs implicit end of the prompt");
  // end_prompt again, or on the default schedule, changes nothing.
  const std::string before = saved(*a);
  a->end_prompt();
  EXPECT_EQ(saved(*a), before);
  auto d = make(snap_cfg(20, 8, 2));
  feed(*d, {30, 25}, 5, 2);
  const std::string d_before = saved(*d);
  d->end_prompt();
  EXPECT_EQ(saved(*d), d_before);
}

TEST(SnapKVCache, PromptEndPendingSurvivesSaveLoad) {
  CacheConfig c = snap_cfg(20, 8, 2);
  c.snap_scoring = SnapScoring::kQuery;
  c.snap_evict_at = SnapEvictAt::kPromptEnd;
  auto a = make(c), b = make(c);
  feed(*a, {30, 25}, 9, 4);
  std::istringstream in(saved(*a));
  b->load(in);
  EXPECT_TRUE(b->eviction_pending());
  a->end_prompt();
  b->end_prompt();
  EXPECT_EQ(saved(*a), saved(*b));
  // A file with a pending eviction is refused by a cache on the default schedule.
  auto p = make(c);
  feed(*p, {30}, 3, 4);
  CacheConfig dflt = c;
  dflt.snap_evict_at = SnapEvictAt::kPrefillCall;
  auto q = make(dflt);
  std::istringstream in2(saved(*p));
  EXPECT_THROW(q->load(in2), Error);
}

}  // namespace
}  // namespace vq
