// The opt-in bf16 matrix-product mode (kernels::Precision::kBF16, ForwardOptions::matmul):
// the fp32 -> bf16 rounding against hand-worked cases and the vector instruction against the
// scalar rule; matmul in bf16 mode against matmul_bf16_reference (activations rounded to bf16,
// products and sums in double) over ragged shapes (M 1, 2, 3, 7, 33, 512; K not a multiple of
// 32; N ragged; bias; row strides) on both dispatch paths (vdpbf16ps where the CPU has
// avx512_bf16, and the portable path, forced); integer-valued data where every order of
// summation is exact (results must be bit-identical to the reference); fp32/fp16 weights keep
// the exact path. End to end (tiny bf16 model): bf16 mode near the exact mode, chunked prefill ==
// one-shot and decode == last row of prefill within the bounds derived below.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <vector>

#include "ops/kernels.h"
#include "util/tiny_model.h"
#include "veloxquant/dtype.h"
#include "veloxquant/model.h"

namespace vq {
namespace {

constexpr double kU = 1.0 / 16777216.0;  // fp32 unit roundoff 2^-24

float bits_to_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
uint32_t f32_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}
float bf16_value(uint16_t h) {
  return bits_to_f32(static_cast<uint32_t>(h) << 16);
}

// Both dispatch paths where the CPU allows: {false} = vdpbf16ps (if present), {true} = portable.
std::vector<bool> paths() {
  std::vector<bool> p;
  kernels::force_portable_bf16(false);
  if (kernels::bf16_dot_active())
    p.push_back(false);
  else
    std::printf("  (this CPU or build has no avx512_bf16: only the portable path is tested)\n");
  p.push_back(true);
  return p;
}

struct PathGuard {  // restores the automatic dispatch when a test ends
  ~PathGuard() { kernels::force_portable_bf16(false); }
};

TEST(BF16Round, HandWorkedCases) {
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1). 1 + 3 * 2^-8 is halfway
  // between 1 + 2^-7 (odd) and 1 + 2^-6: up to the even one.
  EXPECT_EQ(kernels::bf16_round(1.0f), 0x3F80);
  EXPECT_EQ(kernels::bf16_round(1.0f + 0x1p-8f), 0x3F80);
  EXPECT_EQ(kernels::bf16_round(1.0f + 3 * 0x1p-8f), 0x3F82);
  EXPECT_EQ(kernels::bf16_round(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);  // above halfway: up
  EXPECT_EQ(kernels::bf16_round(-1.0f - 0x1p-8f - 0x1p-20f), 0xBF81);
  EXPECT_EQ(kernels::bf16_round(-0.0f), 0x8000);
  EXPECT_EQ(kernels::bf16_round(0x1p-130f), 0x0000);  // fp32 subnormal -> zero (as the insn)
  EXPECT_EQ(kernels::bf16_round(-0x1p-130f), 0x8000);
  EXPECT_EQ(kernels::bf16_round(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(kernels::bf16_round(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  const uint16_t nan = kernels::bf16_round(bits_to_f32(0x7F800001u));         // signalling NaN
  EXPECT_EQ(nan & 0x7FC0, 0x7FC0);                                            // quiet NaN
}

TEST(BF16Round, VectorEqualsScalarOnEveryPath) {
  PathGuard g;
  std::mt19937_64 rng(7);
  std::vector<float> x;
  for (int i = 0; i < 100000; ++i) x.push_back(bits_to_f32(static_cast<uint32_t>(rng())));
  for (uint32_t b : {0u, 0x80000000u, 0x00000001u, 0x807FFFFFu, 0x00800000u, 0x7F7FFFFFu,
                     0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u, 0x3F808000u, 0x3F818000u})
    x.push_back(bits_to_f32(b));
  for (int i = 0; i < 1000; ++i)  // exact halfway cases of every binade
    x.push_back(bits_to_f32((static_cast<uint32_t>(rng()) & 0xFFFF0000u) | 0x8000u));
  for (bool portable : paths()) {
    kernels::force_portable_bf16(portable);
    for (int64_t n : {static_cast<int64_t>(x.size()), int64_t{37}, int64_t{5}}) {
      std::vector<uint16_t> out(static_cast<size_t>(n));
      kernels::round_to_bf16(x.data(), n, out.data());
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(out[static_cast<size_t>(i)], kernels::bf16_round(x[static_cast<size_t>(i)]))
            << "portable " << portable << " input bits " << std::hex
            << f32_bits(x[static_cast<size_t>(i)]);
    }
  }
}

// Error bound of one output of the bf16 mode against the double reference on the same rounded
// activations. The products a_i w_i of two bf16 values are exact in fp32 (8 + 8 significand
// bits), so the only errors are the fp32 additions: a sum evaluated so that no term passes
// through more than d roundings errs by at most gamma_d * sum |terms| with
// gamma_d = d u / (1 - d u), u = 2^-24 (the bias counts as a term). vdpbf16ps adds the two
// products of a pair to a lane with at most two roundings. Orders (kernels.cpp):
// - packed (>= 4 tokens): one chain per output, bias first, K/2 pair steps: d = 2 ceil(K/2);
// - dot (1-3 tokens): a lane takes at most ceil(K/32) pair steps, then 4 accumulators
//   (2 levels), the 16-lane sum (4 levels) and the bias: d = 2 ceil(K/32) + 7;
// - portable: the exact kernels' orders on the rounded activations (their bound in
//   test_forward: d = K + 7).
// vdpbf16ps flushes subnormal inputs and results to zero: each flush moves a sum by less than
// 2^-126, at most d times; the reference's own rounding to fp32 adds u |ref|.
double bound(int64_t k, int64_t m, bool portable, double abs_sum, double ref) {
  const int64_t d = portable ? k + 7 : m >= 4 ? 2 * ((k + 1) / 2) : 2 * ((k + 31) / 32) + 7;
  const double gamma = d * kU / (1 - d * kU);
  return gamma * abs_sum + kU * std::abs(ref) + d * 0x1p-126;
}

// Weights [n, k] in dtype dt from fp32 values (rounded to nearest by from_f32).
std::vector<uint16_t> to16(const std::vector<float>& w, DType dt) {
  std::vector<uint16_t> out(w.size());
  from_f32(w.data(), out.data(), dt, w.size());
  return out;
}

TEST(MatmulBF16, MatchesReferenceOverRaggedShapesOnEveryPath) {
  PathGuard g;
  std::mt19937_64 rng(123);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  double worst = 0;
  for (bool portable : paths()) {
    kernels::force_portable_bf16(portable);
    for (int64_t M : {1, 2, 3, 7, 33, 512})
      for (int64_t K : {1, 5, 31, 33, 67, 200, 1100})
        for (int64_t N : {1, 17, 45}) {
          if (M == 512 && K == 1100 && N == 45) continue;  // the reference's cost, not coverage
          const int64_t ldx = K + 3, ldy = N + 2;
          std::vector<float> x(static_cast<size_t>(M * ldx)), wf(static_cast<size_t>(N * K));
          std::vector<float> bias(static_cast<size_t>(N));
          for (auto& v : x) v = nd(rng);
          for (auto& v : wf) v = 0.1f * nd(rng);
          for (auto& v : bias) v = nd(rng);
          const std::vector<uint16_t> w = to16(wf, DType::kBF16);
          for (bool with_bias : {false, true}) {
            const float* b = with_bias ? bias.data() : nullptr;
            std::vector<float> y(static_cast<size_t>(M * ldy), -7.0f), r(y);
            kernels::matmul(x.data(), M, K, ldx, w.data(), DType::kBF16, N, b, y.data(), ldy,
                            kernels::Precision::kBF16);
            kernels::matmul_bf16_reference(x.data(), M, K, ldx, w.data(), DType::kBF16, N, b,
                                           r.data(), ldy);
            for (int64_t t = 0; t < M; ++t) {
              for (int64_t n = 0; n < N; ++n) {
                double abs_sum = b ? std::abs(b[n]) : 0.0;
                for (int64_t i = 0; i < K; ++i)
                  abs_sum += std::abs(static_cast<double>(bf16_value(kernels::bf16_round(
                                          x[static_cast<size_t>(t * ldx + i)]))) *
                                      bf16_value(w[static_cast<size_t>(n * K + i)]));
                const size_t at = static_cast<size_t>(t * ldy + n);
                const double tol = bound(K, M, portable, abs_sum, r[at]);
                const double err = std::abs(static_cast<double>(y[at]) - r[at]);
                worst = std::max(worst, err / tol);
                ASSERT_LE(err, tol) << "portable " << portable << " M " << M << " K " << K << " N "
                                    << N << " bias " << with_bias << " t " << t << " n " << n;
              }
              for (int64_t n = N; n < ldy; ++n)  // the row stride's gap is left alone
                ASSERT_EQ(y[static_cast<size_t>(t * ldy + n)], -7.0f);
            }
          }
        }
  }
  std::printf("  worst error: %.1f%% of the bound\n", 100 * worst);
}

// Small integers: every product and partial sum is an integer below 2^24, so any summation
// order is exact and the result must equal the reference bit for bit (an indexing, tail or
// packing slip cannot hide under a tolerance). Activations with a fraction below half a bf16 ulp
// (e.g. 3 + 2^-9) must round back to the integer first.
TEST(MatmulBF16, IntegerDataIsExactOnEveryPath) {
  PathGuard g;
  std::mt19937_64 rng(5);
  for (bool portable : paths()) {
    kernels::force_portable_bf16(portable);
    for (int64_t M : {1, 3, 4, 13, 100})
      for (int64_t K : {7, 32, 45, 129, 300, 5000})
        for (int64_t N : {3, 32, 70}) {
          std::vector<float> x(static_cast<size_t>(M * K)), wf(static_cast<size_t>(N * K));
          std::vector<float> bias(static_cast<size_t>(N));
          for (auto& v : x)
            v = static_cast<float>(static_cast<int>(rng() % 17) - 8) + 0x1p-9f;  // |.| <= 8
          for (auto& v : wf) v = static_cast<float>(static_cast<int>(rng() % 17) - 8);
          for (auto& v : bias) v = static_cast<float>(static_cast<int>(rng() % 101) - 50);
          const std::vector<uint16_t> w = to16(wf, DType::kBF16);
          std::vector<float> y(static_cast<size_t>(M * N)), r(y);
          kernels::matmul(x.data(), M, K, K, w.data(), DType::kBF16, N, bias.data(), y.data(), N,
                          kernels::Precision::kBF16);
          kernels::matmul_bf16_reference(x.data(), M, K, K, w.data(), DType::kBF16, N, bias.data(),
                                         r.data(), N);
          for (size_t i = 0; i < y.size(); ++i)
            ASSERT_EQ(y[i], r[i]) << "portable " << portable << " M " << M << " K " << K << " N "
                                  << N << " at " << i;
        }
  }
}

// fp32 and fp16 weights keep the exact arithmetic in bf16 mode; in a mixed matmul_multi the
// bf16 output equals its own single call and the others equal the exact call, bit for bit.
TEST(MatmulBF16, OtherDtypesStayExactAndMultiEqualsSingle) {
  PathGuard g;
  std::mt19937_64 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t K = 77, N = 29;
  std::vector<float> wf(static_cast<size_t>(N * K));
  for (auto& v : wf) v = nd(rng);
  const std::vector<uint16_t> wh = to16(wf, DType::kF16), wb = to16(wf, DType::kBF16);
  for (bool portable : paths()) {
    kernels::force_portable_bf16(portable);
    for (int64_t M : {1, 3, 9, 40}) {
      std::vector<float> x(static_cast<size_t>(M * K));
      for (auto& v : x) v = nd(rng);
      const size_t sz = static_cast<size_t>(M * N);
      std::vector<float> y32(sz), y16(sz), yb(sz), e32(sz), e16(sz), sb(sz);
      const kernels::MatmulOut outs[3] = {{wf.data(), DType::kF32, N, nullptr, y32.data(), N},
                                          {wb.data(), DType::kBF16, N, nullptr, yb.data(), N},
                                          {wh.data(), DType::kF16, N, nullptr, y16.data(), N}};
      kernels::matmul_multi(x.data(), M, K, K, outs, 3, kernels::Precision::kBF16);
      kernels::matmul(x.data(), M, K, K, wf.data(), DType::kF32, N, nullptr, e32.data(), N);
      kernels::matmul(x.data(), M, K, K, wh.data(), DType::kF16, N, nullptr, e16.data(), N);
      kernels::matmul(x.data(), M, K, K, wb.data(), DType::kBF16, N, nullptr, sb.data(), N,
                      kernels::Precision::kBF16);
      for (size_t i = 0; i < sz; ++i) {
        ASSERT_EQ(y32[i], e32[i]) << "M " << M << " at " << i;
        ASSERT_EQ(y16[i], e16[i]) << "M " << M << " at " << i;
        ASSERT_EQ(yb[i], sb[i]) << "M " << M << " at " << i;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// end to end on a tiny bf16 model

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return ids;
}

std::vector<float> run_chunks(const Model& m, const std::vector<int32_t>& ids,
                              const std::vector<int64_t>& chunks, MatmulPrecision mp) {
  CacheConfig cfg;
  cfg.method = "full";
  auto caches = m.make_caches(cfg);
  ForwardOptions fo;
  fo.kv_dtype = DType::kF32;
  fo.logits = ForwardOptions::Logits::kAll;
  fo.matmul = mp;
  std::vector<float> all, part;
  for (size_t i = 0, done = 0; i < chunks.size(); done += static_cast<size_t>(chunks[i]), ++i) {
    m.forward(ids.data() + done, 1, chunks[i], caches, fo, &part);
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

float max_abs(const std::vector<float>& v) {
  float mx = 0;
  for (float x : v) mx = std::max(mx, std::abs(x));
  return mx;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, static_cast<double>(std::abs(a[i] - b[i])));
  return worst;
}

test::TinyModelSpec bf16_spec() {
  test::TinyModelSpec s;
  s.dtype = DType::kBF16;
  return s;
}

// Allowances. Rounding an activation to bf16 moves it by at most half a bf16 ulp, 2^-8
// relative, so against the exact mode each product stage errs by <= (2^-8 + (K + 7) u) of its
// terms' magnitude (K <= 88 here, the second term is < 2^-17). Two layers chain ~12 stages with
// a gain of a few, the same budget as test_forward's (16 x the per-stage relative error, of the
// largest |logit|): 16 * 2^-8 * max|logit|. Between two bf16-mode runs whose fp32 sums differ
// in order (chunks of 1-3 tokens take the dot path), an activation differing by a few u can
// round to a neighbouring bf16 value: one bf16 ulp (2^-7 relative) at worst, so the same chain
// gives 16 * 2^-7 * max|logit| (a worst case; the printed use is far below it).
constexpr double kVsExact = 16 * 0x1p-8;
constexpr double kBetweenOrders = 16 * 0x1p-7;

TEST(ForwardBF16, FP32WeightsAreUnchangedAndBF16WeightsChangeWithinBound) {
  PathGuard g;
  {  // fp32 weights: the bf16 mode is the exact mode
    const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-bf16"));
    const auto m = Model::load(dir);
    const auto ids = random_ids(30, 320, 1);
    EXPECT_EQ(run_chunks(*m, ids, {30}, MatmulPrecision::kBF16),
              run_chunks(*m, ids, {30}, MatmulPrecision::kExact));
    std::filesystem::remove_all(dir);
  }
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-bf16"), bf16_spec());
  const auto m = Model::load(dir);
  const auto ids = random_ids(45, 320, 2);
  const std::vector<float> exact = run_chunks(*m, ids, {45}, MatmulPrecision::kExact);
  for (bool portable : paths()) {
    kernels::force_portable_bf16(portable);
    const std::vector<float> bf = run_chunks(*m, ids, {45}, MatmulPrecision::kBF16);
    ASSERT_EQ(bf.size(), exact.size());
    const double d = max_diff(bf, exact), tol = kVsExact * max_abs(exact);
    EXPECT_GT(d, 0.0) << "the bf16 mode changed nothing: not engaged?";
    EXPECT_LE(d, tol);
    std::printf("  portable %d: bf16 vs exact max |difference| %.3g (%.2f%% of the allowance)\n",
                static_cast<int>(portable), d, 100 * d / tol);
  }
  std::filesystem::remove_all(dir);
}

TEST(ForwardBF16, ChunkedPrefillEqualsOneShotAndPathsAgree) {
  PathGuard g;
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-bf16"), bf16_spec());
  const auto m = Model::load(dir);
  const auto ids = random_ids(75, 320, 3);
  std::vector<std::vector<float>> one_shots;
  for (bool portable : paths()) {
    kernels::force_portable_bf16(portable);
    const std::vector<float> one = run_chunks(*m, ids, {75}, MatmulPrecision::kBF16);
    one_shots.push_back(one);
    const double tol = kBetweenOrders * max_abs(one);
    for (const std::vector<int64_t>& chunks : std::vector<std::vector<int64_t>>{
             {1, 74}, {32, 32, 11}, {10, 20, 30, 15}, {74, 1}, std::vector<int64_t>(75, 1)}) {
      const std::vector<float> got = run_chunks(*m, ids, chunks, MatmulPrecision::kBF16);
      ASSERT_EQ(got.size(), one.size());
      const double d = max_diff(got, one);
      EXPECT_LE(d, tol) << "portable " << portable << ", " << chunks.size() << " chunks";
      std::printf("  portable %d, %zu chunks: max |difference| %.3g (%.2f%% of the allowance)\n",
                  static_cast<int>(portable), chunks.size(), d, 100 * d / tol);
    }
  }
  if (one_shots.size() == 2) {  // vdpbf16ps vs portable: same products, other fp32 orders
    const double d = max_diff(one_shots[0], one_shots[1]);
    EXPECT_LE(d, kBetweenOrders * max_abs(one_shots[0]));
    std::printf("  vdpbf16ps vs portable: max |difference| %.3g\n", d);
  }
  std::filesystem::remove_all(dir);
}

TEST(ForwardBF16, DecodeAfterPrefillEqualsLastRowOfWholePrefill) {
  PathGuard g;
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-bf16"), bf16_spec());
  const auto m = Model::load(dir);
  const auto ids = random_ids(50, 320, 8);
  for (bool portable : paths()) {
    kernels::force_portable_bf16(portable);
    const std::vector<float> whole = run_chunks(*m, ids, {50}, MatmulPrecision::kBF16);
    CacheConfig cfg;
    cfg.method = "full";
    auto caches = m->make_caches(cfg);
    ForwardOptions fo;
    fo.kv_dtype = DType::kF32;
    fo.matmul = MatmulPrecision::kBF16;
    fo.logits = ForwardOptions::Logits::kNone;
    m->forward(ids.data(), 1, 49, caches, fo, nullptr);
    fo.logits = ForwardOptions::Logits::kLast;
    std::vector<float> last;
    m->forward(ids.data() + 49, 1, 1, caches, fo, &last);
    ASSERT_EQ(last.size(), 320u);
    const std::vector<float> row(whole.begin() + 49 * 320, whole.end());
    const double d = max_diff(last, row), tol = kBetweenOrders * max_abs(last);
    EXPECT_LE(d, tol) << "portable " << portable;
    std::printf(
        "  portable %d: decode vs prefill row max |difference| %.3g (%.2f%% of allowance)\n",
        static_cast<int>(portable), d, 100 * d / tol);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace vq
