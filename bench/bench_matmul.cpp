// Matrix products of the forward pass: our kernel (bf16 weights read in place, see
// src/ops/kernels.h) against OpenBLAS on the same problem, at the shipped model's shapes
// (hidden 384, intermediate 1024, vocab 8192) and Llama-3.2-1B's (hidden 2048, intermediate
// 8192), for decode (1 token) and prefill (128 and 512 tokens).
//
// OpenBLAS has no bf16 GEMM in Debian's build, so its variant converts the weights to fp32 in
// tiles of 256 rows and calls cblas_sgemm per tile ("convert+sgemm", what using BLAS for bf16
// weights costs), and a "sgemm (fp32 weights)" variant gives BLAS fp32 weights converted once
// beforehand (twice the memory; its ideal case). Bytes/s counts the bf16 weight bytes.
// BM_ours_bf16_dot is the opt-in bf16 mode (Precision::kBF16: activations rounded to bf16,
// vdpbf16ps where the CPU has avx512_bf16, else the portable path; see kernels.h).
// Run with OMP_NUM_THREADS and OPENBLAS_NUM_THREADS equal (1 or 2).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <random>
#include <vector>

#include "ops/kernels.h"
#include "veloxquant/dtype.h"

namespace {

struct Problem {
  int64_t t, k, n;
  std::vector<float> x, y, wf;
  std::vector<uint16_t> w;
  Problem(int64_t t_, int64_t k_, int64_t n_) : t(t_), k(k_), n(n_) {
    std::mt19937_64 rng(1);
    std::normal_distribution<float> d(0, 1);
    x.resize(static_cast<size_t>(t * k));
    y.resize(static_cast<size_t>(t * n));
    wf.resize(static_cast<size_t>(n * k));
    for (float& v : x) v = d(rng);
    for (float& v : wf) v = d(rng) * 0.05f;
    w.resize(wf.size());
    vq::from_f32(wf.data(), w.data(), vq::DType::kBF16, wf.size());
    vq::to_f32(w.data(), vq::DType::kBF16, wf.data(), wf.size());
  }
};

void set_counters(benchmark::State& st, const Problem& p) {
  st.counters["weight_bytes/s"] = benchmark::Counter(static_cast<double>(p.n * p.k * 2),
                                                     benchmark::Counter::kIsIterationInvariantRate);
  st.counters["GFLOP/s"] = benchmark::Counter(static_cast<double>(2 * p.t * p.k * p.n) * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

void BM_ours_bf16(benchmark::State& st) {
  Problem p(st.range(0), st.range(1), st.range(2));
  for (auto _ : st) {
    vq::kernels::matmul(p.x.data(), p.t, p.k, p.k, p.w.data(), vq::DType::kBF16, p.n, nullptr,
                        p.y.data(), p.n);
    benchmark::DoNotOptimize(p.y.data());
  }
  set_counters(st, p);
}

void BM_ours_bf16_dot(benchmark::State& st) {
  Problem p(st.range(0), st.range(1), st.range(2));
  st.SetLabel(vq::kernels::bf16_dot_active() ? "vdpbf16ps" : "portable");
  for (auto _ : st) {
    vq::kernels::matmul(p.x.data(), p.t, p.k, p.k, p.w.data(), vq::DType::kBF16, p.n, nullptr,
                        p.y.data(), p.n, vq::kernels::Precision::kBF16);
    benchmark::DoNotOptimize(p.y.data());
  }
  set_counters(st, p);
}

void BM_openblas_convert_sgemm(benchmark::State& st) {
  Problem p(st.range(0), st.range(1), st.range(2));
  const int64_t tile = 256;
  std::vector<float> wt(static_cast<size_t>(tile * p.k));
  for (auto _ : st) {
    for (int64_t n0 = 0; n0 < p.n; n0 += tile) {
      const int64_t rows = std::min(tile, p.n - n0);
      vq::to_f32(p.w.data() + n0 * p.k, vq::DType::kBF16, wt.data(),
                 static_cast<size_t>(rows * p.k));
      // Y[:, n0:n0+rows] = X . Wtile^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(p.t),
                  static_cast<int>(rows), static_cast<int>(p.k), 1.0f, p.x.data(),
                  static_cast<int>(p.k), wt.data(), static_cast<int>(p.k), 0.0f, p.y.data() + n0,
                  static_cast<int>(p.n));
    }
    benchmark::DoNotOptimize(p.y.data());
  }
  set_counters(st, p);
}

void BM_openblas_sgemm_f32_weights(benchmark::State& st) {
  Problem p(st.range(0), st.range(1), st.range(2));
  for (auto _ : st) {
    if (p.t == 1) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(p.n), static_cast<int>(p.k), 1.0f,
                  p.wf.data(), static_cast<int>(p.k), p.x.data(), 1, 0.0f, p.y.data(), 1);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(p.t),
                  static_cast<int>(p.n), static_cast<int>(p.k), 1.0f, p.x.data(),
                  static_cast<int>(p.k), p.wf.data(), static_cast<int>(p.k), 0.0f, p.y.data(),
                  static_cast<int>(p.n));
    }
    benchmark::DoNotOptimize(p.y.data());
  }
  set_counters(st, p);
}

void shapes(benchmark::internal::Benchmark* b) {
  for (int64_t t : {1, 128, 512}) {
    b->Args({t, 384, 1024});   // mini gate/up
    b->Args({t, 384, 8192});   // mini lm_head
    b->Args({t, 2048, 8192});  // 1B gate/up
  }
  b->ArgNames({"tokens", "K", "N"});
  b->Unit(benchmark::kMicrosecond);
  b->UseRealTime();
}

BENCHMARK(BM_ours_bf16)->Apply(shapes);
BENCHMARK(BM_ours_bf16_dot)->Apply(shapes);
BENCHMARK(BM_openblas_convert_sgemm)->Apply(shapes);
BENCHMARK(BM_openblas_sgemm_f32_weights)->Apply(shapes);

}  // namespace

BENCHMARK_MAIN();
