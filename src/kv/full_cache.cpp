// The full-precision cache (caches.md §2; layout in veloxquant/full_cache.h).
//
// Buffers are [B, H, capacity, D]; growth copies the stored rows once into a buffer of
// max(needed, 1.25 x capacity) rows rounded up to 256, so n decode appends copy at most 5n rows
// in total (amortised O(1) each: a growth copying c rows buys c/4 appends) while the slack stays
// below a quarter of the capacity plus one 256-row step (resident bytes track accounted bytes).
// Every call validates its input completely before changing anything; growth builds the new buffers
// aside and swaps them in, so a failure (including std::bad_alloc) leaves the cache as it was.
// Buffers are not zero-filled: only rows below offset() are ever read, saved or shown in a view.
#include "veloxquant/full_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "veloxquant/binary_io.h"
#include "veloxquant/error.h"

namespace vq {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;  // transparent huge page size on x86-64 Linux
constexpr int64_t kMaxPositions = std::numeric_limits<int32_t>::max();  // positions are int32

std::string shape_str(const TensorView& t) {
  return "[" + std::to_string(t.shape[0]) + ", " + std::to_string(t.shape[1]) + ", " +
         std::to_string(t.shape[2]) + ", " + std::to_string(t.shape[3]) + "]";
}

// Copies row (b, h, s) of src (any strides, any dtype) to a contiguous row of D elements.
void copy_row(const TensorView& src, int64_t b, int64_t h, int64_t s, void* dst, DType dst_t) {
  const int64_t d = src.shape[3];
  const void* row = src.row(b, h, s);
  if (src.stride[3] == 1) {
    convert_row(row, src.dtype, dst, dst_t, static_cast<size_t>(d));
    return;
  }
  const size_t es = dtype_size(src.dtype);
  for (int64_t i = 0; i < d; ++i) {
    const char* p = static_cast<const char*>(row) + i * src.stride[3] * static_cast<int64_t>(es);
    convert_row(p, src.dtype, static_cast<char*>(dst) + i * static_cast<int64_t>(dtype_size(dst_t)),
                dst_t, 1);
  }
}

void check_block(const TensorView& t, const char* name) {
  for (int i = 0; i < 4; ++i)
    VQ_CHECK(t.shape[i] >= 1, std::string("[full_cache] expected ") + name +
                                  " [B, H, S, D] with every dim >= 1 but got " + shape_str(t));
  VQ_CHECK(static_cast<uint8_t>(t.dtype) <= static_cast<uint8_t>(DType::kBF16),
           std::string("[full_cache] expected ") + name +
               " dtype float32/float16/bfloat16 but got " +
               std::to_string(static_cast<int>(t.dtype)));
  VQ_CHECK(t.data != nullptr,
           std::string("[full_cache] expected ") + name + " data but got a null pointer");
}

}  // namespace

void FullCache::RowStore::Free::operator()(void* p) const {
  std::free(p);
}

FullCache::RowStore::RowStore(DType t, int64_t b, int64_t h, int64_t cap, int64_t d)
    : dtype_(t), shape_{b, h, cap, d} {
  const size_t bytes = static_cast<size_t>(b * h * cap * d) * dtype_size(t);
  if (bytes == 0) return;
  const size_t align = bytes >= kHugePage ? kHugePage : 64;
  const size_t rounded = (bytes + align - 1) / align * align;  // aligned_alloc needs a multiple
  void* p = std::aligned_alloc(align, rounded);
  if (!p) throw std::bad_alloc();
#ifdef __linux__
  // Advice only: where THP is off, or the call fails, the buffer simply uses 4 KiB pages.
  if (align == kHugePage) (void)madvise(p, rounded, MADV_HUGEPAGE);
#endif
  data_.reset(p);
  bytes_ = rounded;
}

TensorView FullCache::RowStore::view() const {
  return TensorView::contiguous(data_.get(), dtype_, shape_[0], shape_[1], shape_[2], shape_[3]);
}

FullCache::State FullCache::with_capacity(const State& shape_of, int64_t capacity) {
  State s;
  s.has_data = shape_of.has_data;
  s.dtype = shape_of.dtype;
  s.batch = shape_of.batch;
  s.heads = shape_of.heads;
  s.head_dim = shape_of.head_dim;
  s.offset = 0;
  s.capacity = capacity;
  s.keys = RowStore(s.dtype, s.batch, s.heads, capacity, s.head_dim);
  s.values = RowStore(s.dtype, s.batch, s.heads, capacity, s.head_dim);
  return s;
}

TensorView FullCache::rows_view(const RowStore& t, int64_t rows) {
  TensorView v = t.view();  // [B, H, capacity, D]
  v.shape[2] = rows;        // strides keep the capacity: rows [0, rows) of every (b, h)
  return v;
}

TensorView FullCache::keys() const {
  return rows_view(st_.keys, st_.offset);
}
TensorView FullCache::values() const {
  return rows_view(st_.values, st_.offset);
}

CacheView FullCache::update_and_fetch(const TensorView& keys, const TensorView& values,
                                      const UpdateOptions&) {
  check_block(keys, "keys");
  check_block(values, "values");
  VQ_CHECK(keys.shape == values.shape, "[full_cache] expected values of the keys' shape " +
                                           shape_str(keys) + " but got " + shape_str(values));
  const int64_t n_b = keys.shape[0], n_h = keys.shape[1], n_s = keys.shape[2], n_d = keys.shape[3];
  if (st_.has_data) {
    VQ_CHECK(n_b == st_.batch && n_h == st_.heads && n_d == st_.head_dim,
             "[full_cache] expected blocks [" + std::to_string(st_.batch) + ", " +
                 std::to_string(st_.heads) + ", S, " + std::to_string(st_.head_dim) +
                 "] (fixed by the first call) but got " + shape_str(keys));
  }
  VQ_CHECK(n_s <= kMaxPositions - st_.offset,
           "[full_cache] expected at most " + std::to_string(kMaxPositions) +
               " positions in total but got " + std::to_string(st_.offset) + " + " +
               std::to_string(n_s));

  const int64_t new_offset = st_.offset + n_s;
  State grown;
  State* dst = &st_;
  if (!st_.has_data || new_offset > st_.capacity) {
    State shape;  // shape fields only (copying st_ would copy its buffers)
    shape.has_data = true;
    shape.dtype = st_.has_data ? st_.dtype : keys.dtype;
    shape.batch = n_b;
    shape.heads = n_h;
    shape.head_dim = n_d;
    const int64_t cap = round_up(std::max(new_offset, st_.capacity + st_.capacity / 4), kStep);
    grown = with_capacity(shape, cap);
    grown.offset = st_.offset;
    const size_t row_bytes = static_cast<size_t>(n_d) * dtype_size(grown.dtype);
    for (int64_t b = 0; b < n_b && st_.offset > 0; ++b)
      for (int64_t h = 0; h < n_h; ++h) {
        std::memcpy(grown.keys.view().row(b, h, 0), st_.keys.view().row(b, h, 0),
                    row_bytes * static_cast<size_t>(st_.offset));
        std::memcpy(grown.values.view().row(b, h, 0), st_.values.view().row(b, h, 0),
                    row_bytes * static_cast<size_t>(st_.offset));
      }
    dst = &grown;
  }
  // Write the new rows (the input may even point into the old buffers: they are still alive).
  const TensorView kd = dst->keys.view(), vd = dst->values.view();
  for (int64_t b = 0; b < n_b; ++b)
    for (int64_t h = 0; h < n_h; ++h)
      for (int64_t s = 0; s < n_s; ++s) {
        copy_row(keys, b, h, s, kd.row(b, h, dst->offset + s), dst->dtype);
        copy_row(values, b, h, s, vd.row(b, h, dst->offset + s), dst->dtype);
      }
  dst->offset = new_offset;
  if (dst != &st_) st_ = std::move(grown);

  CacheView view;
  view.batch = n_b;
  view.n_kv_heads = n_h;
  view.head_dim = n_d;
  ViewSegment seg;
  seg.n_rows = new_offset;
  seg.positions = nullptr;
  seg.first_pos = 0;
  seg.keys = rows_view(st_.keys, new_offset);
  seg.values = rows_view(st_.values, new_offset);
  view.segments.push_back(seg);
  return view;
}

std::vector<int32_t> FullCache::stored_positions(int64_t b, int64_t h) const {
  VQ_CHECK(st_.has_data && b >= 0 && b < st_.batch && h >= 0 && h < st_.heads,
           "[full_cache] stored_positions: expected 0 <= b < " + std::to_string(st_.batch) +
               " and 0 <= h < " + std::to_string(st_.heads) + " but got (" + std::to_string(b) +
               ", " + std::to_string(h) + ")");
  std::vector<int32_t> p(static_cast<size_t>(st_.offset));
  for (int64_t i = 0; i < st_.offset; ++i) p[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  return p;
}

Mask FullCache::make_mask(int64_t n_queries, int64_t window) const {
  if (window != 0 || n_queries < 1) return KVCache::make_mask(n_queries, window);  // validates
  Mask m;
  m.kind = n_queries == 1 ? Mask::Kind::kNone : Mask::Kind::kCausal;
  m.n_queries = n_queries;
  m.n_keys = st_.offset + n_queries;
  return m;
}

int64_t FullCache::trim(int64_t n) {
  VQ_CHECK(n >= 0, "[trim] expected n >= 0 but got " + std::to_string(n));
  const int64_t dropped = std::min(n, st_.offset);
  st_.offset -= dropped;
  return dropped;
}

CacheStats FullCache::stats() const {
  CacheStats s;
  s.method = method();
  s.tokens_seen = st_.offset;
  s.rows_stored = st_.offset;
  const int64_t elems = st_.offset * st_.batch * st_.heads * st_.head_dim;  // per K or V
  const int64_t es = static_cast<int64_t>(dtype_size(st_.dtype));
  s.bytes_accounted = elems * 2 * es;
  s.bytes_resident = static_cast<int64_t>(st_.keys.capacity_bytes() + st_.values.capacity_bytes());
  s.fp16_bytes = elems * 2 * 2;
  s.figures = {
      {"key_bytes", static_cast<double>(elems * es)},
      {"value_bytes", static_cast<double>(elems * es)},
      {"capacity_rows", static_cast<double>(st_.capacity)},
      {"element_bytes", static_cast<double>(es)},
  };
  return s;
}

void FullCache::save(std::ostream& out) const {
  StateWriter w;
  w.boolean(st_.has_data);
  w.u8(static_cast<uint8_t>(st_.dtype));
  w.i64(st_.batch);
  w.i64(st_.heads);
  w.i64(st_.head_dim);
  w.i64(st_.offset);
  if (st_.has_data) {
    w.tensor(keys());
    w.tensor(values());
  }
  w.write(out, method());
}

void FullCache::load(std::istream& in) {
  StateReader r(in, method());
  State s;
  s.has_data = r.boolean();
  const uint8_t dt = r.u8();
  VQ_CHECK(dt <= static_cast<uint8_t>(DType::kBF16),
           "[load_state] full: expected dtype 0..2 but got " + std::to_string(dt));
  s.dtype = static_cast<DType>(dt);
  const int64_t lo = s.has_data ? 1 : 0;
  const int64_t hi = s.has_data ? kMaxPositions : 0;
  s.batch = r.i64_in("full batch", lo, hi);
  s.heads = r.i64_in("full heads", lo, hi);
  s.head_dim = r.i64_in("full head_dim", lo, hi);
  s.offset = r.i64_in("full offset", 0, hi);
  if (s.has_data) {
    const Tensor k = r.tensor();
    const Tensor v = r.tensor();
    const std::array<int64_t, 4> want{s.batch, s.heads, s.offset, s.head_dim};
    VQ_CHECK(k.dtype() == s.dtype && v.dtype() == s.dtype && k.shape() == want && v.shape() == want,
             "[load_state] full: expected key/value tensors [" + std::to_string(s.batch) + ", " +
                 std::to_string(s.heads) + ", " + std::to_string(s.offset) + ", " +
                 std::to_string(s.head_dim) + "] of the saved dtype but got others");
    r.expect_end();
    State full = with_capacity(s, round_up(s.offset, kStep));
    full.offset = s.offset;
    const size_t row_bytes = static_cast<size_t>(s.head_dim) * dtype_size(s.dtype);
    for (int64_t b = 0; b < s.batch && s.offset > 0; ++b)
      for (int64_t h = 0; h < s.heads; ++h) {
        std::memcpy(full.keys.view().row(b, h, 0), k.view().row(b, h, 0),
                    row_bytes * static_cast<size_t>(s.offset));
        std::memcpy(full.values.view().row(b, h, 0), v.view().row(b, h, 0),
                    row_bytes * static_cast<size_t>(s.offset));
      }
    st_ = std::move(full);
    return;
  }
  r.expect_end();
  st_ = State{};
}

std::unique_ptr<KVCache> FullCache::merge_into_batch(
    const std::vector<const KVCache*>& caches) const {
  std::vector<const FullCache*> fc;
  for (size_t i = 0; i < caches.size(); ++i) {
    const auto* c = dynamic_cast<const FullCache*>(caches[i]);
    VQ_CHECK(c != nullptr, "[merge_batch] expected a full cache at index " + std::to_string(i) +
                               " but got " + (caches[i] ? caches[i]->method() : "null"));
    fc.push_back(c);
  }
  const State& first = fc[0]->st_;
  for (size_t i = 1; i < fc.size(); ++i)
    VQ_CHECK(fc[i]->st_.offset == first.offset,
             "[merge_batch] expected equal offsets (" + std::to_string(first.offset) +
                 " at index 0) but got " + std::to_string(fc[i]->st_.offset) + " at index " +
                 std::to_string(i));
  auto out = std::make_unique<FullCache>();
  if (first.offset == 0) return out;  // nothing stored anywhere: a fresh cache
  int64_t total_b = 0;
  for (size_t i = 0; i < fc.size(); ++i) {
    const State& s = fc[i]->st_;
    VQ_CHECK(s.heads == first.heads && s.head_dim == first.head_dim && s.dtype == first.dtype,
             "[merge_batch] expected H=" + std::to_string(first.heads) +
                 ", D=" + std::to_string(first.head_dim) + ", " + dtype_name(first.dtype) +
                 " (index 0) but got H=" + std::to_string(s.heads) +
                 ", D=" + std::to_string(s.head_dim) + ", " + dtype_name(s.dtype) + " at index " +
                 std::to_string(i));
    total_b += s.batch;
  }
  State shape;
  shape.has_data = true;
  shape.dtype = first.dtype;
  shape.batch = total_b;
  shape.heads = first.heads;
  shape.head_dim = first.head_dim;
  State m = with_capacity(shape, round_up(first.offset, kStep));
  m.offset = first.offset;
  const size_t bytes = static_cast<size_t>(first.head_dim) * dtype_size(first.dtype) *
                       static_cast<size_t>(first.offset);
  int64_t b_out = 0;
  for (const FullCache* c : fc)
    for (int64_t b = 0; b < c->st_.batch; ++b, ++b_out)
      for (int64_t h = 0; h < first.heads; ++h) {
        std::memcpy(m.keys.view().row(b_out, h, 0), c->st_.keys.view().row(b, h, 0), bytes);
        std::memcpy(m.values.view().row(b_out, h, 0), c->st_.values.view().row(b, h, 0), bytes);
      }
  out->st_ = std::move(m);
  return out;
}

std::unique_ptr<KVCache> make_full_cache(const CacheConfig&) {
  return std::make_unique<FullCache>();
}

}  // namespace vq
