// libFuzzer target for the tokenizer.json loader: the input bytes are parsed as a
// tokenizer.json; when they load, a fixed text (ASCII, accents, CJK, emoji, digits, whitespace
// runs, special-looking tokens) is encoded, decoded, and streamed back id by id. The only
// acceptable failure is vq::Error; anything else (crash, sanitizer report, other exception)
// is a bug. Seeds: tests/data/tokenizers/*.json (run with that folder as a corpus directory).
// Build: cmake -DVQ_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ ... (tools/fuzz/CMakeLists.txt).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "veloxquant/error.h"
#include "veloxquant/tokenizer.h"

namespace {

constexpr size_t kMaxInput = 4 << 20;  // larger documents only slow the fuzzer down

const char kText[] =
    "Hello, world! It's 2024-01-31: caf\xC3\xA9 na\xC3\xAFve, e\xCC\x81, "
    "\xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD 12345 "
    "  spaces\t\ttabs\n\nnewlines <s></s><unk><|endoftext|> \xE2\x96\x81x \xC4\xA0y";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > kMaxInput) return 0;
  const std::string_view document(reinterpret_cast<const char*>(data), size);
  try {
    const vq::Tokenizer tok = vq::Tokenizer::from_json(document);
    for (bool special : {false, true}) {
      const std::vector<int32_t> ids = tok.encode(kText, special);
      const std::string text = tok.decode(ids);
      (void)tok.decode(ids, /*skip_special_tokens=*/true);
      vq::StreamDecoder stream(tok);
      std::string streamed;
      for (int32_t id : ids) streamed += stream.push(id);
      streamed += stream.flush();
      if (streamed != text) __builtin_trap();  // streaming must equal the full decode
    }
    (void)tok.describe();
  } catch (const vq::Error&) {
    // Refused with a message: the expected outcome for malformed documents.
  }
  return 0;
}
