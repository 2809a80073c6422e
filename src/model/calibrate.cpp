// calibrate_skvq_perms (see veloxquant/calibrate.h): full-precision prefill of the calibration
// ids, then one permutation set per layer from the stored keys and values.
#include "veloxquant/calibrate.h"

#include <string>

#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/generate.h"

namespace vq {

SkvqPermSet calibrate_skvq_perms(const Model& model, const std::vector<int32_t>& tokens,
                                 int64_t prefill_step) {
  VQ_CHECK(!tokens.empty(),
           "[calibrate_skvq_perms] expected at least 1 calibration token but got 0");
  const ModelConfig& mc = model.config();
  VQ_CHECK(static_cast<int64_t>(tokens.size()) <= mc.max_position_embeddings ||
               mc.max_position_embeddings <= 0,
           "[calibrate_skvq_perms] expected at most " + std::to_string(mc.max_position_embeddings) +
               " tokens (the model's context) but got " + std::to_string(tokens.size()));
  CacheConfig full;
  full.method = "full";
  const auto caches = model.make_caches(full);
  // fp32 keys and values: the permutation is computed from the model's own values, not from
  // their fp16 rounding.
  prefill(model, tokens.data(), static_cast<int64_t>(tokens.size()), caches, prefill_step,
          DType::kF32, nullptr);
  SkvqPermSet set;
  set.n_kv_heads = mc.n_kv_heads;
  set.head_dim = mc.head_dim;
  for (const auto& c : caches) {
    const auto* fc = dynamic_cast<const FullCache*>(c.get());
    VQ_CHECK(fc != nullptr, "[calibrate_skvq_perms] expected full caches from the builder");
    set.key.push_back(skvq_channel_perms(fc->keys()));
    set.value.push_back(skvq_channel_perms(fc->values()));
  }
  return set;
}

}  // namespace vq
