// Private building blocks shared by the SKVQ cache and the snapkv+skvq cache: frozen settings,
// channel transforms, packed blocks, full-precision row buffers and the helpers that quantize,
// account and serialise them. Implemented in skvq_cache.cpp.
//
// Layouts: FpRows holds [B, H, cap, D] raw elements of the storage dtype, live rows
// [start, start + count) of every (b, h), optional explicit positions [B, H, cap]. A PackedBlock
// holds `rows` packed records per (b, h): keys [B, H, rows, fk.row_stride] bytes, values likewise,
// positions either implicit (first_pos, first_pos + 1, ...) or explicit [B, H, rows].
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/binary_io.h"
#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/packed.h"

namespace vq::skvq {

// Everything of a CacheConfig an SKVQ store uses, validated (the config's own rules plus the
// ones only the cache knows, e.g. Hadamard needs an even head_dim).
struct Settings {
  int64_t head_dim = 0;
  int64_t window = 0;
  int64_t n_sink = 0;
  int64_t recent = 0;
  // window + recent, computed once by from_config (both <= kMaxCacheRows, so no overflow): a chunk
  // is flushed while the rows after its start number at least flush_span.
  int64_t flush_span = 0;
  int64_t max_ctx = 0;  // 0 = unlimited
  bool reorder = true;  // false when rotation is on (rotation wins, see skvq_cache.h)
  bool rotate = false;
  bool rotate_values = false;
  uint64_t rotation_seed = 0;
  GroupQuantParams qk, qv;
  PackedRowFormat fk, fv;
  // Calibrated permutations of this layer ([H * D] each), empty when none.
  std::vector<int32_t> file_perm_k, file_perm_v;
  int64_t file_heads = 0;

  static Settings from_config(const CacheConfig& cfg, int64_t layer_index, const char* op);
  // Writes / checks the fields a state file must agree on.
  void save(StateWriter& w) const;
  void check_saved(StateReader& r, const char* op) const;
};

// Frozen channel transforms of one cache: t = P(R x).
struct Transforms {
  std::vector<int32_t> perm_k, perm_v;  // [H * D] or empty
  std::vector<float> signs;             // [H * D] of +-1, or empty (no rotation)
  int32_t rot_block = 0;
  bool rotate_values = false;

  bool has_perms() const { return !perm_k.empty(); }
  void save(StateWriter& w) const;
  static Transforms load(StateReader& r, int64_t heads, int64_t d, const char* op);
};

// Stable ascending per-channel range of rows [n, d] fp32: the SKVQ permutation of one head.
std::vector<int32_t> channel_range_perm(const float* rows, int64_t n, int64_t d);

struct PackedBlock {
  int64_t rows = 0;
  int64_t first_pos = 0;      // implicit positions when pos is empty
  std::vector<uint8_t> k, v;  // [B, H, rows, row_stride]
  std::vector<int32_t> pos;   // [B, H, rows] or empty
  PackedSegment seg;          // points into k, v and the transforms (see bind)

  void bind(int64_t batch, int64_t heads, const Settings& s, const Transforms& t, DType out);
  int64_t resident_bytes() const;
};

struct FpRows {
  DType dtype = DType::kF16;
  int64_t batch = 0, heads = 0, d = 0;
  int64_t cap = 0, start = 0, count = 0;
  bool explicit_pos = false;
  std::vector<uint64_t> buf_k, buf_v;  // [B, H, cap, D] elements of dtype (8-byte aligned)
  std::vector<int32_t> pos;            // [B, H, cap] when explicit_pos

  void init(DType t, int64_t b, int64_t h, int64_t dim, bool explicit_positions);
  size_t es() const { return dtype_size(dtype); }
  char* k_row(int64_t b, int64_t h, int64_t i) {  // i relative to start
    return reinterpret_cast<char*>(buf_k.data()) +
           static_cast<int64_t>(es()) * (((b * heads + h) * cap + start + i) * d);
  }
  char* v_row(int64_t b, int64_t h, int64_t i) {
    return reinterpret_cast<char*>(buf_v.data()) +
           static_cast<int64_t>(es()) * (((b * heads + h) * cap + start + i) * d);
  }
  const char* k_row(int64_t b, int64_t h, int64_t i) const {
    return const_cast<FpRows*>(this)->k_row(b, h, i);
  }
  const char* v_row(int64_t b, int64_t h, int64_t i) const {
    return const_cast<FpRows*>(this)->v_row(b, h, i);
  }
  int32_t& position(int64_t b, int64_t h, int64_t i) {
    return pos[static_cast<size_t>((b * heads + h) * cap + start + i)];
  }
  int32_t position(int64_t b, int64_t h, int64_t i) const {
    return pos[static_cast<size_t>((b * heads + h) * cap + start + i)];
  }
  // Makes room for `extra` more rows at the end: compacts to start 0 and/or reallocates to
  // round_up(max(count + extra, 2 * cap), 16) rows. Moves data: only call when no view refers
  // to this buffer. Shrinks a buffer much larger than its rows (cap > 2 * max(rows, 16)).
  void reserve_append(int64_t extra);
  // Drops the first n live rows (no data moves: views stay valid).
  void pop_front(int64_t n) {
    start += n;
    count -= n;
  }
  // Full-precision view of rows [i0, i0 + n) (relative to start).
  TensorView k_view(int64_t i0, int64_t n) const;
  TensorView v_view(int64_t i0, int64_t n) const;
  int64_t resident_bytes() const;
  // Live rows (and explicit positions), compact, for state files.
  void save(StateWriter& w) const;
  void load(StateReader& r, const char* op);
};

// n elements of type t -> fp32, with the hardware fp16 conversion where the build has F16C
// (exact either way: every fp16 / bf16 value is an fp32 value).
void fast_to_f32(const void* src, DType t, float* dst, size_t n);
// Converts element row src (n values of src_t) to dst_t through fp32 when the types differ.
void convert_row_to(const void* src, DType src_t, void* dst, DType dst_t, int64_t n);

// Quantizes n rows of head h, given in original channel order as fp32 [n, D] (overwritten by
// the transform), into records dst + i * row_stride.
void quantize_head_rows(float* rows, int64_t n, int64_t h, const Settings& s, const Transforms& t,
                        bool values, uint8_t* dst);

// Makes the transforms once B, H are known (signs for rotation, the calibrated permutation).
Transforms initial_transforms(const Settings& s, int64_t heads, const char* op);

std::string shape_str(const TensorView& t);

}  // namespace vq::skvq
