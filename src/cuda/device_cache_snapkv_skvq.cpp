// The GPU-resident snapkv+skvq cache (method "snapkv+skvq", docs/design.md §C5): the device twin of
// vq::SnapkvSkvqCache (veloxquant/snapkv_skvq_cache.h) with the same call sequence, selection,
// per-row representation, sinks, flush and figures.
//
// Storage (cudaMalloc), per frame f = b*H + h:
//   sinks [F, scap, D] (positions 0..n_sinks-1 implicit, full precision),
//   packed records keys [F, pcap, fk.row_stride], values [F, pcap, fv.row_stride] bytes with
//     explicit positions [F, pcap] int32 (rows 0..n_packed-1),
//   the full-precision tail [F, tcap, D] with explicit positions [F, tcap] (live rows
//     [tstart, tstart + tcount)),
// full-precision rows in fp16 or bf16 (the snap_dtype rule), permutations [H, D] once frozen.
// The view is [sinks][packed][tail], one segment each (the CPU's packed blocks are consecutive,
// so one device segment holds the same rows in the same order).
// Eviction (after a multi-token call, or at end_prompt with snap_evict_at = prompt_end): the
// frame sinks ++ packed (keys dequantized, dequant_rows) ++ tail is built in fp32 [F, n, D],
// snap_select_frames picks the same rows as the CPU (scores to an ulp of expf: see
// device_cache_snapkv.cpp), the indices come to the host, which plans the gathers: kept packed
// records are copied byte for byte, the oldest kept tail rows of heads that kept fewer packed
// rows than the most are quantized early (skvq_quantize_rows, bit-identical to the CPU), the
// other tail rows are copied. Flush: while the tail holds >= window + skvq_recent rows its oldest
// `window` rows are packed and appended. Buffers the returned view still reads are retired until
// the next mutating call. With skvq_rotation = hadamard (rotation replaces reordering, as on the
// CPU) keys, and values with skvq_rotate_values, are rotated before grouping (skvq_quantize_rows
// with the signs), the scoring frame un-rotates the dequantized keys exactly as the CPU's
// dequantize_row (dequant_rows), and the view's packed segment carries the signs (decode_attention
// rotates the query; prefill_attention refuses rotated segments, as for the skvq device cache).
// State: vq::SnapkvSkvqCache's stream, written and read with its own pieces (skvq::Settings,
// Transforms and FpRows of kv/skvq_store.h): the packed store is cut into (and rebuilt from)
// the CPU's blocks (block_rows_), each with its records and explicit positions.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <istream>
#include <ostream>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/device_cache_dequant.cuh"
#include "cuda/device_cache_util.h"
#include "kv/skvq_store.h"
#include "veloxquant/error.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/snapkv.h"
#include "veloxquant/snapkv_skvq_cache.h"

namespace vq::cuda {

namespace {

constexpr const char* kOp = "snapkv+skvq";

class SnapkvSkvqDeviceCache final : public DeviceKVCache {
 public:
  SnapkvSkvqDeviceCache(const CacheConfig& cfg, int64_t b, int64_t h, int64_t d, Stream s)
      : DeviceKVCache(b, h, d, s),
        cfg_(cfg),
        set_(skvq::Settings::from_config(cfg, 0, kOp)),
        params_(SnapSelectParams::from_config(cfg)),
        n_s_max_(std::min(cfg.skvq_n_sink, std::max<int64_t>(cfg.snap_n_sink, 0))) {}

  std::string method() const override { return "snapkv+skvq"; }

  DeviceCacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                                   const DeviceUpdateOptions& opts) override {
    const skvq::Settings& s = set_;
    detail::check_blocks(keys, values, batch_, heads_, head_dim_, "cuda snapkv+skvq");
    const int64_t n_new = keys.shape[2];
    if (s.max_ctx > 0 && offset_ + n_new > s.max_ctx)
      throw Error("[cuda snapkv+skvq] skvq_max_ctx: expected at most " + std::to_string(s.max_ctx) +
                  " tokens but this call would reach " + std::to_string(offset_ + n_new) +
                  "; nothing was changed");
    VQ_CHECK(offset_ + n_new <= INT32_MAX,
             "[cuda snapkv+skvq] expected positions to fit int32 but offset " +
                 std::to_string(offset_) + " + S " + std::to_string(n_new) + " does not");
    const TensorView* queries = cfg_.snap_scoring == SnapScoring::kQuery ? opts.queries : nullptr;
    if (queries) {
      const TensorView& q = *queries;
      VQ_CHECK(static_cast<uint8_t>(q.dtype) <= static_cast<uint8_t>(DType::kBF16) &&
                   (q.data != nullptr || q.numel() == 0),
               "[cuda snapkv+skvq] expected device queries of dtype float32/float16/bfloat16");
      VQ_CHECK(q.shape[0] == batch_ && q.shape[2] == n_new && q.shape[3] == head_dim_ &&
                   q.shape[1] >= heads_ && q.shape[1] % heads_ == 0,
               "[cuda snapkv+skvq] expected queries [" + std::to_string(batch_) +
                   ", H_q (a multiple of " + std::to_string(heads_) + "), " +
                   std::to_string(n_new) + ", " + std::to_string(head_dim_) + "] but got " +
                   detail::shape_str(q));
    }
    const int64_t F = batch_ * heads_;
    if (!has_data_) {
      skvq::Transforms tr = skvq::initial_transforms(s, heads_, kOp);  // may throw
      dtype_ = snap_storage_dtype(cfg_.snap_dtype, keys.dtype, values.dtype);
      detail::upload_transforms(tr, perm_k_, perm_v_, signs_, stream_);
      tr_ = std::move(tr);
      has_data_ = true;
    }
    // A single-token call after a prompt whose eviction is still owed: the prompt is over.
    if (cfg_.snap_evict_at == SnapEvictAt::kPromptEnd && pending_ && n_new == 1) end_prompt();
    release_retired();  // the previous view is over

    // ---- 1. append (positions < n_s extend the sinks while they are contiguous)
    int64_t to_sinks = 0;
    while (to_sinks < n_new && offset_ + to_sinks < n_s_max_ && offset_ == n_sinks_ &&
           tcount_ == 0 && n_packed_ == 0)
      ++to_sinks;
    if (to_sinks > 0) {
      if (!sk_.data()) {
        scap_ = n_s_max_;
        sk_ = DeviceBuffer(static_cast<size_t>(F * scap_ * row_bytes()));
        sv_ = DeviceBuffer(static_cast<size_t>(F * scap_ * row_bytes()));
      }
      detail::convert_block(keys, 0, to_sinks, sk_.data(), dtype_, scap_, n_sinks_, stream_);
      detail::convert_block(values, 0, to_sinks, sv_.data(), dtype_, scap_, n_sinks_, stream_);
      n_sinks_ += to_sinks;
    }
    const int64_t n_tail_new = n_new - to_sinks;
    tail_reserve(n_tail_new);
    const TensorView kt = keys.slice_tokens(to_sinks, n_new);
    const TensorView vt = values.slice_tokens(to_sinks, n_new);
    detail::convert_block(kt, 0, n_tail_new, tk_.data(), dtype_, tcap_, tstart_ + tcount_, stream_);
    detail::convert_block(vt, 0, n_tail_new, tv_.data(), dtype_, tcap_, tstart_ + tcount_, stream_);
    detail::fill_positions(tpos_.as<int32_t>(), F, tcap_, tstart_ + tcount_, n_tail_new,
                           offset_ + to_sinks, stream_);
    tcount_ += n_tail_new;
    offset_ += n_new;

    // ---- 2. the view: stored ++ new, as they are now
    DeviceCacheView view = stored_view();

    // ---- 3. permutations from the frame's first `window` rows (all full precision here)
    if (s.reorder && !tr_.has_perms() && stored_rows() >= s.window) {
      VQ_CHECK(n_packed_ == 0, "[cuda snapkv+skvq] internal: packed rows without permutations");
      freeze_perms();
    }

    // ---- 4. eviction (S > 1), 5. flush; with snap_evict_at = prompt_end both wait for the end
    // of the prompt
    if (cfg_.snap_evict_at == SnapEvictAt::kPromptEnd) {
      if (n_new > 1) keep_query_window(queries, n_new);
      if (pending_) return view;
    } else if (n_new > 1) {
      evict_frame(queries, n_new);
    }
    flush_tail();
    return view;
  }

  void end_prompt() override {
    if (!pending_) return;
    release_retired();  // end_prompt invalidates the last view
    TensorView q;
    if (win_rows_ > 0)
      q = TensorView::contiguous(win_q_.data(), DType::kF32, batch_, win_hq_, win_rows_, head_dim_);
    evict_frame(win_rows_ > 0 ? &q : nullptr, win_rows_);
    flush_tail();
    pending_ = false;
    win_hq_ = win_rows_ = 0;
    win_q_ = DeviceBuffer();
    release_retired();
  }

  DeviceCacheView stored_view() const override {
    DeviceCacheView view(batch_, heads_, head_dim_);
    if (!has_data_) return view;
    if (n_sinks_ > 0) {
      DeviceSegment seg;
      seg.n_rows = n_sinks_;
      seg.capacity = scap_;
      seg.first_pos = 0;
      seg.dtype = dtype_;
      seg.keys = sk_.data();
      seg.values = sv_.data();
      view.add_segment(seg);
    }
    if (n_packed_ > 0) {
      DeviceSegment seg;
      seg.n_rows = n_packed_;
      seg.capacity = pcap_;
      seg.positions = ppos_.as<const int32_t>();
      seg.packed = true;
      seg.dtype = dtype_;
      seg.k_fmt = set_.fk;
      seg.v_fmt = set_.fv;
      seg.k_data = pk_.as<const uint8_t>();
      seg.v_data = pv_.as<const uint8_t>();
      seg.k_perm = perm_k_.as<const int32_t>();
      seg.v_perm = perm_v_.as<const int32_t>();
      for (int kv = 0; kv < 2; ++kv)
        if (rotated(kv == 1)) {
          (kv == 0 ? seg.k_signs : seg.v_signs) = signs_.as<const float>();
          (kv == 0 ? seg.k_rot_block : seg.v_rot_block) = tr_.rot_block;
        }
      view.add_segment(seg);
    }
    if (tcount_ > 0) {
      DeviceSegment seg;
      seg.n_rows = tcount_;
      seg.capacity = tcap_;
      seg.positions = tpos_.as<const int32_t>() + tstart_;
      seg.dtype = dtype_;
      seg.keys = tk_.as<const char>() + tstart_ * row_bytes();
      seg.values = tv_.as<const char>() + tstart_ * row_bytes();
      view.add_segment(seg);
    }
    return view;
  }

  int64_t offset() const override { return offset_; }
  int64_t stored_rows() const override { return n_sinks_ + n_packed_ + tcount_; }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override {
    VQ_CHECK(b >= 0 && b < batch_ && h >= 0 && h < heads_,
             "[cuda snapkv+skvq] expected (b, h) within [" + std::to_string(batch_) + ", " +
                 std::to_string(heads_) + ") but got (" + std::to_string(b) + ", " +
                 std::to_string(h) + ")");
    const int64_t f = b * heads_ + h;
    std::vector<int32_t> p(static_cast<size_t>(stored_rows()));
    for (int64_t i = 0; i < n_sinks_; ++i) p[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    if (n_packed_ > 0)
      ppos_.download(p.data() + n_sinks_, static_cast<size_t>(n_packed_) * 4,
                     static_cast<size_t>(f * pcap_) * 4, stream_);
    if (tcount_ > 0)
      tpos_.download(p.data() + n_sinks_ + n_packed_, static_cast<size_t>(tcount_) * 4,
                     static_cast<size_t>(f * tcap_ + tstart_) * 4, stream_);
    return p;
  }

  Mask make_mask(int64_t n_queries, int64_t window) const override {
    if (pending_ && n_queries == 1)
      return detail::pending_single_query_mask("cuda snapkv+skvq", window,
                                               snap_keep_count(stored_rows(), params_));
    return DeviceKVCache::make_mask(n_queries, window);
  }

  void save(std::ostream& out) const override {
    const skvq::Settings& s = set_;
    const CacheConfig& c = cfg_;
    const int64_t F = batch_ * heads_;
    StateWriter w;
    s.save(w);
    write_snapkv_skvq_settings(w, c);
    w.boolean(has_data_);
    if (has_data_) {
      w.u8(static_cast<uint8_t>(dtype_));
      w.i64(batch_);
      w.i64(heads_);
      w.i64(offset_);
      tr_.save(w);
      detail::download_fp_rows(dtype_, batch_, heads_, head_dim_, sk_, sv_, nullptr, n_sinks_,
                               scap_, 0, stream_)
          .save(w);
      const detail::HostRecords rec = detail::download_records(
          pk_, pv_, F, n_packed_, pcap_, s.fk.row_stride, s.fv.row_stride, stream_);
      const std::vector<uint8_t> pos =
          detail::download_store(ppos_, F, n_packed_, pcap_, 4, stream_);
      w.u64(block_rows_.size());
      int64_t r0 = 0;  // first record of the block in the store
      for (const int64_t rows : block_rows_) {
        w.i64(rows);
        rec.write_block(w, r0, rows);
        const std::vector<uint8_t> bp = detail::slice_frames(pos, F, n_packed_, r0, rows, 4);
        std::vector<int32_t> bpos(static_cast<size_t>(F * rows));
        if (!bp.empty()) std::memcpy(bpos.data(), bp.data(), bp.size());
        w.vec_i32(bpos);
        r0 += rows;
      }
      detail::download_fp_rows(dtype_, batch_, heads_, head_dim_, tk_, tv_, &tpos_, tcount_, tcap_,
                               tstart_, stream_)
          .save(w);
      w.boolean(pending_);
      w.i64(win_hq_);
      w.i64(win_rows_);
      w.vec_f32(win_q_.to_vector<float>(
          static_cast<size_t>(batch_ * win_hq_ * win_rows_ * head_dim_), stream_));
    }
    w.write(out, method());
  }

  void load(std::istream& in) override {
    const skvq::Settings& s = set_;
    StateReader r = detail::read_validated_state(in, cfg_);
    s.check_saved(r, kOp);
    r.i64();  // the snap_* settings: equal to cfg_ (the CPU load checked them)
    r.i64();
    r.i64();
    r.i64();
    r.u8();
    r.boolean();
    r.u8();
    r.u8();
    r.u8();
    SnapkvSkvqDeviceCache fresh(cfg_, batch_, heads_, head_dim_, stream_);
    fresh.has_data_ = r.boolean();
    if (fresh.has_data_) {
      const int64_t D = head_dim_, F = batch_ * heads_;
      fresh.dtype_ = static_cast<DType>(r.u8());
      const int64_t b = r.i64(), h = r.i64();
      detail::check_state_shape(kOp, true, b, h, D, batch_, heads_, head_dim_);
      fresh.offset_ = r.i64();
      fresh.tr_ = skvq::Transforms::load(r, heads_, D, kOp);
      detail::upload_transforms(fresh.tr_, fresh.perm_k_, fresh.perm_v_, fresh.signs_, stream_);
      const skvq::FpRows sinks =
          detail::read_fp_rows(r, fresh.dtype_, batch_, heads_, D, false, kOp);
      fresh.n_sinks_ = sinks.count;
      if (sinks.count > 0) {  // room for the sinks still to come while they grow
        fresh.scap_ = std::max(sinks.count, n_s_max_);
        fresh.sk_ = detail::upload_fp_rows(sinks, false, fresh.scap_, stream_);
        fresh.sv_ = detail::upload_fp_rows(sinks, true, fresh.scap_, stream_);
      }
      const uint64_t n_blocks = r.u64();
      std::vector<std::string> blobs[2];
      std::vector<std::vector<int32_t>> bpos;
      for (uint64_t c = 0; c < n_blocks; ++c) {
        fresh.block_rows_.push_back(r.i64());
        blobs[0].push_back(r.blob());
        blobs[1].push_back(r.blob());
        bpos.push_back(r.vec_i32());
      }
      for (const int64_t n : fresh.block_rows_) fresh.n_packed_ += n;
      fresh.pcap_ = fresh.n_packed_ > 0 ? round_up(fresh.n_packed_, 64) : 0;
      std::vector<const void*> src[3];  // key records, value records, positions
      for (uint64_t c = 0; c < n_blocks; ++c) {
        src[0].push_back(blobs[0][c].data());
        src[1].push_back(blobs[1][c].data());
        src[2].push_back(bpos[c].data());
      }
      const int64_t row_bytes[3] = {s.fk.row_stride, s.fv.row_stride, 4};
      DeviceBuffer* dst[3] = {&fresh.pk_, &fresh.pv_, &fresh.ppos_};
      for (int i = 0; i < 3; ++i)
        *dst[i] =
            detail::upload_blocks(src[i], fresh.block_rows_, F, fresh.pcap_, row_bytes[i], stream_);
      const skvq::FpRows tail = detail::read_fp_rows(r, fresh.dtype_, batch_, heads_, D, true, kOp);
      fresh.tcount_ = tail.count;
      fresh.tcap_ = tail.cap;
      fresh.tk_ = detail::upload_fp_rows(tail, false, tail.cap, stream_);
      fresh.tv_ = detail::upload_fp_rows(tail, true, tail.cap, stream_);
      if (tail.count > 0) {
        fresh.tpos_ = DeviceBuffer(static_cast<size_t>(F * tail.cap * 4));
        detail::upload_frames(fresh.tpos_.data(), tail.cap, 0, tail.pos.data(), tail.cap, F,
                              tail.count, 4, stream_);
      }
      fresh.pending_ = r.boolean();
      fresh.win_hq_ = r.i64();
      fresh.win_rows_ = r.i64();
      const std::vector<float> q = r.vec_f32();
      if (!q.empty()) fresh.win_q_ = DeviceBuffer::from_vector(q, stream_);
    }
    synchronize(stream_);  // the last view is over
    *this = std::move(fresh);
  }

  CacheStats stats() const override {
    const skvq::Settings& s = set_;
    const int64_t bh = batch_ * heads_, d = head_dim_;
    CacheStats cs;
    cs.method = method();
    cs.tokens_seen = offset_;
    const int64_t rows = stored_rows(), n_p = n_packed_, n_fp = n_sinks_ + tcount_;
    cs.rows_stored = rows;
    int64_t comp_k = 0, comp_v = 0;
    for (const int64_t r : block_rows_) {  // per block, as the CPU's byte formula counts them
      comp_k += skvq_compressed_bytes(r, d, s.qk.bits, s.qk.group_size, s.qk.meta).total() * bh;
      comp_v += skvq_compressed_bytes(r, d, s.qv.bits, s.qv.group_size, s.qv.meta).total() * bh;
    }
    const int64_t residual = n_fp * d * 2 * 2 * bh;
    const int64_t perm_bytes = tr_.has_perms() ? 2 * heads_ * d * 4 : 0;
    const int64_t fp16_k = has_data_ ? bh * offset_ * d * 2 : 0;
    const double kept_k = static_cast<double>(bh * rows * d * 2);
    cs.bytes_accounted = comp_k + comp_v + residual + perm_bytes;
    cs.fp16_bytes = 2 * fp16_k;
    cs.bytes_resident = 0;
    for (const DeviceBuffer* b :
         {&sk_, &sv_, &pk_, &pv_, &ppos_, &tk_, &tv_, &tpos_, &perm_k_, &perm_v_, &signs_, &win_q_})
      cs.bytes_resident += detail::held_bytes(*b);
    for (const DeviceBuffer& b : retired_) cs.bytes_resident += detail::held_bytes(b);
    const double tokens_kept = static_cast<double>(bh * rows);
    const double tokens_total = static_cast<double>(bh * offset_);
    cs.figures = {
        {"compressed_key_bytes", static_cast<double>(comp_k)},
        {"compressed_value_bytes", static_cast<double>(comp_v)},
        {"fp16_key_bytes", static_cast<double>(fp16_k)},
        {"fp16_value_bytes", static_cast<double>(fp16_k)},
        {"residual_fp16_bytes", static_cast<double>(residual)},
        {"perm_bytes", static_cast<double>(perm_bytes)},
        {"packed_rows", static_cast<double>(n_p)},
        {"fp_rows", static_cast<double>(n_fp)},
        {"tokens_seen", static_cast<double>(offset_)},
        {"key_perms", tr_.has_perms() ? 1.0 : 0.0},
        {"value_perms", tr_.has_perms() ? 1.0 : 0.0},
        {"assigned_avg_bits",
         n_p > 0 ? 8.0 * static_cast<double>(comp_k) / static_cast<double>(n_p * d * bh) : 16.0},
        {"evicted_key_bytes", kept_k},
        {"evicted_value_bytes", kept_k},
        {"kept_key_bytes", kept_k},
        {"kept_value_bytes", kept_k},
        {"full_key_bytes", static_cast<double>(fp16_k)},
        {"full_value_bytes", static_cast<double>(fp16_k)},
        {"eviction_ratio",
         rows > 0 ? static_cast<double>(offset_) / static_cast<double>(rows) : 1.0},
        {"tokens_kept", tokens_kept},
        {"tokens_total", tokens_total},
        {"keep_rate", tokens_total > 0 ? tokens_kept / tokens_total : 1.0},
    };
    return cs;
  }

 private:
  int64_t row_bytes() const { return head_dim_ * static_cast<int64_t>(dtype_size(dtype_)); }

  // A row store [F, cap, D] of dtype_ as a device TensorView [B, H, n, D].
  TensorView store_view(const DeviceBuffer& b, int64_t n, int64_t cap) const {
    TensorView v;
    v.data = b.data();
    v.dtype = dtype_;
    v.shape = {batch_, heads_, n, head_dim_};
    v.stride = {heads_ * cap * head_dim_, cap * head_dim_, head_dim_, 1};
    return v;
  }

  void retire(DeviceBuffer& b) {
    if (b.data()) retired_.push_back(std::move(b));
    b = DeviceBuffer();
  }
  void release_retired() {
    if (retired_.empty()) return;
    synchronize(stream_);
    retired_.clear();
  }

  // Tail room for `extra` more rows (the CPU FpRows policy: grow to max(need, 2 cap) rounded up
  // to 16 rows, shrink a buffer more than twice its rows, compact when the end is reached).
  // Called only while no view reads the tail (before this call's view is made).
  void tail_reserve(int64_t extra) {
    const int64_t need = tcount_ + extra;
    int64_t new_cap = tcap_;
    if (need > tcap_)
      new_cap = round_up(std::max({need, 2 * tcap_, int64_t{16}}), 16);
    else if (tcap_ > 2 * std::max<int64_t>(need, 16))
      new_cap = round_up(std::max<int64_t>(need, 16), 16);
    if (new_cap == tcap_ && tstart_ + need <= tcap_) return;
    const int64_t F = batch_ * heads_;
    DeviceBuffer nk(static_cast<size_t>(F * new_cap * row_bytes()));
    DeviceBuffer nv(static_cast<size_t>(F * new_cap * row_bytes()));
    DeviceBuffer np(static_cast<size_t>(F * new_cap * 4));
    detail::copy_frames(nk.data(), new_cap, 0, tk_.data(), tcap_, tstart_, F, tcount_, row_bytes(),
                        stream_);
    detail::copy_frames(nv.data(), new_cap, 0, tv_.data(), tcap_, tstart_, F, tcount_, row_bytes(),
                        stream_);
    detail::copy_frames(np.data(), new_cap, 0, tpos_.data(), tcap_, tstart_, F, tcount_, 4,
                        stream_);
    synchronize(stream_);  // the old buffers are freed below
    tk_ = std::move(nk);
    tv_ = std::move(nv);
    tpos_ = std::move(np);
    tcap_ = new_cap;
    tstart_ = 0;
  }

  // Room for `rows` packed records per frame (x1.5 growth in steps of 64 rows); the old buffers
  // are retired (this call's view may read them).
  void packed_reserve(int64_t rows) {
    if (rows <= pcap_) return;
    const int64_t new_cap = round_up(std::max({rows, pcap_ + pcap_ / 2, int64_t{64}}), 64);
    const int64_t F = batch_ * heads_;
    DeviceBuffer nk(static_cast<size_t>(F * new_cap * set_.fk.row_stride));
    DeviceBuffer nv(static_cast<size_t>(F * new_cap * set_.fv.row_stride));
    DeviceBuffer np(static_cast<size_t>(F * new_cap * 4));
    detail::copy_frames(nk.data(), new_cap, 0, pk_.data(), pcap_, 0, F, n_packed_,
                        set_.fk.row_stride, stream_);
    detail::copy_frames(nv.data(), new_cap, 0, pv_.data(), pcap_, 0, F, n_packed_,
                        set_.fv.row_stride, stream_);
    detail::copy_frames(np.data(), new_cap, 0, ppos_.data(), pcap_, 0, F, n_packed_, 4, stream_);
    retire(pk_);
    retire(pv_);
    retire(ppos_);
    pk_ = std::move(nk);
    pv_ = std::move(nv);
    ppos_ = std::move(np);
    pcap_ = new_cap;
  }

  // Copies the first `w` frame rows (sinks, then tail; no packed rows yet) of K or V contiguous.
  DeviceBuffer first_rows(bool values, int64_t w) const {
    const int64_t F = batch_ * heads_, from_sinks = std::min(n_sinks_, w);
    DeviceBuffer chunk(static_cast<size_t>(F * w * row_bytes()));
    detail::copy_frames(chunk.data(), w, 0, (values ? sv_ : sk_).data(), scap_, 0, F, from_sinks,
                        row_bytes(), stream_);
    detail::copy_frames(chunk.data(), w, from_sinks, (values ? tv_ : tk_).data(), tcap_, tstart_, F,
                        w - from_sinks, row_bytes(), stream_);
    return chunk;
  }

  void freeze_perms() {
    const int64_t w = set_.window, D = head_dim_;
    DeviceBuffer pk(static_cast<size_t>(heads_ * D * 4)), pv(pk.size());
    for (int kv = 0; kv < 2; ++kv) {
      DeviceBuffer chunk = first_rows(kv == 1, w);
      skvq_channel_perms(TensorView::contiguous(chunk.data(), dtype_, batch_, heads_, w, D),
                         (kv == 0 ? pk : pv).as<int32_t>(), stream_);
      synchronize(stream_);  // chunk is freed at the end of this iteration
    }
    tr_.perm_k = pk.to_vector<int32_t>(static_cast<size_t>(heads_ * D), stream_);
    tr_.perm_v = pv.to_vector<int32_t>(static_cast<size_t>(heads_ * D), stream_);
    perm_k_ = std::move(pk);
    perm_v_ = std::move(pv);
  }

  // Whether the K (values = false) or V records are Hadamard-rotated.
  bool rotated(bool values) const {
    return signs_.data() != nullptr && (!values || tr_.rotate_values);
  }

  // Packs rows [F, n, D] (dtype_, contiguous) into records [F, n, row_stride] of K or V.
  void quantize(const DeviceBuffer& rows, int64_t n, bool values, DeviceBuffer& rec) const {
    skvq_quantize_rows(TensorView::contiguous(rows.data(), dtype_, batch_, heads_, n, head_dim_),
                       values ? set_.fv : set_.fk, values ? set_.qv : set_.qk,
                       (values ? perm_v_ : perm_k_).as<const int32_t>(),
                       rotated(values) ? signs_.as<const float>() : nullptr,
                       rotated(values) ? tr_.rot_block : 0, rec.as<uint8_t>(), stream_);
  }

  // Keeps the last min(obs_window, n_new) query rows of this call (fp32) for the prompt-end
  // selection.
  void keep_query_window(const TensorView* queries, int64_t n_new) {
    pending_ = true;
    win_hq_ = queries ? queries->shape[1] : 0;
    win_rows_ = queries ? std::min(cfg_.snap_obs_window, n_new) : 0;
    win_q_ = DeviceBuffer();
    if (win_rows_ > 0) {
      win_q_ = DeviceBuffer(static_cast<size_t>(batch_ * win_hq_ * win_rows_ * head_dim_ * 4));
      detail::convert_block(*queries, n_new - win_rows_, win_rows_, win_q_.data(), DType::kF32,
                            win_rows_, 0, stream_);
    }
  }

  // SnapKV selection over the frame sinks ++ packed ++ tail of every (b, h), scored with the last
  // min(obs_window, n_new) rows of queries (nullptr = key proxy), whose positions are the frame's
  // last ones; the survivors replace the store (what the view reads is retired).
  void evict_frame(const TensorView* queries, int64_t n_new) {
    const int64_t n_s = n_sinks_, n_p = n_packed_, n_t = tcount_, n = n_s + n_p + n_t;
    const int64_t count = snap_keep_count(n, params_);
    if (count >= n) return;
    const int64_t F = batch_ * heads_, D = head_dim_, rb = row_bytes();

    // The fp32 frame [F, n, D] and its positions [F, n].
    DeviceBuffer frame(static_cast<size_t>(F * n * D * 4)), fpos;
    if (n_s > 0)
      detail::convert_block(store_view(sk_, n_s, scap_), 0, n_s, frame.data(), DType::kF32, n, 0,
                            stream_);
    if (n_p > 0) {
      DequantRowsParams dp;
      dp.records = pk_.as<const uint8_t>();
      dp.src_cap = pcap_;
      dp.row_stride = set_.fk.row_stride;
      dp.code_bytes = set_.fk.code_bytes;
      dp.bits = set_.fk.spec.bits();
      dp.ternary = set_.fk.spec.ternary() ? 1 : 0;
      dp.group_size = set_.fk.group_size;
      dp.meta = static_cast<int32_t>(set_.fk.meta);
      dp.head_dim = static_cast<int32_t>(D);
      dp.perm = perm_k_.as<const int32_t>();
      if (rotated(false)) {
        dp.signs = signs_.as<const float>();
        dp.rot_block = tr_.rot_block;
        dp.rot_norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(tr_.rot_block)));
      }
      dp.n_frames = F;
      dp.heads = heads_;
      dp.n = n_p;
      dp.dst = frame.as<float>();
      dp.dst_cap = n;
      dp.dst_row0 = n_s;
      dequant_rows_launch(dp, detail::to_stream(stream_));
    }
    if (n_t > 0)
      detail::convert_block(store_view(tk_, tstart_ + n_t, tcap_), tstart_, n_t, frame.data(),
                            DType::kF32, n, n_s + n_p, stream_);
    DeviceBuffer qbuf, qpos;
    TensorView qv;
    if (queries) {
      const int64_t hq = queries->shape[1];
      const int64_t w_q = std::min(std::clamp<int64_t>(cfg_.snap_obs_window, 1, n), n_new);
      fpos = DeviceBuffer(static_cast<size_t>(F * n * 4));
      detail::fill_positions(fpos.as<int32_t>(), F, n, 0, n_s, 0, stream_);
      detail::copy_frames(fpos.data(), n, n_s, ppos_.data(), pcap_, 0, F, n_p, 4, stream_);
      detail::copy_frames(fpos.data(), n, n_s + n_p, tpos_.data(), tcap_, tstart_, F, n_t, 4,
                          stream_);
      qbuf = DeviceBuffer(static_cast<size_t>(batch_ * hq * w_q * D * 4));
      detail::convert_block(*queries, n_new - w_q, w_q, qbuf.data(), DType::kF32, w_q, 0, stream_);
      qpos = DeviceBuffer(static_cast<size_t>(w_q * 4));
      detail::fill_positions(qpos.as<int32_t>(), 1, w_q, 0, w_q, offset_ - w_q, stream_);
      qv = TensorView::contiguous(qbuf.data(), DType::kF32, batch_, hq, w_q, D);
    }
    DeviceBuffer idx(static_cast<size_t>(F * count * 4));
    DecodeWorkspace ws;
    const int64_t got = snap_select_frames(
        TensorView::contiguous(frame.data(), DType::kF32, batch_, heads_, n, D),
        queries ? &qv : nullptr, queries ? fpos.as<int32_t>() : nullptr,
        queries ? qpos.as<int32_t>() : nullptr, params_, idx.as<int32_t>(), ws, stream_);
    VQ_CHECK(got == count, "[cuda snapkv+skvq] internal: selected " + std::to_string(got) +
                               " rows per head, expected " + std::to_string(count));
    const std::vector<int32_t> sel =
        idx.to_vector<int32_t>(static_cast<size_t>(F * count), stream_);

    // Plan (host): per frame, sel = [sinks n_s2][packed at_f][tail ...], ascending.
    const int64_t n_s2 = std::min(n_s, count);
    std::vector<int64_t> at(static_cast<size_t>(F), 0);
    for (int64_t f = 0; f < F; ++f) {
      const int32_t* sf = sel.data() + f * count;
      for (int64_t i = 0; i < n_s2; ++i)
        VQ_CHECK(sf[i] == i, "[cuda snapkv+skvq] internal: a sink row was not kept");
      for (int64_t i = n_s2; i < count; ++i)
        at[static_cast<size_t>(f)] += sf[i] >= n_s && sf[i] < n_s + n_p;
    }
    const int64_t p2 = *std::max_element(at.begin(), at.end());
    const int64_t f2 = count - n_s2 - p2;
    // idx_early [F, p2]: tail rows quantized early (rows < at_f are placeholders: row tstart);
    // idx_packed [F, p2] into packed ++ early records; idx_tail [F, f2] into the tail store.
    std::vector<int32_t> plan(static_cast<size_t>(F * (2 * p2 + f2)));
    int32_t* idx_early = plan.data();
    int32_t* idx_packed = idx_early + F * p2;
    int32_t* idx_tail = idx_packed + F * p2;
    int64_t max_early = 0;
    for (int64_t f = 0; f < F; ++f) {
      const int32_t* sf = sel.data() + f * count + n_s2;
      const int64_t a = at[static_cast<size_t>(f)];
      max_early = std::max(max_early, p2 - a);
      for (int64_t i = 0; i < p2; ++i) {
        const bool kept_packed = i < a;
        idx_early[f * p2 + i] =
            static_cast<int32_t>(tstart_ + (kept_packed ? 0 : sf[i] - n_s - n_p));
        idx_packed[f * p2 + i] = static_cast<int32_t>(kept_packed ? sf[i] - n_s : n_p + i);
      }
      for (int64_t j = 0; j < f2; ++j)
        idx_tail[f * f2 + j] = static_cast<int32_t>(tstart_ + sf[p2 + j] - n_s - n_p);
    }
    DeviceBuffer dplan = DeviceBuffer::from_vector(plan, stream_);
    const int32_t* d_early = dplan.as<const int32_t>();
    const int32_t* d_packed = d_early + F * p2;
    const int32_t* d_tail = d_packed + F * p2;

    // New sinks (only when the budget cuts into them).
    DeviceBuffer nsk, nsv;
    if (n_s2 < n_s && n_s2 > 0) {
      nsk = DeviceBuffer(static_cast<size_t>(F * n_s2 * rb));
      nsv = DeviceBuffer(static_cast<size_t>(F * n_s2 * rb));
      detail::copy_frames(nsk.data(), n_s2, 0, sk_.data(), scap_, 0, F, n_s2, rb, stream_);
      detail::copy_frames(nsv.data(), n_s2, 0, sv_.data(), scap_, 0, F, n_s2, rb, stream_);
    }
    // New packed store: kept records (bytes) and early-quantized tail rows.
    const int64_t new_pcap = p2 > 0 ? round_up(p2, 64) : 0;
    DeviceBuffer npk, npv, npp;
    if (p2 > 0) {
      npk = DeviceBuffer(static_cast<size_t>(F * new_pcap * set_.fk.row_stride));
      npv = DeviceBuffer(static_cast<size_t>(F * new_pcap * set_.fv.row_stride));
      npp = DeviceBuffer(static_cast<size_t>(F * new_pcap * 4));
      const int64_t m = n_p + p2;  // rows of the combined source: old packed ++ early
      for (int kv = 0; kv < 2; ++kv) {
        const int64_t stride = kv == 0 ? set_.fk.row_stride : set_.fv.row_stride;
        DeviceBuffer comb(static_cast<size_t>(F * m * stride));
        detail::copy_frames(comb.data(), m, 0, (kv == 0 ? pk_ : pv_).data(), pcap_, 0, F, n_p,
                            stride, stream_);
        if (max_early > 0) {
          DeviceBuffer rows(static_cast<size_t>(F * p2 * rb)),
              rec(static_cast<size_t>(F * p2 * stride));
          gather_rows((kv == 0 ? tk_ : tv_).data(), F, tcap_, rb, d_early, p2, rows.data(), nullptr,
                      0, nullptr, stream_);
          quantize(rows, p2, kv == 1, rec);
          detail::copy_frames(comb.data(), m, n_p, rec.data(), p2, 0, F, p2, stride, stream_);
          synchronize(stream_);  // rows and rec are freed at the end of this block
        }
        DeviceBuffer g(static_cast<size_t>(F * p2 * stride));
        gather_rows(comb.data(), F, m, stride, d_packed, p2, g.data(), nullptr, 0, nullptr,
                    stream_);
        detail::copy_frames((kv == 0 ? npk : npv).data(), new_pcap, 0, g.data(), p2, 0, F, p2,
                            stride, stream_);
        synchronize(stream_);  // comb and g are freed at the end of this iteration
      }
      DeviceBuffer comb_pos(static_cast<size_t>(F * (n_p + p2) * 4)),
          g(static_cast<size_t>(F * p2 * 4));
      detail::copy_frames(comb_pos.data(), n_p + p2, 0, ppos_.data(), pcap_, 0, F, n_p, 4, stream_);
      DeviceBuffer early_pos(static_cast<size_t>(F * p2 * 4));
      if (max_early > 0) {  // else no frame selects rows n_p.. of the combined positions
        gather_rows(tpos_.data(), F, tcap_, 4, d_early, p2, early_pos.data(), nullptr, 0, nullptr,
                    stream_);
        detail::copy_frames(comb_pos.data(), n_p + p2, n_p, early_pos.data(), p2, 0, F, p2, 4,
                            stream_);
      }
      gather_rows(comb_pos.data(), F, n_p + p2, 4, d_packed, p2, g.data(), nullptr, 0, nullptr,
                  stream_);
      detail::copy_frames(npp.data(), new_pcap, 0, g.data(), p2, 0, F, p2, 4, stream_);
      synchronize(stream_);
    }
    // New tail: the remaining full-precision rows with their positions.
    const int64_t new_tcap = round_up(std::max<int64_t>(f2, 16), 16);
    DeviceBuffer ntk(static_cast<size_t>(F * new_tcap * rb));
    DeviceBuffer ntv(static_cast<size_t>(F * new_tcap * rb));
    DeviceBuffer ntp(static_cast<size_t>(F * new_tcap * 4));
    if (f2 > 0) {
      DeviceBuffer gk(static_cast<size_t>(F * f2 * rb)), gv(gk.size()),
          gp(static_cast<size_t>(F * f2 * 4));
      gather_rows(tk_.data(), F, tcap_, rb, d_tail, f2, gk.data(), nullptr, 0, nullptr, stream_);
      gather_rows(tv_.data(), F, tcap_, rb, d_tail, f2, gv.data(), nullptr, 0, nullptr, stream_);
      gather_rows(tpos_.data(), F, tcap_, 4, d_tail, f2, gp.data(), nullptr, 0, nullptr, stream_);
      detail::copy_frames(ntk.data(), new_tcap, 0, gk.data(), f2, 0, F, f2, rb, stream_);
      detail::copy_frames(ntv.data(), new_tcap, 0, gv.data(), f2, 0, F, f2, rb, stream_);
      detail::copy_frames(ntp.data(), new_tcap, 0, gp.data(), f2, 0, F, f2, 4, stream_);
    }
    synchronize(stream_);  // the temporaries are freed on return

    // Retire what the view reads; install the new store.
    if (n_s2 < n_s) {
      retire(sk_);
      retire(sv_);
      sk_ = std::move(nsk);
      sv_ = std::move(nsv);
      scap_ = n_s2;
      n_sinks_ = n_s2;
    }
    retire(pk_);
    retire(pv_);
    retire(ppos_);
    pk_ = std::move(npk);
    pv_ = std::move(npv);
    ppos_ = std::move(npp);
    pcap_ = new_pcap;
    n_packed_ = p2;
    block_rows_.clear();
    if (p2 > 0) block_rows_.push_back(p2);
    retire(tk_);
    retire(tv_);
    retire(tpos_);
    tk_ = std::move(ntk);
    tv_ = std::move(ntv);
    tpos_ = std::move(ntp);
    tcap_ = new_tcap;
    tstart_ = 0;
    tcount_ = f2;
  }

  // Packs the tail's oldest `window` rows while it holds >= window + recent (appended to the
  // packed store; the tail's rows stay where they are: the view may read them).
  void flush_tail() {
    const int64_t w = set_.window, F = batch_ * heads_, rb = row_bytes();
    while (tcount_ >= set_.flush_span) {
      packed_reserve(n_packed_ + w);
      for (int kv = 0; kv < 2; ++kv) {
        const int64_t stride = kv == 0 ? set_.fk.row_stride : set_.fv.row_stride;
        DeviceBuffer rows(static_cast<size_t>(F * w * rb)),
            rec(static_cast<size_t>(F * w * stride));
        detail::copy_frames(rows.data(), w, 0, (kv == 0 ? tk_ : tv_).data(), tcap_, tstart_, F, w,
                            rb, stream_);
        quantize(rows, w, kv == 1, rec);
        detail::copy_frames((kv == 0 ? pk_ : pv_).data(), pcap_, n_packed_, rec.data(), w, 0, F, w,
                            stride, stream_);
        synchronize(stream_);  // rows and rec are freed at the end of this iteration
      }
      detail::copy_frames(ppos_.data(), pcap_, n_packed_, tpos_.data(), tcap_, tstart_, F, w, 4,
                          stream_);
      n_packed_ += w;
      block_rows_.push_back(w);
      tstart_ += w;
      tcount_ -= w;
    }
  }

  CacheConfig cfg_;
  skvq::Settings set_;
  SnapSelectParams params_;
  int64_t n_s_max_ = 0;
  skvq::Transforms tr_;
  bool has_data_ = false;
  DType dtype_ = DType::kF16;
  int64_t offset_ = 0;
  int64_t n_sinks_ = 0, scap_ = 0;
  int64_t n_packed_ = 0, pcap_ = 0;
  std::vector<int64_t> block_rows_;  // rows of the CPU's packed blocks, in order
  int64_t tcap_ = 0, tstart_ = 0, tcount_ = 0;
  DeviceBuffer perm_k_, perm_v_, signs_;
  DeviceBuffer sk_, sv_, pk_, pv_, ppos_, tk_, tv_, tpos_;
  std::vector<DeviceBuffer> retired_;
  // snap_evict_at = prompt_end: a selection (and the flush after it) is owed, scored with the
  // window queries win_q_ [B, win_hq, win_rows, D] fp32 (none = key proxy).
  bool pending_ = false;
  int64_t win_hq_ = 0, win_rows_ = 0;
  DeviceBuffer win_q_;
};

}  // namespace

std::unique_ptr<DeviceKVCache> make_device_snapkv_skvq_cache(const CacheConfig& cfg, int64_t b,
                                                             int64_t h, int64_t d, Stream s) {
  return std::make_unique<SnapkvSkvqDeviceCache>(cfg, b, h, d, s);
}

}  // namespace vq::cuda
