// GPU decode attention over packed formats that the split kernels do not read in place (1.5-bit
// codes, 1/3/5/6/7-bit codes, mixed key/value bits other than (4,2)/(2,4), groups that are not a
// multiple of 8), with channel permutations and Hadamard rotation: decode_attention dequantizes
// them into fp32 scratch (dequant_rows: the CPU's dequantize_row operations) and attends to them
// as f32 rows on the CUDA-core kernel. Oracle: attention_reference over dequantize_view of the
// same CPU cache view (test::check_attention, kDecode: the decode kernel's derived fp32 bound, the
// f32-row path being the one that bound was derived for). Views come from real CPU caches: SKVQ
// (fp16 sinks, packed middle, fp16 tail) and snapkv+skvq (packed rows with explicit per-head
// positions), batch 1 and 8, GQA 1/4/8, head_dim 64/128, with and without a window. Skipped
// cleanly without a device.
#include <gtest/gtest.h>

#include <algorithm>
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
#include "veloxquant/error.h"
#include "veloxquant/packed.h"

namespace vq {
namespace {

using test::random_q;

struct Format {
  double kb, vb;
  int64_t group;
  MetaType meta;
  bool reorder;
  Rotation rot;
};

// Decodes one query per sequence at the newest position (and with a window) over the cache's
// last view; returns the worst error as a fraction of the tolerance.
double check_view(const CacheView& view, int64_t newest, int64_t Hq, uint64_t seed,
                  const std::string& name) {
  const cuda::DeviceCacheView dv = cuda::DeviceCacheView::upload(view);
  const DenseView dense = dequantize_view(view, DType::kF32);
  double worst = 0;
  for (int64_t window : {int64_t{0}, int64_t{24}}) {
    AttentionParams ap;
    ap.q_pos0 = newest;
    ap.window = window;
    const auto q = random_q(view.batch * Hq * view.head_dim, seed + window);
    const auto out = cuda::decode_attention_host(q, Hq, dv, ap);
    const std::string vars =
        name + " Hq=" + std::to_string(Hq) + " window=" + std::to_string(window);
    const auto c =
        test::check_attention(dense.view, q, Hq, 1, ap, out, test::AttnKernel::kDecode, vars);
    EXPECT_GT(c.nonzero, 0) << vars << ": reference is all zeros";
    worst = std::max(worst, c.worst_ratio);
  }
  return worst;
}

TEST(CudaDecodeFormats, UnfusedFormatsMatchTheReference) {
  SKIP_WITHOUT_DEVICE();
  const Format formats[] = {
      {1.5, 1.5, 32, MetaType::kF16, true, Rotation::kNone},
      {1.5, 4, 16, MetaType::kF32, false, Rotation::kHadamard},
      {3, 3, 32, MetaType::kF16, true, Rotation::kNone},
      {1, 2, 32, MetaType::kFP8E4M3, false, Rotation::kNone},
      {8, 4, 32, MetaType::kF16, true, Rotation::kHadamard},
      {5, 6, 24, MetaType::kF16, false, Rotation::kNone},
      {2, 2, 12, MetaType::kF16, true, Rotation::kNone},  // group not a multiple of 8
      {7, 7, 128, MetaType::kF32, false, Rotation::kNone},
  };
  double worst = 0;
  int cases = 0, fi = 0;
  for (const Format& f : formats)
    for (int64_t D : {64, 128})
      for (const char* method : {"skvq", "snapkv+skvq"}) {
        CacheConfig cfg;
        cfg.method = method;
        cfg.head_dim = D;
        cfg.skvq_bits_key = f.kb;
        cfg.skvq_bits_value = f.vb;
        cfg.skvq_group_size = f.group;
        cfg.skvq_meta = f.meta;
        cfg.skvq_reorder = f.reorder;
        cfg.skvq_rotation = f.rot;
        cfg.skvq_rotate_values = f.rot == Rotation::kHadamard;
        cfg.skvq_window = 32;
        cfg.skvq_n_sink = 3;
        cfg.snap_budget = 96;
        cfg.snap_obs_window = 8;
        const int64_t B = (fi++ % 2) ? 8 : 1, H = 2;
        auto cache = make_cache(cfg);
        CacheView view;
        int step = 0;
        for (int64_t s : {int64_t{129}, int64_t{40}, int64_t{1}}) {
          const Tensor k = test::random_tensor(DType::kF16, B, H, s, D, 500 + 2 * step + fi);
          const Tensor v = test::random_tensor(DType::kF16, B, H, s, D, 501 + 2 * step + fi);
          ++step;
          view = cache->update_and_fetch(k.view(), v.view());
        }
        ASSERT_TRUE(view.has_packed()) << method;
        const std::string name = std::string(method) + " K" + std::to_string(f.kb) + "V" +
                                 std::to_string(f.vb) + " g" + std::to_string(f.group) +
                                 (f.rot == Rotation::kHadamard ? " hadamard" : "") + " D" +
                                 std::to_string(D) + " B" + std::to_string(B);
        for (int64_t g : {1, 4, 8}) {
          worst = std::max(worst, check_view(view, cache->offset() - 1, H * g, 40 + fi + g, name));
          cases += 2;
        }
      }
  std::printf("[unfused formats] %d cases, worst error %.3f%% of tolerance\n", cases, 100 * worst);
}

}  // namespace
}  // namespace vq
