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

// The cache of model layer `layer` (>= 0): what build_caches makes for that layer. The SKVQ
// methods take the layer's entries of skvq_layer_bits_key / skvq_layer_key_rows /
// skvq_layer_bits_value (skvq_key_bits_of / skvq_key_rows_of / skvq_value_bits_of; a list without
// an entry for the layer is refused, naming the list) and of skvq_perm_file; the other methods are
// make_cache's. Validates cfg; the lists' length against the model's layers is the caller's check
// (check_layer_lists).
std::unique_ptr<KVCache> make_layer_cache(const CacheConfig& cfg, int64_t layer);

// Refuses (vq::Error "[op] name: expected n_layers entries (one per layer) but got ...") a
// per-layer SKVQ list of cfg with neither 0 nor n_layers entries: a longer list is a spec for
// another model, a shorter one leaves layers without an entry.
void check_layer_lists(const CacheConfig& cfg, int64_t n_layers, const char* op);

// One cache per layer, each with the layer's head_dim (make_layer_cache of each layer).
std::vector<std::unique_ptr<KVCache>> build_caches(const ModelCacheShape& shape,
                                                   const CacheConfig& cfg);

}  // namespace vq
