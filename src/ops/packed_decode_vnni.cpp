// AVX-512 VNNI packed key kernels (packed_decode.h): key logits from integer dot products of the
// codes with the query rounded to int8 per group. Chosen at run time where the CPU has
// avx512_vnni, for 1/2/4/8-bit codes with fp16 metadata; values use the AVX-512 fp32 kernel.
//
// A row's codes are read 64 bytes (one chunk: 64 * P channels, P = 8 / B codes per byte) at a
// time. Sub-vector j (0 <= j < P) holds code j of every byte: (x >> jB) & (2^B - 1), bytes as u8.
// The prepared query holds, per chunk and j, the int8 query of the channel each byte position
// carries (channel = chunk start + byte * P + j), so vpdpbusd sums 4 bytes x P codes per 32-bit
// lane: lane l of a chunk is the exact integer sum of q8_i c_i over its 4P channels (a lane never
// crosses a group: the group size is a multiple of 4P). Then per lane, in fp32:
//   tot += (float(lane) * sq_g) * s_g + lo_g * qs_l     (qs_l = qsum_g on a group's first lane)
// and the logit is the sum of the 16 lanes of tot. The lanes' s_g and lo_g come from one masked
// load of the chunk's metadata (<= 8 groups), converted from fp16 and permuted to the lanes.
// Query rounding (packed_decode.h, PackedKernel::int8_query): sq_g = max_{i in g} |q'_i| / 127,
// q8_i = rne(q'_i / sq_g); a group with a NaN or infinite q' gets sq_g = NaN (the logit is NaN,
// as the reference's).
#include "ops/packed_decode.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC takes the target as a pragma; clang as an attribute on every function that follows.
#if defined(__clang__)
#include <immintrin.h>
#pragma clang attribute push(                                                               \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>
#endif

#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace vq::detail {
namespace {

// Per chunk: the lanes' metadata indices (into the chunk's 16-value window lo0, s0, lo1, ...),
// the window's first group, its value count and the chunk's code bytes. 192 bytes.
struct ChunkHead {
  int32_t s_idx[16];
  int32_t lo_idx[16];
  int32_t g0, n_meta, n_bytes, pad[13];
};
static_assert(sizeof(ChunkHead) == 192);

// Per (query, chunk): int8 q8[P][64], float sq[16], float qs[16].
template <int B>
constexpr int64_t qblock_bytes() {
  return (8 / B) * 64 + 128;
}

int64_t chunks(const PackedRowFormat& f, int p) {
  return (f.head_dim + 64 * p - 1) / (64 * p);
}

template <int B>
int64_t prep_bytes(const PackedRowFormat& f, int64_t n_q) {
  const int64_t nc = chunks(f, 8 / B);
  return nc * (static_cast<int64_t>(sizeof(ChunkHead)) + n_q * qblock_bytes<B>());
}

template <int B>
void prepare(const PackedRowFormat& f, const float* q, const float* qsum, int64_t n_q, void* out) {
  constexpr int P = 8 / B, CH = 64 * P, LW = 4 * P;
  const int64_t d = f.head_dim, gs = f.group_size, ng = f.n_groups, nc = chunks(f, P);
  ChunkHead* heads = static_cast<ChunkHead*>(out);
  uint8_t* qb = static_cast<uint8_t*>(out) + nc * static_cast<int64_t>(sizeof(ChunkHead));
  for (int64_t c = 0; c < nc; ++c) {
    ChunkHead& h = heads[c];
    const int64_t ch0 = c * CH, ch1 = ch0 + CH < d ? ch0 + CH : d;
    h.g0 = static_cast<int32_t>(ch0 / gs);
    h.n_meta = static_cast<int32_t>(2 * ((ch1 - 1) / gs - h.g0 + 1));
    h.n_bytes = static_cast<int32_t>((ch1 - ch0) / P);
    for (int l = 0; l < 16; ++l) {
      const int64_t ch = ch0 + l * LW;
      const int64_t gl = (ch < d ? ch : d - 1) / gs - h.g0;
      h.s_idx[l] = static_cast<int32_t>(2 * gl + 1);
      h.lo_idx[l] = static_cast<int32_t>(2 * gl);
    }
  }
  for (int64_t m = 0; m < n_q; ++m) {
    const float* qm = q + m * d;
    float sq[1024];
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
    }
    for (int64_t c = 0; c < nc; ++c) {
      uint8_t* blk = qb + (m * nc + c) * qblock_bytes<B>();
      int8_t* q8 = reinterpret_cast<int8_t*>(blk);
      float* sqv = reinterpret_cast<float*>(blk + P * 64);
      float* qsv = sqv + 16;
      const int64_t ch0 = c * CH;
      for (int j = 0; j < P; ++j)
        for (int k = 0; k < 64; ++k) {
          const int64_t ch = ch0 + k * P + j;
          int v = 0;
          if (ch < d) {
            const float s = sq[ch / gs];
            if (s > 0.0f) {  // false for 0 and NaN
              const float r = __builtin_nearbyintf(qm[ch] / s);
              v = static_cast<int>(r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r));
            }
          }
          q8[j * 64 + k] = static_cast<int8_t>(v);
        }
      for (int l = 0; l < 16; ++l) {
        const int64_t ch = ch0 + l * LW;
        const bool valid = ch < d;
        const int64_t g = (valid ? ch : d - 1) / gs;
        sqv[l] = valid ? sq[g] : 0.0f;
        qsv[l] = valid && ch % gs == 0 ? qsum[m * ng + g] : 0.0f;
      }
    }
  }
}

inline float hsum(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}

// Logits of one row for queries m0 .. m0 + QB.
template <int B, int QB>
inline void row_logits(const uint8_t* rec, const PackedRowFormat& f, const ChunkHead* heads,
                       const uint8_t* qb, int64_t nc, int64_t m0, float* logits, int64_t ld,
                       int64_t t) {
  constexpr int P = 8 / B;
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << B) - 1));
  const uint16_t* meta = reinterpret_cast<const uint16_t*>(rec + f.code_bytes);
  __m512 tot[QB];
  for (int j = 0; j < QB; ++j) tot[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nc; ++c) {
    const ChunkHead& h = heads[c];
    const __mmask64 bm = h.n_bytes >= 64 ? ~__mmask64{0} : (__mmask64{1} << h.n_bytes) - 1;
    const __m512i x = _mm512_maskz_loadu_epi8(bm, rec + c * 64);
    const __m512 mw = _mm512_cvtph_ps(
        _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << h.n_meta) - 1u), meta + 2 * h.g0));
    const __m512 s = _mm512_permutexvar_ps(_mm512_loadu_si512(h.s_idx), mw);
    const __m512 lo = _mm512_permutexvar_ps(_mm512_loadu_si512(h.lo_idx), mw);
    __m512i sub[P];
    for (int j = 0; j < P; ++j)
      sub[j] = B == 8 ? x : _mm512_and_si512(j == 0 ? x : _mm512_srli_epi16(x, j * B), mask);
    for (int k = 0; k < QB; ++k) {
      const uint8_t* blk = qb + ((m0 + k) * nc + c) * qblock_bytes<B>();
      __m512i a = _mm512_setzero_si512();
      for (int j = 0; j < P; ++j)
        a = _mm512_dpbusd_epi32(a, sub[j], _mm512_loadu_si512(blk + 64 * j));
      const float* sqv = reinterpret_cast<const float*>(blk + P * 64);
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_loadu_ps(sqv));
      tot[k] = _mm512_fmadd_ps(v, s, tot[k]);
      tot[k] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(sqv + 16), tot[k]);
    }
  }
  for (int k = 0; k < QB; ++k) logits[(m0 + k) * ld + t] = hsum(tot[k]);
}

template <int B>
void keys_vnni(const PackedRowFormat& f, const PackedTile& tile, const float* /*q*/,
               const float* /*qsum*/, int64_t n_q, float* logits, int64_t ld, const void* prep) {
  const int64_t nc = chunks(f, 8 / B);
  const ChunkHead* heads = static_cast<const ChunkHead*>(prep);
  const uint8_t* qb =
      static_cast<const uint8_t*>(prep) + nc * static_cast<int64_t>(sizeof(ChunkHead));
  for (int64_t r = 0; r < tile.n_rows; ++r) {
    const int64_t t = tile.rows[r];
    const uint8_t* rec = tile.rec0 + t * tile.stride;
    int64_t m0 = 0;
    for (; m0 + 4 <= n_q; m0 += 4) row_logits<B, 4>(rec, f, heads, qb, nc, m0, logits, ld, t);
    switch (n_q - m0) {
      case 3:
        row_logits<B, 3>(rec, f, heads, qb, nc, m0, logits, ld, t);
        break;
      case 2:
        row_logits<B, 2>(rec, f, heads, qb, nc, m0, logits, ld, t);
        break;
      case 1:
        row_logits<B, 1>(rec, f, heads, qb, nc, m0, logits, ld, t);
        break;
      default:
        break;
    }
  }
}

template <int B>
PackedKernel kernel() {
  PackedKernel k;
  k.keys = keys_vnni<B>;
  k.prepare = prepare<B>;
  k.prep_bytes = prep_bytes<B>;
  k.isa = CpuIsa::kAvx512Vnni;
  k.int8_query = true;
  return k;
}

}  // namespace

PackedKernel packed_kernel_vnni(const PackedRowFormat& f) {
  if (f.spec.ternary() || f.meta != MetaType::kF16 || f.n_groups > 1024) return {};
  const int b = f.spec.bits();
  if (b != 1 && b != 2 && b != 4 && b != 8) return {};
  const int p = 8 / b;
  if (f.group_size % (4 * p) != 0 || f.head_dim % p != 0) return {};
  for (int64_t c = 0; c < chunks(f, p); ++c) {  // each chunk's metadata fits one 16-value window
    const int64_t ch0 = c * 64 * p, ch1 = ch0 + 64 * p < f.head_dim ? ch0 + 64 * p : f.head_dim;
    if ((ch1 - 1) / f.group_size - ch0 / f.group_size + 1 > 8) return {};
  }
  switch (b) {
    case 1:
      return kernel<1>();
    case 2:
      return kernel<2>();
    case 4:
      return kernel<4>();
    default:
      return kernel<8>();
  }
}

}  // namespace vq::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else

namespace vq::detail {
PackedKernel packed_kernel_vnni(const PackedRowFormat&) {
  return {};
}
}  // namespace vq::detail

#endif
