// GPU test of batched decode attention (cuda::decode_attention_run_batch, src/cuda/decode_api.cpp):
// one launch for many sequences, each over its own device cache of its own length, must give
// every sequence exactly the output of its own decode_attention_run with the same plan (the same
// kernel arithmetic, only the way a block finds its sequence differs), bit for bit: no tolerance.
// The sequences mix methods and row types (full f16 / bf16 / f32, SKVQ 2- and 4-bit with a
// Hadamard rotation), so one call holds several kernel instances (one launch each) and ragged
// lengths (20 to 4,100 rows, several split counts); the full f16 group is larger than one launch
// takes (cuda::kDecodeBatchMaxSequences), so it runs as pieces. A second batch at a group of 16
// query heads (the 16-head block). Skipped cleanly without a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "util/test_util.h"
#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/error.h"

namespace vq {
namespace {

constexpr int64_t kH = 2, kD = 128;

struct Seq {
  std::unique_ptr<cuda::DeviceKVCache> cache;
  cuda::DeviceCacheView view;
  cuda::DecodePlan plan;
  cuda::DeviceBuffer q, out;
  int64_t hq = 0;
  std::string name;
};

// A device cache of cfg holding n random rows of dtype t (one update), its stored view, queries
// of hq heads and a plan for the query at position n - 1 aiming at `target` blocks (0: the
// default), with `heads` query heads per block where the view allows 16 (0: automatic).
std::unique_ptr<Seq> make_seq(const CacheConfig& cfg, DType t, int64_t n, int64_t target,
                              uint64_t seed, cuda::DecodeWorkspace& ws, int64_t hq = kH * 4,
                              int64_t heads = 0) {
  auto s = std::make_unique<Seq>();
  s->hq = hq;
  s->name =
      cfg.method + " " + dtype_name(t) + " n=" + std::to_string(n) + " hq=" + std::to_string(hq);
  s->cache = cuda::make_device_cache(cfg, 1, kH, kD);
  const Tensor k = test::random_tensor(t, 1, kH, n, kD, seed);
  const Tensor v = test::random_tensor(t, 1, kH, n, kD, seed + 1);
  cuda::DeviceBuffer dk = cuda::DeviceBuffer::from_host(k.data(), k.nbytes());
  cuda::DeviceBuffer dv = cuda::DeviceBuffer::from_host(v.data(), v.nbytes());
  s->cache->update_and_fetch(TensorView::contiguous(dk.data(), t, 1, kH, n, kD),
                             TensorView::contiguous(dv.data(), t, 1, kH, n, kD));
  cuda::synchronize(nullptr);  // dk, dv are freed on return
  s->view = s->cache->stored_view();
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(hq * kD));
  for (float& x : q) x = nd(rng);
  s->q = cuda::DeviceBuffer::from_vector(q);
  s->out = cuda::DeviceBuffer(q.size() * 4);
  AttentionParams ap;
  ap.q_pos0 = n - 1;
  cuda::DecodePlanOptions opt;
  opt.target_blocks = target;
  opt.heads_per_block = heads;
  s->plan = cuda::decode_attention_plan(ws.context(), hq, s->view, ap, opt);
  return s;
}

std::vector<float> download(const Seq& s) {
  return s.out.to_vector<float>(static_cast<size_t>(s.hq * kD));
}

// Each sequence alone, then all in one batched call: the same bytes; ragged split counts.
void expect_batched_equals_alone(std::vector<std::unique_ptr<Seq>>& seqs,
                                 cuda::DecodeWorkspace& ws) {
  std::vector<std::vector<float>> alone;
  for (auto& s : seqs) {
    cuda::decode_attention_run(s->plan, s->q.as<float>(), s->view, s->out.as<float>(), ws);
    alone.push_back(download(*s));
    s->out.fill_zero();
  }
  std::vector<cuda::DecodeBatchItem> items;
  for (auto& s : seqs) items.push_back({&s->plan, s->q.as<float>(), &s->view, s->out.as<float>()});
  cuda::decode_attention_run_batch(items, ws);
  cuda::synchronize(nullptr);
  int n_split_counts = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const std::vector<float> got = download(*seqs[i]);
    double norm = 0;
    for (float x : alone[i]) {
      ASSERT_TRUE(std::isfinite(x)) << seqs[i]->name;
      norm += std::abs(x);
    }
    EXPECT_GT(norm, 0.0) << seqs[i]->name << ": the one-at-a-time output is all zeros";
    EXPECT_EQ(0, std::memcmp(got.data(), alone[i].data(), got.size() * 4))
        << seqs[i]->name << " (" << cuda::decode_kernel_name(seqs[i]->plan.kernel) << ", "
        << seqs[i]->plan.n_splits << " splits): batched differs from one at a time";
    if (i > 0 && seqs[i]->plan.n_splits != seqs[0]->plan.n_splits) ++n_split_counts;
  }
  EXPECT_GT(n_split_counts, 0) << "expected ragged split counts in the batch";
}

// The batches' cache methods: the full cache, SKVQ K2V2, SKVQ K4V4 with a Hadamard rotation.
struct Methods {
  CacheConfig full, k2, k4;
  Methods() {
    full.method = "full";
    k2 = full;
    k2.method = "skvq";
    k2.skvq_window = 64;
    k2.skvq_bits_key = k2.skvq_bits_value = 2;
    k4 = k2;
    k4.skvq_bits_key = k4.skvq_bits_value = 4;
    k4.skvq_rotation = Rotation::kHadamard;
  }
};

TEST(CudaDecodeBatch, BatchedEqualsOneAtATime) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  cuda::DecodeWorkspace ws;
  const Methods m;
  const CacheConfig &full = m.full, &k2 = m.k2, &k4 = m.k4;
  std::vector<std::unique_ptr<Seq>> seqs;
  uint64_t seed = 100;
  // ragged full f16 sequences, two block targets (several split counts), interleaved with the
  // other instances so that a group's members are not adjacent
  const int64_t lens[] = {37, 300, 1000, 4100, 70, 2049};
  for (size_t i = 0; i < std::size(lens); ++i) {
    seqs.push_back(make_seq(full, DType::kF16, lens[i], i % 2 ? 16 : 0, seed += 7, ws));
    if (i == 1) seqs.push_back(make_seq(k2, DType::kF16, 1500, 0, seed += 7, ws));
    if (i == 2) seqs.push_back(make_seq(full, DType::kBF16, 900, 0, seed += 7, ws));
    if (i == 3) seqs.push_back(make_seq(k4, DType::kF16, 700, 8, seed += 7, ws));
    if (i == 4) seqs.push_back(make_seq(full, DType::kF32, 400, 0, seed += 7, ws));
  }
  seqs.push_back(make_seq(k2, DType::kF16, 3000, 0, seed += 7, ws));
  seqs.push_back(make_seq(k4, DType::kF16, 260, 0, seed += 7, ws));
  // 30 more full f16 sequences: that group (36) passes the 32 a launch takes and runs as pieces
  for (int64_t i = 0; i < 30; ++i)
    seqs.push_back(make_seq(full, DType::kF16, 20 + 97 * i, i % 3 ? 0 : 24, seed += 7, ws));
  ASSERT_GT(6 + 30, cuda::kDecodeBatchMaxSequences);
  expect_batched_equals_alone(seqs, ws);
}

// Groups of 16 query heads: the 16-head block (heads in the mma's M dimension) in batched
// launches too, for f16 and bf16 rows and 2- / 4-bit fixed records (forced for the short packed
// views, which the automatic plan gives blocks of 8), beside packed views in blocks of 8.
TEST(CudaDecodeBatch, BatchedEqualsOneAtATimeGroup16) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  cuda::DecodeWorkspace ws;
  const Methods m;
  const CacheConfig &full = m.full, &k2 = m.k2, &k4 = m.k4;
  constexpr int64_t hq = kH * 16;
  std::vector<std::unique_ptr<Seq>> seqs;
  uint64_t seed = 900;
  const int64_t lens[] = {37, 1000, 4100, 300};
  for (size_t i = 0; i < std::size(lens); ++i) {
    seqs.push_back(make_seq(full, DType::kF16, lens[i], i % 2 ? 16 : 0, seed += 7, ws, hq));
    seqs.push_back(
        make_seq(k2, i % 2 ? DType::kBF16 : DType::kF16, lens[i] + 500, 0, seed += 7, ws, hq, 16));
    seqs.push_back(
        make_seq(k4, DType::kF16, lens[i] + 200, i % 2 ? 8 : 0, seed += 7, ws, hq, i % 2 ? 16 : 8));
  }
  seqs.push_back(make_seq(full, DType::kBF16, 2000, 0, seed += 7, ws, hq));
  int n16 = 0;
  for (const auto& s : seqs) n16 += s->plan.kv_rep == 1;
  EXPECT_EQ(n16, 11) << "expected the rows' plans, the forced packed ones on the 16-head block";
  expect_batched_equals_alone(seqs, ws);
}

TEST(CudaDecodeBatch, RefusesBeforeQueuing) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  cuda::DecodeWorkspace ws;
  CacheConfig full;
  full.method = "full";
  auto a = make_seq(full, DType::kF16, 100, 0, 1, ws);
  auto b = make_seq(full, DType::kF16, 200, 0, 2, ws);
  b->out.fill_zero();
  // b's plan over a's view: refused, and a (first in the list) is not run either
  std::vector<cuda::DecodeBatchItem> items = {
      {&b->plan, b->q.as<float>(), &b->view, b->out.as<float>()},
      {&b->plan, a->q.as<float>(), &a->view, a->out.as<float>()}};
  a->out.fill_zero();
  EXPECT_THROW(cuda::decode_attention_run_batch(items, ws), Error);
  cuda::synchronize(nullptr);
  for (float x : download(*b)) ASSERT_EQ(x, 0.0f) << "an item ran before the refusal";
}

}  // namespace
}  // namespace vq
