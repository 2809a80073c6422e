// Packed decode kernel micro-benchmark: the key kernel and the value kernel of one record format
// (src/ops/packed_decode.h) alone, without the online softmax around them, over tiles of 32
// consecutive records that stay in the L2 cache (16K records by default: 1.3 MiB at D 128, K4),
// so the figures are the kernels' compute per row, not the memory's. Prints the best ns per row
// of each kernel over the passes (one pass = every tile once).
//
//   bench_packed_kernels [--shapes 128,4,4;64,4,3;64,2,3] [--rows 16384] [--passes 30]
//                        [--isa NAME]
//   (shape: head_dim, bits, queries per KV head; group 32, fp16 metadata; --isa: isa_name of the
//   packed path, capped to this CPU's as vq::attention does)
//
// Random codes, metadata (lo -0.5, scale 0.07) and weights: the kernels' speed does not depend on
// the values.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ops/packed_decode.h"
#include "veloxquant/dtype.h"
#include "veloxquant/packed.h"

namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::vector<double>> parse_shapes(const std::string& s) {
  std::vector<std::vector<double>> out;
  size_t a = 0;
  while (a <= s.size()) {
    const size_t b = std::min(s.find(';', a), s.size());
    std::vector<double> v;
    size_t c = a;
    while (c < b) {
      const size_t e = std::min(s.find(',', c), b);
      v.push_back(std::atof(s.substr(c, e - c).c_str()));
      c = e + 1;
    }
    if (v.size() == 3) out.push_back(v);
    a = b + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shapes = "128,4,4;64,4,3;64,2,3";
  int64_t rows = 16384;
  int passes = 30;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--shapes" && i + 1 < argc) {
      shapes = argv[++i];
    } else if (a == "--rows" && i + 1 < argc) {
      rows = std::max<int64_t>(32, std::atoll(argv[++i]) / 32 * 32);
    } else if (a == "--passes" && i + 1 < argc) {
      passes = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--isa" && i + 1 < argc) {
      const std::string name = argv[++i];
      bool found = false;
      for (int k = 0; k <= static_cast<int>(vq::detail::CpuIsa::kAvx512Bf16); ++k)
        if (name == vq::detail::isa_name(static_cast<vq::detail::CpuIsa>(k))) {
          vq::detail::set_attention_isa(static_cast<vq::detail::CpuIsa>(k));
          found = true;
        }
      if (!found) {
        std::fprintf(stderr, "unknown --isa %s\n", name.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  std::printf("# packed decode kernels alone: %lld records (L2-resident), best of %d passes\n",
              static_cast<long long>(rows), passes);
  std::printf("| D | bits | queries | isa | bf16 values | keys ns/row | values ns/row |\n");
  std::printf("|---:|---:|---:|---|---|---:|---:|\n");
  for (const auto& sh : parse_shapes(shapes)) {
    const int64_t d = static_cast<int64_t>(sh[0]), nq = static_cast<int64_t>(sh[2]);
    const vq::PackedRowFormat f = vq::make_row_format(d, sh[1], 32, vq::MetaType::kF16);
    const vq::detail::PackedKernel k = vq::detail::packed_kernel(f, vq::detail::attention_isa());
    std::vector<uint8_t> rec(static_cast<size_t>(rows * f.row_stride));
    std::mt19937 rng(1);
    for (auto& b : rec) b = static_cast<uint8_t>(rng());
    const uint16_t lo = vq::f32_to_fp16(-0.5f), sc = vq::f32_to_fp16(0.07f);
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* m = rec.data() + r * f.row_stride + f.code_bytes;
      for (int32_t g = 0; g < f.n_groups; ++g) {
        std::memcpy(m + 4 * g, &lo, 2);
        std::memcpy(m + 4 * g + 2, &sc, 2);
      }
    }
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(nq * d)), qsum(static_cast<size_t>(nq * f.n_groups));
    for (auto& x : q) x = nd(rng);
    for (int64_t m = 0; m < nq; ++m)
      for (int64_t c = 0; c < d; ++c)
        qsum[static_cast<size_t>(m * f.n_groups + c / 32)] += q[m * d + c];
    std::vector<uint64_t> prep(k.prep_bytes ? static_cast<size_t>((k.prep_bytes(f, nq) + 7) / 8)
                                            : 0);
    if (k.prepare) k.prepare(f, q.data(), qsum.data(), nq, prep.data());
    std::vector<float> logits(static_cast<size_t>(nq * 32)), p(static_cast<size_t>(nq * 32));
    for (auto& x : p) x = std::abs(nd(rng)) / 32.0f;
    std::vector<float> acc(static_cast<size_t>(nq * d)),
        acc_lo(static_cast<size_t>(nq * f.n_groups));
    std::vector<float> scratch(
        static_cast<size_t>(vq::detail::packed_values_scratch(f.n_groups, nq)));
    int32_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = i;
    double best_k = 1e30, best_v = 1e30;
    for (int pass = 0; pass < passes; ++pass) {
      const auto t0 = Clock::now();
      for (int64_t r0 = 0; r0 < rows; r0 += 32) {
        const vq::detail::PackedTile t{rec.data() + r0 * f.row_stride, f.row_stride, idx, 32};
        k.keys(f, t, q.data(), qsum.data(), nq, logits.data(), 32, prep.data());
      }
      const auto t1 = Clock::now();
      for (int64_t r0 = 0; r0 < rows; r0 += 32) {
        const vq::detail::PackedTile t{rec.data() + r0 * f.row_stride, f.row_stride, idx, 32};
        k.values(f, t, p.data(), 32, nq, acc.data(), acc_lo.data(), scratch.data());
      }
      const auto t2 = Clock::now();
      best_k = std::min(best_k, std::chrono::duration<double>(t1 - t0).count() * 1e9 / rows);
      best_v = std::min(best_v, std::chrono::duration<double>(t2 - t1).count() * 1e9 / rows);
    }
    volatile float sink = logits[1] + acc[1] + acc_lo[0];
    (void)sink;
    std::printf("| %lld | %g | %lld | %s | %s | %.2f | %.2f |\n", static_cast<long long>(d), sh[1],
                static_cast<long long>(nq), vq::detail::isa_name(k.isa),
                k.bf16_values ? "yes" : "no", best_k, best_v);
  }
  return 0;
}
