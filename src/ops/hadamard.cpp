// Fast Walsh-Hadamard transform (in place, butterflies of span 1, 2, 4, ... within each
// power-of-two block), the seeded sign vector and the dense reference matrix. See hadamard.h.
#include "veloxquant/hadamard.h"

#include <bit>
#include <cmath>
#include <string>

#include "veloxquant/error.h"

namespace vq {

int64_t hadamard_block(int64_t d) {
  VQ_CHECK(d >= 1, "[hadamard] expected head_dim >= 1 but got " + std::to_string(d));
  return d & -d;
}

static void check_block(int64_t d, int64_t block) {
  VQ_CHECK(block >= 1 && std::has_single_bit(static_cast<uint64_t>(block)) && d % block == 0,
           "[hadamard] expected a power-of-two block dividing " + std::to_string(d) + " but got " +
               std::to_string(block));
}

void fwht_normalized(float* x, int64_t d, int64_t block) {
  check_block(d, block);
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  for (int64_t b0 = 0; b0 < d; b0 += block) {
    float* v = x + b0;
    for (int64_t span = 1; span < block; span *= 2) {
      for (int64_t i = 0; i < block; i += 2 * span) {
        // Contiguous inner loop: vectorises for span >= the vector width.
        for (int64_t j = i; j < i + span; ++j) {
          const float a = v[j];
          const float c = v[j + span];
          v[j] = a + c;
          v[j + span] = a - c;
        }
      }
    }
    for (int64_t j = 0; j < block; ++j) v[j] *= norm;
  }
}

void hadamard_rotate(float* x, const float* signs, int64_t d, int64_t block) {
  for (int64_t j = 0; j < d; ++j) x[j] *= signs[j];
  fwht_normalized(x, d, block);
}

void hadamard_unrotate(float* x, const float* signs, int64_t d, int64_t block) {
  fwht_normalized(x, d, block);
  for (int64_t j = 0; j < d; ++j) x[j] *= signs[j];
}

std::vector<float> hadamard_signs(uint64_t seed, int64_t n) {
  VQ_CHECK(n >= 0, "[hadamard_signs] expected n >= 0 but got " + std::to_string(n));
  std::vector<float> s(static_cast<size_t>(n));
  uint64_t state = seed;
  uint64_t word = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 64 == 0) {  // splitmix64
      state += 0x9e3779b97f4a7c15ull;
      uint64_t z = state;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      word = z ^ (z >> 31);
    }
    s[static_cast<size_t>(i)] = ((word >> (i % 64)) & 1u) ? -1.0f : 1.0f;
  }
  return s;
}

std::vector<double> hadamard_matrix_reference(int64_t d, int64_t block, const float* signs) {
  check_block(d, block);
  std::vector<double> m(static_cast<size_t>(d * d), 0.0);
  const double norm = 1.0 / std::sqrt(static_cast<double>(block));
  for (int64_t b0 = 0; b0 < d; b0 += block)
    for (int64_t i = 0; i < block; ++i)
      for (int64_t j = 0; j < block; ++j) {
        const int par = std::popcount(static_cast<uint64_t>(i & j)) & 1;
        // R = H diag(signs): column j is scaled by signs[j].
        m[static_cast<size_t>((b0 + i) * d + b0 + j)] =
            (par ? -norm : norm) * static_cast<double>(signs[b0 + j]);
      }
  return m;
}

}  // namespace vq
