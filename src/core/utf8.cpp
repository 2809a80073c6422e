// UTF-8 well-formedness (utf8.h): each lead byte admits one range for the byte after it and the
// continuation range 0x80-0xBF for the rest, which rules out overlong forms, surrogates and code
// points past U+10FFFF without decoding.
#include "core/utf8.h"

namespace vq::utf8 {

namespace {

// Second-byte range and width of a UTF-8 sequence by its lead byte; width 0 = invalid lead.
struct LeadInfo {
  int width;
  unsigned char lo, hi;
};

LeadInfo lead_info(unsigned char b) {
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

}  // namespace

int scan_sequence(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  const LeadInfo info = lead_info(b);
  if (info.width == 0) return -1;
  for (int k = 1; k < info.width; ++k) {
    if (i + k >= s.size()) return 0;
    const auto c = static_cast<unsigned char>(s[i + k]);
    const unsigned char lo = k == 1 ? info.lo : 0x80;
    const unsigned char hi = k == 1 ? info.hi : 0xBF;
    if (c < lo || c > hi) return -k;
  }
  return info.width;
}

size_t valid_prefix(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const int n = scan_sequence(s, i);
    if (n <= 0) return i;
    i += static_cast<size_t>(n);
  }
  return i;
}

}  // namespace vq::utf8
