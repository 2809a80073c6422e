// Attention error bounds for the op harness (see attention_bounds.h). u = 2^-24.
#include "ops_harness/attention_bounds.h"

#include <algorithm>
#include <cmath>

#include "ops_harness/harness.h"
#include "veloxquant/dtype.h"
#include "veloxquant/hadamard.h"
#include "veloxquant/packed.h"
#include "veloxquant/tensor.h"

namespace vq::harness {
namespace {

double scale_of(const AttentionParams& ap, int64_t d) {
  return ap.scale != 0.0f ? ap.scale : 1.0 / std::sqrt(static_cast<double>(d));
}

// The relative error of a weight p s_g formed in fp32, then rounded to bf16 (round to nearest
// even, 8 significand bits: u_b = 2^-8).
constexpr double kBf16Weight = 0x1p-8 + kU + 0x1p-8 * kU;

bool visible(int64_t pos, int64_t q_pos, int64_t window) {
  return pos <= q_pos && (window <= 0 || q_pos < pos + window);
}

// One stored row of (b, kv head) as the fused bound needs it.
struct RowInfo {
  int64_t pos = 0;
  std::vector<double> k, v;  // dequantized, original channel order
  bool packed = false;
  double k_l2 = 0, k_l1 = 0;   // of (|c_i s| + |lo|) in stored order (packed)
  double v_max = 0, v_l1 = 0;  // of (|c_i s| + |lo|) (packed)
  bool k_rot = false, v_rot = false;
  int32_t k_block = 0, v_block = 0;
  int32_t k_group = 0, k_groups = 0;  // packed keys: group size and groups per row
  // Packed keys whose kernel rounds the query to int8 per group (PackedKernel::int8_query):
  // sum_{i in g} c_i s_g per group, and the key transform of this head.
  bool k_int8 = false;
  bool k_channel = false;  // channel-axis keys: the general path's depth D + 8
  // Packed values whose kernel rounds the weights p s_g to bf16 (PackedKernel::bf16_values).
  bool v_bf16 = false;
  std::vector<double> k_cs;
  const int32_t* k_perm = nullptr;
  const float* k_signs = nullptr;
};

// Norms of the per-element magnitudes |code * scale| + |lo| of one record.
void magnitudes(const PackedTensor& t, int64_t b, int64_t h, int64_t i, double* l2, double* l1,
                double* mx) {
  const PackedRowFormat& f = t.fmt;
  std::vector<uint8_t> codes(static_cast<size_t>(f.head_dim));
  const uint8_t* rec = t.record(b, h, i);
  unpack_codes(rec, f.head_dim, f.spec, codes.data());
  *l2 = *l1 = *mx = 0;
  // (lo, scale) of stored channel c: its group's in this record, or (channel-axis records,
  // packed.h) channel c's of the run holding row i (row 0 of t without t.runs).
  const uint8_t* run0 = t.record(b, h, channel_run_start(t.runs, t.n_runs, i));
  const auto meta = [&](int64_t c, int k) {
    if (f.axis == QuantAxis::kChannel)
      return double(channel_meta(run0, f.row_stride, f, 2 * c + k));
    return double(meta_load(rec + f.code_bytes, 2 * (c / f.group_size) + k, f.meta));
  };
  for (int64_t c = 0; c < f.head_dim; ++c) {
    const double m = std::fabs(codes[c] * meta(c, 1)) + std::fabs(meta(c, 0));
    *l2 += m * m;
    *l1 += m;
    *mx = std::max(*mx, m);
  }
  *l2 = std::sqrt(*l2);
}

// sum_{i in g} c_i s_g of each group of one record.
std::vector<double> code_scale_sums(const PackedTensor& t, int64_t b, int64_t h, int64_t i) {
  const PackedRowFormat& f = t.fmt;
  std::vector<uint8_t> codes(static_cast<size_t>(f.head_dim));
  const uint8_t* rec = t.record(b, h, i);
  unpack_codes(rec, f.head_dim, f.spec, codes.data());
  std::vector<double> out(static_cast<size_t>(f.n_groups), 0.0);
  for (int64_t c = 0; c < f.head_dim; ++c) {
    const int64_t g = c / f.group_size;
    out[g] += codes[c] * double(meta_load(rec + f.code_bytes, 2 * g + 1, f.meta));
  }
  return out;
}

std::vector<RowInfo> rows_info(const CacheView& view, const CacheView& dense, int64_t b, int64_t h,
                               detail::CpuIsa isa) {
  std::vector<RowInfo> out;
  const int64_t d = view.head_dim;
  for (size_t s = 0; s < view.segments.size(); ++s) {
    const ViewSegment& seg = view.segments[s];
    const ViewSegment& ds = dense.segments[s];
    for (int64_t i = 0; i < seg.n_rows; ++i) {
      RowInfo r;
      r.pos = seg.position(b, h, i, view.n_kv_heads);
      for (int64_t c = 0; c < d; ++c) {
        r.k.push_back(ds.keys.at(b, h, i, c));
        r.v.push_back(ds.values.at(b, h, i, c));
      }
      if (seg.packed) {
        r.packed = true;
        double unused;
        magnitudes(seg.packed->keys, b, h, i, &r.k_l2, &r.k_l1, &unused);
        magnitudes(seg.packed->values, b, h, i, &unused, &r.v_l1, &r.v_max);
        r.k_rot = seg.packed->keys.signs != nullptr;
        r.v_rot = seg.packed->values.signs != nullptr;
        r.k_block = seg.packed->keys.rot_block;
        r.k_group = seg.packed->keys.fmt.group_size;
        r.k_groups = seg.packed->keys.fmt.n_groups;
        const PackedTensor& kt = seg.packed->keys;
        // Channel-axis keys never take the key kernels (fused_attention.cpp's attend_channel:
        // fp32 query times scale, then the general path's dot): no int8 term, and their logit
        // depth (1 + D + 1 + D summands of one sum) is inside the general (D + 8) u.
        r.k_channel = kt.fmt.axis == QuantAxis::kChannel;
        r.k_int8 =
            kt.fmt.axis == QuantAxis::kToken && detail::packed_kernel(kt.fmt, isa).int8_query;
        if (r.k_int8) {
          r.k_cs = code_scale_sums(kt, b, h, i);
          r.k_perm = kt.perm ? kt.perm + h * d : nullptr;
          r.k_signs = kt.signs ? kt.signs + h * d : nullptr;
        }
        r.v_block = seg.packed->values.rot_block;
        r.v_bf16 = detail::packed_kernel(seg.packed->values.fmt, isa).bf16_values;
      }
      out.push_back(std::move(r));
    }
  }
  return out;
}

// Bound on |fused - reference| for every output channel of one query. First order in u:
//  * logit: the fused kernel scales q (1 rounding), forms fp32 products and sums D of them in
//    lanes (<= D u of the absolute sum), adds n_groups lo * qsum terms (within the same absolute
//    sum): |dl| <= scale (D + 8) u sum_i |q'_i| (|c_i s| + |lo|) <= scale (D + 8) u ||q|| ||m||
//    (Cauchy-Schwarz; q' = PRq has q's norm); full-precision rows: scale (D + 8) u sum |q_d k_d|.
//    Rotated keys: the computed q' is within t_q = (log2 b + 2) u ||q||_1 / sqrt(b) of P R q per
//    element (the fast Walsh-Hadamard transform's bound) and the reference's un-rotated key
//    within t_k: R_j = sqrt(D) (t_q ||m|| + ||q|| t_k). The weight exp(l - l_max) is off by
//    u |l - l_max| (the difference) plus the kernel's exp error (<= 1.41 u measured, 2 u
//    allowed), counted as a further logit error; weights below 2^-125 are flushed: an absolute
//    n 2^-125 max|v|.
//  * weights: logits off by <= eps move each normalised weight by a factor in [e^-2eps, e^2eps]:
//    (e^{2 eps} - 1) sum_j w_j |v_jd|.
//  * values: n sequential fp32 accumulations, up to n_tiles rescalings, 1/l and the scale:
//    (n + n_tiles + 8) u sum_j w_j V_j, V_j = |v_jd| (fp) or max_i (|c_i s| + |lo|) (packed);
//    rotated values mix channels in R^T (norm <= sqrt(D) times the largest element); the
//    un-rotation of the sum and the reference's un-rotated values add T_rot each.
//  * bf16 value kernels (PackedKernel::bf16_values, src/ops/packed_decode_bf16.cpp): each weight
//    p s_g is rounded once more, to bf16 (u_b = 2^-8 after the fp32 product's u), its product
//    with the exact code exact and summed in fp32 as above: (u_b + u + u_b u) sum_j w_j V_j
//    more (kBf16Weight), with V_j and the rotation's sqrt(D) as in the values term; weights or
//    sums below 2^-126 flushed to 0 (denormals as zero): at most 2^-126 (2^B + 1) <= 2^-121
//    per such row (the normalised weights' sum l >= 1 only shrinks it).
//  Packed rows in decode (packed_decode_bound: the kernels of src/ops/packed_decode.h compute on
//  the codes): codes are exact in fp32; per group, fp32 FMA partial sums of q'_i c_i over the
//  group (at most g sequential roundings per lane), one FMA by s_g into the lane totals, a lane
//  reduction (log2 16 = 4 roundings), then n_groups additions of lo_g qsum_g (a product and a
//  sum each, qsum_g itself a sum of g terms of q'). Every term of sum_i |q'_i| (|c_i s| + |lo|)
//  passes through at most g + 2 n_groups + 7 roundings: the logit depth is g + 2 n_groups + 7
//  instead of D + 8 (<= D + 8 for g >= 2, so the general bound covers these kernels too). The
//  values keep the general term: p s_g rounded once, then one FMA per row in order, and the
//  offsets' sums p lo_g: (n + n_tiles + 8) u as above.
//  Int8 query kernels (AVX-512 VNNI, PackedKernel::int8_query): q' (the kernel's scaled,
//  transformed fp32 query, recomputed here with the same fp32 operations) is replaced by
//  sq_g q8_i with |q'_i - sq_g q8_i| <= sq_g (1/2 + 127 u), sq_g = fl(max_{i in g} |q'_i| / 127);
//  the integer sums are exact, so the logit moves by at most
//  sum_g sq_g (1/2 + 127 u) sum_{i in g} c_i s_g, added to the row's logit error; the fp32
//  steps after the integer sums (the lane's product by sq_g, the FMA by s_g, the lane sum, the
//  offsets) stay within the depth above.
// The fp32 query of a query row as the packed kernels see it: scaled in fp32 (fscale), rotated,
// permuted (the key class of fused_attention.cpp).
std::vector<float> kernel_query(const std::vector<double>& q, float fscale, const RowInfo& r,
                                int64_t d) {
  std::vector<float> x(static_cast<size_t>(d)), t(static_cast<size_t>(d));
  for (int64_t i = 0; i < d; ++i) x[i] = static_cast<float>(q[i]) * fscale;
  if (r.k_signs) hadamard_rotate(x.data(), r.k_signs, d, r.k_block);
  if (!r.k_perm) return x;
  for (int64_t j = 0; j < d; ++j) t[j] = x[r.k_perm[j]];
  return t;
}

// The int8 query rounding's logit shift bound for row r (see above).
double int8_logit_term(const std::vector<float>& qk, const RowInfo& r, int64_t d) {
  double out = 0;
  for (int32_t g = 0; g < r.k_groups; ++g) {
    float mx = 0.0f;
    for (int64_t i = g * int64_t{r.k_group}; i < std::min<int64_t>(d, (g + 1) * int64_t{r.k_group});
         ++i)
      mx = std::max(mx, std::fabs(qk[i]));
    const double sq = static_cast<double>(mx / 127.0f);
    out += sq * (0.5 + 127 * kU) * r.k_cs[g];
  }
  return out;
}

std::vector<double> bound_for(const std::vector<double>& q, const std::vector<RowInfo>& rows,
                              int64_t q_pos, int64_t window, double scale, float fscale, int64_t d,
                              bool packed_decode) {
  std::vector<const RowInfo*> vis;
  for (const RowInfo& r : rows)
    if (visible(r.pos, q_pos, window)) vis.push_back(&r);
  std::vector<double> out(static_cast<size_t>(d), 0.0);
  if (vis.empty()) return out;
  double q2 = 0, q1 = 0;
  for (double x : q) {
    q2 += x * x;
    q1 += std::fabs(x);
  }
  q2 = std::sqrt(q2);
  std::vector<double> logit(vis.size());
  double lmax = -1e300;
  for (size_t j = 0; j < vis.size(); ++j) {
    double s = 0;
    for (int64_t c = 0; c < d; ++c) s += q[c] * vis[j]->k[c];
    logit[j] = s * scale;
    lmax = std::max(lmax, logit[j]);
  }
  double eps = 0, wsum = 0;
  std::vector<double> w(vis.size());
  std::vector<float> qk;  // kernel_query for the last int8 row's transform
  const int32_t* qk_perm = nullptr;
  const float* qk_signs = nullptr;
  for (size_t j = 0; j < vis.size(); ++j) {
    const RowInfo& r = *vis[j];
    double kterm = 0, rterm = 0;
    if (r.packed) {
      kterm = q2 * r.k_l2;
      if (r.k_rot) {
        const double lb = std::log2(double(r.k_block)) + 2;
        const double tq = lb * kU * q1 / std::sqrt(double(r.k_block));
        const double tk = lb * kU * r.k_l1 / std::sqrt(double(r.k_block));
        rterm = std::sqrt(double(d)) * (tq * r.k_l2 + q2 * tk);
      }
    } else {
      for (int64_t c = 0; c < d; ++c) kterm += std::fabs(q[c] * r.k[c]);
    }
    const double depth = packed_decode && r.packed && !r.k_channel
                             ? r.k_group + 2.0 * r.k_groups + 7
                             : static_cast<double>(d + 8);
    if (r.k_int8) {
      if (r.k_perm != qk_perm || r.k_signs != qk_signs || qk.empty()) {
        qk = kernel_query(q, fscale, r, d);
        qk_perm = r.k_perm;
        qk_signs = r.k_signs;
      }
      rterm += int8_logit_term(qk, r, d) / scale;  // rterm is scaled by scale below
    }
    eps =
        std::max(eps, scale * (depth * kU * kterm + rterm) + kU * (std::fabs(logit[j] - lmax) + 2));
    w[j] = std::exp(logit[j] - lmax);
    wsum += w[j];
  }
  const double n = double(vis.size()), n_tiles = std::ceil(n / 32.0) + 1;
  const double gamma = (n + n_tiles + 8) * kU;
  double vmax = 0;
  for (const RowInfo* r : vis)
    for (double x : r->v) vmax = std::max(vmax, std::fabs(x));
  double n_bf16 = 0;  // rows whose values take bf16 weights, and their flush term's factor
  for (const RowInfo* r : vis)
    if (r->v_bf16) n_bf16 += r->v_rot ? std::sqrt(double(d)) : 1.0;
  for (int64_t c = 0; c < d; ++c) {
    double a = 0, bterm = 0, trot = 0, bf = 0;
    for (size_t j = 0; j < vis.size(); ++j) {
      const RowInfo& r = *vis[j];
      const double wj = w[j] / wsum;
      a += wj * std::fabs(r.v[c]);
      if (r.packed) {
        const double vb = wj * r.v_max * (r.v_rot ? std::sqrt(double(d)) : 1.0);
        bterm += vb;
        if (r.v_bf16) bf += vb;
        if (r.v_rot)
          trot +=
              wj * (std::log2(double(r.v_block)) + 2) * kU * r.v_l1 / std::sqrt(double(r.v_block));
      } else {
        bterm += wj * std::fabs(r.v[c]);
      }
    }
    out[c] = std::expm1(2 * eps) * a + gamma * bterm + 2 * trot + n * 0x1p-125 * vmax +
             kBf16Weight * bf + n_bf16 * 0x1p-121;
  }
  return out;
}

}  // namespace

std::vector<double> attention_ref(const CacheView& dense, const std::vector<float>& q, int64_t hq,
                                  int64_t n_q, const AttentionParams& ap) {
  const int64_t d = dense.head_dim;
  Tensor qt(DType::kF32, dense.batch, hq, n_q, d);
  std::copy(q.begin(), q.end(), static_cast<float*>(qt.data()));
  std::vector<float> out(q.size());
  attention_reference(qt.view(), dense, ap, out.data());
  return std::vector<double>(out.begin(), out.end());
}

namespace {

std::vector<double> fused_bound(const CacheView& view, const CacheView& dense,
                                const std::vector<float>& q, int64_t hq, int64_t n_q,
                                const AttentionParams& ap, bool packed_decode, detail::CpuIsa isa) {
  const int64_t B = view.batch, H = view.n_kv_heads, D = view.head_dim, rep = hq / H;
  const double scale = scale_of(ap, D);
  // vq::attention's fp32 scale (1/sqrt(D) computed in double, then rounded)
  const float fscale =
      ap.scale != 0.0f ? ap.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  std::vector<double> out(q.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kh = 0; kh < H; ++kh) {
      const auto rows = rows_info(view, dense, b, kh, isa);
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t i = 0; i < n_q; ++i) {
          const int64_t qh = kh * rep + r;
          const size_t at = static_cast<size_t>(((b * hq + qh) * n_q + i) * D);
          const std::vector<double> qv(q.begin() + at, q.begin() + at + D);
          const auto bd =
              bound_for(qv, rows, ap.q_pos0 + i, ap.window, scale, fscale, D, packed_decode);
          // The reference itself (fp32 products, double sums) is rounded once: u |ref| is part
          // of bound_for's value term already (gamma's + 8).
          std::copy(bd.begin(), bd.end(), out.begin() + at);
        }
    }
  return out;
}

}  // namespace

std::vector<double> fused_cpu_bound(const CacheView& view, const CacheView& dense,
                                    const std::vector<float>& q, int64_t hq, int64_t n_q,
                                    const AttentionParams& ap) {
  // Decode-sized calls (< 8 queries per head: fused_attention.cpp's kManyQueries) run packed
  // rows through the packed decode kernels of attention_isa(): their int8 query term applies.
  const detail::CpuIsa isa = n_q < 8 ? detail::attention_isa() : detail::CpuIsa::kPortable;
  return fused_bound(view, dense, q, hq, n_q, ap, false, isa);
}

std::vector<double> packed_decode_bound(const CacheView& view, const CacheView& dense,
                                        const std::vector<float>& q, int64_t hq, int64_t n_q,
                                        const AttentionParams& ap, detail::CpuIsa isa) {
  return fused_bound(view, dense, q, hq, n_q, ap, true, isa);
}

// CUDA kernels, per output element (b, qh, i, d), V = max |v| over the visible rows, n their
// count (as tests/cuda/attention_check.h):
//  * kDecode: logit error scale gamma(D + log2 D + 3D/8 + 8) ||q|| ||k|| + 4u |logit| + 2^-22
//    (fp32 products, split-K partial sums, fp16 hi + lo splits of q and p on tensor cores whose
//    products are exact, exp2 of log2e-scaled logits within 2 ulp); sums 2 gamma(9n/8 + 64) V
//    (n fma terms, per-tile rescales, the split merge, the final division); plus the 16-bit
//    operand terms of attention_bounds.h (kGpu* of operands' type).
//  * kPrefillTc (tensor-core prefill): kDecode's terms plus, per key, scale (1 + 2^-10)
//    sum_d |q_d| |dk_d| in its logit error and (1 + 2^-10) max_j |dv_jd| per output channel,
//    the rounding of operands not exact in the operand type (attention_bounds.h).
//  * kPrefill (CUDA-core prefill): a logit is an fp32 fma chain of D products (gamma(D)
//    ||q|| ||k||) times the rounded scale (4u |logit|); the exponent s - m rounded once (2u L, L
//    the largest |logit|); expf within 2 ulp and one rescale per 32 keys: 2^-22 (n/32 + 2);
//    sums 2 gamma(n + n/32 + 4) V.
//  Logit shifts bounded by delta move each normalised weight by a factor within e^(+-2 delta):
//  output error (e^(2 delta) - 1) V. The reference's own rounding adds 2^-23 |ref|.
DType tc_operands(const CacheView& view) {
  for (const ViewSegment& s : view.segments)
    if (!s.packed && s.n_rows > 0 && s.keys.dtype == DType::kBF16) return DType::kBF16;
  return DType::kF16;
}

namespace {

// |fl_E(x) - x| bounded as kPrefillTc's derivation has it (attention_bounds.h): 0 where x is
// exact in the operand type E, else u_E |x| + s_E.
double operand_rounding(float x, DType operands) {
  uint16_t h = 0;
  float back = 0;
  from_f32(&x, &h, operands, 1);
  to_f32(&h, operands, &back, 1);
  if (back == x) return 0.0;
  return operands == DType::kBF16 ? 0x1p-8 * std::abs(double(x)) + 0x1p-134
                                  : 0x1p-11 * std::abs(double(x)) + 0x1p-25;
}

}  // namespace

std::vector<double> gpu_attention_bound(const CacheView& dense, const std::vector<float>& q,
                                        int64_t hq, int64_t n_q, const AttentionParams& ap,
                                        GpuAttnKernel kern, DType operands,
                                        const std::vector<double>& ref) {
  const int64_t B = dense.batch, H = dense.n_kv_heads, D = dense.head_dim, G = hq / H;
  const bool bf16 = operands == DType::kBF16;
  const bool cuda_core = kern == GpuAttnKernel::kPrefill;
  const bool rounded = kern == GpuAttnKernel::kPrefillTc;
  const double logit_rel = bf16 ? kGpuBf16LogitRel : kGpuLogitRel;
  const double value_rel = bf16 ? kGpuBf16ValueRel : kGpuValueRel;
  const double scale = scale_of(ap, D);
  const double log2d = std::log2(static_cast<double>(D));
  // kPrefillTc: the operand roundings dk, dv of every stored element, per segment
  // [(b H + h) n_rows + j][d]
  std::vector<std::vector<double>> dks(dense.segments.size()), dvs(dense.segments.size());
  if (rounded)
    for (size_t si = 0; si < dense.segments.size(); ++si) {
      const ViewSegment& s = dense.segments[si];
      dks[si].resize(static_cast<size_t>(B * H * s.n_rows * D));
      dvs[si].resize(dks[si].size());
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t j = 0; j < s.n_rows; ++j)
            for (int64_t d = 0; d < D; ++d) {
              const size_t e = static_cast<size_t>(((b * H + h) * s.n_rows + j) * D + d);
              dks[si][e] = operand_rounding(s.keys.at(b, h, j, d), operands);
              dvs[si][e] = operand_rounding(s.values.at(b, h, j, d), operands);
            }
    }
  std::vector<double> out(q.size());
  std::vector<double> dv_max(static_cast<size_t>(D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t qh = 0; qh < hq; ++qh)
      for (int64_t i = 0; i < n_q; ++i) {
        const int64_t kh = qh / G, qpos = ap.q_pos0 + i;
        const float* qr = q.data() + ((b * hq + qh) * n_q + i) * D;
        double qn = 0;
        for (int64_t d = 0; d < D; ++d) qn += static_cast<double>(qr[d]) * qr[d];
        qn = std::sqrt(qn);
        double vmax = 0, big = 0;
        std::fill(dv_max.begin(), dv_max.end(), 0.0);
        std::vector<double> kns, dots, rks;
        for (size_t si = 0; si < dense.segments.size(); ++si) {
          const ViewSegment& s = dense.segments[si];
          for (int64_t j = 0; j < s.n_rows; ++j) {
            if (!visible(s.position(b, kh, j, H), qpos, ap.window)) continue;
            double kn = 0, dot = 0, rk = 0;
            const size_t e0 = static_cast<size_t>(((b * H + kh) * s.n_rows + j) * D);
            for (int64_t d = 0; d < D; ++d) {
              const double kv = s.keys.at(b, kh, j, d);
              kn += kv * kv;
              dot += kv * qr[d];
              vmax = std::max(vmax, std::abs(static_cast<double>(s.values.at(b, kh, j, d))));
              if (rounded) {
                rk += std::abs(static_cast<double>(qr[d])) * dks[si][e0 + d];
                dv_max[d] = std::max(dv_max[d], dvs[si][e0 + d]);
              }
            }
            kns.push_back(std::sqrt(kn));
            dots.push_back(dot * scale);
            rks.push_back(scale * (1 + 0x1p-10) * rk);
            big = std::max(big, std::abs(dot * scale));
          }
        }
        const double n_vis = static_cast<double>(kns.size());
        double delta = 0;
        for (size_t j = 0; j < kns.size(); ++j) {
          const double dj =
              !cuda_core
                  ? scale * (gamma_n(D + log2d + 3.0 * D / 8 + 8) + logit_rel) * qn * kns[j] +
                        4 * kU * std::abs(dots[j]) + 0x1p-22 + rks[j]
                  : scale * gamma_n(static_cast<double>(D)) * qn * kns[j] +
                        4 * kU * std::abs(dots[j]) + 2 * kU * big + 0x1p-22 * (n_vis / 32 + 2);
          delta = std::max(delta, dj);
        }
        const double sum_terms = !cuda_core ? 9.0 * n_vis / 8 + 64 : n_vis + n_vis / 32 + 4;
        for (int64_t d = 0; d < D; ++d) {
          const size_t e = static_cast<size_t>(((b * hq + qh) * n_q + i) * D + d);
          out[e] = std::expm1(2 * delta) * vmax + 2 * gamma_n(sum_terms) * vmax +
                   (!cuda_core ? value_rel * vmax : 0.0) +
                   (kern == GpuAttnKernel::kDecode ? kGpuValueAbs : 0.0) +
                   (1 + 0x1p-10) * dv_max[d] + 0x1p-23 * std::abs(ref[e]) + 1e-30;
        }
      }
  return out;
}

}  // namespace vq::harness
