// Tests of the packed format (code packing, fp8 e4m3, metadata rounding, row records) and the
// group quantizer: reference vs optimised bit for bit, fp32 metadata vs a plain scalar
// implementation of the original formulas, the alpha = 1 error bound, clip search, bits sweep,
// ragged groups, byte formulas and parameter checks.
//
// Shapes: rows [n, d] fp32 row-major; lo/scale [n, ceil(d/g)].
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "veloxquant/error.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/packed.h"

namespace vq {
namespace {

constexpr float kU = 0x1p-24f;  // fp32 unit roundoff

std::vector<float> gaussian(int64_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

// Rows with channel c scaled by 0.1 * (1 + c % 7) * (c % 11 == 0 ? 20 : 1): heterogeneous.
std::vector<float> heterogeneous(int64_t n, int64_t d, uint64_t seed) {
  auto v = gaussian(n * d, seed);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c)
      v[r * d + c] *= 0.1f * static_cast<float>(1 + c % 7) * (c % 11 == 0 ? 20.0f : 1.0f);
  return v;
}

bool same_bits(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// ------------------------------------------------------------------------------------------
// Packed format

TEST(Packed, CodeSpecAcceptsOneToEightAndOnePointFive) {
  for (int b = 1; b <= 8; ++b) {
    const CodeSpec s = code_spec_from_bits(b);
    EXPECT_EQ(s.bits(), b);
    EXPECT_EQ(s.levels(), (1 << b) - 1);
    EXPECT_FALSE(s.ternary());
  }
  const CodeSpec t = code_spec_from_bits(1.5);
  EXPECT_TRUE(t.ternary());
  EXPECT_EQ(t.levels(), 2);
  for (double bad : {0.0, 9.0, 2.5, -1.0}) {
    try {
      (void)code_spec_from_bits(bad);
      ADD_FAILURE() << "bits " << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("bits"), std::string::npos) << e.what();
    }
  }
}

TEST(Packed, PackUnpackRoundTripAllWidthsAwkwardLengths) {
  std::mt19937_64 rng(7);
  for (double bits : {1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0}) {
    const CodeSpec s = code_spec_from_bits(bits);
    for (int64_t n : {1, 2, 3, 5, 7, 8, 17, 64, 127, 128, 129}) {
      std::vector<uint8_t> codes(static_cast<size_t>(n)), back(static_cast<size_t>(n));
      for (auto& c : codes) c = static_cast<uint8_t>(rng() % (s.levels() + 1));
      std::vector<uint8_t> packed(static_cast<size_t>(packed_code_bytes(n, s)) + 1, 0xAB);
      pack_codes(codes.data(), n, s, packed.data());
      EXPECT_EQ(packed.back(), 0xAB) << "wrote past the packed size, bits " << bits;
      unpack_codes(packed.data(), n, s, back.data());
      EXPECT_EQ(codes, back) << "bits " << bits << " n " << n;
    }
  }
}

TEST(Packed, BitLayoutIsLittleEndianStream) {
  const uint8_t c2[4] = {1, 2, 3, 0};
  uint8_t out[2] = {0, 0};
  pack_codes(c2, 4, code_spec_from_bits(2), out);
  EXPECT_EQ(out[0], 0b00111001);
  const uint8_t c3[3] = {5, 6, 7};  // bits 0-2: 101, 3-5: 110, 6-8: 111
  uint8_t out3[2];
  pack_codes(c3, 3, code_spec_from_bits(3), out3);
  EXPECT_EQ(out3[0], static_cast<uint8_t>(0b11110101));
  EXPECT_EQ(out3[1], 0b1);
  const uint8_t t[6] = {1, 2, 0, 0, 1, 2};  // byte 0 = 1 + 2*3 + 1*81, byte 1 = 2
  uint8_t out5[2];
  pack_codes(t, 6, code_spec_from_bits(1.5), out5);
  EXPECT_EQ(out5[0], 88);
  EXPECT_EQ(out5[1], 2);
  EXPECT_EQ(packed_code_bytes(128, code_spec_from_bits(1.5)), 26);
  EXPECT_EQ(packed_code_bytes(10, code_spec_from_bits(3)), 4);
}

// Every fp8 e4m3 code: decode is the OCP E4M3FN value, encode(decode(c)) == c, and encode
// rounds every value between neighbours to the nearer (ties to the even code).
TEST(Packed, Fp8E4m3ExhaustiveAllCodes) {
  std::vector<std::pair<float, int>> finite;  // (value, code) of non-negative finite codes
  for (int c = 0; c < 256; ++c) {
    const float v = fp8_e4m3_decode(static_cast<uint8_t>(c));
    const int e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) {
      EXPECT_TRUE(std::isnan(v)) << c;
      EXPECT_EQ(fp8_e4m3_encode(v) & 0x7f, 0x7f);
      continue;
    }
    const double expect =
        (c & 0x80 ? -1.0 : 1.0) * (e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10));
    EXPECT_EQ(static_cast<double>(v), expect) << c;
    EXPECT_EQ(fp8_e4m3_encode(v), c) << c;
    if (!(c & 0x80)) finite.push_back({v, c});
  }
  ASSERT_EQ(finite.size(), 127u);
  EXPECT_EQ(finite.back().first, 448.0f);
  std::sort(finite.begin(), finite.end());
  for (size_t i = 0; i + 1 < finite.size(); ++i) {
    const float a = finite[i].first, b = finite[i + 1].first;
    const float mid = (a + b) / 2;  // exact in fp32 (few significant bits)
    const int even = (finite[i].second % 2 == 0) ? finite[i].second : finite[i + 1].second;
    EXPECT_EQ(fp8_e4m3_encode(mid), even) << "tie at " << mid;
    EXPECT_EQ(fp8_e4m3_encode(-mid), even | 0x80) << "tie at " << -mid;
    EXPECT_EQ(fp8_e4m3_encode(std::nextafter(mid, 0.0f)), finite[i].second);
    EXPECT_EQ(fp8_e4m3_encode(std::nextafter(mid, 1e9f)), finite[i + 1].second);
  }
  // Saturation, infinities and signed zero.
  EXPECT_EQ(fp8_e4m3_encode(464.0f), 0x7e);
  EXPECT_EQ(fp8_e4m3_encode(1e30f), 0x7e);
  EXPECT_EQ(fp8_e4m3_encode(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(fp8_e4m3_encode(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(fp8_e4m3_encode(-0.0f), 0x80);
  EXPECT_EQ(fp8_e4m3_encode(0x1p-11f), 0x00);   // a quarter step rounds to zero
  EXPECT_EQ(fp8_e4m3_encode(0x1p-10f), 0x00);   // half step: tie to even (0)
  EXPECT_EQ(fp8_e4m3_encode(0x1.8p-9f), 0x02);  // 1.5 steps: tie to even (2)
}

TEST(Packed, MetaRoundingSaturatesAndFloorsScale) {
  EXPECT_EQ(meta_round(1e6f, MetaType::kF16), 65504.0f);
  EXPECT_EQ(meta_round(-1e6f, MetaType::kF16), -65504.0f);
  EXPECT_EQ(meta_round(0.1f, MetaType::kF32), 0.1f);
  EXPECT_EQ(meta_round_scale(1e-8f, MetaType::kF16), 0x1p-24f);
  EXPECT_EQ(meta_round_scale(1e-8f, MetaType::kFP8E4M3), 0x1p-9f);
  EXPECT_EQ(meta_round_scale(1e-8f, MetaType::kF32), 1e-8f);
  uint8_t buf[8];
  for (MetaType t : {MetaType::kF16, MetaType::kF32, MetaType::kFP8E4M3}) {
    const float v = meta_round(-3.3f, t);
    meta_store(buf, 1, v, t);
    EXPECT_EQ(meta_load(buf, 1, t), v);
  }
}

TEST(Packed, RowFormatSizes) {
  const PackedRowFormat f = make_row_format(128, 2, 32, MetaType::kF16);
  EXPECT_EQ(f.n_groups, 4);
  EXPECT_EQ(f.code_bytes, 32);
  EXPECT_EQ(f.row_stride, 48);
  const PackedRowFormat g = make_row_format(10, 3, 4, MetaType::kF32);
  EXPECT_EQ(g.n_groups, 3);
  EXPECT_EQ(g.code_bytes, 4);  // 30 bits -> 4 bytes, already 4-aligned
  EXPECT_EQ(g.row_stride, 4 + 3 * 2 * 4);
  const PackedRowFormat t = make_row_format(128, 1.5, 32, MetaType::kFP8E4M3);
  EXPECT_EQ(t.code_bytes, 26);
  EXPECT_EQ(t.row_stride, 26 + 8);
}

// ------------------------------------------------------------------------------------------
// Byte formulas (seed helpers)

TEST(GroupQuant, ByteHelpersSeedValues) {
  const SkvqBytes a = skvq_compressed_bytes(100, 64, 2, 16);
  EXPECT_EQ(a.code_bytes, 1600);
  EXPECT_EQ(a.meta_bytes, 1600);
  const SkvqBytes b = skvq_compressed_bytes(10, 10, 4, 4);
  EXPECT_EQ(b.code_bytes, 50);
  EXPECT_EQ(b.meta_bytes, 120);
  EXPECT_EQ(skvq_compressed_bytes(10, 10, 4, 4, MetaType::kF32).meta_bytes, 240);
  EXPECT_EQ(skvq_compressed_bytes(10, 10, 4, 4, MetaType::kFP8E4M3).meta_bytes, 60);
  EXPECT_EQ(skvq_compressed_bytes(3, 128, 1.5, 32).code_bytes, 3 * 26);
  EXPECT_EQ(skvq_fp16_bytes(35, 64), 35 * 64 * 2);
}

// ------------------------------------------------------------------------------------------
// Quantizer

struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<float> lo, scale;
};

Quantized run_ref(const std::vector<float>& x, int64_t n, int64_t d, const GroupQuantParams& p) {
  const int64_t ng = (d + p.group_size - 1) / p.group_size;
  Quantized q{std::vector<uint8_t>(static_cast<size_t>(n * d)),
              std::vector<float>(static_cast<size_t>(n * ng)),
              std::vector<float>(static_cast<size_t>(n * ng))};
  group_quantize_reference(x.data(), n, d, p, q.codes.data(), q.lo.data(), q.scale.data());
  return q;
}

Quantized run_opt(const std::vector<float>& x, int64_t n, int64_t d, const GroupQuantParams& p) {
  const int64_t ng = (d + p.group_size - 1) / p.group_size;
  Quantized q{std::vector<uint8_t>(static_cast<size_t>(n * d)),
              std::vector<float>(static_cast<size_t>(n * ng)),
              std::vector<float>(static_cast<size_t>(n * ng))};
  group_quantize(x.data(), n, d, p, q.codes.data(), q.lo.data(), q.scale.data());
  return q;
}

bool same(const Quantized& a, const Quantized& b) {
  if (a.codes != b.codes || a.lo.size() != b.lo.size()) return false;
  for (size_t i = 0; i < a.lo.size(); ++i)
    if (!same_bits(a.lo[i], b.lo[i]) || !same_bits(a.scale[i], b.scale[i])) return false;
  return true;
}

TEST(GroupQuant, OptimisedEqualsReferenceBitForBit) {
  int cases = 0;
  for (double bits : {1.0, 1.5, 2.0, 3.0, 4.0, 8.0})
    for (int64_t d : {10, 64, 128})
      for (int64_t g : {4, 16, 32})
        for (MetaType m : {MetaType::kF16, MetaType::kF32, MetaType::kFP8E4M3})
          for (bool search : {true, false}) {
            const int64_t n = (cases % 3 == 0) ? 1 : (cases % 3 == 1 ? 17 : 100);
            const auto x = heterogeneous(n, d, 100 + cases);
            GroupQuantParams p{bits, g, search, 0.9f, m};
            EXPECT_TRUE(same(run_ref(x, n, d, p), run_opt(x, n, d, p)))
                << "bits " << bits << " d " << d << " g " << g << " meta " << int(m) << " search "
                << search << " n " << n;
            ++cases;
          }
  EXPECT_EQ(cases, 6 * 3 * 3 * 3 * 2);
}

// A plain, independent scalar implementation of the original formulas with fp32 metadata
// (MLX semantics: fp32 arithmetic, rint = round half to even, mean of squared error, argmin
// takes the first minimum). With fp32 metadata our quantizer must match it bit for bit, in
// codes, lo, scale and reconstruction.
void plain_original(const std::vector<float>& x, int64_t n, int64_t d, int64_t gs, int bits,
                    std::vector<uint8_t>& codes, std::vector<float>& lo, std::vector<float>& sc,
                    std::vector<float>& recon) {
  const int64_t G = (d + gs - 1) / gs;
  const float levels = static_cast<float>((1 << bits) - 1);
  const float grid[5] = {1.0f, 0.97f, 0.94f, 0.90f, 0.85f};
  codes.assign(static_cast<size_t>(n * d), 0);
  lo.assign(static_cast<size_t>(n * G), 0);
  sc.assign(static_cast<size_t>(n * G), 0);
  recon.assign(static_cast<size_t>(n * d), 0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t gi = 0; gi < G; ++gi) {
      std::vector<float> v;
      for (int64_t i = 0; i < gs; ++i) v.push_back(x[r * d + std::min(gi * gs + i, d - 1)]);
      const float mn = *std::min_element(v.begin(), v.end());
      const float mx = *std::max_element(v.begin(), v.end());
      const float mid = (mx + mn) / 2, rng = mx - mn;
      float errs[5], los[5], scs[5];
      for (int k = 0; k < 5; ++k) {
        los[k] = mid - grid[k] * rng / 2;
        scs[k] = std::max(grid[k] * rng / levels, 1e-8f);
        float acc = 0;
        for (float xi : v) {
          const float c = std::clamp(std::nearbyint((xi - los[k]) / scs[k]), 0.0f, levels);
          const float prod = c * scs[k];
          const float e = (prod + los[k]) - xi;
          acc += e * e;
        }
        errs[k] = acc / static_cast<float>(gs);
      }
      const int best = static_cast<int>(std::min_element(errs, errs + 5) - errs);
      lo[r * G + gi] = los[best];
      sc[r * G + gi] = scs[best];
      for (int64_t c = gi * gs; c < std::min(d, (gi + 1) * gs); ++c) {
        const float q =
            std::clamp(std::nearbyint((x[r * d + c] - los[best]) / scs[best]), 0.0f, levels);
        codes[r * d + c] = static_cast<uint8_t>(q);
        const float prod = q * scs[best];
        recon[r * d + c] = prod + los[best];
      }
    }
}

TEST(GroupQuant, Fp32MetadataMatchesPlainOriginalFormulasBitForBit) {
  for (int bits : {2, 3, 4, 8})
    for (int64_t d : {10, 64}) {
      const int64_t n = 64, gs = 16;
      const auto x = heterogeneous(n, d, 900 + bits * 7 + d);
      std::vector<uint8_t> pc;
      std::vector<float> pl, ps, pr;
      plain_original(x, n, d, gs, bits, pc, pl, ps, pr);
      GroupQuantParams p{static_cast<double>(bits), gs, true, 1.0f, MetaType::kF32};
      const Quantized q = run_opt(x, n, d, p);
      EXPECT_EQ(q.codes, pc) << bits;
      std::vector<float> rec(static_cast<size_t>(n * d));
      group_dequantize_reference(q.codes.data(), q.lo.data(), q.scale.data(), n, d, gs, rec.data());
      // Through row records as well (the cache's storage path).
      const PackedRowFormat f = make_row_format(d, bits, gs, MetaType::kF32);
      std::vector<uint8_t> recs(static_cast<size_t>(n * f.row_stride));
      quantize_to_records(x.data(), n, f, p, recs.data(), f.row_stride);
      std::vector<float> rec2(static_cast<size_t>(d));
      for (int64_t r = 0; r < n; ++r) {
        dequantize_record(recs.data() + r * f.row_stride, f, rec2.data());
        for (int64_t c = 0; c < d; ++c) {
          ASSERT_TRUE(same_bits(rec[r * d + c], pr[r * d + c])) << r << "," << c;
          ASSERT_TRUE(same_bits(rec2[c], pr[r * d + c])) << r << "," << c;
        }
      }
      for (size_t i = 0; i < pl.size(); ++i) {
        ASSERT_TRUE(same_bits(q.lo[i], pl[i]));
        ASSERT_TRUE(same_bits(q.scale[i], ps[i]));
      }
    }
}

// alpha = 1, fp32 metadata: |x - x_hat| <= scale/2 + eps with eps = 16 u M, M = max |x| over the
// group, u = 2^-24. Derivation: the code decision uses t = fl(fl(x - lo)/scale), within 2u|t| of
// the exact (x - lo)/scale, so an unclamped code is within 1/2 + 2u|t| steps (error scale/2 +
// 2u|x - lo| <= scale/2 + 4uM); lo = fl(fl((max+min)/2) - fl(rng/2)) is within 3uM + u*rng/2 <=
// 4uM of the group minimum and levels*scale within u*rng <= 2uM of rng, which bounds the clamped
// ends by 6uM; reconstruction fl(fl(c*scale) + lo) adds at most u*rng + u(|lo| + rng) <= 5uM.
// 4 + 6 + 5 = 15 <= 16. With fp16 metadata (u16 = 2^-11) the stored lo moves by <= u16*M and
// levels*scale by <= u16*rng <= 2*u16*M, so eps16 = 3 u16 M + 16 u M + 2^-24 (subnormal lo).
TEST(GroupQuant, AlphaOneErrorBoundHalfScale) {
  for (MetaType m : {MetaType::kF32, MetaType::kF16})
    for (int bits : {1, 2, 4, 8}) {
      const int64_t n = 200, d = 64, gs = 32;
      const auto x = heterogeneous(n, d, 1234 + bits);
      GroupQuantParams p{static_cast<double>(bits), gs, false, 1.0f, m};
      const Quantized q = run_opt(x, n, d, p);
      std::vector<float> rec(static_cast<size_t>(n * d));
      group_dequantize_reference(q.codes.data(), q.lo.data(), q.scale.data(), n, d, gs, rec.data());
      double worst_used = 0;
      for (int64_t r = 0; r < n; ++r)
        for (int64_t gi = 0; gi < d / gs; ++gi) {
          float mabs = 0;
          for (int64_t c = gi * gs; c < (gi + 1) * gs; ++c)
            mabs = std::max(mabs, std::fabs(x[r * d + c]));
          const double eps = (m == MetaType::kF32)
                                 ? 16.0 * kU * mabs
                                 : 3.0 * 0x1p-11 * mabs + 16.0 * kU * mabs + 0x1p-24;
          const double bound = q.scale[r * (d / gs) + gi] / 2.0 + eps;
          for (int64_t c = gi * gs; c < (gi + 1) * gs; ++c) {
            const double err = std::fabs(static_cast<double>(x[r * d + c]) - rec[r * d + c]);
            ASSERT_LE(err, bound) << "bits " << bits << " meta " << int(m) << " row " << r;
            worst_used = std::max(worst_used, err / bound);
          }
        }
      EXPECT_GT(worst_used, 0.5) << "bound never approached: test would not catch a regression";
    }
}

// alpha = 1 is plain asymmetric min/max quantization (lo = min, scale = (max - min)/levels) up to
// fp32 rounding of mid -/+ rng/2: codes agree on > 99.9% of elements and never differ by more
// than one step.
TEST(GroupQuant, AlphaOneMatchesPlainMinMax) {
  const int64_t n = 512, d = 64, gs = 16;
  const auto x = heterogeneous(n, d, 31);
  GroupQuantParams p{3, gs, false, 1.0f, MetaType::kF32};
  const Quantized q = run_opt(x, n, d, p);
  int64_t same = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) {
      const int64_t g0 = c / gs * gs;
      float mn = x[r * d + g0], mx = mn;
      for (int64_t i = g0; i < g0 + gs; ++i) {
        mn = std::min(mn, x[r * d + i]);
        mx = std::max(mx, x[r * d + i]);
      }
      const float sc = std::max((mx - mn) / 7.0f, 1e-8f);
      const int plain =
          static_cast<int>(std::clamp(std::nearbyint((x[r * d + c] - mn) / sc), 0.0f, 7.0f));
      const int got = q.codes[r * d + c];
      ASSERT_LE(std::abs(got - plain), 1);
      same += got == plain;
    }
  EXPECT_GT(double(same) / double(n * d), 0.999);
}

// Per-group mean squared error in element order (the quantizer's own criterion, pad included).
std::vector<float> group_mse(const std::vector<float>& x, const Quantized& q, int64_t n, int64_t d,
                             int64_t gs) {
  const int64_t G = (d + gs - 1) / gs;
  std::vector<float> rec(static_cast<size_t>(n * d));
  group_dequantize_reference(q.codes.data(), q.lo.data(), q.scale.data(), n, d, gs, rec.data());
  std::vector<float> out(static_cast<size_t>(n * G));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t gi = 0; gi < G; ++gi) {
      float acc = 0;
      for (int64_t c = gi * gs; c < (gi + 1) * gs; ++c) {
        const float e = rec[r * d + c] - x[r * d + c];
        acc += e * e;
      }
      out[r * G + gi] = acc / static_cast<float>(gs);
    }
  return out;
}

TEST(GroupQuant, ClipSearchNeverWorseThanAlphaOnePerGroup) {
  const int64_t n = 256, d = 64, gs = 16;
  auto x = gaussian(n * d, 55);
  std::mt19937_64 rng(56);
  for (auto& v : x)
    if (rng() % 50 == 0) v *= 20.0f;  // sparse x20 outliers
  for (int bits : {2, 3, 4}) {
    GroupQuantParams search{static_cast<double>(bits), gs, true, 1.0f, MetaType::kF32};
    GroupQuantParams one{static_cast<double>(bits), gs, false, 1.0f, MetaType::kF32};
    const auto es = group_mse(x, run_opt(x, n, d, search), n, d, gs);
    const auto e1 = group_mse(x, run_opt(x, n, d, one), n, d, gs);
    double ts = 0, t1 = 0;
    for (size_t i = 0; i < es.size(); ++i) {
      ASSERT_LE(es[i], e1[i]) << "group " << i << " bits " << bits;
      ts += es[i];
      t1 += e1[i];
    }
    EXPECT_LT(ts, t1) << "clip search should win in total on outlier data, bits " << bits;
  }
}

// skvq_value_clip_floor (GroupQuantParams::clip_floor): the search continues below the seed's
// 0.85. The optimised quantizer and the reference agree bit for bit on the longer grids; a
// superset of alphas with ties to the earlier one can only lower each group's error (the errors
// of the shared alphas are the same floats); at 2 bits on normal groups of 32 the tail is where
// the optimum lies (range ~4.1 sigma, best step ~1.0 sigma: alpha ~0.73), so the mean error must
// fall by a clear margin (measured 0.85x at floor 0.5; a search that ignored the floor gives
// 1.0x) and the chosen alphas must reach past the seed's five.
TEST(GroupQuant, ClipFloorExtendsTheSearch) {
  for (double floor : {0.8, 0.5, 0.25})
    for (double bits : {1.5, 2.0, 4.0})
      for (MetaType m : {MetaType::kF16, MetaType::kFP8E4M3}) {
        const int64_t n = 37, d = 72, gs = 32;
        const auto x = heterogeneous(n, d, 77);
        GroupQuantParams p{bits, gs, true, 1.0f, m, floor};
        EXPECT_TRUE(same(run_ref(x, n, d, p), run_opt(x, n, d, p)))
            << "floor " << floor << " bits " << bits << " meta " << int(m);
      }
  const int64_t n = 512, d = 64, gs = 32;
  const auto x = gaussian(n * d, 91);
  GroupQuantParams seed{2.0, gs, true, 1.0f, MetaType::kF32};
  GroupQuantParams wide = seed;
  wide.clip_floor = 0.5;
  const auto es = group_mse(x, run_opt(x, n, d, seed), n, d, gs);
  const auto ew = group_mse(x, run_opt(x, n, d, wide), n, d, gs);
  double ts = 0, tw = 0;
  for (size_t i = 0; i < es.size(); ++i) {
    ASSERT_LE(ew[i], es[i]) << "group " << i;
    ts += es[i];
    tw += ew[i];
  }
  EXPECT_LT(tw, 0.9 * ts) << "mean error ratio " << tw / ts;
  std::vector<uint8_t> codes(static_cast<size_t>(n * d)), idx(static_cast<size_t>(n * 2));
  std::vector<float> lo(idx.size()), sc(idx.size());
  group_quantize_reference(x.data(), n, d, wide, codes.data(), lo.data(), sc.data(), idx.data());
  int64_t tail = 0;
  for (uint8_t k : idx) {
    ASSERT_LT(k, 5 + 7) << "an alpha below the floor";  // 0.80 .. 0.50: seven tail entries
    tail += k >= 5;
  }
  EXPECT_GT(tail, n) << "groups choosing an alpha below 0.85";
  // A floor outside [0.25, 0.85] is refused.
  for (double bad : {0.2, 0.9}) {
    GroupQuantParams b = seed;
    b.clip_floor = bad;
    EXPECT_THROW(run_opt(x, 2, d, b), Error) << bad;
  }
}

TEST(GroupQuant, ErrorFallsAsBitsRise) {
  const int64_t n = 256, d = 128, gs = 32;
  const auto x = gaussian(n * d, 77);
  double prev = 1e30;
  for (int bits : {1, 2, 3, 4, 5, 6, 7, 8}) {
    GroupQuantParams p{static_cast<double>(bits), gs, true, 1.0f, MetaType::kF16};
    const auto e = group_mse(x, run_opt(x, n, d, p), n, d, gs);
    double mse = 0;
    for (float v : e) mse += v;
    mse /= static_cast<double>(e.size());
    EXPECT_LT(mse, prev) << bits;
    prev = mse;
    // 8 bits: scale ~ range/255 ~ 5/255 for 32 N(0,1) samples, MSE ~ scale^2/12 ~ 3e-5.
    if (bits == 8) {
      EXPECT_LT(mse, 1e-4);
    }
  }
}

TEST(GroupQuant, OnePointFiveBitsUsesThreeLevels) {
  const int64_t n = 32, d = 64, gs = 32;
  const auto x = gaussian(n * d, 3);
  GroupQuantParams p{1.5, gs, true, 1.0f, MetaType::kF16};
  const Quantized q = run_opt(x, n, d, p);
  std::vector<int> seen(3, 0);
  for (uint8_t c : q.codes) {
    ASSERT_LE(c, 2);
    seen[c]++;
  }
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  EXPECT_GT(seen[2], 0);
}

// Ragged d = 10, g = 4: three groups, the last padded by repeating channel 9. Metamorphic: it
// equals quantizing the explicitly padded d = 12 rows and dropping the two pad codes.
TEST(GroupQuant, RaggedLastGroupRepeatsLastChannel) {
  const int64_t n = 16, d = 10, gs = 4;
  auto x = heterogeneous(n, d, 11);
  std::vector<float> padded(static_cast<size_t>(n * 12));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < 12; ++c) padded[r * 12 + c] = x[r * d + std::min<int64_t>(c, 9)];
  for (MetaType m : {MetaType::kF32, MetaType::kF16}) {
    GroupQuantParams p{3, gs, true, 1.0f, m};
    const Quantized a = run_opt(x, n, d, p);
    const Quantized b = run_opt(padded, n, 12, p);
    ASSERT_EQ(a.lo.size(), static_cast<size_t>(n * 3));
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < d; ++c) EXPECT_EQ(a.codes[r * d + c], b.codes[r * 12 + c]);
    for (size_t i = 0; i < a.lo.size(); ++i) {
      EXPECT_TRUE(same_bits(a.lo[i], b.lo[i]));
      EXPECT_TRUE(same_bits(a.scale[i], b.scale[i]));
    }
  }
}

TEST(GroupQuant, ConstantAndZeroGroupsRoundTripExactly) {
  const int64_t n = 3, d = 32, gs = 16;
  std::vector<float> x(static_cast<size_t>(n * d), 0.0f);
  for (int64_t c = 0; c < d; ++c) x[d + c] = 0.75f;  // row 1 constant (fp16-exact)
  for (int64_t c = 0; c < d; ++c) x[2 * d + c] = (c < 16) ? -2.5f : 0.0f;
  for (MetaType m : {MetaType::kF32, MetaType::kF16}) {
    GroupQuantParams p{2, gs, true, 1.0f, m};
    const Quantized q = run_opt(x, n, d, p);
    std::vector<float> rec(static_cast<size_t>(n * d));
    group_dequantize_reference(q.codes.data(), q.lo.data(), q.scale.data(), n, d, gs, rec.data());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(rec[i], x[i]) << i;
  }
}

TEST(GroupQuant, RecordsDecodeToReferenceDequantization) {
  for (double bits : {1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 8.0})
    for (MetaType m : {MetaType::kF16, MetaType::kF32, MetaType::kFP8E4M3}) {
      const int64_t n = 37, d = 72, gs = 32;  // ragged last group of 8
      const auto x = heterogeneous(n, d, 4321);
      GroupQuantParams p{bits, gs, true, 1.0f, m};
      const Quantized q = run_ref(x, n, d, p);
      std::vector<float> rec(static_cast<size_t>(n * d));
      group_dequantize_reference(q.codes.data(), q.lo.data(), q.scale.data(), n, d, gs, rec.data());
      const PackedRowFormat f = make_row_format(d, bits, gs, m);
      std::vector<uint8_t> recs(static_cast<size_t>(n * f.row_stride));
      quantize_to_records(x.data(), n, f, p, recs.data(), f.row_stride, true);
      std::vector<float> row(static_cast<size_t>(d));
      for (int64_t r = 0; r < n; ++r) {
        dequantize_record(recs.data() + r * f.row_stride, f, row.data());
        for (int64_t c = 0; c < d; ++c)
          ASSERT_TRUE(same_bits(row[c], rec[r * d + c])) << bits << " " << int(m);
      }
    }
}

// Channel-axis chunks (packed.h, skvq_key_axis=channel): channel c over the chunk's n rows is one
// group of the scalar reference quantizer; every code, the metadata bits, the padding slots,
// dequantize_row and the byte formula are checked exactly, for every width and metadata type,
// chunks at and above the format's shortest and metadata slots per record from 1 to 12.
TEST(GroupQuant, ChannelChunkRecordsMatchPerChannelReferenceExactly) {
  struct Shape {
    int64_t n, d, min_rows;
  };
  int cases = 0;
  for (const Shape sh : {Shape{123, 64, 123}, Shape{128, 64, 123}, Shape{28, 64, 28},
                         Shape{17, 96, 17}, Shape{256, 128, 256}, Shape{5, 3, 4}})
    for (double bits : {1.0, 1.5, 2.0, 3.0, 4.0, 8.0})
      for (MetaType m : {MetaType::kF16, MetaType::kF32, MetaType::kFP8E4M3})
        for (bool clip : {true, false}) {
          const int64_t n = sh.n, d = sh.d;
          const auto x = heterogeneous(n, d, 77 + static_cast<uint64_t>(cases));
          const GroupQuantParams p{bits, 32, clip, clip ? 1.0f : 0.9f, m};
          const PackedRowFormat f = make_channel_row_format(d, bits, sh.min_rows, m);
          ASSERT_EQ(f.n_groups, (2 * d + sh.min_rows - 1) / sh.min_rows);
          ASSERT_EQ(f.row_stride, f.code_bytes + f.n_groups * meta_size(m));
          std::vector<uint8_t> recs(static_cast<size_t>(n * f.row_stride), 0xAB);
          quantize_chunk_to_records(x.data(), n, f, p, recs.data(), f.row_stride);
          PackedTensor t;
          t.data = recs.data();
          t.fmt = f;
          std::vector<float> row(static_cast<size_t>(d));
          std::vector<std::vector<float>> deq(static_cast<size_t>(n), row);
          for (int64_t r = 0; r < n; ++r) dequantize_row(t, 0, 0, r, deq[r].data());
          for (int64_t c = 0; c < d; ++c) {
            std::vector<float> col(static_cast<size_t>(n));
            for (int64_t r = 0; r < n; ++r) col[r] = x[r * d + c];
            GroupQuantParams pc = p;
            pc.group_size = n;
            std::vector<uint8_t> codes(static_cast<size_t>(n));
            float lo = 0, sc = 0;
            group_quantize_reference(col.data(), 1, n, pc, codes.data(), &lo, &sc);
            ASSERT_TRUE(same_bits(channel_meta(recs.data(), f.row_stride, f, 2 * c), lo));
            ASSERT_TRUE(same_bits(channel_meta(recs.data(), f.row_stride, f, 2 * c + 1), sc));
            for (int64_t r = 0; r < n; ++r) {
              ASSERT_EQ(code_at(recs.data() + r * f.row_stride, c, f.spec), codes[r])
                  << "bits " << bits << " row " << r << " channel " << c;
              ASSERT_TRUE(same_bits(deq[r][c], dequantize_code(codes[r], sc, lo)));
            }
          }
          // Slots past the 2d elements are zero bytes; the codes' padding too.
          for (int64_t e = 2 * d; e < n * f.n_groups; ++e) {
            const uint8_t* slot = recs.data() + (e / f.n_groups) * f.row_stride + f.code_bytes +
                                  (e % f.n_groups) * meta_size(m);
            for (int i = 0; i < meta_size(m); ++i) ASSERT_EQ(slot[i], 0) << "slot " << e;
          }
          const SkvqBytes b = skvq_channel_bytes(n, f);
          EXPECT_EQ(b.code_bytes,
                    f.spec.ternary() ? n * ((d + 4) / 5) : (n * d * f.spec.bits() + 7) / 8);
          EXPECT_EQ(b.meta_bytes, n * f.n_groups * meta_size(m));
          ++cases;
        }
  EXPECT_EQ(cases, 6 * 6 * 3 * 2);
}

TEST(GroupQuant, ChannelChunkRefusesShortChunksAndOtherFormats) {
  const PackedRowFormat f = make_channel_row_format(64, 2, 32, MetaType::kF16);  // 4 slots
  const auto x = gaussian(64 * 64, 5);
  std::vector<uint8_t> recs(static_cast<size_t>(64 * f.row_stride));
  const GroupQuantParams p{2, 32, true, 1.0f, MetaType::kF16};
  try {
    quantize_chunk_to_records(x.data(), 31, f, p, recs.data(), f.row_stride);
    ADD_FAILURE() << "a 31-row chunk of a 32-row format accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected a chunk of at least 32 rows"), std::string::npos)
        << e.what();
  }
  const GroupQuantParams p4{4, 32, true, 1.0f, MetaType::kF16};
  EXPECT_THROW(quantize_chunk_to_records(x.data(), 32, f, p4, recs.data(), f.row_stride), Error);
  const PackedRowFormat tok = make_row_format(64, 2, 32, MetaType::kF16);
  EXPECT_THROW(quantize_chunk_to_records(x.data(), 32, tok, p, recs.data(), tok.row_stride), Error);
  std::vector<float> out(64);
  EXPECT_THROW(dequantize_record(recs.data(), f, out.data()), Error);
  EXPECT_THROW(make_channel_row_format(64, 2, 0, MetaType::kF16), Error);
}

// Keys shaped like an LLM's (each channel a fixed offset, outlier channels 10x larger, small
// per-token spread): one (lo, scale) per channel over the chunk beats groups of 32 channels per
// row at 2 bits by far, in fewer bytes per row.
TEST(GroupQuant, ChannelAxisBeatsTokenAxisOnChannelOffsets) {
  const int64_t n = 128, d = 64;
  auto x = gaussian(n * d, 99, 0.5f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c)
      x[r * d + c] += 3.0f * static_cast<float>(c % 5 - 2) * (c % 11 == 0 ? 10.0f : 1.0f);
  const GroupQuantParams p{2, 32, true, 1.0f, MetaType::kF16};
  const PackedRowFormat fc = make_channel_row_format(d, 2, n, MetaType::kF16);
  const PackedRowFormat ft = make_row_format(d, 2, 32, MetaType::kF16);
  std::vector<uint8_t> rc(static_cast<size_t>(n * fc.row_stride)),
      rt(static_cast<size_t>(n * ft.row_stride));
  quantize_chunk_to_records(x.data(), n, fc, p, rc.data(), fc.row_stride);
  quantize_to_records(x.data(), n, ft, p, rt.data(), ft.row_stride, false);
  PackedTensor tc, tt;
  tc.data = rc.data();
  tc.fmt = fc;
  tt.data = rt.data();
  tt.fmt = ft;
  double ec = 0, et = 0;
  std::vector<float> a(static_cast<size_t>(d)), b(static_cast<size_t>(d));
  for (int64_t r = 0; r < n; ++r) {
    dequantize_row(tc, 0, 0, r, a.data());
    dequantize_row(tt, 0, 0, r, b.data());
    for (int64_t c = 0; c < d; ++c) {
      ec += std::pow(a[c] - x[r * d + c], 2);
      et += std::pow(b[c] - x[r * d + c], 2);
    }
  }
  EXPECT_LT(ec, 0.25 * et) << "channel " << ec << " token " << et;
  EXPECT_LT(fc.row_stride, ft.row_stride);  // 16 + 2 vs 16 + 8 bytes per row
}

TEST(GroupQuant, DeterministicAndBadParamsRefused) {
  const auto x = gaussian(64, 1);
  GroupQuantParams p;
  p.group_size = 16;
  EXPECT_TRUE(same(run_opt(x, 2, 32, p), run_opt(x, 2, 32, p)));
  std::vector<uint8_t> c(64);
  std::vector<float> lo(8), sc(8);
  auto refused = [&](GroupQuantParams bad, const char* field) {
    try {
      group_quantize(x.data(), 2, 32, bad, c.data(), lo.data(), sc.data());
      ADD_FAILURE() << field << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  GroupQuantParams b1 = p;
  b1.group_size = 0;
  refused(b1, "group_size");
  GroupQuantParams b2 = p;
  b2.clip_alpha = 0.0f;
  refused(b2, "clip_alpha");
  GroupQuantParams b3 = p;
  b3.clip_alpha = 1.5f;
  refused(b3, "clip_alpha");
  GroupQuantParams b4 = p;
  b4.bits = 9;
  refused(b4, "bits");
}

}  // namespace
}  // namespace vq
