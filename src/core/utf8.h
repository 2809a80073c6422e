// UTF-8 well-formedness (Unicode's table 3-7, RFC 3629: no overlong forms, no surrogates, nothing
// past U+10FFFF), shared by the tokenizer's text handling (src/text/utf8.cpp) and the cache
// config, whose text settings are written as JSON (src/core/cache_config.cpp).
#pragma once

#include <cstddef>
#include <string_view>

namespace vq::utf8 {

// Scans one sequence at s[i] (s[i] >= 0x80). Returns the number of bytes that form a valid
// character (> 0), or -k for an invalid maximal subpart of k bytes, or 0 when the bytes run out
// before the sequence is complete (all present bytes valid so far).
int scan_sequence(std::string_view s, size_t i);

// The length of the valid UTF-8 prefix of s (s.size() when all of s is valid).
size_t valid_prefix(std::string_view s);

}  // namespace vq::utf8
