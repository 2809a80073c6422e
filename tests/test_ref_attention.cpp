// Tests of attention_reference (src/ops/ref_attention.cpp), the oracle of every later attention
// kernel: against a double-precision brute force written here (different loop order, double
// products, explicit position lookup), with a tolerance derived from the reference's fp32
// products; and metamorphic checks that must hold bit for bit: GQA == MHA with repeated KV
// heads, sliding window == plain attention over the sliced cache, split segments == one segment.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "util/test_util.h"
#include "veloxquant/attention.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"

namespace vq {
namespace {

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    FAIL() << "expected a vq::Error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

int64_t pos_of(const ViewSegment& s, int64_t b, int64_t h, int64_t i, int64_t n_heads) {
  if (!s.positions) return s.first_pos + i;
  return s.positions[(b * n_heads + h) * s.n_rows + i];
}

// Brute force in double, plus the tolerance the reference is allowed per element:
//   each fp32 product q_d*k_d has relative error <= 2^-24, so logit j is off by at most
//   eps_j = |scale| * sum_d |q_d k_d| * (2^-24 + D 2^-52) (the second term: double summation);
//   shifting every logit by at most eps = max_j eps_j changes each softmax weight by a factor
//   within [e^-2eps, e^2eps], so the output moves by at most (e^{2 eps} - 1) * sum_j p_j |v_j|;
//   the double accumulation of sum_j p_j v_j adds n * 2^-52 * sum_j p_j |v_j|; the final
//   rounding to fp32 adds 2^-24 |o|.
struct Brute {
  std::vector<double> out, tol;
};

Brute brute_force(const Tensor& q, const CacheView& view, const AttentionParams& p) {
  const int64_t B = q.shape()[0], Hq = q.shape()[1], N = q.shape()[2], D = q.shape()[3];
  const int64_t Hkv = view.n_kv_heads, rep = Hq / Hkv;
  const double scale = p.scale != 0.0f ? p.scale : 1.0 / std::sqrt(static_cast<double>(D));
  Brute r;
  r.out.assign(static_cast<size_t>(B * Hq * N * D), 0.0);
  r.tol.assign(r.out.size(), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < N; ++i) {
        const int64_t kh = h / rep, qp = p.q_pos0 + i;
        std::vector<double> logit, eps;
        std::vector<std::pair<const ViewSegment*, int64_t>> keys;
        for (const auto& s : view.segments)
          for (int64_t j = 0; j < s.n_rows; ++j) {
            const int64_t kp = pos_of(s, b, kh, j, Hkv);
            if (kp > qp || (p.window > 0 && qp - kp >= p.window)) continue;
            double dot = 0, mag = 0;
            for (int64_t d = 0; d < D; ++d) {
              const double prod = static_cast<double>(q.at(b, h, i, d)) * s.keys.at(b, kh, j, d);
              dot += prod;
              mag += std::fabs(prod);
            }
            logit.push_back(dot * scale);
            eps.push_back(std::fabs(scale) * mag *
                          (std::ldexp(1.0, -24) + D * std::ldexp(1.0, -52)));
            keys.push_back({&s, j});
          }
        if (logit.empty()) continue;  // zeros, tolerance 0
        double mx = logit[0], e_max = 0;
        for (size_t k = 0; k < logit.size(); ++k) {
          mx = std::max(mx, logit[k]);
          e_max = std::max(e_max, eps[k]);
        }
        double z = 0;
        for (double l : logit) z += std::exp(l - mx);
        for (int64_t d = 0; d < D; ++d) {
          double o = 0, mass = 0;
          for (size_t k = 0; k < logit.size(); ++k) {
            const double pk = std::exp(logit[k] - mx) / z;
            const double v = keys[k].first->values.at(b, kh, keys[k].second, d);
            o += pk * v;
            mass += pk * std::fabs(v);
          }
          const size_t at = static_cast<size_t>(((b * Hq + h) * N + i) * D + d);
          r.out[at] = o;
          r.tol[at] = std::expm1(2 * e_max) * mass +
                      static_cast<double>(logit.size() + 2) * std::ldexp(mass, -52) +
                      std::ldexp(std::fabs(o), -24);
        }
      }
  return r;
}

std::vector<float> run_ref(const Tensor& q, const CacheView& view, const AttentionParams& p) {
  std::vector<float> out(static_cast<size_t>(q.numel()), -1.0f);
  attention_reference(q.view(), view, p, out.data());
  return out;
}

// Compares and returns the largest fraction of the tolerance used.
double expect_close(const std::vector<float>& got, const Brute& want) {
  double used = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want.out[i]);
    EXPECT_LE(err, want.tol[i]) << "element " << i << ": got " << got[i] << " want " << want.out[i];
    if (want.tol[i] > 0) used = std::max(used, err / want.tol[i]);
    norm += want.out[i] * want.out[i];
  }
  EXPECT_GT(norm, 0.0) << "reference output is all zeros: the test would prove nothing";
  return used;
}

TEST(RefAttention, MatchesDoubleBruteForceOverShapes) {
  double worst = 0;
  uint64_t seed = 1;
  for (int64_t D : {16, 64})
    for (int64_t Hkv : {1, 2})
      for (int64_t rep : {1, 4})
        for (int64_t N : {1, 3, 17})
          for (int64_t T0 : {0, 31, 129})
            for (int64_t window : {0, 5}) {
              if (T0 == 0 && N == 1 && window) continue;
              const int64_t B = (D == 16) ? 2 : 1;
              FullCache c;
              if (T0) {
                const Tensor k = test::random_tensor(DType::kF16, B, Hkv, T0, D, seed++);
                const Tensor v = test::random_tensor(DType::kF16, B, Hkv, T0, D, seed++);
                c.update_and_fetch(k.view(), v.view());
              }
              const Tensor k = test::random_tensor(DType::kF16, B, Hkv, N, D, seed++);
              const Tensor v = test::random_tensor(DType::kF16, B, Hkv, N, D, seed++);
              const CacheView view = c.update_and_fetch(k.view(), v.view());
              // Queries with a larger spread, so the softmax is far from uniform.
              const Tensor q = test::random_tensor(DType::kF32, B, Hkv * rep, N, D, seed++, 3.0f);
              AttentionParams p;
              p.q_pos0 = T0;
              p.window = window;
              SCOPED_TRACE("D=" + std::to_string(D) + " Hkv=" + std::to_string(Hkv) +
                           " rep=" + std::to_string(rep) + " N=" + std::to_string(N) +
                           " T0=" + std::to_string(T0) + " window=" + std::to_string(window));
              worst = std::max(worst, expect_close(run_ref(q, view, p), brute_force(q, view, p)));
            }
  // Printed, not asserted: how much of the derived tolerance the worst element used.
  std::printf("worst error: %.1f%% of the derived tolerance\n", 100 * worst);
}

TEST(RefAttention, ExplicitScaleAndFp16Queries) {
  FullCache c;
  const Tensor k = test::random_tensor(DType::kBF16, 1, 2, 40, 32, 5);
  const CacheView view = c.update_and_fetch(k.view(), k.view());
  const Tensor q = test::random_tensor(DType::kF16, 1, 2, 4, 32, 6);
  AttentionParams p;
  p.scale = 0.3f;
  p.q_pos0 = 36;
  std::vector<float> out(static_cast<size_t>(q.numel()));
  attention_reference(q.view(), view, p, out.data());
  expect_close(out, brute_force(q, view, p));
}

TEST(RefAttention, GqaEqualsMhaWithRepeatedKvHeads) {
  const int64_t B = 2, Hkv = 2, rep = 4, T = 50, N = 6, D = 32;
  const Tensor k = test::random_tensor(DType::kF16, B, Hkv, T, D, 1);
  const Tensor v = test::random_tensor(DType::kF16, B, Hkv, T, D, 2);
  Tensor k_rep(DType::kF16, B, Hkv * rep, T, D), v_rep(DType::kF16, B, Hkv * rep, T, D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv * rep; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < D; ++d) {
          k_rep.set(b, h, t, d, k.at(b, h / rep, t, d));
          v_rep.set(b, h, t, d, v.at(b, h / rep, t, d));
        }
  FullCache gqa, mha;
  const CacheView vg = gqa.update_and_fetch(k.view(), v.view());
  const CacheView vm = mha.update_and_fetch(k_rep.view(), v_rep.view());
  const Tensor q = test::random_tensor(DType::kF32, B, Hkv * rep, N, D, 3, 2.0f);
  for (int64_t window : {0, 7}) {
    AttentionParams p;
    p.q_pos0 = T - N;
    p.window = window;
    EXPECT_EQ(run_ref(q, vg, p), run_ref(q, vm, p)) << "window " << window;
  }
}

// Rows [r0, r1) of a full-cache view as a view with implicit positions r0..r1-1.
CacheView slice_view(const CacheView& v, int64_t r0, int64_t r1) {
  CacheView s = v;
  ViewSegment& seg = s.segments.at(0);
  seg.keys = seg.keys.slice_tokens(r0, r1);
  seg.values = seg.values.slice_tokens(r0, r1);
  seg.n_rows = r1 - r0;
  seg.first_pos = r0;
  return s;
}

TEST(RefAttention, SlidingWindowEqualsPlainAttentionOnTheSlicedCache) {
  const int64_t B = 1, H = 2, T = 90, D = 16, W = 24;
  FullCache c;
  const Tensor k = test::random_tensor(DType::kF16, B, H, T, D, 1);
  const Tensor v = test::random_tensor(DType::kF16, B, H, T, D, 2);
  const CacheView view = c.update_and_fetch(k.view(), v.view());
  // Each query of a prefill block, one at a time: query at position p sees rows (p-W, p].
  for (int64_t qp : {0, 5, 23, 24, 60, 89}) {
    const Tensor q = test::random_tensor(DType::kF32, B, H, 1, D, 100 + qp, 2.0f);
    AttentionParams windowed;
    windowed.q_pos0 = qp;
    windowed.window = W;
    AttentionParams plain;
    plain.q_pos0 = qp;
    const CacheView sliced = slice_view(view, std::max<int64_t>(0, qp - W + 1), qp + 1);
    EXPECT_EQ(run_ref(q, view, windowed), run_ref(q, sliced, plain)) << "q_pos " << qp;
  }
}

TEST(RefAttention, SplitSegmentsEqualOneSegment) {
  FullCache c;
  const Tensor k = test::random_tensor(DType::kF32, 2, 2, 40, 8, 1);
  const CacheView one = c.update_and_fetch(k.view(), k.view());
  CacheView two = slice_view(one, 0, 13);
  two.segments.push_back(slice_view(one, 13, 40).segments[0]);
  const Tensor q = test::random_tensor(DType::kF32, 2, 4, 5, 8, 2);
  AttentionParams p;
  p.q_pos0 = 35;
  p.window = 20;
  EXPECT_EQ(run_ref(q, one, p), run_ref(q, two, p));
}

TEST(RefAttention, PerRowPositionsAreHonoured) {
  // Two KV heads that kept different positions (as after eviction), then 3 new rows at 10..12.
  const int64_t B = 1, H = 2, D = 16, n_kept = 4, N = 3;
  const Tensor kept_k = test::random_tensor(DType::kF16, B, H, n_kept, D, 1);
  const Tensor kept_v = test::random_tensor(DType::kF16, B, H, n_kept, D, 2);
  const Tensor new_k = test::random_tensor(DType::kF16, B, H, N, D, 3);
  const Tensor new_v = test::random_tensor(DType::kF16, B, H, N, D, 4);
  const std::vector<int32_t> pos = {0, 3, 7, 9,   // head 0
                                    1, 2, 8, 9};  // head 1
  CacheView view;
  view.batch = B;
  view.n_kv_heads = H;
  view.head_dim = D;
  ViewSegment kept;
  kept.n_rows = n_kept;
  kept.positions = pos.data();
  kept.keys = kept_k.view();
  kept.values = kept_v.view();
  ViewSegment fresh;
  fresh.n_rows = N;
  fresh.first_pos = 10;
  fresh.keys = new_k.view();
  fresh.values = new_v.view();
  view.segments = {kept, fresh};
  const Tensor q = test::random_tensor(DType::kF32, B, 4, 5, D, 5, 2.0f);
  for (int64_t q0 : {6, 8, 10})
    for (int64_t window : {0, 3}) {
      AttentionParams p;
      p.q_pos0 = q0;  // queries at q0 .. q0+4: some keys are still in their future
      p.window = window;
      SCOPED_TRACE("q0=" + std::to_string(q0) + " window=" + std::to_string(window));
      const auto out = run_ref(q, view, p);
      expect_close(out, brute_force(q, view, p));
      // Head 0 at position 8 sees {0, 3, 7}; head 1 at 8 sees {1, 2, 8}: different outputs
      // prove the per-head positions matter (query heads 0,1 -> KV 0; 2,3 -> KV 1).
    }
  // Metamorphic: per KV head, the same as a view holding only that head's visible rows, listed
  // with implicit positions is impossible (gaps), so compare with a one-head view per head.
  for (int64_t h = 0; h < H; ++h) {
    CacheView one = view;
    one.n_kv_heads = 1;
    std::vector<int32_t> p1(pos.begin() + h * n_kept, pos.begin() + (h + 1) * n_kept);
    TensorView kk = kept_k.view(), kv = kept_v.view(), nk = new_k.view(), nv = new_v.view();
    for (TensorView* t : {&kk, &kv, &nk, &nv}) {
      t->data = t->row(0, h, 0);
      t->shape[1] = 1;
    }
    one.segments[0].keys = kk;
    one.segments[0].values = kv;
    one.segments[0].positions = p1.data();
    one.segments[1].keys = nk;
    one.segments[1].values = nv;
    Tensor q1(DType::kF32, B, 2, 5, D);
    for (int64_t r = 0; r < 2; ++r)
      for (int64_t i = 0; i < 5; ++i)
        for (int64_t d = 0; d < D; ++d) q1.set(0, r, i, d, q.at(0, h * 2 + r, i, d));
    AttentionParams p;
    p.q_pos0 = 8;
    p.window = 3;
    const auto full = run_ref(q, view, p);
    const auto part = run_ref(q1, one, p);
    for (int64_t r = 0; r < 2; ++r)
      for (int64_t i = 0; i < 5 * D; ++i)
        EXPECT_EQ(full[static_cast<size_t>((h * 2 + r) * 5 * D + i)],
                  part[static_cast<size_t>(r * 5 * D + i)]);
  }
}

TEST(RefAttention, QueryThatSeesNoKeyGetsZeros) {
  FullCache c;
  const Tensor k = test::random_tensor(DType::kF16, 1, 1, 4, 8, 1);
  const CacheView view = c.update_and_fetch(k.view(), k.view());
  const Tensor q = test::random_tensor(DType::kF32, 1, 1, 3, 8, 2);
  AttentionParams p;
  p.q_pos0 = -2;  // positions -2, -1, 0: only the last query sees key 0
  const auto out = run_ref(q, view, p);
  for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(out[static_cast<size_t>(i)], 0.0f);
  for (int64_t d = 0; d < 8; ++d)
    EXPECT_EQ(out[static_cast<size_t>(16 + d)], view.segments[0].values.at(0, 0, 0, d));
}

TEST(RefAttention, BadInputIsRefused) {
  FullCache c;
  const Tensor k = test::random_tensor(DType::kF16, 1, 2, 4, 8, 1);
  const CacheView view = c.update_and_fetch(k.view(), k.view());
  std::vector<float> out(1000);
  const Tensor q3 = test::random_tensor(DType::kF32, 1, 3, 1, 8, 2);
  expect_error([&] { attention_reference(q3.view(), view, {}, out.data()); },
               "H_q a multiple of H_kv = 2");
  const Tensor qd = test::random_tensor(DType::kF32, 1, 2, 1, 16, 2);
  expect_error([&] { attention_reference(qd.view(), view, {}, out.data()); },
               "expected q [1, H_q, N, 8]");
  const Tensor qb = test::random_tensor(DType::kF32, 2, 2, 1, 8, 2);
  expect_error([&] { attention_reference(qb.view(), view, {}, out.data()); }, "expected q [1");
  const Tensor q = test::random_tensor(DType::kF32, 1, 2, 1, 8, 2);
  AttentionParams neg;
  neg.window = -1;
  expect_error([&] { attention_reference(q.view(), view, neg, out.data()); }, "window >= 0");
  expect_error([&] { attention_reference(q.view(), view, {}, nullptr); }, "null pointer");
  CacheView packed = view;
  packed.segments[0].packed = reinterpret_cast<const PackedSegment*>(&out);  // never dereferenced
  expect_error([&] { attention_reference(q.view(), packed, {}, out.data()); }, "is packed");
  CacheView wrong = view;
  wrong.segments[0].n_rows = 3;
  expect_error([&] { attention_reference(q.view(), wrong, {}, out.data()); },
               "segment 0 keys/values");
}

}  // namespace
}  // namespace vq
