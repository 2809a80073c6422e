// Fused decode attention (N = 1 query per sequence) over a device cache view: the parameter block
// that decode_api.cpp fills from a DecodePlan (decode_plan.h) and a layer's view for the kernels,
// and the host launcher.
//
// Grid: (total splits * kv_rep, H_kv, B) (decode_impl::split_grid: the kv_rep blocks of a split
// are x neighbours); each block reads rows [begin, end) of ONE segment for
// one (b, kv head) and the G = H_q / (H_kv * kv_rep) query heads of its share of the group (with
// kv_rep 1, all of them: every KV row is read once), and
// writes a partial (running max m, sum l, unnormalised accumulator acc[D]) per query head. The
// combine kernel merges the splits of each (b, query head) exactly (log-sum-exp) and un-transforms
// the accumulator of packed-value splits (stored channel order -> original) once.
// Layouts: q, out [B, H_q, D] fp32; partial acc [B, H_q, n_splits, D], m/l [B, H_q, n_splits, 2].
// A batched launch (DecodeParams::seqs) runs one such view of batch 1 per sequence: z (y for the
// combine) indexes the sequence, whose own parameter block the kernels read instead.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/decode_plan.h"

namespace vq::cuda {

struct DecodeSegmentParams {
  int packed = 0;                      // 0: full precision, 1: packed, 2: channel-axis keys
  int dtype = 1;                       // full precision: 0 f32, 1 f16, 2 bf16 (vq::DType values)
  int64_t n_rows = 0;                  // rows per (b, h)
  int64_t first_pos = 0;               // implicit positions first_pos + i when positions == nullptr
  int64_t capacity = 0;                // rows allocated per (b, h) (>= n_rows)
  const int32_t* positions = nullptr;  // [B, H, capacity] or nullptr
  const uint8_t* k = nullptr;          // row (b, h, i) at k + ((b*H + h)*capacity + i)*k_row_bytes
  const uint8_t* v = nullptr;
  int32_t k_row_bytes = 0;  // D*elem_size, or the packed record stride
  int32_t v_row_bytes = 0;
  int32_t tile_rows = 0;    // rows staged per pipeline step (multiple of 8; of 16 for the
                            // tensor-core kernel, of 64 for its packed and f16-only views)
  int32_t split_begin = 0;  // index of this segment's first split
  int32_t n_splits = 0;
  int64_t rows_per_split = 0;
};

// Format and transforms shared by every packed segment of a view.
struct DecodePackedParams {
  int32_t group_size = 32;
  int32_t k_code_bytes = 0, v_code_bytes = 0;
  int32_t k_meta = 0, v_meta = 0;  // vq::MetaType values: 0 f16, 1 f32, 2 fp8 e4m3
  // CodeSpec::bits_x2 of the key and value codes (1..8 bits: 2..16, 1.5 bits: 3), read by the
  // CUDA-core kernel's any-bits instance (decode_attention_kernel.cuh, kAnyBits)
  int32_t k_bits_x2 = 0, v_bits_x2 = 0;
  const int32_t* k_perm = nullptr;  // [H_kv, D] or nullptr
  const float* k_signs = nullptr;   // [H_kv, D] or nullptr
  int32_t k_rot_block = 0;
  float k_rot_norm = 1.0f;  // 1/sqrt(k_rot_block)
  const int32_t* v_perm = nullptr;
  const float* v_signs = nullptr;
  int32_t v_rot_block = 0;
  float v_rot_norm = 1.0f;
};

struct DecodeParams {
  const float* q = nullptr;   // [B, H_q, D]
  float* out = nullptr;       // [B, H_q, D]
  float* part_acc = nullptr;  // [B, H_q, n_splits, D]
  float* part_ml = nullptr;   // [B, H_q, n_splits, 2]
  int32_t batch = 0, n_kv_heads = 0, group = 0, head_dim = 0;
  float scale_log2 = 0.0f;  // softmax scale * log2(e)
  // Blocks per stored KV head (DecodePlan::kv_rep): n_kv_heads and group above are the kernels'
  // (H_kv * kv_rep blocks of H_q / (H_kv * kv_rep) query heads); block head kvh reads the rows,
  // positions and transforms of stored head kvh / kv_rep (kv_bh below)
  int32_t kv_rep = 1;
  int64_t q_pos = 0;
  int64_t window = 0;
  int32_t n_segments = 0;
  int32_t n_splits = 0;  // total over segments
  DecodeSegmentParams seg[kDecodeMaxSegments];
  DecodePackedParams pk;
  int32_t k_bits = 0, v_bits = 0;  // 0 when the view has no packed segment
  // Split kernel instance (DecodeKernel in veloxquant/cuda.h): the CUDA-core kernel of
  // decode_attention_kernel.cuh, or one of the tensor-core kernel of decode_attention_mma.cuh;
  // stage_half_bytes: bytes of K (and of V) per pipeline stage of the tensor-core kernel.
  DecodeKernel kernel = DecodeKernel::kCudaCore;
  int32_t stage_half_bytes = 0;
  // A batched launch (decode_attention_run_batch): device array [batch] of every sequence's own
  // parameters (its q, out, partials, q_pos, splits, segments, packed transforms; batch 1 each),
  // read by block z of the split kernel and block y of the combine; this block then holds what
  // they share (kernel, head_dim, group, n_kv_heads, bits, stage bytes) and n_splits = the
  // largest sequence's, the blocks past a sequence's own n_splits returning at once. nullptr: one
  // view of `batch` rows of B, this block alone.
  const DecodeParams* seqs = nullptr;
};

// A batched launch's sequences as the tensor-core split kernel reads them: by value, in its kernel
// parameter (the constant bank), so each block's reads stay as cheap as a single launch's and
// can be reloaded past the pipeline's barriers instead of held in registers. Staged in shared
// memory instead, they cost the engine's batched f16 launch 24% (325 against 262 us per layer at
// 8 x 32K; docs/results/gpu/run11_s12/c3). At most kDecodeBatchInline sequences per launch (the
// 32,764-byte kernel parameter limit of sm_70+ with CUDA 12.1+); decode_attention_run_batch
// launches larger groups in balanced pieces (veloxquant/cuda.h decode_batch_pieces).
constexpr int kDecodeBatchInline = static_cast<int>(kDecodeBatchMaxSequences);
struct DecodeBatchArg {
  DecodeParams seq[kDecodeBatchInline];
};
static_assert(sizeof(DecodeBatchArg) <= 32764, "a kernel parameter holds at most 32,764 bytes");

// Queues the split kernel and the combine kernel on stream s; throws vq::Error for an unsupported
// (head_dim, group, bits) combination, a segment with channel-axis keys (packed 2:
// decode_attention_launch_channel) or a failed launch. A batched p (p.seqs) with a tensor-core
// kernel also needs `batch`: the same p.batch sequences' parameters on the host.
void decode_attention_launch(const DecodeParams& p, cudaStream_t s,
                             const DecodeBatchArg* batch = nullptr);

// What the channel kernel (decode_attention_channel.cuh) reads beyond DecodeParams for the
// segments with channel-axis keys (DecodeSegmentParams::packed == 2; their DecodePackedParams
// group_size is the values'). A separate block so that DecodeParams keeps its layout.
struct DecodeChannelParams {
  // per segment: run starts [k_n_runs + 1] (DeviceSegment::k_runs), or nullptr: one run
  const int32_t* k_runs[kDecodeMaxSegments] = {};
  int32_t k_n_runs[kDecodeMaxSegments] = {};
  int32_t k_bits_x2 = 0, v_bits_x2 = 0;  // CodeSpec::bits_x2 of the key and value codes
  int32_t k_meta_slots = 0;  // metadata slots per key record (PackedRowFormat::n_groups)
};

// A view with channel-axis key segments (unbatched, CUDA-core kernel): the split kernel over the
// other segments (the channel-axis ones emptied: their splits get empty partials), then the
// channel kernel over those splits, then the combine; all on stream s.
void decode_attention_launch_channel(const DecodeParams& p, const DecodeChannelParams& ch,
                                     cudaStream_t s);

// Resident blocks per SM of the tensor-core kernel for p (p.kernel, head_dim, group and
// stage_half_bytes set): the planner sizes the splits to one wave of them.
int decode_mma_blocks_per_sm(const DecodeParams& p);

}  // namespace vq::cuda
