// Group quantizer (reference and optimised), row records and the packed-format helpers declared
// in packed.h (whose inline codecs, quant_code and the metadata rounding included, are the ones
// the CUDA flush kernel uses too). See group_quant.h for the algorithm.
//
// Bit-exactness: this file is compiled without floating-point contraction (the pragma below), so
// code*scale + lo rounds twice exactly as the formulas say, in the reference, the optimised
// version and dequantization alike. The optimised quantizer keeps the reference's per-group
// summation order by putting 16 rows side by side in SIMD lanes (a transposed tile) instead of
// vectorising along a row.
#pragma GCC optimize("fp-contract=off")

#include "veloxquant/group_quant.h"

#include <algorithm>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <cmath>
#include <string>
#include <vector>

#include "ops/thread_pool.h"
#include "veloxquant/error.h"
#include "veloxquant/hadamard.h"
#include "veloxquant/key_rounding.h"

namespace vq {

// ---------------------------------------------------------------------------------------------
// Format helpers (packed.h)

CodeSpec code_spec_from_bits(double bits) {
  CodeSpec s;
  if (bits == 1.5) {
    s.bits_x2 = 3;
    return s;
  }
  VQ_CHECK(bits >= 1 && bits <= 8 && bits == std::floor(bits),
           "[packed] bits: expected an integer in 1..8 or 1.5 but got " + std::to_string(bits));
  s.bits_x2 = static_cast<uint8_t>(2 * static_cast<int>(bits));
  return s;
}

PackedRowFormat make_row_format(int64_t head_dim, double bits, int64_t group_size, MetaType meta) {
  VQ_CHECK(head_dim >= 1 && head_dim <= 65536,
           "[packed] head_dim: expected 1..65536 but got " + std::to_string(head_dim));
  VQ_CHECK(group_size >= 1 && group_size <= 65536,
           "[packed] group_size: expected 1..65536 but got " + std::to_string(group_size));
  PackedRowFormat f;
  f.spec = code_spec_from_bits(bits);
  f.meta = meta;
  f.head_dim = static_cast<int32_t>(head_dim);
  f.group_size = static_cast<int32_t>(group_size);
  f.n_groups = static_cast<int32_t>((head_dim + group_size - 1) / group_size);
  const int ms = meta_size(meta);
  const int64_t cb = packed_code_bytes(head_dim, f.spec);
  f.code_bytes = static_cast<int32_t>((cb + ms - 1) / ms * ms);
  f.row_stride = f.code_bytes + f.n_groups * 2 * ms;
  return f;
}

PackedRowFormat make_channel_row_format(int64_t head_dim, double bits, int64_t min_chunk_rows,
                                        MetaType meta) {
  VQ_CHECK(min_chunk_rows >= 1 && min_chunk_rows <= kMaxCacheRows,
           "[packed] min_chunk_rows: expected 1.." + std::to_string(kMaxCacheRows) + " but got " +
               std::to_string(min_chunk_rows));
  PackedRowFormat f = make_row_format(head_dim, bits, head_dim, meta);
  f.axis = QuantAxis::kChannel;
  // 2D metadata elements spread over the chunk's records, n_groups of them per record.
  f.n_groups = static_cast<int32_t>((2 * head_dim + min_chunk_rows - 1) / min_chunk_rows);
  f.row_stride = f.code_bytes + f.n_groups * meta_size(meta);
  return f;
}

void dequantize_record(const uint8_t* record, const PackedRowFormat& f, float* out) {
  VQ_CHECK(f.axis == QuantAxis::kToken,
           "[dequantize_record] expected a token-axis record but got a channel-axis one (its "
           "metadata lives in its chunk: dequantize_row)");
  uint8_t small[512];
  std::vector<uint8_t> big;
  uint8_t* codes = small;
  if (f.head_dim > 512) {
    big.resize(static_cast<size_t>(f.head_dim));
    codes = big.data();
  }
  unpack_codes(record, f.head_dim, f.spec, codes);
  const void* meta = record_meta(record, f);
  for (int32_t g = 0; g < f.n_groups; ++g) {
    const float lo = meta_load(meta, 2 * g, f.meta);
    const float sc = meta_load(meta, 2 * g + 1, f.meta);
    const int32_t c1 = std::min(f.head_dim, (g + 1) * f.group_size);
    for (int32_t c = g * f.group_size; c < c1; ++c) out[c] = dequantize_code(codes[c], sc, lo);
  }
}

void untransform_row(const PackedTensor& t, int64_t h, float* row, float* tmp) {
  const int64_t d = t.fmt.head_dim;
  if (t.perm) {  // stored j holds channel perm[j]
    const int32_t* p = t.perm + h * d;
    for (int64_t j = 0; j < d; ++j) tmp[p[j]] = row[j];
    std::copy(tmp, tmp + d, row);
  }
  if (t.signs) hadamard_unrotate(row, t.signs + h * d, d, t.rot_block);
}

void transform_row(const PackedTensor& t, int64_t h, float* row, float* tmp) {
  const int64_t d = t.fmt.head_dim;
  if (t.signs) hadamard_rotate(row, t.signs + h * d, d, t.rot_block);
  if (t.perm) {
    const int32_t* p = t.perm + h * d;
    for (int64_t j = 0; j < d; ++j) tmp[j] = row[p[j]];
    std::copy(tmp, tmp + d, row);
  }
}

void dequantize_row(const PackedTensor& t, int64_t b, int64_t h, int64_t i, float* out) {
  if (t.fmt.axis == QuantAxis::kChannel) {
    const uint8_t* chunk0 = t.record(b, h, channel_run_start(t.runs, t.n_runs, i));
    const uint8_t* rec = t.record(b, h, i);
    for (int64_t c = 0; c < t.fmt.head_dim; ++c)
      out[c] = dequantize_code(code_at(rec, c, t.fmt.spec),
                               channel_meta(chunk0, t.fmt.row_stride, t.fmt, 2 * c + 1),
                               channel_meta(chunk0, t.fmt.row_stride, t.fmt, 2 * c));
  } else {
    dequantize_record(t.record(b, h, i), t.fmt, out);
  }
  if (t.transformed()) {
    std::vector<float> tmp(static_cast<size_t>(t.fmt.head_dim));
    untransform_row(t, h, out, tmp.data());
  }
}

// ---------------------------------------------------------------------------------------------
// Quantizer

void check_params(const GroupQuantParams& p, int64_t d) {
  (void)code_spec_from_bits(p.bits);
  VQ_CHECK(p.group_size >= 1,
           "[group_quant] group_size: expected >= 1 but got " + std::to_string(p.group_size));
  VQ_CHECK(p.clip_alpha > 0.0f && p.clip_alpha <= 1.0f,
           "[group_quant] clip_alpha: expected in (0, 1] but got " + std::to_string(p.clip_alpha));
  VQ_CHECK(
      p.clip_floor >= kClipFloorMin && p.clip_floor <= kClipFloorSeed,
      "[group_quant] clip_floor: expected in [0.25, 0.85] but got " + std::to_string(p.clip_floor));
  VQ_CHECK(d >= 1, "[group_quant] expected d >= 1 but got " + std::to_string(d));
}

ClipAlphas clip_alphas(const GroupQuantParams& p) {
  ClipAlphas s;
  if (p.clip_search) {
    for (float a : kClipAlphaGrid) s.a[s.n++] = a;
    for (float a : kClipAlphaTail)
      if (static_cast<double>(a) >= p.clip_floor - 1e-9) s.a[s.n++] = a;
  } else {
    s.a[0] = p.clip_alpha;
    s.n = 1;
  }
  return s;
}

namespace {

// lo and scale of one alpha, as stored.
inline void alpha_meta(float mid, float rng, float alpha, float levels, MetaType meta, float* lo,
                       float* scale) {
  *lo = meta_round(mid - alpha * rng / 2.0f, meta);
  float sc = alpha * rng / levels;
  sc = sc < kScaleFloor ? kScaleFloor : sc;
  *scale = meta_round_scale(sc, meta);
}

}  // namespace

void group_quantize_reference(const float* x, int64_t n, int64_t d, const GroupQuantParams& p,
                              uint8_t* codes, float* lo, float* scale, uint8_t* alpha_index) {
  check_params(p, d);
  const int64_t g = p.group_size;
  const int64_t n_groups = (d + g - 1) / g;
  const float levels = static_cast<float>(code_spec_from_bits(p.bits).levels());
  const ClipAlphas al = clip_alphas(p);
  std::vector<float> buf(static_cast<size_t>(g));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t gi = 0; gi < n_groups; ++gi) {
      const int64_t c0 = gi * g;
      for (int64_t i = 0; i < g; ++i) buf[i] = x[r * d + std::min(c0 + i, d - 1)];  // pad
      float gmin = buf[0], gmax = buf[0];
      for (int64_t i = 1; i < g; ++i) {
        if (buf[i] < gmin) gmin = buf[i];
        if (buf[i] > gmax) gmax = buf[i];
      }
      const float mid = (gmax + gmin) / 2.0f;
      const float rng = gmax - gmin;
      float best_err = 0.0f, best_lo = 0.0f, best_sc = 1.0f;
      int best = 0;
      for (int k = 0; k < al.n; ++k) {
        float l, s;
        alpha_meta(mid, rng, al.a[k], levels, p.meta, &l, &s);
        float err = 0.0f;
        for (int64_t i = 0; i < g; ++i) {
          const float rec = quant_code(buf[i], l, s, levels) * s + l;
          const float e = rec - buf[i];
          err += e * e;
        }
        err = err / static_cast<float>(g);
        if (k == 0 || err < best_err) {
          best_err = err;
          best_lo = l;
          best_sc = s;
          best = k;
        }
      }
      lo[r * n_groups + gi] = best_lo;
      scale[r * n_groups + gi] = best_sc;
      if (alpha_index) alpha_index[r * n_groups + gi] = static_cast<uint8_t>(best);
      for (int64_t c = c0; c < std::min(c0 + g, d); ++c)
        codes[r * d + c] = static_cast<uint8_t>(quant_code(x[r * d + c], best_lo, best_sc, levels));
    }
  }
}

void group_dequantize_reference(const uint8_t* codes, const float* lo, const float* scale,
                                int64_t n, int64_t d, int64_t group_size, float* out) {
  const int64_t n_groups = (d + group_size - 1) / group_size;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) {
      const int64_t gi = r * n_groups + c / group_size;
      out[r * d + c] = static_cast<float>(codes[r * d + c]) * scale[gi] + lo[gi];
    }
}

namespace {

constexpr int kLanes = 16;  // rows quantized side by side

// lo[r], scale[r] -> their values as stored in `meta` (what meta_round / meta_round_scale give,
// with the hardware fp16 conversion where the build has F16C).
void round_meta_lanes(float* lo, float* scale, MetaType meta) {
  if (meta == MetaType::kF32) return;
#if defined(__F16C__) && defined(__AVX__)
  if (meta == MetaType::kF16) {
    // Saturate to +-65504 (max/min return their second operand for NaN: NaN passes through).
    const __m256 hi = _mm256_set1_ps(65504.0f), lo_lim = _mm256_set1_ps(-65504.0f);
    const __m256 tiny = _mm256_set1_ps(0x1p-24f);
    for (int r = 0; r < kLanes; r += 8) {
      __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo_lim, _mm256_loadu_ps(lo + r)));
      v = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      _mm256_storeu_ps(lo + r, v);
      __m256 w = _mm256_min_ps(hi, _mm256_max_ps(lo_lim, _mm256_loadu_ps(scale + r)));
      w = _mm256_cvtph_ps(_mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // rounded >= 2^-24 ? rounded : 2^-24 (a NaN gives the floor, as in meta_round_scale).
      w = _mm256_blendv_ps(tiny, w, _mm256_cmp_ps(w, tiny, _CMP_GE_OQ));
      _mm256_storeu_ps(scale + r, w);
    }
    return;
  }
#endif
  for (int r = 0; r < kLanes; ++r) {
    lo[r] = meta_round(lo[r], meta);
    scale[r] = meta_round_scale(scale[r], meta);
  }
}

// The alpha search of one group for kLanes rows side by side. All NA candidates are evaluated in
// the same pass over the elements: NA independent error chains per lane (the sum order of each
// stays the element order, as in the reference) instead of one latency-bound chain at a time.
// NA = kMaxClipAlphas: the first al.n of them (an extended grid, GroupQuantParams::clip_floor).
template <int NA>
void search_alphas(const float* tile, int64_t g, const float* mid, const float* rng,
                   const ClipAlphas& al, float levels, MetaType meta, float* best_lo,
                   float* best_sc) {
  const int na = NA == kMaxClipAlphas ? al.n : NA;
  alignas(64) float l[NA][kLanes], s[NA][kLanes], err[NA][kLanes];
  for (int k = 0; k < na; ++k) {
    const float a = al.a[k];
    for (int r = 0; r < kLanes; ++r) {
      l[k][r] = mid[r] - a * rng[r] / 2.0f;
      const float sc = a * rng[r] / levels;
      s[k][r] = sc < kScaleFloor ? kScaleFloor : sc;
      err[k][r] = 0.0f;
    }
    round_meta_lanes(l[k], s[k], meta);
  }
  for (int64_t i = 0; i < g; ++i) {
    const float* trow = tile + i * kLanes;
    for (int k = 0; k < na; ++k)
      for (int r = 0; r < kLanes; ++r) {
        float t = (trow[r] - l[k][r]) / s[k][r];
        t = t > 0.0f ? t : 0.0f;
        t = t < levels ? t : levels;
        t = (t + 0x1p23f) - 0x1p23f;
        const float e = (t * s[k][r] + l[k][r]) - trow[r];
        err[k][r] += e * e;
      }
  }
  alignas(64) float best_err[kLanes];
  for (int r = 0; r < kLanes; ++r) {
    best_err[r] = err[0][r] / static_cast<float>(g);
    best_lo[r] = l[0][r];
    best_sc[r] = s[0][r];
  }
  for (int k = 1; k < na; ++k)
    for (int r = 0; r < kLanes; ++r) {
      const float e = err[k][r] / static_cast<float>(g);
      if (e < best_err[r]) {  // strict: ties keep the earlier alpha
        best_err[r] = e;
        best_lo[r] = l[k][r];
        best_sc[r] = s[k][r];
      }
    }
}

// Quantizes rows [r0, r0 + m) (m <= kLanes) of x. tile: scratch [g][kLanes].
void quantize_tile(const float* x, int64_t r0, int64_t m, int64_t d, const GroupQuantParams& p,
                   const ClipAlphas& al, float levels, float* tile, uint8_t* codes, float* lo,
                   float* scale) {
  const int64_t g = p.group_size;
  const int64_t n_groups = (d + g - 1) / g;
  for (int64_t gi = 0; gi < n_groups; ++gi) {
    const int64_t c0 = gi * g;
    // Transpose the group into lanes; missing rows repeat the last one (results discarded).
    for (int64_t i = 0; i < g; ++i) {
      const int64_t c = std::min(c0 + i, d - 1);
      float* trow = tile + i * kLanes;
      for (int r = 0; r < kLanes; ++r) trow[r] = x[(r0 + std::min<int64_t>(r, m - 1)) * d + c];
    }
    alignas(64) float mn[kLanes], mx[kLanes], mid[kLanes], rng[kLanes];
    alignas(64) float best_lo[kLanes] = {}, best_sc[kLanes] = {};
    for (int r = 0; r < kLanes; ++r) mn[r] = mx[r] = tile[r];
    for (int64_t i = 1; i < g; ++i) {
      const float* trow = tile + i * kLanes;
      for (int r = 0; r < kLanes; ++r) {
        mn[r] = trow[r] < mn[r] ? trow[r] : mn[r];
        mx[r] = trow[r] > mx[r] ? trow[r] : mx[r];
      }
    }
    for (int r = 0; r < kLanes; ++r) {
      mid[r] = (mx[r] + mn[r]) / 2.0f;
      rng[r] = mx[r] - mn[r];
    }
    if (al.n == 5)
      search_alphas<5>(tile, g, mid, rng, al, levels, p.meta, best_lo, best_sc);
    else if (al.n == 1)
      search_alphas<1>(tile, g, mid, rng, al, levels, p.meta, best_lo, best_sc);
    else
      search_alphas<kMaxClipAlphas>(tile, g, mid, rng, al, levels, p.meta, best_lo, best_sc);
    for (int64_t r = 0; r < m; ++r) {
      lo[(r0 + r) * n_groups + gi] = best_lo[r];
      scale[(r0 + r) * n_groups + gi] = best_sc[r];
    }
    const int64_t c1 = std::min(c0 + g, d);
    for (int64_t c = c0; c < c1; ++c) {
      const float* trow = tile + (c - c0) * kLanes;
      alignas(64) float q[kLanes];
      for (int r = 0; r < kLanes; ++r) {
        float t = (trow[r] - best_lo[r]) / best_sc[r];
        t = t > 0.0f ? t : 0.0f;
        t = t < levels ? t : levels;
        q[r] = (t + 0x1p23f) - 0x1p23f;
      }
      for (int64_t r = 0; r < m; ++r) codes[(r0 + r) * d + c] = static_cast<uint8_t>(q[r]);
    }
  }
}

// Packs codes into a record (fast paths for 2, 4 and 8 bits).
void pack_row(const uint8_t* codes, int64_t d, CodeSpec spec, uint8_t* out) {
  if (spec.bits_x2 == 4 && d % 4 == 0) {
    for (int64_t k = 0; k < d / 4; ++k)
      out[k] = static_cast<uint8_t>(codes[4 * k] | (codes[4 * k + 1] << 2) |
                                    (codes[4 * k + 2] << 4) | (codes[4 * k + 3] << 6));
  } else if (spec.bits_x2 == 8 && d % 2 == 0) {
    for (int64_t k = 0; k < d / 2; ++k)
      out[k] = static_cast<uint8_t>(codes[2 * k] | (codes[2 * k + 1] << 4));
  } else if (spec.bits_x2 == 16) {
    std::copy(codes, codes + d, out);
  } else {
    pack_codes(codes, d, spec, out);
  }
}

}  // namespace

void group_quantize(const float* x, int64_t n, int64_t d, const GroupQuantParams& p, uint8_t* codes,
                    float* lo, float* scale) {
  check_params(p, d);
  const float levels = static_cast<float>(code_spec_from_bits(p.bits).levels());
  const ClipAlphas al = clip_alphas(p);
  const int64_t n_tiles = (n + kLanes - 1) / kLanes;
  // Tiles of kLanes rows on the worker pool (ops/thread_pool.h; serial inside a pool unit, e.g. a
  // store's flush of one frame) from 4 tiles on; each thread's scratch kept between calls.
  ops::parallel_for_if(n_tiles >= 4, n_tiles, [&](int64_t t) {
    thread_local std::vector<float> tile;
    tile.resize(static_cast<size_t>(p.group_size * kLanes));
    const int64_t r0 = t * kLanes;
    quantize_tile(x, r0, std::min<int64_t>(kLanes, n - r0), d, p, al, levels, tile.data(), codes,
                  lo, scale);
  });
}

void quantize_to_records(const float* x, int64_t n, const PackedRowFormat& f,
                         const GroupQuantParams& p, uint8_t* dst, int64_t dst_stride,
                         bool parallel) {
  const int64_t d = f.head_dim;
  check_params(p, d);
  VQ_CHECK(p.group_size == f.group_size && code_spec_from_bits(p.bits).bits_x2 == f.spec.bits_x2 &&
               p.meta == f.meta,
           "[quantize_to_records] expected params matching the row format");
  const float levels = static_cast<float>(f.spec.levels());
  const ClipAlphas al = clip_alphas(p);
  const int64_t n_tiles = (n + kLanes - 1) / kLanes;
  const int64_t ng = f.n_groups;
  // tiles on the worker pool (ops/thread_pool.h) when parallel; each thread's scratch kept
  // between calls (a store's flush calls this serially for every frame)
  ops::parallel_for_if(parallel && n_tiles >= 2, n_tiles, [&](int64_t t) {
    thread_local std::vector<float> tile, lo, sc;
    thread_local std::vector<uint8_t> codes;
    tile.resize(static_cast<size_t>(p.group_size * kLanes));
    codes.resize(static_cast<size_t>(kLanes * d));
    lo.resize(static_cast<size_t>(kLanes * ng));
    sc.resize(static_cast<size_t>(kLanes * ng));
    const int64_t r0 = t * kLanes;
    const int64_t m = std::min<int64_t>(kLanes, n - r0);
    quantize_tile(x + r0 * d, 0, m, d, p, al, levels, tile.data(), codes.data(), lo.data(),
                  sc.data());
    for (int64_t r = 0; r < m; ++r) {
      uint8_t* rec = dst + (r0 + r) * dst_stride;
      std::fill(rec, rec + f.code_bytes, uint8_t{0});
      pack_row(codes.data() + r * d, d, f.spec, rec);
      void* meta = rec + f.code_bytes;
      for (int64_t gi = 0; gi < ng; ++gi) {
        meta_store(meta, 2 * gi, lo[r * ng + gi], f.meta);
        meta_store(meta, 2 * gi + 1, sc[r * ng + gi], f.meta);
      }
    }
  });
}

void quantize_chunk_to_records(const float* x, int64_t n, const PackedRowFormat& f,
                               const GroupQuantParams& p, uint8_t* dst, int64_t dst_stride,
                               const double* key_u) {
  const int64_t d = f.head_dim;
  VQ_CHECK(f.axis == QuantAxis::kChannel && code_spec_from_bits(p.bits).bits_x2 == f.spec.bits_x2 &&
               p.meta == f.meta,
           "[quantize_chunk_to_records] expected params matching a channel-axis row format");
  VQ_CHECK(n >= 1 && n * f.n_groups >= 2 * d,
           "[quantize_chunk_to_records] expected a chunk of at least " +
               std::to_string((2 * d + f.n_groups - 1) / f.n_groups) +
               " rows (its metadata lives in its records) but got " + std::to_string(n));
  // Channel c over the chunk's rows is one group of n values: the group quantizer on x^T.
  std::vector<float> xt(static_cast<size_t>(d * n));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < d; ++c) xt[static_cast<size_t>(c * n + t)] = x[t * d + c];
  GroupQuantParams pc = p;
  pc.group_size = n;
  std::vector<uint8_t> ct(static_cast<size_t>(d * n)), row(static_cast<size_t>(d));
  std::vector<float> lo(static_cast<size_t>(d)), sc(static_cast<size_t>(d));
  group_quantize(xt.data(), d, n, pc, ct.data(), lo.data(), sc.data());
  if (key_u != nullptr)
    key_feedback_codes(x, n, d, lo.data(), sc.data(), f.spec.levels(), key_u, ct.data());
  for (int64_t t = 0; t < n; ++t) {
    uint8_t* rec = dst + t * dst_stride;
    std::fill(rec, rec + f.row_stride, uint8_t{0});
    for (int64_t c = 0; c < d; ++c)
      row[static_cast<size_t>(c)] = ct[static_cast<size_t>(c * n + t)];
    pack_row(row.data(), d, f.spec, rec);
  }
  for (int64_t e = 0; e < 2 * d; ++e) {
    const float v = e % 2 == 0 ? lo[static_cast<size_t>(e / 2)] : sc[static_cast<size_t>(e / 2)];
    meta_store(dst + (e / f.n_groups) * dst_stride + f.code_bytes, e % f.n_groups, v, f.meta);
  }
}

SkvqBytes skvq_channel_bytes(int64_t n, const PackedRowFormat& f) {
  VQ_CHECK(n >= 0 && f.axis == QuantAxis::kChannel,
           "[skvq_channel_bytes] expected n >= 0 and a channel-axis format but got n = " +
               std::to_string(n));
  SkvqBytes b;
  b.code_bytes =
      f.spec.ternary() ? n * ((f.head_dim + 4) / 5) : (n * f.head_dim * f.spec.bits() + 7) / 8;
  b.meta_bytes = n * f.n_groups * meta_size(f.meta);
  return b;
}

SkvqBytes skvq_compressed_bytes(int64_t n, int64_t d, double bits, int64_t group_size,
                                MetaType meta) {
  const CodeSpec spec = code_spec_from_bits(bits);
  VQ_CHECK(n >= 0 && d >= 1 && group_size >= 1,
           "[skvq_compressed_bytes] expected n >= 0, d >= 1, group_size >= 1 but got " +
               std::to_string(n) + ", " + std::to_string(d) + ", " + std::to_string(group_size));
  SkvqBytes b;
  b.code_bytes = spec.ternary() ? n * ((d + 4) / 5) : (n * d * spec.bits() + 7) / 8;
  b.meta_bytes = n * ((d + group_size - 1) / group_size) * 2 * meta_size(meta);
  return b;
}

}  // namespace vq
