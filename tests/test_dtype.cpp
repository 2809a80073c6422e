// Tests of the scalar dtype conversions (veloxquant/dtype.h) against independent references
// written with double arithmetic (frexp/ldexp and an explicit round-half-to-even), not with the
// bit tricks the library uses.
//
// fp16: all 65536 bit patterns decode correctly and round-trip; fp32 -> fp16 is checked on every
// halfway point between adjacent fp16 values (and one float ulp either side), on a strided sweep
// of all 2^32 float patterns and on random floats, including subnormals, overflow and NaN.
// bf16: the same, with every halfway point of all 65536 patterns.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "veloxquant/dtype.h"
#include "veloxquant/error.h"

namespace vq {
namespace {

// Round half to even of a non-negative double holding an exactly representable quotient.
double round_half_even(double n) {
  const double fl = std::floor(n);
  const double frac = n - fl;
  if (frac > 0.5) return fl + 1;
  if (frac < 0.5) return fl;
  return std::fmod(fl, 2.0) == 0.0 ? fl : fl + 1;
}

// Independent decoders.
double ref_fp16_value(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0)
    v = std::ldexp(static_cast<double>(m), -24);
  else if (e == 31)
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else
    v = std::ldexp(static_cast<double>(1024 + m), e - 25);
  return s ? -v : v;
}

double ref_bf16_value(uint16_t h) {
  const int s = h >> 15, e = (h >> 7) & 255, m = h & 127;
  double v;
  if (e == 0)
    v = std::ldexp(static_cast<double>(m), -133);
  else if (e == 255)
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else
    v = std::ldexp(static_cast<double>(128 + m), e - 134);
  return s ? -v : v;
}

// Value an fp32 -> narrow conversion must produce (for finite, non-NaN f): the nearest value
// with `mant_bits` fraction bits and exponent >= min_exp, ties to even; inf when the rounded
// magnitude reaches `overflow`.
double ref_round(float f, int mant_bits, int min_exp, double overflow) {
  const double a = std::fabs(static_cast<double>(f));
  double r = 0.0;
  if (a != 0.0) {
    int ex = 0;
    std::frexp(a, &ex);                               // a = fr * 2^ex, fr in [0.5, 1)
    const int e = std::max(ex - 1, min_exp);          // exponent of the leading bit, clamped
    const double q = std::ldexp(1.0, e - mant_bits);  // spacing of representable values
    r = round_half_even(a / q) * q;                   // a / q is exact (power-of-two scaling)
    if (r >= overflow) r = std::numeric_limits<double>::infinity();
  }
  return std::signbit(f) ? -r : r;
}

double ref_fp16_round(float f) {
  return ref_round(f, 10, -14, 65536.0);
}
double ref_bf16_round(float f) {
  return ref_round(f, 7, -126, std::ldexp(1.0, 128));
}

void check_fp16(float f) {
  const uint16_t h = f32_to_fp16(f);
  if (std::isnan(f)) {
    ASSERT_EQ(h & 0x7c00, 0x7c00) << std::hex << std::bit_cast<uint32_t>(f);
    ASSERT_NE(h & 0x3ff, 0);
    ASSERT_NE(h & 0x200, 0) << "NaN must come out quiet";
    ASSERT_EQ(h >> 15, std::bit_cast<uint32_t>(f) >> 31);
    return;
  }
  const double want = ref_fp16_round(f);
  const double got = ref_fp16_value(h);
  ASSERT_EQ(got, want) << "f32 bits 0x" << std::hex << std::bit_cast<uint32_t>(f) << " -> 0x" << h;
  ASSERT_EQ(std::signbit(got), std::signbit(want)) << std::hex << std::bit_cast<uint32_t>(f);
}

void check_bf16(float f) {
  const uint16_t h = f32_to_bf16(f);
  if (std::isnan(f)) {
    ASSERT_EQ(h & 0x7f80, 0x7f80);
    ASSERT_NE(h & 0x7f, 0);
    ASSERT_NE(h & 0x40, 0) << "NaN must come out quiet";
    ASSERT_EQ(h >> 15, std::bit_cast<uint32_t>(f) >> 31);
    return;
  }
  const double want = ref_bf16_round(f);
  const double got = ref_bf16_value(h);
  ASSERT_EQ(got, want) << "f32 bits 0x" << std::hex << std::bit_cast<uint32_t>(f) << " -> 0x" << h;
  ASSERT_EQ(std::signbit(got), std::signbit(want));
}

TEST(DType, Fp16AllPatternsDecodeAndRoundTrip) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const float f = fp16_to_f32(h);
    const double want = ref_fp16_value(h);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << i;
      // NaN keeps its sign and payload and becomes quiet.
      ASSERT_EQ(f32_to_fp16(f), h | 0x200) << std::hex << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), want) << std::hex << i;
    ASSERT_EQ(std::signbit(f), (i >> 15) != 0) << i;
    ASSERT_EQ(f32_to_fp16(f), h) << std::hex << i;
  }
}

TEST(DType, Fp16HalfwayCasesAndNeighbours) {
  // Every pair of adjacent non-negative fp16 values, including subnormals and the pair
  // (65504, 65536) where 65536 is the first value that overflows.
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const double lo = ref_fp16_value(static_cast<uint16_t>(h));
    const double hi = h + 1 < 0x7c00 ? ref_fp16_value(static_cast<uint16_t>(h + 1)) : 65536.0;
    const float mid = static_cast<float>((lo + hi) / 2);  // needs 12 significant bits: exact
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    for (float f :
         {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f), static_cast<float>(lo)}) {
      check_fp16(f);
      check_fp16(-f);
    }
  }
  // Spot values with known answers (independent of the reference above).
  EXPECT_EQ(f32_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_fp16(65519.996f), 0x7bff);
  EXPECT_EQ(f32_to_fp16(65520.0f), 0x7c00);  // halfway to 65536: ties to even = overflow
  EXPECT_EQ(f32_to_fp16(1e10f), 0x7c00);
  EXPECT_EQ(f32_to_fp16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(f32_to_fp16(0x1p-25f), 0x0000);  // half the smallest subnormal -> 0
  EXPECT_EQ(f32_to_fp16(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(f32_to_fp16(0x3p-25f), 0x0002);  // 1.5 ulp -> even (2)
  EXPECT_EQ(f32_to_fp16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_fp16(1.0f + 0x1p-11f), 0x3c00);  // tie, 1.0 is even
  EXPECT_EQ(f32_to_fp16(1.0f + 0x3p-11f), 0x3c02);  // tie, rounds up to even
  EXPECT_EQ(f32_to_fp16(0x1.ffcp-15f), 0x0400);     // largest subnormal tie -> smallest normal
}

TEST(DType, Fp16SweepOfFloatPatternsAndNaN) {
  // A strided sweep over all 2^32 patterns (every exponent, both signs, NaNs included).
  for (uint64_t bits = 0; bits < (1ull << 32); bits += 4099)
    check_fp16(std::bit_cast<float>(static_cast<uint32_t>(bits)));
  std::mt19937 rng(7);
  for (int i = 0; i < 1000000; ++i) check_fp16(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  // Random floats concentrated in the fp16 range.
  std::uniform_real_distribution<float> e(-26.0f, 17.0f);
  for (int i = 0; i < 1000000; ++i) check_fp16(std::exp2(e(rng)) * (i % 2 ? 1.0f : -1.0f));
  for (uint32_t nan : {0x7f800001u, 0x7fc00000u, 0xffc00000u, 0x7fbfffffu, 0xff800123u})
    check_fp16(std::bit_cast<float>(nan));
}

TEST(DType, Bf16AllPatternsAndEveryHalfwayPoint) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const float f = bf16_to_f32(h);
    const double want = ref_bf16_value(h);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f));
      ASSERT_EQ(f32_to_bf16(f), h | 0x40) << std::hex << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), want) << std::hex << i;
    ASSERT_EQ(f32_to_bf16(f), h) << std::hex << i;
    // The exact halfway point to the next pattern, and one float ulp either side.
    for (uint32_t low : {0x8000u, 0x7fffu, 0x8001u, 0x0001u, 0xffffu})
      check_bf16(std::bit_cast<float>((i << 16) | low));
  }
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x7f7f8000u)), 0x7f80);  // overflow to inf
}

TEST(DType, Bf16SweepAndRandom) {
  for (uint64_t bits = 0; bits < (1ull << 32); bits += 4099)
    check_bf16(std::bit_cast<float>(static_cast<uint32_t>(bits)));
  std::mt19937 rng(11);
  for (int i = 0; i < 1000000; ++i) check_bf16(std::bit_cast<float>(static_cast<uint32_t>(rng())));
}

TEST(DType, RowConversionsMatchTheScalarOnes) {
  // 1000 elements: more than the 256-element staging buffer of fp16 <-> bf16 conversion.
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 100.0f);
  std::vector<float> f(1000);
  for (auto& x : f) x = nd(rng);
  std::vector<uint16_t> h(1000), b(1000), hb(1000), bh(1000);
  from_f32(f.data(), h.data(), DType::kF16, f.size());
  from_f32(f.data(), b.data(), DType::kBF16, f.size());
  convert_row(h.data(), DType::kF16, hb.data(), DType::kBF16, f.size());
  convert_row(b.data(), DType::kBF16, bh.data(), DType::kF16, f.size());
  std::vector<float> back(1000);
  to_f32(h.data(), DType::kF16, back.data(), f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    ASSERT_EQ(h[i], f32_to_fp16(f[i]));
    ASSERT_EQ(b[i], f32_to_bf16(f[i]));
    ASSERT_EQ(hb[i], f32_to_bf16(fp16_to_f32(h[i])));
    ASSERT_EQ(bh[i], f32_to_fp16(bf16_to_f32(b[i])));
    ASSERT_EQ(back[i], fp16_to_f32(h[i]));
    ASSERT_EQ(load_f32(b.data(), DType::kBF16, i), bf16_to_f32(b[i]));
  }
}

TEST(DType, NamesSizesAndParsing) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16})
    EXPECT_EQ(dtype_from_string(dtype_name(t)), t);
  EXPECT_EQ(dtype_from_string("fp16"), DType::kF16);
  EXPECT_EQ(dtype_from_string("bf16"), DType::kBF16);
  EXPECT_THROW(dtype_from_string("int8"), Error);
}

}  // namespace
}  // namespace vq
