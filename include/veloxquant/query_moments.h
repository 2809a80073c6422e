// Query second moments per layer and KV head: what `veloxquant calibrate --query-moments`
// measures and the cache option skvq_query_moments_file reads (veloxquant/key_rounding.h).
//
// For layer l and KV head h: M = mean over the calibration tokens t and the query heads j of the
// head's group of q_{t,j} q_{t,j}^T (queries after RoPE, fp64 sums, D x D, the model's channel
// order). The file, little-endian: "VQQMOMNT" | u32 version 1 | i64 layers | i64 KV heads |
// i64 head_dim | i64 calibration tokens | layers * heads * D * D f64 (row-major M per layer, then
// head) | u64 xxHash64 (seed 0) of every byte before it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vq {

struct QueryMomentSet {
  int64_t n_kv_heads = 0, head_dim = 0, n_tokens = 0;
  std::vector<std::vector<double>> layers;  // [layers][heads * D * D]
};

// Throws vq::Error "[query_moments_file] ..." on an inconsistent set (sizes, a non-finite or
// asymmetric matrix, a diagonal entry <= 0) or an unwritable path; nothing is written then.
void save_query_moment_file(const std::string& path, const QueryMomentSet& set);
// Throws vq::Error "[query_moments_file] ..." naming what is wrong with a missing, truncated,
// corrupt or inconsistent file.
QueryMomentSet load_query_moment_file(const std::string& path);

}  // namespace vq
