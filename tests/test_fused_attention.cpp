// Fused CPU attention (vq::attention) against dequantize-then-attention_reference, for every
// cache method, GQA ratios 1/4/8, head_dim 64 and 128, lengths 1, 17, 127, 129, ragged groups,
// decode and multi-query calls, sliding windows, rotation and metadata types; plus metamorphic
// checks (GQA == MHA with repeated KV heads, sliding window == attention over the sliced rows,
// decode over rows read in place == over channel-strided copies; many-query and one-query calls
// over packed rows, each within its own bound).
//
// The bound (per output element; harness::fused_cpu_bound, derived in
// tests/ops_harness/attention_bounds.cpp, shared with the op harness) is the fp32 rounding of the
// fused kernel relative to the double-accumulated reference: u = 2^-24,
//   logit error  eps_j <= scale * ((D + 8) u K_j + R_j) + u (|l_j - l_max| + 3)
//   output error <= (exp(2 eps) - 1) * sum_j w_j |v_jd| + (n + n_tiles + 8) u sum_j w_j V_j * r
//                   + 2 T_rot + n 2^-125 max|v|
// with K_j = ||q||_2 * ||(|c_i s| + |lo|)_i||_2 for packed rows (sum |q_d k_jd| for full
// precision), V_j the row's value magnitude, r = sqrt(D) when values are rotated (1 otherwise),
// R_j and T_rot the Hadamard transform errors. Every case reports the share of the bound used.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ops_harness/attention_bounds.h"
#include "util/test_util.h"
#include "veloxquant/attention.h"
#include "veloxquant/builder.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/packed.h"
#include "veloxquant/skvq_cache.h"

namespace vq {
namespace {

struct Case {
  CacheConfig cfg;
  int64_t n_rep = 1, h_kv = 2, d = 64, len = 17, n_q = 1, batch = 1, window = 0;
  DType dtype = DType::kF16;
  std::string name() const {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "%s rep=%lld d=%lld len=%lld nq=%lld b=%lld win=%lld g=%lld rot=%d",
                  cfg.method.c_str(), (long long)n_rep, (long long)d, (long long)len,
                  (long long)n_q, (long long)batch, (long long)window,
                  (long long)cfg.skvq_group_size, int(cfg.skvq_rotation));
    return buf;
  }
};

// Runs a case: feeds len - n_q rows, then the n_q-row call whose view the queries attend to.
// Returns the largest share of the bound used (fails the test on any violation).
double run_case(const Case& cs, uint64_t seed) {
  CacheConfig cfg = cs.cfg;
  cfg.head_dim = cs.d;
  auto cache = make_cache(cfg);
  const Tensor k = test::random_tensor(cs.dtype, cs.batch, cs.h_kv, cs.len, cs.d, seed);
  const Tensor v = test::random_tensor(cs.dtype, cs.batch, cs.h_kv, cs.len, cs.d, seed + 1);
  const int64_t pre = cs.len - cs.n_q;
  if (pre > 0)
    cache->update_and_fetch(k.view().slice_tokens(0, pre), v.view().slice_tokens(0, pre));
  const CacheView view = cache->update_and_fetch(k.view().slice_tokens(pre, cs.len),
                                                 v.view().slice_tokens(pre, cs.len));
  const int64_t h_q = cs.h_kv * cs.n_rep;
  const Tensor q = test::random_tensor(DType::kF32, cs.batch, h_q, cs.n_q, cs.d, seed + 2, 1.5f);
  AttentionParams p;
  p.q_pos0 = pre;
  p.window = cs.window;
  std::vector<float> fused(static_cast<size_t>(q.numel())), ref(fused.size());
  attention(q.view(), view, p, fused.data());
  const DenseView dense = dequantize_view(view, DType::kF32);
  attention_reference(q.view(), dense.view, p, ref.data());
  const std::vector<float> qv(static_cast<const float*>(q.data()),
                              static_cast<const float*>(q.data()) + q.numel());
  const std::vector<double> bound = harness::fused_cpu_bound(view, dense.view, qv, h_q, cs.n_q, p);
  double used = 0, ref_abs = 0;
  for (size_t idx = 0; idx < fused.size(); ++idx) {
    const double err = std::fabs(double(fused[idx]) - ref[idx]);
    EXPECT_FALSE(std::isnan(fused[idx]));
    if (err > bound[idx]) {
      ADD_FAILURE() << cs.name() << ": |fused - ref| = " << err << " > bound " << bound[idx]
                    << " at output element " << idx << " ([B, H_q, N, D] order)";
      return 1e9;
    }
    if (bound[idx] > 0) used = std::max(used, err / bound[idx]);
    ref_abs = std::max(ref_abs, std::fabs(double(ref[idx])));
  }
  EXPECT_GT(ref_abs, 0.0) << cs.name() << ": reference all zeros";
  return used;
}

CacheConfig method_cfg(const std::string& m) {
  CacheConfig c;
  c.method = m;
  c.snap_budget = 48;
  c.snap_obs_window = 8;
  c.snap_n_sink = 4;
  c.skvq_window = 32;
  c.skvq_n_sink = 4;
  c.skvq_group_size = 32;
  return c;
}

std::vector<std::string> methods_built() {
  std::vector<std::string> out;
  for (const std::string& m : cache_methods()) {
    try {
      (void)make_cache(method_cfg(m));
      out.push_back(m);
    } catch (const Error&) {
    }
  }
  return out;
}

TEST(FusedAttention, EveryMethodGqaHeadDimsLengths) {
  const auto methods = methods_built();
  ASSERT_GE(methods.size(), 3u) << "full, snapkv and skvq at least";
  double worst = 0;
  int n = 0;
  for (const std::string& m : methods)
    for (int64_t rep : {1, 4, 8})
      for (int64_t d : {64, 128})
        for (int64_t len : {1, 17, 127, 129})
          for (int64_t nq : {int64_t{1}, std::min<int64_t>(len, 5)}) {
            if (nq == 1 && len > 1 && rep == 8 && d == 128) continue;  // keep the sweep quick
            Case cs;
            cs.cfg = method_cfg(m);
            cs.n_rep = rep;
            cs.d = d;
            cs.len = len;
            cs.n_q = nq;
            // Ragged groups: 24 does not divide 64, 48 does not divide 128.
            if ((len + rep) % 2) cs.cfg.skvq_group_size = d == 64 ? 24 : 48;
            const double used = run_case(cs, 1000 + n);
            worst = std::max(worst, used);
            ++n;
          }
  std::printf("[fused] %d cases, worst share of the bound used: %.3g\n", n, worst);
}

TEST(FusedAttention, SkvqOptionsBitsMetaRotationWindows) {
  double worst = 0;
  int n = 0;
  for (int variant = 0; variant < 9; ++variant) {
    Case cs;
    cs.cfg = method_cfg("skvq");
    cs.len = 129;
    cs.n_rep = 4;
    cs.d = variant % 2 ? 128 : 64;
    cs.n_q = variant % 3 == 0 ? 1 : 7;
    switch (variant) {
      case 0:
        cs.cfg.skvq_bits_key = cs.cfg.skvq_bits_value = 4;
        break;
      case 1:
        cs.cfg.skvq_rotation = Rotation::kHadamard;
        break;
      case 2:
        cs.cfg.skvq_rotation = Rotation::kHadamard;
        cs.cfg.skvq_rotate_values = true;
        cs.cfg.skvq_group_size = 24;
        break;
      case 3:
        cs.cfg.skvq_meta = MetaType::kFP8E4M3;
        cs.cfg.skvq_bits_value = 1.5;
        break;
      case 4:
        cs.cfg.skvq_meta = MetaType::kF32;
        cs.cfg.skvq_bits_key = 3;
        cs.cfg.skvq_bits_value = 8;
        cs.window = 40;
        break;
      case 5:
        cs.cfg.skvq_bits_key = 1;
        cs.cfg.skvq_bits_value = 5;
        cs.cfg.skvq_recent = 9;
        cs.window = 3;
        break;
      case 6:
        cs.cfg.skvq_reorder = false;
        cs.batch = 2;
        cs.dtype = DType::kBF16;
        break;
      case 8:  // head_dim 96: Hadamard in three blocks of 32
        cs.d = 96;
        cs.cfg.skvq_rotation = Rotation::kHadamard;
        cs.cfg.skvq_rotate_values = true;
        break;
      case 7:
        cs.cfg.skvq_bits_key = 6;
        cs.cfg.skvq_bits_value = 7;
        cs.dtype = DType::kF32;
        cs.n_rep = 8;
        break;
    }
    worst = std::max(worst, run_case(cs, 5000 + variant));
    ++n;
  }
  std::printf("[fused] %d option cases, worst share of the bound used: %.3g\n", n, worst);
}

// Channel-axis keys (skvq_key_axis=channel: per-channel metadata per chunk, packed.h): the
// channel path of vq::attention (the query scaled per channel once per chunk, then dots with the
// codes) meets the same bound (its logit depth 2D + 2 roundings per |q_c|(|c s_c| + |lo_c|) term
// split over two sums of D: within D + 8), decode-sized and prefill-sized calls, every code width,
// metadata type, rotation, GQA ratio, and lengths before, at and across chunk ends; with
// skvq_key_rows (variants 14-16) each run of a chunk is its own segment with its own metadata.
TEST(FusedAttention, ChannelAxisKeys) {
  double worst = 0;
  int n = 0;
  for (int variant = 0; variant < 17; ++variant) {
    Case cs;
    cs.cfg = method_cfg("skvq");
    cs.cfg.skvq_key_axis = QuantAxis::kChannel;
    cs.len = std::vector<int64_t>{129, 31, 300, 1, 64, 97, 129}[variant % 7];
    cs.n_rep = std::vector<int64_t>{4, 1, 8}[variant % 3];
    cs.d = variant % 2 ? 128 : 64;
    cs.n_q = std::min<int64_t>(cs.len, variant % 4 == 3 ? 33 : (variant % 3 == 0 ? 1 : 7));
    cs.cfg.skvq_bits_key = std::vector<double>{2, 3, 4, 1.5, 8, 1, 2}[variant % 7];
    switch (variant) {
      case 1:
        cs.cfg.skvq_rotation = Rotation::kHadamard;
        break;
      case 2:
        cs.cfg.skvq_meta = MetaType::kFP8E4M3;
        cs.cfg.skvq_bits_value = 1.5;
        break;
      case 3:
        cs.cfg.skvq_meta = MetaType::kF32;
        cs.window = 40;
        break;
      case 4:
        cs.cfg.skvq_recent = 9;
        cs.cfg.skvq_window = 3;
        cs.cfg.skvq_n_sink = 1;
        break;
      case 5:
        cs.cfg.skvq_reorder = false;
        cs.batch = 2;
        cs.dtype = DType::kBF16;
        break;
      case 6:
        cs.d = 96;
        cs.cfg.skvq_n_sink = 0;
        break;
      case 8:
        cs.cfg.skvq_clip_search = false;
        cs.cfg.skvq_bits_value = 4;
        cs.dtype = DType::kF32;
        break;
      case 9:
        cs.cfg.skvq_window = 128;
        cs.cfg.skvq_n_sink = 5;
        break;
      case 14:  // runs of 8 (chunk 0: 8 + 20 rows), fp8 metadata
        cs.cfg.skvq_key_rows = 8;
        cs.cfg.skvq_meta = MetaType::kFP8E4M3;
        break;
      case 15:  // KIVI's layout: runs of 32 in chunks of 128, rotated
        cs.cfg.skvq_window = 128;
        cs.cfg.skvq_n_sink = 5;
        cs.cfg.skvq_key_rows = 32;
        cs.cfg.skvq_rotation = Rotation::kHadamard;
        cs.len = 300;
        break;
      case 16:  // runs of 5 (a remainder in every chunk)
        cs.cfg.skvq_key_rows = 5;
        break;
    }
    worst = std::max(worst, run_case(cs, 9000 + variant));
    ++n;
  }
  std::printf("[fused] %d channel-axis cases, worst share of the bound used: %.3g\n", n, worst);
}

// Prefill-sized calls (>= 8 queries per head) take the lanes-over-queries tiles for
// full-precision rows (mixed with packed segments for SKVQ/SnapKV): same bound.
TEST(FusedAttention, ManyQueriesPerHead) {
  const auto methods = methods_built();
  double worst = 0;
  int n = 0;
  for (const std::string& m : methods)
    for (int64_t rep : {1, 3, 4})
      for (int64_t len : {40, 129, 300})
        for (int64_t nq : {int64_t{8}, int64_t{33}, std::min<int64_t>(len, 130)})
          for (int64_t window : {int64_t{0}, int64_t{50}}) {
            // Keep the sweep quick: the other methods once per length and GQA ratio.
            if (m != "full" && (window > 0 || rep == 3 || nq != 33)) continue;
            Case cs;
            cs.cfg = method_cfg(m);
            cs.n_rep = rep;
            cs.d = (len + nq) % 3 == 0 ? 128 : 64;
            cs.len = len;
            cs.n_q = nq;
            cs.window = window;
            cs.batch = len == 40 && rep == 3 ? 2 : 1;
            cs.dtype = len == 129 ? DType::kBF16 : DType::kF16;
            const double used = run_case(cs, 7000 + n);
            worst = std::max(worst, used);
            ++n;
          }
  std::printf("[fused] %d many-query cases, worst share of the bound used: %.3g\n", n, worst);
}

// A window that hides every key of a query gives zeros, as the reference.
TEST(FusedAttention, FullyMaskedQueryGivesZeros) {
  CacheConfig cfg = method_cfg("skvq");
  cfg.head_dim = 64;
  auto cache = make_cache(cfg);
  const Tensor k = test::random_tensor(DType::kF16, 1, 2, 60, 64, 1);
  const CacheView view = cache->update_and_fetch(k.view(), k.view());
  const Tensor q = test::random_tensor(DType::kF32, 1, 2, 1, 64, 2);
  AttentionParams p;
  p.q_pos0 = 200;  // every key is older than the window
  p.window = 10;
  std::vector<float> out(128, 1.0f);
  attention(q.view(), view, p, out.data());
  for (float x : out) EXPECT_EQ(x, 0.0f);
}

// A NaN key makes the softmax of every query that sees it NaN in attention_reference; an Inf
// key channel gives a +inf logit (NaN output) or a -inf one (weight 0) by the query's sign. The
// fused attention used to drop NaN rows silently: its outputs must be NaN exactly where the
// reference's are, and agree elsewhere. Decode (1 query), few and many queries per head,
// full-precision and packed rows.
TEST(FusedAttention, NanAndInfKeysGiveNanAsTheReference) {
  int n_nan_cases = 0;
  for (const std::string& m : methods_built())
    for (int64_t n_q : {1, 5, 40}) {
      SCOPED_TRACE(m + " n_q " + std::to_string(n_q));
      CacheConfig cfg = method_cfg(m);
      cfg.head_dim = 64;
      auto cache = make_cache(cfg);
      const int64_t len = 100, h_kv = 2, rep = 2, d = 64, pre = len - n_q;
      Tensor k = test::random_tensor(DType::kF16, 1, h_kv, len, d, 11);
      const Tensor v = test::random_tensor(DType::kF16, 1, h_kv, len, d, 12);
      k.set(0, 0, 6, 3, std::nanf(""));   // kv head 0: a NaN channel in an old row
      k.set(0, 1, len - 3, 0, INFINITY);  // kv head 1: an Inf channel in a recent row
      if (pre > 0)
        cache->update_and_fetch(k.view().slice_tokens(0, pre), v.view().slice_tokens(0, pre));
      const CacheView view =
          cache->update_and_fetch(k.view().slice_tokens(pre, len), v.view().slice_tokens(pre, len));
      const Tensor q = test::random_tensor(DType::kF32, 1, h_kv * rep, n_q, d, 13);
      AttentionParams p;
      p.q_pos0 = pre;
      std::vector<float> fused(static_cast<size_t>(q.numel())), ref(fused.size());
      const DenseView dense = dequantize_view(view, DType::kF32);
      attention_reference(q.view(), dense.view, p, ref.data());
      // The default path (int8 queries on VNNI CPUs): NaN exactly where the reference has NaN.
      attention(q.view(), view, p, fused.data());
      for (size_t i = 0; i < fused.size(); ++i)
        ASSERT_EQ(std::isnan(fused[i]), std::isnan(ref[i]))
            << "default path, element " << i << ": fused " << fused[i] << ", reference " << ref[i];
      // The fp32 kernels, also checked against a dropped or extra row below (the int8 query
      // rounding alone moves outputs by ~2e-3 here: packed_decode_bound holds it elsewhere).
      // (AVX-512's below VNNI, AVX2's below its int8 keys)
      const detail::CpuIsa isa = detail::attention_isa();
      detail::set_attention_isa(isa >= detail::CpuIsa::kAvx512
                                    ? std::min(isa, detail::CpuIsa::kAvx512)
                                    : std::min(isa, detail::CpuIsa::kAvx2));
      attention(q.view(), view, p, fused.data());
      detail::set_attention_isa(isa);
      int n_nan = 0, n_finite = 0;
      for (size_t i = 0; i < fused.size(); ++i) {
        ASSERT_EQ(std::isnan(fused[i]), std::isnan(ref[i]))
            << "element " << i << ": fused " << fused[i] << ", reference " << ref[i];
        if (std::isnan(ref[i])) {
          ++n_nan;
        } else {
          ++n_finite;
          // Both read the same rows (packed ones dequantized for the reference): what differs
          // is fp32 vs double summation over <= 100 rows of O(1) logits and values, about 1e-6;
          // 1e-3 only guards against a dropped or extra row (EveryMethodGqaHeadDimsLengths
          // holds the derived bound).
          EXPECT_NEAR(fused[i], ref[i], 1e-3) << "element " << i;
        }
      }
      EXPECT_GT(n_finite, 0);
      if (m == "full") {
        EXPECT_GT(n_nan, 0) << "the NaN key is visible to every query";
      }
      n_nan_cases += n_nan > 0;
    }
  EXPECT_GT(n_nan_cases, 0);
}

// [1, H, S, D] -> [1, H * rep, S, D]: head h of the result is head h / rep of t (MHA standing in
// for GQA with rep query heads per KV head).
Tensor repeat_heads(const Tensor& t, int64_t rep) {
  const auto& sh = t.shape();
  Tensor r(t.dtype(), sh[0], sh[1] * rep, sh[2], sh[3]);
  for (int64_t h = 0; h < sh[1] * rep; ++h)
    for (int64_t s = 0; s < sh[2]; ++s)
      for (int64_t c = 0; c < sh[3]; ++c) r.set(0, h, s, c, t.at(0, h / rep, s, c));
  return r;
}

// Metamorphic: GQA with n_rep query heads per KV head equals MHA over the KV heads repeated.
TEST(FusedAttention, GqaEqualsMhaWithRepeatedKvHeads) {
  CacheConfig cfg = method_cfg("skvq");
  cfg.head_dim = 64;
  const int64_t rep = 4, len = 100;
  const Tensor k = test::random_tensor(DType::kF16, 1, 2, len, 64, 10);
  const Tensor v = test::random_tensor(DType::kF16, 1, 2, len, 64, 11);
  const Tensor kr = repeat_heads(k, rep), vr = repeat_heads(v, rep);
  auto a = make_cache(cfg), b = make_cache(cfg);
  const CacheView va = a->update_and_fetch(k.view(), v.view());
  const CacheView vb = b->update_and_fetch(kr.view(), vr.view());
  const Tensor q = test::random_tensor(DType::kF32, 1, 2 * rep, 3, 64, 12);
  AttentionParams p;
  p.q_pos0 = len - 3;
  std::vector<float> oa(static_cast<size_t>(q.numel())), ob(oa.size());
  attention(q.view(), va, p, oa.data());
  attention(q.view(), vb, p, ob.data());
  // Permutations pool per KV head over the same rows, so the repeated heads quantize
  // identically: the two computations are the same arithmetic, bit for bit.
  EXPECT_EQ(oa, ob);
}

// The same with prefill-sized calls (the lanes-over-queries tiles): each query's arithmetic is
// independent of how many query heads share its KV head and of its lane mates.
TEST(FusedAttention, GqaEqualsMhaWithRepeatedKvHeadsManyQueries) {
  const int64_t rep = 3, len = 150, nq = 70;
  const Tensor k = test::random_tensor(DType::kF16, 1, 2, len, 64, 40);
  const Tensor v = test::random_tensor(DType::kF16, 1, 2, len, 64, 41);
  const Tensor kr = repeat_heads(k, rep), vr = repeat_heads(v, rep);
  FullCache a, b;
  const CacheView va = a.update_and_fetch(k.view(), v.view());
  const CacheView vb = b.update_and_fetch(kr.view(), vr.view());
  const Tensor q = test::random_tensor(DType::kF32, 1, 2 * rep, nq, 64, 42, 1.5f);
  for (int64_t window : {int64_t{0}, int64_t{40}}) {
    AttentionParams p;
    p.q_pos0 = len - nq;
    p.window = window;
    std::vector<float> oa(static_cast<size_t>(q.numel())), ob(oa.size());
    attention(q.view(), va, p, oa.data());
    attention(q.view(), vb, p, ob.data());
    EXPECT_EQ(oa, ob) << "window " << window;
  }
}

// A view of the same rows with a channel stride of 2 (a strided copy of k and v).
TensorView strided_copy(const Tensor& t, std::vector<uint8_t>& buf) {
  const TensorView src = t.view();
  const size_t es = dtype_size(src.dtype);
  buf.assign(static_cast<size_t>(src.numel()) * 2 * es, 0xFF);  // gaps hold NaN patterns
  for (int64_t i = 0; i < src.numel(); ++i)
    std::memcpy(buf.data() + static_cast<size_t>(2 * i) * es,
                static_cast<const uint8_t*>(src.data) + static_cast<size_t>(i) * es, es);
  TensorView r = src;
  r.data = buf.data();
  for (int a = 0; a < 4; ++a) r.stride[a] = src.stride[a] * 2;
  return r;
}

// Decode-sized calls (< 8 queries per head) read contiguous full-precision rows in place,
// converting fp16/bf16 in registers and summing 16 rows' logits by a transposed reduction; rows
// with a channel stride take the row-by-row conversion to an fp32 tile. Both are specified as the
// same fp32 operations in the same order, so the outputs must agree bit for bit (two segments,
// ragged tiles, causal and sliding-window masks, every head_dim the in-place path takes).
TEST(FusedAttention, DecodeRowsInPlaceEqualStridedRowsBitForBit) {
  int n = 0;
  for (DType dt : {DType::kF16, DType::kBF16, DType::kF32})
    for (int64_t d : {32, 64, 96, 128})
      for (int64_t len : {5, 40, 129})
        for (int64_t nq : {1, 3, 7}) {
          if (nq > len) continue;
          const int64_t rep = (d / 32 + nq) % 4 + 1, window = len % 2 ? 0 : 21;
          const uint64_t seed = 900 + 10 * static_cast<uint64_t>(n);
          const Tensor k = test::random_tensor(dt, 1, 2, len, d, seed);
          const Tensor v = test::random_tensor(dt, 1, 2, len, d, seed + 1);
          const Tensor q = test::random_tensor(DType::kF32, 1, 2 * rep, nq, d, seed + 2, 1.5f);
          std::vector<uint8_t> kb, vb;
          const TensorView ks = strided_copy(k, kb), vs = strided_copy(v, vb);
          const int64_t split = len / 3;  // two segments: rows [0, split) and [split, len)
          auto make_view = [&](const TensorView& kk, const TensorView& vv) {
            CacheView cv;
            cv.batch = 1;
            cv.n_kv_heads = 2;
            cv.head_dim = d;
            for (auto [s0, s1] : {std::pair{int64_t{0}, split}, std::pair{split, len}}) {
              ViewSegment seg;
              seg.n_rows = s1 - s0;
              seg.first_pos = s0;
              seg.keys = kk.slice_tokens(s0, s1);
              seg.values = vv.slice_tokens(s0, s1);
              cv.segments.push_back(seg);
            }
            return cv;
          };
          AttentionParams p;
          p.q_pos0 = len - nq;
          p.window = window;
          std::vector<float> oa(static_cast<size_t>(q.numel())), ob(oa.size());
          attention(q.view(), make_view(k.view(), v.view()), p, oa.data());
          attention(q.view(), make_view(ks, vs), p, ob.data());
          EXPECT_EQ(std::memcmp(oa.data(), ob.data(), oa.size() * 4), 0)
              << "dtype " << dtype_name(dt) << " d " << d << " len " << len << " nq " << nq
              << " rep " << rep;
          ++n;
        }
  EXPECT_GT(n, 90);
}

// Decode over a long SKVQ view (sinks, one packed segment per chunk, the full-precision window)
// splits each KV head's rows into parts (fused_attention.cpp, kSplitRows) that the threads share:
// the parts depend on the view's length only, so 1, 2 and 5 threads give the same bits, and the
// result meets the fused bound against the reference at every length (one part and several).
TEST(FusedAttention, DecodeSplitRowsSameBitsAtAnyThreadCount) {
  const int old = omp_get_max_threads();
  for (int64_t len : {1500, 4100, 9000}) {
    Case cs;
    cs.cfg = method_cfg("skvq");
    cs.cfg.skvq_bits_key = cs.cfg.skvq_bits_value = 4;
    cs.cfg.skvq_window = 64;
    cs.len = len;
    cs.n_rep = 3;
    cs.window = len == 4100 ? 3000 : 0;  // the first part sees no key: its sum is 0
    EXPECT_LE(run_case(cs, 77 + static_cast<uint64_t>(len)), 1.0) << cs.name();
    CacheConfig cfg = cs.cfg;
    cfg.head_dim = cs.d;
    auto cache = make_cache(cfg);
    const Tensor k = test::random_tensor(DType::kF16, 1, 2, len, cs.d, 5);
    const Tensor v = test::random_tensor(DType::kF16, 1, 2, len, cs.d, 6);
    cache->update_and_fetch(k.view().slice_tokens(0, len - 1), v.view().slice_tokens(0, len - 1));
    const CacheView view = cache->update_and_fetch(k.view().slice_tokens(len - 1, len),
                                                   v.view().slice_tokens(len - 1, len));
    const Tensor q = test::random_tensor(DType::kF32, 1, 6, 1, cs.d, 7, 1.5f);
    AttentionParams p;
    p.q_pos0 = len - 1;
    p.window = cs.window;
    std::vector<float> one(static_cast<size_t>(q.numel()));
    omp_set_num_threads(1);
    attention(q.view(), view, p, one.data());
    for (int t : {2, 5}) {
      omp_set_num_threads(t);
      std::vector<float> many(one.size());
      attention(q.view(), view, p, many.data());
      EXPECT_EQ(std::memcmp(one.data(), many.data(), one.size() * 4), 0)
          << "len " << len << " threads " << t;
    }
  }
  omp_set_num_threads(old);
}

// The view's packed segments alone (the SKVQ cache's quantized rows).
CacheView packed_segments(const CacheView& full_view) {
  CacheView view = full_view;
  view.segments.clear();
  for (const ViewSegment& seg : full_view.segments)
    if (seg.packed) view.segments.push_back(seg);
  return view;
}

// Prefill-sized calls (>= 8 queries per head) over packed rows take the lanes-over-queries tiles,
// decode-sized calls the packed decode kernels (src/ops/packed_decode.h) on the codes: different
// arithmetic, so a 16-query call and 16 one-query calls are each held to their own bound against
// the reference (fused_cpu_bound, packed_decode_bound: docs/design.md §4), over a view of packed
// rows only (causal masks that hide rows from the early queries, sliding windows, GQA, rotation).
// They agreed bit for bit while both paths unpacked rows the same way; that is no longer declared.
TEST(FusedAttention, ManyQueriesAndOneQueryCallsOverPackedRowsMeetTheirBounds) {
  int n = 0;
  for (int64_t d : {64, 96, 128})
    for (int64_t rep : {1, 3})
      for (int64_t window : {int64_t{0}, int64_t{30}}) {
        CacheConfig cfg = method_cfg("skvq");
        cfg.head_dim = d;
        if (d == 96) {
          cfg.skvq_rotation = Rotation::kHadamard;
          cfg.skvq_rotate_values = true;
        }
        auto cache = make_cache(cfg);
        const int64_t len = 150, nq = 16;
        const uint64_t seed = 3000 + 10 * static_cast<uint64_t>(n);
        const Tensor k = test::random_tensor(DType::kF16, 1, 2, len, d, seed);
        const Tensor v = test::random_tensor(DType::kF16, 1, 2, len, d, seed + 1);
        const CacheView full_view = cache->update_and_fetch(k.view(), v.view());
        const CacheView view = packed_segments(full_view);
        ASSERT_FALSE(view.segments.empty()) << "the SKVQ cache should hold packed rows";
        const DenseView dense = dequantize_view(view, DType::kF32);
        const Tensor q = test::random_tensor(DType::kF32, 1, 2 * rep, nq, d, seed + 2, 1.5f);
        const float* qd = static_cast<const float*>(q.data());
        for (int64_t q0 : {int64_t{20}, len - nq}) {
          AttentionParams p;
          p.q_pos0 = q0;
          p.window = window;
          std::vector<float> many(static_cast<size_t>(q.numel()));
          attention(q.view(), view, p, many.data());
          const std::vector<float> qall(qd, qd + q.numel());
          const auto ref = harness::attention_ref(dense.view, qall, 2 * rep, nq, p);
          const auto bound = harness::fused_cpu_bound(view, dense.view, qall, 2 * rep, nq, p);
          for (size_t e = 0; e < many.size(); ++e)
            ASSERT_LE(std::fabs(many[e] - ref[e]), bound[e])
                << "many: d " << d << " rep " << rep << " window " << window << " q0 " << q0;
          for (int64_t i = 0; i < nq; ++i) {
            AttentionParams pi = p;
            pi.q_pos0 = q0 + i;
            std::vector<float> one(static_cast<size_t>(2 * rep * d)), q1(one.size());
            for (int64_t h = 0; h < 2 * rep; ++h)
              std::copy(qd + (h * nq + i) * d, qd + (h * nq + i + 1) * d, q1.begin() + h * d);
            attention(q.view().slice_tokens(i, i + 1), view, pi, one.data());
            const auto r1 = harness::attention_ref(dense.view, q1, 2 * rep, 1, pi);
            const auto b1 = harness::packed_decode_bound(view, dense.view, q1, 2 * rep, 1, pi,
                                                         detail::attention_isa());
            for (size_t e = 0; e < one.size(); ++e)
              ASSERT_LE(std::fabs(one[e] - r1[e]), b1[e])
                  << "one: d " << d << " rep " << rep << " window " << window << " q0 " << q0
                  << " query " << i;
          }
        }
        ++n;
      }
  EXPECT_EQ(n, 12);
}

// Many-query calls over packed rows whose explicit positions put rows no query may see (future
// positions) inside tiles whose visible rows every query sees (the tile's "every" case with rows
// left out): the left-out rows must not enter the softmax, whatever their unpacked tile slot held.
TEST(FusedAttention, ManyQueriesOverPackedRowsLeaveOutFutureRowsOfEveryTile) {
  for (int64_t d : {64, 128}) {
    CacheConfig cfg = method_cfg("skvq");
    cfg.head_dim = d;
    auto cache = make_cache(cfg);
    const int64_t len = 150, nq = 16, rep = 2, h_kv = 2;
    const Tensor k = test::random_tensor(DType::kF16, 1, h_kv, len, d, 4100 + d);
    const Tensor v = test::random_tensor(DType::kF16, 1, h_kv, len, d, 4101 + d);
    const CacheView full_view = cache->update_and_fetch(k.view(), v.view());
    CacheView view = packed_segments(full_view);
    ASSERT_FALSE(view.segments.empty()) << "the SKVQ cache should hold packed rows";
    // Row j (counted over the view) at position j, every third row at 1000 + j: after every
    // query (positions 200 .. 215), so hidden, while the others are seen by all of them.
    std::vector<std::vector<int32_t>> pos(view.segments.size());
    int64_t j = 0;
    for (size_t si = 0; si < view.segments.size(); ++si) {
      ViewSegment& seg = view.segments[si];
      pos[si].resize(static_cast<size_t>(h_kv * seg.n_rows));
      for (int64_t r = 0; r < seg.n_rows; ++r, ++j)
        for (int64_t h = 0; h < h_kv; ++h)
          pos[si][static_cast<size_t>(h * seg.n_rows + r)] =
              static_cast<int32_t>(j % 3 == 1 ? 1000 + j : j);
      seg.positions = pos[si].data();
      seg.pos_stride = seg.n_rows;
    }
    const DenseView dense = dequantize_view(view, DType::kF32);
    const Tensor q = test::random_tensor(DType::kF32, 1, h_kv * rep, nq, d, 4102 + d, 1.5f);
    const float* qd = static_cast<const float*>(q.data());
    AttentionParams p;
    p.q_pos0 = 200;
    std::vector<float> out(static_cast<size_t>(q.numel()));
    attention(q.view(), view, p, out.data());
    const std::vector<float> qall(qd, qd + q.numel());
    const auto ref = harness::attention_ref(dense.view, qall, h_kv * rep, nq, p);
    const auto bound = harness::fused_cpu_bound(view, dense.view, qall, h_kv * rep, nq, p);
    for (size_t e = 0; e < out.size(); ++e)
      ASSERT_LE(std::fabs(out[e] - ref[e]), bound[e]) << "d " << d << " element " << e;
  }
}

// Metamorphic: a sliding window over the whole view equals attention over only the rows inside
// the window (a full-precision copy restricted to them). The CPU attention walks a segment in
// tiles of 32 rows from its first row (src/ops/fused_attention.cpp kTile) and its softmax adds a
// tile's weights in lane partials by row within the tile (AVX-512: rows t and t + 16 in lane t),
// so the two are the same sums in the same order, bit for bit, when the window starts on a tile
// boundary; a window that starts inside a tile adds the same weights in other pairs, so there
// both are held to the fused path's bound around the reference over the window's rows (a window
// that let one more row in would move the output by about 1 / 25 of a value, far past it).
TEST(FusedAttention, WindowEqualsSlicedRows) {
  FullCache full;
  const Tensor k = test::random_tensor(DType::kF32, 1, 2, 90, 64, 20);
  const Tensor v = test::random_tensor(DType::kF32, 1, 2, 90, 64, 21);
  const CacheView view = full.update_and_fetch(k.view(), v.view());
  const Tensor q = test::random_tensor(DType::kF32, 1, 2, 1, 64, 22);
  const std::vector<float> qall(static_cast<const float*>(q.data()),
                                static_cast<const float*>(q.data()) + q.numel());
  for (const int64_t window : {26, 25}) {  // from row 64 (a tile boundary), from row 65
    AttentionParams p;
    p.q_pos0 = 89;
    p.window = window;
    std::vector<float> a(128), b(128);
    attention(q.view(), view, p, a.data());
    const int64_t first = 90 - window;
    CacheView sliced = view;
    sliced.segments[0].keys = view.segments[0].keys.slice_tokens(first, 90);
    sliced.segments[0].values = view.segments[0].values.slice_tokens(first, 90);
    sliced.segments[0].n_rows = window;
    sliced.segments[0].first_pos = first;
    AttentionParams p0 = p;
    p0.window = 0;
    attention(q.view(), sliced, p0, b.data());
    if (first % 32 == 0) {
      EXPECT_EQ(a, b) << "window " << window;
      continue;
    }
    const DenseView dense = dequantize_view(sliced, DType::kF32);
    const std::vector<double> ref = harness::attention_ref(dense.view, qall, 2, 1, p0);
    const std::vector<double> bound = harness::fused_cpu_bound(sliced, dense.view, qall, 2, 1, p0);
    for (size_t e = 0; e < a.size(); ++e) {
      EXPECT_LE(std::fabs(a[e] - ref[e]), bound[e]) << "window " << window << " element " << e;
      EXPECT_LE(std::fabs(b[e] - ref[e]), bound[e]) << "window " << window << " element " << e;
    }
  }
}

TEST(FusedAttention, BadInputRefused) {
  FullCache full;
  const Tensor k = test::random_tensor(DType::kF32, 1, 2, 10, 64, 30);
  const CacheView view = full.update_and_fetch(k.view(), k.view());
  std::vector<float> out(6 * 64);
  const Tensor q3 = test::random_tensor(DType::kF32, 1, 3, 1, 64, 31);  // 3 % 2 != 0
  EXPECT_THROW(attention(q3.view(), view, {}, out.data()), Error);
  const Tensor q32 = test::random_tensor(DType::kF32, 1, 2, 1, 32, 32);  // wrong D
  EXPECT_THROW(attention(q32.view(), view, {}, out.data()), Error);
  AttentionParams bad;
  bad.window = -1;
  const Tensor q = test::random_tensor(DType::kF32, 1, 2, 1, 64, 33);
  EXPECT_THROW(attention(q.view(), view, bad, out.data()), Error);
}

}  // namespace
}  // namespace vq
