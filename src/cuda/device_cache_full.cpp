// The GPU-resident full-precision cache (method "full", caches.md §2): the device twin of
// vq::FullCache. Keys and values each in one cudaMalloc buffer [B, H, capacity, D] of the first
// keys block's dtype (later blocks converted, round to nearest even); capacity grows like the
// CPU's (max(needed, 1.25 x capacity) rounded up to 256 rows), the stored rows copied once per
// growth. The view is one segment with implicit positions 0 .. offset-1. Trimmable.
// State: vq::FullCache's stream (has_data, dtype, B, H, D, offset, keys and values [B, H, offset,
// D]); a loaded cache holds its rows rounded up to 256, as the CPU's.
#include <algorithm>
#include <climits>
#include <istream>
#include <ostream>
#include <string>

#include "cuda/check.h"
#include "cuda/device_cache_util.h"
#include "veloxquant/error.h"

namespace vq::cuda {

namespace {

constexpr int64_t kStep = 256;

class FullDeviceCache final : public DeviceKVCache {
 public:
  FullDeviceCache(const CacheConfig& cfg, int64_t b, int64_t h, int64_t d, Stream s)
      : DeviceKVCache(b, h, d, s), cfg_(cfg) {}

  std::string method() const override { return "full"; }

  DeviceCacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                                   const DeviceUpdateOptions&) override {
    detail::check_blocks(keys, values, batch_, heads_, head_dim_, "cuda full_cache");
    const int64_t n_s = keys.shape[2];
    VQ_CHECK(n_s >= 1, "[cuda full_cache] expected keys [B, H, S, D] with every dim >= 1 but got " +
                           detail::shape_str(keys));
    VQ_CHECK(n_s <= INT32_MAX - offset_, "[cuda full_cache] expected at most " +
                                             std::to_string(INT32_MAX) +
                                             " positions in total but got " +
                                             std::to_string(offset_) + " + " + std::to_string(n_s));
    if (!has_data_) dtype_ = keys.dtype;
    const int64_t F = batch_ * heads_;
    const int64_t row_bytes = head_dim_ * static_cast<int64_t>(dtype_size(dtype_));
    const int64_t new_offset = offset_ + n_s;
    if (!has_data_ || new_offset > capacity_) {
      const int64_t cap = round_up(std::max(new_offset, capacity_ + capacity_ / 4), kStep);
      DeviceBuffer nk(static_cast<size_t>(F * cap * row_bytes));
      DeviceBuffer nv(static_cast<size_t>(F * cap * row_bytes));
      detail::copy_frames(nk.data(), cap, 0, k_.data(), capacity_, 0, F, offset_, row_bytes,
                          stream_);
      detail::copy_frames(nv.data(), cap, 0, v_.data(), capacity_, 0, F, offset_, row_bytes,
                          stream_);
      synchronize(stream_);  // the old buffers are freed below
      k_ = std::move(nk);
      v_ = std::move(nv);
      capacity_ = cap;
    }
    has_data_ = true;
    detail::convert_block(keys, 0, n_s, k_.data(), dtype_, capacity_, offset_, stream_);
    detail::convert_block(values, 0, n_s, v_.data(), dtype_, capacity_, offset_, stream_);
    offset_ = new_offset;
    return stored_view();
  }

  DeviceCacheView stored_view() const override {
    DeviceCacheView view(batch_, heads_, head_dim_);
    DeviceSegment seg;
    seg.n_rows = offset_;
    seg.capacity = capacity_;
    seg.first_pos = 0;
    seg.dtype = dtype_;
    seg.keys = k_.data();
    seg.values = v_.data();
    if (offset_ > 0) view.add_segment(seg);
    return view;
  }

  int64_t offset() const override { return offset_; }
  int64_t stored_rows() const override { return offset_; }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override {
    VQ_CHECK(b >= 0 && b < batch_ && h >= 0 && h < heads_,
             "[cuda full_cache] stored_positions: expected 0 <= b < " + std::to_string(batch_) +
                 " and 0 <= h < " + std::to_string(heads_) + " but got (" + std::to_string(b) +
                 ", " + std::to_string(h) + ")");
    std::vector<int32_t> p(static_cast<size_t>(offset_));
    for (int64_t i = 0; i < offset_; ++i) p[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    return p;
  }
  bool is_trimmable() const override { return true; }
  int64_t trim(int64_t n) override {
    VQ_CHECK(n >= 0, "[trim] expected n >= 0 but got " + std::to_string(n));
    const int64_t dropped = std::min(n, offset_);
    offset_ -= dropped;
    return dropped;
  }

  void save(std::ostream& out) const override {
    StateWriter w;
    detail::write_state_head(w, has_data_, dtype_, batch_, heads_, head_dim_, offset_);
    if (has_data_) {
      for (const DeviceBuffer* b : {&k_, &v_})
        w.tensor(detail::download_rows(b->data(), dtype_, batch_, heads_, offset_, head_dim_,
                                       capacity_, 0, stream_)
                     .view());
    }
    w.write(out, method());
  }

  void load(std::istream& in) override {
    StateReader r = detail::read_validated_state(in, cfg_);
    FullDeviceCache fresh(cfg_, batch_, heads_, head_dim_, stream_);
    detail::read_state_head(r, "cuda full_cache", batch_, heads_, head_dim_, fresh.has_data_,
                            fresh.dtype_, fresh.offset_);
    if (fresh.has_data_) {
      fresh.capacity_ = round_up(fresh.offset_, kStep);
      const Tensor k = r.tensor(), v = r.tensor();
      fresh.k_ = detail::upload_rows(k.view(), fresh.capacity_, stream_);
      fresh.v_ = detail::upload_rows(v.view(), fresh.capacity_, stream_);
    }
    synchronize(stream_);  // the last view is over
    *this = std::move(fresh);
  }

  CacheStats stats() const override {
    CacheStats s;
    s.method = method();
    s.tokens_seen = offset_;
    s.rows_stored = offset_;
    const int64_t elems = offset_ * batch_ * heads_ * head_dim_;
    const int64_t es = static_cast<int64_t>(dtype_size(dtype_));
    s.bytes_accounted = elems * 2 * es;
    s.bytes_resident = detail::held_bytes(k_) + detail::held_bytes(v_);
    s.fp16_bytes = elems * 2 * 2;
    s.figures = {
        {"key_bytes", static_cast<double>(elems * es)},
        {"value_bytes", static_cast<double>(elems * es)},
        {"capacity_rows", static_cast<double>(capacity_)},
        {"element_bytes", static_cast<double>(es)},
    };
    return s;
  }

 private:
  CacheConfig cfg_;
  bool has_data_ = false;
  DType dtype_ = DType::kF16;
  int64_t offset_ = 0, capacity_ = 0;
  DeviceBuffer k_, v_;
};

}  // namespace

std::unique_ptr<DeviceKVCache> make_device_full_cache(const CacheConfig& cfg, int64_t b, int64_t h,
                                                      int64_t d, Stream s) {
  return std::make_unique<FullDeviceCache>(cfg, b, h, d, s);
}

}  // namespace vq::cuda
