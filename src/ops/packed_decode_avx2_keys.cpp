// AVX2 packed key kernels on int8 queries (packed_decode.h): for CPUs with AVX2 but no AVX-512
// VNNI, where the fp32 key kernel (packed_decode_simd.h) spends about 8 instructions per 8
// channels per query on converting codes and multiplying them in fp32. Chosen at run time by
// packed_kernel for 1-, 2- and 4-bit codes, fp16 metadata, at most 4 groups per row, group sizes
// that are a multiple of 4 P channels (P = 8 / B codes per byte), records of 16 or a multiple of
// 32 code bytes up to 128.
//
// The query is rounded to int8 per group exactly as the VNNI kernels' (packed_decode_vnni.cpp):
// sq_g = max_{i in g} |q'_i| / 127, q8_i = rne(q'_i / sq_g) (a NaN or infinite q' gives sq_g =
// NaN), so PackedKernel::int8_query's bound covers it. Lanes run over channels of one record:
// a record's codes are read 32 bytes at a time (a 16-byte record or tail zero-extended), and for
// each j < P the j-th code of every byte, (byte >> jB) & (2^B - 1), meets the prepared query
// bytes of those channels in vpmaddubsw (u8 x s8 -> pairs summed in int16); the P results add in
// int16 (at most 2 P (2^B - 1) 127 <= 7620 in magnitude: no saturation) and vpmaddwd by ones
// gives int32 lane k = the exact sum over channels [(32 r + 4 k) P, (32 r + 4 k + 4) P) of
// register r, inside one group (the group size is a multiple of 4 P). Then, in fp32:
//   tot_2g = lo_g * qsum_g                            (the metadata vector lo_0, s_0, lo_1, ...
//                                                      with its scales masked off)
//   tot_lane += float(acc_lane) * (s_g * sq_g)       (per register r; float(acc) exact)
//   logit = lane sum of tot (reduce4's tree in fused_attention.cpp)
// Lanes past the record's channels hold zero codes, zero query bytes and a zero scale.
#include "ops/packed_decode.h"

#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#endif

namespace vq::detail {
namespace {

constexpr int64_t kMaxRegs = 4;    // 32-byte code registers per record (128 code bytes)
constexpr int32_t kMaxGroups = 4;  // (lo, s) fp16 pairs read in one 16-byte load

#include "ops/packed_decode_qblocks.h"

int64_t regs(const PackedRowFormat& f) {
  return (f.code_bytes + 31) / 32;
}

// Prepared query m: int8 bytes [R][P][32], then float sq_lanes [R][8], then float qsum_lanes
// [8] (qsum_g in lane 2 g, zeros elsewhere).
template <int B>
int64_t qblock_bytes(const PackedRowFormat& f) {
  return regs(f) * (8 / B) * 32 + regs(f) * 32 + 32;
}

template <int B>
int64_t prep_bytes(const PackedRowFormat& f, int64_t n_q) {
  return n_q * qblock_bytes<B>(f);
}

// Round to nearest even for |x| < 2^22 (default rounding mode; the build does not contract).
inline float rne_small(float x) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return x >= 0.0f ? (x + magic) - magic : (x - magic) + magic;
}

template <int B>
void prepare(const PackedRowFormat& f, const float* q, const float* qsum, int64_t n_q, void* out) {
  constexpr int P = 8 / B;
  const int64_t d = f.head_dim, gs = f.group_size, ng = f.n_groups, R = regs(f);
  float sq[kMaxGroups];
  for (int64_t m = 0; m < n_q; ++m) {
    uint8_t* blk = static_cast<uint8_t*>(out) + m * qblock_bytes<B>(f);
    int8_t* q8 = reinterpret_cast<int8_t*>(blk);
    float* sql = reinterpret_cast<float*>(blk + R * P * 32);
    float* qs = sql + R * 8;
    for (int k = 0; k < 8; ++k) qs[k] = 0.0f;
    const float* qm = q + m * d;
    for (int64_t g = 0; g < ng; ++g) {
      float mx = 0.0f;
      bool finite = true;
      const int64_t i1 = (g + 1) * gs < d ? (g + 1) * gs : d;
      for (int64_t i = g * gs; i < i1; ++i) {
        const float a = __builtin_fabsf(qm[i]);
        finite = finite && a <= 3.4028234663852886e38f;
        mx = a > mx ? a : mx;
      }
      sq[g] = finite ? mx / 127.0f : __builtin_nanf("");
      qs[2 * g] = qsum[m * ng + g];
    }
    for (int64_t r = 0; r < R; ++r) {
      for (int j = 0; j < P; ++j)
        for (int64_t b = 0; b < 32; ++b) {
          const int64_t ch = (32 * r + b) * P + j;
          int v = 0;
          if (ch < d && sq[ch / gs] > 0.0f) {  // false for 0 and NaN
            const float x = rne_small(qm[ch] / sq[ch / gs]);
            v = static_cast<int>(x < -127.0f ? -127.0f : (x > 127.0f ? 127.0f : x));
          }
          q8[(r * P + j) * 32 + b] = static_cast<int8_t>(v);
        }
      for (int64_t k = 0; k < 8; ++k) {
        const int64_t c0 = (32 * r + 4 * k) * P;
        sql[r * 8 + k] = c0 < d ? sq[c0 / gs] : 0.0f;
      }
    }
  }
}

template <int B, int QB>
inline void row_logits(const PackedRowFormat& f, const uint8_t* rec, const uint8_t* prep,
                       int64_t qbb, int64_t m0, const __m256i* sidx, const __m256* lane_ok,
                       float* res) {
  constexpr int P = 8 / B;
  const int64_t R = regs(f), ng = f.n_groups;
  const __m256i mask = _mm256_set1_epi8(static_cast<char>((1 << B) - 1));
  const __m256i ones = _mm256_set1_epi16(1);
  // (lo, s) fp16 pairs: loads of exactly 4 ng bytes (no copy through memory: a 16-byte load of
  // an 8-byte store would wait for the store instead of taking its data)
  const uint8_t* mp = rec + f.code_bytes;
  const auto word = [](const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
  };
  __m128i mraw;
  switch (ng) {
    case 1:
      mraw = _mm_cvtsi32_si128(word(mp));
      break;
    case 2:
      mraw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mp));
      break;
    case 3:
      mraw =
          _mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mp)), word(mp + 8), 2);
      break;
    default:
      mraw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mp));
      break;
  }
  const __m256 mv = _mm256_cvtph_ps(mraw);  // lo_0, s_0, lo_1, s_1, ... (zeros past ng)
  const __m256 lo = _mm256_blend_ps(mv, _mm256_setzero_ps(), 0xaa);
  __m256i sub[kMaxRegs][P];
  __m256 sl[kMaxRegs];
  for (int64_t r = 0; r < R; ++r) {
    const __m256i x = 32 * (r + 1) <= f.code_bytes
                          ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * r))
                          : _mm256_inserti128_si256(
                                _mm256_setzero_si256(),
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 * r)), 0);
    for (int j = 0; j < P; ++j)
      sub[r][j] = _mm256_and_si256(j == 0 ? x : _mm256_srli_epi16(x, j * B), mask);
    sl[r] = _mm256_and_ps(_mm256_permutevar8x32_ps(mv, sidx[r]), lane_ok[r]);
  }
  __m256 tot[4];
  for (int q = QB; q < 4; ++q) tot[q] = _mm256_setzero_ps();
  for (int q = 0; q < QB; ++q) {
    const uint8_t* pq = prep + (m0 + q) * qbb;
    const float* sql = reinterpret_cast<const float*>(pq + R * P * 32);
    tot[q] = _mm256_mul_ps(lo, _mm256_loadu_ps(sql + 8 * R));
    for (int64_t r = 0; r < R; ++r) {
      __m256i a = _mm256_maddubs_epi16(
          sub[r][0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pq + r * P * 32)));
      for (int j = 1; j < P; ++j)
        a = _mm256_add_epi16(
            a, _mm256_maddubs_epi16(sub[r][j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                   pq + (r * P + j) * 32))));
      const __m256 sc = _mm256_mul_ps(sl[r], _mm256_loadu_ps(sql + 8 * r));
      tot[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a, ones)), sc, tot[q]);
    }
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(tot[0], tot[1]), _mm256_hadd_ps(tot[2], tot[3]));
  _mm_storeu_ps(res, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

template <int B>
void keys(const PackedRowFormat& f, const PackedTile& tile, const float* /*q*/,
          const float* /*qsum*/, int64_t n_q, float* logits, int64_t ld, const void* prep) {
  constexpr int P = 8 / B;
  const int64_t R = regs(f), gs = f.group_size, d = f.head_dim;
  const uint8_t* pb = static_cast<const uint8_t*>(prep);
  const int64_t qbb = qblock_bytes<B>(f);
  __m256i sidx[kMaxRegs];
  __m256 lane_ok[kMaxRegs];
  for (int64_t r = 0; r < R; ++r) {
    alignas(32) int32_t idx[8], ok[8];
    for (int64_t k = 0; k < 8; ++k) {
      const int64_t c0 = (32 * r + 4 * k) * P;
      idx[k] = c0 < d ? static_cast<int32_t>(2 * (c0 / gs) + 1) : 0;
      ok[k] = c0 < d ? -1 : 0;
    }
    sidx[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
    lane_ok[r] = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ok)));
  }
  for (int64_t i = 0; i < tile.n_rows; ++i) {
    const int64_t t = tile.rows[i];
    const uint8_t* rec = tile.rec0 + t * tile.stride;
    for_query_blocks(n_q, [&](auto qb, int64_t m0) {
      constexpr int QB = decltype(qb)::value;
      float res[4];
      row_logits<B, QB>(f, rec, pb, qbb, m0, sidx, lane_ok, res);
      for (int q = 0; q < QB; ++q) logits[(m0 + q) * ld + t] = res[q];
    });
  }
}

template <int B>
PackedKernel kernel() {
  PackedKernel k;
  k.keys = keys<B>;
  k.prepare = prepare<B>;
  k.prep_bytes = prep_bytes<B>;
  k.isa = CpuIsa::kAvx2Int8;
  k.int8_query = true;
  return k;
}

}  // namespace

PackedKernel packed_keys_avx2_int8(const PackedRowFormat& f) {
  if (f.spec.ternary() || f.meta != MetaType::kF16 || f.axis != QuantAxis::kToken ||
      f.n_groups > kMaxGroups || f.n_groups < 1)
    return {};
  const int b = f.spec.bits();
  if (b != 1 && b != 2 && b != 4) return {};
  const int64_t lane_ch = 4 * (8 / b);  // channels per int32 lane
  if (f.group_size % lane_ch != 0 || f.code_bytes != f.head_dim * b / 8 ||
      (f.code_bytes % 32 != 0 && f.code_bytes != 16) || f.code_bytes > 32 * kMaxRegs ||
      int64_t{f.n_groups} * f.group_size < f.head_dim)
    return {};
  return b == 1 ? kernel<1>() : (b == 2 ? kernel<2>() : kernel<4>());
}

}  // namespace vq::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else

namespace vq::detail {
PackedKernel packed_keys_avx2_int8(const PackedRowFormat&) {
  return {};
}
}  // namespace vq::detail

#endif
