// Small kernels behind the GPU-resident caches (include/veloxquant/cuda_cache.h): converting a
// strided block into a row store, and writing implicit position runs.
// Layouts: a frame f = b*H + h; a row store is [F, cap, D] elements of the storage dtype (rows of
// frame f start at f*cap); positions [F, cap] int32. dtype codes are vq::DType values
// (0 = f32, 1 = f16, 2 = bf16).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vq::cuda {

struct ConvertRowsParams {
  const void* src = nullptr;  // element (b, h, s, d) at src + b*st0 + h*st1 + s*st2 + d*st3
  int src_dtype = 0;
  int64_t st0 = 0, st1 = 0, st2 = 0, st3 = 0;  // element strides
  int64_t batch = 0, heads = 0, n = 0, head_dim = 0;
  int64_t s0 = 0;  // first source row
  void* dst = nullptr;
  int dst_dtype = 0;
  int64_t dst_cap = 0, dst_row0 = 0;
};
// dst[(b*H + h)*cap + row0 + i][d] = src(b, h, s0 + i, d) converted (round to nearest even, as
// vq::convert_row; the same dtype is copied bit for bit).
void convert_rows_launch(const ConvertRowsParams& p, cudaStream_t s);

// Many writes in few launches (src/cuda/row_writes.cpp): each item a conversion of
// convert_rows_launch (kind 0) or a position run of fill_positions_launch (kind 1: dst = pos,
// batch = frames, heads = 1, head_dim = 1, dst_cap = cap, dst_row0 = row0, first), applied in
// order (items write disjoint rows, so order does not change the result).
struct RowWriteItem {
  ConvertRowsParams p;
  int kind = 0;
  int32_t first = 0;
};
inline constexpr int kRowWritesPerLaunch = 24;  // kernel parameters stay under 4 KiB
struct RowWriteItems {
  RowWriteItem item[kRowWritesPerLaunch];
  int count = 0;
};
void row_writes_launch(const RowWriteItems& items, cudaStream_t s);

// pos[f*cap + row0 + i] = first + i for every frame f < n_frames and i < n.
void fill_positions_launch(int32_t* pos, int64_t n_frames, int64_t cap, int64_t row0, int64_t n,
                           int32_t first, cudaStream_t s);

}  // namespace vq::cuda
