// GPU prefill attention (vq::cuda::prefill_attention) against the CPU oracle attention_reference
// over the same view (packed rows dequantized on the host by dequantize_view). Views are built
// by the CPU caches themselves and uploaded (DeviceCacheView::upload): full-precision caches of
// each dtype, SKVQ caches (full-precision sinks, packed middle with channel permutations, tail:
// mixed views; K2V2, K4V4, K4V2, K8V8, 1.5-bit codes, Hadamard rotation, metadata f16/f32/fp8,
// ragged groups) and SnapKV caches
// (explicit per-head gapped positions, then an implicit tail). Awkward shapes: view lengths 1,
// 17, 127, 129 (and 300), N queries 1, 17, 127, 129, GQA 1/4/8, head_dim 64/128, batch 1 and 8,
// window off / on (including windows so small that some queries see no key), queries placed
// after the view and inside it (causal). Skipped cleanly without a device.
// Tolerances (cuda/attention_check.h): views of f32 or bf16 rows run on the CUDA-core kernel and
// are held to its bound (kPrefillCudaCore). Views of f16 rows and packed records run on the
// tensor-core kernel, held to the bound of the tensor-core decode kernel (kDecode), whose terms
// cover it:
//  * logit: q enters as the fp16 rounding of q * 2^sigma (FlashAttention numerics: 2^-11
//    relative, the kGpuLogitRel term of tests/ops_harness/attention_bounds.h), f16 keys exact,
//    packed keys as hi + lo planes (2^-22 |k|): at most 2^-22 sum |q_d k_d| more; the fp32
//    accumulation runs 1 (f16) or 2 (packed) mma per 16 channels, each one alignment and
//    rounding of at most 2^-22 of the terms' magnitude (products exact): at most 2 D / 16 * 4u
//    sum |q_d k_d|, inside gamma(D + log2 D + 3D/8 + 8) ||q|| ||k|| (Cauchy-Schwarz); the
//    log2-unit scaling adds 2u |logit| (the rounded scale * log2 e, the product), inside
//    4u |logit|;
//  * weights: exp2f (2 ulp, the 2^-22 term); the rounding of the argument logit - running max
//    moves weight p by at most u/e absolutely; p enters P V as its fp16 rounding (2^-11 relative,
//    the kGpuValueRel term; the row sums add the unrounded p; fp16 subnormals 2^-25 absolute);
//    per 64-key tile one rescale (exp2f) and 4 or 6 mma per output chain; the row sums are
//    per-lane fp32 sums of 16 terms per tile: all together at most 2 n u V + 64u V for n visible
//    rows (V = max |v|, the sum of weights >= 1), inside 2 gamma(9n/8 + 64) V.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/attention_check.h"
#include "cuda/cuda_test_util.h"
#include "util/test_util.h"
#include "veloxquant/builder.h"
#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/error.h"
#include "veloxquant/packed.h"

namespace vq {
namespace {

using test::random_q;

// Runs prefill attention of N queries (positions q_pos0 ..) over the uploaded view and checks it.
double check_case(const CacheView& view, int64_t Hq, int64_t N, int64_t q_pos0, int64_t window,
                  uint64_t seed, const std::string& name) {
  const cuda::DeviceCacheView dv = cuda::DeviceCacheView::upload(view);
  const DenseView dense = dequantize_view(view, DType::kF32);
  AttentionParams ap;
  ap.q_pos0 = q_pos0;
  ap.window = window;
  const auto q = random_q(view.batch * Hq * N * view.head_dim, seed);
  const auto out = cuda::prefill_attention_host(q, Hq, N, dv, ap);
  const std::string vars = name + " Hq=" + std::to_string(Hq) + " N=" + std::to_string(N) +
                           " q_pos0=" + std::to_string(q_pos0) +
                           " window=" + std::to_string(window);
  bool tc = true;  // the path the kernel takes: f16 rows and packed records -> tensor cores
  for (const ViewSegment& s : view.segments)
    if (s.n_rows > 0 && s.packed == nullptr && s.keys.dtype != DType::kF16) tc = false;
  const auto c =
      test::check_attention(dense.view, q, Hq, N, ap, out,
                            tc ? test::AttnKernel::kDecode : test::AttnKernel::kPrefillCudaCore,
                            vars + (tc ? " [tensor cores]" : " [cuda cores]"));
  EXPECT_GT(c.nonzero, 0) << vars << ": reference is all zeros";
  return c.worst_ratio;
}

// A cache of cfg fed `steps` blocks of dtype t; returns it (its last view stays valid).
std::unique_ptr<KVCache> filled_cache(CacheConfig cfg, int64_t B, int64_t H, int64_t D, DType t,
                                      const std::vector<int64_t>& steps, uint64_t seed,
                                      CacheView* last) {
  cfg.head_dim = D;
  auto cache = make_cache(cfg);
  int i = 0;
  for (int64_t s : steps) {
    const Tensor k = test::random_tensor(t, B, H, s, D, seed + 2 * i);
    const Tensor v = test::random_tensor(t, B, H, s, D, seed + 2 * i + 1);
    ++i;
    *last = cache->update_and_fetch(k.view(), v.view());
    if (i < static_cast<int>(steps.size())) continue;
  }
  return cache;
}

TEST(CudaPrefill, FullPrecisionAwkwardShapes) {
  SKIP_WITHOUT_DEVICE();
  double worst = 0;
  int cases = 0;
  const DType dtypes[] = {DType::kF16, DType::kBF16, DType::kF32};
  int di = 0;
  for (int64_t D : {64, 128})
    for (int64_t n : {1, 17, 127, 129})
      for (int64_t B : {1, 8}) {
        const int64_t H = 2;
        const DType t = dtypes[di++ % 3];
        CacheConfig cfg;
        cfg.method = "full";
        CacheView view;
        auto cache = filled_cache(cfg, B, H, D, t, {n}, 100 + n + D + B, &view);
        for (int64_t g : {1, 4, 8}) {
          if (B == 8 && g == 8 && n > 17) continue;  // keep the host reference quick
          const int64_t N = std::min<int64_t>(n, g == 4 ? 17 : n);
          for (int64_t window : {int64_t{0}, int64_t{5}}) {
            const std::string name = std::string("full ") + dtype_name(t) + " D" +
                                     std::to_string(D) + " n" + std::to_string(n) + " B" +
                                     std::to_string(B);
            worst = std::max(worst, check_case(view, H * g, N, n - N, window, 7 + n, name));
            ++cases;
          }
        }
      }
  // Queries after the view (a decode-like block of 3), and a long view.
  CacheConfig cfg;
  cfg.method = "full";
  CacheView view;
  auto cache = filled_cache(cfg, 1, 8, 128, DType::kF16, {300}, 5, &view);
  worst = std::max(worst, check_case(view, 32, 3, 300, 0, 9, "full after view"));
  worst = std::max(worst, check_case(view, 32, 129, 171, 64, 10, "full long window 64"));
  cases += 2;
  std::printf("[prefill full precision] %d cases, worst error %.3f%% of tolerance\n", cases,
              100 * worst);
}

TEST(CudaPrefill, PackedAndMixedViews) {
  SKIP_WITHOUT_DEVICE();
  double worst = 0;
  int cases = 0;
  struct Q {
    double kb, vb;
    int64_t g;
    MetaType meta;
    bool reorder;
    Rotation rot = Rotation::kNone;
  };
  const Q qs[] = {{2, 2, 32, MetaType::kF16, true},
                  {4, 4, 32, MetaType::kF32, true},
                  {4, 2, 48, MetaType::kFP8E4M3, false},
                  {8, 8, 128, MetaType::kF16, true},
                  {2, 2, 32, MetaType::kF16, true, Rotation::kHadamard},
                  {1.5, 1.5, 16, MetaType::kF16, false},
                  {1.5, 4, 32, MetaType::kF32, true, Rotation::kHadamard}};
  int qi = 0;
  for (int64_t D : {64, 128})
    for (const Q& q : qs) {
      CacheConfig cfg;
      cfg.method = "skvq";
      cfg.skvq_bits_key = q.kb;
      cfg.skvq_bits_value = q.vb;
      cfg.skvq_group_size = q.g;
      cfg.skvq_meta = q.meta;
      cfg.skvq_reorder = q.reorder;
      cfg.skvq_rotation = q.rot;
      cfg.skvq_window = 32;
      cfg.skvq_n_sink = 5;
      const int64_t B = (qi++ % 2) ? 8 : 1;
      CacheView view;
      auto cache = filled_cache(cfg, B, 2, D, DType::kF16, {129, 17}, 300 + qi, &view);
      EXPECT_TRUE(view.has_packed());
      const std::string name = "skvq K" + std::to_string(q.kb) + "V" + std::to_string(q.vb) + " g" +
                               std::to_string(q.g) + " meta" +
                               std::to_string(static_cast<int>(q.meta)) +
                               (q.rot == Rotation::kHadamard ? " hadamard" : "") + " D" +
                               std::to_string(D) + " B" + std::to_string(B);
      for (int64_t g : {1, 4}) {
        worst = std::max(worst, check_case(view, 2 * g, 17, 129, 0, 11 + qi, name));
        worst = std::max(worst, check_case(view, 2 * g, 17, 129, 40, 12 + qi, name));
        cases += 2;
      }
    }
  // SnapKV: explicit per-head gapped positions, then an implicit tail; tiny windows leave some
  // queries with no visible key.
  CacheConfig sc;
  sc.method = "snapkv";
  sc.snap_budget = 40;
  sc.snap_obs_window = 8;
  CacheView view;
  auto cache = filled_cache(sc, 2, 2, 128, DType::kBF16, {127, 1, 1, 17}, 900, &view);
  for (int64_t window : {int64_t{0}, int64_t{3}, int64_t{1}}) {
    worst = std::max(worst, check_case(view, 16, 17, 129, window, 13, "snapkv gapped"));
    ++cases;
  }
  // The same with f16 rows (tensor-core path, explicit positions), over several key tiles.
  CacheConfig sc16 = sc;
  sc16.snap_budget = 150;
  CacheView view16;
  auto cache16 = filled_cache(sc16, 2, 2, 64, DType::kF16, {257, 1, 1, 70}, 901, &view16);
  for (int64_t window : {int64_t{0}, int64_t{40}, int64_t{1}}) {
    worst = std::max(worst, check_case(view16, 8, 33, 259, window, 14, "snapkv f16 gapped"));
    ++cases;
  }
  std::printf("[prefill packed/mixed] %d cases, worst error %.3f%% of tolerance\n", cases,
              100 * worst);
}

TEST(CudaPrefill, RefusesUnsupported) {
  SKIP_WITHOUT_DEVICE();
  auto expect_error = [](auto&& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  CacheConfig cfg;
  cfg.method = "full";
  CacheView v96;
  auto c96 = filled_cache(cfg, 1, 2, 96, DType::kF16, {4}, 1, &v96);
  const cuda::DeviceCacheView d96 = cuda::DeviceCacheView::upload(v96);
  expect_error([&] { cuda::prefill_attention_host(random_q(2 * 96, 1), 2, 1, d96, {}); },
               "head_dim 64 or 128");
  CacheView v64;
  auto c64 = filled_cache(cfg, 1, 2, 64, DType::kF16, {4}, 1, &v64);
  const cuda::DeviceCacheView d64 = cuda::DeviceCacheView::upload(v64);
  expect_error([&] { cuda::prefill_attention_host(random_q(3 * 64, 1), 3, 1, d64, {}); },
               "multiple of H_kv");
  // Rotated packed rows take the tensor-core path only: with bf16 full-precision rows (the
  // CUDA-core path) they are refused.
  CacheConfig rc;
  rc.method = "skvq";
  rc.skvq_window = 16;
  rc.skvq_rotation = Rotation::kHadamard;
  CacheView vr;
  auto cr = filled_cache(rc, 1, 2, 64, DType::kBF16, {40}, 1, &vr);
  ASSERT_TRUE(vr.has_packed());
  const cuda::DeviceCacheView dr = cuda::DeviceCacheView::upload(vr);
  expect_error([&] { cuda::prefill_attention_host(random_q(2 * 64, 1), 2, 1, dr, {}); },
               "tensor-core path");
}

}  // namespace
}  // namespace vq
