// The StreamingLLM baseline cache (method "streaming"): keep the first streaming_n_sink positions
// (attention sinks) and the most recent streaming_window rows, drop everything in between.
//
// Deferred contract, as SnapKV (docs/design.md §C3): every update_and_fetch returns stored rows ++
// this call's S new rows, un-evicted; after the step the store is trimmed to sinks + window. A
// decode call (S == 1) therefore evicts the oldest non-sink row once the store is over budget: the
// window slides, as in StreamingLLM (decision: it does evict during decode; a budget that only
// prefill enforced would grow without bound in long generations, which is what the baseline exists
// to avoid). Kept rows keep their positions and RoPE rotation; offset() keeps counting.
//
// Storage: one row store (src/kv/row_store.h) on the CPU or on the device of the backend it was
// built with: keys and values [B, H, capacity, D] fp16 (bf16 when both inputs are bf16).
// Per (b, h): rows [0, n_sink_rows) are the sinks (positions 0 ..), rows [head, head + n_recent)
// the recent run, positions offset - n_recent .. offset - 1. Every head keeps the same positions,
// so a view has at most two segments with implicit positions. The buffer grows with the rows it
// holds (capacity doubles, in kRowStep rows, up to the steady capacity = sinks + window + slack):
// a short prompt under a huge window holds a few rows, not the window. Once at the steady
// capacity a decode append writes at the end of the run; when the run reaches the capacity it is
// moved back to row n_sink_rows (once per `slack` appends, each move copying `window` rows:
// amortised O(1) per decode step). A failed allocation is a vq::Error naming streaming_window.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"

namespace vq {

namespace kv {
class RowBackend;
class RowStore;
}  // namespace kv

// Validates cfg and builds the cache.
std::unique_ptr<KVCache> make_streaming_cache(const CacheConfig& cfg);

class StreamingCache final : public KVCache {
 public:
  static constexpr int64_t kRowStep = 64;  // capacity granularity, in rows

  // Rows live on `backend`'s device (the CPU by default); blocks handed to the cache must be
  // memory of that device.
  explicit StreamingCache(const CacheConfig& cfg);
  StreamingCache(const CacheConfig& cfg, const kv::RowBackend& backend);
  ~StreamingCache() override;

  std::string method() const override { return "streaming"; }
  // keys, values: [B, H, S, D] (f32, f16 or bf16, any strides; the same shape; B, H, D fixed by
  // the first call). Bad input: vq::Error and nothing changed.
  CacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                             const UpdateOptions& opts = {}) override;
  int64_t offset() const override { return offset_; }
  int64_t stored_rows() const override { return n_sink_rows_ + n_recent_; }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override;
  int64_t batch() const override { return batch_; }
  int64_t n_kv_heads() const override { return heads_; }
  Mask make_mask(int64_t n_queries, int64_t window = 0) const override;
  CacheStats stats() const override;
  void save(std::ostream& out) const override;
  // All-or-nothing. Refuses another method's file, a corrupt or truncated one, one saved with
  // different streaming_* settings, and inconsistent contents.
  void load(std::istream& in) override;

  int64_t n_sink() const { return n_sink_; }
  int64_t window() const { return window_; }
  // Most rows kept per (b, h) after a step: n_sink + window.
  int64_t budget() const { return n_sink_ + window_; }
  DType storage_dtype() const { return dtype_; }
  // Rows allocated per (b, h) in the live store.
  int64_t capacity() const { return capacity_; }
  int64_t head_dim() const { return head_dim_; }
  // The view of what is stored now (what the last update_and_fetch returned).
  CacheView stored_view() const;

 private:
  void check_input(const TensorView& keys, const TensorView& values) const;
  // Makes room for `extra` rows after the recent run (compacts or grows; the old view is invalid).
  void make_room(int64_t extra);
  // Copies sinks + recent run into a buffer of new_cap rows (recent run at row n_sink_rows_).
  void relocate(int64_t new_cap, bool retire_old);
  int64_t steady_capacity() const { return steady_cap_; }

  const kv::RowBackend* backend_;
  int64_t n_sink_ = 4;
  int64_t window_ = 512;
  int64_t steady_cap_ = 0;  // sinks + window + slack in kRowStep rows, computed once (checked)

  bool has_data_ = false;
  DType dtype_ = DType::kF16;
  int64_t batch_ = 0, heads_ = 0, head_dim_ = 0;
  int64_t offset_ = 0;
  int64_t n_sink_rows_ = 0;  // min(n_sink, offset)
  int64_t head_ = 0;         // first row of the recent run
  int64_t n_recent_ = 0;     // rows in the recent run
  int64_t capacity_ = 0;
  std::unique_ptr<kv::RowStore> rows_;     // [B, H, capacity_, D] keys and values
  std::unique_ptr<kv::RowStore> retired_;  // what the last view may still point at
};

}  // namespace vq
