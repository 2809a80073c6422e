// Cost of one decode update_and_fetch (S = 1) at contexts 1K .. 64K, B = 1, H = 8 KV heads,
// D = 128, fp16 blocks [1, 8, S, 128]. Two views of "amortised O(1)":
//   decode_step/<method>/<ctx>:  ctx tokens prefilled in one call, then each iteration appends one
//       token (and, for trimmable caches, trims it again so the context stays at ctx and no
//       growth happens inside the timed loop). Flat = the fetch never copies the context.
//   decode_from_empty/<method>/<ctx>: ctx single-token appends into a fresh cache, growth copies
//       included; reported per token (items/s). Flat = growth is amortised O(1).
// Caches are built through make_cache from a spec, so a method not in this build is skipped.
#include <benchmark/benchmark.h>

#include <memory>
#include <random>
#include <string>

#include "veloxquant/builder.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/error.h"
#include "veloxquant/tensor.h"

namespace {

constexpr int64_t kHeads = 8, kHeadDim = 128;

vq::Tensor random_block(int64_t s, uint64_t seed) {
  vq::Tensor t(vq::DType::kF16, 1, kHeads, s, kHeadDim);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto* p = static_cast<uint16_t*>(t.data());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = vq::f32_to_fp16(nd(rng));
  return t;
}

std::unique_ptr<vq::KVCache> make(benchmark::State& state, const std::string& spec) {
  try {
    return vq::make_cache(vq::config_from_spec(spec));
  } catch (const vq::Error& e) {
    state.SkipWithError(e.what());
    return nullptr;
  }
}

void decode_step(benchmark::State& state, const std::string& spec) {
  const int64_t ctx = state.range(0);
  auto cache = make(state, spec);
  if (!cache) return;
  {
    const vq::Tensor prefill = random_block(ctx, 1);
    cache->update_and_fetch(prefill.view(), prefill.view());
  }
  const vq::Tensor tok = random_block(1, 2);
  const bool trim = cache->is_trimmable();
  // Warm-up append: any growth triggered by crossing the prefill's capacity happens here.
  cache->update_and_fetch(tok.view(), tok.view());
  if (trim) cache->trim(1);
  for (auto _ : state) {
    vq::CacheView v = cache->update_and_fetch(tok.view(), tok.view());
    benchmark::DoNotOptimize(v.segments.data());
    if (trim) cache->trim(1);
  }
  state.counters["rows"] = static_cast<double>(cache->stored_rows());
}

void decode_from_empty(benchmark::State& state, const std::string& spec) {
  const int64_t ctx = state.range(0);
  const vq::Tensor tok = random_block(1, 3);
  for (auto _ : state) {
    auto cache = make(state, spec);
    if (!cache) return;
    for (int64_t t = 0; t < ctx; ++t) {
      vq::CacheView v = cache->update_and_fetch(tok.view(), tok.view());
      benchmark::DoNotOptimize(v.segments.data());
    }
    state.PauseTiming();
    cache.reset();  // freeing the buffers is not part of the appends
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * ctx);
}

void contexts(benchmark::internal::Benchmark* b) {
  b->RangeMultiplier(2)->Range(1 << 10, 1 << 16)->ArgName("ctx");
}

}  // namespace

BENCHMARK_CAPTURE(decode_step, full, std::string("full"))
    ->Apply(contexts)
    ->Unit(benchmark::kNanosecond);
BENCHMARK_CAPTURE(decode_from_empty, full, std::string("full"))
    ->Apply(contexts)
    ->Unit(benchmark::kMillisecond);

// ---- SnapKV spot -------------------------------------------------------------------------------
// SnapKV is not trimmable, so its decode_step grows the context by one token per iteration; a
// fixed iteration count bounds that growth (4096 tokens on top of ctx). The budget is at least
// the context, so the prefill keeps every row and the decode sees ctx stored rows. Skipped (with
// the builder's message) where this build has no snapkv cache.
BENCHMARK_CAPTURE(decode_step, snapkv, std::string("snapkv:budget=65536"))
    ->Apply(contexts)
    ->Iterations(4096)
    ->Unit(benchmark::kNanosecond);
BENCHMARK_CAPTURE(decode_from_empty, snapkv, std::string("snapkv:budget=512"))
    ->Apply(contexts)
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
