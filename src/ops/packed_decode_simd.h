// The SIMD packed decode kernels (packed_decode.h) written once over a vector type V (16 lanes
// of AVX-512 or 8 of AVX2): included inside an anonymous namespace by packed_decode_avx512.cpp
// and packed_decode_avx2.cpp after their `#pragma GCC target`, so each instantiation is compiled
// for its instruction set and nothing of it is shared with other files. V provides:
//   reg, L (lanes), zero(), load(p), store(p, v), set1(x), fma(a, b, c) = a*b + c (one rounding)
//   (simd_vec.h's Avx2Vec / Avx512Vec), reduce(v) (sum of the lanes), codes<B>(rec, i): the
//   B-bit codes of channels i .. i + L as floats (i a multiple of L), half(h) (fp16 -> fp32).
// Covered: B in {1, 2, 4, 8}, group size and D multiples of L. Arithmetic (docs/design.md §4):
//   keys: per group, L lane partial sums of q'_i c_i over the group's g / L vectors (fp32 FMA),
//         times s_g into L lane totals (FMA), a lane reduction, then + lo_g qsum_g per group;
//   values: w = p s_g per (row, group), acc_i = fma(w, c_i, acc_i) row after row in order;
//         acc_lo_g += p lo_g.
// This header is meant to be included inside an anonymous namespace only.

// Metadata of one record as fp32 (lo[g], s[g]); fp8 decoded as packed.h's fp8_e4m3_decode does.
template <class V>
inline void simd_meta(const uint8_t* rec, const PackedRowFormat& f, float* lo, float* s) {
  const uint8_t* meta = rec + f.code_bytes;
  const int32_t ng = f.n_groups;
  switch (f.meta) {
    case MetaType::kF16: {
      for (int32_t g = 0; g < ng; ++g) {
        uint16_t h[2];
        __builtin_memcpy(h, meta + 4 * g, 4);
        lo[g] = V::half(h[0]);
        s[g] = V::half(h[1]);
      }
      return;
    }
    case MetaType::kF32:
      for (int32_t g = 0; g < ng; ++g) {
        __builtin_memcpy(lo + g, meta + 8 * g, 4);
        __builtin_memcpy(s + g, meta + 8 * g + 4, 4);
      }
      return;
    case MetaType::kFP8E4M3:
      for (int32_t g = 0; g < ng; ++g) {
        lo[g] = simd_fp8(meta[2 * g]);
        s[g] = simd_fp8(meta[2 * g + 1]);
      }
      return;
  }
}

// logits of the listed rows for queries m0 .. m0 + QB.
template <class V, int B, int QB>
void simd_keys_block(const PackedRowFormat& f, const PackedTile& tile, const float* q,
                     const float* qsum, int64_t m0, float* logits, int64_t ld, const float* lo,
                     const float* s, int64_t r) {
  using reg = typename V::reg;
  const int64_t d = f.head_dim, gs = f.group_size, ng = f.n_groups;
  const int64_t t = tile.rows[r];
  const uint8_t* rec = tile.rec0 + t * tile.stride;
  reg tot[QB];
  for (int j = 0; j < QB; ++j) tot[j] = V::zero();
  for (int64_t g = 0; g < ng; ++g) {
    reg part[QB];
    for (int j = 0; j < QB; ++j) part[j] = V::zero();
    const int64_t i1 = (g + 1) * gs < d ? (g + 1) * gs : d;
    for (int64_t i = g * gs; i < i1; i += V::L) {
      const reg c = V::template codes<B>(rec, i);
      for (int j = 0; j < QB; ++j) part[j] = V::fma(V::load(q + (m0 + j) * d + i), c, part[j]);
    }
    const reg sg = V::set1(s[g]);
    for (int j = 0; j < QB; ++j) tot[j] = V::fma(part[j], sg, tot[j]);
  }
  for (int j = 0; j < QB; ++j) {
    float l = V::reduce(tot[j]);
    const float* qs = qsum + (m0 + j) * ng;
    for (int64_t g = 0; g < ng; ++g) l += lo[g] * qs[g];
    logits[(m0 + j) * ld + t] = l;
  }
}

template <class V, int B>
void simd_keys(const PackedRowFormat& f, const PackedTile& tile, const float* q, const float* qsum,
               int64_t n_q, float* logits, int64_t ld, const void* /*prep*/) {
  float lo[kSimdMaxGroups], s[kSimdMaxGroups];
  for (int64_t r = 0; r < tile.n_rows; ++r) {
    simd_meta<V>(tile.rec0 + tile.rows[r] * tile.stride, f, lo, s);
    int64_t m0 = 0;
    for (; m0 + 4 <= n_q; m0 += 4)
      simd_keys_block<V, B, 4>(f, tile, q, qsum, m0, logits, ld, lo, s, r);
    switch (n_q - m0) {
      case 3:
        simd_keys_block<V, B, 3>(f, tile, q, qsum, m0, logits, ld, lo, s, r);
        break;
      case 2:
        simd_keys_block<V, B, 2>(f, tile, q, qsum, m0, logits, ld, lo, s, r);
        break;
      case 1:
        simd_keys_block<V, B, 1>(f, tile, q, qsum, m0, logits, ld, lo, s, r);
        break;
      default:
        break;
    }
  }
}

// acc of queries m0 .. m0 + QB over channels [i, i + NC * L): the listed rows in order.
// w: [n_rows, ng, n_q] weights p s_g.
template <class V, int B, int QB, int NC>
void simd_values_block(const PackedRowFormat& f, const PackedTile& tile, const float* w,
                       int64_t n_q, float* acc, int64_t m0, int64_t i) {
  using reg = typename V::reg;
  const int64_t d = f.head_dim, ng = f.n_groups;
  const int64_t g = i / f.group_size;  // NC * L channels never cross a group (see simd_values)
  reg a[QB][NC];
  for (int j = 0; j < QB; ++j)
    for (int c = 0; c < NC; ++c) a[j][c] = V::load(acc + (m0 + j) * d + i + c * V::L);
  for (int64_t r = 0; r < tile.n_rows; ++r) {
    const uint8_t* rec = tile.rec0 + tile.rows[r] * tile.stride;
    reg cv[NC];
    for (int c = 0; c < NC; ++c) cv[c] = V::template codes<B>(rec, i + c * V::L);
    const float* wr = w + (r * ng + g) * n_q + m0;
    for (int j = 0; j < QB; ++j) {
      const reg wj = V::set1(wr[j]);
      for (int c = 0; c < NC; ++c) a[j][c] = V::fma(wj, cv[c], a[j][c]);
    }
  }
  for (int j = 0; j < QB; ++j)
    for (int c = 0; c < NC; ++c) V::store(acc + (m0 + j) * d + i + c * V::L, a[j][c]);
}

template <class V, int B, int NC>
void simd_values_chunks(const PackedRowFormat& f, const PackedTile& tile, const float* w,
                        int64_t n_q, float* acc, int64_t i) {
  int64_t m0 = 0;
  for (; m0 + 4 <= n_q; m0 += 4) simd_values_block<V, B, 4, NC>(f, tile, w, n_q, acc, m0, i);
  switch (n_q - m0) {
    case 3:
      simd_values_block<V, B, 3, NC>(f, tile, w, n_q, acc, m0, i);
      break;
    case 2:
      simd_values_block<V, B, 2, NC>(f, tile, w, n_q, acc, m0, i);
      break;
    case 1:
      simd_values_block<V, B, 1, NC>(f, tile, w, n_q, acc, m0, i);
      break;
    default:
      break;
  }
}

template <class V, int B>
void simd_values(const PackedRowFormat& f, const PackedTile& tile, const float* p, int64_t ld,
                 int64_t n_q, float* acc, float* acc_lo, float* scratch) {
  const int64_t d = f.head_dim, ng = f.n_groups, gs = f.group_size;
  float lo[kSimdMaxGroups], s[kSimdMaxGroups];
  for (int64_t r = 0; r < tile.n_rows; ++r) {  // weights p s_g and the offsets' sums
    const int64_t t = tile.rows[r];
    simd_meta<V>(tile.rec0 + t * tile.stride, f, lo, s);
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t m = 0; m < n_q; ++m) {
        const float pm = p[m * ld + t];
        scratch[(r * ng + g) * n_q + m] = pm * s[g];
        acc_lo[m * ng + g] += pm * lo[g];
      }
  }
  // Two vectors per step where both lie in one group (gs a multiple of 2 L), else one.
  int64_t i = 0;
  if (gs % (2 * V::L) == 0)
    for (; i + 2 * V::L <= d; i += 2 * V::L)
      simd_values_chunks<V, B, 2>(f, tile, scratch, n_q, acc, i);
  for (; i < d; i += V::L) simd_values_chunks<V, B, 1>(f, tile, scratch, n_q, acc, i);
}

// The kernel for f, or {} when f is not covered.
template <class V>
PackedKernel simd_kernel(const PackedRowFormat& f, CpuIsa isa) {
  if (f.spec.ternary() || f.group_size % V::L != 0 || f.head_dim % V::L != 0 ||
      f.n_groups > kSimdMaxGroups)
    return {};
  PackedKernel k;
  k.isa = isa;
  switch (f.spec.bits()) {
    case 1:
      k.keys = simd_keys<V, 1>;
      k.values = simd_values<V, 1>;
      return k;
    case 2:
      k.keys = simd_keys<V, 2>;
      k.values = simd_values<V, 2>;
      return k;
    case 4:
      k.keys = simd_keys<V, 4>;
      k.values = simd_values<V, 4>;
      return k;
    case 8:
      k.keys = simd_keys<V, 8>;
      k.values = simd_values<V, 8>;
      return k;
    default:
      return {};
  }
}
