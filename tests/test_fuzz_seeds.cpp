// The committed seed corpus of the state-file fuzz target (tools/fuzz/corpus/fuzz_cache_state/):
// every seed is a valid state of its cache settings (tools/fuzz/state_configs.h), so the fuzzer
// starts from states that parse, for every method. Run with VQ_WRITE_FUZZ_SEEDS=1 to rewrite
// them (after a state format change): each settings entry gets a fresh state, a state after a
// 20-token prefill and two decode steps (batch 1, 2 heads), and one of a 2-sequence batch.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "../tools/fuzz/state_configs.h"
#include "util/test_util.h"
#include "veloxquant/builder.h"
#include "veloxquant/error.h"

namespace vq {
namespace {

namespace fs = std::filesystem;

std::string seed_dir() {
  return test::source_path("tools/fuzz/corpus/fuzz_cache_state");
}

std::string file_stem(size_t index, const CacheConfig& cfg, const char* what) {
  std::string m = cfg.method;
  for (char& c : m)
    if (c == '+') c = '_';
  return std::to_string(index) + "_" + m + "_" + what;
}

void write_seed(const std::string& name, size_t index, const KVCache& c) {
  std::ostringstream out;
  out.put(static_cast<char>(index));
  c.save(out);
  std::ofstream(seed_dir() + "/" + name + ".state", std::ios::binary) << out.str();
}

void write_seeds() {
  fs::create_directories(seed_dir());
  const auto& configs = fuzz::state_configs();
  for (size_t i = 0; i < configs.size(); ++i) {
    const CacheConfig& cfg = configs[i];
    auto fresh = make_cache(cfg);
    write_seed(file_stem(i, cfg, "fresh"), i, *fresh);

    auto one = make_cache(cfg);
    const Tensor k = test::random_tensor(DType::kF16, 1, 2, 20, cfg.head_dim, 100 + i);
    const Tensor v = test::random_tensor(DType::kF16, 1, 2, 20, cfg.head_dim, 200 + i);
    one->update_and_fetch(k.view(), v.view());
    if (cfg.snap_evict_at == SnapEvictAt::kPromptEnd)  // a pending eviction in the file
      write_seed(file_stem(i, cfg, "pending"), i, *one);
    if (cfg.skvq_protect > 0.0) one->end_prompt();  // the protected rows in the file
    for (int step = 0; step < 2; ++step) {
      const Tensor k1 = test::random_tensor(DType::kF16, 1, 2, 1, cfg.head_dim, 300 + step);
      const Tensor v1 = test::random_tensor(DType::kF16, 1, 2, 1, cfg.head_dim, 400 + step);
      one->update_and_fetch(k1.view(), v1.view());
    }
    write_seed(file_stem(i, cfg, "decoded"), i, *one);

    auto two = make_cache(cfg);
    const Tensor k2 = test::random_tensor(DType::kF16, 2, 1, 11, cfg.head_dim, 500 + i);
    const Tensor v2 = test::random_tensor(DType::kF16, 2, 1, 11, cfg.head_dim, 600 + i);
    two->update_and_fetch(k2.view(), v2.view());
    if (cfg.skvq_protect > 0.0) two->end_prompt();  // a state is saved after the selection
    write_seed(file_stem(i, cfg, "batch2"), i, *two);
  }
}

TEST(FuzzSeeds, EveryStateSeedLoadsIntoItsCache) {
  if (std::getenv("VQ_WRITE_FUZZ_SEEDS")) write_seeds();
  const auto& configs = fuzz::state_configs();
  std::vector<bool> method_seen(configs.size(), false);
  size_t n = 0;
  for (const auto& entry : fs::directory_iterator(seed_dir())) {
    std::ifstream in(entry.path(), std::ios::binary);
    const int sel = in.get();
    ASSERT_GE(sel, 0) << entry.path();
    ASSERT_LT(static_cast<size_t>(sel), configs.size()) << entry.path();
    auto c = make_cache(configs[static_cast<size_t>(sel)]);
    EXPECT_NO_THROW(c->load(in)) << entry.path();
    method_seen[static_cast<size_t>(sel)] = true;
    ++n;
  }
  EXPECT_EQ(n, 3 * configs.size() + 3) << "fresh + decoded + batch2 each, pending for 3 settings";
  for (size_t i = 0; i < configs.size(); ++i)
    EXPECT_TRUE(method_seen[i]) << "no seed for settings " << i << " (" << configs[i].method << ")";
}

// Inputs the state fuzzer found (tools/fuzz/regressions/fuzz_cache_state/), given a valid
// checksum here (the fuzz build skips it): each is refused with a vq::Error, quickly.
// snapkv_no_sel_huge_batch.state: batch and heads near 2^24 with no selected rows; the position
// check looped 2^48 times over empty heads (libFuzzer timeout; fixed in src/kv/snapkv_cache.cpp).
TEST(FuzzSeeds, StateFuzzerFindingsAreRefused) {
  const auto& configs = fuzz::state_configs();
  size_t n = 0;
  for (const auto& entry :
       fs::directory_iterator(test::source_path("tools/fuzz/regressions/fuzz_cache_state"))) {
    std::ifstream in(entry.path(), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_GT(bytes.size(), 9u) << entry.path();
    std::string frame = bytes.substr(1);
    const uint64_t sum = XXH64(frame.data(), frame.size() - 8, 0);
    for (size_t i = 0; i < 8; ++i)
      frame[frame.size() - 8 + i] = static_cast<char>((sum >> (8 * i)) & 0xff);
    auto c = make_cache(configs[static_cast<uint8_t>(bytes[0]) % configs.size()]);
    std::istringstream fin(frame);
    EXPECT_THROW(c->load(fin), Error) << entry.path();
    EXPECT_EQ(c->offset(), 0) << entry.path();
    ++n;
  }
  EXPECT_GE(n, 1u);
}

}  // namespace
}  // namespace vq
