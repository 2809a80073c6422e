// GPU-resident caches (veloxquant/cuda_cache.h) against the CPU caches of the same config: the
// same sequence of prefill chunks and decode steps is fed to both, and after every call the
// fetched views must hold the same rows per (b, h) in the same order, with the same positions,
// the same representation (full precision or packed) and the same bytes (full-precision rows,
// packed codes + metadata; permutations too), and the caches the same offsets, stored positions
// and figures (bytes_resident excepted: on the device it is what cudaMalloc holds, checked
// against the byte formulas instead). decode_attention over each GPU view is checked against
// attention_reference over the CPU view (dequantized), and prefill_attention over the views of
// prefill calls likewise. Methods full, snapkv, skvq, snapkv+skvq, streaming; snapkv and
// snapkv+skvq also with snap_evict_at = prompt_end (end_prompt() on both caches, or the first
// single-token call), and chunked prompt-end prefill against one-shot on the device. Error cases:
// bad configs, shapes, max_ctx, trim, merge, the refused rotation of snapkv+skvq.
// snapkv+skvq scores packed rows by their dequantized keys: the device dequantizes with the same
// two roundings (code * scale, + lo) as the CPU, so its frame is bit-identical and the selections
// meet the same ulp-of-expf argument as SnapKV alone.
// SnapKV scores are not bit-exact on the device (expf differs from the host's exp by an ulp or
// two; test_cuda_snapkv bounds the score difference): with continuous random data no two
// competing scores come within that bound, so the selections must still be identical here.
// Skipped cleanly without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/attention_check.h"
#include "util/test_util.h"
#include "veloxquant/builder.h"
#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/error.h"
#include "veloxquant/packed.h"

namespace vq {
namespace {

#define SKIP_WITHOUT_DEVICE() \
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device"

// ---- blocks on host and device ------------------------------------------------------------------

// A host block [B, H, S, D] stored either contiguous or token-major ([B, S, H, D] memory, the
// layout a projection produces), and its device copy with the same strides.
struct Block {
  Tensor storage;
  TensorView host;
  cuda::DeviceBuffer buf;
  TensorView dev;
};

std::unique_ptr<Block> make_block(DType t, int64_t B, int64_t H, int64_t S, int64_t D,
                                  uint64_t seed, bool token_major) {
  auto blk = std::make_unique<Block>();
  blk->storage = token_major ? test::random_tensor(t, B, S, H, D, seed)
                             : test::random_tensor(t, B, H, S, D, seed);
  TensorView v = blk->storage.view();
  if (token_major) {  // view [B, H, S, D] over [B, S, H, D] memory
    v.shape = {B, H, S, D};
    v.stride = {S * H * D, D, H * D, 1};
  }
  blk->host = v;
  blk->buf = cuda::DeviceBuffer::from_host(blk->storage.data(), blk->storage.nbytes());
  blk->dev = v;
  blk->dev.data = blk->buf.data();
  return blk;
}

// ---- rows of a view, per (b, h) -----------------------------------------------------------------

struct Row {
  int32_t pos = 0;
  bool packed = false;
  std::vector<uint8_t> k, v;
};
using Rows = std::vector<std::vector<Row>>;  // [B * H][rows]

Rows cpu_rows(const CacheView& view) {
  const int64_t B = view.batch, H = view.n_kv_heads, D = view.head_dim;
  Rows out(static_cast<size_t>(B * H));
  for (const ViewSegment& s : view.segments)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < s.n_rows; ++i) {
          Row r;
          r.pos = s.position(b, h, i, H);
          r.packed = s.packed != nullptr;
          if (s.packed) {
            const uint8_t* k = s.packed->keys.record(b, h, i);
            const uint8_t* v = s.packed->values.record(b, h, i);
            r.k.assign(k, k + s.packed->keys.fmt.row_stride);
            r.v.assign(v, v + s.packed->values.fmt.row_stride);
          } else {
            EXPECT_EQ(s.keys.stride[3], 1);
            const size_t nb = static_cast<size_t>(D) * dtype_size(s.keys.dtype);
            const auto* k = static_cast<const uint8_t*>(s.keys.row(b, h, i));
            const auto* v = static_cast<const uint8_t*>(s.values.row(b, h, i));
            r.k.assign(k, k + nb);
            r.v.assign(v, v + nb);
          }
          out[static_cast<size_t>(b * H + h)].push_back(std::move(r));
        }
  return out;
}

Rows gpu_rows(const cuda::DeviceCacheView& view) {
  const int64_t F = view.batch() * view.n_kv_heads();
  Rows out(static_cast<size_t>(F));
  for (size_t si = 0; si < view.segments().size(); ++si) {
    const cuda::HostSegment hs = cuda::download_segment(view, si);
    for (int64_t f = 0; f < F; ++f)
      for (int64_t i = 0; i < hs.n_rows; ++i) {
        Row r;
        r.pos = hs.positions[static_cast<size_t>(f * hs.n_rows + i)];
        r.packed = hs.packed;
        const uint8_t* k = hs.keys.data() + (f * hs.n_rows + i) * hs.k_row_bytes;
        const uint8_t* v = hs.values.data() + (f * hs.n_rows + i) * hs.v_row_bytes;
        r.k.assign(k, k + hs.k_row_bytes);
        r.v.assign(v, v + hs.v_row_bytes);
        out[static_cast<size_t>(f)].push_back(std::move(r));
      }
  }
  return out;
}

void expect_same_rows(const Rows& c, const Rows& g, const std::string& vars) {
  ASSERT_EQ(c.size(), g.size()) << vars;
  int64_t bad = 0;
  for (size_t f = 0; f < c.size(); ++f) {
    ASSERT_EQ(c[f].size(), g[f].size()) << vars << " frame " << f << ": row counts";
    for (size_t i = 0; i < c[f].size(); ++i) {
      const Row &a = c[f][i], &b = g[f][i];
      if (a.pos != b.pos || a.packed != b.packed || a.k != b.k || a.v != b.v) {
        if (bad++ < 3)
          ADD_FAILURE() << vars << " frame " << f << " row " << i << ": cpu pos " << a.pos
                        << (a.packed ? " packed" : " fp") << ", gpu pos " << b.pos
                        << (b.packed ? " packed" : " fp") << ", keys "
                        << (a.k == b.k ? "equal" : "differ") << ", values "
                        << (a.v == b.v ? "equal" : "differ");
      }
    }
  }
  EXPECT_EQ(bad, 0) << vars << ": rows that differ";
}

// Permutations of the packed segments: the CPU's (one per packed block, all the same) against
// the device's.
void expect_same_perms(const CacheView& cv, const cuda::DeviceCacheView& gv,
                       const std::string& vars) {
  const int64_t HD = cv.n_kv_heads * cv.head_dim;
  const PackedSegment* cp = nullptr;
  for (const ViewSegment& s : cv.segments)
    if (s.packed) cp = s.packed;
  for (size_t i = 0; i < gv.segments().size(); ++i) {
    if (!gv.segments()[i].packed) continue;
    ASSERT_NE(cp, nullptr) << vars;
    const cuda::HostSegment hs = cuda::download_segment(gv, i);
    ASSERT_EQ(hs.k_perm.empty(), cp->keys.perm == nullptr) << vars;
    if (cp->keys.perm) {
      EXPECT_EQ(hs.k_perm, std::vector<int32_t>(cp->keys.perm, cp->keys.perm + HD)) << vars;
      EXPECT_EQ(hs.v_perm, std::vector<int32_t>(cp->values.perm, cp->values.perm + HD)) << vars;
    }
  }
}

void expect_same_stats(const CacheStats& c, const CacheStats& g, const std::string& vars) {
  EXPECT_EQ(c.method, g.method) << vars;
  EXPECT_EQ(c.tokens_seen, g.tokens_seen) << vars;
  EXPECT_EQ(c.rows_stored, g.rows_stored) << vars;
  EXPECT_EQ(c.bytes_accounted, g.bytes_accounted) << vars;
  EXPECT_EQ(c.fp16_bytes, g.fp16_bytes) << vars;
  ASSERT_EQ(c.figures.size(), g.figures.size()) << vars;
  for (size_t i = 0; i < c.figures.size(); ++i) {
    EXPECT_EQ(c.figures[i].first, g.figures[i].first) << vars;
    EXPECT_EQ(c.figures[i].second, g.figures[i].second) << vars << " " << c.figures[i].first;
  }
}

std::vector<float> random_q(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(n));
  for (auto& x : q) x = nd(rng);
  return q;
}

// ---- the driver ---------------------------------------------------------------------------------

struct Case {
  CacheConfig cfg;
  int64_t B = 1, H = 2, D = 64, Hq = 8;
  DType dtype = DType::kF16;
  bool token_major = false;
  bool queries = false;   // pass the real queries (SnapKV query scoring)
  bool attention = true;  // decode / prefill attention checks over the views
  std::vector<int64_t> steps;
  std::vector<size_t> end_prompt_after;  // 1-based steps after which end_prompt() runs on both
  std::string name;
};

struct Worst {
  double decode = 0, prefill = 0;
};

void run_case(const Case& cs, uint64_t seed, Worst& worst) {
  CacheConfig cfg = cs.cfg;
  cfg.head_dim = cs.D;
  std::unique_ptr<KVCache> cpu = make_cache(cfg);
  std::unique_ptr<cuda::DeviceKVCache> gpu = cuda::make_device_cache(cfg, cs.B, cs.H, cs.D);
  const int64_t B = cs.B, H = cs.H, D = cs.D, Hq = cs.Hq;
  int step = 0;
  for (int64_t s : cs.steps) {
    const std::string vars = cs.name + " step " + std::to_string(step) +
                             " (S=" + std::to_string(s) + ", offset " +
                             std::to_string(cpu->offset()) + ")";
    ++step;
    auto k = make_block(cs.dtype, B, H, s, D, seed + 101 * step, cs.token_major);
    auto v = make_block(cs.dtype, B, H, s, D, seed + 101 * step + 1, cs.token_major);
    std::unique_ptr<Block> q;
    UpdateOptions co;
    cuda::DeviceUpdateOptions go;
    if (cs.queries) {
      q = make_block(DType::kF32, B, Hq, s, D, seed + 101 * step + 2, false);
      co.queries = &q->host;
      go.queries = &q->dev;
    }
    const CacheView cv = cpu->update_and_fetch(k->host, v->host, co);
    const cuda::DeviceCacheView gv = gpu->update_and_fetch(k->dev, v->dev, go);
    expect_same_rows(cpu_rows(cv), gpu_rows(gv), vars + " fetched view");
    expect_same_perms(cv, gv, vars);
    if (cs.attention && cv.n_rows() > 0) {
      const DenseView dense = dequantize_view(cv, DType::kF32);
      AttentionParams ap;
      ap.q_pos0 = cpu->offset() - 1;  // the newest row's query
      const auto qd = random_q(B * Hq * D, seed + step);
      const auto od = cuda::decode_attention_host(qd, Hq, gv, ap);
      const auto cd = test::check_attention(dense.view, qd, Hq, 1, ap, od,
                                            test::AttnKernel::kDecode, vars + " decode");
      EXPECT_GT(cd.nonzero, 0) << vars;
      worst.decode = std::max(worst.decode, cd.worst_ratio);
      bool rotated = false;
      for (const auto& sg : gv.segments()) rotated = rotated || sg.k_signs || sg.v_signs;
      if (s > 1 && !rotated) {  // this call's queries over the view, with and without a window
        for (int64_t window : {int64_t{0}, int64_t{13}}) {
          AttentionParams pp;
          pp.q_pos0 = cpu->offset() - s;
          pp.window = window;
          const auto qp = random_q(B * Hq * s * D, seed + step + 7);
          const auto op = cuda::prefill_attention_host(qp, Hq, s, gv, pp);
          const auto cp =
              test::check_attention(dense.view, qp, Hq, s, pp, op, test::AttnKernel::kPrefill,
                                    vars + " prefill window " + std::to_string(window));
          EXPECT_GT(cp.nonzero, 0) << vars;
          worst.prefill = std::max(worst.prefill, cp.worst_ratio);
        }
      }
    }
    ASSERT_EQ(cpu->offset(), gpu->offset()) << vars;
    ASSERT_EQ(cpu->stored_rows(), gpu->stored_rows()) << vars;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        EXPECT_EQ(cpu->stored_positions(b, h), gpu->stored_positions(b, h)) << vars;
    const CacheStats gs = gpu->stats();
    expect_same_stats(cpu->stats(), gs, vars);
    // Resident bytes are real allocations that hold at least what the formula counts (records
    // round their codes up to the metadata alignment, never down) minus the permutations the
    // formula counts at 4 bytes and the buffers hold at 4 bytes too.
    EXPECT_GE(gs.bytes_resident, gs.bytes_accounted) << vars;
    if (std::find(cs.end_prompt_after.begin(), cs.end_prompt_after.end(),
                  static_cast<size_t>(step)) != cs.end_prompt_after.end()) {
      cpu->end_prompt();
      gpu->end_prompt();
      const std::string ev = vars + " after end_prompt";
      ASSERT_EQ(cpu->offset(), gpu->offset()) << ev;
      ASSERT_EQ(cpu->stored_rows(), gpu->stored_rows()) << ev;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          EXPECT_EQ(cpu->stored_positions(b, h), gpu->stored_positions(b, h)) << ev;
      expect_same_stats(cpu->stats(), gpu->stats(), ev);
    }
  }
}

// ---- tests --------------------------------------------------------------------------------------

TEST(CudaCaches, FullMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  Worst w;
  std::vector<Case> cases;
  Case c;
  c.cfg.method = "full";
  c.steps = {17, 1, 1, 300, 1, 129};
  c.name = "full f16 B1 H2 D64";
  cases.push_back(c);
  c.B = 2;
  c.H = 1;
  c.D = 128;
  c.Hq = 4;
  c.dtype = DType::kBF16;
  c.token_major = true;
  c.steps = {1, 127, 1};
  c.name = "full bf16 token-major B2 H1 D128";
  cases.push_back(c);
  c.B = 8;
  c.H = 2;
  c.D = 64;
  c.Hq = 2;
  c.dtype = DType::kF32;
  c.token_major = false;
  c.steps = {129, 1};
  c.name = "full f32 B8 H2 D64";
  cases.push_back(c);
  for (size_t i = 0; i < cases.size(); ++i) run_case(cases[i], 1000 + i, w);
  std::printf("[full] worst decode error %.3f%%, prefill %.3f%% of tolerance\n", 100 * w.decode,
              100 * w.prefill);
}

TEST(CudaCaches, FullTrimMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  CacheConfig cfg;
  cfg.method = "full";
  cfg.head_dim = 64;
  auto cpu = make_cache(cfg);
  auto gpu = cuda::make_device_cache(cfg, 1, 2, 64);
  ASSERT_TRUE(gpu->is_trimmable());
  auto k = make_block(DType::kF16, 1, 2, 40, 64, 5, false);
  auto v = make_block(DType::kF16, 1, 2, 40, 64, 6, false);
  cpu->update_and_fetch(k->host, v->host);
  gpu->update_and_fetch(k->dev, v->dev);
  EXPECT_EQ(cpu->trim(7), gpu->trim(7));
  EXPECT_EQ(cpu->trim(100), gpu->trim(100) + 0);
  EXPECT_THROW(gpu->trim(-1), Error);
  auto k2 = make_block(DType::kF16, 1, 2, 9, 64, 7, false);
  auto v2 = make_block(DType::kF16, 1, 2, 9, 64, 8, false);
  const CacheView cv = cpu->update_and_fetch(k2->host, v2->host);
  const cuda::DeviceCacheView gv = gpu->update_and_fetch(k2->dev, v2->dev);
  expect_same_rows(cpu_rows(cv), gpu_rows(gv), "full after trim");
  expect_same_stats(cpu->stats(), gpu->stats(), "full after trim");
}

TEST(CudaCaches, SnapKVMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  Worst w;
  std::vector<Case> cases;
  Case c;
  c.cfg.method = "snapkv";
  c.cfg.snap_budget = 24;
  c.cfg.snap_obs_window = 8;
  c.cfg.snap_n_sink = 4;
  c.steps = {50, 37, 1, 1, 1, 20, 1, 2};
  c.name = "snapkv key-proxy f16 B1 H2 D64";
  cases.push_back(c);
  c.dtype = DType::kBF16;
  c.cfg.snap_pool_kernel = 5;
  c.B = 2;
  c.H = 2;
  c.D = 128;
  c.Hq = 8;
  c.token_major = true;
  c.steps = {129, 1, 17, 1};
  c.name = "snapkv pool max 5 bf16 token-major B2 H2 D128";
  cases.push_back(c);
  c.cfg.snap_pool_kernel = 3;
  c.cfg.snap_pool = PoolKind::kAvg;
  c.cfg.snap_keep_window = true;
  c.dtype = DType::kF32;
  c.token_major = false;
  c.steps = {127, 1, 40};
  c.name = "snapkv keep-window avg 3 f32 B2 H2 D128";
  cases.push_back(c);
  c.cfg = CacheConfig{};
  c.cfg.method = "snapkv";
  c.cfg.snap_budget = 20;
  c.cfg.snap_obs_window = 6;
  c.cfg.snap_scoring = SnapScoring::kQuery;
  c.queries = true;
  c.B = 8;
  c.H = 1;
  c.D = 64;
  c.Hq = 4;
  c.dtype = DType::kF16;
  c.steps = {33, 1, 1, 17, 2};
  c.name = "snapkv query scoring GQA 4 B8 H1 D64";
  cases.push_back(c);
  for (size_t i = 0; i < cases.size(); ++i) run_case(cases[i], 2000 + i, w);
  std::printf("[snapkv] worst decode error %.3f%%, prefill %.3f%% of tolerance\n", 100 * w.decode,
              100 * w.prefill);
}

TEST(CudaCaches, StreamingMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  Worst w;
  std::vector<Case> cases;
  Case c;
  c.cfg.method = "streaming";
  c.cfg.streaming_n_sink = 4;
  c.cfg.streaming_window = 32;
  c.steps = {50, 1, 1, 1};
  for (int i = 0; i < 70; ++i) c.steps.push_back(1);  // slides past the slack: run moved back
  c.steps.insert(c.steps.end(), {100, 1, 3, 2});
  c.name = "streaming sinks 4 window 32 f16 B1 H2 D64";
  cases.push_back(c);
  c.cfg.streaming_n_sink = 0;
  c.cfg.streaming_window = 17;
  c.B = 2;
  c.D = 128;
  c.dtype = DType::kBF16;
  c.token_major = true;
  c.steps = {1, 2, 17, 1, 129, 1};
  c.name = "streaming no sinks window 17 bf16 token-major B2 H2 D128";
  cases.push_back(c);
  c.cfg.streaming_n_sink = 7;
  c.cfg.streaming_window = 5;
  c.B = 8;
  c.H = 1;
  c.D = 64;
  c.Hq = 8;
  c.dtype = DType::kF32;
  c.token_major = false;
  c.steps = {3, 3, 1, 127, 1, 1};
  c.name = "streaming sinks 7 window 5 f32 B8 H1 D64";
  cases.push_back(c);
  for (size_t i = 0; i < cases.size(); ++i) run_case(cases[i], 4000 + i, w);
  std::printf("[streaming] worst decode error %.3f%%, prefill %.3f%% of tolerance\n",
              100 * w.decode, 100 * w.prefill);
}

// caches.md §3 worked example: B=1, H=2, D=128, S=64, budget 16.
TEST(CudaCaches, SnapKVWorkedExample) {
  SKIP_WITHOUT_DEVICE();
  CacheConfig cfg;
  cfg.method = "snapkv";
  cfg.snap_budget = 16;
  auto gpu = cuda::make_device_cache(cfg, 1, 2, 128);
  auto k = make_block(DType::kF16, 1, 2, 64, 128, 9, false);
  auto v = make_block(DType::kF16, 1, 2, 64, 128, 10, false);
  const cuda::DeviceCacheView view = gpu->update_and_fetch(k->dev, v->dev);
  EXPECT_EQ(view.n_rows(), 64);  // deferred eviction: this step sees every row
  CacheStats s = gpu->stats();
  EXPECT_EQ(s.figure("kept_key_bytes"), 8192);
  EXPECT_EQ(s.figure("full_key_bytes"), 32768);
  EXPECT_EQ(s.figure("eviction_ratio"), 4.0);
  EXPECT_EQ(s.figure("keep_rate"), 0.25);
  auto k1 = make_block(DType::kF16, 1, 2, 1, 128, 11, false);
  auto v1 = make_block(DType::kF16, 1, 2, 1, 128, 12, false);
  gpu->update_and_fetch(k1->dev, v1->dev);
  s = gpu->stats();
  EXPECT_EQ(s.figure("kept_key_bytes"), 8192 + 512);
  EXPECT_EQ(s.figure("full_key_bytes"), 32768 + 512);
}

TEST(CudaCaches, SkvqMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  Worst w;
  std::vector<Case> cases;
  Case c;
  c.cfg.method = "skvq";
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 16;
  c.steps = {35, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 40, 1, 3};
  c.name = "skvq K2V2 g16 f16 B1 H2 D64";
  cases.push_back(c);
  c.cfg.skvq_bits_key = 4;
  c.cfg.skvq_bits_value = 4;
  c.cfg.skvq_group_size = 32;
  c.cfg.skvq_meta = MetaType::kF32;
  c.cfg.skvq_recent = 8;
  c.cfg.skvq_window = 32;
  c.B = 2;
  c.D = 128;
  c.dtype = DType::kBF16;
  c.token_major = true;
  c.steps = {17, 1, 129, 1, 1, 40};
  c.name = "skvq K4V4 g32 meta f32 recent 8 bf16 token-major B2 H2 D128";
  cases.push_back(c);
  c.cfg = CacheConfig{};
  c.cfg.method = "skvq";
  c.cfg.skvq_window = 16;
  c.cfg.skvq_bits_key = 2;
  c.cfg.skvq_bits_value = 4;
  c.cfg.skvq_group_size = 48;  // ragged last group at D = 64
  c.cfg.skvq_meta = MetaType::kFP8E4M3;
  c.cfg.skvq_reorder = false;
  c.B = 8;
  c.H = 1;
  c.D = 64;
  c.Hq = 1;
  c.dtype = DType::kF32;
  c.token_major = false;
  c.steps = {1, 17, 127, 1};
  c.name = "skvq K2V4 g48 fp8 no reorder f32 B8 H1 D64";
  cases.push_back(c);
  c.cfg = CacheConfig{};
  c.cfg.method = "skvq";
  c.cfg.skvq_window = 32;
  c.cfg.skvq_bits_key = 4;
  c.cfg.skvq_bits_value = 2;
  c.cfg.skvq_rotation = Rotation::kHadamard;
  c.cfg.skvq_rotate_values = true;
  c.B = 1;
  c.H = 2;
  c.D = 128;
  c.Hq = 16;
  c.dtype = DType::kF16;
  c.steps = {70, 1, 33};
  c.name = "skvq K4V2 hadamard keys+values B1 H2 D128";
  cases.push_back(c);
  for (size_t i = 0; i < cases.size(); ++i) run_case(cases[i], 3000 + i, w);
  std::printf("[skvq] worst decode error %.3f%%, prefill %.3f%% of tolerance\n", 100 * w.decode,
              100 * w.prefill);
}

// Path independence on the device (caches.md §4): one-shot prefill and token-by-token decode
// give bit-identical stores (the flush rule depends only on the row count).
TEST(CudaCaches, SkvqPathIndependence) {
  SKIP_WITHOUT_DEVICE();
  CacheConfig cfg;
  cfg.method = "skvq";
  cfg.skvq_window = 32;
  cfg.skvq_recent = 3;
  auto one = cuda::make_device_cache(cfg, 2, 2, 64);
  auto step = cuda::make_device_cache(cfg, 2, 2, 64);
  auto k = make_block(DType::kF16, 2, 2, 150, 64, 41, false);
  auto v = make_block(DType::kF16, 2, 2, 150, 64, 42, false);
  one->update_and_fetch(k->dev, v->dev);
  for (int64_t i = 0; i < 150; ++i) {
    TensorView ki = k->dev.slice_tokens(i, i + 1), vi = v->dev.slice_tokens(i, i + 1);
    step->update_and_fetch(ki, vi);
  }
  expect_same_rows(gpu_rows(one->stored_view()), gpu_rows(step->stored_view()),
                   "skvq one-shot vs token-by-token");
  EXPECT_EQ(one->stats().bytes_accounted, step->stats().bytes_accounted);
  EXPECT_EQ(one->stats().figure("quantized_tokens"), 128);
}

// caches.md §4 worked example (B=1, H=2, D=64, window 16, n_sink 4, group 16, 2 bits, S = 35),
// and resident memory that follows the packed bytes over a long decode.
TEST(CudaCaches, SkvqWorkedExampleAndResidentBytes) {
  SKIP_WITHOUT_DEVICE();
  CacheConfig cfg;
  cfg.method = "skvq";
  cfg.skvq_window = 16;
  cfg.skvq_n_sink = 4;
  cfg.skvq_group_size = 16;
  auto gpu = cuda::make_device_cache(cfg, 1, 2, 64);
  auto k = make_block(DType::kF16, 1, 2, 35, 64, 13, false);
  auto v = make_block(DType::kF16, 1, 2, 35, 64, 14, false);
  gpu->update_and_fetch(k->dev, v->dev);
  const CacheStats s = gpu->stats();
  EXPECT_EQ(s.figure("compressed_key_bytes"), 1792);
  EXPECT_EQ(s.figure("fp16_key_bytes"), 8960);
  EXPECT_EQ(s.figure("residual_fp16_bytes"), 3584);
  EXPECT_EQ(s.figure("perm_bytes"), 1024);
  EXPECT_EQ(s.figure("assigned_avg_bits"), 4.0);

  // 4096 rows of B=1, H=8, D=128 at K2V2 g32: the fp16 rows are freed as chunks are packed.
  CacheConfig big;
  big.method = "skvq";
  auto g2 = cuda::make_device_cache(big, 1, 8, 128);
  auto kb = make_block(DType::kF16, 1, 8, 4096, 128, 15, false);
  auto vb = make_block(DType::kF16, 1, 8, 4096, 128, 16, false);
  g2->update_and_fetch(kb->dev, vb->dev);
  const CacheStats s2 = g2->stats();
  std::printf("[skvq resident] accounted %lld, resident %lld, fp16 %lld bytes\n",
              static_cast<long long>(s2.bytes_accounted), static_cast<long long>(s2.bytes_resident),
              static_cast<long long>(s2.fp16_bytes));
  // Packed capacity grows by at most 1.5x (plus a 64-row step) and the tail buffer holds at most
  // twice its rows (plus 16): resident <= 1.5 x accounted + 64 packed rows + 2 x the residual.
  const int64_t slack =
      64 * 8 * 2 * 32 * 2 + 2 * static_cast<int64_t>(s2.figure("residual_fp16_bytes")) + 4096;
  EXPECT_LE(s2.bytes_resident, s2.bytes_accounted * 3 / 2 + slack);
  EXPECT_LT(s2.bytes_resident, s2.fp16_bytes / 4);
}

TEST(CudaCaches, ErrorsMatchCpuAndChangeNothing) {
  SKIP_WITHOUT_DEVICE();
  // Bad configs: the CPU builder's message.
  std::vector<std::pair<std::string, CacheConfig>> bad(3);
  bad[0].first = "snapkv budget 0";
  bad[0].second.method = "snapkv";
  bad[0].second.snap_budget = 0;
  bad[1].first = "skvq window 1";
  bad[1].second.method = "skvq";
  bad[1].second.skvq_window = 1;
  bad[2].first = "skvq n_sink 200";
  bad[2].second.method = "skvq";
  bad[2].second.skvq_n_sink = 200;
  for (const auto& [spec, cfg] : bad) {
    std::string cpu_msg, gpu_msg;
    try {
      CacheConfig c = cfg;
      c.head_dim = 64;
      make_cache(c);
    } catch (const Error& e) {
      cpu_msg = e.what();
    }
    try {
      cuda::make_device_cache(cfg, 1, 2, 64);
    } catch (const Error& e) {
      gpu_msg = e.what();
    }
    EXPECT_FALSE(cpu_msg.empty()) << spec;
    EXPECT_EQ(cpu_msg, gpu_msg) << spec;
  }
  for (const char* method : {"full", "snapkv", "skvq", "snapkv+skvq", "streaming"}) {
    CacheConfig cfg;
    cfg.method = method;
    cfg.skvq_window = 16;
    cfg.skvq_max_ctx = 40;
    cfg.snap_budget = 10;
    auto gpu = cuda::make_device_cache(cfg, 1, 2, 64);
    auto k = make_block(DType::kF16, 1, 2, 35, 64, 21, false);
    auto v = make_block(DType::kF16, 1, 2, 35, 64, 22, false);
    gpu->update_and_fetch(k->dev, v->dev);
    const Rows before = gpu_rows(gpu->stored_view());
    const CacheStats st = gpu->stats();
    auto expect_refused = [&](auto&& f, const std::string& needle, const std::string& what) {
      try {
        f();
        ADD_FAILURE() << method << " " << what << ": accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
            << method << " " << what << ": " << e.what();
      }
      EXPECT_EQ(gpu->offset(), 35) << method << " " << what;
      expect_same_rows(before, gpu_rows(gpu->stored_view()), std::string(method) + " " + what);
      EXPECT_EQ(gpu->stats().bytes_accounted, st.bytes_accounted) << method << " " << what;
    };
    auto kh = make_block(DType::kF16, 1, 3, 2, 64, 23, false);  // wrong H
    auto vh = make_block(DType::kF16, 1, 3, 2, 64, 24, false);
    expect_refused([&] { gpu->update_and_fetch(kh->dev, vh->dev); },
                   "expected keys [1, 2, S>=0, 64]", "wrong heads");
    auto kd = make_block(DType::kF16, 1, 2, 2, 32, 25, false);  // wrong D
    expect_refused([&] { gpu->update_and_fetch(kd->dev, kd->dev); }, "but got [1, 2, 2, 32]",
                   "wrong head_dim");
    auto k2 = make_block(DType::kF16, 1, 2, 2, 64, 26, false);
    auto v3 = make_block(DType::kF16, 1, 2, 3, 64, 27, false);
    expect_refused([&] { gpu->update_and_fetch(k2->dev, v3->dev); }, "values of the keys' shape",
                   "values shape");
    TensorView bad = k2->dev;
    bad.dtype = static_cast<DType>(7);
    expect_refused([&] { gpu->update_and_fetch(bad, k2->dev); }, "dtype code 7", "bad dtype");
    expect_refused([&] { gpu->merge_batch({gpu.get()}); }, "merg", "merge");
    if (std::string(method) != "full") {
      expect_refused([&] { gpu->trim(1); }, "not trimmable", "trim");
    }
    if (std::string(method) == "skvq" || std::string(method) == "snapkv+skvq") {
      auto k6 = make_block(DType::kF16, 1, 2, 6, 64, 28, false);
      expect_refused([&] { gpu->update_and_fetch(k6->dev, k6->dev); }, "skvq_max_ctx", "max_ctx");
      auto k5 = make_block(DType::kF16, 1, 2, 5, 64, 29, false);
      gpu->update_and_fetch(k5->dev, k5->dev);  // exactly max_ctx is fine
      EXPECT_EQ(gpu->offset(), 40);
    }
  }

  // SnapKV query scoring: query heads must be a multiple of the KV heads.
  CacheConfig qc;
  qc.method = "snapkv";
  qc.snap_scoring = SnapScoring::kQuery;
  auto gq = cuda::make_device_cache(qc, 1, 2, 64);
  auto k = make_block(DType::kF16, 1, 2, 4, 64, 31, false);
  auto q3 = make_block(DType::kF32, 1, 3, 4, 64, 32, false);
  cuda::DeviceUpdateOptions o;
  o.queries = &q3->dev;
  EXPECT_THROW(gq->update_and_fetch(k->dev, k->dev, o), Error);
  EXPECT_EQ(gq->offset(), 0);
}

TEST(CudaCaches, SnapkvSkvqMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  Worst w;
  std::vector<Case> cases;
  Case c;
  c.cfg.method = "snapkv+skvq";
  c.cfg.snap_budget = 40;
  c.cfg.snap_obs_window = 8;
  c.cfg.snap_n_sink = 4;
  c.cfg.skvq_window = 16;
  c.cfg.skvq_n_sink = 4;
  c.cfg.skvq_group_size = 16;
  // 50: evict to 40 (all full precision), flush two chunks; 37: selection over sinks ++ packed ++
  // tail keeps some packed rows per head (equalised by early quantization); decode steps flush.
  c.steps = {50, 37, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 30, 1, 2};
  c.name = "snapkv+skvq key-proxy K2V2 g16 f16 B1 H2 D64";
  cases.push_back(c);
  c.cfg.snap_budget = 64;
  c.cfg.snap_pool_kernel = 5;
  c.cfg.skvq_bits_key = 4;
  c.cfg.skvq_bits_value = 4;
  c.cfg.skvq_group_size = 32;
  c.cfg.skvq_meta = MetaType::kF32;
  c.cfg.skvq_recent = 8;
  c.cfg.skvq_window = 32;
  c.cfg.skvq_n_sink = 5;
  c.B = 2;
  c.D = 128;
  c.dtype = DType::kBF16;
  c.token_major = true;
  c.steps = {129, 1, 17, 1, 1, 40, 1};
  c.name = "snapkv+skvq pool max 5 K4V4 g32 meta f32 recent 8 bf16 token-major B2 H2 D128";
  cases.push_back(c);
  c.cfg = CacheConfig{};
  c.cfg.method = "snapkv+skvq";
  c.cfg.snap_budget = 30;
  c.cfg.snap_obs_window = 6;
  c.cfg.snap_scoring = SnapScoring::kQuery;
  c.cfg.skvq_window = 16;
  c.cfg.skvq_bits_key = 2;
  c.cfg.skvq_bits_value = 4;
  c.cfg.skvq_group_size = 48;  // ragged last group at D = 64
  c.cfg.skvq_meta = MetaType::kFP8E4M3;
  c.cfg.skvq_reorder = false;
  c.queries = true;
  c.B = 8;
  c.H = 1;
  c.D = 64;
  c.Hq = 4;
  c.dtype = DType::kF16;
  c.token_major = false;
  c.steps = {33, 1, 1, 17, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 20};
  c.name = "snapkv+skvq query scoring GQA 4 K2V4 g48 fp8 no reorder B8 H1 D64";
  cases.push_back(c);
  c.cfg = CacheConfig{};
  c.cfg.method = "snapkv+skvq";
  c.cfg.snap_budget = 3;  // below the sinks: the budget cuts into them
  c.cfg.snap_n_sink = 4;
  c.cfg.skvq_n_sink = 5;
  c.cfg.skvq_window = 6;
  c.cfg.skvq_group_size = 32;
  c.queries = false;
  c.B = 1;
  c.H = 2;
  c.D = 64;
  c.Hq = 2;
  c.dtype = DType::kF32;
  // 2 + 1 + 1: the sinks grow to 4; 10 evicts to 3 rows (new sinks); six decode rows flush one
  // packed chunk; 5 evicts every packed row (the budget keeps the 3 sinks only).
  c.steps = {2, 1, 10, 1, 1, 1, 1, 1, 1, 1, 5, 1};
  c.name = "snapkv+skvq budget 3 < sinks 4 window 6 f32 B1 H2 D64";
  cases.push_back(c);
  // Key codes decode_attention does not read (1.5-bit ternary, 3-bit codes across byte borders):
  // the selection still scores their dequantized keys; rows, positions and figures only.
  for (const double kb : {1.5, 3.0}) {
    c.cfg = CacheConfig{};
    c.cfg.method = "snapkv+skvq";
    c.cfg.snap_budget = 40;
    c.cfg.snap_obs_window = 8;
    c.cfg.skvq_window = 16;
    c.cfg.skvq_group_size = 16;
    c.cfg.skvq_bits_key = kb;
    c.cfg.skvq_bits_value = kb == 3.0 ? 1.5 : 3.0;
    c.attention = false;
    c.dtype = DType::kF16;
    c.steps = {50, 37, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 30, 1};
    c.name = "snapkv+skvq keys " + std::to_string(kb) + " bits, no attention, f16 B1 H2 D64";
    cases.push_back(c);
  }
  for (size_t i = 0; i < cases.size(); ++i) run_case(cases[i], 5000 + i, w);
  std::printf("[snapkv+skvq] worst decode error %.3f%%, prefill %.3f%% of tolerance\n",
              100 * w.decode, 100 * w.prefill);
}

// snap_evict_at = prompt_end: the chunks of a prompt are stored whole, the selection runs once,
// at end_prompt() (explicit) or before the first single-token call (implicit); decode calls after
// that append; a later multi-token call starts a new prompt.
TEST(CudaCaches, PromptEndMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  Worst w;
  std::vector<Case> cases;
  Case c;
  c.cfg.method = "snapkv";
  c.cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
  c.cfg.snap_budget = 24;
  c.cfg.snap_obs_window = 8;
  c.steps = {50, 37, 20, 1, 1, 1, 30, 1, 1};
  c.name = "snapkv prompt_end implicit key-proxy f16 B1 H2 D64";
  cases.push_back(c);
  c.cfg.snap_scoring = SnapScoring::kQuery;
  c.cfg.snap_pool_kernel = 3;
  c.queries = true;
  c.B = 2;
  c.D = 128;
  c.Hq = 8;
  c.dtype = DType::kBF16;
  c.token_major = true;
  c.steps = {40, 5, 33, 1, 1, 17, 1};  // the last chunk (33) is longer than the window (8)
  c.end_prompt_after = {3, 6};
  c.name = "snapkv prompt_end explicit query scoring pool 3 bf16 token-major B2 H2 D128";
  cases.push_back(c);
  c.cfg = CacheConfig{};
  c.cfg.method = "snapkv+skvq";
  c.cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
  c.cfg.snap_budget = 40;
  c.cfg.snap_obs_window = 8;
  c.cfg.skvq_window = 16;
  c.cfg.skvq_group_size = 16;
  c.queries = false;
  c.B = 1;
  c.H = 2;
  c.D = 64;
  c.Hq = 8;
  c.dtype = DType::kF16;
  c.token_major = false;
  c.steps = {50, 37, 20, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 30, 1, 1};
  c.end_prompt_after = {};
  c.name = "snapkv+skvq prompt_end implicit key-proxy K2V2 g16 f16 B1 H2 D64";
  cases.push_back(c);
  c.cfg.snap_scoring = SnapScoring::kQuery;
  c.cfg.snap_obs_window = 6;
  c.cfg.skvq_bits_key = 4;
  c.cfg.skvq_bits_value = 4;
  c.cfg.skvq_group_size = 32;
  c.cfg.skvq_recent = 4;
  c.queries = true;
  c.B = 4;
  c.H = 2;
  c.D = 128;
  c.Hq = 8;
  c.steps = {3, 60, 4, 1, 1, 25, 1};  // the last chunk (4) is shorter than the window (6)
  c.end_prompt_after = {3, 6};
  c.name = "snapkv+skvq prompt_end explicit query scoring K4V4 g32 recent 4 B4 H2 D128";
  cases.push_back(c);
  for (size_t i = 0; i < cases.size(); ++i) run_case(cases[i], 6000 + i, w);
  std::printf("[prompt_end] worst decode error %.3f%%, prefill %.3f%% of tolerance\n",
              100 * w.decode, 100 * w.prefill);
}

// Metamorphic, on the device alone: with snap_evict_at = prompt_end a prompt fed in chunks stores
// exactly what the one-shot prompt stores (key-proxy scoring: the frame and its last key rows are
// the same), for snapkv and snapkv+skvq.
TEST(CudaCaches, PromptEndChunkedEqualsOneShot) {
  SKIP_WITHOUT_DEVICE();
  for (const char* method : {"snapkv", "snapkv+skvq"}) {
    CacheConfig cfg;
    cfg.method = method;
    cfg.snap_evict_at = SnapEvictAt::kPromptEnd;
    cfg.snap_budget = 48;
    cfg.skvq_window = 16;
    auto one = cuda::make_device_cache(cfg, 2, 2, 64);
    auto chunked = cuda::make_device_cache(cfg, 2, 2, 64);
    auto k = make_block(DType::kF16, 2, 2, 150, 64, 51, false);
    auto v = make_block(DType::kF16, 2, 2, 150, 64, 52, false);
    one->update_and_fetch(k->dev, v->dev);
    one->end_prompt();
    for (auto [a, b] : {std::pair<int64_t, int64_t>{0, 40}, {40, 73}, {73, 150}})
      chunked->update_and_fetch(k->dev.slice_tokens(a, b), v->dev.slice_tokens(a, b));
    EXPECT_EQ(chunked->stored_rows(), 150) << method << ": nothing evicted before the end";
    chunked->end_prompt();
    EXPECT_EQ(one->stored_rows(), 48) << method;
    expect_same_rows(gpu_rows(one->stored_view()), gpu_rows(chunked->stored_view()),
                     std::string(method) + " one-shot vs chunked prompt");
    EXPECT_EQ(one->stats().bytes_accounted, chunked->stats().bytes_accounted) << method;
  }
}

// Needs no device: the config is refused before anything is allocated.
TEST(CudaCaches, RefusesRotationForSnapkvSkvq) {
  CacheConfig cfg;
  cfg.method = "snapkv+skvq";
  cfg.skvq_rotation = Rotation::kHadamard;
  try {
    cuda::make_device_cache(cfg, 1, 2, 64);
    ADD_FAILURE() << "snapkv+skvq with skvq_rotation = hadamard accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("skvq_rotation"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace vq
