// libFuzzer target for the values of the CLI's cache and method options, through the library
// functions the CLI hands them to (tools/cli parses numbers with CLI11 and keeps its own helpers
// file-local, so those are not reachable from here):
//   - "--cache METHOD --cache-opt key=value ...": set_field on a config of each method, then
//     validate (veloxquant/cache_config.h);
//   - "eval --methods LIST": parse_eval_methods, then config_for_context with a fuzzed context
//     length (veloxquant/eval.h).
// Input: line 1 is the --methods list, line 2 the context length (decimal), every further line
// one --cache-opt assignment. An accepted value must leave a config that validates and
// round-trips through JSON. The only acceptable failure is vq::Error.
// Seeds: tools/fuzz/corpus/fuzz_cli_options/.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "veloxquant/cache_config.h"
#include "veloxquant/error.h"
#include "veloxquant/eval.h"

namespace {

void check_config(const vq::CacheConfig& cfg) {
  try {
    vq::validate(cfg);
  } catch (const vq::Error&) {
    __builtin_trap();
  }
  // The JSON reader applies the rules of settings a user writes (check_cache_config); a config
  // the library builds itself (eval's placeholder budget before the context is known) may be
  // refused there, with a message, and then has no JSON round trip to check.
  try {
    vq::check_cache_config(cfg);
  } catch (const vq::Error&) {
    return;
  }
  try {
    const std::string j = vq::config_to_json(cfg);
    if (vq::config_to_json(vq::config_from_json(j)) != j) __builtin_trap();
  } catch (const vq::Error&) {
    __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Short inputs: unknown keys are answered with close names (an edit distance per field).
  if (size > 4096) return 0;
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  std::string methods, context;
  std::getline(in, methods);
  std::getline(in, context);
  std::vector<std::string> opts;
  for (std::string line; std::getline(in, line) && opts.size() < 64;) opts.push_back(line);

  try {
    const std::vector<vq::EvalMethod> ms = vq::parse_eval_methods(methods);
    const long long n = std::strtoll(context.c_str(), nullptr, 10);
    for (const auto& m : ms) {
      check_config(m.cfg);
      try {
        check_config(vq::config_for_context(m, n));
      } catch (const vq::Error&) {
        // A context the method refuses (n < 1): fine.
      }
    }
  } catch (const vq::Error&) {
    // Refused with a message.
  }

  for (const std::string& method : vq::cache_methods()) {
    vq::CacheConfig cfg;
    cfg.method = method;
    for (const std::string& o : opts) {
      const size_t eq = o.find('=');
      if (eq == std::string::npos) continue;
      const vq::CacheConfig before = cfg;
      try {
        vq::set_field(cfg, o.substr(0, eq), o.substr(eq + 1));
      } catch (const vq::Error&) {
        // A refused value leaves the config untouched.
        if (vq::config_to_json(cfg) != vq::config_to_json(before)) __builtin_trap();
      }
    }
    try {
      vq::validate(cfg);
    } catch (const vq::Error&) {
      continue;  // out-of-range settings are refused at build time
    }
    check_config(cfg);
  }
  return 0;
}
