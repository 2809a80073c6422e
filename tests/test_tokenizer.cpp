// Tokenizer tests: golden ids and decoded text from the Hugging Face `tokenizers` library
// (tests/data/tokenizers/goldens_*.json, written by tools/make_tokenizer_goldens.py) for every
// tokenizer file present (the small trained ones and the shipped model's), exact equality;
// round trips where the reference round-trips; the streaming decoder fed one token at a time
// equals the full decode and only ever emits valid UTF-8 (also on random id sequences); and
// malformed tokenizer.json files refused with a vq::Error that names what is wrong.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "util/test_util.h"
#include "veloxquant/error.h"
#include "veloxquant/tokenizer.h"

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Strict UTF-8 check (independent of the library's own helpers): shortest forms, no surrogates,
// nothing above U+10FFFF, no truncated sequence.
bool is_valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    const uint32_t min_cp = n == 2 ? 0x80 : n == 3 ? 0x800 : 0x10000;
    if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

// Repository path of a data file. The test binary has VQ_SOURCE_DIR compiled in, which also
// holds while ctest lists the tests (the environment variable is only set for test runs).
std::string data_path(const std::string& rel) {
  if (const char* root = std::getenv("VQ_SOURCE_DIR")) return std::string(root) + "/" + rel;
#ifdef VQ_SOURCE_DIR
  return std::string(VQ_SOURCE_DIR) + "/" + rel;
#else
  return vq::test::source_path(rel);
#endif
}

std::vector<int32_t> to_ids(const json& j) {
  return j.get<std::vector<int32_t>>();
}

// FNV-1a 64 of a file's bytes, as tools/make_tokenizer_goldens.py records it.
std::string fnv1a64_hex(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// Streams ids one at a time; checks every chunk is valid UTF-8; returns the concatenation and
// how many pushes returned nothing (held back).
std::string stream_decode(const vq::Tokenizer& tok, const std::vector<int32_t>& ids, bool skip,
                          int* held_back = nullptr) {
  vq::StreamDecoder stream(tok, skip);
  std::string all;
  int held = 0;
  for (int32_t id : ids) {
    const std::string chunk = stream.push(id);
    EXPECT_TRUE(is_valid_utf8(chunk)) << "chunk after id " << id;
    if (chunk.empty()) ++held;
    all += chunk;
  }
  const std::string rest = stream.flush();
  EXPECT_TRUE(is_valid_utf8(rest));
  all += rest;
  if (held_back) *held_back = held;
  return all;
}

std::vector<std::string> golden_files() {
  std::vector<std::string> out;
  const fs::path dir = data_path("tests/data/tokenizers");
  if (!fs::exists(dir)) return out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("goldens_") && name.ends_with(".json"))
      out.push_back(entry.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// ------------------------------------------------------------------------------------ goldens

class TokenizerGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerGolden, MatchesReference) {
  const json golden = json::parse(read_text(GetParam()));
  const std::string tok_path = data_path(golden.at("tokenizer_file").get<std::string>());
  if (!fs::exists(tok_path)) GTEST_SKIP() << "tokenizer not present: " << tok_path;
  // Goldens of another tokenizer.json would test nothing: say how to refresh them.
  ASSERT_EQ(fnv1a64_hex(read_text(tok_path)), golden.at("tokenizer_fnv1a64").get<std::string>())
      << tok_path << " changed since " << GetParam()
      << " was written: re-run python3 tools/make_tokenizer_goldens.py";
  const vq::Tokenizer tok = vq::Tokenizer::from_file(tok_path);
  const json& cases = golden.at("cases");
  ASSERT_GE(cases.size(), 50u);
  int n_roundtrip = 0;
  for (const json& c : cases) {
    const std::string text = c.at("text").get<std::string>();
    SCOPED_TRACE("text: \"" + text.substr(0, 80) + "\"");
    const std::vector<int32_t> ids = to_ids(c.at("ids"));
    const std::vector<int32_t> ids_special = to_ids(c.at("ids_special"));
    // "decoded" is omitted where the reference round-trips (decoded == text), "decoded_skip"
    // where it equals "decoded".
    const bool roundtrip = !c.contains("decoded");
    const std::string decoded = roundtrip ? text : c.at("decoded").get<std::string>();
    const std::string decoded_skip =
        c.contains("decoded_skip") ? c.at("decoded_skip").get<std::string>() : decoded;
    EXPECT_EQ(tok.encode(text, false), ids);
    EXPECT_EQ(tok.encode(text, true), ids_special);
    EXPECT_EQ(tok.decode(ids), decoded);
    EXPECT_EQ(tok.decode(ids_special, true), decoded_skip);
    if (roundtrip) {
      ++n_roundtrip;
      EXPECT_EQ(tok.decode(tok.encode(text, false)), text);
    }
    EXPECT_EQ(stream_decode(tok, ids, false), decoded);
  }
  // The byte-level and SentencePiece-style pipelines are lossless on most of the set (the
  // exceptions are texts with special tokens or an add_prefix_space pipeline); a golden file
  // where nothing round-trips would mean the test lost its teeth.
  EXPECT_GT(n_roundtrip, 0);
}

INSTANTIATE_TEST_SUITE_P(Files, TokenizerGolden, ::testing::ValuesIn(golden_files()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = fs::path(info.param).stem().string();
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

TEST(Tokenizer, GoldenFilesPresent) {
  const auto files = golden_files();
  for (const char* name :
       {"goldens_sp_bpe.json", "goldens_bl_bpe.json", "goldens_sp_meta.json",
        "goldens_bl_qwen2.json", "goldens_bl_gpt2.json", "goldens_bl_splits.json",
        "goldens_wp_bpe.json", "goldens_wp_fused.json"}) {
    EXPECT_TRUE(std::any_of(files.begin(), files.end(), [&](const std::string& f) {
      return f.ends_with(name);
    })) << name;
  }
}

// The runtime's golden prompts (tests/data/golden/golden.json, written on the training machine
// with the transformers tokenizer): prompt ids with <|bos|>, and the greedy continuation's text
// (decoded with special tokens kept), streamed token by token as generation would.
TEST(Tokenizer, ModelGoldenPrompts) {
  const std::string golden_path = data_path("tests/data/golden/golden.json");
  const std::string tok_path = data_path("models/vq-mini-llama/tokenizer.json");
  if (!fs::exists(golden_path) || !fs::exists(tok_path)) GTEST_SKIP() << "no model goldens";
  const json golden = json::parse(read_text(golden_path));
  const vq::Tokenizer tok = vq::Tokenizer::from_file(tok_path);
  ASSERT_GE(golden.at("prompts").size(), 3u);
  for (const json& p : golden.at("prompts")) {
    SCOPED_TRACE(p.at("name").get<std::string>());
    const std::string text = p.at("text").get<std::string>();
    EXPECT_EQ(tok.encode(text, true), to_ids(p.at("ids")));
    const std::vector<int32_t> greedy = to_ids(p.at("greedy_ids"));
    EXPECT_EQ(tok.decode(greedy), p.at("greedy_text").get<std::string>());
    EXPECT_EQ(stream_decode(tok, greedy, false), p.at("greedy_text").get<std::string>());
  }
}

// The evaluation data (data/eval, ids written with the transformers tokenizer): the first 2048
// ids of each held-out document and the token length of every passkey prompt.
TEST(Tokenizer, ModelEvalData) {
  const std::string tok_path = data_path("models/vq-mini-llama/tokenizer.json");
  const std::string heldout = data_path("data/eval/heldout.jsonl");
  const std::string heldout_ids = data_path("data/eval/heldout_ids.u16");
  const std::string passkey = data_path("data/eval/passkey.jsonl");
  if (!fs::exists(tok_path) || !fs::exists(heldout) || !fs::exists(heldout_ids) ||
      !fs::exists(passkey)) {
    GTEST_SKIP() << "no evaluation data";
  }
  const vq::Tokenizer tok = vq::Tokenizer::from_file(tok_path);
  const std::string ids_bytes = read_text(heldout_ids);
  std::istringstream docs(read_text(heldout));
  std::string line;
  size_t row = 0;
  constexpr size_t kRow = 2048;
  while (std::getline(docs, line)) {
    if (line.empty()) continue;
    const json doc = json::parse(line);
    SCOPED_TRACE(doc.at("id").get<std::string>());
    ASSERT_LE((row + 1) * kRow * 2, ids_bytes.size());
    std::vector<int32_t> expected(kRow);
    for (size_t i = 0; i < kRow; ++i) {  // little-endian uint16
      const size_t at = (row * kRow + i) * 2;
      expected[i] = static_cast<unsigned char>(ids_bytes[at]) |
                    (static_cast<unsigned char>(ids_bytes[at + 1]) << 8);
    }
    std::vector<int32_t> ids = tok.encode(doc.at("text").get<std::string>(), true);
    EXPECT_EQ(static_cast<int64_t>(ids.size()), doc.at("n_tokens").get<int64_t>());
    ids.resize(std::min(ids.size(), kRow));
    EXPECT_EQ(ids, expected);
    ++row;
  }
  EXPECT_EQ(row * kRow * 2, ids_bytes.size());
  std::istringstream prompts(read_text(passkey));
  size_t n_prompts = 0;
  while (std::getline(prompts, line)) {
    if (line.empty()) continue;
    const json p = json::parse(line);
    EXPECT_EQ(static_cast<int64_t>(tok.encode(p.at("prompt").get<std::string>(), true).size()),
              p.at("length").get<int64_t>())
        << p.at("id");
    ++n_prompts;
  }
  EXPECT_GE(n_prompts, 150u);
}

// ---------------------------------------------------------------------------------- streaming

vq::Tokenizer load(const char* name) {
  return vq::Tokenizer::from_file(data_path(std::string("tests/data/tokenizers/") + name));
}

TEST(TokenizerStream, EmojiAndCjkTokenByToken) {
  const std::string text = "emoji 😀👍🏽 👨‍👩‍👧 and 中文测试，日本語 ok";
  for (const char* name : {"sp_bpe.json", "bl_bpe.json", "sp_meta.json"}) {
    SCOPED_TRACE(name);
    const vq::Tokenizer tok = load(name);
    const std::vector<int32_t> ids = tok.encode(text, true);
    int held = 0;
    EXPECT_EQ(stream_decode(tok, ids, false, &held), tok.decode(ids));
    EXPECT_EQ(stream_decode(tok, ids, true), tok.decode(ids, true));
    EXPECT_EQ(tok.decode(ids, true), text);
    // These vocabularies (1000 tokens) split the emoji and CJK into byte tokens, so some
    // pushes must have held back an unfinished character.
    EXPECT_GT(held, 0);
  }
}

TEST(TokenizerStream, RandomIdsMatchFullDecode) {
  // Random ids, half of them drawn from the first 300 (the byte tokens of both kinds: <0xNN>
  // and single mapped bytes), so runs of bytes that are incomplete, invalid or complete
  // characters are frequent: the lossy and hold-back paths.
  std::vector<std::string> files;
  for (const char* name :
       {"sp_bpe.json", "bl_bpe.json", "sp_meta.json", "bl_gpt2.json", "wp_bpe.json"}) {
    files.push_back(data_path(std::string("tests/data/tokenizers/") + name));
  }
  const std::string model = data_path("models/vq-mini-llama/tokenizer.json");
  if (fs::exists(model)) files.push_back(model);
  for (const std::string& file : files) {
    SCOPED_TRACE(file);
    const vq::Tokenizer tok = vq::Tokenizer::from_file(file);
    std::mt19937 rng(42);
    std::uniform_int_distribution<int32_t> any_id(0, tok.vocab_size() - 1);
    std::uniform_int_distribution<int32_t> low_id(0, std::min(299, tok.vocab_size() - 1));
    for (int trial = 0; trial < 400; ++trial) {
      std::vector<int32_t> ids(static_cast<size_t>(1 + trial % 50));
      for (int32_t& id : ids) id = (rng() & 1) ? low_id(rng) : any_id(rng);
      for (bool skip : {false, true}) {
        const std::string full = tok.decode(ids, skip);
        EXPECT_TRUE(is_valid_utf8(full));
        EXPECT_EQ(stream_decode(tok, ids, skip), full) << "trial " << trial;
      }
    }
  }
}

// A Strip after a Fuse strips the start of the whole text only. The stream decodes windows of
// ids that start later; with a Strip of 2 or more characters, a window starting at a one-space
// token used to strip the next token's spaces too (fuzz_tokenizer's finding, kept as a seed in
// tools/fuzz/regressions/fuzz_tokenizer/). sp_bpe.json's decoder with start 1 to 3: runs of
// spaces, random ids, both skip modes.
TEST(TokenizerStream, StripAfterFuseMatchesFullDecodeAtAnyWidth) {
  std::ifstream in(data_path("tests/data/tokenizers/sp_bpe.json"));
  json doc = json::parse(in);
  json& strip = doc["decoder"]["decoders"][3];
  ASSERT_EQ(strip["type"], "Strip");
  for (int start : {1, 2, 3}) {
    SCOPED_TRACE("start " + std::to_string(start));
    strip["start"] = start;
    const vq::Tokenizer tok = vq::Tokenizer::from_json(doc.dump());
    const std::string text = "a  b   c    d x\n\n  y 12345   spaces";
    const std::vector<int32_t> ids = tok.encode(text, false);
    EXPECT_EQ(stream_decode(tok, ids, false), tok.decode(ids));
    std::mt19937 rng(7);
    std::uniform_int_distribution<int32_t> any_id(0, tok.vocab_size() - 1);
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<int32_t> r(static_cast<size_t>(1 + trial % 40));
      for (int32_t& id : r) id = any_id(rng);
      for (bool skip : {false, true})
        EXPECT_EQ(stream_decode(tok, r, skip), tok.decode(r, skip)) << "trial " << trial;
    }
  }
}

TEST(TokenizerStream, BadIdChangesNothing) {
  const vq::Tokenizer tok = load("bl_bpe.json");
  const std::vector<int32_t> ids = tok.encode("héllo wörld 😀", false);
  vq::StreamDecoder stream(tok);
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i == 2) {
      EXPECT_THROW(stream.push(tok.vocab_size()), vq::Error);
      EXPECT_THROW(stream.push(-1), vq::Error);
    }
    out += stream.push(ids[i]);
  }
  out += stream.flush();
  EXPECT_EQ(out, "héllo wörld 😀");
}

// ------------------------------------------------------------------------------ API behaviour

TEST(Tokenizer, SpecialTokensAndPostProcessor) {
  const vq::Tokenizer sp = load("sp_bpe.json");
  EXPECT_EQ(sp.prefix_special_ids(), std::vector<int32_t>{1});
  EXPECT_TRUE(sp.suffix_special_ids().empty());
  EXPECT_EQ(sp.token_to_id("<s>"), 1);
  EXPECT_TRUE(sp.is_special(1));
  EXPECT_FALSE(sp.token_to_id("no such token").has_value());
  EXPECT_EQ(sp.id_to_token(*sp.token_to_id("<0x41>")), "<0x41>");
  EXPECT_EQ(sp.encode("", true), std::vector<int32_t>{1});
  EXPECT_TRUE(sp.encode("", false).empty());
  EXPECT_EQ(sp.decode(std::vector<int32_t>{}), "");
  // A special token in the text is one id, as the reference matches them before normalizing.
  const auto ids = sp.encode("a</s>b", false);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 2), ids.end());
  EXPECT_NE(sp.describe().find("byte_fallback"), std::string::npos);
}

TEST(Tokenizer, RejectsBadInputText) {
  const vq::Tokenizer tok = load("bl_bpe.json");
  try {
    tok.encode(std::string("ok \xC3\x28 bad"), false);
    FAIL() << "invalid UTF-8 accepted";
  } catch (const vq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("UTF-8"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("offset 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tok.decode(std::vector<int32_t>{0, tok.vocab_size()}), vq::Error);
  EXPECT_THROW(tok.decode(std::vector<int32_t>{-5}), vq::Error);
  EXPECT_THROW(tok.id_to_token(tok.vocab_size()), vq::Error);
}

TEST(Tokenizer, ConcurrentEncodeIsDeterministic) {
  const vq::Tokenizer tok = load("bl_bpe.json");
  std::string text;
  for (int i = 0; i < 200; ++i) text += "word" + std::to_string(i % 37) + " café 中文 ";
  const auto expected = tok.encode(text, true);
  std::vector<std::vector<int32_t>> results(4);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < results.size(); ++t) {
    threads.emplace_back([&, t] { results[t] = tok.encode(text, true); });
  }
  for (auto& th : threads) th.join();
  for (const auto& r : results) EXPECT_EQ(r, expected);
}

// Metamorphic: with a byte-level tokenizer, encoding text A then text B separately gives the
// same ids as encoding A+B when A ends at a pre-tokenizer boundary (a newline here, which the
// Llama-3 pattern always isolates before a letter).
TEST(Tokenizer, ConcatenationAtBoundary) {
  const vq::Tokenizer tok = load("bl_bpe.json");
  const std::string a = "First line of text, 123 numbers.\n";
  const std::string b = "Second line: café 中文";
  auto ia = tok.encode(a, false), ib = tok.encode(b, false), iab = tok.encode(a + b, false);
  ia.insert(ia.end(), ib.begin(), ib.end());
  EXPECT_EQ(ia, iab);
}

// ------------------------------------------------------------------------ malformed documents

// A minimal valid byte-level document, edited per case.
json minimal_tokenizer() {
  return json::parse(R"({
    "version": "1.0",
    "added_tokens": [{"id": 5, "content": "<s>", "special": true, "normalized": false,
                      "lstrip": false, "rstrip": false, "single_word": false}],
    "normalizer": null,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{L}+|\\p{N}"}, "behavior": "Isolated",
         "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
    "post_processor": {"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [5], "tokens": ["<s>"]}}},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false,
              "byte_fallback": false, "ignore_merges": false,
              "vocab": {"a": 0, "b": 1, "ab": 2, "c": 3, "abc": 4},
              "merges": ["a b", ["ab", "c"]]}
  })");
}

void expect_refused(const json& doc, const std::string& needle) {
  try {
    vq::Tokenizer::from_json(doc.dump());
    ADD_FAILURE() << "accepted a document that should fail with: " << needle;
  } catch (const vq::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << needle;
  }
}

TEST(TokenizerMalformed, MinimalDocumentWorks) {
  const vq::Tokenizer tok = vq::Tokenizer::from_json(minimal_tokenizer().dump());
  EXPECT_EQ(tok.encode("abc", true), (std::vector<int32_t>{5, 4}));
  EXPECT_EQ(tok.encode("ab<s>c", false), (std::vector<int32_t>{2, 5, 3}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{5, 4}, true), "abc");
  EXPECT_EQ(tok.vocab_size(), 6);
}

TEST(TokenizerMalformed, RefusedWithClearErrors) {
  EXPECT_THROW(vq::Tokenizer::from_json("{\"model\": "), vq::Error);
  try {
    vq::Tokenizer::from_json("{not json");
    ADD_FAILURE();
  } catch (const vq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected valid JSON"), std::string::npos) << e.what();
  }
  expect_refused(json::array(), "JSON object at the top level");
  {
    json d = minimal_tokenizer();
    d.erase("model");
    expect_refused(d, "\"model\" field but it is missing");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["type"] = "Unigram";
    expect_refused(d, "unsupported model type 'Unigram'");
  }
  {
    json d = minimal_tokenizer();
    d["model"].erase("vocab");
    expect_refused(d, "\"vocab\" but it is missing");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["vocab"] = json::array();
    expect_refused(d, "model.vocab: expected an object");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["merges"].push_back("a zz");
    expect_refused(d, "merges[2]: expected both tokens in the vocab but 'zz' is not in it");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["merges"].push_back("b a");  // "ba" is not in the vocab
    expect_refused(d, "merged token 'ba'");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["merges"].push_back("a b c");
    expect_refused(d, "merges[2]: expected \"a b\"");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["merges"].push_back(42);
    expect_refused(d, "merges[2]: expected \"a b\" or");
  }
  {
    json d = minimal_tokenizer();
    d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(\\p{L}+";
    expect_refused(d, "expected a valid regex");
  }
  {
    json d = minimal_tokenizer();
    d["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
    expect_refused(d, "behavior: expected Removed");
  }
  {
    json d = minimal_tokenizer();
    d["pre_tokenizer"]["pretokenizers"][1]["type"] = "BertPreTokenizer";
    expect_refused(d, "unsupported type 'BertPreTokenizer'");
  }
  {
    json d = minimal_tokenizer();
    d["normalizer"] = {{"type", "Lowercase"}};
    expect_refused(d, "normalizer: expected");
  }
  {
    json d = minimal_tokenizer();
    d["decoder"] = {{"type", "WordPiece"}};
    expect_refused(d, "unsupported type 'WordPiece'");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["dropout"] = 0.1;
    expect_refused(d, "dropout");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["unk_token"] = "<unk>";
    expect_refused(d, "unk_token: expected a token of the vocab but got '<unk>'");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["vocab"]["z"] = -3;
    expect_refused(d, "model.vocab['z']: expected an id");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["vocab"]["z"] = 1;
    expect_refused(d, "expected unique ids but id 1");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["vocab"]["z"] = 1000000;
    expect_refused(d, "expected dense ids");
  }
  {
    json d = minimal_tokenizer();
    d["added_tokens"][0]["id"] = 3;  // id of "c"
    expect_refused(d, "added_tokens: expected unique ids but id 3");
  }
  {
    json d = minimal_tokenizer();
    d["added_tokens"][0].erase("content");
    expect_refused(d, "added_tokens[0]: expected a \"content\" field");
  }
  {
    json d = minimal_tokenizer();
    d["post_processor"]["special_tokens"] = json::object();
    expect_refused(d, "expected special token '<s>' in special_tokens");
  }
  {
    json d = minimal_tokenizer();
    d["post_processor"]["single"][1]["Sequence"]["id"] = "B";
    expect_refused(d, "expected one $A sequence but got $B");
  }
  {
    json d = minimal_tokenizer();
    d["model"]["fuse_unk"] = "yes";
    expect_refused(d, "fuse_unk: expected true/false");
  }
  {
    // Deeply nested Sequence: refused, not a stack overflow.
    json d = minimal_tokenizer();
    json inner = {{"type", "ByteLevel"}, {"use_regex", false}};
    for (int i = 0; i < 40; ++i)
      inner = {{"type", "Sequence"}, {"pretokenizers", json::array({inner})}};
    d["pre_tokenizer"] = inner;
    expect_refused(d, "nested Sequence levels");
  }
  try {
    vq::Tokenizer::from_file("/nonexistent/tokenizer.json");
    ADD_FAILURE();
  } catch (const vq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/tokenizer.json"), std::string::npos);
  }
}

// NFC normalizer: known answers from the Unicode standard (checked with Python's
// unicodedata.normalize), through a byte-level tokenizer whose decode returns the normalized
// bytes: composition, Hangul jamo composition, a singleton (CJK compatibility ideograph),
// reordering of combining marks by class before composing, a blocked mark, and a leading mark.
TEST(Tokenizer, NfcNormalizer) {
  json d = minimal_tokenizer();
  d["normalizer"] = {{"type", "NFC"}};
  d["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}};
  // Vocabulary: the 256 mapped bytes, no merges.
  json vocab = json::object();
  {
    // GPT-2 byte map, written independently of the library.
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      const int cp = printable ? b : next++;
      std::string utf8;
      if (cp < 0x80) {
        utf8 += static_cast<char>(cp);
      } else {
        utf8 += static_cast<char>(0xC0 | (cp >> 6));
        utf8 += static_cast<char>(0x80 | (cp & 0x3F));
      }
      vocab[utf8] = b;
    }
  }
  d["model"]["vocab"] = vocab;
  d["model"]["merges"] = json::array();
  d["added_tokens"] = json::array();
  d.erase("post_processor");
  const vq::Tokenizer tok = vq::Tokenizer::from_json(d.dump());
  auto nfc = [&](const std::string& s) { return tok.decode(tok.encode(s, false)); };
  EXPECT_EQ(nfc("cafe\u0301"), "caf\u00e9");
  EXPECT_EQ(nfc("\u1100\u1161\u11a8"), "\uac01");   // jamo -> 각
  EXPECT_EQ(nfc("\uf900"), "\u8c48");               // singleton decomposition
  EXPECT_EQ(nfc("a\u0302\u0323"), "\u1ead");        // reorder (220 < 230), then compose
  EXPECT_EQ(nfc("\u00e9\u0301"), "\u00e9\u0301");   // acute after é: no composite
  EXPECT_EQ(nfc("\u0301e"), "\u0301e");             // leading mark stays
  EXPECT_EQ(nfc("e\u0327\u0301"), "\u0229\u0301");  // ȩ then acute
  EXPECT_EQ(nfc("plain ascii"), "plain ascii");
}

// A catastrophic regex from a hostile file fails with vq::Error, it does not hang.
TEST(TokenizerMalformed, CatastrophicRegexIsBounded) {
  json d = minimal_tokenizer();
  d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(a+)+$";
  const vq::Tokenizer tok = vq::Tokenizer::from_json(d.dump());
  EXPECT_THROW(tok.encode(std::string(40, 'a') + "!", false), vq::Error);
}

}  // namespace
