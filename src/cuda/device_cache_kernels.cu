// Kernels of device_cache_kernels.cuh: one thread per element (conversion) or per position.
// Conversions round like vq::convert_row (f32 -> f16 / bf16 to nearest even; widening is exact);
// a source of the storage dtype is copied as raw bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/check.h"
#include "cuda/device_cache_kernels.cuh"

namespace vq::cuda {

namespace {

__device__ __forceinline__ float load_as_f32(const void* base, int64_t i, int dtype) {
  if (dtype == 0) return static_cast<const float*>(base)[i];
  if (dtype == 1) return __half2float(static_cast<const __half*>(base)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
}

// Element e (of batch * heads * n * head_dim) of a conversion.
__device__ __forceinline__ void convert_element(const ConvertRowsParams& p, int64_t e) {
  const int64_t d = e % p.head_dim;
  const int64_t i = (e / p.head_dim) % p.n;
  const int64_t h = (e / (p.head_dim * p.n)) % p.heads;
  const int64_t b = e / (p.head_dim * p.n * p.heads);
  const int64_t si = b * p.st0 + h * p.st1 + (p.s0 + i) * p.st2 + d * p.st3;
  const int64_t di = ((b * p.heads + h) * p.dst_cap + p.dst_row0 + i) * p.head_dim + d;
  if (p.src_dtype == p.dst_dtype) {
    if (p.dst_dtype == 0)
      static_cast<float*>(p.dst)[di] = static_cast<const float*>(p.src)[si];
    else
      static_cast<uint16_t*>(p.dst)[di] = static_cast<const uint16_t*>(p.src)[si];
    return;
  }
  const float x = load_as_f32(p.src, si, p.src_dtype);
  if (p.dst_dtype == 0)
    static_cast<float*>(p.dst)[di] = x;
  else if (p.dst_dtype == 1)
    static_cast<__half*>(p.dst)[di] = __float2half_rn(x);
  else
    static_cast<__nv_bfloat16*>(p.dst)[di] = __float2bfloat16_rn(x);
}

__global__ void convert_rows_kernel(ConvertRowsParams p) {
  const int64_t total = p.batch * p.heads * p.n * p.head_dim;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    convert_element(p, e);
}

// blockIdx.y: the item; x: a grid-stride loop over its elements.
__global__ void row_writes_kernel(const __grid_constant__ RowWriteItems items) {
  const RowWriteItem& w = items.item[blockIdx.y];
  const ConvertRowsParams& p = w.p;
  const int64_t total = p.batch * p.heads * p.n * p.head_dim;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (w.kind == 0) {
      convert_element(p, e);
    } else {
      const int64_t f = e / p.n, i = e % p.n;
      static_cast<int32_t*>(p.dst)[f * p.dst_cap + p.dst_row0 + i] =
          w.first + static_cast<int32_t>(i);
    }
  }
}

__global__ void fill_positions_kernel(int32_t* pos, int64_t n_frames, int64_t cap, int64_t row0,
                                      int64_t n, int32_t first) {
  const int64_t total = n_frames * n;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t f = e / n, i = e % n;
    pos[f * cap + row0 + i] = first + static_cast<int32_t>(i);
  }
}

unsigned grid_for(int64_t total) {
  const int64_t blocks = (total + 255) / 256;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

void convert_rows_launch(const ConvertRowsParams& p, cudaStream_t s) {
  const int64_t total = p.batch * p.heads * p.n * p.head_dim;
  if (total <= 0) return;
  convert_rows_kernel<<<grid_for(total), 256, 0, s>>>(p);
  VQ_CUDA_LAUNCH_CHECK("convert_rows");
}

void row_writes_launch(const RowWriteItems& items, cudaStream_t s) {
  if (items.count <= 0) return;
  int64_t most = 0;
  for (int i = 0; i < items.count; ++i) {
    const ConvertRowsParams& p = items.item[i].p;
    most = std::max(most, p.batch * p.heads * p.n * p.head_dim);
  }
  if (most <= 0) return;
  row_writes_kernel<<<dim3(grid_for(most), static_cast<unsigned>(items.count)), 256, 0, s>>>(items);
  VQ_CUDA_LAUNCH_CHECK("row_writes");
}

void fill_positions_launch(int32_t* pos, int64_t n_frames, int64_t cap, int64_t row0, int64_t n,
                           int32_t first, cudaStream_t s) {
  if (n_frames * n <= 0) return;
  fill_positions_kernel<<<grid_for(n_frames * n), 256, 0, s>>>(pos, n_frames, cap, row0, n, first);
  VQ_CUDA_LAUNCH_CHECK("fill_positions");
}

}  // namespace vq::cuda
