// GPU tests of the SnapKV kernels beyond the op harness's table
// (tests/cuda/test_backend_ops_cuda.cpp holds snap_scores to its derived bound and snap_pool,
// snap_select and gather_rows to the CPU bit for bit, tie-heavy and non-finite scores included):
// non-finite keys give NaN scores, and the whole per-head pipeline against snap_select_head
// (identical keep-sets, or, where they differ, only between rows whose reference scores tie within
// the scores' bound). Skipped without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "util/test_util.h"
#include "veloxquant/cuda.h"
#include "veloxquant/snapkv.h"

namespace vq {
namespace {

constexpr double kU = 0x1p-24;
inline double gamma(double n) {
  return n * kU / (1.0 - n * kU);
}

// Tolerance of a GPU score against the double reference (relative, per score): logits are fp32
// dot products, |delta l| <= scale * gamma(D + 1) * sum_d |q_d k_d| + u |l| (the final scaling);
// shifting a row's logits by at most delta_i changes each softmax probability by a factor within
// e^(+-2 delta_i); the row's normaliser Z is a sum of fp32 tile sums (64 terms) combined in
// double with expf factors (2 ulp), then 1/Z, exp(l - M) (2 ulp) and the product add
// gamma(64 + 8) + 2^-20 relative; every score is a positive mean of such probabilities, so
// |gpu - ref| <= ref * (max_i (e^(2 delta_i) - 1) + gamma(72) + 2^-20) + the final fp32 rounding
// (u * ref) + 1e-30.
// The tensor-core scorer (f16 keys, D 64/128, W <= 128) stays inside these terms: the query enters
// as fp16 hi + lo (|q - hi - lo| <= 2^-22 |q| = 4u |q|, products with f16 keys exact), and its
// fp32 accumulation is 2 mma per 16 channels, each one alignment and rounding of at most 4u of
// the terms' magnitude: |delta l| <= scale * (D / 2 + 4) u sum |q_d k_d| <= scale * gamma(D + 1)
// sum |q_d k_d|; its tile sums add 64 terms in a different order (16 per lane, then 2 adds), and
// its pass 2 sums all W probabilities in double before one division by W (the same mean).
double score_rel_tol(const std::vector<float>& keys, const std::vector<float>& q, int64_t n,
                     int64_t W, int64_t D) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  double worst = 0;
  for (int64_t i = 0; i < W; ++i) {
    double di = 0;
    for (int64_t j = 0; j < n; ++j) {
      double a = 0, dot = 0;
      for (int64_t d = 0; d < D; ++d) {
        a += std::abs(static_cast<double>(q[i * D + d]) * keys[j * D + d]);
        dot += static_cast<double>(q[i * D + d]) * keys[j * D + d];
      }
      di = std::max(di, scale * gamma(D + 1) * a + kU * std::abs(dot * scale));
    }
    worst = std::max(worst, std::expm1(2 * di));
  }
  return worst + gamma(72) + 0x1p-20 + kU;
}

TEST(CudaSnapkv, NonFiniteKeysGiveNanScores) {
  SKIP_WITHOUT_DEVICE();
  Tensor keys = test::random_tensor(DType::kF32, 1, 1, 40, 64, 2);
  keys.set(0, 0, 7, 3, NAN);
  cuda::DeviceBuffer dk = cuda::DeviceBuffer::from_host(keys.data(), keys.nbytes());
  cuda::DeviceBuffer ds(40 * 4);
  cuda::snap_scores(TensorView::contiguous(dk.data(), DType::kF32, 1, 1, 40, 64), nullptr, nullptr,
                    nullptr, 8, ds.as<float>());
  std::vector<float> cpu(40);
  snap_key_proxy_scores(static_cast<const float*>(keys.data()), 40, 64, 8, cpu.data());
  const auto gpu = ds.to_vector<float>(40);
  for (int j = 0; j < 40; ++j) EXPECT_EQ(std::isnan(gpu[j]), std::isnan(cpu[j])) << j;
  EXPECT_TRUE(std::isnan(gpu[0]));
}

// The pipeline: GPU keep-sets equal the CPU's snap_select_head, except between rows whose
// reference scores are within the score tolerance of the selection threshold (near-ties).
TEST(CudaSnapkv, PipelineMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  const int64_t B = 2, H = 2, F = B * H, n = 700, D = 128;
  const Tensor keys = test::random_tensor(DType::kF16, B, H, n, D, 99, 1.5f);
  cuda::DeviceBuffer dk = cuda::DeviceBuffer::from_host(keys.data(), keys.nbytes());
  const TensorView kv = TensorView::contiguous(dk.data(), DType::kF16, B, H, n, D);
  const int64_t n_rep = 4, w = 16;
  std::vector<float> q(static_cast<size_t>(F * n_rep * w * D));
  for (auto& x : q) x = nd(rng);
  std::vector<int32_t> kpos(static_cast<size_t>(F * n)), qpos(static_cast<size_t>(w));
  for (int64_t f = 0; f < F; ++f)
    for (int64_t j = 0; j < n; ++j) kpos[static_cast<size_t>(f * n + j)] = static_cast<int32_t>(j);
  for (int64_t i = 0; i < w; ++i) qpos[static_cast<size_t>(i)] = static_cast<int32_t>(n - w + i);
  cuda::DeviceBuffer dq = cuda::DeviceBuffer::from_vector(q);
  cuda::DeviceBuffer dkp = cuda::DeviceBuffer::from_vector(kpos);
  cuda::DeviceBuffer dqp = cuda::DeviceBuffer::from_vector(qpos);
  const TensorView qv = TensorView::contiguous(dq.data(), DType::kF32, B, H * n_rep, w, D);
  cuda::DecodeWorkspace ws;
  int64_t mismatches = 0;
  for (bool use_q : {false, true})
    for (int64_t pool : {1, 7})
      for (bool keep_window : {false, true}) {
        SnapSelectParams p;
        p.budget = 100;
        p.obs_window = 32;
        p.n_sink = 4;
        p.pool_kernel = pool;
        p.pool = PoolKind::kMax;
        p.keep_window = keep_window;
        const int64_t count = snap_keep_count(n, p);
        cuda::DeviceBuffer dout(static_cast<size_t>(F * count) * 4);
        const int64_t got = cuda::snap_select_frames(
            kv, use_q ? &qv : nullptr, use_q ? dkp.as<int32_t>() : nullptr,
            use_q ? dqp.as<int32_t>() : nullptr, p, dout.as<int32_t>(), ws);
        ASSERT_EQ(got, count);
        cuda::synchronize();
        const auto gpu = dout.to_vector<int32_t>(static_cast<size_t>(F * count));
        std::ostringstream vars;
        vars << "query=" << use_q << " pool=" << pool << " keep_window=" << keep_window;
        for (int64_t f = 0; f < F; ++f) {
          std::vector<float> kf(static_cast<size_t>(n * D));
          for (int64_t j = 0; j < n; ++j)
            for (int64_t d = 0; d < D; ++d)
              kf[static_cast<size_t>(j * D + d)] = keys.at(f / H, f % H, j, d);
          SnapQueryWindow qw;
          qw.data = q.data() + f * n_rep * w * D;
          qw.n_rep = n_rep;
          qw.w = w;
          qw.positions = qpos.data();
          std::vector<int64_t> cpu(static_cast<size_t>(count));
          SnapScratch scratch;
          snap_select_head(kf.data(), use_q ? kpos.data() + f * n : nullptr, n, D,
                           use_q ? &qw : nullptr, p, cpu.data(), scratch);
          // reference scores (double), pooled like the pipeline, and their tolerance
          std::vector<float> ref(static_cast<size_t>(n)), qf;
          int64_t W;
          if (use_q) {
            snap_query_scores_reference(kf.data(), kpos.data() + f * n, n, D, qw.data, qpos.data(),
                                        n_rep, w, ref.data());
            qf.assign(qw.data, qw.data + n_rep * w * D);
            W = n_rep * w;
          } else {
            snap_key_proxy_scores_reference(kf.data(), n, D, p.obs_window, ref.data());
            qf.assign(kf.begin() + (n - p.obs_window) * D, kf.end());
            W = p.obs_window;
          }
          // GPU scores are within rel of the reference; the CPU's optimised scores sum each
          // softmax row sequentially in fp32 (gamma(n) more). Pooling by max keeps a relative
          // bound. The competing rows are [sinks, n), or the prefix [sinks, n - w) with
          // keep_window; the selection reads the (pooled) scores of those rows only.
          const double rel = score_rel_tol(kf, qf, n, W, D);
          const double rel_cpu = rel + gamma(static_cast<double>(n) + 8);
          const int64_t sinks = std::min<int64_t>(p.n_sink, count);
          const int64_t wk = use_q ? w : std::clamp<int64_t>(p.obs_window, 1, n);
          const int64_t lo = sinks, hi = keep_window ? std::max(sinks, n - wk) : n;
          std::vector<float> sel_ref = ref;
          if (pool > 1)
            snap_pool_scores(ref.data() + lo, hi - lo, pool, p.pool, sel_ref.data() + lo);
          std::set<int64_t> gs, cs(cpu.begin(), cpu.end());
          for (int64_t i = 0; i < count; ++i) {
            const int32_t g = gpu[static_cast<size_t>(f * count + i)];
            if (i > 0) {
              ASSERT_LT(gpu[static_cast<size_t>(f * count + i - 1)], g)
                  << vars.str() << " ascending";
            }
            gs.insert(g);
          }
          ASSERT_EQ(static_cast<int64_t>(gs.size()), count) << vars.str() << " duplicates";
          std::vector<int64_t> only;
          for (int64_t x : gs)
            if (!cs.count(x)) only.push_back(x);
          for (int64_t x : cs)
            if (!gs.count(x)) only.push_back(x);
          if (only.empty()) continue;
          // Disputed rows were ranked differently by two scorers whose errors are within rel
          // and rel_cpu of the reference: a GPU-only row x and a CPU-only row y satisfy
          // ref_x >= ref_y (1 - 2 rel) and ref_y >= ref_x (1 - 2 rel_cpu), so all disputed
          // reference scores lie within 2 (rel + rel_cpu) * max of each other.
          double lo_s = INFINITY, hi_s = -INFINITY;
          for (int64_t x : only) {
            ASSERT_TRUE(x >= lo && x < hi)
                << vars.str() << " disputed row " << x << " outside the competing rows";
            lo_s = std::min(lo_s, static_cast<double>(sel_ref[static_cast<size_t>(x)]));
            hi_s = std::max(hi_s, static_cast<double>(sel_ref[static_cast<size_t>(x)]));
          }
          EXPECT_LE(hi_s - lo_s, 2 * (rel + rel_cpu) * hi_s)
              << vars.str() << " frame " << f << ": " << only.size() << " disputed rows";
          mismatches += static_cast<int64_t>(only.size());
        }
      }
  std::printf("[snapkv pipeline] %lld disputed (near-tie) rows\n",
              static_cast<long long>(mismatches));
}

}  // namespace
}  // namespace vq
