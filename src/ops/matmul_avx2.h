// AVX2 + FMA matrix products for CPUs without AVX-512 (private to kernels.cpp, which chooses them
// at run time): the same two formulations as kernels.cpp's AVX-512 ones, with 8-lane registers.
// - dot_rows_avx2 (1-3 tokens): each weight row streamed once in 32-element steps into 4 x 8-lane
//   accumulators per token, reduced once (4 -> 1 accumulators, then the 8 lanes: 2 + 3 tree
//   levels) and the bias added last. Each lane is one chain of ceil(K / 32) steps at most (the
//   8-element and masked tail steps go to accumulators 0 and 1). The order is the same for every
//   token count, so a token's result does not depend on its call-mates.
// - panel_avx2 (many tokens): up to 16 weight rows converted and transposed into an fp32 panel
//   P[k][16] per K block of 2048, swept by 6 tokens x 16 rows in 12 accumulators; each output
//   is one chain over k in order, starting at the bias (or 0).
// Every product is one FMA of an fp32 x value and the weight converted exactly to fp32, so both
// obey kernels.cpp's exact-mode bound (K + 7) u sum |x w| (tests/test_backend_ops.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "veloxquant/dtype.h"

namespace vq::kernels::detail {

// Whether this build has the AVX2 kernels and this CPU runs them (AVX2, FMA, F16C; checked once).
bool avx2_matmul_ok();

// Decode's dot products (1-3 tokens; dot_rows_avx2 and kernels.cpp's AVX-512 dot_rows) prefetch
// each weight row this many rows before reading it: the products stream the weights from memory,
// and the hardware prefetchers alone left them waiting on it. AVX2 VM, shipped model, 512 tokens:
// 336 -> 379 tok/s at 1 thread, 701 -> 924 at 2 (4 and 8 rows ahead the same, 16 no gain at 2).
// AVX-512, an H100 host's 16-core Xeon, 2K (docs/results/gpu/run24_s30, calls p1 and p2):
// +5 to +20 % at 1 and 2 threads; at 8 and 16 threads a median of -4 % over 24 alternated pairs
// (-29 to +22 %: the host's noise there); stopping at the thread's own rows lost the 1-thread gain.
constexpr size_t kPrefetchRows = 4;

// The cache lines of the row kPrefetchRows rows after `row` into L1 (a prefetch never faults:
// addresses past the matrix are dropped; formed as integers, so no pointer leaves the array).
inline void prefetch_row_ahead(const void* row, size_t row_bytes) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(row) + kPrefetchRows * row_bytes;
  for (size_t off = 0; off < row_bytes; off += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(ahead + off), 0, 3);
}

// Weight rows per panel_avx2 call.
constexpr int64_t kAvx2PanelRows = 16;

// y[t * ldy + r] = x[t] . W[r] (+ bias[r]) for rows r in [n0, n0 + rows) and tokens t < n_tokens
// (1 to 3). W: [*, k] row-major in dtype wt.
void dot_rows_avx2(DType wt, const float* x, int64_t n_tokens, int64_t ldx, const void* w,
                   int64_t k, int64_t n0, int64_t rows, const float* bias, float* y, int64_t ldy);

// The same for any token count and rows <= kAvx2PanelRows, through packed panels.
void panel_avx2(DType wt, const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w,
                int64_t n0, int64_t rows, const float* bias, float* y, int64_t ldy);

}  // namespace vq::kernels::detail
