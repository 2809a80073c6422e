// libFuzzer target for cache state files (KVCache::load of every CPU cache method): the first
// input byte picks the cache settings (tools/fuzz/state_configs.h), the rest is the state frame.
// The fuzz build defines VQ_FUZZ_SKIP_CHECKSUM (tools/fuzz/CMakeLists.txt), so a mutated frame
// reaches the payload parser instead of stopping at the checksum.
// Checked: a refused load is a vq::Error and leaves the cache as it was (fresh); an accepted
// state saves, loads into a fresh cache and saves again to the same bytes, and takes one more
// decode step (when small) with a consistent view. Anything else traps.
// Seeds: tools/fuzz/corpus/fuzz_cache_state/ (written by make_state_seeds, one per method).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>

#include "state_configs.h"
#include "veloxquant/builder.h"
#include "veloxquant/error.h"
#include "veloxquant/tensor.h"

namespace {

std::string save_bytes(const vq::KVCache& c) {
  std::ostringstream out;
  c.save(out);
  return out.str();
}

// One decode step on a loaded cache: the view must hold every stored row plus the new one.
void decode_step(vq::KVCache& c, int64_t head_dim) {
  const int64_t b = c.batch(), h = c.n_kv_heads();
  if (b <= 0 || h <= 0 || b * h > 64 || c.stored_rows() > 4096) return;
  vq::Tensor k(vq::DType::kF16, b, h, 1, head_dim), v(vq::DType::kF16, b, h, 1, head_dim);
  for (int64_t d = 0; d < head_dim; ++d) {
    k.set(0, 0, 0, d, static_cast<float>(d) * 0.25f - 1.0f);
    v.set(0, 0, 0, d, 1.0f - static_cast<float>(d) * 0.125f);
  }
  try {
    const int64_t before = c.offset();
    const vq::CacheView view = c.update_and_fetch(k.view(), v.view());
    if (c.offset() != before + 1) __builtin_trap();
    if (view.batch != b || view.n_kv_heads != h || view.head_dim != head_dim) __builtin_trap();
    (void)c.stats();
    (void)c.make_mask(1);
  } catch (const vq::Error&) {
    // Refused with a message (another dtype than the stored rows, a full budget ...): fine.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > (1u << 20)) return 0;
  const auto& configs = vq::fuzz::state_configs();
  const vq::CacheConfig& cfg = configs[data[0] % configs.size()];
  const std::string frame(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::unique_ptr<vq::KVCache> cache = vq::make_cache(cfg);
  const std::string fresh = save_bytes(*cache);
  try {
    std::istringstream in(frame);
    cache->load(in);
  } catch (const vq::Error&) {
    // Refused: the cache must be untouched.
    if (cache->offset() != 0 || cache->stored_rows() != 0 || save_bytes(*cache) != fresh)
      __builtin_trap();
    return 0;
  }
  const std::string saved = save_bytes(*cache);
  std::unique_ptr<vq::KVCache> again = vq::make_cache(cfg);
  try {
    std::istringstream in(saved);
    again->load(in);
  } catch (const vq::Error&) {
    __builtin_trap();  // a cache must load what it saved
  }
  if (save_bytes(*again) != saved || again->offset() != cache->offset() ||
      again->stored_rows() != cache->stored_rows())
    __builtin_trap();
  decode_step(*cache, cfg.head_dim);
  return 0;
}
