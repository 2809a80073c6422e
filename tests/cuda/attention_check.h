// Shared by the GPU cache and prefill tests: checks a GPU attention output element by element
// against attention_reference (attention.h) over a dense (full-precision) twin of the view, with
// a per-element tolerance derived from the kernel's fp32 arithmetic (see check_attention).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "ops_harness/attention_bounds.h"
#include "veloxquant/attention.h"
#include "veloxquant/cache.h"
#include "veloxquant/tensor.h"

namespace vq::test {

constexpr double kUnit = 0x1p-24;  // fp32 unit roundoff
inline double gamma_n(double n) {
  return n * kUnit / (1.0 - n * kUnit);
}

// kPrefill: prefill_attention on either of its paths (the larger of the kDecode bound, which its
// tensor-core path for f16 rows and packed segments meets, and the kPrefillCudaCore bound), for
// callers that do not pin the path; kPrefillCudaCore: its CUDA-core path (f32 / bf16 rows).
enum class AttnKernel { kDecode, kPrefill, kPrefillCudaCore };

struct AttnCheck {
  double worst_ratio = 0;
  int64_t nonzero = 0;
};

// q [B, Hq, N, D] fp32 (query i at ap.q_pos0 + i), gpu the kernel's output of the same shape.
// Tolerance per output element (b, qh, i, d), V = max |v| over the visible rows, n = their count:
//  * kDecode: exactly test_cuda_decode.cpp's bound for decode_attention (logit error
//    scale * (gamma(D + log2 D + 3D/8 + 8) + kGpuLogitRel) ||q|| ||k|| + 4u |logit| + 2^-22;
//    sums 2 gamma(9n/8 + 64) V, fp16 p operands kGpuValueRel V: the fp16-operand terms of
//    tests/ops_harness/attention_bounds.h), see the derivation there.
//  * kPrefillCudaCore (prefill_attention's CUDA-core path): a logit is an fp32 fma chain of D
//    products (gamma(D) times sum |q_d k_d| <= ||q|| ||k||, Cauchy-Schwarz) times the rounded scale
//    (u |logit|, plus u for the rounding of 1/sqrt(D) itself); the exponent s - m is rounded once
//    (u (|s| + L), L the largest |logit| of the row); expf is within 2 ulp (2^-22 relative), and
//    each of the at most n/32 + 1 online-softmax rescales multiplies everything accumulated so far
//    by one such exp (2^-22 each): all of it is a shift of each logit by at most delta = scale
//    gamma(D) ||q|| ||k|| + 4u |logit| + 2u L + 2^-22 (n/32 + 2). Shifts bounded by delta move each
//    normalised weight by a factor within e^(+-2 delta): output error (e^(2 delta) - 1) V. The
//    weighted sums and the normaliser accumulate n fp32 fma terms plus the n/32 + 1 rescales and
//    the final reciprocal and product: 2 gamma(n + n/32 + 4) V.
//  * the reference (fp32 products, double sums, one rounding): 2^-23 |ref|.
// Packed rows are dequantized with the same fp32 operations as the dense twin, so they add
// nothing.
inline AttnCheck check_attention(const CacheView& dense, const std::vector<float>& q, int64_t Hq,
                                 int64_t N, const AttentionParams& ap,
                                 const std::vector<float>& gpu, AttnKernel kern,
                                 const std::string& vars) {
  const int64_t B = dense.batch, H = dense.n_kv_heads, D = dense.head_dim, G = Hq / H;
  Tensor qt(DType::kF32, B, Hq, N, D);
  std::copy(q.begin(), q.end(), static_cast<float*>(qt.data()));
  std::vector<float> ref(q.size());
  attention_reference(qt.view(), dense, ap, ref.data());
  const double scale = ap.scale != 0.0f ? ap.scale : 1.0 / std::sqrt(static_cast<double>(D));
  const double log2d = std::log2(static_cast<double>(D));
  AttnCheck c;
  int reported = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t qh = 0; qh < Hq; ++qh)
      for (int64_t i = 0; i < N; ++i) {
        const int64_t kh = qh / G, qpos = ap.q_pos0 + i;
        const float* qr = q.data() + ((b * Hq + qh) * N + i) * D;
        double qn = 0;
        for (int64_t d = 0; d < D; ++d) qn += static_cast<double>(qr[d]) * qr[d];
        qn = std::sqrt(qn);
        double vmax = 0, big = 0;
        std::vector<double> kns, dots;
        for (const ViewSegment& s : dense.segments)
          for (int64_t j = 0; j < s.n_rows; ++j) {
            const int64_t pj = s.position(b, kh, j, H);
            if (pj > qpos || (ap.window > 0 && qpos >= pj + ap.window)) continue;
            double kn = 0, dot = 0;
            for (int64_t d = 0; d < D; ++d) {
              const double kv = s.keys.at(b, kh, j, d);
              kn += kv * kv;
              dot += kv * qr[d];
              vmax = std::max(vmax, std::abs(static_cast<double>(s.values.at(b, kh, j, d))));
            }
            kns.push_back(std::sqrt(kn));
            dots.push_back(dot * scale);
            big = std::max(big, std::abs(dot * scale));
          }
        const double n_vis = static_cast<double>(kns.size());
        double delta_tc = 0, delta_cc = 0;
        for (size_t j = 0; j < kns.size(); ++j) {
          delta_tc = std::max(
              delta_tc,
              scale * (gamma_n(D + log2d + 3.0 * D / 8 + 8) + harness::kGpuLogitRel) * qn * kns[j] +
                  4 * kUnit * std::abs(dots[j]) + 0x1p-22);
          delta_cc = std::max(delta_cc, scale * gamma_n(static_cast<double>(D)) * qn * kns[j] +
                                            4 * kUnit * std::abs(dots[j]) + 2 * kUnit * big +
                                            0x1p-22 * (n_vis / 32 + 2));
        }
        const double tol_tc = std::expm1(2 * delta_tc) * vmax +
                              2 * gamma_n(9.0 * n_vis / 8 + 64) * vmax +
                              harness::kGpuValueRel * vmax;
        const double tol_cc =
            std::expm1(2 * delta_cc) * vmax + 2 * gamma_n(n_vis + n_vis / 32 + 4) * vmax;
        const double tol_kern = kern == AttnKernel::kDecode            ? tol_tc
                                : kern == AttnKernel::kPrefillCudaCore ? tol_cc
                                                                       : std::max(tol_tc, tol_cc);
        for (int64_t d = 0; d < D; ++d) {
          const size_t e = static_cast<size_t>(((b * Hq + qh) * N + i) * D + d);
          const double r = ref[e], g = gpu[e];
          const double tol = tol_kern + 0x1p-23 * std::abs(r) + 1e-30;
          const double err = std::abs(g - r);
          c.worst_ratio = std::max(c.worst_ratio, std::isnan(g) ? 1e30 : err / tol);
          c.nonzero += r != 0.0;
          if (!(err <= tol) && reported < 5) {
            ++reported;
            ADD_FAILURE() << vars << " (b " << b << ", qh " << qh << ", i " << i << ", d " << d
                          << "): gpu " << g << " ref " << r << " err " << err << " tol " << tol;
          }
        }
      }
  return c;
}

}  // namespace vq::test
