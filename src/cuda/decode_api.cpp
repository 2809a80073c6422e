// decode_attention (veloxquant/cuda.h): validates the view and the shapes, plans the splits and
// fills the DecodeParams of decode_attention.cuh, then queues the split + combine kernels.
//
// Plan: every (b, kv head) gets about target / (B * H_kv) splits, each split at least 64 rows and a
// whole number of pipeline tiles (short f16-only views: at least 4 tiles per split while that
// leaves about a block per SM); a split never crosses a segment boundary (so its rows share one
// format). Views of f16 rows and 2/2- or 4/4-bit codes (groups of a multiple of 32) go to the
// tensor-core kernel, target = one wave of its resident blocks (occupancy query); others to the
// generic kernel, target = 16 blocks per SM (about four waves of its ~4 resident blocks). The host
// work is a few hundred operations and no allocation once the workspace is large enough. Tuning
// knobs for the benchmark (environment, read once; unset = the defaults above):
// VQ_DECODE_PACKED_STAGE_BYTES (K + V bytes per stage of packed rows, tensor-core kernel) and
// VQ_DECODE_TARGET_BLOCKS (the split plan's block target). Packed segments of a format no split
// kernel reads in place (fused_format) are dequantized into fp32 scratch first (unfused fallback).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/decode_attention.cuh"
#include "cuda/device_cache_dequant.cuh"
#include "veloxquant/cuda.h"

namespace vq::cuda {

namespace {

int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    VQ_CUDA_CHECK(cudaGetDevice(&dev));
    VQ_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

// The occupancy query of the tensor-core kernel, remembered per (device, kernel, stage size):
// decode runs once per layer and token, and the query costs host time.
int mma_blocks_per_sm_cached(const DecodeParams& dp) {
  struct Entry {
    int dev, kind, d, g, half, n;
  };
  static std::mutex mu;
  static std::vector<Entry> cache;
  int dev = 0;
  VQ_CUDA_CHECK(cudaGetDevice(&dev));
  {
    const std::lock_guard<std::mutex> lock(mu);
    for (const Entry& e : cache)
      if (e.dev == dev && e.kind == dp.use_mma && e.d == dp.head_dim && e.g == dp.group &&
          e.half == dp.stage_half_bytes)
        return e.n;
  }
  const int n = decode_mma_blocks_per_sm(dp);
  const std::lock_guard<std::mutex> lock(mu);
  if (cache.size() < 256)
    cache.push_back({dev, dp.use_mma, dp.head_dim, dp.group, dp.stage_half_bytes, n});
  return n;
}

// A positive integer from the environment variable `name`, or 0 when unset or not one.
int64_t env_knob(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return 0;
  const long long x = std::atoll(v);
  return x > 0 ? static_cast<int64_t>(x) : 0;
}

// Packed formats the split kernels read in place: key/value bits (2,2), (4,4), (8,8), (4,2) or
// (2,4) and one group size, a multiple of 8. Every other SKVQ format (1.5-bit codes, other bit
// pairs, other groups) is dequantized first (dequantized_segment).
bool fused_format(const DeviceSegment& sg) {
  const PackedRowFormat &k = sg.k_fmt, &v = sg.v_fmt;
  if (k.spec.ternary() || v.spec.ternary()) return false;
  const int kb = k.spec.bits(), vb = v.spec.bits();
  const bool pair =
      (kb == vb && (kb == 2 || kb == 4 || kb == 8)) || (kb == 4 && vb == 2) || (kb == 2 && vb == 4);
  return pair && k.group_size == v.group_size && k.group_size % 8 == 0;
}

// Rows per (b, h) of the fp32 copy of a packed segment: its capacity when it has explicit
// positions (they are indexed by the capacity), else its rows.
int64_t dequantized_capacity(const DeviceSegment& sg) {
  return sg.positions ? (sg.capacity > 0 ? sg.capacity : sg.n_rows) : sg.n_rows;
}

// Queues the dequantization of a packed segment into fp32 rows k, v [B*H, cap, D] (original
// channel order: dequant_rows, the CPU's dequantize_row operations, un-rotation included).
void dequantize_segment(const DeviceSegment& sg, int64_t frames, int64_t heads, int64_t cap,
                        float* k, float* v, cudaStream_t st) {
  for (int kv = 0; kv < 2; ++kv) {
    const PackedRowFormat& f = kv ? sg.v_fmt : sg.k_fmt;
    DequantRowsParams d;
    d.records = kv ? sg.v_data : sg.k_data;
    d.src_cap = sg.capacity > 0 ? sg.capacity : sg.n_rows;
    d.row_stride = static_cast<int32_t>(f.row_stride);
    d.code_bytes = static_cast<int32_t>(f.code_bytes);
    d.bits = f.spec.bits();
    d.ternary = f.spec.ternary() ? 1 : 0;
    d.group_size = static_cast<int32_t>(f.group_size);
    d.meta = static_cast<int32_t>(f.meta);
    d.head_dim = static_cast<int32_t>(f.head_dim);
    d.perm = kv ? sg.v_perm : sg.k_perm;
    d.n_frames = frames;
    d.heads = heads;
    d.n = sg.n_rows;
    d.dst = kv ? v : k;
    d.dst_cap = cap;
    d.signs = kv ? sg.v_signs : sg.k_signs;
    if (d.signs) {
      const int32_t blk = kv ? sg.v_rot_block : sg.k_rot_block;
      VQ_CHECK(blk >= 1 && f.head_dim % blk == 0 && (blk & (blk - 1)) == 0,
               "[decode_attention] expected a power-of-two rotation block dividing " +
                   std::to_string(f.head_dim) + " but got " + std::to_string(blk));
      d.rot_block = blk;
      d.rot_norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(blk)));
    }
    dequant_rows_launch(d, st);
  }
}

// Stream-ordered scratch freed (on the stream, after the queued kernels) when it goes out of scope.
struct StreamScratch {
  void* p = nullptr;
  cudaStream_t st = nullptr;
  ~StreamScratch() {
    if (p) (void)cudaFreeAsync(p, st);
  }
};

bool same_fmt(const PackedRowFormat& a, const PackedRowFormat& b) {
  return a.head_dim == b.head_dim && a.group_size == b.group_size && a.code_bytes == b.code_bytes &&
         a.row_stride == b.row_stride && a.spec.bits_x2 == b.spec.bits_x2 && a.meta == b.meta;
}

int32_t tile_rows_for(int64_t k_row_bytes, int64_t v_row_bytes) {
  const int64_t rb = std::max(k_row_bytes, v_row_bytes);
  int64_t t = std::min<int64_t>(128, kDecodeStageBytes / rb);
  t = t / 8 * 8;
  VQ_CHECK(t >= 8, "[decode_attention] expected rows of at most " +
                       std::to_string(kDecodeStageBytes / 8) + " bytes but got " +
                       std::to_string(rb));
  return static_cast<int32_t>(t);
}

}  // namespace

void decode_attention(const float* q, int64_t n_q_heads, const DeviceCacheView& view,
                      const AttentionParams& p, float* out, DecodeWorkspace& ws, Stream s,
                      const DecodeOptions& opt) {
  const int64_t B = view.batch(), H = view.n_kv_heads(), D = view.head_dim();
  VQ_CHECK(B >= 1 && H >= 1, "[decode_attention] expected a view with B, H_kv >= 1 but got " +
                                 std::to_string(B) + ", " + std::to_string(H));
  VQ_CHECK(D == 64 || D == 128,
           "[decode_attention] expected head_dim in {64, 128} but got " + std::to_string(D));
  VQ_CHECK(n_q_heads >= H && n_q_heads % H == 0,
           "[decode_attention] expected H_q a multiple of H_kv = " + std::to_string(H) +
               " but got " + std::to_string(n_q_heads));
  const int64_t G = n_q_heads / H;
  VQ_CHECK(G == 1 || G == 2 || G == 4 || G == 8,
           "[decode_attention] expected H_q / H_kv in {1, 2, 4, 8} but got " + std::to_string(G));
  VQ_CHECK(q && out, "[decode_attention] expected device q and out but got a null pointer");
  VQ_CHECK(p.window >= 0,
           "[decode_attention] expected window >= 0 but got " + std::to_string(p.window));
  VQ_CHECK(B <= 65535 && H <= 65535, "[decode_attention] expected B and H_kv <= 65535 but got " +
                                         std::to_string(B) + ", " + std::to_string(H));

  DecodeParams dp;
  dp.q = q;
  dp.out = out;
  dp.batch = static_cast<int32_t>(B);
  dp.n_kv_heads = static_cast<int32_t>(H);
  dp.group = static_cast<int32_t>(G);
  dp.head_dim = static_cast<int32_t>(D);
  const double scale =
      p.scale != 0.0f ? static_cast<double>(p.scale) : 1.0 / std::sqrt(static_cast<double>(D));
  dp.scale_log2 = static_cast<float>(scale * 1.4426950408889634074);
  dp.q_pos = p.q_pos0;
  dp.window = p.window;

  cudaStream_t st = detail::to_stream(s);
  // Packed segments of a format the split kernels do not read in place: fp32 copies in one
  // stream-ordered allocation, attended to as full-precision rows (not fused: they are read
  // three times, as codes, written and read as fp32).
  StreamScratch deq{nullptr, st};
  size_t deq_bytes = 0;
  for (const DeviceSegment& sg : view.segments())
    if (sg.n_rows > 0 && sg.packed && !fused_format(sg))
      deq_bytes += static_cast<size_t>(2 * B * H * dequantized_capacity(sg) * D) * 4;
  if (deq_bytes > 0) VQ_CUDA_CHECK(cudaMallocAsync(&deq.p, deq_bytes, st));
  size_t deq_used = 0;

  const DeviceSegment* pk_first = nullptr;
  int64_t total_rows = 0;
  for (const DeviceSegment& sg : view.segments()) {
    if (sg.n_rows == 0) continue;
    if (sg.packed && !fused_format(sg)) {
      VQ_CHECK(dp.n_segments < kDecodeMaxSegments,
               "[decode_attention] expected at most " + std::to_string(kDecodeMaxSegments) +
                   " non-empty segments but got more (merge them on upload)");
      VQ_CHECK(sg.k_data && sg.v_data && sg.k_fmt.head_dim == D && sg.v_fmt.head_dim == D,
               "[decode_attention] expected packed records of head_dim " + std::to_string(D));
      const int64_t cap = dequantized_capacity(sg);
      float* k = reinterpret_cast<float*>(static_cast<uint8_t*>(deq.p) + deq_used);
      float* v = k + B * H * cap * D;
      deq_used += static_cast<size_t>(2 * B * H * cap * D) * 4;
      dequantize_segment(sg, B * H, H, cap, k, v, st);
      DecodeSegmentParams& d = dp.seg[dp.n_segments++];
      d.n_rows = sg.n_rows;
      d.capacity = cap;
      d.first_pos = sg.first_pos;
      d.positions = sg.positions;
      d.packed = 0;
      d.dtype = static_cast<int>(DType::kF32);
      d.k = reinterpret_cast<const uint8_t*>(k);
      d.v = reinterpret_cast<const uint8_t*>(v);
      d.k_row_bytes = d.v_row_bytes = static_cast<int32_t>(D * 4);
      d.tile_rows = tile_rows_for(d.k_row_bytes, d.v_row_bytes);
      total_rows += sg.n_rows;
      continue;
    }
    VQ_CHECK(dp.n_segments < kDecodeMaxSegments,
             "[decode_attention] expected at most " + std::to_string(kDecodeMaxSegments) +
                 " non-empty segments but got more (merge them on upload)");
    DecodeSegmentParams& d = dp.seg[dp.n_segments++];
    d.n_rows = sg.n_rows;
    d.capacity = sg.capacity > 0 ? sg.capacity : sg.n_rows;
    VQ_CHECK(d.capacity >= d.n_rows, "[decode_attention] expected capacity >= n_rows but got " +
                                         std::to_string(d.capacity) + " < " +
                                         std::to_string(d.n_rows));
    d.first_pos = sg.first_pos;
    d.positions = sg.positions;
    if (sg.packed) {
      if (!pk_first) {
        pk_first = &sg;
        dp.k_bits = sg.k_fmt.spec.bits();
        dp.v_bits = sg.v_fmt.spec.bits();
        VQ_CHECK(sg.k_fmt.group_size == sg.v_fmt.group_size && sg.k_fmt.group_size % 8 == 0,
                 "[decode_attention] expected one key/value group_size, a multiple of 8, but "
                 "got " +
                     std::to_string(sg.k_fmt.group_size) + " / " +
                     std::to_string(sg.v_fmt.group_size));
        VQ_CHECK(sg.k_fmt.head_dim == D && sg.v_fmt.head_dim == D,
                 "[decode_attention] expected packed rows of head_dim " + std::to_string(D));
        DecodePackedParams& pk = dp.pk;
        pk.group_size = sg.k_fmt.group_size;
        pk.k_code_bytes = sg.k_fmt.code_bytes;
        pk.v_code_bytes = sg.v_fmt.code_bytes;
        pk.k_meta = static_cast<int32_t>(sg.k_fmt.meta);
        pk.v_meta = static_cast<int32_t>(sg.v_fmt.meta);
        pk.k_perm = sg.k_perm;
        pk.v_perm = sg.v_perm;
        pk.k_signs = sg.k_signs;
        pk.v_signs = sg.v_signs;
        for (int kv = 0; kv < 2; ++kv) {
          const int32_t blk = kv == 0 ? sg.k_rot_block : sg.v_rot_block;
          if ((kv == 0 ? sg.k_signs : sg.v_signs) == nullptr) continue;
          VQ_CHECK(blk >= 1 && blk <= D && D % blk == 0 && (blk & (blk - 1)) == 0,
                   "[decode_attention] expected a power-of-two rotation block dividing " +
                       std::to_string(D) + " but got " + std::to_string(blk));
          (kv == 0 ? pk.k_rot_block : pk.v_rot_block) = blk;
          (kv == 0 ? pk.k_rot_norm : pk.v_rot_norm) =
              static_cast<float>(1.0 / std::sqrt(static_cast<double>(blk)));
        }
      } else {
        VQ_CHECK(same_fmt(sg.k_fmt, pk_first->k_fmt) && same_fmt(sg.v_fmt, pk_first->v_fmt) &&
                     sg.k_perm == pk_first->k_perm && sg.v_perm == pk_first->v_perm &&
                     sg.k_signs == pk_first->k_signs && sg.v_signs == pk_first->v_signs,
                 "[decode_attention] expected every packed segment of a view to share one "
                 "format and one set of transforms");
      }
      VQ_CHECK(sg.k_data && sg.v_data,
               "[decode_attention] expected packed records but got a null pointer");
      d.packed = 1;
      d.k = sg.k_data;
      d.v = sg.v_data;
      d.k_row_bytes = sg.k_fmt.row_stride;
      d.v_row_bytes = sg.v_fmt.row_stride;
    } else {
      VQ_CHECK(sg.keys && sg.values,
               "[decode_attention] expected full-precision rows but got a null pointer");
      const int64_t rb = D * static_cast<int64_t>(dtype_size(sg.dtype));
      VQ_CHECK(reinterpret_cast<uintptr_t>(sg.keys) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(sg.values) % 16 == 0,
               "[decode_attention] expected 16-byte aligned full-precision rows");
      d.packed = 0;
      d.dtype = static_cast<int>(sg.dtype);
      d.k = static_cast<const uint8_t*>(sg.keys);
      d.v = static_cast<const uint8_t*>(sg.values);
      d.k_row_bytes = static_cast<int32_t>(rb);
      d.v_row_bytes = static_cast<int32_t>(rb);
    }
    d.tile_rows = tile_rows_for(d.k_row_bytes, d.v_row_bytes);
    total_rows += sg.n_rows;
  }
  if (total_rows == 0) {  // nothing to attend to: zeros, like the reference
    VQ_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(B * n_q_heads * D) * 4, st));
    return;
  }

  // ---- the tensor-core kernel takes f16 rows and 2/2- or 4/4-bit codes in groups of a multiple
  // of 32 channels
  bool all_f16 = true, any_packed = false, packed_aligned = true;
  for (int i = 0; i < dp.n_segments; ++i) {
    const DecodeSegmentParams& d = dp.seg[i];
    if (d.packed) {
      any_packed = true;
      packed_aligned = packed_aligned && d.k_row_bytes % 4 == 0 && d.v_row_bytes % 4 == 0 &&
                       reinterpret_cast<uintptr_t>(d.k) % 4 == 0 &&
                       reinterpret_cast<uintptr_t>(d.v) % 4 == 0;
    } else {
      all_f16 = all_f16 && d.dtype == static_cast<int>(DType::kF16);
    }
  }
  const bool mma =
      all_f16 && (!any_packed || ((dp.k_bits == 2 || dp.k_bits == 4) && dp.v_bits == dp.k_bits &&
                                  dp.pk.group_size % 32 == 0 && dp.pk.k_code_bytes % 4 == 0 &&
                                  dp.pk.v_code_bytes % 4 == 0 && packed_aligned));
  int64_t target_blocks = 16 * static_cast<int64_t>(sm_count());
  if (mma) {
    // stage rows: a multiple of 64 for the packed rows (or the f16 rows of an f16-only view),
    // a multiple of 16 for the f16 sinks / tail of a packed view, within the same stage bytes
    const bool f16_meta = dp.pk.k_meta == 0 && dp.pk.v_meta == 0;
    dp.use_mma = !any_packed ? 1 : (dp.k_bits == 2 ? (f16_meta ? 3 : 2) : (f16_meta ? 5 : 4));
    if (any_packed && f16_meta && dp.pk.group_size == 32) {
      // records of D bits / 8 code bytes + D / 8 bytes of f16 metadata: the instance with every
      // record offset a compile-time constant (fewer instructions per row)
      const int64_t cb = D * dp.k_bits / 8;
      bool fixed = dp.pk.k_code_bytes == cb && dp.pk.v_code_bytes == cb;
      for (int i = 0; i < dp.n_segments; ++i) {
        const DecodeSegmentParams& d = dp.seg[i];
        if (d.packed) fixed = fixed && d.k_row_bytes == cb + D / 8 && d.v_row_bytes == cb + D / 8;
      }
      if (fixed) dp.use_mma = dp.k_bits == 2 ? 6 : 7;
    }
    int64_t half = 0;
    for (int i = 0; i < dp.n_segments; ++i) {
      DecodeSegmentParams& d = dp.seg[i];
      const int64_t rb = d.k_row_bytes + d.v_row_bytes;
      if (d.packed || !any_packed) {
        static const int64_t packed_stage = env_knob("VQ_DECODE_PACKED_STAGE_BYTES");
        // packed rows: 128-row tiles, up to twice the packed stage bytes (4-bit codes at D 128:
        // 128 rows of 160 bytes; H200, 8 x 32K: 184 us against 189 with 64-row tiles)
        const int64_t budget =
            !any_packed
                ? kDecodeMmaStageBytes
                : (packed_stage > 0 ? packed_stage
                                    : std::clamp<int64_t>(128 * rb, kDecodeMmaPackedStageBytes,
                                                          2 * kDecodeMmaPackedStageBytes));
        d.tile_rows = static_cast<int32_t>(std::clamp<int64_t>(budget / rb / 64 * 64, 64, 512));
      }
      half = std::max(half,
                      static_cast<int64_t>(d.tile_rows) * std::max(d.k_row_bytes, d.v_row_bytes));
    }
    if (any_packed) {  // f16 segments of a packed view fit the packed stage (>= 16 rows)
      for (int i = 0; i < dp.n_segments; ++i) {
        DecodeSegmentParams& d = dp.seg[i];
        if (d.packed) continue;
        d.tile_rows = static_cast<int32_t>(std::max<int64_t>(16, half / d.k_row_bytes / 16 * 16));
      }
      half = 0;
      for (int i = 0; i < dp.n_segments; ++i) {
        const DecodeSegmentParams& d = dp.seg[i];
        half = std::max(half,
                        static_cast<int64_t>(d.tile_rows) * std::max(d.k_row_bytes, d.v_row_bytes));
      }
    }
    // + 32 bytes of alignment slack for packed byte ranges; the block merge reuses the stages
    const int64_t merge = (2 * 4 * G + 4 * G * D) * 4;
    half = std::max(half + 32, (merge + 5) / 6);
    dp.stage_half_bytes = static_cast<int32_t>((half + 15) / 16 * 16);
    dp.head_dim = static_cast<int32_t>(D);
    const int bps = std::max(1, mma_blocks_per_sm_cached(dp));
    target_blocks = static_cast<int64_t>(bps) * sm_count();  // one wave
  }

  // ---- plan the splits
  static const int64_t target_knob = env_knob("VQ_DECODE_TARGET_BLOCKS");
  if (target_knob > 0) target_blocks = target_knob;
  int64_t per_bh = mma ? std::max<int64_t>(1, target_blocks / (B * H))
                       : std::max<int64_t>(1, (target_blocks + B * H - 1) / (B * H));
  if (mma && !any_packed && target_knob == 0) {
    // short f16 contexts (batch-1 latency): fewer, fatter splits of at least 4 pipeline tiles when
    // that still leaves about a block per SM. H200, B 1, 8 KV heads: 4K rows take 16 splits of 256
    // rows instead of 32 of 128 (17.3 -> 15.9 us); 2K rows keep 32 of 64 (16 of 128: 14.2 ->
    // 14.8 us)
    const int64_t by_tiles = total_rows / (4 * static_cast<int64_t>(dp.seg[0].tile_rows));
    const int64_t floor_bh = std::max<int64_t>(1, sm_count() / (B * H));
    if (by_tiles >= floor_bh) per_bh = std::min(per_bh, by_tiles);
  }
  int64_t rows_per_split = opt.rows_per_split > 0
                               ? opt.rows_per_split
                               : std::max<int64_t>(64, (total_rows + per_bh - 1) / per_bh);
  int64_t n_splits = 0;
  for (int i = 0; i < dp.n_segments; ++i) {
    DecodeSegmentParams& d = dp.seg[i];
    const int64_t tr = d.tile_rows;
    d.rows_per_split =
        opt.rows_per_split > 0 ? rows_per_split : (rows_per_split + tr - 1) / tr * tr;
    d.split_begin = static_cast<int32_t>(n_splits);
    d.n_splits = static_cast<int32_t>((d.n_rows + d.rows_per_split - 1) / d.rows_per_split);
    n_splits += d.n_splits;
  }
  VQ_CHECK(n_splits <= (1 << 20),
           "[decode_attention] expected at most 2^20 splits but got " + std::to_string(n_splits));
  dp.n_splits = static_cast<int32_t>(n_splits);
  const size_t n_part = static_cast<size_t>(B * n_q_heads * n_splits);
  const size_t acc_bytes = (n_part * static_cast<size_t>(D) * 4 + 255) / 256 * 256;
  uint8_t* w = static_cast<uint8_t*>(ws.reserve(acc_bytes + n_part * 2 * 4));
  dp.part_acc = reinterpret_cast<float*>(w);
  dp.part_ml = reinterpret_cast<float*>(w + acc_bytes);
  decode_attention_launch(dp, st);
}

std::vector<float> decode_attention_host(const std::vector<float>& q, int64_t n_q_heads,
                                         const DeviceCacheView& view, const AttentionParams& p,
                                         const DecodeOptions& opt) {
  const size_t n = static_cast<size_t>(view.batch() * n_q_heads * view.head_dim());
  VQ_CHECK(q.size() == n, "[decode_attention_host] expected q of " + std::to_string(n) +
                              " floats but got " + std::to_string(q.size()));
  DeviceBuffer dq = DeviceBuffer::from_vector(q);
  DeviceBuffer dout(n * 4);
  DecodeWorkspace ws;
  decode_attention(dq.as<float>(), n_q_heads, view, p, dout.as<float>(), ws, nullptr, opt);
  synchronize(nullptr);
  return dout.to_vector<float>(n);
}

}  // namespace vq::cuda
