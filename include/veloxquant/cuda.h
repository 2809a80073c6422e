// The CUDA backend's public API: device buffers, a device-resident cache view (uploaded from any
// CPU CacheView, or assembled from device pieces), fused decode attention over it, the SKVQ flush
// (channel permutations, clipped group quantization into packed records) and the SnapKV
// selection pipeline (scores, pooling, top-k, compaction). Without VQ_CUDA (or without a device)
// is_available() is false and every other entry point throws vq::Error "[cuda] CUDA backend not
// built" (src/cuda/no_cuda.cpp).
//
// Conventions: every pointer documented "device" is device memory (cudaMalloc, never managed);
// a TensorView documented "device" holds a device pointer with the usual [B, H, S, D] shape and
// element strides. Work is queued on the caller's stream (Stream = cudaStream_t; nullptr = the
// legacy default stream); functions returning host data synchronise that stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "veloxquant/attention.h"
#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/packed.h"
#include "veloxquant/snapkv.h"

namespace vq::cuda {

using Stream = void*;  // a cudaStream_t

// True when the library was built with CUDA and a device is present.
bool is_available();

struct DeviceInfo {
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  int64_t l2_bytes = 0;
  int64_t global_bytes = 0;
};
DeviceInfo device_info();

void synchronize(Stream s = nullptr);

// ---- memory ---------------------------------------------------------------------------------

// Owning device allocation (plain cudaMalloc; the size is rounded up to 16 bytes so kernels may
// read whole 16-byte words at the end). Movable, not copyable.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t size() const { return n_; }
  // Host <-> device copies of `bytes` at byte `offset` (synchronous for the host buffer).
  void upload(const void* src, size_t bytes, size_t offset = 0, Stream s = nullptr);
  void download(void* dst, size_t bytes, size_t offset = 0, Stream s = nullptr) const;
  void fill_zero(Stream s = nullptr);

  static DeviceBuffer from_host(const void* src, size_t bytes, Stream s = nullptr);
  template <typename T>
  static DeviceBuffer from_vector(const std::vector<T>& v, Stream s = nullptr) {
    return from_host(v.data(), v.size() * sizeof(T), s);
  }
  template <typename T>
  std::vector<T> to_vector(size_t n, Stream s = nullptr) const {
    std::vector<T> v(n);
    download(v.data(), n * sizeof(T), 0, s);
    return v;
  }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// ---- device cache view ----------------------------------------------------------------------

// One run of rows shared by every (b, h), on the device.
struct DeviceSegment {
  int64_t n_rows = 0;
  // Rows allocated per (b, h): rows, records and positions of (b, h) start at (b*H + h)*capacity
  // (0 = n_rows). Lets a view use the first n_rows of a larger buffer.
  int64_t capacity = 0;
  const int32_t* positions = nullptr;  // device [B, H, capacity], or nullptr: first_pos + i
  int64_t first_pos = 0;
  bool packed = false;
  // Full precision: keys/values device [B, H, capacity, D] contiguous, dtype f16, bf16 or f32.
  DType dtype = DType::kF16;
  const void* keys = nullptr;
  const void* values = nullptr;
  // Packed (packed.h record format): record (b, h, i) at data + ((b*H + h)*capacity + i)*row_stride
  // bytes; perm / signs device [H, D] or nullptr (stored channel j = rotated channel perm[j]).
  PackedRowFormat k_fmt, v_fmt;
  const uint8_t* k_data = nullptr;
  const uint8_t* v_data = nullptr;
  const int32_t* k_perm = nullptr;
  const int32_t* v_perm = nullptr;
  const float* k_signs = nullptr;
  const float* v_signs = nullptr;
  int32_t k_rot_block = 0, v_rot_block = 0;

  // Bytes one pass over the segment reads (rows, metadata and explicit positions).
  int64_t bytes(int64_t batch, int64_t heads, int64_t head_dim) const;
};

// A cache view whose rows live on the device. Holds (or shares) the device memory its
// segments point to.
class DeviceCacheView {
 public:
  DeviceCacheView() = default;
  DeviceCacheView(int64_t batch, int64_t n_kv_heads, int64_t head_dim);

  // Copies every segment of v (full-precision segments of any dtype and strides, packed segments
  // with their transforms) to the device. Neighbouring segments of the same kind and format are
  // merged into one device segment (a CPU SKVQ cache keeps one packed block per flushed chunk;
  // the device view keeps one packed run), positions made explicit where they stop being one
  // implicit run. Synchronises s.
  static DeviceCacheView upload(const CacheView& v, Stream s = nullptr);

  // Appends a segment whose device memory is kept alive by `owned` (moved in) or by the caller.
  void add_segment(const DeviceSegment& seg, std::vector<DeviceBuffer> owned = {});

  int64_t batch() const { return batch_; }
  int64_t n_kv_heads() const { return heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t n_rows() const;
  const std::vector<DeviceSegment>& segments() const { return segs_; }
  // Bytes a decode pass over the whole view reads.
  int64_t bytes() const;

 private:
  int64_t batch_ = 0, heads_ = 0, head_dim_ = 0;
  std::vector<DeviceSegment> segs_;
  std::vector<DeviceBuffer> owned_;
};

// ---- fused decode attention -----------------------------------------------------------------

// Reusable scratch of decode_attention (split partials); grows on demand, never shrinks.
class DecodeWorkspace {
 public:
  DecodeWorkspace() = default;
  void* reserve(size_t bytes);

 private:
  DeviceBuffer buf_;
};

// How decode_attention splits the work (chosen by the plan; fields > 0 override it, for tests).
struct DecodeOptions {
  int64_t rows_per_split = 0;  // rows of one segment one block reads; 0 = automatic
};

// One query per sequence (N = 1): out[b, qh] = softmax(q[b, qh] . K^T * scale) V over every row of
// view that is visible from position p.q_pos0 (pos_j <= q_pos0, and with p.window > 0
// q_pos0 < pos_j + window), query head qh reading KV head qh / (H_q / H_kv).
// q device [B, H_q, D] fp32 contiguous; out device [B, H_q, D] fp32 contiguous.
// Supported: D in {64, 128}; H_q / H_kv in {1, 2, 4, 8}; full-precision segments f16 / bf16 / f32;
// packed segments of every SKVQ format. Fused (read in place): key/value bits (2,2), (4,4), (8,8),
// (4,2) or (2,4), group_size a multiple of 8, any metadata type, permutation and/or Hadamard
// rotation (the query is transformed, never the keys; values are accumulated in stored order and
// un-transformed once); every packed segment of one view must then share one format and one set
// of transforms. Other formats (1.5-bit codes, other bit pairs, other groups) are first
// dequantized into stream-ordered fp32 scratch (the CPU's dequantize_row values) and attended to
// as f32 rows: exact but not fused. Anything else: vq::Error.
// Numerics: fp32 accumulation, exp2 of log2e-scaled logits, splits merged by an exact log-sum-exp
// combine. Products are fp32 on the CUDA-core path; the tensor-core path (f16 rows, 2-bit codes,
// groups a multiple of 32) splits q and p (times the group scale, rescaled by 2^S per tile) into
// fp16 hi + lo parts, whose products with fp16 rows or exact code integers are exact, so its error
// stays within the fp32 bound of tests/cuda/test_cuda_decode.cpp. A query that sees no key gets
// zeros.
void decode_attention(const float* q, int64_t n_q_heads, const DeviceCacheView& view,
                      const AttentionParams& p, float* out, DecodeWorkspace& ws, Stream s = nullptr,
                      const DecodeOptions& opt = {});

// Convenience for tests: host q [B, H_q, D] in, host out [B, H_q, D] back (synchronises).
std::vector<float> decode_attention_host(const std::vector<float>& q, int64_t n_q_heads,
                                         const DeviceCacheView& view, const AttentionParams& p,
                                         const DecodeOptions& opt = {});

// ---- SKVQ flush -----------------------------------------------------------------------------

// Stable ascending per-channel range permutation of each head, pooled over batch and rows (the
// SKVQ reorder of chunk 0): rows device [B, H, n, D] (f16/bf16/f32, contiguous), perm device
// [H, D] int32. Same rule as the CPU (NaN ranges sort last as +inf; ties keep the lower channel).
void skvq_channel_perms(const TensorView& rows, int32_t* perm, Stream s = nullptr);

// Quantizes rows device [B, H, n, D] (f16/bf16/f32, contiguous) into packed records of fmt:
// record (b, h, i) at records + ((b*H + h)*n + i)*fmt.row_stride. Each row is converted to fp32,
// rotated (signs device [H, D], rot_block) and permuted (perm device [H, D]) when given, then
// group-quantized with p (clip search, metadata rounding) exactly as the CPU quantizer: the same
// IEEE operations in the same order, so codes and metadata are bit-identical.
void skvq_quantize_rows(const TensorView& rows, const PackedRowFormat& fmt,
                        const GroupQuantParams& p, const int32_t* perm, const float* signs,
                        int32_t rot_block, uint8_t* records, Stream s = nullptr);

// ---- SnapKV ---------------------------------------------------------------------------------

// Window scores of every (b, h) frame: keys device [B, H, n, D] (f16/bf16/f32, contiguous).
// queries == nullptr: key-proxy scoring with the last w = clamp(obs_window, 1, n) key rows, no
// mask. Otherwise queries device [B, H * n_rep, w, D] fp32 (query head h*n_rep + r shares KV head
// h), with key_pos device [B, H, n] and query_pos device [w] both given (causal) or both nullptr.
// scores device [B, H, n] fp32. Numerics as the CPU's optimised scorer: fp32 dot products and
// softmax, double means (exp differs from the host's by an ulp or two, so scores agree to a
// bound, not bit for bit).
void snap_scores(const TensorView& keys, const TensorView* queries, const int32_t* key_pos,
                 const int32_t* query_pos, int64_t obs_window, float* scores, Stream s = nullptr);

// 1-D pooling of rows [lo, hi) of each of n_frames score rows of length n (snap_pool_scores
// semantics); rows outside [lo, hi) of out are left untouched.
void snap_pool(const float* in, int64_t n_frames, int64_t n, int64_t lo, int64_t hi, int64_t kernel,
               PoolKind kind, float* out, Stream s = nullptr);

// Seed selection (snap_select) or keep-window selection (window >= 0: snap_select_keep_window) of
// every frame: scores device [n_frames, n] -> out device [n_frames, count] int32 ascending,
// count = snap_select_count(n, budget). Same tie and NaN rules as the CPU, bit for bit.
// Returns count.
int64_t snap_select(const float* scores, int64_t n_frames, int64_t n, int64_t budget,
                    int64_t n_sink, int64_t window, int32_t* out, Stream s = nullptr);

// The whole per-head pipeline of snap_select_head on every (b, h): keys device [B, H, n, D];
// q as in snap_scores (nullptr = key proxy). out device [B, H, count] int32. scratch is reused.
// Returns count.
int64_t snap_select_frames(const TensorView& keys, const TensorView* queries,
                           const int32_t* key_pos, const int32_t* query_pos,
                           const SnapSelectParams& p, int32_t* out, DecodeWorkspace& scratch,
                           Stream s = nullptr);

// Compaction (a generic gather of whole rows of row_bytes bytes, full-precision or packed
// records alike): dst[f, i] = src[f, idx[f, i]] for every frame f < n_frames and i < count.
// src device [n_frames, n, row_bytes], dst device [n_frames, count, row_bytes], idx device
// [n_frames, count] int32 in [0, n). With dst_pos (device [n_frames, count]) the positions are
// gathered too: src_pos device [n_frames, n], or nullptr for first_pos + row index.
void gather_rows(const void* src, int64_t n_frames, int64_t n, int64_t row_bytes,
                 const int32_t* idx, int64_t count, void* dst, const int32_t* src_pos = nullptr,
                 int32_t first_pos = 0, int32_t* dst_pos = nullptr, Stream s = nullptr);

}  // namespace vq::cuda
