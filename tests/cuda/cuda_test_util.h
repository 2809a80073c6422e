// Small helpers shared by the GPU tests (tests/cuda/): SKIP_WITHOUT_DEVICE() skips a test cleanly
// when no CUDA device is present, random_q(n, seed) draws n fp32 query values (standard normal,
// mt19937_64 seeded by seed: the same values for the same seed on every machine), laid out by
// the caller (e.g. [B, Hq, N, D]).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "veloxquant/cuda.h"

#define SKIP_WITHOUT_DEVICE() \
  if (!::vq::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

namespace vq::test {

inline std::vector<float> random_q(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(n));
  for (auto& x : q) x = nd(rng);
  return q;
}

}  // namespace vq::test
