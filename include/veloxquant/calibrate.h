// Offline SKVQ calibration: channel permutations computed from a calibration text instead of
// from each sequence's first chunk (the SKVQ paper's offline reorder, done per model and layer),
// and the query second moments that weight the error-feedback rounding of channel-axis keys.
//
// The text runs through the model with full-precision caches; for each layer, the keys and the
// values of every calibration token [1, H_kv, n, D] give one stable ascending channel-range
// permutation per head (skvq_channel_perms). The result is saved with save_skvq_perm_file and
// used through the config field skvq_perm_file.
#pragma once

#include <cstdint>
#include <vector>

#include "veloxquant/model.h"
#include "veloxquant/query_moments.h"
#include "veloxquant/skvq_cache.h"

namespace vq {

// tokens: the calibration ids (>= 1). prefill_step: chunk size of the prefill.
SkvqPermSet calibrate_skvq_perms(const Model& model, const std::vector<int32_t>& tokens,
                                 int64_t prefill_step = 512);

// The query second moments of every layer and KV head (veloxquant/query_moments.h) over the
// calibration ids: the queries (after RoPE, fp32) the model hands its caches during a chunked
// full-precision prefill, summed in fp64 in token order, then divided by tokens x group size.
// Same id limits as calibrate_skvq_perms. Saved with save_query_moment_file and used through
// skvq_query_moments_file.
QueryMomentSet calibrate_query_moments(const Model& model, const std::vector<int32_t>& tokens,
                                       int64_t prefill_step = 512);

}  // namespace vq
