// Private helpers shared by the GPU-resident caches (device_cache_*.cpp): input validation with
// the CPU caches' messages, strided block -> row store conversion, frame-wise device copies and
// the bytes a DeviceBuffer's cudaMalloc holds, host <-> device frame copies and the state-file
// plumbing (read one frame, validate it with the CPU cache's own load). Row stores are
// [F = B*H, cap, row_bytes].
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "kv/skvq_store.h"
#include "veloxquant/binary_io.h"

#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"

namespace vq::cuda::detail {

std::string shape_str(const TensorView& t);

// Bytes the buffer's cudaMalloc holds (DeviceBuffer rounds up to 16 bytes plus one spare word).
int64_t held_bytes(const DeviceBuffer& b);

// Refuses (vq::Error "[op] expected ... but got ...") keys / values that are not device blocks
// [batch, heads, S >= 0, head_dim] of f32/f16/bf16 with the same shape.
void check_blocks(const TensorView& keys, const TensorView& values, int64_t batch, int64_t heads,
                  int64_t head_dim, const char* op);

// dst rows [row0, row0 + n) of every frame (store [F, cap, D] of dst_t) = src rows [s0, s0 + n)
// converted. src is a device TensorView [B, H, S, D] with any element strides.
void convert_block(const TensorView& src, int64_t s0, int64_t n, void* dst, DType dst_t,
                   int64_t cap, int64_t row0, Stream s);

// For every frame f < frames: n rows of row_bytes bytes from src (frame stride src_cap rows,
// starting at src_row0) to dst (frame stride dst_cap rows, starting at dst_row0).
void copy_frames(void* dst, int64_t dst_cap, int64_t dst_row0, const void* src, int64_t src_cap,
                 int64_t src_row0, int64_t frames, int64_t n, int64_t row_bytes, Stream s);

// pos[f*cap + row0 + i] = first + i.
void fill_positions(int32_t* pos, int64_t frames, int64_t cap, int64_t row0, int64_t n,
                    int64_t first, Stream s);

// Device -> host: for every frame f < frames, n rows of row_bytes from src (frame stride src_cap
// rows, from src_row0) to host dst (frame stride dst_cap rows, from row 0). Synchronises s.
void download_frames(void* dst, int64_t dst_cap, const void* src, int64_t src_cap, int64_t src_row0,
                     int64_t frames, int64_t n, int64_t row_bytes, Stream s);
// Host -> device: the reverse (host src frame stride src_cap rows from row 0; device dst frame
// stride dst_cap rows from dst_row0). Synchronises s.
void upload_frames(void* dst, int64_t dst_cap, int64_t dst_row0, const void* src, int64_t src_cap,
                   int64_t frames, int64_t n, int64_t row_bytes, Stream s);

// Host tensor [B, H, n, D] of t from a device row store [F, cap, D] (rows row0 .. row0 + n).
Tensor download_rows(const void* src, DType t, int64_t batch, int64_t heads, int64_t n,
                     int64_t head_dim, int64_t cap, int64_t row0, Stream s);
// Host skvq::FpRows (dtype t, [B, H, ., D]; explicit positions when pos is given) holding rows
// [row0, row0 + n) of the device stores k, v (and pos) [F, cap, ...], for the CPU's FpRows::save.
skvq::FpRows download_fp_rows(DType t, int64_t batch, int64_t heads, int64_t head_dim,
                              const DeviceBuffer& k, const DeviceBuffer& v, const DeviceBuffer* pos,
                              int64_t n, int64_t cap, int64_t row0, Stream s);
// A device store [F, cap, D] (cap >= fp.count) with the live rows of fp (keys or values) at
// row 0; empty when fp holds no rows.
DeviceBuffer upload_fp_rows(const skvq::FpRows& fp, bool values, int64_t cap, Stream s);

// The rows [F, n, row_bytes] of a device store [F, cap, row_bytes] (rows 0 .. n-1), on the host.
std::vector<uint8_t> download_store(const DeviceBuffer& src, int64_t frames, int64_t n, int64_t cap,
                                    int64_t row_bytes, Stream s);
// Rows [r0, r0 + rows) of every frame of host rows [F, n, row_bytes], as [F, rows, row_bytes].
std::vector<uint8_t> slice_frames(const std::vector<uint8_t>& src, int64_t frames, int64_t n,
                                  int64_t r0, int64_t rows, int64_t row_bytes);

// Host copies of a packed key and value record store pair (download_store of each: rows 0 .. n-1
// of [F, cap, row_stride]), written block by block into a state as the CPU's SKVQ caches do.
struct HostRecords {
  std::vector<uint8_t> k, v;
  int64_t frames = 0, n = 0, k_stride = 0, v_stride = 0;
  // Rows [r0, r0 + rows) of every frame: the key records, then the value records, a blob each.
  void write_block(StateWriter& w, int64_t r0, int64_t rows) const;
};
HostRecords download_records(const DeviceBuffer& pk, const DeviceBuffer& pv, int64_t frames,
                             int64_t n, int64_t cap, int64_t k_stride, int64_t v_stride, Stream s);

// SnapKV caches with a prompt-end eviction owed: the mask of a single query (every row that
// will stay, keep_count, and itself); a windowed one is refused (vq::Error naming op).
Mask pending_single_query_mask(const char* op, int64_t window, int64_t keep_count);

// FpRows of dtype t, [B, H, ., D] (explicit positions or not), read by FpRows::load.
skvq::FpRows read_fp_rows(StateReader& r, DType t, int64_t batch, int64_t heads, int64_t head_dim,
                          bool explicit_positions, const char* op);
// A device store [F, cap, row_bytes] holding the host blocks [F, rows[c], row_bytes] one after the
// other from row 0 (the CPU's packed blocks of one run); empty when cap == 0.
DeviceBuffer upload_blocks(const std::vector<const void*>& blocks, const std::vector<int64_t>& rows,
                           int64_t frames, int64_t cap, int64_t row_bytes, Stream s);

// Device copies of frozen transforms: perm_k / perm_v [H, D] when t has permutations, signs
// [H, D] when it has a rotation (each left empty otherwise).
void upload_transforms(const skvq::Transforms& t, DeviceBuffer& perm_k, DeviceBuffer& perm_v,
                       DeviceBuffer& signs, Stream s);

// Reads one state frame of cfg.method from in and validates it with the load() of the CPU cache
// of cfg: the CPU's refusals, checks and messages, nothing changed on error. Returns the frame
// parsed a second, trusted time (StateReader::from_bytes), for the device cache's own load.
StateReader read_validated_state(std::istream& in, const CacheConfig& cfg);

// Refuses (vq::Error, nothing changed) a state of other B, H, D than the cache's.
void check_state_shape(const char* op, bool has_data, int64_t b, int64_t h, int64_t d,
                       int64_t batch, int64_t heads, int64_t head_dim);

}  // namespace vq::cuda::detail

namespace vq::cuda {
// One builder per method; cfg is validated by make_device_cache.
// Full, snapkv and streaming: the CPU policies over the CUDA row backend (device_cache_policy.cpp).
std::unique_ptr<DeviceKVCache> make_device_full_cache(const CacheConfig& cfg, int64_t b, int64_t h,
                                                      int64_t d, Stream s);
std::unique_ptr<DeviceKVCache> make_device_snapkv_cache(const CacheConfig& cfg, int64_t b,
                                                        int64_t h, int64_t d, Stream s);
std::unique_ptr<DeviceKVCache> make_device_streaming_cache(const CacheConfig& cfg, int64_t b,
                                                           int64_t h, int64_t d, Stream s);
std::unique_ptr<DeviceKVCache> make_device_skvq_cache(const CacheConfig& cfg, int64_t b, int64_t h,
                                                      int64_t d, Stream s);
}  // namespace vq::cuda
