// Host entry points of prefill attention (include/veloxquant/cuda_cache.h): validation of the
// query shape and the view's segments, and the kernel's parameter block (prefill_attention.cuh).
#include <cmath>
#include <string>

#include "cuda/check.h"
#include "cuda/prefill_attention.cuh"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/hadamard.h"

namespace vq::cuda {

namespace {

PrefillTensor packed_tensor(const PackedRowFormat& f, const uint8_t* data, const int32_t* perm,
                            const float* signs, size_t seg_index, const char* which,
                            const int32_t* runs = nullptr, int32_t n_runs = 0) {
  const std::string where = "segment " + std::to_string(seg_index) + " " + which;
  VQ_CHECK(f.spec.ternary() || (f.spec.bits() >= 1 && f.spec.bits() <= 8),
           "[prefill_attention] expected 1.5-bit or integer code bits 1..8 but " + where + " has " +
               std::to_string(f.spec.bits_value()));
  VQ_CHECK(f.group_size >= 1 && data != nullptr,
           "[prefill_attention] expected packed records with group_size >= 1 in " + where);
  PrefillTensor t;
  if (f.axis == QuantAxis::kChannel) {  // keys of skvq_key_axis=channel: metadata per run
    VQ_CHECK(runs == nullptr || n_runs >= 1,
             "[prefill_attention] expected channel-axis runs >= 1 in " + where + " but got " +
                 std::to_string(n_runs));
    t.channel = 1;
    t.meta_slots = f.n_groups;
    t.runs = runs;
    t.n_runs = n_runs;
  }
  t.data = data;
  t.perm = perm;
  t.bits = f.spec.bits();
  t.ternary = f.spec.ternary() ? 1 : 0;
  t.group_size = f.group_size;
  t.code_bytes = f.code_bytes;
  t.row_stride = f.row_stride;
  t.meta = static_cast<int32_t>(f.meta);
  if (signs != nullptr) {
    const int64_t block = hadamard_block(f.head_dim);
    VQ_CHECK(block > 0 && f.head_dim % block == 0,
             "[prefill_attention] expected a power-of-two rotation block dividing head_dim " +
                 std::to_string(f.head_dim) + " in " + where);
    t.signs = signs;
    t.rot_block = static_cast<int32_t>(block);
    t.rot_norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  }
  return t;
}

}  // namespace

void prefill_attention(const float* q, int64_t n_q_heads, int64_t n_queries,
                       const DeviceCacheView& view, const AttentionParams& ap, float* out,
                       Stream s) {
  const int64_t B = view.batch(), H = view.n_kv_heads(), D = view.head_dim();
  VQ_CHECK(D == 64 || D == 128,
           "[prefill_attention] expected head_dim 64 or 128 but got " + std::to_string(D));
  VQ_CHECK(H >= 1 && B >= 1 && B <= 65535 && H <= 65535,
           "[prefill_attention] expected a view with 1 <= B, H_kv <= 65535 but got B=" +
               std::to_string(B) + ", H_kv=" + std::to_string(H));
  VQ_CHECK(n_q_heads >= H && n_q_heads % H == 0,
           "[prefill_attention] expected H_q a multiple of H_kv = " + std::to_string(H) +
               " but got H_q = " + std::to_string(n_q_heads));
  VQ_CHECK(n_queries >= 0,
           "[prefill_attention] expected N >= 0 but got " + std::to_string(n_queries));
  VQ_CHECK(ap.window >= 0,
           "[prefill_attention] expected window >= 0 but got " + std::to_string(ap.window));
  VQ_CHECK(n_queries == 0 || (q != nullptr && out != nullptr),
           "[prefill_attention] expected device q and out but got a null pointer");
  const auto& segs = view.segments();
  VQ_CHECK(static_cast<int64_t>(segs.size()) <= kPrefillMaxSegs,
           "[prefill_attention] expected at most " + std::to_string(kPrefillMaxSegs) +
               " segments but got " + std::to_string(segs.size()));
  PrefillParams p;
  p.q = q;
  p.out = out;
  p.batch = static_cast<int32_t>(B);
  p.kv_heads = static_cast<int32_t>(H);
  p.n_rep = static_cast<int32_t>(n_q_heads / H);
  p.head_dim = static_cast<int32_t>(D);
  p.n_queries = n_queries;
  p.q_pos0 = ap.q_pos0;
  p.window = ap.window;
  p.scale =
      ap.scale != 0.0f ? ap.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  for (size_t i = 0; i < segs.size(); ++i) {
    const DeviceSegment& d = segs[i];
    if (d.n_rows == 0) continue;
    PrefillSeg& g = p.segs[p.n_segs++];
    g.n_rows = d.n_rows;
    g.capacity = d.capacity > 0 ? d.capacity : d.n_rows;
    g.first_pos = d.first_pos;
    g.positions = d.positions;
    g.packed = d.packed ? 1 : 0;
    if (d.packed) {
      VQ_CHECK(d.k_fmt.head_dim == D && d.v_fmt.head_dim == D,
               "[prefill_attention] expected packed formats of head_dim " + std::to_string(D) +
                   " in segment " + std::to_string(i));
      VQ_CHECK(d.v_fmt.axis == QuantAxis::kToken,
               "[prefill_attention] expected token-axis value records in segment " +
                   std::to_string(i) + " but got channel-axis ones");
      g.pk = packed_tensor(d.k_fmt, d.k_data, d.k_perm, d.k_signs, i, "keys", d.k_runs, d.k_n_runs);
      g.pv = packed_tensor(d.v_fmt, d.v_data, d.v_perm, d.v_signs, i, "values");
    } else {
      VQ_CHECK(
          static_cast<uint8_t>(d.dtype) <= static_cast<uint8_t>(DType::kBF16) && d.keys && d.values,
          "[prefill_attention] expected full-precision rows f32/f16/bf16 in segment " +
              std::to_string(i));
      g.dtype = static_cast<int32_t>(d.dtype);
      g.keys = d.keys;
      g.values = d.values;
    }
  }
  prefill_attention_launch(p, detail::to_stream(s));
}

std::vector<float> prefill_attention_host(const std::vector<float>& q, int64_t n_q_heads,
                                          int64_t n_queries, const DeviceCacheView& view,
                                          const AttentionParams& p) {
  const size_t n = static_cast<size_t>(view.batch() * n_q_heads * n_queries * view.head_dim());
  VQ_CHECK(q.size() == n, "[prefill_attention_host] expected " + std::to_string(n) +
                              " query values but got " + std::to_string(q.size()));
  DeviceBuffer dq = DeviceBuffer::from_vector(q);
  DeviceBuffer dout(n * 4);
  prefill_attention(dq.as<const float>(), n_q_heads, n_queries, view, p, dout.as<float>());
  return dout.to_vector<float>(n);
}

}  // namespace vq::cuda
