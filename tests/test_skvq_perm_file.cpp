// SKVQ permutation files (load_skvq_perm_file in src/kv/skvq_cache.cpp) with hostile numbers:
// non-integer or out-of-range values for the version, the sizes or a channel index are refused
// with a message naming the field, before any conversion to an integer type (converting 1e20 to
// int is undefined behaviour, which UBSan reported before the fix).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "veloxquant/error.h"
#include "veloxquant/skvq_cache.h"

namespace vq {
namespace {

std::string perm_file(const std::string& version, const std::string& heads,
                      const std::string& head_dim, const std::string& channel) {
  return R"({"format": "veloxquant.skvq_perms", "version": )" + version + R"(, "n_kv_heads": )" +
         heads + R"(, "head_dim": )" + head_dim + R"(, "layers": [{"key": [[)" + channel +
         R"(, 0]], "value": [[0, 1]]}]})";
}

// Writes text to a temporary file and expects load_skvq_perm_file to refuse it naming `needle`.
void expect_refused(const std::string& text, const std::string& needle) {
  const std::string path = ::testing::TempDir() + "skvq_perm_hostile.json";
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(text.c_str(), f);
  std::fclose(f);
  try {
    load_skvq_perm_file(path);
    ADD_FAILURE() << "expected a vq::Error containing '" << needle << "' for " << text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
}

TEST(SkvqPermFile, HostileNumbersAreRefusedByName) {
  // The valid file these are mutations of: one head of two channels, [1, 0] and [0, 1].
  const std::string path = ::testing::TempDir() + "skvq_perm_ok.json";
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(perm_file("1", "1", "2", "1").c_str(), f);
  std::fclose(f);
  const SkvqPermSet ok = load_skvq_perm_file(path);
  EXPECT_EQ(ok.key.at(0), (std::vector<int32_t>{1, 0}));
  std::remove(path.c_str());

  expect_refused(perm_file("1e20", "1", "2", "1"), "version: expected an integer in 1..1 but got");
  expect_refused(perm_file("-1e20", "1", "2", "1"), "version: expected an integer in 1..1");
  expect_refused(perm_file("1.5", "1", "2", "1"), "version: expected an integer in 1..1");
  expect_refused(perm_file("18446744073709551615", "1", "2", "1"), "version: expected");
  expect_refused(perm_file("1", "1e20", "2", "1"), "n_kv_heads: expected an integer in 1..4096");
  expect_refused(perm_file("1", "1", "-1e300", "1"), "head_dim: expected an integer in 1..65536");
  expect_refused(perm_file("1", "1", "2", "1e20"),
                 "layer 0 key channel: expected an integer in 0..1 but got");
  expect_refused(perm_file("1", "1", "2", "4294967297"), "layer 0 key channel: expected");
  expect_refused(perm_file("1", "1", "2", "-2147483649"), "layer 0 key channel: expected");
  expect_refused(perm_file("1", "1", "2", "\"1\""), "layer 0 key channel: expected");
}

}  // namespace
}  // namespace vq
