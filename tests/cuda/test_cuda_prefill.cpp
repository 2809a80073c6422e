// GPU prefill attention (vq::cuda::prefill_attention): what it refuses (head_dim outside 64/128,
// query heads not a multiple of the KV heads, rotated packed rows beside rows of the CUDA-core
// path). Its numerics over the op harness's table of views (full-precision of each dtype, packed
// formats, mixed views with gapped positions, windows, GQA) are checked by
// tests/cuda/test_backend_ops_cuda.cpp against the bounds of tests/ops_harness/attention_bounds.h.
// Skipped cleanly without a device.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

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
  // Rotated packed rows take the tensor-core path only: with f32 full-precision rows (the
  // CUDA-core path) they are refused.
  CacheConfig rc;
  rc.method = "skvq";
  rc.skvq_window = 16;
  rc.skvq_rotation = Rotation::kHadamard;
  CacheView vr;
  auto cr = filled_cache(rc, 1, 2, 64, DType::kF32, {40}, 1, &vr);
  ASSERT_TRUE(vr.has_packed());
  const cuda::DeviceCacheView dr = cuda::DeviceCacheView::upload(vr);
  expect_error([&] { cuda::prefill_attention_host(random_q(2 * 64, 1), 2, 1, dr, {}); },
               "tensor-core path");
}

}  // namespace
}  // namespace vq
