// Host cache views for the op harness: a CacheView of B sequences, H KV heads and head_dim D built
// from a list of segments, each full precision (f32/f16/bf16 rows, contiguous or channel-strided
// at a misaligned offset) or packed (SKVQ records of packed.h: key/value bits, group size,
// metadata type, channel permutation, Hadamard rotation), with implicit positions or explicit
// gapped per-(b, h) positions (as eviction leaves them). The HostView owns every buffer the view
// points to, so the view stays valid as long as the HostView lives.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/packed.h"
#include "veloxquant/tensor.h"

namespace vq::harness {

struct PackedSpec {
  double kbits = 2, vbits = 2;  // 1..8 or 1.5
  int64_t group = 32;
  MetaType meta = MetaType::kF16;
  bool perm = false;  // a random channel permutation per head (keys and values)
  bool rot = false;   // Hadamard rotation of keys and values
  std::string str() const;
};

struct SegSpec {
  int64_t n = 0;  // rows per (b, h); 0 = an empty segment
  bool packed = false;
  DType dtype = DType::kF16;  // full-precision rows
  bool strided = false;       // full precision: channel stride 2, data one element off
  bool explicit_pos = false;  // gapped positions differing per (b, h)
  PackedSpec pk;
  std::string str() const;
};

struct HostView {
  CacheView view;
  int64_t span = 0;  // one past the largest position of any row
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::vector<int32_t>> ints;
  std::vector<std::vector<float>> floats;
  std::vector<std::unique_ptr<PackedSegment>> packed;
};

std::unique_ptr<HostView> make_view(int64_t batch, int64_t n_kv_heads, int64_t head_dim,
                                    const std::vector<SegSpec>& segs, uint64_t seed);

// "fp16x17+K2V2g32x100+..." description of a segment list.
std::string segs_str(const std::vector<SegSpec>& segs);

}  // namespace vq::harness
