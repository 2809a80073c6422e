// SKVQ throughput benchmarks (B = 1, H_kv = 8, D = 128, fp16 blocks [1, 8, S, 128]):
//   flush/<threads>/<tokens>: a prefill of `tokens` rows into a fresh SKVQ cache (K2V2, group 32,
//       window 128): conversion, reordering, clip search and packing of every flushed chunk.
//       Reports tokens/s and GB/s of fp16 K+V input; threads 1 and all (OpenMP).
//   decode_attention/<method>/<ctx>: one decode step of vq::attention (H_q 32 over H_kv 8, GQA 4,
//       one query) over the view of a cache holding ctx tokens: full (fp16), SKVQ K2V2 and K4V4.
//       Reports the KV bytes the view holds and GB/s; the time ratio SKVQ / full at each ctx is
//       read off the table (see the README for the command and a run).
//   decode_ratio/<ctx>: the three at 2K, 8K, 32K, 64K timed back to back per iteration; reports
//       the minimum time of each and the SKVQ / full ratios (the robust figure on a busy machine).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/attention.h"
#include "veloxquant/builder.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/packed.h"
#include "veloxquant/tensor.h"

namespace {

constexpr int64_t kHeads = 8, kQHeads = 32, kHeadDim = 128;

// Fast deterministic N(0,1)-ish fp16 block (sum of uniforms; the benchmark needs volume, not
// exact Gaussians).
vq::Tensor random_block(int64_t s, uint64_t seed, int64_t heads = kHeads) {
  vq::Tensor t(vq::DType::kF16, 1, heads, s, kHeadDim);
  auto* p = static_cast<uint16_t*>(t.data());
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    float acc = 0;
    for (int k = 0; k < 4; ++k) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      acc += static_cast<float>(x >> 40) * 0x1p-24f;
    }
    // Heterogeneous channels: every 16th channel has 8x the spread.
    const float sc = (i % kHeadDim) % 16 == 0 ? 8.0f : 1.0f;
    p[i] = vq::f32_to_fp16((acc - 2.0f) * 1.7f * sc);
  }
  return t;
}

vq::CacheConfig skvq_cfg(double bits) {
  vq::CacheConfig c;
  c.method = "skvq";
  c.head_dim = kHeadDim;
  c.skvq_bits_key = c.skvq_bits_value = bits;
  c.skvq_group_size = 32;
  c.skvq_window = 128;
  return c;
}

void flush(benchmark::State& state) {
  const int threads = state.range(0) == 0 ? omp_get_num_procs() : static_cast<int>(state.range(0));
  const int64_t n = state.range(1);
  const vq::Tensor k = random_block(n, 1), v = random_block(n, 2);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  for (auto _ : state) {
    auto cache = vq::make_cache(skvq_cfg(2));
    vq::CacheView view = cache->update_and_fetch(k.view(), v.view());
    benchmark::DoNotOptimize(view.segments.data());
  }
  omp_set_num_threads(saved);
  state.counters["threads"] = threads;
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * kHeads * kHeadDim * 2 * 2);
}
BENCHMARK(flush)
    ->ArgsProduct({{1, 0}, {4096}})
    ->ArgNames({"threads", "tokens"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

struct Prepared {
  std::unique_ptr<vq::KVCache> cache;
  vq::CacheView view;
  int64_t kv_bytes = 0;  // bytes of K and V the view holds (codes + metadata or fp16 rows)
};

Prepared build(const std::string& method, int64_t ctx);

// One cache per (method, ctx), built once: prefill ctx - 1 tokens, then the decode call whose
// view the attention reads.
Prepared& prepared(const std::string& method, int64_t ctx) {
  static std::map<std::pair<std::string, int64_t>, Prepared> cache;
  auto key = std::make_pair(method, ctx);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  // Keep at most one context size alive (64K fp16 is 256 MiB).
  for (auto i = cache.begin(); i != cache.end();)
    i = i->first.second != ctx ? cache.erase(i) : std::next(i);
  return cache.emplace(key, build(method, ctx)).first->second;
}

Prepared build(const std::string& method, int64_t ctx) {
  Prepared p;
  vq::CacheConfig cfg;
  if (method == "full") {
    cfg.method = "full";
    cfg.head_dim = kHeadDim;
  } else {
    cfg = skvq_cfg(method == "skvq_k2v2" ? 2 : 4);
  }
  p.cache = vq::make_cache(cfg);
  {
    const vq::Tensor pre = random_block(ctx - 1, 7);
    p.cache->update_and_fetch(pre.view(), pre.view());
  }
  const vq::Tensor tok = random_block(1, 8);
  p.view = p.cache->update_and_fetch(tok.view(), tok.view());
  for (const auto& seg : p.view.segments) {
    if (seg.packed)
      p.kv_bytes += seg.n_rows * kHeads *
                    (seg.packed->keys.fmt.row_stride + seg.packed->values.fmt.row_stride);
    else
      p.kv_bytes += seg.n_rows * kHeads * kHeadDim * 2 * 2;
  }
  return p;
}

void decode_attention(benchmark::State& state, const std::string& method) {
  const int64_t ctx = state.range(0);
  Prepared& p = prepared(method, ctx);
  vq::Tensor q(vq::DType::kF32, 1, kQHeads, 1, kHeadDim);
  auto* qp = static_cast<float*>(q.data());
  for (int64_t i = 0; i < q.numel(); ++i)
    qp[i] = static_cast<float>((i * 37) % 101) / 101.0f - 0.5f;
  std::vector<float> out(static_cast<size_t>(q.numel()));
  vq::AttentionParams ap;
  ap.q_pos0 = ctx - 1;
  for (auto _ : state) {
    vq::attention(q.view(), p.view, ap, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["kv_MiB"] = static_cast<double>(p.kv_bytes) / (1 << 20);
  state.SetBytesProcessed(state.iterations() * p.kv_bytes);
}
BENCHMARK_CAPTURE(decode_attention, full, std::string("full"))
    ->RangeMultiplier(4)
    ->Range(2048, 32768)
    ->Arg(65536)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(decode_attention, skvq_k2v2, std::string("skvq_k2v2"))
    ->RangeMultiplier(4)
    ->Range(2048, 32768)
    ->Arg(65536)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(decode_attention, skvq_k4v4, std::string("skvq_k4v4"))
    ->RangeMultiplier(4)
    ->Range(2048, 32768)
    ->Arg(65536)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// The three caches at one ctx, timed back to back in every iteration (so load on a shared machine
// hits them alike); counters are the per-call minimum over iterations (robust to preemption) and
// the SKVQ / full time ratios of those minima.
void decode_ratio(benchmark::State& state) {
  const int64_t ctx = state.range(0);
  Prepared full = build("full", ctx), k2 = build("skvq_k2v2", ctx), k4 = build("skvq_k4v4", ctx);
  vq::Tensor q(vq::DType::kF32, 1, kQHeads, 1, kHeadDim);
  auto* qp = static_cast<float*>(q.data());
  for (int64_t i = 0; i < q.numel(); ++i)
    qp[i] = static_cast<float>((i * 37) % 101) / 101.0f - 0.5f;
  std::vector<float> out(static_cast<size_t>(q.numel()));
  vq::AttentionParams ap;
  ap.q_pos0 = ctx - 1;
  double best[3] = {1e30, 1e30, 1e30};
  Prepared* ps[3] = {&full, &k2, &k4};
  for (auto _ : state) {
    for (int i = 0; i < 3; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      vq::attention(q.view(), ps[i]->view, ap, out.data());
      benchmark::DoNotOptimize(out.data());
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      best[i] = std::min(best[i], us);
    }
  }
  state.counters["full_us"] = best[0];
  state.counters["k2v2_us"] = best[1];
  state.counters["k4v4_us"] = best[2];
  state.counters["k2v2/full"] = best[1] / best[0];
  state.counters["k4v4/full"] = best[2] / best[0];
}
BENCHMARK(decode_ratio)
    ->Arg(2048)
    ->Arg(8192)
    ->Arg(32768)
    ->Arg(65536)
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
