// SnapKV primitives: window scores (key proxy and real queries), 1-D pooling, the seed's
// selection rule and the keep-window variant, and the per-head pipeline (see veloxquant/snapkv.h).
//
// Layouts: keys [n, D] fp32 row-major, queries [n_rep, w, D] fp32, scores [n] fp32.
// The optimised scorer computes logits in blocks of 16 key rows transposed to [D, 16] (a block
// stays in L1 while every query row passes over it): each key's dot product is a sequential fp32
// sum that the compiler vectorises across the 16 keys without reassociation. The *_reference
// versions are plain double loops and are the test oracles.
#include "veloxquant/snapkv.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

#include "veloxquant/error.h"

namespace vq {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Ranking key of a score: NaN -> -inf, -0 -> +0 (so equal scores compare equal bit-for-bit too).
inline float rank_key(float s) {
  if (std::isnan(s)) return kNegInf;
  return s == 0.0f ? 0.0f : s;
}

void check_score_args(const char* op, int64_t n, int64_t head_dim) {
  VQ_CHECK(n >= 0, std::string("[") + op + "] expected n >= 0 but got " + std::to_string(n));
  VQ_CHECK(head_dim >= 1,
           std::string("[") + op + "] expected head_dim >= 1 but got " + std::to_string(head_dim));
}

// acc[t][l] = sum over c of q_t[c] * kt[c][l] for nqb <= 4 queries (rows of q, stride d) and one
// transposed block kt [d, 16]. GCC vector types keep the 4 x 16 accumulators in registers; each
// lane is a sequential fp32 sum over c (the order never depends on the ISA).
typedef float v16f __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

void block_dots(const float* q, int64_t nqb, int64_t d, const float* kt, float (*acc)[16]) {
  v16f a0 = {}, a1 = {}, a2 = {}, a3 = {};
  const float* q0 = q;
  const float* q1 = nqb > 1 ? q + d : q;
  const float* q2 = nqb > 2 ? q + 2 * d : q;
  const float* q3 = nqb > 3 ? q + 3 * d : q;
  for (int64_t c = 0; c < d; ++c) {
    const v16f k = load16(kt + c * 16);
    a0 += q0[c] * k;
    a1 += q1[c] * k;
    a2 += q2[c] * k;
    a3 += q3[c] * k;
  }
  std::memcpy(acc[0], &a0, sizeof(a0));
  if (nqb > 1) std::memcpy(acc[1], &a1, sizeof(a1));
  if (nqb > 2) std::memcpy(acc[2], &a2, sizeof(a2));
  if (nqb > 3) std::memcpy(acc[3], &a3, sizeof(a3));
}

// Scaled logits [n_rep * w, n] of queries [n_rep, w, D] against keys [n, D]; -inf where
// key_pos[j] > query_pos[i] (no mask when key_pos is null). Shared by the window scores and the
// max-attention scores.
void window_logits(const float* keys, const int32_t* key_pos, int64_t n, int64_t d,
                   const float* queries, const int32_t* query_pos, int64_t n_rep, int64_t w,
                   std::vector<float>& logits) {
  const int64_t nq = n_rep * w;  // query rows, head-major
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  logits.resize(static_cast<size_t>(nq * n));
  // Micro-kernel: a block of kLanes keys transposed to [D, kLanes] so that one query element
  // times one row of the block updates kLanes independent dot products (no horizontal sums);
  // each dot product is still a plain sequential fp32 sum over c = 0..D-1 (deterministic).
  constexpr int64_t kLanes = 16;
  constexpr int64_t kQ = 4;  // queries per pass over a block
  alignas(64) float kt[kLanes * 512];
  std::vector<float> kt_heap;
  float* ktp = kt;
  if (d > 512) {
    kt_heap.resize(static_cast<size_t>(kLanes * d));
    ktp = kt_heap.data();
  }
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const int64_t nb = std::min(kLanes, n - j0);
    for (int64_t c = 0; c < d; ++c)
      for (int64_t l = 0; l < kLanes; ++l)
        ktp[c * kLanes + l] = l < nb ? keys[(j0 + l) * d + c] : 0.0f;
    for (int64_t q0 = 0; q0 < nq; q0 += kQ) {
      const int64_t nqb = std::min(kQ, nq - q0);
      float dots[kQ][kLanes];
      block_dots(queries + q0 * d, nqb, d, ktp, dots);
      for (int64_t t = 0; t < nqb; ++t) {
        const int64_t qi = q0 + t;
        float* lrow = logits.data() + qi * n + j0;
        const int32_t qp = query_pos ? query_pos[qi % w] : 0;
        for (int64_t l = 0; l < nb; ++l)
          lrow[l] = key_pos && key_pos[j0 + l] > qp ? kNegInf : dots[t][l] * scale;
      }
    }
  }
}

// Optimised window scores shared by the key-proxy and query modes. queries [n_rep, w, D].
void window_scores_fast(const float* keys, const int32_t* key_pos, int64_t n, int64_t d,
                        const float* queries, const int32_t* query_pos, int64_t n_rep, int64_t w,
                        float* scores, std::vector<float>& logits, std::vector<double>& acc) {
  if (n == 0) return;
  window_logits(keys, key_pos, n, d, queries, query_pos, n_rep, w, logits);
  // Softmax per query row in fp32; per-head sums in double.
  acc.assign(static_cast<size_t>(n), 0.0);
  std::vector<double> head_sum;  // only used when n_rep > 1
  if (n_rep > 1) head_sum.assign(static_cast<size_t>(n), 0.0);
  for (int64_t r = 0; r < n_rep; ++r) {
    double* hs = n_rep > 1 ? head_sum.data() : acc.data();
    if (n_rep > 1) std::fill(head_sum.begin(), head_sum.end(), 0.0);
    for (int64_t i = 0; i < w; ++i) {
      float* lrow = logits.data() + (r * w + i) * n;
      float m = kNegInf;
      bool any_nan = false;
      for (int64_t j = 0; j < n; ++j) {
        if (lrow[j] > m) m = lrow[j];
        any_nan |= std::isnan(lrow[j]);
      }
      if (any_nan) {  // non-finite input: NaN scores (ranked -inf by the selection)
        for (int64_t j = 0; j < n; ++j) hs[j] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      if (m == kNegInf) continue;  // sees no key: contributes zero
      float z = 0.0f;
      if (std::isinf(m)) {  // +inf logit: the softmax is undefined, like the seed's NaN
        for (int64_t j = 0; j < n; ++j) hs[j] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {
        const float e = std::exp(lrow[j] - m);
        lrow[j] = e;
        z += e;
      }
      const float inv_z = 1.0f / z;
      for (int64_t j = 0; j < n; ++j) hs[j] += static_cast<double>(lrow[j] * inv_z);
    }
    if (n_rep > 1) {
      for (int64_t j = 0; j < n; ++j) acc[j] += head_sum[j] / static_cast<double>(w);
    }
  }
  // Per-head mean (n_rep == 1) or head average of per-head means (n_rep > 1): with identical
  // query heads the average is bit-identical to one head's mean (x + x = 2x and 2x / 2 = x are
  // exact for n_rep = 2).
  const double div = n_rep > 1 ? static_cast<double>(n_rep) : static_cast<double>(w);
  for (int64_t j = 0; j < n; ++j) scores[j] = static_cast<float>(acc[j] / div);
}

void window_scores_reference(const float* keys, const int32_t* key_pos, int64_t n, int64_t d,
                             const float* queries, const int32_t* query_pos, int64_t n_rep,
                             int64_t w, float* scores) {
  if (n == 0) return;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> total(static_cast<size_t>(n), 0.0);
  std::vector<double> logit(static_cast<size_t>(n));
  std::vector<char> seen(static_cast<size_t>(n));
  for (int64_t r = 0; r < n_rep; ++r) {
    std::vector<double> head(static_cast<size_t>(n), 0.0);
    for (int64_t i = 0; i < w; ++i) {
      const float* q = queries + (r * w + i) * d;
      double m = -std::numeric_limits<double>::infinity();
      bool any = false;
      for (int64_t j = 0; j < n; ++j) {
        seen[j] = !(key_pos && key_pos[j] > query_pos[i]);
        if (!seen[j]) continue;
        double dot = 0.0;
        for (int64_t c = 0; c < d; ++c)
          dot += static_cast<double>(q[c]) * static_cast<double>(keys[j * d + c]);
        logit[j] = dot * scale;
        m = any ? std::max(m, logit[j]) : logit[j];
        any = true;
      }
      if (!any) continue;
      double z = 0.0;
      for (int64_t j = 0; j < n; ++j)
        if (seen[j]) z += std::exp(logit[j] - m);
      for (int64_t j = 0; j < n; ++j)
        if (seen[j]) head[j] += std::exp(logit[j] - m) / z;
    }
    for (int64_t j = 0; j < n; ++j) total[j] += head[j] / static_cast<double>(w);
  }
  for (int64_t j = 0; j < n; ++j) scores[j] = static_cast<float>(total[j] / n_rep);
}

void check_query_args(const char* op, const int32_t* key_pos, const float* queries,
                      const int32_t* query_pos, int64_t n_rep, int64_t w) {
  VQ_CHECK((key_pos == nullptr) == (query_pos == nullptr),
           std::string("[") + op +
               "] expected key_pos and query_pos both given or both null but got one of them");
  VQ_CHECK(n_rep >= 1,
           std::string("[") + op + "] expected n_rep >= 1 but got " + std::to_string(n_rep));
  VQ_CHECK(w >= 1, std::string("[") + op + "] expected w >= 1 but got " + std::to_string(w));
  VQ_CHECK(queries != nullptr, std::string("[") + op + "] expected queries but got nullptr");
}

}  // namespace

// ---- scores -------------------------------------------------------------------------------------

void snap_key_proxy_scores(const float* keys, int64_t n, int64_t head_dim, int64_t obs_window,
                           float* scores) {
  check_score_args("snap_key_proxy_scores", n, head_dim);
  if (n == 0) return;
  const int64_t w = std::clamp<int64_t>(obs_window, 1, n);
  std::vector<float> logits;
  std::vector<double> acc;
  window_scores_fast(keys, nullptr, n, head_dim, keys + (n - w) * head_dim, nullptr, 1, w, scores,
                     logits, acc);
}

void snap_key_proxy_scores_reference(const float* keys, int64_t n, int64_t head_dim,
                                     int64_t obs_window, float* scores) {
  check_score_args("snap_key_proxy_scores_reference", n, head_dim);
  if (n == 0) return;
  const int64_t w = std::clamp<int64_t>(obs_window, 1, n);
  window_scores_reference(keys, nullptr, n, head_dim, keys + (n - w) * head_dim, nullptr, 1, w,
                          scores);
}

void snap_query_scores(const float* keys, const int32_t* key_pos, int64_t n, int64_t head_dim,
                       const float* queries, const int32_t* query_pos, int64_t n_rep, int64_t w,
                       float* scores) {
  check_score_args("snap_query_scores", n, head_dim);
  check_query_args("snap_query_scores", key_pos, queries, query_pos, n_rep, w);
  std::vector<float> logits;
  std::vector<double> acc;
  window_scores_fast(keys, key_pos, n, head_dim, queries, query_pos, n_rep, w, scores, logits, acc);
}

void snap_query_scores_reference(const float* keys, const int32_t* key_pos, int64_t n,
                                 int64_t head_dim, const float* queries, const int32_t* query_pos,
                                 int64_t n_rep, int64_t w, float* scores) {
  check_score_args("snap_query_scores_reference", n, head_dim);
  check_query_args("snap_query_scores_reference", key_pos, queries, query_pos, n_rep, w);
  window_scores_reference(keys, key_pos, n, head_dim, queries, query_pos, n_rep, w, scores);
}

// ---- max attention (context-reconstruction scores)
// -----------------------------------------------

void snap_max_attention(const float* keys, const int32_t* key_pos, int64_t n, int64_t head_dim,
                        const float* queries, const int32_t* query_pos, int64_t n_rep, int64_t w,
                        int64_t n_score, float* scores, std::vector<float>* scratch) {
  check_score_args("snap_max_attention", n, head_dim);
  check_query_args("snap_max_attention", key_pos, queries, query_pos, n_rep, w);
  VQ_CHECK(n_score >= 0 && n_score <= n, "[snap_max_attention] expected 0 <= n_score <= n (" +
                                             std::to_string(n) + ") but got " +
                                             std::to_string(n_score));
  if (n == 0 || n_score == 0) return;
  std::vector<float> local;
  std::vector<float>& logits = scratch ? *scratch : local;
  window_logits(keys, key_pos, n, head_dim, queries, query_pos, n_rep, w, logits);
  for (int64_t qi = 0; qi < n_rep * w; ++qi) {
    float* lrow = logits.data() + qi * n;
    float m = kNegInf;
    bool any_nan = false;
    for (int64_t j = 0; j < n; ++j) {
      if (lrow[j] > m) m = lrow[j];
      any_nan |= std::isnan(lrow[j]);
    }
    if (any_nan || (std::isinf(m) && m > 0)) {  // undefined softmax: the scores become NaN
      for (int64_t j = 0; j < n_score; ++j) scores[j] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (m == kNegInf) continue;  // sees no key: contributes nothing
    float z = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float e = std::exp(lrow[j] - m);  // exp(-inf) = 0 for masked keys
      lrow[j] = e;
      z += e;
    }
    const float inv_z = 1.0f / z;
    for (int64_t j = 0; j < n_score; ++j) {
      const float p = lrow[j] * inv_z;
      if (!(scores[j] >= p) && !std::isnan(scores[j])) scores[j] = p;
    }
  }
}

void snap_max_attention_reference(const float* keys, const int32_t* key_pos, int64_t n,
                                  int64_t head_dim, const float* queries, const int32_t* query_pos,
                                  int64_t n_rep, int64_t w, int64_t n_score, float* scores) {
  check_score_args("snap_max_attention_reference", n, head_dim);
  check_query_args("snap_max_attention_reference", key_pos, queries, query_pos, n_rep, w);
  VQ_CHECK(n_score >= 0 && n_score <= n,
           "[snap_max_attention_reference] expected 0 <= n_score <= n (" + std::to_string(n) +
               ") but got " + std::to_string(n_score));
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  std::vector<double> logit(static_cast<size_t>(n));
  std::vector<char> seen(static_cast<size_t>(n));
  for (int64_t r = 0; r < n_rep; ++r)
    for (int64_t i = 0; i < w; ++i) {
      const float* q = queries + (r * w + i) * head_dim;
      double m = -std::numeric_limits<double>::infinity();
      bool any = false;
      for (int64_t j = 0; j < n; ++j) {
        seen[j] = !(key_pos && key_pos[j] > query_pos[i]);
        if (!seen[j]) continue;
        double dot = 0.0;
        for (int64_t c = 0; c < head_dim; ++c)
          dot += static_cast<double>(q[c]) * static_cast<double>(keys[j * head_dim + c]);
        logit[j] = dot * scale;
        m = any ? std::max(m, logit[j]) : logit[j];
        any = true;
      }
      if (!any) continue;
      double z = 0.0;
      for (int64_t j = 0; j < n; ++j)
        if (seen[j]) z += std::exp(logit[j] - m);
      for (int64_t j = 0; j < n_score; ++j) {
        const float p = seen[j] ? static_cast<float>(std::exp(logit[j] - m) / z) : 0.0f;
        if (!(scores[j] >= p) && !std::isnan(scores[j])) scores[j] = p;
      }
    }
}

// ---- pooling ------------------------------------------------------------------------------------

void snap_pool_scores(const float* in, int64_t n, int64_t kernel, PoolKind kind, float* out) {
  VQ_CHECK(kernel >= 1 && kernel % 2 == 1,
           "[snap_pool_scores] expected an odd kernel >= 1 but got " + std::to_string(kernel));
  VQ_CHECK(n >= 0, "[snap_pool_scores] expected n >= 0 but got " + std::to_string(n));
  const int64_t half = kernel / 2;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t lo = std::max<int64_t>(0, j - half);
    const int64_t hi = std::min<int64_t>(n, j + half + 1);
    if (kind == PoolKind::kMax) {
      float m = std::numeric_limits<float>::quiet_NaN();
      for (int64_t t = lo; t < hi; ++t)
        if (!std::isnan(in[t]) && (std::isnan(m) || in[t] > m)) m = in[t];
      out[j] = m;
    } else {
      double s = 0.0;
      for (int64_t t = lo; t < hi; ++t) s += static_cast<double>(in[t]);
      out[j] = static_cast<float>(s / static_cast<double>(hi - lo));
    }
  }
}

// ---- selection ----------------------------------------------------------------------------------

int64_t snap_select_count(int64_t n, int64_t budget) {
  if (n <= 0) return 0;
  return std::min(std::max<int64_t>(budget, 1), n);
}

namespace {

// Appends to out the k best rows of [lo, hi) (k < hi - lo), ascending. Threshold version.
int64_t top_k_range(const float* scores, int64_t lo, int64_t hi, int64_t k, int64_t* out,
                    std::vector<float>& buf) {
  if (k <= 0) return 0;
  const int64_t m = hi - lo;
  buf.resize(static_cast<size_t>(m));
  for (int64_t j = 0; j < m; ++j) buf[j] = rank_key(scores[lo + j]);
  // The k-th largest ranking key.
  std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<float>());
  const float thr = buf[k - 1];
  int64_t above = 0;
  for (int64_t j = lo; j < hi; ++j) above += rank_key(scores[j]) > thr;
  int64_t equal_quota = k - above;  // rows equal to the threshold, lowest index first
  int64_t w = 0;
  for (int64_t j = lo; j < hi && w < k; ++j) {
    const float v = rank_key(scores[j]);
    if (v > thr) {
      out[w++] = j;
    } else if (v == thr && equal_quota > 0) {
      out[w++] = j;
      --equal_quota;
    }
  }
  return w;
}

std::vector<int64_t> top_k_range_reference(const float* scores, int64_t lo, int64_t hi, int64_t k) {
  std::vector<int64_t> idx(static_cast<size_t>(hi - lo));
  std::iota(idx.begin(), idx.end(), lo);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int64_t a, int64_t b) { return rank_key(scores[a]) > rank_key(scores[b]); });
  idx.resize(static_cast<size_t>(std::max<int64_t>(k, 0)));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace

int64_t snap_select(const float* scores, int64_t n, int64_t budget, int64_t n_sink, int64_t* out,
                    std::vector<float>* scratch) {
  const int64_t count = snap_select_count(n, budget);
  const int64_t sinks = std::min(std::max<int64_t>(n_sink, 0), count);
  if (count >= n || sinks == count) {
    for (int64_t j = 0; j < count; ++j) out[j] = j;
    return count;
  }
  for (int64_t j = 0; j < sinks; ++j) out[j] = j;
  std::vector<float> local;
  std::vector<float>& buf = scratch ? *scratch : local;
  const int64_t got = top_k_range(scores, sinks, n, count - sinks, out + sinks, buf);
  VQ_CHECK(got == count - sinks, "[snap_select] internal: selected " + std::to_string(got) +
                                     " rows, expected " + std::to_string(count - sinks));
  return count;
}

std::vector<int64_t> snap_select_reference(const float* scores, int64_t n, int64_t budget,
                                           int64_t n_sink) {
  const int64_t count = snap_select_count(n, budget);
  const int64_t sinks = std::min(std::max<int64_t>(n_sink, 0), count);
  std::vector<int64_t> out;
  if (count >= n || sinks == count) {
    for (int64_t j = 0; j < count; ++j) out.push_back(j);
    return out;
  }
  for (int64_t j = 0; j < sinks; ++j) out.push_back(j);
  const auto rest = top_k_range_reference(scores, sinks, n, count - sinks);
  out.insert(out.end(), rest.begin(), rest.end());
  return out;
}

namespace {

struct KeepWindowPlan {
  int64_t count = 0, sinks = 0;
  int64_t keep_w = 0;                    // newest rows kept as window rows: [n - keep_w, n)
  int64_t prefix_lo = 0, prefix_hi = 0;  // competing prefix rows
  int64_t quota = 0;                     // prefix rows to pick
  bool all = false;
};

KeepWindowPlan plan_keep_window(int64_t n, int64_t budget, int64_t n_sink, int64_t window) {
  KeepWindowPlan p;
  p.count = snap_select_count(n, budget);
  p.sinks = std::min(std::max<int64_t>(n_sink, 0), p.count);
  if (p.count >= n) {
    p.all = true;
    return p;
  }
  const int64_t w = std::clamp<int64_t>(window, 0, n);
  const int64_t w_free = n - std::max(n - w, p.sinks);  // window rows that are not sinks
  p.keep_w = std::min(w_free, p.count - p.sinks);
  p.quota = p.count - p.sinks - p.keep_w;
  p.prefix_lo = p.sinks;
  p.prefix_hi = std::max(p.sinks, n - w);
  return p;
}

}  // namespace

int64_t snap_select_keep_window(const float* scores, int64_t n, int64_t budget, int64_t n_sink,
                                int64_t window, int64_t* out, std::vector<float>* scratch) {
  const KeepWindowPlan p = plan_keep_window(n, budget, n_sink, window);
  if (p.all) {
    for (int64_t j = 0; j < n; ++j) out[j] = j;
    return n;
  }
  int64_t w = 0;
  for (int64_t j = 0; j < p.sinks; ++j) out[w++] = j;
  if (p.quota > 0) {
    std::vector<float> local;
    std::vector<float>& buf = scratch ? *scratch : local;
    // quota < prefix size whenever count < n (see plan_keep_window), so top_k_range applies.
    w += top_k_range(scores, p.prefix_lo, p.prefix_hi, p.quota, out + w, buf);
  }
  for (int64_t j = n - p.keep_w; j < n; ++j) out[w++] = j;
  VQ_CHECK(w == p.count, "[snap_select_keep_window] internal: selected " + std::to_string(w) +
                             " rows, expected " + std::to_string(p.count));
  return p.count;
}

std::vector<int64_t> snap_select_keep_window_reference(const float* scores, int64_t n,
                                                       int64_t budget, int64_t n_sink,
                                                       int64_t window) {
  const KeepWindowPlan p = plan_keep_window(n, budget, n_sink, window);
  std::vector<int64_t> out;
  if (p.all) {
    for (int64_t j = 0; j < n; ++j) out.push_back(j);
    return out;
  }
  for (int64_t j = 0; j < p.sinks; ++j) out.push_back(j);
  if (p.quota > 0) {
    const auto rest = top_k_range_reference(scores, p.prefix_lo, p.prefix_hi, p.quota);
    out.insert(out.end(), rest.begin(), rest.end());
  }
  for (int64_t j = n - p.keep_w; j < n; ++j) out.push_back(j);
  return out;
}

// ---- pipeline -----------------------------------------------------------------------------------

SnapSelectParams SnapSelectParams::from_config(const CacheConfig& cfg) {
  SnapSelectParams p;
  p.budget = cfg.snap_budget;
  p.obs_window = cfg.snap_obs_window;
  p.n_sink = cfg.snap_n_sink;
  p.pool_kernel = cfg.snap_pool_kernel;
  p.pool = cfg.snap_pool;
  p.keep_window = cfg.snap_keep_window;
  return p;
}

void SnapPromptWindow::keep(const TensorView* queries, int64_t obs_window) {
  const int64_t b_n = queries ? queries->shape[0] : 0, s = queries ? queries->shape[2] : 0;
  const int64_t d = queries ? queries->shape[3] : 0;
  hq = queries ? queries->shape[1] : 0;
  rows = queries ? std::min(obs_window, s) : 0;
  q.assign(static_cast<size_t>(b_n * hq * rows * d), 0.0f);
  for (int64_t b = 0; b < b_n; ++b)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < rows; ++i)
        convert_view_row(*queries, b, h, s - rows + i, q.data() + ((b * hq + h) * rows + i) * d,
                         DType::kF32);
}

const TensorView* SnapPromptWindow::view(int64_t batch, int64_t head_dim, TensorView* out) const {
  if (rows == 0) return nullptr;
  out->data = const_cast<float*>(q.data());
  out->dtype = DType::kF32;
  out->shape = {batch, hq, rows, head_dim};
  out->stride = {hq * rows * head_dim, rows * head_dim, head_dim, 1};
  return out;
}

void SnapPromptWindow::clear() {
  hq = rows = 0;
  std::vector<float>().swap(q);
}

DType snap_storage_dtype(SnapDType mode, DType keys, DType values) {
  switch (mode) {
    case SnapDType::kFloat16:
      return DType::kF16;
    case SnapDType::kBFloat16:
      return DType::kBF16;
    case SnapDType::kAuto:
      break;
  }
  return keys == DType::kBF16 && values == DType::kBF16 ? DType::kBF16 : DType::kF16;
}

namespace {
// Pooling over the competing rows [lo, hi), then selection (4), or (5) with window w.
int64_t select_scored(const float* scores, int64_t n, const SnapSelectParams& p, int64_t w,
                      int64_t lo, int64_t hi, int64_t* out, SnapScratch& scratch);
}  // namespace

int64_t snap_select_head(const float* keys, const int32_t* key_pos, int64_t n, int64_t head_dim,
                         const SnapQueryWindow* q, const SnapSelectParams& p, int64_t* out,
                         SnapScratch& scratch) {
  check_score_args("snap_select_head", n, head_dim);
  VQ_CHECK(p.pool_kernel >= 1 && p.pool_kernel % 2 == 1,
           "[snap_select_head] expected an odd pool_kernel >= 1 but got " +
               std::to_string(p.pool_kernel));
  const int64_t count = snap_select_count(n, p.budget);
  const int64_t sinks = std::min(std::max<int64_t>(p.n_sink, 0), count);
  const int64_t w = q ? q->w : std::clamp<int64_t>(p.obs_window, 1, std::max<int64_t>(n, 1));
  if (q) {
    check_query_args("snap_select_head", key_pos, q->data, q->positions, q->n_rep, q->w);
  }

  // Rows that compete for the budget; empty means the selection ignores the scores.
  int64_t lo = sinks, hi = n;
  bool needs_scores = count < n && sinks < count;
  if (p.keep_window && needs_scores) {
    const KeepWindowPlan plan = plan_keep_window(n, p.budget, p.n_sink, w);
    lo = plan.prefix_lo;
    hi = plan.prefix_hi;
    needs_scores = plan.quota > 0;
  }
  if (!needs_scores) {
    if (p.keep_window) {  // no prefix quota: the scores are never read
      return snap_select_keep_window(nullptr, n, p.budget, p.n_sink, w, out, &scratch.sel);
    }
    return snap_select(nullptr, n, p.budget, p.n_sink, out, &scratch.sel);
  }

  scratch.scores.resize(static_cast<size_t>(n));
  if (q) {
    window_scores_fast(keys, key_pos, n, head_dim, q->data, q->positions, q->n_rep, q->w,
                       scratch.scores.data(), scratch.logits, scratch.acc);
  } else {
    window_scores_fast(keys, nullptr, n, head_dim, keys + (n - w) * head_dim, nullptr, 1, w,
                       scratch.scores.data(), scratch.logits, scratch.acc);
  }
  return select_scored(scratch.scores.data(), n, p, w, lo, hi, out, scratch);
}

int64_t snap_select_from_scores(const float* scores, int64_t n, const SnapSelectParams& p,
                                int64_t* out, SnapScratch& scratch) {
  VQ_CHECK(n >= 0, "[snap_select_from_scores] expected n >= 0 but got " + std::to_string(n));
  VQ_CHECK(p.pool_kernel >= 1 && p.pool_kernel % 2 == 1,
           "[snap_select_from_scores] expected an odd pool_kernel >= 1 but got " +
               std::to_string(p.pool_kernel));
  const int64_t count = snap_select_count(n, p.budget);
  const int64_t sinks = std::min(std::max<int64_t>(p.n_sink, 0), count);
  const int64_t w = std::clamp<int64_t>(p.obs_window, 1, std::max<int64_t>(n, 1));
  int64_t lo = sinks, hi = n;
  bool needs_scores = count < n && sinks < count;
  if (p.keep_window && needs_scores) {
    const KeepWindowPlan plan = plan_keep_window(n, p.budget, p.n_sink, w);
    lo = plan.prefix_lo;
    hi = plan.prefix_hi;
    needs_scores = plan.quota > 0;
  }
  if (!needs_scores) {
    if (p.keep_window)
      return snap_select_keep_window(nullptr, n, p.budget, p.n_sink, w, out, &scratch.sel);
    return snap_select(nullptr, n, p.budget, p.n_sink, out, &scratch.sel);
  }
  VQ_CHECK(scores != nullptr, "[snap_select_from_scores] expected scores but got nullptr");
  return select_scored(scores, n, p, w, lo, hi, out, scratch);
}

std::vector<int32_t> snap_select_frames_from_scores(const float* scores, int64_t frames, int64_t n,
                                                    const SnapSelectParams& p) {
  const int64_t count = snap_keep_count(n, p);
  std::vector<int32_t> idx(static_cast<size_t>(frames * count));
  std::vector<int64_t> out(static_cast<size_t>(count));
  SnapScratch scratch;
  for (int64_t f = 0; f < frames; ++f) {
    const int64_t got = snap_select_from_scores(scores + f * n, n, p, out.data(), scratch);
    VQ_CHECK(got == count, "[snap_select_frames_from_scores] internal: selected " +
                               std::to_string(got) + " rows, expected " + std::to_string(count));
    for (int64_t k = 0; k < count; ++k)
      idx[static_cast<size_t>(f * count + k)] = static_cast<int32_t>(out[static_cast<size_t>(k)]);
  }
  return idx;
}

namespace {

int64_t select_scored(const float* scores, int64_t n, const SnapSelectParams& p, int64_t w,
                      int64_t lo, int64_t hi, int64_t* out, SnapScratch& scratch) {
  const float* sel_scores = scores;
  if (p.pool_kernel > 1) {
    // Pool over the competing rows only; rows outside [lo, hi) are never read by the selection.
    scratch.pooled.assign(static_cast<size_t>(n), 0.0f);
    snap_pool_scores(scores + lo, hi - lo, p.pool_kernel, p.pool, scratch.pooled.data() + lo);
    sel_scores = scratch.pooled.data();
  }
  if (p.keep_window) {
    return snap_select_keep_window(sel_scores, n, p.budget, p.n_sink, w, out, &scratch.sel);
  }
  return snap_select(sel_scores, n, p.budget, p.n_sink, out, &scratch.sel);
}

}  // namespace

}  // namespace vq
