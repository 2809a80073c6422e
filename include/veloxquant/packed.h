// The packed numeric format of quantized K/V rows, shared by the CPU code and (later) CUDA:
// code specs (1..8 bits, or 1.5 bits = three levels packed five to a byte), metadata types
// (fp16, fp32, fp8 e4m3), the row record layout and the PackedSegment a CacheView refers to.
//
// Row record (one quantized row of D channels): [codes: code_bytes][meta: n_groups x (lo, scale)]
//   codes  : channel j of the *transformed* row (rotated, then permuted) at bits [j*b, j*b + b)
//            of a little-endian bit stream (b = 1..8); ternary: byte k = sum_m c[5k+m] * 3^m.
//            Only D codes are stored (a ragged last group's pad is dropped); code_bytes is the
//            packed size rounded up to the metadata alignment.
//   meta   : per group g, lo then scale, each one MetaType element; x_hat = code*scale + lo.
// Transform of a stored row: t = P(R x), R = blockwise normalised Walsh-Hadamard after a sign
// flip (hadamard.h), P a channel gather t[j] = (R x)[perm[j]]; either may be absent.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/dtype.h"
#include "veloxquant/tensor.h"

namespace vq {

// ---------------------------------------------------------------------------------------------
// Code specs

// Bit width of one packed tensor. bits_x2 = 2 * bits: 2, 4, ..., 16 for 1..8 bits, 3 for 1.5.
struct CodeSpec {
  uint8_t bits_x2 = 4;

  bool ternary() const { return bits_x2 == 3; }
  int bits() const { return bits_x2 / 2; }  // integer bits (1 for ternary: not used for packing)
  double bits_value() const { return bits_x2 / 2.0; }
  // Largest code: 2^bits - 1, or 2 for the three-level format.
  int levels() const { return ternary() ? 2 : (1 << bits()) - 1; }
};
static_assert(sizeof(CodeSpec) == 1, "CodeSpec is one byte in the shared format");

// Throws vq::Error unless bits is 1..8 (integer) or 1.5.
CodeSpec code_spec_from_bits(double bits);

// Bytes of n codes packed tightly (ternary: five per byte).
inline int64_t packed_code_bytes(int64_t n, CodeSpec spec) {
  return spec.ternary() ? (n + 4) / 5 : (n * spec.bits() + 7) / 8;
}

// Scalar pack/unpack of n codes (each code <= spec.levels()). out must hold packed_code_bytes.
inline void pack_codes(const uint8_t* codes, int64_t n, CodeSpec spec, uint8_t* out) {
  const int64_t nb = packed_code_bytes(n, spec);
  std::memset(out, 0, static_cast<size_t>(nb));
  if (spec.ternary()) {
    for (int64_t k = 0; k < nb; ++k) {
      int v = 0;
      for (int m = 4; m >= 0; --m) {
        const int64_t i = 5 * k + m;
        v = v * 3 + (i < n ? codes[i] : 0);
      }
      out[k] = static_cast<uint8_t>(v);
    }
    return;
  }
  const int b = spec.bits();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t bit = i * b;
    const uint32_t c = codes[i];
    out[bit >> 3] = static_cast<uint8_t>(out[bit >> 3] | (c << (bit & 7)));
    if ((bit & 7) + b > 8) out[(bit >> 3) + 1] = static_cast<uint8_t>(c >> (8 - (bit & 7)));
  }
}

inline void unpack_codes(const uint8_t* packed, int64_t n, CodeSpec spec, uint8_t* codes) {
  if (spec.ternary()) {
    for (int64_t i = 0; i < n; ++i) {
      int v = packed[i / 5];
      for (int64_t m = i % 5; m > 0; --m) v /= 3;
      codes[i] = static_cast<uint8_t>(v % 3);
    }
    return;
  }
  const int b = spec.bits();
  const uint32_t mask = (1u << b) - 1u;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t bit = i * b;
    uint32_t w = packed[bit >> 3];
    if ((bit & 7) + b > 8) w |= static_cast<uint32_t>(packed[(bit >> 3) + 1]) << 8;
    codes[i] = static_cast<uint8_t>((w >> (bit & 7)) & mask);
  }
}

// ---------------------------------------------------------------------------------------------
// fp8 e4m3 (OCP "E4M3FN": bias 7, no infinities, 0x7f/0xff NaN, largest finite 448,
// subnormal step 2^-9). Encoding rounds to nearest, ties to even, and saturates to +-448
// (infinities included); NaN stays NaN.

inline float fp8_e4m3_decode(uint8_t c) {
  const float sign = (c & 0x80u) ? -1.0f : 1.0f;
  const int e = (c >> 3) & 0xf;
  const int m = c & 7;
  if (e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);
  return sign * std::ldexp(static_cast<float>(8 + m), e - 10);
}

inline uint8_t fp8_e4m3_encode(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7f);   // NaN
  if (u >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7e);  // >= 448 (or inf): saturate
  if (u < 0x3c800000u) {  // below 2^-6: subnormal codes 0..7, code 8 is the smallest normal
    float a;
    std::memcpy(&a, &u, 4);
    // a * 512 < 8 is exact; adding 2^23 rounds it to an integer, ties to even.
    const float r = (a * 512.0f + 0x1p23f) - 0x1p23f;
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(r));
  }
  // Normal: round the 23-bit mantissa to 3 bits, ties to even; a carry bumps the exponent.
  u += 0x7ffffu + ((u >> 20) & 1u);
  const uint32_t e = (u >> 23) - 127u + 7u;  // >= 1 here
  const uint32_t m = (u >> 20) & 7u;
  if (e > 15 || (e == 15 && m == 7)) return static_cast<uint8_t>(sign | 0x7e);
  return static_cast<uint8_t>(sign | (e << 3) | m);
}

// ---------------------------------------------------------------------------------------------
// Metadata (lo, scale)

inline int meta_size(MetaType t) {
  return t == MetaType::kF32 ? 4 : t == MetaType::kF16 ? 2 : 1;
}

// Value v as it will be stored in type t (fp16 saturates to +-65504 instead of overflowing).
inline float meta_round(float v, MetaType t) {
  switch (t) {
    case MetaType::kF32:
      return v;
    case MetaType::kF16: {
      const float c = v > 65504.0f ? 65504.0f : (v < -65504.0f ? -65504.0f : v);
      return fp16_to_f32(f32_to_fp16(c));
    }
    case MetaType::kFP8E4M3:
      return fp8_e4m3_decode(fp8_e4m3_encode(v));
  }
  return v;
}

// Smallest positive value of type t: a scale that rounds to 0 is stored as this instead.
inline float meta_min_positive(MetaType t) {
  switch (t) {
    case MetaType::kF32:
      return 1e-8f;  // the quantizer's floor (the type could go lower)
    case MetaType::kF16:
      return 0x1p-24f;
    case MetaType::kFP8E4M3:
      return 0x1p-9f;
  }
  return 1e-8f;
}

// A scale as stored: rounded, and never below the type's smallest positive value.
inline float meta_round_scale(float s, MetaType t) {
  const float r = meta_round(s, t);
  return r >= meta_min_positive(t) ? r : meta_min_positive(t);
}

// Stores the (already rounded) value v as element i of a metadata array of type t.
inline void meta_store(void* base, int64_t i, float v, MetaType t) {
  switch (t) {
    case MetaType::kF32:
      static_cast<float*>(base)[i] = v;
      return;
    case MetaType::kF16:
      static_cast<uint16_t*>(base)[i] = f32_to_fp16(v);
      return;
    case MetaType::kFP8E4M3:
      static_cast<uint8_t*>(base)[i] = fp8_e4m3_encode(v);
      return;
  }
}

inline float meta_load(const void* base, int64_t i, MetaType t) {
  switch (t) {
    case MetaType::kF32:
      return static_cast<const float*>(base)[i];
    case MetaType::kF16:
      return fp16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case MetaType::kFP8E4M3:
      return fp8_e4m3_decode(static_cast<const uint8_t*>(base)[i]);
  }
  return 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Row record format

struct PackedRowFormat {
  int32_t head_dim = 0;    // D: channels per row
  int32_t group_size = 0;  // g: channels per quantization group (last group ragged)
  int32_t n_groups = 0;    // ceil(D / g)
  int32_t code_bytes = 0;  // packed codes, rounded up to meta_size(meta)
  int32_t row_stride = 0;  // bytes per record: code_bytes + n_groups * 2 * meta_size(meta)
  CodeSpec spec;
  MetaType meta = MetaType::kF16;
  uint8_t pad_[2] = {0, 0};
};
static_assert(sizeof(PackedRowFormat) == 24, "PackedRowFormat layout is part of the format");
static_assert(std::is_trivially_copyable_v<PackedRowFormat>);

// Throws vq::Error on a bad head_dim, group size or bits.
PackedRowFormat make_row_format(int64_t head_dim, double bits, int64_t group_size, MetaType meta);

// Pointer to the metadata of a record; element 2*g is lo of group g, 2*g+1 its scale.
inline const void* record_meta(const uint8_t* record, const PackedRowFormat& f) {
  return record + f.code_bytes;
}

// One packed tensor (keys or values) of a segment.
struct PackedTensor {
  const uint8_t* data = nullptr;  // records: (b, h, i) at data + b*stride_b + h*stride_h
                                  //          + i*fmt.row_stride
  int64_t stride_b = 0;           // bytes between consecutive batches
  int64_t stride_h = 0;           // bytes between consecutive heads
  PackedRowFormat fmt;
  const int32_t* perm = nullptr;  // [H, D] or nullptr: stored channel j = rotated channel perm[j]
  const float* signs = nullptr;   // [H, D] of +-1, or nullptr: no rotation
  int32_t rot_block = 0;          // Hadamard block size (power of two dividing D) when rotated

  const uint8_t* record(int64_t b, int64_t h, int64_t i) const {
    return data + b * stride_b + h * stride_h + i * static_cast<int64_t>(fmt.row_stride);
  }
  bool transformed() const { return perm != nullptr || signs != nullptr; }
};

// A run of packed rows shared by every (b, h) (see ViewSegment in cache.h).
struct PackedSegment {
  int64_t batch = 0;              // B
  int64_t n_heads = 0;            // H_kv
  int64_t n_rows = 0;             // rows per (b, h)
  int64_t head_dim = 0;           // D
  DType out_dtype = DType::kF16;  // dtype the dequantized rows are cast to (the cache's dtype)
  PackedTensor keys;
  PackedTensor values;
};
static_assert(std::is_trivially_copyable_v<PackedSegment>,
              "PackedSegment is plain data so it can be copied to a device as is");

// Dequantizes one record to fp32 in the *stored* (transformed) channel order: out[j] =
// code_j * scale_g + lo_g, computed in fp32 with one rounding per operation.
void dequantize_record(const uint8_t* record, const PackedRowFormat& fmt, float* out);

// Dequantizes row (b, h, i) of t to fp32 in the original channel order (inverse permutation,
// inverse rotation). out: [D].
void dequantize_row(const PackedTensor& t, int64_t b, int64_t h, int64_t i, float* out);

// Maps a row from stored order back to original order in place (tmp: [D] scratch).
void untransform_row(const PackedTensor& t, int64_t h, float* row, float* tmp);
// Maps a row from original order to stored order in place (rotate, then permute).
void transform_row(const PackedTensor& t, int64_t h, float* row, float* tmp);

// A view whose packed segments are replaced by owned full-precision copies (dequantized,
// inverse-transformed, cast to `dtype`); full-precision segments are referenced as they are.
// For tests and callers that want a dense cache; the runtime's attention never needs it.
struct DenseView {
  CacheView view;
  std::vector<std::unique_ptr<Tensor>> owned;  // [B, H, n_rows, D] keys, values per packed segment
};
DenseView dequantize_view(const CacheView& v, DType dtype = DType::kF32);

}  // namespace vq
