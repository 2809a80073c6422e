// Scalar dtype conversions: fp32 <-> fp16 (IEEE binary16) and fp32 <-> bf16, round to nearest
// even. fp16 conversion handles subnormals, overflow to infinity and NaN explicitly; it is
// checked exhaustively over all 65536 bit patterns in tests/test_dtype.cpp.
#include "veloxquant/dtype.h"

#include <bit>
#include <cstring>

#include "veloxquant/error.h"

namespace vq {

size_t dtype_size(DType t) {
  return t == DType::kF32 ? 4 : 2;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
  }
  return "?";
}

DType dtype_from_string(const std::string& s) {
  if (s == "float32" || s == "f32" || s == "fp32" || s == "F32") return DType::kF32;
  if (s == "float16" || s == "f16" || s == "fp16" || s == "F16") return DType::kF16;
  if (s == "bfloat16" || s == "bf16" || s == "BF16") return DType::kBF16;
  throw Error("[dtype] expected one of float32, float16, bfloat16 but got '" + s + "'");
}

float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: value = man * 2^-24, exact in fp32
      const float v = static_cast<float>(man) * 0x1p-24f;
      bits = sign | std::bit_cast<uint32_t>(v);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t f32_to_fp16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x47800000u) {  // >= 65536: overflow unless it rounds below 65520
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (ax < 0x38800000u) {  // below the smallest normal 2^-14: subnormal or zero
    // value / 2^-24 rounded to nearest even gives the subnormal mantissa (may carry to normal).
    const float a = std::bit_cast<float>(ax);
    const float scaled = a * 0x1p24f;  // exact (power of two scaling, no underflow here)
    // round half to even in fp32 arithmetic: scaled < 1024, so adding 2^23 rounds to integer.
    const float r = (scaled + 0x1p23f) - 0x1p23f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  // normal: rebias exponent, round mantissa from 23 to 10 bits, half to even
  uint32_t m = ax + 0xc8000000u;  // exponent - 112 (in the exponent field)
  const uint32_t lsb = (m >> 13) & 1u;
  m += 0x0fffu + lsb;
  const uint32_t h = m >> 13;
  if (h >= 0x7c00u) return static_cast<uint16_t>(sign | 0x7c00u);
  return static_cast<uint16_t>(sign | h);
}

uint16_t f32_to_bf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  const uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return static_cast<uint16_t>(x >> 16);
}

void to_f32(const void* src, DType src_t, float* dst, size_t n) {
  switch (src_t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = fp16_to_f32(s[i]);
      return;
    }
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
  }
}

void from_f32(const float* src, void* dst, DType dst_t, size_t n) {
  switch (dst_t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_fp16(src[i]);
      return;
    }
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
  }
}

void convert_row(const void* src, DType src_t, void* dst, DType dst_t, size_t n) {
  if (src_t == dst_t) {
    std::memcpy(dst, src, n * dtype_size(src_t));
    return;
  }
  if (src_t == DType::kF32) return from_f32(static_cast<const float*>(src), dst, dst_t, n);
  if (dst_t == DType::kF32) return to_f32(src, src_t, static_cast<float*>(dst), n);
  float buf[256];
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  for (size_t i = 0; i < n; i += 256) {
    const size_t m = n - i < 256 ? n - i : 256;
    to_f32(s + i * 2, src_t, buf, m);
    from_f32(buf, d + i * 2, dst_t, m);
  }
}

}  // namespace vq
