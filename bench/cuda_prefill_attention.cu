// Prefill attention and SnapKV selection benchmark on the GPU at Llama-3-8B shapes (32 query
// heads, 8 KV heads, head_dim 128), batch 1, causal prefill of N = context queries over the
// context's rows (query i sees rows 0..i), contexts 4K and 32K:
//   * f16 rows (full cache)                         -> tensor-core kernel
//   * SKVQ K2V2 g32 view (5 f16 sinks, a packed K2V2 segment, 128-row f16 tail) -> tensor cores
//   * bf16 rows (full cache)                        -> tensor cores (bf16 operands)
//   * SKVQ K2V2 g32 view with bf16 sinks and tail   -> tensor cores (bf16 operands)
// and, at 32K, the SnapKV selection exactly as bench/cuda_decode_attention.cu times it (scores +
// top-2048 + compaction of K and V by gather_rows; 4 sinks, window 32; key proxy, and real
// queries n_rep 4 x w 32) for f16 keys (tensor-core scorer) and bf16 keys (CUDA-core scorer),
// with the f16 selection alone and the score-independent top-k alone as a breakdown. Linked
// against an older library build (--tag), the same program gives the before figures.
// Keys, values and queries: hashed N(0,1)-like values filled on the device.
// Timing: warm-up, then --repeats runs timed with CUDA events, median, min and max (selection:
// 3 warm-ups, L2 evicted by a 64 MB memset before each run, as the decode benchmark does).
// Also a sanity figure: max |f16 rows - f32 rows| outputs at 4K over the same (f16-valued) rows.
// bench/cuda_prefill_sdpa.py times PyTorch SDPA on the same shapes for the ratios.
// Usage: cuda_prefill_attention [--repeats N] [--context N] [--tag NAME] [--skip-bf16]
//                               [--skip-snapkv]
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
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

// f16 values, with bf16 and f32 copies of the f16 value (the bf16 copy rounds it again).
__global__ void fill_rows(__half* h, __nv_bfloat16* bf, float* f32, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const __half x = __float2half_rn(hashed_normalish(static_cast<uint64_t>(i), seed));
    h[i] = x;
    if (bf) bf[i] = __float2bfloat16_rn(__half2float(x));
    if (f32) f32[i] = __half2float(x);
  }
}

__global__ void fill_f32(float* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = hashed_normalish(static_cast<uint64_t>(i), seed);
}

struct Timing {
  double median = 0, lo = 0, hi = 0;
};

// ms; flush: bytes memset before each timed run (0: none).
Timing time_ms(const std::function<void()>& f, int warmup, int repeats, cudaStream_t s,
               void* flush = nullptr, size_t flush_bytes = 0) {
  for (int i = 0; i < warmup; ++i) f();
  CHECK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    if (flush) CHECK(cudaMemsetAsync(flush, r & 0xff, flush_bytes, s));
    CHECK(cudaEventRecord(a, s));
    f();
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back()};
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 5;
  std::string tag = "this build";
  bool skip_bf16 = false, skip_snap = false;
  std::vector<int64_t> contexts = {4096, 32768};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--repeats") && i + 1 < argc) repeats = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--tag") && i + 1 < argc) tag = argv[++i];
    if (!std::strcmp(argv[i], "--skip-bf16")) skip_bf16 = true;
    if (!std::strcmp(argv[i], "--skip-snapkv")) skip_snap = true;
    if (!std::strcmp(argv[i], "--context") && i + 1 < argc) contexts = {std::atoll(argv[++i])};
  }
  if (!vq::cuda::is_available()) {
    std::printf("no CUDA device\n");
    return 0;
  }
  try {
    const auto info = vq::cuda::device_info();
    std::printf("device %s (cc %d.%d, %d SMs); B=1, H_q=32, H_kv=8, D=128, causal; %d repeats\n",
                info.name.c_str(), info.cc_major, info.cc_minor, info.sm_count, repeats);
    const int64_t B = 1, Hq = 32, H = 8, D = 128;
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    std::printf(
        "\n| context | prefill attention over (%s) | path in this build | median ms | min ms | max "
        "ms "
        "| TFLOP/s |\n|---|---|---|---|---|---|---|\n",
        tag.c_str());
    for (int64_t n : contexts) {
      const int64_t ne = B * H * n * D;
      vq::cuda::DeviceBuffer kh(static_cast<size_t>(ne) * 2), vh(kh.size());
      vq::cuda::DeviceBuffer kbf(kh.size()), vbf(kh.size());
      vq::cuda::DeviceBuffer qb(static_cast<size_t>(B * Hq * n * D * 4));
      vq::cuda::DeviceBuffer ob(qb.size());
      fill_rows<<<4096, 256, 0, s>>>(kh.as<__half>(), kbf.as<__nv_bfloat16>(), nullptr, ne, 1);
      fill_rows<<<4096, 256, 0, s>>>(vh.as<__half>(), vbf.as<__nv_bfloat16>(), nullptr, ne, 2);
      fill_f32<<<4096, 256, 0, s>>>(qb.as<float>(), B * Hq * n * D, 3);
      CHECK(cudaGetLastError());
      auto tv = [&](vq::cuda::DeviceBuffer& buf, vq::DType t) {
        return vq::TensorView::contiguous(buf.data(), t, B, H, n, D);
      };
      const double flops = 4.0 * D * Hq * B * (static_cast<double>(n) * (n + 1) / 2);
      vq::AttentionParams ap;  // causal, q_pos0 = 0
      auto run = [&](const char* what, const char* path, const vq::cuda::DeviceCacheView& view,
                     int reps) {
        const Timing t = time_ms(
            [&] {
              vq::cuda::prefill_attention(qb.as<float>(), Hq, n, view, ap, ob.as<float>(), s);
            },
            1, reps, s);
        std::printf("| %lld | %s | %s | %.3f | %.3f | %.3f | %.1f |\n", static_cast<long long>(n),
                    what, path, t.median, t.lo, t.hi, flops / (t.median * 1e-3) / 1e12);
        std::fflush(stdout);
      };
      vq::CacheConfig full;
      full.method = "full";
      auto f16c = vq::cuda::make_device_cache(full, B, H, D, s);
      const vq::cuda::DeviceCacheView v16 =
          f16c->update_and_fetch(tv(kh, vq::DType::kF16), tv(vh, vq::DType::kF16));
      run("f16 rows", "tensor cores", v16, repeats);
      vq::CacheConfig skvq;
      skvq.method = "skvq";  // K2V2 g32, window 128, 5 sinks, reorder + clip search, f16 meta
      auto qc = vq::cuda::make_device_cache(skvq, B, H, D, s);
      const vq::cuda::DeviceCacheView vq2 =
          qc->update_and_fetch(tv(kh, vq::DType::kF16), tv(vh, vq::DType::kF16));
      run("skvq K2V2 g32 (sinks + packed + tail)", "tensor cores", vq2, repeats);
      if (!skip_bf16) {
        auto bfc = vq::cuda::make_device_cache(full, B, H, D, s);
        const vq::cuda::DeviceCacheView vbf16 =
            bfc->update_and_fetch(tv(kbf, vq::DType::kBF16), tv(vbf, vq::DType::kBF16));
        run("bf16 rows", "tensor cores (bf16)", vbf16, repeats);
        auto qbc = vq::cuda::make_device_cache(skvq, B, H, D, s);
        const vq::cuda::DeviceCacheView vqb =
            qbc->update_and_fetch(tv(kbf, vq::DType::kBF16), tv(vbf, vq::DType::kBF16));
        run("skvq K2V2 g32 (bf16 sinks + packed + tail)", "tensor cores (bf16)", vqb, repeats);
      }
      if (n <= 4096) {  // sanity: both paths over the same f16 values (f32 rows -> CUDA cores)
        vq::cuda::DeviceBuffer k32(static_cast<size_t>(ne) * 4), v32(k32.size());
        fill_rows<<<4096, 256, 0, s>>>(kh.as<__half>(), nullptr, k32.as<float>(), ne, 1);
        fill_rows<<<4096, 256, 0, s>>>(vh.as<__half>(), nullptr, v32.as<float>(), ne, 2);
        CHECK(cudaGetLastError());
        auto c32 = vq::cuda::make_device_cache(full, B, H, D, s);
        const vq::cuda::DeviceCacheView v32v =
            c32->update_and_fetch(tv(k32, vq::DType::kF32), tv(v32, vq::DType::kF32));
        vq::cuda::DeviceBuffer o2(ob.size());
        vq::cuda::prefill_attention(qb.as<float>(), Hq, n, v16, ap, ob.as<float>(), s);
        vq::cuda::prefill_attention(qb.as<float>(), Hq, n, v32v, ap, o2.as<float>(), s);
        vq::cuda::synchronize(s);
        const auto a = ob.to_vector<float>(static_cast<size_t>(B * Hq * n * D));
        const auto b = o2.to_vector<float>(a.size());
        double worst = 0, amax = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
          amax = std::max(amax, std::abs(static_cast<double>(b[i])));
        }
        std::printf(
            "| %lld | sanity: max abs(f16 rows - f32 rows outputs), same values | %.3g "
            "(max abs out %.3g) | | | | |\n",
            static_cast<long long>(n), worst, amax);
      }
    }

    // ---- SnapKV selection at 32K, as bench/cuda_decode_attention.cu measures it
    if (!skip_snap) {
      const int64_t n = 32768, count = 2048;
      const int64_t ne = H * n * D;
      vq::cuda::DeviceBuffer kh(static_cast<size_t>(ne) * 2), vh(kh.size()), kbf(kh.size()),
          vbf(kh.size());
      fill_rows<<<4096, 256, 0, s>>>(kh.as<__half>(), kbf.as<__nv_bfloat16>(), nullptr, ne, 11);
      fill_rows<<<4096, 256, 0, s>>>(vh.as<__half>(), vbf.as<__nv_bfloat16>(), nullptr, ne, 12);
      vq::cuda::DeviceBuffer qw(static_cast<size_t>(Hq * 32 * D) * 4);
      fill_f32<<<64, 256, 0, s>>>(qw.as<float>(), Hq * 32 * D, 9);
      CHECK(cudaGetLastError());
      const size_t flush_bytes = size_t{64} << 20;
      vq::cuda::DeviceBuffer flush(flush_bytes);
      vq::cuda::DeviceBuffer idx(static_cast<size_t>(H * count) * 4);
      vq::cuda::DeviceBuffer ko(static_cast<size_t>(H * count * D) * 2), vo(ko.size());
      vq::cuda::DeviceBuffer po(static_cast<size_t>(H * count) * 4);
      vq::SnapSelectParams sp;
      sp.budget = count;
      sp.obs_window = 32;
      sp.n_sink = 4;
      vq::cuda::DecodeWorkspace scratch;
      const auto qv = vq::TensorView::contiguous(qw.data(), vq::DType::kF32, 1, Hq, 32, D);
      std::printf(
          "\n| SnapKV at 32K (%s) | keys | what | median us | min us | max us |\n"
          "|---|---|---|---|---|---|\n",
          tag.c_str());
      auto row = [&](const char* mode, const char* keys, const char* what,
                     const std::function<void()>& fn) {
        const Timing tm = time_ms(fn, 3, repeats < 10 ? 10 : repeats, s, flush.data(), flush_bytes);
        std::printf("| %s | %s | %s | %.1f | %.1f | %.1f |\n", mode, keys, what, 1000 * tm.median,
                    1000 * tm.lo, 1000 * tm.hi);
        std::fflush(stdout);
      };
      for (int dt = 0; dt < 2; ++dt) {
        const vq::DType t = dt == 0 ? vq::DType::kF16 : vq::DType::kBF16;
        vq::cuda::DeviceBuffer& kb = dt == 0 ? kh : kbf;
        vq::cuda::DeviceBuffer& vb = dt == 0 ? vh : vbf;
        const auto kv = vq::TensorView::contiguous(kb.data(), t, 1, H, n, D);
        for (int mode = 0; mode < 2; ++mode) {
          const char* mname = mode ? "real queries n_rep 4 x w 32" : "key proxy (window 32)";
          auto select = [&] {
            vq::cuda::snap_select_frames(kv, mode ? &qv : nullptr, nullptr, nullptr, sp,
                                         idx.as<int32_t>(), scratch, s);
          };
          row(mname, dt == 0 ? "f16" : "bf16", "selection (scores + top-2048 + compaction of K, V)",
              [&] {
                select();
                vq::cuda::gather_rows(kb.data(), H, n, D * 2, idx.as<int32_t>(), count, ko.data(),
                                      nullptr, 0, po.as<int32_t>(), s);
                vq::cuda::gather_rows(vb.data(), H, n, D * 2, idx.as<int32_t>(), count, vo.data(),
                                      nullptr, 0, nullptr, s);
              });
          if (dt == 0)
            row(mname, "f16", "  of which scores + top-2048 (snap_select_frames)", select);
        }
      }
      // the score-independent part: top-2048 + index compaction over given scores
      vq::cuda::DeviceBuffer sc(static_cast<size_t>(H * n) * 4);
      fill_f32<<<1024, 256, 0, s>>>(sc.as<float>(), H * n, 5);
      CHECK(cudaGetLastError());
      row("-", "-", "  top-2048 + index compaction alone (snap_select)", [&] {
        vq::cuda::snap_select(sc.as<float>(), H, n, count, sp.n_sink, -1, idx.as<int32_t>(), s);
      });
    }
    CHECK(cudaStreamDestroy(s));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
