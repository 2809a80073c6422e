// End-to-end generation speed: prefill and decode tokens/s at several context lengths for each
// cache method, mean +- sd over repeats, against the memory-bandwidth bound of decode.
//
//   bench_e2e [--model DIR] [--contexts 512,1024,2048] [--methods "full;snapkv:budget=256;..."]
//             [--repeats 3] [--decode 32] [--threads N] [--prefill-step 512] [--csv FILE]
//             [--no-bandwidth] [--cpu-time] [--matmul exact|bf16|exact,bf16]
//
// Prompt: token ids of the held-out evaluation text (data/eval/heldout_ids.u16, uint16) when
// present, else seeded random ids. Each repeat builds fresh caches, prefills the context in
// prefill-step chunks (timed: prefill tokens/s) and decodes --decode tokens greedily (timed:
// decode tokens/s). Bandwidth: the best of 7 passes of a multi-threaded read (sum of 64-bit
// words, all threads) over a 1 GiB buffer, so a decode step's bound is
//   (weight bytes read per token + the caches' bytes at that context) / bandwidth.
// The weights of a small model may stay in the last-level cache, so the bound is a floor for
// small models, not a ceiling. Output: a Markdown table on stdout (CSV with --csv). The header
// line records the thread count, OMP_WAIT_POLICY and the load average (the decode step runs on
// the worker pool of src/ops/thread_pool.h, which the variable does not touch; model loading
// and the bandwidth pass use OpenMP).
// --no-bandwidth skips the bandwidth pass (bound columns "-"; for profiling). --cpu-time adds
// prefill and decode tokens per CPU-second of the process (all threads' CPU time, from
// CLOCK_PROCESS_CPUTIME_ID): idle pool workers sleep after a short spin, so this counts mostly
// work rather than waiting, a steadier A/B measure than wall time on a loaded machine.
// --matmul picks ForwardOptions::matmul (default exact); a list (exact,bf16) measures each mode
// in turn within every repeat (alternating, so a noisy neighbour hits both alike), one row per
// mode: method "<spec>" for exact, "<spec> (bf16 matmul)" for bf16; the CSV gets a last column
// "matmul".
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "veloxquant/cache_config.h"
#include "veloxquant/error.h"
#include "veloxquant/generate.h"
#include "veloxquant/model.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// CPU seconds used by every thread of this process so far.
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Read bandwidth in bytes/s: every thread sums its share of a 1 GiB buffer; best of 7.
double measure_read_bandwidth() {
  const size_t n = (size_t{1} << 30) / sizeof(uint64_t);
  std::vector<uint64_t> buf(n);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) buf[i] = i * 0x9e3779b97f4a7c15ull;
  double best = 0;
  volatile uint64_t sink = 0;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = Clock::now();
    uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (size_t i = 0; i < n; ++i) total += buf[i];
    const double s = seconds(t0, Clock::now());
    sink = sink + total;
    best = std::max(best, static_cast<double>(n * sizeof(uint64_t)) / s);
  }
  return best;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

struct Stat {
  double mean = 0, sd = 0;
};
Stat stat(const std::vector<double>& v) {
  Stat s;
  for (double x : v) s.mean += x;
  s.mean /= static_cast<double>(v.size());
  for (double x : v) s.sd += (x - s.mean) * (x - s.mean);
  s.sd = v.size() > 1 ? std::sqrt(s.sd / static_cast<double>(v.size() - 1)) : 0.0;
  return s;
}

std::vector<int32_t> prompt_ids(const std::string& root, int64_t n, int64_t vocab) {
  std::vector<int32_t> ids;
  const std::string path = root + "/data/eval/heldout_ids.u16";
  if (std::filesystem::exists(path)) {
    std::ifstream in(path, std::ios::binary);
    std::vector<uint16_t> raw(static_cast<size_t>(n));
    in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(n * 2));
    if (in.gcount() == n * 2)
      for (uint16_t x : raw) ids.push_back(static_cast<int32_t>(x % vocab));
  }
  if (static_cast<int64_t>(ids.size()) != n) {
    ids.clear();
    std::mt19937_64 rng(17);
    for (int64_t i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>(rng() % vocab));
  }
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, csv_path;
  std::string contexts_s = "512,1024,2048";
  std::string methods_s = "full;snapkv:budget=256;skvq;snapkv+skvq:budget=256;streaming:window=256";
  int repeats = 3, threads = 0;
  bool bandwidth = true, cpu_time = false;
  int64_t decode = 32, step = 512;
  std::string matmul_s = "exact";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_e2e: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") {
      model_dir = next();
    } else if (a == "--contexts") {
      contexts_s = next();
    } else if (a == "--methods") {
      methods_s = next();
    } else if (a == "--repeats") {
      repeats = std::stoi(next());
    } else if (a == "--decode") {
      decode = std::stoll(next());
    } else if (a == "--threads") {
      threads = std::stoi(next());
    } else if (a == "--prefill-step") {
      step = std::stoll(next());
    } else if (a == "--csv") {
      csv_path = next();
    } else if (a == "--no-bandwidth") {
      bandwidth = false;
    } else if (a == "--cpu-time") {
      cpu_time = true;
    } else if (a == "--matmul") {
      matmul_s = next();
    } else {
      std::fprintf(stderr,
                   "usage: bench_e2e [--model DIR] [--contexts 512,1024,2048] [--methods "
                   "\"full;snapkv:budget=256\"] [--repeats 3] [--decode 32] [--threads N] "
                   "[--prefill-step 512] [--csv FILE] [--no-bandwidth] [--cpu-time] "
                   "[--matmul exact|bf16|exact,bf16]\n");
      return 2;
    }
  }
  try {
    if (threads > 0) omp_set_num_threads(threads);
    std::vector<vq::MatmulPrecision> modes;
    for (const std::string& m : split(matmul_s, ',')) {
      if (m != "exact" && m != "bf16")
        throw vq::Error("[bench_e2e] --matmul: expected exact, bf16 or a list of them but got " +
                        m);
      modes.push_back(m == "bf16" ? vq::MatmulPrecision::kBF16 : vq::MatmulPrecision::kExact);
    }
    if (model_dir.empty()) model_dir = vq::find_shipped_model();
    if (model_dir.empty()) throw vq::Error("[bench_e2e] no --model and no shipped model found");
    const auto model = vq::Model::load(model_dir);
    const vq::ModelConfig& mc = model->config();
    const std::string root = std::filesystem::path(model_dir).parent_path().parent_path().string();
    if (bandwidth)
      std::fprintf(stderr, "measuring read bandwidth (1 GiB, %d threads)...\n",
                   omp_get_max_threads());
    const double bw = bandwidth ? measure_read_bandwidth() : 0.0;
    const double wbytes = static_cast<double>(model->weight_bytes_per_token());

    std::printf(
        "model %s: %lld layers, hidden %lld, %lld/%lld heads, vocab %lld; weights read "
        "per decode token %.1f MiB\n",
        model_dir.c_str(), static_cast<long long>(mc.n_layers),
        static_cast<long long>(mc.hidden_size), static_cast<long long>(mc.n_heads),
        static_cast<long long>(mc.n_kv_heads), static_cast<long long>(mc.vocab_size),
        wbytes / 1048576.0);
    std::string load = "?";
    if (std::ifstream la("/proc/loadavg"); la) std::getline(la, load);
    const char* wait = std::getenv("OMP_WAIT_POLICY");
    char bw_s[96] = "read bandwidth not measured (--no-bandwidth)";
    if (bandwidth)
      std::snprintf(bw_s, sizeof bw_s,
                    "measured read bandwidth %.1f GB/s (best of 7 passes over 1 GiB)", bw / 1e9);
    std::printf(
        "threads %d (OMP_WAIT_POLICY=%s), %s, %d repeats, %lld decode tokens, prefill step "
        "%lld, K/V fp16; load average at start: %s\n\n",
        omp_get_max_threads(), wait ? wait : "default", bw_s, repeats,
        static_cast<long long>(decode), static_cast<long long>(step), load.c_str());
    std::printf(
        "| context | method | prefill tok/s | decode tok/s | decode bound tok/s | "
        "%% of bound | cache MiB (accounted) | ratio to fp16 |%s\n",
        cpu_time ? " prefill tok/CPU-s | decode tok/CPU-s |" : "");
    std::printf("|---:|---|---:|---:|---:|---:|---:|---:|%s\n", cpu_time ? "---:|---:|" : "");
    std::ofstream csv;
    if (!csv_path.empty()) {
      csv.open(csv_path);
      csv << "context,method,prefill_mean,prefill_sd,decode_mean,decode_sd,bound,cache_bytes,"
             "ratio,matmul\n";
    }
    for (const std::string& cs : split(contexts_s, ',')) {
      const int64_t ctx = std::stoll(cs);
      const auto ids = prompt_ids(root, ctx, mc.vocab_size);
      for (const std::string& spec : split(methods_s, ';')) {
        const vq::CacheConfig cfg = vq::config_from_spec(spec);
        const size_t nm = modes.size();
        std::vector<std::vector<double>> pre(nm), dec(nm), pre_cpu(nm), dec_cpu(nm);
        vq::CacheMemory mem;
        for (int r = 0; r < repeats + 1; ++r) {  // repeat 0 warms up and is dropped
          for (size_t mi = 0; mi < nm; ++mi) {
            auto caches = model->make_caches(cfg);
            vq::ForwardScratch scratch;
            std::vector<float> logits;
            const double c0 = cpu_seconds();
            auto t0 = Clock::now();
            vq::prefill(*model, ids.data(), ctx, caches, step, vq::DType::kF16, &logits, &scratch,
                        {}, modes[mi]);
            auto t1 = Clock::now();
            const double c1 = cpu_seconds();
            if (r == 0) mem = vq::cache_memory(caches, mc.n_kv_heads);
            vq::ForwardOptions fo;
            fo.matmul = modes[mi];
            int32_t tok = vq::argmax(logits.data(), mc.vocab_size);
            const double c2 = cpu_seconds();
            auto t2 = Clock::now();
            for (int64_t d = 0; d < decode; ++d) {
              model->forward(&tok, 1, 1, caches, fo, &logits, &scratch);
              tok = vq::argmax(logits.data(), mc.vocab_size);
            }
            auto t3 = Clock::now();
            const double c3 = cpu_seconds();
            if (r == 0) continue;
            pre[mi].push_back(static_cast<double>(ctx) / seconds(t0, t1));
            dec[mi].push_back(static_cast<double>(decode) / seconds(t2, t3));
            pre_cpu[mi].push_back(static_cast<double>(ctx) / (c1 - c0));
            dec_cpu[mi].push_back(static_cast<double>(decode) / (c3 - c2));
          }
        }
        for (size_t mi = 0; mi < nm; ++mi) {
          const bool bf = modes[mi] == vq::MatmulPrecision::kBF16;
          const std::string label = bf ? spec + " (bf16 matmul)" : spec;
          const Stat p = stat(pre[mi]), d = stat(dec[mi]);
          const double bound = bw / (wbytes + static_cast<double>(mem.bytes_accounted));
          char bound_s[64] = "-", share_s[64] = "-";
          if (bandwidth) {
            std::snprintf(bound_s, sizeof bound_s, "%.0f", bound);
            std::snprintf(share_s, sizeof share_s, "%.0f%%", 100 * d.mean / bound);
          }
          std::printf("| %lld | %s | %.0f ± %.0f | %.1f ± %.1f | %s | %s | %.2f | %.3f |",
                      static_cast<long long>(ctx), label.c_str(), p.mean, p.sd, d.mean, d.sd,
                      bound_s, share_s, static_cast<double>(mem.bytes_accounted) / 1048576.0,
                      mem.ratio_to_fp16());
          if (cpu_time) {
            const Stat pc = stat(pre_cpu[mi]), dc = stat(dec_cpu[mi]);
            std::printf(" %.0f ± %.0f | %.1f ± %.1f |", pc.mean, pc.sd, dc.mean, dc.sd);
          }
          std::printf("\n");
          std::fflush(stdout);
          if (csv.is_open())
            csv << ctx << ",\"" << spec << "\"," << p.mean << "," << p.sd << "," << d.mean << ","
                << d.sd << "," << bound << "," << mem.bytes_accounted << "," << mem.ratio_to_fp16()
                << "," << (bf ? "bf16" : "exact") << "\n";
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_e2e: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
