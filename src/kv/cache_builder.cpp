// Config -> caches (docs/design.md §C6): make_cache builds one cache of cfg.method after validating
// cfg; build_caches builds one per layer of a model, each with its layer's head_dim.
//
// Dispatch is a plain if-chain: a method that joins the library adds one line here. Methods the
// config knows but this build does not construct yet are refused with a clear error.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "veloxquant/builder.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/skvq_cache.h"
#include "veloxquant/snapkv_cache.h"
#include "veloxquant/snapkv_skvq_cache.h"
#include "veloxquant/streaming_cache.h"

namespace vq {

std::unique_ptr<KVCache> make_cache(const CacheConfig& cfg) {
  validate(cfg);
  const std::string& m = cfg.method;
  if (m == "full") return make_full_cache(cfg);
  if (m == "snapkv") return make_snapkv_cache(cfg);
  if (m == "skvq") return make_skvq_cache(cfg);
  if (m == "snapkv+skvq") return make_snapkv_skvq_cache(cfg);
  if (m == "streaming") return make_streaming_cache(cfg);
  throw Error("[make_cache] method '" + m + "' is not available in this build");
}

std::unique_ptr<KVCache> make_layer_cache(const CacheConfig& cfg, int64_t layer) {
  VQ_CHECK(layer >= 0, "[make_layer_cache] layer: expected >= 0 but got " + std::to_string(layer));
  // SKVQ caches learn their layer: which entry of the per-layer lists and of a calibrated
  // permutation file applies.
  if (cfg.method == "skvq") return make_skvq_cache(cfg, layer);
  if (cfg.method == "snapkv+skvq") return make_snapkv_skvq_cache(cfg, layer);
  return make_cache(cfg);
}

void check_layer_lists(const CacheConfig& cfg, int64_t n_layers, const char* op) {
  for (const auto& [name, list] :
       {std::pair<const char*, const std::string*>{"skvq_layer_bits_key", &cfg.skvq_layer_bits_key},
        {"skvq_layer_key_rows", &cfg.skvq_layer_key_rows},
        {"skvq_layer_bits_value", &cfg.skvq_layer_bits_value}}) {
    const int64_t n = skvq_layer_list_size(*list);
    VQ_CHECK(n == 0 || n == n_layers,
             std::string("[") + op + "] " + name + ": expected " + std::to_string(n_layers) +
                 " entries (one per layer) but got " + std::to_string(n) + " ('" + *list + "')");
  }
}

std::vector<std::unique_ptr<KVCache>> build_caches(const ModelCacheShape& shape,
                                                   const CacheConfig& cfg) {
  VQ_CHECK(shape.n_kv_heads.size() == shape.head_dim.size(),
           "[build_caches] expected n_kv_heads and head_dim of one entry per layer but got " +
               std::to_string(shape.n_kv_heads.size()) + " and " +
               std::to_string(shape.head_dim.size()));
  VQ_CHECK(!shape.head_dim.empty(), "[build_caches] expected at least one layer but got 0");
  check_layer_lists(cfg, static_cast<int64_t>(shape.head_dim.size()), "build_caches");
  // Check every layer before building any cache, so a bad layer late in the list costs nothing.
  for (size_t i = 0; i < shape.head_dim.size(); ++i) {
    VQ_CHECK(shape.n_kv_heads[i] >= 1, "[build_caches] layer " + std::to_string(i) +
                                           ": expected n_kv_heads >= 1 but got " +
                                           std::to_string(shape.n_kv_heads[i]));
    VQ_CHECK(shape.head_dim[i] >= 1, "[build_caches] layer " + std::to_string(i) +
                                         ": expected head_dim >= 1 but got " +
                                         std::to_string(shape.head_dim[i]));
    CacheConfig layer = cfg;
    layer.head_dim = shape.head_dim[i];
    validate(layer);
  }
  std::vector<std::unique_ptr<KVCache>> caches;
  caches.reserve(shape.head_dim.size());
  for (size_t i = 0; i < shape.head_dim.size(); ++i) {
    CacheConfig layer = cfg;
    layer.head_dim = shape.head_dim[i];
    caches.push_back(make_layer_cache(layer, static_cast<int64_t>(i)));
  }
  return caches;
}

}  // namespace vq
