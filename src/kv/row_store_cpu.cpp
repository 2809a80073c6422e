// The CPU row backend (src/kv/row_store.h): stores in aligned host memory (2 MiB aligned and
// advised for transparent huge pages from 2 MiB up, so growing a large store faults in few pages;
// never zero-filled: only written rows are read), block conversion through convert_view_row,
// frame-parallel gathers, and the SnapKV selection of snap_select_head per (b, h) in parallel.
// Query windows (decode-time SnapKV): a step-major host vector.
// Packed stores: host records, quantized per frame in parallel with the scalar-exact quantizer of
// group_quant.h (quantize_to_records) after the frozen rotation / permutation.
#include <algorithm>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <new>
#include <numeric>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "kv/row_store.h"
#include "ops/thread_pool.h"
#include "veloxquant/error.h"
#include "veloxquant/hadamard.h"

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

// Positions [F, n] of rows [row0, row0 + n) of a store's positions [F, cap] (zeros without).
std::vector<int32_t> positions_of(const int32_t* pos, int64_t frames, int64_t cap, int64_t row0,
                                  int64_t n) {
  std::vector<int32_t> out(static_cast<size_t>(frames * n));
  for (int64_t f = 0; f < frames && pos && n > 0; ++f)
    std::memcpy(out.data() + f * n, pos + f * cap + row0, sizeof(int32_t) * static_cast<size_t>(n));
  return out;
}

class CpuRowIndex final : public RowIndex {
 public:
  std::vector<int32_t> idx;  // [F, count]
  const int32_t* data() const override { return idx.data(); }
  std::vector<int32_t> download() const override { return idx; }
};

// n elements of type t -> fp32, with the hardware fp16 conversion where the build has F16C
// (exact either way: every fp16 / bf16 value is an fp32 value).
void fast_to_f32(const void* src, DType t, float* dst, size_t n) {
  if (t == DType::kF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    size_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
    for (; i < n; ++i) dst[i] = fp16_to_f32(s[i]);
    return;
  }
  to_f32(src, t, dst, n);
}

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
    const DType st = src.shape().dtype;
    // memmove: src may be this store with overlapping ranges.
    for (int64_t f = 0; f < shape_.frames() && n > 0; ++f) {
      if (st != shape_.dtype) {  // another store (a dtype is a store's own)
        const size_t m = static_cast<size_t>(n * shape_.head_dim);
        convert_row(src.krow(f, src_row0), st, krow(f, dst_row0), shape_.dtype, m);
        convert_row(src.vrow(f, src_row0), st, vrow(f, dst_row0), shape_.dtype, m);
      } else {
        std::memmove(krow(f, dst_row0), src.krow(f, src_row0), rb * static_cast<size_t>(n));
        std::memmove(vrow(f, dst_row0), src.vrow(f, src_row0), rb * static_cast<size_t>(n));
      }
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
    // frames on the worker pool (ops/thread_pool.h) from 1 MiB of rows
    const bool par = shape_.frames() * count * shape_.row_bytes() > (1 << 20);
    ops::parallel_for_if(
        par, shape_.frames(),
        [&](int64_t f) {
          for (int64_t i = 0; i < count; ++i) {
            const int64_t j = ix[f * count + i];
            std::memcpy(krow(f, i), src.krow(f, j), rb);
            std::memcpy(vrow(f, i), src.vrow(f, j), rb);
            if (pos_)
              pos_[f * capacity_ + i] =
                  src.pos_ ? src.pos_[f * src.capacity_ + j] : static_cast<int32_t>(src_first + j);
          }
        },
        ops::Claim::kOne);
  }

  Tensor download(bool values, int64_t row0, int64_t n) const override {
    Tensor t(shape_.dtype, shape_.batch, shape_.heads, n, shape_.head_dim);
    const size_t rb = static_cast<size_t>(shape_.row_bytes());
    for (int64_t f = 0; f < shape_.frames() && n > 0; ++f)
      std::memcpy(static_cast<char*>(t.data()) + static_cast<size_t>(f * n) * rb,
                  values ? vrow(f, row0) : krow(f, row0), rb * static_cast<size_t>(n));
    return t;
  }

  std::vector<int32_t> download_positions(int64_t row0, int64_t n) const override {
    return positions_of(pos_, shape_.frames(), capacity_, row0, n);
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

class CpuTransforms final : public PackedTransforms {
 public:
  std::vector<int32_t> pk, pv;
  std::vector<float> sg;
  std::vector<double> ku;
};

class CpuPackedStore final : public PackedStore {
 public:
  CpuPackedStore(const PackedShape& s, int64_t cap, bool with_pos) {
    shape_ = s;
    capacity_ = cap;
    const size_t rows = static_cast<size_t>(s.frames() * cap);
    kb_ = HostBuffer(rows * static_cast<size_t>(s.fk.row_stride));
    vb_ = HostBuffer(rows * static_cast<size_t>(s.fv.row_stride));
    if (with_pos) pb_ = HostBuffer(rows * sizeof(int32_t));
    k_ = static_cast<uint8_t*>(kb_.data());
    v_ = static_cast<uint8_t*>(vb_.data());
    pos_ = static_cast<int32_t*>(pb_.data());
  }

  uint8_t* rec(bool values, int64_t f, int64_t i) const {
    const int64_t st = shape_.format(values).row_stride;
    return (values ? v_ : k_) + (f * capacity_ + i) * st;
  }

  void copy_range(const PackedStore& src_base, int64_t src_row0, int64_t dst_row0,
                  int64_t n) override {
    const auto& src = static_cast<const CpuPackedStore&>(src_base);
    for (int64_t f = 0; f < shape_.frames() && n > 0; ++f) {
      for (int kv = 0; kv < 2; ++kv)
        std::memcpy(rec(kv, f, dst_row0), src.rec(kv, f, src_row0),
                    static_cast<size_t>(n * shape_.format(kv).row_stride));
      if (pos_ && src.pos_)
        std::memcpy(pos_ + f * capacity_ + dst_row0, src.pos_ + f * src.capacity_ + src_row0,
                    sizeof(int32_t) * static_cast<size_t>(n));
    }
  }

  void quantize(const RowStore& rows_base, int64_t src_row0, int64_t n, int64_t dst_row0,
                const GroupQuantParams& qk, const GroupQuantParams& qv,
                const PackedTransforms& t) override {
    const auto& rows = static_cast<const CpuRowStore&>(rows_base);
    const int64_t F = shape_.frames(), H = shape_.heads, d = shape_.head_dim;
    if (n <= 0) return;
    std::exception_ptr failure;
    std::mutex failure_mu;
    const auto frame = [&](int64_t f) {
      try {
        std::vector<float> x(static_cast<size_t>(n * d)), tmp(static_cast<size_t>(d));
        const int64_t h = f % H;
        for (int kv = 0; kv < 2; ++kv) {
          fast_to_f32(kv ? rows.vrow(f, src_row0) : rows.krow(f, src_row0), rows.shape().dtype,
                      x.data(), x.size());
          const int32_t* perm = t.perm(kv);
          const float* signs = t.signs_for(kv);
          if (perm || signs)
            for (int64_t i = 0; i < n; ++i) {
              float* row = x.data() + i * d;
              if (signs) hadamard_rotate(row, signs + h * d, d, t.rot_block);
              if (perm) {
                for (int64_t j = 0; j < d; ++j) tmp[static_cast<size_t>(j)] = row[perm[h * d + j]];
                std::copy(tmp.begin(), tmp.end(), row);
              }
            }
          const PackedRowFormat& fmt = shape_.format(kv);
          if (fmt.axis == QuantAxis::kChannel)  // the n rows are one chunk (packed.h)
            quantize_chunk_to_records(x.data(), n, fmt, kv ? qv : qk, rec(kv, f, dst_row0),
                                      fmt.row_stride,
                                      !kv && t.key_u ? t.key_u + h * d * d : nullptr);
          else
            quantize_to_records(x.data(), n, fmt, kv ? qv : qk, rec(kv, f, dst_row0),
                                fmt.row_stride, false);
        }
        if (pos_ && rows.positions())
          std::memcpy(pos_ + f * capacity_ + dst_row0,
                      rows.positions() + f * rows.capacity() + src_row0,
                      sizeof(int32_t) * static_cast<size_t>(n));
      } catch (...) {
        std::lock_guard<std::mutex> lk(failure_mu);
        if (!failure) failure = std::current_exception();
      }
    };
    ops::parallel_for_if(F > 1, F, frame, ops::Claim::kOne);
    if (failure) std::rethrow_exception(failure);
  }

  void gather(const PackedStore& src_base, const RowIndex& idx) override {
    const auto& src = static_cast<const CpuPackedStore&>(src_base);
    const int64_t count = idx.count;
    const int32_t* ix = idx.data();
    for (int64_t f = 0; f < shape_.frames(); ++f)
      for (int64_t i = 0; i < count; ++i) {
        const int64_t j = ix[f * count + i];
        for (int kv = 0; kv < 2; ++kv)
          std::memcpy(rec(kv, f, i), src.rec(kv, f, j),
                      static_cast<size_t>(shape_.format(kv).row_stride));
        if (pos_ && src.pos_) pos_[f * capacity_ + i] = src.pos_[f * src.capacity_ + j];
      }
  }

  void dequantize_keys(int64_t src_row0, int64_t n, RowStore& dst_base, int64_t dst_row0,
                       const PackedTransforms& t) const override {
    auto& dst = static_cast<CpuRowStore&>(dst_base);
    VQ_CHECK(dst.shape().dtype == DType::kF32,
             "[packed_store] internal: dequantize_keys expected a float32 store");
    const PackedSegment seg = segment(src_row0, n, DType::kF32, t);
    const int64_t H = shape_.heads, d = shape_.head_dim;
    ops::parallel_for_if(
        shape_.frames() * n > 256, shape_.frames(),
        [&](int64_t f) {
          for (int64_t i = 0; i < n; ++i)
            dequantize_row(seg.keys, f / H, f % H, i,
                           reinterpret_cast<float*>(dst.krow(f, dst_row0 + i)));
          if (pos_ && dst.positions())
            std::memcpy(const_cast<int32_t*>(dst.positions()) + f * dst.capacity() + dst_row0,
                        pos_ + f * capacity_ + src_row0, sizeof(int32_t) * static_cast<size_t>(n));
        },
        ops::Claim::kOne);
    (void)d;
  }

  std::vector<uint8_t> download(bool values, int64_t row0, int64_t n) const override {
    const int64_t st = shape_.format(values).row_stride;
    std::vector<uint8_t> out(static_cast<size_t>(shape_.frames() * n * st));
    for (int64_t f = 0; f < shape_.frames() && n > 0; ++f)
      std::memcpy(out.data() + f * n * st, rec(values, f, row0), static_cast<size_t>(n * st));
    return out;
  }
  std::vector<int32_t> download_positions(int64_t row0, int64_t n) const override {
    return positions_of(pos_, shape_.frames(), capacity_, row0, n);
  }
  void upload(const void* keys, const void* values, const int32_t* positions, int64_t row0,
              int64_t n) override {
    for (int64_t f = 0; f < shape_.frames() && n > 0; ++f) {
      for (int kv = 0; kv < 2; ++kv) {
        const int64_t st = shape_.format(kv).row_stride;
        std::memcpy(rec(kv, f, row0), static_cast<const uint8_t*>(kv ? values : keys) + f * n * st,
                    static_cast<size_t>(n * st));
      }
      if (positions && pos_)
        std::memcpy(pos_ + f * capacity_ + row0, positions + f * n,
                    sizeof(int32_t) * static_cast<size_t>(n));
    }
  }
  int64_t resident_bytes() const override {
    return static_cast<int64_t>(kb_.bytes() + vb_.bytes() + pb_.bytes());
  }

 private:
  HostBuffer kb_, vb_, pb_;
};

// Stable ascending per-channel range of rows [n, d] fp32 (NaN ranges as +inf): one head's SKVQ
// permutation.
std::vector<int32_t> channel_range_perm(const float* rows, int64_t n, int64_t d) {
  std::vector<float> range(static_cast<size_t>(d), 0.0f);
  if (n > 0) {
    std::vector<float> mn(rows, rows + d), mx(rows, rows + d);
    for (int64_t i = 1; i < n; ++i)
      for (int64_t c = 0; c < d; ++c) {
        const float x = rows[i * d + c];
        mn[c] = std::min(mn[c], x);
        mx[c] = std::max(mx[c], x);
      }
    for (int64_t c = 0; c < d; ++c) {
      const float r = mx[c] - mn[c];
      range[c] = std::isnan(r) ? std::numeric_limits<float>::infinity() : r;
    }
  }
  std::vector<int32_t> perm(static_cast<size_t>(d));
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(),
                   [&](int32_t a, int32_t b) { return range[a] < range[b]; });
  return perm;
}

class CpuQueryRows final : public QueryRows {
 public:
  std::vector<float> q;
  const float* data() const override { return q.data(); }
  int64_t resident_bytes() const override {
    return static_cast<int64_t>(q.capacity() * sizeof(float));
  }
  std::vector<float> download() const override { return q; }
};

// A plain vector, step-major: a push past max_rows erases the oldest step (a move of the
// window, obs_window steps at most). Resident bytes count the kept steps.
class CpuQueryWindow final : public QueryWindow {
 public:
  std::vector<float> q;
  void push(const TensorView& src) override {
    const int64_t n = step();
    if (rows == max_rows) {
      q.erase(q.begin(), q.begin() + n);  // drop the oldest step
      --rows;
    }
    q.resize(static_cast<size_t>((rows + 1) * n));
    float* dst = q.data() + rows * n;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < hq; ++h)
        convert_view_row(src, b, h, 0, dst + (b * hq + h) * head_dim, DType::kF32);
    ++rows;
  }
  TensorView view() const override { return view_at(q.data()); }
  std::vector<float> download() const override { return q; }
  int64_t resident_bytes() const override { return static_cast<int64_t>(q.size() * sizeof(float)); }
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

  std::unique_ptr<QueryWindow> make_query_window(int64_t batch, int64_t hq, int64_t head_dim,
                                                 int64_t max_rows,
                                                 const std::vector<float>& q) const override {
    auto out = std::make_unique<CpuQueryWindow>();
    out->batch = batch;
    out->hq = hq;
    out->head_dim = head_dim;
    out->max_rows = max_rows;
    const int64_t n = batch * hq * head_dim;
    out->rows = n > 0 ? static_cast<int64_t>(q.size()) / n : 0;
    out->q = q;
    return out;
  }

  std::unique_ptr<RowIndex> upload_index(int64_t count,
                                         const std::vector<int32_t>& idx) const override {
    auto out = std::make_unique<CpuRowIndex>();
    out->count = count;
    out->idx = idx;
    return out;
  }
  std::unique_ptr<PackedStore> make_packed(const PackedShape& shape, int64_t capacity,
                                           bool with_positions) const override {
    return std::make_unique<CpuPackedStore>(shape, capacity, with_positions);
  }
  std::unique_ptr<PackedTransforms> make_transforms(
      const std::vector<int32_t>& perm_k, const std::vector<int32_t>& perm_v,
      const std::vector<float>& signs, int32_t rot_block, bool rotate_values,
      const std::vector<double>& key_u) const override {
    auto t = std::make_unique<CpuTransforms>();
    t->pk = perm_k;
    t->pv = perm_v;
    t->sg = signs;
    t->ku = key_u;
    t->key_u = t->ku.empty() ? nullptr : t->ku.data();
    t->perm_k = t->pk.empty() ? nullptr : t->pk.data();
    t->perm_v = t->pv.empty() ? nullptr : t->pv.data();
    t->signs = t->sg.empty() ? nullptr : t->sg.data();
    t->rot_block = t->signs ? rot_block : 0;
    t->rotate_values = rotate_values;
    t->bytes = static_cast<int64_t>((t->pk.capacity() + t->pv.capacity() + t->sg.capacity()) * 4 +
                                    t->ku.capacity() * sizeof(double));
    return t;
  }
  std::vector<int32_t> channel_perms(const RowStore& rows_base, int64_t row0, int64_t n,
                                     bool values) const override {
    const auto& rows = static_cast<const CpuRowStore&>(rows_base);
    const RowShape& sh = rows.shape();
    const int64_t B = sh.batch, H = sh.heads, d = sh.head_dim;
    std::vector<int32_t> out(static_cast<size_t>(H * d));
    std::vector<float> x(static_cast<size_t>(B * n * d));
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t f = b * H + h;
        fast_to_f32(values ? rows.vrow(f, row0) : rows.krow(f, row0), sh.dtype,
                    x.data() + b * n * d, static_cast<size_t>(n * d));
      }
      const auto p = channel_range_perm(x.data(), B * n, d);
      std::copy(p.begin(), p.end(), out.begin() + h * d);
    }
    return out;
  }

  std::vector<int32_t> snap_select_rows(const RowStore& rows_base, int64_t n, const TensorView* q,
                                        int64_t q_first, int64_t obs_window, int64_t pool_kernel,
                                        int64_t lo, int64_t hi, int64_t k) const override {
    check_select_rows(rows_base, n, q, lo, hi, k);
    const auto& rows = static_cast<const CpuRowStore&>(rows_base);
    const RowShape& sh = rows.shape();
    const int64_t F = sh.frames(), H = sh.heads, d = sh.head_dim;
    const int64_t n_rep = q ? q->shape[1] / H : 0, w = q ? q->shape[2] : 0;
    std::vector<int32_t> out(static_cast<size_t>(F * k));
    std::vector<float> sc(static_cast<size_t>(n)), pooled(static_cast<size_t>(n)), qwin;
    std::vector<int32_t> qpos(static_cast<size_t>(w));
    for (int64_t i = 0; i < w; ++i) qpos[i] = static_cast<int32_t>(q_first + i);
    std::vector<int64_t> idx(static_cast<size_t>(k));
    for (int64_t f = 0; f < F; ++f) {
      const float* kf = reinterpret_cast<const float*>(rows.krow(f, 0));
      if (q) {
        const int64_t b = f / H, h = f % H;
        qwin.resize(static_cast<size_t>(n_rep * w * d));
        for (int64_t r = 0; r < n_rep; ++r)
          for (int64_t i = 0; i < w; ++i)
            convert_view_row(*q, b, h * n_rep + r, i, qwin.data() + (r * w + i) * d, DType::kF32);
        snap_query_scores(kf, rows.positions() + f * rows.capacity(), n, d, qwin.data(),
                          qpos.data(), n_rep, w, sc.data());
      } else {
        snap_key_proxy_scores(kf, n, d, obs_window, sc.data());
      }
      snap_pool_scores(sc.data(), n, pool_kernel, PoolKind::kMax, pooled.data());
      const int64_t got = vq::snap_select(pooled.data() + lo, hi - lo, k, 0, idx.data());
      VQ_CHECK(got == k, "[snap_select_rows] internal: selected " + std::to_string(got) +
                             " rows, expected " + std::to_string(k));
      for (int64_t i = 0; i < k; ++i)
        out[static_cast<size_t>(f * k + i)] = static_cast<int32_t>(lo + idx[i]);
    }
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
    std::mutex failure_mu;
    ops::parallel_for(
        F,
        [&](int64_t f) {
          try {
            SnapScratch scratch;
            std::vector<float> frame;
            std::vector<int32_t> pos(static_cast<size_t>(n));
            std::vector<float> qwin;
            std::vector<int32_t> qpos(static_cast<size_t>(w_q));
            std::vector<int64_t> idx(static_cast<size_t>(count));
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
            std::lock_guard<std::mutex> lk(failure_mu);
            if (!failure) failure = std::current_exception();
          }
        },
        ops::Claim::kOne);
    if (failure) std::rethrow_exception(failure);
    return out;
  }
};

}  // namespace

void move_rows_down(RowStore& rows, int64_t from, int64_t to, int64_t n) {
  VQ_CHECK(0 <= to && to < from && n >= 0,
           "[move_rows_down] expected 0 <= to < from and n >= 0 but got from " +
               std::to_string(from) + ", to " + std::to_string(to) + ", n " + std::to_string(n));
  const int64_t shift = from - to;
  for (int64_t i = 0; i < n; i += shift)
    rows.copy_range(rows, from + i, to + i, std::min(shift, n - i));
}

void check_select_rows(const RowStore& rows, int64_t n, const TensorView* q, int64_t lo, int64_t hi,
                       int64_t k) {
  const RowShape& sh = rows.shape();
  VQ_CHECK(sh.dtype == DType::kF32 && n >= 1 && n <= rows.capacity() && lo >= 0 && k >= 1 &&
               lo + k <= hi && hi <= n && (!q || rows.has_positions()),
           "[snap_select_rows] expected fp32 rows (with positions for query scoring), 1 <= n <= "
           "capacity " +
               std::to_string(rows.capacity()) +
               ", 0 <= lo, 1 <= k <= hi - lo, hi <= n but got n " + std::to_string(n) + ", lo " +
               std::to_string(lo) + ", hi " + std::to_string(hi) + ", k " + std::to_string(k));
  VQ_CHECK(!q || (q->dtype == DType::kF32 && q->shape[0] == sh.batch && q->shape[1] >= sh.heads &&
                  q->shape[1] % sh.heads == 0 && q->shape[2] >= 1 && q->shape[3] == sh.head_dim),
           "[snap_select_rows] expected fp32 queries [" + std::to_string(sh.batch) +
               ", a multiple of " + std::to_string(sh.heads) + ", w >= 1, " +
               std::to_string(sh.head_dim) + "]");
}

PackedSegment PackedStore::segment(int64_t row0, int64_t n, DType out,
                                   const PackedTransforms& t) const {
  PackedSegment seg;
  seg.batch = shape_.batch;
  seg.n_heads = shape_.heads;
  seg.n_rows = n;
  seg.head_dim = shape_.head_dim;
  seg.out_dtype = out;
  for (int kv = 0; kv < 2; ++kv) {
    PackedTensor& pt = kv ? seg.values : seg.keys;
    const PackedRowFormat& f = shape_.format(kv);
    pt.data = (kv ? v_ : k_) + row0 * f.row_stride;
    pt.fmt = f;
    pt.stride_h = capacity_ * f.row_stride;
    pt.stride_b = shape_.heads * pt.stride_h;
    pt.perm = t.perm(kv);
    pt.signs = t.signs_for(kv);
    pt.rot_block = pt.signs ? t.rot_block : 0;
  }
  return seg;
}

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
