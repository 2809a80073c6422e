// The bound on the logits of the sharded forward pass (veloxquant/tensor_parallel.h) against
// Model::forward on one device, shared by tests/test_tensor_parallel.cpp (the pass itself) and
// tests/test_eval_tensor_parallel.cpp (the evaluation engine's figures on N ranks).
#pragma once

#include <algorithm>
#include <cstdint>

#include "veloxquant/model.h"

namespace vq::test {

constexpr double kFp32Roundoff = 1.0 / 16777216.0;  // 2^-24, the fp32 unit roundoff u

// The bound: the only arithmetic that changes is the o_proj and down_proj sums (q/k/v, gate/up,
// attention, norms and lm_head compute each output from the same terms in the same order on the
// rank that holds it). Single device: fp32 sum of K terms; sharded: fp32 sums of K / N terms per
// rank, then N - 1 fp32 additions in rank order. Each is within gamma(n) ~ n u of the exact sum
// times the sum of the terms' magnitudes, so the two differ by at most
// (K + K / N + N - 1) u * sum|terms| with K = max(H_q * D, intermediate). Two such sums per
// layer perturb the residual stream; through the later layers (norms, attention, SwiGLU, the
// residual adds) and lm_head a relative perturbation grows by a gain we allow as 8 (the same
// allowance as tests/test_forward.cpp's chunked-prefill bound), and sum|terms| is allowed 4x
// the output's magnitude. Logits: 2 * n_layers * (K + K / N + N) * u * 8 * 4 of the step's
// largest |logit|. SnapKV's kept rows must be equal (a selection flipped by an ulp is outside
// this bound). SKVQ's codes are not continuous: a K/V element that the perturbation carries
// across a rounding boundary moves by one quantization step, at most 2 / (2^b - 1) of its
// group's largest magnitude (the step is range / (2^b - 1), range <= 2 max|x|); at 4 bits such
// flips alone were measured to exceed the fp32 term. Quantized methods (quant_bits = b > 0; 0 =
// none) add that relative K/V perturbation with the same gain: 8 * 2 / (2^b - 1) of the largest
// |logit|. K/V must reach the caches in fp32 (an fp16 rounding flip is another such step).
inline double sharded_logit_bound(const ModelConfig& c, int64_t n, double max_logit,
                                  int quant_bits) {
  const int64_t K = std::max(c.n_heads * c.head_dim, c.intermediate_size);
  const double fp32 = 2.0 * static_cast<double>(c.n_layers) * static_cast<double>(K + K / n + n) *
                      kFp32Roundoff * 8 * 4;
  const double step = quant_bits > 0 ? 8 * 2.0 / ((1 << quant_bits) - 1) : 0.0;
  return (fp32 + step) * max_logit;
}

}  // namespace vq::test
