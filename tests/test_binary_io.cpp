// Tests of the state-file framing (veloxquant/binary_io.h): every field type round-trips bit for
// bit, the frame layout is the documented one (checked with an independent xxHash64 call), and
// every corruption we can enumerate on a small frame (each flipped byte, each truncation, another
// method, another version, a lying length) is refused with a "[load_state]" error.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "util/test_util.h"
#include "veloxquant/binary_io.h"
#include "veloxquant/error.h"

namespace vq {
namespace {

std::string sample_frame(const std::string& method = "full") {
  StateWriter w;
  w.u8(7);
  w.i64(-42);
  w.str("hello");
  w.vec_i32({1, -2, 3});
  return w.frame(method);
}

// Expects f to throw vq::Error whose message contains `needle`.
template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    FAIL() << "expected a vq::Error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

uint64_t le64(const std::string& s, size_t at) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i)
    v |= static_cast<uint64_t>(static_cast<uint8_t>(s[at + i])) << (8 * i);
  return v;
}

TEST(BinaryIo, EveryFieldTypeRoundTrips) {
  const float nan_payload = std::bit_cast<float>(0x7fc12345u);
  Tensor big = test::random_tensor(DType::kBF16, 2, 3, 10, 5, 11);
  // A strided view: tokens 2..7 of every (b, h), so the writer must follow the strides.
  const TensorView strided = big.view().slice_tokens(2, 7);
  const Tensor f32t = test::random_tensor(DType::kF32, 1, 2, 3, 4, 12);

  StateWriter w;
  w.u8(255);
  w.u32(0xdeadbeefu);
  w.u64(0x0123456789abcdefull);
  w.i32(-5);
  w.i64(std::numeric_limits<int64_t>::min());
  w.f32(nan_payload);
  w.f32(-0.0f);
  w.f64(-1.0 / 3.0);
  w.boolean(true);
  w.str(std::string("a\0b", 3));
  const char raw[4] = {1, 2, 3, 4};
  w.bytes(raw, 4);
  w.blob(raw, 3);
  w.vec_i32({std::numeric_limits<int32_t>::min(), 0, 9});
  w.vec_i64({-1, 1ll << 40});
  w.vec_f32({1.5f, -2.25f});
  w.vec_u8({0, 200});
  w.vec_u16({0xffff, 1});
  w.tensor(strided);
  w.tensor(f32t.view());
  w.tensor(Tensor(DType::kF16, 1, 0, 3, 4).view());

  std::stringstream ss;
  w.write(ss, "unit");
  StateReader r(ss, "unit");
  EXPECT_EQ(r.method(), "unit");
  EXPECT_EQ(r.version(), kStateFormatVersion);
  EXPECT_EQ(r.u8(), 255);
  EXPECT_EQ(r.u32(), 0xdeadbeefu);
  EXPECT_EQ(r.u64(), 0x0123456789abcdefull);
  EXPECT_EQ(r.i32(), -5);
  EXPECT_EQ(r.i64(), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(std::bit_cast<uint32_t>(r.f32()), 0x7fc12345u);
  EXPECT_EQ(std::bit_cast<uint32_t>(r.f32()), 0x80000000u);
  EXPECT_EQ(r.f64(), -1.0 / 3.0);
  EXPECT_TRUE(r.boolean());
  EXPECT_EQ(r.str(), std::string("a\0b", 3));
  char back[4];
  r.bytes(back, 4);
  EXPECT_EQ(std::memcmp(back, raw, 4), 0);
  EXPECT_EQ(r.blob(), std::string(raw, 3));
  EXPECT_EQ(r.vec_i32(), (std::vector<int32_t>{std::numeric_limits<int32_t>::min(), 0, 9}));
  EXPECT_EQ(r.vec_i64(), (std::vector<int64_t>{-1, 1ll << 40}));
  EXPECT_EQ(r.vec_f32(), (std::vector<float>{1.5f, -2.25f}));
  EXPECT_EQ(r.vec_u8(), (std::vector<uint8_t>{0, 200}));
  EXPECT_EQ(r.vec_u16(), (std::vector<uint16_t>{0xffff, 1}));
  const Tensor t1 = r.tensor();
  EXPECT_TRUE(test::bit_equal(t1.view(), strided));
  EXPECT_TRUE(t1.view().is_contiguous());
  const Tensor t2 = r.tensor();
  EXPECT_TRUE(test::bit_equal(t2.view(), f32t.view()));
  const Tensor t3 = r.tensor();
  EXPECT_EQ(t3.numel(), 0);
  EXPECT_EQ(t3.shape(), (std::array<int64_t, 4>{1, 0, 3, 4}));
  EXPECT_EQ(r.remaining(), 0u);
  r.expect_end();
  expect_error([&] { r.u8(); }, "truncated payload");
}

TEST(BinaryIo, FrameLayoutIsTheDocumentedOne) {
  StateWriter w;
  w.u32(0x01020304u);
  const std::string f = w.frame("abc");
  // magic(8) version(4) method_len(4) "abc"(3) payload_len(8) payload(4) checksum(8)
  ASSERT_EQ(f.size(), 8u + 4 + 4 + 3 + 8 + 4 + 8);
  EXPECT_EQ(f.substr(0, 8), "VQKVSTAT");
  EXPECT_EQ(static_cast<uint8_t>(f[8]), kStateFormatVersion);
  EXPECT_EQ(f[9] | f[10] | f[11], 0);
  EXPECT_EQ(static_cast<uint8_t>(f[12]), 3);
  EXPECT_EQ(f.substr(16, 3), "abc");
  EXPECT_EQ(le64(f, 19), 4u);
  // Little-endian payload: lowest byte first.
  EXPECT_EQ(static_cast<uint8_t>(f[27]), 0x04);
  EXPECT_EQ(static_cast<uint8_t>(f[30]), 0x01);
  const uint64_t want = XXH64(f.data(), f.size() - 8, 0);
  EXPECT_EQ(le64(f, f.size() - 8), want);
}

TEST(BinaryIo, EveryFlippedByteIsRefused) {
  const std::string good = sample_frame();
  ASSERT_NO_THROW(StateReader::from_bytes(good, "full"));
  for (size_t i = 0; i < good.size(); ++i)
    for (uint8_t bit : {0x01, 0x80}) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ bit);
      try {
        StateReader::from_bytes(bad, "full");
        ADD_FAILURE() << "flipping bit " << int(bit) << " of byte " << i << " was accepted";
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()).rfind("[load_state]", 0), 0u) << e.what();
      }
    }
  // A flip inside the payload is reported as a checksum mismatch.
  std::string bad = good;
  bad[good.size() - 12] ^= 1;
  expect_error([&] { StateReader::from_bytes(bad, "full"); }, "checksum mismatch");
}

TEST(BinaryIo, EveryTruncationIsRefused) {
  const std::string good = sample_frame();
  for (size_t n = 0; n < good.size(); ++n)
    expect_error([&] { StateReader::from_bytes(good.substr(0, n), "full"); }, "truncated");
}

TEST(BinaryIo, OtherMethodVersionAndDataAreRefused) {
  expect_error([] { StateReader::from_bytes(sample_frame("snapkv"), "full"); },
               "expected method full but got snapkv");
  // Any method accepted when none is expected.
  EXPECT_EQ(StateReader::from_bytes(sample_frame("snapkv"), "").method(), "snapkv");

  // A version past kStateFormatVersionMax (5) with a valid checksum: refused as unsupported, not
  // as corrupt; versions 2 to 5 (skvq_key_axis=channel states, with skvq_key_rows, with
  // skvq_protect, with skvq_value_clip_floor) are read and reported.
  for (const char v : {char{2}, char{3}, char{4}, char{5}, char{6}, char{0}}) {
    std::string fr = sample_frame();
    fr[8] = v;
    const uint64_t sum = XXH64(fr.data(), fr.size() - 8, 0);
    for (size_t i = 0; i < 8; ++i)
      fr[fr.size() - 8 + i] = static_cast<char>((sum >> (8 * i)) & 0xff);
    if (v >= 2 && v <= 5)
      EXPECT_EQ(StateReader::from_bytes(fr, "full").version(), static_cast<uint32_t>(v));
    else
      expect_error([&] { StateReader::from_bytes(fr, "full"); }, "unsupported version");
  }
  StateWriter w;
  expect_error([&] { w.set_version(6); }, "[save_state] version: expected 1..5 but got 6");

  expect_error([] { StateReader::from_bytes("this is not a cache state file at all", "full"); },
               "expected a veloxquant state file");
  expect_error([&] { StateReader::from_bytes(sample_frame() + "x", "full"); }, "one frame");
}

TEST(BinaryIo, LyingLengthsDoNotAllocate) {
  // A header claiming a 2^62-byte payload, then nothing: refused as truncated (and quickly).
  std::string f(kStateMagic, 8);
  for (uint8_t b : {1, 0, 0, 0, 4, 0, 0, 0}) f.push_back(static_cast<char>(b));
  f += "full";
  const uint64_t huge = 1ull << 62;
  for (size_t i = 0; i < 8; ++i) f.push_back(static_cast<char>((huge >> (8 * i)) & 0xff));
  f += "some bytes";
  expect_error([&] { StateReader::from_bytes(f, "full"); }, "corrupted payload length");

  // Inside a valid frame: element counts and tensor shapes larger than the payload.
  StateWriter w;
  w.u64(1ull << 61);
  w.u8(1);
  for (int64_t s : {int64_t{1} << 20, int64_t{1} << 20, int64_t{1} << 20, int64_t{1} << 20})
    w.i64(s);
  StateReader r = StateReader::from_bytes(w.frame("x"), "x");
  expect_error([&] { r.vec_i64(); }, "truncated payload");
  StateReader r2 = StateReader::from_bytes(w.frame("x"), "x");
  r2.u64();
  expect_error([&] { r2.tensor(); }, "truncated payload");
}

// A damaged length field (one high byte set: 67 TB claimed by a 40-byte file) is reported as a
// corrupted length, not as a truncation of 67 TiB; a plausible length the file does not hold says
// both possibilities. Failed before the fix ("truncated file: expected 73667279061034 bytes").
TEST(BinaryIo, CorruptedLengthFieldIsNamed) {
  const std::string good = sample_frame();
  const size_t len_at = 8 + 4 + 4 + 4;  // magic, version, method length, "full"
  std::string bad = good;
  bad[len_at + 5] = 0x43;  // + 0x43 << 40: 67 TiB
  EXPECT_EQ(le64(bad, len_at) >> 40, 0x43u);
  expect_error([&] { StateReader::from_bytes(bad, "full"); },
               "corrupted payload length: expected at most 1099511627776 bytes but the length "
               "field says " +
                   std::to_string(le64(bad, len_at)));
  bad = good;
  bad[len_at + 2] = 0x01;  // 65536 + the real length: plausible, but the file ends first
  expect_error([&] { StateReader::from_bytes(bad, "full"); },
               "truncated file or corrupted payload length: expected " +
                   std::to_string(le64(bad, len_at)) + " bytes of payload");
}

// A zero-sized tensor whose other dims multiply past int64 (valid checksum): refused with a
// message, before its element count or view strides are computed. Failed before the fix under
// UBSan (signed overflow in Tensor::numel) and returned a tensor in Release.
TEST(BinaryIo, ZeroSizedTensorOfHugeDimsIsRefused) {
  const int64_t huge = int64_t{1} << 40;
  StateWriter w;
  w.u8(static_cast<uint8_t>(DType::kF32));
  for (int64_t s : {huge, huge, int64_t{0}, huge}) w.i64(s);
  StateReader r = StateReader::from_bytes(w.frame("x"), "x");
  expect_error([&] { r.tensor(); },
               "expected a tensor shape whose non-zero dims times 4 bytes fit int64 but got "
               "[1099511627776, 1099511627776, 0, 1099511627776]");
  // The largest shapes that fit still load (zero-sized), and their views have exact strides.
  StateWriter ok;
  ok.u8(static_cast<uint8_t>(DType::kBF16));
  for (int64_t s : {int64_t{1} << 31, int64_t{0}, int64_t{1} << 30, int64_t{1}}) ok.i64(s);
  StateReader r2 = StateReader::from_bytes(ok.frame("x"), "x");
  const Tensor t = r2.tensor();
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.view().stride[1], int64_t{1} << 30);
  EXPECT_EQ(t.view().stride[0], 0);
  // The owning tensor refuses such a shape itself.
  expect_error([&] { Tensor(DType::kF16, huge, huge, 0, huge); }, "[Tensor] expected a shape");
  expect_error([&] { Tensor(DType::kF16, 1, -1, 0, 1); }, "[Tensor] expected a non-negative");
}

TEST(BinaryIo, BadFieldValuesAreRefused) {
  StateWriter w;
  w.u8(2);  // not a bool
  w.u8(9);  // not a dtype
  w.i64(-3);
  w.u8(0);
  StateReader r = StateReader::from_bytes(w.frame("x"), "x");
  expect_error([&] { r.boolean(); }, "expected a bool");
  expect_error([&] { r.tensor(); }, "expected a tensor dtype");
  expect_error([&] { r.i64_in("rows", 0, 10); }, "rows: expected 0..10 but got -3");
  expect_error([&] { r.expect_end(); }, "1 bytes are left unread");
}

TEST(BinaryIo, FramesBackToBackInOneStream) {
  std::stringstream ss;
  StateWriter a, b;
  a.i32(1);
  b.str("two");
  a.write(ss, "full");
  b.write(ss, "snapkv");
  StateReader ra(ss, "full");
  StateReader rb(ss, "snapkv");
  EXPECT_EQ(ra.i32(), 1);
  EXPECT_EQ(rb.str(), "two");
  expect_error([&] { StateReader again(ss, ""); }, "truncated");
}

}  // namespace
}  // namespace vq
