// Query-weighted key rounding (veloxquant/key_rounding.h) and the query-moment file
// (veloxquant/query_moments.h): the factor inverts the damped moments, moments move with the
// rotation and permutation, isotropic moments give the round-to-nearest codes (metamorphic),
// the codes equal an independent implementation of the same greedy order (the inverse-Hessian
// form of GPTQ, not the Cholesky form the library uses), feedback lowers the weighted error it
// is for, only codes change in the records, and hostile files are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "util/test_util.h"
#include "veloxquant/error.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/hadamard.h"
#include "veloxquant/key_rounding.h"
#include "veloxquant/packed.h"
#include "veloxquant/query_moments.h"

namespace vq {
namespace {

using test::aniso_moments;

std::vector<float> random_rows(int64_t n, int64_t d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * d));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < d; ++c) x[t * d + c] = nd(rng) * (0.2f + 0.05f * (c % 7)) + 0.1f * c;
  return x;
}

// Per-channel grids of a chunk and its round-to-nearest codes [d, n] (the quantizer's own).
struct Grid {
  std::vector<float> lo, sc;
  std::vector<uint8_t> ct;
};
Grid channel_grid(const std::vector<float>& x, int64_t n, int64_t d, double bits) {
  std::vector<float> xt(static_cast<size_t>(d * n));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < d; ++c) xt[c * n + t] = x[t * d + c];
  GroupQuantParams p;
  p.bits = bits;
  p.group_size = n;
  p.meta = MetaType::kF16;
  Grid g;
  g.lo.resize(static_cast<size_t>(d));
  g.sc.resize(static_cast<size_t>(d));
  g.ct.resize(static_cast<size_t>(d * n));
  group_quantize_reference(xt.data(), d, n, p, g.ct.data(), g.lo.data(), g.sc.data());
  return g;
}

double weighted_error(const std::vector<float>& x, const Grid& g, const std::vector<uint8_t>& ct,
                      const std::vector<double>& m, int64_t n, int64_t d) {
  double total = 0.0;
  std::vector<double> e(static_cast<size_t>(d));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < d; ++c)
      e[c] = x[t * d + c] - (static_cast<double>(ct[c * n + t]) * g.sc[c] + g.lo[c]);
    for (int64_t i = 0; i < d; ++i)
      for (int64_t j = 0; j < d; ++j) total += e[i] * m[i * d + j] * e[j];
  }
  return total;
}

TEST(KeyRounding, FactorInvertsTheDampedMoments) {
  for (int64_t d : {1, 8, 64, 128}) {
    const std::vector<double> m = aniso_moments(d, 3 + d);
    const std::vector<double> u = key_rounding_factor(m.data(), d);
    double mean = 0.0;
    for (int64_t i = 0; i < d; ++i) mean += m[i * d + i] / static_cast<double>(d);
    // (U^T U) A = I: U upper triangular with a positive diagonal.
    for (int64_t i = 0; i < d; ++i) {
      EXPECT_GT(u[i * d + i], 0.0);
      for (int64_t j = 0; j < i; ++j) EXPECT_EQ(u[i * d + j], 0.0);
    }
    double worst = 0.0;
    for (int64_t i = 0; i < d; ++i)
      for (int64_t j = 0; j < d; ++j) {
        double s = 0.0;
        for (int64_t k = 0; k < d; ++k) {
          double uu = 0.0;  // (U^T U)_ik
          for (int64_t r = 0; r <= std::min(i, k); ++r) uu += u[r * d + i] * u[r * d + k];
          s += uu * (m[k * d + j] + (k == j ? kKeyRoundingDamp * mean : 0.0));
        }
        worst = std::max(worst, std::abs(s - (i == j ? 1.0 : 0.0)));
      }
    // A's condition number is below 1 / damp = 100 relative to its mean eigenvalue scale; fp64
    // Cholesky and triangular inverses lose about cond * d * 2^-53 (< 1e-10 here).
    EXPECT_LT(worst, 1e-9) << "d " << d;
  }
}

TEST(KeyRounding, RefusesMomentsItCannotUse) {
  std::vector<double> m = aniso_moments(4, 1);
  m[5] = 0.0;  // diagonal entry (1, 1)
  EXPECT_THROW(key_rounding_factor(m.data(), 4), Error);
  m = aniso_moments(4, 1);
  m[2] = std::nan("");
  EXPECT_THROW(key_rounding_factor(m.data(), 4), Error);
  // Symmetric, positive diagonal, but indefinite even after damping.
  const std::vector<double> bad{1.0, 5.0, 5.0, 1.0};
  try {
    key_rounding_factor(bad.data(), 2);
    ADD_FAILURE() << "an indefinite matrix was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("positive definite"), std::string::npos) << e.what();
  }
}

TEST(KeyRounding, StoredOrderMomentsFollowTheTransform) {
  const int64_t d = 64;
  const std::vector<double> m = aniso_moments(d, 9);
  const std::vector<float> signs = hadamard_signs(77, d);
  std::vector<int32_t> perm(static_cast<size_t>(d));
  for (int64_t j = 0; j < d; ++j) perm[j] = static_cast<int32_t>((j * 29 + 3) % d);
  const std::vector<double> ms =
      stored_order_moments(m.data(), d, signs.data(), hadamard_block(d), perm.data());
  // For any x, y: (T x)^T m' (T y) = x^T m y, T = P R (R applied by hadamard_rotate in fp32).
  const std::vector<float> x = random_rows(2, d, 5);
  std::vector<float> tx[2];
  for (int r = 0; r < 2; ++r) {
    std::vector<float> v(x.begin() + r * d, x.begin() + (r + 1) * d);
    hadamard_rotate(v.data(), signs.data(), d, hadamard_block(d));
    tx[r].resize(static_cast<size_t>(d));
    for (int64_t j = 0; j < d; ++j) tx[r][j] = v[perm[j]];
  }
  double lhs = 0.0, rhs = 0.0, mag = 0.0;
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < d; ++j) {
      lhs += tx[0][i] * ms[i * d + j] * tx[1][j];
      rhs += static_cast<double>(x[i]) * m[i * d + j] * x[d + j];
      mag += std::abs(static_cast<double>(x[i]) * m[i * d + j] * x[d + j]);
    }
  // fp32 rotations of x (and of R's columns): relative errors of a few 2^-24 per entry.
  EXPECT_LT(std::abs(lhs - rhs), 1e-5 * mag);
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < d; ++j) EXPECT_EQ(ms[i * d + j], ms[j * d + i]);
}

TEST(KeyRounding, IsotropicMomentsGiveTheNearestCodes) {
  const int64_t n = 32, d = 64;
  for (double bits : {2.0, 1.5, 4.0}) {
    const std::vector<float> x = random_rows(n, d, 11);
    const PackedRowFormat f = make_channel_row_format(d, bits, n, MetaType::kFP8E4M3);
    GroupQuantParams p;
    p.bits = bits;
    p.meta = MetaType::kFP8E4M3;
    std::vector<double> iso(static_cast<size_t>(d * d), 0.0);
    for (int64_t i = 0; i < d; ++i) iso[i * d + i] = 2.5;
    const std::vector<double> u = key_rounding_factor(iso.data(), d);
    std::vector<uint8_t> plain(static_cast<size_t>(n * f.row_stride)), fb(plain.size());
    quantize_chunk_to_records(x.data(), n, f, p, plain.data(), f.row_stride);
    quantize_chunk_to_records(x.data(), n, f, p, fb.data(), f.row_stride, u.data());
    EXPECT_EQ(plain, fb) << "bits " << bits;
  }
}

// The same greedy order in the inverse-Hessian form: after channel i is rounded, its error
// (w_i - q_i) / Hinv_ii moves onto the other channels along Hinv's column i, and Hinv loses
// row and column i (a Schur complement). Equal to the Cholesky form in exact arithmetic.
std::vector<uint8_t> inverse_form_codes(const std::vector<float>& x, const Grid& g,
                                        const std::vector<double>& m, int64_t n, int64_t d,
                                        int levels) {
  double mean = 0.0;
  for (int64_t i = 0; i < d; ++i) mean += m[i * d + i] / static_cast<double>(d);
  // Hinv = (m + damp mean I)^-1 by Gauss-Jordan elimination.
  std::vector<double> a(m), inv(static_cast<size_t>(d * d), 0.0);
  for (int64_t i = 0; i < d; ++i) {
    a[i * d + i] += kKeyRoundingDamp * mean;
    inv[i * d + i] = 1.0;
  }
  for (int64_t c = 0; c < d; ++c) {
    const double piv = a[c * d + c];
    for (int64_t j = 0; j < d; ++j) {
      a[c * d + j] /= piv;
      inv[c * d + j] /= piv;
    }
    for (int64_t r = 0; r < d; ++r) {
      if (r == c) continue;
      const double f = a[r * d + c];
      for (int64_t j = 0; j < d; ++j) {
        a[r * d + j] -= f * a[c * d + j];
        inv[r * d + j] -= f * inv[c * d + j];
      }
    }
  }
  std::vector<uint8_t> ct(g.ct);
  for (int64_t t = 0; t < n; ++t) {
    std::vector<double> h(inv), w(static_cast<size_t>(d));
    for (int64_t c = 0; c < d; ++c) w[c] = x[t * d + c];
    for (int64_t i = 0; i < d; ++i) {
      double c = std::nearbyint((w[i] - g.lo[i]) / static_cast<double>(g.sc[i]));
      c = std::min<double>(std::max(c, 0.0), levels);
      ct[i * n + t] = static_cast<uint8_t>(c);
      const double e = (w[i] - (c * g.sc[i] + g.lo[i])) / h[i * d + i];
      for (int64_t j = i + 1; j < d; ++j) w[j] -= e * h[i * d + j];
      for (int64_t r = i + 1; r < d; ++r)  // drop row / column i
        for (int64_t s = i + 1; s < d; ++s)
          h[r * d + s] -= h[r * d + i] * h[i * d + s] / h[i * d + i];
    }
  }
  return ct;
}

// The library's 2-bit feedback codes [d, n] of x on g's grids under moments m.
std::vector<uint8_t> feedback_codes(const std::vector<float>& x, const Grid& g,
                                    const std::vector<double>& m, int64_t n, int64_t d) {
  const std::vector<double> u = key_rounding_factor(m.data(), d);
  std::vector<uint8_t> ct(g.ct);
  key_feedback_codes(x.data(), n, d, g.lo.data(), g.sc.data(), 3, u.data(), ct.data());
  return ct;
}

TEST(KeyRounding, CodesEqualTheInverseHessianForm) {
  const int64_t n = 48, d = 32;
  int64_t changed = 0;
  for (uint64_t seed = 0; seed < 4; ++seed) {
    const std::vector<float> x = random_rows(n, d, 100 + seed);
    const std::vector<double> m = aniso_moments(d, 200 + seed);
    const Grid g = channel_grid(x, n, d, 2);
    const std::vector<uint8_t> ct = feedback_codes(x, g, m, n, d);
    // The two forms round the same quantities through different fp64 operations; a code could
    // differ only where (w - lo) / s lands within ~1e-12 of a half-integer (none does here).
    EXPECT_EQ(ct, inverse_form_codes(x, g, m, n, d, 3)) << "seed " << seed;
    for (size_t i = 0; i < ct.size(); ++i) changed += ct[i] != g.ct[i];
  }
  EXPECT_GT(changed, 0) << "feedback changed no code: the test would not see a wrong order";
}

TEST(KeyRounding, FeedbackLowersTheWeightedErrorAndKeepsTheMetadata) {
  const int64_t n = 32, d = 64;
  double nearest = 0.0, feedback = 0.0;
  for (uint64_t seed = 0; seed < 8; ++seed) {
    const std::vector<float> x = random_rows(n, d, 300 + seed);
    const std::vector<double> m = aniso_moments(d, 400 + seed);
    const Grid g = channel_grid(x, n, d, 2);
    const std::vector<double> u = key_rounding_factor(m.data(), d);
    const std::vector<uint8_t> ct = feedback_codes(x, g, m, n, d);
    nearest += weighted_error(x, g, g.ct, m, n, d);
    feedback += weighted_error(x, g, ct, m, n, d);

    // Records: the same metadata bytes, codes from the feedback.
    const PackedRowFormat f = make_channel_row_format(d, 2, n, MetaType::kF16);
    GroupQuantParams p;
    p.bits = 2;
    std::vector<uint8_t> plain(static_cast<size_t>(n * f.row_stride)), fb(plain.size());
    quantize_chunk_to_records(x.data(), n, f, p, plain.data(), f.row_stride);
    quantize_chunk_to_records(x.data(), n, f, p, fb.data(), f.row_stride, u.data());
    bool codes_differ = false;
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* a = plain.data() + t * f.row_stride;
      const uint8_t* b = fb.data() + t * f.row_stride;
      EXPECT_TRUE(std::equal(a + f.code_bytes, a + f.row_stride, b + f.code_bytes)) << t;
      codes_differ = codes_differ || !std::equal(a, a + f.code_bytes, b);
    }
    EXPECT_TRUE(codes_differ) << "seed " << seed;
  }
  // Measured 0.047x here (moments of effective rank ~6 in 64 channels: most of the error can
  // move where no query looks); a sign error in the update gave 3.3x. The greedy order promises
  // no bound, so the check is the direction with a wide margin.
  EXPECT_LT(feedback, 0.6 * nearest) << "nearest " << nearest << " feedback " << feedback;
}

// ---- the query-moment file -----------------------------------------------------------------

QueryMomentSet small_set() {
  QueryMomentSet s;
  s.n_kv_heads = 2;
  s.head_dim = 4;
  s.n_tokens = 10;
  for (int l = 0; l < 3; ++l) {
    std::vector<double> layer;
    for (int h = 0; h < 2; ++h) {
      const std::vector<double> m = aniso_moments(4, 10 * l + h);
      layer.insert(layer.end(), m.begin(), m.end());
    }
    s.layers.push_back(layer);
  }
  return s;
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void expect_load_refused(const std::string& path, const std::string& needle) {
  try {
    load_query_moment_file(path);
    ADD_FAILURE() << "expected a vq::Error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(QueryMomentFile, RoundTripsExactly) {
  const std::string path = ::testing::TempDir() + "qm_roundtrip.bin";
  const QueryMomentSet s = small_set();
  save_query_moment_file(path, s);
  const QueryMomentSet r = load_query_moment_file(path);
  EXPECT_EQ(r.n_kv_heads, 2);
  EXPECT_EQ(r.head_dim, 4);
  EXPECT_EQ(r.n_tokens, 10);
  EXPECT_EQ(r.layers, s.layers);
  std::remove(path.c_str());
}

TEST(QueryMomentFile, HostileFilesAreRefusedByName) {
  const std::string path = ::testing::TempDir() + "qm_hostile.bin";
  save_query_moment_file(path, small_set());
  const std::string good = read_all(path);
  expect_load_refused(::testing::TempDir() + "qm_missing.bin", "could not open");
  write_all(path, "not a moment file at all, long enough to hold a header");
  expect_load_refused(path, "magic VQQMOMNT");
  write_all(path, good.substr(0, good.size() - 9));
  expect_load_refused(path, "truncated or extended");
  std::string flipped = good;
  flipped[60] = static_cast<char>(flipped[60] ^ 1);
  write_all(path, flipped);
  expect_load_refused(path, "checksum");
  std::string big = good;
  big[20] = 0x7f;  // the layer count's high byte: sizes beyond any file
  write_all(path, big);
  expect_load_refused(path, "expected");
  std::remove(path.c_str());

  // The writer refuses what the reader would: nothing is written.
  QueryMomentSet s = small_set();
  s.layers[1][1] += 1.0;  // (0, 1) no longer equals (1, 0)
  EXPECT_THROW(save_query_moment_file(path, s), Error);
  s = small_set();
  s.layers[2][0] = -1.0;
  EXPECT_THROW(save_query_moment_file(path, s), Error);
  s = small_set();
  s.layers[0].pop_back();
  EXPECT_THROW(save_query_moment_file(path, s), Error);
  EXPECT_FALSE(std::ifstream(path).good());
}

}  // namespace
}  // namespace vq
