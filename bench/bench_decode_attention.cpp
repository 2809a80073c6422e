// Decode-attention micro-benchmark: one query token (H_q = H_kv * rep heads) against a cache view
// of n rows held as fp16 rows, K4V4 or K2V2 packed records (group 32, fp16 metadata), n from 2K
// to 32K, at 1 and 2 threads. Reports the best and median time per call over repeats, the bytes
// the call must read (keys + values + metadata of the view) and that as GB/s beside the measured
// read bandwidth of this machine at the same thread count (best of 7 sums over a 1 GiB buffer).
// Packed rows are random codes and metadata (speed does not depend on the values).
//
//   bench_decode_attention [--contexts 2048,8192,32768] [--shape 8,128,4] [--repeats 30]
//                          [--threads 1,2] [--paths] [--segment-rows N] [--isa NAME]
//                          [--flush]
//                          (--paths: also each packed decode instruction set,
//                          src/ops/packed_decode.h, where this build has them; --isa: the packed
//                          rows' default path by isa_name, e.g. avx512vnni for the fp32 values
//                          where avx512bf16 is the default, capped to this CPU's)
//
// --segment-rows N (default 0: one segment): the packed rows as segments of N rows, each its own
// allocation, as the CPU SKVQ store holds them (one segment per flushed chunk, skvq_window = 128
// rows by default), so the cost of walking many small segments shows beside one long run.
//
// --flush: before every call (warm-up calls too) the decode worker pool reads a 256 MiB buffer,
// so the call finds its rows in memory rather than in the caches, as a model's decode step does
// after the layer's projections have streamed their weights through them; without it a view
// smaller than the last-level cache stays there between calls and the figures overstate what
// decode gets (most for fp16 rows, the largest). The GPU benchmark flushes its L2 the same way.
//
// Also prints the load average and CPU seconds per call (CLOCK_PROCESS_CPUTIME_ID) so a run on
// a shared machine can be judged.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ops/thread_pool.h"
#include "veloxquant/attention.h"
#include "veloxquant/packed.h"
#include "veloxquant/tensor.h"
#if __has_include("ops/packed_decode.h")
#include "ops/packed_decode.h"
#define VQ_HAVE_PACKED_DECODE 1
#endif

namespace {

using Clock = std::chrono::steady_clock;

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double read_bandwidth(int threads) {
  const size_t n = (size_t{1} << 30) / sizeof(uint64_t);
  std::vector<uint64_t> buf(n);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (size_t i = 0; i < n; ++i) buf[i] = i * 0x9e3779b97f4a7c15ull;
  double best = 0;
  volatile uint64_t sink = 0;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = Clock::now();
    uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(threads)
    for (size_t i = 0; i < n; ++i) total += buf[i];
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    sink = sink + total;
    best = std::max(best, static_cast<double>(n * sizeof(uint64_t)) / s);
  }
  return best;
}

// Reads every cache line of a 256 MiB buffer on the decode step's worker pool (see --flush): the
// pool's threads, as a model's projections leave them, stay awake for the call that follows
// (an OpenMP region would leave its own threads spinning beside them and the pool asleep).
void flush_caches() {
  static std::vector<uint64_t> buf;
  constexpr size_t kChunk = size_t{1} << 17;  // words per unit (1 MiB)
  const size_t n = (size_t{256} << 20) / sizeof(uint64_t);
  if (buf.empty()) buf.assign(n, 1);
  std::vector<uint64_t> part(n / kChunk, 0);
  vq::ops::parallel_for(static_cast<int64_t>(n / kChunk), [&](int64_t u) {
    uint64_t t = 0;
    for (size_t i = static_cast<size_t>(u) * kChunk; i < static_cast<size_t>(u + 1) * kChunk;
         i += 8)
      t += buf[i];
    part[static_cast<size_t>(u)] = t;
  });
  static volatile uint64_t sink = 0;
  for (uint64_t t : part) sink = sink + t;
}

struct Bench {
  vq::CacheView view;
  std::unique_ptr<vq::Tensor> k, v;
  std::vector<std::vector<uint8_t>> kb, vb;            // per segment
  std::vector<std::unique_ptr<vq::PackedSegment>> ps;  // per segment
  double bytes = 0;
};

// A view of n rows per (b, h): fp16 rows (bits 0, one segment) or packed records of kbits/vbits
// in segments of seg_rows rows (0: one segment), each segment its own allocation.
std::unique_ptr<Bench> make_bench(int64_t hkv, int64_t d, int64_t n, int bits, int64_t seg_rows) {
  auto b = std::make_unique<Bench>();
  b->view.batch = 1;
  b->view.n_kv_heads = hkv;
  b->view.head_dim = d;
  std::mt19937_64 rng(7);
  if (bits == 0) {
    vq::ViewSegment seg;
    seg.n_rows = n;
    b->k = std::make_unique<vq::Tensor>(vq::DType::kF16, 1, hkv, n, d);
    b->v = std::make_unique<vq::Tensor>(vq::DType::kF16, 1, hkv, n, d);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (vq::Tensor* t : {b->k.get(), b->v.get()}) {
      uint16_t* p = static_cast<uint16_t*>(t->data());
      for (int64_t i = 0; i < hkv * n * d; ++i) p[i] = vq::f32_to_fp16(nd(rng));
    }
    seg.keys = b->k->view();
    seg.values = b->v->view();
    b->bytes = 2.0 * static_cast<double>(hkv * n * d) * 2;
    b->view.segments.push_back(seg);
    return b;
  }
  const vq::PackedRowFormat f = vq::make_row_format(d, bits, 32, vq::MetaType::kF16);
  const int64_t step = seg_rows > 0 ? seg_rows : n;
  for (int64_t r0 = 0; r0 < n; r0 += step) {
    const int64_t m = std::min(step, n - r0);
    auto ps = std::make_unique<vq::PackedSegment>();
    ps->batch = 1;
    ps->n_heads = hkv;
    ps->n_rows = m;
    ps->head_dim = d;
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<uint8_t>& bytes = (kv == 0 ? b->kb : b->vb).emplace_back();
      bytes.resize(static_cast<size_t>(hkv * m * f.row_stride));
      for (int64_t r = 0; r < hkv * m; ++r) {
        uint8_t* rec = bytes.data() + r * f.row_stride;
        for (int32_t c = 0; c < f.code_bytes; ++c) rec[c] = static_cast<uint8_t>(rng());
        for (int32_t g = 0; g < f.n_groups; ++g) {
          vq::meta_store(rec + f.code_bytes, 2 * g, vq::meta_round(-1.0f, f.meta), f.meta);
          vq::meta_store(rec + f.code_bytes, 2 * g + 1, vq::meta_round(0.1f, f.meta), f.meta);
        }
      }
      vq::PackedTensor& t = kv == 0 ? ps->keys : ps->values;
      t.data = bytes.data();
      t.fmt = f;
      t.stride_h = m * f.row_stride;
      t.stride_b = hkv * t.stride_h;
    }
    vq::ViewSegment seg;
    seg.n_rows = m;
    seg.first_pos = r0;
    seg.packed = ps.get();
    b->view.segments.push_back(seg);
    b->ps.push_back(std::move(ps));
  }
  b->bytes = 2.0 * static_cast<double>(hkv * n * f.row_stride);
  return b;
}

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ',')) out.push_back(std::stoll(tok));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> contexts{2048, 8192, 32768}, shape{8, 128, 4}, threads{1, 2};
  int repeats = 30;
  int64_t seg_rows = 0;
  bool paths = false, flush = false;
  int default_isa = -1;  // -1: attention_isa()
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--contexts" && i + 1 < argc)
      contexts = parse_list(argv[++i]);
    else if (a == "--shape" && i + 1 < argc)
      shape = parse_list(argv[++i]);
    else if (a == "--threads" && i + 1 < argc)
      threads = parse_list(argv[++i]);
    else if (a == "--repeats" && i + 1 < argc)
      repeats = std::atoi(argv[++i]);
    else if (a == "--segment-rows" && i + 1 < argc)
      seg_rows = std::atoll(argv[++i]);
    else if (a == "--paths")
      paths = true;
    else if (a == "--flush")
      flush = true;
#ifdef VQ_HAVE_PACKED_DECODE
    else if (a == "--isa" && i + 1 < argc) {
      const std::string name = argv[++i];
      for (int isa = 0; isa <= static_cast<int>(vq::detail::CpuIsa::kAvx512Bf16); ++isa)
        if (name == vq::detail::isa_name(static_cast<vq::detail::CpuIsa>(isa)))
          default_isa = std::min(isa, static_cast<int>(vq::detail::detected_isa()));
      if (default_isa < 0) {
        std::fprintf(stderr, "unknown --isa %s\n", name.c_str());
        return 2;
      }
    }
#endif
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  const int64_t hkv = shape[0], d = shape[1], rep = shape[2];
  double load[3] = {0, 0, 0};
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = -1;
    std::fclose(f);
  }
  const char* wp = std::getenv("OMP_WAIT_POLICY");
  std::printf(
      "# decode attention: H_kv=%lld D=%lld rep=%lld, packed segments of %lld rows (0: one), "
      "load %.2f %.2f %.2f, OMP_WAIT_POLICY=%s, caches %s before each call\n",
      static_cast<long long>(hkv), static_cast<long long>(d), static_cast<long long>(rep),
      static_cast<long long>(seg_rows), load[0], load[1], load[2], wp ? wp : "(unset)",
      flush ? "flushed (256 MiB read)" : "not flushed");
  std::printf(
      "| threads | context | rows | path | bytes MiB | best us | median us | cpu us/call "
      "| GB/s | read BW GB/s | %% of BW | speed vs fp16 "
      "|\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  struct Variant {
    int bits;
    int isa;  // -1: default
  };
  std::vector<Variant> variants{{0, -1}, {4, default_isa}, {2, default_isa}};
#ifdef VQ_HAVE_PACKED_DECODE
  const int best_isa = static_cast<int>(vq::detail::detected_isa());
  if (paths)
    for (int bits : {4, 2})
      for (int isa = 0; isa < best_isa; ++isa) variants.push_back({bits, isa});
#else
  (void)paths;
#endif
  for (int64_t nt : threads) {
    omp_set_num_threads(static_cast<int>(nt));
    const double bw = read_bandwidth(static_cast<int>(nt));
    for (int64_t n : contexts) {
      double fp16_median = 0;
      for (const Variant& var : variants) {
        auto b = make_bench(hkv, d, n, var.bits, seg_rows);
        vq::Tensor q(vq::DType::kF32, 1, hkv * rep, 1, d);
        std::mt19937_64 rng(3);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (int64_t i = 0; i < hkv * rep * d; ++i) static_cast<float*>(q.data())[i] = nd(rng);
        std::vector<float> out(static_cast<size_t>(hkv * rep * d));
        vq::AttentionParams ap;
        ap.q_pos0 = n - 1;
        std::string path = "default";
#ifdef VQ_HAVE_PACKED_DECODE
        if (var.isa >= 0) vq::detail::set_attention_isa(static_cast<vq::detail::CpuIsa>(var.isa));
        if (var.bits > 0)
          path = vq::detail::isa_name(var.isa >= 0 ? static_cast<vq::detail::CpuIsa>(var.isa)
                                                   : vq::detail::attention_isa());
#endif
        for (int w = 0; w < 3; ++w) {
          if (flush) flush_caches();
          vq::attention(q.view(), b->view, ap, out.data());
        }
        std::vector<double> ts;
        const double c0 = cpu_seconds();
        for (int r = 0; r < repeats; ++r) {
          if (flush) flush_caches();
          const auto t0 = Clock::now();
          vq::attention(q.view(), b->view, ap, out.data());
          ts.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        }
        // CPU seconds per call over the whole loop (other threads' time is only counted at
        // scheduler ticks, too coarse to time one call): not shown with --flush, whose reads
        // (milliseconds) would swamp the calls' microseconds
        const double cpu = (cpu_seconds() - c0) / repeats;
#ifdef VQ_HAVE_PACKED_DECODE
        vq::detail::reset_attention_isa();
#endif
        std::sort(ts.begin(), ts.end());
        const double med = ts[ts.size() / 2], best = ts[0];
        if (var.bits == 0) fp16_median = med;
        char name[16];
        if (var.bits == 0)
          std::snprintf(name, sizeof name, "fp16");
        else
          std::snprintf(name, sizeof name, "K%dV%d", var.bits, var.bits);
        char cpu_s[24] = "-";
        if (!flush) std::snprintf(cpu_s, sizeof cpu_s, "%.0f", cpu * 1e6);
        std::printf(
            "| %lld | %lld | %s | %s | %.1f | %.0f | %.0f | %s | %.1f | %.1f | %.0f | "
            "%.2f |\n",
            static_cast<long long>(nt), static_cast<long long>(n), name, path.c_str(),
            b->bytes / 1048576.0, best * 1e6, med * 1e6, cpu_s, b->bytes / med / 1e9, bw / 1e9,
            100.0 * b->bytes / med / bw, fp16_median / med);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
