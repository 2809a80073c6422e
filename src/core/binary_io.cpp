// State-file framing (see veloxquant/binary_io.h): little-endian scalars, a length-prefixed
// payload and an xxHash64 checksum over everything before it.
//
// Scalars are encoded byte by byte, so the format is little-endian on any host. Tensor elements
// are copied as raw bytes, which requires a little-endian host (static_assert below). The reader
// never trusts a length from the file: a payload length above 1 TiB is refused as a corrupted
// length field, and the payload is read in bounded chunks, so a frame that claims more bytes
// than the file holds fails as truncated without a huge allocation.
#include "veloxquant/binary_io.h"

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdio>
#include <cstring>
#include <istream>
#include <limits>
#include <memory>
#include <ostream>
#include <sstream>

#include "veloxquant/error.h"

namespace vq {

static_assert(std::endian::native == std::endian::little,
              "binary_io copies tensor elements raw and needs a little-endian host");

namespace {

constexpr size_t kHeaderFixed = 8 + 4;          // magic + version
constexpr size_t kReadChunk = size_t{1} << 20;  // payload read granularity
// Largest payload length believed (1 TiB): the reader holds a payload in memory, and a larger
// length comes from a damaged length field, not from a cache, so it is reported as such.
constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 40;

template <typename U>
void put_le(std::string& out, U v) {
  for (size_t i = 0; i < sizeof(U); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}

template <typename U>
U get_le(const char* p) {
  U v = 0;
  for (size_t i = 0; i < sizeof(U); ++i)
    v |= static_cast<U>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::string frame_prefix(uint32_t version, const std::string& method, uint64_t payload_size) {
  std::string h(kStateMagic, sizeof(kStateMagic));
  put_le<uint32_t>(h, version);
  put_le<uint32_t>(h, static_cast<uint32_t>(method.size()));
  h += method;
  put_le<uint64_t>(h, payload_size);
  return h;
}

struct Xxh64Deleter {
  void operator()(XXH64_state_t* s) const { XXH64_freeState(s); }
};

class Hasher {
 public:
  Hasher() : st_(XXH64_createState()) {
    VQ_CHECK(st_ != nullptr, "[state] expected an xxHash state but allocation failed");
    XXH64_reset(st_.get(), 0);
  }
  void add(const void* p, size_t n) { XXH64_update(st_.get(), p, n); }
  uint64_t digest() const { return XXH64_digest(st_.get()); }

 private:
  std::unique_ptr<XXH64_state_t, Xxh64Deleter> st_;
};

// Reads exactly n bytes or reports how many arrived.
size_t read_some(std::istream& in, char* dst, size_t n) {
  in.read(dst, static_cast<std::streamsize>(n));
  return static_cast<size_t>(in.gcount());
}

[[noreturn]] void truncated(const std::string& what, size_t need, size_t got) {
  throw Error("[load_state] truncated file: expected " + std::to_string(need) + " bytes of " +
              what + " but got " + std::to_string(got));
}

}  // namespace

// ---------------------------------------------------------------- writer

void StateWriter::u8(uint8_t v) {
  payload_.push_back(static_cast<char>(v));
}
void StateWriter::u32(uint32_t v) {
  put_le<uint32_t>(payload_, v);
}
void StateWriter::u64(uint64_t v) {
  put_le<uint64_t>(payload_, v);
}
void StateWriter::i32(int32_t v) {
  put_le<uint32_t>(payload_, static_cast<uint32_t>(v));
}
void StateWriter::i64(int64_t v) {
  put_le<uint64_t>(payload_, static_cast<uint64_t>(v));
}
void StateWriter::f32(float v) {
  put_le<uint32_t>(payload_, std::bit_cast<uint32_t>(v));
}
void StateWriter::f64(double v) {
  put_le<uint64_t>(payload_, std::bit_cast<uint64_t>(v));
}

void StateWriter::str(const std::string& s) {
  blob(s.data(), s.size());
}

void StateWriter::bytes(const void* data, size_t n) {
  if (n) payload_.append(static_cast<const char*>(data), n);
}

void StateWriter::blob(const void* data, size_t n) {
  u64(n);
  bytes(data, n);
}

void StateWriter::vec_i32(const std::vector<int32_t>& v) {
  u64(v.size());
  for (int32_t x : v) i32(x);
}
void StateWriter::vec_i64(const std::vector<int64_t>& v) {
  u64(v.size());
  for (int64_t x : v) i64(x);
}
void StateWriter::vec_f32(const std::vector<float>& v) {
  u64(v.size());
  for (float x : v) f32(x);
}
void StateWriter::vec_u8(const std::vector<uint8_t>& v) {
  blob(v.data(), v.size());
}
void StateWriter::vec_u16(const std::vector<uint16_t>& v) {
  u64(v.size());
  for (uint16_t x : v) put_le<uint16_t>(payload_, x);
}

void StateWriter::tensor(const TensorView& t) {
  for (int64_t s : t.shape)
    VQ_CHECK(s >= 0,
             "[save_state] expected a non-negative tensor shape but got " + std::to_string(s));
  u8(static_cast<uint8_t>(t.dtype));
  for (int64_t s : t.shape) i64(s);
  if (t.numel() == 0) return;
  const size_t es = dtype_size(t.dtype);
  const size_t row_bytes = static_cast<size_t>(t.shape[3]) * es;
  for (int64_t b = 0; b < t.shape[0]; ++b)
    for (int64_t h = 0; h < t.shape[1]; ++h)
      for (int64_t s = 0; s < t.shape[2]; ++s) {
        const char* row = static_cast<const char*>(t.row(b, h, s));
        if (t.stride[3] == 1) {
          payload_.append(row, row_bytes);
        } else {
          for (int64_t d = 0; d < t.shape[3]; ++d)
            payload_.append(row + d * t.stride[3] * static_cast<int64_t>(es), es);
        }
      }
}

void StateWriter::set_version(uint32_t v) {
  VQ_CHECK(v >= kStateFormatVersion && v <= kStateFormatVersionMax,
           "[save_state] version: expected " + std::to_string(kStateFormatVersion) + ".." +
               std::to_string(kStateFormatVersionMax) + " but got " + std::to_string(v));
  version_ = v;
}

std::string StateWriter::frame(const std::string& method) const {
  VQ_CHECK(method.size() <= 255,
           "[save_state] expected a method name of at most 255 bytes but got " +
               std::to_string(method.size()));
  std::string f = frame_prefix(version_, method, payload_.size());
  f += payload_;
  const uint64_t sum = XXH64(f.data(), f.size(), 0);
  put_le<uint64_t>(f, sum);
  return f;
}

void StateWriter::write(std::ostream& out, const std::string& method) const {
  const std::string f = frame(method);
  out.write(f.data(), static_cast<std::streamsize>(f.size()));
  out.flush();
  VQ_CHECK(out.good(), "[save_state] expected the stream to accept " + std::to_string(f.size()) +
                           " bytes but the write failed");
}

// ---------------------------------------------------------------- reader

StateReader::StateReader(std::istream& in, const std::string& expected_method) {
  parse(in, expected_method);
}

StateReader StateReader::from_bytes(const std::string& frame, const std::string& expected_method) {
  std::istringstream in(frame);
  StateReader r;
  r.parse(in, expected_method);
  const size_t consumed = static_cast<size_t>(in.tellg());
  VQ_CHECK(consumed == frame.size(), "[load_state] expected one frame of " +
                                         std::to_string(consumed) + " bytes but got " +
                                         std::to_string(frame.size()) + " bytes");
  return r;
}

void StateReader::parse(std::istream& in, const std::string& expected_method) {
  Hasher hash;
  char head[kHeaderFixed + 4];
  size_t got = read_some(in, head, sizeof(head));
  if (got < sizeof(kStateMagic) || std::memcmp(head, kStateMagic, sizeof(kStateMagic)) != 0) {
    // Tell "empty / short" apart from "something else entirely".
    if (got < sizeof(kStateMagic) && std::memcmp(head, kStateMagic, got) == 0)
      truncated("magic", sizeof(kStateMagic), got);
    throw Error(
        "[load_state] expected a veloxquant state file (magic VQKVSTAT) but got other data");
  }
  if (got < sizeof(head)) truncated("header", sizeof(head), got);
  hash.add(head, sizeof(head));
  const uint32_t version = get_le<uint32_t>(head + 8);
  if (version < kStateFormatVersion || version > kStateFormatVersionMax)
    throw Error("[load_state] unsupported version: expected " +
                std::to_string(kStateFormatVersion) + ".." +
                std::to_string(kStateFormatVersionMax) + " but got " + std::to_string(version));
  const uint32_t method_len = get_le<uint32_t>(head + 12);
  if (method_len > 255)
    throw Error("[load_state] expected a method name of at most 255 bytes but got " +
                std::to_string(method_len) + " (corrupted file?)");
  std::string method(method_len, '\0');
  got = read_some(in, method.data(), method_len);
  if (got < method_len) truncated("method name", method_len, got);
  hash.add(method.data(), method_len);
  char len_buf[8];
  got = read_some(in, len_buf, 8);
  if (got < 8) truncated("payload length", 8, got);
  hash.add(len_buf, 8);
  const uint64_t payload_len = get_le<uint64_t>(len_buf);
  if (payload_len > kMaxPayloadBytes)
    throw Error("[load_state] corrupted payload length: expected at most " +
                std::to_string(kMaxPayloadBytes) + " bytes but the length field says " +
                std::to_string(payload_len) + " (damaged file)");

  std::string payload;
  while (payload.size() < payload_len) {
    const size_t want =
        static_cast<size_t>(std::min<uint64_t>(kReadChunk, payload_len - payload.size()));
    const size_t old = payload.size();
    payload.resize(old + want);
    got = read_some(in, payload.data() + old, want);
    if (got < want)
      throw Error("[load_state] truncated file or corrupted payload length: expected " +
                  std::to_string(payload_len) + " bytes of payload (the length field) but got " +
                  std::to_string(old + got));
  }
  hash.add(payload.data(), payload.size());
  char sum_buf[8];
  got = read_some(in, sum_buf, 8);
  if (got < 8) truncated("checksum", 8, got);
  const uint64_t stored = get_le<uint64_t>(sum_buf);
  const uint64_t actual = hash.digest();
#ifndef VQ_FUZZ_SKIP_CHECKSUM  // fuzz builds only (tools/fuzz/CMakeLists.txt): reach the parser
  if (stored != actual) {
    char msg[160];
    std::snprintf(msg, sizeof(msg),
                  "[load_state] checksum mismatch: expected %016llx but got %016llx (file "
                  "corrupted)",
                  static_cast<unsigned long long>(stored), static_cast<unsigned long long>(actual));
    throw Error(msg);
  }
#else
  (void)stored;
  (void)actual;
#endif
  if (!expected_method.empty() && method != expected_method)
    throw Error("[load_state] expected method " + expected_method + " but got " + method);
  method_ = std::move(method);
  version_ = version;
  payload_ = std::move(payload);
  pos_ = 0;
}

const char* StateReader::take(size_t n, const char* what) {
  if (n > remaining())
    throw Error(std::string("[load_state] truncated payload: expected ") + std::to_string(n) +
                " bytes for " + what + " but got " + std::to_string(remaining()));
  const char* p = payload_.data() + pos_;
  pos_ += n;
  return p;
}

uint8_t StateReader::u8() {
  return static_cast<uint8_t>(*take(1, "u8"));
}
uint32_t StateReader::u32() {
  return get_le<uint32_t>(take(4, "u32"));
}
uint64_t StateReader::u64() {
  return get_le<uint64_t>(take(8, "u64"));
}
int32_t StateReader::i32() {
  return static_cast<int32_t>(get_le<uint32_t>(take(4, "i32")));
}
int64_t StateReader::i64() {
  return static_cast<int64_t>(get_le<uint64_t>(take(8, "i64")));
}
float StateReader::f32() {
  return std::bit_cast<float>(get_le<uint32_t>(take(4, "f32")));
}
double StateReader::f64() {
  return std::bit_cast<double>(get_le<uint64_t>(take(8, "f64")));
}

bool StateReader::boolean() {
  const uint8_t v = u8();
  VQ_CHECK(v <= 1, "[load_state] expected a bool (0 or 1) but got " + std::to_string(v));
  return v == 1;
}

uint64_t StateReader::count(size_t elem_size, const char* what) {
  const uint64_t n = u64();
  // Compare against what is left before multiplying, so a huge count cannot overflow.
  if (n > remaining() / elem_size)
    throw Error(std::string("[load_state] truncated payload: expected ") + std::to_string(n) +
                " elements of " + what + " but only " + std::to_string(remaining()) +
                " bytes remain");
  return n;
}

std::string StateReader::str() {
  return blob();
}

void StateReader::bytes(void* dst, size_t n) {
  const char* p = take(n, "bytes");
  if (n) std::memcpy(dst, p, n);
}

std::string StateReader::blob() {
  const uint64_t n = count(1, "blob");
  const char* p = take(static_cast<size_t>(n), "blob");
  return std::string(p, static_cast<size_t>(n));
}

std::vector<int32_t> StateReader::vec_i32() {
  const uint64_t n = count(4, "i32 vector");
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = i32();
  return v;
}
std::vector<int64_t> StateReader::vec_i64() {
  const uint64_t n = count(8, "i64 vector");
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = i64();
  return v;
}
std::vector<float> StateReader::vec_f32() {
  const uint64_t n = count(4, "f32 vector");
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = f32();
  return v;
}
std::vector<uint8_t> StateReader::vec_u8() {
  const uint64_t n = count(1, "u8 vector");
  const char* p = take(static_cast<size_t>(n), "u8 vector");
  return std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(p),
                              reinterpret_cast<const uint8_t*>(p) + n);
}
std::vector<uint16_t> StateReader::vec_u16() {
  const uint64_t n = count(2, "u16 vector");
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = get_le<uint16_t>(take(2, "u16"));
  return v;
}

Tensor StateReader::tensor() {
  const uint8_t dt = u8();
  VQ_CHECK(dt <= static_cast<uint8_t>(DType::kBF16),
           "[load_state] expected a tensor dtype 0..2 but got " + std::to_string(dt));
  const DType dtype = static_cast<DType>(dt);
  std::array<int64_t, 4> shape{};
  for (auto& s : shape) s = i64();
  const auto shape_text = [&shape] {
    return "[" + std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + ", " +
           std::to_string(shape[2]) + ", " + std::to_string(shape[3]) + "]";
  };
  for (int64_t s : shape)
    VQ_CHECK(s >= 0, "[load_state] expected a non-negative tensor shape but got " + shape_text());
  const uint64_t es = dtype_size(dtype);
  const bool fits = shape_fits_int64(shape, es);
  const bool empty = std::find(shape.begin(), shape.end(), 0) != shape.end();
  // A non-empty tensor too large for 64 bits is also too large for the payload.
  const uint64_t bytes_needed = empty  ? 0
                                : fits ? static_cast<uint64_t>(shape_numel(shape)) * es
                                       : std::numeric_limits<uint64_t>::max();
  if (bytes_needed > remaining())
    throw Error("[load_state] truncated payload: expected a tensor " + shape_text() + " but only " +
                std::to_string(remaining()) + " bytes remain");
  // Even a zero-sized tensor must have other dims whose product fits int64: the strides of its
  // view are computed from them.
  VQ_CHECK(fits, "[load_state] expected a tensor shape whose non-zero dims times " +
                     std::to_string(es) + " bytes fit int64 but got " + shape_text() +
                     " (corrupted file?)");
  Tensor t(dtype, shape[0], shape[1], shape[2], shape[3]);
  bytes(t.data(), static_cast<size_t>(bytes_needed));
  return t;
}

int64_t StateReader::i64_in(const char* what, int64_t lo, int64_t hi) {
  const int64_t v = i64();
  if (v < lo || v > hi)
    throw Error(std::string("[load_state] ") + what + ": expected " + std::to_string(lo) + ".." +
                std::to_string(hi) + " but got " + std::to_string(v));
  return v;
}

void StateReader::expect_end() const {
  VQ_CHECK(remaining() == 0, "[load_state] expected the payload to end but " +
                                 std::to_string(remaining()) + " bytes are left unread");
}

void check_saved_setting(const std::string& op, const std::string& field, const std::string& saved,
                         const std::string& mine) {
  if (saved != mine)
    throw Error("[" + op + "] state was saved with " + field + "=" + saved +
                " but this cache has " + mine + "; nothing was changed");
}

}  // namespace vq
