// Scalar reference attention over a cache view (veloxquant/attention.h): the oracle for every
// optimised attention kernel. Written for clarity, not speed.
//
// q [B, H_q, N, D] (read through its strides; fp32 expected, f16/bf16 accepted), view segments
// [B, H_kv, n_rows, D] full precision, out [B, H_q, N, D] fp32 contiguous. Query head qh reads KV
// head qh / (H_q / H_kv). Key j is visible to query i (position q_pos0 + i) when
// pos_j <= pos_i and, with window > 0, pos_i < pos_j + window, pos_j being row j's own position.
// Numerics: each q_d * k_d product in fp32, dot products, softmax and the weighted value sum in
// double, one final rounding to fp32. A query that sees no key gets zeros.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "veloxquant/attention.h"
#include "veloxquant/error.h"

namespace vq {

namespace {

std::string shape_str(const std::array<int64_t, 4>& s) {
  return "[" + std::to_string(s[0]) + ", " + std::to_string(s[1]) + ", " + std::to_string(s[2]) +
         ", " + std::to_string(s[3]) + "]";
}

void check_inputs(const TensorView& q, const CacheView& view, const AttentionParams& p,
                  const float* out) {
  VQ_CHECK(view.batch >= 1 && view.n_kv_heads >= 1 && view.head_dim >= 1,
           "[attention_reference] expected a view with B, H_kv, D >= 1 but got B=" +
               std::to_string(view.batch) + ", H_kv=" + std::to_string(view.n_kv_heads) +
               ", D=" + std::to_string(view.head_dim));
  VQ_CHECK(
      q.shape[0] == view.batch && q.shape[1] >= 1 && q.shape[2] >= 0 && q.shape[3] == view.head_dim,
      "[attention_reference] expected q [" + std::to_string(view.batch) + ", H_q, N, " +
          std::to_string(view.head_dim) + "] but got " + shape_str(q.shape));
  VQ_CHECK(q.shape[1] % view.n_kv_heads == 0,
           "[attention_reference] expected H_q a multiple of H_kv = " +
               std::to_string(view.n_kv_heads) + " but got H_q = " + std::to_string(q.shape[1]));
  VQ_CHECK(q.numel() == 0 || (q.data != nullptr && out != nullptr),
           "[attention_reference] expected q data and an output buffer but got a null pointer");
  VQ_CHECK(p.window >= 0,
           "[attention_reference] expected window >= 0 but got " + std::to_string(p.window));
  for (size_t s = 0; s < view.segments.size(); ++s) {
    const ViewSegment& seg = view.segments[s];
    VQ_CHECK(seg.packed == nullptr,
             "[attention_reference] expected full-precision segments but "
             "segment " +
                 std::to_string(s) + " is packed (dequantize the view first)");
    const std::array<int64_t, 4> want{view.batch, view.n_kv_heads, seg.n_rows, view.head_dim};
    VQ_CHECK(seg.n_rows >= 0 && seg.keys.shape == want && seg.values.shape == want,
             "[attention_reference] expected segment " + std::to_string(s) + " keys/values " +
                 shape_str(want) + " but got " + shape_str(seg.keys.shape) + " / " +
                 shape_str(seg.values.shape));
    VQ_CHECK(seg.n_rows == 0 || (seg.keys.data != nullptr && seg.values.data != nullptr),
             "[attention_reference] expected segment " + std::to_string(s) +
                 " data but got a null pointer");
  }
}

}  // namespace

void attention_reference(const TensorView& q, const CacheView& view, const AttentionParams& p,
                         float* out) {
  check_inputs(q, view, p, out);
  const int64_t n_b = q.shape[0], n_hq = q.shape[1], n_q = q.shape[2], n_d = q.shape[3];
  const int64_t n_hkv = view.n_kv_heads;
  const int64_t group = n_hq / n_hkv;
  const double scale =
      p.scale != 0.0f ? static_cast<double>(p.scale) : 1.0 / std::sqrt(static_cast<double>(n_d));

  std::vector<float> qrow(static_cast<size_t>(n_d));
  std::vector<double> logits, acc(static_cast<size_t>(n_d));
  std::vector<const ViewSegment*> key_seg;
  std::vector<int64_t> key_row;
  for (int64_t b = 0; b < n_b; ++b)
    for (int64_t qh = 0; qh < n_hq; ++qh) {
      const int64_t kh = qh / group;
      for (int64_t i = 0; i < n_q; ++i) {
        const int64_t q_pos = p.q_pos0 + i;
        for (int64_t d = 0; d < n_d; ++d) qrow[static_cast<size_t>(d)] = q.at(b, qh, i, d);
        logits.clear();
        key_seg.clear();
        key_row.clear();
        for (const ViewSegment& seg : view.segments)
          for (int64_t j = 0; j < seg.n_rows; ++j) {
            const int64_t k_pos = seg.position(b, kh, j, n_hkv);
            if (k_pos > q_pos) continue;
            if (p.window > 0 && q_pos >= k_pos + p.window) continue;
            double dot = 0.0;
            for (int64_t d = 0; d < n_d; ++d)
              dot += static_cast<double>(qrow[static_cast<size_t>(d)] * seg.keys.at(b, kh, j, d));
            logits.push_back(dot * scale);
            key_seg.push_back(&seg);
            key_row.push_back(j);
          }
        float* o = out + ((b * n_hq + qh) * n_q + i) * n_d;
        if (logits.empty()) {
          for (int64_t d = 0; d < n_d; ++d) o[d] = 0.0f;
          continue;
        }
        double mx = -std::numeric_limits<double>::infinity();
        for (double l : logits) mx = std::max(mx, l);
        double denom = 0.0;
        for (double& l : logits) {
          l = std::exp(l - mx);
          denom += l;
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        for (size_t k = 0; k < logits.size(); ++k)
          for (int64_t d = 0; d < n_d; ++d)
            acc[static_cast<size_t>(d)] +=
                logits[k] * static_cast<double>(key_seg[k]->values.at(b, kh, key_row[k], d));
        for (int64_t d = 0; d < n_d; ++d)
          o[d] = static_cast<float>(acc[static_cast<size_t>(d)] / denom);
      }
    }
}

}  // namespace vq
