// Portable packed decode kernels (packed_decode.h): any code width (1..8 bits, 1.5 bits), any
// group size (a ragged last group included), fp16 / fp32 / fp8 metadata. Each row's codes are
// unpacked to bytes (a table for the five-per-byte ternary format), then the group sums run in
// fp32 in channel order.
#include <algorithm>
#include <array>
#include <vector>

#include "ops/packed_decode.h"

namespace vq::detail {
namespace {

constexpr int kMaxD = 1024;  // channels a row may have on this path (checked by the selector)

struct Ternary {
  std::array<std::array<uint8_t, 5>, 256> t5{};
  Ternary() {
    for (int v = 0; v < 256; ++v) {
      int t = v;
      for (int j = 0; j < 5; ++j) {
        t5[v][j] = static_cast<uint8_t>(t % 3);
        t /= 3;
      }
    }
  }
};

void unpack_row(const uint8_t* rec, const PackedRowFormat& f, uint8_t* codes) {
  if (f.spec.ternary()) {
    static const Ternary tern;
    for (int64_t i = 0; i < f.head_dim; ++i) codes[i] = tern.t5[rec[i / 5]][i % 5];
    return;
  }
  unpack_codes(rec, f.head_dim, f.spec, codes);
}

void meta_row(const uint8_t* rec, const PackedRowFormat& f, float* lo, float* s) {
  const void* meta = record_meta(rec, f);
  for (int32_t g = 0; g < f.n_groups; ++g) {
    lo[g] = meta_load(meta, 2 * g, f.meta);
    s[g] = meta_load(meta, 2 * g + 1, f.meta);
  }
}

void keys_portable(const PackedRowFormat& f, const PackedTile& tile, const float* q,
                   const float* qsum, int64_t n_q, float* logits, int64_t ld,
                   const void* /*prep*/) {
  const int64_t d = f.head_dim, gs = f.group_size, ng = f.n_groups;
  std::array<uint8_t, kMaxD> codes;
  std::array<float, kMaxD> lo, s;
  for (int64_t r = 0; r < tile.n_rows; ++r) {
    const int64_t t = tile.rows[r];
    const uint8_t* rec = tile.rec0 + t * tile.stride;
    unpack_row(rec, f, codes.data());
    meta_row(rec, f, lo.data(), s.data());
    for (int64_t m = 0; m < n_q; ++m) {
      const float* qm = q + m * d;
      float l = 0.0f;
      for (int64_t g = 0; g < ng; ++g) {
        float part = 0.0f;
        for (int64_t i = g * gs; i < std::min(d, (g + 1) * gs); ++i)
          part += qm[i] * static_cast<float>(codes[static_cast<size_t>(i)]);
        l += s[static_cast<size_t>(g)] * part + lo[static_cast<size_t>(g)] * qsum[m * ng + g];
      }
      logits[m * ld + t] = l;
    }
  }
}

void values_portable(const PackedRowFormat& f, const PackedTile& tile, const float* p, int64_t ld,
                     int64_t n_q, float* acc, float* acc_lo, float* /*scratch*/) {
  const int64_t d = f.head_dim, gs = f.group_size, ng = f.n_groups;
  std::array<uint8_t, kMaxD> codes;
  std::array<float, kMaxD> lo, s;
  for (int64_t r = 0; r < tile.n_rows; ++r) {
    const int64_t t = tile.rows[r];
    const uint8_t* rec = tile.rec0 + t * tile.stride;
    unpack_row(rec, f, codes.data());
    meta_row(rec, f, lo.data(), s.data());
    for (int64_t m = 0; m < n_q; ++m) {
      const float pm = p[m * ld + t];
      float* a = acc + m * d;
      for (int64_t g = 0; g < ng; ++g) {
        const float w = pm * s[static_cast<size_t>(g)];
        for (int64_t i = g * gs; i < std::min(d, (g + 1) * gs); ++i)
          a[i] += w * static_cast<float>(codes[static_cast<size_t>(i)]);
        acc_lo[m * ng + g] += pm * lo[static_cast<size_t>(g)];
      }
    }
  }
}

}  // namespace

PackedKernel packed_kernel_portable(const PackedRowFormat& f) {
  if (f.head_dim > kMaxD) return {};
  PackedKernel k;
  k.keys = keys_portable;
  k.values = values_portable;
  return k;
}

}  // namespace vq::detail
