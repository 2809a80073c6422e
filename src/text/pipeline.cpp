// Normalizers, pre-tokenizers, decoders and post-processors of tokenizer.json, each a small
// class with the semantics of the reference Rust `tokenizers` library (0.2x). Supported types:
//   normalizers:    Sequence, Prepend, Replace (String/Regex), Strip, ByteLevel, NFC, NFD
//   pre-tokenizers: Sequence, Split (String/Regex; every SplitDelimiterBehavior; invert), Digits,
//                   ByteLevel (GPT-2 regex, add_prefix_space), Metaspace (prepend_scheme, split),
//                   Whitespace, WhitespaceSplit, CharDelimiterSplit
//   decoders:       Sequence, ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace,
//                   BPEDecoder
//   post-processors (built in tokenizer.cpp): TemplateProcessing (single), BertProcessing,
//                   RobertaProcessing, ByteLevel (no-op on ids), Sequence
// Anything else is refused with "[tokenizer] <where>: expected one of ... but got type X".
#include <algorithm>

#include "text/text_internal.h"
#include "veloxquant/error.h"

namespace vq::text {

namespace {

constexpr int kMaxDepth = 16;  // nesting of Sequence components
const char* const kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kReplacementChar = "\xE2\x96\x81";  // U+2581 "▁"

void check_depth(int depth, const std::string& where) {
  if (depth > kMaxDepth) {
    throw Error("[tokenizer] " + where + ": expected at most " + std::to_string(kMaxDepth) +
                " nested Sequence levels but got more");
  }
}

std::string type_of(const json& j, const std::string& where) {
  if (!j.is_object())
    throw Error("[tokenizer] " + where + ": expected an object but got " + json_kind(j));
  return get_string(j, "type", where);
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty() || s.find(from) == std::string::npos) return;
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out.append(to);
    pos = hit + from.size();
  }
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

// A {"String": s} or {"Regex": r} pattern.
struct Pattern {
  std::string literal;
  std::unique_ptr<Regex> regex;

  Pattern(const json& j, const std::string& where) {
    if (!j.is_object() || j.size() != 1) {
      throw Error("[tokenizer] " + where +
                  ".pattern: expected {\"String\": ...} or {\"Regex\": ...} "
                  "but got " +
                  json_kind(j));
    }
    if (j.contains("String")) {
      literal = get_string(j, "String", where + ".pattern");
      if (literal.empty()) {
        throw Error("[tokenizer] " + where + ".pattern: expected a non-empty String but got \"\"");
      }
    } else if (j.contains("Regex")) {
      regex =
          std::make_unique<Regex>(get_string(j, "Regex", where + ".pattern"), where + ".pattern");
    } else {
      throw Error("[tokenizer] " + where + ".pattern: expected String or Regex but got " +
                  j.begin().key());
    }
  }

  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
    if (regex) {
      regex->find_all(s, out);
      return;
    }
    size_t pos = 0;
    while (true) {
      const size_t hit = s.find(literal, pos);
      if (hit == std::string_view::npos) break;
      out.emplace_back(hit, hit + literal.size());
      pos = hit + literal.size();
    }
  }

  void replace(std::string& s, std::string_view content) const {
    if (!regex) {
      replace_all(s, literal, content);
      return;
    }
    std::vector<std::pair<size_t, size_t>> matches;
    regex->find_all(s, matches);
    if (matches.empty()) return;
    std::string out;
    size_t pos = 0;
    for (auto [a, b] : matches) {
      out.append(s, pos, a - pos);
      out.append(content);
      pos = b;
    }
    out.append(s, pos, std::string::npos);
    s = std::move(out);
  }
};

// ------------------------------------------------------------------------------- normalizers

class SequenceNormalizer : public Normalizer {
 public:
  std::vector<std::unique_ptr<Normalizer>> items;
  void apply(std::string& s) const override {
    for (const auto& n : items) n->apply(s);
  }
  std::string name() const override {
    std::string out = "Sequence[";
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += ',';
      out += items[i]->name();
    }
    return out + "]";
  }
};

class PrependNormalizer : public Normalizer {
 public:
  std::string prepend;
  void apply(std::string& s) const override {
    if (!s.empty()) s.insert(0, prepend);
  }
  std::string name() const override { return "Prepend"; }
};

class ReplaceNormalizer : public Normalizer {
 public:
  std::unique_ptr<Pattern> pattern;
  std::string content;
  void apply(std::string& s) const override { pattern->replace(s, content); }
  std::string name() const override { return "Replace"; }
};

class StripNormalizer : public Normalizer {
 public:
  bool left = true, right = true;
  void apply(std::string& s) const override {
    size_t begin = 0, end = s.size();
    if (left) {
      while (begin < end) {
        const uint32_t cp = utf8_at(s, begin);
        if (!is_unicode_whitespace(cp)) break;
        begin += utf8_len(static_cast<unsigned char>(s[begin]));
      }
    }
    if (right) {
      while (end > begin) {
        size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
        if (!is_unicode_whitespace(utf8_at(s, start))) break;
        end = start;
      }
    }
    s = s.substr(begin, end - begin);
  }
  std::string name() const override { return "Strip"; }
};

class UnicodeNormalizer : public Normalizer {
 public:
  bool compose = true;
  void apply(std::string& s) const override { s = compose ? unicode_nfc(s) : unicode_nfd(s); }
  std::string name() const override { return compose ? "NFC" : "NFD"; }
};

// Every byte -> the UTF-8 of its GPT-2 code point (1 or 2 bytes).
std::string map_bytes(const ByteMap& map, std::string_view s) {
  std::string out(s.size() * 2, '\0');
  size_t n = 0;
  for (char c : s) {
    const std::string& m = map.byte_to_utf8[static_cast<unsigned char>(c)];
    out[n++] = m[0];
    if (m.size() == 2) out[n++] = m[1];
  }
  out.resize(n);
  return out;
}

class ByteLevelNormalizer : public Normalizer {
 public:
  void apply(std::string& s) const override { s = map_bytes(byte_map(), s); }
  std::string name() const override { return "ByteLevel"; }
};

// ---------------------------------------------------------------------------- pre-tokenizers

SplitBehavior parse_behavior(const std::string& b, const std::string& where) {
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  throw Error("[tokenizer] " + where +
              ".behavior: expected Removed, Isolated, MergedWithPrevious, MergedWithNext or "
              "Contiguous but got '" +
              b + "'");
}

class SequencePreTokenizer : public PreTokenizer {
 public:
  std::vector<std::unique_ptr<PreTokenizer>> items;
  void apply(Piece&& piece, const PieceSink& sink) const override {
    run(0, std::move(piece), sink);
  }
  std::string name() const override {
    std::string out = "Sequence[";
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += ',';
      out += items[i]->name();
    }
    return out + "]";
  }

 private:
  void run(size_t i, Piece&& piece, const PieceSink& sink) const {
    if (i == items.size()) {
      sink(std::move(piece));
      return;
    }
    auto next = [&](Piece&& p) { run(i + 1, std::move(p), sink); };
    items[i]->apply(std::move(piece), PieceSink(next));
  }
};

// Split every piece at the matches of a pattern (regex or literal).
class SplitPreTokenizer : public PreTokenizer {
 public:
  std::unique_ptr<Pattern> pattern;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  std::string label = "Split";
  void apply(Piece&& piece, const PieceSink& sink) const override {
    std::vector<std::pair<size_t, size_t>> matches;
    pattern->find_all(piece.text, matches);
    split_by_matches(piece, matches, behavior, invert, sink);
  }
  std::string name() const override { return label; }
};

// Whitespace-delimited splits with a character predicate (WhitespaceSplit, CharDelimiterSplit).
class CharSplitPreTokenizer : public PreTokenizer {
 public:
  uint32_t delimiter = 0;  // 0: any Unicode whitespace
  std::string label;
  void apply(Piece&& piece, const PieceSink& sink) const override {
    std::vector<std::pair<size_t, size_t>> matches;
    const std::string& t = piece.text;
    for (size_t i = 0; i < t.size();) {
      const size_t n = utf8_len(static_cast<unsigned char>(t[i]));
      const uint32_t cp = utf8_at(t, i);
      if (delimiter ? cp == delimiter : is_unicode_whitespace(cp)) matches.emplace_back(i, i + n);
      i += n;
    }
    split_by_matches(piece, matches, SplitBehavior::kRemoved, false, sink);
  }
  std::string name() const override { return label; }
};

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  bool add_prefix_space = false;
  std::unique_ptr<Regex> regex;  // GPT-2 pattern when use_regex
  void apply(Piece&& piece, const PieceSink& sink) const override {
    const ByteMap& map = byte_map();
    if (add_prefix_space && !piece.text.starts_with(' ')) piece.text.insert(0, " ");
    if (!regex) {
      sink({map_bytes(map, piece.text), piece.at_start});
      return;
    }
    std::vector<std::pair<size_t, size_t>> matches;
    regex->find_all(piece.text, matches);
    auto mapped = [&](Piece&& part) { sink({map_bytes(map, part.text), part.at_start}); };
    split_by_matches(piece, matches, SplitBehavior::kIsolated, false, PieceSink(mapped));
  }
  std::string name() const override { return regex ? "ByteLevel(gpt2 regex)" : "ByteLevel"; }
};

enum class PrependScheme { kAlways, kFirst, kNever };

PrependScheme parse_prepend_scheme(const json& j, const std::string& where) {
  if (j.contains("prepend_scheme") && !j.at("prepend_scheme").is_null()) {
    const std::string s = get_string(j, "prepend_scheme", where);
    if (s == "always") return PrependScheme::kAlways;
    if (s == "first") return PrependScheme::kFirst;
    if (s == "never") return PrependScheme::kNever;
    throw Error("[tokenizer] " + where +
                ".prepend_scheme: expected always, first or never but got '" + s + "'");
  }
  // Older files: add_prefix_space (default true).
  return get_bool(j, "add_prefix_space", where, true) ? PrependScheme::kAlways
                                                      : PrependScheme::kNever;
}

std::string parse_replacement(const json& j, const std::string& where) {
  std::string r = j.contains("replacement") ? get_string(j, "replacement", where)
                                            : std::string(kReplacementChar);
  if (r.empty() || utf8_len(static_cast<unsigned char>(r[0])) != r.size()) {
    throw Error("[tokenizer] " + where + ".replacement: expected one character but got '" + r +
                "'");
  }
  return r;
}

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  std::string replacement;
  PrependScheme scheme = PrependScheme::kAlways;
  bool split = true;
  void apply(Piece&& piece, const PieceSink& sink) const override {
    replace_all(piece.text, " ", replacement);
    const bool prepend =
        scheme == PrependScheme::kAlways || (scheme == PrependScheme::kFirst && piece.at_start);
    if (prepend && !piece.text.starts_with(replacement)) piece.text.insert(0, replacement);
    if (!split) {
      sink(std::move(piece));
      return;
    }
    std::vector<std::pair<size_t, size_t>> matches;
    for (size_t pos = piece.text.find(replacement); pos != std::string::npos;
         pos = piece.text.find(replacement, pos + replacement.size())) {
      matches.emplace_back(pos, pos + replacement.size());
    }
    split_by_matches(piece, matches, SplitBehavior::kMergedWithNext, false, sink);
  }
  std::string name() const override { return "Metaspace"; }
};

// ---------------------------------------------------------------------------------- decoders

class SequenceDecoder : public Decoder {
 public:
  std::vector<std::unique_ptr<Decoder>> items;
  void apply(std::vector<std::string>& tokens, DecodeState& st) const override {
    for (const auto& d : items) d->apply(tokens, st);
  }
  std::string name() const override {
    std::string out = "Sequence[";
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += ',';
      out += items[i]->name();
    }
    return out + "]";
  }
};

// Maps every character back to its byte (tokens with a character outside the map keep their
// UTF-8 bytes), then converts all bytes to text at once, invalid sequences becoming U+FFFD.
class ByteLevelDecoder : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens, DecodeState& st) const override {
    const ByteMap& map = byte_map();
    std::string bytes;
    for (const std::string& t : tokens) {
      const size_t start = bytes.size();
      bool all_mapped = true;
      for (size_t i = 0; i < t.size();) {
        const uint32_t cp = utf8_at(t, i);
        i += utf8_len(static_cast<unsigned char>(t[i]));
        if (cp >= map.cp_to_byte.size() || map.cp_to_byte[cp] < 0) {
          all_mapped = false;
          break;
        }
        bytes.push_back(static_cast<char>(map.cp_to_byte[cp]));
      }
      if (!all_mapped) {
        bytes.resize(start);
        bytes += t;
      }
    }
    bool incomplete = false;
    std::string text = utf8_lossy(bytes, &incomplete);
    st.pending = incomplete;
    tokens.assign(1, std::move(text));
  }
  std::string name() const override { return "ByteLevel"; }
};

// <0xNN> tokens -> bytes; a run of byte tokens that is valid UTF-8 becomes its text, otherwise
// one U+FFFD per byte (as the reference).
class ByteFallbackDecoder : public Decoder {
 public:
  static int parse_byte(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    // Rust's u8::from_str_radix(.., 16) accepts an optional leading '+'.
    auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    if (t[3] == '+') return hex(t[4]);
    const int hi = hex(t[3]), lo = hex(t[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
  }
  void apply(std::vector<std::string>& tokens, DecodeState& st) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string run;
    bool run_pending = false;
    auto flush = [&]() {
      run_pending = false;
      if (run.empty()) return;
      // Streaming: a run at the end of the tokens may still grow, and a later byte token can
      // turn the whole run into U+FFFDs or complete its last character, so nothing of it is
      // final until a non-byte token closes it (then no run straddles an emission).
      run_pending = true;
      const size_t valid = utf8_valid_prefix(run);
      if (valid == run.size()) {
        out.push_back(run);
      } else {
        for (size_t i = 0; i < run.size(); ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      run.clear();
    };
    for (std::string& t : tokens) {
      const int b = parse_byte(t);
      if (b >= 0) {
        run.push_back(static_cast<char>(b));
        continue;
      }
      flush();
      out.push_back(std::move(t));
    }
    flush();  // the last run ends the output: its state is the output's
    st.pending = run_pending;
    tokens = std::move(out);
  }
  std::string name() const override { return "ByteFallback"; }
};

class FuseDecoder : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens, DecodeState& st) const override {
    st.fused = true;
    std::string all;
    for (const std::string& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
  std::string name() const override { return "Fuse"; }
};

// Removes up to `start` leading and `stop` trailing occurrences of one character per token
// (after a Fuse, of the whole text: not at the start of a continuation window, DecodeState).
class StripDecoder : public Decoder {
 public:
  uint32_t content = ' ';
  size_t start = 0, stop = 0;
  void apply(std::vector<std::string>& tokens, DecodeState& st) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string& t = tokens[i];
      const size_t lead = i == 0 && st.continuation && st.fused ? 0 : start;
      size_t begin = 0;
      for (size_t k = 0; k < lead && begin < t.size(); ++k) {
        if (utf8_at(t, begin) != content) break;
        begin += utf8_len(static_cast<unsigned char>(t[begin]));
      }
      size_t end = t.size();
      for (size_t k = 0; k < stop && end > 0; ++k) {
        size_t s = end - 1;
        while (s > 0 && (static_cast<unsigned char>(t[s]) & 0xC0) == 0x80) --s;
        if (utf8_at(t, s) != content) break;
        end = s;
      }
      // The reference panics when both cuts overlap; an empty token is the sane result.
      t = end > begin ? t.substr(begin, end - begin) : std::string();
    }
  }
  std::string name() const override { return "Strip"; }
};

class ReplaceDecoder : public Decoder {
 public:
  std::unique_ptr<Pattern> pattern;
  std::string content;
  void apply(std::vector<std::string>& tokens, DecodeState&) const override {
    for (std::string& t : tokens) pattern->replace(t, content);
  }
  std::string name() const override { return "Replace"; }
};

// End-of-word suffix -> space (nothing in the last token), as BPEDecoder does.
class BpeSuffixDecoder : public Decoder {
 public:
  std::string suffix;
  void apply(std::vector<std::string>& tokens, DecodeState&) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      replace_all(tokens[i], suffix, i + 1 == tokens.size() ? std::string_view() : " ");
    }
  }
  std::string name() const override { return "BPEDecoder"; }
};

// Replacement character -> space; in the first token it is dropped (unless scheme "never").
class MetaspaceDecoder : public Decoder {
 public:
  std::string replacement;
  PrependScheme scheme = PrependScheme::kAlways;
  void apply(std::vector<std::string>& tokens, DecodeState&) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      replace_all(tokens[i], replacement,
                  i == 0 && scheme != PrependScheme::kNever ? std::string_view() : " ");
    }
  }
  std::string name() const override { return "Metaspace"; }
};

std::string type_list_error(const std::string& where, const char* expected,
                            const std::string& got) {
  return "[tokenizer] " + where + ": expected " + expected + " but got unsupported type '" + got +
         "'";
}

}  // namespace

// ------------------------------------------------------------------------------ split helper

void split_by_matches(const Piece& piece, const std::vector<std::pair<size_t, size_t>>& matches,
                      SplitBehavior behavior, bool invert, const PieceSink& sink) {
  // Segments covering the whole text: (start, end, is_match).
  struct Seg {
    size_t a, b;
    bool match;
  };
  std::vector<Seg> segs;
  segs.reserve(matches.size() * 2 + 1);
  size_t pos = 0;
  for (auto [a, b] : matches) {
    if (a > pos) segs.push_back({pos, a, invert});
    segs.push_back({a, b, !invert});
    pos = b;
  }
  if (pos < piece.text.size()) segs.push_back({pos, piece.text.size(), invert});

  const std::string& s = piece.text;
  auto emit = [&](size_t a, size_t b) {
    if (b > a) sink({s.substr(a, b - a), piece.at_start && a == 0});
  };
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const Seg& g : segs)
        if (!g.match) emit(g.a, g.b);
      break;
    case SplitBehavior::kIsolated:
      for (const Seg& g : segs) emit(g.a, g.b);
      break;
    case SplitBehavior::kMergedWithPrevious: {
      // A match joins the piece before it.
      size_t start = 0;
      bool open = false;
      for (const Seg& g : segs) {
        if (g.match) {
          emit(open ? start : g.a, g.b);
          open = false;
        } else {
          if (open) emit(start, g.a);
          start = g.a;
          open = true;
        }
      }
      if (open) emit(start, s.size());
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      // A match joins the piece after it.
      size_t start = 0;
      bool open = false;
      for (const Seg& g : segs) {
        if (g.match) {
          if (open) emit(start, g.a);
          start = g.a;
          open = true;
        } else {
          emit(open ? start : g.a, g.b);
          open = false;
        }
      }
      if (open) emit(start, s.size());
      break;
    }
    case SplitBehavior::kContiguous: {
      // Consecutive matches join into one piece.
      size_t i = 0;
      while (i < segs.size()) {
        size_t j = i + 1;
        if (segs[i].match)
          while (j < segs.size() && segs[j].match) ++j;
        emit(segs[i].a, segs[j - 1].b);
        i = j;
      }
      break;
    }
  }
}

// -------------------------------------------------------------------------------- factories

std::unique_ptr<Normalizer> make_normalizer(const json& j, int depth) {
  const std::string where = "normalizer";
  check_depth(depth, where);
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    auto n = std::make_unique<SequenceNormalizer>();
    const json& items = get_field(j, "normalizers", where);
    if (!items.is_array())
      throw Error("[tokenizer] normalizer.normalizers: expected an array but got " +
                  json_kind(items));
    for (const json& item : items) n->items.push_back(make_normalizer(item, depth + 1));
    return n;
  }
  if (type == "Prepend") {
    auto n = std::make_unique<PrependNormalizer>();
    n->prepend = get_string(j, "prepend", where);
    return n;
  }
  if (type == "Replace") {
    auto n = std::make_unique<ReplaceNormalizer>();
    n->pattern = std::make_unique<Pattern>(get_field(j, "pattern", where), where);
    n->content = get_string(j, "content", where);
    return n;
  }
  if (type == "Strip") {
    auto n = std::make_unique<StripNormalizer>();
    n->left = get_bool(j, "strip_left", where, true);
    n->right = get_bool(j, "strip_right", where, true);
    return n;
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelNormalizer>();
  if (type == "NFC" || type == "NFD") {
    auto n = std::make_unique<UnicodeNormalizer>();
    n->compose = type == "NFC";
    return n;
  }
  throw Error(
      type_list_error(where, "Sequence, Prepend, Replace, Strip, ByteLevel, NFC or NFD", type));
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, int depth) {
  const std::string where = "pre_tokenizer";
  check_depth(depth, where);
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    auto p = std::make_unique<SequencePreTokenizer>();
    const json& items = get_field(j, "pretokenizers", where);
    if (!items.is_array())
      throw Error("[tokenizer] pre_tokenizer.pretokenizers: expected an array but got " +
                  json_kind(items));
    for (const json& item : items) p->items.push_back(make_pre_tokenizer(item, depth + 1));
    return p;
  }
  if (type == "Split") {
    auto p = std::make_unique<SplitPreTokenizer>();
    p->pattern = std::make_unique<Pattern>(get_field(j, "pattern", where), where);
    p->behavior = parse_behavior(get_string(j, "behavior", where), where);
    p->invert = get_bool(j, "invert", where, false);
    return p;
  }
  if (type == "Digits") {
    // Rust char::is_numeric = Unicode N (Nd, Nl, No).
    auto p = std::make_unique<SplitPreTokenizer>();
    const bool individual = get_bool(j, "individual_digits", where, false);
    p->pattern =
        std::make_unique<Pattern>(json{{"Regex", individual ? "\\p{N}" : "\\p{N}+"}}, where);
    p->behavior = SplitBehavior::kIsolated;
    p->label = individual ? "Digits(individual)" : "Digits";
    return p;
  }
  if (type == "Whitespace") {
    auto p = std::make_unique<SplitPreTokenizer>();
    p->pattern = std::make_unique<Pattern>(json{{"Regex", "\\w+|[^\\w\\s]+"}}, where);
    p->behavior = SplitBehavior::kRemoved;
    p->invert = true;
    p->label = "Whitespace";
    return p;
  }
  if (type == "WhitespaceSplit") {
    auto p = std::make_unique<CharSplitPreTokenizer>();
    p->label = "WhitespaceSplit";
    return p;
  }
  if (type == "CharDelimiterSplit") {
    auto p = std::make_unique<CharSplitPreTokenizer>();
    const std::string d = get_string(j, "delimiter", where);
    if (d.empty() || utf8_len(static_cast<unsigned char>(d[0])) != d.size()) {
      throw Error("[tokenizer] pre_tokenizer.delimiter: expected one character but got '" + d +
                  "'");
    }
    p->delimiter = utf8_at(d, 0);
    p->label = "CharDelimiterSplit";
    return p;
  }
  if (type == "ByteLevel") {
    auto p = std::make_unique<ByteLevelPreTokenizer>();
    p->add_prefix_space = get_bool(j, "add_prefix_space", where, true);
    if (get_bool(j, "use_regex", where, true))
      p->regex = std::make_unique<Regex>(kGpt2Pattern, where);
    return p;
  }
  if (type == "Metaspace") {
    auto p = std::make_unique<MetaspacePreTokenizer>();
    p->replacement = parse_replacement(j, where);
    p->scheme = parse_prepend_scheme(j, where);
    p->split = get_bool(j, "split", where, true);
    return p;
  }
  throw Error(type_list_error(where,
                              "Sequence, Split, Digits, ByteLevel, Metaspace, Whitespace, "
                              "WhitespaceSplit or CharDelimiterSplit",
                              type));
}

std::unique_ptr<Decoder> make_decoder(const json& j, int depth) {
  const std::string where = "decoder";
  check_depth(depth, where);
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    auto d = std::make_unique<SequenceDecoder>();
    const json& items = get_field(j, "decoders", where);
    if (!items.is_array())
      throw Error("[tokenizer] decoder.decoders: expected an array but got " + json_kind(items));
    for (const json& item : items) d->items.push_back(make_decoder(item, depth + 1));
    return d;
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    auto d = std::make_unique<StripDecoder>();
    const std::string c = get_string(j, "content", where);
    if (c.empty() || utf8_len(static_cast<unsigned char>(c[0])) != c.size()) {
      throw Error("[tokenizer] decoder.content: expected one character but got '" + c + "'");
    }
    d->content = utf8_at(c, 0);
    const json& start = get_field(j, "start", where);
    const json& stop = get_field(j, "stop", where);
    if (!start.is_number_unsigned() || !stop.is_number_unsigned()) {
      throw Error("[tokenizer] decoder(Strip): expected non-negative integers start/stop but got " +
                  json_kind(start) + " / " + json_kind(stop));
    }
    d->start = start.get<size_t>();
    d->stop = stop.get<size_t>();
    return d;
  }
  if (type == "Replace") {
    auto d = std::make_unique<ReplaceDecoder>();
    d->pattern = std::make_unique<Pattern>(get_field(j, "pattern", where), where);
    d->content = get_string(j, "content", where);
    return d;
  }
  if (type == "BPEDecoder") {
    auto d = std::make_unique<BpeSuffixDecoder>();
    d->suffix = j.contains("suffix") ? get_string(j, "suffix", where) : std::string("</w>");
    return d;
  }
  if (type == "Metaspace") {
    auto d = std::make_unique<MetaspaceDecoder>();
    d->replacement = parse_replacement(j, where);
    d->scheme = parse_prepend_scheme(j, where);
    return d;
  }
  throw Error(type_list_error(
      where, "Sequence, ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace or BPEDecoder",
      type));
}

}  // namespace vq::text
