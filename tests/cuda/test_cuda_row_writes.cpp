// GPU test of the row-write batches (veloxquant/cuda_row_writes.h): caches updated inside an open
// RowWriteBatch (their stores' writes recorded, launched together at each flush) must hold, after
// the flush, exactly the bytes of the same caches updated one write at a time: keys, values and
// positions of every segment, full-precision and packed, bit for bit (the same conversion per
// element; only the launches differ). Three caches per method share one stream and one batch per
// step, as the engine's sequences do; the steps cross SKVQ flushes, SnapKV's prompt-end
// eviction, StreamingLLM's ring and the full cache's growth. Skipped cleanly without a device.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "util/test_util.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/cuda_row_writes.h"

namespace vq {
namespace {

constexpr int64_t kH = 2, kD = 64, kSeqs = 3;

struct Block {
  cuda::DeviceBuffer k, v;
  TensorView kv, vv;
};

// Random rows [1, kH, n, kD] of dtype t on the device.
Block block(DType t, int64_t n, uint64_t seed) {
  const Tensor k = test::random_tensor(t, 1, kH, n, kD, seed);
  const Tensor v = test::random_tensor(t, 1, kH, n, kD, seed + 7);
  Block b;
  b.k = cuda::DeviceBuffer::from_host(k.data(), k.nbytes());
  b.v = cuda::DeviceBuffer::from_host(v.data(), v.nbytes());
  b.kv = TensorView::contiguous(b.k.data(), t, 1, kH, n, kD);
  b.vv = TensorView::contiguous(b.v.data(), t, 1, kH, n, kD);
  return b;
}

void expect_same(const cuda::DeviceKVCache& a, const cuda::DeviceKVCache& b,
                 const std::string& what) {
  const cuda::DeviceCacheView va = a.stored_view(), vb = b.stored_view();
  ASSERT_EQ(va.segments().size(), vb.segments().size()) << what;
  for (size_t i = 0; i < va.segments().size(); ++i) {
    const cuda::HostSegment sa = cuda::download_segment(va, i), sb = cuda::download_segment(vb, i);
    ASSERT_EQ(sa.n_rows, sb.n_rows) << what << " segment " << i;
    EXPECT_TRUE(sa.keys == sb.keys) << what << " segment " << i << ": keys differ";
    EXPECT_TRUE(sa.values == sb.values) << what << " segment " << i << ": values differ";
    EXPECT_TRUE(sa.positions == sb.positions) << what << " segment " << i << ": positions differ";
  }
}

void run(const std::string& spec, DType t) {
  const CacheConfig cfg = config_from_spec(spec);
  std::vector<std::unique_ptr<cuda::DeviceKVCache>> alone, batched;
  for (int64_t s = 0; s < kSeqs; ++s) {
    alone.push_back(cuda::make_device_cache(cfg, 1, kH, kD));
    batched.push_back(cuda::make_device_cache(cfg, 1, kH, kD));
  }
  const std::string what = spec + " " + dtype_name(t);
  // prompts of 45, 70 and 1 rows, then 60 single-row steps
  const int64_t prompt[kSeqs] = {45, 70, 1};
  for (int64_t step = 0; step <= 60; ++step) {
    std::vector<Block> blocks;
    for (int64_t s = 0; s < kSeqs; ++s)
      blocks.push_back(block(t, step == 0 ? prompt[s] : 1, 1000 * step + 10 * s + 1));
    for (int64_t s = 0; s < kSeqs; ++s) {
      alone[s]->update_and_fetch(blocks[s].kv, blocks[s].vv);
      if (step == 0) alone[s]->end_prompt();
    }
    {
      cuda::RowWriteBatch writes(nullptr);
      for (int64_t s = 0; s < kSeqs; ++s) {
        batched[s]->update_and_fetch(blocks[s].kv, blocks[s].vv);
        if (step == 0) batched[s]->end_prompt();
      }
      writes.flush();
    }
    cuda::synchronize(nullptr);  // the blocks are freed on return
    if (step % 20 == 0 || step == 60)
      for (int64_t s = 0; s < kSeqs; ++s)
        expect_same(*alone[s], *batched[s],
                    what + " seq " + std::to_string(s) + " step " + std::to_string(step));
  }
}

TEST(CudaRowWrites, BatchedEqualsOneAtATime) {
  SKIP_WITHOUT_DEVICE();
  for (DType t : {DType::kF16, DType::kBF16, DType::kF32}) run("full", t);
  run("snapkv:budget=32:obs_window=8:evict_at=prompt_end", DType::kF16);
  run("streaming:window=24:n_sink=4", DType::kBF16);
  run("skvq:bits_key=4:bits_value=4:window=16", DType::kF16);
  run("skvq:bits_key=2:bits_value=2:window=16:rotation=hadamard", DType::kBF16);
  run("snapkv+skvq:budget=40:obs_window=8:window=16", DType::kF16);
}

// Reading a cache while its batch is still open (stored_view, then a download) sees every row
// of its updates: the read flushes first.
TEST(CudaRowWrites, ReadsInsideAnOpenBatchSeeEveryRow) {
  SKIP_WITHOUT_DEVICE();
  for (const char* spec : {"full", "skvq:bits_key=4:bits_value=4:window=16"}) {
    auto a = cuda::make_device_cache(config_from_spec(spec), 1, kH, kD);
    auto b = cuda::make_device_cache(config_from_spec(spec), 1, kH, kD);
    cuda::RowWriteBatch writes(nullptr);
    for (int64_t step = 0; step < 40; ++step) {
      Block x = block(DType::kF16, step == 0 ? 9 : 1, 77 + step);
      a->update_and_fetch(x.kv, x.vv);
      b->update_and_fetch(x.kv, x.vv);
      expect_same(*a, *b, std::string(spec) + " inside a batch, step " + std::to_string(step));
    }
  }
}

}  // namespace
}  // namespace vq
