// Prefill attention over a device cache view (include/veloxquant/cuda_cache.h): the kernel's
// parameter block. Layouts: q, out [B, H_q, N, D] fp32 contiguous; segment rows of frame
// f = b*H_kv + h start at f*capacity (full precision [F, cap, D] of dtype; packed records of
// row_stride bytes); positions [F, cap] or the implicit run first_pos + i.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vq::cuda {

struct PrefillTensor {  // one packed tensor (keys or values) of a segment
  const uint8_t* data = nullptr;
  const int32_t* perm = nullptr;  // [H, D] or nullptr: stored channel j = original perm[j]
  int32_t bits = 0, group_size = 0, code_bytes = 0, row_stride = 0;
  int32_t meta = 0;     // vq::MetaType: 0 f16, 1 f32, 2 fp8 e4m3
  int32_t ternary = 0;  // 1.5-bit codes (five per byte); tensor-core path only
  // Hadamard rotation (tensor-core path only): signs device [H, D] or nullptr, the power-of-two
  // block hadamard_block(D) and float(1 / sqrt(double(rot_block))).
  const float* signs = nullptr;
  int32_t rot_block = 0;
  float rot_norm = 1.0f;
  // Channel-axis keys (packed.h): metadata element e of a run in slot e % meta_slots of its
  // record e / meta_slots; runs device [n_runs + 1] (DeviceSegment::k_runs) or nullptr: one run.
  int32_t channel = 0;
  int32_t meta_slots = 0;
  const int32_t* runs = nullptr;
  int32_t n_runs = 0;
};

struct PrefillSeg {
  int64_t n_rows = 0, capacity = 0, first_pos = 0;
  const int32_t* positions = nullptr;
  int32_t packed = 0, dtype = 1;  // vq::DType of full-precision rows
  const void* keys = nullptr;
  const void* values = nullptr;
  PrefillTensor pk, pv;
  // Tensor-core path only (set by prefill_attention_launch): rows of frame f start at f*rows_cap
  // in keys/values; a packed segment's rows there are its dequantized values rounded once to the
  // kernel's operand type.
  int64_t rows_cap = 0;
};

constexpr int kPrefillMaxSegs = 8;

struct PrefillParams {
  const float* q = nullptr;
  float* out = nullptr;
  int32_t batch = 0, kv_heads = 0, n_rep = 1, head_dim = 0;
  int64_t n_queries = 0;
  int64_t q_pos0 = 0, window = 0;
  float scale = 1.0f;
  int32_t n_segs = 0;
  PrefillSeg segs[kPrefillMaxSegs];
};

void prefill_attention_launch(const PrefillParams& p, cudaStream_t s);

// The 32-rows-per-warp tensor-core kernel (prefill_fa.cu) over a view of f16 (bf16 false) or
// bf16 rows (packed segments given as such rows by prefill_attention.cu), D 64 or 128, rows
// 16-byte and q, out 8-byte aligned (checked by the caller). Every segment's rows_cap must be set.
void prefill_fa_launch(const PrefillParams& p, bool bf16, cudaStream_t s);

// The warpgroup (wgmma) kernel (prefill_wg.cu) for the same views at D 128: usable when this
// build has sm_90a code and the current device is sm_90 (VQ_PREFILL_MMA_SYNC set in the
// environment keeps the mma.sync kernel, for A/B timing); prefill_fa_launch takes it then.
bool prefill_wg_usable(int head_dim);
void prefill_wg_launch(const PrefillParams& p, bool bf16, cudaStream_t s);

}  // namespace vq::cuda
