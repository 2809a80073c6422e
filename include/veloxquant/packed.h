// The packed numeric format of quantized K/V rows, shared by the CPU code and the CUDA kernels:
// code specs (1..8 bits, or 1.5 bits = three levels packed five to a byte), metadata types
// (fp16, fp32, fp8 e4m3), the row record layout and the PackedSegment a CacheView refers to.
// The codecs (code extraction, fp8 / fp16 metadata encode and decode, rounding as stored, the
// quantizer's code rounding, record offsets) are inline VQ_HD functions: __host__ __device__
// under nvcc, so the CPU quantizer (src/ops/group_quant.cpp) and the kernels that write or read
// records (src/cuda/skvq_flush.cu, device_cache_dequant.cu, the decode kernels) share one copy.
// Their floating-point steps are one IEEE rounding each on both sides (explicit _rn intrinsics on
// the device, no contraction on the host), so both give the same bits.
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
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define VQ_HD __host__ __device__
#else
#define VQ_HD
#endif

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

  VQ_HD bool ternary() const { return bits_x2 == 3; }
  // integer bits (1 for ternary: not used for packing)
  VQ_HD int bits() const { return bits_x2 / 2; }
  VQ_HD double bits_value() const { return bits_x2 / 2.0; }
  // Largest code: 2^bits - 1, or 2 for the three-level format.
  VQ_HD int levels() const { return ternary() ? 2 : (1 << bits()) - 1; }
};
static_assert(sizeof(CodeSpec) == 1, "CodeSpec is one byte in the shared format");

// Throws vq::Error unless bits is 1..8 (integer) or 1.5.
CodeSpec code_spec_from_bits(double bits);

// ---------------------------------------------------------------------------------------------
// Scalar building blocks of the codecs: bit casts and single IEEE roundings, the same on host
// and device (nvcc may contract a*b + c into an FMA unless told not to; the host code is built
// with -ffp-contract=off).

VQ_HD inline uint32_t f32_as_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<uint32_t>(x);
#endif
}
VQ_HD inline float bits_as_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}
VQ_HD inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
VQ_HD inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
VQ_HD inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
VQ_HD inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// fp16 bits <-> fp32, round to nearest even (dtype.h's conversions on the host).
VQ_HD inline uint16_t f32_to_fp16_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(x));
#else
  return f32_to_fp16(x);
#endif
}
VQ_HD inline float fp16_bits_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  return fp16_to_f32(h);
#endif
}

// Bytes of n codes packed tightly (ternary: five per byte).
VQ_HD inline int64_t packed_code_bytes(int64_t n, CodeSpec spec) {
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

// Code j of a packed code stream: bits [j*b, j*b + b) of the little-endian bit stream, or the
// base-3 digit j % 5 of byte j / 5 for the three-level format.
VQ_HD inline uint32_t code_at(const uint8_t* packed, int64_t j, CodeSpec spec) {
  if (spec.ternary()) {
    uint32_t v = packed[j / 5];
    for (int64_t m = j % 5; m > 0; --m) v /= 3u;
    return v % 3u;
  }
  const int b = spec.bits();
  const int64_t bit = j * b;
  uint32_t w = packed[bit >> 3];
  if ((bit & 7) + b > 8) w |= static_cast<uint32_t>(packed[(bit >> 3) + 1]) << 8;
  return (w >> (bit & 7)) & ((1u << b) - 1u);
}

inline void unpack_codes(const uint8_t* packed, int64_t n, CodeSpec spec, uint8_t* codes) {
  for (int64_t i = 0; i < n; ++i) codes[i] = static_cast<uint8_t>(code_at(packed, i, spec));
}

// The quantizer's code of x in a group (lo, scale): clamp((x - lo) / scale, 0, levels) rounded
// to an integer, ties to even; NaN gives 0. Clamping before rounding is equivalent (0 and levels
// are integers, rint is monotone), and on [0, 255] adding and removing 2^23 rounds to an
// integer, ties to even, under the default FP mode.
VQ_HD inline float quant_code(float x, float lo, float scale, float levels) {
  float t = div_rn(sub_rn(x, lo), scale);
  t = t > 0.0f ? t : 0.0f;
  t = t < levels ? t : levels;
  return sub_rn(add_rn(t, 0x1p23f), 0x1p23f);
}

// A code dequantized: code * scale + lo, two roundings (never an FMA).
VQ_HD inline float dequantize_code(uint32_t code, float scale, float lo) {
  return add_rn(mul_rn(static_cast<float>(code), scale), lo);
}

// ---------------------------------------------------------------------------------------------
// fp8 e4m3 (OCP "E4M3FN": bias 7, no infinities, 0x7f/0xff NaN, largest finite 448,
// subnormal step 2^-9). Encoding rounds to nearest, ties to even, and saturates to +-448
// (infinities included); NaN stays NaN.

// The fp8 e4m3 byte in the low 8 bits of c (32-bit arithmetic: the kernels pass loaded words).
VQ_HD inline float fp8_e4m3_decode(uint32_t c) {
  const uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
  if (e == 15u && m == 7u) return bits_as_f32(0x7fc00000u);  // NaN (a positive quiet NaN)
  // subnormal m * 2^-9 (an exact product), normal (1 + m/8) * 2^(e-7) built from its bits
  const float v =
      e == 0u ? static_cast<float>(m) * 0x1p-9f : bits_as_f32(((e + 120u) << 23) | (m << 20));
  return (c & 0x80u) ? -v : v;
}

VQ_HD inline uint8_t fp8_e4m3_encode(float x) {
  uint32_t u = f32_as_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7f);   // NaN
  if (u >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7e);  // >= 448 (or inf): saturate
  if (u < 0x3c800000u) {  // below 2^-6: subnormal codes 0..7, code 8 is the smallest normal
    // a * 512 < 8 is exact; adding 2^23 rounds it to an integer, ties to even.
    const float r = sub_rn(add_rn(mul_rn(bits_as_f32(u), 512.0f), 0x1p23f), 0x1p23f);
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

VQ_HD inline int meta_size(MetaType t) {
  return t == MetaType::kF32 ? 4 : t == MetaType::kF16 ? 2 : 1;
}

// Value v as it will be stored in type t (fp16 saturates to +-65504 instead of overflowing).
VQ_HD inline float meta_round(float v, MetaType t) {
  switch (t) {
    case MetaType::kF32:
      return v;
    case MetaType::kF16: {
      const float c = v > 65504.0f ? 65504.0f : (v < -65504.0f ? -65504.0f : v);
      return fp16_bits_to_f32(f32_to_fp16_bits(c));
    }
    case MetaType::kFP8E4M3:
      return fp8_e4m3_decode(fp8_e4m3_encode(v));
  }
  return v;
}

// Smallest positive value of type t: a scale that rounds to 0 is stored as this instead.
VQ_HD inline float meta_min_positive(MetaType t) {
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
VQ_HD inline float meta_round_scale(float s, MetaType t) {
  const float r = meta_round(s, t);
  return r >= meta_min_positive(t) ? r : meta_min_positive(t);
}

// The meta_size(t) bytes (little-endian, in the low bits) storing the (already rounded) value v.
VQ_HD inline uint32_t meta_encode(float v, MetaType t) {
  switch (t) {
    case MetaType::kF32:
      return f32_as_bits(v);
    case MetaType::kF16:
      return f32_to_fp16_bits(v);
    case MetaType::kFP8E4M3:
      return fp8_e4m3_encode(v);
  }
  return 0;
}

// The value stored as the meta_size(t) bytes in the low bits of `bits`.
VQ_HD inline float meta_decode(uint32_t bits, MetaType t) {
  switch (t) {
    case MetaType::kF32:
      return bits_as_f32(bits);
    case MetaType::kF16:
      return fp16_bits_to_f32(static_cast<uint16_t>(bits & 0xffffu));
    case MetaType::kFP8E4M3:
      return fp8_e4m3_decode(bits & 0xffu);
  }
  return 0.0f;
}

// Stores the (already rounded) value v as element i of a metadata array of type t.
VQ_HD inline void meta_store(void* base, int64_t i, float v, MetaType t) {
  switch (t) {
    case MetaType::kF32:
      static_cast<uint32_t*>(base)[i] = meta_encode(v, t);
      return;
    case MetaType::kF16:
      static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(meta_encode(v, t));
      return;
    case MetaType::kFP8E4M3:
      static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(meta_encode(v, t));
      return;
  }
}

VQ_HD inline float meta_load(const void* base, int64_t i, MetaType t) {
  switch (t) {
    case MetaType::kF32:
      return meta_decode(static_cast<const uint32_t*>(base)[i], t);
    case MetaType::kF16:
      return meta_decode(static_cast<const uint16_t*>(base)[i], t);
    case MetaType::kFP8E4M3:
      return meta_decode(static_cast<const uint8_t*>(base)[i], t);
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
  QuantAxis axis = QuantAxis::kToken;  // kChannel: the chunk layout below
  uint8_t pad_ = 0;
};
static_assert(sizeof(PackedRowFormat) == 24, "PackedRowFormat layout is part of the format");
static_assert(offsetof(PackedRowFormat, head_dim) == 0 &&
                  offsetof(PackedRowFormat, group_size) == 4 &&
                  offsetof(PackedRowFormat, n_groups) == 8 &&
                  offsetof(PackedRowFormat, code_bytes) == 12 &&
                  offsetof(PackedRowFormat, row_stride) == 16 &&
                  offsetof(PackedRowFormat, spec) == 20 && offsetof(PackedRowFormat, meta) == 21 &&
                  offsetof(PackedRowFormat, axis) == 22,
              "PackedRowFormat field offsets are part of the format");
static_assert(sizeof(MetaType) == 1 && sizeof(QuantAxis) == 1,
              "MetaType and QuantAxis are one byte each in PackedRowFormat");
static_assert(std::is_trivially_copyable_v<PackedRowFormat>);
// The metadata element sizes the record layout (and the kernels' word loads) assume.
static_assert(sizeof(uint16_t) == 2 && sizeof(float) == 4 && sizeof(uint32_t) == 4);

// Throws vq::Error on a bad head_dim, group size or bits.
PackedRowFormat make_row_format(int64_t head_dim, double bits, int64_t group_size, MetaType meta);

// Channel-axis records (axis == QuantAxis::kChannel, the keys of skvq_key_axis=channel): the rows
// of one flushed chunk share one (lo, scale) per stored channel, fitted over the chunk's rows.
// Record t of a chunk holds row t's D codes (as above), then n_groups metadata *elements* (not
// pairs): element e of the chunk's list (e = 2c: lo of stored channel c, e = 2c + 1: its scale)
// is slot e % n_groups of record e / n_groups; slots past 2D are zero. n_groups =
// ceil(2D / min_chunk_rows), so every chunk of at least min_chunk_rows rows holds its list;
// group_size = D (one "group" per row: nothing is shared along a row). row_stride = code_bytes +
// n_groups * meta_size. x_hat[t][c] = code[t][c] * scale_c + lo_c (two roundings). A
// PackedTensor of channel records starts at its chunk's first record and covers that one chunk
// (the SKVQ cache gives one packed segment per chunk on the CPU backend), or, with `runs`, several
// chunks one after the other (the CUDA backend's one packed run): run r is records
// [runs[r], runs[r + 1]) and its first record starts its metadata list.
PackedRowFormat make_channel_row_format(int64_t head_dim, double bits, int64_t min_chunk_rows,
                                        MetaType meta);

// Metadata element e of the chunk whose first record is at chunk0 (records `stride` bytes apart).
VQ_HD inline float channel_meta(const uint8_t* chunk0, int64_t stride, const PackedRowFormat& f,
                                int64_t e) {
  return meta_load(chunk0 + (e / f.n_groups) * stride + f.code_bytes, e % f.n_groups, f.meta);
}

// Byte offset, within a record, of metadata element e (2*g: lo of group g, 2*g+1: its scale).
VQ_HD inline int64_t record_meta_offset(const PackedRowFormat& f, int64_t e = 0) {
  return f.code_bytes + e * meta_size(f.meta);
}
// Pointer to the metadata of a record; element 2*g is lo of group g, 2*g+1 its scale.
VQ_HD inline const void* record_meta(const uint8_t* record, const PackedRowFormat& f) {
  return record + f.code_bytes;
}
// Stored channel j of a token-axis record, dequantized (code * scale + lo of its group, two
// roundings). Channel-axis records need their chunk: dequantize_row.
VQ_HD inline float record_value(const uint8_t* record, const PackedRowFormat& f, int64_t j) {
  const int64_t g = j / f.group_size;
  const void* meta = record_meta(record, f);
  return dequantize_code(code_at(record, j, f.spec), meta_load(meta, 2 * g + 1, f.meta),
                         meta_load(meta, 2 * g, f.meta));
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
  // Channel-axis records only: [n_runs + 1] ascending record indices on the tensor's device,
  // runs[0] = 0 and runs[n_runs] = the rows covered; run r = records [runs[r], runs[r + 1]) of
  // every (b, h), one metadata list in its first record. nullptr: the tensor is one run.
  const int32_t* runs = nullptr;
  int32_t n_runs = 0;

  const uint8_t* record(int64_t b, int64_t h, int64_t i) const {
    return data + b * stride_b + h * stride_h + i * static_cast<int64_t>(fmt.row_stride);
  }
  bool transformed() const { return perm != nullptr || signs != nullptr; }
};

// The first record index of the run holding record i (runs as in PackedTensor, n_runs >= 1;
// nullptr: 0). Binary search: O(log n_runs).
VQ_HD inline int64_t channel_run_start(const int32_t* runs, int32_t n_runs, int64_t i) {
  if (runs == nullptr) return 0;
  int32_t lo = 0, hi = n_runs - 1;  // the last run r with runs[r] <= i
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (runs[mid] <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return runs[lo];
}

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

// Dequantizes one token-axis record to fp32 in the *stored* (transformed) channel order: out[j] =
// code_j * scale_g + lo_g, computed in fp32 with one rounding per operation. Throws on a
// channel-axis format (its metadata lives in the chunk: dequantize_row).
void dequantize_record(const uint8_t* record, const PackedRowFormat& fmt, float* out);

// Dequantizes row (b, h, i) of t to fp32 in the original channel order (inverse permutation,
// inverse rotation); channel-axis rows with their run's metadata (t starts at the chunk, or
// t.runs gives the runs; host memory here). out: [D].
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
