// SnapKV cache: deferred eviction over stored ++ new rows (see veloxquant/snapkv_cache.h).
//
// Layout: k_, v_ are [B, H, capacity_, D] raw fp16/bf16 bits; per (b, h) rows [0, n_sel_) carry
// explicit positions sel_pos_ [B, H, n_sel_], rows [n_sel_, n_sel_ + n_tail_) the implicit run
// offset_ - n_tail_ .. offset_ - 1. An evicting call (S > 1 with fewer kept rows than the frame)
// scores each (b, h) in parallel (OpenMP) on an fp32 copy of its frame, gathers the kept rows into
// fresh buffers and retires the old ones until the next mutating call.
// Byte figures follow the seed: 2 bytes per element whatever the storage dtype.
#include "veloxquant/snapkv_cache.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <istream>
#include <new>
#include <ostream>
#include <string>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "veloxquant/binary_io.h"
#include "veloxquant/error.h"

namespace vq {
namespace {

constexpr int64_t kRowStep = 64;               // capacity granularity in rows
constexpr size_t kHugePage = size_t{2} << 20;  // transparent huge page size on x86-64 Linux

std::string shape_str(const TensorView& t) {
  return "[" + std::to_string(t.shape[0]) + ", " + std::to_string(t.shape[1]) + ", " +
         std::to_string(t.shape[2]) + ", " + std::to_string(t.shape[3]) + "]";
}

void check_params(const CacheConfig& cfg) {
  auto fail = [](const std::string& field, int64_t v, const std::string& allowed) {
    throw Error("[snapkv] " + field + ": expected " + allowed + " but got " + std::to_string(v));
  };
  if (cfg.snap_budget < 1) fail("snap_budget", cfg.snap_budget, ">= 1");
  if (cfg.snap_obs_window < 1) fail("snap_obs_window", cfg.snap_obs_window, ">= 1");
  if (cfg.snap_n_sink < 0) fail("snap_n_sink", cfg.snap_n_sink, ">= 0");
  if (cfg.snap_pool_kernel < 1 || cfg.snap_pool_kernel % 2 == 0)
    fail("snap_pool_kernel", cfg.snap_pool_kernel, "an odd number >= 1");
}

}  // namespace

std::unique_ptr<KVCache> make_snapkv_cache(const CacheConfig& cfg) {
  validate(cfg);  // every field, with the config's messages
  return std::make_unique<SnapKVCache>(cfg);
}

SnapKVCache::SnapKVCache(const CacheConfig& cfg)
    : cfg_(cfg), params_(SnapSelectParams::from_config(cfg)) {
  check_params(cfg);
}

SnapKVCache::RowBuffer::RowBuffer(size_t n_elements) {
  const size_t bytes = n_elements * sizeof(uint16_t);
  if (bytes == 0) return;
  const size_t align = bytes >= kHugePage ? kHugePage : 64;
  const size_t rounded = (bytes + align - 1) / align * align;  // aligned_alloc needs a multiple
  void* p = std::aligned_alloc(align, rounded);
  if (!p) throw std::bad_alloc();
#ifdef __linux__
  // Advice only: without transparent huge pages the buffer simply uses 4 KiB pages.
  if (align == kHugePage) (void)madvise(p, rounded, MADV_HUGEPAGE);
#endif
  p_.reset(static_cast<uint16_t*>(p));
  bytes_ = rounded;
}

void SnapKVCache::RowBuffer::Free::operator()(uint16_t* p) const {
  std::free(p);
}

// ---- input ------------------------------------------------------------------------------------

void SnapKVCache::check_input(const TensorView& keys, const TensorView& values,
                              const UpdateOptions& opts) const {
  VQ_CHECK(keys.data != nullptr || keys.numel() == 0,
           "[snapkv] expected keys data but got nullptr");
  VQ_CHECK(values.data != nullptr || values.numel() == 0,
           "[snapkv] expected values data but got nullptr");
  for (const TensorView* t : {&keys, &values})
    VQ_CHECK(static_cast<uint8_t>(t->dtype) <= static_cast<uint8_t>(DType::kBF16),
             "[snapkv] expected float32/float16/bfloat16 blocks but got dtype code " +
                 std::to_string(static_cast<int>(t->dtype)));
  VQ_CHECK(keys.shape == values.shape, "[snapkv] expected values of the keys' shape " +
                                           shape_str(keys) + " but got " + shape_str(values));
  VQ_CHECK(keys.shape[0] >= 1 && keys.shape[1] >= 1 && keys.shape[2] >= 0 && keys.shape[3] >= 1,
           "[snapkv] expected keys [B>=1, H>=1, S>=0, D>=1] but got " + shape_str(keys));
  if (has_data_) {
    VQ_CHECK(keys.shape[0] == batch_ && keys.shape[1] == heads_ && keys.shape[3] == head_dim_,
             "[snapkv] expected keys [" + std::to_string(batch_) + ", " + std::to_string(heads_) +
                 ", S, " + std::to_string(head_dim_) + "] (fixed by the first call) but got " +
                 shape_str(keys));
  }
  const int64_t max_pos = static_cast<int64_t>(INT32_MAX);
  VQ_CHECK(offset_ + keys.shape[2] <= max_pos,
           "[snapkv] expected positions to fit int32 but offset " + std::to_string(offset_) +
               " + S " + std::to_string(keys.shape[2]) + " does not");
  if (cfg_.snap_scoring == SnapScoring::kQuery && opts.queries != nullptr) {
    const TensorView& q = *opts.queries;
    VQ_CHECK(q.data != nullptr || q.numel() == 0, "[snapkv] expected queries data but got nullptr");
    VQ_CHECK(
        q.shape[0] == keys.shape[0] && q.shape[2] == keys.shape[2] && q.shape[3] == keys.shape[3],
        "[snapkv] expected queries [" + std::to_string(keys.shape[0]) + ", H_q, " +
            std::to_string(keys.shape[2]) + ", " + std::to_string(keys.shape[3]) + "] but got " +
            shape_str(q));
    VQ_CHECK(q.shape[1] >= keys.shape[1] && q.shape[1] % keys.shape[1] == 0,
             "[snapkv] expected query heads H_q a multiple of the KV heads " +
                 std::to_string(keys.shape[1]) + " but got " + std::to_string(q.shape[1]));
  }
}

void SnapKVCache::reserve_rows(int64_t rows) {
  if (rows <= capacity_) return;
  // Geometric growth (x1.5, at least one step) keeps a decode append amortised O(1).
  const int64_t new_cap = round_up(std::max({rows, capacity_ + capacity_ / 2, kRowStep}), kRowStep);
  const int64_t bh = batch_ * heads_;
  const int64_t d = head_dim_;
  const int64_t n_rows = n_sel_ + n_tail_;
  RowBuffer nk(static_cast<size_t>(bh * new_cap * d));
  RowBuffer nv(static_cast<size_t>(bh * new_cap * d));
  for (int64_t i = 0; i < bh && n_rows > 0; ++i) {
    std::memcpy(nk.data() + i * new_cap * d, k_.data() + i * capacity_ * d,
                static_cast<size_t>(n_rows * d) * 2);
    std::memcpy(nv.data() + i * new_cap * d, v_.data() + i * capacity_ * d,
                static_cast<size_t>(n_rows * d) * 2);
  }
  k_.swap(nk);
  v_.swap(nv);
  capacity_ = new_cap;
}

// ---- update -----------------------------------------------------------------------------------

CacheView SnapKVCache::update_and_fetch(const TensorView& keys, const TensorView& values,
                                        const UpdateOptions& opts) {
  check_input(keys, values, opts);  // nothing changes before this passes

  // The previous view is invalid from here on: release what only it used.
  retired_k_.reset();
  retired_v_.reset();
  std::vector<int32_t>().swap(retired_pos_);

  const bool at_prompt_end = cfg_.snap_evict_at == SnapEvictAt::kPromptEnd;
  if (at_prompt_end && pending_ && keys.shape[2] == 1) end_prompt();  // the prompt is over

  if (!has_data_) {
    batch_ = keys.shape[0];
    heads_ = keys.shape[1];
    head_dim_ = keys.shape[3];
    dtype_ = snap_storage_dtype(cfg_.snap_dtype, keys.dtype, values.dtype);
    has_data_ = true;
  }

  const int64_t s = keys.shape[2];
  const int64_t n_old = n_sel_ + n_tail_;
  reserve_rows(n_old + s);
  const int64_t d = head_dim_;
  for (int64_t b = 0; b < batch_; ++b)
    for (int64_t h = 0; h < heads_; ++h) {
      const int64_t base = ((b * heads_ + h) * capacity_ + n_old) * d;
      for (int64_t i = 0; i < s; ++i) {
        convert_view_row(keys, b, h, i, k_.data() + base + i * d, dtype_);
        convert_view_row(values, b, h, i, v_.data() + base + i * d, dtype_);
      }
    }
  n_tail_ += s;
  offset_ += s;

  CacheView view = make_view();
  if (s > 1) {
    const bool use_queries = cfg_.snap_scoring == SnapScoring::kQuery && opts.queries != nullptr;
    if (at_prompt_end) {
      pending_ = true;
      win_.keep(use_queries ? opts.queries : nullptr, params_.obs_window);
    } else {
      evict_after_step(s, use_queries ? opts.queries : nullptr);
    }
  }
  return view;
}

void SnapKVCache::end_prompt() {
  if (!pending_) return;
  TensorView q;
  // The window rows are the prompt's last win_.rows positions: offset_ has not moved since.
  evict_after_step(win_.rows, win_.view(batch_, head_dim_, &q));
  pending_ = false;
  win_.clear();
  // No view references the old rows any more (end_prompt invalidates the last view).
  retired_k_.reset();
  retired_v_.reset();
  std::vector<int32_t>().swap(retired_pos_);
}

CacheView SnapKVCache::make_view() const {
  CacheView view;
  view.batch = batch_;
  view.n_kv_heads = heads_;
  view.head_dim = head_dim_;
  auto rows_view = [&](const RowBuffer& buf, int64_t row0, int64_t n) {
    TensorView t;
    t.data = const_cast<uint16_t*>(buf.data()) + row0 * head_dim_;
    t.dtype = dtype_;
    t.shape = {batch_, heads_, n, head_dim_};
    t.stride = {heads_ * capacity_ * head_dim_, capacity_ * head_dim_, head_dim_, 1};
    return t;
  };
  if (n_sel_ > 0) {
    ViewSegment seg;
    seg.n_rows = n_sel_;
    seg.positions = sel_pos_.data();
    seg.keys = rows_view(k_, 0, n_sel_);
    seg.values = rows_view(v_, 0, n_sel_);
    view.segments.push_back(seg);
  }
  if (n_tail_ > 0) {
    ViewSegment seg;
    seg.n_rows = n_tail_;
    seg.first_pos = offset_ - n_tail_;
    seg.keys = rows_view(k_, n_sel_, n_tail_);
    seg.values = rows_view(v_, n_sel_, n_tail_);
    view.segments.push_back(seg);
  }
  return view;
}

void SnapKVCache::evict_after_step(int64_t n_new, const TensorView* queries) {
  const int64_t n = n_sel_ + n_tail_;  // the frame: stored ++ new
  const int64_t count = snap_keep_count(n, params_);
  if (count >= n) return;  // nothing to evict: every row stays where it is

  const int64_t bh_total = batch_ * heads_;
  const int64_t d = head_dim_;
  const int64_t new_cap = round_up(count, kRowStep);
  RowBuffer nk(static_cast<size_t>(bh_total * new_cap * d));
  RowBuffer nv(static_cast<size_t>(bh_total * new_cap * d));
  std::vector<int32_t> npos(static_cast<size_t>(bh_total * count));

  // Query window: the last w_q of this call's queries, positions offset_ - w_q .. offset_ - 1.
  const int64_t n_rep = queries ? queries->shape[1] / heads_ : 0;
  const int64_t w_q = queries ? std::min(std::clamp<int64_t>(params_.obs_window, 1, n), n_new) : 0;

  std::exception_ptr failure;
#pragma omp parallel
  {
    SnapScratch scratch;
    std::vector<float> frame;
    std::vector<int32_t> pos(static_cast<size_t>(n));
    std::vector<float> qwin;
    std::vector<int32_t> qpos(static_cast<size_t>(w_q));
    std::vector<int64_t> idx(static_cast<size_t>(count));
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < bh_total; ++bh) {
      try {
        const int64_t b = bh / heads_;
        const int64_t h = bh % heads_;
        const uint16_t* krows = k_.data() + bh * capacity_ * d;
        const uint16_t* vrows = v_.data() + bh * capacity_ * d;
        for (int64_t j = 0; j < n_sel_; ++j) pos[j] = sel_pos_[bh * n_sel_ + j];
        for (int64_t j = 0; j < n_tail_; ++j)
          pos[n_sel_ + j] = static_cast<int32_t>(offset_ - n_tail_ + j);
        const bool scored = count > std::min(std::max<int64_t>(params_.n_sink, 0), count);
        if (scored) {  // the fp32 frame is only read when scores matter
          frame.resize(static_cast<size_t>(n * d));
          to_f32(krows, dtype_, frame.data(), static_cast<size_t>(n * d));
        }
        SnapQueryWindow qw;
        if (queries && scored) {
          qwin.resize(static_cast<size_t>(n_rep * w_q * d));
          for (int64_t r = 0; r < n_rep; ++r)
            for (int64_t i = 0; i < w_q; ++i)
              convert_view_row(*queries, b, h * n_rep + r, n_new - w_q + i,
                               qwin.data() + (r * w_q + i) * d, DType::kF32);
          for (int64_t i = 0; i < w_q; ++i) qpos[i] = static_cast<int32_t>(offset_ - w_q + i);
          qw.data = qwin.data();
          qw.n_rep = n_rep;
          qw.w = w_q;
          qw.positions = qpos.data();
        }
        const int64_t got =
            snap_select_head(scored ? frame.data() : nullptr, queries ? pos.data() : nullptr, n, d,
                             queries && scored ? &qw : nullptr, params_, idx.data(), scratch);
        VQ_CHECK(got == count, "[snapkv] internal: head selected " + std::to_string(got) +
                                   " rows, expected " + std::to_string(count));
        uint16_t* dk = nk.data() + bh * new_cap * d;
        uint16_t* dv = nv.data() + bh * new_cap * d;
        for (int64_t i = 0; i < count; ++i) {
          const int64_t j = idx[i];
          std::memcpy(dk + i * d, krows + j * d, static_cast<size_t>(d) * 2);
          std::memcpy(dv + i * d, vrows + j * d, static_cast<size_t>(d) * 2);
          npos[bh * count + i] = pos[j];
        }
      } catch (...) {
#pragma omp critical(vq_snapkv_failure)
        if (!failure) failure = std::current_exception();
      }
    }
  }
  if (failure) std::rethrow_exception(failure);

  // The returned view still points at the old buffers: retire them instead of freeing.
  retired_k_.swap(k_);
  retired_v_.swap(v_);
  retired_pos_.swap(sel_pos_);
  k_.swap(nk);
  v_.swap(nv);
  sel_pos_.swap(npos);
  capacity_ = new_cap;
  n_sel_ = count;
  n_tail_ = 0;
}

// ---- queries ----------------------------------------------------------------------------------

std::vector<int32_t> SnapKVCache::stored_positions(int64_t b, int64_t h) const {
  VQ_CHECK(b >= 0 && b < batch_ && h >= 0 && h < heads_,
           "[snapkv] expected (b, h) within [" + std::to_string(batch_) + ", " +
               std::to_string(heads_) + ") but got (" + std::to_string(b) + ", " +
               std::to_string(h) + ")");
  std::vector<int32_t> out(static_cast<size_t>(n_sel_ + n_tail_));
  const int64_t bh = b * heads_ + h;
  for (int64_t j = 0; j < n_sel_; ++j) out[j] = sel_pos_[bh * n_sel_ + j];
  for (int64_t j = 0; j < n_tail_; ++j)
    out[n_sel_ + j] = static_cast<int32_t>(offset_ - n_tail_ + j);
  return out;
}

Mask SnapKVCache::make_mask(int64_t n_queries, int64_t window) const {
  if (pending_ && n_queries == 1)
    VQ_CHECK(window == 0,
             "[snapkv] make_mask: expected end_prompt() before a windowed single-query mask "
             "while a prompt-end eviction is pending (its positions are not chosen yet)");
  if (n_queries == 1 && window == 0) {
    Mask m;  // a single query at offset() sees every stored row and itself
    m.kind = Mask::Kind::kNone;
    m.n_queries = 1;
    m.n_keys = (pending_ ? snap_keep_count(stored_rows(), params_) : stored_rows()) + 1;
    return m;
  }
  return KVCache::make_mask(n_queries, window);
}

CacheStats SnapKVCache::stats() const {
  CacheStats st = eviction_stats(method(), batch_, heads_, head_dim_, stored_rows(), offset_, true);
  st.bytes_resident =
      static_cast<int64_t>(k_.bytes() + v_.bytes() + retired_k_.bytes() + retired_v_.bytes() +
                           (sel_pos_.capacity() + retired_pos_.capacity()) * sizeof(int32_t));
  return st;
}

// ---- state ------------------------------------------------------------------------------------

void write_snapkv_settings(StateWriter& w, const CacheConfig& c) {
  w.i64(c.snap_budget);
  w.i64(c.snap_obs_window);
  w.i64(c.snap_n_sink);
  w.u8(static_cast<uint8_t>(c.snap_dtype));
  w.u8(static_cast<uint8_t>(c.snap_scoring));
  w.i64(c.snap_pool_kernel);
  w.u8(static_cast<uint8_t>(c.snap_pool));
  w.boolean(c.snap_keep_window);
  w.u8(static_cast<uint8_t>(c.snap_evict_at));
}

namespace {

void expect_setting(const char* field, int64_t mine, int64_t file) {
  VQ_CHECK(mine == file, std::string("[load_state] snapkv: expected ") + field + " " +
                             std::to_string(mine) + " (this cache's config) but the file has " +
                             std::to_string(file));
}

void read_settings(StateReader& r, const CacheConfig& c) {
  expect_setting("snap_budget", c.snap_budget, r.i64());
  expect_setting("snap_obs_window", c.snap_obs_window, r.i64());
  expect_setting("snap_n_sink", c.snap_n_sink, r.i64());
  expect_setting("snap_dtype", static_cast<int64_t>(c.snap_dtype), r.u8());
  expect_setting("snap_scoring", static_cast<int64_t>(c.snap_scoring), r.u8());
  expect_setting("snap_pool_kernel", c.snap_pool_kernel, r.i64());
  expect_setting("snap_pool", static_cast<int64_t>(c.snap_pool), r.u8());
  expect_setting("snap_keep_window", c.snap_keep_window ? 1 : 0, r.boolean() ? 1 : 0);
  expect_setting("snap_evict_at", static_cast<int64_t>(c.snap_evict_at), r.u8());
}

}  // namespace

void SnapKVCache::save(std::ostream& out) const {
  StateWriter w;
  write_snapkv_settings(w, cfg_);
  w.boolean(has_data_);
  w.u8(static_cast<uint8_t>(dtype_));
  w.i64(batch_);
  w.i64(heads_);
  w.i64(head_dim_);
  w.i64(offset_);
  w.i64(n_sel_);
  w.i64(n_tail_);
  w.vec_i32(sel_pos_);
  const int64_t n = n_sel_ + n_tail_;
  TensorView kv;
  kv.dtype = dtype_;
  kv.shape = {batch_, heads_, n, head_dim_};
  kv.stride = {heads_ * capacity_ * head_dim_, capacity_ * head_dim_, head_dim_, 1};
  kv.data = const_cast<uint16_t*>(k_.data());
  w.tensor(kv);
  kv.data = const_cast<uint16_t*>(v_.data());
  w.tensor(kv);
  w.boolean(pending_);
  w.i64(win_.hq);
  w.i64(win_.rows);
  w.vec_f32(win_.q);
  w.write(out, method());
}

void SnapKVCache::load(std::istream& in) {
  StateReader r(in, method());  // checksum and method verified before any field is read
  read_settings(r, cfg_);
  const bool has_data = r.boolean();
  const uint8_t dt = r.u8();
  VQ_CHECK(dt == static_cast<uint8_t>(DType::kF16) || dt == static_cast<uint8_t>(DType::kBF16),
           "[load_state] snapkv: expected storage dtype float16 or bfloat16 but got code " +
               std::to_string(dt));
  const DType dtype = static_cast<DType>(dt);
  constexpr int64_t kMaxDim = int64_t{1} << 24;
  const int64_t lo = has_data ? 1 : 0;
  const int64_t batch = r.i64_in("batch", lo, has_data ? kMaxDim : 0);
  const int64_t heads = r.i64_in("heads", lo, has_data ? kMaxDim : 0);
  const int64_t head_dim = r.i64_in("head_dim", lo, has_data ? kMaxDim : 0);
  const int64_t offset = r.i64_in("offset", 0, INT32_MAX);
  const int64_t n_sel = r.i64_in("n_sel", 0, offset);
  const int64_t n_tail = r.i64_in("n_tail", 0, offset - n_sel);
  std::vector<int32_t> sel_pos = r.vec_i32();
  // batch * heads <= 2^48, but times n_sel (< 2^31) it may overflow: compare by division. With
  // n_sel == 0 the per-head loop below is skipped (2^48 empty iterations hung the fuzzer).
  const int64_t n_bh = batch * heads;
  VQ_CHECK(n_sel == 0 ? sel_pos.empty()
                      : static_cast<int64_t>(sel_pos.size()) % n_sel == 0 &&
                            static_cast<int64_t>(sel_pos.size()) / n_sel == n_bh,
           "[load_state] snapkv: expected " + std::to_string(batch) + " x " +
               std::to_string(heads) + " x " + std::to_string(n_sel) + " positions but got " +
               std::to_string(sel_pos.size()));
  // Explicit positions: ascending per head, and before the implicit tail.
  for (int64_t bh = 0; bh < n_bh && n_sel > 0; ++bh)
    for (int64_t j = 0; j < n_sel; ++j) {
      const int32_t p = sel_pos[bh * n_sel + j];
      const int32_t prev = j ? sel_pos[bh * n_sel + j - 1] : -1;
      VQ_CHECK(p > prev && p < offset - n_tail,
               "[load_state] snapkv: expected ascending positions in [0, " +
                   std::to_string(offset - n_tail) + ") but got " + std::to_string(p) + " after " +
                   std::to_string(prev));
    }
  const int64_t n = n_sel + n_tail;
  Tensor keys = r.tensor();
  Tensor values = r.tensor();
  const bool pending = r.boolean();
  const int64_t win_hq = r.i64_in("win_hq", 0, pending ? 256 * heads : 0);
  const int64_t win_rows = r.i64_in("win_rows", 0, std::min(cfg_.snap_obs_window, n_tail));
  std::vector<float> win_q = r.vec_f32();
  r.expect_end();
  VQ_CHECK(!pending || cfg_.snap_evict_at == SnapEvictAt::kPromptEnd,
           "[load_state] snapkv: expected no pending eviction (snap_evict_at = prefill_call) but "
           "the file has one");
  int64_t win_elems = 0;  // batch * win_hq * win_rows * head_dim, which may overflow int64
  const bool win_fits = !__builtin_mul_overflow(batch, win_hq, &win_elems) &&
                        !__builtin_mul_overflow(win_elems, win_rows, &win_elems) &&
                        !__builtin_mul_overflow(win_elems, head_dim, &win_elems);
  VQ_CHECK((win_hq == 0) == (win_rows == 0) && (win_hq == 0 || win_hq % heads == 0) && win_fits &&
               static_cast<int64_t>(win_q.size()) == win_elems,
           "[load_state] snapkv: expected a query window [" + std::to_string(batch) +
               ", H_q (a multiple of " + std::to_string(heads) + "), rows, " +
               std::to_string(head_dim) + "] but got H_q " + std::to_string(win_hq) + ", rows " +
               std::to_string(win_rows) + ", " + std::to_string(win_q.size()) + " values");
  const std::array<int64_t, 4> want{batch, heads, n, head_dim};
  for (const Tensor* t : {&keys, &values}) {
    VQ_CHECK(t->dtype() == dtype && t->shape() == want,
             "[load_state] snapkv: expected rows " + std::string(dtype_name(dtype)) + " [" +
                 std::to_string(batch) + ", " + std::to_string(heads) + ", " + std::to_string(n) +
                 ", " + std::to_string(head_dim) + "] but got " +
                 std::string(dtype_name(t->dtype())) + " " + shape_str(t->view()));
  }

  // Build the new state aside, then swap it in (nothing above touched *this).
  const int64_t cap = n > 0 ? round_up(n, kRowStep) : 0;
  RowBuffer nk(static_cast<size_t>(batch * heads * cap * head_dim));
  RowBuffer nv(static_cast<size_t>(batch * heads * cap * head_dim));
  const auto* sk = static_cast<const uint16_t*>(keys.data());
  const auto* sv = static_cast<const uint16_t*>(values.data());
  for (int64_t bh = 0; bh < batch * heads && n > 0; ++bh) {
    std::memcpy(nk.data() + bh * cap * head_dim, sk + bh * n * head_dim,
                static_cast<size_t>(n * head_dim) * 2);
    std::memcpy(nv.data() + bh * cap * head_dim, sv + bh * n * head_dim,
                static_cast<size_t>(n * head_dim) * 2);
  }
  has_data_ = has_data;
  dtype_ = dtype;
  batch_ = batch;
  heads_ = heads;
  head_dim_ = head_dim;
  offset_ = offset;
  n_sel_ = n_sel;
  n_tail_ = n_tail;
  capacity_ = cap;
  k_.swap(nk);
  v_.swap(nv);
  sel_pos_.swap(sel_pos);
  pending_ = pending;
  win_.hq = win_hq;
  win_.rows = win_rows;
  win_.q.swap(win_q);
  retired_k_.reset();
  retired_v_.reset();
  std::vector<int32_t>().swap(retired_pos_);
}

}  // namespace vq
