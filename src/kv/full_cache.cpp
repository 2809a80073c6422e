// The full-precision cache (docs/design.md §C2; layout in veloxquant/full_cache.h), a policy over
// a row store (src/kv/row_store.h): the same code whatever device holds the rows.
//
// Growth copies the stored rows once into a store of max(needed, 1.25 x capacity, reserve())
// rows rounded up to 256 (reserve() sizes the first store for a known length: then no growth), so
// n decode appends copy at most 5n rows in total (amortised O(1) each: a growth copying c rows
// buys c/4 appends) while the slack stays below a quarter of the capacity plus one 256-row step
// (resident bytes track accounted bytes). Every call validates its input completely before
// changing anything; growth builds the new store aside and swaps it in, so a failure (including
// std::bad_alloc) leaves the cache as it was. Stores are not zero-filled: only rows below offset()
// are ever read, saved or shown in a view.
#include "veloxquant/full_cache.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "kv/row_store.h"
#include "veloxquant/binary_io.h"
#include "veloxquant/error.h"

namespace vq {

namespace {

constexpr int64_t kMaxPositions = std::numeric_limits<int32_t>::max();  // positions are int32

std::string shape_str(const TensorView& t) {
  return "[" + std::to_string(t.shape[0]) + ", " + std::to_string(t.shape[1]) + ", " +
         std::to_string(t.shape[2]) + ", " + std::to_string(t.shape[3]) + "]";
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

FullCache::FullCache() : backend_(&kv::cpu_backend()) {}
FullCache::FullCache(const kv::RowBackend& backend) : backend_(&backend) {}
FullCache::~FullCache() = default;

FullCache::State FullCache::with_capacity(const State& shape_of, int64_t capacity) const {
  State s;
  s.has_data = shape_of.has_data;
  s.dtype = shape_of.dtype;
  s.batch = shape_of.batch;
  s.heads = shape_of.heads;
  s.head_dim = shape_of.head_dim;
  s.offset = 0;
  s.capacity = capacity;
  s.rows = backend_->make({s.dtype, s.batch, s.heads, s.head_dim}, capacity, false);
  return s;
}

TensorView FullCache::keys() const {
  return st_.rows ? st_.rows->keys(0, st_.offset) : TensorView{};
}
TensorView FullCache::values() const {
  return st_.rows ? st_.rows->values(0, st_.offset) : TensorView{};
}

CacheView FullCache::stored_view() const {
  CacheView view;
  view.batch = st_.batch;
  view.n_kv_heads = st_.heads;
  view.head_dim = st_.head_dim;
  if (st_.offset == 0) return view;
  ViewSegment seg;
  seg.n_rows = st_.offset;
  seg.positions = nullptr;
  seg.first_pos = 0;
  seg.keys = keys();
  seg.values = values();
  view.segments.push_back(seg);
  return view;
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
    const int64_t cap =
        round_up(std::max({new_offset, st_.capacity + st_.capacity / 4, reserve_}), kStep);
    grown = with_capacity(shape, cap);
    grown.offset = st_.offset;
    if (st_.offset > 0) grown.rows->copy_rows(*st_.rows, st_.offset);
    dst = &grown;
  }
  // Write the new rows (the input may even point into the old store: it is still alive).
  dst->rows->write_block(keys, values, 0, n_s, dst->offset);
  dst->offset = new_offset;
  if (dst != &st_) st_ = std::move(grown);
  return stored_view();
}

void FullCache::reserve(int64_t rows) {
  VQ_CHECK(rows >= 0 && rows <= kMaxPositions,
           "[full_cache] reserve: expected 0 <= rows <= " + std::to_string(kMaxPositions) +
               " but got " + std::to_string(rows));
  reserve_ = rows;
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
  s.bytes_resident = st_.rows ? st_.rows->resident_bytes() : 0;
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
    // Host copies: the rows may live on a device.
    w.tensor(st_.rows->download(false, 0, st_.offset).view());
    w.tensor(st_.rows->download(true, 0, st_.offset).view());
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
    full.rows->upload(k.view(), v.view(), 0, s.offset, nullptr);
    st_ = std::move(full);
    return;
  }
  r.expect_end();
  st_ = State{};
}

std::unique_ptr<KVCache> FullCache::merge_into_batch(
    const std::vector<const KVCache*>& caches) const {
  VQ_CHECK(backend_->device() == kv::Device::kCpu,
           "[merge_batch] expected caches in host memory but got rows on " + backend_->name());
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
  const TensorView mk = m.rows->keys(0, m.offset), mv = m.rows->values(0, m.offset);
  int64_t b_out = 0;
  for (const FullCache* c : fc) {
    VQ_CHECK(c->backend_->device() == kv::Device::kCpu,
             "[merge_batch] expected caches in host memory but got rows on " + c->backend_->name());
    const TensorView ck = c->keys(), cv = c->values();
    for (int64_t b = 0; b < c->st_.batch; ++b, ++b_out)
      for (int64_t h = 0; h < first.heads; ++h) {
        std::memcpy(mk.row(b_out, h, 0), ck.row(b, h, 0), bytes);
        std::memcpy(mv.row(b_out, h, 0), cv.row(b, h, 0), bytes);
      }
  }
  out->st_ = std::move(m);
  return out;
}

std::unique_ptr<KVCache> make_full_cache(const CacheConfig&) {
  return std::make_unique<FullCache>();
}

}  // namespace vq
