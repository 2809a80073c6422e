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
#include <memory>
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
  // Channel-axis keys (k_fmt.axis == kChannel, packed.h): device [k_n_runs + 1] int32, run r =
  // rows [k_runs[r], k_runs[r + 1]) of every (b, h), its metadata list in its first record
  // (k_runs[0] = 0, k_runs[k_n_runs] = n_rows); nullptr: the segment is one run.
  const int32_t* k_runs = nullptr;
  int32_t k_n_runs = 0;

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

// ---- fused decode attention: plan once per step, run per layer ------------------------------

// Which split kernel a decode plan launches (decode_attention.cuh has the instances).
enum class DecodeKernel : int32_t {
  kCudaCore = 0,           // generic CUDA-core kernel: every supported format
  kMmaF16 = 1,             // tensor-core kernel, f16 rows only
  kMmaPacked2 = 2,         // tensor-core, f16 rows and 2-bit codes (any metadata type)
  kMmaPacked2F16Meta = 3,  // the same with f16 metadata
  kMmaPacked4 = 4,         // tensor-core, f16 rows and 4-bit codes (any metadata type)
  kMmaPacked4F16Meta = 5,  // the same with f16 metadata
  kMmaPacked2G32 = 6,      // 2-bit codes, f16 metadata, groups of 32, records of D/4 + D/8 bytes
                           // (record offsets fixed at compile time)
  kMmaPacked4G32 = 7,      // the same for 4-bit codes (records of D/2 + D/8 bytes)
  // The same instances for views whose full-precision rows are bf16 (bf16 operands on those
  // rows; packed rows as above): kMmaBF16 = kMmaF16's, and so on.
  kMmaBF16 = 8,
  kMmaPacked2BF16 = 9,
  kMmaPacked2F16MetaBF16 = 10,
  kMmaPacked4BF16 = 11,
  kMmaPacked4F16MetaBF16 = 12,
  kMmaPacked2G32BF16 = 13,
  kMmaPacked4G32BF16 = 14,
};
const char* decode_kernel_name(DecodeKernel k);

// Per-device context of decode planning: the device's properties and, memoised, the resident
// blocks per SM of the tensor-core kernel instances a plan asked about (that query costs host
// time, and the planner runs once per step). Not thread-safe: one context per thread or stream.
class DecodeContext {
 public:
  // The current device (cudaGetDevice): its properties are queried now.
  static DecodeContext current();
  // A context that plans without a device (host tests): info as given, and every tensor-core
  // instance answers mma_blocks_per_sm resident blocks per SM.
  static DecodeContext fake(const DeviceInfo& info, int mma_blocks_per_sm);

  const DeviceInfo& info() const { return info_; }
  int device() const { return device_; }  // CUDA ordinal, -1 for a fake context
  // Resident blocks per SM of tensor-core instance k at (head_dim, group = H_q / H_kv, bytes of
  // K per pipeline stage); memoised per context.
  int mma_blocks_per_sm(DecodeKernel k, int32_t head_dim, int32_t group,
                        int32_t stage_half_bytes) const;

 private:
  struct Occupancy {
    DecodeKernel kernel;
    int32_t head_dim, group, stage_half_bytes, blocks;
  };
  using OccupancyQuery = int (*)(DecodeKernel, int32_t head_dim, int32_t group,
                                 int32_t stage_half_bytes);
  int device_ = -1;
  DeviceInfo info_;
  OccupancyQuery query_ = nullptr;  // the device's occupancy query; nullptr: fake_blocks_
  int fake_blocks_ = 0;
  mutable std::vector<Occupancy> memo_;
};

// Knobs of the planner; fields > 0 override its automatic choice (tests and the benchmark).
struct DecodePlanOptions {
  int64_t rows_per_split = 0;      // rows of one segment one block reads (exactly, not rounded)
  int64_t target_blocks = 0;       // total split blocks the plan aims for
  int64_t packed_stage_bytes = 0;  // K + V bytes per pipeline stage of packed rows (tensor-core)
  // Query heads per block where the view and group allow 16 (the tensor-core kernel's 16-head
  // block): 16 always, 8 never (blocks of at most 8); 0 automatic (decode_plan.cpp).
  int64_t heads_per_block = 0;
};

// One non-empty segment of the view a plan was made for, and how it is read.
struct DecodeSegmentPlan {
  int64_t n_rows = 0;            // rows per (b, h)
  int64_t capacity = 0;          // rows allocated per (b, h) in the view (0 = n_rows)
  bool positions = false;        // explicit positions in the view
  bool packed = false;           // packed records in the view
  bool dequantize = false;       // packed in a format no split kernel reads in place: dequantized
                                 // into fp32 scratch by every run, then read as f32 rows
  bool channel = false;          // packed with channel-axis keys: read in place by the channel
                                 // kernel (decode_attention_channel.cuh), fused
  DType dtype = DType::kF16;     // full-precision rows: their dtype
  PackedRowFormat k_fmt, v_fmt;  // packed rows: their formats and which transforms they have
  bool k_perm = false, v_perm = false, k_signs = false, v_signs = false;
  int32_t k_rot_block = 0, v_rot_block = 0;  // with signs: the Hadamard block
  int32_t k_row_bytes = 0, v_row_bytes = 0;  // bytes per row as the split kernel reads it
  int32_t tile_rows = 0;                     // rows per pipeline stage
  int64_t rows_per_split = 0;
  int32_t split_begin = 0, n_splits = 0;
};

// A decode step's plan: made once from the shapes, the formats and the device, then run on every
// layer's view of those shapes (decode_attention_run checks that the view matches).
struct DecodePlan {
  int64_t batch = 0, n_kv_heads = 0, head_dim = 0, n_q_heads = 0;
  // Blocks per (b, KV head): 1 when H_q / H_kv is 1, 2, 4 or 8 (the kernels' query-head groups),
  // else H_q / H_kv over the largest of those dividing it (16 heads: 2 blocks of 8; 3: 3 of 1).
  int32_t kv_rep = 1;
  AttentionParams params;
  int device = -1;  // the context's device (-1: planned on a fake context)
  DecodeKernel kernel = DecodeKernel::kCudaCore;
  int32_t k_bits = 0, v_bits = 0;  // 0 when no segment is read packed
  int32_t stage_half_bytes = 0;    // tensor-core kernel: bytes of K (and of V) per stage
  int64_t target_blocks = 0;       // the block target the splits were sized for
  int64_t total_rows = 0;          // rows per (b, h) over every segment (0: the output is zeros)
  int32_t n_splits = 0;            // split blocks per (b, kv head, one of its kv_rep blocks)
  std::vector<DecodeSegmentPlan> segments;
  size_t workspace_bytes = 0;  // DecodeWorkspace bytes a run reserves (split partials)
  size_t scratch_bytes = 0;    // stream-ordered fp32 scratch of dequantized segments per run
};

// Reusable scratch of decode_attention (split partials) and the decode context of the device it
// lives on (made at first use); grows on demand, never shrinks.
class DecodeWorkspace {
 public:
  void* reserve(size_t bytes);
  // The context of the current device, created at the first call (throws vq::Error when the
  // current device is not the one the workspace was first used on).
  const DecodeContext& context();

 private:
  DeviceBuffer buf_;
  std::unique_ptr<DecodeContext> ctx_;
};

// Kept for callers of the one-call form: the plan's options.
using DecodeOptions = DecodePlanOptions;

// Plans decode attention of n_q_heads query heads over view (its segment sizes, formats and
// transforms, not its memory) on ctx's device: checks the shapes (below), picks the kernel and
// sizes the splits. Every kernel reads every segment of one (b, kv head) with about
// target / (B * H_kv) split blocks of at least 64 rows (a whole number of pipeline tiles, never
// crossing a segment); the tensor-core kernel aims for one wave of its resident blocks, the
// CUDA-core kernel for 16 blocks per SM (about four waves). Host work only: no device call, no
// allocation but the plan's, except a memoised occupancy query on ctx.
DecodePlan decode_attention_plan(const DecodeContext& ctx, int64_t n_q_heads,
                                 const DeviceCacheView& view, const AttentionParams& p,
                                 const DecodePlanOptions& opt = {});

// Runs plan over view (a view of the plan's shapes: batch, heads, head_dim, and the same
// non-empty segments with the same rows, capacities, dtypes, formats and transforms present;
// anything else is a vq::Error), reading q and writing out on stream s. The plan's device must be
// the current one.
void decode_attention_run(const DecodePlan& plan, const float* q, const DeviceCacheView& view,
                          float* out, DecodeWorkspace& ws, Stream s = nullptr);

// One sequence of a batched decode run: its plan, its queries [B, H_q, D], its view and its
// output (as for decode_attention_run).
struct DecodeBatchItem {
  const DecodePlan* plan = nullptr;
  const float* q = nullptr;
  const DeviceCacheView* view = nullptr;
  float* out = nullptr;
};

// Sequences one batched decode launch takes (decode_attention_run_batch); a larger group runs as
// launches of balanced pieces, decode_batch_pieces(n) of them.
constexpr int64_t kDecodeBatchMaxSequences = 32;
inline int64_t decode_batch_pieces(int64_t n) {
  return (n + kDecodeBatchMaxSequences - 1) / kDecodeBatchMaxSequences;
}

// decode_attention_run of every item, the items of batch-1 views whose plans share the kernel
// instance (kernel, head_dim, query and KV heads, bits, stage bytes) in ONE split launch and one
// combine per piece of at most 32 (per-sequence parameters indexed by the grid's z: ragged rows,
// own positions, segments and transforms); each item's plan, splits and arithmetic are its own, so
// every output equals its decode_attention_run bit for bit. Items that cannot join (batch > 1,
// no rows, dequantized segments, a kernel instance of one item) run alone. Checks all first.
void decode_attention_run_batch(const std::vector<DecodeBatchItem>& items, DecodeWorkspace& ws,
                                Stream s = nullptr);

// Whether decode_attention_run_batch can put an item of this plan in a shared launch (a batch-1
// view with rows, no dequantized segment, no channel-axis keys); other plans run alone, so a
// caller sizes their splits as single launches.
bool decode_plan_joins_batch(const DecodePlan& plan);

// One query per sequence (N = 1): out[b, qh] = softmax(q[b, qh] . K^T * scale) V over every row of
// view that is visible from position p.q_pos0 (pos_j <= q_pos0, and with p.window > 0
// q_pos0 < pos_j + window), query head qh reading KV head qh / (H_q / H_kv).
// q device [B, H_q, D] fp32 contiguous; out device [B, H_q, D] fp32 contiguous.
// Supported: D in {64, 128}; any H_q / H_kv (1, 2, 4 or 8 query heads per block, DecodePlan::kv_rep
// blocks per KV head: 16 heads take 2 blocks of 8, each reading the rows); full-precision segments
// f16 / bf16 / f32; packed segments of every SKVQ format. Fused (read in place): keys and values
// of any code spec (1..8 bits or 1.5-bit three-level codes, each its own: the pairs (2,2), (4,4),
// (8,8), (4,2), (2,4) by kernels of their own, every other pair by one that reads the spec at run
// time), one group_size for both, a multiple of 8, any metadata type, permutation and/or Hadamard
// rotation (the query is transformed, never the keys; values are accumulated in stored order and
// un-transformed once); every packed segment of one view must then share one format and one set
// of transforms. Other groups (key and value groups that differ or are not a multiple of 8) are
// first dequantized into stream-ordered fp32 scratch (the CPU's dequantize_row values) and
// attended to as f32 rows: exact but not fused. Channel-axis keys (skvq_key_axis=channel, any code
// bits and metadata type, values of any token-axis format, the same transforms) are read in place
// by a CUDA-core kernel of their own: per run of rows sharing (lo_c, scale_c), q'_c * scale_c is
// folded once and sum_c q'_c * lo_c added to every logit of the run; the view's other segments
// take the CUDA-core split kernel, and such plans run alone in decode_attention_run_batch.
// Anything else: vq::Error.
// Numerics: fp32 accumulation, exp2 of log2e-scaled logits, splits merged by an exact log-sum-exp
// combine. Products are fp32 on the CUDA-core path; the tensor-core path (full-precision rows all
// f16 or all bf16, 2-/4-bit codes, groups a multiple of 32) rounds q and p (times the group scale,
// rescaled by 2^S per tile, for packed values) once to fp16, or to bf16 over bf16 rows, and
// accumulates in fp32 (FlashAttention numerics, docs/design.md section 4; bound in
// tests/ops_harness/attention_bounds.h). A query that sees no key gets
// zeros. This one-call form plans (on ws's context) and runs; a caller decoding many layers of one
// step plans once (decode_attention_plan) and runs per layer (decode_attention_run).
void decode_attention(const float* q, int64_t n_q_heads, const DeviceCacheView& view,
                      const AttentionParams& p, float* out, DecodeWorkspace& ws, Stream s = nullptr,
                      const DecodePlanOptions& opt = {});

// Convenience for tests: host q [B, H_q, D] in, host out [B, H_q, D] back (synchronises).
std::vector<float> decode_attention_host(const std::vector<float>& q, int64_t n_q_heads,
                                         const DeviceCacheView& view, const AttentionParams& p,
                                         const DecodePlanOptions& opt = {});

// ---- decode in the model's dtype (python/src/module.cpp) -------------------------------------

// Device scratch decode_attention_typed needs for B sequences of n_q_heads heads of head_dim.
size_t decode_typed_staging_bytes(int64_t batch, int64_t n_q_heads, int64_t head_dim);

// decode_attention with q and out in the model's dtype, for callers whose tensors are f16 or bf16
// (transformers' layers): q device [B, H_q, 1, D] of f16, bf16 or f32 with any element strides;
// out device [B, H_q, 1, D] contiguous, f16, bf16 or f32. q is widened to fp32 into staging
// (exact; skipped when q is contiguous fp32), decode_attention runs on it, and its fp32 output is
// rounded once to out's dtype (to nearest even; written in place when out is fp32). staging:
// device memory of decode_typed_staging_bytes(B, H_q, D) bytes, not used by anything else queued
// on s. At most two conversion launches beside the attention; no allocation, no synchronisation.
void decode_attention_typed(const TensorView& q, const DeviceCacheView& view,
                            const AttentionParams& p, const TensorView& out, void* staging,
                            DecodeWorkspace& ws, Stream s = nullptr);

// ---- SKVQ flush -----------------------------------------------------------------------------

// Stable ascending per-channel range permutation of each head, pooled over batch and rows (the
// SKVQ reorder of chunk 0): rows device [B, H, n, D] (f16/bf16/f32, contiguous), perm device
// [H, D] int32. Same rule as the CPU (NaN ranges sort last as +inf; ties keep the lower channel).
void skvq_channel_perms(const TensorView& rows, int32_t* perm, Stream s = nullptr);

// Quantizes rows device [B, H, n, D] (f16/bf16/f32, contiguous) into packed records of fmt:
// record (b, h, i) at records + ((b*H + h)*n + i)*fmt.row_stride. Each row is converted to fp32,
// rotated (signs device [H, D], rot_block) and permuted (perm device [H, D]) when given, then
// group-quantized with p (clip search, metadata rounding) exactly as the CPU quantizer: the same
// IEEE operations in the same order, so codes and metadata are bit-identical. A channel-axis fmt
// (packed.h) takes each (b, h)'s n rows as one chunk, quantize_chunk_to_records bit for bit (n
// at least the rows its metadata needs), with key_u (device [H, D, D] fp64, the factors of
// veloxquant/key_rounding.h in stored channel order; channel-axis records only) its codes by
// error feedback as that function's key_u argument gives them. The clip search tries
// clip_alphas(p) (group_quant.h; a value clip floor included).
void skvq_quantize_rows(const TensorView& rows, const PackedRowFormat& fmt,
                        const GroupQuantParams& p, const int32_t* perm, const float* signs,
                        int32_t rot_block, uint8_t* records, Stream s = nullptr,
                        const double* key_u = nullptr);

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
