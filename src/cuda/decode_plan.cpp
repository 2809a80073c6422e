// Decode attention planner (decode_plan.h): validates the shapes and segment formats, chooses the
// kernel (DecodeKernel) and sizes the pipeline tiles and splits, from the shapes, the formats and
// the device context alone; and checks a layer's view against a plan before a run.
//
// Plan: every (b, kv head) gets about target / (B * H_kv) splits, each split at least 64 rows and
// a whole number of pipeline tiles (short f16-only views: at least 4 tiles per split while that
// leaves about a block per SM); a split never crosses a segment boundary (so its rows share one
// format). Views of f16 rows (or of bf16 rows: the bf16-row instances) and 2/2- or 4/4-bit codes
// (groups of a multiple of 32) go to the tensor-core kernel, target = one wave of its resident
// blocks (the context's occupancy); others to the CUDA-core kernel, target = 16 blocks per SM
// (about four waves of its ~4 resident blocks). DecodePlanOptions overrides the block target, the
// packed stage bytes and the rows per split. Packed segments of a format no split kernel reads in
// place (fused_format: key and value groups that differ or are not a multiple of 8 channels)
// are planned as f32 rows that each run dequantizes into scratch first (unfused fallback). Packed
// segments with channel-axis keys are read in place by the channel kernel (128-row tiles, about
// four blocks per SM); a view holding them plans the CUDA-core kernel for its other segments.
#include "cuda/decode_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "veloxquant/error.h"

namespace vq::cuda {

namespace {

// Packed formats the split kernels read in place: keys and values of any code spec (1..8 bits or
// three levels: the pairs (2,2), (4,4), (8,8), (4,2), (2,4) by instances of their own, every other
// pair by the any-bits instance, decode_attention_kany.cu) in one group size, a multiple of 8
// (a kernel lane's 8-channel piece lies in one group). Other groups are dequantized first.
bool fused_format(const DeviceSegment& sg) {
  const PackedRowFormat &k = sg.k_fmt, &v = sg.v_fmt;
  return k.group_size == v.group_size && k.group_size % 8 == 0;
}

bool same_fmt(const PackedRowFormat& a, const PackedRowFormat& b) {
  return a.head_dim == b.head_dim && a.group_size == b.group_size && a.code_bytes == b.code_bytes &&
         a.row_stride == b.row_stride && a.spec.bits_x2 == b.spec.bits_x2 && a.meta == b.meta &&
         a.n_groups == b.n_groups && a.axis == b.axis;
}

// Every packed segment of a view shares the first one's formats and transforms (one kernel
// instance and one set of query transforms per launch).
void check_shares_format(const DeviceSegment& sg, const DeviceSegment& first) {
  VQ_CHECK(same_fmt(sg.k_fmt, first.k_fmt) && same_fmt(sg.v_fmt, first.v_fmt) &&
               sg.k_perm == first.k_perm && sg.v_perm == first.v_perm &&
               sg.k_signs == first.k_signs && sg.v_signs == first.v_signs,
           "[decode_attention] expected every packed segment of a view to share one format and "
           "one set of transforms");
}

bool channel_keys(const DeviceSegment& sg) {
  return sg.packed && sg.k_fmt.axis == QuantAxis::kChannel;
}

int32_t tile_rows_for(int64_t k_row_bytes, int64_t v_row_bytes) {
  const int64_t rb = std::max(k_row_bytes, v_row_bytes);
  int64_t t = std::min<int64_t>(128, kDecodeStageBytes / rb);
  t = t / 8 * 8;
  VQ_CHECK(t >= 8, "[decode_attention] expected rows of at most " +
                       std::to_string(kDecodeStageBytes / 8) + " bytes but got " +
                       std::to_string(rb));
  return static_cast<int32_t>(t);
}

bool is_mma(DecodeKernel k) {
  return k != DecodeKernel::kCudaCore;
}

// The instance of tensor-core kernel k for views whose full-precision rows are bf16.
DecodeKernel bf16_rows_instance(DecodeKernel k) {
  switch (k) {
    case DecodeKernel::kMmaF16:
      return DecodeKernel::kMmaBF16;
    case DecodeKernel::kMmaPacked2:
      return DecodeKernel::kMmaPacked2BF16;
    case DecodeKernel::kMmaPacked2F16Meta:
      return DecodeKernel::kMmaPacked2F16MetaBF16;
    case DecodeKernel::kMmaPacked4:
      return DecodeKernel::kMmaPacked4BF16;
    case DecodeKernel::kMmaPacked4F16Meta:
      return DecodeKernel::kMmaPacked4F16MetaBF16;
    case DecodeKernel::kMmaPacked2G32:
      return DecodeKernel::kMmaPacked2G32BF16;
    case DecodeKernel::kMmaPacked4G32:
      return DecodeKernel::kMmaPacked4G32BF16;
    default:
      break;
  }
  throw Error(std::string("[decode_attention] expected an f16-row tensor-core kernel but got ") +
              decode_kernel_name(k));
}

void check_rot_block(int32_t blk, int64_t D, const char* op) {
  VQ_CHECK(blk >= 1 && blk <= D && D % blk == 0 && (blk & (blk - 1)) == 0,
           std::string("[") + op + "] expected a power-of-two rotation block dividing " +
               std::to_string(D) + " but got " + std::to_string(blk));
}

}  // namespace

const char* decode_kernel_name(DecodeKernel k) {
  switch (k) {
    case DecodeKernel::kCudaCore:
      return "cuda-core";
    case DecodeKernel::kMmaF16:
      return "mma-f16";
    case DecodeKernel::kMmaPacked2:
      return "mma-k2v2";
    case DecodeKernel::kMmaPacked2F16Meta:
      return "mma-k2v2-f16meta";
    case DecodeKernel::kMmaPacked4:
      return "mma-k4v4";
    case DecodeKernel::kMmaPacked4F16Meta:
      return "mma-k4v4-f16meta";
    case DecodeKernel::kMmaPacked2G32:
      return "mma-k2v2-g32";
    case DecodeKernel::kMmaPacked4G32:
      return "mma-k4v4-g32";
    case DecodeKernel::kMmaBF16:
      return "mma-bf16";
    case DecodeKernel::kMmaPacked2BF16:
      return "mma-k2v2-bf16";
    case DecodeKernel::kMmaPacked2F16MetaBF16:
      return "mma-k2v2-f16meta-bf16";
    case DecodeKernel::kMmaPacked4BF16:
      return "mma-k4v4-bf16";
    case DecodeKernel::kMmaPacked4F16MetaBF16:
      return "mma-k4v4-f16meta-bf16";
    case DecodeKernel::kMmaPacked2G32BF16:
      return "mma-k2v2-g32-bf16";
    case DecodeKernel::kMmaPacked4G32BF16:
      return "mma-k4v4-g32-bf16";
  }
  return "unknown";
}

DecodeContext DecodeContext::fake(const DeviceInfo& info, int mma_blocks_per_sm) {
  VQ_CHECK(info.sm_count >= 1 && mma_blocks_per_sm >= 1,
           "[DecodeContext::fake] expected sm_count >= 1 and mma_blocks_per_sm >= 1 but got " +
               std::to_string(info.sm_count) + ", " + std::to_string(mma_blocks_per_sm));
  DecodeContext c;
  c.device_ = -1;
  c.info_ = info;
  c.fake_blocks_ = mma_blocks_per_sm;
  return c;
}

int DecodeContext::mma_blocks_per_sm(DecodeKernel k, int32_t head_dim, int32_t group,
                                     int32_t stage_half_bytes) const {
  VQ_CHECK(is_mma(k), std::string("[DecodeContext] expected a tensor-core kernel but got ") +
                          decode_kernel_name(k));
  if (!query_) return fake_blocks_;
  for (const Occupancy& o : memo_)
    if (o.kernel == k && o.head_dim == head_dim && o.group == group &&
        o.stage_half_bytes == stage_half_bytes)
      return o.blocks;
  const int n = query_(k, head_dim, group, stage_half_bytes);
  memo_.push_back({k, head_dim, group, stage_half_bytes, n});
  return n;
}

// Packed views take the 16-head block from B * H_kv * rows >= this (see plan_decode).
constexpr int64_t kM16Rows = int64_t{1} << 18;

DecodePlan plan_decode(const DecodeContext& ctx, int64_t n_q_heads, int64_t B, int64_t H, int64_t D,
                       const std::vector<DeviceSegment>& segments, const AttentionParams& p,
                       const DecodePlanOptions& opt) {
  VQ_CHECK(B >= 1 && H >= 1, "[decode_attention] expected a view with B, H_kv >= 1 but got " +
                                 std::to_string(B) + ", " + std::to_string(H));
  VQ_CHECK(D == 64 || D == 128,
           "[decode_attention] expected head_dim in {64, 128} but got " + std::to_string(D));
  VQ_CHECK(n_q_heads >= H && n_q_heads % H == 0,
           "[decode_attention] expected H_q a multiple of H_kv = " + std::to_string(H) +
               " but got " + std::to_string(n_q_heads));
  // The kernels take 1, 2, 4 or 8 query heads per block (the tensor-core kernel over rows alone or
  // fixed group-32 records also 16, below): a larger or odd group runs as kv_rep blocks per KV head
  // of G / kv_rep heads each (the largest of those sizes dividing G), every block reading the KV
  // head's rows (the blocks of one KV head are neighbours in the grid).
  const int64_t G = n_q_heads / H;
  int64_t Gk = G % 8 == 0 ? 8 : G % 4 == 0 ? 4 : G % 2 == 0 ? 2 : 1;
  int64_t R = G / Gk, Hv = H * R;
  VQ_CHECK(p.window >= 0,
           "[decode_attention] expected window >= 0 but got " + std::to_string(p.window));
  VQ_CHECK(B <= 65535 && H <= 65535, "[decode_attention] expected B and H_kv <= 65535 but got " +
                                         std::to_string(B) + ", " + std::to_string(H));
  VQ_CHECK(opt.heads_per_block == 0 || opt.heads_per_block == 8 || opt.heads_per_block == 16,
           "[decode_attention] expected heads_per_block 0 (automatic), 8 or 16 but got " +
               std::to_string(opt.heads_per_block));
  VQ_CHECK(opt.rows_per_split >= 0 && opt.target_blocks >= 0 && opt.packed_stage_bytes >= 0,
           "[decode_attention] expected options >= 0 (0 = automatic) but got rows_per_split " +
               std::to_string(opt.rows_per_split) + ", target_blocks " +
               std::to_string(opt.target_blocks) + ", packed_stage_bytes " +
               std::to_string(opt.packed_stage_bytes));
  const int64_t sm_count = ctx.info().sm_count;
  VQ_CHECK(sm_count >= 1,
           "[decode_attention] expected a device context with sm_count >= 1 but "
           "got " +
               std::to_string(sm_count));

  DecodePlan plan;
  plan.batch = B;
  plan.n_kv_heads = H;
  plan.head_dim = D;
  plan.n_q_heads = n_q_heads;
  plan.kv_rep = static_cast<int32_t>(R);
  plan.params = p;
  plan.device = ctx.device();

  const DeviceSegment* pk_first = nullptr;
  for (const DeviceSegment& sg : segments) {
    if (sg.n_rows == 0) continue;
    VQ_CHECK(plan.segments.size() < static_cast<size_t>(kDecodeMaxSegments),
             "[decode_attention] expected at most " + std::to_string(kDecodeMaxSegments) +
                 " non-empty segments but got more (merge them on upload)");
    DecodeSegmentPlan d;
    d.n_rows = sg.n_rows;
    d.capacity = sg.capacity;
    d.positions = sg.positions != nullptr;
    d.packed = sg.packed;
    d.dtype = sg.dtype;
    if (sg.packed) {
      d.k_fmt = sg.k_fmt;
      d.v_fmt = sg.v_fmt;
      d.k_perm = sg.k_perm != nullptr;
      d.v_perm = sg.v_perm != nullptr;
      d.k_signs = sg.k_signs != nullptr;
      d.v_signs = sg.v_signs != nullptr;
      d.k_rot_block = d.k_signs ? sg.k_rot_block : 0;
      d.v_rot_block = d.v_signs ? sg.v_rot_block : 0;
    }
    if (channel_keys(sg)) {
      // Channel-axis keys: the channel kernel reads every code width and metadata type in place
      // (64-row softmax steps); the view's other packed segments must share the format.
      VQ_CHECK(sg.k_fmt.head_dim == D && sg.v_fmt.head_dim == D,
               "[decode_attention] expected packed records of head_dim " + std::to_string(D));
      VQ_CHECK(sg.v_fmt.axis == QuantAxis::kToken && sg.v_fmt.group_size >= 1,
               "[decode_attention] expected token-axis value records beside channel-axis keys");
      VQ_CHECK(sg.k_runs == nullptr || sg.k_n_runs >= 1,
               "[decode_attention] expected channel-axis key runs >= 1 but got " +
                   std::to_string(sg.k_n_runs));
      VQ_CHECK(sg.k_fmt.n_groups >= 1 && (sg.capacity == 0 || sg.capacity >= sg.n_rows),
               "[decode_attention] expected a channel-axis key format with metadata slots and "
               "capacity >= n_rows");
      if (!pk_first) {
        pk_first = &sg;
        plan.k_bits = sg.k_fmt.spec.bits();
        plan.v_bits = sg.v_fmt.spec.bits();
        if (d.k_signs) check_rot_block(d.k_rot_block, D, "decode_attention");
        if (d.v_signs) check_rot_block(d.v_rot_block, D, "decode_attention");
      } else {
        check_shares_format(sg, *pk_first);
      }
      d.channel = true;
      d.k_row_bytes = sg.k_fmt.row_stride;
      d.v_row_bytes = sg.v_fmt.row_stride;
      d.tile_rows = kChannelTileRows;
      plan.total_rows += sg.n_rows;
      plan.segments.push_back(d);
      continue;
    }
    if (sg.packed && !fused_format(sg)) {
      VQ_CHECK(sg.k_fmt.head_dim == D && sg.v_fmt.head_dim == D,
               "[decode_attention] expected packed records of head_dim " + std::to_string(D));
      d.dequantize = true;
      d.dtype = DType::kF32;
      d.k_row_bytes = d.v_row_bytes = static_cast<int32_t>(D * 4);
      d.tile_rows = tile_rows_for(d.k_row_bytes, d.v_row_bytes);
      plan.scratch_bytes += static_cast<size_t>(2 * B * H * dequantized_capacity(sg) * D) * 4;
      plan.total_rows += sg.n_rows;
      plan.segments.push_back(d);
      continue;
    }
    const int64_t cap = sg.capacity > 0 ? sg.capacity : sg.n_rows;
    VQ_CHECK(cap >= sg.n_rows, "[decode_attention] expected capacity >= n_rows but got " +
                                   std::to_string(cap) + " < " + std::to_string(sg.n_rows));
    if (sg.packed) {
      if (!pk_first) {
        pk_first = &sg;
        plan.k_bits = sg.k_fmt.spec.bits();
        plan.v_bits = sg.v_fmt.spec.bits();
        VQ_CHECK(sg.k_fmt.group_size == sg.v_fmt.group_size && sg.k_fmt.group_size % 8 == 0,
                 "[decode_attention] expected one key/value group_size, a multiple of 8, but "
                 "got " +
                     std::to_string(sg.k_fmt.group_size) + " / " +
                     std::to_string(sg.v_fmt.group_size));
        VQ_CHECK(sg.k_fmt.head_dim == D && sg.v_fmt.head_dim == D,
                 "[decode_attention] expected packed rows of head_dim " + std::to_string(D));
        if (d.k_signs) check_rot_block(d.k_rot_block, D, "decode_attention");
        if (d.v_signs) check_rot_block(d.v_rot_block, D, "decode_attention");
      } else {
        check_shares_format(sg, *pk_first);
      }
      d.k_row_bytes = sg.k_fmt.row_stride;
      d.v_row_bytes = sg.v_fmt.row_stride;
    } else {
      const int64_t rb = D * static_cast<int64_t>(dtype_size(sg.dtype));
      d.k_row_bytes = static_cast<int32_t>(rb);
      d.v_row_bytes = static_cast<int32_t>(rb);
    }
    d.tile_rows = tile_rows_for(d.k_row_bytes, d.v_row_bytes);
    plan.total_rows += sg.n_rows;
    plan.segments.push_back(d);
  }
  // Null and misaligned pointers of this view (every run checks its own view the same way).
  (void)match_plan(plan, B, H, D, segments);
  if (plan.total_rows == 0) return plan;  // nothing to attend to: a run writes zeros

  // ---- the tensor-core kernel takes full-precision rows all f16 or all bf16 (its bf16-row
  // instances) and 2/2- or 4/4-bit codes in groups of a multiple of 32 channels
  std::vector<DecodeSegmentPlan>& sp = plan.segments;
  bool all_16 = true, any_packed = false, packed_aligned = true, any_rows = false;
  bool any_channel = false;  // channel-axis keys: CUDA-core kernels only
  DType rows_dtype = DType::kF16;
  size_t si = 0;
  for (const DeviceSegment& sg : segments) {
    if (sg.n_rows == 0) continue;
    const DecodeSegmentPlan& d = sp[si++];
    any_channel = any_channel || d.channel;
    if (d.packed && !d.dequantize) {
      any_packed = true;
      packed_aligned = packed_aligned && d.k_row_bytes % 4 == 0 && d.v_row_bytes % 4 == 0 &&
                       reinterpret_cast<uintptr_t>(sg.k_data) % 4 == 0 &&
                       reinterpret_cast<uintptr_t>(sg.v_data) % 4 == 0;
    } else {
      all_16 = all_16 && (d.dtype == DType::kF16 || d.dtype == DType::kBF16) &&
               (!any_rows || d.dtype == rows_dtype);
      rows_dtype = d.dtype;
      any_rows = true;
    }
  }
  const int32_t group_size = pk_first ? pk_first->k_fmt.group_size : 0;
  const bool mma =
      all_16 && !any_channel &&
      (!any_packed || ((plan.k_bits == 2 || plan.k_bits == 4) && plan.v_bits == plan.k_bits &&
                       group_size % 32 == 0 && pk_first->k_fmt.code_bytes % 4 == 0 &&
                       pk_first->v_fmt.code_bytes % 4 == 0 && packed_aligned));
  // the channel kernel stages tiles of kChannelTileRows rows and sets up its queries once per
  // block: about one wave of its resident blocks (4-5 per SM), so each split streams several
  // tiles through its two stages instead of one (H200, 8 x 32K: 16 blocks per SM of one tile
  // each left it latency-bound, docs/results/gpu/run20_s21)
  int64_t target_blocks = (any_channel ? 4 : 16) * sm_count;
  if (mma) {
    // stage rows: a multiple of 64 for the packed rows (or the f16 rows of an f16-only view),
    // a multiple of 16 for the f16 sinks / tail of a packed view, within the same stage bytes
    const bool f16_meta = pk_first && pk_first->k_fmt.meta == MetaType::kF16 &&
                          pk_first->v_fmt.meta == MetaType::kF16;
    if (!any_packed) {
      plan.kernel = DecodeKernel::kMmaF16;
    } else if (plan.k_bits == 2) {
      plan.kernel = f16_meta ? DecodeKernel::kMmaPacked2F16Meta : DecodeKernel::kMmaPacked2;
    } else {
      plan.kernel = f16_meta ? DecodeKernel::kMmaPacked4F16Meta : DecodeKernel::kMmaPacked4;
    }
    if (any_packed && f16_meta && group_size == 32) {
      // records of D bits / 8 code bytes + D / 8 bytes of f16 metadata: the instance with every
      // record offset a compile-time constant (fewer instructions per row)
      const int64_t cb = D * plan.k_bits / 8;
      bool fixed = pk_first->k_fmt.code_bytes == cb && pk_first->v_fmt.code_bytes == cb;
      for (const DecodeSegmentPlan& d : sp)
        if (d.packed && !d.dequantize)
          fixed = fixed && d.k_row_bytes == cb + D / 8 && d.v_row_bytes == cb + D / 8;
      if (fixed)
        plan.kernel =
            plan.k_bits == 2 ? DecodeKernel::kMmaPacked2G32 : DecodeKernel::kMmaPacked4G32;
    }
    // 16 heads in the mma's M dimension read (and decode) each KV head's rows once. Rows alone
    // take it at every shape; packed views once the grid's rows amortise its heavier query
    // set-up and merge (H200, 128 query / 8 KV heads, docs/results/gpu/run17_s18 i1 / i4: K2V2
    // g32 8 x 32K 231.4 -> 181.9 us, 8 x 4K 70.6 -> 65.7, 1 x 32K 50.7 -> 49.8, but 1 x 4K
    // 22.4 -> 30.3 with twice the splits of half the rows)
    const bool takes16 = plan.kernel == DecodeKernel::kMmaF16 ||
                         plan.kernel == DecodeKernel::kMmaPacked2G32 ||
                         plan.kernel == DecodeKernel::kMmaPacked4G32;
    const bool want16 = opt.heads_per_block == 16 ||
                        (opt.heads_per_block == 0 && (plan.kernel == DecodeKernel::kMmaF16 ||
                                                      B * H * plan.total_rows >= kM16Rows));
    if (G % 16 == 0 && takes16 && want16) {
      Gk = 16;
      R = G / Gk;
      Hv = H * R;
      plan.kv_rep = static_cast<int32_t>(R);
    }
    if (any_rows && rows_dtype == DType::kBF16) plan.kernel = bf16_rows_instance(plan.kernel);
    int64_t half = 0;
    for (DecodeSegmentPlan& d : sp) {
      const int64_t rb = d.k_row_bytes + d.v_row_bytes;
      if (d.packed || !any_packed) {
        // packed rows: 128-row tiles, up to twice the packed stage bytes (4-bit codes at D 128:
        // 128 rows of 160 bytes; H200, 8 x 32K: 184 us against 189 with 64-row tiles)
        const int64_t budget =
            !any_packed ? kDecodeMmaStageBytes
                        : (opt.packed_stage_bytes > 0
                               ? opt.packed_stage_bytes
                               : std::clamp<int64_t>(128 * rb, kDecodeMmaPackedStageBytes,
                                                     2 * kDecodeMmaPackedStageBytes));
        d.tile_rows = static_cast<int32_t>(std::clamp<int64_t>(budget / rb / 64 * 64, 64, 512));
      }
      half = std::max(half,
                      static_cast<int64_t>(d.tile_rows) * std::max(d.k_row_bytes, d.v_row_bytes));
    }
    if (any_packed) {  // f16 segments of a packed view fit the packed stage (>= 16 rows)
      for (DecodeSegmentPlan& d : sp) {
        if (d.packed) continue;
        d.tile_rows = static_cast<int32_t>(std::max<int64_t>(16, half / d.k_row_bytes / 16 * 16));
      }
      half = 0;
      for (const DecodeSegmentPlan& d : sp)
        half = std::max(half,
                        static_cast<int64_t>(d.tile_rows) * std::max(d.k_row_bytes, d.v_row_bytes));
    }
    // + 32 bytes of alignment slack for packed byte ranges; the block merge reuses the stages
    const int64_t merge = (2 * 4 * Gk + 4 * Gk * D) * 4;
    const int64_t stage_halves = 2 * decode_mma_stages(plan.kernel);
    half = std::max(half + 32, (merge + stage_halves - 1) / stage_halves);
    plan.stage_half_bytes = static_cast<int32_t>((half + 15) / 16 * 16);
    const int bps =
        std::max(1, ctx.mma_blocks_per_sm(plan.kernel, static_cast<int32_t>(D),
                                          static_cast<int32_t>(Gk), plan.stage_half_bytes));
    target_blocks = static_cast<int64_t>(bps) * sm_count;  // one wave
  }

  // ---- plan the splits
  if (opt.target_blocks > 0) target_blocks = opt.target_blocks;
  plan.target_blocks = target_blocks;
  int64_t per_bh = mma ? std::max<int64_t>(1, target_blocks / (B * Hv))
                       : std::max<int64_t>(1, (target_blocks + B * Hv - 1) / (B * Hv));
  if (mma && !any_packed && opt.target_blocks == 0) {
    // short f16 contexts (batch-1 latency): fewer, fatter splits of at least 4 pipeline tiles when
    // that still leaves about a block per SM. H200, B 1, 8 KV heads: 4K rows take 16 splits of 256
    // rows instead of 32 of 128 (17.3 -> 15.9 us); 2K rows keep 32 of 64 (16 of 128: 14.2 ->
    // 14.8 us)
    const int64_t by_tiles = plan.total_rows / (4 * static_cast<int64_t>(sp[0].tile_rows));
    const int64_t floor_bh = std::max<int64_t>(1, sm_count / (B * Hv));
    if (by_tiles >= floor_bh) per_bh = std::min(per_bh, by_tiles);
  }
  const int64_t rows_per_split =
      opt.rows_per_split > 0 ? opt.rows_per_split
                             : std::max<int64_t>(64, (plan.total_rows + per_bh - 1) / per_bh);
  int64_t n_splits = 0;
  for (DecodeSegmentPlan& d : sp) {
    const int64_t tr = d.tile_rows;
    d.rows_per_split =
        opt.rows_per_split > 0 ? rows_per_split : (rows_per_split + tr - 1) / tr * tr;
    d.split_begin = static_cast<int32_t>(n_splits);
    d.n_splits = static_cast<int32_t>((d.n_rows + d.rows_per_split - 1) / d.rows_per_split);
    n_splits += d.n_splits;
  }
  VQ_CHECK(n_splits <= (1 << 20),
           "[decode_attention] expected at most 2^20 splits but got " + std::to_string(n_splits));
  // the grid's x dimension holds splits * kv_rep (decode_impl::split_grid)
  VQ_CHECK(n_splits * R <= INT32_MAX,
           "[decode_attention] expected splits * blocks per KV head <= 2^31 - 1 but got " +
               std::to_string(n_splits) + " * " + std::to_string(R));
  plan.n_splits = static_cast<int32_t>(n_splits);
  const size_t n_part = static_cast<size_t>(B * n_q_heads * n_splits);
  const size_t acc_bytes = (n_part * static_cast<size_t>(D) * 4 + 255) / 256 * 256;
  plan.workspace_bytes = acc_bytes + n_part * 2 * 4;
  return plan;
}

bool decode_plan_has_channel(const DecodePlan& plan) {
  return std::any_of(plan.segments.begin(), plan.segments.end(),
                     [](const DecodeSegmentPlan& d) { return d.channel; });
}

bool decode_plan_joins_batch(const DecodePlan& plan) {
  return plan.batch == 1 && plan.total_rows > 0 && plan.scratch_bytes == 0 &&
         !decode_plan_has_channel(plan);
}

PlannedSegments match_plan(const DecodePlan& plan, int64_t B, int64_t H, int64_t D,
                           const std::vector<DeviceSegment>& segments) {
  VQ_CHECK(B == plan.batch && H == plan.n_kv_heads && D == plan.head_dim,
           "[decode_attention_run] expected a view of B, H_kv, D = " + std::to_string(plan.batch) +
               ", " + std::to_string(plan.n_kv_heads) + ", " + std::to_string(plan.head_dim) +
               " (the plan's) but got " + std::to_string(B) + ", " + std::to_string(H) + ", " +
               std::to_string(D));
  PlannedSegments out{};
  size_t i = 0;
  const DeviceSegment* pk_first = nullptr;
  for (const DeviceSegment& sg : segments) {
    if (sg.n_rows == 0) continue;
    const std::string at = "segment " + std::to_string(i);
    VQ_CHECK(i < plan.segments.size(), "[decode_attention_run] expected " +
                                           std::to_string(plan.segments.size()) +
                                           " non-empty segments (the plan's) but got more");
    const DecodeSegmentPlan& d = plan.segments[i];
    VQ_CHECK(sg.n_rows == d.n_rows && sg.capacity == d.capacity,
             "[decode_attention_run] expected " + at + " of " + std::to_string(d.n_rows) +
                 " rows, capacity " + std::to_string(d.capacity) + " (the plan's) but got " +
                 std::to_string(sg.n_rows) + ", " + std::to_string(sg.capacity));
    VQ_CHECK(sg.packed == d.packed && (sg.positions != nullptr) == d.positions,
             "[decode_attention_run] expected " + at + (d.packed ? " packed" : " full-precision") +
                 (d.positions ? " with" : " without") + " explicit positions (the plan's)");
    if (d.packed) {
      VQ_CHECK(same_fmt(sg.k_fmt, d.k_fmt) && same_fmt(sg.v_fmt, d.v_fmt) &&
                   (sg.k_perm != nullptr) == d.k_perm && (sg.v_perm != nullptr) == d.v_perm &&
                   (sg.k_signs != nullptr) == d.k_signs && (sg.v_signs != nullptr) == d.v_signs &&
                   (!d.k_signs || sg.k_rot_block == d.k_rot_block) &&
                   (!d.v_signs || sg.v_rot_block == d.v_rot_block),
               "[decode_attention_run] expected " + at +
                   " of the plan's packed formats and transforms but got others");
      VQ_CHECK(sg.k_data && sg.v_data, "[decode_attention_run] expected packed records in " + at +
                                           " but got a null pointer");
      VQ_CHECK(!d.channel || sg.k_runs == nullptr || sg.k_n_runs >= 1,
               "[decode_attention_run] expected channel-axis key runs >= 1 in " + at + " but got " +
                   std::to_string(sg.k_n_runs));
      if (d.dequantize) {
        if (sg.k_signs) check_rot_block(sg.k_rot_block, D, "decode_attention_run");
        if (sg.v_signs) check_rot_block(sg.v_rot_block, D, "decode_attention_run");
      } else if (!pk_first) {
        pk_first = &sg;
      } else {
        VQ_CHECK(sg.k_perm == pk_first->k_perm && sg.v_perm == pk_first->v_perm &&
                     sg.k_signs == pk_first->k_signs && sg.v_signs == pk_first->v_signs,
                 "[decode_attention_run] expected every packed segment of a view to share one "
                 "set of transforms but " +
                     at + " has others");
      }
      if (!d.dequantize && is_mma(plan.kernel))
        VQ_CHECK(reinterpret_cast<uintptr_t>(sg.k_data) % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(sg.v_data) % 4 == 0,
                 "[decode_attention_run] expected 4-byte aligned packed records in " + at +
                     " (the plan's tensor-core kernel reads words) but got others");
    } else {
      VQ_CHECK(sg.dtype == d.dtype, "[decode_attention_run] expected " + at + " of dtype " +
                                        dtype_name(d.dtype) + " (the plan's) but got " +
                                        dtype_name(sg.dtype));
      VQ_CHECK(sg.keys && sg.values, "[decode_attention_run] expected full-precision rows in " +
                                         at + " but got a null pointer");
      VQ_CHECK(reinterpret_cast<uintptr_t>(sg.keys) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(sg.values) % 16 == 0,
               "[decode_attention_run] expected 16-byte aligned full-precision rows in " + at);
    }
    out[i++] = &sg;
  }
  VQ_CHECK(i == plan.segments.size(),
           "[decode_attention_run] expected " + std::to_string(plan.segments.size()) +
               " non-empty segments (the plan's) but got " + std::to_string(i));
  return out;
}

DecodePlan decode_attention_plan(const DecodeContext& ctx, int64_t n_q_heads,
                                 const DeviceCacheView& view, const AttentionParams& p,
                                 const DecodePlanOptions& opt) {
  return plan_decode(ctx, n_q_heads, view.batch(), view.n_kv_heads(), view.head_dim(),
                     view.segments(), p, opt);
}

}  // namespace vq::cuda
