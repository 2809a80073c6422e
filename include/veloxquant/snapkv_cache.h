// The SnapKV cache (docs/design.md §C3): prefill-time eviction with the deferred-eviction contract.
//
// Every update_and_fetch returns stored rows ++ this call's S new rows, un-evicted, with
// positions stored_pos ++ [offset, offset + S). After the step, when S > 1, the selection of
// veloxquant/snapkv.h runs per (b, h) over exactly that concatenation and only the selected rows
// stay (K, V and positions gathered with the same indices; every (b, h) keeps the same count).
// S == 1 appends and never evicts, unless decode-time eviction is on (snap_decode_budget > 0):
// then a single-token call that leaves more than snap_decode_budget + snap_decode_every - 1 rows
// per (b, h) runs the selection after the step with budget snap_decode_budget, scored by the
// queries of the latest decode calls (the last min(obs_window, steps) of them, kept since the last
// multi-token call on the backend's device; the key proxy when the forward pass handed none).
// offset() is the true position.
//
// With snap_evict_at = prompt_end (the paper's schedule) multi-token calls only append and keep
// the last min(obs_window, S) queries of the latest one; the selection runs once, over the
// whole prompt, at end_prompt() or at the first single-token call (before its row is appended).
// Chunked prefill then stores exactly what one-shot prefill with the default schedule stores.
//
// Storage: one row store (src/kv/row_store.h) on the CPU or on the device of the backend it was
// built with: keys and values [B, H, capacity, D] in fp16 or bf16 (snap_dtype) and the positions
// of every row [B, H, capacity]. Rows [0, n_sel) of each (b, h) are the survivors of the last
// eviction (explicit positions in the view); rows [n_sel, n_sel + n_tail) are the rows appended
// since, whose positions are the contiguous run offset - n_tail .. offset - 1 shared by every head
// (an implicit segment in the view). So a view has up to two segments, and a decode append is
// amortised O(1) (geometric growth, 64-row steps). Eviction gathers into a fresh store and keeps
// the old one alive until the next mutating call, so the returned view is never changed by it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/snapkv.h"

namespace vq {

namespace kv {
class RowBackend;
class RowStore;
class QueryRows;
class QueryWindow;
}  // namespace kv

// Validates the snap_* fields and builds the cache.
std::unique_ptr<KVCache> make_snapkv_cache(const CacheConfig& cfg);

class SnapKVCache final : public KVCache {
 public:
  // Rows live on `backend`'s device (the CPU by default); blocks and queries handed to the cache
  // must be memory of that device.
  explicit SnapKVCache(const CacheConfig& cfg);
  SnapKVCache(const CacheConfig& cfg, const kv::RowBackend& backend);
  ~SnapKVCache() override;

  std::string method() const override { return "snapkv"; }
  // keys, values: [B, H, S, D] (f32, f16 or bf16, any strides; the same shape). With
  // snap_scoring = query and opts.queries = [B, H_q, S, D] (H_q a multiple of H), an evicting
  // call scores with the last min(w, S) real queries (w = clamp(obs_window, 1, frame rows)),
  // causally masked; without queries it falls back to the key proxy. Bad input: vq::Error and
  // nothing changed.
  CacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                             const UpdateOptions& opts = {}) override;
  int64_t offset() const override { return offset_; }
  int64_t stored_rows() const override { return n_sel_ + n_tail_; }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override;
  int64_t batch() const override { return batch_; }
  int64_t n_kv_heads() const override { return heads_; }
  // N == 1 without a window needs no mask (answered without reading positions); else the default.
  // While a prompt-end eviction is pending, a single query's mask counts the rows that will stay
  // (window 0), and a windowed one is refused (call end_prompt() first).
  Mask make_mask(int64_t n_queries, int64_t window = 0) const override;
  // snap_evict_at = prompt_end: runs the pending selection now; otherwise does nothing. With
  // snap_scoring = external it selects by the scores of set_external_scores (refused, nothing
  // changed, when none were given for the rows stored now).
  void end_prompt() override;
  // snap_scoring = external: scores [B, H, stored_rows()] for the pending prompt-end selection
  // (kept until it runs; rows appended after them make them stale and they are dropped).
  bool takes_external_scores() const override {
    return cfg_.snap_scoring == SnapScoring::kExternal;
  }
  void set_external_scores(const float* scores, int64_t batch, int64_t heads,
                           int64_t rows) override;
  // True while a prompt-end eviction is pending.
  bool eviction_pending() const { return pending_; }
  CacheStats stats() const override;
  void save(std::ostream& out) const override;
  // All-or-nothing. Refuses another method's file, a corrupt or truncated one, one saved with
  // different snap_* settings, and inconsistent contents.
  void load(std::istream& in) override;

  int64_t head_dim() const { return head_dim_; }
  // Storage dtype (fixed by the first call; kF16 before it).
  DType storage_dtype() const { return dtype_; }
  // Rows allocated per (b, h) in the live store.
  int64_t capacity() const { return capacity_; }
  // The view of what is stored now (what the last update_and_fetch returned).
  CacheView stored_view() const;

 private:
  void check_input(const TensorView& keys, const TensorView& values,
                   const UpdateOptions& opts) const;
  void reserve_rows(int64_t rows);
  void evict_after_step(int64_t n_new, const TensorView* queries);
  void evict_by_external_scores();
  // The selection with p over every stored row (window queries qwin at positions q_first.., or
  // the key proxy when null), kept rows gathered into a fresh store, the old one retired.
  void select_and_keep(const SnapSelectParams& p, const TensorView* qwin, int64_t q_first);
  // Decode-time eviction after a single-token append (snap_decode_budget > 0).
  void after_decode_step(const UpdateOptions& opts);

  const kv::RowBackend* backend_;
  CacheConfig cfg_;
  SnapSelectParams params_;

  bool has_data_ = false;
  DType dtype_ = DType::kF16;
  int64_t batch_ = 0, heads_ = 0, head_dim_ = 0;
  int64_t offset_ = 0;
  int64_t n_sel_ = 0;   // rows with explicit positions
  int64_t n_tail_ = 0;  // rows with implicit positions offset_ - n_tail_ .. offset_ - 1
  int64_t capacity_ = 0;
  std::unique_ptr<kv::RowStore> rows_;     // [B, H, capacity_, D] and positions
  std::unique_ptr<kv::RowStore> retired_;  // what the last view may still point at
  // snap_evict_at = prompt_end: a selection is owed, scored with the kept window queries
  // ([B, H_q, rows, D] fp32 on the backend's device, or none: key proxy).
  bool pending_ = false;
  std::unique_ptr<kv::QueryRows> win_;
  // snap_scoring = external: [B, H, n_sel_ + n_tail_] host scores for the pending selection.
  std::vector<float> ext_;
  // snap_decode_budget > 0: the queries of the latest dec_->rows (<= obs_window) decode calls on
  // the backend's device, fp32, step-major [rows][B][H_q][D] (oldest first), at positions
  // offset_ - rows .. offset_ - 1; none after a multi-token call or a decode call without queries.
  SnapSelectParams dec_params_;
  std::unique_ptr<kv::QueryWindow> dec_;
};

class StateWriter;
// The snap_* settings heading a SnapKV state (CPU and GPU caches write the same stream); a load
// must match them.
void write_snapkv_settings(StateWriter& w, const CacheConfig& c);

}  // namespace vq
