// Tests of packed.h's host/device codecs (the functions the CUDA kernels share with the CPU):
// code_at against a plain bit-stream / base-3 reading for every code spec, quant_code's rounding
// (ties to even, clamps, NaN), meta_encode / meta_decode against meta_store / meta_load and every
// fp8 byte, record_value against dequantize_record, and the record offsets.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "veloxquant/group_quant.h"
#include "veloxquant/packed.h"

namespace vq {
namespace {

TEST(PackedCodecs, CodeAtReadsEveryCodeSpec) {
  std::mt19937_64 rng(3);
  for (double bits : {1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0})
    for (int64_t n : {1, 5, 7, 64, 129}) {
      const CodeSpec spec = code_spec_from_bits(bits);
      std::vector<uint8_t> codes(static_cast<size_t>(n));
      for (auto& c : codes) c = static_cast<uint8_t>(rng() % (spec.levels() + 1));
      std::vector<uint8_t> packed(static_cast<size_t>(packed_code_bytes(n, spec)) + 1, 0);
      pack_codes(codes.data(), n, spec, packed.data());
      for (int64_t j = 0; j < n; ++j) {
        uint32_t want = 0;
        if (spec.ternary()) {  // digit j % 5 of byte j / 5, base 3
          uint32_t v = packed[j / 5];
          for (int64_t m = 0; m < j % 5; ++m) v /= 3;
          want = v % 3;
        } else {  // bit k of code j at stream bit j*b + k
          for (int k = 0; k < spec.bits(); ++k) {
            const int64_t bit = j * spec.bits() + k;
            want |= static_cast<uint32_t>((packed[bit / 8] >> (bit % 8)) & 1u) << k;
          }
        }
        ASSERT_EQ(code_at(packed.data(), j, spec), want) << "bits " << bits << " j " << j;
        ASSERT_EQ(want, codes[j]) << "bits " << bits << " j " << j;
      }
    }
}

TEST(PackedCodecs, QuantCodeRoundsTiesToEvenAndClamps) {
  EXPECT_EQ(quant_code(2.5f, 0.0f, 1.0f, 3.0f), 2.0f);  // tie -> even
  EXPECT_EQ(quant_code(1.5f, 0.0f, 1.0f, 3.0f), 2.0f);
  EXPECT_EQ(quant_code(0.5f, 0.0f, 1.0f, 3.0f), 0.0f);
  EXPECT_EQ(quant_code(-7.0f, 0.0f, 1.0f, 3.0f), 0.0f);
  EXPECT_EQ(quant_code(70.0f, 0.0f, 1.0f, 3.0f), 3.0f);
  EXPECT_EQ(quant_code(std::nanf(""), 0.0f, 1.0f, 15.0f), 0.0f);
  EXPECT_EQ(quant_code(INFINITY, 0.0f, 1.0f, 255.0f), 255.0f);
  // code * scale + lo, two roundings
  EXPECT_EQ(dequantize_code(3, 0.1f, 0.2f), 3.0f * 0.1f + 0.2f);
}

TEST(PackedCodecs, MetaEncodeDecodeMatchStoreAndLoad) {
  for (int b = 0; b < 256; ++b) {  // every fp8 byte
    const float x = meta_decode(static_cast<uint32_t>(b), MetaType::kFP8E4M3);
    EXPECT_EQ(f32_as_bits(x), f32_as_bits(fp8_e4m3_decode(static_cast<uint8_t>(b)))) << b;
    if (!std::isnan(x)) {
      EXPECT_EQ(fp8_e4m3_encode(x), b) << b;
    }
  }
  EXPECT_EQ(f32_as_bits(fp8_e4m3_decode(0xff)), 0x7fc00000u);  // NaN decodes as +NaN
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.0f, 30.0f);
  for (MetaType t : {MetaType::kF16, MetaType::kF32, MetaType::kFP8E4M3})
    for (int i = 0; i < 2000; ++i) {
      const float v = meta_round(nd(rng), t);
      uint8_t buf[8] = {};
      meta_store(buf, 1, v, t);
      const uint32_t bits = meta_encode(v, t);
      uint32_t stored = 0;
      for (int k = 0; k < meta_size(t); ++k)
        stored |= static_cast<uint32_t>(buf[meta_size(t) + k]) << (8 * k);
      ASSERT_EQ(stored, bits) << "type " << static_cast<int>(t) << " v " << v;
      ASSERT_EQ(meta_decode(bits, t), v);
      ASSERT_EQ(meta_load(buf, 1, t), v);
    }
}

TEST(PackedCodecs, RecordValueMatchesDequantizeRecord) {
  std::mt19937_64 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (double bits : {1.5, 2.0, 3.0, 4.0, 8.0})
    for (MetaType meta : {MetaType::kF16, MetaType::kF32, MetaType::kFP8E4M3})
      for (int64_t g : {16, 32, 48}) {
        const int64_t D = 128;
        const PackedRowFormat f = make_row_format(D, bits, g, meta);
        EXPECT_EQ(record_meta_offset(f), f.code_bytes);
        EXPECT_EQ(record_meta_offset(f, 2 * f.n_groups), f.row_stride);
        GroupQuantParams p;
        p.bits = bits;
        p.group_size = g;
        p.meta = meta;
        std::vector<float> x(static_cast<size_t>(D));
        for (auto& v : x) v = nd(rng);
        std::vector<uint8_t> rec(static_cast<size_t>(f.row_stride));
        quantize_to_records(x.data(), 1, f, p, rec.data(), f.row_stride, false);
        std::vector<float> out(static_cast<size_t>(D));
        dequantize_record(rec.data(), f, out.data());
        for (int64_t j = 0; j < D; ++j)
          ASSERT_EQ(f32_as_bits(record_value(rec.data(), f, j)), f32_as_bits(out[j]))
              << "bits " << bits << " g " << g << " j " << j;
      }
}

}  // namespace
}  // namespace vq
