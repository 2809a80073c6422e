// Prefill attention benchmark on the GPU at Llama-3-8B shapes (32 query heads, 8 KV heads,
// head_dim 128), batch 1: a 32K-token causal prefill (N = 32768 queries over the 32768-row view
// of a full bf16 cache) with vq::cuda::prefill_attention, against what the compressed caches do
// once per prefill on the same 32K block: the whole update_and_fetch of the GPU-resident SKVQ
// cache (K2V2 g32: tail copy, chunk-0 permutations, quantizing K and V of every chunk, packing)
// and of the GPU-resident SnapKV cache (budget 2048: key-proxy scores, top-k, gather of K, V and
// positions). Each: one warm-up, then --repeats runs timed with CUDA events (median, min, max).
// Also a 4K prefill for scale. Keys, values and queries are filled on the device with N(0,1)-like
// hashed values (content does not change the work).
// bench/cuda_prefill_sdpa.py times PyTorch SDPA (tensor cores) on the same shapes.
// Usage: cuda_prefill_attention [--repeats N] [--context N]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"

#define CHECK(x)                                                           \
  do {                                                                     \
    cudaError_t e_ = (x);                                                  \
    if (e_ != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

namespace {

__device__ float hashed_normalish(uint64_t i, uint64_t seed) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  // Sum of 4 uniforms in [-0.5, 0.5): mean 0, variance 1/3; scaled to about unit variance.
  float s = 0.0f;
  for (int k = 0; k < 4; ++k) s += static_cast<float>((x >> (16 * k)) & 0xffff) / 65536.0f - 0.5f;
  return s * 1.7320508f;
}

__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16_rn(hashed_normalish(static_cast<uint64_t>(i), seed));
}

__global__ void fill_f32(float* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = hashed_normalish(static_cast<uint64_t>(i), seed);
}

struct Timing {
  double median = 0, lo = 0, hi = 0;
};

Timing time_ms(const std::function<void()>& f, int repeats, cudaStream_t s) {
  f();  // warm-up
  CHECK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    CHECK(cudaEventRecord(a, s));
    f();
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back()};
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 5;
  std::vector<int64_t> contexts = {4096, 32768};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--repeats") && i + 1 < argc) repeats = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--context") && i + 1 < argc) contexts = {std::atoll(argv[++i])};
  }
  if (!vq::cuda::is_available()) {
    std::printf("no CUDA device\n");
    return 0;
  }
  const auto info = vq::cuda::device_info();
  std::printf("device %s (cc %d.%d, %d SMs); B=1, H_q=32, H_kv=8, D=128, bf16 rows; %d repeats\n",
              info.name.c_str(), info.cc_major, info.cc_minor, info.sm_count, repeats);
  const int64_t B = 1, Hq = 32, H = 8, D = 128;
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  std::printf(
      "| context | op | median ms | min ms | max ms | vs prefill |\n|---|---|---|---|---|---|\n");
  for (int64_t n : contexts) {
    vq::cuda::DeviceBuffer kb(static_cast<size_t>(B * H * n * D * 2));
    vq::cuda::DeviceBuffer vb(kb.size());
    vq::cuda::DeviceBuffer qb(static_cast<size_t>(B * Hq * n * D * 4));
    vq::cuda::DeviceBuffer ob(qb.size());
    fill_bf16<<<4096, 256, 0, s>>>(kb.as<__nv_bfloat16>(), B * H * n * D, 1);
    fill_bf16<<<4096, 256, 0, s>>>(vb.as<__nv_bfloat16>(), B * H * n * D, 2);
    fill_f32<<<4096, 256, 0, s>>>(qb.as<float>(), B * Hq * n * D, 3);
    CHECK(cudaGetLastError());
    const vq::TensorView kv = vq::TensorView::contiguous(kb.data(), vq::DType::kBF16, B, H, n, D);
    const vq::TensorView vv = vq::TensorView::contiguous(vb.data(), vq::DType::kBF16, B, H, n, D);

    vq::CacheConfig full;
    full.method = "full";
    auto fc = vq::cuda::make_device_cache(full, B, H, D, s);
    const vq::cuda::DeviceCacheView view = fc->update_and_fetch(kv, vv);
    vq::AttentionParams ap;  // causal, q_pos0 = 0: query i sees rows 0..i
    const Timing tp = time_ms(
        [&] { vq::cuda::prefill_attention(qb.as<float>(), Hq, n, view, ap, ob.as<float>(), s); },
        repeats, s);
    // Causal: half of the n x n score matrix, per query head: 2 flops (q.k) + 2 (p.v) per D.
    const double flops = 4.0 * D * Hq * B * (static_cast<double>(n) * (n + 1) / 2);
    std::printf(
        "| %lld | prefill attention (causal, fp32 CUDA cores) | %.3f | %.3f | %.3f | 1 "
        "| (%.1f TFLOP/s)\n",
        static_cast<long long>(n), tp.median, tp.lo, tp.hi, flops / (tp.median * 1e-3) / 1e12);

    vq::CacheConfig skvq;
    skvq.method = "skvq";  // K2V2 g32, window 128, 5 sinks, reorder + clip search, fp16 meta
    const Timing tq = time_ms(
        [&] {
          auto c = vq::cuda::make_device_cache(skvq, B, H, D, s);
          c->update_and_fetch(kv, vv);
          vq::cuda::synchronize(s);
        },
        repeats, s);
    std::printf(
        "| %lld | skvq K2V2 g32 cache update (flush of every chunk) | %.3f | %.3f | %.3f "
        "| %.2f%% |\n",
        static_cast<long long>(n), tq.median, tq.lo, tq.hi, 100 * tq.median / tp.median);

    vq::CacheConfig snap;
    snap.method = "snapkv";
    snap.snap_budget = 2048;
    const Timing ts = time_ms(
        [&] {
          auto c = vq::cuda::make_device_cache(snap, B, H, D, s);
          c->update_and_fetch(kv, vv);
          vq::cuda::synchronize(s);
        },
        repeats, s);
    std::printf(
        "| %lld | snapkv budget 2048 cache update (selection + gather) | %.3f | %.3f | "
        "%.3f | %.2f%% |\n",
        static_cast<long long>(n), ts.median, ts.lo, ts.hi, 100 * ts.median / tp.median);
  }
  CHECK(cudaStreamDestroy(s));
  return 0;
}
