// SnapKV on the device: window scores (key proxy or real queries, causal by positions), 1-D
// pooling, the seed / keep-window selection (radix select + ordered compaction, the CPU's tie and
// NaN rules) and the generic row gather. Layouts: a frame f = b*H + h; keys [F, n, D]
// (f16/bf16/f32), queries [F, W = n_rep*w, D] fp32, scores [F, n] fp32, selections [F, count].
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vq::cuda {

struct SnapScoreParams {
  const void* keys = nullptr;  // [F, n, D]
  int dtype = 1;
  const float* queries = nullptr;      // [F, W, D]; nullptr: the last w key rows of each frame
  const int32_t* key_pos = nullptr;    // [F, n] or nullptr
  const int32_t* query_pos = nullptr;  // [w] or nullptr
  int32_t n_frames = 0, head_dim = 0, n_rep = 1, w = 1;
  int64_t n = 0;
  float scale = 1.0f;  // (float)(1 / sqrt(D))
  // scratch
  float* tile_stats = nullptr;  // [F, n_tiles, W, 3]: max, sum, nan flag
  float* row_stats = nullptr;   // [F, W, 2]: max, 1 / sum
  int32_t* poisoned = nullptr;  // [F]
  float* scores = nullptr;      // [F, n]
};

// Scratch floats of tile_stats for a call (the caller sizes its workspace with it).
int64_t snap_score_tile_stats_floats(int64_t n_frames, int64_t n, int64_t W);
void snap_scores_launch(const SnapScoreParams& p, cudaStream_t s);

struct SnapSelectParams_ {
  const float* scores = nullptr;  // [F, n] (read in [lo, hi) only)
  int32_t n_frames = 0;
  int64_t n = 0;
  int64_t n_prefix = 0;           // rows 0..n_prefix-1 always kept (sinks, or everything)
  int64_t lo = 0, hi = 0, k = 0;  // top-k of rows [lo, hi)
  int64_t tail0 = 0;              // rows [tail0, n) kept after the top-k (keep-window)
  int64_t count = 0;              // = n_prefix + k + (n - tail0)
  int32_t* out = nullptr;         // [F, count]
};
void snap_select_launch(const SnapSelectParams_& p, cudaStream_t s);

void snap_pool_launch(const float* in, int64_t n_frames, int64_t n, int64_t lo, int64_t hi,
                      int64_t kernel, int kind, float* out, cudaStream_t s);

void gather_rows_launch(const void* src, int64_t n_frames, int64_t n, int64_t row_bytes,
                        const int32_t* idx, int64_t count, void* dst, const int32_t* src_pos,
                        int32_t first_pos, int32_t* dst_pos, cudaStream_t s);

}  // namespace vq::cuda
