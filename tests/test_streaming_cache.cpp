// Tests of the StreamingLLM baseline cache (veloxquant/streaming_cache.h): the deferred contract
// against an independent row-by-row model (history of every input row; expected store = first
// n_sink positions + last window positions), the sliding window during decode, metamorphic
// checks (window >= length == full cache bit for bit; chunked prefill == one-shot prefill for the
// stored state; attention over the view == attention over the full cache restricted to the kept
// positions), bounded memory over a long decode, figures, masks, refusals and save/load.
// Blocks are [B, H, S, D] fp16 unless a test says otherwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <sstream>
#include <vector>

#include "util/test_util.h"
#include "veloxquant/attention.h"
#include "veloxquant/builder.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/streaming_cache.h"

namespace vq {
namespace {

CacheConfig stream_cfg(int64_t n_sink, int64_t window) {
  CacheConfig c;
  c.method = "streaming";
  c.streaming_n_sink = n_sink;
  c.streaming_window = window;
  return c;
}

Tensor rnd(int64_t b, int64_t h, int64_t s, int64_t d, uint64_t seed, DType t = DType::kF16) {
  return test::random_tensor(t, b, h, s, d, seed);
}

using test::bits_at;
using test::HeadRows;
using test::view_head;

// Independent model: every row ever appended, per (b, h), indexed by position; the expected
// store after a step is {0 .. n_sink-1} ∪ {offset-window .. offset-1} (clipped to seen rows).
struct Model {
  int64_t B, H, D, n_sink, window;
  std::vector<std::vector<uint16_t>> k, v;  // [B*H] -> [positions * D]
  std::vector<int32_t> stored;              // positions stored after the last step
  int64_t offset = 0;

  Model(int64_t b, int64_t h, int64_t d, int64_t ns, int64_t w)
      : B(b), H(h), D(d), n_sink(ns), window(w), k(b * h), v(b * h) {}

  // Appends the block and returns the expected view of (b, h) = stored ++ new.
  std::vector<HeadRows> step(const Tensor& keys, const Tensor& values) {
    const int64_t s = keys.shape()[2];
    std::vector<int32_t> view_pos = stored;
    for (int64_t i = 0; i < s; ++i) view_pos.push_back(static_cast<int32_t>(offset + i));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < s; ++i)
          for (int64_t c = 0; c < D; ++c) {
            k[b * H + h].push_back(bits_at(keys.view(), b, h, i, c));
            v[b * H + h].push_back(bits_at(values.view(), b, h, i, c));
          }
    offset += s;
    std::vector<HeadRows> out;
    for (int64_t bh = 0; bh < B * H; ++bh) {
      HeadRows r;
      r.pos = view_pos;
      for (int32_t p : view_pos)
        for (int64_t c = 0; c < D; ++c) {
          r.k.push_back(k[bh][p * D + c]);
          r.v.push_back(v[bh][p * D + c]);
        }
      out.push_back(r);
    }
    stored.clear();
    for (int64_t p = 0; p < offset; ++p)
      if (p < n_sink || p >= offset - window) stored.push_back(static_cast<int32_t>(p));
    return out;
  }
};

void run_sequence(int64_t B, int64_t H, int64_t D, int64_t n_sink, int64_t window,
                  const std::vector<int64_t>& chunks, uint64_t seed) {
  StreamingCache cache(stream_cfg(n_sink, window));
  Model model(B, H, D, n_sink, window);
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const Tensor k = rnd(B, H, chunks[ci], D, seed + 2 * ci);
    const Tensor v = rnd(B, H, chunks[ci], D, seed + 2 * ci + 1);
    const CacheView view = cache.update_and_fetch(k.view(), v.view());
    const auto want = model.step(k, v);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        ASSERT_EQ(view_head(view, b, h), want[b * H + h])
            << "call " << ci << " (S=" << chunks[ci] << ") b=" << b << " h=" << h;
    ASSERT_EQ(cache.offset(), model.offset);
    ASSERT_EQ(cache.stored_rows(), static_cast<int64_t>(model.stored.size()));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(cache.stored_positions(b, h), model.stored);
  }
}

TEST(StreamingCache, DeferredContractWorkedSequence) {
  // n_sink 2, window 5: a 10-token prefill returns all 10 rows, then stores {0,1,5..9}; a chunk
  // of 4 returns those 7 ++ 4 new, then stores {0,1,9..13}; a decode returns 8 rows and slides.
  StreamingCache c(stream_cfg(2, 5));
  const Tensor k = rnd(1, 1, 10, 4, 1), v = rnd(1, 1, 10, 4, 2);
  EXPECT_EQ(c.update_and_fetch(k.view(), v.view()).n_rows(), 10);
  EXPECT_EQ(c.stored_positions(0, 0), (std::vector<int32_t>{0, 1, 5, 6, 7, 8, 9}));
  const Tensor k2 = rnd(1, 1, 4, 4, 3), v2 = rnd(1, 1, 4, 4, 4);
  EXPECT_EQ(c.update_and_fetch(k2.view(), v2.view()).n_rows(), 11);
  EXPECT_EQ(c.stored_positions(0, 0), (std::vector<int32_t>{0, 1, 9, 10, 11, 12, 13}));
  const Tensor k3 = rnd(1, 1, 1, 4, 5), v3 = rnd(1, 1, 1, 4, 6);
  EXPECT_EQ(c.update_and_fetch(k3.view(), v3.view()).n_rows(), 8);
  EXPECT_EQ(c.stored_positions(0, 0), (std::vector<int32_t>{0, 1, 10, 11, 12, 13, 14}));
  EXPECT_EQ(c.offset(), 15);
}

TEST(StreamingCache, CallSequencesMatchTheModel) {
  // Awkward chunk lengths, sinks filling across calls, decode slides, B and H > 1.
  run_sequence(1, 1, 8, 4, 6, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 10);
  run_sequence(2, 3, 16, 4, 7, {3, 17, 1, 1, 2, 31, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 20);
  run_sequence(1, 2, 8, 0, 3, {5, 1, 1, 4, 1, 1, 1, 1}, 30);    // no sinks
  run_sequence(1, 2, 8, 10, 3, {2, 3, 1, 9, 1, 1, 1, 1}, 40);   // sinks > first chunks
  run_sequence(2, 2, 8, 3, 1, {1, 1, 1, 1, 6, 1, 1, 1}, 50);    // window of one row
  run_sequence(1, 1, 4, 4, 300, {129, 1, 127, 1, 1, 200}, 60);  // crosses the steady capacity
}

TEST(StreamingCache, WindowCoveringEverythingEqualsFullCacheBitForBit) {
  // Metamorphic: with sinks + window >= every position seen, nothing is evicted and each view
  // holds the same positions and bits as the full cache's (fp16 input, fp16 storage in both).
  StreamingCache s(stream_cfg(4, 100));
  FullCache f;
  const std::vector<int64_t> chunks = {7, 1, 1, 33, 1, 2, 1};
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Tensor k = rnd(2, 2, chunks[i], 8, 100 + i), v = rnd(2, 2, chunks[i], 8, 200 + i);
    const CacheView vs = s.update_and_fetch(k.view(), v.view());
    const CacheView vf = f.update_and_fetch(k.view(), v.view());
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 2; ++h) ASSERT_EQ(view_head(vs, b, h), view_head(vf, b, h));
    EXPECT_EQ(vs.segments.size(), 1u);  // contiguous: one implicit run from position 0
  }
}

TEST(StreamingCache, ChunkedPrefillStoresWhatOneShotStores) {
  // Metamorphic: the store after a prompt depends only on the positions seen, not the chunking.
  const Tensor k = rnd(1, 2, 90, 8, 7), v = rnd(1, 2, 90, 8, 8);
  StreamingCache one(stream_cfg(4, 20)), chunked(stream_cfg(4, 20));
  one.update_and_fetch(k.view(), v.view());
  for (int64_t s0 = 0; s0 < 90; s0 += 32) {
    const int64_t s1 = std::min<int64_t>(90, s0 + 32);
    chunked.update_and_fetch(k.view().slice_tokens(s0, s1), v.view().slice_tokens(s0, s1));
  }
  const Tensor k1 = rnd(1, 2, 1, 8, 9), v1 = rnd(1, 2, 1, 8, 10);
  const CacheView a = one.update_and_fetch(k1.view(), v1.view());
  const CacheView b = chunked.update_and_fetch(k1.view(), v1.view());
  for (int64_t h = 0; h < 2; ++h) EXPECT_EQ(view_head(a, 0, h), view_head(b, 0, h));
}

TEST(StreamingCache, AttentionOverViewEqualsFullCacheRestrictedToKeptRows) {
  // After a prefill and some decode steps, the decode attention over the streaming view equals
  // the reference attention over a full cache holding only the kept positions plus the new row
  // (same rows, same per-row positions, same order): the result must be bit-identical, as both
  // are the same deterministic reference computation over identical inputs.
  const int64_t B = 1, H = 2, Hq = 4, D = 16, n_sink = 3, window = 9;
  StreamingCache s(stream_cfg(n_sink, window));
  FullCache f;
  const Tensor k = rnd(B, H, 40, D, 11), v = rnd(B, H, 40, D, 12);
  s.update_and_fetch(k.view(), v.view());
  f.update_and_fetch(k.view(), v.view());
  for (int step = 0; step < 5; ++step) {
    const Tensor kd = rnd(B, H, 1, D, 20 + step), vd = rnd(B, H, 1, D, 40 + step);
    const Tensor q = rnd(B, Hq, 1, D, 60 + step, DType::kF32);
    AttentionParams p;
    p.q_pos0 = s.offset();
    const CacheView vs = s.update_and_fetch(kd.view(), vd.view());
    const CacheView vf = f.update_and_fetch(kd.view(), vd.view());
    // Restrict the full view to the streaming view's positions (one segment per kept run).
    const std::vector<int32_t> keep = view_head(vs, 0, 0).pos;
    CacheView sub;
    sub.batch = B;
    sub.n_kv_heads = H;
    sub.head_dim = D;
    size_t i = 0;
    while (i < keep.size()) {
      size_t j = i + 1;
      while (j < keep.size() && keep[j] == keep[j - 1] + 1) ++j;
      ViewSegment seg;
      seg.n_rows = static_cast<int64_t>(j - i);
      seg.first_pos = keep[i];
      seg.keys = vf.segments[0].keys.slice_tokens(keep[i], keep[i] + seg.n_rows);
      seg.values = vf.segments[0].values.slice_tokens(keep[i], keep[i] + seg.n_rows);
      sub.segments.push_back(seg);
      i = j;
    }
    std::vector<float> out_s(static_cast<size_t>(B * Hq * D)), out_f(out_s.size());
    attention_reference(q.view(), vs, p, out_s.data());
    attention_reference(q.view(), sub, p, out_f.data());
    EXPECT_EQ(out_s, out_f) << "step " << step;
    EXPECT_EQ(static_cast<int64_t>(keep.size()), n_sink + window + 1);
  }
}

TEST(StreamingCache, LongDecodeKeepsBudgetAndBoundedMemory) {
  // 3000 decode steps: the store never exceeds sinks + window, the buffer never grows past the
  // steady capacity, and every step's view is budget + 1 rows (this step's row included).
  StreamingCache c(stream_cfg(4, 60));
  const Tensor k = rnd(1, 2, 1, 8, 3), v = rnd(1, 2, 1, 8, 4);
  int64_t max_cap = 0;
  for (int i = 0; i < 3000; ++i) {
    const CacheView view = c.update_and_fetch(k.view(), v.view());
    ASSERT_EQ(view.n_rows(), std::min<int64_t>(i + 1, 65));
    ASSERT_EQ(c.stored_rows(), std::min<int64_t>(i + 1, 64));
    max_cap = std::max(max_cap, c.capacity());
  }
  // steady = round_up(4 + 60 + max(64, round_up(15, 64)), 64) = 128 rows.
  EXPECT_EQ(max_cap, 128);
  const CacheStats st = c.stats();
  EXPECT_EQ(st.bytes_resident, 2 * 128 * 2 * 8 * 2);  // K and V, H=2, D=8, 2 bytes
  EXPECT_EQ(c.stored_positions(0, 0).front(), 0);
  EXPECT_EQ(c.stored_positions(0, 0).back(), 2999);
}

TEST(StreamingCache, PrefillGivesMemoryBackAfterTheNextCall) {
  // A 1000-row prefill needs a 1000-row buffer for its own view; after the step the survivors
  // move to a steady buffer and the big one is retired until the next mutating call.
  StreamingCache c(stream_cfg(4, 28));
  const Tensor k = rnd(1, 1, 1000, 8, 5), v = rnd(1, 1, 1000, 8, 6);
  c.update_and_fetch(k.view(), v.view());
  EXPECT_EQ(c.capacity(), 128);
  const int64_t steady_bytes = 2 * 128 * 8 * 2;
  EXPECT_GT(c.stats().bytes_resident, steady_bytes);  // the retired buffer is still held
  const Tensor k1 = rnd(1, 1, 1, 8, 7), v1 = rnd(1, 1, 1, 8, 8);
  c.update_and_fetch(k1.view(), v1.view());
  EXPECT_EQ(c.stats().bytes_resident, steady_bytes);
}

TEST(StreamingCache, WorkedByteFigures) {
  // B=1, H=2, D=128, 4 sinks + window 12, S=64: 16 rows kept of 64. Per K (or V): kept
  // 16 * 2 * 128 * 2 = 8192 bytes, full 64 * 512 = 32768; ratio 4.0, keep rate 0.25. A decode
  // step adds 512 bytes to the full figure and none to the kept one (the window slides).
  StreamingCache c(stream_cfg(4, 12));
  const Tensor k = rnd(1, 2, 64, 128, 1), v = rnd(1, 2, 64, 128, 2);
  c.update_and_fetch(k.view(), v.view());
  CacheStats st = c.stats();
  EXPECT_EQ(st.figure("kept_key_bytes"), 8192);
  EXPECT_EQ(st.figure("full_key_bytes"), 32768);
  EXPECT_EQ(st.figure("eviction_ratio"), 4.0);
  EXPECT_EQ(st.figure("keep_rate"), 0.25);
  EXPECT_EQ(st.bytes_accounted, 2 * 8192);
  EXPECT_EQ(st.fp16_bytes, 2 * 32768);
  EXPECT_EQ(st.rows_stored, 16);
  EXPECT_EQ(st.tokens_seen, 64);
  const Tensor k1 = rnd(1, 2, 1, 128, 3), v1 = rnd(1, 2, 1, 128, 4);
  c.update_and_fetch(k1.view(), v1.view());
  st = c.stats();
  EXPECT_EQ(st.figure("kept_key_bytes"), 8192);
  EXPECT_EQ(st.figure("full_key_bytes"), 32768 + 512);
}

TEST(StreamingCache, MaskMatchesPositions) {
  StreamingCache c(stream_cfg(2, 4));
  EXPECT_EQ(c.make_mask(3).kind, Mask::Kind::kCausal);  // empty cache
  const Tensor k = rnd(1, 2, 5, 4, 1), v = rnd(1, 2, 5, 4, 2);
  c.update_and_fetch(k.view(), v.view());  // stores 0..4: contiguous, nothing evicted
  EXPECT_EQ(c.make_mask(3).kind, Mask::Kind::kCausal);
  c.update_and_fetch(k.view(), v.view());  // stores {0, 1, 6..9}
  EXPECT_EQ(c.make_mask(1).kind, Mask::Kind::kNone);
  const Mask m = c.make_mask(2, 5);  // window 5: query 10 sees 6..10, query 11 sees 7..11
  ASSERT_EQ(m.kind, Mask::Kind::kExplicit);
  ASSERT_EQ(m.n_keys, 8);
  const std::vector<int32_t> pos = {0, 1, 6, 7, 8, 9, 10, 11};
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t j = 0; j < 8; ++j) {
        const int64_t q = 10 + i;
        EXPECT_EQ(m.visible(0, h, i, j), pos[j] <= q && q < pos[j] + 5) << i << " " << j;
      }
}

TEST(StreamingCache, Bf16StaysBf16AndF32StoresF16) {
  StreamingCache a(stream_cfg(1, 2)), b(stream_cfg(1, 2));
  const Tensor kb = rnd(1, 1, 3, 4, 1, DType::kBF16), vb = rnd(1, 1, 3, 4, 2, DType::kBF16);
  EXPECT_EQ(a.update_and_fetch(kb.view(), vb.view()).segments[0].keys.dtype, DType::kBF16);
  const Tensor kf = rnd(1, 1, 3, 4, 1, DType::kF32), vf = rnd(1, 1, 3, 4, 2, DType::kF32);
  const CacheView view = b.update_and_fetch(kf.view(), vf.view());
  EXPECT_EQ(view.segments[0].keys.dtype, DType::kF16);
  for (int64_t c = 0; c < 4; ++c)  // fp32 -> fp16 rounding, as fp16 storage must
    EXPECT_EQ(bits_at(view.segments[0].keys, 0, 0, 2, c), f32_to_fp16(kf.at(0, 0, 2, c)));
}

TEST(StreamingCache, TrimMergeAndBadInputRefusedNothingChanged) {
  StreamingCache c(stream_cfg(2, 3));
  const Tensor k = rnd(1, 2, 8, 4, 1), v = rnd(1, 2, 8, 4, 2);
  c.update_and_fetch(k.view(), v.view());
  const auto before = c.stored_positions(0, 1);
  EXPECT_FALSE(c.is_trimmable());
  EXPECT_THROW(c.trim(1), Error);
  EXPECT_THROW(merge_batch({&c, &c}), Error);
  const Tensor wrong_h = rnd(1, 3, 1, 4, 3);
  EXPECT_THROW(c.update_and_fetch(wrong_h.view(), wrong_h.view()), Error);
  const Tensor k1 = rnd(1, 2, 1, 4, 3), v2 = rnd(1, 2, 2, 4, 4);
  EXPECT_THROW(c.update_and_fetch(k1.view(), v2.view()), Error);  // K/V shapes differ
  EXPECT_EQ(c.offset(), 8);
  EXPECT_EQ(c.stored_positions(0, 1), before);
  EXPECT_THROW(StreamingCache(stream_cfg(-1, 3)), Error);
  EXPECT_THROW(StreamingCache(stream_cfg(1, 0)), Error);
  CacheConfig bad = stream_cfg(1, 0);
  EXPECT_THROW(make_cache(bad), Error);
}

TEST(StreamingCache, BuilderDispatchAndSpec) {
  const CacheConfig cfg = config_from_spec("streaming:n_sink=2:window=30");
  EXPECT_EQ(cfg.streaming_window, 30);
  auto caches = build_caches(ModelCacheShape{{2, 2}, {8, 16}}, cfg);
  ASSERT_EQ(caches.size(), 2u);
  auto* s = dynamic_cast<StreamingCache*>(caches[1].get());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->budget(), 32);
  EXPECT_EQ(s->method(), "streaming");
}

TEST(StreamingCache, SaveLoadContinuesBitIdentically) {
  StreamingCache a(stream_cfg(3, 10));
  const Tensor k = rnd(2, 2, 37, 8, 1), v = rnd(2, 2, 37, 8, 2);
  a.update_and_fetch(k.view(), v.view());
  for (int i = 0; i < 5; ++i) {
    const Tensor kd = rnd(2, 2, 1, 8, 10 + i), vd = rnd(2, 2, 1, 8, 20 + i);
    a.update_and_fetch(kd.view(), vd.view());
  }
  std::stringstream buf;
  a.save(buf);
  StreamingCache b(stream_cfg(3, 10));
  b.load(buf);
  EXPECT_EQ(b.offset(), a.offset());
  for (int i = 0; i < 20; ++i) {
    const Tensor kd = rnd(2, 2, i % 3 + 1, 8, 30 + i), vd = rnd(2, 2, i % 3 + 1, 8, 60 + i);
    const CacheView va = a.update_and_fetch(kd.view(), vd.view());
    const CacheView vb = b.update_and_fetch(kd.view(), vd.view());
    for (int64_t bb = 0; bb < 2; ++bb)
      for (int64_t h = 0; h < 2; ++h) ASSERT_EQ(view_head(va, bb, h), view_head(vb, bb, h));
  }
  // An empty cache round-trips too.
  std::stringstream empty;
  StreamingCache(stream_cfg(3, 10)).save(empty);
  StreamingCache e(stream_cfg(3, 10));
  e.load(empty);
  EXPECT_EQ(e.offset(), 0);
}

TEST(StreamingCache, CorruptTruncatedOrMismatchedFilesRefusedNothingChanged) {
  StreamingCache a(stream_cfg(2, 5));
  const Tensor k = rnd(1, 2, 12, 4, 1), v = rnd(1, 2, 12, 4, 2);
  a.update_and_fetch(k.view(), v.view());
  std::stringstream buf;
  a.save(buf);
  const std::string bytes = buf.str();

  StreamingCache target(stream_cfg(2, 5));
  const Tensor k2 = rnd(1, 2, 3, 4, 3);
  target.update_and_fetch(k2.view(), k2.view());
  const auto before = target.stored_positions(0, 1);
  auto refused = [&](const std::string& data, StreamingCache& c) {
    std::istringstream in(data);
    EXPECT_THROW(c.load(in), Error);
    EXPECT_EQ(c.offset(), 3);
    EXPECT_EQ(c.stored_positions(0, 1), before);
  };
  for (size_t i = 0; i < bytes.size(); i += 7) {  // flipped bytes: checksum or framing refuses
    std::string bad = bytes;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    refused(bad, target);
  }
  refused(bytes.substr(0, bytes.size() / 2), target);
  StreamingCache other(stream_cfg(2, 6));  // different window
  other.update_and_fetch(k2.view(), k2.view());
  std::istringstream in(bytes);
  EXPECT_THROW(other.load(in), Error);
  std::stringstream full_state;
  FullCache f;
  f.update_and_fetch(k2.view(), k2.view());
  f.save(full_state);
  refused(full_state.str(), target);  // another method's file
}

// ---- issue 17: memory follows the rows held; bounded windows; clear messages -----------------

TEST(StreamingCache, HugeWindowHoldsOnlyTheRowsSeen) {
  // A 10-token prompt under window=1000000 held the whole window (3.8 GB over a model's heads
  // and layers); the buffer now grows with the rows: 64 rows, then doubling while decoding.
  StreamingCache c(stream_cfg(4, 1000000));
  const Tensor k = rnd(1, 2, 10, 8, 1), v = rnd(1, 2, 10, 8, 2);
  c.update_and_fetch(k.view(), v.view());
  EXPECT_EQ(c.capacity(), 64);
  EXPECT_EQ(c.stats().bytes_resident, 2 * 2 * 64 * 8 * 2);  // K and V, H=2, 64 rows, D=8
  const Tensor k1 = rnd(1, 2, 1, 8, 3), v1 = rnd(1, 2, 1, 8, 4);
  int64_t copies = 0, last_cap = c.capacity();
  for (int i = 0; i < 1000; ++i) {
    c.update_and_fetch(k1.view(), v1.view());
    if (c.capacity() != last_cap) ++copies;
    last_cap = c.capacity();
    ASSERT_LE(c.capacity(), 2 * round_up(c.stored_rows(), StreamingCache::kRowStep));
  }
  EXPECT_EQ(c.stored_rows(), 1010);
  EXPECT_EQ(c.capacity(), 1024);
  EXPECT_EQ(copies, 4);  // 64 -> 128 -> 256 -> 512 -> 1024
  // The largest window the config allows: no allocation up front either.
  StreamingCache top(stream_cfg(4, kMaxCacheRows));
  top.update_and_fetch(k.view(), v.view());
  EXPECT_EQ(top.capacity(), 64);
  EXPECT_EQ(top.stored_rows(), 10);
}

TEST(StreamingCache, GrowthKeepsTheWindowSlidingAsBefore) {
  // A window that is reached by decoding (capacity below the steady size when the slide starts)
  // matches the row-by-row model, and ends at the steady capacity.
  run_sequence(1, 2, 4, 2, 150, std::vector<int64_t>(400, 1), 70);
  run_sequence(1, 1, 4, 3, 90, {5, 1, 1, 60, 1, 1, 1, 40, 1, 1, 200, 1, 1}, 80);
  StreamingCache c(stream_cfg(2, 150));
  const Tensor k = rnd(1, 1, 1, 4, 3);
  for (int i = 0; i < 1000; ++i) c.update_and_fetch(k.view(), k.view());
  EXPECT_EQ(c.capacity(), 256);  // round_up(2 + 150 + max(64, round_up(37, 64)), 64)
}

TEST(StreamingCache, WindowsPastTheCapAreRefused) {
  // window=4611686018427387904 sized a buffer with an overflowed product (heap corruption);
  // window=9223372036854775807 overflowed steady_capacity(). Both refused at construction.
  for (const int64_t w :
       {int64_t{4611686018427387904}, std::numeric_limits<int64_t>::max(), kMaxCacheRows + 1}) {
    try {
      StreamingCache c(stream_cfg(4, w));
      ADD_FAILURE() << "window " << w << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("streaming_window: expected <= 2147483647"),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW(make_cache(stream_cfg(4, w)), Error);
  }
  EXPECT_THROW(StreamingCache(stream_cfg(std::numeric_limits<int64_t>::max(), 8)), Error);
}

TEST(StreamingCache, AllocationFailureIsAnErrorNamingTheWindowAndChangesNothing) {
  // 2^24 heads x head_dim 2^24 (a stride-0 view: little real data) needs 2^55 bytes for 64 rows:
  // the allocation fails, and the failure is a vq::Error, not std::bad_alloc.
  StreamingCache c(stream_cfg(4, 100));
  std::vector<uint16_t> one_row(size_t{1} << 24, 0x3c00);
  TensorView huge;
  huge.data = one_row.data();
  huge.dtype = DType::kF16;
  huge.shape = {1, int64_t{1} << 24, 2, int64_t{1} << 24};
  huge.stride = {0, 0, 0, 1};
  try {
    c.update_and_fetch(huge, huge);
    ADD_FAILURE() << "a 2^55-byte buffer was allocated";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[streaming] streaming_window: expected memory for 64 rows", 0), 0u) << msg;
    EXPECT_NE(msg.find("failed"), std::string::npos) << msg;
  }
  EXPECT_EQ(c.offset(), 0);
  EXPECT_EQ(c.n_kv_heads(), 0);  // the failed first call fixed no shape
  const Tensor k = rnd(1, 2, 3, 4, 1), v = rnd(1, 2, 3, 4, 2);
  EXPECT_EQ(c.update_and_fetch(k.view(), v.view()).n_rows(), 3);
}

TEST(StreamingCache, StateOfOtherSettingsNamesTheSetting) {
  StreamingCache a(stream_cfg(2, 6));
  const Tensor k = rnd(1, 2, 12, 4, 1);
  a.update_and_fetch(k.view(), k.view());
  std::stringstream buf;
  a.save(buf);
  StreamingCache b(stream_cfg(2, 5));
  try {
    b.load(buf);
    ADD_FAILURE() << "another window's state accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[streaming] state was saved with streaming_window=6 but this cache has 5; nothing "
              "was changed");
  }
  // A loaded cache holds its rows, not the window's steady capacity.
  StreamingCache big(stream_cfg(2, 1000000)), big2(stream_cfg(2, 1000000));
  big.update_and_fetch(k.view(), k.view());
  std::stringstream st;
  big.save(st);
  big2.load(st);
  EXPECT_EQ(big2.capacity(), 64);
  EXPECT_EQ(big2.stored_rows(), 12);
}

}  // namespace
}  // namespace vq
