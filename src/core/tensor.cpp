// TensorView helpers and the owning Tensor buffer.
#include "veloxquant/tensor.h"

#include "veloxquant/error.h"

namespace vq {

bool shape_fits_int64(const std::array<int64_t, 4>& s, size_t elem_size) {
  int64_t n = static_cast<int64_t>(elem_size);
  for (int64_t d : s) {
    if (d < 0) return false;
    if (d != 0 && __builtin_mul_overflow(n, d, &n)) return false;
  }
  return true;
}

TensorView TensorView::contiguous(void* data, DType t, int64_t b, int64_t h, int64_t s, int64_t d) {
  TensorView v;
  v.data = data;
  v.dtype = t;
  v.shape = {b, h, s, d};
  v.stride = {h * s * d, s * d, d, 1};
  return v;
}

bool TensorView::is_contiguous() const {
  return stride[3] == 1 && stride[2] == shape[3] && stride[1] == shape[2] * shape[3] &&
         stride[0] == shape[1] * shape[2] * shape[3];
}

TensorView TensorView::slice_tokens(int64_t s0, int64_t s1) const {
  VQ_CHECK(0 <= s0 && s0 <= s1 && s1 <= shape[2],
           "[slice_tokens] expected 0 <= s0 <= s1 <= " + std::to_string(shape[2]) + " but got " +
               std::to_string(s0) + ", " + std::to_string(s1));
  TensorView v = *this;
  v.data = static_cast<char*>(data) + s0 * stride[2] * static_cast<int64_t>(dtype_size(dtype));
  v.shape[2] = s1 - s0;
  return v;
}

Tensor::Tensor(DType t, int64_t b, int64_t h, int64_t s, int64_t d)
    : dtype_(t), shape_{b, h, s, d} {
  VQ_CHECK(b >= 0 && h >= 0 && s >= 0 && d >= 0,
           "[Tensor] expected a non-negative shape but got [" + std::to_string(b) + ", " +
               std::to_string(h) + ", " + std::to_string(s) + ", " + std::to_string(d) + "]");
  VQ_CHECK(shape_fits_int64(shape_, dtype_size(t)),
           "[Tensor] expected a shape whose non-zero dims times the element size fit int64 but "
           "got [" +
               std::to_string(b) + ", " + std::to_string(h) + ", " + std::to_string(s) + ", " +
               std::to_string(d) + "]");
  const size_t bytes = static_cast<size_t>(numel()) * dtype_size(t);
  buf_.assign((bytes + 7) / 8, 0);
}

TensorView Tensor::view() const {
  return TensorView::contiguous(const_cast<uint64_t*>(buf_.data()), dtype_, shape_[0], shape_[1],
                                shape_[2], shape_[3]);
}

void Tensor::set(int64_t b, int64_t h, int64_t s, int64_t d, float v) {
  const TensorView tv = view();
  from_f32(&v, static_cast<char*>(tv.row(b, h, s)) + d * static_cast<int64_t>(dtype_size(dtype_)),
           dtype_, 1);
}

void convert_view_row(const TensorView& t, int64_t b, int64_t h, int64_t s, void* dst,
                      DType dst_t) {
  const int64_t d = t.shape[3];
  if (t.stride[3] == 1) {
    convert_row(t.row(b, h, s), t.dtype, dst, dst_t, static_cast<size_t>(d));
    return;
  }
  for (int64_t i = 0; i < d; ++i) {
    const float x = t.at(b, h, s, i);
    from_f32(&x, static_cast<char*>(dst) + i * static_cast<int64_t>(dtype_size(dst_t)), dst_t, 1);
  }
}

}  // namespace vq
