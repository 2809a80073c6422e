// Parsing JSON text from files (safetensors headers, shard indexes, config.json) with errors that
// say where and why: "not valid JSON: parse error at line 1, column 7: syntax error while parsing
// value - unexpected end of input; expected '[', '{', or a literal (byte 7)".
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

namespace vq::detail {

// nlohmann's message without its "[json.exception.parse_error.N] " prefix.
inline std::string json_reason(const nlohmann::json::exception& e) {
  std::string reason = e.what();
  const size_t close = reason.find("] ");
  if (reason.rfind("[json.exception.", 0) == 0 && close != std::string::npos)
    reason = reason.substr(close + 2);
  return reason;
}

// Parses [begin, end) as one JSON value; on an error calls fail() with the message above (fail
// must throw). A syntax error gives nlohmann's byte position (1-based index of the last byte
// read); a number too large for a double ("1e999": out_of_range.406) gives its reason only.
inline nlohmann::json parse_json_text(const char* begin, const char* end,
                                      const std::function<void(const std::string&)>& fail) {
  try {
    return nlohmann::json::parse(begin, end);
  } catch (const nlohmann::json::parse_error& e) {
    fail("not valid JSON: " + json_reason(e) + " (byte " + std::to_string(e.byte) + ")");
  } catch (const nlohmann::json::exception& e) {
    fail("not valid JSON: " + json_reason(e));
  }
  return nullptr;  // not reached: fail throws
}

}  // namespace vq::detail
