// The cache protocol every KV cache follows (docs/design.md §C1), and the view it returns.
//
// A cache is per layer. It receives blocks of keys and values of shape [B, H_kv, S, D] and
// returns a CacheView for this step's attention: every stored row followed by this call's S new
// rows, per (b, h) in ascending position order. The view is split into segments; each segment is
// either full precision (two [B, H_kv, n, D] TensorViews) or packed codes (PackedSegment, see
// veloxquant/packed.h). Positions are per (b, h, row): with eviction, heads keep different
// positions, and attention applies the causal test with each row's own position.
//
// A view stays valid until the next mutating call on the same cache.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "veloxquant/tensor.h"

namespace vq {

struct PackedSegment;  // veloxquant/packed.h

// One run of rows shared by every (b, h): rows [0, n_rows) of this segment.
struct ViewSegment {
  int64_t n_rows = 0;
  // Positions [B, H, pos_stride] int32 (row i of (b, h) at (b*H + h)*pos_stride + i; pos_stride 0
  // means n_rows); nullptr means the implicit run first_pos, first_pos + 1, ... (the same for
  // every (b, h)).
  const int32_t* positions = nullptr;
  int64_t pos_stride = 0;
  int64_t first_pos = 0;
  // Full-precision rows [B, H, n_rows, D] (used when packed == nullptr).
  TensorView keys;
  TensorView values;
  // Packed rows (keys and values), or nullptr.
  const PackedSegment* packed = nullptr;

  int32_t position(int64_t b, int64_t h, int64_t i, int64_t n_heads) const {
    return positions ? positions[(b * n_heads + h) * (pos_stride ? pos_stride : n_rows) + i]
                     : static_cast<int32_t>(first_pos + i);
  }
};

struct CacheView {
  int64_t batch = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  std::vector<ViewSegment> segments;  // concatenated in order, per (b, h)

  int64_t n_rows() const {
    int64_t n = 0;
    for (const auto& s : segments) n += s.n_rows;
    return n;
  }
  bool has_packed() const {
    for (const auto& s : segments)
      if (s.packed) return true;
    return false;
  }
};

// Attention mask for the next update_and_fetch with n_queries tokens (docs/design.md §C1).
struct Mask {
  enum class Kind : uint8_t {
    kNone,      // every key visible (n_queries == 1, no window)
    kCausal,    // implicit lower-right causal: stored rows are positions 0..n-1 exactly
    kExplicit,  // data holds visible[b][h][i][j]
  };
  Kind kind = Kind::kNone;
  int64_t batch = 0, n_heads = 0, n_queries = 0, n_keys = 0;
  // [B, H_kv, n_queries, n_keys], 1 = visible. A cache that has not seen a block yet does not
  // know B and H: its explicit masks have batch = n_heads = 1, shared by every (b, h).
  std::vector<uint8_t> data;
  bool visible(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (batch == 1) b = 0;
    if (n_heads == 1) h = 0;
    return data[((b * n_heads + h) * n_queries + i) * n_keys + j] != 0;
  }
};

// Figures of a cache. Byte counts cover keys and values of every (b, h) of this layer.
struct CacheStats {
  std::string method;
  int64_t tokens_seen = 0;      // offset(): true positions consumed
  int64_t rows_stored = 0;      // rows per (b, h) currently stored
  int64_t bytes_accounted = 0;  // the method's byte formula
  int64_t bytes_resident = 0;   // what the cache really holds (allocation slack included)
  int64_t fp16_bytes = 0;       // K+V of every token seen at 2 bytes per element
  std::vector<std::pair<std::string, double>> figures;  // method-specific, seed names

  double ratio_to_fp16() const {
    return fp16_bytes ? static_cast<double>(bytes_accounted) / static_cast<double>(fp16_bytes)
                      : 1.0;
  }
  // Value of a named figure; throws vq::Error naming the figure if absent.
  double figure(const std::string& name) const;
};

// Stats of an evicting cache that keeps `stored_rows` full-precision fp16/bf16 rows per (b, h)
// out of `offset` tokens (SnapKV, streaming; CPU and GPU): bytes accounted at 2 bytes per element
// and the figures kept_/full_key_bytes, kept_/full_value_bytes, eviction_ratio, tokens_kept,
// tokens_total, keep_rate (with seed_names also the seed's evicted_key_bytes and
// evicted_value_bytes, which are the kept bytes). The caller sets bytes_resident and may append
// figures.
CacheStats eviction_stats(const std::string& method, int64_t batch, int64_t heads, int64_t head_dim,
                          int64_t stored_rows, int64_t offset, bool seed_names);

struct UpdateOptions {
  // This call's queries after RoPE, [B, H_q, S, D] (H_q a multiple of H_kv), or nullptr.
  // Used by SnapKV's query scoring; every other cache ignores them.
  const TensorView* queries = nullptr;
};

class KVCache {
 public:
  virtual ~KVCache() = default;

  virtual std::string method() const = 0;
  // Appends this call's rows and returns the view for this step's attention.
  virtual CacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                                     const UpdateOptions& opts = {}) = 0;
  // The true absolute position of the next token (tokens seen so far).
  virtual int64_t offset() const = 0;
  // Rows stored per (b, h) and their positions (ascending).
  virtual int64_t stored_rows() const = 0;
  virtual std::vector<int32_t> stored_positions(int64_t b, int64_t h) const = 0;
  // Batch size and KV heads of the stored rows: 0 before the first update_and_fetch. Every
  // cache should override both (the default make_mask needs them once rows are stored).
  virtual int64_t batch() const { return 0; }
  virtual int64_t n_kv_heads() const { return 0; }
  // Mask for the next update_and_fetch with n_queries tokens; window 0 = no sliding window.
  virtual Mask make_mask(int64_t n_queries, int64_t window = 0) const;

  // The caller has handed over the whole prompt (every prefill chunk) and is about to decode.
  // Caches that compress once per prompt (SnapKV with snap_evict_at = prompt_end) compress now;
  // the others do nothing. Invalidates the last returned view. Calling it again, or with no
  // prompt pending, does nothing.
  virtual void end_prompt() {}

  // Caches that select rows by scores the caller computes (SnapKV with snap_scoring = external)
  // return true and take them here: scores [batch, heads, rows] fp32 contiguous, row i of (b, h)
  // scoring the i-th of stored_positions(b, h), for every row stored now; the next end_prompt()
  // selects by them. Wrong shape, or no prompt pending: vq::Error naming expected and got, nothing
  // changed. The default refuses, naming the method.
  virtual bool takes_external_scores() const { return false; }
  virtual void set_external_scores(const float* scores, int64_t batch, int64_t heads, int64_t rows);

  virtual bool is_trimmable() const { return false; }
  // Drops the last n tokens; returns how many were dropped. Refused (vq::Error, nothing
  // changed) by caches that cannot do it.
  virtual int64_t trim(int64_t n);

  virtual CacheStats stats() const = 0;

  // Versioned, checksummed state. load() is all-or-nothing: on any error the cache is unchanged.
  virtual void save(std::ostream& out) const = 0;
  virtual void load(std::istream& in) = 0;
  void save_file(const std::string& path) const;
  void load_file(const std::string& path);

  // Hook behind merge_batch(): `caches` (this one first, all of this cache's method) become
  // one batch. The default refuses with a vq::Error naming the method.
  virtual std::unique_ptr<KVCache> merge_into_batch(
      const std::vector<const KVCache*>& caches) const;
};

// Merges independent single-sequence caches into one batch. Only caches that can do it (the
// full-precision cache) are accepted; any other is refused with a vq::Error naming its method.
std::unique_ptr<KVCache> merge_batch(const std::vector<const KVCache*>& caches);

}  // namespace vq
