// Builds caches from a CacheConfig: one cache, or one per layer of a model (docs/design.md §C6).
#pragma once

#include <memory>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"

namespace vq {

// What the builder needs to know of a model: per layer, its KV heads and head_dim.
struct ModelCacheShape {
  std::vector<int64_t> n_kv_heads;  // [n_layers]
  std::vector<int64_t> head_dim;    // [n_layers]
};

// Validates cfg (vq::Error naming the field) and returns one cache of cfg.method.
std::unique_ptr<KVCache> make_cache(const CacheConfig& cfg);

// One cache per layer, each with the layer's head_dim.
std::vector<std::unique_ptr<KVCache>> build_caches(const ModelCacheShape& shape,
                                                   const CacheConfig& cfg);

}  // namespace vq
