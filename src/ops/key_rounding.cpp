// Query-weighted rounding of channel-axis key rows: the Cholesky factor, the moments in the
// stored channel order and the feedback loop of veloxquant/key_rounding.h.
#include "veloxquant/key_rounding.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "veloxquant/error.h"
#include "veloxquant/hadamard.h"

namespace vq {

namespace {

// Lower Cholesky factor l of the symmetric a (l l^T = a); false when a is not positive definite.
bool cholesky_lower(const std::vector<double>& a, int64_t d, std::vector<double>& l) {
  l.assign(static_cast<size_t>(d * d), 0.0);
  for (int64_t j = 0; j < d; ++j) {
    double s = a[static_cast<size_t>(j * d + j)];
    for (int64_t k = 0; k < j; ++k) s -= l[j * d + k] * l[j * d + k];
    if (!(s > 0.0) || !std::isfinite(s)) return false;
    const double ljj = std::sqrt(s);
    l[static_cast<size_t>(j * d + j)] = ljj;
    for (int64_t i = j + 1; i < d; ++i) {
      double t = a[static_cast<size_t>(i * d + j)];
      for (int64_t k = 0; k < j; ++k) t -= l[i * d + k] * l[j * d + k];
      l[static_cast<size_t>(i * d + j)] = t / ljj;
    }
  }
  return true;
}

}  // namespace

std::vector<double> key_rounding_factor(const double* m, int64_t d, double damp) {
  VQ_CHECK(d >= 1 && m != nullptr,
           "[key_rounding_factor] expected d >= 1 and moments but got d = " + std::to_string(d));
  VQ_CHECK(damp > 0.0 && std::isfinite(damp),
           "[key_rounding_factor] expected a damping > 0 but got " + std::to_string(damp));
  double mean = 0.0;
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < d; ++j)
      VQ_CHECK(std::isfinite(m[i * d + j]),
               "[key_rounding_factor] expected finite query moments but entry (" +
                   std::to_string(i) + ", " + std::to_string(j) + ") is not");
    VQ_CHECK(m[i * d + i] > 0.0,
             "[key_rounding_factor] expected positive diagonal moments but "
             "entry (" +
                 std::to_string(i) + ", " + std::to_string(i) + ") is " +
                 std::to_string(m[i * d + i]));
    mean += m[i * d + i];
  }
  mean /= static_cast<double>(d);
  std::vector<double> a(m, m + d * d), l, li(static_cast<size_t>(d * d), 0.0), inv(a.size());
  for (int64_t i = 0; i < d; ++i) a[static_cast<size_t>(i * d + i)] += damp * mean;
  VQ_CHECK(cholesky_lower(a, d, l),
           "[key_rounding_factor] expected positive definite (damped) query moments but the "
           "Cholesky factorisation failed");
  // li = l^-1 (lower), then A^-1 = li^T li.
  for (int64_t i = 0; i < d; ++i) {
    li[static_cast<size_t>(i * d + i)] = 1.0 / l[static_cast<size_t>(i * d + i)];
    for (int64_t j = 0; j < i; ++j) {
      double s = 0.0;
      for (int64_t k = j; k < i; ++k) s += l[i * d + k] * li[k * d + j];
      li[static_cast<size_t>(i * d + j)] = -s / l[static_cast<size_t>(i * d + i)];
    }
  }
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      double s = 0.0;
      for (int64_t k = i; k < d; ++k) s += li[k * d + i] * li[k * d + j];
      inv[static_cast<size_t>(i * d + j)] = s;
      inv[static_cast<size_t>(j * d + i)] = s;
    }
  VQ_CHECK(cholesky_lower(inv, d, l),
           "[key_rounding_factor] expected a positive definite inverse but its Cholesky "
           "factorisation failed (query moments too ill-conditioned)");
  std::vector<double> u(static_cast<size_t>(d * d), 0.0);
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = i; j < d; ++j) u[static_cast<size_t>(i * d + j)] = l[j * d + i];
  return u;
}

std::vector<double> stored_order_moments(const double* m, int64_t d, const float* signs,
                                         int64_t rot_block, const int32_t* perm) {
  std::vector<double> r(static_cast<size_t>(d * d), 0.0);  // r[i, j] = R_ij
  if (signs != nullptr) {
    std::vector<float> e(static_cast<size_t>(d));
    for (int64_t j = 0; j < d; ++j) {
      std::fill(e.begin(), e.end(), 0.0f);
      e[static_cast<size_t>(j)] = 1.0f;
      hadamard_rotate(e.data(), signs, d, rot_block);
      for (int64_t i = 0; i < d; ++i) r[static_cast<size_t>(i * d + j)] = e[static_cast<size_t>(i)];
    }
  } else {
    for (int64_t i = 0; i < d; ++i) r[static_cast<size_t>(i * d + i)] = 1.0;
  }
  std::vector<double> rm(static_cast<size_t>(d * d), 0.0), out(static_cast<size_t>(d * d));
  for (int64_t i = 0; i < d; ++i)
    for (int64_t k = 0; k < d; ++k) {
      const double rik = r[static_cast<size_t>(i * d + k)];
      if (rik == 0.0) continue;
      for (int64_t j = 0; j < d; ++j) rm[static_cast<size_t>(i * d + j)] += rik * m[k * d + j];
    }
  for (int64_t a = 0; a < d; ++a) {
    const int64_t i = perm ? perm[a] : a;
    for (int64_t b = a; b < d; ++b) {
      const int64_t j = perm ? perm[b] : b;
      double s = 0.0;  // (R m R^T)_ij
      for (int64_t k = 0; k < d; ++k) s += rm[i * d + k] * r[j * d + k];
      out[static_cast<size_t>(a * d + b)] = s;
      out[static_cast<size_t>(b * d + a)] = s;
    }
  }
  return out;
}

void key_feedback_codes(const float* x, int64_t n, int64_t d, const float* lo, const float* scale,
                        int levels, const double* u, uint8_t* codes_t) {
  std::vector<double> w(static_cast<size_t>(d));
  const double top = static_cast<double>(levels);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < d; ++c) w[static_cast<size_t>(c)] = x[t * d + c];
    for (int64_t i = 0; i < d; ++i) {
      const double r = (w[static_cast<size_t>(i)] - lo[i]) / static_cast<double>(scale[i]);
      if (!std::isfinite(r)) continue;  // the round-to-nearest code stays, nothing fed back
      double c = std::nearbyint(r);
      c = c < 0.0 ? 0.0 : (c > top ? top : c);
      codes_t[i * n + t] = static_cast<uint8_t>(c);
      const double e =
          (w[static_cast<size_t>(i)] - (c * static_cast<double>(scale[i]) + lo[i])) / u[i * d + i];
      for (int64_t j = i + 1; j < d; ++j) w[static_cast<size_t>(j)] -= e * u[i * d + j];
    }
  }
}

}  // namespace vq
