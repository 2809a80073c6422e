// Errors raised by the library. Every public entry point validates its input and throws
// vq::Error with a message of the form "[op] expected X but got Y". The library never exits.
#pragma once

#include <stdexcept>
#include <string>

namespace vq {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Always-on check for cheap, critical invariants and input validation.
// VQ_CHECK(cond, "[op] expected ... but got " + ...);
#define VQ_CHECK(cond, msg)                           \
  do {                                                \
    if (!(cond)) throw ::vq::Error(std::string(msg)); \
  } while (0)

}  // namespace vq
