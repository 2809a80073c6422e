// Kernel of device_cache_dequant.cuh: one thread per (frame, row, stored channel). The code, the
// group's (lo, scale) (channel-axis records: the channel's, from its run's first records) and
// code * scale + lo (rounded twice) come from packed.h's host/device codecs (code_at, meta_load,
// dequantize_code, channel_run_start), the ones the CPU's dequantize_row uses. With a rotation a
// second kernel un-rotates each row (one thread per row: D <= a few hundred floats, the CPU's
// fast Walsh-Hadamard transform in the same order of operations).
#include <cuda_fp16.h>

#include "cuda/check.h"
#include "cuda/device_cache_dequant.cuh"
#include "veloxquant/packed.h"

namespace vq::cuda {

namespace {

__global__ void dequant_rows_kernel(DequantRowsParams p) {
  const int64_t D = p.head_dim;
  const int64_t total = p.n_frames * p.n * D;
  CodeSpec spec;
  spec.bits_x2 = static_cast<uint8_t>(p.ternary ? 3 : 2 * p.bits);
  const MetaType mt = static_cast<MetaType>(p.meta);
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int j = static_cast<int>(e % D);
    const int64_t i = (e / D) % p.n;
    const int64_t f = e / (D * p.n);
    const uint8_t* rec = p.records + (f * p.src_cap + p.src_row0 + i) * p.row_stride;
    const uint32_t code = code_at(rec, j, spec);
    float lo, scale;
    if (p.channel) {  // the run's list: element e in slot e % slots of its record e / slots
      const int64_t r0 = channel_run_start(p.runs, p.n_runs, i);
      const uint8_t* chunk0 = p.records + (f * p.src_cap + p.src_row0 + r0) * p.row_stride;
      const int64_t el = 2 * static_cast<int64_t>(j), es = el + 1;
      lo = meta_load(chunk0 + (el / p.meta_slots) * p.row_stride + p.code_bytes, el % p.meta_slots,
                     mt);
      scale = meta_load(chunk0 + (es / p.meta_slots) * p.row_stride + p.code_bytes,
                        es % p.meta_slots, mt);
    } else {
      const int g = j / p.group_size;
      const uint8_t* meta = rec + p.code_bytes;
      lo = meta_load(meta, 2 * g, mt);
      scale = meta_load(meta, 2 * g + 1, mt);
    }
    const float x = dequantize_code(code, scale, lo);
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
