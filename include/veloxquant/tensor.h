// Tensors: a non-owning 4-D view (TensorView) and an owning buffer (Tensor).
// Layout of every K/V block in this library: [B, H, S, D] = (batch, heads, tokens, head_dim).
// Strides are in elements; a contiguous view has stride = {H*S*D, S*D, D, 1}.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "veloxquant/dtype.h"

namespace vq {

// x rounded up to a multiple of m (x >= 0, m >= 1): capacities of row stores.
constexpr int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// Element count of a [B, H, S, D] shape: 0 when any dim is 0 (whatever the others are), else the
// product, which the caller guarantees fits int64 (Tensor's constructor checks it).
constexpr int64_t shape_numel(const std::array<int64_t, 4>& s) {
  if (s[0] == 0 || s[1] == 0 || s[2] == 0 || s[3] == 0) return 0;
  return s[0] * s[1] * s[2] * s[3];
}

// True when the product of the non-zero dims of s, times elem_size bytes, fits int64: then every
// partial product (element count, contiguous strides, byte offsets) is representable.
bool shape_fits_int64(const std::array<int64_t, 4>& s, size_t elem_size);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  std::array<int64_t, 4> shape{0, 0, 0, 0};   // [B, H, S, D]
  std::array<int64_t, 4> stride{0, 0, 0, 0};  // elements

  static TensorView contiguous(void* data, DType t, int64_t b, int64_t h, int64_t s, int64_t d);

  // 0 when any dim is 0, so a zero-sized view of huge other dims does not overflow.
  int64_t numel() const { return shape_numel(shape); }
  bool is_contiguous() const;
  // Pointer to element (b, h, s, 0).
  void* row(int64_t b, int64_t h, int64_t s) const {
    return static_cast<char*>(data) + (b * stride[0] + h * stride[1] + s * stride[2]) *
                                          static_cast<int64_t>(dtype_size(dtype));
  }
  float at(int64_t b, int64_t h, int64_t s, int64_t d) const {
    return load_f32(row(b, h, s), dtype, static_cast<size_t>(d * stride[3]));
  }
  // Rows [s0, s1) of the token axis.
  TensorView slice_tokens(int64_t s0, int64_t s1) const;
};

// Row (b, h, s) of a [B, H, S, D] view (any element strides) converted to dst_t into a contiguous
// destination of D elements (through fp32 when the types differ: exact when widening).
void convert_view_row(const TensorView& t, int64_t b, int64_t h, int64_t s, void* dst, DType dst_t);

// Owning, 64-byte aligned, contiguous [B, H, S, D] buffer, zero-initialised.
class Tensor {
 public:
  Tensor() = default;
  // Throws vq::Error if a dim is negative or the shape fails shape_fits_int64 (even when another
  // dim is 0: the strides of its view would still overflow).
  Tensor(DType t, int64_t b, int64_t h, int64_t s, int64_t d);
  TensorView view() const;
  DType dtype() const { return dtype_; }
  const std::array<int64_t, 4>& shape() const { return shape_; }
  void* data() { return buf_.data(); }
  const void* data() const { return buf_.data(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  size_t capacity_bytes() const { return buf_.capacity() * sizeof(uint64_t); }
  int64_t numel() const { return shape_numel(shape_); }
  void set(int64_t b, int64_t h, int64_t s, int64_t d, float v);
  float at(int64_t b, int64_t h, int64_t s, int64_t d) const { return view().at(b, h, s, d); }

 private:
  DType dtype_ = DType::kF32;
  std::array<int64_t, 4> shape_{0, 0, 0, 0};
  std::vector<uint64_t> buf_;  // uint64_t for 8-byte alignment at least
};

}  // namespace vq
