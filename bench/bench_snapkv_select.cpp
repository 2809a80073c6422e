// SnapKV selection time: scores + selection for every KV head of one layer, as the cache runs it
// after an evicting call (OpenMP over heads). Frames of S = 2K, 8K, 32K rows, H = 8 KV heads,
// D = 128, observation window 32, budget 512, 4 sinks; key-proxy mode and query mode with
// n_rep = 4 query heads per KV head. Also the scalar double reference scorer (one head) as the
// baseline the optimised scorer is checked against.
// Counter "GFLOP/s": 2 * (window query rows) * S * D multiply-adds of the logits, all heads.
#include <benchmark/benchmark.h>

#include <omp.h>

#include <random>
#include <vector>

#include "veloxquant/snapkv.h"

namespace {

constexpr int64_t kHeads = 8, kDim = 128, kObs = 32, kBudget = 512, kSinks = 4;

std::vector<float> randn(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

void select_all_heads(benchmark::State& state, int64_t n_rep) {
  const int64_t s = state.range(0);
  const auto keys = randn(static_cast<size_t>(kHeads * s * kDim), 1);  // [H, S, D]
  const auto queries = randn(static_cast<size_t>(kHeads * (n_rep ? n_rep : 1) * kObs * kDim), 2);
  std::vector<int32_t> kpos(static_cast<size_t>(s)), qpos(kObs);
  for (int64_t j = 0; j < s; ++j) kpos[j] = static_cast<int32_t>(j);
  for (int64_t i = 0; i < kObs; ++i) qpos[i] = static_cast<int32_t>(s - kObs + i);
  vq::SnapSelectParams p;
  p.budget = kBudget;
  p.obs_window = kObs;
  p.n_sink = kSinks;
  std::vector<int64_t> out(static_cast<size_t>(kHeads * kBudget));
  for (auto _ : state) {
#pragma omp parallel
    {
      vq::SnapScratch scratch;
#pragma omp for schedule(dynamic, 1)
      for (int64_t h = 0; h < kHeads; ++h) {
        vq::SnapQueryWindow qw{queries.data() + h * n_rep * kObs * kDim, n_rep, kObs, qpos.data()};
        vq::snap_select_head(keys.data() + h * s * kDim, n_rep ? kpos.data() : nullptr, s, kDim,
                             n_rep ? &qw : nullptr, p, out.data() + h * kBudget, scratch);
      }
    }
    benchmark::DoNotOptimize(out.data());
  }
  const double flops = 2.0 * static_cast<double>(kHeads * (n_rep ? n_rep : 1) * kObs * s * kDim);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = omp_get_max_threads();
}

void BM_snapkv_select_key_proxy(benchmark::State& state) {
  select_all_heads(state, 0);
}
void BM_snapkv_select_query_nrep4(benchmark::State& state) {
  select_all_heads(state, 4);
}

// One head, scalar double reference scorer (the oracle), for scale.
void BM_snapkv_key_proxy_reference_one_head(benchmark::State& state) {
  const int64_t s = state.range(0);
  const auto keys = randn(static_cast<size_t>(s * kDim), 1);
  std::vector<float> scores(static_cast<size_t>(s));
  for (auto _ : state) {
    vq::snap_key_proxy_scores_reference(keys.data(), s, kDim, kObs, scores.data());
    benchmark::DoNotOptimize(scores.data());
  }
}

// One head, optimised scorer only (no selection), single thread.
void BM_snapkv_key_proxy_scores_one_head(benchmark::State& state) {
  const int64_t s = state.range(0);
  const auto keys = randn(static_cast<size_t>(s * kDim), 1);
  std::vector<float> scores(static_cast<size_t>(s));
  for (auto _ : state) {
    vq::snap_key_proxy_scores(keys.data(), s, kDim, kObs, scores.data());
    benchmark::DoNotOptimize(scores.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * kObs * s * kDim * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// Selection alone (threshold + pass) on one head's scores.
void BM_snapkv_select_only_one_head(benchmark::State& state) {
  const int64_t s = state.range(0);
  const auto scores = randn(static_cast<size_t>(s), 3);
  std::vector<int64_t> out(kBudget);
  std::vector<float> scratch;
  for (auto _ : state) {
    vq::snap_select(scores.data(), s, kBudget, kSinks, out.data(), &scratch);
    benchmark::DoNotOptimize(out.data());
  }
}

}  // namespace

BENCHMARK(BM_snapkv_select_key_proxy)
    ->Arg(2048)
    ->Arg(8192)
    ->Arg(32768)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_snapkv_select_query_nrep4)
    ->Arg(2048)
    ->Arg(8192)
    ->Arg(32768)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_snapkv_key_proxy_scores_one_head)
    ->Arg(2048)
    ->Arg(8192)
    ->Arg(32768)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_snapkv_key_proxy_reference_one_head)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_snapkv_select_only_one_head)
    ->Arg(2048)
    ->Arg(8192)
    ->Arg(32768)
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
