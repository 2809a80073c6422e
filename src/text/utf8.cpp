// UTF-8 helpers, the GPT-2 byte<->unicode map and the PCRE2 regex wrapper for the tokenizer.
// UTF-8 validation (src/core/utf8.h) and lossy conversion follow Rust's std (the reference
// `tokenizers` is Rust): a "maximal subpart" of an invalid sequence becomes one U+FFFD. Regexes are
// compiled with PCRE2_UTF | PCRE2_UCP so \p{L}, \p{N}, \s and \w use Unicode properties,
// JIT-compiled when available, and matched with bounded match/heap limits so hostile patterns fail
// with vq::Error.
#include <string>

#include "core/utf8.h"
#include "text/text_internal.h"
#include "veloxquant/error.h"

namespace vq::text {

uint32_t utf8_at(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return b0;
  const size_t n = utf8_len(b0);
  uint32_t cp = b0 & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string utf8_lossy(std::string_view s, bool* incomplete_tail) {
  static constexpr char kReplacement[] = "\xEF\xBF\xBD";
  if (incomplete_tail) *incomplete_tail = false;
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      out.push_back(s[i++]);
      continue;
    }
    const int n = utf8::scan_sequence(s, i);
    if (n > 0) {
      out.append(s.substr(i, static_cast<size_t>(n)));
      i += static_cast<size_t>(n);
    } else if (n < 0) {
      out += kReplacement;
      i += static_cast<size_t>(-n);
    } else {  // truncated at the end
      out += kReplacement;
      if (incomplete_tail) *incomplete_tail = true;
      break;
    }
  }
  return out;
}

bool is_unicode_whitespace(uint32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

const ByteMap& byte_map() {
  static const ByteMap map = [] {
    ByteMap m;
    m.cp_to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : next++;
      utf8_append(m.byte_to_utf8[b], cp);
      m.cp_to_byte[cp] = static_cast<int16_t>(b);
    }
    return m;
  }();
  return map;
}

// ---------------------------------------------------------------------------------------------
// Regex

namespace {

// Limits for one match attempt: enough for any sane pre-tokenizer pattern on long inputs, small
// enough that a catastrophic pattern from a hostile file fails quickly.
constexpr uint32_t kMatchLimit = 10'000'000;
constexpr uint32_t kHeapLimitKiB = 64 * 1024;

// Per-thread match context and JIT stack (pcre2 contexts are not thread-safe to share for
// writing, and JIT stacks must not be used by two threads at once).
struct MatchResources {
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  MatchResources() {
    context = pcre2_match_context_create(nullptr);
    pcre2_set_match_limit(context, kMatchLimit);
    pcre2_set_heap_limit(context, kHeapLimitKiB);
    jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (jit_stack) pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchResources() {
    if (jit_stack) pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
  }
  MatchResources(const MatchResources&) = delete;
  MatchResources& operator=(const MatchResources&) = delete;
};

MatchResources& match_resources() {
  thread_local MatchResources resources;
  return resources;
}

struct MatchData {
  pcre2_match_data* md;
  explicit MatchData(const pcre2_code* code)
      : md(pcre2_match_data_create_from_pattern(code, nullptr)) {}
  ~MatchData() { pcre2_match_data_free(md); }
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
};

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  const int n = pcre2_get_error_message(code, buffer, sizeof(buffer));
  if (n < 0) return "error " + std::to_string(code);
  return std::string(reinterpret_cast<const char*>(buffer), static_cast<size_t>(n));
}

// The reference runs Oniguruma, whose Unicode \s is exactly White_Space and whose \w is
// Alphabetic | Mark | Nd | Pc | Join_Control. PCRE2 10.42 under UCP differs (\s also matches
// U+180E; \w is only L | N | _), so \s \S \w \W are rewritten into explicit classes:
// outside a class \s -> [ws], \S -> [^ws] (same for \w); inside a class \s -> ws and
// \w -> word items (\S and \W inside a class are left alone: no tokenizer pattern uses them).
constexpr const char* kWhiteSpaceItems =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";
constexpr const char* kWordItems = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}";

std::string rewrite_onig_classes(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  size_t class_start = 0;  // index in p just after '[' or '[^'
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char n = p[i + 1];
      const char* items = n == 's' || n == 'S'   ? kWhiteSpaceItems
                          : n == 'w' || n == 'W' ? kWordItems
                                                 : nullptr;
      if (items && (n == 's' || n == 'w')) {
        out += in_class ? std::string(items) : "[" + std::string(items) + "]";
      } else if (items && !in_class) {  // \S or \W
        out += "[^" + std::string(items) + "]";
      } else {
        out += c;
        out += n;
      }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      class_start = i + 1;
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // POSIX [:name:]
      const size_t end = p.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out.append(p.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']' && i != class_start) in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

Regex::Regex(std::string_view original, std::string_view what) : what_(what) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  const std::string rewritten = rewrite_onig_classes(original);
  const std::string_view pattern = rewritten;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                        PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (!code_) {
    throw Error("[tokenizer] " + what_ + ": expected a valid regex but got /" +
                std::string(original.substr(0, 200)) + "/ (" + pcre2_message(error_code) + ")");
  }
  // JIT is an optimisation only: the interpreter is used when it is unavailable.
  (void)pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() {
  pcre2_code_free(code_);
}

void Regex::find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
  MatchData data(code_);
  if (!data.md) throw Error("[tokenizer] " + what_ + ": out of memory for regex match data");
  pcre2_match_context* context = match_resources().context;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t offset = 0;
  while (offset < s.size()) {
    const int rc =
        pcre2_match(code_, subject, s.size(), offset, PCRE2_NO_UTF_CHECK, data.md, context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      throw Error("[tokenizer] " + what_ + ": expected the regex to match within limits but got " +
                  pcre2_message(rc));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data.md);
    const size_t start = ov[0];
    const size_t end = ov[1];
    if (end <= start) {  // empty match (or \K oddity): step over one character
      const size_t at = start < offset ? offset : start;
      if (at >= s.size()) break;
      offset = at + utf8_len(static_cast<unsigned char>(s[at]));
      continue;
    }
    out.emplace_back(start, end);
    offset = end;
  }
}

bool Regex::search(std::string_view s) const {
  MatchData data(code_);
  if (!data.md) throw Error("[tokenizer] " + what_ + ": out of memory for regex match data");
  const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0,
                             PCRE2_NO_UTF_CHECK, data.md, match_resources().context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    throw Error("[tokenizer] " + what_ + ": expected the regex to match within limits but got " +
                pcre2_message(rc));
  }
  return true;
}

}  // namespace vq::text
