// External scores for the GPU-resident caches (scoring=external, veloxquant/reconstruct.h): the
// device cache's policy (src/cuda/device_cache_policy.cpp) takes host scores through its CPU
// interface (KVCache::takes_external_scores / set_external_scores), and its selection at
// end_prompt() runs on the host over them, as on the CPU. Private to the CUDA engine.
#pragma once

#include <cstdint>

#include "veloxquant/cuda_cache.h"

namespace vq::cuda {

// Whether the cache's policy selects by external scores (snapkv or snapkv+skvq with
// snap_scoring = external, skvq with skvq_protect_scoring = external).
bool takes_external_scores(const DeviceKVCache& cache);
// scores: host [batch, heads, rows] fp32 contiguous; the policy's own checks and messages.
void set_external_scores(DeviceKVCache& cache, const float* scores, int64_t batch, int64_t heads,
                         int64_t rows);

}  // namespace vq::cuda
