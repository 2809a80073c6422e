// The full-precision KV cache (docs/design.md §C2): the exact baseline every compressed cache is
// compared with.
//
// Storage: one row store (src/kv/row_store.h) of keys and values [B, H, capacity, D] in the dtype
// of the first keys block (later blocks, and values of another dtype, are converted), on the CPU
// or on the device of the backend it was built with. Rows [0, offset()) of each (b, h) are valid.
// capacity is a multiple of 256 rows; when a call does not fit it grows geometrically
// (max(needed, 1.25 x capacity), rounded up to 256), so a decode append costs amortised O(1).
// update_and_fetch returns one full-precision segment with implicit positions 0 .. offset()-1 (a
// strided view into the store, valid until the next mutating call).
#pragma once

#include <cstdint>
#include <memory>

#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/tensor.h"

namespace vq {

namespace kv {
class RowBackend;
class RowStore;
}  // namespace kv

class FullCache final : public KVCache {
 public:
  static constexpr int64_t kStep = 256;  // capacity granularity, in rows

  // A cache whose rows live on `backend`'s device (the CPU by default); blocks handed to it must
  // be memory of that device.
  FullCache();
  explicit FullCache(const kv::RowBackend& backend);
  ~FullCache() override;

  std::string method() const override { return "full"; }
  CacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                             const UpdateOptions& opts = {}) override;
  int64_t offset() const override { return st_.offset; }
  int64_t stored_rows() const override { return st_.offset; }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override;
  int64_t batch() const override { return st_.batch; }
  int64_t n_kv_heads() const override { return st_.heads; }
  // Stored rows are always positions 0 .. offset()-1, so without a window this is kNone (N == 1)
  // or kCausal without reading positions; with a window it is the default explicit mask.
  Mask make_mask(int64_t n_queries, int64_t window = 0) const override;
  bool is_trimmable() const override { return true; }
  // Drops the last min(n, offset()) tokens (n >= 0); returns how many were dropped. Capacity
  // is kept, so appending again after a trim does not reallocate.
  int64_t trim(int64_t n) override;
  CacheStats stats() const override;
  void save(std::ostream& out) const override;
  // Refuses (nothing changed) a frame of another method, a corrupt one, or inconsistent fields.
  // A loaded cache holds exactly its rows rounded up to 256 (capacity is not saved).
  void load(std::istream& in) override;
  // Same H, D and dtype, equal offsets: stacks the batch axis in the order given.
  std::unique_ptr<KVCache> merge_into_batch(
      const std::vector<const KVCache*>& caches) const override;

  // Rows allocated per (b, h) (a multiple of kStep; 0 before the first call).
  int64_t capacity() const { return st_.capacity; }
  // The next store this cache makes (its first, or a growth) holds at least `rows` rows per
  // (b, h), rounded up to kStep: a caller that knows the sequence's length (prompt + new tokens)
  // reserves it before the first call and no growth copy follows. Allocates nothing now; rows and
  // results are unchanged. 0 <= rows <= 2^31 - 1 (vq::Error otherwise, nothing changed).
  void reserve(int64_t rows);
  int64_t reserved() const { return reserve_; }
  int64_t head_dim() const { return st_.head_dim; }
  DType dtype() const { return st_.dtype; }
  // Views of the stored rows [B, H, offset(), D] (strided into the store).
  TensorView keys() const;
  TensorView values() const;
  // The view of what is stored now (what the last update_and_fetch returned).
  CacheView stored_view() const;

 private:
  // Everything a load() or merge replaces at once.
  struct State {
    bool has_data = false;  // B, H, D and dtype are fixed by the first call
    DType dtype = DType::kF16;
    int64_t batch = 0, heads = 0, head_dim = 0;
    int64_t offset = 0, capacity = 0;
    std::unique_ptr<kv::RowStore> rows;  // [B, H, capacity, D] keys and values
  };
  State with_capacity(const State& shape_of, int64_t capacity) const;
  int64_t reserve_ = 0;  // reserve(): the least capacity of the next store

  const kv::RowBackend* backend_;
  State st_;
};

// The builder's entry point for method "full" (cfg is validated by the caller).
std::unique_ptr<KVCache> make_full_cache(const CacheConfig& cfg);

}  // namespace vq
