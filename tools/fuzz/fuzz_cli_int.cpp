// libFuzzer target for the CLI's own number parsing (tools/cli/options.cpp, compiled into this
// target): parse_int_in_range and parse_uint64, which every integer option of generate, eval,
// calibrate, compare and demo goes through. Input: the first byte picks one of the option ranges
// the CLI uses, the rest is the option's text. A value must either be refused with a vq::Error or
// be in its range and equal to the text read as a plain base-10 integer (std::from_chars after an
// optional '+'). Seeds: tools/fuzz/corpus/fuzz_cli_int/.
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>

#include "options.h"
#include "veloxquant/error.h"

namespace {

struct Range {
  int64_t lo, hi;
};
constexpr Range kRanges[] = {{0, vq::cli::kMaxTokenCount},
                             {1, vq::cli::kMaxTokenCount},
                             {0, 64},
                             {INT64_MIN, INT64_MAX},
                             {-1, 1}};

// text read as a base-10 integer of T (optional '+', then std::from_chars): the reference.
template <class T>
bool reference(const std::string& text, T* out) {
  const char* b = text.data();
  const char* e = b + text.size();
  if (b != e && *b == '+') {
    ++b;
    if (b != e && (*b == '-' || *b == '+')) return false;  // one sign at most
  }
  if (b == e) return false;
  const auto r = std::from_chars(b, e, *out);
  return r.ec == std::errc() && r.ptr == e;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Range range = kRanges[data[0] % (sizeof(kRanges) / sizeof(kRanges[0]))];
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    const int64_t v = vq::cli::parse_int_in_range(text, range.lo, range.hi, "fuzz", "--opt");
    int64_t ref = 0;
    if (v < range.lo || v > range.hi || !reference(text, &ref) || ref != v) __builtin_trap();
  } catch (const vq::Error&) {
    int64_t ref = 0;  // refused: then the text is not an integer in the range
    if (reference(text, &ref) && ref >= range.lo && ref <= range.hi) __builtin_trap();
  }
  try {
    const uint64_t u = vq::cli::parse_uint64(text, "fuzz", "--seed");
    uint64_t ref = 0;
    if (!reference(text, &ref) || ref != u) __builtin_trap();
  } catch (const vq::Error&) {
    uint64_t ref = 0;
    if (reference(text, &ref)) __builtin_trap();
  }
  return 0;
}
