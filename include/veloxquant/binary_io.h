// Versioned, checksummed framing for cache state files (every cache's save/load uses it).
// One frame, little-endian: "VQKVSTAT" | u32 version | u32 n + method name | u64 n + payload |
// u64 xxHash64 (seed 0) of every byte before it. A stream may hold several frames back to back;
// a StateReader consumes exactly one.
// Loads are all-or-nothing: StateReader reads the whole frame and verifies the checksum and the
// method before handing out a single field; callers parse into temporaries, call expect_end(),
// and only then swap the new state in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "veloxquant/tensor.h"

namespace vq {

inline constexpr char kStateMagic[8] = {'V', 'Q', 'K', 'V', 'S', 'T', 'A', 'T'};
// The version a frame gets unless its writer asks for a later one (set_version); readers accept
// 1 .. kStateFormatVersionMax and hand the version to the cache's parser. Version 2 (an SKVQ
// cache with skvq_key_axis=channel, a SnapKV cache with snap_decode_budget > 0) adds fields only
// such caches write; version 3 (an SKVQ cache with skvq_key_rows > 0) adds one more; version 4
// (an SKVQ cache with skvq_protect > 0) adds its protected rows; version 5 (an SKVQ cache with
// skvq_value_clip_floor below the seed's 0.85) adds that floor. Each cache's parser reads the
// versions it writes and refuses the others.
inline constexpr uint32_t kStateFormatVersion = 1;
inline constexpr uint32_t kStateFormatVersionMax = 5;

// Builds a payload in memory, then writes one frame.
class StateWriter {
 public:
  void u8(uint8_t v);
  void u32(uint32_t v);
  void u64(uint64_t v);
  void i32(int32_t v);
  void i64(int64_t v);
  void f32(float v);  // IEEE bits, so NaN payloads and -0 survive
  void f64(double v);
  void boolean(bool v) { u8(v ? 1 : 0); }
  void str(const std::string& s);                // u64 length + bytes
  void bytes(const void* data, size_t n);        // raw, no length (reader must know n)
  void blob(const void* data, size_t n);         // u64 length + bytes
  void vec_i32(const std::vector<int32_t>& v);   // u64 count + elements
  void vec_i64(const std::vector<int64_t>& v);   // u64 count + elements
  void vec_f32(const std::vector<float>& v);     // u64 count + elements
  void vec_u8(const std::vector<uint8_t>& v);    // u64 count + elements
  void vec_u16(const std::vector<uint16_t>& v);  // u64 count + elements
  // u8 dtype, 4 x i64 shape, then the elements in [B, H, S, D] row-major order (any strides).
  void tensor(const TensorView& t);

  // The frame's version, kStateFormatVersion .. kStateFormatVersionMax (throws otherwise).
  void set_version(uint32_t v);
  uint32_t version() const { return version_; }
  const std::string& payload() const { return payload_; }
  // Writes the frame; throws vq::Error "[save_state] ..." if the stream fails.
  void write(std::ostream& out, const std::string& method) const;
  // The frame as bytes (what write() would emit).
  std::string frame(const std::string& method) const;

 private:
  std::string payload_;
  uint32_t version_ = kStateFormatVersion;
};

// Reads and verifies one frame, then hands out bounds-checked fields of its payload. Every
// failure throws vq::Error "[load_state] ...": not a state file, unsupported version,
// truncated, checksum mismatch, expected method X but got Y, or a field past the payload end.
class StateReader {
 public:
  // Reads exactly one frame from `in`. expected_method empty = accept any method.
  StateReader(std::istream& in, const std::string& expected_method);
  // Same over bytes already in memory (must hold exactly one frame, nothing after it).
  static StateReader from_bytes(const std::string& frame, const std::string& expected_method);

  const std::string& method() const { return method_; }
  uint32_t version() const { return version_; }
  size_t remaining() const { return payload_.size() - pos_; }

  uint8_t u8();
  uint32_t u32();
  uint64_t u64();
  int32_t i32();
  int64_t i64();
  float f32();
  double f64();
  bool boolean();  // refuses anything but 0 or 1
  std::string str();
  void bytes(void* dst, size_t n);
  std::string blob();
  std::vector<int32_t> vec_i32();
  std::vector<int64_t> vec_i64();
  std::vector<float> vec_f32();
  std::vector<uint8_t> vec_u8();
  std::vector<uint16_t> vec_u16();
  Tensor tensor();
  // i64 that must lie in [lo, hi]; `what` names the field in the error.
  int64_t i64_in(const char* what, int64_t lo, int64_t hi);
  // Throws if payload bytes are left unread (a payload longer than its parser expects).
  void expect_end() const;

 private:
  StateReader() = default;
  void parse(std::istream& in, const std::string& expected_method);
  const char* take(size_t n, const char* what);
  uint64_t count(size_t elem_size, const char* what);

  std::string method_;
  uint32_t version_ = 0;
  std::string payload_;
  size_t pos_ = 0;
};

// The settings check of every cache's load(): a state saved with other settings is refused with
// "[op] state was saved with FIELD=SAVED but this cache has MINE; nothing was changed" (values as
// a user writes them: 1.5 bits, float16, true).
void check_saved_setting(const std::string& op, const std::string& field, const std::string& saved,
                         const std::string& mine);

}  // namespace vq
