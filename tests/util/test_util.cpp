// Shared test helpers (see test_util.h).
#include "util/test_util.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>

#include "veloxquant/error.h"

namespace vq::test {

Tensor random_tensor(DType t, int64_t b, int64_t h, int64_t s, int64_t d, uint64_t seed,
                     float stddev) {
  Tensor out(t, b, h, s, d);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  for (int64_t i0 = 0; i0 < b; ++i0)
    for (int64_t i1 = 0; i1 < h; ++i1)
      for (int64_t i2 = 0; i2 < s; ++i2)
        for (int64_t i3 = 0; i3 < d; ++i3) out.set(i0, i1, i2, i3, dist(rng));
  return out;
}

bool bit_equal(const TensorView& a, const TensorView& b) {
  if (a.dtype != b.dtype || a.shape != b.shape) return false;
  const size_t es = dtype_size(a.dtype);
  for (int64_t i0 = 0; i0 < a.shape[0]; ++i0)
    for (int64_t i1 = 0; i1 < a.shape[1]; ++i1)
      for (int64_t i2 = 0; i2 < a.shape[2]; ++i2)
        for (int64_t i3 = 0; i3 < a.shape[3]; ++i3) {
          const char* pa = static_cast<const char*>(a.row(i0, i1, i2)) + i3 * a.stride[3] * es;
          const char* pb = static_cast<const char*>(b.row(i0, i1, i2)) + i3 * b.stride[3] * es;
          if (std::memcmp(pa, pb, es) != 0) return false;
        }
  return true;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string source_path(const std::string& rel) {
  const char* root = std::getenv("VQ_SOURCE_DIR");
#ifdef VQ_SOURCE_DIR
  if (!root) root = VQ_SOURCE_DIR;
#endif
  return std::string(root ? root : ".") + "/" + rel;
}

uint16_t bits_at(const TensorView& t, int64_t b, int64_t h, int64_t row, int64_t c) {
  return static_cast<const uint16_t*>(t.row(b, h, row))[c * t.stride[3]];
}

HeadRows view_head(const CacheView& view, int64_t b, int64_t h) {
  HeadRows r;
  for (const auto& seg : view.segments)
    for (int64_t i = 0; i < seg.n_rows; ++i) {
      r.pos.push_back(seg.position(b, h, i, view.n_kv_heads));
      for (int64_t c = 0; c < view.head_dim; ++c) {
        r.k.push_back(bits_at(seg.keys, b, h, i, c));
        r.v.push_back(bits_at(seg.values, b, h, i, c));
      }
    }
  return r;
}

std::vector<double> aniso_moments(int64_t d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> m(static_cast<size_t>(d * d), 0.0);
  std::vector<double> a(static_cast<size_t>(d));
  for (int r = 0; r < 6; ++r) {
    for (auto& x : a) x = nd(rng) * std::pow(0.5, r);
    for (int64_t i = 0; i < d; ++i)
      for (int64_t j = 0; j < d; ++j) m[static_cast<size_t>(i * d + j)] += a[i] * a[j];
  }
  for (int64_t i = 0; i < d; ++i) m[static_cast<size_t>(i * d + i)] += 0.01;
  return m;
}

}  // namespace vq::test
