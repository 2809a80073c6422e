// States saved by an earlier version still load (docs/design.md §C1): tests/data/states holds
// files written by tests/data/states/make_states.cpp built against commit 76e8f0d, the last main
// whose caches were per-device classes. Each NAME.state must load into a cache of the same
// setting, save back to the same bytes, and continue bit for bit: fed the two decode steps the
// old version was fed after saving, it must save exactly NAME.next.state.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "veloxquant/builder.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/tensor.h"

namespace vq {
namespace {

constexpr int64_t kB = 1, kH = 2, kD = 32;

// The generator's inputs (make_states.cpp): [1, 2, s, 32] fp16 values from (seed, index).
Tensor block(int64_t s, uint64_t seed) {
  Tensor t(DType::kF16, kB, kH, s, kD);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t h = 0; h < kH; ++h)
    for (int64_t i = 0; i < s; ++i)
      for (int64_t d = 0; d < kD; ++d) {
        x ^= x >> 33;
        x *= 0xFF51AFD7ED558CCDull;
        x ^= x >> 29;
        t.set(0, h, i, d, static_cast<float>(static_cast<int64_t>(x % 256) - 128) / 64.0f);
      }
  return t;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string state_of(const KVCache& c) {
  std::ostringstream out;
  c.save(out);
  return out.str();
}

CacheConfig setting(const std::string& name) {
  CacheConfig c;
  c.head_dim = kD;
  c.method = "full";
  if (name == "full") return c;
  c.method = "streaming";
  c.streaming_n_sink = 2;
  c.streaming_window = 16;
  if (name == "streaming") return c;
  c.method = "snapkv";
  c.snap_budget = 12;
  c.snap_obs_window = 4;
  c.snap_n_sink = 2;
  if (name == "snapkv") return c;
  c.snap_evict_at = SnapEvictAt::kPromptEnd;
  if (name == "snapkv_prompt_end") return c;
  c.snap_evict_at = SnapEvictAt::kPrefillCall;
  c.method = "skvq";
  c.skvq_window = 8;
  c.skvq_n_sink = 2;
  c.skvq_group_size = 16;
  c.skvq_bits_key = 4;
  c.skvq_bits_value = 2;
  if (name == "skvq") return c;
  c.skvq_rotation = Rotation::kHadamard;
  if (name == "skvq_hadamard") return c;
  c.skvq_rotation = Rotation::kNone;
  c.method = "snapkv+skvq";
  c.snap_budget = 16;
  return c;
}

class StateCompat : public ::testing::TestWithParam<std::string> {};

TEST_P(StateCompat, OldStateLoadsSavesAndContinuesBitForBit) {
  const std::string dir = std::string(VQ_SOURCE_DIR) + "/tests/data/states/";
  const std::string saved = read_bytes(dir + GetParam() + ".state");
  const std::string next = read_bytes(dir + GetParam() + ".next.state");
  ASSERT_FALSE(saved.empty());
  auto cache = make_cache(setting(GetParam()));
  std::istringstream in(saved);
  cache->load(in);
  EXPECT_EQ(cache->offset(), 24 + 17 + 3);
  EXPECT_EQ(state_of(*cache), saved) << "load -> save changed the bytes";
  for (uint64_t i = 0; i < 2; ++i) {
    const Tensor k = block(1, 20 + i), v = block(1, 1020 + i);
    cache->update_and_fetch(k.view(), v.view());
  }
  EXPECT_EQ(state_of(*cache), next) << "the continuation differs from the old version's";
}

INSTANTIATE_TEST_SUITE_P(Files, StateCompat,
                         ::testing::Values("full", "streaming", "snapkv", "snapkv_prompt_end",
                                           "skvq", "skvq_hadamard", "snapkv_skvq"));

}  // namespace
}  // namespace vq
