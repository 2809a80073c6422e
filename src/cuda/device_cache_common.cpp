// What every GPU-resident cache shares (include/veloxquant/cuda_cache.h): the refusals of trim
// and merge, segment download for tests, and the helpers of device_cache_util.h (input checks,
// block conversion, frame-wise copies) that the CUDA row backend uses.
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "cuda/check.h"
#include "cuda/device_cache_kernels.cuh"
#include "cuda/device_cache_util.h"
#include "veloxquant/device_memory.h"
#include "veloxquant/error.h"

namespace vq::cuda {

Mask DeviceKVCache::make_mask(int64_t n_queries, int64_t window) const {
  // Every device cache is a policy adapter (device_cache_policy.cpp) that answers with its
  // policy's mask; this is reached only by a cache that does not.
  throw Error("[make_mask] expected a device cache with a mask rule but got method '" + method() +
              "' (" + std::to_string(n_queries) + " queries, window " + std::to_string(window) +
              ")");
}

int64_t DeviceKVCache::trim(int64_t n) {
  throw Error("[trim] expected a trimmable cache but got device method '" + method() +
              "' (not trimmable: its rows were evicted or quantized); asked to trim " +
              std::to_string(n) + ", nothing changed");
}

void DeviceKVCache::merge_batch(const std::vector<const DeviceKVCache*>& others) const {
  throw Error("[merge_batch] expected caches that can be merged but got device method '" +
              method() + "' (" + std::to_string(others.size() + 1) +
              " caches): merging into one batch is not offered on the device");
}

namespace detail {

std::string shape_str(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < 4; ++i) {
    s += std::to_string(t.shape[i]);
    s += i < 3 ? ", " : "]";
  }
  return s;
}

int64_t held_bytes(const DeviceBuffer& b) {
  return b.data() ? device_alloc_bytes(static_cast<int64_t>(b.size())) : 0;
}

void check_blocks(const TensorView& keys, const TensorView& values, int64_t batch, int64_t heads,
                  int64_t head_dim, const char* op) {
  for (const TensorView* t : {&keys, &values})
    VQ_CHECK(static_cast<uint8_t>(t->dtype) <= static_cast<uint8_t>(DType::kBF16),
             std::string("[") + op +
                 "] expected float32/float16/bfloat16 blocks but got dtype code " +
                 std::to_string(static_cast<int>(t->dtype)));
  VQ_CHECK(keys.shape == values.shape, std::string("[") + op +
                                           "] expected values of the keys' shape " +
                                           shape_str(keys) + " but got " + shape_str(values));
  VQ_CHECK(keys.shape[0] == batch && keys.shape[1] == heads && keys.shape[2] >= 0 &&
               keys.shape[3] == head_dim,
           std::string("[") + op + "] expected keys [" + std::to_string(batch) + ", " +
               std::to_string(heads) + ", S>=0, " + std::to_string(head_dim) +
               "] (fixed when the cache was built) but got " + shape_str(keys));
  VQ_CHECK((keys.data && values.data) || keys.numel() == 0,
           std::string("[") + op + "] expected device keys and values but got nullptr");
}

void convert_block(const TensorView& src, int64_t s0, int64_t n, void* dst, DType dst_t,
                   int64_t cap, int64_t row0, Stream s, bool may_defer) {
  if (n <= 0) return;
  ConvertRowsParams p;
  p.src = src.data;
  p.src_dtype = static_cast<int>(src.dtype);
  p.st0 = src.stride[0];
  p.st1 = src.stride[1];
  p.st2 = src.stride[2];
  p.st3 = src.stride[3];
  p.batch = src.shape[0];
  p.heads = src.shape[1];
  p.n = n;
  p.head_dim = src.shape[3];
  p.s0 = s0;
  p.dst = dst;
  p.dst_dtype = static_cast<int>(dst_t);
  p.dst_cap = cap;
  p.dst_row0 = row0;
  if (!may_defer || !record_row_write(p, 0, 0, s)) convert_rows_launch(p, to_stream(s));
}

void copy_frames(void* dst, int64_t dst_cap, int64_t dst_row0, const void* src, int64_t src_cap,
                 int64_t src_row0, int64_t frames, int64_t n, int64_t row_bytes, Stream s) {
  flush_row_writes(s);
  if (frames <= 0 || n <= 0) return;
  VQ_CUDA_CHECK(cudaMemcpy2DAsync(
      static_cast<char*>(dst) + dst_row0 * row_bytes, static_cast<size_t>(dst_cap * row_bytes),
      static_cast<const char*>(src) + src_row0 * row_bytes,
      static_cast<size_t>(src_cap * row_bytes), static_cast<size_t>(n * row_bytes),
      static_cast<size_t>(frames), cudaMemcpyDeviceToDevice, to_stream(s)));
}

void fill_positions(int32_t* pos, int64_t frames, int64_t cap, int64_t row0, int64_t n,
                    int64_t first, Stream s, bool may_defer) {
  if (frames <= 0 || n <= 0) return;
  ConvertRowsParams p;
  p.dst = pos;
  p.batch = frames;
  p.heads = 1;
  p.n = n;
  p.head_dim = 1;
  p.dst_cap = cap;
  p.dst_row0 = row0;
  if (may_defer && record_row_write(p, 1, static_cast<int32_t>(first), s)) return;
  fill_positions_launch(pos, frames, cap, row0, n, static_cast<int32_t>(first), to_stream(s));
}

void download_frames(void* dst, int64_t dst_cap, const void* src, int64_t src_cap, int64_t src_row0,
                     int64_t frames, int64_t n, int64_t row_bytes, Stream s) {
  flush_row_writes(s);
  if (frames <= 0 || n <= 0) return;
  VQ_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<size_t>(dst_cap * row_bytes),
                                  static_cast<const char*>(src) + src_row0 * row_bytes,
                                  static_cast<size_t>(src_cap * row_bytes),
                                  static_cast<size_t>(n * row_bytes), static_cast<size_t>(frames),
                                  cudaMemcpyDeviceToHost, to_stream(s)));
  synchronize(s);
}

void upload_frames(void* dst, int64_t dst_cap, int64_t dst_row0, const void* src, int64_t src_cap,
                   int64_t frames, int64_t n, int64_t row_bytes, Stream s) {
  flush_row_writes(s);
  if (frames <= 0 || n <= 0) return;
  VQ_CUDA_CHECK(cudaMemcpy2DAsync(
      static_cast<char*>(dst) + dst_row0 * row_bytes, static_cast<size_t>(dst_cap * row_bytes), src,
      static_cast<size_t>(src_cap * row_bytes), static_cast<size_t>(n * row_bytes),
      static_cast<size_t>(frames), cudaMemcpyHostToDevice, to_stream(s)));
  synchronize(s);
}

Tensor download_rows(const void* src, DType t, int64_t batch, int64_t heads, int64_t n,
                     int64_t head_dim, int64_t cap, int64_t row0, Stream s) {
  Tensor out(t, batch, heads, n, head_dim);
  download_frames(out.data(), n, src, cap, row0, batch * heads, n,
                  head_dim * static_cast<int64_t>(dtype_size(t)), s);
  return out;
}

void check_state_shape(const char* op, bool has_data, int64_t b, int64_t h, int64_t d,
                       int64_t batch, int64_t heads, int64_t head_dim) {
  VQ_CHECK(!has_data || (b == batch && h == heads && d == head_dim),
           std::string("[") + op + "] load: expected a state of batch " + std::to_string(batch) +
               ", KV heads " + std::to_string(heads) + ", head_dim " + std::to_string(head_dim) +
               " (fixed when the device cache was built) but got " + std::to_string(b) + ", " +
               std::to_string(h) + ", " + std::to_string(d) + "; nothing was changed");
}

}  // namespace detail

HostSegment download_segment(const DeviceCacheView& view, size_t i, Stream s) {
  VQ_CHECK(i < view.segments().size(), "[download_segment] expected a segment index below " +
                                           std::to_string(view.segments().size()) + " but got " +
                                           std::to_string(i));
  const DeviceSegment& seg = view.segments()[i];
  const int64_t F = view.batch() * view.n_kv_heads(), D = view.head_dim();
  const int64_t n = seg.n_rows, cap = seg.capacity > 0 ? seg.capacity : seg.n_rows;
  HostSegment h;
  h.n_rows = n;
  h.packed = seg.packed;
  h.k_row_bytes =
      seg.packed ? seg.k_fmt.row_stride : D * static_cast<int64_t>(dtype_size(seg.dtype));
  h.v_row_bytes = seg.packed ? seg.v_fmt.row_stride : h.k_row_bytes;
  h.keys.resize(static_cast<size_t>(F * n * h.k_row_bytes));
  h.values.resize(static_cast<size_t>(F * n * h.v_row_bytes));
  h.positions.resize(static_cast<size_t>(F * n));
  cudaStream_t st = detail::to_stream(s);
  const void* k = seg.packed ? static_cast<const void*>(seg.k_data) : seg.keys;
  const void* v = seg.packed ? static_cast<const void*>(seg.v_data) : seg.values;
  if (n > 0) {
    VQ_CUDA_CHECK(cudaMemcpy2DAsync(h.keys.data(), static_cast<size_t>(n * h.k_row_bytes), k,
                                    static_cast<size_t>(cap * h.k_row_bytes),
                                    static_cast<size_t>(n * h.k_row_bytes), static_cast<size_t>(F),
                                    cudaMemcpyDeviceToHost, st));
    VQ_CUDA_CHECK(cudaMemcpy2DAsync(h.values.data(), static_cast<size_t>(n * h.v_row_bytes), v,
                                    static_cast<size_t>(cap * h.v_row_bytes),
                                    static_cast<size_t>(n * h.v_row_bytes), static_cast<size_t>(F),
                                    cudaMemcpyDeviceToHost, st));
    if (seg.positions) {
      VQ_CUDA_CHECK(cudaMemcpy2DAsync(h.positions.data(), static_cast<size_t>(n * 4), seg.positions,
                                      static_cast<size_t>(cap * 4), static_cast<size_t>(n * 4),
                                      static_cast<size_t>(F), cudaMemcpyDeviceToHost, st));
    } else {
      for (int64_t f = 0; f < F; ++f)
        for (int64_t r = 0; r < n; ++r)
          h.positions[static_cast<size_t>(f * n + r)] = static_cast<int32_t>(seg.first_pos + r);
    }
  }
  const int64_t HD = view.n_kv_heads() * D;
  if (seg.packed && seg.k_perm) {
    h.k_perm.resize(static_cast<size_t>(HD));
    VQ_CUDA_CHECK(cudaMemcpyAsync(h.k_perm.data(), seg.k_perm, static_cast<size_t>(HD * 4),
                                  cudaMemcpyDeviceToHost, st));
  }
  if (seg.packed && seg.v_perm) {
    h.v_perm.resize(static_cast<size_t>(HD));
    VQ_CUDA_CHECK(cudaMemcpyAsync(h.v_perm.data(), seg.v_perm, static_cast<size_t>(HD * 4),
                                  cudaMemcpyDeviceToHost, st));
  }
  synchronize(s);
  return h;
}

}  // namespace vq::cuda
