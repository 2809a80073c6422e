// Device caches that are the CPU policies themselves (docs/design.md §3): a cache policy
// (vq::FullCache, vq::SnapKVCache, vq::StreamingCache, vq::SkvqCache, vq::SnapkvSkvqCache) built
// over the CUDA row backend, behind the DeviceKVCache interface. The policy's views already point
// at device memory; they are handed out as DeviceCacheViews without a copy (one DeviceSegment per
// segment: full-precision rows with the capacity taken from the view's strides, packed records
// with the capacity taken from their head stride and the transforms' device pointers). The adapter
// adds what a device cache promises beyond the policy: B, H and D fixed at construction (checked on
// every block and on load) and the device messages.
#include <istream>
#include <memory>
#include <string>
#include <type_traits>

#include "cuda/device_cache_scores.h"
#include "cuda/device_cache_util.h"
#include "cuda/row_store_cuda.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/skvq_cache.h"
#include "veloxquant/snapkv_cache.h"
#include "veloxquant/snapkv_skvq_cache.h"
#include "veloxquant/streaming_cache.h"

namespace vq::cuda {
namespace {

// A device view over the policy's view (no copy). Full-precision segments: rows [B, H, capacity,
// D] with element strides (H*cap*D, cap*D, D, 1). Packed segments: records [B, H, capacity,
// row_stride] (capacity from the head stride) with the transforms' device pointers. Positions,
// when explicit, [B, H, capacity].
DeviceCacheView device_view(const CacheView& v, int64_t batch, int64_t heads, int64_t head_dim) {
  DeviceCacheView out(batch, heads, head_dim);
  for (const ViewSegment& seg : v.segments) {
    DeviceSegment ds;
    bool ok = false;
    if (seg.packed) {
      const PackedTensor& pk = seg.packed->keys;
      const PackedTensor& pv = seg.packed->values;
      ds.capacity = pk.stride_h / pk.fmt.row_stride;
      ok = pk.stride_h == ds.capacity * pk.fmt.row_stride &&
           pv.stride_h == ds.capacity * pv.fmt.row_stride && pk.stride_b == heads * pk.stride_h &&
           pv.stride_b == heads * pv.stride_h;
      ds.packed = true;
      ds.dtype = seg.packed->out_dtype;
      ds.k_fmt = pk.fmt;
      ds.v_fmt = pv.fmt;
      ds.k_data = pk.data;
      ds.v_data = pv.data;
      ds.k_perm = pk.perm;
      ds.v_perm = pv.perm;
      ds.k_signs = pk.signs;
      ds.v_signs = pv.signs;
      ds.k_rot_block = pk.rot_block;
      ds.v_rot_block = pv.rot_block;
      ds.k_runs = pk.runs;  // channel-axis keys: the blocks of the run
      ds.k_n_runs = pk.n_runs;
    } else {
      const TensorView& k = seg.keys;
      ds.capacity = k.stride[1] / head_dim;
      ok = k.stride[3] == 1 && k.stride[2] == head_dim && k.stride[1] == ds.capacity * head_dim &&
           k.stride[0] == heads * k.stride[1] && seg.values.stride == k.stride;
      ds.dtype = k.dtype;
      ds.keys = k.data;
      ds.values = seg.values.data;
    }
    VQ_CHECK(ok && (seg.positions == nullptr || seg.pos_stride == ds.capacity),
             "[cuda cache] internal: expected store views [B, H, capacity, row bytes]");
    ds.n_rows = seg.n_rows;
    ds.positions = seg.positions;
    ds.first_pos = seg.first_pos;
    out.add_segment(ds);
  }
  return out;
}

// What every policy cache gives device_cache_scores.h: its policy through the CPU interface.
class PolicyCacheBase : public DeviceKVCache {
 public:
  virtual KVCache& policy() = 0;
  virtual const KVCache& policy() const = 0;

 protected:
  using DeviceKVCache::DeviceKVCache;
};

template <class Policy>
class PolicyDeviceCache final : public PolicyCacheBase {
 public:
  // layer: the model layer (the SKVQ policies' layer_index; the other policies have none).
  PolicyDeviceCache(const CacheConfig& cfg, int64_t b, int64_t h, int64_t d, Stream s,
                    int64_t layer = 0)
      : PolicyCacheBase(b, h, d, s),
        cfg_(cfg),
        layer_(layer),
        backend_(make_row_backend(s)),
        p_(make()) {}

  std::string method() const override { return p_->method(); }
  KVCache& policy() override { return *p_; }
  const KVCache& policy() const override { return *p_; }

  DeviceCacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                                   const DeviceUpdateOptions& opts) override {
    detail::check_blocks(keys, values, batch_, heads_, head_dim_, op().c_str());
    UpdateOptions o;
    o.queries = opts.queries;
    // inside an open RowWriteBatch the stores' writes from these blocks are recorded
    const detail::UpdateCall call(stream_, keys.data, values.data);
    const CacheView v = p_->update_and_fetch(keys, values, o);
    return device_view(v, batch_, heads_, head_dim_);
  }
  DeviceCacheView stored_view() const override {
    detail::flush_row_writes(stream_);  // the view's reader cannot see a pending row
    return device_view(p_->stored_view(), batch_, heads_, head_dim_);
  }
  int64_t offset() const override { return p_->offset(); }
  int64_t stored_rows() const override { return p_->stored_rows(); }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override {
    VQ_CHECK(b >= 0 && b < batch_ && h >= 0 && h < heads_,
             "[" + op() + "] stored_positions: expected 0 <= b < " + std::to_string(batch_) +
                 " and 0 <= h < " + std::to_string(heads_) + " but got (" + std::to_string(b) +
                 ", " + std::to_string(h) + ")");
    if (p_->offset() == 0) return {};
    return p_->stored_positions(b, h);
  }
  void end_prompt() override { p_->end_prompt(); }
  // The full cache's one store and the skvq cache's packed run (FullCache::reserve,
  // SkvqCache::reserve); snapkv+skvq rebuilds its packed store at each eviction and sizes itself.
  void reserve(int64_t rows) override {
    if constexpr (std::is_same_v<Policy, FullCache> || std::is_same_v<Policy, SkvqCache>)
      p_->reserve(rows);
  }
  // The policy's own mask (KVCache::make_mask over its positions, or its pending-eviction rule).
  Mask make_mask(int64_t n_queries, int64_t window) const override {
    return p_->make_mask(n_queries, window);
  }
  bool is_trimmable() const override { return p_->is_trimmable(); }
  int64_t trim(int64_t n) override {
    if (!p_->is_trimmable()) return DeviceKVCache::trim(n);
    return p_->trim(n);
  }
  CacheStats stats() const override { return p_->stats(); }
  void save(std::ostream& out) const override { p_->save(out); }
  void load(std::istream& in) override {
    std::unique_ptr<Policy> fresh = make();
    fresh->load(in);  // the policy's own checks and messages; nothing here changed on error
    detail::check_state_shape(op().c_str(), fresh->batch() > 0, fresh->batch(), fresh->n_kv_heads(),
                              head_dim_of(*fresh), batch_, heads_, head_dim_);
    p_ = std::move(fresh);
  }

 private:
  std::unique_ptr<Policy> make() const {
    if constexpr (std::is_same_v<Policy, FullCache>) {
      return std::make_unique<FullCache>(*backend_);
    } else if constexpr (std::is_same_v<Policy, SkvqCache> ||
                         std::is_same_v<Policy, SnapkvSkvqCache>) {
      return std::make_unique<Policy>(cfg_, *backend_, layer_);
    } else {
      return std::make_unique<Policy>(cfg_, *backend_);
    }
  }
  static int64_t head_dim_of(const Policy& p) { return p.head_dim(); }
  std::string op() const { return "cuda " + std::string(p_ ? p_->method() : "cache"); }

  CacheConfig cfg_;
  int64_t layer_ = 0;
  std::unique_ptr<kv::RowBackend> backend_;  // outlives the policy's stores
  std::unique_ptr<Policy> p_;
};

}  // namespace

bool takes_external_scores(const DeviceKVCache& cache) {
  const auto* p = dynamic_cast<const PolicyCacheBase*>(&cache);
  return p != nullptr && p->policy().takes_external_scores();
}

void set_external_scores(DeviceKVCache& cache, const float* scores, int64_t batch, int64_t heads,
                         int64_t rows) {
  auto* p = dynamic_cast<PolicyCacheBase*>(&cache);
  VQ_CHECK(p != nullptr, "[cuda " + cache.method() +
                             "] set_external_scores: expected a cache over a CPU policy "
                             "(src/cuda/device_cache_policy.cpp) but got another device cache");
  p->policy().set_external_scores(scores, batch, heads, rows);
}

std::unique_ptr<DeviceKVCache> make_device_full_cache(const CacheConfig& cfg, int64_t b, int64_t h,
                                                      int64_t d, Stream s) {
  return std::make_unique<PolicyDeviceCache<FullCache>>(cfg, b, h, d, s);
}

std::unique_ptr<DeviceKVCache> make_device_skvq_cache(const CacheConfig& cfg, int64_t b, int64_t h,
                                                      int64_t d, Stream s, int64_t layer) {
  return std::make_unique<PolicyDeviceCache<SkvqCache>>(cfg, b, h, d, s, layer);
}

std::unique_ptr<DeviceKVCache> make_device_snapkv_skvq_cache(const CacheConfig& cfg, int64_t b,
                                                             int64_t h, int64_t d, Stream s,
                                                             int64_t layer) {
  return std::make_unique<PolicyDeviceCache<SnapkvSkvqCache>>(cfg, b, h, d, s, layer);
}

std::unique_ptr<DeviceKVCache> make_device_snapkv_cache(const CacheConfig& cfg, int64_t b,
                                                        int64_t h, int64_t d, Stream s) {
  return std::make_unique<PolicyDeviceCache<SnapKVCache>>(cfg, b, h, d, s);
}

}  // namespace vq::cuda

namespace vq::cuda {

std::unique_ptr<DeviceKVCache> make_device_streaming_cache(const CacheConfig& cfg, int64_t b,
                                                           int64_t h, int64_t d, Stream s) {
  return std::make_unique<PolicyDeviceCache<StreamingCache>>(cfg, b, h, d, s);
}

}  // namespace vq::cuda
