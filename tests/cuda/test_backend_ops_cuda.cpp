// The CUDA part of the op harness (tests/test_backend_ops.cpp is the CPU part): every CUDA op
// against the same CPU references over the same tables (tests/ops_harness/tables.h), each with
// its declared metric: decode_attention (N = 1, automatic and forced small splits) and
// prefill_attention against attention_reference within the bounds of
// tests/ops_harness/attention_bounds.h; skvq_quantize_rows against the CPU flush path (to fp32,
// rotate, permute, quantize_to_records; channel-axis chunks: quantize_chunk_to_records) byte for
// byte; skvq_channel_perms against a stable sort;
// snap_scores within a derived bound of the double references; snap_pool, snap_select (seed and
// keep-window rules) and gather_rows exact. Skipped cleanly without a device (SKIP_WITHOUT_DEVICE).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "ops_harness/attention_bounds.h"
#include "ops_harness/harness.h"
#include "ops_harness/tables.h"
#include "ops_harness/views.h"
#include "util/test_util.h"
#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/error.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/hadamard.h"
#include "veloxquant/key_rounding.h"
#include "veloxquant/packed.h"
#include "veloxquant/snapkv.h"

namespace vq {
namespace {

using harness::Check;
using harness::kU;
using harness::Vars;

std::vector<float> gaussian(int64_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = nd(rng);
  return v;
}

// ---- attention --------------------------------------------------------------------------------

TEST(BackendOpsCuda, DecodeAttention) {
  SKIP_WITHOUT_DEVICE();
  uint64_t seed = 1;
  for (const harness::AttnCase& c : harness::attention_cases(harness::small_sweep())) {
    ++seed;
    if (c.n_q != 1) continue;
    const auto hv = harness::make_view(c.batch, c.n_kv_heads, c.head_dim, c.segs, seed);
    const cuda::DeviceCacheView dv = cuda::DeviceCacheView::upload(hv->view);
    const DenseView dense = dequantize_view(hv->view, DType::kF32);
    const int64_t hq = c.n_kv_heads * c.n_rep;
    AttentionParams ap;
    ap.q_pos0 = std::max<int64_t>(hv->span - 1, 0) + c.q_shift;
    ap.window = c.window;
    const auto q = gaussian(c.batch * hq * c.head_dim, seed * 7 + 1, 1.5f);
    const auto ref = harness::attention_ref(dense.view, q, hq, 1, ap);
    // bf16 rows (alone or beside packed rows) take the tensor-core kernel's bf16-row instances:
    // bf16 operands, the bf16 terms of the bound
    const DType ops = harness::tc_operands(hv->view);
    const auto bound = harness::gpu_attention_bound(dense.view, q, hq, 1, ap,
                                                    harness::GpuAttnKernel::kDecode, ops, ref);
    // groups of 16: also the 16-head block forced (the automatic plan gives small packed views
    // blocks of 8)
    const int n_pass = c.n_rep % 16 == 0 ? 4 : 2;
    for (int pass = 0; pass < n_pass; ++pass) {
      const int64_t split = pass % 2 ? 16 : 0;
      cuda::DecodeOptions opt;
      opt.rows_per_split = split;
      opt.heads_per_block = pass >= 2 ? 16 : 0;
      const auto got = cuda::decode_attention_host(q, hq, dv, ap, opt);
      Check k("decode_attention", "cuda",
              c.vars() + ",split=" + std::to_string(split) + (pass >= 2 ? ",heads=16" : "") +
                  ",operands=" + dtype_name(ops));
      if (c.q_shift >= 500) {
        k.allow_zero_reference();
        k.exact(got, std::vector<float>(got.size(), 0.0f), "out");
        continue;
      }
      k.bounded(got, ref, bound, "out");
    }
  }
}

// Every harness case of prefill attention through the kernel the view takes; tag names the pass.
void prefill_cases(const std::string& tag) {
  uint64_t seed = 1;
  for (const harness::AttnCase& c : harness::attention_cases(harness::small_sweep())) {
    ++seed;
    const auto hv = harness::make_view(c.batch, c.n_kv_heads, c.head_dim, c.segs, seed);
    const cuda::DeviceCacheView dv = cuda::DeviceCacheView::upload(hv->view);
    const DenseView dense = dequantize_view(hv->view, DType::kF32);
    const int64_t hq = c.n_kv_heads * c.n_rep;
    AttentionParams ap;
    ap.q_pos0 = std::max<int64_t>(hv->span - c.n_q, 0) + c.q_shift;
    ap.window = c.window;
    const auto q = gaussian(c.batch * hq * c.n_q * c.head_dim, seed * 7 + 1, 1.5f);
    // The kernel the view takes (cuda_cache.h): full-precision rows all f16 or all bf16 (fp16 or
    // bf16 operands) beside any packed records -> tensor cores, held to the tensor-core prefill
    // bound of that operand type (kPrefillTc: packed rows rounded once to it); f32 rows or f16
    // beside bf16 -> CUDA cores (kPrefill).
    const bool tc = c.all_fp_dtype(DType::kF16) || c.all_fp_dtype(DType::kBF16);
    const DType ops = harness::tc_operands(hv->view);
    bool supported = tc;
    if (!tc) {
      supported = true;
      for (const harness::SegSpec& s : c.segs)
        if (s.packed && (s.pk.rot || s.pk.kbits == 1.5 || s.pk.vbits == 1.5)) supported = false;
    }
    Check k(
        "prefill_attention", "cuda",
        c.vars() + (tc ? std::string(",path=tc,operands=") + dtype_name(ops) : ",path=cc") + tag);
    if (!supported) {  // documented refusal: rotation / 1.5-bit codes need the tensor-core path
      bool threw = false;
      try {
        (void)cuda::prefill_attention_host(q, hq, c.n_q, dv, ap);
      } catch (const Error&) {
        threw = true;
      }
      k.allow_zero_reference();
      k.exact(std::vector<uint8_t>{threw}, std::vector<uint8_t>{1}, "refused with vq::Error");
      continue;
    }
    const auto got = cuda::prefill_attention_host(q, hq, c.n_q, dv, ap);
    if (c.q_shift >= 500) {
      k.allow_zero_reference();
      k.exact(got, std::vector<float>(got.size(), 0.0f), "out");
      continue;
    }
    const auto ref = harness::attention_ref(dense.view, q, hq, c.n_q, ap);
    k.bounded(
        got, ref,
        harness::gpu_attention_bound(
            dense.view, q, hq, c.n_q, ap,
            tc ? harness::GpuAttnKernel::kPrefillTc : harness::GpuAttnKernel::kPrefill, ops, ref),
        "out");
  }
}

// On an sm_90 device (and an sm_90a build) f16 and bf16 views at D 128 take the wgmma kernel
// (src/cuda/prefill_wg.cu); the second pass holds the mma.sync kernel (src/cuda/prefill_fa.cu),
// which every other device takes, to the same bounds.
TEST(BackendOpsCuda, PrefillAttention) {
  SKIP_WITHOUT_DEVICE();
  prefill_cases("");
  ::setenv("VQ_PREFILL_MMA_SYNC", "1", 1);
  prefill_cases(",kernel=mma.sync");
  ::unsetenv("VQ_PREFILL_MMA_SYNC");
}

// ---- SKVQ flush -------------------------------------------------------------------------------

// The quantizer settings of a harness case and the transforms its rows go through: a shuffled
// permutation per head (drawn from rng) and Hadamard signs, as the case asks.
struct QuantSetup {
  GroupQuantParams gp;
  std::vector<int32_t> perm;
  std::vector<float> signs;
  int32_t block = 0;
};
QuantSetup quant_setup(const harness::QuantCase& c, int64_t H, int64_t D, uint64_t seed,
                       std::mt19937_64& rng) {
  QuantSetup q;
  q.gp.bits = c.bits;
  q.gp.group_size = c.group;
  q.gp.meta = c.meta;
  q.gp.clip_search = c.clip;
  q.gp.clip_alpha = c.clip ? 1.0f : 0.9f;
  q.gp.clip_floor = c.clip_floor;
  if (c.perm) {
    q.perm.resize(static_cast<size_t>(H * D));
    for (int64_t h = 0; h < H; ++h) {
      std::iota(q.perm.begin() + h * D, q.perm.begin() + (h + 1) * D, 0);
      std::shuffle(q.perm.begin() + h * D, q.perm.begin() + (h + 1) * D, rng);
    }
  }
  q.block = c.rot ? static_cast<int32_t>(hadamard_block(D)) : 0;
  if (c.rot) q.signs = hadamard_signs(seed, H * D);
  return q;
}

TEST(BackendOpsCuda, SkvqQuantizeRows) {
  SKIP_WITHOUT_DEVICE();
  uint64_t seed = 100;
  for (const harness::QuantCase& c : harness::quant_cases(harness::small_sweep())) {
    ++seed;
    const int64_t B = 1, H = 2, n = c.n, D = c.d;
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> xf(static_cast<size_t>(B * H * n * D));
    for (size_t i = 0; i < xf.size(); ++i)
      xf[i] = (i / static_cast<size_t>(D)) % 9 == 4 ? 0.0f : nd(rng) * (1.0f + (i % 7));
    std::vector<uint8_t> rows(xf.size() * dtype_size(c.in_dtype));
    from_f32(xf.data(), rows.data(), c.in_dtype, xf.size());
    to_f32(rows.data(), c.in_dtype, xf.data(), xf.size());  // the values the device sees
    const PackedRowFormat f = make_row_format(D, c.bits, c.group, c.meta);
    const QuantSetup qs = quant_setup(c, H, D, seed, rng);
    const GroupQuantParams& gp = qs.gp;
    const std::vector<int32_t>& perm = qs.perm;
    const std::vector<float>& signs = qs.signs;
    const int32_t block = qs.block;
    // CPU flush path: rotate, permute (transform_row), quantize_to_records.
    PackedTensor t;
    t.fmt = f;
    t.perm = c.perm ? perm.data() : nullptr;
    t.signs = c.rot ? signs.data() : nullptr;
    t.rot_block = block;
    const size_t nbytes = static_cast<size_t>(B * H * n * f.row_stride);
    std::vector<uint8_t> want(nbytes, 0);
    std::vector<float> row(static_cast<size_t>(D)), tmp(row.size());
    for (int64_t r = 0; r < B * H * n; ++r) {
      std::copy(xf.begin() + r * D, xf.begin() + (r + 1) * D, row.begin());
      if (t.transformed()) transform_row(t, (r / n) % H, row.data(), tmp.data());
      quantize_to_records(row.data(), 1, f, gp, want.data() + r * f.row_stride, f.row_stride,
                          false);
    }
    cuda::DeviceBuffer drows = cuda::DeviceBuffer::from_host(rows.data(), rows.size());
    cuda::DeviceBuffer dperm =
        perm.empty() ? cuda::DeviceBuffer() : cuda::DeviceBuffer::from_vector(perm);
    cuda::DeviceBuffer dsigns =
        signs.empty() ? cuda::DeviceBuffer() : cuda::DeviceBuffer::from_vector(signs);
    cuda::DeviceBuffer out(std::max<size_t>(nbytes, 1));
    out.fill_zero();
    cuda::skvq_quantize_rows(TensorView::contiguous(drows.data(), c.in_dtype, B, H, n, D), f, gp,
                             dperm.as<int32_t>(), dsigns.as<float>(), block, out.as<uint8_t>());
    cuda::synchronize();
    Check k("skvq_quantize_rows", "cuda", c.vars());
    k.exact(out.to_vector<uint8_t>(nbytes), want, "records");
  }
}

// Key rounding factors (veloxquant/key_rounding.h) of H heads of anisotropic moments
// (test::aniso_moments), so that the feedback moves codes away from round-to-nearest.
std::vector<double> aniso_factors(int64_t H, int64_t D, uint64_t seed) {
  std::vector<double> u(static_cast<size_t>(H * D * D));
  for (int64_t h = 0; h < H; ++h) {
    const std::vector<double> m = test::aniso_moments(D, seed + static_cast<uint64_t>(h));
    const std::vector<double> uh = key_rounding_factor(m.data(), D);
    std::copy(uh.begin(), uh.end(), u.begin() + h * D * D);
  }
  return u;
}

// Channel-axis chunks (skvq_key_axis=channel): each (b, h)'s n rows are one chunk, stored
// channel c over them one group of n values; records with the chunk's metadata list spread over
// its first records (packed.h). Against the CPU flush path (to fp32, rotate, permute,
// quantize_chunk_to_records) byte for byte, every table case with n large enough to hold the
// list (the format's metadata slots follow from min_chunk_rows = n, so every n >= 1 does; the
// short ones give 2D slots per record). Every other case rounds its codes by error feedback on
// anisotropic factors (skvq_query_moments_file), the device's warp per row against
// key_feedback_codes; most feedback cases must change some codes against round-to-nearest (so
// that a device ignoring the factors would fail; a chunk of two rows may sit on its grid). Exact.
TEST(BackendOpsCuda, SkvqQuantizeChannelChunks) {
  SKIP_WITHOUT_DEVICE();
  uint64_t seed = 700;
  int fb_cases = 0, fb_changed = 0;
  for (const harness::QuantCase& c : harness::quant_cases(harness::small_sweep())) {
    ++seed;
    const int64_t B = 2, H = 2, n = c.n, D = c.d;
    if (n < 1) continue;
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> xf(static_cast<size_t>(B * H * n * D));
    // outlier channels (x (1 + c % 7)) and a zero channel 4: the per-channel groups see both
    for (size_t i = 0; i < xf.size(); ++i) {
      const size_t ch = i % static_cast<size_t>(D);
      xf[i] = ch == 4 ? 0.0f : nd(rng) * (1.0f + (ch % 7));
    }
    std::vector<uint8_t> rows(xf.size() * dtype_size(c.in_dtype));
    from_f32(xf.data(), rows.data(), c.in_dtype, xf.size());
    to_f32(rows.data(), c.in_dtype, xf.data(), xf.size());  // the values the device sees
    const PackedRowFormat f = make_channel_row_format(D, c.bits, n, c.meta);
    const QuantSetup qs = quant_setup(c, H, D, seed, rng);  // gp.group_size unused here
    const GroupQuantParams& gp = qs.gp;
    const std::vector<int32_t>& perm = qs.perm;
    const std::vector<float>& signs = qs.signs;
    const int32_t block = qs.block;
    PackedTensor t;
    t.fmt = f;
    t.perm = c.perm ? perm.data() : nullptr;
    t.signs = c.rot ? signs.data() : nullptr;
    t.rot_block = block;
    const bool feedback = seed % 2 == 0;
    const std::vector<double> ku = feedback ? aniso_factors(H, D, seed) : std::vector<double>{};
    const size_t nbytes = static_cast<size_t>(B * H * n * f.row_stride);
    std::vector<uint8_t> want(nbytes, 0), nearest(nbytes, 0);
    std::vector<float> chunk(static_cast<size_t>(n * D)), tmp(static_cast<size_t>(D));
    for (int64_t fr = 0; fr < B * H; ++fr) {
      std::copy(xf.begin() + fr * n * D, xf.begin() + (fr + 1) * n * D, chunk.begin());
      if (t.transformed())
        for (int64_t i = 0; i < n; ++i) transform_row(t, fr % H, chunk.data() + i * D, tmp.data());
      uint8_t* at = want.data() + fr * n * f.row_stride;
      quantize_chunk_to_records(chunk.data(), n, f, gp, at, f.row_stride,
                                feedback ? ku.data() + (fr % H) * D * D : nullptr);
      if (feedback)
        quantize_chunk_to_records(chunk.data(), n, f, gp, nearest.data() + fr * n * f.row_stride,
                                  f.row_stride);
    }
    if (feedback) {
      ++fb_cases;
      fb_changed += want != nearest;
    }
    cuda::DeviceBuffer drows = cuda::DeviceBuffer::from_host(rows.data(), rows.size());
    cuda::DeviceBuffer dperm =
        perm.empty() ? cuda::DeviceBuffer() : cuda::DeviceBuffer::from_vector(perm);
    cuda::DeviceBuffer dsigns =
        signs.empty() ? cuda::DeviceBuffer() : cuda::DeviceBuffer::from_vector(signs);
    cuda::DeviceBuffer out(std::max<size_t>(nbytes, 1));
    out.fill_zero();
    cuda::DeviceBuffer dku = feedback ? cuda::DeviceBuffer::from_vector(ku) : cuda::DeviceBuffer();
    cuda::skvq_quantize_rows(TensorView::contiguous(drows.data(), c.in_dtype, B, H, n, D), f, gp,
                             dperm.as<int32_t>(), dsigns.as<float>(), block, out.as<uint8_t>(),
                             nullptr, dku.as<const double>());
    cuda::synchronize();
    Check k("skvq_quantize_rows channel-axis", "cuda",
            c.vars() + (feedback ? ",feedback=1" : ",feedback=0"));
    k.exact(out.to_vector<uint8_t>(nbytes), want, "records");
  }
  EXPECT_GT(2 * fb_changed, fb_cases)
      << fb_changed << " of " << fb_cases << " feedback cases changed codes";
}

// Channel permutations: stable ascending sort of each head's channels by range (max - min in
// fp32, pooled over batch and rows; a NaN range sorts last as +inf; ties keep the lower channel),
// written here from the contract in cuda.h. Exact. Rows carry tied channels (a copy, two
// constants) and a NaN in the first row of one head.
std::vector<int32_t> perms_ref(const std::vector<float>& x, int64_t B, int64_t H, int64_t n,
                               int64_t D) {
  std::vector<int32_t> out;
  for (int64_t h = 0; h < H; ++h) {
    std::vector<float> mn(static_cast<size_t>(D)), mx(static_cast<size_t>(D));
    bool first = true;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t d = 0; d < D; ++d) {
          const float v = x[static_cast<size_t>(((b * H + h) * n + i) * D + d)];
          mn[d] = first ? v : std::min(mn[d], v);
          mx[d] = first ? v : std::max(mx[d], v);
        }
        first = false;
      }
    std::vector<float> range(static_cast<size_t>(D));
    for (int64_t d = 0; d < D; ++d) {
      const float r = mx[d] - mn[d];
      range[d] = std::isnan(r) ? std::numeric_limits<float>::infinity() : r;
    }
    std::vector<int32_t> p(static_cast<size_t>(D));
    std::iota(p.begin(), p.end(), 0);
    std::stable_sort(p.begin(), p.end(), [&](int32_t a, int32_t c) { return range[a] < range[c]; });
    out.insert(out.end(), p.begin(), p.end());
  }
  return out;
}

TEST(BackendOpsCuda, SkvqChannelPerms) {
  SKIP_WITHOUT_DEVICE();
  uint64_t seed = 300;
  for (int64_t n : harness::seq_lens(harness::small_sweep()))
    for (int64_t D : {64, 128})
      for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
        const int64_t B = 2, H = 3;
        auto x = gaussian(B * H * n * D, ++seed);
        for (int64_t r = 0; r < B * H * n; ++r) {
          float* row = x.data() + r * D;
          row[7] = row[3];
          row[11] = row[12] = 0.5f;
          if (r == n) row[20] = std::numeric_limits<float>::quiet_NaN();  // head 1, row 0
        }
        std::vector<uint8_t> rows(x.size() * dtype_size(dt));
        from_f32(x.data(), rows.data(), dt, x.size());
        to_f32(rows.data(), dt, x.data(), x.size());
        cuda::DeviceBuffer d = cuda::DeviceBuffer::from_host(rows.data(), rows.size());
        cuda::DeviceBuffer p(static_cast<size_t>(H * D) * 4);
        cuda::skvq_channel_perms(TensorView::contiguous(d.data(), dt, B, H, n, D), p.as<int32_t>());
        cuda::synchronize();
        Check k("skvq_channel_perms", "cuda",
                Vars()("n", n)("D", D)("dtype", dtype_name(dt)).str());
        k.exact(p.to_vector<int32_t>(static_cast<size_t>(H * D)), perms_ref(x, B, H, n, D), "perm");
      }
}

// ---- SnapKV -----------------------------------------------------------------------------------

// Relative bound of a device score against the double reference: logits are fp32 dot products
// (or fp16 hi + lo splits with exact products on tensor cores), |dl| <= scale gamma(D + 1)
// sum |q k| + u |l|; logit shifts move each probability by e^(+-2 dl); per-tile fp32 sums of 64
// terms combined in double with expf factors (2 ulp), 1/Z, exp(l - M) and the product add
// gamma(72) + 2^-20; the fp32 rounding of the mean u.
double score_rel_tol(const std::vector<float>& keys, const float* q, int64_t n, int64_t w,
                     int64_t d) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double worst = 0;
  for (int64_t i = 0; i < w; ++i) {
    double di = 0;
    for (int64_t j = 0; j < n; ++j) {
      double a = 0, dot = 0;
      for (int64_t c = 0; c < d; ++c) {
        a += std::abs(static_cast<double>(q[i * d + c]) * keys[j * d + c]);
        dot += static_cast<double>(q[i * d + c]) * keys[j * d + c];
      }
      di = std::max(di, scale * harness::gamma_n(double(d + 1)) * a + kU * std::abs(dot * scale));
    }
    worst = std::max(worst, std::expm1(2 * di));
  }
  return worst + harness::gamma_n(72) + 0x1p-20 + kU;
}

TEST(BackendOpsCuda, SnapScores) {
  SKIP_WITHOUT_DEVICE();
  uint64_t seed = 500;
  const DType dtypes[] = {DType::kF16, DType::kBF16, DType::kF32};
  int idx = 0;
  for (int64_t n : harness::seq_lens(harness::small_sweep()))
    for (int64_t d : {64, 128})
      for (int64_t w : {1, 8, 32})
        for (int64_t n_rep : {0, 1, 4, 8}) {
          ++seed;
          if ((n_rep == 8 && d == 64) || (n_rep == 1 && w == 8)) continue;
          const DType dt = dtypes[idx++ % 3];
          const int64_t B = 1, H = 2, F = B * H;
          const auto kf = gaussian(F * n * d, seed);
          std::vector<uint8_t> kb(kf.size() * dtype_size(dt));
          from_f32(kf.data(), kb.data(), dt, kf.size());
          std::vector<float> keys(kf.size());
          to_f32(kb.data(), dt, keys.data(), keys.size());
          cuda::DeviceBuffer dk = cuda::DeviceBuffer::from_host(kb.data(), kb.size());
          const TensorView kv = TensorView::contiguous(dk.data(), dt, B, H, n, d);
          const int64_t wq = n_rep == 0 ? std::clamp<int64_t>(w, 1, n) : w;
          const auto q = gaussian(F * std::max<int64_t>(n_rep, 1) * wq * d, seed + 1);
          std::vector<int32_t> kpos(static_cast<size_t>(F * n)), qpos(static_cast<size_t>(wq));
          for (int64_t f = 0; f < F; ++f)
            for (int64_t j = 0; j < n; ++j) kpos[f * n + j] = static_cast<int32_t>(2 * j + f % 2);
          for (int64_t i = 0; i < wq; ++i) qpos[i] = static_cast<int32_t>(2 * (n - wq + i) + 1);
          cuda::DeviceBuffer dq = cuda::DeviceBuffer::from_vector(q);
          cuda::DeviceBuffer dkp = cuda::DeviceBuffer::from_vector(kpos);
          cuda::DeviceBuffer dqp = cuda::DeviceBuffer::from_vector(qpos);
          const TensorView qv = TensorView::contiguous(dq.data(), DType::kF32, B,
                                                       H * std::max<int64_t>(n_rep, 1), wq, d);
          cuda::DeviceBuffer ds(static_cast<size_t>(F * n) * 4);
          if (n_rep == 0)
            cuda::snap_scores(kv, nullptr, nullptr, nullptr, w, ds.as<float>());
          else
            cuda::snap_scores(kv, &qv, dkp.as<int32_t>(), dqp.as<int32_t>(), w, ds.as<float>());
          const auto gpu = ds.to_vector<float>(static_cast<size_t>(F * n));
          for (int64_t f = 0; f < F; ++f) {
            const std::vector<float> kf_f(keys.begin() + f * n * d, keys.begin() + (f + 1) * n * d);
            std::vector<float> rf(static_cast<size_t>(n));
            double rel;
            if (n_rep == 0) {
              snap_key_proxy_scores_reference(kf_f.data(), n, d, w, rf.data());
              rel = score_rel_tol(kf_f, kf_f.data() + (n - wq) * d, n, wq, d);
            } else {
              const float* qf = q.data() + f * n_rep * wq * d;
              snap_query_scores_reference(kf_f.data(), kpos.data() + f * n, n, d, qf, qpos.data(),
                                          n_rep, wq, rf.data());
              rel = score_rel_tol(kf_f, qf, n, n_rep * wq, d);
            }
            const std::vector<double> ref(rf.begin(), rf.end());
            std::vector<double> bound(ref.size());
            for (size_t j = 0; j < ref.size(); ++j) bound[j] = std::abs(ref[j]) * rel + 1e-30;
            const std::vector<float> got(gpu.begin() + f * n, gpu.begin() + (f + 1) * n);
            Check k(n_rep == 0 ? "snap_scores key proxy" : "snap_scores queries", "cuda",
                    Vars()("n", n)("D", d)("w", w)("rep", n_rep)("keys", dtype_name(dt))("frame", f)
                        .str());
            if (n_rep > 0) k.allow_zero_reference();
            k.bounded(got, ref, bound, "scores");
          }
        }
}

TEST(BackendOpsCuda, SnapPool) {
  SKIP_WITHOUT_DEVICE();
  uint64_t seed = 900;
  for (int64_t n : harness::seq_lens(harness::small_sweep()))
    for (int64_t kernel : {1, 3, 5, 7})
      for (PoolKind kind : {PoolKind::kMax, PoolKind::kAvg}) {
        const int64_t F = 2, lo = n > 8 ? 4 : 0, hi = n > 8 ? n - 3 : n;
        auto in = gaussian(F * n, ++seed);
        for (auto& v : in) v = std::abs(v);
        if (n > 10) in[static_cast<size_t>(n / 2)] = std::numeric_limits<float>::quiet_NaN();
        cuda::DeviceBuffer din = cuda::DeviceBuffer::from_vector(in);
        cuda::DeviceBuffer dout = cuda::DeviceBuffer::from_vector(in);  // outside [lo, hi): kept
        cuda::snap_pool(din.as<float>(), F, n, lo, hi, kernel, kind, dout.as<float>());
        cuda::synchronize();
        const auto got = dout.to_vector<float>(static_cast<size_t>(F * n));
        std::vector<float> want = in;
        for (int64_t f = 0; f < F; ++f)
          snap_pool_scores(in.data() + f * n + lo, hi - lo, kernel, kind, want.data() + f * n + lo);
        Check k("snap_pool", "cuda",
                Vars()("n", n)("lo", lo)("hi", hi)("kernel", kernel)(
                    "kind", kind == PoolKind::kMax ? "max" : "avg")
                    .str());
        k.exact(got, want, "pooled");
      }
}

TEST(BackendOpsCuda, SnapSelect) {
  SKIP_WITHOUT_DEVICE();
  uint64_t seed = 1300;
  for (int64_t n : {1, 2, 3, 17, 31, 127, 129, 1000})
    for (int kind : {0, 1, 2})
      for (int64_t budget : {int64_t{1}, n / 2, n - 1, n, n + 3})
        for (int64_t window : {int64_t{-1}, int64_t{0}, int64_t{8}}) {
          const int64_t F = 3, sinks = (n + kind) % 2 ? 4 : 0;
          std::mt19937_64 rng(++seed);
          std::vector<float> s(static_cast<size_t>(F * n));
          for (auto& v : s) {
            const uint64_t r = rng();
            v = kind == 0   ? static_cast<float>(r % 1000003) * 1e-3f
                : kind == 1 ? static_cast<float>(r % 4)
                            : (r % 6 == 0   ? std::numeric_limits<float>::quiet_NaN()
                               : r % 6 == 1 ? -0.0f
                               : r % 6 == 2 ? 0.0f
                               : r % 6 == 3 ? -std::numeric_limits<float>::infinity()
                                            : static_cast<float>(r % 7));
          }
          const int64_t count = snap_select_count(n, budget);
          cuda::DeviceBuffer ds = cuda::DeviceBuffer::from_vector(s);
          cuda::DeviceBuffer dout(static_cast<size_t>(std::max<int64_t>(F * count, 1)) * 4);
          const int64_t r =
              cuda::snap_select(ds.as<float>(), F, n, budget, sinks, window, dout.as<int32_t>());
          cuda::synchronize();
          const auto got = dout.to_vector<int32_t>(static_cast<size_t>(F * count));
          std::vector<int32_t> want;
          for (int64_t f = 0; f < F; ++f) {
            const float* sf = s.data() + f * n;
            const auto w = window < 0
                               ? snap_select_reference(sf, n, budget, sinks)
                               : snap_select_keep_window_reference(sf, n, budget, sinks, window);
            for (int64_t i : w) want.push_back(static_cast<int32_t>(i));
          }
          Check k(window < 0 ? "snap_select" : "snap_select keep_window", "cuda",
                  Vars()("n", n)("scores", kind)("budget", budget)("sinks", sinks)("window", window)
                      .str());
          k.allow_zero_reference();
          k.expect(r == count, "returned count differs from snap_select_count");
          k.exact(got, want, "indices");
        }
}

TEST(BackendOpsCuda, GatherRows) {
  SKIP_WITHOUT_DEVICE();
  uint64_t seed = 1700;
  for (int64_t n : {1, 2, 3, 17, 31, 127, 129, 1000})
    for (int64_t row_bytes : {2, 36, 128, 256, 1})  // fp16 pair, a packed record, f16 x 64 ...
      for (int pos_mode : {0, 1, 2}) {              // none, implicit source, explicit source
        std::mt19937_64 rng(++seed);
        const int64_t F = 3, count = std::max<int64_t>(n / 2, 1);
        std::vector<uint8_t> src(static_cast<size_t>(F * n * row_bytes));
        for (auto& b : src) b = static_cast<uint8_t>(rng());
        std::vector<int32_t> idx;
        for (int64_t f = 0; f < F; ++f) {
          std::vector<int32_t> all(static_cast<size_t>(n));
          std::iota(all.begin(), all.end(), 0);
          std::shuffle(all.begin(), all.end(), rng);
          all.resize(static_cast<size_t>(count));
          std::sort(all.begin(), all.end());
          idx.insert(idx.end(), all.begin(), all.end());
        }
        std::vector<int32_t> spos(static_cast<size_t>(F * n));
        for (auto& p : spos) p = static_cast<int32_t>(rng() % 100000);
        const int32_t first_pos = 7;
        std::vector<uint8_t> want(static_cast<size_t>(F * count * row_bytes));
        std::vector<int32_t> want_pos(static_cast<size_t>(F * count));
        for (int64_t f = 0; f < F; ++f)
          for (int64_t i = 0; i < count; ++i) {
            const int64_t j = idx[f * count + i];
            std::memcpy(want.data() + (f * count + i) * row_bytes,
                        src.data() + (f * n + j) * row_bytes, static_cast<size_t>(row_bytes));
            want_pos[f * count + i] =
                pos_mode == 2 ? spos[f * n + j] : static_cast<int32_t>(first_pos + j);
          }
        cuda::DeviceBuffer dsrc = cuda::DeviceBuffer::from_vector(src);
        cuda::DeviceBuffer didx = cuda::DeviceBuffer::from_vector(idx);
        cuda::DeviceBuffer dspos = cuda::DeviceBuffer::from_vector(spos);
        cuda::DeviceBuffer ddst(want.size());
        cuda::DeviceBuffer ddpos(want_pos.size() * 4);
        cuda::gather_rows(dsrc.data(), F, n, row_bytes, didx.as<int32_t>(), count, ddst.data(),
                          pos_mode == 2 ? dspos.as<int32_t>() : nullptr, first_pos,
                          pos_mode ? ddpos.as<int32_t>() : nullptr);
        cuda::synchronize();
        Check k("gather_rows", "cuda",
                Vars()("n", n)("count", count)("row_bytes", row_bytes)("pos", pos_mode).str());
        k.exact(ddst.to_vector<uint8_t>(want.size()), want, "rows");
        if (pos_mode) k.exact(ddpos.to_vector<int32_t>(want_pos.size()), want_pos, "positions");
      }
}

}  // namespace
}  // namespace vq
