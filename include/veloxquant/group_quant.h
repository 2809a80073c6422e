// Clipped asymmetric group quantization of rows (docs/design.md §C4), its scalar reference, the
// optimised CPU version, packing into row records (packed.h) and the SKVQ byte formulas.
//
// x: n rows of d fp32 channels, row-major [n, d]. Groups of g channels along each row; a ragged
// last group is padded by repeating the row's last channel (the pad counts in the error that
// picks alpha, and is dropped from the output). Per (row, group): mid = (max+min)/2,
// rng = max-min, levels = 2^bits-1 (2 for 1.5 bits); for each alpha of the grid (or the fixed
// alpha): lo = mid - alpha*rng/2, scale = max(alpha*rng/levels, 1e-8), both rounded to the
// metadata type (scale never below its smallest positive value), code = clamp(rint((x-lo)/scale),
// 0, levels) (ties to even), error = mean of (code*scale+lo - x)^2 summed in element order in
// fp32; the least error wins, the earlier alpha on ties. Outputs: codes [n, d] uint8 and lo, scale
// [n, G] fp32 holding the values as stored.
#pragma once

#include <array>
#include <cstdint>

#include "veloxquant/cache_config.h"
#include "veloxquant/packed.h"

namespace vq {

inline constexpr std::array<float, 5> kClipAlphaGrid{1.0f, 0.97f, 0.94f, 0.90f, 0.85f};
// The grid's continuation below 0.85 (GroupQuantParams::clip_floor): steps of 0.05 down to 0.25.
// At 2 bits the seed's grid stops short of the squared-error optimum: for a group of 32 normal
// values the range is about 4.1 sigma and the best 4-level step about 1.0 sigma, alpha ~0.73.
inline constexpr std::array<float, 12> kClipAlphaTail{0.80f, 0.75f, 0.70f, 0.65f, 0.60f, 0.55f,
                                                      0.50f, 0.45f, 0.40f, 0.35f, 0.30f, 0.25f};
inline constexpr double kClipFloorMin = 0.25, kClipFloorSeed = 0.85;
inline constexpr float kScaleFloor = 1e-8f;
inline constexpr int kMaxClipAlphas =
    static_cast<int>(kClipAlphaGrid.size() + kClipAlphaTail.size());

struct GroupQuantParams {
  double bits = 2;  // 1..8, or 1.5 (three levels)
  int64_t group_size = 32;
  bool clip_search = true;  // search kClipAlphaGrid
  float clip_alpha = 1.0f;  // the single alpha when clip_search is false, (0, 1]
  MetaType meta = MetaType::kF16;
  // With clip_search: also the alphas of kClipAlphaTail >= clip_floor, tried after the seed's
  // five in that order (ties keep the earlier alpha). [0.25, 0.85]; 0.85 = the seed's grid.
  double clip_floor = kClipFloorSeed;
};

// Throws vq::Error naming the bad parameter.
void check_params(const GroupQuantParams& p, int64_t d);

// The alphas a (row, group) tries, in order: with clip_search the seed's grid, then the tail's
// alphas >= clip_floor; without it clip_alpha alone. Every backend's quantizer takes this list.
struct ClipAlphas {
  std::array<float, kMaxClipAlphas> a{};
  int n = 0;
};
ClipAlphas clip_alphas(const GroupQuantParams& p);

// Scalar reference (the oracle). codes: [n, d]; lo, scale: [n, ceil(d/g)]; alpha_index (may be
// nullptr): [n, ceil(d/g)], the grid entry chosen (0 when search is off).
void group_quantize_reference(const float* x, int64_t n, int64_t d, const GroupQuantParams& p,
                              uint8_t* codes, float* lo, float* scale,
                              uint8_t* alpha_index = nullptr);

// Optimised version (rows in lane-parallel tiles, OpenMP over tiles): bit-identical output.
void group_quantize(const float* x, int64_t n, int64_t d, const GroupQuantParams& p, uint8_t* codes,
                    float* lo, float* scale);

// Scalar reference dequantization: out[r, c] = codes[r, c] * scale[r, c/g] + lo[r, c/g].
void group_dequantize_reference(const uint8_t* codes, const float* lo, const float* scale,
                                int64_t n, int64_t d, int64_t group_size, float* out);

// Quantizes n rows (already in stored channel order) straight into row records of format f
// (records[r] at dst + r*dst_stride). Uses the optimised quantizer; threads over rows when
// `parallel`.
void quantize_to_records(const float* x, int64_t n, const PackedRowFormat& f,
                         const GroupQuantParams& p, uint8_t* dst, int64_t dst_stride,
                         bool parallel = true);

// Quantizes one chunk of n rows (stored channel order, x [n, d]) into channel-axis records of
// format f (packed.h): channel c over the n rows is one group of the quantizer above (the same
// clip search, rounding and metadata rounding), its codes go to each row's record and its
// (lo, scale) to the chunk's metadata slots. Needs n * f.n_groups >= 2d (the chunk holds its
// metadata). Bit-identical to group_quantize_reference on the transposed chunk. With key_u (the
// factor of veloxquant/key_rounding.h, d x d) the codes are the error-feedback ones of
// key_feedback_codes on the same metadata.
void quantize_chunk_to_records(const float* x, int64_t n, const PackedRowFormat& f,
                               const GroupQuantParams& p, uint8_t* dst, int64_t dst_stride,
                               const double* key_u = nullptr);

// SKVQ byte formula for n rows of d channels (docs/design.md §C4): codes ceil(n*d*bits/8) (ternary:
// n*ceil(d/5), five codes per byte within a row) + metadata n*ceil(d/g)*2*meta_size.
struct SkvqBytes {
  int64_t code_bytes = 0;
  int64_t meta_bytes = 0;
  int64_t total() const { return code_bytes + meta_bytes; }
};
SkvqBytes skvq_compressed_bytes(int64_t n, int64_t d, double bits, int64_t group_size,
                                MetaType meta = MetaType::kF16);
// The same for one chunk of n channel-axis rows of format f: codes as above, metadata the
// n * f.n_groups elements its records hold (2D used, the rest padding, counted: they are stored).
SkvqBytes skvq_channel_bytes(int64_t n, const PackedRowFormat& f);
inline int64_t skvq_fp16_bytes(int64_t n, int64_t d) {
  return n * d * 2;
}

}  // namespace vq
