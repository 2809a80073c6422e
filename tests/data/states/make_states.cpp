// Writes the state files of tests/data/states (tests/test_state_compat.cpp): for each cache setting
// below, a cache fed a two-chunk prefill and three decode steps is saved to NAME.state, then fed
// two more decode steps and saved to NAME.next.state. The files in the repository were written by
// this program built against commit 76e8f0d (the last main before the row stores), so the test
// shows that states saved by that version load and continue bit for bit:
//   g++ -std=c++20 -O1 -I include tests/data/states/make_states.cpp -L build \
//       -lvq_builder -lvq_quant -lvq_evict -lvq_core -lxxhash -fopenmp -o /tmp/make_states
//   /tmp/make_states tests/data/states
// Inputs are exact in fp16: k = (hash % 256 - 128) / 64.
#include <cstdint>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "veloxquant/builder.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/tensor.h"

namespace {

constexpr int64_t kB = 1, kH = 2, kD = 32;

// Block [1, 2, s, 32] of fp16 values determined by (seed, element index).
vq::Tensor block(int64_t s, uint64_t seed) {
  vq::Tensor t(vq::DType::kF16, kB, kH, s, kD);
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

void feed(vq::KVCache& c, int64_t s, uint64_t seed) {
  const vq::Tensor k = block(s, seed), v = block(s, seed + 1000);
  c.update_and_fetch(k.view(), v.view());
}

struct Setting {
  std::string name;
  vq::CacheConfig cfg;
};

std::vector<Setting> settings() {
  std::vector<Setting> out;
  vq::CacheConfig c;
  c.head_dim = kD;
  c.method = "full";
  out.push_back({"full", c});
  c.method = "streaming";
  c.streaming_n_sink = 2;
  c.streaming_window = 16;
  out.push_back({"streaming", c});
  c.method = "snapkv";
  c.snap_budget = 12;
  c.snap_obs_window = 4;
  c.snap_n_sink = 2;
  out.push_back({"snapkv", c});
  c.snap_evict_at = vq::SnapEvictAt::kPromptEnd;
  out.push_back({"snapkv_prompt_end", c});
  c.snap_evict_at = vq::SnapEvictAt::kPrefillCall;
  c.method = "skvq";
  c.skvq_window = 8;
  c.skvq_n_sink = 2;
  c.skvq_group_size = 16;
  c.skvq_bits_key = 4;
  c.skvq_bits_value = 2;
  out.push_back({"skvq", c});
  c.skvq_rotation = vq::Rotation::kHadamard;
  out.push_back({"skvq_hadamard", c});
  c.skvq_rotation = vq::Rotation::kNone;
  c.method = "snapkv+skvq";
  c.snap_budget = 16;
  out.push_back({"snapkv_skvq", c});
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  for (const Setting& s : settings()) {
    auto cache = vq::make_cache(s.cfg);
    feed(*cache, 24, 1);
    feed(*cache, 17, 2);
    for (uint64_t i = 0; i < 3; ++i) feed(*cache, 1, 10 + i);
    cache->save_file(dir + "/" + s.name + ".state");
    for (uint64_t i = 0; i < 2; ++i) feed(*cache, 1, 20 + i);
    cache->save_file(dir + "/" + s.name + ".next.state");
    std::cout << s.name << ": offset " << cache->offset() << ", rows " << cache->stored_rows()
              << "\n";
  }
  return 0;
}
