// Decode attention runs (veloxquant/cuda.h): DecodeContext::current (the device's properties and
// its tensor-core occupancy query), decode_attention_run (a DecodePlan of decode_plan.cpp over
// one layer's view: the DecodeParams of decode_attention.cuh filled from the plan and the view's
// pointers, then the split + combine kernels queued) and the one-call decode_attention (plan on
// the workspace's context, then run). A run does no host allocation once the workspace is large
// enough; packed segments the plan marks `dequantize` are dequantized into stream-ordered fp32
// scratch first (unfused fallback); segments with channel-axis keys are read in place (packed 2).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/decode_attention.cuh"
#include "cuda/decode_plan.h"
#include "cuda/device_cache_dequant.cuh"
#include "cuda/stream_scratch.h"
#include "veloxquant/cuda.h"

namespace vq::cuda {

namespace {

// Resident blocks per SM of one tensor-core instance on the current device.
int query_mma_blocks_per_sm(DecodeKernel k, int32_t head_dim, int32_t group,
                            int32_t stage_half_bytes) {
  DecodeParams dp;
  dp.kernel = k;
  dp.head_dim = head_dim;
  dp.group = group;
  dp.stage_half_bytes = stage_half_bytes;
  return decode_mma_blocks_per_sm(dp);
}

int current_device() {
  int dev = 0;
  VQ_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
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
    if (d.signs) {  // block checked by match_plan
      const int32_t blk = kv ? sg.v_rot_block : sg.k_rot_block;
      d.rot_block = blk;
      d.rot_norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(blk)));
    }
    dequant_rows_launch(d, st);
  }
}

}  // namespace

DecodeContext DecodeContext::current() {
  DecodeContext c;
  c.device_ = current_device();
  c.info_ = device_info();
  c.query_ = &query_mma_blocks_per_sm;
  return c;
}

const DecodeContext& DecodeWorkspace::context() {
  const int dev = current_device();
  if (!ctx_) ctx_ = std::make_unique<DecodeContext>(DecodeContext::current());
  VQ_CHECK(ctx_->device() == dev,
           "[DecodeWorkspace] expected device " + std::to_string(ctx_->device()) +
               " (the workspace's) but got current device " + std::to_string(dev));
  return *ctx_;
}

namespace {

// Checks a run of plan on the current device over view (match_plan) and returns its segments.
PlannedSegments check_run(const DecodePlan& plan, const float* q, const DeviceCacheView& view,
                          const float* out) {
  VQ_CHECK(q && out, "[decode_attention_run] expected device q and out but got a null pointer");
  VQ_CHECK(plan.device >= 0,
           "[decode_attention_run] expected a plan made on a device context but got a fake one");
  const int dev = current_device();
  VQ_CHECK(plan.device == dev, "[decode_attention_run] expected the plan's device " +
                                   std::to_string(plan.device) + " but got current device " +
                                   std::to_string(dev));
  return match_plan(plan, view.batch(), view.n_kv_heads(), view.head_dim(), view.segments());
}

// The DecodeParams of one run of plan over its matched segments (partials not set). Packed
// segments the plan marks `dequantize` are dequantized into deq (plan.scratch_bytes) on st; those
// with channel-axis keys are described in *ch as well (nullptr: the plan has none).
DecodeParams fill_params(const DecodePlan& plan, const PlannedSegments& segs, const float* q,
                         float* out, int64_t B, int64_t H, int64_t D, uint8_t* deq, cudaStream_t st,
                         DecodeChannelParams* ch = nullptr) {
  DecodeParams dp;
  dp.q = q;
  dp.out = out;
  dp.batch = static_cast<int32_t>(B);
  dp.n_kv_heads = static_cast<int32_t>(H * plan.kv_rep);  // the blocks' heads (kv_rep each)
  dp.group = static_cast<int32_t>(plan.n_q_heads / (H * plan.kv_rep));
  dp.kv_rep = plan.kv_rep;
  dp.head_dim = static_cast<int32_t>(D);
  const AttentionParams& p = plan.params;
  const double scale =
      p.scale != 0.0f ? static_cast<double>(p.scale) : 1.0 / std::sqrt(static_cast<double>(D));
  dp.scale_log2 = static_cast<float>(scale * 1.4426950408889634074);
  dp.q_pos = p.q_pos0;
  dp.window = p.window;
  dp.k_bits = plan.k_bits;
  dp.v_bits = plan.v_bits;
  dp.kernel = plan.kernel;
  dp.stage_half_bytes = plan.stage_half_bytes;
  dp.n_splits = plan.n_splits;

  // Packed segments of a format the split kernels do not read in place: fp32 copies in one
  // stream-ordered allocation, attended to as full-precision rows (not fused: they are read
  // three times, as codes, written and read as fp32).
  size_t deq_used = 0;
  bool pk_set = false;
  dp.n_segments = static_cast<int32_t>(plan.segments.size());
  for (size_t i = 0; i < plan.segments.size(); ++i) {
    const DecodeSegmentPlan& sp = plan.segments[i];
    const DeviceSegment& sg = *segs[i];
    DecodeSegmentParams& d = dp.seg[i];
    d.n_rows = sg.n_rows;
    d.first_pos = sg.first_pos;
    d.positions = sg.positions;
    d.k_row_bytes = sp.k_row_bytes;
    d.v_row_bytes = sp.v_row_bytes;
    d.tile_rows = sp.tile_rows;
    d.rows_per_split = sp.rows_per_split;
    d.split_begin = sp.split_begin;
    d.n_splits = sp.n_splits;
    if (sp.dequantize) {
      const int64_t cap = dequantized_capacity(sg);
      float* k = reinterpret_cast<float*>(deq + deq_used);
      float* v = k + B * H * cap * D;
      deq_used += static_cast<size_t>(2 * B * H * cap * D) * 4;
      dequantize_segment(sg, B * H, H, cap, k, v, st);
      d.capacity = cap;
      d.packed = 0;
      d.dtype = static_cast<int>(DType::kF32);
      d.k = reinterpret_cast<const uint8_t*>(k);
      d.v = reinterpret_cast<const uint8_t*>(v);
      continue;
    }
    d.capacity = sg.capacity > 0 ? sg.capacity : sg.n_rows;
    if (sg.packed) {
      if (!pk_set) {  // the format and transforms every fused packed segment shares
        pk_set = true;
        DecodePackedParams& pk = dp.pk;
        // channel-axis keys: group_size is the values' (the keys' is one per row)
        pk.group_size = sp.channel ? sg.v_fmt.group_size : sg.k_fmt.group_size;
        if (sp.channel && ch) {
          ch->k_bits_x2 = sg.k_fmt.spec.bits_x2;
          ch->v_bits_x2 = sg.v_fmt.spec.bits_x2;
          ch->k_meta_slots = sg.k_fmt.n_groups;
        }
        pk.k_code_bytes = sg.k_fmt.code_bytes;
        pk.v_code_bytes = sg.v_fmt.code_bytes;
        pk.k_meta = static_cast<int32_t>(sg.k_fmt.meta);
        pk.v_meta = static_cast<int32_t>(sg.v_fmt.meta);
        pk.k_bits_x2 = sg.k_fmt.spec.bits_x2;
        pk.v_bits_x2 = sg.v_fmt.spec.bits_x2;
        pk.k_perm = sg.k_perm;
        pk.v_perm = sg.v_perm;
        pk.k_signs = sg.k_signs;
        pk.v_signs = sg.v_signs;
        if (sg.k_signs) {
          pk.k_rot_block = sg.k_rot_block;
          pk.k_rot_norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(sg.k_rot_block)));
        }
        if (sg.v_signs) {
          pk.v_rot_block = sg.v_rot_block;
          pk.v_rot_norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(sg.v_rot_block)));
        }
      }
      d.packed = sp.channel ? 2 : 1;
      d.k = sg.k_data;
      d.v = sg.v_data;
      if (sp.channel) {
        VQ_CHECK(ch != nullptr, "[decode_attention] internal: channel-axis keys in a batched run");
        ch->k_runs[i] = sg.k_runs;
        ch->k_n_runs[i] = sg.k_n_runs;
      }
    } else {
      d.packed = 0;
      d.dtype = static_cast<int>(sg.dtype);
      d.k = static_cast<const uint8_t*>(sg.keys);
      d.v = static_cast<const uint8_t*>(sg.values);
    }
  }
  return dp;
}

// Points dp's partials at w (plan.workspace_bytes: acc, then m/l 256-byte aligned).
void set_partials(DecodeParams& dp, const DecodePlan& plan, uint8_t* w) {
  const size_t n_part = static_cast<size_t>(plan.batch * plan.n_q_heads * plan.n_splits);
  const size_t acc_bytes = (n_part * static_cast<size_t>(plan.head_dim) * 4 + 255) / 256 * 256;
  dp.part_acc = reinterpret_cast<float*>(w);
  dp.part_ml = reinterpret_cast<float*>(w + acc_bytes);
}

size_t round256(size_t n) {
  return (n + 255) / 256 * 256;
}

// Whether two plans share a kernel instance and its launch shape (one batched launch).
bool same_instance(const DecodePlan& a, const DecodePlan& b) {
  // kv_rep: the kernel's group (heads per block) and the grid's y dimension; plans of one shape
  // differ in it since the 16-head block depends on the rows (decode_plan.cpp)
  return a.kernel == b.kernel && a.head_dim == b.head_dim && a.n_q_heads == b.n_q_heads &&
         a.n_kv_heads == b.n_kv_heads && a.kv_rep == b.kv_rep && a.k_bits == b.k_bits &&
         a.v_bits == b.v_bits && a.stage_half_bytes == b.stage_half_bytes && a.device == b.device;
}

}  // namespace

void decode_attention_run(const DecodePlan& plan, const float* q, const DeviceCacheView& view,
                          float* out, DecodeWorkspace& ws, Stream s) {
  const PlannedSegments segs = check_run(plan, q, view, out);
  const int64_t B = view.batch(), H = view.n_kv_heads(), D = view.head_dim();
  cudaStream_t st = detail::to_stream(s);
  if (plan.total_rows == 0) {  // nothing to attend to: zeros, like the reference
    VQ_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(B * plan.n_q_heads * D) * 4, st));
    return;
  }
  const detail::StreamScratch deq(static_cast<size_t>(plan.scratch_bytes), st);
  DecodeChannelParams ch;
  DecodeParams dp = fill_params(plan, segs, q, out, B, H, D, deq.as<uint8_t>(), st, &ch);
  set_partials(dp, plan, static_cast<uint8_t*>(ws.reserve(plan.workspace_bytes)));
  if (decode_plan_has_channel(plan)) {
    decode_attention_launch_channel(dp, ch, st);
  } else {
    decode_attention_launch(dp, st);
  }
}

void decode_attention_run_batch(const std::vector<DecodeBatchItem>& items, DecodeWorkspace& ws,
                                Stream s) {
  // every item's plan checked against its view before anything is queued
  std::vector<PlannedSegments> segs(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const DecodeBatchItem& it = items[i];
    VQ_CHECK(it.plan && it.view,
             "[decode_attention_run_batch] expected a plan and a view for item " +
                 std::to_string(i) + " but got a null pointer");
    segs[i] = check_run(*it.plan, it.q, *it.view, it.out);
  }
  // groups of items that share a launch; the rest run alone
  std::vector<std::vector<size_t>> groups;
  std::vector<size_t> alone;
  for (size_t i = 0; i < items.size(); ++i) {
    const DecodePlan& pl = *items[i].plan;
    if (!decode_plan_joins_batch(pl)) {
      alone.push_back(i);
      continue;
    }
    auto g = std::find_if(groups.begin(), groups.end(), [&](const std::vector<size_t>& gr) {
      return same_instance(*items[gr[0]].plan, pl);
    });
    if (g == groups.end()) {
      groups.push_back({i});
    } else {
      g->push_back(i);
    }
  }
  // at most kDecodeBatchInline sequences per launch (the tensor-core kernel takes their
  // parameters by value): a larger group runs as decode_batch_pieces(n) pieces of balanced
  // sizes (the engine sizes each sequence's splits for a piece of that size)
  const size_t n_groups = groups.size();
  for (size_t k = 0; k < n_groups; ++k) {
    const int64_t n = static_cast<int64_t>(groups[k].size());
    const int64_t pieces = decode_batch_pieces(n);
    if (pieces == 1) continue;
    std::vector<size_t> all = std::move(groups[k]);
    groups[k].clear();
    for (int64_t i = 0; i < pieces; ++i) {
      std::vector<size_t> piece(all.begin() + i * n / pieces, all.begin() + (i + 1) * n / pieces);
      if (i == 0) {
        groups[k] = std::move(piece);
      } else {
        groups.push_back(std::move(piece));
      }
    }
  }
  // a group of one needs no parameter array: it runs alone too
  std::erase_if(groups, [&](const std::vector<size_t>& g) {
    if (g.size() == 1) alone.push_back(g[0]);
    return g.size() == 1;
  });
  for (size_t i : alone) {
    const DecodeBatchItem& it = items[i];
    decode_attention_run(*it.plan, it.q, *it.view, it.out, ws, s);
  }
  if (groups.empty()) return;
  cudaStream_t st = detail::to_stream(s);
  // one workspace: every sequence's partials, then every group's parameter array
  std::vector<size_t> part_off(items.size()), desc_off(groups.size());
  size_t bytes = 0;
  for (const auto& g : groups)
    for (size_t i : g) {
      part_off[i] = bytes;
      bytes += round256(items[i].plan->workspace_bytes);
    }
  for (size_t k = 0; k < groups.size(); ++k) {
    desc_off[k] = bytes;
    bytes += round256(groups[k].size() * sizeof(DecodeParams));
  }
  uint8_t* w = static_cast<uint8_t*>(ws.reserve(bytes));
  std::vector<DecodeParams> seqs;
  auto inline_seqs = std::make_unique<DecodeBatchArg>();  // 28 KB: not on the stack
  for (size_t k = 0; k < groups.size(); ++k) {
    seqs.clear();
    DecodeParams all;
    for (size_t i : groups[k]) {
      const DecodeBatchItem& it = items[i];
      const DeviceCacheView& v = *it.view;
      DecodeParams dp = fill_params(*it.plan, segs[i], it.q, it.out, 1, v.n_kv_heads(),
                                    v.head_dim(), nullptr, st);
      set_partials(dp, *it.plan, w + part_off[i]);
      if (seqs.empty()) all = dp;
      all.n_splits = std::max(all.n_splits, dp.n_splits);
      seqs.push_back(dp);
    }
    // the shared block: the first sequence's instance fields, the largest split count; the
    // kernels read everything else from seqs (pageable copy: staged by the driver at the call)
    DecodeParams* d_seqs = reinterpret_cast<DecodeParams*>(w + desc_off[k]);
    VQ_CUDA_CHECK(cudaMemcpyAsync(d_seqs, seqs.data(), seqs.size() * sizeof(DecodeParams),
                                  cudaMemcpyHostToDevice, st));
    all.batch = static_cast<int32_t>(seqs.size());
    all.seqs = d_seqs;
    std::copy(seqs.begin(), seqs.end(), inline_seqs->seq);
    decode_attention_launch(all, st, inline_seqs.get());
  }
}

void decode_attention(const float* q, int64_t n_q_heads, const DeviceCacheView& view,
                      const AttentionParams& p, float* out, DecodeWorkspace& ws, Stream s,
                      const DecodePlanOptions& opt) {
  VQ_CHECK(q && out, "[decode_attention] expected device q and out but got a null pointer");
  const DecodePlan plan = decode_attention_plan(ws.context(), n_q_heads, view, p, opt);
  decode_attention_run(plan, q, view, out, ws, s);
}

std::vector<float> decode_attention_host(const std::vector<float>& q, int64_t n_q_heads,
                                         const DeviceCacheView& view, const AttentionParams& p,
                                         const DecodePlanOptions& opt) {
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
