// GPU tests of fused decode attention (vq::cuda::decode_attention) against the CPU oracle
// attention_reference over the same cache view, dequantized on the host with the public
// dequantize_row (packed.h) where it is packed. Skipped cleanly without a device.
//
// The op harness (tests/cuda/test_backend_ops_cuda.cpp) holds decode_attention to its bound over
// the table of shapes, dtypes and packed formats; this file keeps what the table does not cover:
// a long mixed view (2,105 rows: fp16 sinks, rotated and permuted 4-bit middle, fp16 tail) across
// many splits, one plan run over several layers' views with the planner's knobs
// (DecodePlanOptions), real SKVQ cache contents from the builder, and the refusals. The metric is
// the harness's per-element bound (tests/cuda/attention_check.h), and the reference must not be
// all zeros.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/attention_check.h"
#include "ops_harness/attention_bounds.h"
#include "util/test_util.h"
#include "veloxquant/attention.h"
#include "veloxquant/builder.h"
#include "veloxquant/cuda.h"
#include "veloxquant/error.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/hadamard.h"
#include "veloxquant/packed.h"

namespace vq {
namespace {

#define SKIP_WITHOUT_DEVICE() \
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device"

// ---- building views on the host ---------------------------------------------------------------

// A packed segment and the buffers it points to.
struct PackedHost {
  std::vector<uint8_t> k, v;
  std::vector<int32_t> perm_k, perm_v;
  std::vector<float> signs;
  PackedSegment seg;
};

struct PackedSpec {
  double kbits = 2, vbits = 2;
  int64_t group = 32;
  MetaType meta = MetaType::kF16;
  bool perm = false;
  bool rotate = false;  // keys and values
};

std::unique_ptr<PackedHost> make_packed(int64_t B, int64_t H, int64_t n, int64_t D,
                                        const PackedSpec& sp, uint64_t seed) {
  auto ph = std::make_unique<PackedHost>();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> ch_scale(static_cast<size_t>(D));
  for (auto& c : ch_scale) c = 0.25f + 2.0f * std::abs(nd(rng));  // heterogeneous channels
  PackedSegment& seg = ph->seg;
  seg.batch = B;
  seg.n_heads = H;
  seg.n_rows = n;
  seg.head_dim = D;
  seg.out_dtype = DType::kF16;
  if (sp.perm) {
    for (int kv = 0; kv < 2; ++kv) {
      auto& p = kv == 0 ? ph->perm_k : ph->perm_v;
      p.resize(static_cast<size_t>(H * D));
      for (int64_t h = 0; h < H; ++h) {
        std::iota(p.begin() + h * D, p.begin() + (h + 1) * D, 0);
        std::shuffle(p.begin() + h * D, p.begin() + (h + 1) * D, rng);
      }
    }
  }
  if (sp.rotate) ph->signs = hadamard_signs(seed ^ 0x5eedull, H * D);
  for (int kv = 0; kv < 2; ++kv) {
    PackedTensor& t = kv == 0 ? seg.keys : seg.values;
    const double bits = kv == 0 ? sp.kbits : sp.vbits;
    t.fmt = make_row_format(D, bits, sp.group, sp.meta);
    auto& buf = kv == 0 ? ph->k : ph->v;
    buf.assign(static_cast<size_t>(B * H * n * t.fmt.row_stride + 16), 0);
    t.data = buf.data();
    t.stride_h = n * t.fmt.row_stride;
    t.stride_b = H * t.stride_h;
    if (sp.perm) t.perm = (kv == 0 ? ph->perm_k : ph->perm_v).data();
    if (sp.rotate) {
      t.signs = ph->signs.data();
      t.rot_block = static_cast<int32_t>(hadamard_block(D));
    }
    GroupQuantParams gp;
    gp.bits = bits;
    gp.group_size = sp.group;
    gp.meta = sp.meta;
    std::vector<float> row(static_cast<size_t>(D)), tmp(static_cast<size_t>(D));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t d = 0; d < D; ++d) row[d] = nd(rng) * ch_scale[d];
          if (t.transformed()) transform_row(t, h, row.data(), tmp.data());
          quantize_to_records(row.data(), 1, t.fmt, gp, const_cast<uint8_t*>(t.record(b, h, i)),
                              t.fmt.row_stride, false);
        }
  }
  return ph;
}

// A view plus everything it points to, and its dense (dequantized, fp32) twin.
struct HostView {
  CacheView view;
  CacheView dense;
  std::vector<std::unique_ptr<Tensor>> tensors;
  std::vector<std::unique_ptr<PackedHost>> packed;
  std::vector<std::vector<int32_t>> positions;
};

void add_fp_segment(HostView& hv, DType dt, int64_t n, int64_t first_pos,
                    const std::vector<int32_t>* pos, uint64_t seed) {
  const int64_t B = hv.view.batch, H = hv.view.n_kv_heads, D = hv.view.head_dim;
  auto k = std::make_unique<Tensor>(test::random_tensor(dt, B, H, n, D, seed));
  auto v = std::make_unique<Tensor>(test::random_tensor(dt, B, H, n, D, seed + 1));
  ViewSegment s;
  s.n_rows = n;
  s.first_pos = first_pos;
  if (pos) {
    hv.positions.push_back(*pos);
    s.positions = hv.positions.back().data();
  }
  s.keys = k->view();
  s.values = v->view();
  hv.view.segments.push_back(s);
  hv.dense.segments.push_back(s);  // the reference reads f16/bf16/f32 rows as they are
  hv.tensors.push_back(std::move(k));
  hv.tensors.push_back(std::move(v));
}

void add_packed_segment(HostView& hv, const PackedSpec& sp, int64_t n, int64_t first_pos,
                        const std::vector<int32_t>* pos, uint64_t seed) {
  const int64_t B = hv.view.batch, H = hv.view.n_kv_heads, D = hv.view.head_dim;
  auto ph = make_packed(B, H, n, D, sp, seed);
  ViewSegment s;
  s.n_rows = n;
  s.first_pos = first_pos;
  if (pos) {
    hv.positions.push_back(*pos);
    s.positions = hv.positions.back().data();
  }
  s.packed = &ph->seg;
  s.keys.dtype = s.values.dtype = DType::kF16;
  s.keys.shape = s.values.shape = {B, H, n, D};
  ViewSegment d = s;
  d.packed = nullptr;
  auto dk = std::make_unique<Tensor>(DType::kF32, B, H, n, D);
  auto dv = std::make_unique<Tensor>(DType::kF32, B, H, n, D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; ++i) {
        dequantize_row(ph->seg.keys, b, h, i, static_cast<float*>(dk->view().row(b, h, i)));
        dequantize_row(ph->seg.values, b, h, i, static_cast<float*>(dv->view().row(b, h, i)));
      }
  d.keys = dk->view();
  d.values = dv->view();
  hv.view.segments.push_back(s);
  hv.dense.segments.push_back(d);
  hv.tensors.push_back(std::move(dk));
  hv.tensors.push_back(std::move(dv));
  hv.packed.push_back(std::move(ph));
}

HostView empty_view(int64_t B, int64_t H, int64_t D) {
  HostView hv;
  hv.view.batch = hv.dense.batch = B;
  hv.view.n_kv_heads = hv.dense.n_kv_heads = H;
  hv.view.head_dim = hv.dense.head_dim = D;
  return hv;
}

// ---- the check ----------------------------------------------------------------------------------

// The decode kernel's per-element bound of the op harness (tests/ops_harness/attention_bounds.h,
// derived there; checked by tests/cuda/attention_check.h).
struct Check {
  double max_ratio = 0;
  int64_t nonzero = 0;
};

Check check_against_reference(const HostView& hv, const std::vector<float>& q, int64_t Hq,
                              const AttentionParams& ap, const std::vector<float>& gpu,
                              const std::string& vars) {
  const test::AttnCheck a = test::check_attention(
      hv.dense, q, Hq, 1, ap, gpu, test::AttnKernel::kDecode, harness::tc_operands(hv.view), vars);
  return {a.worst_ratio, a.nonzero};
}

std::vector<float> random_q(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(n));
  for (auto& x : q) x = nd(rng);
  return q;
}

// Uploads, runs (automatic plan and a forced small split), checks; returns the worst ratio.
double run_case(const HostView& hv, int64_t Hq, const AttentionParams& ap, uint64_t seed,
                const std::string& vars, bool expect_nonzero = true) {
  const int64_t B = hv.view.batch, D = hv.view.head_dim;
  const auto q = random_q(B * Hq * D, seed);
  const cuda::DeviceCacheView dv = cuda::DeviceCacheView::upload(hv.view);
  double worst = 0;
  for (int64_t rps : {int64_t{0}, int64_t{8}, int64_t{40}}) {
    cuda::DecodeOptions opt;
    opt.rows_per_split = rps;
    const auto gpu = cuda::decode_attention_host(q, Hq, dv, ap, opt);
    const std::string v = vars + " rows_per_split=" + std::to_string(rps);
    const Check c = check_against_reference(hv, q, Hq, ap, gpu, v);
    if (expect_nonzero) {
      EXPECT_GT(c.nonzero, 0) << v << ": reference is all zeros";
    }
    worst = std::max(worst, c.max_ratio);
  }
  return worst;
}

// ---- tests --------------------------------------------------------------------------------------

TEST(CudaDecode, LongContextSplits) {
  SKIP_WITHOUT_DEVICE();
  uint64_t seed = 900;
  double worst = 0;
  for (DType rows : {DType::kF16, DType::kBF16})  // bf16: the bf16-row tensor-core instance
    for (int64_t G : {4, 8}) {
      HostView hv = empty_view(1, 2, 128);
      add_fp_segment(hv, rows, 5, 0, nullptr, ++seed);
      add_packed_segment(hv, {4, 4, 32, MetaType::kF16, true, true}, 2000, 5, nullptr, ++seed);
      add_fp_segment(hv, rows, 100, 2005, nullptr, ++seed);
      AttentionParams ap;
      ap.q_pos0 = 2104;
      worst = std::max(worst, run_case(hv, 2 * G, ap, ++seed,
                                       "long G=" + std::to_string(G) + " " + dtype_name(rows)));
    }
  std::printf("[long] worst error = %.3f%% of tolerance\n", 100 * worst);
}

// Plan once, run per layer: one plan over two "layers" (views of the same shapes and formats,
// different contents) gives exactly the one-call results of each, the planner's knobs
// (DecodePlanOptions) keep the numerics within the bound, and a view of other shapes is refused.
TEST(CudaDecode, PlanOnceRunPerLayer) {
  SKIP_WITHOUT_DEVICE();
  const int64_t B = 2, H = 2, D = 128, Hq = 8;
  auto layer = [&](uint64_t seed) {
    HostView hv = empty_view(B, H, D);
    add_fp_segment(hv, DType::kF16, 5, 0, nullptr, seed);
    add_packed_segment(hv, {2, 2, 32, MetaType::kF16, true, false}, 700, 5, nullptr, seed + 1);
    add_fp_segment(hv, DType::kF16, 40, 705, nullptr, seed + 2);
    return hv;
  };
  HostView h0 = layer(11), h1 = layer(21);
  const cuda::DeviceCacheView d0 = cuda::DeviceCacheView::upload(h0.view);
  const cuda::DeviceCacheView d1 = cuda::DeviceCacheView::upload(h1.view);
  AttentionParams ap;
  ap.q_pos0 = 744;
  const auto q = random_q(B * Hq * D, 5);
  cuda::DecodeWorkspace ws;
  const cuda::DecodePlan plan = cuda::decode_attention_plan(ws.context(), Hq, d0, ap);
  EXPECT_NE(plan.kernel, cuda::DecodeKernel::kCudaCore) << cuda::decode_kernel_name(plan.kernel);
  EXPECT_EQ(plan.device, ws.context().device());
  const size_t n = static_cast<size_t>(B * Hq * D);
  cuda::DeviceBuffer dq = cuda::DeviceBuffer::from_vector(q), dout(n * 4);
  for (int l = 0; l < 2; ++l) {
    const cuda::DeviceCacheView& dv = l ? d1 : d0;
    cuda::decode_attention_run(plan, dq.as<float>(), dv, dout.as<float>(), ws);
    cuda::synchronize();
    const auto ran = dout.to_vector<float>(n);
    const auto one = cuda::decode_attention_host(q, Hq, dv, ap);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(ran[i], one[i]) << "layer " << l << " element " << i;
    check_against_reference(l ? h1 : h0, q, Hq, ap, ran, "plan layer " + std::to_string(l));
  }
  double worst = 0;
  for (int64_t target : {int64_t{1}, int64_t{7}, int64_t{1000}})
    for (int64_t stage : {int64_t{0}, int64_t{6144}, int64_t{49152}}) {
      cuda::DecodePlanOptions o;
      o.target_blocks = target;
      o.packed_stage_bytes = stage;
      const std::string v =
          "knobs target=" + std::to_string(target) + " stage=" + std::to_string(stage);
      const auto out = cuda::decode_attention_host(q, Hq, d0, ap, o);
      worst = std::max(worst, check_against_reference(h0, q, Hq, ap, out, v).max_ratio);
    }
  std::printf("[plan knobs] worst error = %.3f%% of tolerance\n", 100 * worst);
  HostView other = empty_view(B, H, D);
  add_fp_segment(other, DType::kF16, 745, 0, nullptr, 3);
  const cuda::DeviceCacheView dov = cuda::DeviceCacheView::upload(other.view);
  try {
    cuda::decode_attention_run(plan, dq.as<float>(), dov, dout.as<float>(), ws);
    FAIL() << "expected a vq::Error for a view of other segments";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[decode_attention_run] expected"), std::string::npos)
        << e.what();
  }
}

// Real cache contents: an SKVQ cache (reorder + clip search, sinks, packed chunks, f16 tail), when
// the builder offers the method.
TEST(CudaDecode, RealSkvqCacheView) {
  SKIP_WITHOUT_DEVICE();
  for (DType rows : {DType::kF16, DType::kBF16})  // bf16: a bf16 model's cache
    for (bool rotate : {false, true}) {
      CacheConfig cfg;
      cfg.method = "skvq";
      cfg.head_dim = 128;
      cfg.skvq_window = 32;
      cfg.skvq_group_size = 32;
      if (rotate) cfg.skvq_rotation = Rotation::kHadamard;
      std::unique_ptr<KVCache> cache;
      try {
        cache = make_cache(cfg);
      } catch (const Error& e) {
        GTEST_SKIP() << "skvq cache not available: " << e.what();
      }
      const Tensor k = test::random_tensor(rows, 2, 2, 150, 128, 11);
      const Tensor v = test::random_tensor(rows, 2, 2, 150, 128, 12);
      const CacheView view = cache->update_and_fetch(k.view(), v.view());
      ASSERT_TRUE(view.has_packed());
      HostView hv = empty_view(2, 2, 128);
      hv.view = view;
      hv.dense = view;
      for (size_t i = 0; i < view.segments.size(); ++i) {
        const ViewSegment& s = view.segments[i];
        if (!s.packed) continue;
        auto dk = std::make_unique<Tensor>(DType::kF32, 2, 2, s.n_rows, 128);
        auto dvv = std::make_unique<Tensor>(DType::kF32, 2, 2, s.n_rows, 128);
        for (int64_t b = 0; b < 2; ++b)
          for (int64_t h = 0; h < 2; ++h)
            for (int64_t r = 0; r < s.n_rows; ++r) {
              dequantize_row(s.packed->keys, b, h, r, static_cast<float*>(dk->view().row(b, h, r)));
              dequantize_row(s.packed->values, b, h, r,
                             static_cast<float*>(dvv->view().row(b, h, r)));
            }
        hv.dense.segments[i].packed = nullptr;
        hv.dense.segments[i].keys = dk->view();
        hv.dense.segments[i].values = dvv->view();
        hv.tensors.push_back(std::move(dk));
        hv.tensors.push_back(std::move(dvv));
      }
      AttentionParams ap;
      ap.q_pos0 = 149;
      const std::string name =
          std::string(rotate ? "skvq cache rotated " : "skvq cache ") + dtype_name(rows);
      const double w = run_case(hv, 8, ap, 77, name);
      std::printf("[%s] worst error = %.3f%% of tolerance\n", name.c_str(), 100 * w);
    }
}

TEST(CudaDecode, RefusesUnsupportedShapes) {
  SKIP_WITHOUT_DEVICE();
  auto expect_error = [](auto&& f, const std::string& needle) {
    try {
      f();
      FAIL() << "expected a vq::Error containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  {
    HostView hv = empty_view(1, 2, 128);
    add_fp_segment(hv, DType::kF16, 17, 0, nullptr, 1);
    const auto dv = cuda::DeviceCacheView::upload(hv.view);
    AttentionParams ap;
    expect_error([&] { cuda::decode_attention_host(random_q(3 * 128, 1), 3, dv, ap); },
                 "multiple of H_kv");
  }
  {
    HostView hv = empty_view(1, 2, 96);
    add_fp_segment(hv, DType::kF16, 17, 0, nullptr, 1);
    const auto dv = cuda::DeviceCacheView::upload(hv.view);
    expect_error([&] { cuda::decode_attention_host(random_q(2 * 96, 1), 2, dv, {}); }, "head_dim");
  }
  // Every packed format decodes, none is refused: codes of any spec are read in place (the
  // any-bits instance), groups that are not a multiple of 8 are dequantized first; the op
  // harness's packed formats (tests/ops_harness/tables.cpp) check both against the reference.
}

}  // namespace
}  // namespace vq
