// The host-only half of decode attention (veloxquant/cuda.h): the planner that turns shapes,
// segment formats and a device context into a DecodePlan, and the check that a layer's view
// matches a plan. Plain C++ without the CUDA runtime, so it is built (and unit-tested,
// tests/test_decode_plan.cpp) with or without VQ_CUDA; decode_api.cpp runs the plans.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "veloxquant/cuda.h"

namespace vq::cuda {

// Non-empty segments one decode launch can read (DecodeParams::seg of decode_attention.cuh).
constexpr int kDecodeMaxSegments = 8;

// K + V bytes one stage of the tensor-core kernel aims for (tile_rows a multiple of 64): f16-only
// views, and the lower end of the packed rows' range (up to twice that, 128-row tiles).
constexpr int kDecodeMmaStageBytes = 32768;
constexpr int kDecodeMmaPackedStageBytes = 12288;

// Pipeline stages of a tensor-core kernel instance: 2 for the 4-bit packed ones, 3 for the others
// (decode_attention_mma.cuh, mma_stages, has the reason); the block merge reuses those stages.
inline int decode_mma_stages(DecodeKernel k) {
  switch (k) {
    case DecodeKernel::kMmaPacked4:
    case DecodeKernel::kMmaPacked4F16Meta:
    case DecodeKernel::kMmaPacked4G32:
    case DecodeKernel::kMmaPacked4BF16:
    case DecodeKernel::kMmaPacked4F16MetaBF16:
    case DecodeKernel::kMmaPacked4G32BF16:
      return 2;
    default:
      return 3;
  }
}

// Rows one pipeline stage of K (or V) of the CUDA-core kernel can hold: tile_rows =
// min(128, this / row_bytes) rounded down to a multiple of 8.
constexpr int kDecodeStageBytes = 8192;

// Rows per pipeline tile of the channel kernel (decode_attention_channel.cu: one row per thread
// of its 128-thread block); the planner's tile_rows of channel-axis segments.
constexpr int32_t kChannelTileRows = 128;

// Whether plan reads channel-axis keys (the channel kernel; such plans run alone in a batched
// run, decode_plan_joins_batch).
bool decode_plan_has_channel(const DecodePlan& plan);

// decode_attention_plan over the pieces of a view: batch B, n_kv_heads H, head_dim D and its
// segments (empty ones are skipped). Throws vq::Error "[decode_attention] ..." for shapes or
// formats the kernels do not take.
DecodePlan plan_decode(const DecodeContext& ctx, int64_t n_q_heads, int64_t batch,
                       int64_t n_kv_heads, int64_t head_dim,
                       const std::vector<DeviceSegment>& segments, const AttentionParams& p,
                       const DecodePlanOptions& opt);

// The non-empty segments of a view, in order, after checking them against plan (shapes,
// rows, capacities, kinds, dtypes, formats, presence of positions and transforms, null and
// misaligned pointers); throws vq::Error "[decode_attention_run] expected ... but got ...".
using PlannedSegments = std::array<const DeviceSegment*, kDecodeMaxSegments>;
PlannedSegments match_plan(const DecodePlan& plan, int64_t batch, int64_t n_kv_heads,
                           int64_t head_dim, const std::vector<DeviceSegment>& segments);

// Rows per (b, h) of the fp32 copy of a packed segment that is dequantized: its capacity when it
// has explicit positions (they are indexed by the capacity), else its rows.
inline int64_t dequantized_capacity(const DeviceSegment& sg) {
  return sg.positions ? (sg.capacity > 0 ? sg.capacity : sg.n_rows) : sg.n_rows;
}

}  // namespace vq::cuda
