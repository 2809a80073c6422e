// The full-precision KV cache (caches.md §2): the exact baseline every compressed cache is
// compared with.
//
// Storage: keys and values each in one buffer [B, H, capacity, D] in the dtype of the first
// keys block (later blocks, and values of another dtype, are converted). Rows [0, offset()) of
// each (b, h) are valid. capacity is a multiple of 256 rows; when a call does not fit it grows
// geometrically (max(needed, 2 x capacity), rounded up to 256), so a decode append costs
// amortised O(1). update_and_fetch returns one full-precision segment with implicit positions
// 0 .. offset()-1 (a strided view into the buffers, valid until the next mutating call).
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/tensor.h"

namespace vq {

class FullCache final : public KVCache {
 public:
  static constexpr int64_t kStep = 256;  // capacity granularity, in rows

  FullCache() = default;

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
  int64_t head_dim() const { return st_.head_dim; }
  DType dtype() const { return st_.dtype; }
  // Views of the stored rows [B, H, offset(), D] (strided into the buffers).
  TensorView keys() const;
  TensorView values() const;

 private:
  // A [B, H, capacity, D] buffer like Tensor, but not zero-initialised (rows past offset() are
  // never read) and, from 2 MiB up, 2 MiB-aligned and advised for transparent huge pages: a
  // growth then faults in 512x fewer pages, which dominates its cost on a fresh buffer.
  class RowStore {
   public:
    RowStore() = default;
    RowStore(DType t, int64_t b, int64_t h, int64_t cap, int64_t d);
    TensorView view() const;  // [B, H, capacity, D], contiguous
    size_t capacity_bytes() const { return bytes_; }

   private:
    struct Free {
      void operator()(void* p) const;
    };
    std::unique_ptr<void, Free> data_;
    size_t bytes_ = 0;
    DType dtype_ = DType::kF16;
    std::array<int64_t, 4> shape_{0, 0, 0, 0};
  };

  // Everything a load() or merge replaces at once.
  struct State {
    bool has_data = false;  // B, H, D and dtype are fixed by the first call
    DType dtype = DType::kF16;
    int64_t batch = 0, heads = 0, head_dim = 0;
    int64_t offset = 0, capacity = 0;
    RowStore keys, values;  // [B, H, capacity, D]
  };
  static State with_capacity(const State& shape_of, int64_t capacity);
  static TensorView rows_view(const RowStore& t, int64_t rows);

  State st_;
};

// The builder's entry point for method "full" (cfg is validated by the caller).
std::unique_ptr<KVCache> make_full_cache(const CacheConfig& cfg);

}  // namespace vq
