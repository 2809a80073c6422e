// Row stores: where a cache policy's full-precision rows live (docs/design.md §3).
//
// A RowStore holds the rows of one layer on one device: keys and values [F = B*H, capacity, D] of
// one dtype (frame f = b*H + h), and optionally positions [F, capacity] int32. A store has a fixed
// capacity; policies grow by making a larger store (make) and copying rows into it (copy_rows).
// Data movement is the store's: block conversion, frame-wise copies, gathers by index, host bytes
// for state files. Views returned by keys()/values()/positions() point at the store's device memory
// and stay valid while the store lives. Everything is queued in order on the store's device (the
// CUDA store on its stream); download_* synchronise.
//
// A PackedStore holds packed SKVQ records beside a RowStore: keys [F, capacity, fk.row_stride] and
// values [F, capacity, fv.row_stride] bytes (the record formats of veloxquant/packed.h), optionally
// positions [F, capacity]. Rows enter it quantized from a RowStore with a cache's frozen channel
// transforms (PackedTransforms, on the backend's device), by copies and by gathers; it gives
// packed views for attention (PackedSegment) and host bytes for state files.
//
// RowBackend is one device's factory of stores plus the ops a policy dispatches on the rows (the
// SnapKV selection, the SKVQ channel permutations). Implementations: the CPU backend
// (src/kv/row_store_cpu.cpp) and the CUDA backend (src/cuda/row_store_cuda.cpp, made by
// vq::cuda::row_backend()).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/binary_io.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/packed.h"
#include "veloxquant/snapkv.h"
#include "veloxquant/tensor.h"

namespace vq::kv {

enum class Device : uint8_t { kCpu, kCuda };

struct RowShape {
  DType dtype = DType::kF16;
  int64_t batch = 0, heads = 0, head_dim = 0;
  int64_t frames() const { return batch * heads; }
  int64_t row_bytes() const { return head_dim * static_cast<int64_t>(dtype_size(dtype)); }
};

// Indices on a backend's device: [F, count] int32 (a selection of rows of every frame).
class RowIndex {
 public:
  virtual ~RowIndex() = default;
  int64_t count = 0;
  virtual const int32_t* data() const = 0;
  // Host copy [F, count] (synchronises).
  virtual std::vector<int32_t> download() const = 0;
};

class RowStore {
 public:
  virtual ~RowStore() = default;

  const RowShape& shape() const { return shape_; }
  int64_t capacity() const { return capacity_; }
  bool has_positions() const { return with_pos_; }

  // Rows [src_row0, src_row0 + n) of every frame of src (and their positions, when both stores
  // have them) to rows [dst_row0, dst_row0 + n) of this store. src is a store of the same backend
  // and B, H, D, or this store itself (the ranges may then overlap); rows of another dtype are
  // converted (through fp32, exact from fp16/bf16 to fp32).
  virtual void copy_range(const RowStore& src, int64_t src_row0, int64_t dst_row0, int64_t n) = 0;
  // Rows [0, n) of every frame from src (growth).
  void copy_rows(const RowStore& src, int64_t n) { copy_range(src, 0, 0, n); }
  // Rows [s0, s0 + n) of blocks keys / values [B, H, S, D] (any float dtype and element strides,
  // memory of this store's device) converted into rows [row0, row0 + n) of every frame.
  virtual void write_block(const TensorView& keys, const TensorView& values, int64_t s0, int64_t n,
                           int64_t row0) = 0;
  // positions[f, row0 + i] = first + i for i < n.
  virtual void fill_positions(int64_t row0, int64_t n, int64_t first) = 0;
  // Rows [0, idx.count) of every frame = src rows idx[f, i] (positions too: src's, or
  // src_first + index when src has none). src: same backend and shape.
  virtual void gather(const RowStore& src, const RowIndex& idx, int64_t src_first) = 0;

  // [B, H, n, D] views of rows [row0, row0 + n) (strided by capacity), on the store's device.
  TensorView keys(int64_t row0, int64_t n) const { return view(k_, row0, n); }
  TensorView values(int64_t row0, int64_t n) const { return view(v_, row0, n); }
  // positions [F, capacity] from row 0, or nullptr.
  const int32_t* positions() const { return pos_; }

  // Host copies of rows [row0, row0 + n) of every frame: [B, H, n, D] contiguous; positions of
  // rows [0, n): [F, n].
  virtual Tensor download(bool values, int64_t row0, int64_t n) const = 0;
  Tensor download(bool values, int64_t n) const { return download(values, 0, n); }
  std::vector<int32_t> download_positions(int64_t n) const { return download_positions(0, n); }
  // Positions of rows [row0, row0 + n): [F, n].
  virtual std::vector<int32_t> download_positions(int64_t row0, int64_t n) const = 0;
  // Rows [row0, row0 + n) of every frame from host tensors [B, H, n, D] of the store's dtype
  // (contiguous), positions from host [F, n] when given.
  virtual void upload(const TensorView& keys, const TensorView& values, int64_t row0, int64_t n,
                      const std::vector<int32_t>* positions) = 0;

  // Bytes this store's allocations hold.
  virtual int64_t resident_bytes() const = 0;

 protected:
  TensorView view(void* base, int64_t row0, int64_t n) const {
    TensorView t;
    t.data = static_cast<char*>(base) + row0 * shape_.row_bytes();
    t.dtype = shape_.dtype;
    t.shape = {shape_.batch, shape_.heads, n, shape_.head_dim};
    t.stride = {shape_.heads * capacity_ * shape_.head_dim, capacity_ * shape_.head_dim,
                shape_.head_dim, 1};
    return t;
  }
  RowShape shape_;
  int64_t capacity_ = 0;
  bool with_pos_ = false;
  void* k_ = nullptr;  // [F, capacity, D]
  void* v_ = nullptr;
  int32_t* pos_ = nullptr;  // [F, capacity] or nullptr
};

// fp32 window queries kept on a backend's device: [B, hq, rows, D] contiguous.
class QueryRows {
 public:
  virtual ~QueryRows() = default;
  int64_t batch = 0, hq = 0, rows = 0, head_dim = 0;
  // The view of the kept rows (device memory of the backend).
  TensorView view() const {
    return TensorView::contiguous(const_cast<float*>(data()), DType::kF32, batch, hq, rows,
                                  head_dim);
  }
  virtual const float* data() const = 0;
  virtual int64_t resident_bytes() const = 0;
  // Host copy [B, hq, rows, D] (synchronises).
  virtual std::vector<float> download() const = 0;
};

// The queries of a run of single-token calls kept on a backend's device (SnapKV's decode-time
// eviction): the fp32 queries of the latest `rows` calls (at most max_rows), step-major
// [rows][B][hq][D], oldest first. Made by RowBackend::make_query_window.
class QueryWindow {
 public:
  virtual ~QueryWindow() = default;
  int64_t batch = 0, hq = 0, head_dim = 0, max_rows = 0, rows = 0;
  // Appends one call's queries [B, hq, 1, D] (this backend's memory, any float dtype and
  // strides) as fp32, first dropping the oldest call when rows == max_rows.
  virtual void push(const TensorView& q) = 0;
  // The kept queries as [B, hq, rows, D] with strides (hq*D, D, B*hq*D, 1), on the backend's
  // device; valid until the next push.
  virtual TensorView view() const = 0;
  // Host copy, step-major [rows][B][hq][D] (synchronises).
  virtual std::vector<float> download() const = 0;
  virtual int64_t resident_bytes() const = 0;

 protected:
  int64_t step() const { return batch * hq * head_dim; }
  // The view of `rows` steps from base.
  TensorView view_at(const float* base) const {
    TensorView t;
    t.data = const_cast<float*>(base);
    t.dtype = DType::kF32;
    t.shape = {batch, hq, rows, head_dim};
    t.stride = {hq * head_dim, head_dim, step(), 1};
    return t;
  }
};

// The record formats of a packed store: B, H, D and the key / value row formats.
struct PackedShape {
  int64_t batch = 0, heads = 0, head_dim = 0;
  PackedRowFormat fk, fv;
  int64_t frames() const { return batch * heads; }
  const PackedRowFormat& format(bool values) const { return values ? fv : fk; }
};

// A cache's frozen channel transforms on a backend's device: permutations perm_k / perm_v [H, D]
// (stored channel j of head h = channel perm[h*D + j]) or nullptr, Hadamard signs [H, D] or
// nullptr (values rotated too when rotate_values). Made by RowBackend::make_transforms.
class PackedTransforms {
 public:
  virtual ~PackedTransforms() = default;
  const int32_t* perm_k = nullptr;
  const int32_t* perm_v = nullptr;
  const float* signs = nullptr;
  int32_t rot_block = 0;
  bool rotate_values = false;
  // Channel-axis keys rounded by error feedback (veloxquant/key_rounding.h): the factor U of
  // head h at key_u + h * D * D (fp64 on the backend's device, stored channel order), or nullptr
  // (round to nearest).
  const double* key_u = nullptr;
  int64_t bytes = 0;  // what the copies hold
  const int32_t* perm(bool values) const { return values ? perm_v : perm_k; }
  const float* signs_for(bool values) const {
    return signs && (!values || rotate_values) ? signs : nullptr;
  }
};

class PackedStore {
 public:
  virtual ~PackedStore() = default;

  const PackedShape& shape() const { return shape_; }
  int64_t capacity() const { return capacity_; }
  bool has_positions() const { return pos_ != nullptr; }
  // positions [F, capacity] from row 0, or nullptr.
  const int32_t* positions() const { return pos_; }

  // Records [src_row0, src_row0 + n) of every frame of src (positions too when both have them) to
  // rows [dst_row0, dst_row0 + n). src: a store of the same backend and shape (not this one).
  virtual void copy_range(const PackedStore& src, int64_t src_row0, int64_t dst_row0,
                          int64_t n) = 0;
  // Rows [src_row0, src_row0 + n) of every frame of `rows` (same backend, B, H, D), converted to
  // fp32, transformed with t (rotation, then permutation) and group-quantized (qk for keys, qv
  // for values) into records [dst_row0, dst_row0 + n); positions copied when both have them.
  // Exact: the codes and metadata of veloxquant/group_quant.h on every backend.
  virtual void quantize(const RowStore& rows, int64_t src_row0, int64_t n, int64_t dst_row0,
                        const GroupQuantParams& qk, const GroupQuantParams& qv,
                        const PackedTransforms& t) = 0;
  // Records [0, idx.count) of every frame = src records idx[f, i] (positions too).
  virtual void gather(const PackedStore& src, const RowIndex& idx) = 0;
  // Keys of records [src_row0, src_row0 + n), dequantized to fp32 in the original channel order
  // (dequantize_row of packed.h, bit for bit), into rows [dst_row0, dst_row0 + n) of dst, a
  // float32 store of this backend (its keys only; positions too when both have them).
  virtual void dequantize_keys(int64_t src_row0, int64_t n, RowStore& dst, int64_t dst_row0,
                               const PackedTransforms& t) const = 0;

  // The packed view of records [row0, row0 + n) (pointers into this store and into t, on the
  // store's device), dequantized rows cast to `out`.
  PackedSegment segment(int64_t row0, int64_t n, DType out, const PackedTransforms& t) const;

  // Host bytes of records [row0, row0 + n): [F, n, row_stride]; positions [F, n].
  virtual std::vector<uint8_t> download(bool values, int64_t row0, int64_t n) const = 0;
  virtual std::vector<int32_t> download_positions(int64_t row0, int64_t n) const = 0;
  // Records [row0, row0 + n) from host bytes [F, n, row_stride] (positions [F, n] when given).
  virtual void upload(const void* keys, const void* values, const int32_t* positions, int64_t row0,
                      int64_t n) = 0;

  virtual int64_t resident_bytes() const = 0;

 protected:
  PackedShape shape_;
  int64_t capacity_ = 0;
  uint8_t* k_ = nullptr;  // [F, capacity, fk.row_stride]
  uint8_t* v_ = nullptr;  // [F, capacity, fv.row_stride]
  int32_t* pos_ = nullptr;
};

class RowBackend {
 public:
  virtual ~RowBackend() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;

  // An uninitialised store (positions too when with_positions).
  virtual std::unique_ptr<RowStore> make(const RowShape& shape, int64_t capacity,
                                         bool with_positions) const = 0;

  // The last `rows` rows of queries [B, H_q, S, D] (this backend's memory, any float dtype and
  // strides) as fp32.
  virtual std::unique_ptr<QueryRows> keep_queries(const TensorView& queries,
                                                  int64_t rows) const = 0;
  // Window queries from host values [B, hq, rows, D] (a state file's).
  virtual std::unique_ptr<QueryRows> upload_queries(int64_t batch, int64_t hq, int64_t rows,
                                                    int64_t head_dim,
                                                    const std::vector<float>& q) const = 0;

  // A query window for calls of queries [B, hq, 1, D] keeping at most max_rows (>= 1) calls;
  // with host values step-major [rows][B][hq][D] (rows <= max_rows whole steps: a state
  // file's) it starts with those rows, else empty.
  virtual std::unique_ptr<QueryWindow> make_query_window(int64_t batch, int64_t hq,
                                                         int64_t head_dim, int64_t max_rows,
                                                         const std::vector<float>& q) const = 0;

  // SnapKV selection of every frame of rows [0, n) of `rows` (snap_select_head per (b, h): key
  // proxy when q == nullptr, else query scoring with q [B, H*n_rep, w, D] fp32 at positions
  // q_first .. q_first + w - 1 against the rows' positions). Returns [F, snap_keep_count] ascending
  // indices. Exact: the tie and NaN rules of veloxquant/snapkv.h on every backend.
  virtual std::unique_ptr<RowIndex> snap_select(const RowStore& rows, int64_t n,
                                                const TensorView* q, int64_t q_first,
                                                const SnapSelectParams& p) const = 0;

  // The protected-row selection of the skvq cache (veloxquant/skvq_cache.h) on every frame of
  // rows [0, n) of `rows` (fp32; with positions when q is given): SnapKV scores over all n rows
  // (snap_key_proxy_scores with obs_window when q == nullptr, else snap_query_scores with q
  // [B, H*n_rep, w, D] fp32 at positions q_first .. q_first + w - 1 against the rows' positions),
  // max-pooled over all n rows (snap_pool_scores, pool_kernel), then the k rows of [lo, hi) of
  // the highest pooled scores (snap_select: NaN ranked as -inf, ties to the lower row). Host
  // [F, k] ascending row indices; 0 <= lo, 1 <= k <= hi - lo, hi <= n. Exact on the CPU; the
  // device's scores agree with the CPU's to a bound (snap_scores, veloxquant/cuda.h) and its
  // ranking rules are the CPU's.
  virtual std::vector<int32_t> snap_select_rows(const RowStore& rows, int64_t n,
                                                const TensorView* q, int64_t q_first,
                                                int64_t obs_window, int64_t pool_kernel, int64_t lo,
                                                int64_t hi, int64_t k) const = 0;

  // Indices from host values [F, count] (each below the rows of the store they will index).
  virtual std::unique_ptr<RowIndex> upload_index(int64_t count,
                                                 const std::vector<int32_t>& idx) const = 0;

  // ---- packed records (the SKVQ methods)
  virtual std::unique_ptr<PackedStore> make_packed(const PackedShape& shape, int64_t capacity,
                                                   bool with_positions) const = 0;
  // Device copies of host transforms (perms [H * D] each or empty, signs [H * D] or empty, the
  // key rounding factors key_u [H * D * D] or empty).
  virtual std::unique_ptr<PackedTransforms> make_transforms(
      const std::vector<int32_t>& perm_k, const std::vector<int32_t>& perm_v,
      const std::vector<float>& signs, int32_t rot_block, bool rotate_values,
      const std::vector<double>& key_u) const = 0;
  // The SKVQ channel permutation of every head from rows [row0, row0 + n) of `rows` (keys, or
  // values when `values`), pooled over the batch: per head the stable ascending order of the
  // channels' ranges (max - min, NaN as +inf). Host [H * D]. Exact on every backend.
  virtual std::vector<int32_t> channel_perms(const RowStore& rows, int64_t row0, int64_t n,
                                             bool values) const = 0;
  // True when packed records should grow as one run per cache (a device whose attention wants
  // few segments); false: a policy may keep one packed store per flushed chunk (no copies).
  virtual bool one_packed_run() const { return false; }
  // True when an SKVQ store's full-precision tail keeps room for the rows it holds before its
  // next flush (sinks + window + recent) instead of shrinking to its rows after each flush and
  // doubling back: a device, where each regrowth's allocation and free stall the device
  // (skvq::Store::refit). The CPU shrinks (a host realloc costs little).
  virtual bool keeps_tail_room() const { return false; }

  // Waits for the backend's queued work (the CUDA stream); nothing on the CPU.
  virtual void synchronize() const {}
};

// Refuses (vq::Error "[snap_select_rows] ...") arguments RowBackend::snap_select_rows does not
// take; every backend checks them first.
void check_select_rows(const RowStore& rows, int64_t n, const TensorView* q, int64_t lo, int64_t hi,
                       int64_t k);

// The head of the snapkv and streaming state streams: has_data, the fp16/bf16 storage dtype, B,
// H, D (each 1 .. 2^24 with data, 0 without) and offset (0 .. 2^31-1).
struct RowStateHead {
  bool has_data = false;
  DType dtype = DType::kF16;
  int64_t batch = 0, heads = 0, head_dim = 0, offset = 0;

  void write(StateWriter& w) const;
  // Refuses (vq::Error "[load_state] <method>: ...") out-of-range fields.
  static RowStateHead read(StateReader& r, const char* method);
};

// Moves rows [from, from + n) of `rows` down to [to, to + n) (to < from) as one overlapping
// copy_range would, but in pieces no longer than from - to, front first, so that no copy's
// ranges overlap: a device store copies an overlapping range through a scratch store of n rows
// (src/cuda/row_store_cuda.cpp, copy_range), an allocation and a wait in a decode step.
void move_rows_down(RowStore& rows, int64_t from, int64_t to, int64_t n);

// The CPU backend (a process-wide instance; stores are plain aligned host memory, large ones
// advised for transparent huge pages).
const RowBackend& cpu_backend();

}  // namespace vq::kv
