// vq::Tokenizer: loads tokenizer.json and runs the Hugging Face encode pipeline
//   added tokens matched in the raw text (normalized=false ones) -> normalizer -> added tokens
//   matched in the normalized text (normalized=true ones) -> pre-tokenizer -> BPE per word ->
//   post-processor (only with add_special_tokens)
// and the decode pipeline (id -> token string, optional removal of special tokens, decoder
// chain). Added-token matching is leftmost-longest like the reference's Aho-Corasick, with
// lstrip/rstrip swallowing Unicode whitespace and single_word checked with Rust's \w class.
// Known differences from the reference: regexes run on PCRE2 10.42 instead of Oniguruma and
// NFC uses Python's Unicode 14 tables (characters newer than that may classify differently),
// and an added token whose content starts with whitespace right after an rstrip token.
#include <algorithm>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "text/text_internal.h"
#include "veloxquant/error.h"
#include "veloxquant/tokenizer.h"

namespace vq {

using text::json;

namespace text {

const json& get_field(const json& j, const char* key, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) {
    throw Error("[tokenizer] " + where + ": expected a \"" + key + "\" field but it is missing");
  }
  return j.at(key);
}

std::string get_string(const json& j, const char* key, const std::string& where) {
  const json& v = get_field(j, key, where);
  if (!v.is_string()) {
    throw Error("[tokenizer] " + where + "." + key + ": expected a string but got " + json_kind(v));
  }
  return v.get<std::string>();
}

bool get_bool(const json& j, const char* key, const std::string& where, bool fallback) {
  if (!j.is_object() || !j.contains(key) || j.at(key).is_null()) return fallback;
  const json& v = j.at(key);
  if (!v.is_boolean()) {
    throw Error("[tokenizer] " + where + "." + key + ": expected true/false but got " +
                json_kind(v));
  }
  return v.get<bool>();
}

std::string truncate_utf8(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return std::string(s);
  size_t n = max_bytes;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;  // char boundary
  return std::string(s.substr(0, n)) + "...";
}

std::string json_kind(const json& j) {
  // Never dump containers: a hostile document may nest them deeply (dump recurses).
  if (j.is_object()) return "object of " + std::to_string(j.size()) + " fields";
  if (j.is_array()) return "array of " + std::to_string(j.size()) + " items";
  if (j.is_string()) {
    const std::string& v = j.get_ref<const std::string&>();
    return "string \"" + truncate_utf8(v, 60) + "\"";
  }
  return std::string(j.type_name()) + " " + j.dump();
}

namespace {

int32_t parse_id(const json& v, const std::string& where) {
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= INT32_MAX) {
    throw Error("[tokenizer] " + where + ": expected an id in [0, 2^31-1) but got " + json_kind(v));
  }
  return static_cast<int32_t>(v.get<int64_t>());
}

// ["[CLS]", 101] as Bert/Roberta serialise their special tokens.
int32_t parse_pair_id(const json& j, const char* key, const std::string& where) {
  const json& v = get_field(j, key, where);
  if (!v.is_array() || v.size() != 2 || !v[0].is_string()) {
    throw Error("[tokenizer] " + where + "." + key + ": expected [\"token\", id] but got " +
                json_kind(v));
  }
  return parse_id(v[1], where + "." + key);
}

}  // namespace

PostProcessor make_post_processor(const json& j, int depth) {
  const std::string where = "post_processor";
  if (depth > 16)
    throw Error(
        "[tokenizer] post_processor: expected at most 16 nested Sequence levels but got more");
  if (!j.is_object())
    throw Error("[tokenizer] post_processor: expected an object but got " + json_kind(j));
  const std::string type = get_string(j, "type", where);
  PostProcessor p;
  p.name = type;
  if (type == "ByteLevel") return p;  // only adjusts offsets
  if (type == "Sequence") {
    const json& items = get_field(j, "processors", where);
    if (!items.is_array())
      throw Error("[tokenizer] post_processor.processors: expected an array but got " +
                  json_kind(items));
    p.name = "Sequence[";
    for (const json& item : items) {
      PostProcessor q = make_post_processor(item, depth + 1);
      // Each processor wraps the result of the previous one.
      q.prefix.insert(q.prefix.end(), p.prefix.begin(), p.prefix.end());
      p.prefix = std::move(q.prefix);
      p.suffix.insert(p.suffix.end(), q.suffix.begin(), q.suffix.end());
      if (p.name.back() != '[') p.name += ',';
      p.name += q.name;
    }
    p.name += "]";
    return p;
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    p.prefix.push_back(parse_pair_id(j, "cls", where));
    p.suffix.push_back(parse_pair_id(j, "sep", where));
    return p;
  }
  if (type == "TemplateProcessing") {
    const json& single = get_field(j, "single", where);
    const json& specials = get_field(j, "special_tokens", where);
    if (!single.is_array())
      throw Error("[tokenizer] post_processor.single: expected an array but got " +
                  json_kind(single));
    if (!specials.is_object())
      throw Error("[tokenizer] post_processor.special_tokens: expected an object but got " +
                  json_kind(specials));
    bool seen_sequence = false;
    for (const json& item : single) {
      if (item.is_object() && item.contains("Sequence")) {
        const std::string id = get_string(item.at("Sequence"), "id", where + ".single");
        if (id != "A" || seen_sequence) {
          throw Error("[tokenizer] post_processor.single: expected one $A sequence but got $" + id);
        }
        seen_sequence = true;
      } else if (item.is_object() && item.contains("SpecialToken")) {
        const std::string name = get_string(item.at("SpecialToken"), "id", where + ".single");
        if (!specials.contains(name)) {
          throw Error("[tokenizer] post_processor.single: expected special token '" + name +
                      "' in special_tokens but it is missing");
        }
        const json& ids = get_field(specials.at(name), "ids", where + ".special_tokens." + name);
        if (!ids.is_array())
          throw Error("[tokenizer] post_processor.special_tokens." + name +
                      ".ids: expected an array but got " + json_kind(ids));
        auto& target = seen_sequence ? p.suffix : p.prefix;
        for (const json& id : ids)
          target.push_back(parse_id(id, where + ".special_tokens." + name));
      } else {
        throw Error(
            "[tokenizer] post_processor.single: expected {\"Sequence\": ...} or "
            "{\"SpecialToken\": ...} but got " +
            json_kind(item));
      }
    }
    if (!seen_sequence)
      throw Error("[tokenizer] post_processor.single: expected a $A sequence but got none");
    return p;
  }
  throw Error(
      "[tokenizer] post_processor: expected TemplateProcessing, BertProcessing, "
      "RobertaProcessing, ByteLevel or Sequence but got unsupported type '" +
      type + "'");
}

}  // namespace text

// ---------------------------------------------------------------------------------------------

namespace {

// Leftmost-longest matcher over the added tokens' strings (few patterns: first-byte buckets,
// longest first).
class AddedMatcher {
 public:
  struct Match {
    size_t start, end;
    size_t token;  // index into Impl::added
  };
  void add(std::string pattern, size_t token) {
    if (pattern.empty()) return;
    const auto b = static_cast<unsigned char>(pattern[0]);
    patterns_.push_back({std::move(pattern), token});
    auto& bucket = buckets_[b];
    bucket.push_back(patterns_.size() - 1);
    std::stable_sort(bucket.begin(), bucket.end(), [this](size_t x, size_t y) {
      return patterns_[x].text.size() > patterns_[y].text.size();
    });
  }
  bool empty() const { return patterns_.empty(); }
  // Next match starting at or after pos, or false.
  bool find(std::string_view s, size_t pos, Match& m) const {
    for (; pos < s.size(); ++pos) {
      const auto& bucket = buckets_[static_cast<unsigned char>(s[pos])];
      for (size_t idx : bucket) {
        const std::string& p = patterns_[idx].text;
        if (s.size() - pos >= p.size() && s.compare(pos, p.size(), p) == 0) {
          m = {pos, pos + p.size(), patterns_[idx].token};
          return true;
        }
      }
    }
    return false;
  }

 private:
  struct Pattern {
    std::string text;
    size_t token;
  };
  std::vector<Pattern> patterns_;
  std::array<std::vector<size_t>, 256> buckets_;
};

// A span of text that is either an added token or text still to tokenize.
struct Segment {
  size_t start, end;
  int32_t id;  // -1: text
};

}  // namespace

struct Tokenizer::Impl {
  std::unique_ptr<text::BpeModel> model;
  std::unique_ptr<text::Normalizer> normalizer;
  std::unique_ptr<text::PreTokenizer> pre_tokenizer;
  std::unique_ptr<text::Decoder> decoder;
  text::PostProcessor post;
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_by_content;
  AddedMatcher raw_matcher;         // normalized == false
  AddedMatcher normalized_matcher;  // normalized == true, patterns normalized
  std::unique_ptr<text::Regex> word_char;
  std::vector<std::string> tokens;  // id -> token string
  std::vector<uint8_t> kind;        // id -> 0 hole, 1 token, 2 special token
  int32_t size = 0;

  void find_added(std::string_view s, const AddedMatcher& matcher, std::vector<Segment>& out) const;
  void encode_text(std::string_view text, bool at_start, std::vector<int32_t>& ids) const;
  // continuation: ids start after the beginning of the text (StreamDecoder's window).
  std::string decode(std::span<const int32_t> ids, bool skip_special, bool* pending,
                     bool continuation = false) const;
};

// The reference's AddedVocabulary::find_matches: splits s into text and added-token segments.
void Tokenizer::Impl::find_added(std::string_view s, const AddedMatcher& matcher,
                                 std::vector<Segment>& out) const {
  size_t start_offset = 0;
  size_t pos = 0;
  AddedMatcher::Match m{};
  while (!matcher.empty() && matcher.find(s, pos, m)) {
    pos = m.end;
    const AddedToken& tok = added[m.token];
    size_t start = m.start, stop = m.end;
    if (tok.single_word) {
      bool word_before = false, word_after = false;
      if (start > 0) {
        size_t c = start - 1;
        while (c > 0 && (static_cast<unsigned char>(s[c]) & 0xC0) == 0x80) --c;
        word_before = word_char->search(s.substr(c, start - c));
      }
      if (stop < s.size()) {
        word_after =
            word_char->search(s.substr(stop, text::utf8_len(static_cast<unsigned char>(s[stop]))));
      }
      if (word_before || word_after) continue;
    }
    if (tok.lstrip) {
      size_t b = start;
      while (b > start_offset) {
        size_t c = b - 1;
        while (c > 0 && (static_cast<unsigned char>(s[c]) & 0xC0) == 0x80) --c;
        if (!text::is_unicode_whitespace(text::utf8_at(s, c))) break;
        b = c;
      }
      start = std::max(b, start_offset);
    }
    if (tok.rstrip) {
      while (stop < s.size() && text::is_unicode_whitespace(text::utf8_at(s, stop))) {
        stop += text::utf8_len(static_cast<unsigned char>(s[stop]));
      }
      pos = std::max(pos, stop);
    }
    if (start_offset < start) out.push_back({start_offset, start, -1});
    out.push_back({start, stop, tok.id});
    start_offset = stop;
  }
  if (start_offset < s.size()) out.push_back({start_offset, s.size(), -1});
}

// Normalized text of one segment -> pre-tokenizer -> BPE.
void Tokenizer::Impl::encode_text(std::string_view text, bool at_start,
                                  std::vector<int32_t>& ids) const {
  if (!pre_tokenizer) {
    model->tokenize(text, ids);
    return;
  }
  auto to_model = [&](text::Piece&& p) { model->tokenize(p.text, ids); };
  pre_tokenizer->apply({std::string(text), at_start}, text::PieceSink(to_model));
}

std::string Tokenizer::Impl::decode(std::span<const int32_t> ids, bool skip_special, bool* pending,
                                    bool continuation) const {
  std::vector<std::string> parts;
  parts.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= size || kind[static_cast<size_t>(id)] == 0) {
      throw Error("[tokenizer.decode] expected an id of the vocabulary [0, " +
                  std::to_string(size) + ") but got " + std::to_string(id));
    }
    if (skip_special && kind[static_cast<size_t>(id)] == 2) continue;
    parts.push_back(tokens[static_cast<size_t>(id)]);
  }
  text::DecodeState st;
  st.continuation = continuation;
  std::string out;
  if (decoder) {
    decoder->apply(parts, st);
    for (const std::string& p : parts) out += p;
  } else {
    for (size_t i = 0; i < parts.size(); ++i) {
      if (i) out += ' ';
      out += parts[i];
    }
  }
  if (pending) *pending = st.pending;
  return out;
}

// ---------------------------------------------------------------------------------------------

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw Error("[tokenizer] expected a readable tokenizer.json but could not open '" + path + "'");
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) throw Error("[tokenizer] expected to read '" + path + "' but the read failed");
  try {
    return from_json(buffer.str());
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (in " + path + ")");
  }
}

Tokenizer Tokenizer::from_json(std::string_view json_text) {
  json j;
  try {
    j = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {
    throw Error(std::string("[tokenizer] expected valid JSON but got a parse error: ") + e.what());
  }
  if (!j.is_object())
    throw Error("[tokenizer] expected a JSON object at the top level but got " +
                text::json_kind(j));
  auto impl = std::make_shared<Impl>();
  try {
    if (!j.contains("model"))
      throw Error("[tokenizer] expected a \"model\" field but it is missing");
    impl->model = std::make_unique<text::BpeModel>(j.at("model"));
    if (j.contains("normalizer") && !j.at("normalizer").is_null()) {
      impl->normalizer = text::make_normalizer(j.at("normalizer"), 0);
    }
    if (j.contains("pre_tokenizer") && !j.at("pre_tokenizer").is_null()) {
      impl->pre_tokenizer = text::make_pre_tokenizer(j.at("pre_tokenizer"), 0);
    }
    if (j.contains("decoder") && !j.at("decoder").is_null()) {
      impl->decoder = text::make_decoder(j.at("decoder"), 0);
    }
    if (j.contains("post_processor") && !j.at("post_processor").is_null()) {
      impl->post = text::make_post_processor(j.at("post_processor"), 0);
    }
  } catch (const json::exception& e) {
    throw Error(std::string("[tokenizer] unexpected JSON structure: ") + e.what());
  }

  // Id table: model vocabulary first, then added tokens (their content wins for decoding).
  const text::Vocab& vocab = impl->model->vocab();
  int32_t max_id = impl->model->max_id();
  std::vector<AddedToken> added;
  if (j.contains("added_tokens") && !j.at("added_tokens").is_null()) {
    const json& list = j.at("added_tokens");
    if (!list.is_array())
      throw Error("[tokenizer] added_tokens: expected an array but got " + text::json_kind(list));
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string where = "added_tokens[" + std::to_string(i) + "]";
      const json& t = list[i];
      if (!t.is_object())
        throw Error("[tokenizer] " + where + ": expected an object but got " + text::json_kind(t));
      AddedToken a;
      a.id = text::parse_id(text::get_field(t, "id", where), where + ".id");
      a.content = text::get_string(t, "content", where);
      a.special = text::get_bool(t, "special", where, false);
      a.lstrip = text::get_bool(t, "lstrip", where, false);
      a.rstrip = text::get_bool(t, "rstrip", where, false);
      a.single_word = text::get_bool(t, "single_word", where, false);
      a.normalized = text::get_bool(t, "normalized", where, !a.special);
      if (a.content.empty()) continue;  // the reference ignores empty added tokens
      // As the reference: a token already in the model vocabulary keeps the vocabulary's id.
      if (auto it = vocab.find(a.content); it != vocab.end()) a.id = it->second;
      max_id = std::max(max_id, a.id);
      added.push_back(std::move(a));
    }
  }
  const size_t entries = vocab.size() + added.size();
  if (max_id < 0) throw Error("[tokenizer] model.vocab: expected at least one token but got none");
  if (static_cast<size_t>(max_id) + 1 > 2 * entries + 1024) {
    throw Error("[tokenizer] expected dense ids (largest id below 2 x entries + 1024) but got id " +
                std::to_string(max_id) + " for " + std::to_string(entries) + " tokens");
  }
  impl->size = max_id + 1;
  impl->tokens.assign(static_cast<size_t>(impl->size), std::string());
  impl->kind.assign(static_cast<size_t>(impl->size), 0);
  for (const auto& [token, id] : vocab) {
    if (impl->kind[static_cast<size_t>(id)] != 0) {
      throw Error("[tokenizer] model.vocab: expected unique ids but id " + std::to_string(id) +
                  " is used by '" + impl->tokens[static_cast<size_t>(id)] + "' and '" + token +
                  "'");
    }
    impl->tokens[static_cast<size_t>(id)] = token;
    impl->kind[static_cast<size_t>(id)] = 1;
  }
  // Later entries with the same content replace earlier ones (as the reference).
  std::unordered_set<std::string> special_contents;
  for (AddedToken& a : added) {
    if (auto it = impl->added_by_content.find(a.content); it != impl->added_by_content.end()) {
      for (AddedToken& b : impl->added) {
        if (b.content == a.content) b = a;
      }
      continue;
    }
    if (impl->kind[static_cast<size_t>(a.id)] != 0 && vocab.find(a.content) == vocab.end()) {
      throw Error("[tokenizer] added_tokens: expected unique ids but id " + std::to_string(a.id) +
                  " is used by '" + impl->tokens[static_cast<size_t>(a.id)] + "' and '" +
                  a.content + "'");
    }
    // As the reference (0.2x): a normalized added token decodes from its normalized form, so
    // that the decoder can invert the normalizer (for example a Prepend "▁").
    std::string decoded_form = a.content;
    if (a.normalized && impl->normalizer) impl->normalizer->apply(decoded_form);
    impl->tokens[static_cast<size_t>(a.id)] = std::move(decoded_form);
    impl->kind[static_cast<size_t>(a.id)] = 1;
    impl->added_by_content.emplace(a.content, a.id);
    impl->added.push_back(a);
  }
  for (const AddedToken& a : impl->added) {
    if (a.special) special_contents.insert(a.content);
  }
  // Special-ness is by content (a model token equal to a special token's content is special).
  for (size_t id = 0; id < impl->tokens.size(); ++id) {
    if (impl->kind[id] != 0 && special_contents.count(impl->tokens[id])) impl->kind[id] = 2;
  }
  // Matchers: special tokens first, then the others (the reference's pattern order).
  bool any_single_word = false;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < impl->added.size(); ++i) {
      const AddedToken& a = impl->added[i];
      if (a.special != (pass == 0)) continue;
      any_single_word = any_single_word || a.single_word;
      if (!a.normalized) {
        impl->raw_matcher.add(a.content, i);
      } else {
        std::string pattern = a.content;
        if (impl->normalizer) impl->normalizer->apply(pattern);
        impl->normalized_matcher.add(std::move(pattern), i);
      }
    }
  }
  // The reference checks single_word with Rust's \w (Alphabetic, marks, decimal digits,
  // connector punctuation, Join_Control); text::Regex rewrites \w into exactly that class.
  if (any_single_word) {
    impl->word_char = std::make_unique<text::Regex>("\\w", "single_word");
  }
  for (int32_t id : impl->post.prefix) {
    if (id >= impl->size || impl->kind[static_cast<size_t>(id)] == 0) {
      throw Error("[tokenizer] post_processor: expected special ids in the vocabulary but got " +
                  std::to_string(id));
    }
  }
  for (int32_t id : impl->post.suffix) {
    if (id >= impl->size || impl->kind[static_cast<size_t>(id)] == 0) {
      throw Error("[tokenizer] post_processor: expected special ids in the vocabulary but got " +
                  std::to_string(id));
    }
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view input, bool add_special_tokens) const {
  const Impl& im = *impl_;
  const size_t valid = text::utf8_valid_prefix(input);
  if (valid != input.size()) {
    throw Error("[tokenizer.encode] expected valid UTF-8 text but got an invalid byte at offset " +
                std::to_string(valid));
  }
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = im.post.prefix;
  std::vector<Segment> raw;
  im.find_added(input, im.raw_matcher, raw);
  std::vector<Segment> sub;
  std::string normalized;
  for (const Segment& seg : raw) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    normalized.assign(input.substr(seg.start, seg.end - seg.start));
    if (im.normalizer) im.normalizer->apply(normalized);
    sub.clear();
    im.find_added(normalized, im.normalized_matcher, sub);
    for (const Segment& s : sub) {
      if (s.id >= 0) {
        ids.push_back(s.id);
      } else {
        im.encode_text(std::string_view(normalized).substr(s.start, s.end - s.start),
                       seg.start == 0 && s.start == 0, ids);
      }
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), im.post.suffix.begin(), im.post.suffix.end());
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return impl_->decode(ids, skip_special_tokens, nullptr);
}

int32_t Tokenizer::vocab_size() const {
  return impl_->size;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(std::string(token));
      it != impl_->added_by_content.end()) {
    return it->second;
  }
  const text::Vocab& vocab = impl_->model->vocab();
  if (auto it = vocab.find(token); it != vocab.end()) return it->second;
  return std::nullopt;
}

const std::string& Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= impl_->size || impl_->kind[static_cast<size_t>(id)] == 0) {
    throw Error("[tokenizer.id_to_token] expected an id of the vocabulary [0, " +
                std::to_string(impl_->size) + ") but got " + std::to_string(id));
  }
  return impl_->tokens[static_cast<size_t>(id)];
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < impl_->size && impl_->kind[static_cast<size_t>(id)] == 2;
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const {
  return impl_->added;
}
std::vector<int32_t> Tokenizer::prefix_special_ids() const {
  return impl_->post.prefix;
}
std::vector<int32_t> Tokenizer::suffix_special_ids() const {
  return impl_->post.suffix;
}

std::string Tokenizer::describe() const {
  const Impl& im = *impl_;
  std::string out = im.model->describe();
  out += "; normalizer " + (im.normalizer ? im.normalizer->name() : std::string("none"));
  out += "; pre_tokenizer " + (im.pre_tokenizer ? im.pre_tokenizer->name() : std::string("none"));
  out += "; decoder " + (im.decoder ? im.decoder->name() : std::string("none"));
  out += "; post_processor " + (im.post.name.empty() ? std::string("none") : im.post.name);
  out += "; " + std::to_string(im.added.size()) + " added tokens";
  return out;
}

// ---------------------------------------------------------------------------------------------
// Streaming: decode the context ids plus the new ones and emit what lies beyond the context's
// text, unless the end is an unfinished UTF-8 character. After an emission the ids just
// emitted become the context (they carry decoder state such as "first token" rules).

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_(skip_special_tokens) {}

std::string StreamDecoder::push(int32_t id) {
  const Tokenizer::Impl& im = *tokenizer_.impl_;
  ids_.push_back(id);
  bool pending = false;
  std::string text;
  try {
    text = im.decode(ids_, skip_special_, &pending, continued_);
  } catch (...) {
    ids_.pop_back();  // a bad id changes nothing
    throw;
  }
  if (pending || text.size() <= prefix_.size() || text.compare(0, prefix_.size(), prefix_) != 0) {
    return {};
  }
  std::string delta = text.substr(prefix_.size());
  const size_t emitted = ids_.size() - prefix_index_;
  ids_.erase(ids_.begin(), ids_.begin() + static_cast<ptrdiff_t>(prefix_index_));
  continued_ = continued_ || prefix_index_ > 0;
  prefix_ = im.decode(ids_, skip_special_, nullptr, continued_);
  prefix_index_ = emitted;
  return delta;
}

std::string StreamDecoder::flush() {
  const Tokenizer::Impl& im = *tokenizer_.impl_;
  std::string text = im.decode(ids_, skip_special_, nullptr, continued_);
  std::string delta;
  if (text.size() > prefix_.size() && text.compare(0, prefix_.size(), prefix_) == 0) {
    delta = text.substr(prefix_.size());
  }
  reset();
  return delta;
}

void StreamDecoder::reset() {
  ids_.clear();
  prefix_.clear();
  prefix_index_ = 0;
  continued_ = false;
}

}  // namespace vq
