// GPU tests of the SKVQ flush kernels beyond the op harness's table
// (tests/cuda/test_backend_ops_cuda.cpp holds skvq_quantize_rows and skvq_channel_perms to the CPU
// byte for byte over bit widths, groups, metadata, clip search, dtypes, permutation and rotation):
// groups whose codes land on and one ulp around every rounding tie (the device divides by the
// scale only near ties), exact; the records and permutations of real SKVQ caches (what their flush
// stored) reproduced byte for byte; and the refusal of a mismatched format. Skipped cleanly
// without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "util/llama_shapes.h"
#include "util/test_util.h"
#include "veloxquant/builder.h"
#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/error.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/hadamard.h"
#include "veloxquant/memory_plan.h"
#include "veloxquant/packed.h"
#include "veloxquant/prefill_schedule.h"
#include "veloxquant/skvq_cache.h"

namespace vq {
namespace {

#define SKIP_WITHOUT_DEVICE() \
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device"

// Rows [B, H, n, D] of dtype dt with outliers and special rows (constant, zero, huge, tiny).
Tensor special_rows(DType dt, int64_t B, int64_t H, int64_t n, int64_t D, uint64_t seed) {
  Tensor t(dt, B, H, n, D);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 9);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; ++i) {
        const int k = kind(rng);
        for (int64_t d = 0; d < D; ++d) {
          float x = nd(rng) * (d % 7 == 3 ? 20.0f : 1.0f);       // outlier channels
          if (k == 0) x = 1.25f;                                 // constant row: range 0
          if (k == 1) x = 0.0f;                                  // zero row
          if (k == 2) x *= dt == DType::kF16 ? 500.0f : 3.0e5f;  // huge: fp16 meta saturates
          if (k == 3) x *= 1e-6f;                                // tiny: scales below fp8's range
          t.set(b, h, i, d, x);
        }
      }
  return t;
}

// The CPU flush of rows [B, H, n, D] into records [B, H, n, stride]: to fp32, transform, quantize.
std::vector<uint8_t> cpu_records(const Tensor& rows, const PackedRowFormat& f,
                                 const GroupQuantParams& gp, const std::vector<int32_t>& perm,
                                 const std::vector<float>& signs) {
  const int64_t B = rows.shape()[0], H = rows.shape()[1], n = rows.shape()[2], D = rows.shape()[3];
  std::vector<uint8_t> out(static_cast<size_t>(B * H * n * f.row_stride));
  PackedTensor t;
  t.fmt = f;
  t.perm = perm.empty() ? nullptr : perm.data();
  t.signs = signs.empty() ? nullptr : signs.data();
  t.rot_block = signs.empty() ? 0 : static_cast<int32_t>(hadamard_block(D));
  std::vector<float> row(static_cast<size_t>(D)), tmp(static_cast<size_t>(D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; ++i) {
        to_f32(rows.view().row(b, h, i), rows.dtype(), row.data(), static_cast<size_t>(D));
        if (t.transformed()) transform_row(t, h, row.data(), tmp.data());
        quantize_to_records(row.data(), 1, f, gp, out.data() + ((b * H + h) * n + i) * f.row_stride,
                            f.row_stride, false);
      }
  return out;
}

std::vector<uint8_t> gpu_records(const Tensor& rows, const PackedRowFormat& f,
                                 const GroupQuantParams& gp, const std::vector<int32_t>& perm,
                                 const std::vector<float>& signs) {
  const auto& s = rows.shape();
  const int64_t D = s[3];
  cuda::DeviceBuffer drows = cuda::DeviceBuffer::from_host(rows.data(), rows.nbytes());
  const TensorView v = TensorView::contiguous(drows.data(), rows.dtype(), s[0], s[1], s[2], s[3]);
  cuda::DeviceBuffer dperm, dsigns;
  if (!perm.empty()) dperm = cuda::DeviceBuffer::from_vector(perm);
  if (!signs.empty()) dsigns = cuda::DeviceBuffer::from_vector(signs);
  const size_t nbytes = static_cast<size_t>(s[0] * s[1] * s[2] * f.row_stride);
  cuda::DeviceBuffer out(nbytes);
  out.fill_zero();
  cuda::skvq_quantize_rows(v, f, gp, dperm.as<int32_t>(), dsigns.as<float>(),
                           signs.empty() ? 0 : static_cast<int32_t>(hadamard_block(D)),
                           out.as<uint8_t>());
  cuda::synchronize();
  return out.to_vector<uint8_t>(nbytes);
}

int64_t count_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) n += a[i] != b[i];
  return n + static_cast<int64_t>(std::max(a.size(), b.size()) - std::min(a.size(), b.size()));
}

// The device quantizer divides by the scale only near rounding ties (it multiplies by the
// reciprocal elsewhere): groups whose codes land exactly on, and one ulp either side of, every
// half-integer k + 1/2 (alpha = 1 with dyadic data gives lo = min and scale = range / levels
// exactly; the clip search's other alphas give near-ties of their own) must still agree bit for
// bit.
TEST(CudaSkvq, QuantizeRowsTiesBitIdentical) {
  SKIP_WITHOUT_DEVICE();
  int cases = 0;
  for (double bits : {2.0, 4.0, 1.5})
    for (MetaType meta : {MetaType::kF32, MetaType::kF16})
      for (bool search : {false, true})
        for (float mag : {1.0f, 0x1p-6f, 0x1p5f}) {
          const int64_t B = 1, H = 2, n = 9, D = 64, group = 32;
          const PackedRowFormat f = make_row_format(D, bits, group, meta);
          const int levels = f.spec.levels();
          Tensor rows(DType::kF32, B, H, n, D);
          std::mt19937_64 rng(static_cast<uint64_t>(++cases));
          for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < n; ++i)
              for (int64_t d = 0; d < D; ++d) {
                const int64_t j = d % group;
                float x;
                if (j == 0) {
                  x = 0.0f;  // the group's min
                } else if (j == 1) {
                  x = static_cast<float>(levels);  // its max: scale = 1 at alpha = 1
                } else {
                  const float tie = static_cast<float>(rng() % levels) + 0.5f;
                  const int side = static_cast<int>((j + i) % 3);  // below, on, above the tie
                  x = side == 1 ? tie : std::nextafter(tie, side == 0 ? -INFINITY : INFINITY);
                }
                rows.set(0, h, i, d, x * mag);
              }
          GroupQuantParams gp;
          gp.bits = bits;
          gp.group_size = group;
          gp.meta = meta;
          gp.clip_search = search;
          gp.clip_alpha = 1.0f;
          std::ostringstream vars;
          vars << "bits=" << bits << " meta=" << static_cast<int>(meta) << " search=" << search
               << " mag=" << mag;
          const auto cpu = cpu_records(rows, f, gp, {}, {});
          const auto gpu = gpu_records(rows, f, gp, {}, {});
          EXPECT_EQ(count_diff(cpu, gpu), 0) << vars.str() << ": record bytes differ";
        }
  std::printf("[skvq quantize ties] %d cases, records bit-identical\n", cases);
}

// A contiguous copy of rows [i0, i0 + n) of t.
Tensor slice_rows(const Tensor& t, int64_t i0, int64_t n) {
  const auto& s = t.shape();
  Tensor out(t.dtype(), s[0], s[1], n, s[3]);
  const size_t rb = static_cast<size_t>(s[3]) * dtype_size(t.dtype());
  for (int64_t b = 0; b < s[0]; ++b)
    for (int64_t h = 0; h < s[1]; ++h)
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(out.view().row(b, h, i), t.view().row(b, h, i0 + i), rb);
  return out;
}

// The records a real SKVQ cache stored are what the GPU flush makes of the same rows with the
// cache's permutations / signs; the GPU's chunk-0 permutations are the cache's.
TEST(CudaSkvq, RealCacheFlushReproduced) {
  SKIP_WITHOUT_DEVICE();
  struct Cfg {
    double kb, vb;
    int64_t group;
    MetaType meta;
    bool rotate;
    bool search;
  };
  const Cfg cfgs[] = {{2, 2, 32, MetaType::kF16, false, true},
                      {4, 2, 128, MetaType::kFP8E4M3, false, true},
                      {2, 1.5, 32, MetaType::kF32, true, false},
                      {8, 4, 48, MetaType::kF16, false, true}};
  for (const Cfg& c : cfgs) {
    CacheConfig cfg;
    cfg.method = "skvq";
    cfg.head_dim = 128;
    cfg.skvq_window = 32;
    cfg.skvq_n_sink = 5;
    cfg.skvq_bits_key = c.kb;
    cfg.skvq_bits_value = c.vb;
    cfg.skvq_group_size = c.group;
    cfg.skvq_meta = c.meta;
    cfg.skvq_clip_search = c.search;
    cfg.skvq_clip_alpha = 0.94;
    if (c.rotate) cfg.skvq_rotation = Rotation::kHadamard;
    std::unique_ptr<KVCache> cache;
    try {
      cache = make_cache(cfg);
    } catch (const Error& e) {
      GTEST_SKIP() << "skvq cache not available: " << e.what();
    }
    const int64_t B = 2, H = 2, S = 150, D = 128;
    const Tensor k = special_rows(DType::kF16, B, H, S, D, 21);
    const Tensor v = special_rows(DType::kF16, B, H, S, D, 22);
    const CacheView view = cache->update_and_fetch(k.view(), v.view());
    std::ostringstream vars;
    vars << "K" << c.kb << "V" << c.vb << " g" << c.group << " meta" << static_cast<int>(c.meta)
         << (c.rotate ? " rot" : " reorder");
    int packed_segments = 0;
    for (const ViewSegment& s : view.segments) {
      if (!s.packed) continue;
      ++packed_segments;
      const PackedSegment& ps = *s.packed;
      for (int kv = 0; kv < 2; ++kv) {
        const PackedTensor& t = kv == 0 ? ps.keys : ps.values;
        const Tensor& src = kv == 0 ? k : v;
        std::vector<int32_t> perm;
        std::vector<float> signs;
        if (t.perm) perm.assign(t.perm, t.perm + H * D);
        if (t.signs) signs.assign(t.signs, t.signs + H * D);
        if (t.perm && s.first_pos < 32) {  // chunk 0 froze the permutation: recompute it
          const Tensor chunk0 = slice_rows(src, 0, 32);
          cuda::DeviceBuffer d = cuda::DeviceBuffer::from_host(chunk0.data(), chunk0.nbytes());
          cuda::DeviceBuffer p(static_cast<size_t>(H * D) * 4);
          cuda::skvq_channel_perms(TensorView::contiguous(d.data(), DType::kF16, B, H, 32, D),
                                   p.as<int32_t>());
          cuda::synchronize();
          EXPECT_EQ(p.to_vector<int32_t>(static_cast<size_t>(H * D)), perm)
              << vars.str() << (kv ? " value" : " key") << " permutation";
        }
        GroupQuantParams gp;
        gp.bits = kv == 0 ? c.kb : c.vb;
        gp.group_size = c.group;
        gp.meta = c.meta;
        gp.clip_search = c.search;
        gp.clip_alpha = 0.94f;
        const Tensor rows = slice_rows(src, s.first_pos, s.n_rows);
        const auto gpu = gpu_records(rows, t.fmt, gp, perm, signs);
        int64_t diff = 0;
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < s.n_rows; ++i)
              diff += std::memcmp(gpu.data() + ((b * H + h) * s.n_rows + i) * t.fmt.row_stride,
                                  t.record(b, h, i), static_cast<size_t>(t.fmt.row_stride)) != 0;
        EXPECT_EQ(diff, 0) << vars.str() << (kv ? " value" : " key") << " records of chunk at "
                           << s.first_pos << " differ";
      }
    }
    EXPECT_GT(packed_segments, 0) << vars.str();
  }
}

// The device skvq cache (one packed run per cache, src/cuda/row_store_cuda.cpp) against the memory
// planner at Llama-3-8B's per-layer shapes (8 KV heads, D 128) and the CLI's defaults (window 128,
// 5 sinks, group 32): through a 2,048-token fill in 512-token calls and 199 decode steps (one more
// flush) its
// resident bytes (CacheStats::bytes_resident, device allocations) never pass the plan's per-layer
// figure and the accounted peak is the plan's, with DeviceKVCache::reserve of the context (made
// once, never grown: the resident bytes after the first flush move only with the full-precision
// store) and without (grown x1.5, the planner's growth bound).
TEST(CudaSkvq, ResidentBytesStayWithinThePlan) {
  SKIP_WITHOUT_DEVICE();
  const ModelConfig mc = test::llama3_8b_layer();
  const int64_t H = mc.n_kv_heads, D = mc.head_dim, prompt = 2048, step = 512, gen = 200;
  for (const char* bits : {"K2V2", "K4V4"})
    for (bool reserve : {true, false}) {
      const std::string what = std::string(bits) + (reserve ? " reserved" : " growing");
      CacheConfig cfg;
      cfg.method = "skvq";
      cfg.skvq_bits_key = cfg.skvq_bits_value = bits[1] == '2' ? 2 : 4;
      MemoryPlanRequest req;
      req.model = mc;
      req.cache = cfg;
      req.prompt_tokens = prompt;
      req.max_new_tokens = gen;
      req.prefill_step = step;
      req.reserve_capacity = reserve;
      const MemoryPlan plan = plan_memory(req);
      auto c = cuda::make_device_cache(cfg, 1, H, D);
      if (reserve) c->reserve(plan.context_tokens);
      int64_t done = 0, peak = 0, peak_acc = 0;
      auto feed = [&](int64_t n) {
        const Tensor k = test::random_tensor(DType::kF16, 1, H, n, D, static_cast<uint64_t>(done));
        const Tensor v = test::random_tensor(DType::kF16, 1, H, n, D, ~static_cast<uint64_t>(done));
        cuda::DeviceBuffer dk = cuda::DeviceBuffer::from_host(k.data(), k.nbytes());
        cuda::DeviceBuffer dv = cuda::DeviceBuffer::from_host(v.data(), v.nbytes());
        c->update_and_fetch(TensorView::contiguous(dk.data(), DType::kF16, 1, H, n, D),
                            TensorView::contiguous(dv.data(), DType::kF16, 1, H, n, D), {});
        cuda::synchronize();
        done += n;
        const CacheStats st = c->stats();
        const int64_t res = st.bytes_resident;
        peak = std::max(peak, res);
        peak_acc = std::max(peak_acc, st.bytes_accounted);
        ASSERT_LE(res, plan.cache_bytes_resident) << what << " after " << done << " tokens";
      };
      for (int64_t n : prefill_chunks(prompt, step)) feed(n);
      const int64_t after_prompt = c->stats().bytes_resident;
      for (int64_t i = 1; i < gen; ++i) feed(1);
      EXPECT_EQ(done, plan.context_tokens);
      EXPECT_EQ(peak_acc, plan.cache_bytes_peak) << what;
      // reserved: the packed run was not reallocated; only the small fp store moved
      if (reserve) {
        EXPECT_LE(peak - after_prompt, 2 * 256 * H * D * 2) << what;
      }
      std::printf("[plan] %s: resident peak %lld <= plan %lld (accounted %lld)\n", what.c_str(),
                  static_cast<long long>(peak), static_cast<long long>(plan.cache_bytes_resident),
                  static_cast<long long>(plan.cache_bytes_peak));
    }
}

// Per-layer key precision: the planner plans every layer at the lists' widest format (an upper
// bound, cache_bytes_exact false, src/model/memory_plan.cpp). Two layers' device caches (layer 0
// and 1 of the lists, so of other key bits and key_rows) fed the same life: their summed resident
// bytes never pass the plan's figure for the two layers, nor their summed accounted bytes its
// peak.
TEST(CudaSkvq, PerLayerListsStayWithinThePlan) {
  SKIP_WITHOUT_DEVICE();
  ModelConfig mc = test::llama3_8b_layer();
  mc.n_layers = 2;
  const int64_t H = mc.n_kv_heads, D = mc.head_dim, prompt = 1024, step = 512, gen = 140;
  for (const char* spec : {"skvq:bits_value=2:layer_bits_key=4/2",
                           "skvq:bits_value=2:key_axis=channel:layer_bits_key=2/4:"
                           "layer_key_rows=32/64",
                           "snapkv+skvq:budget=512:bits_value=2:key_axis=channel:"
                           "evict_at=prompt_end:layer_bits_key=3/2:layer_key_rows=0/16"})
    for (bool reserve : {true, false}) {
      const std::string what = std::string(spec) + (reserve ? " reserved" : " growing");
      const CacheConfig cfg = parse_cache_arg(spec);
      MemoryPlanRequest req;
      req.model = mc;
      req.cache = cfg;
      req.prompt_tokens = prompt;
      req.max_new_tokens = gen;
      req.prefill_step = step;
      req.reserve_capacity = reserve;
      const MemoryPlan plan = plan_memory(req);
      EXPECT_FALSE(plan.cache_bytes_exact) << what;
      std::vector<std::unique_ptr<cuda::DeviceKVCache>> caches;
      for (int64_t l = 0; l < mc.n_layers; ++l) {
        caches.push_back(cuda::make_device_cache(cfg, 1, H, D, nullptr, l));
        if (reserve) caches.back()->reserve(plan.context_tokens);
      }
      int64_t done = 0, peak = 0, peak_acc = 0;
      auto feed = [&](int64_t n) {
        const Tensor k = test::random_tensor(DType::kF16, 1, H, n, D, static_cast<uint64_t>(done));
        const Tensor v = test::random_tensor(DType::kF16, 1, H, n, D, ~static_cast<uint64_t>(done));
        cuda::DeviceBuffer dk = cuda::DeviceBuffer::from_host(k.data(), k.nbytes());
        cuda::DeviceBuffer dv = cuda::DeviceBuffer::from_host(v.data(), v.nbytes());
        int64_t res = 0, acc = 0;
        for (auto& c : caches) {
          c->update_and_fetch(TensorView::contiguous(dk.data(), DType::kF16, 1, H, n, D),
                              TensorView::contiguous(dv.data(), DType::kF16, 1, H, n, D), {});
          cuda::synchronize();
          res += c->stats().bytes_resident;
          acc += c->stats().bytes_accounted;
        }
        done += n;
        peak = std::max(peak, res);
        peak_acc = std::max(peak_acc, acc);
        ASSERT_LE(res, plan.cache_bytes_resident) << what << " after " << done << " tokens";
        ASSERT_LE(acc, plan.cache_bytes_peak) << what << " after " << done << " tokens";
      };
      for (int64_t n : prefill_chunks(prompt, step)) feed(n);
      for (auto& c : caches) c->end_prompt();
      for (int64_t i = 1; i < gen; ++i) feed(1);
      // the layers' formats differ: a cache that ignored its layer would match layer 0's
      EXPECT_NE(caches[0]->stats().bytes_accounted, caches[1]->stats().bytes_accounted) << what;
      std::printf("[plan] %s: resident peak %lld <= plan %lld, accounted peak %lld <= %lld\n",
                  what.c_str(), static_cast<long long>(peak),
                  static_cast<long long>(plan.cache_bytes_resident),
                  static_cast<long long>(peak_acc), static_cast<long long>(plan.cache_bytes_peak));
    }
}

TEST(CudaSkvq, RefusesMismatchedFormat) {
  SKIP_WITHOUT_DEVICE();
  const Tensor rows = test::random_tensor(DType::kF16, 1, 1, 4, 64, 1);
  cuda::DeviceBuffer d = cuda::DeviceBuffer::from_host(rows.data(), rows.nbytes());
  cuda::DeviceBuffer out(4096);
  GroupQuantParams gp;
  gp.bits = 4;
  const PackedRowFormat f = make_row_format(64, 2, 32, MetaType::kF16);
  EXPECT_THROW(cuda::skvq_quantize_rows(TensorView::contiguous(d.data(), DType::kF16, 1, 1, 4, 64),
                                        f, gp, nullptr, nullptr, 0, out.as<uint8_t>()),
               Error);
}

}  // namespace
}  // namespace vq
