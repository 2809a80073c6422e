// libFuzzer target for cache settings text, through the public parsers of
// veloxquant/cache_config.h: the first input byte picks the parser (even: a compact spec such as
// "snapkv:budget=256:obs_window=16", config_from_spec; odd: a JSON object, config_from_json), the
// rest is the text. An accepted config must pass validate() and survive the JSON round trip
// (config_to_json then config_from_json gives the same JSON). The only acceptable failure is
// vq::Error. Seeds: tools/fuzz/corpus/fuzz_cache_spec/.
#include <cstddef>
#include <cstdint>
#include <string>

#include "veloxquant/cache_config.h"
#include "veloxquant/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > (1u << 16)) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  vq::CacheConfig cfg;
  try {
    cfg = data[0] % 2 == 0 ? vq::config_from_spec(text) : vq::config_from_json(text);
  } catch (const vq::Error&) {
    return 0;  // refused with a message
  }
  try {
    vq::validate(cfg);
    const std::string j = vq::config_to_json(cfg);
    if (vq::config_to_json(vq::config_from_json(j)) != j) __builtin_trap();
  } catch (const vq::Error&) {
    __builtin_trap();  // an accepted config must validate and round-trip
  }
  return 0;
}
