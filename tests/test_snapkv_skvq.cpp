// Tests of method snapkv+skvq (veloxquant/snapkv_skvq_cache.h): the same positions as SnapKV
// alone (first prefill, decode, chunked prefill while no packed row exists; key-proxy and query
// scoring, pooling, keep-window), each kept row decoding exactly as SKVQ alone holds it, kept
// packed rows keeping their codes through later evictions, rectangular storage when heads keep
// different packed counts, the returned view untouched by the eviction that follows it, the
// flush frontier, resident bytes ~ kept rows x packed row size, save/load and refusals.
// Blocks are [B, H, S, D]; queries [B, H_q, S, D].
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "util/test_util.h"
#include "veloxquant/builder.h"
#include "veloxquant/error.h"
#include "veloxquant/packed.h"
#include "veloxquant/skvq_cache.h"
#include "veloxquant/snapkv_cache.h"
#include "veloxquant/snapkv_skvq_cache.h"

namespace vq {
namespace {

CacheConfig both_cfg() {
  CacheConfig c;
  c.method = "snapkv+skvq";
  c.head_dim = 64;
  c.snap_budget = 64;
  c.snap_obs_window = 8;
  c.snap_n_sink = 4;
  c.skvq_window = 16;
  c.skvq_n_sink = 4;
  c.skvq_group_size = 16;
  return c;
}

CacheConfig as(const CacheConfig& c, const char* method) {
  CacheConfig o = c;
  o.method = method;
  return o;
}

Tensor rnd(int64_t b, int64_t h, int64_t s, int64_t d, uint64_t seed, DType t = DType::kF16) {
  return test::random_tensor(t, b, h, s, d, seed);
}

std::string state_of(const KVCache& c) {
  std::ostringstream os;
  c.save(os);
  return os.str();
}

// Record bytes of every packed row of (b, h) in a view, by position.
std::map<int32_t, std::string> packed_records(const CacheView& v, int64_t b, int64_t h) {
  std::map<int32_t, std::string> out;
  for (const auto& seg : v.segments) {
    if (!seg.packed) continue;
    for (int64_t i = 0; i < seg.n_rows; ++i) {
      const PackedTensor& k = seg.packed->keys;
      const PackedTensor& val = seg.packed->values;
      std::string rec(reinterpret_cast<const char*>(k.record(b, h, i)), k.fmt.row_stride);
      rec.append(reinterpret_cast<const char*>(val.record(b, h, i)), val.fmt.row_stride);
      out[seg.position(b, h, i, v.n_kv_heads)] = rec;
    }
  }
  return out;
}

// Positions of the full-precision rows of (b, h), with their rows' raw bytes (keys ++ values).
std::map<int32_t, std::string> fp_rows_of(const CacheView& v, int64_t b, int64_t h) {
  std::map<int32_t, std::string> out;
  for (const auto& seg : v.segments) {
    if (seg.packed) continue;
    const size_t n = static_cast<size_t>(v.head_dim) * dtype_size(seg.keys.dtype);
    for (int64_t i = 0; i < seg.n_rows; ++i) {
      std::string r(static_cast<const char*>(seg.keys.row(b, h, i)), n);
      r.append(static_cast<const char*>(seg.values.row(b, h, i)), n);
      out[seg.position(b, h, i, v.n_kv_heads)] = r;
    }
  }
  return out;
}

void expect_same_positions(const KVCache& a, const KVCache& b, const std::string& what) {
  ASSERT_EQ(a.stored_rows(), b.stored_rows()) << what;
  for (int64_t bb = 0; bb < a.batch(); ++bb)
    for (int64_t h = 0; h < a.n_kv_heads(); ++h)
      ASSERT_EQ(a.stored_positions(bb, h), b.stored_positions(bb, h))
          << what << " b " << bb << " h " << h;
}

TEST(SnapkvSkvq, FactoryDispatch) {
  auto c = make_cache(both_cfg());
  EXPECT_EQ(c->method(), "snapkv+skvq");
  EXPECT_FALSE(c->is_trimmable());
}

// Prefill then decode: SnapKV alone and snapkv+skvq keep exactly the same positions, for
// key-proxy scoring, query scoring (GQA 2), pooling and keep-window.
TEST(SnapkvSkvq, KeepsExactlySnapkvPositions) {
  for (int variant = 0; variant < 4; ++variant) {
    CacheConfig cfg = both_cfg();
    if (variant == 1) cfg.snap_scoring = SnapScoring::kQuery;
    if (variant == 2) {
      cfg.snap_pool_kernel = 5;
      cfg.snap_pool = PoolKind::kAvg;
    }
    if (variant == 3) cfg.snap_keep_window = true;
    const Tensor k = rnd(2, 2, 240, 64, 10 + variant), v = rnd(2, 2, 240, 64, 20 + variant);
    const Tensor q = rnd(2, 4, 240, 64, 30 + variant, DType::kF32);
    auto snap = make_cache(as(cfg, "snapkv"));
    auto both = make_cache(cfg);
    auto call = [&](int64_t s0, int64_t s1) {
      const TensorView qv = q.view().slice_tokens(s0, s1);
      UpdateOptions o;
      o.queries = &qv;
      snap->update_and_fetch(k.view().slice_tokens(s0, s1), v.view().slice_tokens(s0, s1), o);
      both->update_and_fetch(k.view().slice_tokens(s0, s1), v.view().slice_tokens(s0, s1), o);
    };
    call(0, 200);
    expect_same_positions(*snap, *both, "after prefill, variant " + std::to_string(variant));
    auto* bc = dynamic_cast<SnapkvSkvqCache*>(both.get());
    EXPECT_GT(bc->packed_rows(), 0) << "the test must exercise packed rows";
    for (int64_t s = 200; s < 240; ++s) {
      call(s, s + 1);
      expect_same_positions(*snap, *both, "decode " + std::to_string(s));
    }
  }
}

// Chunked prefill while no stored row is packed (window larger than what survives): every
// selection scores the same full-precision keys, so positions match chunk after chunk.
TEST(SnapkvSkvq, ChunkedPrefillSamePositionsWhileNothingPacked) {
  CacheConfig cfg = both_cfg();
  cfg.snap_budget = 40;
  cfg.skvq_window = 128;
  const Tensor k = rnd(1, 3, 150, 64, 40), v = rnd(1, 3, 150, 64, 41);
  auto snap = make_cache(as(cfg, "snapkv"));
  auto both = make_cache(cfg);
  for (int64_t s = 0; s < 150; s += 50) {
    snap->update_and_fetch(k.view().slice_tokens(s, s + 50), v.view().slice_tokens(s, s + 50));
    both->update_and_fetch(k.view().slice_tokens(s, s + 50), v.view().slice_tokens(s, s + 50));
    expect_same_positions(*snap, *both, "chunk at " + std::to_string(s));
  }
}

// Every kept row holds exactly what SKVQ alone holds for its position: packed rows have the
// same code and metadata bytes (same permutations, per-row quantization), full-precision rows
// are the input rows.
TEST(SnapkvSkvq, KeptRowsDecodeAsSkvqAlone) {
  for (bool rotate : {false, true}) {
    CacheConfig cfg = both_cfg();
    if (rotate) {
      cfg.skvq_rotation = Rotation::kHadamard;
      cfg.skvq_rotate_values = true;
    }
    const Tensor k = rnd(1, 2, 230, 64, 50), v = rnd(1, 2, 230, 64, 51);
    auto both = std::make_unique<SnapkvSkvqCache>(cfg);
    auto alone = std::make_unique<SkvqCache>(as(cfg, "skvq"));
    both->update_and_fetch(k.view().slice_tokens(0, 200), v.view().slice_tokens(0, 200));
    alone->update_and_fetch(k.view().slice_tokens(0, 200), v.view().slice_tokens(0, 200));
    for (int64_t s = 200; s < 230; ++s) {
      both->update_and_fetch(k.view().slice_tokens(s, s + 1), v.view().slice_tokens(s, s + 1));
      alone->update_and_fetch(k.view().slice_tokens(s, s + 1), v.view().slice_tokens(s, s + 1));
    }
    EXPECT_EQ(both->key_perms(), alone->key_perms());
    const CacheView vb = both->stored_view(), va = alone->stored_view();
    int64_t checked_packed = 0, checked_fp = 0;
    for (int64_t h = 0; h < 2; ++h) {
      const auto pa = packed_records(va, 0, h);
      for (const auto& [pos, rec] : packed_records(vb, 0, h)) {
        if (pos >= alone->quantized_tokens()) continue;  // not yet flushed by SKVQ alone
        ASSERT_TRUE(pa.count(pos)) << "position " << pos;
        EXPECT_EQ(rec, pa.at(pos)) << "row at position " << pos << " head " << h;
        ++checked_packed;
      }
      for (const auto& [pos, bytes] : fp_rows_of(vb, 0, h)) {
        const size_t n = 64 * 2;
        EXPECT_EQ(std::memcmp(bytes.data(), k.view().row(0, h, pos), n), 0) << pos;
        EXPECT_EQ(std::memcmp(bytes.data() + n, v.view().row(0, h, pos), n), 0) << pos;
        ++checked_fp;
      }
    }
    EXPECT_GT(checked_packed, 50);
    EXPECT_GT(checked_fp, 4);
  }
}

// A later eviction keeps packed rows as they are (codes copied, never re-quantized), and heads
// that kept fewer packed rows get their oldest kept full-precision rows quantized so that every
// head holds the same packed count (rectangular storage).
TEST(SnapkvSkvq, EvictionKeepsCodesAndEqualisesPackedCounts) {
  CacheConfig cfg = both_cfg();
  cfg.snap_budget = 48;
  const Tensor k = rnd(1, 4, 400, 64, 60), v = rnd(1, 4, 400, 64, 61);
  auto c = std::make_unique<SnapkvSkvqCache>(cfg);
  auto alone = std::make_unique<SkvqCache>(as(cfg, "skvq"));
  alone->update_and_fetch(k.view(), v.view());
  c->update_and_fetch(k.view().slice_tokens(0, 100), v.view().slice_tokens(0, 100));
  for (int64_t s = 100; s < 140; ++s)
    c->update_and_fetch(k.view().slice_tokens(s, s + 1), v.view().slice_tokens(s, s + 1));
  ASSERT_GT(c->packed_rows(), 0);
  std::vector<std::map<int32_t, std::string>> before(4);
  for (int64_t h = 0; h < 4; ++h) before[h] = packed_records(c->stored_view(), 0, h);
  c->update_and_fetch(k.view().slice_tokens(140, 200), v.view().slice_tokens(140, 200));
  std::set<int64_t> kept_counts;
  for (int64_t h = 0; h < 4; ++h) {
    const auto after = packed_records(c->stored_view(), 0, h);
    EXPECT_EQ(static_cast<int64_t>(after.size()), c->packed_rows()) << "rectangular";
    int64_t kept_packed = 0;
    for (const auto& [pos, rec] : after) {
      if (before[h].count(pos)) {
        EXPECT_EQ(rec, before[h].at(pos)) << "kept packed row re-quantized at " << pos;
        ++kept_packed;
      }
    }
    kept_counts.insert(kept_packed);
    // Early-quantized rows hold SKVQ alone's codes for their positions.
    const auto pa = packed_records(alone->stored_view(), 0, h);
    for (const auto& [pos, rec] : after)
      if (!before[h].count(pos) && pa.count(pos)) {
        EXPECT_EQ(rec, pa.at(pos)) << pos;
      }
  }
  EXPECT_GT(kept_counts.size(), 1u) << "heads should have kept different packed counts here";
  // Packed count = the largest kept count (P), plus whole windows flushed after the eviction.
  EXPECT_GE(c->packed_rows(), *kept_counts.rbegin());
  EXPECT_EQ((c->packed_rows() - *kept_counts.rbegin()) % 16, 0);
}

// The view returned by an evicting call is stored ++ new, un-evicted, and reading it after the
// call (eviction and flush already done) still gives exactly those rows.
TEST(SnapkvSkvq, ReturnedViewUntouchedByFollowingEviction) {
  CacheConfig cfg = both_cfg();
  const Tensor k = rnd(1, 2, 300, 64, 70), v = rnd(1, 2, 300, 64, 71);
  auto c = std::make_unique<SnapkvSkvqCache>(cfg);
  c->update_and_fetch(k.view().slice_tokens(0, 150), v.view().slice_tokens(0, 150));
  const CacheView stored = c->stored_view();
  const auto dense_before = dequantize_view(stored);
  std::vector<std::vector<float>> rows_before;
  for (const auto& seg : dense_before.view.segments)
    for (int64_t i = 0; i < seg.n_rows; ++i) {
      std::vector<float> r(64);
      for (int64_t ch = 0; ch < 64; ++ch) r[ch] = seg.keys.at(0, 1, i, ch);
      rows_before.push_back(r);
    }
  const int64_t n_before = c->stored_rows();
  const CacheView view =
      c->update_and_fetch(k.view().slice_tokens(150, 300), v.view().slice_tokens(150, 300));
  EXPECT_EQ(view.n_rows(), n_before + 150);
  EXPECT_EQ(c->stored_rows(), 64);
  const auto dense = dequantize_view(view);
  int64_t j = 0;
  for (const auto& seg : dense.view.segments)
    for (int64_t i = 0; i < seg.n_rows; ++i, ++j) {
      const int32_t pos = seg.position(0, 1, i, 2);
      for (int64_t ch = 0; ch < 64; ++ch) {
        const float x = seg.keys.at(0, 1, i, ch);
        if (j < n_before)
          ASSERT_EQ(x, rows_before[j][ch]) << "stored row " << j;
        else
          ASSERT_EQ(x, k.at(0, 1, pos, ch)) << "new row at " << pos;
      }
    }
}

// Flush frontier: after every call fewer than window + recent full-precision rows remain beyond
// the sinks, and the flush never touches this call's rows in the returned view.
TEST(SnapkvSkvq, FlushFrontier) {
  for (int64_t recent : {0, 5}) {
    CacheConfig cfg = both_cfg();
    cfg.skvq_recent = recent;
    const Tensor k = rnd(1, 2, 260, 64, 80), v = rnd(1, 2, 260, 64, 81);
    auto c = std::make_unique<SnapkvSkvqCache>(cfg);
    c->update_and_fetch(k.view().slice_tokens(0, 100), v.view().slice_tokens(0, 100));
    for (int64_t s = 100; s < 260; ++s) {
      const CacheView view =
          c->update_and_fetch(k.view().slice_tokens(s, s + 1), v.view().slice_tokens(s, s + 1));
      const int64_t tail = c->fp_rows() - 4;
      ASSERT_LT(tail, 16 + recent) << s;
      ASSERT_GE(tail, recent) << s;
      EXPECT_EQ(view.segments.back().packed, nullptr);
      EXPECT_EQ(c->packed_rows() % 16, 0) << "decode-era flushes pack whole windows";
    }
  }
}

// Resident bytes ~ kept rows x packed row size: after a long prefill and one decode step (the
// view's retired buffers are gone), resident = packed rows x (K and V record bytes + a 4-byte
// position) + full-precision rows x (K and V bytes + position) per (b, h), plus at most the tail
// buffer's slack (16 rows) and 8 KiB of bookkeeping.
TEST(SnapkvSkvq, ResidentBytesFollowKeptRows) {
  CacheConfig cfg = both_cfg();
  cfg.head_dim = 128;
  cfg.snap_budget = 2048;
  cfg.skvq_window = 128;
  cfg.skvq_group_size = 32;
  const int64_t h = 8, d = 128;
  const Tensor k = rnd(1, h, 8193, d, 90), v = rnd(1, h, 8193, d, 91);
  auto c = std::make_unique<SnapkvSkvqCache>(cfg);
  c->update_and_fetch(k.view().slice_tokens(0, 8192), v.view().slice_tokens(0, 8192));
  c->update_and_fetch(k.view().slice_tokens(8192, 8193), v.view().slice_tokens(8192, 8193));
  const PackedRowFormat fk = make_row_format(d, 2, 32, MetaType::kF16);
  const int64_t packed = c->packed_rows(), fp = c->fp_rows();
  const int64_t formula = h * (packed * (2 * fk.row_stride + 4) + fp * (2 * d * 2 + 4));
  const int64_t resident = c->stats().bytes_resident;
  std::printf("[snapkv+skvq] packed %lld fp %lld rows/head: formula %lld resident %lld\n",
              (long long)packed, (long long)fp, (long long)formula, (long long)resident);
  EXPECT_GE(resident, formula);
  EXPECT_LE(resident, 1.05 * formula + 16 * h * (2 * d * 2 + 4) + 8192);
  EXPECT_EQ(c->stored_rows(), 2049);
  EXPECT_LT(resident, 0.2 * (8193.0 * h * d * 2 * 2)) << "vs a full fp16 cache";
}

TEST(SnapkvSkvq, FiguresAndMask) {
  auto c = std::make_unique<SnapkvSkvqCache>(both_cfg());
  const Tensor k = rnd(1, 2, 100, 64, 95), v = rnd(1, 2, 100, 64, 96);
  c->update_and_fetch(k.view(), v.view());
  const CacheStats st = c->stats();
  EXPECT_EQ(st.figure("tokens_total"), 200);
  EXPECT_EQ(st.figure("tokens_kept"), 128);
  EXPECT_DOUBLE_EQ(st.figure("keep_rate"), 0.64);
  EXPECT_EQ(st.figure("packed_rows") + st.figure("fp_rows"), 64);
  EXPECT_EQ(st.bytes_accounted, st.figure("compressed_key_bytes") +
                                    st.figure("compressed_value_bytes") +
                                    st.figure("residual_fp16_bytes") + st.figure("perm_bytes"));
  EXPECT_EQ(st.figure("assigned_avg_bits"), 4.0);  // 2 bits + 2 x 16 / 16 metadata
  const Mask m = c->make_mask(3);
  EXPECT_EQ(m.kind, Mask::Kind::kExplicit);
  EXPECT_EQ(m.n_keys, 67);
}

// Full-precision rows follow snap_dtype: bf16 stays bf16, fp16 and fp32 input are held in fp16.
TEST(SnapkvSkvq, StorageDtypeFollowsSnapDtype) {
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    auto c = std::make_unique<SnapkvSkvqCache>(both_cfg());
    const Tensor k = rnd(1, 2, 40, 64, 120, t);
    const CacheView view = c->update_and_fetch(k.view(), k.view());
    const DType want = t == DType::kBF16 ? DType::kBF16 : DType::kF16;
    EXPECT_EQ(c->storage_dtype(), want);
    for (const auto& seg : view.segments) {
      if (!seg.packed) {
        EXPECT_EQ(seg.keys.dtype, want);
      }
    }
  }
}

TEST(SnapkvSkvq, SaveLoadContinuesBitIdentically) {
  CacheConfig cfg = both_cfg();
  const Tensor k = rnd(2, 2, 260, 64, 100), v = rnd(2, 2, 260, 64, 101);
  auto a = std::make_unique<SnapkvSkvqCache>(cfg);
  a->update_and_fetch(k.view().slice_tokens(0, 150), v.view().slice_tokens(0, 150));
  for (int64_t s = 150; s < 170; ++s)
    a->update_and_fetch(k.view().slice_tokens(s, s + 1), v.view().slice_tokens(s, s + 1));
  auto b = std::make_unique<SnapkvSkvqCache>(cfg);
  std::istringstream in(state_of(*a));
  b->load(in);
  EXPECT_EQ(state_of(*a), state_of(*b));
  for (auto [s0, s1] :
       {std::pair<int64_t, int64_t>{170, 171}, {171, 230}, {230, 231}, {231, 260}}) {
    a->update_and_fetch(k.view().slice_tokens(s0, s1), v.view().slice_tokens(s0, s1));
    b->update_and_fetch(k.view().slice_tokens(s0, s1), v.view().slice_tokens(s0, s1));
  }
  EXPECT_EQ(state_of(*a), state_of(*b));
  // Refusals leave the cache as it was.
  const std::string good = state_of(*a), b_state = state_of(*b);
  std::istringstream trunc(good.substr(0, good.size() - 9));
  EXPECT_THROW(b->load(trunc), Error);
  CacheConfig other = cfg;
  other.snap_budget = 65;
  auto o = std::make_unique<SnapkvSkvqCache>(other);
  std::istringstream in2(good);
  try {
    o->load(in2);
    ADD_FAILURE() << "another budget's state accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("snap_budget"), std::string::npos) << e.what();
  }
  EXPECT_EQ(state_of(*b), b_state);
}

TEST(SnapkvSkvq, RefusalsChangeNothing) {
  CacheConfig cfg = both_cfg();
  cfg.skvq_max_ctx = 100;
  auto c = std::make_unique<SnapkvSkvqCache>(cfg);
  const Tensor k = rnd(1, 2, 101, 64, 110), v = rnd(1, 2, 101, 64, 111);
  c->update_and_fetch(k.view().slice_tokens(0, 90), v.view().slice_tokens(0, 90));
  const std::string before = state_of(*c);
  try {
    c->update_and_fetch(k.view().slice_tokens(90, 101), v.view().slice_tokens(90, 101));
    ADD_FAILURE() << "max_ctx passed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("skvq_max_ctx"), std::string::npos);
  }
  EXPECT_THROW(c->trim(1), Error);
  EXPECT_THROW(merge_batch({c.get()}), Error);
  const Tensor bad = rnd(1, 3, 2, 64, 112);
  EXPECT_THROW(c->update_and_fetch(bad.view(), bad.view()), Error);
  EXPECT_EQ(state_of(*c), before);
  CacheConfig odd = both_cfg();
  odd.head_dim = 63;
  odd.skvq_rotation = Rotation::kHadamard;
  EXPECT_THROW(make_snapkv_skvq_cache(odd), Error);
  CacheConfig bad_budget = both_cfg();
  bad_budget.snap_budget = 0;
  try {
    (void)make_snapkv_skvq_cache(bad_budget);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("snap_budget"), std::string::npos);
  }
}

// snap_evict_at = prompt_end: a prompt in chunks stays at full precision and unevicted until
// the prompt ends, then stores exactly what the default schedule stores after the prompt in one
// call (same selection over the same full-precision frame, then the same flush): positions,
// packed records and full-precision rows, bit for bit; and the positions of SnapKV alone.
TEST(SnapkvSkvq, PromptEndChunkedEqualsOneShot) {
  for (int variant = 0; variant < 2; ++variant) {
    CacheConfig cfg = both_cfg();
    if (variant == 1) {
      cfg.snap_scoring = SnapScoring::kQuery;
      cfg.snap_pool_kernel = 5;
    }
    CacheConfig pe = cfg;
    pe.snap_evict_at = SnapEvictAt::kPromptEnd;
    const Tensor k = rnd(2, 2, 203, 64, 40 + variant), v = rnd(2, 2, 203, 64, 50 + variant);
    const Tensor q = rnd(2, 4, 203, 64, 60 + variant, DType::kF32);
    auto one = make_cache(cfg), chunked = make_cache(pe), snap = make_cache(as(pe, "snapkv"));
    auto call = [&](KVCache& c, int64_t s0, int64_t s1) {
      const TensorView qv = q.view().slice_tokens(s0, s1);
      UpdateOptions o;
      o.queries = &qv;
      return c.update_and_fetch(k.view().slice_tokens(s0, s1), v.view().slice_tokens(s0, s1), o);
    };
    call(*one, 0, 200);
    for (auto [s0, s1] : {std::pair<int64_t, int64_t>{0, 60}, {60, 130}, {130, 200}}) {
      call(*chunked, s0, s1);
      call(*snap, s0, s1);
    }
    auto* cc = dynamic_cast<SnapkvSkvqCache*>(chunked.get());
    EXPECT_TRUE(cc->eviction_pending());
    EXPECT_EQ(cc->packed_rows(), 0);  // nothing packed or evicted while the prompt is open
    EXPECT_EQ(cc->stored_rows(), 200);
    chunked->end_prompt();
    EXPECT_GT(cc->packed_rows(), 0) << "the test must exercise packed rows";
    expect_same_positions(*one, *chunked, "variant " + std::to_string(variant));
    // snap ends its prompt at its first decode step.
    for (int64_t s = 200; s < 203; ++s) {
      const CacheView va = call(*one, s, s + 1);
      const CacheView vb = call(*chunked, s, s + 1);
      call(*snap, s, s + 1);
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t h = 0; h < 2; ++h) {
          EXPECT_EQ(packed_records(va, b, h), packed_records(vb, b, h));
          EXPECT_EQ(fp_rows_of(va, b, h), fp_rows_of(vb, b, h));
        }
      expect_same_positions(*snap, *chunked, "snapkv alone, step " + std::to_string(s));
    }
  }
}

// both_cfg() scored by the real queries, evicting at the end of the prompt.
CacheConfig prompt_end_cfg() {
  CacheConfig cfg = both_cfg();
  cfg.snap_scoring = SnapScoring::kQuery;
  cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
  return cfg;
}

// A prompt chunk of s rows [1, 2, s, 64] with its queries: keys, values and queries drawn from
// seeds seed, seed + 1, seed + 2 (the same chunk for the same seed).
void prompt_chunk(KVCache& c, int64_t s, uint64_t seed) {
  const Tensor k = rnd(1, 2, s, 64, seed), v = rnd(1, 2, s, 64, seed + 1);
  const Tensor q = rnd(1, 2, s, 64, seed + 2, DType::kF32);
  const TensorView qv = q.view();
  UpdateOptions o;
  o.queries = &qv;
  c.update_and_fetch(k.view(), v.view(), o);
}

TEST(SnapkvSkvq, PromptEndPendingSurvivesSaveLoadAndMaskCountsSurvivors) {
  const CacheConfig cfg = prompt_end_cfg();
  auto a = make_cache(cfg), b = make_cache(cfg);
  prompt_chunk(*a, 150, 70);
  EXPECT_EQ(a->make_mask(1).n_keys, cfg.snap_budget + 1);
  EXPECT_THROW(a->make_mask(1, 32), Error);
  std::istringstream in(state_of(*a));
  b->load(in);
  a->end_prompt();
  b->end_prompt();
  EXPECT_EQ(state_of(*a), state_of(*b));
  EXPECT_EQ(a->stored_rows(), cfg.snap_budget);
}

// A first prompt chunk shorter than the sink count leaves every row (and so every window query
// row) among the sinks with an empty tail: the saved state must load, and both caches must go on
// bit for bit (found by the GPU cache's state exchange test).
TEST(SnapkvSkvq, PromptEndChunkInsideSinksSurvivesSaveLoad) {
  const CacheConfig cfg = prompt_end_cfg();
  auto a = make_cache(cfg), b = make_cache(cfg);
  prompt_chunk(*a, 3, 80);
  std::istringstream in(state_of(*a));
  ASSERT_NO_THROW(b->load(in));
  EXPECT_EQ(state_of(*a), state_of(*b));
  prompt_chunk(*a, 120, 83);
  prompt_chunk(*b, 120, 83);
  a->end_prompt();
  b->end_prompt();
  EXPECT_EQ(state_of(*a), state_of(*b));
  EXPECT_EQ(a->stored_rows(), cfg.snap_budget);
}

// ---- issue 17: bounded settings and clear settings messages --------------------------------

TEST(SnapkvSkvq, RecentPastTheCapRefusedAtConstruction) {
  // recent=9223372036854775807 made window + recent wrap: the flush read past the tail (SIGSEGV).
  CacheConfig cfg = both_cfg();
  cfg.skvq_recent = std::numeric_limits<int64_t>::max();
  try {
    SnapkvSkvqCache c(cfg);
    ADD_FAILURE() << "skvq_recent INT64_MAX accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("skvq_recent: expected <= 2147483647"), std::string::npos)
        << e.what();
  }
  cfg.skvq_recent = kMaxCacheRows + 1;
  EXPECT_THROW(make_snapkv_skvq_cache(cfg), Error);
  CacheConfig big_budget = both_cfg();
  big_budget.snap_budget = std::numeric_limits<int64_t>::max();
  EXPECT_THROW(make_snapkv_skvq_cache(big_budget), Error);
}

TEST(SnapkvSkvq, RecentAtTheCapKeepsTheTailFullPrecision) {
  CacheConfig cfg = both_cfg();
  cfg.skvq_recent = kMaxCacheRows;
  auto c = std::make_unique<SnapkvSkvqCache>(cfg);
  const Tensor k = rnd(1, 2, 100, 64, 140), v = rnd(1, 2, 100, 64, 141);
  c->update_and_fetch(k.view(), v.view());
  for (int64_t i = 0; i < 20; ++i) {
    const Tensor kd = rnd(1, 2, 1, 64, 150 + i);
    c->update_and_fetch(kd.view(), kd.view());
  }
  EXPECT_EQ(c->offset(), 120);
  EXPECT_EQ(c->stored_rows(), 64 + 20);  // budget after the prompt, then every decode row
  EXPECT_EQ(c->stats().figure("packed_rows"), 0);
}

TEST(SnapkvSkvq, StateOfOtherSettingsNamesTheSettingAsWritten) {
  const Tensor k = rnd(1, 2, 80, 64, 160), v = rnd(1, 2, 80, 64, 161);
  struct Case {
    std::function<void(CacheConfig&)> saved;
    const char* method;
    const char* message;
  };
  const Case cases[] = {
      {[](CacheConfig& c) { c.snap_budget = 65; }, "snapkv+skvq",
       "[snapkv+skvq] state was saved with snap_budget=65 but this cache has 64; nothing was "
       "changed"},
      {[](CacheConfig& c) { c.snap_pool = PoolKind::kAvg; }, "snapkv+skvq",
       "[snapkv+skvq] state was saved with snap_pool=avg but this cache has max; nothing was "
       "changed"},
      {[](CacheConfig& c) { c.skvq_bits_value = 4; }, "snapkv+skvq",
       "[snapkv+skvq] state was saved with skvq_bits_value=4 but this cache has 2; nothing was "
       "changed"},
      {[](CacheConfig& c) { c.snap_budget = 65; }, "snapkv",
       "[snapkv] state was saved with snap_budget=65 but this cache has 64; nothing was changed"},
      {[](CacheConfig& c) { c.snap_scoring = SnapScoring::kQuery; }, "snapkv",
       "[snapkv] state was saved with snap_scoring=query but this cache has key_proxy; nothing was "
       "changed"},
      {[](CacheConfig& c) { c.snap_keep_window = true; }, "snapkv",
       "[snapkv] state was saved with snap_keep_window=true but this cache has false; nothing was "
       "changed"},
  };
  for (const auto& cs : cases) {
    CacheConfig saved = as(both_cfg(), cs.method), mine = as(both_cfg(), cs.method);
    cs.saved(saved);
    auto a = make_cache(saved), b = make_cache(mine);
    a->update_and_fetch(k.view(), v.view());
    const std::string before = state_of(*b);
    try {
      std::istringstream in(state_of(*a));
      b->load(in);
      ADD_FAILURE() << cs.message;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), cs.message);
    }
    EXPECT_EQ(state_of(*b), before);
  }
}

}  // namespace
}  // namespace vq
