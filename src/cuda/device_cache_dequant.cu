// Kernel of device_cache_dequant.cuh: one thread per (frame, row, stored channel). The code is
// read from the little-endian bit stream of the record (or the base-3 digits of a ternary byte),
// the group's (lo, scale) from the metadata that follows the codes (f16, f32 or fp8 e4m3, decoded
// exactly), and code * scale + lo is rounded twice like the CPU's dequantize_record. With a
// rotation a second kernel un-rotates each row (one thread per row: D <= a few hundred floats, the
// CPU's fast Walsh-Hadamard transform in the same order of operations).
#include <cuda_fp16.h>

#include "cuda/check.h"
#include "cuda/device_cache_dequant.cuh"

namespace vq::cuda {

namespace {

__device__ __forceinline__ float fp8_e4m3_decode(uint8_t c) {
  const float sign = (c & 0x80u) ? -1.0f : 1.0f;
  const int e = (c >> 3) & 0xf;
  const int m = c & 7;
  if (e == 15 && m == 7) return __int_as_float(0x7fc00000);
  if (e == 0) return sign * ldexpf(static_cast<float>(m), -9);
  return sign * ldexpf(static_cast<float>(8 + m), e - 10);
}

__device__ __forceinline__ float meta_value(const uint8_t* meta, int i, int type) {
  if (type == 0) return __half2float(reinterpret_cast<const __half*>(meta)[i]);
  if (type == 1) return reinterpret_cast<const float*>(meta)[i];
  return fp8_e4m3_decode(meta[i]);
}

__global__ void dequant_rows_kernel(DequantRowsParams p) {
  const int64_t D = p.head_dim;
  const int64_t total = p.n_frames * p.n * D;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int j = static_cast<int>(e % D);
    const int64_t i = (e / D) % p.n;
    const int64_t f = e / (D * p.n);
    const uint8_t* rec = p.records + (f * p.src_cap + p.src_row0 + i) * p.row_stride;
    uint32_t code;
    if (p.ternary) {
      uint32_t byte = rec[j / 5];
      for (int m = j % 5; m > 0; --m) byte /= 3u;
      code = byte % 3u;
    } else {
      const int bit = j * p.bits;
      uint32_t w = rec[bit >> 3];
      if ((bit & 7) + p.bits > 8) w |= static_cast<uint32_t>(rec[(bit >> 3) + 1]) << 8;
      code = (w >> (bit & 7)) & ((1u << p.bits) - 1u);
    }
    const int g = j / p.group_size;
    const uint8_t* meta = rec + p.code_bytes;
    const float lo = meta_value(meta, 2 * g, p.meta);
    const float scale = meta_value(meta, 2 * g + 1, p.meta);
    const float x = __fadd_rn(__fmul_rn(static_cast<float>(code), scale), lo);
    const int64_t c = p.perm ? p.perm[(f % p.heads) * D + j] : j;
    p.dst[(f * p.dst_cap + p.dst_row0 + i) * D + c] = x;
  }
}

// One thread per (frame, row): vq::hadamard_unrotate in place (fwht_normalized, then signs).
__global__ void unrotate_rows_kernel(DequantRowsParams p) {
  const int64_t D = p.head_dim;
  const int64_t total = p.n_frames * p.n;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e % p.n, f = e / p.n;
    float* x = p.dst + (f * p.dst_cap + p.dst_row0 + i) * D;
    const float* sg = p.signs + (f % p.heads) * D;
    const int64_t block = p.rot_block;
    for (int64_t b0 = 0; b0 < D; b0 += block) {
      float* v = x + b0;
      for (int64_t span = 1; span < block; span *= 2)
        for (int64_t k = 0; k < block; k += 2 * span)
          for (int64_t j = k; j < k + span; ++j) {
            const float a = v[j], c = v[j + span];
            v[j] = __fadd_rn(a, c);
            v[j + span] = __fsub_rn(a, c);
          }
      for (int64_t j = 0; j < block; ++j) v[j] = __fmul_rn(v[j], p.rot_norm);
    }
    for (int64_t j = 0; j < D; ++j) x[j] = __fmul_rn(x[j], sg[j]);
  }
}

}  // namespace

void dequant_rows_launch(const DequantRowsParams& p, cudaStream_t s) {
  const int64_t total = p.n_frames * p.n * p.head_dim;
  if (total <= 0) return;
  const int64_t blocks = (total + 255) / 256;
  const unsigned grid = static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
  dequant_rows_kernel<<<grid, 256, 0, s>>>(p);
  VQ_CUDA_LAUNCH_CHECK("dequant_rows");
  if (!p.signs) return;
  const int64_t rows = p.n_frames * p.n;
  const int64_t rblocks = (rows + 127) / 128;
  unrotate_rows_kernel<<<static_cast<unsigned>(rblocks < 65536 ? rblocks : 65536), 128, 0, s>>>(p);
  VQ_CUDA_LAUNCH_CHECK("unrotate_rows");
}

}  // namespace vq::cuda
