// Element types of keys, values and weights, and scalar conversions between them.
// fp16 (IEEE binary16) and bf16 are stored as raw uint16_t bit patterns; every conversion from
// fp32 rounds to nearest, ties to even, and keeps NaN a NaN (quiet) and infinities infinite.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace vq {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// Parses "float32"/"f32"/"fp32", "float16"/"f16"/"fp16", "bfloat16"/"bf16"; throws vq::Error.
DType dtype_from_string(const std::string& s);

float fp16_to_f32(uint16_t h);
uint16_t f32_to_fp16(float f);
// Inline: the portable matmul loop converts every weight through it (kernels.cpp).
inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
uint16_t f32_to_bf16(float f);

// Row conversions (contiguous). dst and src may not overlap.
void convert_row(const void* src, DType src_t, void* dst, DType dst_t, size_t n);
void to_f32(const void* src, DType src_t, float* dst, size_t n);
void from_f32(const float* src, void* dst, DType dst_t, size_t n);

// Reads element i of a contiguous array of type t as fp32.
inline float load_f32(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kF16:
      return fp16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.0f;
}

}  // namespace vq
