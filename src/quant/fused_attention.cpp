// vq::attention: fused CPU attention over a CacheView that mixes full-precision and packed
// segments, and dequantize_view (packed.h) for callers that want dense rows.
//
// q [B, H_q, N, D] (any strides, f32/f16/bf16), out [B, H_q, N, D] fp32 contiguous. Work items
// are (b, kv head, block of queries), spread over OpenMP threads; each item holds the
// M = n_rep * n_queries query vectors that share one KV head, so every KV row is read and
// unpacked once for all of them (GQA). Per tile of 32 rows: logits, an online-softmax update
// (running max and sum, fp32), then the value accumulation.
// Packed rows are never dequantized to a dense cache: row j of group g has x_i = c_i*s_g + lo_g
// in the stored (rotated/permuted) channel order, so
//   logit = (q'.(c*s)) + sum_g lo_g * sum_{i in g} q'_i         q' = P R q, computed once
//   acc'  += p * (c*s),  acc_lo[g] += p * lo_g                   out = R^T P^T (acc' + acc_lo)
// with the un-transform applied once per query at the end. Full-precision rows are converted to
// fp32 row by row. A query that sees no key gets zeros (as attention_reference).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "veloxquant/attention.h"
#include "veloxquant/error.h"
#include "veloxquant/hadamard.h"
#include "veloxquant/packed.h"

namespace vq {
namespace {

constexpr int64_t kTile = 32;         // rows per online-softmax step
constexpr int64_t kMaxQueries = 256;  // query vectors per work item

// ---- small vector kernels (lane accumulators so the loops vectorise without -ffast-math) -----

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int l = 0; l < 16; ++l) s += acc[l];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scal(float* y, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// Lookup tables: byte -> its codes as floats (1, 2, 4 bits; ternary five codes).
struct Luts {
  alignas(64) float b1[256][8];
  alignas(64) float b2[256][4];
  alignas(64) float b4[256][2];
  alignas(64) float t5[256][5];
  Luts() {
    for (int v = 0; v < 256; ++v) {
      for (int j = 0; j < 8; ++j) b1[v][j] = static_cast<float>((v >> j) & 1);
      for (int j = 0; j < 4; ++j) b2[v][j] = static_cast<float>((v >> (2 * j)) & 3);
      for (int j = 0; j < 2; ++j) b4[v][j] = static_cast<float>((v >> (4 * j)) & 15);
      int t = v;
      for (int j = 0; j < 5; ++j) {
        t5[v][j] = static_cast<float>(t % 3);
        t /= 3;
      }
    }
  }
};
const Luts& luts() {
  static const Luts l;
  return l;
}

// Codes of one record as floats, multiplied by their group scale: out[i] = c_i * s_g(i).
// lo receives the n_groups offsets.
void unpack_scaled(const uint8_t* rec, const PackedRowFormat& f, float* __restrict out,
                   float* __restrict lo) {
  const int64_t d = f.head_dim;
  const Luts& L = luts();
  switch (f.spec.bits_x2) {
    case 2:  // 1 bit
      for (int64_t k = 0; k < d / 8; ++k) std::memcpy(out + 8 * k, L.b1[rec[k]], 32);
      for (int64_t i = d / 8 * 8; i < d; ++i)
        out[i] = static_cast<float>((rec[i / 8] >> (i % 8)) & 1);
      break;
    case 4:  // 2 bits
      for (int64_t k = 0; k < d / 4; ++k) std::memcpy(out + 4 * k, L.b2[rec[k]], 16);
      for (int64_t i = d / 4 * 4; i < d; ++i)
        out[i] = static_cast<float>((rec[i / 4] >> (2 * (i % 4))) & 3);
      break;
    case 8:  // 4 bits
      for (int64_t k = 0; k < d / 2; ++k) std::memcpy(out + 2 * k, L.b4[rec[k]], 8);
      if (d % 2) out[d - 1] = static_cast<float>(rec[d / 2] & 15);
      break;
    case 16:  // 8 bits
      for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(rec[i]);
      break;
    case 3: {  // ternary
      const int64_t full = d / 5;
      for (int64_t k = 0; k < full; ++k) std::memcpy(out + 5 * k, L.t5[rec[k]], 20);
      for (int64_t i = full * 5; i < d; ++i) out[i] = L.t5[rec[full]][i - full * 5];
      break;
    }
    default: {  // 3, 5, 6, 7 bits: generic bit stream
      const int b = f.spec.bits();
      const uint32_t mask = (1u << b) - 1u;
      for (int64_t i = 0; i < d; ++i) {
        const int64_t bit = i * b;
        uint32_t w = rec[bit >> 3];
        if ((bit & 7) + b > 8) w |= static_cast<uint32_t>(rec[(bit >> 3) + 1]) << 8;
        out[i] = static_cast<float>((w >> (bit & 7)) & mask);
      }
    }
  }
  const void* meta = rec + f.code_bytes;
  const int64_t g = f.group_size;
  for (int32_t gi = 0; gi < f.n_groups; ++gi) {
    const float s = meta_load(meta, 2 * gi + 1, f.meta);
    lo[gi] = meta_load(meta, 2 * gi, f.meta);
    const int64_t c1 = std::min<int64_t>(d, (gi + 1) * g);
    for (int64_t i = gi * g; i < c1; ++i) out[i] *= s;
  }
}

// ---- transform classes -----------------------------------------------------------------------

// Queries mapped into one stored channel order (P R q) and their per-group sums.
struct KeyClass {
  const int32_t* perm = nullptr;
  const float* signs = nullptr;
  int32_t rot_block = 0;
  int32_t group_size = 0, n_groups = 0;
  std::vector<float> q;     // [M, D]
  std::vector<float> qsum;  // [M, n_groups]
};

// Value accumulators in one stored channel order.
struct ValClass {
  const int32_t* perm = nullptr;
  const float* signs = nullptr;
  int32_t rot_block = 0;
  int32_t group_size = 0, n_groups = 0;
  std::vector<float> acc;     // [M, D]
  std::vector<float> acc_lo;  // [M, n_groups]
};

struct Work {
  int64_t m = 0, d = 0;
  std::vector<float> q;       // [M, D] scaled queries, original order
  std::vector<int64_t> qpos;  // [M]
  std::vector<float> acc;     // [M, D] full-precision rows' sum
  std::vector<float> mx, l;   // [M] running max and sum
  std::vector<KeyClass> kcls;
  std::vector<ValClass> vcls;
  std::vector<float> logits, probs;  // [M, kTile]
  std::vector<float> row, row_lo, tmp;
  std::vector<int32_t> pos;  // [kTile]
};

KeyClass& key_class(Work& w, const PackedTensor& t) {
  for (KeyClass& k : w.kcls)
    if (k.perm == t.perm && k.signs == t.signs && k.group_size == t.fmt.group_size) return k;
  KeyClass k;
  k.perm = t.perm;
  k.signs = t.signs;
  k.rot_block = t.rot_block;
  k.group_size = t.fmt.group_size;
  k.n_groups = t.fmt.n_groups;
  k.q = w.q;
  k.qsum.assign(static_cast<size_t>(w.m * k.n_groups), 0.0f);
  std::vector<float> tmp(static_cast<size_t>(w.d));
  for (int64_t m = 0; m < w.m; ++m) {
    float* qm = k.q.data() + m * w.d;
    if (t.transformed()) {
      // The signs/perm of head h were bound by the caller into t (already offset).
      if (k.signs) hadamard_rotate(qm, k.signs, w.d, k.rot_block);
      if (k.perm) {
        for (int64_t j = 0; j < w.d; ++j) tmp[static_cast<size_t>(j)] = qm[k.perm[j]];
        std::copy(tmp.begin(), tmp.end(), qm);
      }
    }
    for (int64_t i = 0; i < w.d; ++i)
      k.qsum[static_cast<size_t>(m * k.n_groups + i / k.group_size)] += qm[i];
  }
  w.kcls.push_back(std::move(k));
  return w.kcls.back();
}

ValClass& val_class(Work& w, const PackedTensor& t) {
  for (ValClass& v : w.vcls)
    if (v.perm == t.perm && v.signs == t.signs && v.group_size == t.fmt.group_size) return v;
  ValClass v;
  v.perm = t.perm;
  v.signs = t.signs;
  v.rot_block = t.rot_block;
  v.group_size = t.fmt.group_size;
  v.n_groups = t.fmt.n_groups;
  v.acc.assign(static_cast<size_t>(w.m * w.d), 0.0f);
  v.acc_lo.assign(static_cast<size_t>(w.m * v.n_groups), 0.0f);
  w.vcls.push_back(std::move(v));
  return w.vcls.back();
}

// Rescales every accumulator of query m by f.
void rescale(Work& w, int64_t m, float f) {
  scal(w.acc.data() + m * w.d, f, w.d);
  for (ValClass& v : w.vcls) {
    scal(v.acc.data() + m * w.d, f, w.d);
    scal(v.acc_lo.data() + m * v.n_groups, f, v.n_groups);
  }
  w.l[static_cast<size_t>(m)] *= f;
}

// PackedTensor of segment rows for head h: perm/signs offset to head h.
PackedTensor head_tensor(const PackedTensor& t, int64_t h, int64_t d) {
  PackedTensor r = t;
  if (r.perm) r.perm += h * d;
  if (r.signs) r.signs += h * d;
  return r;
}

void check(const TensorView& q, const CacheView& view, const AttentionParams& p, const float* out) {
  VQ_CHECK(
      view.batch >= 1 && view.n_kv_heads >= 1 && view.head_dim >= 1,
      "[attention] expected a view with B, H_kv, D >= 1 but got B=" + std::to_string(view.batch) +
          ", H_kv=" + std::to_string(view.n_kv_heads) + ", D=" + std::to_string(view.head_dim));
  VQ_CHECK(
      q.shape[0] == view.batch && q.shape[1] >= 1 && q.shape[2] >= 0 && q.shape[3] == view.head_dim,
      "[attention] expected q [" + std::to_string(view.batch) + ", H_q, N, " +
          std::to_string(view.head_dim) + "] but got [" + std::to_string(q.shape[0]) + ", " +
          std::to_string(q.shape[1]) + ", " + std::to_string(q.shape[2]) + ", " +
          std::to_string(q.shape[3]) + "]");
  VQ_CHECK(q.shape[1] % view.n_kv_heads == 0,
           "[attention] expected H_q a multiple of H_kv = " + std::to_string(view.n_kv_heads) +
               " but got H_q = " + std::to_string(q.shape[1]));
  VQ_CHECK(q.numel() == 0 || (q.data != nullptr && out != nullptr),
           "[attention] expected q data and an output buffer but got a null pointer");
  VQ_CHECK(p.window >= 0, "[attention] expected window >= 0 but got " + std::to_string(p.window));
  for (size_t s = 0; s < view.segments.size(); ++s) {
    const ViewSegment& seg = view.segments[s];
    VQ_CHECK(seg.n_rows >= 0, "[attention] expected segment rows >= 0");
    if (seg.n_rows == 0) continue;
    if (seg.packed) {
      const PackedSegment& ps = *seg.packed;
      VQ_CHECK(ps.batch == view.batch && ps.n_heads == view.n_kv_heads && ps.n_rows == seg.n_rows &&
                   ps.head_dim == view.head_dim && ps.keys.fmt.head_dim == view.head_dim &&
                   ps.values.fmt.head_dim == view.head_dim && ps.keys.data && ps.values.data,
               "[attention] expected packed segment " + std::to_string(s) +
                   " to match the view's [B, H_kv, n, D]");
    } else {
      const std::array<int64_t, 4> want{view.batch, view.n_kv_heads, seg.n_rows, view.head_dim};
      VQ_CHECK(
          seg.keys.shape == want && seg.values.shape == want && seg.keys.data && seg.values.data,
          "[attention] expected segment " + std::to_string(s) +
              " keys/values of shape [B, H_kv, n_rows, D] with data");
    }
  }
}

// One work item: batch b, KV head kh, queries [i0, i1) of each of the n_rep query heads.
void run_item(const TensorView& q, const CacheView& view, const AttentionParams& p, float scale,
              int64_t b, int64_t kh, int64_t i0, int64_t i1, float* out, Work& w) {
  const int64_t d = view.head_dim, n_hkv = view.n_kv_heads;
  const int64_t n_rep = q.shape[1] / n_hkv, nq = i1 - i0, n_q_all = q.shape[2];
  const int64_t M = n_rep * nq;
  w.m = M;
  w.d = d;
  w.q.resize(static_cast<size_t>(M * d));
  w.qpos.resize(static_cast<size_t>(M));
  for (int64_t r = 0; r < n_rep; ++r)
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t m = r * nq + i;
      float* qm = w.q.data() + m * d;
      const TensorView qv = q;
      if (qv.dtype == DType::kF32 && qv.stride[3] == 1)
        std::memcpy(qm, qv.row(b, kh * n_rep + r, i0 + i), static_cast<size_t>(d) * 4);
      else
        for (int64_t c = 0; c < d; ++c) qm[c] = qv.at(b, kh * n_rep + r, i0 + i, c);
      scal(qm, scale, d);
      w.qpos[static_cast<size_t>(m)] = p.q_pos0 + i0 + i;
    }
  const int64_t qpos_min = p.q_pos0 + i0, qpos_max = p.q_pos0 + i1 - 1;
  w.acc.assign(static_cast<size_t>(M * d), 0.0f);
  w.mx.assign(static_cast<size_t>(M), -std::numeric_limits<float>::infinity());
  w.l.assign(static_cast<size_t>(M), 0.0f);
  w.kcls.clear();
  w.vcls.clear();
  w.logits.resize(static_cast<size_t>(M * kTile));
  w.probs.resize(static_cast<size_t>(M * kTile));
  w.row.resize(static_cast<size_t>(d));
  w.tmp.resize(static_cast<size_t>(d));
  w.pos.resize(static_cast<size_t>(kTile));
  const float neg_inf = -std::numeric_limits<float>::infinity();

  for (const ViewSegment& seg : view.segments) {
    if (seg.n_rows == 0) continue;
    const bool packed = seg.packed != nullptr;
    KeyClass* kc = nullptr;
    ValClass* vc = nullptr;
    PackedTensor pk, pv;
    if (packed) {
      pk = head_tensor(seg.packed->keys, kh, d);
      pv = head_tensor(seg.packed->values, kh, d);
      kc = &key_class(w, pk);
      vc = &val_class(w, pv);
      w.row_lo.resize(static_cast<size_t>(std::max(pk.fmt.n_groups, pv.fmt.n_groups)));
    }
    for (int64_t j0 = 0; j0 < seg.n_rows; j0 += kTile) {
      const int64_t nt = std::min(kTile, seg.n_rows - j0);
      bool any = false;
      for (int64_t t = 0; t < nt; ++t) {
        const int64_t pj = seg.position(b, kh, j0 + t, n_hkv);
        w.pos[static_cast<size_t>(t)] = static_cast<int32_t>(pj);
        const bool vis_some = pj <= qpos_max && (p.window == 0 || qpos_min < pj + p.window);
        any = any || vis_some;
      }
      if (!any) continue;
      // ---- logits [M, nt]
      for (int64_t t = 0; t < nt; ++t) {
        const int64_t pj = w.pos[static_cast<size_t>(t)];
        float* lcol = w.logits.data() + t;  // stride kTile per query
        if (pj > qpos_max || (p.window > 0 && qpos_min >= pj + p.window)) {
          for (int64_t m = 0; m < M; ++m) lcol[m * kTile] = neg_inf;
          continue;
        }
        if (packed) {
          unpack_scaled(pk.record(b, kh, j0 + t), pk.fmt, w.row.data(), w.row_lo.data());
          for (int64_t m = 0; m < M; ++m) {
            const int64_t qp = w.qpos[static_cast<size_t>(m)];
            if (pj > qp || (p.window > 0 && qp >= pj + p.window)) {
              lcol[m * kTile] = neg_inf;
              continue;
            }
            float s = dot(kc->q.data() + m * d, w.row.data(), d);
            const float* qs = kc->qsum.data() + m * kc->n_groups;
            for (int32_t g = 0; g < kc->n_groups; ++g)
              s += w.row_lo[static_cast<size_t>(g)] * qs[g];
            lcol[m * kTile] = s;
          }
        } else {
          const void* kr = seg.keys.row(b, kh, j0 + t);
          const float* krow;
          if (seg.keys.dtype == DType::kF32 && seg.keys.stride[3] == 1) {
            krow = static_cast<const float*>(kr);
          } else {
            if (seg.keys.stride[3] == 1)
              to_f32(kr, seg.keys.dtype, w.row.data(), static_cast<size_t>(d));
            else
              for (int64_t c = 0; c < d; ++c)
                w.row[static_cast<size_t>(c)] = seg.keys.at(b, kh, j0 + t, c);
            krow = w.row.data();
          }
          for (int64_t m = 0; m < M; ++m) {
            const int64_t qp = w.qpos[static_cast<size_t>(m)];
            lcol[m * kTile] = (pj > qp || (p.window > 0 && qp >= pj + p.window))
                                  ? neg_inf
                                  : dot(w.q.data() + m * d, krow, d);
          }
        }
      }
      // ---- online softmax update
      for (int64_t m = 0; m < M; ++m) {
        const float* lr = w.logits.data() + m * kTile;
        float* pr = w.probs.data() + m * kTile;
        float tmax = neg_inf;
        for (int64_t t = 0; t < nt; ++t) tmax = std::max(tmax, lr[t]);
        if (tmax == neg_inf) {
          for (int64_t t = 0; t < nt; ++t) pr[t] = 0.0f;
          continue;
        }
        float& mxm = w.mx[static_cast<size_t>(m)];
        if (tmax > mxm) {
          if (mxm != neg_inf) rescale(w, m, std::exp(mxm - tmax));
          mxm = tmax;
        }
        float sum = 0.0f;
        for (int64_t t = 0; t < nt; ++t) {
          pr[t] = lr[t] == neg_inf ? 0.0f : std::exp(lr[t] - mxm);
          sum += pr[t];
        }
        w.l[static_cast<size_t>(m)] += sum;
      }
      // ---- values
      for (int64_t t = 0; t < nt; ++t) {
        bool used = false;
        for (int64_t m = 0; m < M && !used; ++m)
          used = w.probs[static_cast<size_t>(m * kTile + t)] != 0.0f;
        if (!used) continue;
        if (packed) {
          unpack_scaled(pv.record(b, kh, j0 + t), pv.fmt, w.row.data(), w.row_lo.data());
          for (int64_t m = 0; m < M; ++m) {
            const float pm = w.probs[static_cast<size_t>(m * kTile + t)];
            if (pm == 0.0f) continue;
            axpy(vc->acc.data() + m * d, pm, w.row.data(), d);
            float* al = vc->acc_lo.data() + m * vc->n_groups;
            for (int32_t g = 0; g < vc->n_groups; ++g)
              al[g] += pm * w.row_lo[static_cast<size_t>(g)];
          }
        } else {
          const void* vr = seg.values.row(b, kh, j0 + t);
          const float* vrow;
          if (seg.values.dtype == DType::kF32 && seg.values.stride[3] == 1) {
            vrow = static_cast<const float*>(vr);
          } else {
            if (seg.values.stride[3] == 1)
              to_f32(vr, seg.values.dtype, w.row.data(), static_cast<size_t>(d));
            else
              for (int64_t c = 0; c < d; ++c)
                w.row[static_cast<size_t>(c)] = seg.values.at(b, kh, j0 + t, c);
            vrow = w.row.data();
          }
          for (int64_t m = 0; m < M; ++m) {
            const float pm = w.probs[static_cast<size_t>(m * kTile + t)];
            if (pm != 0.0f) axpy(w.acc.data() + m * d, pm, vrow, d);
          }
        }
      }
    }
  }
  // ---- finalise: un-transform each value class once, normalise
  for (int64_t r = 0; r < n_rep; ++r)
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t m = r * nq + i;
      float* o = out + ((b * q.shape[1] + kh * n_rep + r) * n_q_all + i0 + i) * d;
      const float lm = w.l[static_cast<size_t>(m)];
      if (lm == 0.0f) {
        std::fill(o, o + d, 0.0f);
        continue;
      }
      std::copy(w.acc.begin() + m * d, w.acc.begin() + (m + 1) * d, o);
      for (ValClass& v : w.vcls) {
        float* a = v.acc.data() + m * d;
        const float* al = v.acc_lo.data() + m * v.n_groups;
        for (int64_t c = 0; c < d; ++c) a[c] += al[c / v.group_size];
        if (v.perm) {
          for (int64_t j = 0; j < d; ++j) w.tmp[static_cast<size_t>(v.perm[j])] = a[j];
          std::copy(w.tmp.begin(), w.tmp.end(), a);
        }
        if (v.signs) hadamard_unrotate(a, v.signs, d, v.rot_block);
        for (int64_t c = 0; c < d; ++c) o[c] += a[c];
      }
      scal(o, 1.0f / lm, d);
    }
}

}  // namespace

void attention(const TensorView& q, const CacheView& view, const AttentionParams& p, float* out) {
  check(q, view, p, out);
  const int64_t n_b = q.shape[0], n_hq = q.shape[1], n_q = q.shape[2], d = q.shape[3];
  const int64_t n_hkv = view.n_kv_heads, n_rep = n_hq / n_hkv;
  if (n_q == 0) return;
  const float scale =
      p.scale != 0.0f ? p.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const int64_t q_block = std::max<int64_t>(1, kMaxQueries / n_rep);
  const int64_t n_qb = (n_q + q_block - 1) / q_block;
  const int64_t items = n_b * n_hkv * n_qb;
  std::exception_ptr failure;
#pragma omp parallel if (items > 1)
  {
    Work w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      try {
        const int64_t qb = it % n_qb, kh = (it / n_qb) % n_hkv, b = it / (n_qb * n_hkv);
        const int64_t i0 = qb * q_block, i1 = std::min(n_q, i0 + q_block);
        run_item(q, view, p, scale, b, kh, i0, i1, out, w);
      } catch (...) {
#pragma omp critical(vq_attention_failure)
        if (!failure) failure = std::current_exception();
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
}

DenseView dequantize_view(const CacheView& v, DType dtype) {
  DenseView dv;
  dv.view.batch = v.batch;
  dv.view.n_kv_heads = v.n_kv_heads;
  dv.view.head_dim = v.head_dim;
  const int64_t d = v.head_dim;
  std::vector<float> row(static_cast<size_t>(d));
  for (const ViewSegment& seg : v.segments) {
    if (!seg.packed) {
      dv.view.segments.push_back(seg);
      continue;
    }
    const PackedSegment& ps = *seg.packed;
    auto k = std::make_unique<Tensor>(dtype, v.batch, v.n_kv_heads, seg.n_rows, d);
    auto val = std::make_unique<Tensor>(dtype, v.batch, v.n_kv_heads, seg.n_rows, d);
    const TensorView kv = k->view(), vv = val->view();
    for (int64_t b = 0; b < v.batch; ++b)
      for (int64_t h = 0; h < v.n_kv_heads; ++h)
        for (int64_t i = 0; i < seg.n_rows; ++i) {
          dequantize_row(ps.keys, b, h, i, row.data());
          from_f32(row.data(), kv.row(b, h, i), dtype, static_cast<size_t>(d));
          dequantize_row(ps.values, b, h, i, row.data());
          from_f32(row.data(), vv.row(b, h, i), dtype, static_cast<size_t>(d));
        }
    ViewSegment out = seg;
    out.packed = nullptr;
    out.keys = kv;
    out.values = vv;
    dv.view.segments.push_back(out);
    dv.owned.push_back(std::move(k));
    dv.owned.push_back(std::move(val));
  }
  return dv;
}

}  // namespace vq
