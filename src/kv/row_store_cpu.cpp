// The CPU row backend (src/kv/row_store.h): stores in aligned host memory (2 MiB aligned and
// advised for transparent huge pages from 2 MiB up, so growing a large store faults in few pages;
// never zero-filled: only written rows are read), block conversion through convert_view_row,
// frame-parallel gathers, and the SnapKV selection of snap_select_head per (b, h) in parallel.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "kv/row_store.h"
#include "veloxquant/error.h"

namespace vq::kv {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;  // transparent huge page size on x86-64 Linux

// Uninitialised host allocation of at least `bytes`, 64-byte aligned (2 MiB from 2 MiB up).
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(size_t bytes) {
    if (bytes == 0) return;
    // More than 1 TiB is memory no host gives: refused as an allocation failure up front (some
    // allocators, ASan's among them, abort on such a request instead of returning null).
    if (bytes > (size_t{1} << 40)) throw std::bad_alloc();
    const size_t align = bytes >= kHugePage ? kHugePage : 64;
    const size_t rounded = (bytes + align - 1) / align * align;  // aligned_alloc needs a multiple
    void* p = std::aligned_alloc(align, rounded);
    if (!p) throw std::bad_alloc();
#ifdef __linux__
    // Advice only: without transparent huge pages the buffer simply uses 4 KiB pages.
    if (align == kHugePage) (void)madvise(p, rounded, MADV_HUGEPAGE);
#endif
    p_.reset(p);
    bytes_ = rounded;
  }
  void* data() const {
    return p_.get();
  }
  size_t bytes() const {
    return bytes_;
  }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, Free> p_;
  size_t bytes_ = 0;
};

class CpuRowIndex final : public RowIndex {
 public:
  std::vector<int32_t> idx;  // [F, count]
  const int32_t* data() const override { return idx.data(); }
};

class CpuRowStore final : public RowStore {
 public:
  CpuRowStore(const RowShape& s, int64_t cap, bool with_pos) {
    shape_ = s;
    capacity_ = cap;
    with_pos_ = with_pos;
    const size_t rows = static_cast<size_t>(s.frames() * cap);
    kb_ = HostBuffer(rows * static_cast<size_t>(s.row_bytes()));
    vb_ = HostBuffer(rows * static_cast<size_t>(s.row_bytes()));
    if (with_pos) pb_ = HostBuffer(rows * sizeof(int32_t));
    k_ = kb_.data();
    v_ = vb_.data();
    pos_ = static_cast<int32_t*>(pb_.data());
  }

  char* krow(int64_t f, int64_t i) const { return row(k_, f, i); }
  char* vrow(int64_t f, int64_t i) const { return row(v_, f, i); }

  void copy_range(const RowStore& src_base, int64_t src_row0, int64_t dst_row0,
                  int64_t n) override {
    const auto& src = static_cast<const CpuRowStore&>(src_base);
    const size_t rb = static_cast<size_t>(shape_.row_bytes());
    // memmove: src may be this store with overlapping ranges.
    for (int64_t f = 0; f < shape_.frames() && n > 0; ++f) {
      std::memmove(krow(f, dst_row0), src.krow(f, src_row0), rb * static_cast<size_t>(n));
      std::memmove(vrow(f, dst_row0), src.vrow(f, src_row0), rb * static_cast<size_t>(n));
      if (pos_ && src.pos_)
        std::memmove(pos_ + f * capacity_ + dst_row0, src.pos_ + f * src.capacity_ + src_row0,
                     sizeof(int32_t) * static_cast<size_t>(n));
    }
  }

  void write_block(const TensorView& keys, const TensorView& values, int64_t s0, int64_t n,
                   int64_t row0) override {
    const int64_t H = shape_.heads;
    for (int64_t b = 0; b < shape_.batch; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < n; ++i) {
          convert_view_row(keys, b, h, s0 + i, krow(b * H + h, row0 + i), shape_.dtype);
          convert_view_row(values, b, h, s0 + i, vrow(b * H + h, row0 + i), shape_.dtype);
        }
  }

  void fill_positions(int64_t row0, int64_t n, int64_t first) override {
    for (int64_t f = 0; f < shape_.frames(); ++f)
      for (int64_t i = 0; i < n; ++i)
        pos_[f * capacity_ + row0 + i] = static_cast<int32_t>(first + i);
  }

  void gather(const RowStore& src_base, const RowIndex& idx, int64_t src_first) override {
    const auto& src = static_cast<const CpuRowStore&>(src_base);
    const size_t rb = static_cast<size_t>(shape_.row_bytes());
    const int64_t count = idx.count;
    const int32_t* ix = idx.data();
#pragma omp parallel for schedule(static) if (shape_.frames() * count * shape_.row_bytes() > \
                                              (1 << 20))
    for (int64_t f = 0; f < shape_.frames(); ++f)
      for (int64_t i = 0; i < count; ++i) {
        const int64_t j = ix[f * count + i];
        std::memcpy(krow(f, i), src.krow(f, j), rb);
        std::memcpy(vrow(f, i), src.vrow(f, j), rb);
        if (pos_)
          pos_[f * capacity_ + i] =
              src.pos_ ? src.pos_[f * src.capacity_ + j] : static_cast<int32_t>(src_first + j);
      }
  }

  Tensor download(bool values, int64_t row0, int64_t n) const override {
    Tensor t(shape_.dtype, shape_.batch, shape_.heads, n, shape_.head_dim);
    const size_t rb = static_cast<size_t>(shape_.row_bytes());
    for (int64_t f = 0; f < shape_.frames() && n > 0; ++f)
      std::memcpy(static_cast<char*>(t.data()) + static_cast<size_t>(f * n) * rb,
                  values ? vrow(f, row0) : krow(f, row0), rb * static_cast<size_t>(n));
    return t;
  }

  std::vector<int32_t> download_positions(int64_t n) const override {
    std::vector<int32_t> out(static_cast<size_t>(shape_.frames() * n));
    for (int64_t f = 0; f < shape_.frames() && pos_; ++f)
      std::memcpy(out.data() + f * n, pos_ + f * capacity_,
                  sizeof(int32_t) * static_cast<size_t>(n));
    return out;
  }

  void upload(const TensorView& keys, const TensorView& values, int64_t row0, int64_t n,
              const std::vector<int32_t>* positions) override {
    const size_t rb = static_cast<size_t>(shape_.row_bytes());
    for (int64_t f = 0; f < shape_.frames() && n > 0; ++f) {
      std::memcpy(krow(f, row0),
                  static_cast<const char*>(keys.data) + static_cast<size_t>(f * n) * rb,
                  rb * static_cast<size_t>(n));
      std::memcpy(vrow(f, row0),
                  static_cast<const char*>(values.data) + static_cast<size_t>(f * n) * rb,
                  rb * static_cast<size_t>(n));
      if (positions && pos_)
        std::memcpy(pos_ + f * capacity_ + row0, positions->data() + f * n,
                    sizeof(int32_t) * static_cast<size_t>(n));
    }
  }

  int64_t resident_bytes() const override {
    return static_cast<int64_t>(kb_.bytes() + vb_.bytes() + pb_.bytes());
  }

 private:
  char* row(void* base, int64_t f, int64_t i) const {
    return static_cast<char*>(base) + (f * capacity_ + i) * shape_.row_bytes();
  }
  HostBuffer kb_, vb_, pb_;
};

class CpuQueryRows final : public QueryRows {
 public:
  std::vector<float> q;
  const float* data() const override { return q.data(); }
  int64_t resident_bytes() const override {
    return static_cast<int64_t>(q.capacity() * sizeof(float));
  }
  std::vector<float> download() const override { return q; }
};

class CpuBackend final : public RowBackend {
 public:
  Device device() const override { return Device::kCpu; }
  std::string name() const override { return "cpu"; }

  std::unique_ptr<RowStore> make(const RowShape& shape, int64_t capacity,
                                 bool with_positions) const override {
    return std::make_unique<CpuRowStore>(shape, capacity, with_positions);
  }

  std::unique_ptr<QueryRows> keep_queries(const TensorView& queries, int64_t rows) const override {
    auto out = std::make_unique<CpuQueryRows>();
    const int64_t B = queries.shape[0], hq = queries.shape[1], S = queries.shape[2];
    const int64_t D = queries.shape[3];
    out->batch = B;
    out->hq = hq;
    out->rows = rows;
    out->head_dim = D;
    out->q.resize(static_cast<size_t>(B * hq * rows * D));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t i = 0; i < rows; ++i)
          convert_view_row(queries, b, h, S - rows + i,
                           out->q.data() + ((b * hq + h) * rows + i) * D, DType::kF32);
    return out;
  }

  std::unique_ptr<QueryRows> upload_queries(int64_t batch, int64_t hq, int64_t rows,
                                            int64_t head_dim,
                                            const std::vector<float>& q) const override {
    auto out = std::make_unique<CpuQueryRows>();
    out->batch = batch;
    out->hq = hq;
    out->rows = rows;
    out->head_dim = head_dim;
    out->q = q;
    return out;
  }

  std::unique_ptr<RowIndex> snap_select(const RowStore& rows_base, int64_t n, const TensorView* q,
                                        int64_t q_first, const SnapSelectParams& p) const override {
    const auto& rows = static_cast<const CpuRowStore&>(rows_base);
    const RowShape& sh = rows.shape();
    const int64_t count = snap_keep_count(n, p);
    const int64_t F = sh.frames(), H = sh.heads, d = sh.head_dim;
    auto out = std::make_unique<CpuRowIndex>();
    out->count = count;
    out->idx.resize(static_cast<size_t>(F * count));
    const int64_t n_rep = q ? q->shape[1] / H : 0;
    const int64_t w_q = q ? q->shape[2] : 0;
    const bool scored = count < n && count > std::min(std::max<int64_t>(p.n_sink, 0), count);

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
      for (int64_t f = 0; f < F; ++f) {
        try {
          const int64_t b = f / H, h = f % H;
          const int32_t* fpos = rows.positions() + f * rows.capacity();
          std::copy(fpos, fpos + n, pos.begin());
          if (scored) {  // the fp32 frame is only read when scores matter
            frame.resize(static_cast<size_t>(n * d));
            to_f32(rows.krow(f, 0), sh.dtype, frame.data(), static_cast<size_t>(n * d));
          }
          SnapQueryWindow qw;
          if (q && scored) {
            qwin.resize(static_cast<size_t>(n_rep * w_q * d));
            for (int64_t r = 0; r < n_rep; ++r)
              for (int64_t i = 0; i < w_q; ++i)
                convert_view_row(*q, b, h * n_rep + r, i, qwin.data() + (r * w_q + i) * d,
                                 DType::kF32);
            for (int64_t i = 0; i < w_q; ++i) qpos[i] = static_cast<int32_t>(q_first + i);
            qw.data = qwin.data();
            qw.n_rep = n_rep;
            qw.w = w_q;
            qw.positions = qpos.data();
          }
          const int64_t got =
              snap_select_head(scored ? frame.data() : nullptr, q ? pos.data() : nullptr, n, d,
                               q && scored ? &qw : nullptr, p, idx.data(), scratch);
          VQ_CHECK(got == count, "[snapkv] internal: head selected " + std::to_string(got) +
                                     " rows, expected " + std::to_string(count));
          for (int64_t i = 0; i < count; ++i)
            out->idx[static_cast<size_t>(f * count + i)] = static_cast<int32_t>(idx[i]);
        } catch (...) {
#pragma omp critical(vq_snap_select_failure)
          if (!failure) failure = std::current_exception();
        }
      }
    }
    if (failure) std::rethrow_exception(failure);
    return out;
  }
};

}  // namespace

void RowStateHead::write(StateWriter& w) const {
  w.boolean(has_data);
  w.u8(static_cast<uint8_t>(dtype));
  w.i64(batch);
  w.i64(heads);
  w.i64(head_dim);
  w.i64(offset);
}

RowStateHead RowStateHead::read(StateReader& r, const char* method) {
  RowStateHead h;
  h.has_data = r.boolean();
  const uint8_t dt = r.u8();
  VQ_CHECK(dt == static_cast<uint8_t>(DType::kF16) || dt == static_cast<uint8_t>(DType::kBF16),
           std::string("[load_state] ") + method +
               ": expected storage dtype float16 or bfloat16 but got code " + std::to_string(dt));
  h.dtype = static_cast<DType>(dt);
  constexpr int64_t kMaxDim = int64_t{1} << 24;
  const int64_t lo = h.has_data ? 1 : 0;
  h.batch = r.i64_in("batch", lo, h.has_data ? kMaxDim : 0);
  h.heads = r.i64_in("heads", lo, h.has_data ? kMaxDim : 0);
  h.head_dim = r.i64_in("head_dim", lo, h.has_data ? kMaxDim : 0);
  h.offset = r.i64_in("offset", 0, INT32_MAX);
  return h;
}

const RowBackend& cpu_backend() {
  static const CpuBackend backend;
  return backend;
}

}  // namespace vq::kv
