// SnapKV cache: deferred eviction over stored ++ new rows (see veloxquant/snapkv_cache.h), a
// policy over a row store (src/kv/row_store.h): the same code whatever device holds the rows.
//
// Layout: one store [B, H, capacity_, D] of fp16/bf16 rows with positions; per (b, h) rows
// [0, n_sel_) are the survivors of the last eviction, rows [n_sel_, n_sel_ + n_tail_) the run
// offset_ - n_tail_ .. offset_ - 1 (their positions are written too, so a selection reads every
// row's position from the store). An evicting call (S > 1 with fewer kept rows than the frame)
// asks the backend for the selection of every (b, h), gathers the kept rows into a fresh store and
// retires the old one until the next mutating call.
// Byte figures follow the seed: 2 bytes per element whatever the storage dtype.
#include "veloxquant/snapkv_cache.h"

#include <algorithm>
#include <array>
#include <climits>
#include <istream>
#include <ostream>
#include <string>

#include "kv/row_store.h"
#include "veloxquant/binary_io.h"
#include "veloxquant/error.h"

namespace vq {
namespace {

constexpr int64_t kRowStep = 64;  // capacity granularity in rows

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
  // Upper bounds as validate() (positions fit int32), so sums such as j + kernel / 2 cannot wrap.
  const std::string cap = "<= " + std::to_string(kMaxCacheRows);
  if (cfg.snap_budget > kMaxCacheRows) fail("snap_budget", cfg.snap_budget, cap);
  if (cfg.snap_obs_window > kMaxCacheRows) fail("snap_obs_window", cfg.snap_obs_window, cap);
  if (cfg.snap_n_sink > kMaxCacheRows) fail("snap_n_sink", cfg.snap_n_sink, cap);
  if (cfg.snap_pool_kernel > kMaxCacheRows) fail("snap_pool_kernel", cfg.snap_pool_kernel, cap);
  if (cfg.snap_decode_budget < 0 || cfg.snap_decode_budget > kMaxCacheRows)
    fail("snap_decode_budget", cfg.snap_decode_budget,
         "0 (off) .. " + std::to_string(kMaxCacheRows));
  if (cfg.snap_decode_every < 1 || cfg.snap_decode_every > kMaxCacheRows)
    fail("snap_decode_every", cfg.snap_decode_every, "1 .. " + std::to_string(kMaxCacheRows));
}

}  // namespace

std::unique_ptr<KVCache> make_snapkv_cache(const CacheConfig& cfg) {
  validate(cfg);  // every field, with the config's messages
  return std::make_unique<SnapKVCache>(cfg);
}

SnapKVCache::SnapKVCache(const CacheConfig& cfg) : SnapKVCache(cfg, kv::cpu_backend()) {}

SnapKVCache::SnapKVCache(const CacheConfig& cfg, const kv::RowBackend& backend)
    : backend_(&backend),
      cfg_(cfg),
      params_(SnapSelectParams::from_config(cfg)),
      dec_params_(params_) {
  check_params(cfg);
  dec_params_.budget = cfg.snap_decode_budget;
}

SnapKVCache::~SnapKVCache() = default;

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
  // Queries are read by query scoring and by decode-time eviction (single-token calls).
  const bool reads_queries = cfg_.snap_scoring == SnapScoring::kQuery ||
                             (cfg_.snap_decode_budget > 0 && keys.shape[2] == 1);
  if (reads_queries && opts.queries != nullptr) {
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
  // Geometric growth keeps a decode append amortised O(1). x1.25 (at least one step), as the full
  // cache grows: an eviction leaves capacity = the kept rows rounded up to kRowStep, so the first
  // decode append after it regrows, and x1.5 then held 1.5 x the kept rows (1.12x the full
  // cache's bytes at 75 % kept); x1.25 keeps the slack below a quarter of the rows plus a step.
  const int64_t new_cap = round_up(std::max({rows, capacity_ + capacity_ / 4, kRowStep}), kRowStep);
  auto grown = backend_->make({dtype_, batch_, heads_, head_dim_}, new_cap, true);
  if (rows_) grown->copy_rows(*rows_, n_sel_ + n_tail_);
  // No view refers to the old store any more (update_and_fetch invalidated the last one).
  rows_ = std::move(grown);
  capacity_ = new_cap;
}

// ---- update -----------------------------------------------------------------------------------

CacheView SnapKVCache::update_and_fetch(const TensorView& keys, const TensorView& values,
                                        const UpdateOptions& opts) {
  check_input(keys, values, opts);  // nothing changes before this passes

  // The previous view is invalid from here on: release what only it used.
  retired_.reset();

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
  if (s > 0) {
    rows_->write_block(keys, values, 0, s, n_old);
    rows_->fill_positions(n_old, s, offset_);
  }
  n_tail_ += s;
  offset_ += s;
  if (s > 0) ext_.clear();  // scores were for the rows before these

  CacheView view = stored_view();
  if (s == 1 && cfg_.snap_decode_budget > 0) after_decode_step(opts);
  if (s > 1) {
    dec_.reset();  // decode windows are runs of single-token calls
    const bool use_queries = cfg_.snap_scoring == SnapScoring::kQuery && opts.queries != nullptr;
    if (at_prompt_end) {
      pending_ = true;
      win_.reset();
      if (use_queries)
        win_ = backend_->keep_queries(*opts.queries, std::min(params_.obs_window, s));
    } else {
      evict_after_step(s, use_queries ? opts.queries : nullptr);
    }
  }
  return view;
}

void SnapKVCache::set_external_scores(const float* scores, int64_t batch, int64_t heads,
                                      int64_t rows) {
  VQ_CHECK(takes_external_scores(),
           "[snapkv] set_external_scores: expected snap_scoring=external but this cache has " +
               cache_enum_name("snap_scoring", static_cast<int64_t>(cfg_.snap_scoring)));
  VQ_CHECK(pending_,
           "[snapkv] set_external_scores: expected a pending prompt (rows appended by "
           "a multi-token call, end_prompt not yet run) but there is none");
  const int64_t n = n_sel_ + n_tail_;
  VQ_CHECK(batch == batch_ && heads == heads_ && rows == n,
           "[snapkv] set_external_scores: expected scores [" + std::to_string(batch_) + ", " +
               std::to_string(heads_) + ", " + std::to_string(n) +
               "] (batch, KV heads, stored "
               "rows) but got [" +
               std::to_string(batch) + ", " + std::to_string(heads) + ", " + std::to_string(rows) +
               "]");
  VQ_CHECK(scores != nullptr || n == 0,
           "[snapkv] set_external_scores: expected scores but got nullptr");
  ext_.assign(scores, scores + batch * heads * n);
}

void SnapKVCache::evict_by_external_scores() {
  const int64_t n = n_sel_ + n_tail_;
  const int64_t count = snap_keep_count(n, params_);
  if (count >= n) return;  // nothing to evict
  const auto index = backend_->upload_index(
      count, snap_select_frames_from_scores(ext_.data(), batch_ * heads_, n, params_));
  const int64_t new_cap = round_up(count, kRowStep);
  auto kept = backend_->make({dtype_, batch_, heads_, head_dim_}, new_cap, true);
  kept->gather(*rows_, *index, 0);
  retired_ = std::move(rows_);
  rows_ = std::move(kept);
  capacity_ = new_cap;
  n_sel_ = count;
  n_tail_ = 0;
}

void SnapKVCache::end_prompt() {
  if (!pending_) return;
  if (takes_external_scores()) {
    const int64_t n = n_sel_ + n_tail_;
    VQ_CHECK(snap_keep_count(n, params_) >= n || !ext_.empty(),
             "[snapkv] end_prompt: expected external scores for the " + std::to_string(n) +
                 " stored rows (set_external_scores, snap_scoring=external) but got none; "
                 "nothing was changed");
    evict_by_external_scores();
    pending_ = false;
    ext_.clear();
    win_.reset();
    retired_.reset();
    return;
  }
  // The window rows are the prompt's last rows: offset_ has not moved since they were kept.
  if (win_) {
    const TensorView q = win_->view();
    evict_after_step(win_->rows, &q);
  } else {
    evict_after_step(std::min(params_.obs_window, n_tail_), nullptr);
  }
  pending_ = false;
  win_.reset();
  // No view references the old rows any more (end_prompt invalidates the last view).
  retired_.reset();
}

CacheView SnapKVCache::stored_view() const {
  CacheView view;
  view.batch = batch_;
  view.n_kv_heads = heads_;
  view.head_dim = head_dim_;
  if (n_sel_ > 0) {
    ViewSegment seg;
    seg.n_rows = n_sel_;
    seg.positions = rows_->positions();
    seg.pos_stride = capacity_;
    seg.keys = rows_->keys(0, n_sel_);
    seg.values = rows_->values(0, n_sel_);
    view.segments.push_back(seg);
  }
  if (n_tail_ > 0) {
    ViewSegment seg;
    seg.n_rows = n_tail_;
    seg.first_pos = offset_ - n_tail_;
    seg.keys = rows_->keys(n_sel_, n_tail_);
    seg.values = rows_->values(n_sel_, n_tail_);
    view.segments.push_back(seg);
  }
  return view;
}

void SnapKVCache::evict_after_step(int64_t n_new, const TensorView* queries) {
  const int64_t n = n_sel_ + n_tail_;            // the frame: stored ++ new
  if (snap_keep_count(n, params_) >= n) return;  // nothing to evict: every row stays where it is

  // Query window: the last w_q of this call's queries, positions offset_ - w_q .. offset_ - 1.
  TensorView qwin;
  if (queries) {
    const int64_t w_q = std::min(std::clamp<int64_t>(params_.obs_window, 1, n), n_new);
    qwin = queries->slice_tokens(queries->shape[2] - w_q, queries->shape[2]);
  }
  select_and_keep(params_, queries ? &qwin : nullptr, offset_ - (queries ? qwin.shape[2] : 0));
}

void SnapKVCache::after_decode_step(const UpdateOptions& opts) {
  // Keep this call's queries (the last obs_window calls' form the window), on the backend's
  // device.
  const TensorView* q = opts.queries;
  if (q == nullptr || (dec_ && q->shape[1] != dec_->hq)) dec_.reset();
  if (q != nullptr) {
    if (!dec_)
      dec_ = backend_->make_query_window(batch_, q->shape[1], head_dim_,
                                         std::clamp<int64_t>(params_.obs_window, 1, kMaxCacheRows),
                                         {});
    dec_->push(*q);
  }
  const int64_t n = n_sel_ + n_tail_;
  if (n <= cfg_.snap_decode_budget + cfg_.snap_decode_every - 1) return;
  if (dec_) {
    const TensorView w = dec_->view();
    select_and_keep(dec_params_, &w, offset_ - dec_->rows);
  } else {
    select_and_keep(dec_params_, nullptr, offset_);
  }
}

void SnapKVCache::select_and_keep(const SnapSelectParams& p, const TensorView* qwin,
                                  int64_t q_first) {
  const int64_t n = n_sel_ + n_tail_;
  const int64_t count = snap_keep_count(n, p);
  const auto idx = backend_->snap_select(*rows_, n, qwin, q_first, p);
  const int64_t new_cap = round_up(count, kRowStep);
  auto kept = backend_->make({dtype_, batch_, heads_, head_dim_}, new_cap, true);
  kept->gather(*rows_, *idx, 0);

  // The returned view still points at the old store: retire it instead of freeing.
  retired_ = std::move(rows_);
  rows_ = std::move(kept);
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
  const int64_t n = n_sel_ + n_tail_;
  std::vector<int32_t> out(static_cast<size_t>(n));
  if (n_sel_ > 0) {
    // The explicit positions of every frame live with the rows (on the backend's device).
    const std::vector<int32_t> all = rows_->download_positions(n_sel_);
    const int64_t bh = b * heads_ + h;
    for (int64_t j = 0; j < n_sel_; ++j) out[j] = all[bh * n_sel_ + j];
  }
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
  st.bytes_resident = (rows_ ? rows_->resident_bytes() : 0) +
                      (retired_ ? retired_->resident_bytes() : 0) +
                      (win_ ? win_->resident_bytes() : 0) + (dec_ ? dec_->resident_bytes() : 0) +
                      static_cast<int64_t>(ext_.size() * sizeof(float));
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
  // Decode-time eviction: a version-2 frame with its settings (older files stay readable).
  if (c.snap_decode_budget > 0) {
    w.set_version(std::max<uint32_t>(w.version(), 2));
    w.i64(c.snap_decode_budget);
    w.i64(c.snap_decode_every);
  }
}

namespace {

// "[snapkv] state was saved with snap_budget=64 but this cache has 65; nothing was changed"
void expect_number(const char* field, int64_t mine, int64_t file) {
  check_saved_setting("snapkv", field, std::to_string(file), std::to_string(mine));
}

void expect_named(const char* field, int64_t mine, int64_t file) {
  check_saved_setting("snapkv", field, cache_enum_name(field, file), cache_enum_name(field, mine));
}

// A saved query window: hq == 0 exactly when rows == 0, hq a multiple of the KV heads, and
// batch * hq * rows * head_dim values (a product that may overflow int64 in a corrupt file).
void check_query_window(const char* what, int64_t batch, int64_t heads, int64_t head_dim,
                        int64_t hq, int64_t rows, size_t got) {
  int64_t elems = 0;
  const bool fits = !__builtin_mul_overflow(batch, hq, &elems) &&
                    !__builtin_mul_overflow(elems, rows, &elems) &&
                    !__builtin_mul_overflow(elems, head_dim, &elems);
  VQ_CHECK((hq == 0) == (rows == 0) && (hq == 0 || hq % heads == 0) && fits &&
               static_cast<int64_t>(got) == elems,
           "[load_state] snapkv: expected a " + std::string(what) + " [" + std::to_string(batch) +
               ", H_q (a multiple of " + std::to_string(heads) + "), rows, " +
               std::to_string(head_dim) + "] but got H_q " + std::to_string(hq) + ", rows " +
               std::to_string(rows) + ", " + std::to_string(got) + " values");
}

void read_settings(StateReader& r, const CacheConfig& c) {
  expect_number("snap_budget", c.snap_budget, r.i64());
  expect_number("snap_obs_window", c.snap_obs_window, r.i64());
  expect_number("snap_n_sink", c.snap_n_sink, r.i64());
  expect_named("snap_dtype", static_cast<int64_t>(c.snap_dtype), r.u8());
  expect_named("snap_scoring", static_cast<int64_t>(c.snap_scoring), r.u8());
  expect_number("snap_pool_kernel", c.snap_pool_kernel, r.i64());
  expect_named("snap_pool", static_cast<int64_t>(c.snap_pool), r.u8());
  const bool keep_window = r.boolean();
  check_saved_setting("snapkv", "snap_keep_window", keep_window ? "true" : "false",
                      c.snap_keep_window ? "true" : "false");
  expect_named("snap_evict_at", static_cast<int64_t>(c.snap_evict_at), r.u8());
  // Version 1: no decode-time eviction; version 2 adds it; later versions are SKVQ's
  // (binary_io.h), never written for a SnapKV frame.
  VQ_CHECK(r.version() <= 2, "[snapkv] load: expected a state frame of version 1 or 2 but got " +
                                 std::to_string(r.version()));
  const int64_t dec_budget = r.version() >= 2 ? r.i64() : 0;
  expect_number("snap_decode_budget", c.snap_decode_budget, dec_budget);
  if (dec_budget > 0) expect_number("snap_decode_every", c.snap_decode_every, r.i64());
}

}  // namespace

void SnapKVCache::save(std::ostream& out) const {
  StateWriter w;
  write_snapkv_settings(w, cfg_);
  kv::RowStateHead{has_data_, dtype_, batch_, heads_, head_dim_, offset_}.write(w);
  w.i64(n_sel_);
  w.i64(n_tail_);
  w.vec_i32(n_sel_ > 0 ? rows_->download_positions(n_sel_) : std::vector<int32_t>{});
  const int64_t n = n_sel_ + n_tail_;
  if (n > 0) {
    w.tensor(rows_->download(false, n).view());
    w.tensor(rows_->download(true, n).view());
  } else {
    TensorView none;  // [B, H, 0, D] of the storage dtype
    none.dtype = dtype_;
    none.shape = {batch_, heads_, 0, head_dim_};
    w.tensor(none);
    w.tensor(none);
  }
  w.boolean(pending_);
  w.i64(win_ ? win_->hq : 0);
  w.i64(win_ ? win_->rows : 0);
  w.vec_f32(win_ ? win_->download() : std::vector<float>{});
  // External scores only in the states of snap_scoring = external (older files stay readable).
  if (takes_external_scores()) w.vec_f32(ext_);
  if (cfg_.snap_decode_budget > 0) {  // the decode query window, step-major
    w.i64(dec_ ? dec_->hq : 0);
    w.i64(dec_ ? dec_->rows : 0);
    w.vec_f32(dec_ ? dec_->download() : std::vector<float>{});
  }
  w.write(out, method());
}

void SnapKVCache::load(std::istream& in) {
  StateReader r(in, method());  // checksum and method verified before any field is read
  read_settings(r, cfg_);
  const kv::RowStateHead head = kv::RowStateHead::read(r, "snapkv");
  const bool has_data = head.has_data;
  const DType dtype = head.dtype;
  const int64_t batch = head.batch, heads = head.heads, head_dim = head.head_dim;
  const int64_t offset = head.offset;
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
  std::vector<float> ext;
  if (takes_external_scores()) ext = r.vec_f32();
  int64_t dec_hq = 0, dec_rows = 0;
  std::vector<float> dec_q;
  if (cfg_.snap_decode_budget > 0) {
    dec_hq = r.i64_in("dec_hq", 0, 256 * heads);
    // The window's calls are single-token calls since the last multi-token one: the tail.
    dec_rows = r.i64_in("dec_rows", 0, std::min(cfg_.snap_obs_window, offset));
    dec_q = r.vec_f32();
  }
  r.expect_end();
  check_query_window("decode query window", batch, heads, head_dim, dec_hq, dec_rows, dec_q.size());
  VQ_CHECK(ext.empty() ||
               (pending &&
                static_cast<int64_t>(ext.size()) / std::max<int64_t>(n_sel + n_tail, 1) ==
                    batch * heads &&
                static_cast<int64_t>(ext.size()) % std::max<int64_t>(n_sel + n_tail, 1) == 0 &&
                n_sel + n_tail > 0),
           "[load_state] snapkv: expected no external scores or [" + std::to_string(batch) + ", " +
               std::to_string(heads) + ", " + std::to_string(n_sel + n_tail) +
               "] with a pending prompt but got " + std::to_string(ext.size()) + " values");
  VQ_CHECK(!pending || cfg_.snap_evict_at == SnapEvictAt::kPromptEnd,
           "[load_state] snapkv: expected no pending eviction (snap_evict_at = prefill_call) but "
           "the file has one");
  check_query_window("query window", batch, heads, head_dim, win_hq, win_rows, win_q.size());
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
  std::unique_ptr<kv::RowStore> rows;
  if (has_data) {
    rows = backend_->make({dtype, batch, heads, head_dim}, cap, true);
    // Positions of every row: the explicit ones, then the tail's run.
    std::vector<int32_t> pos(static_cast<size_t>(batch * heads * n));
    for (int64_t bh = 0; bh < batch * heads && n > 0; ++bh) {
      for (int64_t j = 0; j < n_sel; ++j) pos[bh * n + j] = sel_pos[bh * n_sel + j];
      for (int64_t j = 0; j < n_tail; ++j)
        pos[bh * n + n_sel + j] = static_cast<int32_t>(offset - n_tail + j);
    }
    rows->upload(keys.view(), values.view(), 0, n, &pos);
  }
  std::unique_ptr<kv::QueryRows> win;
  if (win_rows > 0) win = backend_->upload_queries(batch, win_hq, win_rows, head_dim, win_q);
  std::unique_ptr<kv::QueryWindow> dec;
  if (dec_rows > 0)
    dec = backend_->make_query_window(
        batch, dec_hq, head_dim, std::clamp<int64_t>(params_.obs_window, 1, kMaxCacheRows), dec_q);
  has_data_ = has_data;
  dtype_ = dtype;
  batch_ = batch;
  heads_ = heads;
  head_dim_ = head_dim;
  offset_ = offset;
  n_sel_ = n_sel;
  n_tail_ = n_tail;
  capacity_ = cap;
  rows_ = std::move(rows);
  retired_.reset();
  pending_ = pending;
  win_ = std::move(win);
  ext_ = std::move(ext);
  dec_ = std::move(dec);
}

}  // namespace vq
