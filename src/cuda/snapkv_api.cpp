// Host entry points of SnapKV on the device (veloxquant/cuda.h): validation, the selection plans
// (the seed rule and the keep-window rule, computed exactly as snapkv_select.cpp does) and the
// per-head pipeline snap_select_frames (scores -> pooling over the competing rows -> selection).
#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/check.h"
#include "cuda/snapkv.cuh"
#include "veloxquant/cuda.h"

namespace vq::cuda {

namespace {

std::string shape_str(const TensorView& t) {
  return "[" + std::to_string(t.shape[0]) + ", " + std::to_string(t.shape[1]) + ", " +
         std::to_string(t.shape[2]) + ", " + std::to_string(t.shape[3]) + "]";
}

// The selection as (always-kept prefix, top-k range, kept tail).
struct Plan {
  int64_t count = 0;
  int64_t n_prefix = 0;
  int64_t lo = 0, hi = 0, k = 0;
  int64_t tail0 = 0;
};

Plan plan_select(int64_t n, int64_t budget, int64_t n_sink, int64_t window) {
  Plan p;
  p.count = snap_select_count(n, budget);
  p.tail0 = n;
  const int64_t sinks = std::min(std::max<int64_t>(n_sink, 0), p.count);
  if (window < 0) {  // seed rule
    if (p.count >= n || sinks == p.count) {
      p.n_prefix = p.count;
      return p;
    }
    p.n_prefix = sinks;
    p.lo = sinks;
    p.hi = n;
    p.k = p.count - sinks;
    return p;
  }
  if (p.count >= n) {  // keep-window rule (snapkv_select.cpp plan_keep_window)
    p.n_prefix = n;
    return p;
  }
  const int64_t w = std::clamp<int64_t>(window, 0, n);
  const int64_t w_free = n - std::max(n - w, sinks);
  const int64_t keep_w = std::min(w_free, p.count - sinks);
  p.n_prefix = sinks;
  p.k = p.count - sinks - keep_w;
  p.lo = sinks;
  p.hi = std::max(sinks, n - w);
  p.tail0 = n - keep_w;
  return p;
}

void run_plan(const Plan& pl, const float* scores, int64_t n_frames, int64_t n, int32_t* out,
              cudaStream_t s) {
  SnapSelectParams_ sp;
  sp.scores = scores;
  sp.n_frames = static_cast<int32_t>(n_frames);
  sp.n = n;
  sp.n_prefix = pl.n_prefix;
  sp.lo = pl.lo;
  sp.hi = pl.hi;
  sp.k = pl.k;
  sp.tail0 = pl.tail0;
  sp.count = pl.count;
  sp.out = out;
  snap_select_launch(sp, s);
}

void check_keys(const TensorView& keys, const char* op) {
  VQ_CHECK(keys.shape[0] >= 1 && keys.shape[1] >= 1 && keys.shape[2] >= 0 && keys.shape[3] >= 4 &&
               keys.shape[3] % 4 == 0 && keys.shape[3] <= 256,
           std::string("[") + op +
               "] expected keys [B>=1, H>=1, n>=0, D in 4..256, D%4==0] but got " +
               shape_str(keys));
  VQ_CHECK(keys.is_contiguous() && (keys.data || keys.numel() == 0),
           std::string("[") + op + "] expected contiguous device keys");
  VQ_CHECK(keys.shape[0] * keys.shape[1] <= 65535,
           std::string("[") + op + "] expected at most 65535 frames (B * H)");
}

// Scores into `scores`; scratch: snap_scores_scratch_bytes(...) bytes of device memory.
SnapScoreParams score_params(const TensorView& keys, const TensorView* queries,
                             const int32_t* key_pos, const int32_t* query_pos, int64_t obs_window) {
  check_keys(keys, "snap_scores");
  const int64_t F = keys.shape[0] * keys.shape[1], n = keys.shape[2], D = keys.shape[3];
  SnapScoreParams p;
  p.keys = keys.data;
  p.dtype = static_cast<int>(keys.dtype);
  p.n_frames = static_cast<int32_t>(F);
  p.head_dim = static_cast<int32_t>(D);
  p.n = n;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  if (queries) {
    const TensorView& q = *queries;
    VQ_CHECK(q.dtype == DType::kF32 && q.is_contiguous() && q.shape[0] == keys.shape[0] &&
                 q.shape[1] % keys.shape[1] == 0 && q.shape[1] >= keys.shape[1] &&
                 q.shape[2] >= 1 && q.shape[3] == D,
             "[snap_scores] expected fp32 contiguous queries [" + std::to_string(keys.shape[0]) +
                 ", H*n_rep, w>=1, " + std::to_string(D) + "] but got " + shape_str(q));
    VQ_CHECK((key_pos == nullptr) == (query_pos == nullptr),
             "[snap_scores] expected key_pos and query_pos both given or both null but got one "
             "of them");
    p.queries = static_cast<const float*>(q.data);
    p.n_rep = static_cast<int32_t>(q.shape[1] / keys.shape[1]);
    p.w = static_cast<int32_t>(q.shape[2]);
    p.key_pos = key_pos;
    p.query_pos = query_pos;
  } else {
    p.w = static_cast<int32_t>(std::clamp<int64_t>(obs_window, 1, std::max<int64_t>(n, 1)));
  }
  VQ_CHECK(static_cast<int64_t>(p.n_rep) * p.w <= 4096,
           "[snap_scores] expected at most 4096 window query rows but got " +
               std::to_string(static_cast<int64_t>(p.n_rep) * p.w));
  return p;
}

size_t score_scratch_bytes(const SnapScoreParams& p) {
  const int64_t W = static_cast<int64_t>(p.n_rep) * p.w;
  return (static_cast<size_t>(snap_score_tile_stats_floats(p.n_frames, p.n, W)) +
          static_cast<size_t>(p.n_frames * W * 2) + static_cast<size_t>(p.n_frames)) *
         4;
}

void run_scores(SnapScoreParams p, float* scores, void* scratch, cudaStream_t s) {
  if (p.n == 0) return;
  const int64_t W = static_cast<int64_t>(p.n_rep) * p.w;
  p.tile_stats = static_cast<float*>(scratch);
  p.row_stats = p.tile_stats + snap_score_tile_stats_floats(p.n_frames, p.n, W);
  p.poisoned = reinterpret_cast<int32_t*>(p.row_stats + p.n_frames * W * 2);
  p.scores = scores;
  snap_scores_launch(p, s);
}

}  // namespace

void snap_scores(const TensorView& keys, const TensorView* queries, const int32_t* key_pos,
                 const int32_t* query_pos, int64_t obs_window, float* scores, Stream s) {
  const SnapScoreParams p = score_params(keys, queries, key_pos, query_pos, obs_window);
  if (p.n == 0) return;
  VQ_CHECK(scores != nullptr, "[snap_scores] expected a device scores buffer but got nullptr");
  DeviceBuffer scratch(score_scratch_bytes(p));
  run_scores(p, scores, scratch.data(), detail::to_stream(s));
  synchronize(s);  // the scratch is freed on return
}

void snap_pool(const float* in, int64_t n_frames, int64_t n, int64_t lo, int64_t hi, int64_t kernel,
               PoolKind kind, float* out, Stream s) {
  VQ_CHECK(kernel >= 1 && kernel % 2 == 1,
           "[snap_pool] expected an odd kernel >= 1 but got " + std::to_string(kernel));
  VQ_CHECK(0 <= lo && lo <= hi && hi <= n, "[snap_pool] expected 0 <= lo <= hi <= n but got " +
                                               std::to_string(lo) + ", " + std::to_string(hi) +
                                               ", " + std::to_string(n));
  snap_pool_launch(in, n_frames, n, lo, hi, kernel, kind == PoolKind::kMax ? 0 : 1, out,
                   detail::to_stream(s));
}

int64_t snap_select(const float* scores, int64_t n_frames, int64_t n, int64_t budget,
                    int64_t n_sink, int64_t window, int32_t* out, Stream s) {
  VQ_CHECK(n_frames >= 0 && n >= 0 && n < (int64_t{1} << 31),
           "[snap_select] expected 0 <= n < 2^31 frames rows but got " + std::to_string(n));
  const Plan pl = plan_select(n, budget, n_sink, window);
  run_plan(pl, scores, n_frames, n, out, detail::to_stream(s));
  return pl.count;
}

int64_t snap_select_frames(const TensorView& keys, const TensorView* queries,
                           const int32_t* key_pos, const int32_t* query_pos,
                           const SnapSelectParams& p, int32_t* out, DecodeWorkspace& scratch,
                           Stream s) {
  check_keys(keys, "snap_select_frames");
  VQ_CHECK(p.pool_kernel >= 1 && p.pool_kernel % 2 == 1,
           "[snap_select_frames] expected an odd pool_kernel >= 1 but got " +
               std::to_string(p.pool_kernel));
  const int64_t F = keys.shape[0] * keys.shape[1], n = keys.shape[2];
  const int64_t w =
      queries ? queries->shape[2] : std::clamp<int64_t>(p.obs_window, 1, std::max<int64_t>(n, 1));
  const Plan pl = plan_select(n, p.budget, p.n_sink, p.keep_window ? w : -1);
  cudaStream_t st = detail::to_stream(s);
  if (pl.k == 0) {  // the selection does not depend on scores
    run_plan(pl, nullptr, F, n, out, st);
    return pl.count;
  }
  const size_t n_scores = static_cast<size_t>(F * n);
  const SnapScoreParams sp = score_params(keys, queries, key_pos, query_pos, p.obs_window);
  float* buf = static_cast<float*>(scratch.reserve(n_scores * 4 * 2 + score_scratch_bytes(sp)));
  run_scores(sp, buf, buf + 2 * n_scores, st);
  const float* sel = buf;
  if (p.pool_kernel > 1) {
    snap_pool_launch(buf, F, n, pl.lo, pl.hi, p.pool_kernel, p.pool == PoolKind::kMax ? 0 : 1,
                     buf + n_scores, st);
    sel = buf + n_scores;
  }
  run_plan(pl, sel, F, n, out, st);
  return pl.count;
}

void gather_rows(const void* src, int64_t n_frames, int64_t n, int64_t row_bytes,
                 const int32_t* idx, int64_t count, void* dst, const int32_t* src_pos,
                 int32_t first_pos, int32_t* dst_pos, Stream s) {
  VQ_CHECK(n_frames >= 0 && n >= 0 && row_bytes >= 1 && count >= 0 && n_frames <= 65535,
           "[gather_rows] expected n_frames in 0..65535, n >= 0, row_bytes >= 1, count >= 0");
  VQ_CHECK(count == 0 || n_frames == 0 || (src && idx && dst),
           "[gather_rows] expected device src, idx and dst but got a null pointer");
  gather_rows_launch(src, n_frames, n, row_bytes, idx, count, dst, src_pos, first_pos, dst_pos,
                     detail::to_stream(s));
}

}  // namespace vq::cuda
