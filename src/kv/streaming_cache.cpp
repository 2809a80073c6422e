// StreamingLLM baseline cache: sinks + most recent window (see veloxquant/streaming_cache.h).
//
// A policy over a row store (src/kv/row_store.h): the same code whatever device holds the rows.
// Layout: one store [B, H, capacity_, D] of fp16/bf16 rows; per (b, h) rows [0, n_sink_rows_)
// hold positions 0 .. n_sink_rows_ - 1 and rows [head_, head_ + n_recent_) hold the contiguous run
// offset_ - n_recent_ .. offset_ - 1 (the same positions for every head). Before any eviction the
// two parts touch (head_ == n_sink_rows_, positions 0 .. offset_ - 1) and the view is one segment.
// Eviction only advances head_ (the bytes of the returned view are never touched); a prefill call
// that left the buffer larger than the steady capacity copies the survivors into a fresh buffer and
// keeps the old one alive until the next mutating call. The buffer grows by doubling up to the
// steady capacity (make_room), so memory follows the rows held, not the configured window.
// Byte figures: 2 bytes per element.
#include "veloxquant/streaming_cache.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <istream>
#include <limits>
#include <new>
#include <ostream>
#include <stdexcept>
#include <string>

#include "kv/row_store.h"
#include "veloxquant/binary_io.h"
#include "veloxquant/error.h"

namespace vq {
namespace {

std::string shape_str(const std::array<int64_t, 4>& s) {
  return "[" + std::to_string(s[0]) + ", " + std::to_string(s[1]) + ", " + std::to_string(s[2]) +
         ", " + std::to_string(s[3]) + "]";
}

// a * b for non-negative a, b; false when the product does not fit int64.
bool mul_fits(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

}  // namespace

std::unique_ptr<KVCache> make_streaming_cache(const CacheConfig& cfg) {
  validate(cfg);
  return std::make_unique<StreamingCache>(cfg);
}

StreamingCache::StreamingCache(const CacheConfig& cfg) : StreamingCache(cfg, kv::cpu_backend()) {}

StreamingCache::~StreamingCache() = default;

StreamingCache::StreamingCache(const CacheConfig& cfg, const kv::RowBackend& backend)
    : backend_(&backend), n_sink_(cfg.streaming_n_sink), window_(cfg.streaming_window) {
  VQ_CHECK(n_sink_ >= 0,
           "[streaming] streaming_n_sink: expected >= 0 but got " + std::to_string(n_sink_));
  VQ_CHECK(window_ >= 1,
           "[streaming] streaming_window: expected >= 1 but got " + std::to_string(window_));
  // The config's caps (positions fit int32), so the sum below cannot wrap.
  VQ_CHECK(n_sink_ <= kMaxCacheRows,
           "[streaming] streaming_n_sink: expected <= " + std::to_string(kMaxCacheRows) +
               " but got " + std::to_string(n_sink_));
  VQ_CHECK(window_ <= kMaxCacheRows,
           "[streaming] streaming_window: expected <= " + std::to_string(kMaxCacheRows) +
               " but got " + std::to_string(window_));
  // Sinks + window + slack rows. The slack (a quarter window, at least one step) is how many
  // decode appends fit before the run must be moved back: a move copies `window` rows, so the
  // amortised cost is at most window / slack <= 4 row copies per decode step, whatever the
  // context length. At most ~2.5 * 2^31 rows: no overflow.
  const int64_t slack = std::max(kRowStep, round_up(window_ / 4, kRowStep));
  steady_cap_ = round_up(n_sink_ + window_ + slack, kRowStep);
}

void StreamingCache::check_input(const TensorView& keys, const TensorView& values) const {
  VQ_CHECK(keys.data != nullptr || keys.numel() == 0,
           "[streaming] expected keys data but got nullptr");
  VQ_CHECK(values.data != nullptr || values.numel() == 0,
           "[streaming] expected values data but got nullptr");
  VQ_CHECK(keys.shape == values.shape, "[streaming] expected values of the keys' shape " +
                                           shape_str(keys.shape) + " but got " +
                                           shape_str(values.shape));
  VQ_CHECK(keys.shape[0] >= 1 && keys.shape[1] >= 1 && keys.shape[2] >= 0 && keys.shape[3] >= 1,
           "[streaming] expected keys [B>=1, H>=1, S>=0, D>=1] but got " + shape_str(keys.shape));
  if (has_data_) {
    VQ_CHECK(keys.shape[0] == batch_ && keys.shape[1] == heads_ && keys.shape[3] == head_dim_,
             "[streaming] expected keys [" + std::to_string(batch_) + ", " +
                 std::to_string(heads_) + ", S, " + std::to_string(head_dim_) +
                 "] (fixed by the first call) but got " + shape_str(keys.shape));
  }
  VQ_CHECK(offset_ + keys.shape[2] <= static_cast<int64_t>(INT32_MAX),
           "[streaming] expected positions to fit int32 but offset " + std::to_string(offset_) +
               " + S " + std::to_string(keys.shape[2]) + " does not");
}

void StreamingCache::relocate(int64_t new_cap, bool retire_old) {
  const int64_t bh_total = batch_ * heads_;
  const int64_t d = head_dim_;
  // [B, H, new_cap, D] twice: a product that does not fit, or memory the system refuses, is an
  // error naming the window (nothing has changed yet).
  int64_t per_head = 0, elems = 0;
  const bool fits = mul_fits(new_cap, d, &per_head) && mul_fits(per_head, bh_total, &elems) &&
                    elems <= std::numeric_limits<int64_t>::max() / 4;
  auto refuse = [&](const std::string& why) {
    throw Error("[streaming] streaming_window: expected memory for " + std::to_string(new_cap) +
                " rows of [" + std::to_string(batch_) + ", " + std::to_string(heads_) + ", rows, " +
                std::to_string(d) + "] fp16 keys and values (streaming_n_sink " +
                std::to_string(n_sink_) + ", streaming_window " + std::to_string(window_) +
                ") but " + why + "; a smaller streaming_window needs less");
  };
  if (!fits) refuse("the size does not fit 64 bits");
  std::unique_ptr<kv::RowStore> fresh;
  try {
    fresh = backend_->make({dtype_, batch_, heads_, head_dim_}, new_cap, false);
  } catch (const std::bad_alloc&) {
    refuse("allocating " + std::to_string(elems * 4) + " bytes failed");
  } catch (const std::length_error&) {
    refuse("allocating " + std::to_string(elems * 4) + " bytes failed");
  }
  if (rows_) {
    fresh->copy_range(*rows_, 0, 0, n_sink_rows_);
    fresh->copy_range(*rows_, head_, n_sink_rows_, n_recent_);
  }
  if (retire_old) retired_ = std::move(rows_);
  rows_ = std::move(fresh);
  capacity_ = new_cap;
  head_ = n_sink_rows_;
}

void StreamingCache::make_room(int64_t extra) {
  if (head_ + n_recent_ + extra <= capacity_) return;
  const int64_t needed = n_sink_rows_ + n_recent_ + extra;
  if (needed <= capacity_ && capacity_ >= steady_cap_) {
    // Move the run back next to the sinks (head > sinks here, else needed > capacity), without
    // overlapping copies: on a device each would make a scratch store in a decode step.
    kv::move_rows_down(*rows_, head_, n_sink_rows_, n_recent_);
    head_ = n_sink_rows_;
    return;
  }
  // Grow: double (amortised O(1) copies per appended row) up to the steady capacity; a prefill
  // call larger than that gets what it needs (given back after the step's trim).
  const int64_t target = std::max(needed, std::min(steady_cap_, 2 * capacity_));
  relocate(round_up(target, kRowStep), /*retire_old=*/false);
}

CacheView StreamingCache::update_and_fetch(const TensorView& keys, const TensorView& values,
                                           const UpdateOptions& /*opts*/) {
  check_input(keys, values);  // nothing changes before this passes

  // The previous view is invalid from here on: release what only it used.
  retired_.reset();

  const bool first = !has_data_;
  if (first) {
    batch_ = keys.shape[0];
    heads_ = keys.shape[1];
    head_dim_ = keys.shape[3];
    dtype_ =
        keys.dtype == DType::kBF16 && values.dtype == DType::kBF16 ? DType::kBF16 : DType::kF16;
    has_data_ = true;
  }

  const int64_t s = keys.shape[2];
  try {
    make_room(s);  // may refuse the memory: then nothing has changed
  } catch (const Error&) {
    if (first) {
      has_data_ = false;
      batch_ = heads_ = head_dim_ = 0;
      dtype_ = DType::kF16;
    }
    throw;
  }
  if (s > 0) rows_->write_block(keys, values, 0, s, head_ + n_recent_);
  n_recent_ += s;
  offset_ += s;
  // Until n_sink positions were seen nothing was evicted (head_ == n_sink_rows_): the first
  // positions of the run become sinks in place.
  if (n_sink_rows_ < n_sink_) {
    const int64_t grow = std::min(n_sink_, offset_) - n_sink_rows_;
    n_sink_rows_ += grow;
    head_ += grow;
    n_recent_ -= grow;
  }

  CacheView view = stored_view();

  // Trim to sinks + window (deferred: the view above keeps every row of this step).
  if (n_recent_ > window_) {
    head_ += n_recent_ - window_;
    n_recent_ = window_;
    // A prefill call may have grown the buffer past the steady size: give the memory back.
    if (s > 1 && capacity_ > steady_cap_) relocate(steady_cap_, /*retire_old=*/true);
  }
  return view;
}

CacheView StreamingCache::stored_view() const {
  CacheView view;
  view.batch = batch_;
  view.n_kv_heads = heads_;
  view.head_dim = head_dim_;
  auto keys_at = [&](int64_t row0, int64_t n) { return rows_->keys(row0, n); };
  auto values_at = [&](int64_t row0, int64_t n) { return rows_->values(row0, n); };
  const int64_t run_first = offset_ - n_recent_;
  if (head_ == n_sink_rows_ && run_first == n_sink_rows_) {
    // Nothing evicted: rows 0 .. offset_ - 1 in one run.
    if (n_sink_rows_ + n_recent_ > 0) {
      ViewSegment seg;
      seg.n_rows = n_sink_rows_ + n_recent_;
      seg.first_pos = 0;
      seg.keys = keys_at(0, seg.n_rows);
      seg.values = values_at(0, seg.n_rows);
      view.segments.push_back(seg);
    }
    return view;
  }
  if (n_sink_rows_ > 0) {
    ViewSegment seg;
    seg.n_rows = n_sink_rows_;
    seg.first_pos = 0;
    seg.keys = keys_at(0, n_sink_rows_);
    seg.values = values_at(0, n_sink_rows_);
    view.segments.push_back(seg);
  }
  if (n_recent_ > 0) {
    ViewSegment seg;
    seg.n_rows = n_recent_;
    seg.first_pos = run_first;
    seg.keys = keys_at(head_, n_recent_);
    seg.values = values_at(head_, n_recent_);
    view.segments.push_back(seg);
  }
  return view;
}

std::vector<int32_t> StreamingCache::stored_positions(int64_t b, int64_t h) const {
  VQ_CHECK(b >= 0 && b < batch_ && h >= 0 && h < heads_,
           "[streaming] expected (b, h) within [" + std::to_string(batch_) + ", " +
               std::to_string(heads_) + ") but got (" + std::to_string(b) + ", " +
               std::to_string(h) + ")");
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(n_sink_rows_ + n_recent_));
  for (int64_t j = 0; j < n_sink_rows_; ++j) out.push_back(static_cast<int32_t>(j));
  for (int64_t j = offset_ - n_recent_; j < offset_; ++j) out.push_back(static_cast<int32_t>(j));
  return out;
}

Mask StreamingCache::make_mask(int64_t n_queries, int64_t window) const {
  if (n_queries == 1 && window == 0) {
    Mask m;  // a single query at offset() sees every stored row and itself
    m.kind = Mask::Kind::kNone;
    m.n_queries = 1;
    m.n_keys = stored_rows() + 1;
    return m;
  }
  return KVCache::make_mask(n_queries, window);
}

CacheStats StreamingCache::stats() const {
  CacheStats st =
      eviction_stats(method(), batch_, heads_, head_dim_, stored_rows(), offset_, false);
  st.bytes_resident =
      (rows_ ? rows_->resident_bytes() : 0) + (retired_ ? retired_->resident_bytes() : 0);
  st.figures.push_back({"sink_rows", static_cast<double>(n_sink_rows_)});
  st.figures.push_back({"recent_rows", static_cast<double>(n_recent_)});
  return st;
}

// ---- state ------------------------------------------------------------------------------------

void StreamingCache::save(std::ostream& out) const {
  StateWriter w;
  w.i64(n_sink_);
  w.i64(window_);
  kv::RowStateHead{has_data_, dtype_, batch_, heads_, head_dim_, offset_}.write(w);
  w.i64(n_sink_rows_);
  w.i64(n_recent_);
  // Sinks, then the recent run, each as a [B, H, n, D] tensor, keys then values.
  for (bool values : {false, true}) {
    if (rows_) {
      w.tensor(rows_->download(values, 0, n_sink_rows_).view());
      w.tensor(rows_->download(values, head_, n_recent_).view());
    } else {
      TensorView none;  // [B, H, 0, D] of the storage dtype
      none.dtype = dtype_;
      none.shape = {batch_, heads_, 0, head_dim_};
      w.tensor(none);
      w.tensor(none);
    }
  }
  w.write(out, method());
}

void StreamingCache::load(std::istream& in) {
  StateReader r(in, method());  // checksum and method verified before any field is read
  const int64_t n_sink = r.i64();
  const int64_t window = r.i64();
  // "[streaming] state was saved with streaming_window=6 but this cache has 5; ..."
  check_saved_setting("streaming", "streaming_n_sink", std::to_string(n_sink),
                      std::to_string(n_sink_));
  check_saved_setting("streaming", "streaming_window", std::to_string(window),
                      std::to_string(window_));
  const kv::RowStateHead head = kv::RowStateHead::read(r, "streaming");
  const bool has_data = head.has_data;
  const DType dtype = head.dtype;
  const int64_t batch = head.batch, heads = head.heads, head_dim = head.head_dim;
  const int64_t offset = head.offset;
  const int64_t n_sink_rows =
      r.i64_in("n_sink_rows", std::min(n_sink_, offset), std::min(n_sink_, offset));
  const int64_t n_recent = r.i64_in("n_recent", 0, std::min(window_, offset - n_sink_rows));
  // After every step the run is either everything after the sinks or exactly the window.
  VQ_CHECK(n_recent == offset - n_sink_rows || n_recent == window_,
           "[load_state] streaming: expected " + std::to_string(offset - n_sink_rows) + " or " +
               std::to_string(window_) + " recent rows but got " + std::to_string(n_recent));
  Tensor parts[4];
  for (Tensor& p : parts) p = r.tensor();
  r.expect_end();
  for (int i = 0; i < 4; ++i) {
    const std::array<int64_t, 4> want{batch, heads, i % 2 == 0 ? n_sink_rows : n_recent, head_dim};
    VQ_CHECK(parts[i].dtype() == dtype && parts[i].shape() == want,
             "[load_state] streaming: expected rows " + std::string(dtype_name(dtype)) + " " +
                 shape_str(want) + " but got " + std::string(dtype_name(parts[i].dtype())) + " " +
                 shape_str(parts[i].shape()));
  }

  // Build the new state aside, then swap it in (nothing above touched *this).
  CacheConfig cfg;
  cfg.method = method();
  cfg.streaming_n_sink = n_sink_;
  cfg.streaming_window = window_;
  StreamingCache fresh(cfg, *backend_);
  fresh.has_data_ = has_data;
  fresh.dtype_ = dtype;
  fresh.batch_ = batch;
  fresh.heads_ = heads;
  fresh.head_dim_ = head_dim;
  fresh.offset_ = offset;
  fresh.n_sink_rows_ = n_sink_rows;
  fresh.n_recent_ = n_recent;
  fresh.head_ = n_sink_rows;
  // Room for the rows held (the buffer grows from there like a live one's).
  fresh.capacity_ = has_data ? round_up(std::max<int64_t>(n_sink_rows + n_recent, 1), kRowStep) : 0;
  if (has_data) {
    fresh.rows_ = backend_->make({dtype, batch, heads, head_dim}, fresh.capacity_, false);
    fresh.rows_->upload(parts[0].view(), parts[2].view(), 0, n_sink_rows, nullptr);
    fresh.rows_->upload(parts[1].view(), parts[3].view(), n_sink_rows, n_recent, nullptr);
  }
  retired_.reset();
  has_data_ = fresh.has_data_;
  dtype_ = fresh.dtype_;
  batch_ = fresh.batch_;
  heads_ = fresh.heads_;
  head_dim_ = fresh.head_dim_;
  offset_ = fresh.offset_;
  n_sink_rows_ = fresh.n_sink_rows_;
  n_recent_ = fresh.n_recent_;
  head_ = fresh.head_;
  capacity_ = fresh.capacity_;
  rows_ = std::move(fresh.rows_);
}

}  // namespace vq
