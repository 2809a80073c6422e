// Parsing JSON text from files (safetensors headers, shard indexes, config.json) with errors that
// say where and why: "not valid JSON: parse error at line 1, column 7: syntax error while parsing
// value - unexpected end of input; expected '[', '{', or a literal (byte 7)".
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

namespace vq::detail {

// Parses [begin, end) as one JSON value; on a syntax error calls fail() with the message above
// (fail must throw). nlohmann's reason is kept without its "[json.exception.parse_error.N] "
// prefix; the byte position is nlohmann's (1-based index of the last byte read).
inline nlohmann::json parse_json_text(const char* begin, const char* end,
                                      const std::function<void(const std::string&)>& fail) {
  try {
    return nlohmann::json::parse(begin, end);
  } catch (const nlohmann::json::parse_error& e) {
    std::string reason = e.what();
    const size_t close = reason.find("] ");
    if (reason.rfind("[json.exception.", 0) == 0 && close != std::string::npos)
      reason = reason.substr(close + 2);
    fail("not valid JSON: " + reason + " (byte " + std::to_string(e.byte) + ")");
  }
  return nullptr;  // not reached: fail throws
}

}  // namespace vq::detail
