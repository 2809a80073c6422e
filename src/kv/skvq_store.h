// What the two SKVQ policies (skvq_cache.cpp, snapkv_skvq_cache.cpp) share: frozen settings,
// channel transforms, and skvq::Store, the rows of one cache over a row backend (docs/design.md
// §3) with the flush frontier's packed tail and the state-file pieces. Implemented in
// skvq_store.cpp.
//
// Store layout: one RowStore of full-precision rows [F, cap, D] (storage dtype): sinks at rows
// [0, n_sink), the tail at rows [t0, t0 + n_tail) (t0 >= n_sink: packing the tail's oldest rows
// only moves t0, so a view of them stays valid); positions [F, cap] when explicit. Packed rows
// live in runs of PackedStores (records [F, cap, row_stride], explicit positions or implicit
// ones following the sinks), in position order: one run per packed block on a backend without
// one_packed_run (no copies), else one growing run. `blocks` keeps the rows of each packed block
// as the state file lists them, whatever the runs. Channel-axis keys: every block is quantized by
// itself (one metadata list per block); a view of one growing run lists the blocks' first records
// (PackedTensor::runs, packed.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kv/row_store.h"
#include "veloxquant/binary_io.h"
#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/packed.h"
#include "veloxquant/query_moments.h"

namespace vq::skvq {

// Everything of a CacheConfig an SKVQ store uses, validated (the config's own rules plus the
// ones only the cache knows, e.g. Hadamard needs an even head_dim).
struct Settings {
  int64_t head_dim = 0;
  int64_t window = 0;
  int64_t n_sink = 0;
  int64_t recent = 0;
  // window + recent, computed once by from_config (both <= kMaxCacheRows, so no overflow): a chunk
  // is flushed while the rows after its start number at least flush_span.
  int64_t flush_span = 0;
  int64_t max_ctx = 0;  // 0 = unlimited
  bool reorder = true;  // false when rotation is on (rotation wins, see skvq_cache.h)
  bool rotate = false;
  bool rotate_values = false;
  uint64_t rotation_seed = 0;
  // kChannel: keys quantized per channel over each flushed chunk (fk is a channel-axis format,
  // packed.h); values always per token.
  QuantAxis key_axis = QuantAxis::kToken;
  // Channel-axis keys: rows per key (lo, scale) inside a chunk (skvq_key_rows; 0 = whole chunk).
  int64_t key_rows = 0;
  // Protected rows (skvq_protect > 0, the skvq cache only): the config's fields as they are.
  double protect = 0;
  SnapScoring protect_scoring = SnapScoring::kQuery;
  int64_t protect_obs_window = 32;
  int64_t protect_pool_kernel = 1;
  bool protect_values = true;
  GroupQuantParams qk, qv;
  PackedRowFormat fk, fv;
  // Calibrated permutations of this layer ([H * D] each), empty when none.
  std::vector<int32_t> file_perm_k, file_perm_v;
  int64_t file_heads = 0;
  // Query moments (skvq_query_moments_file, veloxquant/query_moments.h): the file as loaded
  // once per process and shared by every cache that names it (null: keys round to nearest),
  // and this layer's [moment_heads * D * D] in the original channel order.
  std::shared_ptr<const QueryMomentSet> moment_set;
  const double* query_moments = nullptr;
  int64_t moment_heads = 0;
  // The layer's heads this cache holds (CacheConfig::kv_head_first, kv_heads_total): signs and
  // file permutations are those of global heads head_first .. head_first + H - 1.
  int64_t head_first = 0, heads_total = 0;

  static Settings from_config(const CacheConfig& cfg, int64_t layer_index, const char* op);
  // Writes / checks the fields a state file must agree on. A channel-axis cache writes state
  // format version 2 (set_state_version), which adds the key axis after the version-1 fields,
  // or version 3 with skvq_key_rows > 0, which adds key_rows after the axis; a version-1 state
  // has token-axis keys, a version-2 one whole-chunk key runs. Version 4 (skvq_protect > 0) writes
  // the axis and key_rows whatever they are, then the skvq_protect* fields.
  int state_version() const;
  void set_state_version(StateWriter& w) const;
  void save(StateWriter& w) const;
  void check_saved(StateReader& r, const char* op) const;
  // The packed blocks a flushed chunk of n rows becomes: {n}, or with key_rows > 0 runs of
  // key_rows rows, the last one taking the remainder (each holds its channel metadata).
  std::vector<int64_t> chunk_blocks(int64_t n) const;
  // The packed bytes of one block of n rows (the byte formulas of group_quant.h).
  int64_t key_chunk_bytes(int64_t n) const;
  int64_t value_chunk_bytes(int64_t n) const;
};

// Frozen channel transforms of one cache (host copies): t = P(R x).
struct Transforms {
  std::vector<int32_t> perm_k, perm_v;  // [H * D] or empty
  std::vector<float> signs;             // [H * D] of +-1, or empty (no rotation)
  int32_t rot_block = 0;
  bool rotate_values = false;

  bool has_perms() const { return !perm_k.empty(); }
  void save(StateWriter& w) const;
  static Transforms load(StateReader& r, int64_t heads, int64_t d, const char* op);
};

// Makes the transforms once B, H are known (signs for rotation, the calibrated permutation).
Transforms initial_transforms(const Settings& s, int64_t heads, const char* op);
// True when p is H permutations of 0..d-1.
bool is_perm_set(const std::vector<int32_t>& p, int64_t heads, int64_t d);
std::string shape_str(const TensorView& t);
// Refuses (vq::Error "[op] ...") blocks a cache of head_dim d (B, H fixed once has_data) cannot
// take; nothing changes.
void check_blocks(const TensorView& keys, const TensorView& values, int64_t d, bool has_data,
                  int64_t batch, int64_t heads, const char* op);

// Full-precision rows of a state file (FpRows stream: i64 count, keys [B, H, n, D], values, and
// with explicit positions [B, H, n] int32).
struct HostRows {
  int64_t n = 0;
  std::vector<uint8_t> k, v;
  std::vector<int32_t> pos;
};
// One packed block of a state file: records [B, H, rows, row_stride], positions [B, H, rows].
struct HostBlock {
  int64_t rows = 0;
  std::string k, v;
  std::vector<int32_t> pos;
};

class Store {
 public:
  Store(const kv::RowBackend& backend, const Settings& s, bool explicit_positions, const char* op);

  // ---- shape and transforms
  bool has_data = false;
  DType dtype = DType::kF16;
  int64_t batch = 0, heads = 0;
  Transforms tr;
  void start(DType t, int64_t b, int64_t h, Transforms transforms);
  void set_perms(std::vector<int32_t> pk, std::vector<int32_t> pv);

  // ---- rows
  int64_t n_sink = 0, n_tail = 0;
  int64_t packed() const;
  int64_t rows() const { return n_sink + packed() + n_tail; }
  const std::vector<int64_t>& blocks() const { return blocks_; }
  // Rows [s0, s0 + n) of blocks [B, H, S, D] appended to the tail (positions first_pos.. when
  // explicit). Compacts or regrows the full-precision store first (call only when no view of it
  // is alive).
  void append(const TensorView& keys, const TensorView& values, int64_t s0, int64_t n,
              int64_t first_pos);
  // The tail's first n rows become sinks (only while no row is packed and the tail follows the
  // sinks: no data moves).
  void promote_sinks(int64_t n);
  // Frozen permutations from full-precision rows [0, n) (sinks, then the tail following them).
  void freeze_perms(int64_t n);
  // Quantizes the tail's oldest rows as packed blocks of the given sizes (in order) and drops
  // them from the tail (no data moves: a view of them stays valid; a replaced store is retired).
  void pack_tail(const std::vector<int64_t>& block_rows);
  // Shrinks the full-precision store when it is more than twice max(its rows, the floor below)
  // (the old one retired).
  void fit();
  // After keep() and the flush that follows it: on a backend that keeps_tail_room, shrinks the
  // full-precision store keep() made (room for every kept row, most of which the flush packed)
  // as fit() does, now rather than at the next append, which would otherwise reallocate it on a
  // decode step; the old store is freed at once. Nothing when no keep() made the store or a view
  // has read it since, or on another backend: the next append's refit shrinks it (the CPU's
  // rule).
  void fit_kept();
  // Frees what the last view alone still referenced.
  void release_retired();

  // ---- capacity
  // On a one_packed_run backend, the run this store makes next (its first, a growth, a load)
  // holds at least `rows` records per (b, h), rounded up to 64: packing up to that many rows
  // then copies no run. Allocates nothing now; rows and records are unchanged. Per-block stores
  // (other backends) are sized exactly and ignore it.
  void reserve_packed(int64_t rows) { packed_reserve_ = rows; }
  int64_t packed_reserved() const { return packed_reserve_; }
  // Records per (b, h) the packed stores hold (their capacities summed).
  int64_t packed_capacity() const;

  // ---- views: [sinks, positions 0..][packed runs][tail], implicit positions following each
  // other, or explicit ones (sinks implicit); slot 0 / 1 keep the packed segments of two views.
  CacheView view(int slot) const;

  // ---- SnapKV over the frame sinks ++ packed ++ tail of every (b, h): [F, count] frame indices
  // (ascending) of the rows to keep, scored on fp32 keys (packed ones dequantized).
  std::vector<int32_t> select(int64_t count, const TensorView* q, int64_t q_first,
                              const SnapSelectParams& p) const;
  // Keeps frame rows idx [F, count] (ascending, the first n_keep_sinks of every frame the sinks):
  // kept packed rows keep their codes, and every frame is brought to the same packed count by
  // quantizing its oldest kept full-precision rows early. Replaced stores are retired.
  void keep(const std::vector<int32_t>& idx, int64_t count);

  // Positions of frame f's stored rows (sinks 0.., packed, tail), explicit positions only.
  std::vector<int32_t> frame_positions(int64_t f) const;

  // ---- state
  void write_rows(StateWriter& w, bool sinks) const;
  HostRows read_rows(StateReader& r, bool positions) const;
  std::vector<uint8_t> block_records(size_t i, bool values) const;
  std::vector<int32_t> block_positions(size_t i) const;
  // A loaded state's rows (validated by the caller); replaces everything stored.
  void install(const HostRows& sinks, const std::vector<HostBlock>& blocks, const HostRows& tail);

  int64_t resident_bytes() const;

 private:
  struct Run {
    std::unique_ptr<kv::PackedStore> store;
    int64_t rows = 0;
  };
  kv::RowShape fp_shape() const { return {dtype, batch, heads, s_->head_dim}; }
  kv::PackedShape packed_shape() const { return {batch, heads, s_->head_dim, s_->fk, s_->fv}; }
  int64_t fp_cap() const { return fp_ ? fp_->capacity() : 0; }
  // The rows the full-precision store keeps room for when it shrinks: sinks + flush span on a
  // backend that keeps_tail_room() (kv::RowBackend), else 16.
  int64_t fp_floor() const;
  // Reallocates (new_cap != cap) or compacts the full-precision store so that `extra` more tail
  // rows fit; the old store is retired when `retire`.
  void refit(int64_t extra, bool retire);
  // Records [row0, row0 + n) of the packed rows (across runs), host bytes.
  std::vector<uint8_t> records(int64_t row0, int64_t n, bool values) const;
  std::vector<int32_t> record_positions(int64_t row0, int64_t n) const;

  const kv::RowBackend* be_;
  const Settings* s_;
  bool explicit_pos_;
  const char* op_;
  // The transforms on the backend's device, with the key rounding factors of the cache's heads in
  // the stored channel order ([H * D * D], veloxquant/key_rounding.h) when the settings carry
  // query moments (made by make_dtr; counted in resident_bytes, per cache: not shared).
  std::unique_ptr<kv::PackedTransforms> dtr_;
  void make_dtr();
  std::unique_ptr<kv::RowStore> fp_;
  // fp_ was made by keep() and no view has read it since (view() clears it): fit_kept may free it.
  mutable bool fp_unseen_ = false;
  int64_t t0_ = 0;
  std::vector<Run> runs_;
  std::vector<int64_t> blocks_;
  int64_t packed_reserve_ = 0;  // reserve_packed(): the least capacity of the next packed run
  // Channel-axis keys on a one_packed_run backend: the first record of every block of the run
  // ([blocks + 1], the last the run's rows), host and device copies, one per view slot.
  struct RunIndex {
    std::vector<int32_t> host;
    std::unique_ptr<kv::RowIndex> dev;
  };
  const RunIndex& run_index(int slot) const;
  mutable RunIndex run_index_[2];
  std::vector<std::unique_ptr<kv::RowStore>> retired_fp_;
  std::vector<std::unique_ptr<kv::PackedStore>> retired_packed_;
  mutable std::vector<PackedSegment> segs_[2];
};

}  // namespace vq::skvq
