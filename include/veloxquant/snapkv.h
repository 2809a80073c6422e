// SnapKV scoring and selection primitives (docs/design.md §C3, docs/design.md §C3), pure
// functions over one (b, h) "frame": the n candidate rows a selection chooses from.
//
// Layouts: keys [n, D] fp32 row-major (row j = candidate j, in ascending position order);
// window queries [n_rep, w, D] fp32 (query head r, window row i); scores [n] fp32; positions int32;
// selections are ascending row indices (int64) into the frame.
// Each numeric op has a plain scalar *_reference version (double accumulation) that is the test
// oracle of the optimised one. Nothing here allocates per call except through SnapScratch.
#pragma once

#include <cstdint>
#include <vector>

#include "veloxquant/cache_config.h"
#include "veloxquant/dtype.h"
#include "veloxquant/tensor.h"

namespace vq {

// ---- (1) + (2): scores ------------------------------------------------------------------------
//
// Window scores: for every window query row i (of every query head r), logits
// L[i, j] = q_i . k_j / sqrt(D) over the frame rows j, a row softmax, then
// score[j] = mean over heads r of (mean over the window rows i of softmax_i[j]).
// With positions (key_pos and query_pos both non-null) a query at position p only sees keys with
// position <= p (causal). A query row that sees no key contributes zero to every score (its
// softmax is empty) but still counts in the mean. Non-finite inputs give NaN scores, which the
// selection treats as -inf.
//
// Numerics of the optimised version: fp32 products and fp32 lane accumulation of the dot
// products, fp32 softmax (max-subtracted, exp in fp32), per-head means and the head average in
// double, one final rounding to fp32. The *_reference versions do everything in double.

// Seed key-proxy scores (the default): the last w = clamp(obs_window, 1, n) key rows are the
// queries, logits over all n rows with NO causal mask (a window row also sees later window rows),
// one head. n == 0 writes nothing.
void snap_key_proxy_scores(const float* keys, int64_t n, int64_t head_dim, int64_t obs_window,
                           float* scores);
void snap_key_proxy_scores_reference(const float* keys, int64_t n, int64_t head_dim,
                                     int64_t obs_window, float* scores);

// Query scores: real window queries [n_rep, w, D] of the n_rep query heads sharing this KV head.
// key_pos [n] and query_pos [w] may both be nullptr (no mask) or both be given (causal mask, the
// paper's choice: real queries come with real positions, so a window query never votes for a key
// that comes after it).
void snap_query_scores(const float* keys, const int32_t* key_pos, int64_t n, int64_t head_dim,
                       const float* queries, const int32_t* query_pos, int64_t n_rep, int64_t w,
                       float* scores);
void snap_query_scores_reference(const float* keys, const int32_t* key_pos, int64_t n,
                                 int64_t head_dim, const float* queries, const int32_t* query_pos,
                                 int64_t n_rep, int64_t w, float* scores);

// ---- (3): pooling -----------------------------------------------------------------------------
//
// 1-D pooling over positions, same length: out[j] pools in[j - k/2 .. j + k/2] clipped to
// [0, n) (edges use only the neighbours that exist). kernel must be odd and >= 1 (1 = copy).
// kMax: the largest neighbour, NaN ranked as -inf (NaN only if every neighbour is NaN).
// kAvg: the sum of the available neighbours (double) divided by their count (so an edge row is
// averaged over fewer rows, not padded with zeros); any NaN neighbour gives NaN.
// in and out must not overlap.
void snap_pool_scores(const float* in, int64_t n, int64_t kernel, PoolKind kind, float* out);

// ---- (4): selection ---------------------------------------------------------------------------
//
// Seed rule (docs/design.md §C3): count = min(max(budget, 1), n) (0 when n == 0),
// sinks = min(max(n_sink, 0), count). If count >= n or sinks == count: rows 0..count-1, scores
// unread. Otherwise rows 0..sinks-1 plus the count - sinks highest-scoring rows of sinks..n-1,
// NaN ranked as -inf, -0 equal to +0, ties to the lower index; ascending order.
int64_t snap_select_count(int64_t n, int64_t budget);
// Optimised: threshold by nth_element, then one ascending pass. Writes count indices to out.
// scratch is reused between calls (resized as needed).
int64_t snap_select(const float* scores, int64_t n, int64_t budget, int64_t n_sink, int64_t* out,
                    std::vector<float>* scratch = nullptr);
// Oracle: stable sort of the candidates by descending score.
std::vector<int64_t> snap_select_reference(const float* scores, int64_t n, int64_t budget,
                                           int64_t n_sink);

// ---- (5): keep-window selection ---------------------------------------------------------------
//
// The paper's choice: the last `window` rows (the observation window) are always kept and only
// the prefix competes. With count and sinks as in (4) and w = clamp(window, 0, n):
//   count >= n                  -> every row;
//   otherwise keep rows 0..sinks-1, then the most recent min(window rows not already sinks,
//   count - sinks) rows, then fill the rest of the budget with the highest-scoring prefix rows
//   sinks..n-w-1 (same ordering rule as (4)).
// So a budget smaller than sinks + window keeps the sinks and the newest window rows that fit.
// Only the prefix scores are read. Ascending order; returns count.
int64_t snap_select_keep_window(const float* scores, int64_t n, int64_t budget, int64_t n_sink,
                                int64_t window, int64_t* out,
                                std::vector<float>* scratch = nullptr);
std::vector<int64_t> snap_select_keep_window_reference(const float* scores, int64_t n,
                                                       int64_t budget, int64_t n_sink,
                                                       int64_t window);

// ---- the whole per-head pipeline ----------------------------------------------------------------

struct SnapSelectParams {
  int64_t budget = 512;
  int64_t obs_window = 32;
  int64_t n_sink = 4;
  int64_t pool_kernel = 1;  // odd, 1 = none
  PoolKind pool = PoolKind::kMax;
  bool keep_window = false;

  static SnapSelectParams from_config(const CacheConfig& cfg);
};

// The window queries a prompt-end selection (snap_evict_at = prompt_end) scores with: the last
// min(obs_window, S) rows of the latest multi-token call's queries, fp32 [B, hq, rows, D].
struct SnapPromptWindow {
  int64_t hq = 0, rows = 0;
  std::vector<float> q;

  // Keeps the last rows of queries [B, H_q, S, D]; nullptr keeps none (key-proxy scoring).
  void keep(const TensorView* queries, int64_t obs_window);
  // The kept rows as a view [B, hq, rows, D] written to *out, or nullptr when none are kept.
  const TensorView* view(int64_t batch, int64_t head_dim, TensorView* out) const;
  void clear();
};

// Storage dtype of the SnapKV caches (CPU and GPU, alone or composed with SKVQ): snap_dtype auto
// keeps bf16 when keys and values arrive in bf16 and stores fp16 otherwise.
DType snap_storage_dtype(SnapDType mode, DType keys, DType values);

// Real window queries of one KV head for query scoring.
struct SnapQueryWindow {
  const float* data = nullptr;         // [n_rep, w, D]
  int64_t n_rep = 0;                   // query heads sharing the KV head (>= 1)
  int64_t w = 0;                       // window rows (>= 1)
  const int32_t* positions = nullptr;  // [w] positions of the window rows
};

// Workspace reused across calls (one per thread).
struct SnapScratch {
  std::vector<float> scores, pooled, sel;
  std::vector<float> logits;
  std::vector<double> acc;
};

// ---- (6): selection from given scores (snap_scoring = external) --------------------------------
//
// What snap_select_head does after its scoring step, on scores [n] the caller computed: pooling
// over the competing rows, then selection (4), or (5) with window w = clamp(obs_window, 1, n).
// The same tie and NaN rules (equal ranking keys: the lower index wins; NaN ranks as -inf).
// scores may be null when the selection does not read them (count >= n, sinks == count, or
// keep_window with no prefix quota). Writes snap_keep_count(n, p) ascending indices to out.
int64_t snap_select_from_scores(const float* scores, int64_t n, const SnapSelectParams& p,
                                int64_t* out, SnapScratch& scratch);
// snap_select_from_scores for each of `frames` rows of scores [frames, n]: the kept indices
// [frames, snap_keep_count(n, p)] as int32 (a cache's gather index).
std::vector<int32_t> snap_select_frames_from_scores(const float* scores, int64_t frames, int64_t n,
                                                    const SnapSelectParams& p);

// ---- (7): max attention weight: context-reconstruction scores (KVzip's) ----------------------
//
// keys [n, D] fp32 at key_pos [n], queries [n_rep, w, D] fp32 at query_pos [w] (key j is visible
// to query i when key_pos[j] <= query_pos[i]; both null: every key visible). Per query row the
// softmax of q.k / sqrt(D) over the visible keys, and scores[j] = max(scores[j], weight) for
// j < n_score: a running max over query heads, query rows and calls (the caller zeroes scores
// once). A row that sees no key contributes nothing; a NaN or +inf logit makes scores[0, n_score)
// NaN (ranked -inf by the selection). Arithmetic: fp32 dot products (a sequential sum over D),
// fp32 exp of (logit - row max), fp32 sum and reciprocal; the reference does it all in double.
void snap_max_attention(const float* keys, const int32_t* key_pos, int64_t n, int64_t head_dim,
                        const float* queries, const int32_t* query_pos, int64_t n_rep, int64_t w,
                        int64_t n_score, float* scores, std::vector<float>* scratch = nullptr);
void snap_max_attention_reference(const float* keys, const int32_t* key_pos, int64_t n,
                                  int64_t head_dim, const float* queries, const int32_t* query_pos,
                                  int64_t n_rep, int64_t w, int64_t n_score, float* scores);

// Rows a frame of n rows keeps: snap_select_count(n, budget).
inline int64_t snap_keep_count(int64_t n, const SnapSelectParams& p) {
  return snap_select_count(n, p.budget);
}

// Scores (key proxy when q == nullptr, else query scores with the causal mask from key_pos and
// q->positions), pooling over the rows that compete (sinks and kept-window rows excluded, so a
// large sink score never lifts its neighbours), then selection (4) or (5).
// Skips scoring when the selection does not depend on scores (count >= n or sinks == count, or
// keep_window with no prefix quota). The keep_window window is w = clamp(obs_window, 1, n) with
// the key proxy, q->w with queries. Writes snap_keep_count(n, p) ascending indices to out.
int64_t snap_select_head(const float* keys, const int32_t* key_pos, int64_t n, int64_t head_dim,
                         const SnapQueryWindow* q, const SnapSelectParams& p, int64_t* out,
                         SnapScratch& scratch);

}  // namespace vq
