// Unicode canonical normalization (NFD and NFC) for the tokenizer's "NFC"/"NFD" normalizers
// (Qwen2-style tokenizer.json files use NFC). The standard algorithm: full canonical
// decomposition (tables from unicode_tables.cpp, Hangul algorithmic), canonical ordering of
// combining marks (stable sort by combining class), then for NFC canonical composition of
// unblocked pairs. Text whose code points are all below U+0300 is already NFC and is returned
// as is by the NFC fast path. Code points are UTF-32 in std::vector<uint32_t> buffers.
#include <algorithm>

#include "text/text_internal.h"
#include "text/unicode_tables.h"

namespace vq::text {

namespace {

constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28;
constexpr uint32_t kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

uint8_t combining_class(uint32_t cp) {
  if (cp < 0x300) return 0;
  const auto* begin = unicode::kCombiningClass;
  const auto* end = begin + unicode::kCombiningClassSize;
  const auto* it = std::upper_bound(
      begin, end, cp, [](uint32_t c, const unicode::CombiningRange& r) { return c < r.first; });
  if (it == begin) return 0;
  --it;
  return cp <= it->last ? it->ccc : 0;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const auto* begin = unicode::kDecomposition;
  const auto* end = begin + unicode::kDecompositionSize;
  const auto* it = std::lower_bound(
      begin, end, cp, [](const unicode::Decomposition& d, uint32_t c) { return d.cp < c; });
  if (it != end && it->cp == cp) {
    out.insert(out.end(), unicode::kDecompositionData + it->offset,
               unicode::kDecompositionData + it->offset + it->length);
  } else {
    out.push_back(cp);
  }
}

// Primary composite of (a, b), or 0.
uint32_t compose_pair(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const uint64_t key = (static_cast<uint64_t>(a) << 21) | b;
  const auto* begin = unicode::kComposition;
  const auto* end = begin + unicode::kCompositionSize;
  const auto* it = std::lower_bound(
      begin, end, key, [](const unicode::Composition& c, uint64_t k) { return c.key < k; });
  return it != end && it->key == key ? it->composite : 0;
}

std::string normalize(const std::string& s, bool compose) {
  // Fast path: below U+0300 there are no combining marks, and the letters there that have
  // canonical decompositions (U+00C0..U+02FF) are already composed, so NFC leaves such text
  // unchanged; NFD does not, so the fast path is for NFC only.
  if (compose) {
    bool simple = true;
    for (size_t i = 0; i < s.size() && simple;) {
      const auto b = static_cast<unsigned char>(s[i]);
      if (b < 0x80) {
        ++i;
        continue;
      }
      simple = utf8_at(s, i) < 0x300;
      i += utf8_len(b);
    }
    if (simple) return s;
  }
  std::vector<uint32_t> cps;
  cps.reserve(s.size());
  for (size_t i = 0; i < s.size(); i += utf8_len(static_cast<unsigned char>(s[i]))) {
    decompose(utf8_at(s, i), cps);
  }
  // Canonical ordering: stable sort of each run of non-starters by combining class.
  std::vector<uint8_t> ccc(cps.size());
  for (size_t i = 0; i < cps.size(); ++i) ccc[i] = combining_class(cps[i]);
  for (size_t i = 0; i < cps.size();) {
    if (ccc[i] == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && ccc[j] != 0) ++j;
    if (j - i > 1) {
      std::vector<std::pair<uint8_t, uint32_t>> run;
      for (size_t k = i; k < j; ++k) run.emplace_back(ccc[k], cps[k]);
      std::stable_sort(run.begin(), run.end(),
                       [](const auto& x, const auto& y) { return x.first < y.first; });
      for (size_t k = i; k < j; ++k) {
        ccc[k] = run[k - i].first;
        cps[k] = run[k - i].second;
      }
    }
    i = j;
  }
  if (compose && !cps.empty()) {
    // Canonical composition: a character joins the last starter unless a character between
    // them has class 0 or a class >= its own (blocked).
    size_t out = 1;
    size_t starter = 0;
    int last_class = ccc[0] == 0 ? 0 : 256;  // a leading non-starter blocks everything
    for (size_t i = 1; i < cps.size(); ++i) {
      const int cls = ccc[i];
      const uint32_t composite =
          (last_class < cls || last_class == 0) ? compose_pair(cps[starter], cps[i]) : 0;
      if (composite != 0) {
        cps[starter] = composite;
        continue;
      }
      if (cls == 0) starter = out;
      last_class = cls;
      cps[out] = cps[i];
      ccc[out] = ccc[i];
      ++out;
    }
    cps.resize(out);
  }
  std::string result;
  result.reserve(s.size());
  for (uint32_t cp : cps) utf8_append(result, cp);
  return result;
}

}  // namespace

std::string unicode_nfc(const std::string& s) {
  return normalize(s, true);
}
std::string unicode_nfd(const std::string& s) {
  return normalize(s, false);
}

}  // namespace vq::text
