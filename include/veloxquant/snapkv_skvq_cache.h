// Method "snapkv+skvq" (docs/design.md §C5): SnapKV decides which rows stay, SKVQ decides how each
// stored row is held (full precision or packed codes). One row store per (b, h):
//   [sinks: positions 0..n_s-1, full precision][packed rows][full-precision tail]
// with explicit per-head positions after eviction. Quantization is per row, so an evicted
// neighbour never forces a re-quantization: a kept packed row keeps its codes (bytes copied).
//
// Call sequence (S new rows):
//   1. append the S rows to the tail (full precision);
//   2. return the view stored ++ new (SnapKV's deferred eviction: nothing below changes what
//      this step's attention sees; replaced buffers are retired until the next mutating call);
//   3. freeze the K/V permutations the first time the frame holds >= window rows, from its
//      first `window` rows per head pooled over batch (with no earlier eviction these are
//      positions 0..window-1, exactly SKVQ's chunk 0);
//   4. when S > 1: SnapKV selection over the frame (snapkv.h; packed rows are scored with their
//      dequantized keys), then a gather that keeps each row's representation. Heads may keep
//      different numbers of packed rows; to keep storage rectangular every head is brought to
//      the largest count P by quantizing its oldest kept full-precision rows early (the codes
//      any later flush would give them);
//   5. flush frontier: while the tail (full-precision rows beyond the sinks) holds
//      >= window + skvq_recent rows, its oldest `window` rows are packed.
// So this call's rows are always at full precision in their own step's attention.
// Sinks: the first n_s = min(skvq_n_sink, snap_n_sink) positions stay at full precision (SnapKV
// always keeps its snap_n_sink first rows, so every head keeps them and storage stays
// rectangular; with snap_n_sink < skvq_n_sink the extra SKVQ sinks are quantized like any row).
// Positions: as SnapKV alone on the same input as long as no packed row was stored when a
// selection ran (always true for the first prefill; with packed rows SnapKV scores their
// dequantized keys, while SnapKV alone scores full-precision ones).
// Full-precision rows are stored in fp16 or bf16 (snap_dtype rule). Not trimmable.
// snap_scoring = external (snap_evict_at = prompt_end): the prompt-end selection ranks by scores
// the caller hands over (context reconstruction, veloxquant/reconstruct.h) instead of the window
// queries; the kept rows are then packed as with any scoring.
// Views: the sinks, one packed segment per packed block (one packed run on a backend that keeps
// one, src/kv/row_store.h), the tail, with explicit positions after the sinks.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"

namespace vq {

namespace skvq {
struct Settings;
struct SnapSkvqState;
}  // namespace skvq
namespace kv {
class RowBackend;
}  // namespace kv

std::unique_ptr<KVCache> make_snapkv_skvq_cache(const CacheConfig& cfg, int64_t layer_index = 0);

class SnapkvSkvqCache final : public KVCache {
 public:
  SnapkvSkvqCache(const CacheConfig& cfg, int64_t layer_index = 0);
  // The same policy with its rows and records on `backend`'s device (src/kv/row_store.h), which
  // must outlive the cache.
  SnapkvSkvqCache(const CacheConfig& cfg, const kv::RowBackend& backend, int64_t layer_index = 0);
  ~SnapkvSkvqCache() override;

  std::string method() const override { return "snapkv+skvq"; }
  // keys, values [B, H, S, D], D == head_dim; opts.queries [B, H_q, S, D] for
  // snap_scoring = query (else key-proxy scoring).
  CacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                             const UpdateOptions& opts = {}) override;
  int64_t offset() const override;
  int64_t stored_rows() const override;
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override;
  int64_t batch() const override;
  int64_t n_kv_heads() const override;
  // While a prompt-end eviction is owed, a single query's mask counts the rows that will stay
  // (window 0), and a windowed one is refused (call end_prompt() first).
  Mask make_mask(int64_t n_queries, int64_t window = 0) const override;
  // snap_evict_at = prompt_end: runs the owed selection and flush now; otherwise does nothing.
  // With snap_scoring = external the selection ranks the rows by the scores handed over by
  // set_external_scores (SnapKV's rules: snap_select_from_scores, snapkv.h), as the snapkv cache
  // does; a prompt that owes a selection without them is refused (nothing changed).
  void end_prompt() override;
  // snap_scoring = external (veloxquant/reconstruct.h): scores [B, H, stored rows] for the owed
  // selection. Wrong shape, or no selection owed: vq::Error, nothing changed.
  bool takes_external_scores() const override;
  void set_external_scores(const float* scores, int64_t batch, int64_t heads,
                           int64_t rows) override;
  // True while a prompt-end eviction is owed.
  bool eviction_pending() const;
  CacheStats stats() const override;
  void save(std::ostream& out) const override;
  void load(std::istream& in) override;

  // The view of what is stored now (no new rows); valid until the next mutating call or the
  // next stored_view() (it never disturbs the view update_and_fetch returned).
  CacheView stored_view() const;
  // Rows per (b, h) held packed / at full precision (sinks included).
  int64_t packed_rows() const;
  int64_t fp_rows() const;
  const std::vector<int32_t>& key_perms() const;
  const std::vector<int32_t>& value_perms() const;
  DType storage_dtype() const;
  int64_t head_dim() const;

 private:
  void evict_by_external_scores();
  void evict(const TensorView* queries, int64_t n_new);
  void flush();

  const kv::RowBackend* backend_;
  std::unique_ptr<CacheConfig> cfg_;
  std::unique_ptr<skvq::Settings> set_;
  std::unique_ptr<skvq::SnapSkvqState> st_;
};

class StateWriter;
// The snap_* settings of a snapkv+skvq state, after the SKVQ settings (CPU and GPU caches write
// the same stream; their order differs from the SnapKV cache's); a load must match them.
void write_snapkv_skvq_settings(StateWriter& w, const CacheConfig& c);

}  // namespace vq
