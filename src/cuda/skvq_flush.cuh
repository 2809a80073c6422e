// SKVQ flush on the device: the chunk-0 channel permutations and the clipped group quantization
// of rows into packed records (packed.h), bit-identical to the CPU (group_quant.h).
//
// Rows: [n_rows_total = B*H*n, D] contiguous, dtype f16/bf16/f32; row r belongs to head
// (r / n) % H. Records: [n_rows_total, row_stride] bytes. perm/signs: [H, D] or nullptr.
// Channel-axis records (channel = 1, packed.h): the n rows of each (b, h) are one chunk; stored
// channel c over them is one group of n values (quantize_chunk_to_records of group_quant.h),
// its codes chosen by error feedback when key_u is set (key_feedback_codes, key_rounding.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vq::cuda {

struct SkvqQuantParams {
  const void* rows = nullptr;
  int dtype = 1;              // vq::DType: 0 f32, 1 f16, 2 bf16
  int64_t n_rows_total = 0;   // B * H * n
  int64_t rows_per_head = 0;  // n
  int32_t n_heads = 0;        // H
  int32_t head_dim = 0;       // D
  const int32_t* perm = nullptr;
  const float* signs = nullptr;
  int32_t rot_block = 0;
  float rot_norm = 1.0f;  // (float)(1 / sqrt((double)rot_block)), as the CPU computes it
  // quantizer
  int32_t group_size = 32;
  int32_t n_groups = 0;
  float levels = 3.0f;
  int32_t bits = 2;  // integer bits (unused when ternary)
  int32_t ternary = 0;
  int32_t meta = 0;  // vq::MetaType: 0 f16, 1 f32, 2 fp8 e4m3
  // the alphas tried in order (veloxquant/group_quant.h clip_alphas: the seed's five, then the
  // value rows' tail down to their clip floor)
  int32_t n_alpha = 5;
  float alpha[17] = {1.0f, 0.97f, 0.94f, 0.90f, 0.85f};
  int32_t code_bytes = 0;    // packed codes rounded up to the metadata size
  int32_t packed_bytes = 0;  // packed codes, unrounded
  int32_t row_stride = 0;
  uint8_t* records = nullptr;
  // Channel-axis records: group_size is then n, n_groups the metadata slots per record.
  int32_t channel = 0;
  // Channel-axis keys rounded by error feedback (veloxquant/key_rounding.h): the factor U of head
  // h at key_u + h * D * D (device, stored channel order, fp64), or nullptr (round to nearest).
  const double* key_u = nullptr;
};

void skvq_quantize_launch(const SkvqQuantParams& p, cudaStream_t s);

struct SkvqPermParams {
  const void* rows = nullptr;  // [B, H, n, D]
  int dtype = 1;
  int32_t batch = 0, n_heads = 0, head_dim = 0;
  int64_t n = 0;
  int32_t* perm = nullptr;  // [H, D]
};

void skvq_channel_perms_launch(const SkvqPermParams& p, cudaStream_t s);

}  // namespace vq::cuda
