// Token selection from logits [vocab] fp32: argmax and the seeded temperature / top-k / top-p
// sampler (see generate.h). Probabilities are computed in double; the uniform draw takes the top
// 53 bits of a std::mt19937_64 output, so a seed gives the same tokens on every platform.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "veloxquant/error.h"
#include "veloxquant/generate.h"

namespace vq {

int32_t argmax(const float* logits, int64_t n) {
  VQ_CHECK(n >= 1, "[argmax] expected at least one logit but got " + std::to_string(n));
  int64_t best = 0;
  float best_v = -std::numeric_limits<float>::infinity();
  bool found = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = logits[i];
    if (std::isnan(v)) continue;
    if (!found || v > best_v) {
      best = i;
      best_v = v;
      found = true;
    }
  }
  return static_cast<int32_t>(best);
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {
  VQ_CHECK(std::isfinite(p.temperature),
           "[sampler] expected a finite temperature but got " + std::to_string(p.temperature));
  VQ_CHECK(p.top_k >= 0, "[sampler] top_k: expected >= 0 but got " + std::to_string(p.top_k));
  VQ_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f,
           "[sampler] top_p: expected a value in (0, 1] but got " + std::to_string(p.top_p));
}

std::vector<double> Sampler::distribution(const float* logits, int64_t n) const {
  VQ_CHECK(n >= 1, "[sampler] expected at least one logit but got " + std::to_string(n));
  std::vector<double> prob(static_cast<size_t>(n), 0.0);
  if (p_.temperature <= 0.0f) {
    prob[static_cast<size_t>(argmax(logits, n))] = 1.0;
    return prob;
  }
  // Candidates sorted by logit, descending; ties keep the lower id first; NaN last (excluded).
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  auto key = [&](int32_t i) {
    const float v = logits[i];
    return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v;
  };
  int64_t keep = n;
  if (p_.top_k > 0) keep = std::min<int64_t>(keep, p_.top_k);
  auto cmp = [&](int32_t a, int32_t b) {
    const float ka = key(a), kb = key(b);
    return ka != kb ? ka > kb : a < b;
  };
  if (keep < n) {
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), cmp);
    order.resize(static_cast<size_t>(keep));
  } else {
    std::sort(order.begin(), order.end(), cmp);
  }
  const double inv_t = 1.0 / static_cast<double>(p_.temperature);
  const double top = static_cast<double>(key(order[0])) * inv_t;
  std::vector<double> w(order.size());
  double total = 0.0;
  for (size_t i = 0; i < order.size(); ++i) {
    const double l = static_cast<double>(key(order[i])) * inv_t;
    w[i] = std::isfinite(top) ? std::exp(l - top) : (i == 0 ? 1.0 : 0.0);
    total += w[i];
  }
  size_t cut = order.size();
  if (p_.top_p < 1.0f) {
    // Smallest prefix whose probability reaches top_p (at least one token).
    double cum = 0.0;
    for (size_t i = 0; i < order.size(); ++i) {
      cum += w[i] / total;
      if (cum >= static_cast<double>(p_.top_p)) {
        cut = i + 1;
        break;
      }
    }
  }
  double kept = 0.0;
  for (size_t i = 0; i < cut; ++i) kept += w[i];
  for (size_t i = 0; i < cut; ++i) prob[static_cast<size_t>(order[i])] = w[i] / kept;
  return prob;
}

int32_t Sampler::sample(const float* logits, int64_t n) {
  if (p_.temperature <= 0.0f) return argmax(logits, n);
  const std::vector<double> prob = distribution(logits, n);
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;  // [0, 1)
  double cum = 0.0;
  int32_t last_nonzero = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (prob[static_cast<size_t>(i)] <= 0.0) continue;
    cum += prob[static_cast<size_t>(i)];
    last_nonzero = static_cast<int32_t>(i);
    if (u < cum) return static_cast<int32_t>(i);
  }
  return last_nonzero;  // u landed in the rounding slack of the cumulative sum
}

}  // namespace vq
