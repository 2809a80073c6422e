// GPU-resident KV caches (methods full, snapkv, skvq, snapkv+skvq, streaming) with the protocol of
// the CPU caches (docs/design.md §C1, cache.h), and prefill attention over a DeviceCacheView.
//
// A DeviceKVCache is built for fixed B, H_kv and D (make_device_cache); every block it receives
// is a *device* TensorView [B, H_kv, S, D] (f16, bf16 or f32, any element strides). It is the CPU
// cache's policy itself over the CUDA row backend (docs/design.md §3): rows, packed records and
// positions live in plain cudaMalloc memory (DeviceBuffer); all work is queued on the stream given
// at construction; host figures (offset, counts, byte formulas) are kept on the host. The CPU
// cache of the same config is the oracle: same positions, selections, packed codes and metadata,
// full-precision rows and figures (bytes_resident excepted: here it is what the cache's
// cudaMalloc calls hold, retired buffers included; the SKVQ methods keep one packed run where the
// CPU keeps one packed segment per block).
// Without VQ_CUDA every entry point throws vq::Error (src/cuda/no_cuda.cpp).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/cuda.h"

namespace vq::cuda {

struct DeviceUpdateOptions {
  // This call's queries after RoPE, device [B, H_q, S, D] (f16/bf16/f32, any strides), or nullptr.
  // Used by SnapKV's query scoring (snap_scoring = query); every other cache ignores them.
  const TensorView* queries = nullptr;
};

class DeviceKVCache {
 public:
  virtual ~DeviceKVCache() = default;

  virtual std::string method() const = 0;
  // Appends this call's rows and returns the view for this step's attention (stored ++ new, the
  // CPU cache's deferred-eviction contract). The view points into the cache's buffers and stays
  // valid until the next mutating call. Bad input: vq::Error naming expected vs found, nothing
  // changed.
  virtual DeviceCacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                                           const DeviceUpdateOptions& opts = {}) = 0;
  virtual int64_t offset() const = 0;
  virtual int64_t stored_rows() const = 0;
  // Positions of the stored rows of (b, h), ascending (downloads; synchronises the stream).
  virtual std::vector<int32_t> stored_positions(int64_t b, int64_t h) const = 0;
  // The stored rows now (what the last update_and_fetch left stored), valid like a fetched view.
  virtual DeviceCacheView stored_view() const = 0;
  // The prompt is over (KVCache::end_prompt): snapkv and snapkv+skvq with snap_evict_at =
  // prompt_end run the selection (and flush) they owe, scored with the window queries of the last
  // multi-token call; a single-token call while one is owed does the same first. Invalidates the
  // last view. Every other cache: nothing.
  virtual void end_prompt() {}
  // Capacity for `rows` rows per (b, h) at the cache's next allocation (full: FullCache::reserve;
  // skvq: SkvqCache::reserve, its packed run), so a sequence of known length never grows; every
  // other method sizes itself: nothing.
  virtual void reserve(int64_t rows) { (void)rows; }
  virtual bool is_trimmable() const { return false; }
  // Refused (vq::Error, nothing changed) unless is_trimmable().
  virtual int64_t trim(int64_t n);
  virtual CacheStats stats() const = 0;
  // Mask for the next update_and_fetch with n_queries tokens (window 0 = none): the policy's own
  // (KVCache::make_mask over offset() and stored_positions(), built on the host): causal only
  // while the stored rows are positions 0..n-1, explicit per (b, h) once eviction made them
  // non-contiguous; snapkv and snapkv+skvq with a prompt-end eviction owed answer a single query
  // with the rows that will stay (a windowed one is refused).
  virtual Mask make_mask(int64_t n_queries, int64_t window = 0) const;
  // State in the CPU cache's format (cache.h save/load, binary_io.h framing): a device cache
  // writes exactly the stream the CPU cache of the same config writes after the same calls, and
  // loads any such stream (a CPU cache's or a device cache's). load() is the policy's own load
  // (the same refusals and messages: another method, other settings, truncated, corrupted,
  // inconsistent), then requires this cache's B, H and D; it is all-or-nothing (on error nothing
  // changed) and invalidates the last view. Both synchronise.
  virtual void save(std::ostream& out) const = 0;
  virtual void load(std::istream& in) = 0;
  // Merging caches into one batch is refused, like the CPU SnapKV and SKVQ caches.
  void merge_batch(const std::vector<const DeviceKVCache*>& others) const;

  int64_t batch() const { return batch_; }
  int64_t n_kv_heads() const { return heads_; }
  int64_t head_dim() const { return head_dim_; }
  Stream stream() const { return stream_; }

 protected:
  DeviceKVCache(int64_t batch, int64_t heads, int64_t head_dim, Stream s)
      : batch_(batch), heads_(heads), head_dim_(head_dim), stream_(s) {}
  int64_t batch_ = 0, heads_ = 0, head_dim_ = 0;
  Stream stream_ = nullptr;
};

// Validates cfg exactly as the CPU builder does (vq::Error naming the field; cfg.head_dim is
// replaced by head_dim) and builds the device cache of cfg.method: "full", "snapkv", "skvq",
// "snapkv+skvq" or "streaming", both snap_evict_at rules, skvq_rotation none or hadamard; any
// other method is refused (vq::Error naming the method and the supported ones). `layer` is the
// model layer the cache serves, as for the CPU's make_skvq_cache / make_snapkv_skvq_cache: the
// SKVQ methods take that entry of skvq_layer_bits_key / skvq_layer_key_rows /
// skvq_layer_bits_value (a list without it is refused, naming the list) and of skvq_perm_file; the
// device cache of layer i is the CPU cache of layer i over the CUDA row backend. The list's length
// against the model's layers is the caller's check (build_caches, the CUDA engine).
std::unique_ptr<DeviceKVCache> make_device_cache(const CacheConfig& cfg, int64_t batch,
                                                 int64_t heads, int64_t head_dim,
                                                 Stream s = nullptr, int64_t layer = 0);

// Host copy of segment i of a device view, for tests and tools: per (b, h) its n_rows rows
// ([B, H, n_rows, row_bytes] bytes, row_bytes = D * dtype size, or the record stride when
// packed) and positions ([B, H, n_rows], made explicit). Synchronises s.
struct HostSegment {
  int64_t n_rows = 0;
  bool packed = false;
  int64_t k_row_bytes = 0, v_row_bytes = 0;
  std::vector<uint8_t> keys, values;
  std::vector<int32_t> positions;
  std::vector<int32_t> k_perm, v_perm;  // [H * D] when the segment has them
};
HostSegment download_segment(const DeviceCacheView& view, size_t i, Stream s = nullptr);

// ---- prefill attention --------------------------------------------------------------------------

// N queries per sequence: q device [B, H_q, N, D] fp32 contiguous, query i at position
// p.q_pos0 + i; out device [B, H_q, N, D] fp32 contiguous. Same semantics as
// attention_reference (attention.h) over every row of view: key j visible when pos_j <= pos_i
// and, with p.window > 0, pos_i < pos_j + window, each row using its own position; query head qh
// reads KV head qh / (H_q / H_kv). Two kernels, both tiled over keys with an online softmax and
// fp32 accumulation: views whose full-precision rows are all f16 or all bf16 run on tensor cores
// (mma with q and p rounded once to the rows' type, fp16 for views of packed rows alone, and
// dequantized packed rows rounded once to that type; packed segments are dequantized once per
// call into stream-ordered scratch, code*scale + lo with the CPU's roundings, inverse channel
// permutation and Hadamard un-rotation); views with f32 rows, or f16 beside bf16 rows, on CUDA
// cores (fp32 tiles in shared memory). A query that sees no key gets zeros.
// Supported: D in {64, 128}; H_q a multiple of H_kv; full-precision segments f16/bf16/f32; packed
// segments with 1.5-bit or integer 1..8-bit codes, any metadata type, a channel permutation; a
// Hadamard rotation or 1.5-bit codes only on the tensor-core path (full-precision rows all f16 or
// all bf16). Channel-axis keys (skvq_key_axis=channel, runs from DeviceSegment::k_runs): the
// CUDA-core kernel dequantizes them tile by tile (each tile row's run found once per tile); the
// tensor-core path dequantizes the segment once per call like rotated ones (dequant_rows).
// Anything else: vq::Error.
void prefill_attention(const float* q, int64_t n_q_heads, int64_t n_queries,
                       const DeviceCacheView& view, const AttentionParams& p, float* out,
                       Stream s = nullptr);

// Convenience for tests: host q [B, H_q, N, D] in, host out back (synchronises).
std::vector<float> prefill_attention_host(const std::vector<float>& q, int64_t n_q_heads,
                                          int64_t n_queries, const DeviceCacheView& view,
                                          const AttentionParams& p);

}  // namespace vq::cuda
