// Dequantization of packed SKVQ records (packed.h record format) into fp32 rows in the original
// channel order, for the snapkv+skvq scoring frame on the CUDA row backend (row_store_cuda.cpp).
// Layouts: a frame f = b*H + h; the record store is [F, src_cap, row_stride] bytes; the output is
// [F, dst_cap, D] fp32; perm (optional) [H, D] int32: stored channel j holds channel perm[h*D + j];
// signs (optional) [H, D] of +-1: the records hold Hadamard-rotated rows (hadamard.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vq::cuda {

struct DequantRowsParams {
  const uint8_t* records = nullptr;
  int64_t src_cap = 0, src_row0 = 0;
  int32_t row_stride = 0, code_bytes = 0;
  int32_t bits = 2;     // integer bits 1..8 (ignored when ternary)
  int32_t ternary = 0;  // 1.5 bits: byte k = sum_m c[5k+m] * 3^m
  int32_t group_size = 32;
  int32_t meta = 0;  // MetaType code: 0 = f16, 1 = f32, 2 = fp8 e4m3
  int32_t head_dim = 0;
  const int32_t* perm = nullptr;
  int64_t n_frames = 0, heads = 1, n = 0;  // n rows per frame
  float* dst = nullptr;
  int64_t dst_cap = 0, dst_row0 = 0;
  // Inverse rotation (after the inverse permutation): signs device [H, D] or nullptr, the
  // power-of-two block (hadamard_block(D)) and its norm, float(1 / sqrt(double(rot_block))).
  const float* signs = nullptr;
  int32_t rot_block = 0;
  float rot_norm = 1.0f;
  // Channel-axis records (packed.h): each row's (lo, scale) of stored channel j are elements 2j,
  // 2j + 1 of its run's list, the run starting at record channel_run_start(runs, n_runs, i) of
  // the frame (runs device [n_runs + 1] relative to src_row0, or nullptr: one run from src_row0);
  // meta_slots = the format's n_groups. group_size is then unused.
  int32_t channel = 0;
  int32_t meta_slots = 0;
  const int32_t* runs = nullptr;
  int32_t n_runs = 0;
};

// dst[(f*dst_cap + dst_row0 + i)*D + perm[h*D + j]] = code_j * scale_g + lo_g of record
// (f, src_row0 + i), computed in fp32 with one rounding per operation (no FMA), exactly as
// vq::dequantize_record + the inverse permutation of vq::dequantize_row; with signs, then each
// row is un-rotated like vq::hadamard_unrotate (butterflies of span 1, 2, 4, ... per block in
// its order, * norm, * sign), so the rows are bit-identical to vq::dequantize_row's.
void dequant_rows_launch(const DequantRowsParams& p, cudaStream_t s);

}  // namespace vq::cuda
