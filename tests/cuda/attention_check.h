// Shared by the GPU cache and prefill tests: checks a GPU attention output element by element
// against attention_reference (attention.h) over a dense (full-precision) twin of the view, with
// the per-element bounds of the op harness (tests/ops_harness/attention_bounds.h, where they are
// derived): one derivation for every GPU test.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "ops_harness/attention_bounds.h"
#include "veloxquant/attention.h"
#include "veloxquant/cache.h"

namespace vq::test {

// kDecode: decode_attention (harness GpuAttnKernel::kDecode); kPrefillCudaCore:
// prefill_attention's CUDA-core path (GpuAttnKernel::kPrefill); kPrefill: prefill_attention on
// either path (the larger of GpuAttnKernel::kPrefillTc and kPrefill), for callers that do not
// pin the path.
enum class AttnKernel { kDecode, kPrefill, kPrefillCudaCore };

struct AttnCheck {
  double worst_ratio = 0;
  int64_t nonzero = 0;
};

// q [B, Hq, N, D] fp32 (query i at ap.q_pos0 + i), gpu the kernel's output of the same shape;
// operands: the tensor-core operand type of the view the kernel read (harness::tc_operands).
// Adds a test failure (at most five reported) for every element outside its bound.
inline AttnCheck check_attention(const CacheView& dense, const std::vector<float>& q, int64_t Hq,
                                 int64_t N, const AttentionParams& ap,
                                 const std::vector<float>& gpu, AttnKernel kern, DType operands,
                                 const std::string& vars) {
  using harness::GpuAttnKernel;
  const std::vector<double> ref = harness::attention_ref(dense, q, Hq, N, ap);
  std::vector<double> tol;
  const DType ops = operands;
  if (kern == AttnKernel::kDecode) {
    tol = harness::gpu_attention_bound(dense, q, Hq, N, ap, GpuAttnKernel::kDecode, ops, ref);
  } else if (kern == AttnKernel::kPrefillCudaCore) {
    tol = harness::gpu_attention_bound(dense, q, Hq, N, ap, GpuAttnKernel::kPrefill, ops, ref);
  } else {
    tol = harness::gpu_attention_bound(dense, q, Hq, N, ap, GpuAttnKernel::kPrefillTc, ops, ref);
    const auto cc =
        harness::gpu_attention_bound(dense, q, Hq, N, ap, GpuAttnKernel::kPrefill, ops, ref);
    for (size_t e = 0; e < tol.size(); ++e) tol[e] = std::max(tol[e], cc[e]);
  }
  const int64_t D = dense.head_dim;
  AttnCheck c;
  int reported = 0;
  for (size_t e = 0; e < ref.size(); ++e) {
    const double r = ref[e], g = gpu[e], err = std::abs(g - r);
    c.worst_ratio = std::max(c.worst_ratio, std::isnan(g) ? 1e30 : err / tol[e]);
    c.nonzero += r != 0.0;
    if (!(err <= tol[e]) && reported < 5) {
      ++reported;
      const int64_t d = static_cast<int64_t>(e) % D, row = static_cast<int64_t>(e) / D;
      ADD_FAILURE() << vars << " (row " << row << " = (b * Hq + qh) * N + i, d " << d << "): gpu "
                    << g << " ref " << r << " err " << err << " tol " << tol[e];
    }
  }
  return c;
}

}  // namespace vq::test
