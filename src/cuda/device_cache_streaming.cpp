// The GPU-resident StreamingLLM baseline (method "streaming"): the device twin of
// vq::StreamingCache: the first streaming_n_sink positions plus the most recent streaming_window
// rows, with the deferred contract (every call returns stored ++ new, then trims).
//
// Storage: keys and values [B, H, capacity, D] fp16 (bf16 when both inputs are bf16) in
// cudaMalloc buffers; per (b, h) rows [0, n_sink_rows) are the sinks, rows [head, head + n_recent)
// the recent run (positions offset - n_recent .. offset - 1), the same for every head, so a view
// has at most two segments with implicit positions. Capacity follows the CPU's rules (grows by
// doubling with the rows held up to the steady size sinks + window + slack; a prefill that grew
// the buffer past it gives it back after its step, the old buffer retired until the next mutating
// call); moving the run back next to the sinks is a copy into a fresh buffer (device copies may
// not overlap). A failed allocation is a vq::Error naming streaming_window.
// State: vq::StreamingCache's stream (settings, shape, offset, sink and recent counts, then the
// sink rows and the recent run of K, then of V); a loaded cache has room for its rows only.
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

constexpr int64_t kRowStep = 64;

class StreamingDeviceCache final : public DeviceKVCache {
 public:
  StreamingDeviceCache(const CacheConfig& cfg, int64_t b, int64_t h, int64_t d, Stream s)
      : DeviceKVCache(b, h, d, s),
        cfg_(cfg),
        n_sink_(cfg.streaming_n_sink),
        window_(cfg.streaming_window) {
    VQ_CHECK(n_sink_ >= 0,
             "[cuda streaming] streaming_n_sink: expected >= 0 but got " + std::to_string(n_sink_));
    VQ_CHECK(window_ >= 1,
             "[cuda streaming] streaming_window: expected >= 1 but got " + std::to_string(window_));
    // The config's caps (positions fit int32), so steady_capacity() cannot wrap.
    VQ_CHECK(n_sink_ <= kMaxCacheRows && window_ <= kMaxCacheRows,
             "[cuda streaming] streaming_n_sink, streaming_window: expected <= " +
                 std::to_string(kMaxCacheRows) + " but got " + std::to_string(n_sink_) + ", " +
                 std::to_string(window_));
  }

  std::string method() const override { return "streaming"; }

  DeviceCacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                                   const DeviceUpdateOptions&) override {
    detail::check_blocks(keys, values, batch_, heads_, head_dim_, "cuda streaming");
    VQ_CHECK(offset_ + keys.shape[2] <= static_cast<int64_t>(INT32_MAX),
             "[cuda streaming] expected positions to fit int32 but offset " +
                 std::to_string(offset_) + " + S " + std::to_string(keys.shape[2]) + " does not");
    synchronize(stream_);  // the previous view is invalid from here on
    retired_k_ = DeviceBuffer();
    retired_v_ = DeviceBuffer();
    if (!has_data_) {
      dtype_ =
          keys.dtype == DType::kBF16 && values.dtype == DType::kBF16 ? DType::kBF16 : DType::kF16;
      has_data_ = true;
    }
    const int64_t s = keys.shape[2];
    make_room(s);
    detail::convert_block(keys, 0, s, k_.data(), dtype_, capacity_, head_ + n_recent_, stream_);
    detail::convert_block(values, 0, s, v_.data(), dtype_, capacity_, head_ + n_recent_, stream_);
    n_recent_ += s;
    offset_ += s;
    if (n_sink_rows_ < n_sink_) {  // the first positions of the run become sinks in place
      const int64_t grow = std::min(n_sink_, offset_) - n_sink_rows_;
      n_sink_rows_ += grow;
      head_ += grow;
      n_recent_ -= grow;
    }
    DeviceCacheView view = stored_view();
    if (n_recent_ > window_) {  // deferred trim
      head_ += n_recent_ - window_;
      n_recent_ = window_;
      if (s > 1 && capacity_ > steady_capacity()) relocate(steady_capacity(), true);
    }
    return view;
  }

  DeviceCacheView stored_view() const override {
    DeviceCacheView view(batch_, heads_, head_dim_);
    const int64_t row_bytes = head_dim_ * 2;
    auto add = [&](int64_t row0, int64_t n, int64_t first_pos) {
      DeviceSegment seg;
      seg.n_rows = n;
      seg.capacity = capacity_;
      seg.first_pos = first_pos;
      seg.dtype = dtype_;
      seg.keys = k_.as<const char>() + row0 * row_bytes;
      seg.values = v_.as<const char>() + row0 * row_bytes;
      view.add_segment(seg);
    };
    const int64_t run_first = offset_ - n_recent_;
    if (head_ == n_sink_rows_ && run_first == n_sink_rows_) {
      if (n_sink_rows_ + n_recent_ > 0) add(0, n_sink_rows_ + n_recent_, 0);
      return view;
    }
    if (n_sink_rows_ > 0) add(0, n_sink_rows_, 0);
    if (n_recent_ > 0) add(head_, n_recent_, run_first);
    return view;
  }

  int64_t offset() const override { return offset_; }
  int64_t stored_rows() const override { return n_sink_rows_ + n_recent_; }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override {
    VQ_CHECK(b >= 0 && b < batch_ && h >= 0 && h < heads_,
             "[cuda streaming] expected (b, h) within [" + std::to_string(batch_) + ", " +
                 std::to_string(heads_) + ") but got (" + std::to_string(b) + ", " +
                 std::to_string(h) + ")");
    std::vector<int32_t> out;
    for (int64_t j = 0; j < n_sink_rows_; ++j) out.push_back(static_cast<int32_t>(j));
    for (int64_t j = offset_ - n_recent_; j < offset_; ++j) out.push_back(static_cast<int32_t>(j));
    return out;
  }

  void save(std::ostream& out) const override {
    StateWriter w;
    w.i64(n_sink_);
    w.i64(window_);
    detail::write_state_head(w, has_data_, dtype_, batch_, heads_, head_dim_, offset_);
    w.i64(n_sink_rows_);
    w.i64(n_recent_);
    const int64_t b = has_data_ ? batch_ : 0, h = has_data_ ? heads_ : 0,
                  d = has_data_ ? head_dim_ : 0;
    for (const DeviceBuffer* buf : {&k_, &v_}) {  // sinks, then the recent run
      w.tensor(
          detail::download_rows(buf->data(), dtype_, b, h, n_sink_rows_, d, capacity_, 0, stream_)
              .view());
      w.tensor(
          detail::download_rows(buf->data(), dtype_, b, h, n_recent_, d, capacity_, head_, stream_)
              .view());
    }
    w.write(out, method());
  }

  void load(std::istream& in) override {
    StateReader r = detail::read_validated_state(in, cfg_);
    r.i64();  // streaming_n_sink and streaming_window: equal to cfg_ (the CPU load checked them)
    r.i64();
    StreamingDeviceCache fresh(cfg_, batch_, heads_, head_dim_, stream_);
    detail::read_state_head(r, "cuda streaming", batch_, heads_, head_dim_, fresh.has_data_,
                            fresh.dtype_, fresh.offset_);
    fresh.n_sink_rows_ = r.i64();
    fresh.n_recent_ = r.i64();
    fresh.head_ = fresh.n_sink_rows_;
    fresh.capacity_ =
        fresh.has_data_
            ? round_up(std::max<int64_t>(fresh.n_sink_rows_ + fresh.n_recent_, 1), kRowStep)
            : 0;
    const int64_t F = batch_ * heads_, row_bytes = head_dim_ * 2;
    for (DeviceBuffer* buf : {&fresh.k_, &fresh.v_}) {
      const Tensor sinks = r.tensor(), run = r.tensor();
      if (!fresh.has_data_) continue;
      *buf = DeviceBuffer(static_cast<size_t>(F * fresh.capacity_ * row_bytes));
      detail::upload_frames(buf->data(), fresh.capacity_, 0, sinks.data(), fresh.n_sink_rows_, F,
                            fresh.n_sink_rows_, row_bytes, stream_);
      detail::upload_frames(buf->data(), fresh.capacity_, fresh.head_, run.data(), fresh.n_recent_,
                            F, fresh.n_recent_, row_bytes, stream_);
    }
    synchronize(stream_);  // the last view is over
    *this = std::move(fresh);
  }

  CacheStats stats() const override {
    CacheStats st =
        eviction_stats(method(), batch_, heads_, head_dim_, stored_rows(), offset_, false);
    st.bytes_resident = detail::held_bytes(k_) + detail::held_bytes(v_) +
                        detail::held_bytes(retired_k_) + detail::held_bytes(retired_v_);
    st.figures.push_back({"sink_rows", static_cast<double>(n_sink_rows_)});
    st.figures.push_back({"recent_rows", static_cast<double>(n_recent_)});
    return st;
  }

 private:
  int64_t steady_capacity() const {
    const int64_t slack = std::max(kRowStep, round_up(window_ / 4, kRowStep));
    return round_up(n_sink_ + window_ + slack, kRowStep);
  }

  // Sinks + recent run into a fresh buffer of new_cap rows (run at row n_sink_rows).
  void relocate(int64_t new_cap, bool retire_old) {
    const int64_t F = batch_ * heads_, row_bytes = head_dim_ * 2;
    // [B, H, new_cap, D] twice; a size that does not fit or memory the device refuses is an error
    // naming the window (nothing has changed yet).
    int64_t frame = 0, bytes = 0;
    const bool fits = !__builtin_mul_overflow(new_cap, row_bytes, &frame) &&
                      !__builtin_mul_overflow(frame, F, &bytes);
    auto refuse = [&](const std::string& why) {
      throw Error("[cuda streaming] streaming_window: expected device memory for " +
                  std::to_string(new_cap) + " rows per head (streaming_n_sink " +
                  std::to_string(n_sink_) + ", streaming_window " + std::to_string(window_) +
                  ") but " + why + "; a smaller streaming_window needs less");
    };
    if (!fits) refuse("the size does not fit 64 bits");
    DeviceBuffer nk, nv;
    try {
      nk = DeviceBuffer(static_cast<size_t>(bytes));
      nv = DeviceBuffer(static_cast<size_t>(bytes));
    } catch (const Error& e) {
      refuse(std::string("the allocation failed: ") + e.what());
    }
    for (int kv = 0; kv < 2; ++kv) {
      DeviceBuffer& dst = kv == 0 ? nk : nv;
      const DeviceBuffer& src = kv == 0 ? k_ : v_;
      detail::copy_frames(dst.data(), new_cap, 0, src.data(), capacity_, 0, F, n_sink_rows_,
                          row_bytes, stream_);
      detail::copy_frames(dst.data(), new_cap, n_sink_rows_, src.data(), capacity_, head_, F,
                          n_recent_, row_bytes, stream_);
    }
    if (retire_old) {
      retired_k_ = std::move(k_);
      retired_v_ = std::move(v_);
    } else {
      synchronize(stream_);  // the old buffers are freed below
    }
    k_ = std::move(nk);
    v_ = std::move(nv);
    capacity_ = new_cap;
    head_ = n_sink_rows_;
  }

  void make_room(int64_t extra) {
    if (head_ + n_recent_ + extra <= capacity_) return;
    const int64_t needed = n_sink_rows_ + n_recent_ + extra;
    if (needed <= capacity_ && capacity_ >= steady_capacity()) {
      relocate(capacity_, false);  // the CPU's in-place move, as a copy into a fresh buffer
      return;
    }
    // Grow as the CPU cache does: double up to the steady size, or what a large prefill needs.
    const int64_t target = std::max(needed, std::min(steady_capacity(), 2 * capacity_));
    relocate(round_up(target, kRowStep), false);
  }

  CacheConfig cfg_;
  int64_t n_sink_ = 4, window_ = 512;
  bool has_data_ = false;
  DType dtype_ = DType::kF16;
  int64_t offset_ = 0, n_sink_rows_ = 0, head_ = 0, n_recent_ = 0, capacity_ = 0;
  DeviceBuffer k_, v_, retired_k_, retired_v_;
};

}  // namespace

std::unique_ptr<DeviceKVCache> make_device_streaming_cache(const CacheConfig& cfg, int64_t b,
                                                           int64_t h, int64_t d, Stream s) {
  return std::make_unique<StreamingDeviceCache>(cfg, b, h, d, s);
}

}  // namespace vq::cuda
