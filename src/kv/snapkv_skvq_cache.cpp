// snapkv+skvq (see veloxquant/snapkv_skvq_cache.h): SnapKV selection over a row store whose rows
// are either full precision or packed SKVQ records.
//
// State: sinks FpRows [B, H, n_s, D] (implicit positions 0..n_s-1), packed blocks (explicit
// positions [B, H, rows]), tail FpRows with explicit positions [B, H, cap]. Per (b, h) the
// frame is sinks ++ packed rows (blocks in order) ++ tail, ascending in position. Eviction
// selects per (b, h) in parallel (OpenMP) on an fp32 frame (packed keys dequantized), then
// gathers into fresh buffers: packed records are copied byte for byte, full-precision rows are
// copied or (to equalise the packed count across heads) quantized. Buffers the returned view
// still references are retired until the next mutating call.
#include "veloxquant/snapkv_skvq_cache.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <istream>
#include <ostream>

#include "kv/skvq_store.h"
#include "veloxquant/error.h"
#include "veloxquant/snapkv.h"

namespace vq {
namespace skvq {

struct SnapSkvqState {
  bool has_data = false;
  DType dtype = DType::kF16;
  int64_t batch = 0, heads = 0;
  int64_t offset = 0;
  Transforms tr;
  FpRows sinks;  // positions 0..count-1
  std::vector<std::unique_ptr<PackedBlock>> blocks;
  FpRows tail;  // explicit positions
  // What the last view may still reference (freed at the next mutating call).
  std::vector<std::unique_ptr<PackedBlock>> retired_blocks;
  std::vector<FpRows> retired_rows;
  std::vector<int32_t> view_tail_pos;    // [B, H, tail.count] for the last update's view
  std::vector<int32_t> stored_tail_pos;  // the same for the last stored_view()
  // snap_evict_at = prompt_end: a selection (and the flush after it) is owed, scored with the
  // kept window queries.
  bool pending = false;
  SnapPromptWindow win;

  int64_t packed() const {
    int64_t n = 0;
    for (const auto& b : blocks) n += b->rows;
    return n;
  }
};

}  // namespace skvq

using skvq::FpRows;
using skvq::PackedBlock;
using skvq::Settings;
using skvq::SnapSkvqState;

namespace {

constexpr const char* kOp = "snapkv+skvq";

int64_t n_fp_sinks(const CacheConfig& c) {
  return std::min(c.skvq_n_sink, std::max<int64_t>(c.snap_n_sink, 0));
}

// Position of packed row i of (b, h) in block blk.
int32_t block_pos(const PackedBlock& blk, int64_t bh, int64_t i) {
  return blk.pos[static_cast<size_t>(bh * blk.rows + i)];
}

}  // namespace

std::unique_ptr<KVCache> make_snapkv_skvq_cache(const CacheConfig& cfg, int64_t layer_index) {
  return std::make_unique<SnapkvSkvqCache>(cfg, layer_index);
}

SnapkvSkvqCache::SnapkvSkvqCache(const CacheConfig& cfg, int64_t layer_index)
    : cfg_(std::make_unique<CacheConfig>(cfg)),
      set_(std::make_unique<Settings>(Settings::from_config(cfg, layer_index, kOp))),
      st_(std::make_unique<SnapSkvqState>()) {}

SnapkvSkvqCache::~SnapkvSkvqCache() = default;

int64_t SnapkvSkvqCache::offset() const {
  return st_->offset;
}
int64_t SnapkvSkvqCache::stored_rows() const {
  return st_->sinks.count + st_->packed() + st_->tail.count;
}
int64_t SnapkvSkvqCache::batch() const {
  return st_->batch;
}
int64_t SnapkvSkvqCache::n_kv_heads() const {
  return st_->heads;
}
int64_t SnapkvSkvqCache::packed_rows() const {
  return st_->packed();
}
int64_t SnapkvSkvqCache::fp_rows() const {
  return st_->sinks.count + st_->tail.count;
}
const std::vector<int32_t>& SnapkvSkvqCache::key_perms() const {
  return st_->tr.perm_k;
}
const std::vector<int32_t>& SnapkvSkvqCache::value_perms() const {
  return st_->tr.perm_v;
}
DType SnapkvSkvqCache::storage_dtype() const {
  return st_->dtype;
}

std::vector<int32_t> SnapkvSkvqCache::stored_positions(int64_t b, int64_t h) const {
  const SnapSkvqState& st = *st_;
  VQ_CHECK(b >= 0 && b < st.batch && h >= 0 && h < st.heads,
           "[snapkv+skvq] expected (b, h) within [" + std::to_string(st.batch) + ", " +
               std::to_string(st.heads) + ") but got (" + std::to_string(b) + ", " +
               std::to_string(h) + ")");
  std::vector<int32_t> p;
  for (int64_t i = 0; i < st.sinks.count; ++i) p.push_back(static_cast<int32_t>(i));
  const int64_t bh = b * st.heads + h;
  for (const auto& blk : st.blocks)
    for (int64_t i = 0; i < blk->rows; ++i) p.push_back(block_pos(*blk, bh, i));
  for (int64_t i = 0; i < st.tail.count; ++i) p.push_back(st.tail.position(b, h, i));
  return p;
}

CacheView SnapkvSkvqCache::stored_view() const {
  return make_view(&st_->stored_tail_pos);
}

CacheView SnapkvSkvqCache::make_view(std::vector<int32_t>* tail_pos) const {
  SnapSkvqState& st = *st_;
  CacheView view;
  view.batch = st.batch;
  view.n_kv_heads = st.heads;
  view.head_dim = set_->head_dim;
  if (!st.has_data) return view;
  if (st.sinks.count > 0) {
    ViewSegment seg;
    seg.n_rows = st.sinks.count;
    seg.keys = st.sinks.k_view(0, st.sinks.count);
    seg.values = st.sinks.v_view(0, st.sinks.count);
    view.segments.push_back(seg);
  }
  for (const auto& blk : st.blocks) {
    ViewSegment seg;
    seg.n_rows = blk->rows;
    seg.positions = blk->pos.data();
    seg.packed = &blk->seg;
    seg.keys.dtype = seg.values.dtype = st.dtype;
    seg.keys.shape = seg.values.shape = {st.batch, st.heads, blk->rows, set_->head_dim};
    view.segments.push_back(seg);
  }
  if (st.tail.count > 0) {
    const size_t need = static_cast<size_t>(st.batch * st.heads * st.tail.count);
    if (tail_pos->capacity() > 2 * need + 64) std::vector<int32_t>().swap(*tail_pos);
    tail_pos->resize(need);
    for (int64_t b = 0; b < st.batch; ++b)
      for (int64_t h = 0; h < st.heads; ++h)
        for (int64_t i = 0; i < st.tail.count; ++i)
          (*tail_pos)[static_cast<size_t>((b * st.heads + h) * st.tail.count + i)] =
              st.tail.position(b, h, i);
    ViewSegment seg;
    seg.n_rows = st.tail.count;
    seg.positions = tail_pos->data();
    seg.keys = st.tail.k_view(0, st.tail.count);
    seg.values = st.tail.v_view(0, st.tail.count);
    view.segments.push_back(seg);
  }
  return view;
}

namespace {

// SnapKV selection over the whole frame (sinks ++ packed ++ tail) of every (b, h), scored with the
// last min(obs_window, n_new) rows of queries (nullptr = key proxy), whose positions are the
// frame's last ones; the survivors replace the store (what the last view reads is retired).
void evict_frame(SnapSkvqState& st, const Settings& s, const CacheConfig& cfg,
                 const TensorView* queries, int64_t n_new) {
  const int64_t bsz = st.batch, heads = st.heads, d = s.head_dim;
  const int64_t n_s = st.sinks.count, n_p = st.packed(), n_t = st.tail.count;
  const int64_t n = n_s + n_p + n_t;
  const SnapSelectParams sp = SnapSelectParams::from_config(cfg);
  const int64_t count = snap_keep_count(n, sp);
  if (count < n) {
    const int64_t bh_total = bsz * heads;
    // Packed frame row -> (block, row).
    std::vector<std::pair<int32_t, int32_t>> pmap;
    for (size_t bi = 0; bi < st.blocks.size(); ++bi)
      for (int64_t i = 0; i < st.blocks[bi]->rows; ++i)
        pmap.push_back({static_cast<int32_t>(bi), static_cast<int32_t>(i)});
    std::vector<int64_t> idx(static_cast<size_t>(bh_total * count));
    std::vector<int64_t> p_kept(static_cast<size_t>(bh_total), 0);
    const int64_t n_rep = queries ? queries->shape[1] / heads : 0;
    const int64_t w_q =
        queries ? std::min(std::clamp<int64_t>(cfg.snap_obs_window, 1, n), n_new) : 0;
    std::exception_ptr failure;
#pragma omp parallel
    {
      SnapScratch scratch;
      std::vector<float> frame(static_cast<size_t>(n * d)), qwin;
      std::vector<int32_t> pos(static_cast<size_t>(n)), qpos(static_cast<size_t>(w_q));
#pragma omp for schedule(dynamic, 1)
      for (int64_t bh = 0; bh < bh_total; ++bh) {
        try {
          const int64_t b = bh / heads, h = bh % heads;
          for (int64_t j = 0; j < n; ++j) {
            float* out = frame.data() + j * d;
            if (j < n_s) {
              skvq::fast_to_f32(st.sinks.k_row(b, h, j), st.dtype, out, static_cast<size_t>(d));
              pos[j] = static_cast<int32_t>(j);
            } else if (j < n_s + n_p) {
              const auto [bi, i] = pmap[static_cast<size_t>(j - n_s)];
              dequantize_row(st.blocks[bi]->seg.keys, b, h, i, out);
              pos[j] = block_pos(*st.blocks[bi], bh, i);
            } else {
              skvq::fast_to_f32(st.tail.k_row(b, h, j - n_s - n_p), st.dtype, out,
                                static_cast<size_t>(d));
              pos[j] = st.tail.position(b, h, j - n_s - n_p);
            }
          }
          SnapQueryWindow qw;
          if (queries) {
            qwin.resize(static_cast<size_t>(n_rep * w_q * d));
            for (int64_t r = 0; r < n_rep; ++r)
              for (int64_t i = 0; i < w_q; ++i)
                convert_view_row(*queries, b, h * n_rep + r, n_new - w_q + i,
                                 qwin.data() + (r * w_q + i) * d, DType::kF32);
            for (int64_t i = 0; i < w_q; ++i) qpos[i] = static_cast<int32_t>(st.offset - w_q + i);
            qw.data = qwin.data();
            qw.n_rep = n_rep;
            qw.w = w_q;
            qw.positions = qpos.data();
          }
          int64_t* out_idx = idx.data() + bh * count;
          const int64_t got = snap_select_head(frame.data(), queries ? pos.data() : nullptr, n, d,
                                               queries ? &qw : nullptr, sp, out_idx, scratch);
          VQ_CHECK(got == count, "[snapkv+skvq] internal: head selected " + std::to_string(got) +
                                     " rows, expected " + std::to_string(count));
          for (int64_t i = 0; i < std::min(n_s, count); ++i)
            VQ_CHECK(out_idx[i] == i, "[snapkv+skvq] internal: a sink row was not kept");
          int64_t pk = 0;
          for (int64_t i = 0; i < count; ++i) pk += out_idx[i] >= n_s && out_idx[i] < n_s + n_p;
          p_kept[static_cast<size_t>(bh)] = pk;
        } catch (...) {
#pragma omp critical(vq_snapkv_skvq_failure)
          if (!failure) failure = std::current_exception();
        }
      }
    }
    if (failure) std::rethrow_exception(failure);

    const int64_t n_s2 = std::min(n_s, count);
    const int64_t p2 = *std::max_element(p_kept.begin(), p_kept.end());
    const int64_t f2 = count - n_s2 - p2;
    // New sinks (only when the budget cuts into them).
    FpRows sinks2;
    const bool new_sinks = n_s2 < n_s;
    if (new_sinks) {
      sinks2.init(st.dtype, bsz, heads, d, false);
      sinks2.reserve_append(n_s2);
      for (int64_t b = 0; b < bsz; ++b)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < n_s2; ++i) {
            std::memcpy(sinks2.k_row(b, h, i), st.sinks.k_row(b, h, i), d * dtype_size(st.dtype));
            std::memcpy(sinks2.v_row(b, h, i), st.sinks.v_row(b, h, i), d * dtype_size(st.dtype));
          }
      sinks2.count = n_s2;
    }
    auto blk2 = std::make_unique<PackedBlock>();
    blk2->rows = p2;
    blk2->k.resize(static_cast<size_t>(bh_total * p2 * s.fk.row_stride));
    blk2->v.resize(static_cast<size_t>(bh_total * p2 * s.fv.row_stride));
    blk2->pos.resize(static_cast<size_t>(bh_total * p2));
    FpRows tail2;
    tail2.init(st.dtype, bsz, heads, d, true);
    tail2.reserve_append(f2);
    tail2.count = f2;
    const size_t row_bytes = static_cast<size_t>(d) * dtype_size(st.dtype);
#pragma omp parallel
    {
      std::vector<float> kr, vr;
#pragma omp for schedule(dynamic, 1)
      for (int64_t bh = 0; bh < bh_total; ++bh) {
        const int64_t b = bh / heads, h = bh % heads;
        const int64_t* sel = idx.data() + bh * count;
        int64_t at = 0;  // packed rows written
        int64_t i = n_s2;
        for (; i < count && sel[i] < n_s + n_p; ++i, ++at) {  // kept packed rows: copy codes
          const auto [bi, r] = pmap[static_cast<size_t>(sel[i] - n_s)];
          const PackedBlock& src = *st.blocks[bi];
          std::memcpy(blk2->k.data() + (bh * p2 + at) * s.fk.row_stride,
                      src.k.data() + (bh * src.rows + r) * s.fk.row_stride,
                      static_cast<size_t>(s.fk.row_stride));
          std::memcpy(blk2->v.data() + (bh * p2 + at) * s.fv.row_stride,
                      src.v.data() + (bh * src.rows + r) * s.fv.row_stride,
                      static_cast<size_t>(s.fv.row_stride));
          blk2->pos[static_cast<size_t>(bh * p2 + at)] = block_pos(src, bh, r);
        }
        const int64_t early = p2 - at;  // full-precision rows quantized to equalise heads
        if (early > 0) {
          kr.resize(static_cast<size_t>(early * d));
          vr.resize(kr.size());
          for (int64_t e = 0; e < early; ++e) {
            const int64_t t = sel[i + e] - n_s - n_p;
            skvq::fast_to_f32(st.tail.k_row(b, h, t), st.dtype, kr.data() + e * d,
                              static_cast<size_t>(d));
            skvq::fast_to_f32(st.tail.v_row(b, h, t), st.dtype, vr.data() + e * d,
                              static_cast<size_t>(d));
            blk2->pos[static_cast<size_t>(bh * p2 + at + e)] = st.tail.position(b, h, t);
          }
          skvq::quantize_head_rows(kr.data(), early, h, s, st.tr, false,
                                   blk2->k.data() + (bh * p2 + at) * s.fk.row_stride);
          skvq::quantize_head_rows(vr.data(), early, h, s, st.tr, true,
                                   blk2->v.data() + (bh * p2 + at) * s.fv.row_stride);
          i += early;
        }
        for (int64_t f = 0; i < count; ++i, ++f) {  // remaining full-precision rows
          const int64_t t = sel[i] - n_s - n_p;
          std::memcpy(tail2.k_row(b, h, f), st.tail.k_row(b, h, t), row_bytes);
          std::memcpy(tail2.v_row(b, h, f), st.tail.v_row(b, h, t), row_bytes);
          tail2.position(b, h, f) = st.tail.position(b, h, t);
        }
      }
    }
    // Retire what the view references; install the new store.
    for (auto& blk : st.blocks) st.retired_blocks.push_back(std::move(blk));
    st.blocks.clear();
    if (p2 > 0) {
      blk2->bind(bsz, heads, s, st.tr, st.dtype);
      st.blocks.push_back(std::move(blk2));
    }
    st.retired_rows.push_back(std::move(st.tail));
    st.tail = std::move(tail2);
    if (new_sinks) {
      st.retired_rows.push_back(std::move(st.sinks));
      st.sinks = std::move(sinks2);
    }
  }
}

// Packs the tail's oldest `window` rows while it holds >= window + recent.
void flush_tail(SnapSkvqState& st, const Settings& s) {
  const int64_t bsz = st.batch, heads = st.heads, d = s.head_dim, w = s.window;
  while (st.tail.count >= s.flush_span) {
    auto blk = std::make_unique<PackedBlock>();
    blk->rows = w;
    const int64_t bh_total = bsz * heads;
    blk->k.resize(static_cast<size_t>(bh_total * w * s.fk.row_stride));
    blk->v.resize(static_cast<size_t>(bh_total * w * s.fv.row_stride));
    blk->pos.resize(static_cast<size_t>(bh_total * w));
#pragma omp parallel if (bh_total > 1)
    {
      std::vector<float> kr(static_cast<size_t>(w * d)), vr(kr.size());
#pragma omp for schedule(dynamic, 1)
      for (int64_t bh = 0; bh < bh_total; ++bh) {
        const int64_t b = bh / heads, h = bh % heads;
        for (int64_t i = 0; i < w; ++i) {
          skvq::fast_to_f32(st.tail.k_row(b, h, i), st.dtype, kr.data() + i * d,
                            static_cast<size_t>(d));
          skvq::fast_to_f32(st.tail.v_row(b, h, i), st.dtype, vr.data() + i * d,
                            static_cast<size_t>(d));
          blk->pos[static_cast<size_t>(bh * w + i)] = st.tail.position(b, h, i);
        }
        skvq::quantize_head_rows(kr.data(), w, h, s, st.tr, false,
                                 blk->k.data() + bh * w * s.fk.row_stride);
        skvq::quantize_head_rows(vr.data(), w, h, s, st.tr, true,
                                 blk->v.data() + bh * w * s.fv.row_stride);
      }
    }
    blk->bind(bsz, heads, s, st.tr, st.dtype);
    st.blocks.push_back(std::move(blk));
    st.tail.pop_front(w);  // no data moves: the view still reads these rows
  }
}

}  // namespace

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

void SnapkvSkvqCache::end_prompt() {
  SnapSkvqState& st = *st_;
  if (!st.pending) return;
  TensorView q;
  st.retired_blocks.clear();
  st.retired_rows.clear();
  evict_frame(st, *set_, *cfg_, st.win.view(st.batch, set_->head_dim, &q), st.win.rows);
  flush_tail(st, *set_);
  st.pending = false;
  st.win.clear();
  // No view references the old rows any more (end_prompt invalidates the last view).
  st.retired_blocks.clear();
  st.retired_rows.clear();
}

CacheView SnapkvSkvqCache::update_and_fetch(const TensorView& keys, const TensorView& values,
                                            const UpdateOptions& opts) {
  const Settings& s = *set_;
  const CacheConfig& cfg = *cfg_;
  SnapSkvqState& st = *st_;
  // ---- validation (nothing changes before it passes)
  VQ_CHECK(keys.shape == values.shape, "[snapkv+skvq] expected values of the keys' shape " +
                                           skvq::shape_str(keys) + " but got " +
                                           skvq::shape_str(values));
  VQ_CHECK(
      keys.shape[0] >= 1 && keys.shape[1] >= 1 && keys.shape[2] >= 0 && keys.shape[3] == s.head_dim,
      "[snapkv+skvq] expected keys [B>=1, H>=1, S>=0, " + std::to_string(s.head_dim) +
          " (head_dim)] but got " + skvq::shape_str(keys));
  VQ_CHECK((keys.data && values.data) || keys.numel() == 0,
           "[snapkv+skvq] expected keys and values data but got nullptr");
  if (st.has_data)
    VQ_CHECK(keys.shape[0] == st.batch && keys.shape[1] == st.heads,
             "[snapkv+skvq] expected keys [" + std::to_string(st.batch) + ", " +
                 std::to_string(st.heads) + ", S, D] (fixed by the first call) but got " +
                 skvq::shape_str(keys));
  const int64_t n_new = keys.shape[2];
  if (s.max_ctx > 0 && st.offset + n_new > s.max_ctx)
    throw Error("[snapkv+skvq] skvq_max_ctx: expected at most " + std::to_string(s.max_ctx) +
                " tokens but this call would reach " + std::to_string(st.offset + n_new) +
                "; nothing was changed");
  VQ_CHECK(st.offset + n_new <= INT32_MAX,
           "[snapkv+skvq] expected positions to fit int32 but offset " + std::to_string(st.offset) +
               " + S " + std::to_string(n_new) + " does not");
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
  if (!st.has_data) {
    skvq::Transforms tr = skvq::initial_transforms(s, keys.shape[1], kOp);  // may throw
    st.has_data = true;
    st.dtype = snap_storage_dtype(cfg.snap_dtype, keys.dtype, values.dtype);
    st.batch = keys.shape[0];
    st.heads = keys.shape[1];
    st.tr = std::move(tr);
    st.sinks.init(st.dtype, st.batch, st.heads, s.head_dim, false);
    st.tail.init(st.dtype, st.batch, st.heads, s.head_dim, true);
  }
  // A single-token call after a prompt whose eviction is still owed: the prompt is over.
  if (cfg.snap_evict_at == SnapEvictAt::kPromptEnd && st.pending && n_new == 1) end_prompt();
  // The previous view is over: free what only it used.
  st.retired_blocks.clear();
  st.retired_rows.clear();

  // ---- 1. append (positions < n_s extend the sinks while they are contiguous)
  const int64_t bsz = st.batch, heads = st.heads, d = s.head_dim;
  const int64_t n_s_max = n_fp_sinks(cfg);
  int64_t to_sinks = 0;
  while (to_sinks < n_new && st.offset + to_sinks < n_s_max &&
         st.offset + to_sinks == st.sinks.count + to_sinks && st.tail.count == 0 &&
         st.blocks.empty())
    ++to_sinks;
  if (to_sinks > 0) {
    st.sinks.reserve_append(to_sinks);
    for (int64_t b = 0; b < bsz; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < to_sinks; ++i) {
          convert_view_row(keys, b, h, i, st.sinks.k_row(b, h, st.sinks.count + i), st.dtype);
          convert_view_row(values, b, h, i, st.sinks.v_row(b, h, st.sinks.count + i), st.dtype);
        }
    st.sinks.count += to_sinks;
  }
  st.tail.reserve_append(n_new - to_sinks);
  for (int64_t b = 0; b < bsz; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = to_sinks; i < n_new; ++i) {
        const int64_t r = st.tail.count + i - to_sinks;
        convert_view_row(keys, b, h, i, st.tail.k_row(b, h, r), st.dtype);
        convert_view_row(values, b, h, i, st.tail.v_row(b, h, r), st.dtype);
        st.tail.position(b, h, r) = static_cast<int32_t>(st.offset + i);
      }
  st.tail.count += n_new - to_sinks;
  st.offset += n_new;

  // ---- 2. the view: stored ++ new, as they are now
  CacheView view = make_view(&st.view_tail_pos);

  // ---- 3. permutations from the frame's first `window` rows (all full precision here)
  const int64_t w = s.window;
  auto frame_fp_row = [&](int64_t b, int64_t h, int64_t j) -> std::pair<const char*, const char*> {
    if (j < st.sinks.count) return {st.sinks.k_row(b, h, j), st.sinks.v_row(b, h, j)};
    const int64_t t = j - st.sinks.count - st.packed();
    return {st.tail.k_row(b, h, t), st.tail.v_row(b, h, t)};
  };
  if (s.reorder && !st.tr.has_perms() && stored_rows() >= w) {
    VQ_CHECK(st.blocks.empty(), "[snapkv+skvq] internal: packed rows without permutations");
    std::vector<int32_t> pk(static_cast<size_t>(heads * d)), pv(pk.size());
    std::vector<float> kr(static_cast<size_t>(bsz * w * d)), vr(kr.size());
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t b = 0; b < bsz; ++b)
        for (int64_t j = 0; j < w; ++j) {
          const auto [kp, vp] = frame_fp_row(b, h, j);
          skvq::fast_to_f32(kp, st.dtype, kr.data() + (b * w + j) * d, static_cast<size_t>(d));
          skvq::fast_to_f32(vp, st.dtype, vr.data() + (b * w + j) * d, static_cast<size_t>(d));
        }
      const auto a = skvq::channel_range_perm(kr.data(), bsz * w, d);
      const auto v = skvq::channel_range_perm(vr.data(), bsz * w, d);
      std::copy(a.begin(), a.end(), pk.begin() + h * d);
      std::copy(v.begin(), v.end(), pv.begin() + h * d);
    }
    st.tr.perm_k = std::move(pk);
    st.tr.perm_v = std::move(pv);
  }

  // ---- 4. eviction (S > 1), 5. flush; with snap_evict_at = prompt_end both wait for the end
  // of the prompt (the rows stay at full precision meanwhile, as one-shot prefill keeps them)
  if (cfg.snap_evict_at == SnapEvictAt::kPromptEnd) {
    if (n_new > 1) {
      st.pending = true;
      st.win.keep(queries, cfg.snap_obs_window);
    }
    if (st.pending) return view;
  } else if (n_new > 1) {
    evict_frame(st, s, cfg, queries, n_new);
  }
  flush_tail(st, s);
  return view;
}

CacheStats SnapkvSkvqCache::stats() const {
  const Settings& s = *set_;
  const SnapSkvqState& st = *st_;
  const int64_t bh = st.batch * st.heads, d = s.head_dim;
  CacheStats cs;
  cs.method = method();
  cs.tokens_seen = st.offset;
  const int64_t rows = stored_rows(), n_p = st.packed(), n_fp = fp_rows();
  cs.rows_stored = rows;
  int64_t comp_k = 0, comp_v = 0;
  for (const auto& blk : st.blocks) {
    comp_k +=
        skvq_compressed_bytes(blk->rows, d, s.qk.bits, s.qk.group_size, s.qk.meta).total() * bh;
    comp_v +=
        skvq_compressed_bytes(blk->rows, d, s.qv.bits, s.qv.group_size, s.qv.meta).total() * bh;
  }
  const int64_t residual = n_fp * d * 2 * 2 * bh;
  const int64_t perm_bytes = st.tr.has_perms() ? 2 * st.heads * d * 4 : 0;
  const int64_t fp16_k = bh * st.offset * d * 2;
  const double kept_k = static_cast<double>(bh * rows * d * 2);
  cs.bytes_accounted = comp_k + comp_v + residual + perm_bytes;
  cs.fp16_bytes = 2 * fp16_k;
  int64_t resident = st.sinks.resident_bytes() + st.tail.resident_bytes() +
                     static_cast<int64_t>((st.tr.perm_k.capacity() + st.tr.perm_v.capacity() +
                                           st.tr.signs.capacity() + st.view_tail_pos.capacity() +
                                           st.stored_tail_pos.capacity()) *
                                          4);
  for (const auto& blk : st.blocks) resident += blk->resident_bytes();
  for (const auto& blk : st.retired_blocks) resident += blk->resident_bytes();
  for (const auto& r : st.retired_rows) resident += r.resident_bytes();
  cs.bytes_resident = resident;
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
      {"key_perms", st.tr.has_perms() ? 1.0 : 0.0},
      {"value_perms", st.tr.has_perms() ? 1.0 : 0.0},
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
  const CacheConfig& c = *cfg_;
  StateWriter w;
  set_->save(w);
  write_snapkv_skvq_settings(w, c);
  w.boolean(st.has_data);
  if (st.has_data) {
    w.u8(static_cast<uint8_t>(st.dtype));
    w.i64(st.batch);
    w.i64(st.heads);
    w.i64(st.offset);
    st.tr.save(w);
    st.sinks.save(w);
    w.u64(st.blocks.size());
    for (const auto& blk : st.blocks) {
      w.i64(blk->rows);
      w.blob(blk->k.data(), blk->k.size());
      w.blob(blk->v.data(), blk->v.size());
      w.vec_i32(blk->pos);
    }
    st.tail.save(w);
    w.boolean(st.pending);
    w.i64(st.win.hq);
    w.i64(st.win.rows);
    w.vec_f32(st.win.q);
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
  auto ns = std::make_unique<SnapSkvqState>();
  ns->has_data = r.boolean();
  if (ns->has_data) {
    const uint8_t dt = r.u8();
    VQ_CHECK(dt == static_cast<uint8_t>(DType::kF16) || dt == static_cast<uint8_t>(DType::kBF16),
             pre + "expected an fp16 or bf16 storage dtype but got code " + std::to_string(dt));
    ns->dtype = static_cast<DType>(dt);
    ns->batch = r.i64_in("batch", 1, 1 << 20);
    ns->heads = r.i64_in("heads", 1, 1 << 20);
    ns->offset = r.i64_in("offset", 0, s.max_ctx > 0 ? s.max_ctx : INT32_MAX);
    const int64_t d = s.head_dim, bh = ns->batch * ns->heads;
    ns->tr = skvq::Transforms::load(r, ns->heads, d, kOp);
    VQ_CHECK(ns->tr.signs.empty() == !s.rotate,
             pre + "expected rotation signs exactly when skvq_rotation is on");
    ns->sinks.init(ns->dtype, ns->batch, ns->heads, d, false);
    ns->sinks.load(r, kOp);
    VQ_CHECK(ns->sinks.count <= std::min(n_fp_sinks(c), ns->offset),
             pre + "expected at most " + std::to_string(n_fp_sinks(c)) + " sink rows");
    const uint64_t n_blocks = r.u64();
    VQ_CHECK(n_blocks <= static_cast<uint64_t>(ns->offset) + 1,
             pre + "expected at most one packed block per token");
    for (uint64_t i = 0; i < n_blocks; ++i) {
      auto blk = std::make_unique<PackedBlock>();
      blk->rows = r.i64_in("packed rows", 1, ns->offset);
      const std::string kb = r.blob(), vb = r.blob();
      blk->pos = r.vec_i32();
      VQ_CHECK(static_cast<int64_t>(kb.size()) == bh * blk->rows * s.fk.row_stride &&
                   static_cast<int64_t>(vb.size()) == bh * blk->rows * s.fv.row_stride &&
                   static_cast<int64_t>(blk->pos.size()) == bh * blk->rows,
               pre + "expected packed block sizes of the row format");
      blk->k.assign(kb.begin(), kb.end());
      blk->v.assign(vb.begin(), vb.end());
      ns->blocks.push_back(std::move(blk));
    }
    VQ_CHECK(n_blocks == 0 || !s.reorder || ns->tr.has_perms(),
             pre + "expected permutations with packed rows and reordering on");
    ns->tail.init(ns->dtype, ns->batch, ns->heads, d, true);
    ns->tail.load(r, kOp);
    ns->pending = r.boolean();
    ns->win.hq = r.i64_in("win_hq", 0, ns->pending ? 256 * ns->heads : 0);
    // The window rows are the last rows of the last prompt chunk; a chunk shorter than the sink
    // count stores them among the full-precision sinks, so both stores bound them.
    ns->win.rows =
        r.i64_in("win_rows", 0, std::min(c.snap_obs_window, ns->sinks.count + ns->tail.count));
    ns->win.q = r.vec_f32();
    VQ_CHECK(!ns->pending || c.snap_evict_at == SnapEvictAt::kPromptEnd,
             pre +
                 "expected no pending eviction (snap_evict_at = prefill_call) but the state "
                 "has one");
    VQ_CHECK((ns->win.hq == 0) == (ns->win.rows == 0) &&
                 (ns->win.hq == 0 || ns->win.hq % ns->heads == 0) &&
                 static_cast<int64_t>(ns->win.q.size()) ==
                     bh * (ns->win.hq / ns->heads) * ns->win.rows * d,
             pre + "expected a query window [B, H_q (a multiple of H), rows, D] of " +
                 std::to_string(ns->win.hq) + " heads and " + std::to_string(ns->win.rows) +
                 " rows but got " + std::to_string(ns->win.q.size()) + " values");
    // A pending prompt keeps every row at full precision until its selection and flush.
    VQ_CHECK(ns->pending || ns->tail.count < s.flush_span,
             pre + "expected fewer than window + recent full-precision tail rows");
    // Positions strictly ascending per (b, h) and below offset (no loop over (b, h) when no row
    // is stored: B * H alone may be near 2^48 in a corrupted state).
    int64_t rows_per_frame = ns->tail.count;
    for (const auto& blk : ns->blocks) rows_per_frame += blk->rows;
    for (int64_t b = 0; b < ns->batch && rows_per_frame > 0; ++b)
      for (int64_t h = 0; h < ns->heads; ++h) {
        int64_t prev = ns->sinks.count - 1;
        auto next = [&](int64_t p) {
          VQ_CHECK(p > prev && p < ns->offset,
                   pre + "expected ascending positions below offset but got " + std::to_string(p));
          prev = p;
        };
        for (const auto& blk : ns->blocks)
          for (int64_t i = 0; i < blk->rows; ++i) next(block_pos(*blk, b * ns->heads + h, i));
        for (int64_t i = 0; i < ns->tail.count; ++i) next(ns->tail.position(b, h, i));
      }
    for (auto& blk : ns->blocks) blk->bind(ns->batch, ns->heads, s, ns->tr, ns->dtype);
  }
  r.expect_end();
  st_.swap(ns);
}

}  // namespace vq
