// Tests of the full-precision cache (docs/design.md §C2) and of the KVCache defaults it relies on
// (cache_base.cpp: make_mask, trim refusal, save_file/load_file, merge_batch).
//
// The oracle for every view is a plain concatenation of the blocks fed in, kept by the test in a
// std::vector per (b, h); contents are compared bit for bit (the cache must be exact).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "util/test_util.h"
#include "veloxquant/binary_io.h"
#include "veloxquant/builder.h"
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

// What the cache should hold: rows per (b, h) as fp32 values of the storage dtype.
struct Oracle {
  int64_t B, H, D;
  DType dt;
  std::vector<std::vector<float>> k, v;  // [B*H][rows*D]
  Oracle(int64_t b, int64_t h, int64_t d, DType t)
      : B(b), H(h), D(d), dt(t), k(static_cast<size_t>(b * h)), v(static_cast<size_t>(b * h)) {}
  // Appends a block, rounding through the storage dtype like the cache must.
  void append(const TensorView& keys, const TensorView& values) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t s = 0; s < keys.shape[2]; ++s)
          for (int64_t d = 0; d < D; ++d) {
            k[b * H + h].push_back(round(keys.at(b, h, s, d)));
            v[b * H + h].push_back(round(values.at(b, h, s, d)));
          }
  }
  float round(float x) const {
    if (dt == DType::kF16) return fp16_to_f32(f32_to_fp16(x));
    if (dt == DType::kBF16) return bf16_to_f32(f32_to_bf16(x));
    return x;
  }
  void trim(int64_t n) {
    for (auto* vec : {&k, &v})
      for (auto& r : *vec) r.resize(r.size() - static_cast<size_t>(n * D));
  }
  int64_t rows() const { return static_cast<int64_t>(k[0].size()) / D; }
  // Checks a view (one or more full-precision segments) holds exactly these rows, positions
  // 0..rows-1.
  void check(const CacheView& view) const {
    ASSERT_EQ(view.batch, B);
    ASSERT_EQ(view.n_kv_heads, H);
    ASSERT_EQ(view.head_dim, D);
    ASSERT_EQ(view.n_rows(), rows());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        int64_t row = 0;
        for (const auto& seg : view.segments) {
          ASSERT_EQ(seg.packed, nullptr);
          ASSERT_EQ(seg.keys.dtype, dt);
          for (int64_t i = 0; i < seg.n_rows; ++i, ++row) {
            ASSERT_EQ(seg.position(b, h, i, H), row);
            for (int64_t d = 0; d < D; ++d) {
              const size_t at = static_cast<size_t>(row * D + d);
              // Exact: the cache stores what the oracle rounded (bitwise via float compare is
              // fine here because NaN never occurs in these inputs).
              ASSERT_EQ(seg.keys.at(b, h, i, d), k[b * H + h][at]) << b << h << row << d;
              ASSERT_EQ(seg.values.at(b, h, i, d), v[b * H + h][at]) << b << h << row << d;
            }
          }
        }
      }
  }
};

std::string saved(const KVCache& c) {
  std::ostringstream os;
  c.save(os);
  return os.str();
}

TEST(FullCache, GrowsInStepsOf256Geometrically) {
  FullCache c;
  EXPECT_EQ(c.capacity(), 0);
  int64_t growths = 0, prev_cap = 0;
  for (int64_t t = 1; t <= 5000; ++t) {
    const Tensor k = test::random_tensor(DType::kF16, 1, 2, 1, 8, static_cast<uint64_t>(t));
    c.update_and_fetch(k.view(), k.view());
    const int64_t cap = c.capacity();
    ASSERT_EQ(cap % FullCache::kStep, 0);
    ASSERT_GE(cap, t);
    if (cap != prev_cap) {
      ++growths;
      // It grew only because the row did not fit, and by at least 1.25x (amortised O(1):
      // a growth that copies c rows is followed by at least c/4 appends without copying).
      ASSERT_EQ(t, prev_cap + 1);
      ASSERT_GE(4 * cap, 5 * prev_cap);
      prev_cap = cap;
    }
    // Slack: after a growth at t = c + 1 the capacity is round_up(1.25 c, 256) < 1.25 t + 256.
    ASSERT_LT(4 * cap, 5 * t + 4 * FullCache::kStep);
  }
  // Geometric growth: 5000 rows take O(log 5000) growths, not 5000 / 256 = 20.
  EXPECT_LE(growths, 14);

  // A prefill that does not fit grows straight to the next multiple of 256 (or 1.25x).
  FullCache p;
  const Tensor a = test::random_tensor(DType::kF16, 1, 1, 300, 4, 1);
  p.update_and_fetch(a.view(), a.view());
  EXPECT_EQ(p.capacity(), 512);
  const Tensor b = test::random_tensor(DType::kF16, 1, 1, 1000, 4, 2);
  p.update_and_fetch(b.view(), b.view());
  EXPECT_EQ(p.capacity(), 1536);  // max(1300, 640) rounded up to 256
}

// reserve(): the first store holds the reserved length (rounded up to 256), no growth follows up
// to it, and the contents equal an unreserved cache's; past it the usual growth takes over.
TEST(FullCache, ReserveSizesTheFirstStoreAndNothingGrowsUpToIt) {
  FullCache r, g;
  r.reserve(1000);
  EXPECT_EQ(r.capacity(), 0);  // nothing allocated by reserve()
  Oracle o(1, 2, 8, DType::kF16);
  const Tensor prompt = test::random_tensor(DType::kF16, 1, 2, 700, 8, 5);
  r.update_and_fetch(prompt.view(), prompt.view());
  g.update_and_fetch(prompt.view(), prompt.view());
  o.append(prompt.view(), prompt.view());
  EXPECT_EQ(r.capacity(), 1024);  // round_up(max(700, 1000), 256)
  EXPECT_EQ(g.capacity(), 768);   // unreserved: round_up(700, 256)
  for (int64_t t = 701; t <= 1024; ++t) {
    const Tensor k = test::random_tensor(DType::kF16, 1, 2, 1, 8, static_cast<uint64_t>(t));
    r.update_and_fetch(k.view(), k.view());
    g.update_and_fetch(k.view(), k.view());
    o.append(k.view(), k.view());
    ASSERT_EQ(r.capacity(), 1024) << "grew at row " << t;
  }
  o.check(r.stored_view());
  EXPECT_EQ(saved(r), saved(g));  // the same state whatever the capacity
  EXPECT_EQ(g.capacity(), 1024);  // the unreserved one grew (768 -> 1024: a copy) on the way
  const Tensor k = test::random_tensor(DType::kF16, 1, 2, 1, 8, 9);
  r.update_and_fetch(k.view(), k.view());  // past the reservation: 1.25x growth
  EXPECT_EQ(r.capacity(), 1280);
  expect_error([&] { r.reserve(-1); }, "[full_cache] reserve: expected 0 <= rows");
}

TEST(FullCache, ViewIsTheConcatenationOfEveryBlock) {
  const int64_t B = 2, H = 3, D = 16;
  FullCache c;
  Oracle o(B, H, D, DType::kF16);
  uint64_t seed = 100;
  for (int64_t s : {5, 1, 17, 256, 1, 1, 300, 2}) {
    const Tensor k = test::random_tensor(DType::kF16, B, H, s, D, seed++);
    const Tensor v = test::random_tensor(DType::kF16, B, H, s, D, seed++);
    const CacheView view = c.update_and_fetch(k.view(), v.view());
    o.append(k.view(), v.view());
    ASSERT_EQ(view.segments.size(), 1u);
    EXPECT_EQ(view.segments[0].positions, nullptr);
    EXPECT_EQ(view.segments[0].first_pos, 0);
    o.check(view);
    EXPECT_EQ(c.offset(), o.rows());
    EXPECT_EQ(c.stored_rows(), o.rows());
  }
  EXPECT_EQ(c.batch(), B);
  EXPECT_EQ(c.n_kv_heads(), H);
  const auto pos = c.stored_positions(1, 2);
  ASSERT_EQ(static_cast<int64_t>(pos.size()), o.rows());
  for (size_t i = 0; i < pos.size(); ++i) EXPECT_EQ(pos[i], static_cast<int32_t>(i));
}

TEST(FullCache, StorageDtypeIsTheFirstBlocksAndLaterBlocksConvert) {
  FullCache c;
  Oracle o(1, 2, 8, DType::kBF16);
  const Tensor k0 = test::random_tensor(DType::kBF16, 1, 2, 3, 8, 1);
  const Tensor v0 = test::random_tensor(DType::kF32, 1, 2, 3, 8, 2);  // values converted too
  c.update_and_fetch(k0.view(), v0.view());
  o.append(k0.view(), v0.view());
  const Tensor k1 = test::random_tensor(DType::kF32, 1, 2, 4, 8, 3);
  const Tensor v1 = test::random_tensor(DType::kF16, 1, 2, 4, 8, 4);
  o.append(k1.view(), v1.view());
  o.check(c.update_and_fetch(k1.view(), v1.view()));
  EXPECT_EQ(c.dtype(), DType::kBF16);
}

TEST(FullCache, StridedInputEqualsContiguousInput) {
  // Input whose token axis is a slice of a bigger buffer, and one with stride[3] = 2.
  const Tensor big = test::random_tensor(DType::kF32, 1, 2, 20, 8, 9);
  const TensorView sliced = big.view().slice_tokens(3, 9);
  Tensor wide = test::random_tensor(DType::kF32, 1, 2, 6, 16, 10);
  TensorView every_other = wide.view();
  every_other.shape[3] = 8;
  every_other.stride[3] = 2;
  FullCache a;
  Oracle o(1, 2, 8, DType::kF32);
  o.append(sliced, every_other);
  o.check(a.update_and_fetch(sliced, every_other));
  o.append(sliced.slice_tokens(2, 3), every_other.slice_tokens(4, 5));
  o.check(a.update_and_fetch(sliced.slice_tokens(2, 3), every_other.slice_tokens(4, 5)));
}

TEST(FullCache, TrimDropsTheLastTokensAndAppendsContinue) {
  FullCache c;
  Oracle o(1, 2, 4, DType::kF16);
  const Tensor k = test::random_tensor(DType::kF16, 1, 2, 100, 4, 1);
  c.update_and_fetch(k.view(), k.view());
  o.append(k.view(), k.view());
  EXPECT_TRUE(c.is_trimmable());
  EXPECT_EQ(c.trim(30), 30);
  o.trim(30);
  EXPECT_EQ(c.offset(), 70);
  EXPECT_EQ(c.stored_rows(), 70);
  const int64_t cap = c.capacity();
  const Tensor k2 = test::random_tensor(DType::kF16, 1, 2, 5, 4, 2);
  o.append(k2.view(), k2.view());
  o.check(c.update_and_fetch(k2.view(), k2.view()));
  EXPECT_EQ(c.capacity(), cap);  // trim keeps the buffers
  EXPECT_EQ(c.trim(1000), 75);   // min(n, offset)
  EXPECT_EQ(c.offset(), 0);
  EXPECT_EQ(c.trim(0), 0);
  const std::string before = saved(c);
  expect_error([&] { c.trim(-1); }, "[trim] expected n >= 0 but got -1");
  EXPECT_EQ(saved(c), before);
}

TEST(FullCache, StatsFollowTheByteFormulas) {
  FullCache c;
  CacheStats s0 = c.stats();
  EXPECT_EQ(s0.method, "full");
  EXPECT_EQ(s0.bytes_accounted, 0);
  EXPECT_EQ(s0.ratio_to_fp16(), 1.0);
  const int64_t B = 2, H = 4, D = 32, S = 300;
  const Tensor k = test::random_tensor(DType::kF32, B, H, S, D, 1);
  c.update_and_fetch(k.view(), k.view());
  const CacheStats s = c.stats();
  EXPECT_EQ(s.tokens_seen, S);
  EXPECT_EQ(s.rows_stored, S);
  // accounted = rows * B*H*D * 2 (K, V) * sizeof(fp32); fp16 equivalent at 2 bytes.
  EXPECT_EQ(s.bytes_accounted, S * B * H * D * 2 * 4);
  EXPECT_EQ(s.fp16_bytes, S * B * H * D * 2 * 2);
  EXPECT_DOUBLE_EQ(s.ratio_to_fp16(), 2.0);
  // resident = the allocated capacity (512 rows), K and V.
  EXPECT_EQ(s.bytes_resident, 512 * B * H * D * 2 * 4);
  EXPECT_EQ(s.figure("capacity_rows"), 512.0);
  EXPECT_EQ(s.figure("key_bytes"), static_cast<double>(S * B * H * D * 4));
  expect_error([&] { s.figure("no_such_figure"); }, "no_such_figure");
}

TEST(FullCache, BadInputIsRefusedAndNothingChanges) {
  FullCache c;
  const Tensor k = test::random_tensor(DType::kF16, 2, 3, 4, 8, 1);
  c.update_and_fetch(k.view(), k.view());
  const std::string before = saved(c);
  const Tensor other_v = test::random_tensor(DType::kF16, 2, 3, 5, 8, 2);
  expect_error([&] { c.update_and_fetch(k.view(), other_v.view()); }, "expected values of the");
  const Tensor h4 = test::random_tensor(DType::kF16, 2, 4, 1, 8, 3);
  expect_error([&] { c.update_and_fetch(h4.view(), h4.view()); }, "fixed by the first call");
  const Tensor d16 = test::random_tensor(DType::kF16, 2, 3, 1, 16, 4);
  expect_error([&] { c.update_and_fetch(d16.view(), d16.view()); }, "fixed by the first call");
  const Tensor b1 = test::random_tensor(DType::kF16, 1, 3, 1, 8, 5);
  expect_error([&] { c.update_and_fetch(b1.view(), b1.view()); }, "fixed by the first call");
  const Tensor s0(DType::kF16, 2, 3, 0, 8);
  expect_error([&] { c.update_and_fetch(s0.view(), s0.view()); }, "every dim >= 1");
  TensorView null_k = k.view();
  null_k.data = nullptr;
  expect_error([&] { c.update_and_fetch(null_k, k.view()); }, "null pointer");
  EXPECT_EQ(saved(c), before);
  EXPECT_EQ(c.offset(), 4);
}

TEST(FullCache, MaskKinds) {
  FullCache c;
  // Fresh cache: N == 1 needs none, N > 1 is implicit causal, a biting window is explicit.
  EXPECT_EQ(c.make_mask(1).kind, Mask::Kind::kNone);
  EXPECT_EQ(c.make_mask(5).kind, Mask::Kind::kCausal);
  const Mask fresh = c.make_mask(5, 2);
  ASSERT_EQ(fresh.kind, Mask::Kind::kExplicit);
  EXPECT_EQ(fresh.n_keys, 5);
  EXPECT_TRUE(fresh.visible(3, 7, 4, 3));  // shared by every (b, h) before the first block
  EXPECT_FALSE(fresh.visible(0, 0, 4, 2));

  const Tensor k = test::random_tensor(DType::kF16, 2, 2, 10, 4, 1);
  c.update_and_fetch(k.view(), k.view());
  EXPECT_EQ(c.make_mask(1).kind, Mask::Kind::kNone);
  EXPECT_EQ(c.make_mask(3).kind, Mask::Kind::kCausal);
  // A window that cannot hide anything (offset + N - 1 < window) is the same as none.
  EXPECT_EQ(c.make_mask(3, 13).kind, Mask::Kind::kCausal);
  EXPECT_EQ(c.make_mask(3, 12).kind, Mask::Kind::kExplicit);  // hides key 0 from query 12
  EXPECT_EQ(c.make_mask(1, 11).kind, Mask::Kind::kNone);
  const int64_t W = 4, N = 3;
  const Mask m = c.make_mask(N, W);
  ASSERT_EQ(m.kind, Mask::Kind::kExplicit);
  ASSERT_EQ(m.batch, 2);
  ASSERT_EQ(m.n_heads, 2);
  ASSERT_EQ(m.n_queries, N);
  ASSERT_EQ(m.n_keys, 10 + N);
  ASSERT_EQ(m.data.size(), static_cast<size_t>(2 * 2 * N * (10 + N)));
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < 10 + N; ++j) {
          // key j has position j (contiguous cache); query i has position 10 + i.
          const int64_t qp = 10 + i;
          const bool want = j <= qp && qp - j < W;
          EXPECT_EQ(m.visible(b, h, i, j), want) << b << h << i << j;
        }
  // A one-query mask with a biting window is explicit too.
  const Mask m1 = c.make_mask(1, 3);
  ASSERT_EQ(m1.kind, Mask::Kind::kExplicit);
  EXPECT_FALSE(m1.visible(0, 0, 0, 7));
  EXPECT_TRUE(m1.visible(0, 0, 0, 8));
  expect_error([&] { c.make_mask(0); }, "n_queries >= 1");
  expect_error([&] { c.make_mask(2, -1); }, "window >= 0");
}

TEST(FullCache, MaskShortcutEqualsTheDefaultMask) {
  FullCache c;
  uint64_t seed = 1;
  for (int64_t s : {0, 1, 7, 300}) {
    if (s) {
      const Tensor k = test::random_tensor(DType::kF16, 2, 3, s, 4, seed++);
      c.update_and_fetch(k.view(), k.view());
    }
    for (int64_t n : {1, 2, 9})
      for (int64_t w : {0, 1, 4, 1000}) {
        const Mask fast = c.make_mask(n, w);
        const Mask slow = c.KVCache::make_mask(n, w);
        EXPECT_EQ(fast.kind, slow.kind) << s << " " << n << " " << w;
        EXPECT_EQ(fast.n_keys, slow.n_keys);
        EXPECT_EQ(fast.n_queries, slow.n_queries);
        EXPECT_EQ(fast.data, slow.data);
      }
  }
}

// A minimal cache with per-head, non-contiguous positions, to test the KVCache defaults.
class GappyCache final : public KVCache {
 public:
  std::string method() const override { return "gappy"; }
  CacheView update_and_fetch(const TensorView&, const TensorView&, const UpdateOptions&) override {
    return {};
  }
  int64_t offset() const override { return 20; }
  int64_t stored_rows() const override { return 3; }
  std::vector<int32_t> stored_positions(int64_t, int64_t h) const override {
    return h == 0 ? std::vector<int32_t>{0, 5, 19} : std::vector<int32_t>{1, 2, 3};
  }
  int64_t batch() const override { return 1; }
  int64_t n_kv_heads() const override { return 2; }
  CacheStats stats() const override { return {}; }
  void save(std::ostream&) const override {}
  void load(std::istream&) override {}
};

TEST(KVCacheDefaults, MaskUsesEachHeadsOwnPositions) {
  GappyCache g;
  EXPECT_EQ(g.make_mask(1).kind, Mask::Kind::kNone);
  const Mask m = g.make_mask(2);  // not contiguous: explicit even without a window
  ASSERT_EQ(m.kind, Mask::Kind::kExplicit);
  ASSERT_EQ(m.n_keys, 5);
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 5; ++j) {
      EXPECT_EQ(m.visible(0, 0, i, j), j < 3 || j - 3 <= i);
      EXPECT_EQ(m.visible(0, 1, i, j), j < 3 || j - 3 <= i);
    }
  const Mask w = g.make_mask(2, 16);  // q positions 20, 21; window 16 hides positions <= q-16
  const int32_t p0[] = {0, 5, 19, 20, 21}, p1[] = {1, 2, 3, 20, 21};
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 5; ++j) {
      const int64_t q = 20 + i;
      EXPECT_EQ(w.visible(0, 0, i, j), p0[j] <= q && q < p0[j] + 16) << i << j;
      EXPECT_EQ(w.visible(0, 1, i, j), p1[j] <= q && q < p1[j] + 16) << i << j;
    }
}

TEST(KVCacheDefaults, TrimAndMergeAreRefusedByDefault) {
  GappyCache g;
  EXPECT_FALSE(g.is_trimmable());
  expect_error([&] { g.trim(1); }, "[trim] gappy cache is not trimmable");
  expect_error([&] { merge_batch({&g}); }, "got a gappy cache");
  FullCache f;
  expect_error([&] { merge_batch({&f, &g}); }, "gappy");
  expect_error([&] { merge_batch({}); }, "at least one cache");
}

TEST(FullCache, SaveLoadRoundTripContinuesBitIdentically) {
  const int64_t B = 2, H = 2, D = 8;
  FullCache a;
  uint64_t seed = 1;
  for (int64_t s : {7, 1, 300}) {
    const Tensor k = test::random_tensor(DType::kF16, B, H, s, D, seed++);
    a.update_and_fetch(k.view(), k.view());
  }
  std::stringstream ss;
  a.save(ss);
  FullCache b;
  b.load(ss);
  EXPECT_EQ(b.offset(), a.offset());
  EXPECT_EQ(b.capacity(), 512);  // rows rounded up to 256, capacity itself is not saved
  for (int step = 0; step < 5; ++step) {
    const Tensor k = test::random_tensor(DType::kF16, B, H, step == 2 ? 40 : 1, D, seed++);
    const Tensor v = test::random_tensor(DType::kF16, B, H, step == 2 ? 40 : 1, D, seed++);
    const CacheView va = a.update_and_fetch(k.view(), v.view());
    const CacheView vb = b.update_and_fetch(k.view(), v.view());
    ASSERT_TRUE(test::bit_equal(va.segments[0].keys, vb.segments[0].keys));
    ASSERT_TRUE(test::bit_equal(va.segments[0].values, vb.segments[0].values));
  }
  EXPECT_EQ(saved(a), saved(b));
  EXPECT_EQ(a.stats().bytes_accounted, b.stats().bytes_accounted);

  // A fresh cache round-trips too and then accepts any shape.
  FullCache e, e2;
  std::stringstream es;
  e.save(es);
  e2.load(es);
  EXPECT_EQ(e2.offset(), 0);
  const Tensor k = test::random_tensor(DType::kF32, 1, 1, 2, 3, 1);
  EXPECT_NO_THROW(e2.update_and_fetch(k.view(), k.view()));
}

TEST(FullCache, CorruptTruncatedOrForeignFilesAreRefusedWithNothingChanged) {
  FullCache a;
  const Tensor k = test::random_tensor(DType::kF16, 1, 2, 5, 4, 1);
  a.update_and_fetch(k.view(), k.view());
  const std::string good = saved(a);

  FullCache victim;
  const Tensor kv = test::random_tensor(DType::kF16, 1, 1, 3, 2, 2);
  victim.update_and_fetch(kv.view(), kv.view());
  const std::string victim_state = saved(victim);
  auto refused = [&](const std::string& bytes, const std::string& needle) {
    std::istringstream in(bytes);
    expect_error([&] { victim.load(in); }, needle);
    ASSERT_EQ(saved(victim), victim_state);
  };
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x10);
    refused(bad, "[load_state]");
  }
  for (size_t n = 0; n < good.size(); ++n) refused(good.substr(0, n), "truncated");
  // A well-formed frame of another cache type.
  StateWriter w;
  w.i64(1);
  refused(w.frame("snapkv"), "expected method full but got snapkv");
  // A valid frame whose contents disagree with themselves (offset 6 but 5 rows of tensor).
  StateWriter lie;
  lie.boolean(true);
  lie.u8(static_cast<uint8_t>(DType::kF16));
  for (int64_t x : {1, 2, 4, 6}) lie.i64(x);
  lie.tensor(a.keys());
  lie.tensor(a.values());
  refused(lie.frame("full"), "expected key/value tensors");
  // A consistent state followed by bytes its parser does not expect.
  StateWriter extra;
  extra.boolean(true);
  extra.u8(static_cast<uint8_t>(DType::kF16));
  for (int64_t x : {1, 2, 4, 5}) extra.i64(x);
  extra.tensor(a.keys());
  extra.tensor(a.values());
  StateReader ok = StateReader::from_bytes(extra.frame("full"), "full");  // well-formed so far
  (void)ok;
  extra.u8(0);
  refused(extra.frame("full"), "left unread");
  // Still usable after all those refusals.
  const Tensor more = test::random_tensor(DType::kF16, 1, 1, 1, 2, 3);
  EXPECT_EQ(victim.update_and_fetch(more.view(), more.view()).n_rows(), 4);
}

TEST(FullCache, SaveFileLoadFile) {
  const auto dir = std::filesystem::temp_directory_path() / "vq_test_full_cache";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "state.vqkv").string();
  FullCache a;
  const Tensor k = test::random_tensor(DType::kBF16, 1, 3, 33, 8, 5);
  a.update_and_fetch(k.view(), k.view());
  a.save_file(path);
  FullCache b;
  b.load_file(path);
  EXPECT_EQ(saved(a), saved(b));
  // Trailing garbage after the frame: refused before anything is replaced.
  {
    std::ofstream app(path, std::ios::binary | std::ios::app);
    app << "garbage";
  }
  FullCache c;
  const std::string c_before = saved(c);
  expect_error([&] { c.load_file(path); }, "7 bytes follow it");
  EXPECT_EQ(saved(c), c_before);
  expect_error([&] { c.load_file((dir / "missing.vqkv").string()); }, "could not open");
  std::filesystem::remove_all(dir);
}

TEST(FullCache, BatchOfThreeAndMerge) {
  const int64_t H = 2, D = 4;
  std::vector<FullCache> singles(3);
  std::vector<Oracle> oracles(3, Oracle(1, H, D, DType::kF16));
  uint64_t seed = 50;
  for (int64_t s : {6, 1, 1}) {
    for (size_t i = 0; i < 3; ++i) {
      const Tensor k = test::random_tensor(DType::kF16, 1, H, s, D, seed++);
      singles[i].update_and_fetch(k.view(), k.view());
      oracles[i].append(k.view(), k.view());
    }
  }
  const std::string s0 = saved(singles[0]);
  auto merged = merge_batch({&singles[0], &singles[1], &singles[2]});
  EXPECT_EQ(saved(singles[0]), s0);  // inputs untouched
  ASSERT_EQ(merged->method(), "full");
  EXPECT_EQ(merged->batch(), 3);
  EXPECT_EQ(merged->offset(), 8);
  // Continue the merged batch with one more token per sequence and check every sequence.
  const Tensor k = test::random_tensor(DType::kF16, 3, H, 1, D, 99);
  const CacheView view = merged->update_and_fetch(k.view(), k.view());
  Oracle all(3, H, D, DType::kF16);
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t h = 0; h < H; ++h) {
      all.k[b * H + h] = oracles[b].k[h];
      all.v[b * H + h] = oracles[b].v[h];
    }
  all.append(k.view(), k.view());
  all.check(view);

  // Unequal offsets, other H or dtype: refused.
  FullCache shorter;
  const Tensor k5 = test::random_tensor(DType::kF16, 1, H, 5, D, 7);
  shorter.update_and_fetch(k5.view(), k5.view());
  expect_error([&] { merge_batch({&singles[0], &shorter}); }, "expected equal offsets");
  FullCache other_h;
  const Tensor k8 = test::random_tensor(DType::kF16, 1, H + 1, 8, D, 7);
  other_h.update_and_fetch(k8.view(), k8.view());
  expect_error([&] { merge_batch({&singles[0], &other_h}); }, "expected H=2");
  FullCache other_t;
  const Tensor k8f = test::random_tensor(DType::kF32, 1, H, 8, D, 7);
  other_t.update_and_fetch(k8f.view(), k8f.view());
  expect_error([&] { merge_batch({&singles[0], &other_t}); }, "float32");
  // Empty caches merge to an empty cache.
  FullCache e1, e2;
  EXPECT_EQ(merge_batch({&e1, &e2})->offset(), 0);
}

TEST(FullCache, BuiltByTheBuilderPerLayer) {
  CacheConfig cfg;
  cfg.method = "full";
  auto one = make_cache(cfg);
  EXPECT_EQ(one->method(), "full");
  ModelCacheShape shape{{2, 2, 4}, {64, 64, 128}};
  auto layers = build_caches(shape, cfg);
  ASSERT_EQ(layers.size(), 3u);
  for (const auto& l : layers) EXPECT_EQ(l->method(), "full");
  expect_error([&] { build_caches(ModelCacheShape{{2}, {64, 64}}, cfg); }, "one entry per layer");
  expect_error(
      [&] {
        build_caches(ModelCacheShape{{2, 0}, {64, 64}}, cfg);
      },
      "layer 1: expected n_kv_heads >= 1 but got 0");
  expect_error([&] { build_caches(ModelCacheShape{{}, {}}, cfg); }, "at least one layer");
  cfg.snap_budget = 0;
  expect_error([&] { make_cache(cfg); }, "snap_budget: expected >= 1 but got 0");
  cfg.snap_budget = 512;
  cfg.method = "bogus";
  expect_error([&] { make_cache(cfg); }, "method: expected one of full, snapkv");
}

}  // namespace
}  // namespace vq
