// The prefill schedule: how a prompt is cut into forward calls. One rule for every caller
// (generate, the evaluation engine, bench/bench_e2e.cpp), so a SnapKV cache that evicts after
// every prefill call runs the same protocol on the same prompt whoever feeds it.
//
// Rule: chunks of exactly `step` tokens while more than `step` remain, then the remainder
// (n = 20, step = 8: 8 + 8 + 4). It is the schedule mlx_lm's generate_step used before v0.27
// and the one the evaluation engine always used, so the figures in docs/results/ stay valid.
// The last chunk may be short: an eviction that scores with the observation window's queries
// sees fewer than a window of them there when the remainder is smaller than the window.
#pragma once

#include <cstdint>
#include <vector>

namespace vq {

// Chunk lengths for a prompt of n >= 0 tokens at a step of `step` >= 1 tokens; sums to n, every
// chunk but the last is exactly `step` long, the last is in [1, step]. n = 0 gives no chunk.
// Errors: vq::Error naming the value (step < 1, n < 0).
std::vector<int64_t> prefill_chunks(int64_t n, int64_t step);

}  // namespace vq
