// Shared helpers for the test suite: seeded random K/V blocks and small comparisons.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/tensor.h"

namespace vq::test {

// Tensor [B, H, S, D] of type t, N(0, 1) values scaled per channel by channel_scale(d) if given,
// deterministic for a seed.
Tensor random_tensor(DType t, int64_t b, int64_t h, int64_t s, int64_t d, uint64_t seed,
                     float stddev = 1.0f);

// True when both tensors have the same shape, dtype and bytes.
bool bit_equal(const TensorView& a, const TensorView& b);

// The message of the vq::Error f throws, or "" when it throws none.
std::string error_of(const std::function<void()>& f);

// Path of a file inside the repository (VQ_SOURCE_DIR).
std::string source_path(const std::string& rel);

// Raw 16-bit pattern of element (b, h, row, c) of a view of a 2-byte dtype.
uint16_t bits_at(const TensorView& t, int64_t b, int64_t h, int64_t row, int64_t c);

// One (b, h) of a cache view of a 2-byte dtype, materialised: positions and raw K/V bits.
struct HeadRows {
  std::vector<int32_t> pos;
  std::vector<uint16_t> k, v;  // [n, D]
  bool operator==(const HeadRows&) const = default;
};
HeadRows view_head(const CacheView& view, int64_t b, int64_t h);

// Symmetric positive definite d x d query moments with a few dominant directions (as a head's
// queries have): m = sum_r a_r a_r^T (six a_r of decaying length) + 0.01 I. Error-feedback key
// rounding (veloxquant/key_rounding.h) on these moves codes away from round-to-nearest.
std::vector<double> aniso_moments(int64_t d, uint64_t seed);

}  // namespace vq::test
