// Tokenizer loaded from a Hugging Face `tokenizer.json` (the format the `tokenizers` library
// writes), matching its ids and decoded text exactly (goldens from tokenizers 0.23). Supported:
// model type BPE, both as byte-level BPE (GPT-2 / Llama-3 / Qwen2: NFC, Split regex + Digits +
// ByteLevel pre-tokenizers, ByteLevel decoder) and as SentencePiece-style BPE (Llama-2 /
// Mistral: Prepend + Replace normalizers or a Metaspace pre-tokenizer, byte_fallback <0xNN>
// tokens, unk + fuse_unk, ByteFallback/Fuse/Strip/Metaspace decoders); added/special tokens
// matched before normalization (lstrip, rstrip, single_word, normalized); TemplateProcessing,
// Bert and Roberta post-processors (single sequence). The full component list is at the top of
// src/text/pipeline.cpp; anything else (Unigram/WordPiece models, NFKC, Lowercase, BPE dropout,
// ...) is refused at load time with a vq::Error naming it. Ids are int32; text is UTF-8.
// Thread-safe after loading (the BPE word cache is internally locked).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vq {

// One entry of tokenizer.json's "added_tokens".
struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;      // skipped by decode(..., skip_special_tokens = true)
  bool lstrip = false;       // swallows the whitespace on its left when matched
  bool rstrip = false;       // swallows the whitespace on its right when matched
  bool single_word = false;  // matches only when not inside a word (\w on either side)
  bool normalized = false;   // matched in the normalized text instead of the raw text
};

class StreamDecoder;

class Tokenizer {
 public:
  // Parses tokenizer.json; throws vq::Error naming what is wrong or unsupported.
  static Tokenizer from_file(const std::string& path);
  static Tokenizer from_json(std::string_view json_text);

  // Text (valid UTF-8, else vq::Error) -> ids. add_special_tokens applies the post-processor
  // (for example the BOS of a TemplateProcessing "<s> $A"); added tokens in the text are always
  // matched, as Hugging Face does.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;

  // Ids -> text through the tokenizer's decoder (bytes that do not form valid UTF-8 become
  // U+FFFD, as Hugging Face does). An id outside [0, vocab_size()) or a hole in the
  // vocabulary is refused with vq::Error.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // One past the largest id of the model vocabulary and the added tokens.
  int32_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token's string as stored (byte-level tokens in their mapped form). Throws if unknown.
  const std::string& id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const;
  // Ids the post-processor puts before / after the text of a single sequence (may be empty).
  std::vector<int32_t> prefix_special_ids() const;
  std::vector<int32_t> suffix_special_ids() const;
  // A one-line description: model kind, vocabulary size, pipeline components.
  std::string describe() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
  friend class StreamDecoder;
};

// Incremental detokenizer for generation: push ids one at a time and get back only text made of
// complete UTF-8 characters. Bytes of a character split across tokens are held back until the
// character is complete. The concatenation of every push() plus flush() equals
// Tokenizer::decode of all pushed ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  // Returns the new text this id completes (possibly empty).
  std::string push(int32_t id);
  // Emits whatever is held back (an unfinished character becomes U+FFFD) and starts over.
  std::string flush();
  // Forgets everything pushed so far.
  void reset();

 private:
  Tokenizer tokenizer_;
  bool skip_special_;
  std::vector<int32_t> ids_;  // context ids + ids not yet emitted
  std::string prefix_;        // decode of ids_[0, prefix_index_)
  size_t prefix_index_ = 0;   // start of the ids not yet emitted
  bool continued_ = false;    // ids_ no longer starts at the first pushed id
};

}  // namespace vq
