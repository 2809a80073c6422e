// The op harness's case tables, shared by the CPU harness (tests/test_backend_ops.cpp) and its
// CUDA part (tests/cuda/test_backend_ops_cuda.cpp) so both backends see the same shapes:
// sequence lengths 1, 2, 3, 17, 31, 127, 129, 1000; lengths not a multiple of the group;
// GQA 1/3/4/8 and 6/12/16/32; head_dim 64/128; f32/f16/bf16 rows, channel-strided rows at a
// misaligned offset; packed formats (key/value bits 2/2, 4/4, 8/8, 4/2, 1.5/1.5, groups 32/128
// (ragged at D = 64) and 24, fp16/fp8/fp32 metadata, with and without permutation and Hadamard
// rotation), mixed views with explicit gapped positions, empty segments, windows, and fully masked
// queries. small = the reduced table (sanitizer builds, see harness.h small_sweep()).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ops_harness/views.h"
#include "veloxquant/packed.h"

namespace vq::harness {

inline const std::vector<int64_t>& seq_lens(bool small) {
  static const std::vector<int64_t> full{1, 2, 3, 17, 31, 127, 129, 1000};
  static const std::vector<int64_t> reduced{1, 2, 3, 17, 129};
  return small ? reduced : full;
}

struct AttnCase {
  int64_t batch = 1, n_kv_heads = 2, n_rep = 1, head_dim = 64;
  int64_t n_q = 1;      // queries per head; they sit at the last n_q positions of the view
  int64_t q_shift = 0;  // queries placed q_shift positions later (0 = causal inside the view)
  int64_t window = 0;   // sliding window (0 = none)
  std::vector<SegSpec> segs;
  std::string vars() const;
  bool packed() const;
  bool all_fp_dtype(DType t) const;  // every non-empty full-precision segment has dtype t
};

// Full-precision views, packed and mixed views, windows, edge cases, and decode over long
// views (split into parts by the fused CPU attention).
std::vector<AttnCase> attention_cases(bool small);

// Decode over packed rows (the packed decode kernels, src/ops/packed_decode.h): every pair of key
// and value bits of {1, 1.5, 2, 4, 8}, head_dim 64/80/96/128, groups 16/32/64/24 (ragged last
// groups at 80, 96 and with 24), fp16/fp8/fp32 metadata, permutation and rotation, GQA 1/4/8,
// one or two queries per head, sinks + packed + tail views with explicit positions, long
// contexts (4096 rows; 16384 in the full sweep), and views of many consecutive packed segments
// (the CPU SKVQ store's one segment per chunk), alike or changing format or transforms.
std::vector<AttnCase> packed_decode_cases(bool small);

// The packed formats of the sweep.
std::vector<PackedSpec> packed_formats();

struct QuantCase {
  int64_t n = 1, d = 64;
  double bits = 2;
  int64_t group = 32;
  MetaType meta = MetaType::kF16;
  bool clip = true;
  double clip_floor = 0.85;        // GroupQuantParams::clip_floor (0.85: the seed's grid)
  DType in_dtype = DType::kF32;    // inputs rounded to this dtype first
  bool perm = false, rot = false;  // the CUDA flush's transforms (CPU: transform_row)
  std::string vars() const;
};
std::vector<QuantCase> quant_cases(bool small);

}  // namespace vq::harness
