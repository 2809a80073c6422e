// The SKVQ cache (see veloxquant/skvq_cache.h): a policy over a row backend (docs/design.md §3),
// the same code whatever device holds the rows.
//
// State (skvq::Store, src/kv/skvq_store.h): sinks [B, H, n_sink, D] full precision (after chunk
// 0), packed records for positions n_sink .. q_end-1 (implicit positions; one block per flushed
// chunk: chunk 0 holds rows n_sink..window-1, chunk k rows k*window..(k+1)*window-1; with
// skvq_key_rows, the chunk's runs of key rows, Settings::chunk_blocks), and the
// full-precision tail (positions q_end..offset-1). A call appends its rows to the tail (converted
// to the storage dtype), then packs every chunk the flush rule flushes, quantized on the
// backend's device, and drops their full-precision copies (the row buffer shrinks when it is
// more than twice its rows).
#include "veloxquant/skvq_cache.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <exception>
#include <fstream>
#include <istream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <ostream>

#include "kv/skvq_store.h"
#include "veloxquant/error.h"
#include "veloxquant/packed.h"
#include "veloxquant/snapkv.h"

namespace vq {
namespace skvq {

// Protected rows (skvq_protect > 0; see veloxquant/skvq_cache.h).
struct Protect {
  bool pending = false;  // the first prompt is being copied; its selection is owed
  bool done = false;     // the selection has run (or cannot run any more)
  // While pending: fp32 copies of the prompt's rows [F, capacity, D] on the backend's device,
  // positions 0 .. rows - 1.
  std::unique_ptr<kv::RowStore> copies;
  int64_t rows = 0;
  // Window queries of the latest multi-token call [B, hq, w, D] fp32 at positions q_first..
  std::unique_ptr<kv::QueryRows> q;
  int64_t q_first = 0;
  std::vector<float> ext;  // external scores [F, ext_rows] (host: the CPU backend only)
  int64_t ext_rows = 0;
  // After the selection: prompt rows it ran over, the packed frontier then (its candidates were
  // positions n_sink .. covered - 1), rows per frame, their copies, their positions [F, count]
  // (host), and the packed rows' positions from position table_first, [F, table->count] on the
  // backend's device (INT32_MAX for a protected row): positions 0 .. covered - 1 when packed rows
  // live in one store per block, every record of the one packed run (from n_sink, its capacity
  // long: a device view's positions are strided by the run's capacity) on a one_packed_run
  // backend.
  int64_t prompt_rows = 0, covered = 0, count = 0;
  std::unique_ptr<kv::RowStore> fp;
  std::vector<int32_t> pos;
  std::unique_ptr<kv::RowIndex> table;
  int64_t table_first = 0;
};

struct State {
  explicit State(const kv::RowBackend& be, const Settings& s) : rows(be, s, false, "skvq") {}
  Store rows;
  int64_t offset = 0;              // tokens seen
  int64_t q_end = 0;               // flush frontier (multiple of window)
  int64_t comp_k = 0, comp_v = 0;  // seed byte formula, cumulative over flushed chunks
  Protect pr;
};

}  // namespace skvq

using skvq::Settings;
using skvq::State;

namespace {
constexpr const char* kOp = "skvq";

// The flush frontier after n rows (the update's rule: chunks of w while >= span rows remain).
int64_t flush_frontier(int64_t n, int64_t w, int64_t span) {
  return n >= span ? ((n - span) / w + 1) * w : 0;
}

// Rows packed after n tokens: the frontier less the sinks chunk 0 keeps.
int64_t packed_rows_of(const Settings& s, int64_t n) {
  const int64_t q_end = flush_frontier(n, s.window, s.flush_span);
  return q_end > 0 ? q_end - s.n_sink : 0;
}

// Protected rows of a prompt of n rows with `packed` packed candidates: round(protect * n), at
// least 1, at most the candidates.
int64_t protect_count(double protect, int64_t n, int64_t packed) {
  if (protect <= 0.0 || packed <= 0) return 0;
  const int64_t k = std::max<int64_t>(1, std::llround(protect * static_cast<double>(n)));
  return std::min(k, packed);
}

// The columns and first position the protected rows' position table needs now (Protect::table).
std::pair<int64_t, int64_t> table_span(const kv::RowBackend& be, const skvq::Store& rows,
                                       const skvq::Protect& pr, int64_t n_sink) {
  if (!be.one_packed_run()) return {pr.covered, 0};
  return {std::max(rows.packed_capacity(), pr.covered - n_sink), n_sink};
}

// (Re)builds the position table when the packed stores no longer match it (a selection, a load,
// a grown packed run). A replaced table may still be read by queued work: the backend drains
// first.
void fit_table(const kv::RowBackend& be, const skvq::Store& rows, skvq::Protect& pr,
               int64_t n_sink) {
  if (pr.count == 0) return;
  const auto [cols, first] = table_span(be, rows, pr, n_sink);
  if (pr.table && pr.table->count == cols && pr.table_first == first) return;
  const int64_t F = rows.batch * rows.heads, k = pr.count;
  std::vector<int32_t> t(static_cast<size_t>(F * cols));
  for (int64_t f = 0; f < F; ++f) {
    for (int64_t c = 0; c < cols; ++c)
      t[static_cast<size_t>(f * cols + c)] = static_cast<int32_t>(first + c);
    for (int64_t i = 0; i < k; ++i)
      t[static_cast<size_t>(f * cols + pr.pos[static_cast<size_t>(f * k + i)] - first)] = INT32_MAX;
  }
  if (pr.table) be.synchronize();
  pr.table = be.upload_index(cols, t);
  pr.table_first = first;
}
}  // namespace

std::unique_ptr<KVCache> make_skvq_cache(const CacheConfig& cfg, int64_t layer_index) {
  return std::make_unique<SkvqCache>(cfg, layer_index);
}

SkvqCache::SkvqCache(const CacheConfig& cfg, int64_t layer_index)
    : SkvqCache(cfg, kv::cpu_backend(), layer_index) {}

SkvqCache::SkvqCache(const CacheConfig& cfg, const kv::RowBackend& backend, int64_t layer_index)
    : backend_(&backend),
      set_(std::make_unique<Settings>(Settings::from_config(cfg, layer_index, kOp))),
      st_(std::make_unique<State>(backend, *set_)) {}

SkvqCache::~SkvqCache() = default;

int64_t skvq_packed_rows(const CacheConfig& cfg, int64_t tokens) {
  const int64_t q_end = flush_frontier(tokens, cfg.skvq_window, cfg.skvq_window + cfg.skvq_recent);
  return q_end > 0 ? q_end - cfg.skvq_n_sink : 0;
}

int64_t skvq_protect_copy_capacity(int64_t cap, int64_t need) {
  if (need <= cap) return cap;
  return round_up(std::max({need, 2 * cap, int64_t{16}}), 16);
}

void SkvqCache::reserve(int64_t rows) {
  VQ_CHECK(rows >= 0 && rows <= INT32_MAX,
           "[skvq] reserve: expected 0 <= rows <= " + std::to_string(INT32_MAX) + " but got " +
               std::to_string(rows));
  reserve_ = rows;
  st_->rows.reserve_packed(packed_rows_of(*set_, rows));
}

int64_t SkvqCache::packed_capacity() const {
  return st_->rows.packed_capacity();
}

int64_t SkvqCache::offset() const {
  return st_->offset;
}
int64_t SkvqCache::stored_rows() const {
  return st_->offset;
}
int64_t SkvqCache::batch() const {
  return st_->rows.batch;
}
int64_t SkvqCache::n_kv_heads() const {
  return st_->rows.heads;
}
int64_t SkvqCache::head_dim() const {
  return set_->head_dim;
}
int64_t SkvqCache::quantized_tokens() const {
  return st_->q_end;
}
DType SkvqCache::storage_dtype() const {
  return st_->rows.dtype;
}
const std::vector<int32_t>& SkvqCache::key_perms() const {
  return st_->rows.tr.perm_k;
}
const std::vector<int32_t>& SkvqCache::value_perms() const {
  return st_->rows.tr.perm_v;
}
const std::vector<float>& SkvqCache::rotation_signs() const {
  return st_->rows.tr.signs;
}

std::vector<int32_t> SkvqCache::stored_positions(int64_t b, int64_t h) const {
  VQ_CHECK(b >= 0 && b < st_->rows.batch && h >= 0 && h < st_->rows.heads,
           "[skvq] expected (b, h) within [" + std::to_string(st_->rows.batch) + ", " +
               std::to_string(st_->rows.heads) + ") but got (" + std::to_string(b) + ", " +
               std::to_string(h) + ")");
  std::vector<int32_t> p(static_cast<size_t>(st_->offset));
  std::iota(p.begin(), p.end(), 0);
  return p;
}

CacheView SkvqCache::update_and_fetch(const TensorView& keys, const TensorView& values,
                                      const UpdateOptions& opts) {
  const Settings& s = *set_;
  State& st = *st_;
  skvq::Store& rows = st.rows;
  // ---- validation: nothing changes before all of it passes
  skvq::check_blocks(keys, values, s.head_dim, rows.has_data, rows.batch, rows.heads, kOp);
  const int64_t n_new = keys.shape[2];
  if (s.max_ctx > 0 && st.offset + n_new > s.max_ctx)
    throw Error("[skvq] skvq_max_ctx: expected at most " + std::to_string(s.max_ctx) +
                " tokens but this call would reach " + std::to_string(st.offset + n_new) + " (" +
                std::to_string(st.offset) + " seen + " + std::to_string(n_new) +
                "); nothing was changed");
  VQ_CHECK(st.offset + n_new <= INT32_MAX, "[skvq] expected positions to fit int32 but offset " +
                                               std::to_string(st.offset) + " + S " +
                                               std::to_string(n_new) + " does not");
  skvq::Protect& pr = st.pr;
  const TensorView* queries = opts.queries;
  if (s.protect > 0.0 && !pr.done && s.protect_scoring == SnapScoring::kQuery && queries &&
      n_new > 1) {
    const TensorView& q = *queries;
    VQ_CHECK(q.shape[0] == keys.shape[0] && q.shape[2] == n_new && q.shape[3] == s.head_dim &&
                 q.shape[1] >= keys.shape[1] && q.shape[1] % keys.shape[1] == 0 &&
                 (q.data || q.numel() == 0),
             "[skvq] skvq_protect_scoring=query: expected queries [" +
                 std::to_string(keys.shape[0]) + ", H_q (a multiple of " +
                 std::to_string(keys.shape[1]) + "), " + std::to_string(n_new) + ", " +
                 std::to_string(s.head_dim) + "] but got " + skvq::shape_str(q));
  }
  if (!rows.has_data) {
    skvq::Transforms tr = skvq::initial_transforms(s, keys.shape[1], kOp);  // may throw
    rows.start(keys.dtype, keys.shape[0], keys.shape[1], std::move(tr));
  }
  // A single-token call after the first prompt: the prompt is over.
  if (s.protect > 0.0 && !pr.done && n_new == 1) {
    if (pr.pending)
      end_prompt();
    else
      pr.done = true;  // no prompt came first: nothing is protected
  }
  rows.release_retired();  // the previous view is over

  // ---- protected rows: fp32 copies of the first prompt's rows and its window queries
  if (s.protect > 0.0 && !pr.done) {
    const int64_t B = keys.shape[0], H = keys.shape[1], D = s.head_dim;
    pr.pending = true;
    const int64_t need = pr.rows + n_new;
    if (!pr.copies || pr.copies->capacity() < need) {  // x2 growth in steps of 16 rows
      const int64_t cap = pr.copies ? pr.copies->capacity() : 0;
      auto grown =
          backend_->make({DType::kF32, B, H, D}, skvq_protect_copy_capacity(cap, need), true);
      if (pr.copies) grown->copy_rows(*pr.copies, pr.rows);
      pr.copies = std::move(grown);
    }
    pr.copies->write_block(keys, values, 0, n_new, pr.rows);
    pr.copies->fill_positions(pr.rows, n_new, pr.rows);
    pr.rows = need;
    pr.ext.clear();  // scores cover the rows stored when they were given
    pr.ext_rows = 0;
    if (s.protect_scoring == SnapScoring::kQuery && queries) {
      const int64_t w_q = std::min(s.protect_obs_window, n_new);
      pr.q_first = st.offset + n_new - w_q;
      pr.q = backend_->keep_queries(*queries, w_q);
    }
  }

  // ---- append, then flush the chunks [q_end, q_new)
  rows.append(keys, values, 0, n_new, st.offset);
  const int64_t w = s.window, n_total = st.offset + n_new;
  int64_t q_new = st.q_end;
  while (n_total - q_new >= s.flush_span) q_new += w;
  if (q_new > st.q_end) {
    if (st.q_end == 0) {
      // Chunk 0: permutations (pooled over batch and the chunk's rows, sinks included) and the
      // exact sinks (its first n_sink rows stay where they are).
      if (s.reorder && !rows.tr.has_perms()) rows.freeze_perms(w);
      rows.promote_sinks(s.n_sink);
    }
    std::vector<int64_t> blocks;  // each chunk's blocks (skvq_key_rows runs, or the chunk)
    for (int64_t c0 = st.q_end; c0 < q_new; c0 += w)
      for (const int64_t n : s.chunk_blocks(c0 == 0 ? w - s.n_sink : w)) {
        blocks.push_back(n);
        const int64_t bh = rows.batch * rows.heads;
        st.comp_k += s.key_chunk_bytes(n) * bh;
        st.comp_v += s.value_chunk_bytes(n) * bh;
      }
    rows.pack_tail(blocks);
    rows.fit();  // the flushed rows' full-precision copies are freed
    rows.release_retired();
    fit_table(*backend_, rows, pr, s.n_sink);  // a grown packed run
  }
  st.q_end = q_new;
  st.offset = n_total;
  return with_protected(rows.view(0));
}

CacheView SkvqCache::stored_view() const {
  return with_protected(st_->rows.view(1));
}

// The protected rows' segment first, then the stored segments, packed ones below the selection's
// frontier with the positions that hide their protected rows.
CacheView SkvqCache::with_protected(CacheView v) const {
  const skvq::Protect& pr = st_->pr;
  if (pr.count == 0) return v;
  for (ViewSegment& seg : v.segments) {
    if (!seg.packed || seg.positions || seg.first_pos >= pr.covered) continue;
    VQ_CHECK(seg.first_pos >= pr.table_first &&
                 seg.first_pos + seg.n_rows <= pr.table_first + pr.table->count,
             "[skvq] internal: a packed segment straddles the protected rows' position table");
    seg.positions = pr.table->data() + (seg.first_pos - pr.table_first);
    seg.pos_stride = pr.table->count;
  }
  ViewSegment ps;
  ps.n_rows = pr.count;
  ps.positions = pr.fp->positions();
  ps.pos_stride = pr.fp->capacity();
  ps.keys = pr.fp->keys(0, pr.count);
  ps.values = pr.fp->values(0, pr.count);
  v.segments.insert(v.segments.begin(), ps);
  return v;
}

bool SkvqCache::protection_pending() const {
  return st_->pr.pending;
}

int64_t SkvqCache::protected_rows() const {
  return st_->pr.count;
}

std::vector<int32_t> SkvqCache::protected_positions(int64_t b, int64_t h) const {
  const skvq::Protect& pr = st_->pr;
  VQ_CHECK(b >= 0 && b < st_->rows.batch && h >= 0 && h < st_->rows.heads,
           "[skvq] expected (b, h) within [" + std::to_string(st_->rows.batch) + ", " +
               std::to_string(st_->rows.heads) + ") but got (" + std::to_string(b) + ", " +
               std::to_string(h) + ")");
  if (pr.count == 0) return {};
  const std::vector<int32_t> all = pr.fp->download_positions(pr.count);
  const auto first = all.begin() + (b * st_->rows.heads + h) * pr.count;
  return std::vector<int32_t>(first, first + pr.count);
}

bool SkvqCache::takes_external_scores() const {
  return set_->protect > 0.0 && set_->protect_scoring == SnapScoring::kExternal;
}

void SkvqCache::set_external_scores(const float* scores, int64_t batch, int64_t heads,
                                    int64_t rows) {
  if (!takes_external_scores()) {
    KVCache::set_external_scores(scores, batch, heads, rows);
    return;
  }
  skvq::Protect& pr = st_->pr;
  VQ_CHECK(pr.pending,
           "[skvq] set_external_scores: expected a pending first prompt (scores "
           "choose its protected rows) but there is none");
  VQ_CHECK(batch == st_->rows.batch && heads == st_->rows.heads && rows == st_->offset &&
               (scores || rows == 0),
           "[skvq] set_external_scores: expected scores [" + std::to_string(st_->rows.batch) +
               ", " + std::to_string(st_->rows.heads) + ", " + std::to_string(st_->offset) +
               "] but got [" + std::to_string(batch) + ", " + std::to_string(heads) + ", " +
               std::to_string(rows) + "]");
  pr.ext.assign(scores, scores + batch * heads * rows);
  pr.ext_rows = rows;
}

void SkvqCache::end_prompt() {
  skvq::Protect& pr = st_->pr;
  if (set_->protect == 0.0 || pr.done) return;
  if (!pr.pending) {
    pr.done = true;  // no prompt: nothing is protected
    return;
  }
  select_protected();
}

// The selection of veloxquant/skvq_cache.h over the pending prompt, then its copies are freed.
void SkvqCache::select_protected() {
  const Settings& s = *set_;
  State& st = *st_;
  skvq::Protect& pr = st.pr;
  const skvq::Store& rows = st.rows;
  const int64_t n = pr.rows, B = rows.batch, H = rows.heads, F = B * H, D = s.head_dim;
  VQ_CHECK(s.protect_scoring != SnapScoring::kExternal || pr.ext_rows == n,
           "[skvq] skvq_protect_scoring=external: expected set_external_scores for the " +
               std::to_string(n) + " rows of the prompt before end_prompt() but got none");
  VQ_CHECK(n == st.offset, "[skvq] internal: the protected copies do not cover the prompt");
  const int64_t lo = st.q_end > 0 ? s.n_sink : 0, hi = st.q_end;
  const int64_t k = protect_count(s.protect, n, hi - lo);
  std::vector<int32_t> pos;  // [F, k] ascending positions (= rows of the copies)
  if (k > 0 && s.protect_scoring == SnapScoring::kExternal) {
    // host scores (KVCache::set_external_scores; a device cache's policy takes them the same way,
    // src/cuda/device_cache_policy.cpp): the selection runs here, the gather on the backend
    pos.resize(static_cast<size_t>(F * k));
    std::vector<float> sc(static_cast<size_t>(n)), pooled(static_cast<size_t>(n));
    std::vector<int64_t> idx(static_cast<size_t>(k));
    for (int64_t f = 0; f < F; ++f) {
      std::copy(pr.ext.begin() + f * n, pr.ext.begin() + (f + 1) * n, sc.begin());
      snap_pool_scores(sc.data(), n, s.protect_pool_kernel, PoolKind::kMax, pooled.data());
      const int64_t got = snap_select(pooled.data() + lo, hi - lo, k, 0, idx.data());
      VQ_CHECK(got == k, "[skvq] internal: protected selection size");
      for (int64_t i = 0; i < k; ++i) pos[f * k + i] = static_cast<int32_t>(lo + idx[i]);
    }
  } else if (k > 0) {  // query scores (the kept window), else the key proxy (also without queries)
    TensorView qv;
    const bool by_query = s.protect_scoring == SnapScoring::kQuery && pr.q && pr.q->rows > 0;
    if (by_query) qv = pr.q->view();
    pos = backend_->snap_select_rows(*pr.copies, n, by_query ? &qv : nullptr, pr.q_first,
                                     s.protect_obs_window, s.protect_pool_kernel, lo, hi, k);
  }
  pr.prompt_rows = n;
  pr.covered = hi;
  pr.count = k;
  if (k > 0) {
    // The chosen copies (positions too), on the backend's device.
    auto tmp = backend_->make({DType::kF32, B, H, D}, k, true);
    tmp->gather(*pr.copies, *backend_->upload_index(k, pos), 0);
    if (!s.protect_values) {
      // Values of unprotected-value rows: the codes' own values, dequantized as attention would
      // (dequantize_row, packed.h; value records are per token), from the packed blocks' host
      // bytes.
      const PackedRowFormat& fv = s.fv;
      const int64_t rs = fv.row_stride;
      std::vector<uint8_t> rec(static_cast<size_t>(F * k * rs));
      int64_t first = lo;
      for (size_t bi = 0; bi < rows.blocks().size(); ++bi) {
        const int64_t nb = rows.blocks()[bi];
        const std::vector<uint8_t> bytes = rows.block_records(bi, true);  // [F, nb, rs]
        for (int64_t f = 0; f < F; ++f)
          for (int64_t i = 0; i < k; ++i) {
            const int64_t p = pos[static_cast<size_t>(f * k + i)];
            if (p >= first && p < first + nb)
              std::copy_n(bytes.data() + (f * nb + p - first) * rs, rs,
                          rec.data() + (f * k + i) * rs);
          }
        first += nb;
      }
      PackedTensor pt;
      pt.data = rec.data();
      pt.stride_h = k * rs;
      pt.stride_b = H * k * rs;
      pt.fmt = fv;
      pt.perm = rows.tr.perm_v.empty() ? nullptr : rows.tr.perm_v.data();
      pt.signs = rows.tr.signs.empty() || !rows.tr.rotate_values ? nullptr : rows.tr.signs.data();
      pt.rot_block = pt.signs ? rows.tr.rot_block : 0;
      const Tensor tk = tmp->download(false, k);
      Tensor tv(DType::kF32, B, H, k, D);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < k; ++i)
            dequantize_row(pt, b, h, i, static_cast<float*>(tv.data()) + ((b * H + h) * k + i) * D);
      tmp->upload(tk.view(), tv.view(), 0, k, &pos);
    }
    pr.fp = backend_->make({rows.dtype, B, H, D}, k, true);
    pr.fp->copy_range(*tmp, 0, 0, k);  // converted to the storage dtype, positions copied
    pr.pos = std::move(pos);
    fit_table(*backend_, rows, pr, s.n_sink);
  }
  pr.pending = false;
  pr.done = true;
  pr.copies.reset();
  pr.q.reset();
  std::vector<float>().swap(pr.ext);
  pr.rows = pr.ext_rows = 0;
}

CacheStats SkvqCache::stats() const {
  const Settings& s = *set_;
  const State& st = *st_;
  const int64_t bh = st.rows.batch * st.rows.heads, d = s.head_dim;
  CacheStats cs;
  cs.method = method();
  cs.tokens_seen = st.offset;
  cs.rows_stored = st.offset;
  const int64_t fp16_k = bh * st.offset * d * 2;
  const int64_t n_sink_kept = std::min(s.n_sink, st.q_end);
  const int64_t residual = (st.offset - st.q_end + n_sink_kept) * d * 2 * 2 * bh;
  const int64_t perm_bytes = st.rows.tr.has_perms() ? 2 * st.rows.heads * d * 4 : 0;
  const int64_t n_q = st.q_end - n_sink_kept;
  const double avg_bits =
      n_q > 0 ? 8.0 * static_cast<double>(st.comp_k) / static_cast<double>(n_q * d * bh) : 16.0;
  // Protected rows: per row and (b, h) the fp16 key (and value) and an int32 position.
  const skvq::Protect& pr = st.pr;
  const int64_t protected_bytes = pr.count * (d * 2 * (s.protect_values ? 2 : 1) + 4) * bh;
  cs.bytes_accounted = st.comp_k + st.comp_v + residual + perm_bytes + protected_bytes;
  cs.fp16_bytes = 2 * fp16_k;
  const int64_t copies = (pr.copies ? pr.copies->resident_bytes() : 0) +
                         (pr.q ? pr.q->resident_bytes() : 0) +
                         static_cast<int64_t>(pr.ext.size()) * 4;
  cs.bytes_resident = st.rows.resident_bytes() + (pr.fp ? pr.fp->resident_bytes() : 0) +
                      (pr.table ? bh * pr.table->count * 4 : 0) + copies;
  cs.figures = {
      {"compressed_key_bytes", static_cast<double>(st.comp_k)},
      {"compressed_value_bytes", static_cast<double>(st.comp_v)},
      {"fp16_key_bytes", static_cast<double>(fp16_k)},
      {"fp16_value_bytes", static_cast<double>(fp16_k)},
      {"residual_fp16_bytes", static_cast<double>(residual)},
      {"perm_bytes", static_cast<double>(perm_bytes)},
      {"quantized_tokens", static_cast<double>(st.q_end)},
      {"tokens_seen", static_cast<double>(st.offset)},
      {"key_perms", st.rows.tr.has_perms() ? 1.0 : 0.0},
      {"value_perms", st.rows.tr.has_perms() ? 1.0 : 0.0},
      {"assigned_avg_bits", avg_bits},
      {"packed_rows", static_cast<double>(n_q)},
      {"rotation", st.rows.tr.signs.empty() ? 0.0 : 1.0},
  };
  if (s.protect > 0.0) {
    cs.figures.push_back({"protected_rows", static_cast<double>(pr.count)});
    cs.figures.push_back({"protected_bytes", static_cast<double>(protected_bytes)});
  }
  return cs;
}

void SkvqCache::save(std::ostream& out) const {
  const State& st = *st_;
  const skvq::Store& rows = st.rows;
  VQ_CHECK(!st.pr.pending,
           "[skvq] save: expected no pending selection of protected rows (skvq_protect; call "
           "end_prompt() first) but the first prompt's is owed");
  StateWriter w;
  set_->set_state_version(w);
  set_->save(w);
  w.boolean(rows.has_data);
  if (rows.has_data) {
    w.u8(static_cast<uint8_t>(rows.dtype));
    w.i64(rows.batch);
    w.i64(rows.heads);
    w.i64(st.offset);
    w.i64(st.q_end);
    w.i64(st.comp_k);
    w.i64(st.comp_v);
    rows.tr.save(w);
    rows.write_rows(w, true);
    const std::vector<int64_t>& blocks = rows.blocks();
    w.u64(blocks.size());
    int64_t first = set_->n_sink;
    for (size_t i = 0; i < blocks.size(); ++i) {
      w.i64(blocks[i]);
      w.i64(first);
      first += blocks[i];
      for (int kv = 0; kv < 2; ++kv) {
        const std::vector<uint8_t> rec = rows.block_records(i, kv == 1);
        w.blob(rec.data(), rec.size());
      }
    }
    rows.write_rows(w, false);
    if (set_->protect > 0.0) {  // version 4: the protected rows
      const skvq::Protect& pr = st.pr;
      w.boolean(pr.done);
      w.i64(pr.prompt_rows);
      w.i64(pr.covered);
      w.i64(pr.count);
      if (pr.count > 0) {
        const Tensor k = pr.fp->download(false, pr.count), v = pr.fp->download(true, pr.count);
        w.blob(k.data(), k.nbytes());
        w.blob(v.data(), v.nbytes());
        w.vec_i32(pr.fp->download_positions(pr.count));
      }
    }
  }
  w.write(out, method());
}

void SkvqCache::load(std::istream& in) {
  const Settings& s = *set_;
  StateReader r(in, method());
  s.check_saved(r, kOp);
  auto ns = std::make_unique<State>(*backend_, s);
  skvq::Store& rows = ns->rows;
  rows.reserve_packed(packed_rows_of(s, reserve_));  // the reservation outlives a load
  const std::string pre = "[skvq] load: ";
  if (r.boolean()) {
    const uint8_t dt = r.u8();
    VQ_CHECK(dt <= 2, pre + "expected a dtype code 0..2 but got " + std::to_string(dt));
    const int64_t batch = r.i64_in("batch", 1, 1 << 20);
    const int64_t heads = r.i64_in("heads", 1, 1 << 20);
    ns->offset = r.i64_in("offset", 0, s.max_ctx > 0 ? s.max_ctx : INT32_MAX);
    ns->q_end = r.i64_in("quantized_tokens", 0, ns->offset);
    ns->comp_k = r.i64();
    ns->comp_v = r.i64();
    const int64_t d = s.head_dim, bh = batch * heads;
    VQ_CHECK(ns->q_end % s.window == 0 && ns->offset - ns->q_end < s.flush_span,
             pre +
                 "expected a frontier at a whole chunk with fewer than window + recent rows "
                 "after it but got offset " +
                 std::to_string(ns->offset) + ", frontier " + std::to_string(ns->q_end));
    skvq::Transforms tr = skvq::Transforms::load(r, heads, d, kOp);
    VQ_CHECK(tr.signs.empty() == !s.rotate,
             pre + "expected rotation signs exactly when skvq_rotation is on");
    VQ_CHECK(tr.has_perms() == (s.reorder && (ns->q_end > 0 || !s.file_perm_k.empty())),
             pre + "expected permutations exactly when reordering has run");
    rows.start(static_cast<DType>(dt), batch, heads, std::move(tr));
    const skvq::HostRows sinks = rows.read_rows(r, false);
    VQ_CHECK(sinks.n == (ns->q_end > 0 ? s.n_sink : 0),
             pre + "expected " + std::to_string(ns->q_end > 0 ? s.n_sink : 0) +
                 " sink rows but got " + std::to_string(sinks.n));
    // The blocks the flushes made: each chunk's runs (Settings::chunk_blocks), in order; counted
    // without listing them (a forged frontier must not allocate).
    const int64_t n_chunks = ns->q_end / s.window;
    const int64_t per_chunk = static_cast<int64_t>(s.chunk_blocks(s.window).size());
    const int64_t want_blocks =
        n_chunks == 0 ? 0
                      : static_cast<int64_t>(s.chunk_blocks(s.window - s.n_sink).size()) +
                            (n_chunks - 1) * per_chunk;
    const uint64_t n_blocks = r.u64();
    VQ_CHECK(n_blocks == static_cast<uint64_t>(want_blocks),
             pre + "expected " + std::to_string(want_blocks) + " packed blocks (" +
                 std::to_string(n_chunks) + " chunks) but got " + std::to_string(n_blocks));
    std::vector<skvq::HostBlock> blocks;
    int64_t ck = 0, cv = 0;
    std::vector<int64_t> runs;  // the current chunk's runs, from its run j
    size_t j = 0;
    int64_t c0 = -s.window, want_first = 0;
    for (uint64_t i = 0; i < n_blocks; ++i) {
      if (j == runs.size()) {  // the next chunk
        c0 += s.window;
        want_first = c0 == 0 ? s.n_sink : c0;
        runs = s.chunk_blocks(c0 + s.window - want_first);
        j = 0;
      }
      const int64_t want_rows = runs[j++];
      skvq::HostBlock blk;
      blk.rows = r.i64();
      const int64_t first_pos = r.i64();
      VQ_CHECK(first_pos == want_first && blk.rows == want_rows,
               pre + "expected block " + std::to_string(i) + " at rows " +
                   std::to_string(want_first) + ".." + std::to_string(want_first + want_rows - 1));
      want_first += want_rows;
      blk.k = r.blob();
      blk.v = r.blob();
      VQ_CHECK(static_cast<int64_t>(blk.k.size()) == bh * blk.rows * s.fk.row_stride &&
                   static_cast<int64_t>(blk.v.size()) == bh * blk.rows * s.fv.row_stride,
               pre + "expected packed chunk sizes of the row format");
      ck += s.key_chunk_bytes(blk.rows) * bh;
      cv += s.value_chunk_bytes(blk.rows) * bh;
      blocks.push_back(std::move(blk));
    }
    VQ_CHECK(ck == ns->comp_k && cv == ns->comp_v,
             pre + "expected compressed byte counters matching the chunks");
    const skvq::HostRows tail = rows.read_rows(r, false);
    VQ_CHECK(tail.n == ns->offset - ns->q_end, pre + "expected " +
                                                   std::to_string(ns->offset - ns->q_end) +
                                                   " tail rows but got " + std::to_string(tail.n));
    // Protected rows (version 4): the selection's prompt, frontier and rows, each checked against
    // the rule that made them; positions ascending among the frontier's packed rows.
    skvq::Protect& pr = ns->pr;
    std::string pk, pv;
    std::vector<int32_t> ppos;
    if (s.protect > 0.0) {
      // Rows are stored only after a first call, which starts (or, single-token, skips) the
      // selection, and a pending one is never saved: the selection is done.
      pr.done = r.boolean();
      VQ_CHECK(pr.done, pre + "expected the selection of protected rows done in a state with rows");
      pr.prompt_rows = r.i64_in("protected prompt rows", 0, ns->offset);
      const int64_t frontier = flush_frontier(pr.prompt_rows, s.window, s.flush_span);
      pr.covered = r.i64_in("protected frontier", frontier, frontier);
      const int64_t lo = pr.covered > 0 ? s.n_sink : 0;
      const int64_t want = protect_count(s.protect, pr.prompt_rows, pr.covered - lo);
      pr.count = r.i64_in("protected rows", want, want);
      if (pr.count > 0) {
        pk = r.blob();
        pv = r.blob();
        ppos = r.vec_i32();
        const size_t rb =
            static_cast<size_t>(bh * pr.count * d) * dtype_size(static_cast<DType>(dt));
        VQ_CHECK(
            pk.size() == rb && pv.size() == rb && ppos.size() == static_cast<size_t>(bh * pr.count),
            pre + "expected " + std::to_string(pr.count) +
                " protected rows per (b, h) of the storage dtype with their positions");
        for (int64_t f = 0; f < bh; ++f)
          for (int64_t i = 0; i < pr.count; ++i) {
            const int32_t p = ppos[static_cast<size_t>(f * pr.count + i)];
            VQ_CHECK(p >= lo && p < pr.covered &&
                         (i == 0 || p > ppos[static_cast<size_t>(f * pr.count + i - 1)]),
                     pre + "expected ascending protected positions among packed rows " +
                         std::to_string(lo) + ".." + std::to_string(pr.covered - 1) + " but got " +
                         std::to_string(p));
          }
      }
    }
    r.expect_end();
    rows.install(sinks, blocks, tail);
    if (pr.count > 0) {
      const TensorView kv =
          TensorView::contiguous(pk.data(), static_cast<DType>(dt), batch, heads, pr.count, d);
      const TensorView vv =
          TensorView::contiguous(pv.data(), static_cast<DType>(dt), batch, heads, pr.count, d);
      pr.fp = backend_->make({static_cast<DType>(dt), batch, heads, d}, pr.count, true);
      pr.fp->upload(kv, vv, 0, pr.count, &ppos);
      pr.pos = std::move(ppos);
      fit_table(*backend_, rows, pr, s.n_sink);
    }
  } else {
    r.expect_end();
  }
  st_.swap(ns);
}

// ---- calibrated permutations ------------------------------------------------------------------

std::vector<int32_t> skvq_channel_perms(const TensorView& block) {
  const int64_t bsz = block.shape[0], heads = block.shape[1], n = block.shape[2],
                d = block.shape[3];
  VQ_CHECK(bsz >= 1 && heads >= 1 && n >= 1 && d >= 1 && block.data,
           "[skvq_channel_perms] expected a non-empty block [B, H, S, D] but got " +
               skvq::shape_str(block));
  // The rows in a CPU store of the block's dtype, then the backend's permutation op.
  const kv::RowBackend& be = kv::cpu_backend();
  auto rows = be.make({block.dtype, bsz, heads, d}, n, false);
  rows->write_block(block, block, 0, n, 0);
  return be.channel_perms(*rows, 0, n, false);
}

void save_skvq_perm_file(const std::string& path, const SkvqPermSet& ps) {
  VQ_CHECK(ps.key.size() == ps.value.size() && !ps.key.empty(),
           "[skvq_perm_file] expected as many key as value layers (>= 1) but got " +
               std::to_string(ps.key.size()) + " and " + std::to_string(ps.value.size()));
  nlohmann::json j;
  j["format"] = "veloxquant.skvq_perms";
  j["version"] = 1;
  j["n_kv_heads"] = ps.n_kv_heads;
  j["head_dim"] = ps.head_dim;
  j["layers"] = nlohmann::json::array();
  for (size_t l = 0; l < ps.key.size(); ++l) {
    VQ_CHECK(skvq::is_perm_set(ps.key[l], ps.n_kv_heads, ps.head_dim) &&
                 skvq::is_perm_set(ps.value[l], ps.n_kv_heads, ps.head_dim),
             "[skvq_perm_file] expected valid permutations for layer " + std::to_string(l));
    nlohmann::json layer;
    for (int kv = 0; kv < 2; ++kv) {
      nlohmann::json heads = nlohmann::json::array();
      const auto& p = kv == 0 ? ps.key[l] : ps.value[l];
      for (int64_t h = 0; h < ps.n_kv_heads; ++h)
        heads.push_back(
            std::vector<int32_t>(p.begin() + h * ps.head_dim, p.begin() + (h + 1) * ps.head_dim));
      layer[kv == 0 ? "key" : "value"] = heads;
    }
    j["layers"].push_back(layer);
  }
  std::ofstream f(path);
  VQ_CHECK(f.good(), "[skvq_perm_file] expected a writable file but could not open '" + path + "'");
  f << j.dump() << "\n";
  VQ_CHECK(f.good(), "[skvq_perm_file] expected to write '" + path + "' but the write failed");
}

SkvqPermSet load_skvq_perm_file(const std::string& path) {
  std::ifstream f(path);
  VQ_CHECK(f.good(), "[skvq_perm_file] expected a readable file but could not open '" + path + "'");
  const std::string pre = "[skvq_perm_file] '" + path + "': ";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    throw Error(pre + "expected JSON but got a parse error: " + e.what());
  }
  // An integer field in [lo, hi]. JSON numbers that are not integers (1e20, 2.5) are refused
  // before any conversion: converting an out-of-range double to an integer is undefined.
  const auto integer = [&pre](const nlohmann::json& v, const std::string& what, int64_t lo,
                              int64_t hi) -> int64_t {
    bool ok = false;
    int64_t x = 0;
    if (v.is_number_unsigned()) {  // nlohmann stores non-negative integers as unsigned
      ok = v.get<uint64_t>() <= static_cast<uint64_t>(hi);
      if (ok) x = static_cast<int64_t>(v.get<uint64_t>());
    } else if (v.is_number_integer()) {
      ok = true;
      x = v.get<int64_t>();
    }
    VQ_CHECK(ok && x >= lo && x <= hi, pre + what + ": expected an integer in " +
                                           std::to_string(lo) + ".." + std::to_string(hi) +
                                           " but got " + v.dump());
    return x;
  };
  SkvqPermSet ps;
  try {
    VQ_CHECK(j.is_object() && j.value("format", "") == "veloxquant.skvq_perms",
             pre + "expected format \"veloxquant.skvq_perms\"");
    integer(j.at("version"), "version", 1, 1);
    ps.n_kv_heads = integer(j.at("n_kv_heads"), "n_kv_heads", 1, 4096);
    ps.head_dim = integer(j.at("head_dim"), "head_dim", 1, 65536);
    const auto& layers = j.at("layers");
    VQ_CHECK(layers.is_array() && !layers.empty(), pre + "expected a non-empty layers array");
    for (size_t l = 0; l < layers.size(); ++l)
      for (int kv = 0; kv < 2; ++kv) {
        const std::string where = "layer " + std::to_string(l) + (kv == 0 ? " key" : " value");
        const auto& heads = layers[l].at(kv == 0 ? "key" : "value");
        VQ_CHECK(heads.is_array() && static_cast<int64_t>(heads.size()) == ps.n_kv_heads,
                 pre + "layer " + std::to_string(l) + ": expected " +
                     std::to_string(ps.n_kv_heads) + " heads");
        std::vector<int32_t> flat;
        for (const auto& hp : heads) {
          VQ_CHECK(hp.is_array() && static_cast<int64_t>(hp.size()) == ps.head_dim,
                   pre + "layer " + std::to_string(l) + ": expected " +
                       std::to_string(ps.head_dim) + " channels per head but got " +
                       (hp.is_array() ? std::to_string(hp.size()) : std::string(hp.type_name())));
          for (const auto& c : hp)
            flat.push_back(
                static_cast<int32_t>(integer(c, where + " channel", 0, ps.head_dim - 1)));
        }
        VQ_CHECK(skvq::is_perm_set(flat, ps.n_kv_heads, ps.head_dim),
                 pre + "layer " + std::to_string(l) +
                     ": expected each head's list to be a "
                     "permutation of 0.." +
                     std::to_string(ps.head_dim - 1));
        (kv == 0 ? ps.key : ps.value).push_back(std::move(flat));
      }
  } catch (const nlohmann::json::exception& e) {
    throw Error(pre + "expected the documented fields but got: " + e.what());
  }
  return ps;
}

}  // namespace vq
