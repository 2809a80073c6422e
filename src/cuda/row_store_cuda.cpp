// The CUDA row backend (src/kv/row_store.h): stores in cudaMalloc memory ([F, capacity, D] keys
// and values, [F, capacity] positions), every copy queued on the backend's stream (block
// conversion, frame-wise copies, gathers), and the SnapKV selection of snap_select_frames over a
// contiguous copy of the frames. A store synchronises its stream before its memory is freed, so a
// store dropped while work that reads it is queued stays valid until that work is done.
// Packed stores: records in cudaMalloc memory, quantized by skvq_quantize_rows (bit-identical to
// the CPU quantizer; channel-axis keys one chunk per call, as the CPU store), dequantized for
// scoring by dequant_rows_launch, gathered by gather_rows; the channel permutations come from
// skvq_channel_perms. Query windows (decode-time SnapKV): one cudaMalloc buffer of fp32 steps.
#include "cuda/row_store_cuda.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/check.h"
#include "cuda/device_cache_dequant.cuh"
#include "cuda/device_cache_util.h"
#include "cuda/stream_scratch.h"
#include "veloxquant/error.h"

namespace vq::cuda {
namespace {

class CudaRowIndex final : public kv::RowIndex {
 public:
  DeviceBuffer idx;  // [F, count] int32
  int64_t frames = 0;
  Stream stream = nullptr;
  const int32_t* data() const override { return idx.as<const int32_t>(); }
  std::vector<int32_t> download() const override {
    return idx.to_vector<int32_t>(static_cast<size_t>(frames * count), stream);
  }
};

class CudaRowStore final : public kv::RowStore {
 public:
  CudaRowStore(const kv::RowShape& s, int64_t cap, bool with_pos, Stream stream) : stream_(stream) {
    shape_ = s;
    capacity_ = cap;
    with_pos_ = with_pos;
    const size_t rows = static_cast<size_t>(s.frames() * cap);
    kb_ = DeviceBuffer(rows * static_cast<size_t>(s.row_bytes()));
    vb_ = DeviceBuffer(rows * static_cast<size_t>(s.row_bytes()));
    if (with_pos) pb_ = DeviceBuffer(rows * sizeof(int32_t));
    k_ = kb_.data();
    v_ = vb_.data();
    pos_ = pb_.as<int32_t>();
  }
  ~CudaRowStore() override {
    // Recorded writes may target this memory, queued work may still read it.
    try {
      detail::flush_row_writes(stream_);
      synchronize(stream_);
    } catch (...) {  // a sticky device error: nothing left to protect
    }
  }

  void copy_range(const kv::RowStore& src, int64_t src_row0, int64_t dst_row0, int64_t n) override {
    if (n <= 0) return;
    detail::flush_row_writes(stream_);
    const int64_t F = shape_.frames(), rb = shape_.row_bytes();
    if (src.shape().dtype != shape_.dtype) {  // another store: converted rows, positions copied
      detail::convert_block(src.keys(src_row0, n), 0, n, k_, shape_.dtype, capacity_, dst_row0,
                            stream_);
      detail::convert_block(src.values(src_row0, n), 0, n, v_, shape_.dtype, capacity_, dst_row0,
                            stream_);
      if (pos_ && src.positions())
        detail::copy_frames(pos_, capacity_, dst_row0, src.positions(), src.capacity(), src_row0, F,
                            n, 4, stream_);
      return;
    }
    if (&src == this && src_row0 != dst_row0 &&
        std::max(src_row0, dst_row0) < std::min(src_row0, dst_row0) + n) {
      // Device copies may not overlap: through a scratch of n rows per frame.
      CudaRowStore tmp(shape_, n, pos_ != nullptr, stream_);
      tmp.copy_range(*this, src_row0, 0, n);
      copy_range(tmp, 0, dst_row0, n);
      return;  // tmp synchronises before its memory is freed
    }
    detail::copy_frames(k_, capacity_, dst_row0, src_k(src), src.capacity(), src_row0, F, n, rb,
                        stream_);
    detail::copy_frames(v_, capacity_, dst_row0, src_v(src), src.capacity(), src_row0, F, n, rb,
                        stream_);
    if (pos_ && src.positions())
      detail::copy_frames(pos_, capacity_, dst_row0, src.positions(), src.capacity(), src_row0, F,
                          n, 4, stream_);
  }

  void write_block(const TensorView& keys, const TensorView& values, int64_t s0, int64_t n,
                   int64_t row0) override {
    detail::convert_block(keys, s0, n, k_, shape_.dtype, capacity_, row0, stream_, true);
    detail::convert_block(values, s0, n, v_, shape_.dtype, capacity_, row0, stream_, true);
  }

  void fill_positions(int64_t row0, int64_t n, int64_t first) override {
    detail::fill_positions(pos_, shape_.frames(), capacity_, row0, n, first, stream_, true);
  }

  void gather(const kv::RowStore& src, const kv::RowIndex& idx, int64_t src_first) override {
    const int64_t F = shape_.frames(), rb = shape_.row_bytes(), count = idx.count;
    if (count <= 0) return;
    detail::flush_row_writes(stream_);
    // gather_rows writes [F, count] contiguous: gather straight into this store when its
    // capacity is the count, else through a contiguous scratch.
    const bool direct = capacity_ == count;
    DeviceBuffer tk, tv, tp;
    if (!direct) {
      tk = DeviceBuffer(static_cast<size_t>(F * count * rb));
      tv = DeviceBuffer(static_cast<size_t>(F * count * rb));
      if (pos_) tp = DeviceBuffer(static_cast<size_t>(F * count * 4));
    }
    void* dk = direct ? k_ : tk.data();
    void* dv = direct ? v_ : tv.data();
    int32_t* dp = pos_ ? (direct ? pos_ : tp.as<int32_t>()) : nullptr;
    gather_rows(src_k(src), F, src.capacity(), rb, idx.data(), count, dk, src.positions(),
                static_cast<int32_t>(src_first), dp, stream_);
    gather_rows(src_v(src), F, src.capacity(), rb, idx.data(), count, dv, nullptr, 0, nullptr,
                stream_);
    if (!direct) {
      detail::copy_frames(k_, capacity_, 0, tk.data(), count, 0, F, count, rb, stream_);
      detail::copy_frames(v_, capacity_, 0, tv.data(), count, 0, F, count, rb, stream_);
      if (pos_) detail::copy_frames(pos_, capacity_, 0, tp.data(), count, 0, F, count, 4, stream_);
      synchronize(stream_);  // the scratch is freed on return
    }
  }

  Tensor download(bool values, int64_t row0, int64_t n) const override {
    return detail::download_rows(values ? v_ : k_, shape_.dtype, shape_.batch, shape_.heads, n,
                                 shape_.head_dim, capacity_, row0, stream_);
  }

  std::vector<int32_t> download_positions(int64_t row0, int64_t n) const override {
    std::vector<int32_t> out(static_cast<size_t>(shape_.frames() * n));
    if (pos_ && n > 0)
      detail::download_frames(out.data(), n, pos_, capacity_, row0, shape_.frames(), n, 4, stream_);
    return out;
  }

  void upload(const TensorView& keys, const TensorView& values, int64_t row0, int64_t n,
              const std::vector<int32_t>* positions) override {
    if (n <= 0) return;
    const int64_t F = shape_.frames(), rb = shape_.row_bytes();
    detail::upload_frames(k_, capacity_, row0, keys.data, n, F, n, rb, stream_);
    detail::upload_frames(v_, capacity_, row0, values.data, n, F, n, rb, stream_);
    if (positions && pos_)
      detail::upload_frames(pos_, capacity_, row0, positions->data(), n, F, n, 4, stream_);
  }

  int64_t resident_bytes() const override {
    return detail::held_bytes(kb_) + detail::held_bytes(vb_) + detail::held_bytes(pb_);
  }

  // The raw store pointers of another store of this backend.
  static const void* src_k(const kv::RowStore& s) { return static_cast<const CudaRowStore&>(s).k_; }
  static const void* src_v(const kv::RowStore& s) { return static_cast<const CudaRowStore&>(s).v_; }

 private:
  Stream stream_;
  DeviceBuffer kb_, vb_, pb_;
};

class CudaTransforms final : public kv::PackedTransforms {
 public:
  DeviceBuffer pk, pv, sg;  // [H, D] each, or empty
  DeviceBuffer ku;          // [H, D, D] fp64, or empty
};

class CudaPackedStore final : public kv::PackedStore {
 public:
  CudaPackedStore(const kv::PackedShape& s, int64_t cap, bool with_pos, Stream stream)
      : stream_(stream) {
    shape_ = s;
    capacity_ = cap;
    const size_t rows = static_cast<size_t>(s.frames() * cap);
    kb_ = DeviceBuffer(rows * static_cast<size_t>(s.fk.row_stride));
    vb_ = DeviceBuffer(rows * static_cast<size_t>(s.fv.row_stride));
    if (with_pos) pb_ = DeviceBuffer(rows * sizeof(int32_t));
    k_ = kb_.as<uint8_t>();
    v_ = vb_.as<uint8_t>();
    pos_ = pb_.as<int32_t>();
  }
  ~CudaPackedStore() override {
    try {
      detail::flush_row_writes(stream_);
      synchronize(stream_);  // queued work may still read this memory
    } catch (...) {          // a sticky device error: nothing left to protect
    }
  }

  uint8_t* recs(bool values) const { return values ? v_ : k_; }
  int64_t stride(bool values) const { return shape_.format(values).row_stride; }

  void copy_range(const kv::PackedStore& src_base, int64_t src_row0, int64_t dst_row0,
                  int64_t n) override {
    const auto& src = static_cast<const CudaPackedStore&>(src_base);
    const int64_t F = shape_.frames();
    for (int kv = 0; kv < 2; ++kv)
      detail::copy_frames(recs(kv), capacity_, dst_row0, src.recs(kv), src.capacity_, src_row0, F,
                          n, stride(kv), stream_);
    if (pos_ && src.pos_)
      detail::copy_frames(pos_, capacity_, dst_row0, src.pos_, src.capacity_, src_row0, F, n, 4,
                          stream_);
  }

  void quantize(const kv::RowStore& rows, int64_t src_row0, int64_t n, int64_t dst_row0,
                const GroupQuantParams& qk, const GroupQuantParams& qv,
                const kv::PackedTransforms& t) override {
    detail::flush_row_writes(stream_);  // the rows may still be pending
    if (n <= 0) return;
    const kv::RowShape& rs = rows.shape();
    const int64_t F = shape_.frames(), rb = rs.row_bytes();
    // skvq_quantize_rows reads contiguous rows [B, H, n, D] and writes records [F, n, stride].
    // Both temporaries are stream-ordered: the copies and the kernel that use them are queued on
    // stream_ before x is rewritten or either is freed, so no step of a flush waits (a cudaMalloc
    // / cudaFree pair and a synchronisation per call each cost the decode step a device stall:
    // bench --phases, docs/results/gpu/run13_s14/e2).
    const cudaStream_t st = detail::to_stream(stream_);
    const detail::StreamScratch x(static_cast<size_t>(F * n * rb), st);
    const bool direct = dst_row0 == 0 && capacity_ == n;
    for (int kv = 0; kv < 2; ++kv) {
      const TensorView src = kv ? rows.values(0, 0) : rows.keys(0, 0);
      detail::copy_frames(x.data(), n, 0, src.data, rows.capacity(), src_row0, F, n, rb, stream_);
      const detail::StreamScratch rec(direct ? 0 : static_cast<size_t>(F * n * stride(kv)), st);
      const float* signs = t.signs_for(kv);
      skvq_quantize_rows(
          TensorView::contiguous(x.data(), rs.dtype, rs.batch, rs.heads, n, rs.head_dim),
          shape_.format(kv), kv ? qv : qk, t.perm(kv), signs, signs ? t.rot_block : 0,
          direct ? recs(kv) : rec.as<uint8_t>(), stream_,
          kv == 0 && shape_.fk.axis == QuantAxis::kChannel ? t.key_u : nullptr);
      if (!direct)
        detail::copy_frames(recs(kv), capacity_, dst_row0, rec.data(), n, 0, F, n, stride(kv),
                            stream_);
    }
    if (pos_ && rows.positions())
      detail::copy_frames(pos_, capacity_, dst_row0, rows.positions(), rows.capacity(), src_row0, F,
                          n, 4, stream_);
  }

  void gather(const kv::PackedStore& src_base, const kv::RowIndex& idx) override {
    detail::flush_row_writes(stream_);
    const auto& src = static_cast<const CudaPackedStore&>(src_base);
    const int64_t F = shape_.frames(), count = idx.count;
    if (count <= 0) return;
    // gather_rows writes [F, count] contiguous: straight into this store when its capacity is
    // the count, else through a scratch.
    const bool direct = capacity_ == count;
    for (int kv = 0; kv < 2; ++kv) {
      DeviceBuffer t, tp;
      if (!direct) {
        t = DeviceBuffer(static_cast<size_t>(F * count * stride(kv)));
        if (kv == 0 && pos_) tp = DeviceBuffer(static_cast<size_t>(F * count * 4));
      }
      const bool with_pos = kv == 0 && pos_ && src.pos_;
      gather_rows(src.recs(kv), F, src.capacity_, stride(kv), idx.data(), count,
                  direct ? recs(kv) : t.data(), with_pos ? src.pos_ : nullptr, 0,
                  with_pos ? (direct ? pos_ : tp.as<int32_t>()) : nullptr, stream_);
      if (!direct) {
        detail::copy_frames(recs(kv), capacity_, 0, t.data(), count, 0, F, count, stride(kv),
                            stream_);
        if (with_pos)
          detail::copy_frames(pos_, capacity_, 0, tp.data(), count, 0, F, count, 4, stream_);
        synchronize(stream_);  // the scratch is freed next
      }
    }
  }

  void dequantize_keys(int64_t src_row0, int64_t n, kv::RowStore& dst, int64_t dst_row0,
                       const kv::PackedTransforms& t) const override {
    detail::flush_row_writes(stream_);
    VQ_CHECK(dst.shape().dtype == DType::kF32,
             "[cuda packed store] internal: dequantize_keys expected a float32 store");
    if (n <= 0) return;
    const PackedRowFormat& f = shape_.fk;
    // The store does not know its blocks; the policies never score packed channel-axis rows
    // (skvq::Store::keep refuses a selection over them).
    VQ_CHECK(f.axis == QuantAxis::kToken,
             "[cuda packed store] internal: dequantize_keys expected token-axis key records");
    DequantRowsParams dp;
    dp.records = k_;
    dp.src_cap = capacity_;
    dp.src_row0 = src_row0;
    dp.row_stride = static_cast<int32_t>(f.row_stride);
    dp.code_bytes = f.code_bytes;
    dp.bits = f.spec.bits();
    dp.ternary = f.spec.ternary() ? 1 : 0;
    dp.group_size = f.group_size;
    dp.meta = static_cast<int32_t>(f.meta);
    dp.head_dim = static_cast<int32_t>(shape_.head_dim);
    dp.perm = t.perm_k;
    if (const float* signs = t.signs_for(false)) {
      dp.signs = signs;
      dp.rot_block = t.rot_block;
      dp.rot_norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(t.rot_block)));
    }
    dp.n_frames = shape_.frames();
    dp.heads = shape_.heads;
    dp.n = n;
    dp.dst = static_cast<float*>(dst.keys(0, 0).data);
    dp.dst_cap = dst.capacity();
    dp.dst_row0 = dst_row0;
    dequant_rows_launch(dp, detail::to_stream(stream_));
    if (pos_ && dst.positions())
      detail::copy_frames(const_cast<int32_t*>(dst.positions()), dst.capacity(), dst_row0, pos_,
                          capacity_, src_row0, shape_.frames(), n, 4, stream_);
  }

  std::vector<uint8_t> download(bool values, int64_t row0, int64_t n) const override {
    std::vector<uint8_t> out(static_cast<size_t>(shape_.frames() * n * stride(values)));
    detail::download_frames(out.data(), n, recs(values), capacity_, row0, shape_.frames(), n,
                            stride(values), stream_);
    return out;
  }
  std::vector<int32_t> download_positions(int64_t row0, int64_t n) const override {
    std::vector<int32_t> out(static_cast<size_t>(shape_.frames() * n));
    if (pos_)
      detail::download_frames(out.data(), n, pos_, capacity_, row0, shape_.frames(), n, 4, stream_);
    return out;
  }
  void upload(const void* keys, const void* values, const int32_t* positions, int64_t row0,
              int64_t n) override {
    const int64_t F = shape_.frames();
    detail::upload_frames(k_, capacity_, row0, keys, n, F, n, stride(false), stream_);
    detail::upload_frames(v_, capacity_, row0, values, n, F, n, stride(true), stream_);
    if (positions && pos_)
      detail::upload_frames(pos_, capacity_, row0, positions, n, F, n, 4, stream_);
  }
  int64_t resident_bytes() const override {
    return detail::held_bytes(kb_) + detail::held_bytes(vb_) + detail::held_bytes(pb_);
  }

 private:
  Stream stream_;
  DeviceBuffer kb_, vb_, pb_;
};

class CudaQueryRows final : public kv::QueryRows {
 public:
  DeviceBuffer q;  // [B, hq, rows, D] fp32
  Stream stream = nullptr;
  const float* data() const override { return q.as<const float>(); }
  int64_t resident_bytes() const override { return detail::held_bytes(q); }
  std::vector<float> download() const override {
    return q.to_vector<float>(static_cast<size_t>(batch * hq * rows * head_dim), stream);
  }
};

// The window lives in a buffer of cap steps as the run [start, start + rows): a push writes the
// step after the run; when the run reaches the buffer's end it moves to the front in one copy if
// the two ranges are disjoint (start >= rows), else the buffer grows (at most 2 x max_rows
// steps), so a push is amortised O(1) device work and the view stays one strided run.
class CudaQueryWindow final : public kv::QueryWindow {
 public:
  explicit CudaQueryWindow(Stream s) : stream_(s) {}
  ~CudaQueryWindow() override {
    try {
      synchronize(stream_);  // a queued push or selection may still use the buffer
    } catch (...) {          // a sticky device error: nothing left to protect
    }
  }

  // A buffer of cap steps (the old run moved to its front).
  void reallocate(int64_t cap) {
    DeviceBuffer grown(static_cast<size_t>(cap * step() * 4));
    if (rows > 0)
      detail::copy_frames(grown.data(), cap, 0, buf_.data(), cap_, start_, 1, rows, step() * 4,
                          stream_);
    synchronize(stream_);  // the old buffer is freed next
    buf_ = std::move(grown);
    cap_ = cap;
    start_ = 0;
  }

  void push(const TensorView& q) override {
    if (rows == max_rows) {  // drop the oldest step
      ++start_;
      --rows;
    }
    if (start_ + rows == cap_) {
      if (rows == 0 && cap_ > 0) {
        start_ = 0;
      } else if (rows > 0 && start_ >= rows) {  // disjoint: one copy to the front
        detail::copy_frames(buf_.data(), cap_, 0, buf_.data(), cap_, start_, 1, rows, step() * 4,
                            stream_);
        start_ = 0;
      } else {  // rows + 1 <= max_rows, and cap_ = start_ + rows < 2 * rows < the new size
        reallocate(2 * std::min(max_rows, std::max<int64_t>(rows + 1, 4)));
      }
    }
    detail::convert_block(q, 0, 1, at(start_ + rows), DType::kF32, 1, 0, stream_);
    ++rows;
  }

  TensorView view() const override { return view_at(at(start_)); }

  std::vector<float> download() const override {
    std::vector<float> out(static_cast<size_t>(rows * step()));
    if (rows > 0)
      detail::download_frames(out.data(), rows, buf_.data(), cap_, start_, 1, rows, step() * 4,
                              stream_);
    return out;
  }

  // Rows from host values, step-major (a state file's).
  void upload(const std::vector<float>& q) {
    rows = step() > 0 ? static_cast<int64_t>(q.size()) / step() : 0;
    if (rows == 0) return;
    buf_ = DeviceBuffer(static_cast<size_t>(rows * step() * 4));
    cap_ = rows;
    start_ = 0;
    detail::upload_frames(buf_.data(), cap_, 0, q.data(), rows, 1, rows, step() * 4, stream_);
  }

  int64_t resident_bytes() const override { return detail::held_bytes(buf_); }

 private:
  float* at(int64_t s) const { return buf_.as<float>() + s * step(); }

  Stream stream_;
  DeviceBuffer buf_;  // [cap_][B][hq][D] fp32
  int64_t cap_ = 0, start_ = 0;
};

// What SnapKV scoring reads, on the stream: the first n rows' keys of every frame copied
// contiguous [B, H, n, D], and with a query window q [B, H_q, w, D] its fp32 copy, the rows'
// positions [B, H, n] and the window's positions q_first + i.
struct ScoringFrame {
  DeviceBuffer frame, frame_pos, qbuf, qpos;
  TensorView keys, qv;
  ScoringFrame(const kv::RowStore& rows, int64_t n, const TensorView* q, int64_t q_first,
               Stream st) {
    const kv::RowShape& sh = rows.shape();
    const int64_t F = sh.frames(), D = sh.head_dim, rb = sh.row_bytes();
    frame = DeviceBuffer(static_cast<size_t>(F * n * rb));
    detail::copy_frames(frame.data(), n, 0, CudaRowStore::src_k(rows), rows.capacity(), 0, F, n, rb,
                        st);
    keys = TensorView::contiguous(frame.data(), sh.dtype, sh.batch, sh.heads, n, D);
    if (!q) return;
    const int64_t hq = q->shape[1], w = q->shape[2];
    frame_pos = DeviceBuffer(static_cast<size_t>(F * n * 4));
    detail::copy_frames(frame_pos.data(), n, 0, rows.positions(), rows.capacity(), 0, F, n, 4, st);
    qbuf = DeviceBuffer(static_cast<size_t>(sh.batch * hq * w * D * 4));
    detail::convert_block(*q, 0, w, qbuf.data(), DType::kF32, w, 0, st);
    qpos = DeviceBuffer(static_cast<size_t>(w * 4));
    detail::fill_positions(qpos.as<int32_t>(), 1, w, 0, w, q_first, st);
    qv = TensorView::contiguous(qbuf.data(), DType::kF32, sh.batch, hq, w, D);
  }
};

class CudaBackend final : public kv::RowBackend {
 public:
  explicit CudaBackend(Stream s) : stream_(s) {}

  kv::Device device() const override { return kv::Device::kCuda; }
  std::string name() const override { return "cuda"; }

  std::unique_ptr<kv::RowStore> make(const kv::RowShape& shape, int64_t capacity,
                                     bool with_positions) const override {
    return std::make_unique<CudaRowStore>(shape, capacity, with_positions, stream_);
  }

  std::unique_ptr<kv::QueryRows> keep_queries(const TensorView& queries,
                                              int64_t rows) const override {
    auto out = std::make_unique<CudaQueryRows>();
    out->batch = queries.shape[0];
    out->hq = queries.shape[1];
    out->rows = rows;
    out->head_dim = queries.shape[3];
    out->stream = stream_;
    if (rows > 0) {
      out->q = DeviceBuffer(static_cast<size_t>(out->batch * out->hq * rows * out->head_dim * 4));
      detail::convert_block(queries, queries.shape[2] - rows, rows, out->q.data(), DType::kF32,
                            rows, 0, stream_);
    }
    return out;
  }

  std::unique_ptr<kv::QueryRows> upload_queries(int64_t batch, int64_t hq, int64_t rows,
                                                int64_t head_dim,
                                                const std::vector<float>& q) const override {
    auto out = std::make_unique<CudaQueryRows>();
    out->batch = batch;
    out->hq = hq;
    out->rows = rows;
    out->head_dim = head_dim;
    out->stream = stream_;
    out->q = DeviceBuffer::from_vector(q, stream_);
    return out;
  }

  std::unique_ptr<kv::QueryWindow> make_query_window(int64_t batch, int64_t hq, int64_t head_dim,
                                                     int64_t max_rows,
                                                     const std::vector<float>& q) const override {
    auto out = std::make_unique<CudaQueryWindow>(stream_);
    out->batch = batch;
    out->hq = hq;
    out->head_dim = head_dim;
    out->max_rows = max_rows;
    out->upload(q);
    return out;
  }

  std::unique_ptr<kv::RowIndex> snap_select(const kv::RowStore& rows, int64_t n,
                                            const TensorView* q, int64_t q_first,
                                            const SnapSelectParams& p) const override {
    const kv::RowShape& sh = rows.shape();
    const int64_t F = sh.frames();
    const int64_t count = snap_keep_count(n, p);
    const ScoringFrame sf(rows, n, q, q_first, stream_);
    auto out = std::make_unique<CudaRowIndex>();
    out->count = count;
    out->frames = F;
    out->stream = stream_;
    out->idx = DeviceBuffer(static_cast<size_t>(std::max<int64_t>(F * count, 1) * 4));
    DecodeWorkspace ws;
    const int64_t got = snap_select_frames(
        sf.keys, q ? &sf.qv : nullptr, q ? sf.frame_pos.as<int32_t>() : nullptr,
        q ? sf.qpos.as<int32_t>() : nullptr, p, out->idx.as<int32_t>(), ws, stream_);
    VQ_CHECK(got == count, "[cuda snapkv] internal: selected " + std::to_string(got) +
                               " rows per head, expected " + std::to_string(count));
    vq::cuda::synchronize(stream_);  // the frame copies are freed on return
    return out;
  }

  // Scores (snap_scores), pooling over every row (snap_pool) and the top k of [lo, hi) (snap_select
  // over a contiguous copy of those rows' pooled scores), the indices shifted by lo on the host.
  std::vector<int32_t> snap_select_rows(const kv::RowStore& rows, int64_t n, const TensorView* q,
                                        int64_t q_first, int64_t obs_window, int64_t pool_kernel,
                                        int64_t lo, int64_t hi, int64_t k) const override {
    kv::check_select_rows(rows, n, q, lo, hi, k);
    const kv::RowShape& sh = rows.shape();
    const int64_t F = sh.frames(), m = hi - lo;
    detail::flush_row_writes(stream_);
    const ScoringFrame sf(rows, n, q, q_first, stream_);
    DeviceBuffer scores(static_cast<size_t>(F * n * 4)), pooled,
        top(static_cast<size_t>(F * m * 4));
    DeviceBuffer idx(static_cast<size_t>(F * k * 4));
    snap_scores(sf.keys, q ? &sf.qv : nullptr, q ? sf.frame_pos.as<int32_t>() : nullptr,
                q ? sf.qpos.as<int32_t>() : nullptr, obs_window, scores.as<float>(), stream_);
    const float* sel = scores.as<const float>();
    if (pool_kernel > 1) {
      pooled = DeviceBuffer(static_cast<size_t>(F * n * 4));
      snap_pool(sel, F, n, 0, n, pool_kernel, PoolKind::kMax, pooled.as<float>(), stream_);
      sel = pooled.as<const float>();
    }
    detail::copy_frames(top.data(), m, 0, sel, n, lo, F, m, 4, stream_);
    const int64_t got =
        vq::cuda::snap_select(top.as<const float>(), F, m, k, 0, -1, idx.as<int32_t>(), stream_);
    VQ_CHECK(got == k, "[cuda snap_select_rows] internal: selected " + std::to_string(got) +
                           " rows per head, expected " + std::to_string(k));
    std::vector<int32_t> out = idx.to_vector<int32_t>(static_cast<size_t>(F * k), stream_);
    for (int32_t& i : out) i += static_cast<int32_t>(lo);
    return out;  // to_vector synchronised: the buffers are idle
  }

  std::unique_ptr<kv::RowIndex> upload_index(int64_t count,
                                             const std::vector<int32_t>& idx) const override {
    auto out = std::make_unique<CudaRowIndex>();
    out->count = count;
    out->frames = count > 0 ? static_cast<int64_t>(idx.size()) / count : 0;
    out->stream = stream_;
    if (!idx.empty()) out->idx = DeviceBuffer::from_vector(idx, stream_);
    return out;
  }

  std::unique_ptr<kv::PackedStore> make_packed(const kv::PackedShape& shape, int64_t capacity,
                                               bool with_positions) const override {
    return std::make_unique<CudaPackedStore>(shape, capacity, with_positions, stream_);
  }

  std::unique_ptr<kv::PackedTransforms> make_transforms(
      const std::vector<int32_t>& perm_k, const std::vector<int32_t>& perm_v,
      const std::vector<float>& signs, int32_t rot_block, bool rotate_values,
      const std::vector<double>& key_u) const override {
    auto t = std::make_unique<CudaTransforms>();
    if (!perm_k.empty()) t->pk = DeviceBuffer::from_vector(perm_k, stream_);
    if (!perm_v.empty()) t->pv = DeviceBuffer::from_vector(perm_v, stream_);
    if (!signs.empty()) t->sg = DeviceBuffer::from_vector(signs, stream_);
    if (!key_u.empty()) t->ku = DeviceBuffer::from_vector(key_u, stream_);
    t->key_u = t->ku.as<const double>();
    t->perm_k = t->pk.as<const int32_t>();
    t->perm_v = t->pv.as<const int32_t>();
    t->signs = t->sg.as<const float>();
    t->rot_block = t->signs ? rot_block : 0;
    t->rotate_values = rotate_values;
    t->bytes = detail::held_bytes(t->pk) + detail::held_bytes(t->pv) + detail::held_bytes(t->sg) +
               detail::held_bytes(t->ku);
    return t;
  }

  std::vector<int32_t> channel_perms(const kv::RowStore& rows, int64_t row0, int64_t n,
                                     bool values) const override {
    const kv::RowShape& sh = rows.shape();
    const int64_t F = sh.frames(), rb = sh.row_bytes();
    DeviceBuffer x(static_cast<size_t>(F * n * rb));
    const TensorView src = values ? rows.values(0, 0) : rows.keys(0, 0);
    detail::copy_frames(x.data(), n, 0, src.data, rows.capacity(), row0, F, n, rb, stream_);
    DeviceBuffer perm(static_cast<size_t>(sh.heads * sh.head_dim * 4));
    skvq_channel_perms(
        TensorView::contiguous(x.data(), sh.dtype, sh.batch, sh.heads, n, sh.head_dim),
        perm.as<int32_t>(), stream_);
    return perm.to_vector<int32_t>(static_cast<size_t>(sh.heads * sh.head_dim), stream_);
  }

  bool one_packed_run() const override { return true; }
  bool keeps_tail_room() const override { return true; }

  void synchronize() const override {
    detail::flush_row_writes(stream_);
    vq::cuda::synchronize(stream_);
  }

 private:
  Stream stream_;
};

}  // namespace

std::unique_ptr<kv::RowBackend> make_row_backend(Stream s) {
  return std::make_unique<CudaBackend>(s);
}

}  // namespace vq::cuda
