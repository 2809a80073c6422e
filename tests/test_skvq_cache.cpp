// Tests of the SKVQ cache (veloxquant/skvq_cache.h): the seed behaviours of
// the original SKVQ tests (docs/design.md §C7) (worked byte example, pass-through, whole-chunk
// frontier, exact sinks, quantized region, one-shot == token-by-token bit for bit, frozen chunks
// and permutations, reorder ablation, clip options, ratio at long context, max_ctx guard,
// build-time validation, not trimmable), real packed storage (resident vs accounted bytes,
// heap-measured), the options (skvq_recent, 1.5-bit values, calibrated permutation file, Hadamard
// rotation, metadata types) and save/load. Blocks are [B, H, S, D].
#include <gtest/gtest.h>
#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include "kv/skvq_store.h"
#include "util/test_util.h"
#include "veloxquant/binary_io.h"
#include "veloxquant/builder.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/packed.h"
#include "veloxquant/query_moments.h"
#include "veloxquant/skvq_cache.h"
#include "veloxquant/snapkv_skvq_cache.h"

namespace vq {
namespace {

CacheConfig small_cfg() {  // the seed tests' defaults
  CacheConfig c;
  c.method = "skvq";
  c.head_dim = 64;
  c.skvq_window = 16;
  c.skvq_n_sink = 4;
  c.skvq_group_size = 16;
  c.skvq_bits_key = 2;
  c.skvq_bits_value = 2;
  return c;
}

// N(0,1) with heterogeneous channel scales (some channels 20x): what reordering is for.
Tensor hetero(int64_t b, int64_t h, int64_t s, int64_t d, uint64_t seed, DType t = DType::kF16) {
  Tensor x = test::random_tensor(DType::kF32, b, h, s, d, seed);
  Tensor out(t, b, h, s, d);
  for (int64_t i0 = 0; i0 < b; ++i0)
    for (int64_t i1 = 0; i1 < h; ++i1)
      for (int64_t i2 = 0; i2 < s; ++i2)
        for (int64_t c = 0; c < d; ++c) {
          const float sc =
              0.1f * static_cast<float>(1 + (c * 5 + i1) % 7) * (c % 11 == 0 ? 20.f : 1.f);
          out.set(i0, i1, i2, c, x.at(i0, i1, i2, c) * sc);
        }
  return out;
}

std::string state_of(const KVCache& c) {
  std::ostringstream os;
  c.save(os);
  return os.str();
}

// Feeds x in calls of the given sizes (token by token when sizes is empty); returns the last view.
CacheView feed(KVCache& c, const Tensor& k, const Tensor& v, std::vector<int64_t> sizes = {}) {
  const int64_t s = k.shape()[2];
  if (sizes.empty()) sizes.assign(static_cast<size_t>(s), 1);
  CacheView last;
  int64_t at = 0;
  for (int64_t n : sizes) {
    last = c.update_and_fetch(k.view().slice_tokens(at, at + n), v.view().slice_tokens(at, at + n));
    at += n;
  }
  EXPECT_EQ(at, s);
  return last;
}

// Rows of (b, h) of a view, dequantized to fp32: [n][D] (keys when values == false).
std::vector<std::vector<float>> rows_of(const CacheView& view, int64_t b, int64_t h,
                                        bool values = false) {
  const DenseView dv = dequantize_view(view, DType::kF32);
  std::vector<std::vector<float>> out;
  for (const auto& seg : dv.view.segments)
    for (int64_t i = 0; i < seg.n_rows; ++i) {
      std::vector<float> r(static_cast<size_t>(view.head_dim));
      for (int64_t c = 0; c < view.head_dim; ++c)
        r[c] = (values ? seg.values : seg.keys).at(b, h, i, c);
      out.push_back(r);
    }
  return out;
}

bool row_equals_input(const std::vector<float>& row, const Tensor& x, int64_t b, int64_t h,
                      int64_t s) {
  for (size_t c = 0; c < row.size(); ++c)
    if (row[c] != x.at(b, h, s, static_cast<int64_t>(c))) return false;
  return true;
}

double figure(const KVCache& c, const char* name) {
  return c.stats().figure(name);
}

std::unique_ptr<SkvqCache> make(const CacheConfig& c) {
  return std::make_unique<SkvqCache>(c);
}

// ---------------------------------------------------------------------------------------------

TEST(SkvqCache, FactoryDispatchAndMethod) {
  auto c = make_cache(small_cfg());
  EXPECT_EQ(c->method(), "skvq");
  EXPECT_NE(dynamic_cast<SkvqCache*>(c.get()), nullptr);
  EXPECT_FALSE(c->is_trimmable());
}

TEST(SkvqCache, WorkedExampleByteFigures) {
  auto c = make(small_cfg());
  const Tensor k = hetero(1, 2, 35, 64, 1), v = hetero(1, 2, 35, 64, 2);
  c->update_and_fetch(k.view(), v.view());
  EXPECT_EQ(figure(*c, "compressed_key_bytes"), 1792);
  EXPECT_EQ(figure(*c, "compressed_value_bytes"), 1792);
  EXPECT_EQ(figure(*c, "fp16_key_bytes"), 8960);
  EXPECT_EQ(figure(*c, "fp16_value_bytes"), 8960);
  EXPECT_EQ(figure(*c, "residual_fp16_bytes"), 3584);
  EXPECT_EQ(figure(*c, "perm_bytes"), 1024);
  EXPECT_EQ(figure(*c, "assigned_avg_bits"), 4.0);
  EXPECT_EQ(figure(*c, "tokens_seen"), 35);
  EXPECT_EQ(figure(*c, "quantized_tokens"), 32);
  EXPECT_EQ(figure(*c, "key_perms"), 1.0);
  const CacheStats st = c->stats();
  EXPECT_EQ(st.bytes_accounted, 1792 + 1792 + 3584 + 1024);
  EXPECT_EQ(st.fp16_bytes, 2 * 8960);
}

TEST(SkvqCache, ShortSequencePassesThroughExactly) {
  auto c = make(small_cfg());
  const Tensor k = hetero(1, 2, 10, 64, 3), v = hetero(1, 2, 10, 64, 4);
  const CacheView view = c->update_and_fetch(k.view(), v.view());
  ASSERT_EQ(view.segments.size(), 1u);
  EXPECT_EQ(view.segments[0].packed, nullptr);
  EXPECT_TRUE(test::bit_equal(view.segments[0].keys, k.view()));
  EXPECT_TRUE(test::bit_equal(view.segments[0].values, v.view()));
  EXPECT_EQ(figure(*c, "quantized_tokens"), 0);
  EXPECT_EQ(figure(*c, "compressed_key_bytes"), 0);
  EXPECT_EQ(figure(*c, "assigned_avg_bits"), 16.0);
  EXPECT_EQ(figure(*c, "key_perms"), 0.0);
  EXPECT_TRUE(c->key_perms().empty());
}

TEST(SkvqCache, FrontierAdvancesInWholeChunks) {
  auto c = make(small_cfg());
  const Tensor k = hetero(1, 2, 53, 64, 5), v = hetero(1, 2, 53, 64, 6);
  const CacheView view = c->update_and_fetch(k.view(), v.view());
  EXPECT_EQ(c->quantized_tokens(), 48);
  const auto rows = rows_of(view, 0, 1);
  ASSERT_EQ(rows.size(), 53u);
  for (int64_t s = 48; s < 53; ++s) EXPECT_TRUE(row_equals_input(rows[s], k, 0, 1, s)) << s;
  // Token by token the frontier is floor(n / 16) * 16 after every call.
  auto d = make(small_cfg());
  for (int64_t n = 1; n <= 53; ++n) {
    d->update_and_fetch(k.view().slice_tokens(n - 1, n), v.view().slice_tokens(n - 1, n));
    EXPECT_EQ(d->quantized_tokens(), n / 16 * 16) << n;
  }
}

TEST(SkvqCache, SinkRowsExactAndQuantizedRegionDiffers) {
  auto c = make(small_cfg());
  const Tensor k = hetero(1, 2, 40, 64, 7), v = hetero(1, 2, 40, 64, 8);
  const CacheView view = c->update_and_fetch(k.view(), v.view());
  EXPECT_EQ(c->quantized_tokens(), 32);
  ASSERT_TRUE(view.has_packed());
  for (int64_t h = 0; h < 2; ++h) {
    const auto kr = rows_of(view, 0, h), vr = rows_of(view, 0, h, true);
    for (int64_t s = 0; s < 4; ++s) {
      EXPECT_TRUE(row_equals_input(kr[s], k, 0, h, s)) << "sink " << s;
      EXPECT_TRUE(row_equals_input(vr[s], v, 0, h, s)) << "sink " << s;
    }
    for (int64_t s = 4; s < 32; ++s) {
      EXPECT_FALSE(row_equals_input(kr[s], k, 0, h, s)) << "row " << s << " not quantized";
      EXPECT_FALSE(row_equals_input(vr[s], v, 0, h, s)) << "row " << s << " not quantized";
    }
    for (int64_t s = 32; s < 40; ++s) EXPECT_TRUE(row_equals_input(kr[s], k, 0, h, s));
  }
  // The view really holds packed storage for rows 4..31: two chunks.
  int64_t packed_rows = 0;
  for (const auto& seg : view.segments)
    if (seg.packed) packed_rows += seg.n_rows;
  EXPECT_EQ(packed_rows, 28);
}

// One-shot prefill, token-by-token decode and irregular chunks give the same state, bit for bit
// (53 tokens, heterogeneous channel scales), for several option sets.
TEST(SkvqCache, OneShotEqualsTokenByTokenBitForBit) {
  std::vector<CacheConfig> cfgs;
  cfgs.push_back(small_cfg());
  CacheConfig r = small_cfg();
  r.skvq_recent = 5;
  cfgs.push_back(r);
  CacheConfig rot = small_cfg();
  rot.skvq_rotation = Rotation::kHadamard;
  rot.skvq_rotate_values = true;
  cfgs.push_back(rot);
  CacheConfig m = small_cfg();
  m.skvq_meta = MetaType::kFP8E4M3;
  m.skvq_bits_value = 1.5;
  m.skvq_group_size = 24;  // ragged
  cfgs.push_back(m);
  for (size_t ci = 0; ci < cfgs.size(); ++ci)
    for (DType t : {DType::kF16, DType::kF32}) {
      const Tensor k = hetero(2, 2, 53, 64, 9 + ci, t), v = hetero(2, 2, 53, 64, 19 + ci, t);
      auto one = make(cfgs[ci]), tok = make(cfgs[ci]), chunks = make(cfgs[ci]);
      one->update_and_fetch(k.view(), v.view());
      feed(*tok, k, v);
      feed(*chunks, k, v, {7, 13, 1, 20, 12});
      EXPECT_EQ(one->quantized_tokens(), tok->quantized_tokens());
      EXPECT_EQ(state_of(*one), state_of(*tok)) << "config " << ci;
      EXPECT_EQ(state_of(*one), state_of(*chunks)) << "config " << ci;
      const auto a = rows_of(one->stored_view(), 1, 1), b = rows_of(tok->stored_view(), 1, 1);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_EQ(std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4), 0) << i;
    }
}

TEST(SkvqCache, FlushedChunksAndPermutationsFrozen) {
  auto c = make(small_cfg());
  const Tensor k = hetero(1, 2, 48, 64, 30), v = hetero(1, 2, 48, 64, 31);
  c->update_and_fetch(k.view().slice_tokens(0, 15), v.view().slice_tokens(0, 15));
  EXPECT_TRUE(c->key_perms().empty()) << "no permutation before the first flush";
  c->update_and_fetch(k.view().slice_tokens(15, 16), v.view().slice_tokens(15, 16));
  const std::vector<int32_t> pk = c->key_perms(), pv = c->value_perms();
  ASSERT_EQ(pk.size(), 2u * 64);
  ASSERT_EQ(pv.size(), 2u * 64);
  for (int h = 0; h < 2; ++h) {
    std::set<int32_t> sk(pk.begin() + h * 64, pk.begin() + (h + 1) * 64);
    std::set<int32_t> sv(pv.begin() + h * 64, pv.begin() + (h + 1) * 64);
    EXPECT_EQ(sk.size(), 64u);
    EXPECT_EQ(sv.size(), 64u);
    EXPECT_EQ(*sk.rbegin(), 63);
  }
  EXPECT_NE(pk, pv) << "K and V get their own permutations";
  const auto chunk0 = rows_of(c->stored_view(), 0, 1);
  std::vector<std::vector<float>> first(chunk0.begin(), chunk0.begin() + 16);
  for (int64_t s = 16; s < 48; ++s)
    c->update_and_fetch(k.view().slice_tokens(s, s + 1), v.view().slice_tokens(s, s + 1));
  EXPECT_EQ(c->key_perms(), pk);
  EXPECT_EQ(c->value_perms(), pv);
  const auto later = rows_of(c->stored_view(), 0, 1);
  for (int64_t s = 0; s < 16; ++s)
    EXPECT_EQ(std::memcmp(later[s].data(), first[s].data(), 64 * 4), 0) << s;
}

// The permutation sorts chunk 0's per-channel ranges (pooled over batch and time) ascending,
// ties to the lower channel.
TEST(SkvqCache, PermutationSortsChannelRangesStably) {
  CacheConfig cfg = small_cfg();
  auto c = make(cfg);
  Tensor k = hetero(2, 2, 16, 64, 33);
  for (int64_t b = 0; b < 2; ++b)  // channels 3 and 9: identical constant range 0 (tie)
    for (int64_t s = 0; s < 16; ++s) {
      k.set(b, 0, s, 3, 1.0f);
      k.set(b, 0, s, 9, 1.0f);
    }
  const Tensor v = hetero(2, 2, 16, 64, 34);
  c->update_and_fetch(k.view(), v.view());
  const auto& p = c->key_perms();
  std::vector<float> range(64);
  for (int64_t ch = 0; ch < 64; ++ch) {
    float mn = 1e30f, mx = -1e30f;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t s = 0; s < 16; ++s) {
        mn = std::min(mn, k.at(b, 0, s, ch));
        mx = std::max(mx, k.at(b, 0, s, ch));
      }
    range[ch] = mx - mn;
  }
  for (int j = 0; j + 1 < 64; ++j) {
    EXPECT_LE(range[p[j]], range[p[j + 1]]);
    if (range[p[j]] == range[p[j + 1]]) {
      EXPECT_LT(p[j], p[j + 1]);
    }
  }
  EXPECT_EQ(p[0], 3);
  EXPECT_EQ(p[1], 9);
}

TEST(SkvqCache, ReorderOffGivesIdentityAndNoPermBytes) {
  CacheConfig cfg = small_cfg();
  cfg.skvq_reorder = false;
  auto c = make(cfg);
  const Tensor k = hetero(1, 2, 40, 64, 40), v = hetero(1, 2, 40, 64, 41);
  c->update_and_fetch(k.view(), v.view());
  EXPECT_TRUE(c->key_perms().empty());
  EXPECT_EQ(figure(*c, "perm_bytes"), 0);
  EXPECT_EQ(figure(*c, "key_perms"), 0);
  EXPECT_EQ(c->stats().bytes_accounted, figure(*c, "compressed_key_bytes") +
                                            figure(*c, "compressed_value_bytes") +
                                            figure(*c, "residual_fp16_bytes"));
}

double key_mse(const CacheConfig& cfg, const Tensor& k, const Tensor& v) {
  auto c = make(cfg);
  const CacheView view = c->update_and_fetch(k.view(), v.view());
  double se = 0;
  int64_t n = 0;
  for (int64_t h = 0; h < k.shape()[1]; ++h) {
    const auto rows = rows_of(view, 0, h);
    for (size_t s = 0; s < rows.size(); ++s)
      for (int64_t ch = 0; ch < 64; ++ch, ++n)
        se += std::pow(double(rows[s][ch]) - k.at(0, h, static_cast<int64_t>(s), ch), 2);
  }
  return se / double(n);
}

// Channel scales spread geometrically (0.05 .. 20, shuffled across channels): sorting by range
// groups channels of similar scale, so fewer channels share a group with a wide one. (With a few
// isolated x20 spikes instead, identity grouping can win on absolute MSE: sorting puts every spike
// in one group, where the smaller spikes get the largest one's step. The seed's claim is about
// smooth heterogeneity like this.)
TEST(SkvqCache, ReorderBeatsIdentityOnHeterogeneousChannels) {
  CacheConfig on = small_cfg();
  on.skvq_n_sink = 0;
  CacheConfig off = on;
  off.skvq_reorder = false;
  Tensor k = test::random_tensor(DType::kF32, 1, 2, 128, 64, 50);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t s = 0; s < 128; ++s)
      for (int64_t c = 0; c < 64; ++c)
        k.set(0, h, s, c, k.at(0, h, s, c) * 0.05f * std::pow(1.1f, float((c * 7 + h) % 64)));
  const Tensor v = hetero(1, 2, 128, 64, 51, DType::kF32);
  const double e_on = key_mse(on, k, v), e_off = key_mse(off, k, v);
  EXPECT_LT(e_on, e_off) << "reorder " << e_on << " identity " << e_off;
}

// ---- quantizer-level reorder behaviours (seed test_skvq.py) -------------------------------------

// Rows [n, d] of head 0 of a block, permuted by perm (stored j = original perm[j]).
std::vector<float> permuted_rows(const Tensor& x, const std::vector<int32_t>& perm, bool apply) {
  const int64_t n = x.shape()[2], d = x.shape()[3];
  std::vector<float> out(static_cast<size_t>(n * d));
  for (int64_t s = 0; s < n; ++s)
    for (int64_t j = 0; j < d; ++j) out[s * d + j] = x.at(0, 0, s, apply ? perm[j] : j);
  return out;
}

// Per-channel squared error of a 2-bit round trip of rows [n, d] (in the rows' own order).
std::vector<double> channel_se(const std::vector<float>& rows, int64_t n, int64_t d) {
  GroupQuantParams p{2, 16, true, 1.0f, MetaType::kF16};
  std::vector<uint8_t> codes(rows.size());
  std::vector<float> lo(static_cast<size_t>(n * d / 16)), sc(lo.size()), rec(rows.size());
  group_quantize(rows.data(), n, d, p, codes.data(), lo.data(), sc.data());
  group_dequantize_reference(codes.data(), lo.data(), sc.data(), n, d, 16, rec.data());
  std::vector<double> se(static_cast<size_t>(d), 0.0);
  for (int64_t s = 0; s < n; ++s)
    for (int64_t c = 0; c < d; ++c) se[c] += std::pow(double(rec[s * d + c]) - rows[s * d + c], 2);
  return se;
}

Tensor scaled(int64_t n, int64_t d, uint64_t seed, const std::vector<float>& ch_scale) {
  Tensor x = test::random_tensor(DType::kF32, 1, 1, n, d, seed);
  for (int64_t s = 0; s < n; ++s)
    for (int64_t c = 0; c < d; ++c) x.set(0, 0, s, c, x.at(0, 0, s, c) * ch_scale[c]);
  return x;
}

TEST(SkvqReorder, PermutationValidInverseRoundTripsAndShrinksGroupSpread) {
  const int64_t n = 128, d = 64;
  std::vector<float> sc(d);
  for (int64_t c = 0; c < d; ++c) sc[c] = 0.05f * std::pow(1.1f, float((c * 7) % 64));
  const Tensor x = scaled(n, d, 5, sc);
  const auto perm = skvq_channel_perms(x.view());
  std::vector<int32_t> inv(d, -1);
  for (int64_t j = 0; j < d; ++j) inv[perm[j]] = static_cast<int32_t>(j);
  for (int64_t c = 0; c < d; ++c) ASSERT_EQ(perm[inv[c]], c);
  const auto pr = permuted_rows(x, perm, true);
  for (int64_t s = 0; s < n; ++s)  // inverse permutation restores every row exactly
    for (int64_t c = 0; c < d; ++c) ASSERT_EQ(pr[s * d + inv[c]], x.at(0, 0, s, c));
  // Within-group spread of channel ranges (max - min of the 16 ranges), summed over groups.
  auto spread = [&](const std::vector<float>& rows) {
    double total = 0;
    for (int64_t g = 0; g < d / 16; ++g) {
      double lo = 1e30, hi = 0;
      for (int64_t c = g * 16; c < (g + 1) * 16; ++c) {
        float mn = 1e30f, mx = -1e30f;
        for (int64_t s = 0; s < n; ++s) {
          mn = std::min(mn, rows[s * d + c]);
          mx = std::max(mx, rows[s * d + c]);
        }
        lo = std::min(lo, double(mx - mn));
        hi = std::max(hi, double(mx - mn));
      }
      total += hi - lo;
    }
    return total;
  };
  EXPECT_LT(spread(pr), spread(permuted_rows(x, perm, false)));
}

// Reordering cuts the error of heterogeneous channels by more than 5%, and by more than 3
// points more than it changes homogeneous (iid) channels.
TEST(SkvqReorder, ImprovesHeterogeneousNotHomogeneous) {
  const int64_t n = 256, d = 64;
  std::vector<float> het(d), hom(d, 1.0f);
  for (int64_t c = 0; c < d; ++c) het[c] = 0.05f * std::pow(1.1f, float((c * 7) % 64));
  auto gain = [&](const std::vector<float>& sc) {
    const Tensor x = scaled(n, d, 9, sc);
    const auto perm = skvq_channel_perms(x.view());
    double with = 0, without = 0;
    for (double v : channel_se(permuted_rows(x, perm, true), n, d)) with += v;
    for (double v : channel_se(permuted_rows(x, perm, false), n, d)) without += v;
    return (without - with) / without;
  };
  const double g_het = gain(het), g_hom = gain(hom);
  std::printf("[reorder] heterogeneous gain %.1f%%, homogeneous %.1f%%\n", 100 * g_het,
              100 * g_hom);
  EXPECT_GT(g_het, 0.05);
  EXPECT_GT(g_het - g_hom, 0.03);
}

// 16 of 64 channels are outliers (x20): the per-channel error normalised by the channel's
// variance, averaged, falls below half with reordering (outliers no longer share every group).
TEST(SkvqReorder, OutlierChannelsNormalisedErrorHalved) {
  const int64_t n = 256, d = 64;
  std::vector<float> sc(d, 1.0f);
  for (int64_t c = 0; c < d; c += 4) sc[c] = 20.0f;  // 16 outliers spread over every group
  const Tensor x = scaled(n, d, 13, sc);
  const auto perm = skvq_channel_perms(x.view());
  const auto se_with = channel_se(permuted_rows(x, perm, true), n, d);
  const auto se_without = channel_se(permuted_rows(x, perm, false), n, d);
  double with = 0, without = 0;
  for (int64_t j = 0; j < d; ++j) {
    with += se_with[j] / (n * double(sc[perm[j]]) * sc[perm[j]]);
    without += se_without[j] / (n * double(sc[j]) * sc[j]);
  }
  EXPECT_LT(with, 0.5 * without) << with / d << " vs " << without / d;
}

TEST(SkvqCache, ClipSearchOffFixedAlphaRuns) {
  CacheConfig cfg = small_cfg();
  cfg.skvq_clip_search = false;
  cfg.skvq_clip_alpha = 0.9;
  auto c = make(cfg);
  const Tensor k = hetero(1, 2, 40, 64, 60), v = hetero(1, 2, 40, 64, 61);
  c->update_and_fetch(k.view(), v.view());
  EXPECT_EQ(c->quantized_tokens(), 32);
}

TEST(SkvqCache, CompressionRatioBeatsFp16AtLongContext) {
  CacheConfig cfg = small_cfg();
  cfg.skvq_window = 32;
  auto c = make(cfg);
  const Tensor k = hetero(1, 2, 1024, 64, 70), v = hetero(1, 2, 1024, 64, 71);
  c->update_and_fetch(k.view(), v.view());
  const double num = figure(*c, "compressed_key_bytes") + figure(*c, "compressed_value_bytes") +
                     figure(*c, "residual_fp16_bytes") + figure(*c, "perm_bytes");
  const double den = figure(*c, "fp16_key_bytes") + figure(*c, "fp16_value_bytes");
  EXPECT_LT(num / den, 0.35);
  EXPECT_DOUBLE_EQ(c->stats().ratio_to_fp16(), num / den);
}

TEST(SkvqCache, Deterministic) {
  const Tensor k = hetero(1, 2, 70, 64, 80), v = hetero(1, 2, 70, 64, 81);
  auto a = make(small_cfg()), b = make(small_cfg());
  a->update_and_fetch(k.view(), v.view());
  b->update_and_fetch(k.view(), v.view());
  EXPECT_EQ(state_of(*a), state_of(*b));
}

TEST(SkvqCache, MaxCtxRefusedBeforeAnyChange) {
  CacheConfig cfg = small_cfg();
  cfg.skvq_max_ctx = 32;
  auto c = make(cfg);
  const Tensor k = hetero(1, 2, 33, 64, 90), v = hetero(1, 2, 33, 64, 91);
  const std::string empty = state_of(*c);
  try {
    c->update_and_fetch(k.view(), v.view());
    ADD_FAILURE() << "33 tokens accepted with skvq_max_ctx 32";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("skvq_max_ctx"), std::string::npos) << e.what();
  }
  EXPECT_EQ(c->offset(), 0);
  EXPECT_EQ(state_of(*c), empty);
  c->update_and_fetch(k.view().slice_tokens(0, 32), v.view().slice_tokens(0, 32));  // exactly 32
  const std::string full = state_of(*c);
  EXPECT_THROW(c->update_and_fetch(k.view().slice_tokens(32, 33), v.view().slice_tokens(32, 33)),
               Error);
  EXPECT_EQ(state_of(*c), full);
}

void expect_refused(CacheConfig cfg, const std::string& field) {
  try {
    (void)make_skvq_cache(cfg);
    ADD_FAILURE() << field << " accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}

TEST(SkvqCache, BadConfigRefusedNamingTheField) {
  auto with = [](auto f) {
    CacheConfig c = small_cfg();
    f(c);
    return c;
  };
  expect_refused(with([](CacheConfig& c) { c.skvq_bits_key = 0; }), "skvq_bits_key");
  expect_refused(with([](CacheConfig& c) { c.skvq_bits_value = 9; }), "skvq_bits_value");
  expect_refused(with([](CacheConfig& c) { c.skvq_bits_value = 2.5; }), "skvq_bits_value");
  expect_refused(with([](CacheConfig& c) { c.skvq_group_size = 0; }), "skvq_group_size");
  expect_refused(with([](CacheConfig& c) { c.skvq_window = 1; }), "skvq_window");
  expect_refused(with([](CacheConfig& c) { c.skvq_n_sink = 16; }), "skvq_n_sink");
  expect_refused(with([](CacheConfig& c) { c.skvq_clip_alpha = 0.0; }), "skvq_clip_alpha");
  expect_refused(with([](CacheConfig& c) {
                   c.skvq_clip_search = false;
                   c.skvq_clip_alpha = 1.5;
                 }),
                 "skvq_clip_alpha");
  expect_refused(with([](CacheConfig& c) { c.skvq_recent = -1; }), "skvq_recent");
  expect_refused(with([](CacheConfig& c) { c.skvq_max_ctx = -5; }), "skvq_max_ctx");
  // Rules only the cache knows.
  expect_refused(with([](CacheConfig& c) {
                   c.skvq_rotation = Rotation::kHadamard;
                   c.head_dim = 63;
                 }),
                 "head_dim");
  expect_refused(with([](CacheConfig& c) {
                   c.skvq_rotation = Rotation::kHadamard;
                   c.skvq_perm_file = "/nonexistent.json";
                 }),
                 "skvq_perm_file");
  expect_refused(with([](CacheConfig& c) { c.skvq_perm_file = "/nonexistent/perm.json"; }),
                 "skvq_perm_file");
}

TEST(SkvqCache, WrongShapesRefusedNothingChanged) {
  auto c = make(small_cfg());
  const Tensor k = hetero(1, 2, 20, 64, 95), v = hetero(1, 2, 20, 64, 96);
  c->update_and_fetch(k.view(), v.view());
  const std::string before = state_of(*c);
  const Tensor k3 = hetero(1, 3, 2, 64, 97), d32 = hetero(1, 2, 2, 32, 98);
  EXPECT_THROW(c->update_and_fetch(k3.view(), k3.view()), Error);
  EXPECT_THROW(c->update_and_fetch(d32.view(), d32.view()), Error);
  EXPECT_THROW(c->update_and_fetch(k.view(), k.view().slice_tokens(0, 3)), Error);
  EXPECT_EQ(state_of(*c), before);
}

TEST(SkvqCache, NotTrimmableAndNotMergeable) {
  auto c = make(small_cfg());
  const Tensor k = hetero(1, 2, 20, 64, 100), v = hetero(1, 2, 20, 64, 101);
  c->update_and_fetch(k.view(), v.view());
  const std::string before = state_of(*c);
  EXPECT_FALSE(c->is_trimmable());
  EXPECT_THROW(c->trim(3), Error);
  EXPECT_EQ(state_of(*c), before);
  EXPECT_EQ(c->offset(), 20);
  auto d = make(small_cfg());
  d->update_and_fetch(k.view(), v.view());
  EXPECT_THROW(merge_batch({c.get(), d.get()}), Error);
}

TEST(SkvqCache, OutputDtypeFollowsInput) {
  CacheConfig cfg = small_cfg();
  cfg.skvq_window = 128;
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    auto c = make(cfg);
    const Tensor k = hetero(1, 2, 40, 64, 110, t), v = hetero(1, 2, 40, 64, 111, t);
    const CacheView view = c->update_and_fetch(k.view(), v.view());
    ASSERT_EQ(view.segments.size(), 1u);
    EXPECT_EQ(view.segments[0].keys.dtype, t);
    EXPECT_TRUE(test::bit_equal(view.segments[0].keys, k.view()));
    EXPECT_EQ(c->storage_dtype(), t);
  }
}

TEST(SkvqCache, MaskIsImplicitCausal) {
  auto c = make(small_cfg());
  const Tensor k = hetero(1, 2, 40, 64, 115), v = hetero(1, 2, 40, 64, 116);
  c->update_and_fetch(k.view(), v.view());
  EXPECT_EQ(c->make_mask(3).kind, Mask::Kind::kCausal);
  EXPECT_EQ(c->make_mask(1).kind, Mask::Kind::kNone);
  const auto pos = c->stored_positions(0, 1);
  ASSERT_EQ(pos.size(), 40u);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(pos[i], i);
}

// skvq_recent: chunk [q, q + W) is flushed iff at least `recent` rows remain after it, so the
// frontier after n tokens is floor((n - R) / W) * W (0 while n < W + R), whatever the call split.
TEST(SkvqCache, RecentKeepsNewestRowsFullPrecision) {
  CacheConfig cfg = small_cfg();
  cfg.skvq_recent = 5;
  const Tensor k = hetero(1, 2, 100, 64, 120), v = hetero(1, 2, 100, 64, 121);
  auto c = make(cfg);
  for (int64_t n = 1; n <= 100; ++n) {
    const CacheView view =
        c->update_and_fetch(k.view().slice_tokens(n - 1, n), v.view().slice_tokens(n - 1, n));
    const int64_t expect = n >= 21 ? (n - 5) / 16 * 16 : 0;
    ASSERT_EQ(c->quantized_tokens(), expect) << n;
    EXPECT_GE(n - c->quantized_tokens(), std::min<int64_t>(n, 5));
    // The newest row is at full precision in its own step's view.
    const ViewSegment& last = view.segments.back();
    EXPECT_EQ(last.packed, nullptr);
    EXPECT_EQ(last.first_pos + last.n_rows, n);
  }
}

TEST(SkvqCache, OnePointFiveBitValues) {
  CacheConfig cfg = small_cfg();
  cfg.skvq_bits_value = 1.5;
  auto c = make(cfg);
  const Tensor k = hetero(1, 2, 32, 64, 130), v = hetero(1, 2, 32, 64, 131);
  const CacheView view = c->update_and_fetch(k.view(), v.view());
  // 28 packed rows per head: 13 code bytes (ceil(64/5)) + 4 groups x 2 x 2 metadata bytes.
  EXPECT_EQ(figure(*c, "compressed_value_bytes"), 2 * 28 * (13 + 16));
  EXPECT_EQ(figure(*c, "compressed_key_bytes"), 2 * 28 * (16 + 16));
  for (const auto& seg : view.segments) {
    if (!seg.packed) continue;
    EXPECT_TRUE(seg.packed->values.fmt.spec.ternary());
    std::vector<uint8_t> codes(64);
    for (int64_t i = 0; i < seg.n_rows; ++i) {
      unpack_codes(seg.packed->values.record(0, 1, i), 64, seg.packed->values.fmt.spec,
                   codes.data());
      for (uint8_t cd : codes) EXPECT_LE(cd, 2);
    }
  }
}

// fp32 metadata: every packed row decodes to a plain scalar implementation of the original
// round trip (permute by the frozen permutation, clipped group quantization, dequantize,
// inverse permutation), bit for bit.
TEST(SkvqCache, Fp32MetadataRowsMatchScalarRoundTripBitForBit) {
  CacheConfig cfg = small_cfg();
  cfg.skvq_meta = MetaType::kF32;
  auto c = make(cfg);
  const Tensor k = hetero(1, 2, 48, 64, 140, DType::kF32),
               v = hetero(1, 2, 48, 64, 141, DType::kF32);
  const CacheView view = c->update_and_fetch(k.view(), v.view());
  GroupQuantParams p{2, 16, true, 1.0f, MetaType::kF32};
  for (int kv = 0; kv < 2; ++kv)
    for (int64_t h = 0; h < 2; ++h) {
      const Tensor& x = kv ? v : k;
      const auto& perm = kv ? c->value_perms() : c->key_perms();
      const auto rows = rows_of(view, 0, h, kv == 1);
      for (int64_t s = 4; s < 48; ++s) {
        std::vector<float> pr(64), rec(64), out(64);
        for (int j = 0; j < 64; ++j) pr[j] = x.at(0, h, s, perm[h * 64 + j]);
        std::vector<uint8_t> codes(64);
        std::vector<float> lo(4), sc(4);
        group_quantize_reference(pr.data(), 1, 64, p, codes.data(), lo.data(), sc.data());
        for (int j = 0; j < 64; ++j) rec[j] = static_cast<float>(codes[j]) * sc[j / 16];
        for (int j = 0; j < 64; ++j) rec[j] = rec[j] + lo[j / 16];
        for (int j = 0; j < 64; ++j) out[perm[h * 64 + j]] = rec[j];
        ASSERT_EQ(std::memcmp(out.data(), rows[s].data(), 64 * 4), 0) << kv << " " << h << " " << s;
      }
    }
}

TEST(SkvqCache, MetadataTypesScaleTheMetaTerm) {
  for (MetaType m : {MetaType::kF16, MetaType::kF32, MetaType::kFP8E4M3}) {
    CacheConfig cfg = small_cfg();
    cfg.skvq_meta = m;
    auto c = make(cfg);
    const Tensor k = hetero(1, 2, 35, 64, 150), v = hetero(1, 2, 35, 64, 151);
    c->update_and_fetch(k.view(), v.view());
    const int64_t meta = m == MetaType::kF32 ? 4 : m == MetaType::kF16 ? 2 : 1;
    EXPECT_EQ(figure(*c, "compressed_key_bytes"), 2 * 28 * (16 + 4 * 2 * meta));
  }
}

// A calibrated permutation file: written from recorded chunk-0 blocks it reproduces the cache's
// own permutation (same state bit for bit); a file for another layer or head count is refused.
TEST(SkvqCache, CalibratedPermutationFile) {
  const Tensor k = hetero(1, 2, 40, 64, 160), v = hetero(1, 2, 40, 64, 161);
  const std::string path = ::testing::TempDir() + "skvq_perm_test.json";
  SkvqPermSet ps;
  ps.n_kv_heads = 2;
  ps.head_dim = 64;
  std::vector<int32_t> ident(128);
  for (int i = 0; i < 128; ++i) ident[i] = i % 64;
  ps.key = {ident, skvq_channel_perms(k.view().slice_tokens(0, 16))};
  ps.value = {ident, skvq_channel_perms(v.view().slice_tokens(0, 16))};
  save_skvq_perm_file(path, ps);
  const SkvqPermSet back = load_skvq_perm_file(path);
  EXPECT_EQ(back.key, ps.key);
  EXPECT_EQ(back.value, ps.value);

  CacheConfig cfg = small_cfg();
  cfg.skvq_perm_file = path;
  SkvqCache from_file(cfg, 1);
  from_file.update_and_fetch(k.view().slice_tokens(0, 1), v.view().slice_tokens(0, 1));
  EXPECT_EQ(from_file.key_perms(), ps.key[1]) << "file permutation in use from the first call";
  from_file.update_and_fetch(k.view().slice_tokens(1, 40), v.view().slice_tokens(1, 40));
  auto own = make(small_cfg());
  own->update_and_fetch(k.view(), v.view());
  EXPECT_EQ(own->key_perms(), from_file.key_perms());
  EXPECT_EQ(rows_of(own->stored_view(), 0, 1), rows_of(from_file.stored_view(), 0, 1));

  EXPECT_THROW(SkvqCache(cfg, 2), Error);  // no layer 2
  CacheConfig d32 = cfg;
  d32.head_dim = 32;
  EXPECT_THROW(SkvqCache(d32, 0), Error);  // head_dim mismatch
  SkvqCache three_heads(cfg, 0);
  const Tensor k3 = hetero(1, 3, 2, 64, 162);
  EXPECT_THROW(three_heads.update_and_fetch(k3.view(), k3.view()), Error);
  EXPECT_EQ(three_heads.offset(), 0);
  // Malformed files.
  for (const char* bad :
       {"not json", "{\"format\": \"other\"}",
        "{\"format\": \"veloxquant.skvq_perms\", \"version\": 1, \"n_kv_heads\": "
        "1, \"head_dim\": 2, \"layers\": [{\"key\": [[0, 0]], \"value\": [[0, 1]]}]}"}) {
    std::FILE* f = std::fopen(path.c_str(), "w");
    std::fputs(bad, f);
    std::fclose(f);
    EXPECT_THROW(load_skvq_perm_file(path), Error) << bad;
  }
  std::remove(path.c_str());
}

// build_caches tells each layer's cache its index, so each layer gets its own file entry.
TEST(SkvqCache, BuilderGivesEachLayerItsPermutation) {
  const std::string path = ::testing::TempDir() + "skvq_perm_layers.json";
  SkvqPermSet ps;
  ps.n_kv_heads = 2;
  ps.head_dim = 64;
  for (int l = 0; l < 3; ++l) {
    std::vector<int32_t> p(128);
    for (int i = 0; i < 128; ++i) p[i] = (i % 64 * (2 * l + 1)) % 64;  // distinct per layer
    ps.key.push_back(p);
    ps.value.push_back(p);
  }
  save_skvq_perm_file(path, ps);
  for (const char* method : {"skvq", "snapkv+skvq"}) {
    CacheConfig cfg = small_cfg();
    cfg.method = method;
    cfg.skvq_perm_file = path;
    ModelCacheShape shape{{2, 2, 2}, {64, 64, 64}};
    auto caches = build_caches(shape, cfg);
    ASSERT_EQ(caches.size(), 3u);
    const Tensor k = hetero(1, 2, 1, 64, 165);
    for (int l = 0; l < 3; ++l) {
      caches[l]->update_and_fetch(k.view(), k.view());
      const std::vector<int32_t>* got = nullptr;
      if (auto* s = dynamic_cast<SkvqCache*>(caches[l].get())) got = &s->key_perms();
      if (auto* s = dynamic_cast<SnapkvSkvqCache*>(caches[l].get())) got = &s->key_perms();
      ASSERT_NE(got, nullptr);
      EXPECT_EQ(*got, ps.key[l]) << method << " layer " << l;
    }
  }
  std::remove(path.c_str());
}

// Rotation wins over reorder (no permutation, perm_bytes 0), byte figures are unchanged, the
// signs are seeded, and the rows decode back close to the input.
TEST(SkvqCache, HadamardRotationOption) {
  CacheConfig cfg = small_cfg();
  cfg.skvq_rotation = Rotation::kHadamard;
  auto c = make(cfg);
  const Tensor k = hetero(1, 2, 35, 64, 170), v = hetero(1, 2, 35, 64, 171);
  const CacheView view = c->update_and_fetch(k.view(), v.view());
  EXPECT_TRUE(c->key_perms().empty());
  EXPECT_EQ(figure(*c, "perm_bytes"), 0);
  EXPECT_EQ(figure(*c, "compressed_key_bytes"), 1792);
  EXPECT_EQ(figure(*c, "rotation"), 1.0);
  ASSERT_EQ(c->rotation_signs().size(), 128u);
  for (const auto& seg : view.segments)
    if (seg.packed) {
      EXPECT_NE(seg.packed->keys.signs, nullptr);
      EXPECT_EQ(seg.packed->values.signs, nullptr) << "values rotate only with skvq_rotate_values";
    }
  CacheConfig other = cfg;
  other.skvq_rotation_seed = 99;
  auto c2 = make(other);
  c2->update_and_fetch(k.view(), v.view());
  EXPECT_NE(c2->rotation_signs(), c->rotation_signs());
}

// ---- save / load --------------------------------------------------------------------------------

TEST(SkvqCache, SaveLoadContinuesBitIdentically) {
  for (bool rotate : {false, true}) {
    CacheConfig cfg = small_cfg();
    if (rotate) {
      cfg.skvq_rotation = Rotation::kHadamard;
      cfg.skvq_rotate_values = true;
    }
    const Tensor k = hetero(2, 2, 90, 64, 180), v = hetero(2, 2, 90, 64, 181);
    auto a = make(cfg);
    a->update_and_fetch(k.view().slice_tokens(0, 41), v.view().slice_tokens(0, 41));
    std::istringstream in(state_of(*a));
    auto b = make(cfg);
    b->load(in);
    EXPECT_EQ(state_of(*a), state_of(*b));
    for (int64_t s = 41; s < 90; s += 7) {
      const int64_t e = std::min<int64_t>(90, s + 7);
      const CacheView va =
          a->update_and_fetch(k.view().slice_tokens(s, e), v.view().slice_tokens(s, e));
      const CacheView vb =
          b->update_and_fetch(k.view().slice_tokens(s, e), v.view().slice_tokens(s, e));
      EXPECT_EQ(rows_of(va, 1, 0), rows_of(vb, 1, 0));
    }
    EXPECT_EQ(state_of(*a), state_of(*b));
    EXPECT_EQ(a->stats().figures, b->stats().figures);
  }
}

TEST(SkvqCache, EmptyCacheSavesAndLoads) {
  auto a = make(small_cfg()), b = make(small_cfg());
  std::istringstream in(state_of(*a));
  b->load(in);
  EXPECT_EQ(b->offset(), 0);
  EXPECT_EQ(state_of(*a), state_of(*b));
}

TEST(SkvqCache, BadStateRefusedAndNothingChanged) {
  const Tensor k = hetero(1, 2, 40, 64, 190), v = hetero(1, 2, 40, 64, 191);
  auto a = make(small_cfg());
  a->update_and_fetch(k.view(), v.view());
  const std::string good = state_of(*a);
  auto b = make(small_cfg());
  b->update_and_fetch(k.view().slice_tokens(0, 5), v.view().slice_tokens(0, 5));
  const std::string b_before = state_of(*b);
  auto refused = [&](const std::string& bytes, const char* what) {
    std::istringstream in(bytes);
    EXPECT_THROW(b->load(in), Error) << what;
    EXPECT_EQ(state_of(*b), b_before) << what;
  };
  refused(good.substr(0, good.size() / 2), "truncated");
  std::string flipped = good;
  flipped[flipped.size() / 2] ^= 0x10;
  refused(flipped, "corrupted");
  // Another configuration's state.
  CacheConfig other = small_cfg();
  other.skvq_window = 32;
  auto c = std::make_unique<SkvqCache>(other);
  c->update_and_fetch(k.view(), v.view());
  try {
    std::istringstream in(state_of(*c));
    b->load(in);
    ADD_FAILURE() << "state of another window accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("skvq_window"), std::string::npos) << e.what();
  }
  EXPECT_EQ(state_of(*b), b_before);
  // Another method's state.
  FullCache full;
  full.update_and_fetch(k.view(), v.view());
  refused(state_of(full), "full cache state");
}

// ---- issue 17: bounded settings and clear settings messages --------------------------------

TEST(SkvqCache, RecentOrWindowPastTheCapRefusedAtConstruction) {
  // recent=9223372036854775807 made window + recent wrap and the flush frontier loop forever.
  for (const int64_t recent : {std::numeric_limits<int64_t>::max(), kMaxCacheRows + 1}) {
    CacheConfig cfg = small_cfg();
    cfg.skvq_recent = recent;
    try {
      SkvqCache c(cfg);
      ADD_FAILURE() << "skvq_recent " << recent << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("skvq_recent: expected <= 2147483647"),
                std::string::npos)
          << e.what();
    }
  }
  CacheConfig wide = small_cfg();
  wide.skvq_window = std::numeric_limits<int64_t>::max();
  EXPECT_THROW(SkvqCache{wide}, Error);
}

TEST(SkvqCache, RecentAtTheCapKeepsEverythingFullPrecision) {
  // The largest recent allowed: window + recent is computed once, without overflow; nothing is
  // ever flushed (fewer than window + recent rows), one-shot or token by token.
  CacheConfig cfg = small_cfg();
  cfg.skvq_recent = kMaxCacheRows;
  const Tensor k = hetero(1, 2, 70, 64, 130), v = hetero(1, 2, 70, 64, 131);
  auto a = make(cfg), b = make(cfg);
  feed(*a, k, v, {70});
  feed(*b, k, v);
  EXPECT_EQ(a->quantized_tokens(), 0);
  EXPECT_EQ(b->quantized_tokens(), 0);
  EXPECT_EQ(state_of(*a), state_of(*b));
  std::istringstream in(state_of(*a));
  auto c = make(cfg);
  c->load(in);
  EXPECT_EQ(c->offset(), 70);
}

TEST(SkvqCache, StateOfOtherSettingsNamesTheSettingAsWritten) {
  // Was "expected skvq_bits_value (x2) 8 (this cache) but the state has 4".
  const Tensor k = hetero(1, 2, 40, 64, 195), v = hetero(1, 2, 40, 64, 196);
  struct Case {
    std::function<void(CacheConfig&)> saved, mine;
    const char* message;
  };
  const Case cases[] = {
      {[](CacheConfig& c) { c.skvq_bits_value = 2; }, [](CacheConfig& c) { c.skvq_bits_value = 4; },
       "[skvq] state was saved with skvq_bits_value=2 but this cache has 4; nothing was changed"},
      {[](CacheConfig& c) { c.skvq_bits_key = 1.5; }, [](CacheConfig& c) { c.skvq_bits_key = 2; },
       "[skvq] state was saved with skvq_bits_key=1.5 but this cache has 2; nothing was changed"},
      {[](CacheConfig& c) { c.skvq_meta = MetaType::kFP8E4M3; },
       [](CacheConfig& c) { c.skvq_meta = MetaType::kF16; },
       "[skvq] state was saved with skvq_meta=fp8_e4m3 but this cache has float16; nothing was "
       "changed"},
      {[](CacheConfig& c) { c.skvq_recent = 3; }, [](CacheConfig&) {},
       "[skvq] state was saved with skvq_recent=3 but this cache has 0; nothing was changed"},
      {[](CacheConfig& c) { c.skvq_clip_search = false; }, [](CacheConfig&) {},
       "[skvq] state was saved with skvq_clip_search=false but this cache has true; nothing was "
       "changed"},
  };
  for (const auto& cs : cases) {
    CacheConfig saved = small_cfg(), mine = small_cfg();
    cs.saved(saved);
    cs.mine(mine);
    auto a = make(saved), b = make(mine);
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

// ---- real storage -------------------------------------------------------------------------------

size_t heap_in_use() {
  return mallinfo2().uordblks;
}

// 8192 tokens, H = 8, D = 128, K2V2, group 32, window 128, fp16 input. Packed rows are the only
// copy of flushed tokens, so resident bytes follow the byte formula: resident <= 1.05 x accounted
// + F, F = the full-precision tail buffer's slack (at most max(live rows, 16) rows of K and V:
// 16 * B*H*D*2*2 = 64 KiB here, as the tail is empty at 8192) + 64 KiB of bookkeeping, and below
// 0.2x the full cache (which holds 8192 fp16 rows: 32 MiB). The resident figure is checked
// against the heap growth malloc reports, so it cannot be an accounting fiction.
TEST(SkvqCache, ResidentMemoryFollowsAccountedBytes) {
  CacheConfig cfg;
  cfg.method = "skvq";
  cfg.head_dim = 128;
  cfg.skvq_window = 128;
  cfg.skvq_group_size = 32;
  const int64_t n = 8192, h = 8, d = 128;
  const Tensor k = test::random_tensor(DType::kF16, 1, h, n, d, 200);
  const Tensor v = test::random_tensor(DType::kF16, 1, h, n, d, 201);
  FullCache full;
  full.update_and_fetch(k.view(), v.view());
  const int64_t full_resident = full.stats().bytes_resident;
  for (int mode = 0; mode < 2; ++mode) {
    const size_t heap0 = heap_in_use();
    auto c = std::make_unique<SkvqCache>(cfg);
    if (mode == 0) {
      c->update_and_fetch(k.view(), v.view());
    } else {  // chunked prefill, then decode
      c->update_and_fetch(k.view().slice_tokens(0, 3000), v.view().slice_tokens(0, 3000));
      for (int64_t s = 3000; s < n; ++s)
        c->update_and_fetch(k.view().slice_tokens(s, s + 1), v.view().slice_tokens(s, s + 1));
    }
    const int64_t heap = static_cast<int64_t>(heap_in_use()) - static_cast<int64_t>(heap0);
    const CacheStats st = c->stats();
    const int64_t fixed = 16 * h * d * 2 * 2 + 64 * 1024;
    std::printf("[memory] mode %d: accounted %lld, resident %lld, heap %lld, full %lld (%.3fx)\n",
                mode, static_cast<long long>(st.bytes_accounted),
                static_cast<long long>(st.bytes_resident), static_cast<long long>(heap),
                static_cast<long long>(full_resident),
                double(st.bytes_resident) / double(full_resident));
    EXPECT_LE(st.bytes_resident, 1.05 * st.bytes_accounted + fixed);
    EXPECT_LT(st.bytes_resident, 0.2 * full_resident);
    // The heap grew by what the cache says it holds (malloc headers: 16 bytes per block).
    // Only with glibc's allocator: AddressSanitizer replaces malloc and mallinfo2 reports 0.
#ifndef __SANITIZE_ADDRESS__
    EXPECT_LE(heap, st.bytes_resident + 64 * 1024);
    EXPECT_GE(heap, st.bytes_resident * 0.95);
#endif
  }
}

}  // namespace
}  // namespace vq

// ---- skvq_key_axis=channel (per-channel keys over each chunk, packed.h) ---------------------

namespace vq {
namespace {

CacheConfig channel_cfg() {
  CacheConfig c = small_cfg();
  c.skvq_key_axis = QuantAxis::kChannel;
  return c;
}

TEST(SkvqCacheChannel, WorkedExampleByteFigures) {
  // Chunk 0 holds rows 4..15 (12 rows: the format's shortest), chunk 1 rows 16..31. Each record:
  // 64 2-bit codes (16 bytes) + ceil(2 * 64 / 12) = 11 fp16 metadata slots (22 bytes).
  auto c = make(channel_cfg());
  const Tensor k = hetero(1, 2, 35, 64, 1), v = hetero(1, 2, 35, 64, 2);
  c->update_and_fetch(k.view(), v.view());
  EXPECT_EQ(figure(*c, "compressed_key_bytes"), 2 * (12 * (16 + 22) + 16 * (16 + 22)));
  EXPECT_EQ(figure(*c, "compressed_value_bytes"), 1792);  // values per token, as before
  EXPECT_EQ(figure(*c, "residual_fp16_bytes"), 3584);
  const CacheStats st = c->stats();
  EXPECT_EQ(st.bytes_accounted, 2128 + 1792 + 3584 + 1024);
}

TEST(SkvqCacheChannel, OneShotEqualsTokenByTokenBitForBit) {
  const Tensor k = hetero(2, 2, 70, 64, 11), v = hetero(2, 2, 70, 64, 12);
  auto a = make(channel_cfg()), b = make(channel_cfg());
  a->update_and_fetch(k.view(), v.view());
  feed(*b, k, v);
  EXPECT_EQ(state_of(*a), state_of(*b));
  // Sinks and the tail are exact, packed rows are not (their codes: test_group_quant.cpp).
  const auto rows = rows_of(a->stored_view(), 1, 1);
  ASSERT_EQ(rows.size(), 70u);
  for (int64_t s : {0, 3, 64, 69}) EXPECT_TRUE(row_equals_input(rows[s], k, 1, 1, s)) << s;
  EXPECT_FALSE(row_equals_input(rows[10], k, 1, 1, 10));
}

TEST(SkvqCacheChannel, SaveLoadContinuesBitIdenticallyInStateVersion2) {
  for (bool rotate : {false, true}) {
    CacheConfig cfg = channel_cfg();
    if (rotate) cfg.skvq_rotation = Rotation::kHadamard;
    const Tensor k = hetero(2, 2, 90, 64, 180), v = hetero(2, 2, 90, 64, 181);
    auto a = make(cfg);
    a->update_and_fetch(k.view().slice_tokens(0, 41), v.view().slice_tokens(0, 41));
    const std::string saved = state_of(*a);
    EXPECT_EQ(saved[8], 2) << "channel-axis states are frame version 2";
    std::istringstream in(saved);
    auto b = make(cfg);
    b->load(in);
    EXPECT_EQ(state_of(*b), saved);
    for (int64_t s = 41; s < 90; s += 7) {
      const int64_t e = std::min<int64_t>(90, s + 7);
      const CacheView va =
          a->update_and_fetch(k.view().slice_tokens(s, e), v.view().slice_tokens(s, e));
      const CacheView vb =
          b->update_and_fetch(k.view().slice_tokens(s, e), v.view().slice_tokens(s, e));
      EXPECT_EQ(rows_of(va, 1, 0), rows_of(vb, 1, 0));
    }
    EXPECT_EQ(state_of(*a), state_of(*b));
    EXPECT_EQ(a->stats().figures, b->stats().figures);
  }
  // Token-axis states stay version 1 (tests/test_state_compat.cpp: old files resave identically).
  auto t = make(small_cfg());
  t->update_and_fetch(hetero(1, 2, 20, 64, 3).view(), hetero(1, 2, 20, 64, 4).view());
  EXPECT_EQ(state_of(*t)[8], 1);
}

TEST(SkvqCacheChannel, StateOfTheOtherAxisRefusedNamingIt) {
  const Tensor k = hetero(1, 2, 40, 64, 190), v = hetero(1, 2, 40, 64, 191);
  for (int dir = 0; dir < 2; ++dir) {
    auto a = make(dir == 0 ? small_cfg() : channel_cfg());
    auto b = make(dir == 0 ? channel_cfg() : small_cfg());
    a->update_and_fetch(k.view(), v.view());
    b->update_and_fetch(k.view().slice_tokens(0, 20), v.view().slice_tokens(0, 20));
    const std::string before = state_of(*b);
    try {
      std::istringstream in(state_of(*a));
      b->load(in);
      ADD_FAILURE() << "state of the other axis accepted";
    } catch (const Error& e) {
      const std::string want = dir == 0 ? "[skvq] state was saved with skvq_key_axis=token but "
                                          "this cache has channel; nothing was changed"
                                        : "[skvq] state was saved with skvq_key_axis=channel but "
                                          "this cache has token; nothing was changed";
      EXPECT_EQ(std::string(e.what()), want);
    }
    EXPECT_EQ(state_of(*b), before);
  }
}

TEST(SkvqCacheChannel, OptionParsedAndRefusedWhereUnsupported) {
  const CacheConfig c = parse_cache_arg("skvq:bits_key=2:key_axis=channel");
  EXPECT_EQ(c.skvq_key_axis, QuantAxis::kChannel);
  EXPECT_EQ(config_from_json(config_to_json(c)).skvq_key_axis, QuantAxis::kChannel);
  try {
    (void)parse_cache_arg("skvq:key_axis=rows");
    ADD_FAILURE() << "key_axis=rows accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("skvq_key_axis"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("channel"), std::string::npos) << e.what();
  }
  CacheConfig sk = channel_cfg();
  sk.method = "snapkv+skvq";  // snap_evict_at = prefill_call (the default)
  try {
    (void)make_cache(sk);
    ADD_FAILURE() << "snapkv+skvq with channel-axis keys evicting per prefill call accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[snapkv+skvq] skvq_key_axis=channel: expected "
                                         "snap_evict_at=prompt_end"),
              std::string::npos)
        << e.what();
  }
}

// ---- skvq_key_rows (channel-axis keys over runs of rows inside each chunk) -------------------
CacheConfig key_rows_cfg(int64_t r) {
  CacheConfig c = channel_cfg();
  c.skvq_key_rows = r;
  return c;
}

TEST(SkvqCacheKeyRows, RunsOfAChunkAndWorkedByteFigures) {
  // window 16, n_sink 4: chunk 0 holds 12 rows, later chunks 16.
  const skvq::Settings s5 = skvq::Settings::from_config(key_rows_cfg(5), 0, "skvq");
  EXPECT_EQ(s5.chunk_blocks(12), (std::vector<int64_t>{5, 7}));
  EXPECT_EQ(s5.chunk_blocks(16), (std::vector<int64_t>{5, 5, 6}));
  const skvq::Settings s8 = skvq::Settings::from_config(key_rows_cfg(8), 0, "skvq");
  EXPECT_EQ(s8.chunk_blocks(12), (std::vector<int64_t>{12}));  // one run takes the remainder
  EXPECT_EQ(s8.chunk_blocks(16), (std::vector<int64_t>{8, 8}));
  // Runs of at least 8 rows hold ceil(2 * 64 / 8) = 16 fp16 metadata slots per record: 16 code
  // bytes + 32 metadata bytes. S = 35 packs chunks 0 (12 rows) and 1 (16 rows) of 2 heads.
  auto c = make(key_rows_cfg(8));
  c->update_and_fetch(hetero(1, 2, 35, 64, 1).view(), hetero(1, 2, 35, 64, 2).view());
  EXPECT_EQ(figure(*c, "compressed_key_bytes"), 2 * (12 + 16) * (16 + 32));
  EXPECT_EQ(figure(*c, "compressed_value_bytes"), 1792);  // values per token, as before
  EXPECT_EQ(figure(*c, "quantized_tokens"), 32);
}

// Runs of r rows inside chunks of window W hold the same codes and metadata as chunks of r rows
// (no sinks, no reordering, so nothing else depends on the window): every packed row equal.
TEST(SkvqCacheKeyRows, RunsEqualChunksOfTheirLength) {
  for (bool rotate : {false, true}) {
    CacheConfig a = key_rows_cfg(8), b = channel_cfg();
    for (CacheConfig* c : {&a, &b}) {
      c->skvq_n_sink = 0;
      c->skvq_reorder = false;
      if (rotate) c->skvq_rotation = Rotation::kHadamard;
    }
    b.skvq_window = 8;
    const Tensor k = hetero(2, 2, 34, 64, 21), v = hetero(2, 2, 34, 64, 22);
    auto ca = make(a), cb = make(b);
    const CacheView va = ca->update_and_fetch(k.view(), v.view());
    const CacheView vb = cb->update_and_fetch(k.view(), v.view());
    EXPECT_EQ(ca->quantized_tokens(), 32);
    EXPECT_EQ(cb->quantized_tokens(), 32);
    for (int64_t h = 0; h < 2; ++h) {
      EXPECT_EQ(rows_of(va, 1, h), rows_of(vb, 1, h)) << h;
      EXPECT_EQ(rows_of(va, 1, h, true), rows_of(vb, 1, h, true)) << h;
    }
    // ... and differ from whole 16-row chunks (the runs are fitted separately).
    CacheConfig whole = a;
    whole.skvq_key_rows = 0;
    auto cw = make(whole);
    EXPECT_NE(rows_of(cw->update_and_fetch(k.view(), v.view()), 1, 0), rows_of(va, 1, 0));
  }
}

TEST(SkvqCacheKeyRows, OneShotEqualsTokenByTokenAndSaveLoadInStateVersion3) {
  const Tensor k = hetero(2, 2, 70, 64, 31), v = hetero(2, 2, 70, 64, 32);
  auto a = make(key_rows_cfg(5)), b = make(key_rows_cfg(5));
  a->update_and_fetch(k.view().slice_tokens(0, 41), v.view().slice_tokens(0, 41));
  for (int64_t t = 0; t < 41; ++t)
    b->update_and_fetch(k.view().slice_tokens(t, t + 1), v.view().slice_tokens(t, t + 1));
  const std::string saved = state_of(*a);
  EXPECT_EQ(saved, state_of(*b));
  EXPECT_EQ(saved[8], 3) << "states with skvq_key_rows are frame version 3";
  auto c = make(key_rows_cfg(5));
  std::istringstream in(saved);
  c->load(in);
  EXPECT_EQ(state_of(*c), saved);
  const CacheView va =
      a->update_and_fetch(k.view().slice_tokens(41, 70), v.view().slice_tokens(41, 70));
  const CacheView vc =
      c->update_and_fetch(k.view().slice_tokens(41, 70), v.view().slice_tokens(41, 70));
  EXPECT_EQ(rows_of(va, 1, 1), rows_of(vc, 1, 1));
  EXPECT_EQ(a->stats().figures, c->stats().figures);
  // A version-2 state (whole-chunk runs) and a version-3 one of other runs are refused by name.
  for (const int64_t other : {int64_t{0}, int64_t{6}}) {
    auto o = make(key_rows_cfg(other));
    o->update_and_fetch(k.view().slice_tokens(0, 41), v.view().slice_tokens(0, 41));
    std::istringstream oin(state_of(*o));
    const std::string before = state_of(*c);
    try {
      c->load(oin);
      ADD_FAILURE() << "state of key_rows " << other << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()),
                "[skvq] state was saved with skvq_key_rows=" + std::to_string(other) +
                    " but this cache has 5; nothing was changed");
    }
    EXPECT_EQ(state_of(*c), before);
  }
}

TEST(SkvqCacheKeyRows, BadValuesRefusedNamingTheField) {
  const auto refused = [](const std::string& spec, const std::string& want) {
    try {
      CacheConfig c = parse_cache_arg(spec);
      c.head_dim = 64;
      (void)make_cache(c);
      ADD_FAILURE() << spec << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  refused("skvq:key_rows=32", "skvq_key_rows: expected 0 with skvq_key_axis=token");
  refused("skvq:key_axis=channel:key_rows=124",
          "skvq_key_rows: expected 0 (the whole chunk) or 1..skvq_window - skvq_n_sink (123");
  refused("skvq:key_axis=channel:key_rows=-1", "skvq_key_rows");
  const CacheConfig ok = parse_cache_arg("skvq:key_axis=channel:key_rows=32");
  EXPECT_EQ(ok.skvq_key_rows, 32);
  EXPECT_EQ(config_from_json(config_to_json(ok)).skvq_key_rows, 32);
}

// ---- skvq_layer_bits_key / skvq_layer_key_rows (mixed key precision by layer) ----------------

// The caches build_caches makes for three 2-head D-64 layers under cfg's per-layer lists, each
// checked against the single-field cache of its entries (`single(l)`: cfg without the lists, the
// fields set to entry l) after the same updates (rows 17, 28 of k, v): the same state bytes
// (settings, codes, metadata) and byte figures. The layers' states come back in `states`.
std::vector<std::unique_ptr<KVCache>> layers_as_single_field_caches(
    const CacheConfig& cfg, const std::function<CacheConfig(int64_t)>& single, uint64_t seed,
    std::vector<std::string>& states) {
  auto layers = build_caches(ModelCacheShape{{2, 2, 2}, {64, 64, 64}}, cfg);
  EXPECT_EQ(layers.size(), 3u);
  const Tensor k = hetero(1, 2, 45, 64, seed), v = hetero(1, 2, 45, 64, seed + 1);
  states.clear();
  for (int64_t l = 0; l < static_cast<int64_t>(layers.size()); ++l) {
    auto one = make_skvq_cache(single(l), l);
    feed(*layers[static_cast<size_t>(l)], k, v, {17, 28});
    feed(*one, k, v, {17, 28});
    states.push_back(state_of(*layers[static_cast<size_t>(l)]));
    EXPECT_TRUE(states.back() == state_of(*one)) << "state bytes differ, layer " << l;
    EXPECT_EQ(layers[static_cast<size_t>(l)]->stats().figures, one->stats().figures) << l;
  }
  return layers;
}

// Layer l of a model's caches with per-layer lists is the single-field cache of its entries: the
// same state bytes (settings, codes, metadata) and byte figures, so each layer's formats, byte
// formulas, attention and state frames are those the single fields already have.
TEST(SkvqCacheLayerKeys, EachLayerEqualsTheSingleFieldCacheOfItsEntries) {
  CacheConfig cfg = key_rows_cfg(8);
  cfg.skvq_rotation = Rotation::kHadamard;
  cfg.skvq_meta = MetaType::kFP8E4M3;
  cfg.skvq_layer_bits_key = "3/2/1.5";
  cfg.skvq_layer_key_rows = "5/0/8";
  const double bits[] = {3, 2, 1.5};
  const int64_t rows[] = {5, 0, 8};
  std::vector<std::string> states;
  const auto layers = layers_as_single_field_caches(
      cfg,
      [&](int64_t l) {
        CacheConfig one = cfg;
        one.skvq_layer_bits_key.clear();
        one.skvq_layer_key_rows.clear();
        one.skvq_bits_key = bits[l];
        one.skvq_key_rows = rows[l];
        return one;
      },
      41, states);
  ASSERT_EQ(layers.size(), 3u);
  // Worked key bytes at S = 45 (chunks 0 and 1: 12 + 16 rows of 2 heads, fp8 metadata):
  // layer 0, 3 bits, runs of >= 5: 24 code bytes + ceil(128 / 5) = 26 slots;
  // layer 1, 2 bits, whole chunks (>= 12 rows): 16 + ceil(128 / 12) = 11;
  // layer 2, 1.5 bits (five codes a byte), runs of >= 8: ceil(64 / 5) = 13 + 16 slots.
  const int64_t per_row[] = {24 + 26, 16 + 11, 13 + 16};
  for (int64_t l = 0; l < 3; ++l)
    EXPECT_EQ(figure(*layers[static_cast<size_t>(l)], "compressed_key_bytes"),
              2 * (12 + 16) * per_row[l])
        << l;
  // A layer's state is refused by another layer's cache, naming the setting; nothing changes.
  std::istringstream in(states[0]);
  try {
    layers[1]->load(in);
    ADD_FAILURE() << "layer 0's state accepted by layer 1";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[skvq] state was saved with skvq_bits_key=3 but this cache has 2; nothing was "
              "changed");
  }
  EXPECT_EQ(state_of(*layers[1]), states[1]);
}

TEST(SkvqCacheLayerKeys, ListsOfAnotherLengthAreRefused) {
  CacheConfig cfg = key_rows_cfg(8);
  cfg.skvq_layer_bits_key = "3/2/2";
  try {
    (void)build_caches(ModelCacheShape{{2, 2}, {64, 64}}, cfg);
    ADD_FAILURE() << "3 entries for 2 layers accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[build_caches] skvq_layer_bits_key: expected 2 entries (one per layer) but got 3 "
              "('3/2/2')");
  }
  cfg.skvq_layer_bits_key.clear();
  cfg.skvq_layer_key_rows = "8";
  try {
    (void)make_skvq_cache(cfg, 1);
    ADD_FAILURE() << "layer 1 of a one-entry list accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[cache_config] skvq_layer_key_rows: expected an entry for layer 1 but got 1 "
              "entries ('8')");
  }
  // snapkv+skvq reads the lists too (its settings are the same per-layer ones).
  CacheConfig snap = cfg;
  snap.method = "snapkv+skvq";
  snap.snap_evict_at = SnapEvictAt::kPromptEnd;
  snap.skvq_layer_key_rows = "8/4";
  EXPECT_EQ(skvq::Settings::from_config(snap, 1, "snapkv+skvq").key_rows, 4);
}

// skvq_layer_bits_value: layer l is the single-field cache of its value bits (and of its key
// entries, the lists combine); each layer's value bytes follow its own bits; a list of another
// length is refused by the builder before any cache is made.
TEST(SkvqCacheLayerValues, EachLayerEqualsTheSingleFieldCacheOfItsEntries) {
  CacheConfig cfg = key_rows_cfg(8);
  cfg.skvq_meta = MetaType::kFP8E4M3;
  cfg.skvq_rotation = Rotation::kHadamard;
  cfg.skvq_rotate_values = true;
  cfg.skvq_layer_bits_value = "3/2/4";
  cfg.skvq_layer_bits_key = "2/3/2";
  const double vbits[] = {3, 2, 4}, kbits[] = {2, 3, 2};
  std::vector<std::string> states;
  const auto layers = layers_as_single_field_caches(
      cfg,
      [&](int64_t l) {
        CacheConfig one = cfg;
        one.skvq_layer_bits_value.clear();
        one.skvq_layer_bits_key.clear();
        one.skvq_bits_value = vbits[l];
        one.skvq_bits_key = kbits[l];
        return one;
      },
      51, states);
  ASSERT_EQ(layers.size(), 3u);
  // Worked value bytes at S = 45 (chunks 0 and 1: 12 + 16 rows of 2 heads; values per token in
  // groups of 16 with fp8 (lo, scale): 4 groups a row, 8 metadata bytes): 64 codes of 3 bits are
  // 24 bytes, of 2 bits 16, of 4 bits 32.
  const int64_t per_row[] = {24 + 8, 16 + 8, 32 + 8};
  for (int64_t l = 0; l < 3; ++l)
    EXPECT_EQ(figure(*layers[static_cast<size_t>(l)], "compressed_value_bytes"),
              2 * (12 + 16) * per_row[l])
        << l;
  // Another layer's state is refused, naming the value setting; nothing changes.
  std::istringstream in(states[2]);
  try {
    layers[0]->load(in);
    ADD_FAILURE() << "layer 2's state accepted by layer 0";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[skvq] state was saved with skvq_bits_value=4 but this cache has 3; nothing was "
              "changed");
  }
  EXPECT_EQ(state_of(*layers[0]), states[0]);
  cfg.skvq_layer_bits_value = "3/2";
  try {
    (void)build_caches(ModelCacheShape{{2, 2, 2}, {64, 64, 64}}, cfg);
    ADD_FAILURE() << "2 value entries for 3 layers accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[build_caches] skvq_layer_bits_value: expected 3 entries (one per layer) but got 2 "
              "('3/2')");
  }
}

// make_layer_cache(cfg, l) is build_caches' cache of layer l (the Python cache layers make theirs
// with it): the same state bytes for both SKVQ methods; a layer past the lists is refused, naming
// the list; a negative layer is refused.
TEST(SkvqCacheLayerKeys, MakeLayerCacheIsTheBuildersLayer) {
  CacheConfig cfg = key_rows_cfg(8);
  cfg.skvq_layer_bits_key = "3/2";
  cfg.skvq_layer_key_rows = "8/4";
  CacheConfig snap = cfg;
  snap.method = "snapkv+skvq";
  snap.snap_evict_at = SnapEvictAt::kPromptEnd;
  snap.snap_budget = 40;
  snap.snap_obs_window = 8;
  snap.snap_n_sink = 0;
  snap.snap_scoring = SnapScoring::kKeyProxy;  // no queries in feed()
  snap.skvq_n_sink = 0;
  snap.skvq_reorder = false;
  const Tensor k = hetero(1, 2, 45, 64, 43), v = hetero(1, 2, 45, 64, 44);
  for (const CacheConfig& c : {cfg, snap}) {
    auto layers = build_caches(ModelCacheShape{{2, 2}, {64, 64}}, c);
    for (int64_t l = 0; l < 2; ++l) {
      auto one = make_layer_cache(c, l);
      feed(*layers[static_cast<size_t>(l)], k, v, {17, 28});
      feed(*one, k, v, {17, 28});
      EXPECT_TRUE(state_of(*layers[static_cast<size_t>(l)]) == state_of(*one))
          << c.method << " layer " << l;
    }
    try {
      (void)make_layer_cache(c, 2);
      ADD_FAILURE() << "layer 2 of two-entry lists accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()),
                "[cache_config] skvq_layer_bits_key: expected an entry for layer 2 but got 2 "
                "entries ('3/2')");
    }
  }
  EXPECT_THROW((void)make_layer_cache(cfg, -1), Error);
  // Methods without per-layer settings are make_cache's.
  CacheConfig full;
  full.method = "full";
  full.head_dim = 64;
  EXPECT_EQ(make_layer_cache(full, 5)->method(), "full");
}

// ---- snapkv+skvq with channel-axis keys: the kept rows are packed per channel after the one
// selection at the end of the prompt (snap_evict_at = prompt_end) ------------------------------

CacheConfig snap_channel_cfg(int64_t key_rows) {
  CacheConfig c = key_rows_cfg(key_rows);
  c.method = "snapkv+skvq";
  c.snap_budget = 40;
  c.snap_obs_window = 8;
  c.snap_n_sink = 0;
  c.snap_scoring = SnapScoring::kQuery;
  c.snap_evict_at = SnapEvictAt::kPromptEnd;
  c.skvq_n_sink = 0;  // no full-precision sinks: frames are packed from their first kept row
  c.skvq_reorder = false;
  return c;
}

CacheConfig as_skvq(CacheConfig c) {
  c.method = "skvq";
  return c;
}

// One prompt chunk [1, 2, s, 64] with its queries [1, 2, s, 64], then the end of the prompt.
void snap_prompt(KVCache& c, const Tensor& k, const Tensor& v, uint64_t seed) {
  const Tensor q = test::random_tensor(DType::kF32, 1, 2, k.shape()[2], 64, seed);
  const TensorView qv = q.view();
  UpdateOptions o;
  o.queries = &qv;
  c.update_and_fetch(k.view(), v.view(), o);
  c.end_prompt();
}

// Rows [positions] of head h of x as a [1, 1, n, 64] block.
Tensor gather_rows(const Tensor& x, int64_t h, const std::vector<int32_t>& positions) {
  Tensor out(x.dtype(), 1, 1, static_cast<int64_t>(positions.size()), 64);
  for (size_t i = 0; i < positions.size(); ++i)
    for (int64_t c = 0; c < 64; ++c)
      out.set(0, 0, static_cast<int64_t>(i), c, x.at(0, h, positions[i], c));
  return out;
}

// Evict then quantize == SKVQ alone over each head's kept rows: every kept row (packed or not)
// dequantizes bit for bit as a channel-axis SKVQ cache fed that head's kept rows holds it.
TEST(SnapkvSkvqChannel, KeptRowsPackedAsSkvqAloneOverThem) {
  for (const int64_t key_rows : {int64_t{0}, int64_t{8}}) {
    const Tensor k = hetero(1, 2, 100, 64, 41), v = hetero(1, 2, 100, 64, 42);
    auto both = std::make_unique<SnapkvSkvqCache>(snap_channel_cfg(key_rows));
    snap_prompt(*both, k, v, 43);
    ASSERT_EQ(both->stored_rows(), 40);
    const CacheView vb = both->stored_view();
    for (int64_t h = 0; h < 2; ++h) {
      const std::vector<int32_t> pos = both->stored_positions(0, h);
      CacheConfig alone = key_rows_cfg(key_rows);
      alone.skvq_n_sink = 0;
      alone.skvq_reorder = false;
      auto a = make(alone);
      const CacheView va =
          a->update_and_fetch(gather_rows(k, h, pos).view(), gather_rows(v, h, pos).view());
      EXPECT_EQ(a->quantized_tokens(), 32);  // 2 chunks of 16 packed, 8 rows full precision
      EXPECT_EQ(rows_of(vb, 0, h), rows_of(va, 0, 0)) << "key_rows " << key_rows << " h " << h;
      EXPECT_EQ(rows_of(vb, 0, h, true), rows_of(va, 0, 0, true)) << key_rows << " h " << h;
    }
    EXPECT_EQ(figure(*both, "packed_rows"), 32);
    // Key bytes: 2 heads x 32 rows x (16 code bytes + n_groups fp16 slots); n_groups =
    // ceil(128 / 16) = 8 for whole chunks (window = 16 rows), 16 for runs of 8.
    EXPECT_EQ(figure(*both, "compressed_key_bytes"), 2 * 32 * (16 + 2 * (key_rows ? 16 : 8)));
  }
  // snapkv+skvq packs chunks of `window` kept rows whatever skvq_n_sink (its sinks stay apart):
  // ceil(128 / 16) = 8 slots with skvq_n_sink = 4 too, where SKVQ alone (chunk 0: 12 rows) needs
  // ceil(128 / 12) = 11.
  CacheConfig sinks = snap_channel_cfg(0);
  sinks.skvq_n_sink = 4;
  EXPECT_EQ(skvq::Settings::from_config(sinks, 0, "snapkv+skvq").fk.n_groups, 8);
  EXPECT_EQ(skvq::Settings::from_config(as_skvq(sinks), 0, "skvq").fk.n_groups, 11);
}

TEST(SnapkvSkvqChannel, SaveLoadAndRefusals) {
  const Tensor k = hetero(1, 2, 100, 64, 51), v = hetero(1, 2, 100, 64, 52);
  for (const int64_t key_rows : {int64_t{0}, int64_t{8}}) {
    const CacheConfig cfg = snap_channel_cfg(key_rows);
    auto a = make_cache(cfg), b = make_cache(cfg);
    snap_prompt(*a, k, v, 53);
    const std::string saved = state_of(*a);
    EXPECT_EQ(saved[8], key_rows ? 3 : 2);
    std::istringstream in(saved);
    b->load(in);
    EXPECT_EQ(state_of(*b), saved);
    for (int64_t t = 0; t < 20; ++t) {  // decode steps flush more chunks of kept rows
      const Tensor kt = hetero(1, 2, 1, 64, 60 + t), vt = hetero(1, 2, 1, 64, 90 + t);
      a->update_and_fetch(kt.view(), vt.view());
      b->update_and_fetch(kt.view(), vt.view());
    }
    EXPECT_EQ(state_of(*a), state_of(*b));
    EXPECT_EQ(figure(*a, "packed_rows"), 48);
    // A new prompt over packed channel-axis rows would select single rows of packed chunks.
    const std::string before = state_of(*a);
    try {
      a->update_and_fetch(k.view().slice_tokens(0, 5), v.view().slice_tokens(0, 5));
      ADD_FAILURE() << "a prompt after packed channel-axis rows accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()),
                "[snapkv+skvq] skvq_key_axis=channel: expected single-token calls once rows are "
                "packed (a new prompt's selection would keep single rows of packed chunks, whose "
                "per-channel metadata needs all of their rows) but got 5 rows with 48 packed; "
                "nothing was changed");
    }
    EXPECT_EQ(state_of(*a), before);
  }
}

}  // namespace
}  // namespace vq

// ---- skvq_query_moments_file (error-feedback key rounding, veloxquant/key_rounding.h) --------

namespace vq {
namespace {

// A moment file of `layers` layers, `heads` heads of head_dim d: moments with a few dominant
// directions (a head's queries have them), different per layer and head.
std::string write_moments(const std::string& name, int64_t layers, int64_t heads, int64_t d) {
  QueryMomentSet set;
  set.n_kv_heads = heads;
  set.head_dim = d;
  set.n_tokens = 100;
  std::mt19937_64 rng(17);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int64_t l = 0; l < layers; ++l) {
    std::vector<double> m(static_cast<size_t>(heads * d * d), 0.0);
    for (int64_t h = 0; h < heads; ++h) {
      double* mh = m.data() + h * d * d;
      for (int r = 0; r < 4; ++r) {
        std::vector<double> a(static_cast<size_t>(d));
        for (auto& x : a) x = nd(rng) / (1 + r);
        for (int64_t i = 0; i < d; ++i)
          for (int64_t j = 0; j < d; ++j) mh[i * d + j] += a[i] * a[j];
      }
      for (int64_t i = 0; i < d; ++i) mh[i * d + i] += 0.05;
    }
    set.layers.push_back(m);
  }
  const std::string path = ::testing::TempDir() + name;
  save_query_moment_file(path, set);
  return path;
}

CacheConfig moments_cfg(const std::string& path, bool rotate) {
  CacheConfig c = key_rows_cfg(6);
  c.skvq_query_moments_file = path;
  if (rotate) c.skvq_rotation = Rotation::kHadamard;
  return c;
}

TEST(SkvqCacheQueryMoments, ChunkedEqualsOneShotAndOnlyPackedKeyCodesChange) {
  const std::string path = write_moments("qm_cache.bin", 1, 2, 64);
  for (bool rotate : {false, true}) {
    const Tensor k = hetero(2, 2, 70, 64, 21), v = hetero(2, 2, 70, 64, 22);
    auto a = make(moments_cfg(path, rotate)), b = make(moments_cfg(path, rotate));
    CacheConfig plain_cfg = moments_cfg(path, rotate);
    plain_cfg.skvq_query_moments_file.clear();
    auto plain = make(plain_cfg);
    a->update_and_fetch(k.view(), v.view());
    feed(*b, k, v, {13, 29, 1, 27});
    plain->update_and_fetch(k.view(), v.view());
    EXPECT_EQ(state_of(*a), state_of(*b)) << "rotate " << rotate;
    EXPECT_NE(state_of(*a), state_of(*plain)) << "the option changed nothing";
    // Same values, sinks and tail; packed keys differ from the nearest codes in some row but
    // stay on the same grids (the dequantized rows are as close to the input as a step allows).
    EXPECT_EQ(a->stats().bytes_accounted, plain->stats().bytes_accounted);
    // Resident: the same stores plus the factors U of the 2 heads (64 x 64 fp64 each).
    EXPECT_EQ(a->stats().bytes_resident - plain->stats().bytes_resident, 2 * 64 * 64 * 8);
    const auto ka = rows_of(a->stored_view(), 1, 1), kp = rows_of(plain->stored_view(), 1, 1);
    const auto va = rows_of(a->stored_view(), 1, 1, true),
               vp = rows_of(plain->stored_view(), 1, 1, true);
    EXPECT_EQ(va, vp);
    int64_t differ = 0;
    for (int64_t s : {0, 3, 64, 69}) EXPECT_TRUE(row_equals_input(ka[s], k, 1, 1, s)) << s;
    for (size_t s = 0; s < ka.size(); ++s) differ += ka[s] != kp[s];
    EXPECT_GT(differ, 0);
  }
}

TEST(SkvqCacheQueryMoments, SaveLoadContinuesBitIdentically) {
  const std::string path = write_moments("qm_save.bin", 1, 2, 64);
  const CacheConfig cfg = moments_cfg(path, true);
  const Tensor k = hetero(1, 2, 90, 64, 31), v = hetero(1, 2, 90, 64, 32);
  auto a = make(cfg);
  a->update_and_fetch(k.view().slice_tokens(0, 41), v.view().slice_tokens(0, 41));
  std::istringstream in(state_of(*a));
  auto b = make(cfg);
  b->load(in);
  a->update_and_fetch(k.view().slice_tokens(41, 90), v.view().slice_tokens(41, 90));
  b->update_and_fetch(k.view().slice_tokens(41, 90), v.view().slice_tokens(41, 90));
  EXPECT_EQ(state_of(*a), state_of(*b));
}

TEST(SkvqCacheQueryMoments, RefusedWhereItCannotApplyNamingTheField) {
  const std::string path = write_moments("qm_refuse.bin", 2, 2, 64);
  const auto expect_refused = [](const CacheConfig& c, const std::string& needle) {
    try {
      auto cache = make(c);
      const Tensor k = hetero(1, 2, 20, 64, 1), v = hetero(1, 2, 20, 64, 2);
      cache->update_and_fetch(k.view(), v.view());
      ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("skvq_query_moments_file"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  CacheConfig token = small_cfg();
  token.skvq_query_moments_file = path;
  expect_refused(token, "skvq_key_axis=token");
  CacheConfig d32 = moments_cfg(write_moments("qm_d32.bin", 1, 2, 32), false);
  expect_refused(d32, "head_dim 64");
  expect_refused(moments_cfg(write_moments("qm_h3.bin", 1, 3, 64), false),
                 "moments for 2 KV heads");
  CacheConfig missing = moments_cfg(::testing::TempDir() + "qm_none.bin", false);
  expect_refused(missing, "could not open");
  // Layer 2 of a two-layer file.
  try {
    SkvqCache c(moments_cfg(path, false), 2);
    ADD_FAILURE() << "layer 2 of a two-layer file accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("an entry for layer 2"), std::string::npos) << e.what();
  }
  // The spec string reaches the field.
  const CacheConfig parsed = parse_cache_arg("skvq:key_axis=channel:query_moments_file=" + path);
  EXPECT_EQ(parsed.skvq_query_moments_file, path);
}

TEST(SkvqCacheQueryMoments, SnapkvSkvqRoundsItsChannelKeysToo) {
  const std::string path = write_moments("qm_snap.bin", 1, 2, 64);
  CacheConfig c = moments_cfg(path, true);
  c.method = "snapkv+skvq";
  c.snap_evict_at = SnapEvictAt::kPromptEnd;
  c.snap_budget = 40;
  CacheConfig plain = c;
  plain.skvq_query_moments_file.clear();
  const Tensor k = hetero(1, 2, 80, 64, 41), v = hetero(1, 2, 80, 64, 42);
  auto a = make_cache(c), p = make_cache(plain);
  a->update_and_fetch(k.view(), v.view());
  p->update_and_fetch(k.view(), v.view());
  a->end_prompt();
  p->end_prompt();
  EXPECT_NE(state_of(*a), state_of(*p));
  EXPECT_EQ(a->stored_rows(), p->stored_rows());
}

}  // namespace
}  // namespace vq

// ---- skvq_value_clip_floor (the value rows' clip search continued below 0.85) ----------------

namespace vq {
namespace {

CacheConfig floor_cfg(double floor) {
  CacheConfig c = small_cfg();
  c.skvq_meta = MetaType::kF32;
  c.skvq_value_clip_floor = floor;
  return c;
}

// The value rows are the reference quantizer's with the longer grid (bit for bit, as the seed's
// rows are in Fp32MetadataRowsMatchScalarRoundTripBitForBit); the key rows are the seed's, the
// same as a cache without the option; chunked equals one-shot.
TEST(SkvqCacheValueClipFloor, ValueRowsTakeTheLongerGridKeysDoNot) {
  auto c = make(floor_cfg(0.5)), seed = make(floor_cfg(0.85)), chunked = make(floor_cfg(0.5));
  const Tensor k = hetero(1, 2, 48, 64, 150, DType::kF32),
               v = hetero(1, 2, 48, 64, 151, DType::kF32);
  const CacheView view = c->update_and_fetch(k.view(), v.view());
  const CacheView sview = seed->update_and_fetch(k.view(), v.view());
  feed(*chunked, k, v, {5, 17, 1, 25});
  EXPECT_EQ(state_of(*c), state_of(*chunked));
  GroupQuantParams p{2, 16, true, 1.0f, MetaType::kF32, 0.5};
  int64_t differ = 0;
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_EQ(rows_of(view, 0, h), rows_of(sview, 0, h)) << "keys changed, head " << h;
    const auto& perm = c->value_perms();
    const auto rows = rows_of(view, 0, h, true), srows = rows_of(sview, 0, h, true);
    for (int64_t s = 4; s < 48; ++s) {
      std::vector<float> pr(64), rec(64), out(64);
      for (int j = 0; j < 64; ++j) pr[j] = v.at(0, h, s, perm[h * 64 + j]);
      std::vector<uint8_t> codes(64);
      std::vector<float> lo(4), sc(4);
      group_quantize_reference(pr.data(), 1, 64, p, codes.data(), lo.data(), sc.data());
      for (int j = 0; j < 64; ++j) rec[j] = static_cast<float>(codes[j]) * sc[j / 16] + lo[j / 16];
      for (int j = 0; j < 64; ++j) out[perm[h * 64 + j]] = rec[j];
      ASSERT_EQ(std::memcmp(out.data(), rows[s].data(), 64 * 4), 0) << h << " " << s;
      differ += rows[s] != srows[s];
    }
  }
  EXPECT_GT(differ, 0) << "the floor changed no value row";
  EXPECT_EQ(c->stats().bytes_accounted, seed->stats().bytes_accounted);
}

// States: version 5 with the floor, continued bit for bit after a load; a state of another floor
// (or of the seed's grid, versions 1-4) is refused naming the field, nothing changed.
TEST(SkvqCacheValueClipFloor, SaveLoadInStateVersion5AndOtherFloorsRefused) {
  const Tensor k = hetero(1, 2, 90, 64, 160), v = hetero(1, 2, 90, 64, 161);
  for (bool rotate : {false, true}) {
    CacheConfig cfg = small_cfg();
    cfg.skvq_value_clip_floor = 0.6;
    if (rotate) {
      cfg.skvq_rotation = Rotation::kHadamard;
      cfg.skvq_rotate_values = true;
    }
    auto a = make(cfg);
    a->update_and_fetch(k.view().slice_tokens(0, 41), v.view().slice_tokens(0, 41));
    const std::string st = state_of(*a);
    EXPECT_EQ(StateReader::from_bytes(st, "skvq").version(), 5u);
    std::istringstream in(st);
    auto b = make(cfg);
    b->load(in);
    a->update_and_fetch(k.view().slice_tokens(41, 90), v.view().slice_tokens(41, 90));
    b->update_and_fetch(k.view().slice_tokens(41, 90), v.view().slice_tokens(41, 90));
    EXPECT_EQ(state_of(*a), state_of(*b));
    CacheConfig other = cfg;
    other.skvq_value_clip_floor = 0.85;
    for (const auto& [from, into] : {std::pair{cfg, other}, std::pair{other, cfg}}) {
      auto src = make(from);
      src->update_and_fetch(k.view().slice_tokens(0, 41), v.view().slice_tokens(0, 41));
      auto dst = make(into);
      dst->update_and_fetch(k.view().slice_tokens(0, 20), v.view().slice_tokens(0, 20));
      const std::string before = state_of(*dst);
      std::istringstream sin(state_of(*src));
      try {
        dst->load(sin);
        ADD_FAILURE() << "a state of another value clip floor was accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("skvq_value_clip_floor"), std::string::npos)
            << e.what();
      }
      EXPECT_EQ(state_of(*dst), before);
    }
  }
}

// snapkv+skvq packs its kept values with the same grid; the spec string reaches the field.
TEST(SkvqCacheValueClipFloor, SnapkvSkvqAndSpecString) {
  const CacheConfig parsed = parse_cache_arg("snapkv+skvq:value_clip_floor=0.55");
  EXPECT_EQ(parsed.skvq_value_clip_floor, 0.55);
  CacheConfig c = snap_channel_cfg(8), w = snap_channel_cfg(8);
  w.skvq_value_clip_floor = 0.5;
  SnapkvSkvqCache a(c), b(w);
  const Tensor k = hetero(1, 2, 60, 64, 170), v = hetero(1, 2, 60, 64, 171);
  snap_prompt(a, k, v, 172);
  snap_prompt(b, k, v, 172);
  const CacheView va = a.stored_view(), vb = b.stored_view();
  EXPECT_EQ(rows_of(va, 0, 1), rows_of(vb, 0, 1));
  EXPECT_NE(rows_of(va, 0, 1, true), rows_of(vb, 0, 1, true));
}

}  // namespace
}  // namespace vq
