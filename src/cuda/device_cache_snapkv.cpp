// The GPU-resident SnapKV cache (method "snapkv", caches.md §3): the device twin of
// vq::SnapKVCache with the same deferred-eviction contract.
//
// Storage: keys and values [B, H, capacity, D] (fp16 or bf16, the snap_dtype rule) and the
// positions of every stored row [B, H, capacity] int32 in cudaMalloc buffers. Rows [0, n_sel) are
// the survivors of the last eviction (explicit positions in the view), rows [n_sel, n_sel + n_tail)
// the rows appended since (the implicit run offset - n_tail .. offset - 1). Capacity grows x1.5 in
// steps of 64 rows. After a step with S > 1 the frame (every stored row) is copied contiguous,
// selected with snap_select_frames (key proxy, or the last w real queries with their positions),
// and the kept rows and positions are gathered (gather_rows) into fresh buffers; the old ones are
// retired until the next mutating call, so the returned view never changes.
// With snap_evict_at = prompt_end a multi-token call only keeps its last window queries (fp32 on
// the device) and the selection runs once, at end_prompt() or before the first single-token call.
// Selections equal the CPU's whenever no two competing scores are within the GPU scorer's error
// bound of each other (its exp differs from the host's by an ulp or two: veloxquant/cuda.h).
// State: vq::SnapKVCache's stream (snap_* settings, shape, offset, n_sel, n_tail, the explicit
// positions, rows [B, H, n, D], the owed prompt-end selection and its window queries); a loaded
// cache holds its rows rounded up to 64, as the CPU's.
#include <algorithm>
#include <climits>
#include <istream>
#include <ostream>
#include <string>

#include "cuda/check.h"
#include "cuda/device_cache_util.h"
#include "veloxquant/error.h"
#include "veloxquant/snapkv.h"
#include "veloxquant/snapkv_cache.h"

namespace vq::cuda {

namespace {

constexpr int64_t kRowStep = 64;

class SnapKVDeviceCache final : public DeviceKVCache {
 public:
  SnapKVDeviceCache(const CacheConfig& cfg, int64_t b, int64_t h, int64_t d, Stream s)
      : DeviceKVCache(b, h, d, s), cfg_(cfg), params_(SnapSelectParams::from_config(cfg)) {}

  std::string method() const override { return "snapkv"; }

  DeviceCacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                                   const DeviceUpdateOptions& opts) override {
    detail::check_blocks(keys, values, batch_, heads_, head_dim_, "cuda snapkv");
    VQ_CHECK(offset_ + keys.shape[2] <= static_cast<int64_t>(INT32_MAX),
             "[cuda snapkv] expected positions to fit int32 but offset " + std::to_string(offset_) +
                 " + S " + std::to_string(keys.shape[2]) + " does not");
    const bool use_queries = cfg_.snap_scoring == SnapScoring::kQuery && opts.queries != nullptr;
    if (use_queries) {
      const TensorView& q = *opts.queries;
      VQ_CHECK(static_cast<uint8_t>(q.dtype) <= static_cast<uint8_t>(DType::kBF16) &&
                   (q.data != nullptr || q.numel() == 0),
               "[cuda snapkv] expected device queries of dtype float32/float16/bfloat16");
      VQ_CHECK(
          q.shape[0] == keys.shape[0] && q.shape[2] == keys.shape[2] && q.shape[3] == keys.shape[3],
          "[cuda snapkv] expected queries [" + std::to_string(keys.shape[0]) + ", H_q, " +
              std::to_string(keys.shape[2]) + ", " + std::to_string(keys.shape[3]) + "] but got " +
              detail::shape_str(q));
      VQ_CHECK(q.shape[1] >= heads_ && q.shape[1] % heads_ == 0,
               "[cuda snapkv] expected query heads H_q a multiple of the KV heads " +
                   std::to_string(heads_) + " but got " + std::to_string(q.shape[1]));
    }

    // A single-token call after a prompt whose eviction is still owed: the prompt is over.
    const bool at_prompt_end = cfg_.snap_evict_at == SnapEvictAt::kPromptEnd;
    if (at_prompt_end && pending_ && keys.shape[2] == 1) end_prompt();
    // The previous view is invalid from here on: release what only it used.
    release_retired();

    if (!has_data_) {
      dtype_ = snap_storage_dtype(cfg_.snap_dtype, keys.dtype, values.dtype);
      has_data_ = true;
    }
    const int64_t s = keys.shape[2];
    const int64_t n_old = n_sel_ + n_tail_;
    reserve_rows(n_old + s);
    const int64_t F = batch_ * heads_;
    detail::convert_block(keys, 0, s, k_.data(), dtype_, capacity_, n_old, stream_);
    detail::convert_block(values, 0, s, v_.data(), dtype_, capacity_, n_old, stream_);
    detail::fill_positions(pos_.as<int32_t>(), F, capacity_, n_old, s, offset_, stream_);
    n_tail_ += s;
    offset_ += s;

    DeviceCacheView view = stored_view();
    if (s > 1) {
      if (at_prompt_end)
        keep_query_window(use_queries ? opts.queries : nullptr, s);
      else
        evict_after_step(s, use_queries ? opts.queries : nullptr);
    }
    return view;
  }

  void end_prompt() override {
    if (!pending_) return;
    release_retired();  // end_prompt invalidates the last view
    TensorView q;
    if (win_rows_ > 0)
      q = TensorView::contiguous(win_q_.data(), DType::kF32, batch_, win_hq_, win_rows_, head_dim_);
    // The window rows are the prompt's last win_rows_ positions: offset_ has not moved since.
    evict_after_step(win_rows_, win_rows_ > 0 ? &q : nullptr);
    pending_ = false;
    win_hq_ = win_rows_ = 0;
    win_q_ = DeviceBuffer();
    release_retired();
  }

  DeviceCacheView stored_view() const override {
    DeviceCacheView view(batch_, heads_, head_dim_);
    const int64_t row_bytes = head_dim_ * 2;
    if (n_sel_ > 0) {
      DeviceSegment seg;
      seg.n_rows = n_sel_;
      seg.capacity = capacity_;
      seg.positions = pos_.as<int32_t>();
      seg.dtype = dtype_;
      seg.keys = k_.data();
      seg.values = v_.data();
      view.add_segment(seg);
    }
    if (n_tail_ > 0) {
      DeviceSegment seg;
      seg.n_rows = n_tail_;
      seg.capacity = capacity_;
      seg.first_pos = offset_ - n_tail_;
      seg.dtype = dtype_;
      seg.keys = k_.as<char>() + n_sel_ * row_bytes;
      seg.values = v_.as<char>() + n_sel_ * row_bytes;
      view.add_segment(seg);
    }
    return view;
  }

  int64_t offset() const override { return offset_; }
  int64_t stored_rows() const override { return n_sel_ + n_tail_; }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override {
    VQ_CHECK(b >= 0 && b < batch_ && h >= 0 && h < heads_,
             "[cuda snapkv] expected (b, h) within [" + std::to_string(batch_) + ", " +
                 std::to_string(heads_) + ") but got (" + std::to_string(b) + ", " +
                 std::to_string(h) + ")");
    std::vector<int32_t> out(static_cast<size_t>(n_sel_ + n_tail_));
    if (!out.empty())
      pos_.download(out.data(), out.size() * 4,
                    static_cast<size_t>((b * heads_ + h) * capacity_) * 4, stream_);
    return out;
  }

  Mask make_mask(int64_t n_queries, int64_t window) const override {
    if (pending_ && n_queries == 1)
      return detail::pending_single_query_mask("cuda snapkv", window,
                                               snap_keep_count(stored_rows(), params_));
    return DeviceKVCache::make_mask(n_queries, window);
  }

  void save(std::ostream& out) const override {
    const int64_t F = batch_ * heads_, n = n_sel_ + n_tail_;
    StateWriter w;
    write_snapkv_settings(w, cfg_);
    detail::write_state_head(w, has_data_, dtype_, batch_, heads_, head_dim_, offset_);
    w.i64(n_sel_);
    w.i64(n_tail_);
    std::vector<int32_t> sel(static_cast<size_t>(has_data_ ? F * n_sel_ : 0));
    detail::download_frames(sel.data(), n_sel_, pos_.data(), capacity_, 0, F, n_sel_, 4, stream_);
    w.vec_i32(sel);
    for (const DeviceBuffer* b : {&k_, &v_}) {
      if (has_data_)
        w.tensor(detail::download_rows(b->data(), dtype_, batch_, heads_, n, head_dim_, capacity_,
                                       0, stream_)
                     .view());
      else
        w.tensor(Tensor(dtype_, 0, 0, 0, 0).view());
    }
    w.boolean(pending_);
    w.i64(win_hq_);
    w.i64(win_rows_);
    w.vec_f32(win_q_.to_vector<float>(static_cast<size_t>(batch_ * win_hq_ * win_rows_ * head_dim_),
                                      stream_));
    w.write(out, method());
  }

  void load(std::istream& in) override {
    StateReader r = detail::read_validated_state(in, cfg_);
    r.i64();  // the snap_* settings: equal to cfg_ (the CPU load checked them)
    r.i64();
    r.i64();
    r.u8();
    r.u8();
    r.i64();
    r.u8();
    r.boolean();
    r.u8();
    SnapKVDeviceCache fresh(cfg_, batch_, heads_, head_dim_, stream_);
    detail::read_state_head(r, "cuda snapkv", batch_, heads_, head_dim_, fresh.has_data_,
                            fresh.dtype_, fresh.offset_);
    fresh.n_sel_ = r.i64();
    fresh.n_tail_ = r.i64();
    const std::vector<int32_t> sel = r.vec_i32();
    const Tensor k = r.tensor(), v = r.tensor();
    const int64_t n = fresh.n_sel_ + fresh.n_tail_, F = batch_ * heads_;
    if (n > 0) {
      fresh.capacity_ = round_up(n, kRowStep);
      fresh.k_ = detail::upload_rows(k.view(), fresh.capacity_, stream_);
      fresh.v_ = detail::upload_rows(v.view(), fresh.capacity_, stream_);
      std::vector<int32_t> pos(static_cast<size_t>(F * n));  // explicit, then the implicit run
      for (int64_t f = 0; f < F; ++f)
        for (int64_t i = 0; i < n; ++i)
          pos[static_cast<size_t>(f * n + i)] = i < fresh.n_sel_
                                                    ? sel[static_cast<size_t>(f * fresh.n_sel_ + i)]
                                                    : static_cast<int32_t>(fresh.offset_ - n + i);
      fresh.pos_ = DeviceBuffer(static_cast<size_t>(F * fresh.capacity_ * 4));
      detail::upload_frames(fresh.pos_.data(), fresh.capacity_, 0, pos.data(), n, F, n, 4, stream_);
    }
    fresh.pending_ = r.boolean();
    fresh.win_hq_ = r.i64();
    fresh.win_rows_ = r.i64();
    const std::vector<float> q = r.vec_f32();
    if (!q.empty()) fresh.win_q_ = DeviceBuffer::from_vector(q, stream_);
    synchronize(stream_);  // the last view is over
    *this = std::move(fresh);
  }

  CacheStats stats() const override {
    CacheStats st =
        eviction_stats(method(), batch_, heads_, head_dim_, stored_rows(), offset_, true);
    st.bytes_resident = detail::held_bytes(k_) + detail::held_bytes(v_) + detail::held_bytes(pos_) +
                        detail::held_bytes(retired_k_) + detail::held_bytes(retired_v_) +
                        detail::held_bytes(retired_pos_) + detail::held_bytes(win_q_);
    return st;
  }

 private:
  void release_retired() {
    synchronize(stream_);
    retired_k_ = DeviceBuffer();
    retired_v_ = DeviceBuffer();
    retired_pos_ = DeviceBuffer();
  }

  // snap_evict_at = prompt_end: keeps the last min(obs_window, s) query rows of this call (fp32;
  // none = key proxy) for the selection end_prompt() runs.
  void keep_query_window(const TensorView* queries, int64_t s) {
    pending_ = true;
    win_hq_ = queries ? queries->shape[1] : 0;
    win_rows_ = queries ? std::min(params_.obs_window, s) : 0;
    win_q_ = DeviceBuffer();
    if (win_rows_ > 0) {
      win_q_ = DeviceBuffer(static_cast<size_t>(batch_ * win_hq_ * win_rows_ * head_dim_ * 4));
      detail::convert_block(*queries, s - win_rows_, win_rows_, win_q_.data(), DType::kF32,
                            win_rows_, 0, stream_);
    }
  }

  void reserve_rows(int64_t rows) {
    if (rows <= capacity_) return;
    const int64_t new_cap =
        round_up(std::max({rows, capacity_ + capacity_ / 2, kRowStep}), kRowStep);
    const int64_t F = batch_ * heads_, n = n_sel_ + n_tail_, row_bytes = head_dim_ * 2;
    DeviceBuffer nk(static_cast<size_t>(F * new_cap * row_bytes));
    DeviceBuffer nv(static_cast<size_t>(F * new_cap * row_bytes));
    DeviceBuffer np(static_cast<size_t>(F * new_cap * 4));
    detail::copy_frames(nk.data(), new_cap, 0, k_.data(), capacity_, 0, F, n, row_bytes, stream_);
    detail::copy_frames(nv.data(), new_cap, 0, v_.data(), capacity_, 0, F, n, row_bytes, stream_);
    detail::copy_frames(np.data(), new_cap, 0, pos_.data(), capacity_, 0, F, n, 4, stream_);
    synchronize(stream_);  // the old buffers are freed below
    k_ = std::move(nk);
    v_ = std::move(nv);
    pos_ = std::move(np);
    capacity_ = new_cap;
  }

  void evict_after_step(int64_t n_new, const TensorView* queries) {
    const int64_t n = n_sel_ + n_tail_;  // the frame: stored ++ new
    const int64_t count = snap_keep_count(n, params_);
    if (count >= n) return;
    const int64_t F = batch_ * heads_, D = head_dim_, row_bytes = D * 2;

    // The frame, contiguous [B, H, n, D], and its positions [B, H, n].
    DeviceBuffer frame(static_cast<size_t>(F * n * row_bytes));
    detail::copy_frames(frame.data(), n, 0, k_.data(), capacity_, 0, F, n, row_bytes, stream_);
    const TensorView frame_keys =
        TensorView::contiguous(frame.data(), dtype_, batch_, heads_, n, D);
    DeviceBuffer frame_pos, qbuf, qpos;
    TensorView qv;
    if (queries) {
      // The last w_q of this call's queries, positions offset - w_q .. offset - 1.
      const int64_t hq = queries->shape[1];
      const int64_t w_q = std::min(std::clamp<int64_t>(params_.obs_window, 1, n), n_new);
      frame_pos = DeviceBuffer(static_cast<size_t>(F * n * 4));
      detail::copy_frames(frame_pos.data(), n, 0, pos_.data(), capacity_, 0, F, n, 4, stream_);
      qbuf = DeviceBuffer(static_cast<size_t>(batch_ * hq * w_q * D * 4));
      detail::convert_block(*queries, n_new - w_q, w_q, qbuf.data(), DType::kF32, w_q, 0, stream_);
      qpos = DeviceBuffer(static_cast<size_t>(w_q * 4));
      detail::fill_positions(qpos.as<int32_t>(), 1, w_q, 0, w_q, offset_ - w_q, stream_);
      qv = TensorView::contiguous(qbuf.data(), DType::kF32, batch_, hq, w_q, D);
    }
    DeviceBuffer idx(static_cast<size_t>(F * count * 4));
    DecodeWorkspace ws;
    const int64_t got = snap_select_frames(
        frame_keys, queries ? &qv : nullptr, queries ? frame_pos.as<int32_t>() : nullptr,
        queries ? qpos.as<int32_t>() : nullptr, params_, idx.as<int32_t>(), ws, stream_);
    VQ_CHECK(got == count, "[cuda snapkv] internal: selected " + std::to_string(got) +
                               " rows per head, expected " + std::to_string(count));

    // Gather the kept rows and positions (contiguous), then place them in the new store.
    DeviceBuffer gk(static_cast<size_t>(F * count * row_bytes));
    DeviceBuffer gv(static_cast<size_t>(F * count * row_bytes));
    DeviceBuffer gp(static_cast<size_t>(F * count * 4));
    gather_rows(k_.data(), F, capacity_, row_bytes, idx.as<int32_t>(), count, gk.data(),
                pos_.as<int32_t>(), 0, gp.as<int32_t>(), stream_);
    gather_rows(v_.data(), F, capacity_, row_bytes, idx.as<int32_t>(), count, gv.data(), nullptr, 0,
                nullptr, stream_);
    const int64_t new_cap = round_up(count, kRowStep);
    DeviceBuffer nk(static_cast<size_t>(F * new_cap * row_bytes));
    DeviceBuffer nv(static_cast<size_t>(F * new_cap * row_bytes));
    DeviceBuffer np(static_cast<size_t>(F * new_cap * 4));
    detail::copy_frames(nk.data(), new_cap, 0, gk.data(), count, 0, F, count, row_bytes, stream_);
    detail::copy_frames(nv.data(), new_cap, 0, gv.data(), count, 0, F, count, row_bytes, stream_);
    detail::copy_frames(np.data(), new_cap, 0, gp.data(), count, 0, F, count, 4, stream_);
    synchronize(stream_);  // the temporaries are freed on return

    // The returned view still points at the old buffers: retire them instead of freeing.
    retired_k_ = std::move(k_);
    retired_v_ = std::move(v_);
    retired_pos_ = std::move(pos_);
    k_ = std::move(nk);
    v_ = std::move(nv);
    pos_ = std::move(np);
    capacity_ = new_cap;
    n_sel_ = count;
    n_tail_ = 0;
  }

  CacheConfig cfg_;
  SnapSelectParams params_;
  bool has_data_ = false;
  DType dtype_ = DType::kF16;
  int64_t offset_ = 0, n_sel_ = 0, n_tail_ = 0, capacity_ = 0;
  DeviceBuffer k_, v_, pos_;
  DeviceBuffer retired_k_, retired_v_, retired_pos_;
  // snap_evict_at = prompt_end: a selection is owed, scored with win_q_ [B, win_hq, win_rows, D]
  // fp32 (none = key proxy).
  bool pending_ = false;
  int64_t win_hq_ = 0, win_rows_ = 0;
  DeviceBuffer win_q_;
};

}  // namespace

std::unique_ptr<DeviceKVCache> make_device_snapkv_cache(const CacheConfig& cfg, int64_t b,
                                                        int64_t h, int64_t d, Stream s) {
  return std::make_unique<SnapKVDeviceCache>(cfg, b, h, d, s);
}

}  // namespace vq::cuda
