// Dequantization of packed SKVQ records (packed.h record format) into fp32 rows in the original
// channel order, for the snapkv+skvq device cache's scoring frame (device_cache_snapkv_skvq.cpp).
// Layouts: a frame f = b*H + h; the record store is [F, src_cap, row_stride] bytes; the output is
// [F, dst_cap, D] fp32; perm (optional) [H, D] int32: stored channel j holds channel perm[h*D + j].
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
};

// dst[(f*dst_cap + dst_row0 + i)*D + perm[h*D + j]] = code_j * scale_g + lo_g of record
// (f, src_row0 + i), computed in fp32 with one rounding per operation (no FMA), exactly as
// vq::dequantize_record + the inverse permutation of vq::dequantize_row (no rotation).
void dequant_rows_launch(const DequantRowsParams& p, cudaStream_t s);

}  // namespace vq::cuda
