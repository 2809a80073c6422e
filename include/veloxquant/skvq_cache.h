// The SKVQ cache (docs/design.md §C4): full-precision rows accumulate and whole chunks of `window`
// rows, counted from position 0, are reordered (or rotated), group-quantized and frozen as packed
// codes. Flushed rows are *stored* packed (their full-precision copies are freed), so resident
// memory follows the byte formulas.
//
// Call order (the seed's): append this call's S rows, flush every chunk [q, q + window) with
// (stored - q) >= window + skvq_recent, then return the view
//   [sinks: n_sink rows, full precision][packed chunks][full-precision tail, incl. this call's
//   unflushed rows]
// (before chunk 0 is flushed the view is just the tail from position 0). A row that completes a
// chunk is therefore quantized before its own attention, as in the seed; skvq_recent >= 1 keeps
// the newest rows at full precision (the paper's window). The flush rule depends only on the
// total row count, so one-shot prefill and token-by-token decode give bit-identical state.
// skvq_recent rule: chunk [q, q + window) is flushed iff after flushing at least `recent` rows
// remain beyond it (stored - (q + window) >= recent). Sinks are not counted in `recent`.
//
// Chunk 0 freezes per-head K and V channel permutations (stable ascending range pooled over batch
// and the chunk's rows, sinks included), or a calibrated permutation comes from skvq_perm_file
// (format below). Its first n_sink rows stay at full precision, bit-exact.
// Rotation (skvq_rotation = hadamard): keys (and values with skvq_rotate_values) of head h are
// rotated by R_h = H_norm diag(signs_h) before grouping; signs_h come from skvq_rotation_seed and
// are saved with the state. Rotation wins over skvq_reorder (a reorder after a random rotation
// has no outliers left to sort: permutations stay absent, perm_bytes 0); a calibrated
// permutation file together with rotation is refused. head_dim must be even with rotation
// (blocks of the largest power of two dividing it, see hadamard.h).
//
// Storage dtype of full-precision rows: the first keys block's dtype (f32, f16 or bf16).
// Views: the sinks, one packed segment per flushed chunk (one packed run on a backend that keeps
// one, src/kv/row_store.h), the tail; the view of update_and_fetch and that of stored_view() are
// valid until the next mutating call.
// Not trimmable; merging into a batch is refused.
//
// Protected rows (skvq_protect > 0; on the CUDA backend too, except skvq_protect_scoring =
// external, whose scores only a CPU cache takes): the rows of the cache's first prompt (every call
// before its end_prompt(), or before the first single-token call after a multi-token one) are
// packed as above, and an fp32 copy of them is kept on the backend's device until the prompt
// ends (with the window queries, RowBackend::keep_queries). Then, per (b, h),
// the k = min(max(1, round(skvq_protect * prompt rows)), packed rows) packed rows of the highest
// scores (the SnapKV pipeline of snapkv.h over the prompt's rows: skvq_protect_scoring with window
// skvq_protect_obs_window, max-pooled over skvq_protect_pool_kernel; candidates are the packed
// rows only, ties to the lower position) get a full-precision copy in the storage dtype: keys,
// and values when skvq_protect_values (otherwise the values of their codes, dequantized). The
// copies are one view segment with their own positions; the packed segments get explicit
// positions in which a protected row's entry is INT32_MAX, a position no query reaches, so the
// causal test hides its codes (on a backend with one packed run, that run's segment: positions
// for its capacity, protected or not). The scores and the selection are the backend's
// (RowBackend::snap_select_rows): on the device the scores agree with the CPU's to a bound, so
// the protected rows are the CPU's wherever no two candidates score within it. Codes, flushes and
// the prompt's own attention are those of the plain cache (skvq_protect = 0), bit for bit. Bytes
// accounted: the plain cache's, plus per protected row and (b, h) its full-precision key (and
// value) and a 4-byte position. Protection selects once: later prompts add no protected rows. A
// state cannot be saved while the selection is owed (call end_prompt() first).
//
// Calibrated permutation file (JSON, written by save_skvq_perm_file):
//   {"format": "veloxquant.skvq_perms", "version": 1, "n_kv_heads": H, "head_dim": D,
//    "layers": [{"key": [[D ints] x H], "value": [[D ints] x H]}, ...]}
// Entry j of head h's list is the original channel stored at position j (each a permutation).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"

namespace vq {

namespace skvq {
struct Settings;
struct State;
}  // namespace skvq
namespace kv {
class RowBackend;
}  // namespace kv

// Validates cfg and builds an SKVQ cache for layer `layer_index` (which layer of a calibrated
// permutation file applies).
std::unique_ptr<KVCache> make_skvq_cache(const CacheConfig& cfg, int64_t layer_index = 0);

class SkvqCache final : public KVCache {
 public:
  SkvqCache(const CacheConfig& cfg, int64_t layer_index = 0);
  // The same policy with its rows and records on `backend`'s device (src/kv/row_store.h), which
  // must outlive the cache.
  SkvqCache(const CacheConfig& cfg, const kv::RowBackend& backend, int64_t layer_index = 0);
  ~SkvqCache() override;

  std::string method() const override { return "skvq"; }
  // keys, values: [B, H, S, D] (f32/f16/bf16, any strides), D == cfg.head_dim, B and H fixed by
  // the first call. A call that would pass skvq_max_ctx is refused before anything changes.
  CacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                             const UpdateOptions& opts = {}) override;
  int64_t offset() const override;
  int64_t stored_rows() const override;
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override;
  int64_t batch() const override;
  int64_t n_kv_heads() const override;
  CacheStats stats() const override;
  void save(std::ostream& out) const override;
  void load(std::istream& in) override;
  // skvq_protect > 0: runs the owed selection of protected rows; otherwise does nothing.
  void end_prompt() override;
  // skvq_protect > 0 with skvq_protect_scoring = external: scores [B, H, rows] of every stored
  // row (rows == stored_rows()), taken while the first prompt is pending.
  bool takes_external_scores() const override;
  void set_external_scores(const float* scores, int64_t batch, int64_t heads,
                           int64_t rows) override;
  // Protected rows per (b, h) (0 before the selection), and the positions of (b, h)'s (ascending).
  int64_t protected_rows() const;
  std::vector<int32_t> protected_positions(int64_t b, int64_t h) const;
  // True while the first prompt's selection is owed.
  bool protection_pending() const;

  // The view of what is stored now (what the last update_and_fetch returned).
  CacheView stored_view() const;
  // Frozen permutations [H * D] (stored channel j of head h = original channel perm[h*D + j]),
  // empty before chunk 0 or when reordering is off.
  const std::vector<int32_t>& key_perms() const;
  const std::vector<int32_t>& value_perms() const;
  // Rotation sign vectors [H * D] (empty without rotation).
  const std::vector<float>& rotation_signs() const;
  int64_t quantized_tokens() const;
  DType storage_dtype() const;
  int64_t head_dim() const;

  // Room for a sequence of `rows` tokens: the packed store this cache makes next (its first, a
  // growth, a load) holds every record the flush rule packs by then (skvq_packed_rows), rounded
  // up to 64 rows. On a backend that keeps one growing packed run (the CUDA one) its first
  // allocation then holds them all and no growth copy follows up to that length; per-block
  // stores (the CPU backend) are sized exactly anyway. Allocates nothing now; rows, records,
  // positions and results are unchanged. 0 <= rows <= 2^31 - 1 (vq::Error otherwise, nothing
  // changed).
  void reserve(int64_t rows);
  int64_t reserved() const { return reserve_; }
  // Records per (b, h) the packed stores hold now (>= the packed rows).
  int64_t packed_capacity() const;

 private:
  void select_protected();
  CacheView with_protected(CacheView v) const;

  const kv::RowBackend* backend_;
  std::unique_ptr<skvq::Settings> set_;
  std::unique_ptr<skvq::State> st_;
  int64_t reserve_ = 0;  // reserve(): tokens the next packed store is sized for
};

// Rows per (b, h) the skvq cache holds packed after `tokens` tokens at cfg's settings (the flush
// rule's frontier less the sinks chunk 0 keeps; 0 before the first flush). For reserve() and the
// memory planner.
int64_t skvq_packed_rows(const CacheConfig& cfg, int64_t tokens);

// skvq_protect: the capacity, in rows per (b, h), of the store of the first prompt's fp32 copies
// once `need` rows must fit in a store of `cap` rows (cap itself when they fit; otherwise
// max(need, 2 x cap) rounded up to 16 rows, at least 16). For the cache and the memory planner.
int64_t skvq_protect_copy_capacity(int64_t cap, int64_t need);

// Packed bytes per (b, h) of one flushed chunk of n rows in layer `layer` at cfg's settings, keys
// and values: its runs of skvq_key_rows rows each counted, channel-axis keys by the channel-axis
// formula (group_quant.h), as the cache's stats count them. For the memory planner.
int64_t skvq_flushed_chunk_bytes(const CacheConfig& cfg, int64_t layer, int64_t n);
// Bytes of one packed record (one row of one (b, h)) in layer `layer`'s packed stores: keys, or
// values when `values` (PackedRowFormat::row_stride of the cache's formats). For the planner.
int64_t skvq_record_stride(const CacheConfig& cfg, int64_t layer, bool values);

// ---- calibrated permutations ------------------------------------------------------------------

struct SkvqPermSet {
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  std::vector<std::vector<int32_t>> key, value;  // [n_layers][H * D]
};

// Stable ascending channel-range permutation per head of a recorded block [B, H, S, D] (pooled
// over batch and tokens): [H * D]. The calibration tool records K/V blocks per layer and writes
// the result with save_skvq_perm_file.
std::vector<int32_t> skvq_channel_perms(const TensorView& block);
void save_skvq_perm_file(const std::string& path, const SkvqPermSet& perms);
// Throws vq::Error "[skvq_perm_file] ..." on a missing, malformed or inconsistent file.
SkvqPermSet load_skvq_perm_file(const std::string& path);

}  // namespace vq
