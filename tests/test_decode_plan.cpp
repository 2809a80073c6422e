// Host tests of the CUDA decode planner (src/cuda/decode_plan.h) on a fake device context: no GPU
// and no CUDA build needed. Kernel choice per view (f16-only, packed 2/4-bit with f16 or fp8
// metadata, fixed group-32 records, bf16 rows alone and beside packed rows, f16 beside bf16,
// any code spec read in place, formats that are dequantized first), split and tile
// sizes against the rules written in decode_plan.cpp, channel-axis keys (the channel kernel), the
// DecodePlanOptions overrides (and that the environment no longer changes a plan), shape errors,
// and the check of a layer's view against a plan. Segment pointers are fake aligned addresses:
// planning never dereferences them.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/decode_plan.h"
#include "veloxquant/error.h"
#include "veloxquant/packed.h"

namespace vq::cuda {
namespace {

DeviceInfo h200_like() {
  DeviceInfo d;
  d.name = "fake";
  d.cc_major = 9;
  d.sm_count = 132;
  return d;
}

const void* fake_ptr(uintptr_t i) {
  return reinterpret_cast<const void*>(uintptr_t{1} << 20 | i << 12);
}

DeviceSegment fp_seg(int64_t n, DType dt, int64_t first = 0, uintptr_t tag = 1) {
  DeviceSegment s;
  s.n_rows = n;
  s.first_pos = first;
  s.dtype = dt;
  s.keys = fake_ptr(2 * tag);
  s.values = fake_ptr(2 * tag + 1);
  return s;
}

DeviceSegment packed_seg(int64_t n, double kb, double vb, int64_t group, MetaType meta,
                         int64_t D = 128, int64_t first = 0) {
  DeviceSegment s;
  s.packed = true;
  s.n_rows = n;
  s.first_pos = first;
  s.k_fmt = make_row_format(D, kb, group, meta);
  s.v_fmt = make_row_format(D, vb, group, meta);
  s.k_data = static_cast<const uint8_t*>(fake_ptr(100));
  s.v_data = static_cast<const uint8_t*>(fake_ptr(101));
  return s;
}

DecodePlan plan(const std::vector<DeviceSegment>& segs, int64_t B = 1, int64_t H = 8,
                int64_t Hq = 32, int64_t D = 128, const DecodePlanOptions& opt = {},
                int mma_bps = 2) {
  AttentionParams ap;
  ap.q_pos0 = 1 << 20;
  return plan_decode(DecodeContext::fake(h200_like(), mma_bps), Hq, B, H, D, segs, ap, opt);
}

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    FAIL() << "expected a vq::Error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Every segment is split into whole tiles, and the splits are numbered consecutively.
void expect_consistent(const DecodePlan& p) {
  int64_t next = 0, rows = 0;
  for (const DecodeSegmentPlan& s : p.segments) {
    EXPECT_EQ(s.split_begin, next);
    EXPECT_EQ(s.n_splits, (s.n_rows + s.rows_per_split - 1) / s.rows_per_split);
    next += s.n_splits;
    rows += s.n_rows;
  }
  EXPECT_EQ(p.n_splits, next);
  EXPECT_EQ(p.total_rows, rows);
  const size_t n_part = static_cast<size_t>(p.batch * p.n_q_heads * p.n_splits);
  EXPECT_EQ(p.workspace_bytes,
            (n_part * static_cast<size_t>(p.head_dim) * 4 + 255) / 256 * 256 + n_part * 8);
}

TEST(DecodePlan, F16OnlyTakesTheTensorCoreKernelWithFatSplitsAtShortContexts) {
  // B 1, 8 KV heads, 4K f16 rows: tiles of 32 KiB / 512 B = 64 rows; one wave is 2 * 132 blocks
  // (33 per (b, h)), but 4 tiles per split still leave 16 >= 132 / 8 splits: 16 of 256 rows.
  const DecodePlan p = plan({fp_seg(4096, DType::kF16)});
  EXPECT_EQ(p.kernel, DecodeKernel::kMmaF16);
  EXPECT_EQ(p.target_blocks, 2 * 132);
  ASSERT_EQ(p.segments.size(), 1u);
  EXPECT_EQ(p.segments[0].tile_rows, 64);
  EXPECT_EQ(p.segments[0].rows_per_split, 256);
  EXPECT_EQ(p.n_splits, 16);
  EXPECT_EQ(p.k_bits, 0);
  EXPECT_EQ(p.scratch_bytes, 0u);
  expect_consistent(p);
  // 128K rows: one wave, 264 / 8 = 33 splits per (b, h).
  const DecodePlan l = plan({fp_seg(131072, DType::kF16)});
  EXPECT_EQ(l.n_splits, 33);
  expect_consistent(l);
  // The occupancy of the device decides the target.
  EXPECT_EQ(plan({fp_seg(131072, DType::kF16)}, 1, 8, 32, 128, {}, 3).target_blocks, 3 * 132);
}

TEST(DecodePlan, PackedViewsPickTheirTensorCoreInstance) {
  const std::vector<MetaType> metas = {MetaType::kF16, MetaType::kFP8E4M3};
  for (int bits : {2, 4})
    for (MetaType meta : metas)
      for (int64_t g : {32, 64}) {
        std::vector<DeviceSegment> segs = {fp_seg(5, DType::kF16),
                                           packed_seg(32000, bits, bits, g, meta, 128, 5),
                                           fp_seg(64, DType::kF16, 32005, 2)};
        const DecodePlan p = plan(segs, 8);
        DecodeKernel want;
        if (meta == MetaType::kF16 && g == 32)
          want = bits == 2 ? DecodeKernel::kMmaPacked2G32 : DecodeKernel::kMmaPacked4G32;
        else if (meta == MetaType::kF16)
          want = bits == 2 ? DecodeKernel::kMmaPacked2F16Meta : DecodeKernel::kMmaPacked4F16Meta;
        else
          want = bits == 2 ? DecodeKernel::kMmaPacked2 : DecodeKernel::kMmaPacked4;
        const std::string vars = "bits=" + std::to_string(bits) + " g=" + std::to_string(g) +
                                 " meta=" + std::to_string(static_cast<int>(meta));
        EXPECT_EQ(p.kernel, want) << vars << " got " << decode_kernel_name(p.kernel);
        EXPECT_EQ(p.k_bits, bits) << vars;
        ASSERT_EQ(p.segments.size(), 3u);
        // packed rows: tiles a multiple of 64 rows; f16 sinks and tail a multiple of 16 within
        // the same stage bytes
        EXPECT_EQ(p.segments[1].tile_rows % 64, 0) << vars;
        EXPECT_EQ(p.segments[0].tile_rows % 16, 0) << vars;
        EXPECT_GE(p.segments[0].tile_rows, 16) << vars;
        EXPECT_EQ(p.stage_half_bytes % 16, 0) << vars;
        for (const DecodeSegmentPlan& s : p.segments) {
          EXPECT_EQ(s.rows_per_split % s.tile_rows, 0) << vars;
          EXPECT_GE(static_cast<int64_t>(p.stage_half_bytes),
                    static_cast<int64_t>(s.tile_rows) * std::max(s.k_row_bytes, s.v_row_bytes))
              << vars;
        }
        expect_consistent(p);
      }
  // 2-bit g32 f16: records of 32 + 16 bytes, 128-row tiles (96 B * 128 = 12 KiB of K + V)
  const DecodePlan p = plan({packed_seg(32768, 2, 2, 32, MetaType::kF16)}, 8);
  EXPECT_EQ(p.segments[0].k_row_bytes, 48);
  EXPECT_EQ(p.segments[0].tile_rows, 128);
}

TEST(DecodePlan, Bf16RowsTakeTheBf16RowInstances) {
  // bf16 rows alone: kMmaBF16 with the f16 view's tiles and splits (same row bytes)
  const DecodePlan f = plan({fp_seg(4096, DType::kF16)});
  const DecodePlan b = plan({fp_seg(4096, DType::kBF16)});
  EXPECT_EQ(b.kernel, DecodeKernel::kMmaBF16) << decode_kernel_name(b.kernel);
  EXPECT_EQ(std::string(decode_kernel_name(b.kernel)), "mma-bf16");
  EXPECT_EQ(b.segments[0].tile_rows, f.segments[0].tile_rows);
  EXPECT_EQ(b.n_splits, f.n_splits);
  EXPECT_EQ(b.stage_half_bytes, f.stage_half_bytes);
  expect_consistent(b);
  // bf16 sinks and window beside packed rows (a bf16 model's SKVQ view): the bf16-row instance
  // of each packed kernel, the same tiles as with f16 sinks and window
  const struct {
    int bits;
    MetaType meta;
    int64_t g;
    DecodeKernel f16, bf16;
  } cases[] = {
      {2, MetaType::kF16, 32, DecodeKernel::kMmaPacked2G32, DecodeKernel::kMmaPacked2G32BF16},
      {4, MetaType::kF16, 32, DecodeKernel::kMmaPacked4G32, DecodeKernel::kMmaPacked4G32BF16},
      {2, MetaType::kF16, 64, DecodeKernel::kMmaPacked2F16Meta,
       DecodeKernel::kMmaPacked2F16MetaBF16},
      {4, MetaType::kF16, 64, DecodeKernel::kMmaPacked4F16Meta,
       DecodeKernel::kMmaPacked4F16MetaBF16},
      {2, MetaType::kFP8E4M3, 32, DecodeKernel::kMmaPacked2, DecodeKernel::kMmaPacked2BF16},
      {4, MetaType::kFP8E4M3, 32, DecodeKernel::kMmaPacked4, DecodeKernel::kMmaPacked4BF16},
  };
  for (const auto& c : cases) {
    const std::string vars = "bits=" + std::to_string(c.bits) + " g=" + std::to_string(c.g);
    const auto view = [&](DType t) {
      return std::vector<DeviceSegment>{fp_seg(5, t),
                                        packed_seg(32000, c.bits, c.bits, c.g, c.meta, 128, 5),
                                        fp_seg(64, t, 32005, 2)};
    };
    const DecodePlan pf = plan(view(DType::kF16), 8);
    const DecodePlan pb = plan(view(DType::kBF16), 8);
    EXPECT_EQ(pf.kernel, c.f16) << vars << " got " << decode_kernel_name(pf.kernel);
    EXPECT_EQ(pb.kernel, c.bf16) << vars << " got " << decode_kernel_name(pb.kernel);
    EXPECT_EQ(pb.stage_half_bytes, pf.stage_half_bytes) << vars;
    ASSERT_EQ(pb.segments.size(), 3u);
    for (size_t i = 0; i < 3; ++i)
      EXPECT_EQ(pb.segments[i].tile_rows, pf.segments[i].tile_rows) << vars << " segment " << i;
    expect_consistent(pb);
  }
}

TEST(DecodePlan, OtherViewsTakeTheCudaCoreKernel) {
  // f32 rows, f16 beside bf16 rows, 8-bit codes and mixed bit pairs are read by the CUDA-core
  // kernel, 16 blocks / SM
  for (const std::vector<DeviceSegment>& segs :
       {std::vector<DeviceSegment>{fp_seg(1000, DType::kF32)},
        std::vector<DeviceSegment>{fp_seg(500, DType::kF16), fp_seg(500, DType::kBF16, 500, 2)},
        std::vector<DeviceSegment>{fp_seg(5, DType::kBF16),
                                   packed_seg(1000, 4, 4, 32, MetaType::kF16, 128, 5),
                                   fp_seg(64, DType::kF16, 1005, 2)},
        std::vector<DeviceSegment>{packed_seg(1000, 8, 8, 32, MetaType::kF16)},
        std::vector<DeviceSegment>{packed_seg(1000, 4, 2, 32, MetaType::kF16)},
        std::vector<DeviceSegment>{packed_seg(1000, 2, 2, 16, MetaType::kF16)}}) {
    const DecodePlan p = plan(segs);
    EXPECT_EQ(p.kernel, DecodeKernel::kCudaCore) << decode_kernel_name(p.kernel);
    EXPECT_EQ(p.target_blocks, 16 * 132);
    EXPECT_EQ(p.stage_half_bytes, 0);
    for (const DecodeSegmentPlan& s : p.segments) {
      EXPECT_EQ(s.tile_rows % 8, 0);
      EXPECT_GE(s.rows_per_split, 64);
    }
    expect_consistent(p);
  }
}

TEST(DecodePlan, AnyCodeSpecIsReadInPlace) {
  // 1.5-bit (three-level) codes and every bit pair without an instance of its own are read in
  // place by the CUDA-core kernel's any-bits instance: no scratch, no dequantized copy
  const double pairs[][2] = {{1.5, 2}, {2, 1.5}, {1.5, 1.5}, {3, 3}, {2, 8}, {8, 4},
                             {1, 1},   {5, 7},   {6, 3},     {4, 8}, {8, 2}, {7, 1.5}};
  for (const auto& kv : pairs) {
    const DecodePlan p =
        plan({fp_seg(5, DType::kF16), packed_seg(300, kv[0], kv[1], 32, MetaType::kF16, 128, 5)}, 2,
             4, 16, 128);
    ASSERT_EQ(p.segments.size(), 2u);
    EXPECT_FALSE(p.segments[1].dequantize) << kv[0] << "/" << kv[1];
    EXPECT_EQ(p.segments[1].k_row_bytes,
              make_row_format(128, kv[0], 32, MetaType::kF16).row_stride);
    EXPECT_EQ(p.k_bits, static_cast<int>(kv[0] == 1.5 ? 1 : kv[0]));
    EXPECT_EQ(p.v_bits, static_cast<int>(kv[1] == 1.5 ? 1 : kv[1]));
    EXPECT_EQ(p.kernel, DecodeKernel::kCudaCore) << decode_kernel_name(p.kernel);
    EXPECT_EQ(p.scratch_bytes, 0u);
    expect_consistent(p);
  }
}

TEST(DecodePlan, UnfusedFormatsAreDequantizedIntoScratch) {
  // key and value groups that differ: a kernel lane reads one group for both, so no split kernel
  // reads them; the run dequantizes into fp32 scratch [2, B*H, n, D]
  DeviceSegment t = packed_seg(300, 1.5, 2, 32, MetaType::kF16);
  t.v_fmt = make_row_format(128, 2, 16, MetaType::kF16);
  const DecodePlan p = plan({fp_seg(5, DType::kF16), t}, 2, 4, 16, 128);
  ASSERT_EQ(p.segments.size(), 2u);
  EXPECT_TRUE(p.segments[1].dequantize);
  EXPECT_EQ(p.segments[1].dtype, DType::kF32);
  EXPECT_EQ(p.segments[1].k_row_bytes, 128 * 4);
  EXPECT_EQ(p.k_bits, 0);
  EXPECT_EQ(p.kernel, DecodeKernel::kCudaCore);
  EXPECT_EQ(p.scratch_bytes, static_cast<size_t>(2 * 2 * 4 * 300 * 128) * 4);
  // with explicit positions the copy has the segment's capacity (positions are indexed by it)
  t.capacity = 512;
  t.positions = reinterpret_cast<const int32_t*>(fake_ptr(7));
  EXPECT_EQ(plan({t}, 2, 4, 16, 128).scratch_bytes, static_cast<size_t>(2 * 2 * 4 * 512 * 128) * 4);
}

// Channel-axis keys (skvq_key_axis=channel): read in place by the channel kernel, whatever the
// code width or metadata type (no scratch), on the CUDA-core kernel for the view's other rows
// (f16 rows that alone would take the tensor cores), in whole 128-row tiles; a token-axis packed
// segment beside them is refused (one packed format per view), and a layer's view must keep the
// axis and give runs.
TEST(DecodePlan, ChannelAxisKeysTakeTheChannelKernel) {
  DeviceSegment ch = packed_seg(300, 3, 1.5, 32, MetaType::kFP8E4M3);
  ch.k_fmt = make_channel_row_format(128, 3, 16, MetaType::kFP8E4M3);
  const int32_t* runs = reinterpret_cast<const int32_t*>(fake_ptr(60));
  ch.k_runs = runs;
  ch.k_n_runs = 19;
  const std::vector<DeviceSegment> segs = {fp_seg(5, DType::kF16), ch, fp_seg(20, DType::kF16)};
  const DecodePlan p = plan(segs, 2, 4, 16, 128);
  expect_consistent(p);
  ASSERT_EQ(p.segments.size(), 3u);
  EXPECT_TRUE(p.segments[1].channel);
  EXPECT_FALSE(p.segments[1].dequantize);
  EXPECT_FALSE(p.segments[0].channel);
  EXPECT_EQ(p.segments[1].k_row_bytes, ch.k_fmt.row_stride);
  EXPECT_EQ(p.segments[1].v_row_bytes, ch.v_fmt.row_stride);
  // 128-row tiles (a row per thread), about four blocks per SM (decode_plan.cpp)
  EXPECT_EQ(p.segments[1].tile_rows, 128);
  EXPECT_EQ(p.segments[1].rows_per_split % 128, 0);
  EXPECT_EQ(p.target_blocks, 4 * 132);
  EXPECT_EQ(p.scratch_bytes, 0u);
  // such plans run alone in a batched run (the engine sizes them as single launches); a batch-1
  // view of rows joins, a view of two sequences does not
  EXPECT_FALSE(decode_plan_joins_batch(plan(segs, 1, 4, 16, 128)));
  EXPECT_TRUE(decode_plan_joins_batch(plan({fp_seg(300, DType::kF16)}, 1, 4, 16, 128)));
  EXPECT_FALSE(decode_plan_joins_batch(plan({fp_seg(300, DType::kF16)}, 2, 4, 16, 128)));
  EXPECT_EQ(p.kernel, DecodeKernel::kCudaCore);
  EXPECT_EQ(p.k_bits, 3);
  EXPECT_GT(p.v_bits, 0);  // the combine un-transforms packed values by it
  // 2-bit keys and values of groups of 32 beside f16 rows: still the CUDA-core kernel
  DeviceSegment ch2 = packed_seg(1000, 2, 2, 32, MetaType::kF16);
  ch2.k_fmt = make_channel_row_format(128, 2, 128, MetaType::kF16);
  EXPECT_EQ(plan({fp_seg(5, DType::kF16), ch2}, 1, 8, 32, 128).kernel, DecodeKernel::kCudaCore);
  // one run without a list is fine; a list of no runs is not
  DeviceSegment none = ch;
  none.k_runs = nullptr;
  none.k_n_runs = 0;
  EXPECT_TRUE(plan({none}, 2, 4, 16, 128).segments[0].channel);
  DeviceSegment bad = ch;
  bad.k_n_runs = 0;
  expect_error([&] { plan({bad}, 2, 4, 16, 128); }, "channel-axis key runs >= 1");
  // a token-axis packed segment beside channel-axis keys
  expect_error(
      [&] {
        plan({ch, packed_seg(64, 2, 2, 32, MetaType::kF16)}, 2, 4, 16, 128);
      },
      "share one format");
  // a layer's view: the same axis and runs
  std::vector<DeviceSegment> token = segs;
  token[1].k_fmt = make_row_format(128, 3, 32, MetaType::kFP8E4M3);
  expect_error([&] { match_plan(p, 2, 4, 128, token); }, "packed formats and transforms");
  std::vector<DeviceSegment> no_runs = segs;
  no_runs[1].k_n_runs = 0;
  expect_error([&] { match_plan(p, 2, 4, 128, no_runs); }, "channel-axis key runs >= 1");
  EXPECT_EQ(match_plan(p, 2, 4, 128, segs)[1], &segs[1]);
}

TEST(DecodePlan, OptionsOverrideThePlanAndTheEnvironmentDoesNot) {
  const std::vector<DeviceSegment> segs = {packed_seg(32768, 4, 4, 32, MetaType::kF16)};
  const DecodePlan base = plan(segs, 8);
  // The environment variables the planner once read are ignored now.
  ::setenv("VQ_DECODE_TARGET_BLOCKS", "7", 1);
  ::setenv("VQ_DECODE_PACKED_STAGE_BYTES", "65536", 1);
  const DecodePlan env = plan(segs, 8);
  ::unsetenv("VQ_DECODE_TARGET_BLOCKS");
  ::unsetenv("VQ_DECODE_PACKED_STAGE_BYTES");
  EXPECT_EQ(env.n_splits, base.n_splits);
  EXPECT_EQ(env.segments[0].tile_rows, base.segments[0].tile_rows);
  EXPECT_EQ(env.target_blocks, base.target_blocks);

  DecodePlanOptions o;
  o.target_blocks = 8 * 8 * 4;  // 4 splits per (b, h)
  const DecodePlan t = plan(segs, 8, 8, 32, 128, o);
  EXPECT_EQ(t.target_blocks, 256);
  EXPECT_EQ(t.n_splits, 4);
  expect_consistent(t);

  DecodePlanOptions st;
  st.packed_stage_bytes = 65536;  // 4-bit g32 f16: 80 + 80 B per row -> 384 rows
  EXPECT_EQ(plan(segs, 8, 8, 32, 128, st).segments[0].tile_rows, 384);
  EXPECT_EQ(base.segments[0].tile_rows, 128);

  DecodePlanOptions r;
  r.rows_per_split = 40;  // exact, not rounded to tiles
  const DecodePlan rp =
      plan({fp_seg(100, DType::kF16), fp_seg(50, DType::kF16, 100, 2)}, 1, 2, 2, 64, r);
  EXPECT_EQ(rp.segments[0].rows_per_split, 40);
  EXPECT_EQ(rp.segments[0].n_splits, 3);
  EXPECT_EQ(rp.segments[1].n_splits, 2);
  expect_consistent(rp);

  DecodePlanOptions bad;
  bad.target_blocks = -1;
  expect_error([&] { plan(segs, 8, 8, 32, 128, bad); }, "expected options >= 0");
}

// Query-head groups the kernels do not take in one block (past 8, or not a power of two; past 16
// for views of rows alone or of fixed group-32 records with f16 metadata whose grids are large
// enough, whose tensor-core kernel takes 16 heads in the mma's M dimension) run as kv_rep blocks
// per KV head of the largest of 16 (those views), 8, 4, 2, 1 dividing the group; the splits and the
// block target count those blocks, as H_kv * kv_rep heads of G / kv_rep query heads would.
TEST(DecodePlan, LargeOrOddGroupsTakeSeveralBlocksPerKvHead) {
  const std::vector<DeviceSegment> f16 = {fp_seg(32768, DType::kF16)};
  const std::vector<DeviceSegment> bf16 = {fp_seg(32768, DType::kBF16)};
  const std::vector<DeviceSegment> k2 = {fp_seg(4, DType::kBF16),
                                         packed_seg(32768, 2, 2, 32, MetaType::kF16)};
  const std::vector<DeviceSegment> k4 = {packed_seg(32768, 4, 4, 32, MetaType::kF16)};
  const std::vector<DeviceSegment> k2fp8 = {packed_seg(32768, 2, 2, 32, MetaType::kFP8E4M3)};
  struct Want {
    int64_t H, Hq, rep16, rep8;  // kv_rep of views the 16-head block takes, of the others
  };
  for (const Want w : {Want{8, 128, 1, 2}, Want{8, 256, 2, 4}, Want{2, 6, 3, 3}, Want{4, 12, 3, 3},
                       Want{1, 5, 5, 5}, Want{8, 64, 1, 1}, Want{8, 32, 1, 1}, Want{2, 96, 3, 6},
                       Want{1, 48, 3, 6}}) {
    const std::vector<const std::vector<DeviceSegment>*> views = {&f16, &bf16, &k2, &k4, &k2fp8};
    for (size_t vi = 0; vi < views.size(); ++vi) {
      const std::vector<DeviceSegment>& segs = *views[vi];
      const int64_t rep = vi < 4 ? w.rep16 : w.rep8;
      const std::string vars = "H " + std::to_string(w.H) + " Hq " + std::to_string(w.Hq) +
                               " view " + std::to_string(vi);
      const DecodePlan p = plan(segs, 8, w.H, w.Hq, 128);
      EXPECT_EQ(p.kv_rep, rep) << vars;
      EXPECT_EQ(p.n_kv_heads, w.H) << vars;  // the view's heads: runs check views against them
      // the same plan as H_kv * kv_rep heads of a group of G / kv_rep (a kernel group)
      const DecodePlan same = plan(segs, 8, w.H * rep, w.Hq, 128);
      EXPECT_EQ(same.kv_rep, 1) << vars;
      EXPECT_EQ(p.kernel, same.kernel) << vars;
      EXPECT_EQ(p.n_splits, same.n_splits) << vars;
      EXPECT_EQ(p.stage_half_bytes, same.stage_half_bytes) << vars;
      EXPECT_EQ(p.workspace_bytes, same.workspace_bytes) << vars;
      expect_consistent(p);
    }
  }
  // packed views take the 16-head block from B * H_kv * rows >= 2^18 (rows alone always);
  // heads_per_block forces either way
  const std::vector<DeviceSegment> k2s = {packed_seg(4096, 2, 2, 32, MetaType::kF16)};
  const std::vector<DeviceSegment> f16s = {fp_seg(4096, DType::kF16)};
  EXPECT_EQ(plan(k2s, 1, 8, 128, 128).kv_rep, 2);
  EXPECT_EQ(plan(k2s, 8, 8, 128, 128).kv_rep, 1);
  EXPECT_EQ(plan(f16s, 1, 8, 128, 128).kv_rep, 1);
  DecodePlanOptions force;
  force.heads_per_block = 16;
  EXPECT_EQ(plan(k2s, 1, 8, 128, 128, force).kv_rep, 1);
  EXPECT_EQ(plan(k2fp8, 8, 8, 128, 128, force).kv_rep, 2);  // fp8 metadata: no 16-head block
  force.heads_per_block = 8;
  EXPECT_EQ(plan(f16s, 1, 8, 128, 128, force).kv_rep, 2);
  EXPECT_EQ(plan(k2, 8, 8, 128, 128, force).kv_rep, 2);
  force.heads_per_block = 4;
  expect_error([&] { plan(f16s, 1, 8, 128, 128, force); }, "expected heads_per_block 0");
  // the grid's y dimension holds the stored heads (x the splits' kv_rep blocks): 40000 KV heads
  // of 32 query heads plan, 70000 KV heads do not
  EXPECT_EQ(plan(f16, 1, 40000, 1280000, 128).kv_rep, 2);
  EXPECT_EQ(plan(k2fp8, 1, 40000, 640000, 128).kv_rep, 2);
  expect_error([&] { plan(f16, 1, 70000, 70000, 128); }, "expected B and H_kv <= 65535");
}

TEST(DecodePlan, RefusesShapesTheKernelsDoNotTake) {
  const std::vector<DeviceSegment> f16 = {fp_seg(17, DType::kF16)};
  expect_error([&] { plan(f16, 1, 2, 3, 128); }, "multiple of H_kv");
  expect_error([&] { plan(f16, 1, 2, 2, 96); }, "head_dim in {64, 128}");
  std::vector<DeviceSegment> many(kDecodeMaxSegments + 1, fp_seg(3, DType::kF16));
  expect_error([&] { plan(many); }, "non-empty segments");
  DeviceSegment mis = fp_seg(17, DType::kF16);
  mis.keys = static_cast<const char*>(mis.keys) + 8;
  expect_error([&] { plan({mis}); }, "16-byte aligned");
  // empty segments are skipped; no rows at all plans a zero output
  const DecodePlan z = plan({fp_seg(0, DType::kF16)});
  EXPECT_EQ(z.total_rows, 0);
  EXPECT_TRUE(z.segments.empty());
  expect_error([] { DecodeContext::fake(DeviceInfo{}, 2); }, "sm_count >= 1");
}

TEST(DecodePlan, ARunChecksTheLayersViewAgainstThePlan) {
  const std::vector<DeviceSegment> segs = {fp_seg(5, DType::kF16),
                                           packed_seg(1000, 2, 2, 32, MetaType::kF16, 128, 5)};
  const DecodePlan p = plan(segs, 2, 8, 32, 128);
  // another layer: other pointers, same shapes -> accepted, segments in order
  std::vector<DeviceSegment> other = segs;
  other[0] = fp_seg(5, DType::kF16, 0, 9);
  other[1].k_data += 4096;
  other[1].v_data += 4096;
  const PlannedSegments m = match_plan(p, 2, 8, 128, other);
  EXPECT_EQ(m[0], &other[0]);
  EXPECT_EQ(m[1], &other[1]);
  // an empty segment in between is skipped
  other.insert(other.begin() + 1, fp_seg(0, DType::kF16));
  EXPECT_EQ(match_plan(p, 2, 8, 128, other)[1], &other[2]);

  std::vector<DeviceSegment> rows = segs;
  rows[1].n_rows = 1001;
  expect_error([&] { match_plan(p, 2, 8, 128, rows); }, "segment 1 of 1000 rows");
  expect_error([&] { match_plan(p, 4, 8, 128, segs); }, "expected a view of B, H_kv, D = 2, 8");
  std::vector<DeviceSegment> dt = segs;
  dt[0].dtype = DType::kBF16;
  expect_error([&] { match_plan(p, 2, 8, 128, dt); }, "of dtype float16");
  std::vector<DeviceSegment> fmt = segs;
  fmt[1].k_fmt = make_row_format(128, 4, 32, MetaType::kF16);
  expect_error([&] { match_plan(p, 2, 8, 128, fmt); }, "packed formats and transforms");
  std::vector<DeviceSegment> perm = segs;
  perm[1].k_perm = reinterpret_cast<const int32_t*>(fake_ptr(50));
  expect_error([&] { match_plan(p, 2, 8, 128, perm); }, "packed formats and transforms");
  std::vector<DeviceSegment> fewer = {segs[0]};
  expect_error([&] { match_plan(p, 2, 8, 128, fewer); }, "2 non-empty segments");
  std::vector<DeviceSegment> more = segs;
  more.push_back(fp_seg(3, DType::kF16));
  expect_error([&] { match_plan(p, 2, 8, 128, more); }, "but got more");
  std::vector<DeviceSegment> pos = segs;
  pos[0].positions = reinterpret_cast<const int32_t*>(fake_ptr(60));
  expect_error([&] { match_plan(p, 2, 8, 128, pos); }, "explicit positions");
  std::vector<DeviceSegment> mis = segs;
  mis[1].k_data += 2;  // the plan's tensor-core kernel reads whole words
  ASSERT_NE(p.kernel, DecodeKernel::kCudaCore);
  expect_error([&] { match_plan(p, 2, 8, 128, mis); }, "4-byte aligned packed records");
}

}  // namespace
}  // namespace vq::cuda
