// snapkv+skvq (see veloxquant/snapkv_skvq_cache.h): SnapKV selection over rows that are either
// full precision or packed SKVQ records, a policy over a row backend (docs/design.md §3): the
// same code whatever device holds the rows.
//
// State (skvq::Store, src/kv/skvq_store.h, explicit positions): sinks [B, H, n_s, D] (positions
// 0..n_s-1), packed blocks, the full-precision tail. Per (b, h) the frame is sinks ++ packed rows
// ++ tail, ascending in position. An eviction asks the backend for the selection of every frame
// (scored on fp32 keys, packed ones dequantized), then gathers into fresh stores: packed records
// are copied byte for byte, full-precision rows are copied or (to equalise the packed count
// across heads) quantized. Stores the returned view still references are retired until the next
// mutating call.
#include "veloxquant/snapkv_skvq_cache.h"

#include <algorithm>
#include <climits>
#include <istream>
#include <ostream>

#include "kv/skvq_store.h"
#include "veloxquant/error.h"
#include "veloxquant/snapkv.h"

namespace vq {
namespace skvq {

struct SnapSkvqState {
  SnapSkvqState(const kv::RowBackend& be, const Settings& s) : rows(be, s, true, "snapkv+skvq") {}
  Store rows;
  int64_t offset = 0;
  // snap_evict_at = prompt_end: a selection (and the flush after it) is owed, scored with the
  // kept window queries.
  bool pending = false;
  std::unique_ptr<kv::QueryRows> win;
  // snap_scoring = external: the scores of the owed selection [B * H, rows] (host), or empty.
  std::vector<float> ext;
};

}  // namespace skvq

using skvq::Settings;
using skvq::SnapSkvqState;

namespace {

constexpr const char* kOp = "snapkv+skvq";

int64_t n_fp_sinks(const CacheConfig& c) {
  return std::min(c.skvq_n_sink, std::max<int64_t>(c.snap_n_sink, 0));
}

}  // namespace

std::unique_ptr<KVCache> make_snapkv_skvq_cache(const CacheConfig& cfg, int64_t layer_index) {
  return std::make_unique<SnapkvSkvqCache>(cfg, layer_index);
}

SnapkvSkvqCache::SnapkvSkvqCache(const CacheConfig& cfg, int64_t layer_index)
    : SnapkvSkvqCache(cfg, kv::cpu_backend(), layer_index) {}

SnapkvSkvqCache::SnapkvSkvqCache(const CacheConfig& cfg, const kv::RowBackend& backend,
                                 int64_t layer_index)
    : backend_(&backend),
      cfg_(std::make_unique<CacheConfig>(cfg)),
      set_(std::make_unique<Settings>(Settings::from_config(cfg, layer_index, kOp))),
      st_(std::make_unique<SnapSkvqState>(backend, *set_)) {
  // A channel-axis chunk's metadata is fitted to, and stored in, all of its rows, while SnapKV
  // keeps rows one by one: channel-axis keys are packed only after the selection, from the kept
  // rows in chunks of `window` (snap_evict_at = prompt_end selects before anything is packed).
  if (set_->key_axis == QuantAxis::kChannel) {
    VQ_CHECK(cfg.snap_evict_at == SnapEvictAt::kPromptEnd,
             "[snapkv+skvq] skvq_key_axis=channel: expected snap_evict_at=prompt_end (the kept "
             "rows are packed per channel after the one selection; prefill_call selects again "
             "over packed chunks, whose metadata needs all of their rows) but got prefill_call");
  }
}

SnapkvSkvqCache::~SnapkvSkvqCache() = default;

int64_t SnapkvSkvqCache::offset() const {
  return st_->offset;
}
int64_t SnapkvSkvqCache::stored_rows() const {
  return st_->rows.rows();
}
int64_t SnapkvSkvqCache::batch() const {
  return st_->rows.batch;
}
int64_t SnapkvSkvqCache::n_kv_heads() const {
  return st_->rows.heads;
}
int64_t SnapkvSkvqCache::head_dim() const {
  return set_->head_dim;
}
int64_t SnapkvSkvqCache::packed_rows() const {
  return st_->rows.packed();
}
int64_t SnapkvSkvqCache::fp_rows() const {
  return st_->rows.n_sink + st_->rows.n_tail;
}
const std::vector<int32_t>& SnapkvSkvqCache::key_perms() const {
  return st_->rows.tr.perm_k;
}
const std::vector<int32_t>& SnapkvSkvqCache::value_perms() const {
  return st_->rows.tr.perm_v;
}
DType SnapkvSkvqCache::storage_dtype() const {
  return st_->rows.dtype;
}

std::vector<int32_t> SnapkvSkvqCache::stored_positions(int64_t b, int64_t h) const {
  const skvq::Store& rows = st_->rows;
  VQ_CHECK(b >= 0 && b < rows.batch && h >= 0 && h < rows.heads,
           "[snapkv+skvq] expected (b, h) within [" + std::to_string(rows.batch) + ", " +
               std::to_string(rows.heads) + ") but got (" + std::to_string(b) + ", " +
               std::to_string(h) + ")");
  return rows.frame_positions(b * rows.heads + h);
}

CacheView SnapkvSkvqCache::stored_view() const {
  return st_->rows.view(1);
}

// SnapKV selection over the whole frame (sinks ++ packed ++ tail) of every (b, h), scored with the
// last min(obs_window, n_new) rows of queries (nullptr = key proxy), whose positions are the
// frame's last ones; the survivors replace the stores (what the last view reads is retired).
void SnapkvSkvqCache::evict(const TensorView* queries, int64_t n_new) {
  SnapSkvqState& st = *st_;
  const int64_t n = st.rows.rows();
  const SnapSelectParams sp = SnapSelectParams::from_config(*cfg_);
  const int64_t count = snap_keep_count(n, sp);
  if (count >= n) return;
  TensorView qwin;
  int64_t w_q = 0;
  if (queries) {
    w_q = std::min(std::clamp<int64_t>(cfg_->snap_obs_window, 1, n), n_new);
    qwin = queries->slice_tokens(queries->shape[2] - w_q, queries->shape[2]);
  }
  const std::vector<int32_t> idx =
      st.rows.select(count, queries ? &qwin : nullptr, st.offset - w_q, sp);
  st.rows.keep(idx, count);
}

// Packs the tail's oldest `window` rows (one block each, or their skvq_key_rows runs) while it
// holds >= window + recent: every chunk due in one pack_tail, so that a one-run backend grows its
// run once for all of them (an eviction's flush packs several), not once per chunk.
void SnapkvSkvqCache::flush() {
  skvq::Store& rows = st_->rows;
  if (rows.n_tail < set_->flush_span) return;
  const std::vector<int64_t> chunk = set_->chunk_blocks(set_->window);
  std::vector<int64_t> blocks;
  for (int64_t n = rows.n_tail; n >= set_->flush_span; n -= set_->window)
    blocks.insert(blocks.end(), chunk.begin(), chunk.end());
  rows.pack_tail(blocks);
}

bool SnapkvSkvqCache::eviction_pending() const {
  return st_->pending;
}

Mask SnapkvSkvqCache::make_mask(int64_t n_queries, int64_t window) const {
  if (!st_->pending || n_queries != 1) return KVCache::make_mask(n_queries, window);
  VQ_CHECK(window == 0,
           "[snapkv+skvq] make_mask: expected end_prompt() before a windowed single-query mask "
           "while a prompt-end eviction is pending (its positions are not chosen yet)");
  Mask m;  // a single query at offset() sees every row that will stay, and itself
  m.kind = Mask::Kind::kNone;
  m.n_queries = 1;
  m.n_keys = snap_keep_count(stored_rows(), SnapSelectParams::from_config(*cfg_)) + 1;
  return m;
}

bool SnapkvSkvqCache::takes_external_scores() const {
  return cfg_->snap_scoring == SnapScoring::kExternal;
}

void SnapkvSkvqCache::set_external_scores(const float* scores, int64_t batch, int64_t heads,
                                          int64_t rows) {
  const SnapSkvqState& st = *st_;
  VQ_CHECK(takes_external_scores(),
           "[snapkv+skvq] set_external_scores: expected snap_scoring=external but this cache has " +
               cache_enum_name("snap_scoring", static_cast<int64_t>(cfg_->snap_scoring)));
  VQ_CHECK(st.pending,
           "[snapkv+skvq] set_external_scores: expected a pending prompt (rows appended by a "
           "multi-token call, end_prompt not yet run) but there is none");
  const int64_t n = st.rows.rows();
  VQ_CHECK(batch == st.rows.batch && heads == st.rows.heads && rows == n,
           "[snapkv+skvq] set_external_scores: expected scores [" + std::to_string(st.rows.batch) +
               ", " + std::to_string(st.rows.heads) + ", " + std::to_string(n) +
               "] (batch, KV heads, stored rows) but got [" + std::to_string(batch) + ", " +
               std::to_string(heads) + ", " + std::to_string(rows) + "]");
  VQ_CHECK(scores != nullptr || n == 0,
           "[snapkv+skvq] set_external_scores: expected scores but got nullptr");
  st_->ext.assign(scores, scores + batch * heads * n);
}

// The owed selection by the handed-over scores: per frame SnapKV's rules on its row of scores.
void SnapkvSkvqCache::evict_by_external_scores() {
  SnapSkvqState& st = *st_;
  const int64_t n = st.rows.rows();
  const SnapSelectParams sp = SnapSelectParams::from_config(*cfg_);
  const int64_t count = snap_keep_count(n, sp);
  if (count >= n) return;
  st.rows.keep(snap_select_frames_from_scores(st.ext.data(), st.rows.batch * st.rows.heads, n, sp),
               count);
}

void SnapkvSkvqCache::end_prompt() {
  SnapSkvqState& st = *st_;
  if (!st.pending) return;
  if (takes_external_scores()) {
    const int64_t n = st.rows.rows();
    VQ_CHECK(snap_keep_count(n, SnapSelectParams::from_config(*cfg_)) >= n ||
                 static_cast<int64_t>(st.ext.size()) == st.rows.batch * st.rows.heads * n,
             "[snapkv+skvq] end_prompt: expected external scores for the " + std::to_string(n) +
                 " stored rows (set_external_scores, snap_scoring=external) but got none; "
                 "nothing was changed");
  }
  st.rows.release_retired();
  if (takes_external_scores()) {
    evict_by_external_scores();
    st.ext.clear();
  } else if (st.win) {
    const TensorView q = st.win->view();
    evict(&q, st.win->rows);
  } else {
    evict(nullptr, 0);
  }
  flush();
  st.rows.fit_kept();  // on a device, now rather than on the next (decode) call
  st.pending = false;
  st.win.reset();
  // No view references the old rows any more (end_prompt invalidates the last view).
  st.rows.release_retired();
}

CacheView SnapkvSkvqCache::update_and_fetch(const TensorView& keys, const TensorView& values,
                                            const UpdateOptions& opts) {
  const Settings& s = *set_;
  const CacheConfig& cfg = *cfg_;
  SnapSkvqState& st = *st_;
  skvq::Store& rows = st.rows;
  // ---- validation (nothing changes before it passes)
  skvq::check_blocks(keys, values, s.head_dim, rows.has_data, rows.batch, rows.heads, kOp);
  const int64_t n_new = keys.shape[2];
  if (s.max_ctx > 0 && st.offset + n_new > s.max_ctx)
    throw Error("[snapkv+skvq] skvq_max_ctx: expected at most " + std::to_string(s.max_ctx) +
                " tokens but this call would reach " + std::to_string(st.offset + n_new) +
                "; nothing was changed");
  VQ_CHECK(st.offset + n_new <= INT32_MAX,
           "[snapkv+skvq] expected positions to fit int32 but offset " + std::to_string(st.offset) +
               " + S " + std::to_string(n_new) + " does not");
  VQ_CHECK(s.key_axis == QuantAxis::kToken || n_new == 1 || rows.packed() == 0,
           "[snapkv+skvq] skvq_key_axis=channel: expected single-token calls once rows are packed "
           "(a new prompt's selection would keep single rows of packed chunks, whose per-channel "
           "metadata needs all of their rows) but got " +
               std::to_string(n_new) + " rows with " + std::to_string(rows.packed()) +
               " packed; nothing was changed");
  const TensorView* queries = cfg.snap_scoring == SnapScoring::kQuery ? opts.queries : nullptr;
  if (queries) {
    const TensorView& q = *queries;
    VQ_CHECK(q.shape[0] == keys.shape[0] && q.shape[2] == n_new && q.shape[3] == s.head_dim &&
                 q.shape[1] >= keys.shape[1] && q.shape[1] % keys.shape[1] == 0 &&
                 (q.data || q.numel() == 0),
             "[snapkv+skvq] expected queries [" + std::to_string(keys.shape[0]) +
                 ", H_q (a multiple of " + std::to_string(keys.shape[1]) + "), " +
                 std::to_string(n_new) + ", " + std::to_string(s.head_dim) + "] but got " +
                 skvq::shape_str(q));
  }
  if (!rows.has_data) {
    skvq::Transforms tr = skvq::initial_transforms(s, keys.shape[1], kOp);  // may throw
    rows.start(snap_storage_dtype(cfg.snap_dtype, keys.dtype, values.dtype), keys.shape[0],
               keys.shape[1], std::move(tr));
  }
  // A single-token call after a prompt whose eviction is still owed: the prompt is over.
  if (cfg.snap_evict_at == SnapEvictAt::kPromptEnd && st.pending && n_new == 1) end_prompt();
  // The previous view is over: free what only it used.
  rows.release_retired();

  // ---- 1. append (positions < n_s extend the sinks while they are contiguous)
  const int64_t n_s_max = n_fp_sinks(cfg);
  int64_t to_sinks = 0;
  if (rows.n_tail == 0 && rows.packed() == 0 && st.offset == rows.n_sink)
    to_sinks = std::clamp<int64_t>(n_s_max - st.offset, 0, n_new);
  rows.append(keys, values, 0, n_new, st.offset);
  if (to_sinks > 0) rows.promote_sinks(to_sinks);
  st.offset += n_new;

  // ---- 2. the view: stored ++ new, as they are now
  CacheView view = rows.view(0);

  // ---- 3. permutations from the frame's first `window` rows (all full precision here)
  if (s.reorder && !rows.tr.has_perms() && rows.rows() >= s.window) {
    VQ_CHECK(rows.packed() == 0, "[snapkv+skvq] internal: packed rows without permutations");
    rows.freeze_perms(s.window);
  }

  // ---- 4. eviction (S > 1), 5. flush; with snap_evict_at = prompt_end both wait for the end
  // of the prompt (the rows stay at full precision meanwhile, as one-shot prefill keeps them)
  if (cfg.snap_evict_at == SnapEvictAt::kPromptEnd) {
    if (n_new > 1) {
      st.pending = true;
      st.win.reset();
      if (queries) st.win = backend_->keep_queries(*queries, std::min(cfg.snap_obs_window, n_new));
    }
    if (st.pending) return view;
  } else if (n_new > 1) {
    evict(queries, n_new);
  }
  flush();
  // After an eviction, on a device: the kept tail's fit now rather than on the next (decode)
  // call (Store::fit_kept does nothing when no eviction made the store).
  rows.fit_kept();
  return view;
}

CacheStats SnapkvSkvqCache::stats() const {
  const Settings& s = *set_;
  const SnapSkvqState& st = *st_;
  const skvq::Store& sr = st.rows;
  const int64_t bh = sr.batch * sr.heads, d = s.head_dim;
  CacheStats cs;
  cs.method = method();
  cs.tokens_seen = st.offset;
  const int64_t rows = stored_rows(), n_p = sr.packed(), n_fp = fp_rows();
  cs.rows_stored = rows;
  int64_t comp_k = 0, comp_v = 0;
  for (const int64_t n : sr.blocks()) {
    comp_k += s.key_chunk_bytes(n) * bh;
    comp_v += s.value_chunk_bytes(n) * bh;
  }
  const int64_t residual = n_fp * d * 2 * 2 * bh;
  const int64_t perm_bytes = sr.tr.has_perms() ? 2 * sr.heads * d * 4 : 0;
  const int64_t fp16_k = bh * st.offset * d * 2;
  const double kept_k = static_cast<double>(bh * rows * d * 2);
  cs.bytes_accounted = comp_k + comp_v + residual + perm_bytes;
  cs.fp16_bytes = 2 * fp16_k;
  cs.bytes_resident = sr.resident_bytes() + (st.win ? st.win->resident_bytes() : 0);
  const double tokens_kept = static_cast<double>(bh * rows);
  const double tokens_total = static_cast<double>(bh * st.offset);
  cs.figures = {
      {"compressed_key_bytes", static_cast<double>(comp_k)},
      {"compressed_value_bytes", static_cast<double>(comp_v)},
      {"fp16_key_bytes", static_cast<double>(fp16_k)},
      {"fp16_value_bytes", static_cast<double>(fp16_k)},
      {"residual_fp16_bytes", static_cast<double>(residual)},
      {"perm_bytes", static_cast<double>(perm_bytes)},
      {"packed_rows", static_cast<double>(n_p)},
      {"fp_rows", static_cast<double>(n_fp)},
      {"tokens_seen", static_cast<double>(st.offset)},
      {"key_perms", sr.tr.has_perms() ? 1.0 : 0.0},
      {"value_perms", sr.tr.has_perms() ? 1.0 : 0.0},
      {"assigned_avg_bits",
       n_p > 0 ? 8.0 * static_cast<double>(comp_k) / static_cast<double>(n_p * d * bh) : 16.0},
      {"evicted_key_bytes", kept_k},
      {"evicted_value_bytes", kept_k},
      {"kept_key_bytes", kept_k},
      {"kept_value_bytes", kept_k},
      {"full_key_bytes", static_cast<double>(fp16_k)},
      {"full_value_bytes", static_cast<double>(fp16_k)},
      {"eviction_ratio",
       rows > 0 ? static_cast<double>(st.offset) / static_cast<double>(rows) : 1.0},
      {"tokens_kept", tokens_kept},
      {"tokens_total", tokens_total},
      {"keep_rate", tokens_total > 0 ? tokens_kept / tokens_total : 1.0},
  };
  return cs;
}

void write_snapkv_skvq_settings(StateWriter& w, const CacheConfig& c) {
  w.i64(c.snap_budget);
  w.i64(c.snap_obs_window);
  w.i64(c.snap_n_sink);
  w.i64(c.snap_pool_kernel);
  w.u8(static_cast<uint8_t>(c.snap_pool));
  w.boolean(c.snap_keep_window);
  w.u8(static_cast<uint8_t>(c.snap_scoring));
  w.u8(static_cast<uint8_t>(c.snap_dtype));
  w.u8(static_cast<uint8_t>(c.snap_evict_at));
}

void SnapkvSkvqCache::save(std::ostream& out) const {
  const SnapSkvqState& st = *st_;
  const skvq::Store& rows = st.rows;
  StateWriter w;
  set_->set_state_version(w);
  set_->save(w);
  write_snapkv_skvq_settings(w, *cfg_);
  w.boolean(rows.has_data);
  if (rows.has_data) {
    w.u8(static_cast<uint8_t>(rows.dtype));
    w.i64(rows.batch);
    w.i64(rows.heads);
    w.i64(st.offset);
    rows.tr.save(w);
    rows.write_rows(w, true);
    const std::vector<int64_t>& blocks = rows.blocks();
    w.u64(blocks.size());
    for (size_t i = 0; i < blocks.size(); ++i) {
      w.i64(blocks[i]);
      for (int kv = 0; kv < 2; ++kv) {
        const std::vector<uint8_t> rec = rows.block_records(i, kv == 1);
        w.blob(rec.data(), rec.size());
      }
      w.vec_i32(rows.block_positions(i));
    }
    rows.write_rows(w, false);
    w.boolean(st.pending);
    w.i64(st.win ? st.win->hq : 0);
    w.i64(st.win ? st.win->rows : 0);
    w.vec_f32(st.win ? st.win->download() : std::vector<float>{});
    // External scores only in the states of snap_scoring = external (other files unchanged).
    if (takes_external_scores()) w.vec_f32(st.ext);
  }
  w.write(out, method());
}

void SnapkvSkvqCache::load(std::istream& in) {
  const Settings& s = *set_;
  const CacheConfig& c = *cfg_;
  StateReader r(in, method());
  s.check_saved(r, kOp);
  const std::string pre = "[snapkv+skvq] load: ";
  // "[snapkv+skvq] state was saved with snap_budget=64 but this cache has 65; nothing was changed"
  auto num = [&](const char* field, int64_t saved, int64_t mine) {
    check_saved_setting(kOp, field, std::to_string(saved), std::to_string(mine));
  };
  auto named = [&](const char* field, int64_t saved, int64_t mine) {
    check_saved_setting(kOp, field, cache_enum_name(field, saved), cache_enum_name(field, mine));
  };
  num("snap_budget", r.i64(), c.snap_budget);
  num("snap_obs_window", r.i64(), c.snap_obs_window);
  num("snap_n_sink", r.i64(), c.snap_n_sink);
  num("snap_pool_kernel", r.i64(), c.snap_pool_kernel);
  named("snap_pool", r.u8(), static_cast<uint8_t>(c.snap_pool));
  const bool keep_window = r.boolean();
  check_saved_setting(kOp, "snap_keep_window", keep_window ? "true" : "false",
                      c.snap_keep_window ? "true" : "false");
  named("snap_scoring", r.u8(), static_cast<uint8_t>(c.snap_scoring));
  named("snap_dtype", r.u8(), static_cast<uint8_t>(c.snap_dtype));
  named("snap_evict_at", r.u8(), static_cast<uint8_t>(c.snap_evict_at));
  auto ns = std::make_unique<SnapSkvqState>(*backend_, s);
  skvq::Store& rows = ns->rows;
  if (!r.boolean()) {
    r.expect_end();
    st_.swap(ns);
    return;
  }
  const uint8_t dt = r.u8();
  VQ_CHECK(dt == static_cast<uint8_t>(DType::kF16) || dt == static_cast<uint8_t>(DType::kBF16),
           pre + "expected an fp16 or bf16 storage dtype but got code " + std::to_string(dt));
  const int64_t batch = r.i64_in("batch", 1, 1 << 20);
  const int64_t heads = r.i64_in("heads", 1, 1 << 20);
  ns->offset = r.i64_in("offset", 0, s.max_ctx > 0 ? s.max_ctx : INT32_MAX);
  const int64_t d = s.head_dim, bh = batch * heads;
  skvq::Transforms tr = skvq::Transforms::load(r, heads, d, kOp);
  VQ_CHECK(tr.signs.empty() == !s.rotate,
           pre + "expected rotation signs exactly when skvq_rotation is on");
  const bool has_perms = tr.has_perms();
  rows.start(static_cast<DType>(dt), batch, heads, std::move(tr));
  const skvq::HostRows sinks = rows.read_rows(r, false);
  VQ_CHECK(sinks.n <= std::min(n_fp_sinks(c), ns->offset),
           pre + "expected at most " + std::to_string(n_fp_sinks(c)) + " sink rows");
  const uint64_t n_blocks = r.u64();
  VQ_CHECK(n_blocks <= static_cast<uint64_t>(ns->offset) + 1,
           pre + "expected at most one packed block per token");
  std::vector<skvq::HostBlock> blocks;
  const std::vector<int64_t> chunk_runs = s.chunk_blocks(s.window);
  for (uint64_t i = 0; i < n_blocks; ++i) {
    skvq::HostBlock blk;
    blk.rows = r.i64_in("packed rows", 1, ns->offset);
    blk.k = r.blob();
    blk.v = r.blob();
    blk.pos = r.vec_i32();
    VQ_CHECK(static_cast<int64_t>(blk.k.size()) == bh * blk.rows * s.fk.row_stride &&
                 static_cast<int64_t>(blk.v.size()) == bh * blk.rows * s.fv.row_stride &&
                 static_cast<int64_t>(blk.pos.size()) == bh * blk.rows,
             pre + "expected packed block sizes of the row format");
    // Channel-axis blocks are the flush's runs of `window` kept rows (a block's records hold
    // its metadata: a shorter one would not).
    if (s.key_axis == QuantAxis::kChannel) {
      const size_t j = static_cast<size_t>(i % chunk_runs.size());
      VQ_CHECK(blk.rows == chunk_runs[j], pre + "expected channel-axis block " + std::to_string(i) +
                                              " of " + std::to_string(chunk_runs[j]) +
                                              " rows (the flush's runs of skvq_window) but "
                                              "got " +
                                              std::to_string(blk.rows));
    }
    blocks.push_back(std::move(blk));
  }
  VQ_CHECK(s.key_axis == QuantAxis::kToken || n_blocks % chunk_runs.size() == 0,
           pre + "expected whole chunks of channel-axis blocks (" +
               std::to_string(chunk_runs.size()) + " per chunk) but got " +
               std::to_string(n_blocks) + " blocks");
  VQ_CHECK(n_blocks == 0 || !s.reorder || has_perms,
           pre + "expected permutations with packed rows and reordering on");
  const skvq::HostRows tail = rows.read_rows(r, true);
  ns->pending = r.boolean();
  const int64_t win_hq = r.i64_in("win_hq", 0, ns->pending ? 256 * heads : 0);
  // The window rows are the last rows of the last prompt chunk; a chunk shorter than the sink
  // count stores them among the full-precision sinks, so both stores bound them.
  const int64_t win_rows = r.i64_in("win_rows", 0, std::min(c.snap_obs_window, sinks.n + tail.n));
  const std::vector<float> win_q = r.vec_f32();
  VQ_CHECK(!ns->pending || c.snap_evict_at == SnapEvictAt::kPromptEnd,
           pre +
               "expected no pending eviction (snap_evict_at = prefill_call) but the state "
               "has one");
  VQ_CHECK((win_hq == 0) == (win_rows == 0) && (win_hq == 0 || win_hq % heads == 0) &&
               static_cast<int64_t>(win_q.size()) == bh * (win_hq / heads) * win_rows * d,
           pre + "expected a query window [B, H_q (a multiple of H), rows, D] of " +
               std::to_string(win_hq) + " heads and " + std::to_string(win_rows) +
               " rows but got " + std::to_string(win_q.size()) + " values");
  VQ_CHECK(s.key_axis == QuantAxis::kToken || !ns->pending || n_blocks == 0,
           pre +
               "expected no pending eviction over packed channel-axis rows (a selection keeps "
               "single rows; the cache refuses the prompt that would owe one)");
  // A pending prompt keeps every row at full precision until its selection and flush.
  VQ_CHECK(ns->pending || tail.n < s.flush_span,
           pre + "expected fewer than window + recent full-precision tail rows");
  // Positions strictly ascending per (b, h) and below offset (no loop over (b, h) when no row
  // is stored: B * H alone may be near 2^48 in a corrupted state).
  int64_t rows_per_frame = tail.n;
  for (const auto& blk : blocks) rows_per_frame += blk.rows;
  for (int64_t f = 0; f < bh && rows_per_frame > 0; ++f) {
    int64_t prev = sinks.n - 1;
    auto next = [&](int64_t p) {
      VQ_CHECK(p > prev && p < ns->offset,
               pre + "expected ascending positions below offset but got " + std::to_string(p));
      prev = p;
    };
    for (const auto& blk : blocks)
      for (int64_t i = 0; i < blk.rows; ++i) next(blk.pos[static_cast<size_t>(f * blk.rows + i)]);
    for (int64_t i = 0; i < tail.n; ++i) next(tail.pos[static_cast<size_t>(f * tail.n + i)]);
  }
  if (takes_external_scores()) {
    ns->ext = r.vec_f32();
    VQ_CHECK(ns->ext.empty() || (ns->pending && static_cast<int64_t>(ns->ext.size()) ==
                                                    bh * (sinks.n + rows_per_frame)),
             pre + "expected no external scores or [" + std::to_string(batch) + ", " +
                 std::to_string(heads) + ", stored rows] of a pending prompt but got " +
                 std::to_string(ns->ext.size()) + " values");
  }
  r.expect_end();
  rows.install(sinks, blocks, tail);
  if (win_rows > 0) ns->win = backend_->upload_queries(batch, win_hq, win_rows, d, win_q);
  st_.swap(ns);
}

}  // namespace vq
