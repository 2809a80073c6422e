// The GPU-resident SKVQ cache (method "skvq", docs/design.md §C4): the device twin of
// vq::SkvqCache, with the same call order, flush rule, sinks, permutations and byte formulas.
//
// Storage (cudaMalloc): sinks [B, H, n_sink, D] (full precision, after chunk 0), packed records
// keys [B, H, pcap, fk.row_stride] and values [B, H, pcap, fv.row_stride] bytes (rows n_sink ..
// q_end-1, implicit positions), the full-precision tail [B, H, tcap, D] (rows q_end .. offset-1,
// live rows [start, start + count) of each (b, h)), and the frozen permutations / rotation signs
// [H, D]. A call converts its rows into the tail (storage dtype = the first keys block's), then
// flushes every whole chunk the CPU rule flushes: chunk 0 fixes the permutations
// (skvq_channel_perms over its rows) and copies the sinks, the chunk rows are packed with
// skvq_quantize_rows (bit-identical to the CPU quantizer) into the record store, and the tail
// drops them (its buffer shrinks when it is more than twice its rows: the fp16 copies are freed).
// The view is [sinks][packed][tail], one segment each.
// State: vq::SkvqCache's stream, written and read with its own pieces (skvq::Settings,
// Transforms and FpRows of kv/skvq_store.h): the packed store is cut into (and rebuilt from)
// the CPU's per-chunk blocks.
#include <algorithm>
#include <climits>
#include <cstring>
#include <istream>
#include <ostream>
#include <string>

#include "cuda/check.h"
#include "cuda/device_cache_util.h"
#include "kv/skvq_store.h"
#include "veloxquant/error.h"
#include "veloxquant/group_quant.h"

namespace vq::cuda {

namespace {

constexpr const char* kOp = "cuda skvq";

class SkvqDeviceCache final : public DeviceKVCache {
 public:
  SkvqDeviceCache(const CacheConfig& cfg, int64_t b, int64_t h, int64_t d, Stream s)
      : DeviceKVCache(b, h, d, s), cfg_(cfg), set_(skvq::Settings::from_config(cfg, 0, kOp)) {}

  std::string method() const override { return "skvq"; }

  DeviceCacheView update_and_fetch(const TensorView& keys, const TensorView& values,
                                   const DeviceUpdateOptions&) override {
    const skvq::Settings& s = set_;
    detail::check_blocks(keys, values, batch_, heads_, head_dim_, kOp);
    const int64_t n_new = keys.shape[2];
    if (s.max_ctx > 0 && offset_ + n_new > s.max_ctx)
      throw Error("[cuda skvq] skvq_max_ctx: expected at most " + std::to_string(s.max_ctx) +
                  " tokens but this call would reach " + std::to_string(offset_ + n_new) + " (" +
                  std::to_string(offset_) + " seen + " + std::to_string(n_new) +
                  "); nothing was changed");
    VQ_CHECK(offset_ + n_new <= INT32_MAX,
             "[cuda skvq] expected positions to fit int32 but offset " + std::to_string(offset_) +
                 " + S " + std::to_string(n_new) + " does not");
    const int64_t F = batch_ * heads_, D = head_dim_, w = s.window;
    if (!has_data_) {
      skvq::Transforms tr = skvq::initial_transforms(s, heads_, kOp);  // may throw
      detail::upload_transforms(tr, perm_k_, perm_v_, signs_, stream_);
      tr_ = std::move(tr);
      dtype_ = keys.dtype;
      has_data_ = true;
    }
    const int64_t row_bytes = D * static_cast<int64_t>(dtype_size(dtype_));

    // Append this call's rows to the tail.
    tail_reserve(n_new);
    detail::convert_block(keys, 0, n_new, tk_.data(), dtype_, tcap_, tstart_ + tcount_, stream_);
    detail::convert_block(values, 0, n_new, tv_.data(), dtype_, tcap_, tstart_ + tcount_, stream_);
    tcount_ += n_new;

    // Flush every chunk [q, q + w) with (n_total - q) >= w + recent.
    const int64_t n_total = offset_ + n_new;
    int64_t q_new = q_end_;
    while (n_total - q_new >= s.flush_span) q_new += w;
    if (q_new > q_end_) {
      const int64_t f = q_new - q_end_;  // tail rows flushed
      if (q_end_ == 0) {
        if (s.reorder && !tr_.has_perms()) {
          DeviceBuffer pk(static_cast<size_t>(heads_ * D * 4)), pv(pk.size());
          for (int kv = 0; kv < 2; ++kv) {
            DeviceBuffer chunk(static_cast<size_t>(F * w * row_bytes));
            detail::copy_frames(chunk.data(), w, 0, (kv == 0 ? tk_ : tv_).data(), tcap_, tstart_, F,
                                w, row_bytes, stream_);
            skvq_channel_perms(TensorView::contiguous(chunk.data(), dtype_, batch_, heads_, w, D),
                               (kv == 0 ? pk : pv).as<int32_t>(), stream_);
            synchronize(stream_);  // chunk is freed at the end of this iteration
          }
          tr_.perm_k = pk.to_vector<int32_t>(static_cast<size_t>(heads_ * D), stream_);
          tr_.perm_v = pv.to_vector<int32_t>(static_cast<size_t>(heads_ * D), stream_);
          perm_k_ = std::move(pk);
          perm_v_ = std::move(pv);
        }
        if (s.n_sink > 0) {
          sk_ = DeviceBuffer(static_cast<size_t>(F * s.n_sink * row_bytes));
          sv_ = DeviceBuffer(static_cast<size_t>(F * s.n_sink * row_bytes));
          detail::copy_frames(sk_.data(), s.n_sink, 0, tk_.data(), tcap_, tstart_, F, s.n_sink,
                              row_bytes, stream_);
          detail::copy_frames(sv_.data(), s.n_sink, 0, tv_.data(), tcap_, tstart_, F, s.n_sink,
                              row_bytes, stream_);
          n_sinks_ = s.n_sink;
        }
      }
      const int64_t p0 = q_end_ == 0 ? s.n_sink : 0;  // first tail row packed
      const int64_t np = f - p0;
      packed_reserve(n_packed_ + np);
      for (int kv = 0; kv < 2; ++kv) {
        const PackedRowFormat& fmt = kv == 0 ? s.fk : s.fv;
        DeviceBuffer rows(static_cast<size_t>(F * np * row_bytes));
        DeviceBuffer rec(static_cast<size_t>(F * np * fmt.row_stride));
        detail::copy_frames(rows.data(), np, 0, (kv == 0 ? tk_ : tv_).data(), tcap_, tstart_ + p0,
                            F, np, row_bytes, stream_);
        const bool rot = signs_.data() && (kv == 0 || tr_.rotate_values);
        skvq_quantize_rows(TensorView::contiguous(rows.data(), dtype_, batch_, heads_, np, D), fmt,
                           kv == 0 ? s.qk : s.qv, (kv == 0 ? perm_k_ : perm_v_).as<const int32_t>(),
                           rot ? signs_.as<const float>() : nullptr, rot ? tr_.rot_block : 0,
                           rec.as<uint8_t>(), stream_);
        detail::copy_frames((kv == 0 ? pk_ : pv_).data(), pcap_, n_packed_, rec.data(), np, 0, F,
                            np, fmt.row_stride, stream_);
        synchronize(stream_);  // rows and rec are freed at the end of this iteration
      }
      for (int64_t c0 = q_end_; c0 < q_new; c0 += w) {
        const int64_t rows = c0 == 0 ? w - s.n_sink : w;
        comp_k_ +=
            skvq_compressed_bytes(rows, D, s.qk.bits, s.qk.group_size, s.qk.meta).total() * F;
        comp_v_ +=
            skvq_compressed_bytes(rows, D, s.qv.bits, s.qv.group_size, s.qv.meta).total() * F;
      }
      n_packed_ += np;
      tstart_ += f;
      tcount_ -= f;
      tail_reserve(0);  // frees the flushed rows' memory when the buffer is now mostly empty
    }
    q_end_ = q_new;
    offset_ = n_total;
    return stored_view();
  }

  DeviceCacheView stored_view() const override {
    DeviceCacheView view(batch_, heads_, head_dim_);
    if (!has_data_) return view;
    const int64_t row_bytes = head_dim_ * static_cast<int64_t>(dtype_size(dtype_));
    if (n_sinks_ > 0) {
      DeviceSegment seg;
      seg.n_rows = n_sinks_;
      seg.first_pos = 0;
      seg.dtype = dtype_;
      seg.keys = sk_.data();
      seg.values = sv_.data();
      view.add_segment(seg);
    }
    if (n_packed_ > 0) {
      const skvq::Settings& s = set_;
      DeviceSegment seg;
      seg.n_rows = n_packed_;
      seg.capacity = pcap_;
      seg.first_pos = s.n_sink;
      seg.packed = true;
      seg.dtype = dtype_;
      seg.k_fmt = s.fk;
      seg.v_fmt = s.fv;
      seg.k_data = pk_.as<const uint8_t>();
      seg.v_data = pv_.as<const uint8_t>();
      seg.k_perm = perm_k_.as<const int32_t>();
      seg.v_perm = perm_v_.as<const int32_t>();
      if (signs_.data()) {
        seg.k_signs = signs_.as<const float>();
        seg.k_rot_block = tr_.rot_block;
        if (tr_.rotate_values) {
          seg.v_signs = signs_.as<const float>();
          seg.v_rot_block = tr_.rot_block;
        }
      }
      view.add_segment(seg);
    }
    if (tcount_ > 0) {
      DeviceSegment seg;
      seg.n_rows = tcount_;
      seg.capacity = tcap_;
      seg.first_pos = q_end_;
      seg.dtype = dtype_;
      seg.keys = tk_.as<const char>() + tstart_ * row_bytes;
      seg.values = tv_.as<const char>() + tstart_ * row_bytes;
      view.add_segment(seg);
    }
    return view;
  }

  int64_t offset() const override { return offset_; }
  int64_t stored_rows() const override { return offset_; }
  std::vector<int32_t> stored_positions(int64_t b, int64_t h) const override {
    VQ_CHECK(b >= 0 && b < batch_ && h >= 0 && h < heads_,
             "[cuda skvq] expected (b, h) within [" + std::to_string(batch_) + ", " +
                 std::to_string(heads_) + ") but got (" + std::to_string(b) + ", " +
                 std::to_string(h) + ")");
    std::vector<int32_t> p(static_cast<size_t>(offset_));
    for (int64_t i = 0; i < offset_; ++i) p[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    return p;
  }

  void save(std::ostream& out) const override {
    const skvq::Settings& s = set_;
    const int64_t F = batch_ * heads_, w = s.window;
    StateWriter wr;
    s.save(wr);
    wr.boolean(has_data_);
    if (has_data_) {
      wr.u8(static_cast<uint8_t>(dtype_));
      wr.i64(batch_);
      wr.i64(heads_);
      wr.i64(offset_);
      wr.i64(q_end_);
      wr.i64(comp_k_);
      wr.i64(comp_v_);
      tr_.save(wr);
      detail::download_fp_rows(dtype_, batch_, heads_, head_dim_, sk_, sv_, nullptr, n_sinks_,
                               n_sinks_, 0, stream_)
          .save(wr);
      // The packed store as the CPU's blocks: chunk 0 holds positions n_sink .. w-1, chunk c
      // positions c*w .. c*w + w-1; per block the records [B, H, rows, row_stride].
      const detail::HostRecords rec = detail::download_records(
          pk_, pv_, F, n_packed_, pcap_, s.fk.row_stride, s.fv.row_stride, stream_);
      const int64_t n_blocks = q_end_ / w;
      wr.u64(static_cast<uint64_t>(n_blocks));
      for (int64_t c = 0; c < n_blocks; ++c) {
        const int64_t first = c == 0 ? s.n_sink : c * w, rows = c * w + w - first;
        wr.i64(rows);
        wr.i64(first);
        rec.write_block(wr, first - s.n_sink, rows);  // records from store row first - n_sink
      }
      detail::download_fp_rows(dtype_, batch_, heads_, head_dim_, tk_, tv_, nullptr, tcount_, tcap_,
                               tstart_, stream_)
          .save(wr);
    }
    wr.write(out, method());
  }

  void load(std::istream& in) override {
    const skvq::Settings& s = set_;
    StateReader r = detail::read_validated_state(in, cfg_);
    s.check_saved(r, kOp);
    SkvqDeviceCache fresh(cfg_, batch_, heads_, head_dim_, stream_);
    fresh.has_data_ = r.boolean();
    if (fresh.has_data_) {
      const int64_t D = head_dim_, F = batch_ * heads_;
      fresh.dtype_ = static_cast<DType>(r.u8());
      const int64_t b = r.i64(), h = r.i64();
      detail::check_state_shape(kOp, true, b, h, D, batch_, heads_, head_dim_);
      fresh.offset_ = r.i64();
      fresh.q_end_ = r.i64();
      fresh.comp_k_ = r.i64();
      fresh.comp_v_ = r.i64();
      fresh.tr_ = skvq::Transforms::load(r, heads_, D, kOp);
      detail::upload_transforms(fresh.tr_, fresh.perm_k_, fresh.perm_v_, fresh.signs_, stream_);
      const skvq::FpRows sinks =
          detail::read_fp_rows(r, fresh.dtype_, batch_, heads_, D, false, kOp);
      fresh.n_sinks_ = sinks.count;  // compact, as after chunk 0
      fresh.sk_ = detail::upload_fp_rows(sinks, false, sinks.count, stream_);
      fresh.sv_ = detail::upload_fp_rows(sinks, true, sinks.count, stream_);
      const uint64_t n_blocks = r.u64();
      std::vector<std::string> blobs[2];
      std::vector<int64_t> rows;
      for (uint64_t c = 0; c < n_blocks; ++c) {
        rows.push_back(r.i64());
        r.i64();  // first position: the chunk's (the CPU load checked it)
        blobs[0].push_back(r.blob());
        blobs[1].push_back(r.blob());
      }
      for (const int64_t n : rows) fresh.n_packed_ += n;
      fresh.pcap_ = fresh.n_packed_ > 0 ? round_up(fresh.n_packed_, 64) : 0;
      for (int kv = 0; kv < 2; ++kv) {
        std::vector<const void*> src;
        for (const std::string& b : blobs[kv]) src.push_back(b.data());
        (kv == 0 ? fresh.pk_ : fresh.pv_) = detail::upload_blocks(
            src, rows, F, fresh.pcap_, kv == 0 ? s.fk.row_stride : s.fv.row_stride, stream_);
      }
      const skvq::FpRows tail =
          detail::read_fp_rows(r, fresh.dtype_, batch_, heads_, D, false, kOp);
      fresh.tcount_ = tail.count;
      fresh.tcap_ = tail.cap;
      fresh.tk_ = detail::upload_fp_rows(tail, false, tail.cap, stream_);
      fresh.tv_ = detail::upload_fp_rows(tail, true, tail.cap, stream_);
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
    cs.rows_stored = offset_;
    const int64_t fp16_k = has_data_ ? bh * offset_ * d * 2 : 0;
    const int64_t n_sink_kept = std::min(s.n_sink, q_end_);
    const int64_t residual = has_data_ ? (offset_ - q_end_ + n_sink_kept) * d * 2 * 2 * bh : 0;
    const int64_t perm_bytes = tr_.has_perms() ? 2 * heads_ * d * 4 : 0;
    const int64_t n_q = q_end_ - n_sink_kept;
    const double avg_bits =
        n_q > 0 ? 8.0 * static_cast<double>(comp_k_) / static_cast<double>(n_q * d * bh) : 16.0;
    cs.bytes_accounted = comp_k_ + comp_v_ + residual + perm_bytes;
    cs.fp16_bytes = 2 * fp16_k;
    cs.bytes_resident = 0;
    for (const DeviceBuffer* b : {&sk_, &sv_, &pk_, &pv_, &tk_, &tv_, &perm_k_, &perm_v_, &signs_})
      cs.bytes_resident += detail::held_bytes(*b);
    cs.figures = {
        {"compressed_key_bytes", static_cast<double>(comp_k_)},
        {"compressed_value_bytes", static_cast<double>(comp_v_)},
        {"fp16_key_bytes", static_cast<double>(fp16_k)},
        {"fp16_value_bytes", static_cast<double>(fp16_k)},
        {"residual_fp16_bytes", static_cast<double>(residual)},
        {"perm_bytes", static_cast<double>(perm_bytes)},
        {"quantized_tokens", static_cast<double>(q_end_)},
        {"tokens_seen", static_cast<double>(offset_)},
        {"key_perms", tr_.has_perms() ? 1.0 : 0.0},
        {"value_perms", tr_.has_perms() ? 1.0 : 0.0},
        {"assigned_avg_bits", avg_bits},
        {"packed_rows", static_cast<double>(n_q)},
        {"rotation", tr_.signs.empty() ? 0.0 : 1.0},
    };
    return cs;
  }

 private:
  // Room for `extra` more tail rows (the CPU FpRows policy: grow to max(need, 2 cap) rounded up
  // to 16 rows, shrink a buffer more than twice its rows, compact when the end is reached).
  void tail_reserve(int64_t extra) {
    const int64_t need = tcount_ + extra;
    int64_t new_cap = tcap_;
    if (need > tcap_)
      new_cap = round_up(std::max({need, 2 * tcap_, int64_t{16}}), 16);
    else if (tcap_ > 2 * std::max<int64_t>(need, 16))
      new_cap = round_up(std::max<int64_t>(need, 16), 16);
    if (new_cap == tcap_ && tstart_ + need <= tcap_) return;
    const int64_t F = batch_ * heads_;
    const int64_t row_bytes = head_dim_ * static_cast<int64_t>(dtype_size(dtype_));
    DeviceBuffer nk(static_cast<size_t>(F * new_cap * row_bytes));
    DeviceBuffer nv(static_cast<size_t>(F * new_cap * row_bytes));
    detail::copy_frames(nk.data(), new_cap, 0, tk_.data(), tcap_, tstart_, F, tcount_, row_bytes,
                        stream_);
    detail::copy_frames(nv.data(), new_cap, 0, tv_.data(), tcap_, tstart_, F, tcount_, row_bytes,
                        stream_);
    synchronize(stream_);  // the old buffers are freed below
    tk_ = std::move(nk);
    tv_ = std::move(nv);
    tcap_ = new_cap;
    tstart_ = 0;
  }

  // Room for `rows` packed records per (b, h) (x1.5 growth in steps of 64 rows).
  void packed_reserve(int64_t rows) {
    if (rows <= pcap_) return;
    const int64_t new_cap = round_up(std::max({rows, pcap_ + pcap_ / 2, int64_t{64}}), 64);
    const int64_t F = batch_ * heads_;
    DeviceBuffer nk(static_cast<size_t>(F * new_cap * set_.fk.row_stride));
    DeviceBuffer nv(static_cast<size_t>(F * new_cap * set_.fv.row_stride));
    detail::copy_frames(nk.data(), new_cap, 0, pk_.data(), pcap_, 0, F, n_packed_,
                        set_.fk.row_stride, stream_);
    detail::copy_frames(nv.data(), new_cap, 0, pv_.data(), pcap_, 0, F, n_packed_,
                        set_.fv.row_stride, stream_);
    synchronize(stream_);
    pk_ = std::move(nk);
    pv_ = std::move(nv);
    pcap_ = new_cap;
  }

  CacheConfig cfg_;
  skvq::Settings set_;
  skvq::Transforms tr_;
  bool has_data_ = false;
  DType dtype_ = DType::kF16;
  int64_t offset_ = 0, q_end_ = 0, comp_k_ = 0, comp_v_ = 0;
  int64_t n_sinks_ = 0, n_packed_ = 0, pcap_ = 0;
  int64_t tcap_ = 0, tstart_ = 0, tcount_ = 0;
  DeviceBuffer perm_k_, perm_v_, signs_;
  DeviceBuffer sk_, sv_, pk_, pv_, tk_, tv_;
};

}  // namespace

std::unique_ptr<DeviceKVCache> make_device_skvq_cache(const CacheConfig& cfg, int64_t b, int64_t h,
                                                      int64_t d, Stream s) {
  return std::make_unique<SkvqDeviceCache>(cfg, b, h, d, s);
}

}  // namespace vq::cuda
