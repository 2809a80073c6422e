// Private helpers of the GPU-resident caches (device_cache_*.cpp) and the CUDA row backend
// (row_store_cuda.cpp): input validation with the CPU caches' messages, strided block -> row store
// conversion, frame-wise device copies and the bytes a DeviceBuffer's cudaMalloc holds, host <->
// device frame copies. Row stores are [F = B*H, cap, row_bytes].
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"

namespace vq::cuda {
struct ConvertRowsParams;  // device_cache_kernels.cuh
}  // namespace vq::cuda

namespace vq::cuda::detail {

std::string shape_str(const TensorView& t);

// Bytes the buffer's cudaMalloc holds (DeviceBuffer rounds up to 16 bytes plus one spare word).
int64_t held_bytes(const DeviceBuffer& b);

// Refuses (vq::Error "[op] expected ... but got ...") keys / values that are not device blocks
// [batch, heads, S >= 0, head_dim] of f32/f16/bf16 with the same shape.
void check_blocks(const TensorView& keys, const TensorView& values, int64_t batch, int64_t heads,
                  int64_t head_dim, const char* op);

// dst rows [row0, row0 + n) of every frame (store [F, cap, D] of dst_t) = src rows [s0, s0 + n)
// converted. src is a device TensorView [B, H, S, D] with any element strides. may_defer: a row
// store's own write, which an open row-write batch may record (record_row_write).
void convert_block(const TensorView& src, int64_t s0, int64_t n, void* dst, DType dst_t,
                   int64_t cap, int64_t row0, Stream s, bool may_defer = false);

// For every frame f < frames: n rows of row_bytes bytes from src (frame stride src_cap rows,
// starting at src_row0) to dst (frame stride dst_cap rows, starting at dst_row0).
void copy_frames(void* dst, int64_t dst_cap, int64_t dst_row0, const void* src, int64_t src_cap,
                 int64_t src_row0, int64_t frames, int64_t n, int64_t row_bytes, Stream s);

// pos[f*cap + row0 + i] = first + i (may_defer as for convert_block).
void fill_positions(int32_t* pos, int64_t frames, int64_t cap, int64_t row0, int64_t n,
                    int64_t first, Stream s, bool may_defer = false);

// Device -> host: for every frame f < frames, n rows of row_bytes from src (frame stride src_cap
// rows, from src_row0) to host dst (frame stride dst_cap rows, from row 0). Synchronises s.
void download_frames(void* dst, int64_t dst_cap, const void* src, int64_t src_cap, int64_t src_row0,
                     int64_t frames, int64_t n, int64_t row_bytes, Stream s);
// Host -> device: the reverse (host src frame stride src_cap rows from row 0; device dst frame
// stride dst_cap rows from dst_row0). Synchronises s.
void upload_frames(void* dst, int64_t dst_cap, int64_t dst_row0, const void* src, int64_t src_cap,
                   int64_t frames, int64_t n, int64_t row_bytes, Stream s);

// Row-write batches (veloxquant/cuda_row_writes.h, src/cuda/row_writes.cpp). flush_row_writes
// launches what is recorded on s (every store and cache op on s that reads or replaces rows calls
// it first: the frame copies below, the stores' gathers, quantization and destruction). A row
// store's write_block / fill_positions may be recorded (record_row_write: a conversion, kind 0,
// or a position run, kind 1) when a batch is open on s inside an UpdateCall and, for a
// conversion, its source is the call's key or value block; false: the caller launches it now.
void flush_row_writes(Stream s);
bool record_row_write(const ConvertRowsParams& p, int kind, int32_t first, Stream s);
// Marks a DeviceKVCache::update_and_fetch in progress on s with its key / value blocks.
class UpdateCall {
 public:
  UpdateCall(Stream s, const void* keys, const void* values);
  ~UpdateCall();
  UpdateCall(const UpdateCall&) = delete;
  UpdateCall& operator=(const UpdateCall&) = delete;

 private:
  Stream stream_;
  bool active_ = false;
};

// Host tensor [B, H, n, D] of t from a device row store [F, cap, D] (rows row0 .. row0 + n).
Tensor download_rows(const void* src, DType t, int64_t batch, int64_t heads, int64_t n,
                     int64_t head_dim, int64_t cap, int64_t row0, Stream s);
// Refuses (vq::Error, nothing changed) a state of other B, H, D than the cache's.
void check_state_shape(const char* op, bool has_data, int64_t b, int64_t h, int64_t d,
                       int64_t batch, int64_t heads, int64_t head_dim);

}  // namespace vq::cuda::detail

namespace vq::cuda {
// One builder per method; cfg is validated by make_device_cache. Each is the CPU policy over the
// CUDA row backend (device_cache_policy.cpp); the SKVQ methods' for model layer `layer`.
std::unique_ptr<DeviceKVCache> make_device_full_cache(const CacheConfig& cfg, int64_t b, int64_t h,
                                                      int64_t d, Stream s);
std::unique_ptr<DeviceKVCache> make_device_snapkv_cache(const CacheConfig& cfg, int64_t b,
                                                        int64_t h, int64_t d, Stream s);
std::unique_ptr<DeviceKVCache> make_device_streaming_cache(const CacheConfig& cfg, int64_t b,
                                                           int64_t h, int64_t d, Stream s);
std::unique_ptr<DeviceKVCache> make_device_skvq_cache(const CacheConfig& cfg, int64_t b, int64_t h,
                                                      int64_t d, Stream s, int64_t layer);
std::unique_ptr<DeviceKVCache> make_device_snapkv_skvq_cache(const CacheConfig& cfg, int64_t b,
                                                             int64_t h, int64_t d, Stream s,
                                                             int64_t layer);
}  // namespace vq::cuda
