// GPU tests of the SnapKV kernels against the CPU primitives (snapkv.h): selection (seed rule and
// keep-window rule) bit for bit on tie-heavy and non-finite scores; pooling bit for bit; window
// scores (key proxy, and real queries with causal positions and GQA averaging) within a bound
// derived from fp32 arithmetic against the double reference; the whole per-head pipeline against
// snap_select_head (identical keep-sets, or, where they differ, only between rows whose reference
// scores tie within that bound); and the row gather byte for byte. Skipped without a device.
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

std::vector<int32_t> gpu_select(const std::vector<float>& scores, int64_t F, int64_t n,
                                int64_t budget, int64_t n_sink, int64_t window, int64_t* count) {
  cuda::DeviceBuffer ds = cuda::DeviceBuffer::from_vector(scores);
  const int64_t c = snap_select_count(n, budget);
  cuda::DeviceBuffer out(static_cast<size_t>(std::max<int64_t>(F * c, 1)) * 4);
  *count = cuda::snap_select(ds.as<float>(), F, n, budget, n_sink, window, out.as<int32_t>());
  cuda::synchronize();
  return out.to_vector<int32_t>(static_cast<size_t>(F * c));
}

TEST(CudaSnapkv, SelectionMatchesCpuExactly) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> iv(-4, 4), special(0, 30);
  int cases = 0;
  for (int64_t n : {0, 1, 2, 3, 255, 256, 257, 511, 512, 513, 8193}) {
    const int64_t F = 3;
    std::vector<float> scores(static_cast<size_t>(F * n));
    for (auto& s : scores) {
      const int k = special(rng);
      s = k == 0   ? NAN
          : k == 1 ? INFINITY
          : k == 2 ? -INFINITY
          : k == 3 ? -0.0f
                   : static_cast<float>(iv(rng));
    }
    for (int64_t budget : {int64_t{-1}, int64_t{0}, int64_t{1}, int64_t{3}, n / 2, n - 1, n, n + 4})
      for (int64_t n_sink : {-1, 0, 2, 5})
        for (int64_t window : {-1, 0, 3, 32}) {
          std::ostringstream vars;
          vars << "n=" << n << " budget=" << budget << " n_sink=" << n_sink << " window=" << window;
          int64_t count = 0;
          const auto gpu = gpu_select(scores, F, n, budget, n_sink, window, &count);
          ASSERT_EQ(count, snap_select_count(n, budget)) << vars.str();
          for (int64_t f = 0; f < F; ++f) {
            const float* sf = scores.data() + f * n;
            const std::vector<int64_t> cpu =
                window < 0 ? snap_select_reference(sf, n, budget, n_sink)
                           : snap_select_keep_window_reference(sf, n, budget, n_sink, window);
            ASSERT_EQ(static_cast<int64_t>(cpu.size()), count) << vars.str();
            for (int64_t i = 0; i < count; ++i)
              ASSERT_EQ(gpu[static_cast<size_t>(f * count + i)], cpu[static_cast<size_t>(i)])
                  << vars.str() << " frame " << f << " position " << i;
          }
          ++cases;
        }
  }
  std::printf("[snapkv select] %d cases identical\n", cases);
}

TEST(CudaSnapkv, NonFiniteOrder) {
  SKIP_WITHOUT_DEVICE();
  const std::vector<float> s = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, NAN};
  for (int64_t k = 1; k <= 6; ++k) {
    int64_t count = 0;
    const auto gpu = gpu_select(s, 1, 6, k, 0, -1, &count);
    const auto cpu = snap_select_reference(s.data(), 6, k, 0);
    ASSERT_EQ(count, k);
    for (int64_t i = 0; i < k; ++i)
      EXPECT_EQ(gpu[static_cast<size_t>(i)], cpu[static_cast<size_t>(i)]) << "k=" << k;
  }
}

TEST(CudaSnapkv, PoolingMatchesCpuExactly) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd;
  const int64_t F = 2, n = 300;
  std::vector<float> in(static_cast<size_t>(F * n));
  for (auto& x : in) x = nd(rng);
  in[5] = in[6] = in[7] = NAN;
  in[n + 100] = NAN;
  cuda::DeviceBuffer din = cuda::DeviceBuffer::from_vector(in);
  for (PoolKind kind : {PoolKind::kMax, PoolKind::kAvg})
    for (int64_t kernel : {1, 3, 5, 7})
      for (auto [lo, hi] : {std::pair<int64_t, int64_t>{0, n}, {4, n - 32}, {10, 11}}) {
        cuda::DeviceBuffer dout(static_cast<size_t>(F * n) * 4);
        dout.fill_zero();
        cuda::snap_pool(din.as<float>(), F, n, lo, hi, kernel, kind, dout.as<float>());
        cuda::synchronize();
        const auto gpu = dout.to_vector<float>(static_cast<size_t>(F * n));
        for (int64_t f = 0; f < F; ++f) {
          std::vector<float> cpu(static_cast<size_t>(hi - lo));
          snap_pool_scores(in.data() + f * n + lo, hi - lo, kernel, kind, cpu.data());
          for (int64_t j = lo; j < hi; ++j) {
            const float g = gpu[static_cast<size_t>(f * n + j)],
                        c = cpu[static_cast<size_t>(j - lo)];
            EXPECT_TRUE(std::memcmp(&g, &c, 4) == 0 || (std::isnan(g) && std::isnan(c)))
                << "kind=" << static_cast<int>(kind) << " kernel=" << kernel << " j=" << j
                << " gpu " << g << " cpu " << c;
          }
        }
      }
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

TEST(CudaSnapkv, ScoresWithinDerivedBound) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd;
  double worst_used = 0;
  for (int64_t D : {64, 128})
    for (int64_t n : {1, 17, 129, 1000})
      for (int64_t w : {1, 8, 32})
        for (int64_t n_rep : {0, 1, 4}) {  // 0: key proxy
          const int64_t B = 2, H = 2, F = B * H;
          const Tensor keys = test::random_tensor(DType::kF16, B, H, n, D, rng());
          cuda::DeviceBuffer dk = cuda::DeviceBuffer::from_host(keys.data(), keys.nbytes());
          const TensorView kv = TensorView::contiguous(dk.data(), DType::kF16, B, H, n, D);
          const int64_t wq = n_rep == 0 ? std::clamp<int64_t>(w, 1, n) : w;
          std::vector<float> q(static_cast<size_t>(B * H * std::max<int64_t>(n_rep, 1) * wq * D));
          for (auto& x : q) x = nd(rng);
          std::vector<int32_t> kpos(static_cast<size_t>(F * n)), qpos(static_cast<size_t>(wq));
          for (int64_t f = 0; f < F; ++f)
            for (int64_t j = 0; j < n; ++j)
              kpos[static_cast<size_t>(f * n + j)] = static_cast<int32_t>(2 * j + f % 2);
          for (int64_t i = 0; i < wq; ++i)
            qpos[static_cast<size_t>(i)] = static_cast<int32_t>(2 * (n - wq + i) + 1);
          cuda::DeviceBuffer dq = cuda::DeviceBuffer::from_vector(q);
          cuda::DeviceBuffer dkp = cuda::DeviceBuffer::from_vector(kpos);
          cuda::DeviceBuffer dqp = cuda::DeviceBuffer::from_vector(qpos);
          const TensorView qv = TensorView::contiguous(dq.data(), DType::kF32, B,
                                                       H * std::max<int64_t>(n_rep, 1), wq, D);
          cuda::DeviceBuffer ds(static_cast<size_t>(F * n) * 4);
          if (n_rep == 0) {
            cuda::snap_scores(kv, nullptr, nullptr, nullptr, w, ds.as<float>());
          } else {
            cuda::snap_scores(kv, &qv, dkp.as<int32_t>(), dqp.as<int32_t>(), w, ds.as<float>());
          }
          const auto gpu = ds.to_vector<float>(static_cast<size_t>(F * n));
          for (int64_t f = 0; f < F; ++f) {
            std::vector<float> kf(static_cast<size_t>(n * D));
            for (int64_t j = 0; j < n; ++j)
              for (int64_t d = 0; d < D; ++d)
                kf[static_cast<size_t>(j * D + d)] = keys.at(f / H, f % H, j, d);
            std::vector<float> ref(static_cast<size_t>(n));
            std::vector<float> qf;
            int64_t W;
            if (n_rep == 0) {
              snap_key_proxy_scores_reference(kf.data(), n, D, w, ref.data());
              qf.assign(kf.begin() + (n - wq) * D, kf.end());
              W = wq;
            } else {
              const float* qb = q.data() + f * n_rep * wq * D;
              qf.assign(qb, qb + n_rep * wq * D);
              snap_query_scores_reference(kf.data(), kpos.data() + f * n, n, D, qf.data(),
                                          qpos.data(), n_rep, wq, ref.data());
              W = n_rep * wq;
            }
            const double rel = score_rel_tol(kf, qf, n, W, D);
            for (int64_t j = 0; j < n; ++j) {
              const double g = gpu[static_cast<size_t>(f * n + j)], r = ref[static_cast<size_t>(j)];
              const double tol = std::abs(r) * rel + 1e-30;
              EXPECT_LE(std::abs(g - r), tol) << "D=" << D << " n=" << n << " w=" << w
                                              << " n_rep=" << n_rep << " f=" << f << " j=" << j;
              worst_used = std::max(worst_used, std::abs(g - r) / tol);
            }
          }
        }
  std::printf("[snapkv scores] worst error = %.3f%% of tolerance\n", 100 * worst_used);
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

TEST(CudaSnapkv, GatherRowsExact) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(1);
  for (int64_t row_bytes : {256, 35, 48}) {
    const int64_t F = 3, n = 50, count = 20;
    std::vector<uint8_t> src(static_cast<size_t>(F * n * row_bytes));
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    std::vector<int32_t> idx(static_cast<size_t>(F * count)), pos(static_cast<size_t>(F * n));
    for (int64_t f = 0; f < F; ++f) {
      std::vector<int32_t> all(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) all[static_cast<size_t>(j)] = static_cast<int32_t>(j);
      std::shuffle(all.begin(), all.end(), rng);
      std::sort(all.begin(), all.begin() + count);
      std::copy(all.begin(), all.begin() + count, idx.begin() + f * count);
      for (int64_t j = 0; j < n; ++j)
        pos[static_cast<size_t>(f * n + j)] = static_cast<int32_t>(1000 * f + 3 * j);
    }
    cuda::DeviceBuffer ds = cuda::DeviceBuffer::from_vector(src);
    cuda::DeviceBuffer di = cuda::DeviceBuffer::from_vector(idx);
    cuda::DeviceBuffer dp = cuda::DeviceBuffer::from_vector(pos);
    cuda::DeviceBuffer dd(static_cast<size_t>(F * count * row_bytes));
    cuda::DeviceBuffer dpos(static_cast<size_t>(F * count) * 4);
    cuda::gather_rows(ds.data(), F, n, row_bytes, di.as<int32_t>(), count, dd.data(),
                      dp.as<int32_t>(), 0, dpos.as<int32_t>());
    cuda::synchronize();
    const auto out = dd.to_vector<uint8_t>(static_cast<size_t>(F * count * row_bytes));
    const auto opos = dpos.to_vector<int32_t>(static_cast<size_t>(F * count));
    for (int64_t f = 0; f < F; ++f)
      for (int64_t i = 0; i < count; ++i) {
        const int32_t j = idx[static_cast<size_t>(f * count + i)];
        EXPECT_EQ(std::memcmp(out.data() + (f * count + i) * row_bytes,
                              src.data() + (f * n + j) * row_bytes, static_cast<size_t>(row_bytes)),
                  0);
        EXPECT_EQ(opos[static_cast<size_t>(f * count + i)], pos[static_cast<size_t>(f * n + j)]);
      }
  }
}

}  // namespace
}  // namespace vq
