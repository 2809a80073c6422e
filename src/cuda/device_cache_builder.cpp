// make_device_cache: validates a CacheConfig like the CPU builder (cache_config.h validate, with
// the layer's head_dim) and builds the GPU-resident cache of its method for one model layer.
#include <string>

#include "cuda/device_cache_util.h"
#include "veloxquant/error.h"

namespace vq::cuda {

std::unique_ptr<DeviceKVCache> make_device_cache(const CacheConfig& cfg_in, int64_t batch,
                                                 int64_t heads, int64_t head_dim, Stream s,
                                                 int64_t layer) {
  VQ_CHECK(batch >= 1 && heads >= 1 && head_dim >= 1,
           "[make_device_cache] expected batch, heads, head_dim >= 1 but got " +
               std::to_string(batch) + ", " + std::to_string(heads) + ", " +
               std::to_string(head_dim));
  VQ_CHECK(layer >= 0, "[make_device_cache] layer: expected >= 0 but got " + std::to_string(layer));
  CacheConfig cfg = cfg_in;
  cfg.head_dim = head_dim;
  validate(cfg);  // names the first bad field, its value and the allowed range
  // Per-layer precision (skvq_layer_bits_key / _key_rows / _bits_value): the SKVQ policies take
  // the layer's entries (src/kv/skvq_store.cpp Settings::from_config), as on the CPU.
  if (cfg.method == "full") return make_device_full_cache(cfg, batch, heads, head_dim, s);
  if (cfg.method == "snapkv") return make_device_snapkv_cache(cfg, batch, heads, head_dim, s);
  if (cfg.method == "skvq") return make_device_skvq_cache(cfg, batch, heads, head_dim, s, layer);
  if (cfg.method == "snapkv+skvq")
    return make_device_snapkv_skvq_cache(cfg, batch, heads, head_dim, s, layer);
  if (cfg.method == "streaming") return make_device_streaming_cache(cfg, batch, heads, head_dim, s);
  throw Error(
      "[make_device_cache] method: expected one of full, snapkv, skvq, snapkv+skvq, streaming "
      "(on the device) but got '" +
      cfg.method + "'");
}

}  // namespace vq::cuda
