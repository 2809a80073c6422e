// Decode-attention benchmark on the GPU at Llama-3-8B shapes (32 query heads, 8 KV heads,
// head_dim 128), batch 1 and 8, context 4K / 32K / 128K, for every cache layout:
//   fp16 full                       one f16 segment
//   skvq K2V2 g32 / K2V2 g128 / K4V4 g32 / K3V3 g32 / K1.5V2 g32 (the last two: the CUDA-core
//                                   kernel's any-bits instance)
//                                   5 f16 sinks + packed rows (real codes from the GPU flush,
//                                   channel permutations) + a 64-row f16 tail
//   snapkv budget 2048              2048 f16 rows with explicit per-head positions
//   snapkv+skvq (K2V2 g32)          2048 packed rows with explicit positions
//   bf16 full, skvq K2V2 g32 / K4V4 g32 with bf16 sinks and tail
//                                   the same rows read as bf16 (a bf16 model's caches: the
//                                   bf16-row tensor-core instances; timing only, same bytes)
// Each configuration: warm-up, then repeats timed with CUDA events, the L2 flushed before every
// repeat (--flush read, the default: a kernel reads a 256 MiB buffer, so L2 holds clean lines of
// it, as after a decode step's projections, which read weights; --flush write: a 256 MiB memset,
// the protocol before session 19, which leaves L2 full of dirty lines that the timed kernel must
// write back as it reads); median and p10-p90 spread; bytes read (rows, metadata, positions,
// q and out); achieved TB/s and % of the device-to-device copy bandwidth measured in this run.
// Also: the SKVQ flush of a 32K prefill (chunk-0 permutations + quantizing K and V) and a SnapKV
// selection at 32K (key-proxy scores, top-k, compaction of K and V to 2048 rows).
// Prints Markdown tables and writes CSV (--csv PATH) for tools/bench_sdpa.py, which adds PyTorch
// SDPA over a bf16 cache of the same shapes and prints the combined table.
// Decode is planned once per configuration (decode_attention_plan, the planner's knobs from the
// command line) and the timed repeats run the plan (decode_attention_run), as a model's decode
// step plans once and runs every layer; the kernel a plan chose is printed beside each row.
// Usage: cuda_decode_attention [--csv out.csv] [--repeats N] [--quick] [--only METHOD]
//                              [--batch B] [--context N] [--no-maintenance] [--hq 32|128]
//                              [--flush read|write]
//                              [--target-blocks N] [--packed-stage-bytes N] (planner knobs,
//                              DecodePlanOptions; 0 = automatic)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "veloxquant/cuda.h"
#include "veloxquant/group_quant.h"

namespace {

using vq::cuda::DeviceBuffer;
using vq::cuda::DeviceCacheView;
using vq::cuda::DeviceSegment;

#define CHECK(call)                                                               \
  do {                                                                            \
    const cudaError_t e_ = (call);                                                \
    if (e_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #call, __FILE__, __LINE__, \
                   cudaGetErrorString(e_));                                       \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

constexpr int kHkv = 8, kD = 128;
int g_hq = 32;  // query heads (--hq): 32 (GQA 4, Llama-3-8B) or 128 (GQA 16, issue 14's shape)
constexpr int64_t kMaxCtx = 131072;
constexpr int kMaxB = 8;

__device__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Values ~ uniform(-2, 2) with every 16th channel x8 (outlier channels), as f16.
__global__ void fill_half_kernel(__half* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(hash32(seed * 0x9E3779B97F4A7C15ull + i)) * 0x1p-32f;
    const float s = (i % kD) % 16 == 5 ? 8.0f : 1.0f;
    p[i] = __float2half((4.0f * u - 2.0f) * s);
  }
}

__global__ void fill_float_kernel(float* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = static_cast<float>(hash32(seed * 0x9E3779B97F4A7C15ull + i)) * 0x1p-31f - 1.0f;
}

// Ascending positions of `count` kept rows out of ctx per (b, h): one per stride ctx / count.
__global__ void fill_positions_kernel(int32_t* pos, int64_t capacity, int64_t count, int64_t ctx,
                                      int64_t n_bh) {
  const int64_t stride = ctx / count;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n_bh * count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t bh = i / count, j = i % count;
    const int64_t off = j == 0 ? 0 : hash32(i) % stride;
    pos[bh * capacity + j] = static_cast<int32_t>(j * stride + off);
  }
}

struct Stats {
  double median_us = 0, p10_us = 0, p90_us = 0;
};

bool g_flush_write = false;  // --flush write: the memset flush (see the header)

// Reads n 16-byte words (a sum per block, kept so the loads stay): evicts L2 with clean lines.
__global__ void read_flush_kernel(const uint4* p, int64_t n, uint32_t* sink) {
  uint32_t x = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9E3779B9u) sink[blockIdx.x] = x;  // almost never true; the loads cannot be dropped
}

void flush_l2(void* flush, size_t flush_bytes, int i, cudaStream_t s) {
  if (g_flush_write) {
    CHECK(cudaMemsetAsync(flush, i & 0xff, flush_bytes, s));
  } else {
    // the buffer's last 4 KiB are the sink (never read back)
    const int64_t n = static_cast<int64_t>((flush_bytes - 4096) / 16);
    read_flush_kernel<<<1024, 256, 0, s>>>(
        static_cast<const uint4*>(flush), n,
        reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(flush) + flush_bytes - 4096));
    CHECK(cudaGetLastError());
  }
}

Stats time_it(const std::function<void()>& fn, cudaStream_t s, void* flush, size_t flush_bytes,
              int warmup, int repeats) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    flush_l2(flush, flush_bytes, i, s);  // evict L2 (60 MB)
    CHECK(cudaEventRecord(a, s));
    fn();
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(1000.0 * ms);
  }
  CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  Stats st;
  st.median_us = t[t.size() / 2];
  st.p10_us = t[t.size() / 10];
  st.p90_us = t[(t.size() * 9) / 10];
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return st;
}

void fill_half(void* p, int64_t n, uint64_t seed, cudaStream_t s) {
  fill_half_kernel<<<2048, 256, 0, s>>>(static_cast<__half*>(p), n, seed);
  CHECK(cudaGetLastError());
}

struct PackedFmt {
  const char* name;
  double bits_k, bits_v;
  int64_t group;
};

}  // namespace

int main(int argc, char** argv) {
  std::string csv_path = "cuda_decode_attention.csv";
  int repeats = 30;
  bool quick = false;
  std::string only;                  // --only METHOD: decode configurations of that method only
  int64_t only_b = 0, only_ctx = 0;  // --batch / --context filters (0 = all)
  bool no_maint = false;
  vq::cuda::DecodePlanOptions plan_opt;  // --target-blocks / --packed-stage-bytes
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--csv" && i + 1 < argc) csv_path = argv[++i];
    if (a == "--repeats" && i + 1 < argc) repeats = std::atoi(argv[++i]);
    if (a == "--quick") quick = true;
    if (a == "--only" && i + 1 < argc) only = argv[++i];
    if (a == "--batch" && i + 1 < argc) only_b = std::atoll(argv[++i]);
    if (a == "--context" && i + 1 < argc) only_ctx = std::atoll(argv[++i]);
    if (a == "--no-maintenance") no_maint = true;
    if (a == "--hq" && i + 1 < argc) g_hq = std::atoi(argv[++i]);
    if (a == "--flush" && i + 1 < argc) {
      const std::string m = argv[++i];
      if (m != "read" && m != "write") {
        std::fprintf(stderr, "--flush: expected read or write but got %s\n", m.c_str());
        return 2;
      }
      g_flush_write = m == "write";
    }
    if (a == "--target-blocks" && i + 1 < argc) plan_opt.target_blocks = std::atoll(argv[++i]);
    if (a == "--packed-stage-bytes" && i + 1 < argc)
      plan_opt.packed_stage_bytes = std::atoll(argv[++i]);
  }
  if (!vq::cuda::is_available()) {
    std::printf("no CUDA device: nothing to benchmark\n");
    return 0;
  }
  try {
    const auto info = vq::cuda::device_info();
    std::printf("device: %s (cc %d.%d, %d SMs, L2 %.0f MB, %.1f GB)\n", info.name.c_str(),
                info.cc_major, info.cc_minor, info.sm_count, info.l2_bytes / 1e6,
                info.global_bytes / 1e9);
    std::printf("L2 flush before each repeat: %s\n",
                g_flush_write ? "write (256 MiB memset)" : "read (256 MiB read, clean lines)");
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const size_t flush_bytes = size_t{256} << 20;
    DeviceBuffer flush(flush_bytes);
    FILE* csv = std::fopen(csv_path.c_str(), "w");
    if (!csv) {
      std::fprintf(stderr, "cannot write %s\n", csv_path.c_str());
      return 1;
    }
    std::fprintf(csv,
                 "kind,batch,context,method,rows,bytes,median_us,p10_us,p90_us,tbps,pct_copy\n");

    // ---- copy bandwidth (bytes read + bytes written)
    double copy_tbps = 0;
    {
      const size_t n = size_t{2} << 30;
      DeviceBuffer a(n), b(n);
      CHECK(cudaMemsetAsync(a.data(), 1, n, s));
      const Stats st = time_it(
          [&] { CHECK(cudaMemcpyAsync(b.data(), a.data(), n, cudaMemcpyDeviceToDevice, s)); }, s,
          flush.data(), flush_bytes, 3, 10);
      copy_tbps = 2.0 * n / (st.median_us * 1e-6) / 1e12;
      std::printf("device-to-device copy: %.0f us for 2 x %.2f GB -> %.2f TB/s\n\n", st.median_us,
                  n / 1e9, copy_tbps);
      std::fprintf(csv, "copy,0,0,cudaMemcpy D2D,0,%zu,%.3f,%.3f,%.3f,%.4f,100\n", 2 * n,
                   st.median_us, st.p10_us, st.p90_us, copy_tbps);
    }

    // ---- data: f16 rows [8, 8, 128K, 128] for K and V, packed copies, snapkv positions
    const int64_t n_bh_max = int64_t{kMaxB} * kHkv;
    const int64_t n_elem = n_bh_max * kMaxCtx * kD;
    DeviceBuffer k16(static_cast<size_t>(n_elem) * 2), v16(static_cast<size_t>(n_elem) * 2);
    fill_half(k16.data(), n_elem, 1, s);
    fill_half(v16.data(), n_elem, 2, s);
    std::vector<int32_t> perm_h(static_cast<size_t>(kHkv * kD));
    std::mt19937_64 rng(42);
    for (int h = 0; h < kHkv; ++h) {
      std::iota(perm_h.begin() + h * kD, perm_h.begin() + (h + 1) * kD, 0);
      std::shuffle(perm_h.begin() + h * kD, perm_h.begin() + (h + 1) * kD, rng);
    }
    DeviceBuffer perm = DeviceBuffer::from_vector(perm_h, s);
    const std::vector<PackedFmt> fmts = {{"skvq K2V2 g32", 2, 2, 32},
                                         {"skvq K2V2 g128", 2, 2, 128},
                                         {"skvq K4V4 g32", 4, 4, 32},
                                         {"skvq K3V3 g32", 3, 3, 32},
                                         {"skvq K1.5V2 g32", 1.5, 2, 32}};
    struct PackedData {
      vq::PackedRowFormat fk, fv;
      DeviceBuffer k, v;
    };
    std::vector<PackedData> packed(fmts.size());
    const vq::TensorView kview =
        vq::TensorView::contiguous(k16.data(), vq::DType::kF16, kMaxB, kHkv, kMaxCtx, kD);
    const vq::TensorView vview =
        vq::TensorView::contiguous(v16.data(), vq::DType::kF16, kMaxB, kHkv, kMaxCtx, kD);
    for (size_t f = 0; f < fmts.size(); ++f) {
      PackedData& pd = packed[f];
      pd.fk = vq::make_row_format(kD, fmts[f].bits_k, fmts[f].group, vq::MetaType::kF16);
      pd.fv = vq::make_row_format(kD, fmts[f].bits_v, fmts[f].group, vq::MetaType::kF16);
      pd.k = DeviceBuffer(static_cast<size_t>(n_bh_max * kMaxCtx * pd.fk.row_stride));
      pd.v = DeviceBuffer(static_cast<size_t>(n_bh_max * kMaxCtx * pd.fv.row_stride));
      vq::GroupQuantParams gk, gv;
      gk.bits = fmts[f].bits_k;
      gv.bits = fmts[f].bits_v;
      gk.group_size = gv.group_size = fmts[f].group;
      vq::cuda::skvq_quantize_rows(kview, pd.fk, gk, perm.as<int32_t>(), nullptr, 0,
                                   pd.k.as<uint8_t>(), s);
      vq::cuda::skvq_quantize_rows(vview, pd.fv, gv, perm.as<int32_t>(), nullptr, 0,
                                   pd.v.as<uint8_t>(), s);
    }
    DeviceBuffer pos(static_cast<size_t>(n_bh_max * kMaxCtx) * 4);
    CHECK(cudaStreamSynchronize(s));

    std::printf("## Decode attention (H_q %d, H_kv 8, D 128)\n\n", g_hq);
    std::printf(
        "| batch | context | method | rows/head | MB read | median us | p10-p90 us | "
        "TB/s | %% of copy BW | kernel, splits |\n|---|---|---|---|---|---|---|---|---|---|\n");
    vq::cuda::DecodeWorkspace ws;
    const vq::cuda::DecodeContext& dctx = ws.context();
    DeviceBuffer q(static_cast<size_t>(kMaxB * g_hq * kD) * 4),
        out(static_cast<size_t>(kMaxB * g_hq * kD) * 4);
    fill_float_kernel<<<64, 256, 0, s>>>(q.as<float>(), kMaxB * g_hq * kD, 7);
    CHECK(cudaGetLastError());
    const std::vector<int64_t> ctxs =
        quick ? std::vector<int64_t>{4096, 32768} : std::vector<int64_t>{4096, 32768, 131072};
    for (int64_t B : {1, 8})
      for (int64_t ctx : ctxs) {
        if ((only_b && B != only_b) || (only_ctx && ctx != only_ctx)) continue;
        const int64_t budget = 2048;
        fill_positions_kernel<<<1024, 256, 0, s>>>(pos.as<int32_t>(), kMaxCtx, budget, ctx,
                                                   B * kHkv);
        CHECK(cudaGetLastError());
        struct Method {
          std::string name;
          DeviceCacheView view;
        };
        std::vector<Method> methods;
        auto fp_seg = [&](int64_t first, int64_t n, vq::DType t = vq::DType::kF16) {
          DeviceSegment sg;
          sg.n_rows = n;
          sg.capacity = kMaxCtx;
          sg.first_pos = first;
          sg.dtype = t;  // bf16: the f16 fill's bits read as bf16 (finite: timing only)
          sg.keys = static_cast<const char*>(k16.data()) + first * kD * 2;
          sg.values = static_cast<const char*>(v16.data()) + first * kD * 2;
          return sg;
        };
        auto packed_seg = [&](const PackedData& pd, int64_t first, int64_t n) {
          DeviceSegment sg;
          sg.packed = true;
          sg.n_rows = n;
          sg.capacity = kMaxCtx;
          sg.first_pos = first;
          sg.k_fmt = pd.fk;
          sg.v_fmt = pd.fv;
          sg.k_data = pd.k.as<uint8_t>() + first * pd.fk.row_stride;
          sg.v_data = pd.v.as<uint8_t>() + first * pd.fv.row_stride;
          sg.k_perm = perm.as<int32_t>();
          sg.v_perm = perm.as<int32_t>();
          return sg;
        };
        {
          DeviceCacheView v(B, kHkv, kD);
          v.add_segment(fp_seg(0, ctx));
          methods.push_back({"fp16 full", std::move(v)});
        }
        for (size_t f = 0; f < fmts.size(); ++f) {
          DeviceCacheView v(B, kHkv, kD);
          v.add_segment(fp_seg(0, 5));                            // sinks
          v.add_segment(packed_seg(packed[f], 5, ctx - 5 - 64));  // flushed chunks
          v.add_segment(fp_seg(ctx - 64, 64));                    // unflushed tail
          methods.push_back({fmts[f].name, std::move(v)});
        }
        {
          DeviceCacheView v(B, kHkv, kD);
          DeviceSegment sg = fp_seg(0, budget);
          sg.positions = pos.as<int32_t>();
          v.add_segment(sg);
          methods.push_back({"snapkv b2048", std::move(v)});
        }
        {
          DeviceCacheView v(B, kHkv, kD);
          DeviceSegment sg = packed_seg(packed[0], 0, budget);
          sg.positions = pos.as<int32_t>();
          v.add_segment(sg);
          methods.push_back({"snapkv+skvq b2048 K2V2 g32", std::move(v)});
        }
        {
          DeviceCacheView v(B, kHkv, kD);
          v.add_segment(fp_seg(0, ctx, vq::DType::kBF16));
          methods.push_back({"bf16 full", std::move(v)});
        }
        for (size_t f : {size_t{0}, size_t{2}}) {  // K2V2 g32, K4V4 g32 beside bf16 rows
          DeviceCacheView v(B, kHkv, kD);
          v.add_segment(fp_seg(0, 5, vq::DType::kBF16));
          v.add_segment(packed_seg(packed[f], 5, ctx - 5 - 64));
          v.add_segment(fp_seg(ctx - 64, 64, vq::DType::kBF16));
          methods.push_back({std::string(fmts[f].name) + " bf16 rows", std::move(v)});
        }
        vq::AttentionParams ap;
        ap.q_pos0 = ctx;
        for (Method& m : methods) {
          if (!only.empty() && m.name != only) continue;
          vq::cuda::DecodePlan plan;
          try {
            plan = vq::cuda::decode_attention_plan(dctx, g_hq, m.view, ap, plan_opt);
          } catch (const std::exception& e) {  // e.g. GQA 16 over a view of the CUDA-core kernel
            std::printf("| %lld | %lld | %s | refused: %s |\n", static_cast<long long>(B),
                        static_cast<long long>(ctx), m.name.c_str(), e.what());
            continue;
          }
          const Stats st = time_it(
              [&] {
                vq::cuda::decode_attention_run(plan, q.as<float>(), m.view, out.as<float>(), ws, s);
              },
              s, flush.data(), flush_bytes, 5, repeats);
          const double bytes = static_cast<double>(m.view.bytes()) + 2.0 * B * g_hq * kD * 4;
          const double tbps = bytes / (st.median_us * 1e-6) / 1e12;
          std::printf(
              "| %lld | %lld | %s | %lld | %.1f | %.1f | %.1f-%.1f | %.2f | %.0f%% | %s %d |\n",
              static_cast<long long>(B), static_cast<long long>(ctx), m.name.c_str(),
              static_cast<long long>(m.view.n_rows()), bytes / 1e6, st.median_us, st.p10_us,
              st.p90_us, tbps, 100 * tbps / copy_tbps, vq::cuda::decode_kernel_name(plan.kernel),
              static_cast<int>(plan.n_splits));
          std::fprintf(csv, "decode,%lld,%lld,%s,%lld,%.0f,%.3f,%.3f,%.3f,%.4f,%.1f\n",
                       static_cast<long long>(B), static_cast<long long>(ctx), m.name.c_str(),
                       static_cast<long long>(m.view.n_rows()), bytes, st.median_us, st.p10_us,
                       st.p90_us, tbps, 100 * tbps / copy_tbps);
          std::fflush(stdout);
        }
      }

    // ---- SKVQ flush and SnapKV selection of a 32K prefill (B = 1)
    if (!no_maint) {
      const int64_t n = 32768, count = 2048;
      const int64_t ne = int64_t{kHkv} * n * kD;
      DeviceBuffer kp(static_cast<size_t>(ne) * 2), vp(static_cast<size_t>(ne) * 2);
      fill_half(kp.data(), ne, 11, s);
      fill_half(vp.data(), ne, 12, s);
      DeviceBuffer chunk0(static_cast<size_t>(kHkv * 128 * kD) * 2);
      for (int h = 0; h < kHkv; ++h)
        CHECK(cudaMemcpyAsync(static_cast<char*>(chunk0.data()) + h * 128 * kD * 2,
                              static_cast<const char*>(kp.data()) + h * n * kD * 2, 128 * kD * 2,
                              cudaMemcpyDeviceToDevice, s));
      const auto fk = vq::make_row_format(kD, 2, 32, vq::MetaType::kF16);
      DeviceBuffer rk(static_cast<size_t>(kHkv * n * fk.row_stride)),
          rv(static_cast<size_t>(kHkv * n * fk.row_stride));
      DeviceBuffer pk(kHkv * kD * 4), pv(kHkv * kD * 4);
      vq::GroupQuantParams gp;
      gp.bits = 2;
      gp.group_size = 32;
      const auto kv = vq::TensorView::contiguous(kp.data(), vq::DType::kF16, 1, kHkv, n, kD);
      const auto vv = vq::TensorView::contiguous(vp.data(), vq::DType::kF16, 1, kHkv, n, kD);
      const auto c0 = vq::TensorView::contiguous(chunk0.data(), vq::DType::kF16, 1, kHkv, 128, kD);
      const Stats fl = time_it(
          [&] {
            vq::cuda::skvq_channel_perms(c0, pk.as<int32_t>(), s);
            vq::cuda::skvq_channel_perms(c0, pv.as<int32_t>(), s);
            vq::cuda::skvq_quantize_rows(kv, fk, gp, pk.as<int32_t>(), nullptr, 0, rk.as<uint8_t>(),
                                         s);
            vq::cuda::skvq_quantize_rows(vv, fk, gp, pv.as<int32_t>(), nullptr, 0, rv.as<uint8_t>(),
                                         s);
          },
          s, flush.data(), flush_bytes, 3, repeats);
      DeviceBuffer idx(static_cast<size_t>(kHkv * count) * 4);
      DeviceBuffer ko(static_cast<size_t>(kHkv * count * kD) * 2),
          vo(static_cast<size_t>(kHkv * count * kD) * 2);
      DeviceBuffer po(static_cast<size_t>(kHkv * count) * 4);
      vq::SnapSelectParams sp;
      sp.budget = count;
      sp.obs_window = 32;
      sp.n_sink = 4;
      vq::cuda::DecodeWorkspace scratch;
      const Stats se = time_it(
          [&] {
            vq::cuda::snap_select_frames(kv, nullptr, nullptr, nullptr, sp, idx.as<int32_t>(),
                                         scratch, s);
            vq::cuda::gather_rows(kp.data(), kHkv, n, kD * 2, idx.as<int32_t>(), count, ko.data(),
                                  nullptr, 0, po.as<int32_t>(), s);
            vq::cuda::gather_rows(vp.data(), kHkv, n, kD * 2, idx.as<int32_t>(), count, vo.data(),
                                  nullptr, 0, nullptr, s);
          },
          s, flush.data(), flush_bytes, 3, repeats);
      // query scoring: the window's 32 queries of the 4 query heads per KV head
      DeviceBuffer qw(static_cast<size_t>(g_hq * 32 * kD) * 4);
      fill_float_kernel<<<64, 256, 0, s>>>(qw.as<float>(), g_hq * 32 * kD, 9);
      CHECK(cudaGetLastError());
      const auto qv = vq::TensorView::contiguous(qw.data(), vq::DType::kF32, 1, g_hq, 32, kD);
      const Stats sq = time_it(
          [&] {
            vq::cuda::snap_select_frames(kv, &qv, nullptr, nullptr, sp, idx.as<int32_t>(), scratch,
                                         s);
            vq::cuda::gather_rows(kp.data(), kHkv, n, kD * 2, idx.as<int32_t>(), count, ko.data(),
                                  nullptr, 0, po.as<int32_t>(), s);
            vq::cuda::gather_rows(vp.data(), kHkv, n, kD * 2, idx.as<int32_t>(), count, vo.data(),
                                  nullptr, 0, nullptr, s);
          },
          s, flush.data(), flush_bytes, 3, repeats);
      std::printf("\n## Cache maintenance of a 32K prefill (B 1, H_kv 8, D 128)\n\n");
      std::printf("| operation | median us | p10-p90 us |\n|---|---|---|\n");
      std::printf(
          "| SKVQ flush (perms + K2V2 g32 quantize of K and V, 32K rows) | %.1f | %.1f-%.1f |\n",
          fl.median_us, fl.p10_us, fl.p90_us);
      std::printf(
          "| SnapKV selection, key proxy (scores + top-2048 + compaction) | %.1f | %.1f-%.1f |\n",
          se.median_us, se.p10_us, se.p90_us);
      std::printf("| SnapKV selection, real queries n_rep 4 x w 32 | %.1f | %.1f-%.1f |\n",
                  sq.median_us, sq.p10_us, sq.p90_us);
      std::fprintf(csv, "maint,1,32768,skvq flush,%lld,0,%.3f,%.3f,%.3f,0,0\n",
                   static_cast<long long>(n), fl.median_us, fl.p10_us, fl.p90_us);
      std::fprintf(csv, "maint,1,32768,snapkv select key-proxy,%lld,0,%.3f,%.3f,%.3f,0,0\n",
                   static_cast<long long>(n), se.median_us, se.p10_us, se.p90_us);
      std::fprintf(csv, "maint,1,32768,snapkv select query,%lld,0,%.3f,%.3f,%.3f,0,0\n",
                   static_cast<long long>(n), sq.median_us, sq.p10_us, sq.p90_us);
    }
    std::fclose(csv);
    CHECK(cudaStreamDestroy(s));
    std::printf("\nCSV: %s\n", csv_path.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
