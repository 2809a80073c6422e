// Unicode data for the NFC normalizer, generated into unicode_tables.cpp by
// tools/gen_unicode_tables.py. All arrays are sorted by their first field (binary search).
#pragma once

#include <cstddef>
#include <cstdint>

namespace vq::text::unicode {

struct CombiningRange {
  uint32_t first, last;  // inclusive code point range
  uint8_t ccc;           // canonical combining class (nonzero)
};

struct Decomposition {
  uint32_t cp;
  uint16_t offset;  // into kDecompositionData
  uint8_t length;   // full canonical decomposition length
};

struct Composition {
  uint64_t key;  // first << 21 | second
  uint32_t composite;
};

extern const char* const kUnicodeVersion;
extern const CombiningRange kCombiningClass[];
extern const size_t kCombiningClassSize;
extern const uint32_t kDecompositionData[];
extern const Decomposition kDecomposition[];
extern const size_t kDecompositionSize;
extern const Composition kComposition[];
extern const size_t kCompositionSize;

}  // namespace vq::text::unicode
