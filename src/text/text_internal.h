// Internal pieces of the tokenizer (module vq_text): UTF-8 helpers, the PCRE2 regex wrapper,
// the BPE model and the pipeline components (normalizers, pre-tokenizers, decoders,
// post-processors) built from tokenizer.json. Strings are UTF-8 byte strings; offsets are byte
// offsets. Byte-level tokens are stored in their GPT-2 "bytes to unicode" mapped form.
#pragma once

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/utf8.h"

namespace vq::text {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// UTF-8
// Returns the length of the valid UTF-8 prefix of s (s.size() when all of s is valid).
inline size_t utf8_valid_prefix(std::string_view s) {
  return utf8::valid_prefix(s);
}
// Length in bytes of the character starting at s[i] (s valid UTF-8).
inline size_t utf8_len(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}
// Code point of the character at s[i] (s valid UTF-8).
uint32_t utf8_at(std::string_view s, size_t i);
void utf8_append(std::string& out, uint32_t cp);
// Rust's String::from_utf8_lossy: each maximal invalid subpart becomes U+FFFD. When
// incomplete_tail is given it is set to true if the bytes end with a truncated but so far valid
// sequence (more bytes could still complete it).
std::string utf8_lossy(std::string_view bytes, bool* incomplete_tail = nullptr);
// Unicode canonical normalization forms (nfc.cpp); s valid UTF-8.
std::string unicode_nfc(const std::string& s);
std::string unicode_nfd(const std::string& s);
// Unicode White_Space (Rust's char::is_whitespace).
bool is_unicode_whitespace(uint32_t cp);

// GPT-2 bytes <-> unicode map used by ByteLevel: byte b is stored as the UTF-8 of a code point.
struct ByteMap {
  std::array<std::string, 256> byte_to_utf8;
  std::array<int16_t, 324> cp_to_byte;  // -1 where the code point is not a mapped byte
};
const ByteMap& byte_map();

// ---------------------------------------------------------------------------------------------
// PCRE2 regex, compiled with UTF + UCP (Unicode properties for \p{L}, \s, \w ...) and JIT.
class Regex {
 public:
  // Throws vq::Error "[tokenizer] <what>: bad regex ..." when the pattern does not compile.
  Regex(std::string_view pattern, std::string_view what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Appends the [start, end) byte ranges of successive non-overlapping matches in s (valid
  // UTF-8). Empty matches are skipped. Throws vq::Error when the match limit is hit.
  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const;
  // True when the pattern matches somewhere in s.
  bool search(std::string_view s) const;

 private:
  pcre2_code* code_ = nullptr;
  std::string what_;
};

// ---------------------------------------------------------------------------------------------
// Pipeline components.

// A piece of text on its way through pre-tokenization. at_start: the piece begins at offset 0
// of the original text (Metaspace prepend_scheme "first" needs it).
struct Piece {
  std::string text;
  bool at_start = false;
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void apply(std::string& s) const = 0;
  virtual std::string name() const = 0;
};

// Receives the pieces a pre-tokenizer produces, in order (a non-owning callable reference, so
// pieces flow depth-first through a Sequence without intermediate lists).
class PieceSink {
 public:
  template <class F>
  explicit PieceSink(F& f)
      : object_(&f), call_([](void* o, Piece&& p) { (*static_cast<F*>(o))(std::move(p)); }) {}
  void operator()(Piece&& p) const { call_(object_, std::move(p)); }

 private:
  void* object_;
  void (*call_)(void*, Piece&&);
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void apply(Piece&& piece, const PieceSink& sink) const = 0;
  virtual std::string name() const = 0;
};

// What a decoder chain reads and sets besides the token strings. pending: set when the output
// ends with an unfinished UTF-8 character (streaming holds it back). continuation: the tokens are
// a window that starts after the beginning of the text (StreamDecoder's), so a Strip after a
// Fuse (fused: set by Fuse) must not strip the window's start, which is not the text's.
struct DecodeState {
  bool pending = false;
  bool continuation = false;
  bool fused = false;
};

// Decoders transform the list of token strings, like Hugging Face's decode_chain.
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void apply(std::vector<std::string>& tokens, DecodeState& st) const = 0;
  virtual std::string name() const = 0;
};

// Adds special ids around a single encoded sequence.
struct PostProcessor {
  std::vector<int32_t> prefix;
  std::vector<int32_t> suffix;
  std::string name;
};

// Builders from the tokenizer.json objects; depth counts nested Sequence levels.
std::unique_ptr<Normalizer> make_normalizer(const json& j, int depth);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, int depth);
std::unique_ptr<Decoder> make_decoder(const json& j, int depth);
PostProcessor make_post_processor(const json& j, int depth);

// ---------------------------------------------------------------------------------------------
// BPE model.

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // Validates and builds from tokenizer.json's "model" object; throws vq::Error.
  explicit BpeModel(const json& j);
  // Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;
  const Vocab& vocab() const { return vocab_; }
  int32_t max_id() const { return max_id_; }
  bool byte_fallback() const { return byte_fallback_; }
  std::string describe() const;

 private:
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  Vocab vocab_;
  int32_t max_id_ = -1;
  // (left id, right id) -> (rank, merged id), key = left << 32 | right.
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  std::string unk_token_;
  int32_t unk_id_ = -1;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_fallback_ids_{};  // <0xNN> ids, -1 when absent

  // Word cache (word -> ids): open addressing over a fixed power-of-two table, words and ids
  // in two arenas; it stops growing when half full. Guarded by cache_mutex_.
  struct CacheSlot {
    uint64_t hash = 0;  // 0 = empty
    uint32_t key_offset = 0, key_length = 0, ids_offset = 0, ids_length = 0;
  };
  bool cache_find(std::string_view word, uint64_t hash, std::vector<int32_t>& out) const;
  void cache_insert(std::string_view word, uint64_t hash, const int32_t* ids, size_t n) const;
  mutable std::mutex cache_mutex_;
  mutable std::vector<CacheSlot> cache_slots_;
  mutable std::string cache_keys_;
  mutable std::vector<int32_t> cache_ids_;
  mutable size_t cache_used_ = 0;
};

// Splits text by the [start, end) match ranges with one of Hugging Face's
// SplitDelimiterBehavior values, appending the non-empty pieces to out.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
void split_by_matches(const Piece& piece, const std::vector<std::pair<size_t, size_t>>& matches,
                      SplitBehavior behavior, bool invert, const PieceSink& sink);

// Small JSON accessors that throw vq::Error "[tokenizer] expected <what> but got ...".
const json& get_field(const json& j, const char* key, const std::string& where);
std::string get_string(const json& j, const char* key, const std::string& where);
bool get_bool(const json& j, const char* key, const std::string& where, bool fallback);
std::string json_kind(const json& j);
// s cut to at most max_bytes at a character boundary, "..." appended when cut.
std::string truncate_utf8(std::string_view s, size_t max_bytes);

}  // namespace vq::text
