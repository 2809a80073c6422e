// Internal: the tensor-core split kernel of fused decode attention, for views whose full-precision
// segments are all f16 (BF false) or all bf16 (BF true) and whose packed segments (if any) hold
// KB-bit keys and values (KB = 2 or 4) in groups of a multiple of 32 channels (records 4-byte
// aligned). A block reads one segment, so its operand type is uniform: a block of bf16 rows
// rounds its queries and probabilities to bf16 and multiplies on mma.m16n8k16 .bf16 (fp32
// accumulation; FlashAttention's bf16 numerics, 2^-8 relative where the text below says fp16's
// 2^-11), every other block (f16 rows, packed records) is exactly the fp16 path described below;
// "f16 rows" below means the view's 16-bit rows of either type. Templated on the head dim D,
// the GQA group G, PK (0: f16 segments only; 1: f16 and packed segments, any metadata type; 2: the
// same with f16 metadata, read without a type switch; 3: f16 metadata in groups of 32 and records
// of D KB / 8 code bytes + D / 8 metadata bytes, every record offset a compile-time constant) and
// KB, BF (G = 16, PK 0 or 3, runs decode_attention_mma16.cuh's block: the heads in the mma's M
// dimension). Included by
// decode_attention_mma_*.cu; the generic kernel in decode_attention_kernel.cuh takes every other
// view. Same parameters, partials and combine.
//
// One block = 4 warps = one (split, kv head, batch); the split's rows of one segment stream
// through a 3-stage (4-bit packed views: 2-stage) pipeline of tile_rows rows (a multiple of 64):
// f16 rows by cp.async, packed records as two byte ranges per tile, each one bulk copy issued by
// one thread and completing on the stage's mbarrier (sm_90; cp.async elsewhere). f16 rows are
// staged with their 16-byte chunks swizzled (chunk c of row r at c ^ swz(r & 7)) so that the key
// loads and the transposed value loads (ldmatrix.trans) are free of bank conflicts; packed records
// are staged as byte ranges. Each warp takes warp-tiles of 16 rows, two at a time (wt and wt + 4:
// the pair shares one softmax step), all on mma.m16n8k16 (fp16 inputs, fp32 accumulation):
//  (1) logits: A = 16 key rows x 16 channels, B = the queries as N = 8 columns: for G <= 4
//      n = 2 h + part (head h, part 0 the fp16 rounding of q * sigma_h, part 1 zero), for G = 8
//      n = h (sigma_h = 2^e puts max |q_h| in [2^11, 2^12)), so C holds (row, head) logits:
//      lane t's columns 2 t, 2 t + 1 are head t (G <= 4) or heads 2 t, 2 t + 1 (G = 8; one
//      n-tile and one softmax pass for the 8 heads). Channel map of chunk c (32 channels), k-step
//      s, K index k: 32 c + 8 t + 4 s + 2 (k >= 8) + k % 2 with t = (k % 8) / 2: lane (g, t) reads
//      8 contiguous channels of rows g and g + 8. Packed key codes are masked in place and read
//      as fp16 subnormals (exponent bits zero: the code times its in-place factor times 2^-24,
//      exact; one lop3 per pair, the 2^-24 undone in sigma's inverse); packed 2-bit keys take the
//      KB = 4 map below, the lane's 2 code bytes spread to bytes 0 and 2 so that K pair i reads
//      codes (i, i + 4) as 4^i c 2^-24 in place (q there carries 4^-i); per 32-channel block the
//      logit gains scale * C / sigma + lo * sum q.
//      KB = 4 (and the f16 rows of a KB = 4 view): K index k of k-step s holds channel
//      32 c + 8 t + 2 s + (k >= 8) + 4 (k % 2), i.e. the nibble pairs (j, j + 4) of the lane's
//      32-bit word of 8 codes, taken by masks (a high nibble in place: 16 c 2^-24, q of those
//      pairs carries 1/16; nibbles 2, 3 after one shift by 8; f16 rows: one byte permute).
//  (2) online softmax per head (exp2 of log2e-scaled logits; running max per warp and head).
//  (3) values: A = V^T (16 channels x 16 rows), B = the probabilities as N = 8 columns (the
//      same columns as the queries'; part-1 columns zero again). f16 metadata (PK >= 2): A holds
//      the dequantized values c * scale + lo, one fp16 fma per pair of codes (a lane's pair is one
//      channel of rows 2t, 2t + 1 or 2t + 8, 2t + 9, so the pair's scales and zero-points are one
//      half2 each), B = p. Other metadata types (PK 1): A the exact codes, B = p * scale of the
//      row's group, the zero-point sums p * lo on the side in fp32. f16 values arrive through
//      ldmatrix.x4.trans; 2-bit values are decoded in place: m-tile 2 b + mu of the 32-channel
//      block b maps row g to channel 32 b + 4 g + 2 mu and row g + 8 to the next channel, so a
//      lane's codes are one byte per row and block, each code read where it lies (PK 1: value 4^i c
//      for the i-th code of the byte, undone by an exact power-of-two scale later; PK >= 2: c
//      exactly, each position with its own magic number, see code_pair). KB = 4: the same channel
//      map, a lane's codes are the 16 bits at byte 16 b + 2 g of a row (4 nibbles: channels
//      +0..+3), made exact fp16 integers by mask + (x - 1024) for the low nibble of a byte and mask
//      + (x / 16 - 64) for the high one (both exact). f16 metadata (PK >= 2) takes the lane-unit
//      map instead (LaneCodes below): lane g's code units (a byte of 2-bit or a halfword of 4-bit
//      codes, 4 channels each) are the NCH consecutive units NCH g + b of a row, m-tile 2 b + mu
//      maps row g to channel 4 (NCH g + b) + 2 mu, so a lane's codes of a row are one or two
//      32-bit loads and its channels lie in one metadata group: one (lo, scale) load per row and
//      warp-tile instead of one per block (the same values and products, in another order).
// Numerics (FlashAttention's, docs/design.md section 4): q and p are rounded once to fp16 (2^-11
// relative; the zero-point chunk sums are sums of the rounded q), fp32 accumulation, softmax max
// and sum in fp32 from the unrounded p; packed values with f16 metadata are rounded once to fp16
// as dequantized values (2^-11 of |v|, the operand a dequantize-then-attend kernel would read; a
// group whose dequantized values pass 65504 overflows, which f16 metadata cannot hold anyway);
// PK 1's packed values use B = (p * 2^S) * scale, S warp-uniform and raised (the fp32 accumulators
// rescaled exactly) whenever a row's scale exceeds the binade of the largest seen so far in the
// split (any channel block), so S puts that scale in [2^14, 2^15) and the products accumulate in
// the mma accumulators directly (2^-S applied once at the merge); no term overflows and a term
// loses relative precision only below 2^-28 of that largest scale (fp16 subnormals: absolute error
// at most 2^-25 * 2^-S per term). f16 value rows use B = p <= 1 (terms under 2^-14 carry an
// absolute error of at most 2^-25 * |v|, within the fp32 accumulation budget of the tests). Rows
// past the split end are zero-filled in shared memory (f16 rows when staged, packed bytes once
// their tile has landed), so their p = 0 never meets a stale NaN; invisible rows get logit -inf.
#pragma once

#include <type_traits>

#include "cuda/decode_attention_kernel.cuh"

namespace vq::cuda::decode_mma {

using decode_impl::cp_async16;
using decode_impl::cp_async_commit;
using decode_impl::cp_async_wait;
using decode_impl::kFull;
using decode_impl::merge_slot;
using decode_impl::min64;
using decode_impl::mma_16816;
using decode_impl::write_partials;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Pipeline stages of an instance: 3, except 2 for 4-bit packed views (PK > 0, KB = 4), whose
// three 64-row stages of 160-byte records (66 KB with the queries) left 3 blocks per SM; two
// leave 4 (the register cap of kPackedMinBlocks), one tile in flight while the other is read.
// decode_mma_stages (decode_plan.h) is the planner's copy of this rule.
template <int PK, int KB>
constexpr int mma_stages() {
  return PK > 0 && KB == 4 ? 2 : 3;
}
// Resident blocks the packed kernels aim for with G <= 4 (register cap 65536 / (128 * this)).
#ifndef VQ_MMA_PACKED_MIN_BLOCKS
#define VQ_MMA_PACKED_MIN_BLOCKS 4
#endif
constexpr int kPackedMinBlocks = VQ_MMA_PACKED_MIN_BLOCKS;
// The same for G > 4 (the 8-head block and decode_attention_mma16.cuh's 16-head block).
#ifndef VQ_MMA_PACKED_MIN_BLOCKS_WIDE
#define VQ_MMA_PACKED_MIN_BLOCKS_WIDE 3
#endif
constexpr int kPackedMinBlocksWide = VQ_MMA_PACKED_MIN_BLOCKS_WIDE;

template <int D, int G>
struct MGeo {
  // One n-tile of 8 columns holds the group: columns per head CPH = 2 for G <= 4 (column 2 h:
  // head h, column 2 h + 1 zero: a C-fragment lane t holds head t), 1 for G = 8 (column h: lane t
  // holds heads 2 t and 2 t + 1); HL heads per C-fragment lane.
  static constexpr int CPH = G <= 4 ? 2 : 1;
  static constexpr int HL = 2 / CPH;
  static constexpr int NCH = D / 32;  // 32-channel chunks (blocks)
  static constexpr int MT = D / 16;   // m-tiles of the value accumulator
};

// Shared memory besides the stages: queries [G][D] and the transform's scratch [G][D], sigma [8],
// chunk sums [G][NCH], value bias [warps][G][NCH].
template <int D, int G>
constexpr int mma_extra_smem() {
  return (2 * G * D + 8 + G * (D / 32) + kWarps * G * (D / 32)) * 4;
}
// The block merge at the end reuses the stages: [warps][G] max and sum, [warps][G][D] accumulators.
template <int D, int G>
constexpr int mma_merge_bytes() {
  return (2 * kWarps * G + kWarps * G * D) * 4;
}

__device__ __forceinline__ int swz(int r) {  // a bijection of 0..7; rows 2i, 2i+1 differ in bit 2
  return ((r & 1) << 2) | ((r >> 1) & 3);
}

__device__ __forceinline__ uint32_t lds32(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
__device__ __forceinline__ uint32_t lds16(const uint8_t* p) {
  return *reinterpret_cast<const uint16_t*>(p);
}

// fp16 pair of the magic-biased codes: ((y & mask) | 0x6400 per half) - 1024, exact; the mask
// and the OR in one lop3 (the magic number in a register: one immediate per instruction).
// MAGIC (default 0x6400 = 1024): the fp16 bits 2^e of a binade whose mantissa unit is 1 at the
// masked bits' position, so that the masked code c reads as 2^e + c and the subtraction leaves c
// exactly: 2-bit codes at bits 2i take 2^(10 - 2i), i.e. 0x6400, 0x5C00, 0x5400, 0x4C00.
template <uint32_t MASK, uint32_t MAGIC = 0x6400u>
__device__ __forceinline__ uint32_t code_pair(uint32_t y) {
  uint32_t u;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(u) : "r"(y), "n"(MASK), "r"(MAGIC * 0x10001u));
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&u),
                            __halves2half2(__ushort_as_half(static_cast<unsigned short>(MAGIC)),
                                           __ushort_as_half(static_cast<unsigned short>(MAGIC))));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// c * scale + lo of a pair of codes (exact fp16 integers) in one fp16 fma: the pair's value
// operand, rounded once to fp16 (the dequantized cache a dequantize-then-attend kernel would read)
__device__ __forceinline__ uint32_t dequant_pair(uint32_t c, uint32_t sc, uint32_t lo) {
  const __half2 r =
      __hfma2(*reinterpret_cast<const __half2*>(&c), *reinterpret_cast<const __half2*>(&sc),
              *reinterpret_cast<const __half2*>(&lo));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// fp16 pair of the high nibbles of bytes 0 and 2 of y: ((y & 0x00f000f0) | 0x6400 per half) is
// 1024 + 16 c, and (1024 + 16 c) / 16 - 64 = c (one fma, every step exact).
__device__ __forceinline__ uint32_t code_pair_hi4(uint32_t y) {
  uint32_t u;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(u) : "r"(y), "n"(0x00f000f0u), "r"(0x64006400u));
  const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&u),
                            __halves2half2(__ushort_as_half(0x2c00), __ushort_as_half(0x2c00)),
                            __halves2half2(__ushort_as_half(0xd400), __ushort_as_half(0xd400)));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// The B operand of two values for a lane of column part `part`: their fp16 (BF: bf16) roundings
// for part 0, zeros for part 1 (the columns of the former lo parts; FlashAttention numerics,
// docs/design.md section 4: one rounding per q and p operand, fp32 accumulation).
template <bool BF = false>
__device__ __forceinline__ uint32_t pack_part(float x0, float x1, int part) {
  if constexpr (BF) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    return part ? 0u : *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(x0, x1);
    return part ? 0u : *reinterpret_cast<const uint32_t*>(&h);
  }
}

// d += a * b on mma.m16n8k16 with fp32 accumulation: fp16 operands (mma_16816), or bf16 with BF.
template <bool BF>
__device__ __forceinline__ void mma_rows(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (BF)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    mma_16816(d, a0, a1, a2, a3, b0, b1);
}

// 2^x of x <= 0 on the special function unit (exp2f's approximation without its subnormal
// fix-up: a result below 2^-126 becomes 0, an absolute change under 2^-126)
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void ldsm_x4_trans(const uint8_t* addr, uint32_t& r0, uint32_t& r1,
                                              uint32_t& r2, uint32_t& r3) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
}

// (lo, scale) of group g of a 4-byte aligned record at rec (meta: 0 f16, 1 f32, 2 fp8; MF: f16).
template <bool MF>
__device__ __forceinline__ void meta_a(const uint8_t* rec, int code_bytes, int meta, int g,
                                       float& lo, float& sc) {
  if (MF || meta == 0) {  // the halves of one word, converted in place (no shift)
    const uint32_t w = lds32(rec + code_bytes + 4 * g);
    const __half2 h = *reinterpret_cast<const __half2*>(&w);
    lo = __low2float(h);
    sc = __high2float(h);
  } else if (meta == 1) {
    lo = __uint_as_float(lds32(rec + code_bytes + 8 * g));
    sc = __uint_as_float(lds32(rec + code_bytes + 8 * g + 4));
  } else {
    const uint32_t w = lds16(rec + code_bytes + 2 * g);
    lo = decode_impl::fp8e4m3_to_f32(w & 0xffu);
    sc = decode_impl::fp8e4m3_to_f32((w >> 8) & 0xffu);
  }
}

// ---- pieces shared by decode_mma_block and decode_mma16_block (decode_attention_mma16.cuh) ----

// The split's visible rows [vis_lo, vis_hi) under implicit positions (first_pos + i: i <= q_pos -
// first_pos, and i > q_pos - first_pos - window with a window), in the split's row index.
__device__ __forceinline__ void visible_rows(const DecodeParams& p, const DecodeSegmentParams& sg,
                                             int64_t r_begin, int n_split, int& vis_lo,
                                             int& vis_hi) {
  const int64_t q_rel = p.q_pos - sg.first_pos - r_begin;
  const int64_t lo = p.window > 0 ? q_rel - p.window + 1 : 0;
  vis_lo = static_cast<int>(lo < 0 ? 0 : (lo > n_split ? n_split : lo));
  const int64_t hi = q_rel + 1;
  vis_hi = static_cast<int>(hi < 0 ? 0 : (hi > n_split ? n_split : hi));
}

// Whether row rl of the tile at row_rel (nr rows) is visible: implicit positions by the interval,
// explicit ones (pos0: the split's first) by the query position and window.
__device__ __forceinline__ bool row_visible(const DecodeParams& p, const int32_t* pos0, int row_rel,
                                            int rl, int nr, int vis_lo, int vis_hi) {
  if (!pos0) {
    const int rel = row_rel + rl;
    return rel >= vis_lo && rel < vis_hi;
  }
  if (rl >= nr) return false;
  const int64_t pj = pos0[row_rel + rl];
  return pj <= p.q_pos && (p.window <= 0 || p.q_pos < pj + p.window);
}

// Stage nr rows of K (gk) and V (gv) into sk / sv. Rows (f16 or bf16, D channels): cp.async of
// the 16-byte chunks, chunk c of row r at c ^ swz(r & 7), the rest of the last 16-row warp-tile
// zeroed. Packed records (krec / vrec bytes each): the two byte ranges, as bulk copies by one
// thread completing on *bar (sm_90), else cp.async of the whole 16-byte words.
template <int D>
__device__ __forceinline__ void stage_tile(bool packed, uint8_t* sk, uint8_t* sv, const uint8_t* gk,
                                           const uint8_t* gv, int nr, int krec, int vrec,
                                           uint64_t* bar, int tid) {
  if (!packed) {
    constexpr int RB = 2 * D, CPR = D / 8;  // row bytes, 16-byte chunks per row
    for (int i = tid; i < nr * CPR; i += kThreads) {
      const int r = i / CPR, c = i % CPR;
      const int o = r * RB + 16 * (c ^ swz(r & 7));
      cp_async16(sk + o, gk + 16 * i);
      cp_async16(sv + o, gv + 16 * i);
    }
    const int nr16 = (nr + 15) & ~15;
    for (int i = nr * CPR + tid; i < nr16 * CPR; i += kThreads) {
      *reinterpret_cast<uint4*>(sk + 16 * i) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(sv + 16 * i) = make_uint4(0u, 0u, 0u, 0u);
    }
  } else if constexpr (decode_impl::kBulkCopy) {
    // a few instructions per tile instead of a cp.async and its address per 16 bytes
    if (tid == 0) {
      const uint32_t nk = decode_impl::bulk_range_bytes(gk, nr * krec);
      const uint32_t nv = decode_impl::bulk_range_bytes(gv, nr * vrec);
      decode_impl::mbar_expect_tx(bar, nk + nv);
      decode_impl::bulk_range(sk, gk, nk, bar);
      decode_impl::bulk_range(sv, gv, nv, bar);
    }
  } else {
    decode_impl::copy_range(sk, gk, static_cast<int64_t>(nr) * krec, tid);
    decode_impl::copy_range(sv, gv, static_cast<int64_t>(nr) * vrec, tid);
  }
}

// A partial last tile of packed records (nr of 16 n_wt rows): zero the bytes of its missing rows
// (their metadata would otherwise be stale or uninitialised shared memory, and 0 * NaN is NaN).
__device__ __forceinline__ void zero_missing_records(uint8_t* sk, int SH, int kmis, int vmis,
                                                     int nr, int n_wt, int krb, int vrb, int tid) {
  for (int i = kmis + nr * krb + tid; i < kmis + 16 * n_wt * krb; i += kThreads) sk[i] = 0;
  for (int i = vmis + nr * vrb + tid; i < vmis + 16 * n_wt * vrb; i += kThreads) sk[SH + i] = 0;
  __syncthreads();
}

// The G queries of block head bh (p.q), times scale * log2 e, into qs [G][D] (qtmp [G][D]
// scratch), transformed for packed keys; sigma_h = 2^e putting max |q_h| in [2^11, 2^12) into
// ssig [G]. Ends with a block barrier.
template <int D, int G>
__device__ __forceinline__ void load_queries(const DecodeParams& p, int64_t bh, int kvh,
                                             bool packed, float* qs, float* qtmp, float* ssig,
                                             int tid) {
  const int lane = tid & 31, warp = tid >> 5;
  const float* qg = p.q + (bh * G) * D;
  for (int i = tid; i < G * D; i += kThreads) qs[i] = qg[i] * p.scale_log2;
  __syncthreads();
  if (packed && (p.pk.k_signs || p.pk.k_perm))
    decode_impl::transform_queries<D, G>(qs, qtmp, p.pk, kvh / p.kv_rep, tid);
  for (int h = warp; h < G; h += kWarps) {
    float mx = 0.0f;
    for (int d = lane; d < D; d += 32) mx = fmaxf(mx, fabsf(qs[h * D + d]));
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    if (lane == 0) {
      float sgm = 1.0f;
      if (mx > 0.0f && mx < INFINITY) {
        int e = 0;
        frexpf(mx, &e);  // mx = f 2^e, f in [0.5, 1)
        sgm = ldexpf(1.0f, max(-100, min(100, 12 - e)));
      }
      ssig[h] = sgm;
    }
  }
  __syncthreads();
}

// The packed key codes of one row's 32-channel chunk c for lane t (rg: the row's record) as the
// four K pairs' fp16 subnormals (in-place factors 4^i for 2-bit codes, 16 for 4-bit high nibbles).
template <int KB>
__device__ __forceinline__ void key_code_pairs(const uint8_t* rg, int c, int t, uint32_t (&a)[4]) {
  if constexpr (KB == 2) {
    // the lane's 8 codes (2 bytes) spread to bytes 0 and 2: codes (m, m + 4) then sit at bits
    // 2m of the two halves, read in place as 4^m times their value
    const uint32_t y = __byte_perm(lds16(rg + 8 * c + 2 * t), 0u, 0x4140);
    a[0] = y & 0x00030003u;
    a[1] = y & 0x000C000Cu;
    a[2] = y & 0x00300030u;
    a[3] = y & 0x00C000C0u;
  } else {  // nibbles (j, j + 4) of the lane's 8 codes: j = 0, 1 in place, 2, 3 after >> 8
    const uint32_t w = lds32(rg + 16 * c + 4 * t);
    a[0] = w & 0x000f000fu;
    a[1] = w & 0x00f000f0u;
    a[2] = (w >> 8) & 0x000f000fu;
    a[3] = (w >> 8) & 0x00f000f0u;
  }
}

// The value codes of f16-metadata views (MF) under the lane-unit map: lane g takes the NCH code
// units NCH g + b (b < NCH; KB = 2: a byte, KB = 4: a halfword, channels 4 (NCH g + b) + 0..3) of
// a row, BYTES bytes at byte BYTES g of its codes (4-byte aligned records: BYTES g is a multiple of
// BYTES, so one 16-bit or one or two 32-bit loads). The lane's channels span 4 NCH <= 16, inside
// one metadata group of any multiple of 32 channels.
template <int D, int KB>
struct LaneCodes {
  static constexpr int NCH = D / 32;
  static constexpr int BYTES = NCH * KB / 2;
  static constexpr int WORDS = BYTES >= 4 ? BYTES / 4 : 1;
  uint32_t w[WORDS];
  __device__ __forceinline__ void load(const uint8_t* rec, int g) {
    const uint8_t* q = rec + BYTES * g;
    if constexpr (BYTES < 4) {
      w[0] = lds16(q);
    } else {
#pragma unroll
      for (int i = 0; i < WORDS; ++i) w[i] = lds32(q + 4 * i);
    }
  }
  // the metadata group of lane g's channels (gs: the group size, a multiple of 32)
  static __device__ __forceinline__ int group(int g, int gs) {
    return 4 * NCH * g / gs;
  }
  // the channel of code o (< 4) of unit b of lane g
  static __device__ __forceinline__ int channel(int g, int b, int o) {
    return 4 * (NCH * g + b) + o;
  }
};

// The value code pairs of ya (rows 2 t, 2 t + 1) and yc (+ 8) as exact fp16 integers: e the
// channels + 0, + 1 of the lane's byte (2-bit) or halfword (4-bit), f + 2, + 3; registers 0, 1:
// ya's, 2, 3: yc's. MAGIC: the in-place 2-bit codes as 4^i c (false) or c (true).
template <int KB, bool EXACT2>
__device__ __forceinline__ void value_code_pairs(uint32_t ya, uint32_t yc, uint32_t (&e)[4],
                                                 uint32_t (&f)[4]) {
  if constexpr (KB == 2) {
    // m-tile / n-tile of channel + 0 (x1), + 1 (x4), + 2 (x16), + 3 (x64), or exactly c
    constexpr uint32_t M1 = EXACT2 ? 0x5C00u : 0x6400u, M2 = EXACT2 ? 0x5400u : 0x6400u,
                       M3 = EXACT2 ? 0x4C00u : 0x6400u;
    e[0] = code_pair<0x00030003u, 0x6400u>(ya);
    e[1] = code_pair<0x000C000Cu, M1>(ya);
    e[2] = code_pair<0x00030003u, 0x6400u>(yc);
    e[3] = code_pair<0x000C000Cu, M1>(yc);
    f[0] = code_pair<0x00300030u, M2>(ya);
    f[1] = code_pair<0x00C000C0u, M3>(ya);
    f[2] = code_pair<0x00300030u, M2>(yc);
    f[3] = code_pair<0x00C000C0u, M3>(yc);
  } else {  // nibbles 0, 1 in place, 2, 3 after >> 8; exact
    const uint32_t ya8 = ya >> 8, yc8 = yc >> 8;
    e[0] = code_pair<0x000f000fu>(ya);
    e[1] = code_pair_hi4(ya);
    e[2] = code_pair<0x000f000fu>(yc);
    e[3] = code_pair_hi4(yc);
    f[0] = code_pair<0x000f000fu>(ya8);
    f[1] = code_pair_hi4(ya8);
    f[2] = code_pair<0x000f000fu>(yc8);
    f[3] = code_pair_hi4(yc8);
  }
}

// A lane's value operands of one warp-tile under the lane-unit map (f16 metadata): the codes of
// rows 2 t, 2 t + 1, 2 t + 8, 2 t + 9 (LaneCodes) and those rows' (lo, scale) of the lane's group
// as half2 pairs, read once; unit(b, e, f) gives unit b's dequantized fp16 pairs: e channels + 0,
// + 1, f + 2, + 3, registers 0, 1 rows 2 t, 2 t + 1 and 2, 3 rows + 8 (value_code_pairs'
// order), each c * scale + lo in one fp16 fma. Both tensor-core blocks take their values so.
template <int D, int KB>
struct LaneValues {
  LaneCodes<D, KB> r[4];
  uint32_t lo01, sc01, lo89, sc89;
  // rec: the four rows' records; mo: the byte offset of the lane's metadata group in a record
  __device__ __forceinline__ void load(const uint8_t* const (&rec)[4], int g, int mo) {
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i].load(rec[i], g);
    const uint32_t m0 = lds32(rec[0] + mo), m1 = lds32(rec[1] + mo);
    const uint32_t m2 = lds32(rec[2] + mo), m3 = lds32(rec[3] + mo);
    lo01 = __byte_perm(m0, m1, 0x5410);
    sc01 = __byte_perm(m0, m1, 0x7632);
    lo89 = __byte_perm(m2, m3, 0x5410);
    sc89 = __byte_perm(m2, m3, 0x7632);
  }
  __device__ __forceinline__ void unit(int b, uint32_t (&e)[4], uint32_t (&f)[4]) const {
    // unit b of a row pair as value_code_pairs reads it: KB = 2 the first row's byte at byte 0
    // and the second's at byte 2; KB = 4 the first's halfword low, the second's high
    const auto pair = [&](const LaneCodes<D, KB>& a, const LaneCodes<D, KB>& c) {
      if constexpr (KB == 2) {
        return __byte_perm(a.w[0], c.w[0], static_cast<uint32_t>(b | ((4 + b) << 8)));
      } else {
        return __byte_perm(a.w[b >> 1], c.w[b >> 1], (b & 1) ? 0x7632u : 0x5410u);
      }
    };
    value_code_pairs<KB, true>(pair(r[0], r[1]), pair(r[2], r[3]), e, f);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      e[i] = dequant_pair(e[i], i < 2 ? sc01 : sc89, i < 2 ? lo01 : lo89);
      f[i] = dequant_pair(f[i], i < 2 ? sc01 : sc89, i < 2 ? lo01 : lo89);
    }
  }
};

// One block's work over the parameters p (the kernel parameter itself, or a batched launch's copy
// of its sequence's parameters in shared memory) for batch row b; bars: the stages' mbarriers,
// initialised and published by the caller.
template <int D, int G, int PK, int KB, bool BF>
__device__ __forceinline__ void decode_mma_block(const DecodeParams& p, const int b,
                                                 uint64_t* bars) {
  constexpr int kStages = mma_stages<PK, KB>();
  using Gm = MGeo<D, G>;
  static_assert(KB == 2 || KB == 4, "2- or 4-bit codes");
  constexpr bool MF = PK >= 2;
  constexpr bool FIX = PK == 3;  // compile-time record layout (group 32, f16 metadata)
  constexpr int KREC = D * KB / 8 + D / 8;
  constexpr bool Q4 = PK > 0 && KB == 4;  // the K-index -> channel map of 4-bit codes
  constexpr int CPH = Gm::CPH, HL = Gm::HL, NCH = Gm::NCH, MT = Gm::MT;
  constexpr int RB = 2 * D;  // f16 (or bf16) row bytes
  extern __shared__ __align__(16) uint8_t smem[];
  const int SH = p.stage_half_bytes;
  uint8_t* stages = smem;
  float* qs = reinterpret_cast<float*>(smem + kStages * 2 * SH);  // [G][D]
  float* ssig = qs + G * D;                                       // [8]
  float* sqsum = ssig + 8;                                        // [G][NCH]
  float* sbias = sqsum + G * NCH;                                 // [warps][G][NCH]
  float* qtmp = sbias + kWarps * G * NCH;                         // [G][D]

  decode_impl::grid_dependency_trigger();
  int kvh = 0;
  const int split = decode_impl::block_split(p, kvh);
  if (split >= p.n_splits) return;  // batched: past this sequence's splits
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  int si = 0;
  while (si + 1 < p.n_segments && split >= p.seg[si + 1].split_begin) ++si;
  const DecodeSegmentParams& sg = p.seg[si];
  const bool packed = PK > 0 && sg.packed != 0;
  const int64_t r_begin = static_cast<int64_t>(split - sg.split_begin) * sg.rows_per_split;
  const int64_t r_end = min64(sg.n_rows, r_begin + sg.rows_per_split);
  const int64_t bh = static_cast<int64_t>(b) * p.n_kv_heads + kvh;
  const int64_t kbh = decode_impl::kv_bh(p, b, kvh);  // the stored head's rows
  const int krb = FIX ? (packed ? KREC : RB) : sg.k_row_bytes;
  const int vrb = FIX ? (packed ? KREC : RB) : sg.v_row_bytes;
  const int TR = sg.tile_rows;
  const int kcb = FIX ? D * KB / 8 : p.pk.k_code_bytes, vcb = FIX ? D * KB / 8 : p.pk.v_code_bytes;
  const uint8_t* kbase = sg.k + kbh * sg.capacity * krb;
  const uint8_t* vbase = sg.v + kbh * sg.capacity * vrb;
  const int32_t* pos = sg.positions ? sg.positions + kbh * sg.capacity : nullptr;

  // ---- the first stages are in flight while the queries are prepared
  const int64_t n_split_rows = r_end - r_begin;
  const int n_tiles = static_cast<int>((n_split_rows + TR - 1) / TR);
  // implicit positions first_pos + i: the visible rows are one interval [vis_lo, vis_hi) of the
  // split's row index (i <= q_pos - first_pos, and i > q_pos - first_pos - window with a window)
  int vis_lo = 0, vis_hi = 0;
  visible_rows(p, sg, r_begin, static_cast<int>(n_split_rows), vis_lo, vis_hi);
  // kept in registers: otherwise the 64-bit bound arithmetic is redone for every row
  asm volatile("" : "+r"(vis_lo), "+r"(vis_hi));
  // the split's first row of K, V and positions: the tiles' offsets from them are 32-bit
  // (a split's rows times a row's bytes stay far below 2^31)
  const int n_split = static_cast<int>(n_split_rows);
  const uint8_t* kb0 = kbase + r_begin * krb;
  const uint8_t* vb0 = vbase + r_begin * vrb;
  const int32_t* pos0 = pos ? pos + r_begin : nullptr;
  // tile tt into stage st (tile tt + kStages - 1 is issued while tile tt is read)
  auto issue = [&](int tt, int st) {
    const int r0 = tt * TR;
    uint8_t* sk = stages + st * 2 * SH;
    stage_tile<D>(packed, sk, sk + SH, kb0 + r0 * krb, vb0 + r0 * vrb, min(TR, n_split - r0), krb,
                  vrb, &bars[st], tid);
  };
#pragma unroll
  for (int tt = 0; tt < kStages - 1; ++tt) {
    if (tt < n_tiles) issue(tt, tt);
    cp_async_commit();
  }

  // ---- queries: scaled by scale * log2 e, transformed for packed keys, rounded to fp16 per lane
  load_queries<D, G>(p, bh, kvh, packed, qs, qtmp, ssig, tid);
  // every query value becomes the tensor-core operand it will be (fp16 rounding of q * sigma, times
  // 4^-i for 2-bit packed keys and 16^-(i % 2) for 4-bit ones, exactly undone), so the chunk sums
  // below are sums of the operands and the folded zero-points add no error of their own
  // (docs/design.md section 4)
  {
    const bool k2r = PK > 0 && KB == 2 && packed;
    const bool k4r = Q4 && packed;
    const bool bfq = BF && !packed;  // a block of bf16 rows: bf16 query operands
    for (int i = tid; i < G * D; i += kThreads) {
      const int d = i % D;
      const float fac = ssig[i / D] * (k2r   ? __int_as_float((127 - 2 * (d & 3)) << 23)
                                       : k4r ? ((d & 1) ? 0.0625f : 1.0f)
                                             : 1.0f);
      const float x = qs[i] * fac;
      qs[i] = (bfq ? __bfloat162float(__float2bfloat16_rn(x)) : __half2float(__float2half_rn(x))) *
              (1.0f / fac);
    }
  }
  __syncthreads();
  if (packed) {  // the chunk sums of the zero-points (rows take none)
    for (int i = tid; i < G * NCH; i += kThreads) sqsum[i] = decode_impl::chunk_sum(qs, D, i);
    __syncthreads();
  }
  uint32_t qb[NCH][4];
  // 2-bit packed keys take the 4-bit channel map (K pair i of the lane = channels (i, i + 4) of its
  // 8), their codes read 4^i times their value in place; q carries the exact inverse 4^-i. 4-bit
  // packed keys read the high nibble of a byte in place too (16 times its value): q of the odd K
  // pairs carries 1/16. Packed key codes are read as fp16 subnormals (below)
  const bool k2p = PK > 0 && KB == 2 && packed;
  const bool k4p = Q4 && packed;
  const bool qmap4 = Q4 || k2p;
  {
    const int h = g / CPH, part = g % CPH;  // the B column of this lane: head h, part
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t w = 0u;
        if (h < G) {
          const int ch = 32 * c + 8 * t + (qmap4 ? i : 2 * i), ch1 = ch + (qmap4 ? 4 : 1);
          const float f = k2p                ? __int_as_float((127 - 2 * i) << 23)  // 4^-i
                          : (k4p && (i & 1)) ? 0.0625f
                                             : 1.0f;
          const float sgm = ssig[h] * f;
          w = BF && !packed ? pack_part<true>(qs[h * D + ch] * sgm, qs[h * D + ch1] * sgm, part)
                            : pack_part(qs[h * D + ch] * sgm, qs[h * D + ch1] * sgm, part);
        }
        qb[c][i] = w;
      }
  }
  // Packed key codes enter the mma as fp16 subnormals (code bits masked in place, exponent zero:
  // the value is the code times 2^-24 times its in-place factor, exact), so C is 2^-24 times the
  // product of the magic-number form, with no subtraction per code pair. A packed block's sinv
  // carries the 2^24 back, and MF's chunk sums carry 2^-24 so that both terms of the running logit
  // share the scale; every factor is a power of two in range (sigma in [2^-100, 2^100], scaled
  // chunk sums >= 2^-24 times their value), so the logits are those of the magic-number form.
  constexpr float kSub = 16777216.0f;  // 2^24
  float sinv[HL], qsum[HL][NCH];
#pragma unroll
  for (int hl = 0; hl < HL; ++hl) {
    const int h = (2 * t + hl) / CPH;  // this lane's C-fragment head hl
    sinv[hl] = h < G ? (packed ? kSub : 1.0f) / ssig[h] : 0.0f;
    // MF: the logits of packed keys are accumulated times sigma (bounded metadata, so no overflow:
    // |scale|, |lo| <= 65504, sigma-scaled chunk sums <= 2^17, C <= 2^19) and scaled back once
#pragma unroll
    for (int c = 0; c < NCH; ++c)
      qsum[hl][c] =
          packed && h < G ? sqsum[h * NCH + c] * (MF ? ssig[h] * (1.0f / kSub) : 1.0f) : 0.0f;
  }

  float m_run[HL], l_run[HL];
  float vacc[MT][4];  // columns 2 t, 2 t + 1: heads (2 t) / CPH, (2 t + 1) / CPH (G <= 4: zero)
  float vb[NCH];      // PK 1: sum of p * lo per block for head hb (part-0 lanes)
#pragma unroll
  for (int hl = 0; hl < HL; ++hl) {
    m_run[hl] = -INFINITY;
    l_run[hl] = 0.0f;
  }
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) vacc[j][i] = 0.0f;
#pragma unroll
  for (int c = 0; c < NCH; ++c) vb[c] = 0.0f;

  const int hb = g / CPH, partb = g % CPH;  // the B-operand column of this lane: head hb, part
  int grpc[NCH];                            // metadata group of each 32-channel block
#pragma unroll
  for (int c = 0; c < NCH; ++c) grpc[c] = FIX ? c : (32 * c) / p.pk.group_size;
  // PK 1's packed values: one power of two 2^S, warp-uniform, kept while the split streams (S puts
  // the largest scale seen so far in [2^14, 2^15); a larger one rescales the accumulators exactly,
  // as the online softmax does), so the products p * 2^S * scale accumulate in the mma's fp32
  // accumulators directly; exv = that scale's biased exponent
  int exv = 15;

  const int kmis0 = decode_impl::misalign16(kb0), vmis0 = decode_impl::misalign16(vb0);
  // tile tt sits in stage `stage`; that stage's barrier completes its phase `phase` for it (the
  // k-th use of a stage completes phase k, parity k & 1)
  int stage = 0;
  uint32_t phase = 0;
  for (int tt = 0; tt < n_tiles; ++tt) {
    if (tt + kStages - 1 < n_tiles) issue(tt + kStages - 1, stage == 0 ? kStages - 1 : stage - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    if (decode_impl::kBulkCopy && packed) decode_impl::mbar_wait(&bars[stage], phase);
    __syncthreads();

    const int row_rel = tt * TR;
    const int nr = min(TR, n_split - row_rel);
    const uint8_t* sk = stages + stage * 2 * SH;
    const uint8_t* sv = sk + SH;
    const int kmis = (kmis0 + row_rel * krb) & 15;
    const int vmis = (vmis0 + row_rel * vrb) & 15;
    const int n_wt = (nr + 15) / 16;
    // implicit positions and every row of the tile's warp-tiles visible (no padded rows): no
    // per-row visibility test
    const bool all_vis = !pos && row_rel >= vis_lo && row_rel + 16 * n_wt <= vis_hi;
    if (++stage == kStages) stage = 0, phase ^= 1u;
    if (packed && nr < 16 * n_wt)  // a partial last tile
      zero_missing_records(const_cast<uint8_t*>(sk), SH, kmis, vmis, nr, n_wt, krb, vrb, tid);

    // Warp-tiles in pairs (wt and wt + kWarps; 128-row tiles give every warp exactly two): the
    // two tiles' code decoding, metadata loads and mma chains are independent, so they overlap,
    // and the pair shares one softmax step (one max reduction, one rescale) and one test of the
    // packed values' power of two. A lone last warp-tile takes the W = 1 instance.
    const auto step = [&](const int wt, auto wtag) {
      constexpr int W = decltype(wtag)::value;
      int rb0[W];
#pragma unroll
      for (int w = 0; w < W; ++w) rb0[w] = (wt + w * kWarps) * 16;
      // ---- (1) logits of rows rb0 + g and rb0 + g + 8 for the lane's heads (2 t + hl) / CPH
      float lg[W][HL][2];
#pragma unroll
      for (int w = 0; w < W; ++w)
#pragma unroll
        for (int hl = 0; hl < HL; ++hl) lg[w][hl][0] = lg[w][hl][1] = 0.0f;
      if (!packed) {
#pragma unroll
        for (int w = 0; w < W; ++w) {
          float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          const uint8_t* rg = sk + (rb0[w] + g) * RB;
          const uint8_t* rg8 = rg + 8 * RB;
          const int sw = swz(g);
#pragma unroll
          for (int c = 0; c < NCH; ++c) {
            uint4 ka = *reinterpret_cast<const uint4*>(rg + 16 * ((4 * c + t) ^ sw));
            uint4 kb = *reinterpret_cast<const uint4*>(rg8 + 16 * ((4 * c + t) ^ sw));
            if constexpr (Q4) {  // channel pairs (0,1),(2,3),(4,5),(6,7) -> (0,4),(1,5),(2,6),(3,7)
              ka = make_uint4(__byte_perm(ka.x, ka.z, 0x5410), __byte_perm(ka.x, ka.z, 0x7632),
                              __byte_perm(ka.y, ka.w, 0x5410), __byte_perm(ka.y, ka.w, 0x7632));
              kb = make_uint4(__byte_perm(kb.x, kb.z, 0x5410), __byte_perm(kb.x, kb.z, 0x7632),
                              __byte_perm(kb.y, kb.w, 0x5410), __byte_perm(kb.y, kb.w, 0x7632));
            }
            mma_rows<BF>(acc, ka.x, kb.x, ka.y, kb.y, qb[c][0], qb[c][1]);
            mma_rows<BF>(acc, ka.z, kb.z, ka.w, kb.w, qb[c][2], qb[c][3]);
          }
          // C element 2 j + e: row g + 8 j, column 2 t + e (CPH 2: e = 1 the zero part column)
#pragma unroll
          for (int hl = 0; hl < HL; ++hl) {
            lg[w][hl][0] = (CPH == 2 ? acc[0] + acc[1] : acc[hl]) * sinv[hl];
            lg[w][hl][1] = (CPH == 2 ? acc[2] + acc[3] : acc[2 + hl]) * sinv[hl];
          }
        }
      } else if constexpr (PK > 0) {
#pragma unroll
        for (int w = 0; w < W; ++w) {
          const uint8_t* rg = sk + kmis + (rb0[w] + g) * krb;
          const uint8_t* rg8 = rg + 8 * krb;
#pragma unroll
          for (int c = 0; c < NCH; ++c) {
            uint32_t a[4], a8[4];
            if constexpr (KB == 2) {
              // the lane's 8 codes (2 bytes) spread to bytes 0 and 2: codes (m, m + 4) then sit
              // at bits 2m of the two halves, read in place as 4^m times their value
              const uint32_t y0 = __byte_perm(lds16(rg + 8 * c + 2 * t), 0u, 0x4140);
              const uint32_t y1 = __byte_perm(lds16(rg8 + 8 * c + 2 * t), 0u, 0x4140);
              a[0] = y0 & 0x00030003u;  // fp16 subnormals 4^m c 2^-24
              a8[0] = y1 & 0x00030003u;
              a[1] = y0 & 0x000C000Cu;
              a8[1] = y1 & 0x000C000Cu;
              a[2] = y0 & 0x00300030u;
              a8[2] = y1 & 0x00300030u;
              a[3] = y0 & 0x00C000C0u;
              a8[3] = y1 & 0x00C000C0u;
            } else {  // nibbles (j, j + 4) of the lane's 8 codes: j = 0, 1 in place, 2, 3 >> 8
              // (fp16 subnormals c 2^-24 for a low nibble, 16 c 2^-24 for a high one)
              const uint32_t w0 = lds32(rg + 16 * c + 4 * t), w1 = lds32(rg8 + 16 * c + 4 * t);
              a[0] = w0 & 0x000f000fu;
              a[1] = w0 & 0x00f000f0u;
              a[2] = (w0 >> 8) & 0x000f000fu;
              a[3] = (w0 >> 8) & 0x00f000f0u;
              a8[0] = w1 & 0x000f000fu;
              a8[1] = w1 & 0x00f000f0u;
              a8[2] = (w1 >> 8) & 0x000f000fu;
              a8[3] = (w1 >> 8) & 0x00f000f0u;
            }
            float lo0, sc0, lo1, sc1;
            meta_a<MF>(rg, kcb, p.pk.k_meta, grpc[c], lo0, sc0);
            meta_a<MF>(rg8, kcb, p.pk.k_meta, grpc[c], lo1, sc1);
            float cc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_16816(cc, a[0], a8[0], a[1], a8[1], qb[c][0], qb[c][1]);
            mma_16816(cc, a[2], a8[2], a[3], a8[3], qb[c][2], qb[c][3]);
            // CPH 2: cc[1], cc[3] are the part-1 columns, whose queries are zero (finite codes:
            // 0 exactly); CPH 1: head 2 t + 1's
#pragma unroll
            for (int hl = 0; hl < HL; ++hl) {
              const float s0 = MF ? cc[hl] : cc[hl] * sinv[hl];
              const float s1 = MF ? cc[2 + hl] : cc[2 + hl] * sinv[hl];
              lg[w][hl][0] = fmaf(sc0, s0, fmaf(lo0, qsum[hl][c], lg[w][hl][0]));
              lg[w][hl][1] = fmaf(sc1, s1, fmaf(lo1, qsum[hl][c], lg[w][hl][1]));
            }
          }
          if constexpr (MF) {
#pragma unroll
            for (int hl = 0; hl < HL; ++hl) {
              lg[w][hl][0] *= sinv[hl];  // exact (a power of two)
              lg[w][hl][1] *= sinv[hl];
            }
          }
        }
      }
      if (!all_vis) {
#pragma unroll
        for (int w = 0; w < W; ++w)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            if (!row_visible(p, pos0, row_rel, rb0[w] + g + 8 * j, nr, vis_lo, vis_hi)) {
#pragma unroll
              for (int hl = 0; hl < HL; ++hl) lg[w][hl][j] = -INFINITY;
            }
          }
      }

      // ---- (2) online softmax per head (2 t + hl) / CPH (uniform over the 8 lanes g of a t)
      float pr[W][HL][2], al[HL];
      bool grow = false;
#pragma unroll
      for (int hl = 0; hl < HL; ++hl) {
        float tmax = fmaxf(lg[0][hl][0], lg[0][hl][1]);
#pragma unroll
        for (int w = 1; w < W; ++w) tmax = fmaxf(tmax, fmaxf(lg[w][hl][0], lg[w][hl][1]));
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, o));
        const float m_new = fmaxf(m_run[hl], tmax);
        float psum = 0.0f;
        if (m_new == -INFINITY) {
          al[hl] = 1.0f;
#pragma unroll
          for (int w = 0; w < W; ++w) pr[w][hl][0] = pr[w][hl][1] = 0.0f;
        } else {
          al[hl] = ex2_ftz(m_run[hl] - m_new);
#pragma unroll
          for (int w = 0; w < W; ++w) {
            pr[w][hl][0] = ex2_ftz(lg[w][hl][0] - m_new);
            pr[w][hl][1] = ex2_ftz(lg[w][hl][1] - m_new);
            psum += pr[w][hl][0] + pr[w][hl][1];
          }
        }
        l_run[hl] = fmaf(l_run[hl], al[hl], psum);
        m_run[hl] = m_new;
        grow |= al[hl] != 1.0f;
      }
      if (__any_sync(kFull, grow)) {
        // accumulator element i holds column 2 t + (i & 1): head (2 t + (i & 1)) / CPH
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) vacc[j][i] *= al[HL == 2 ? (i & 1) : 0];
        if constexpr (PK == 1) {  // vb is head hb's: its factor from the C-fragment lane of hb
          float ab = __shfl_sync(kFull, al[0], hb * CPH / 2);
          if constexpr (HL == 2) {
            const float ab1 = __shfl_sync(kFull, al[1], hb / 2);
            ab = (hb & 1) ? ab1 : ab;
          }
#pragma unroll
          for (int c = 0; c < NCH; ++c) vb[c] *= ab;
        }
      }

      // ---- (3) values: the probabilities of rows 2t, 2t+1, 2t+8, 2t+9 for head hb, from the
      // C-fragment lanes g' = row % 8, t' = hb CPH / 2 (element hl' = hb CPH % 2)
      float pv[W][4];
      {
        const int src = 8 * t + hb * CPH / 2;
        // zero for the part-1 columns (and heads past G): their B operands need no select
        const bool on = hb < G && partb == 0;
#pragma unroll
        for (int w = 0; w < W; ++w) {
          float a0 = __shfl_sync(kFull, pr[w][0][0], src);
          float a1 = __shfl_sync(kFull, pr[w][0][0], src + 4);
          float a2 = __shfl_sync(kFull, pr[w][0][1], src);
          float a3 = __shfl_sync(kFull, pr[w][0][1], src + 4);
          if constexpr (HL == 2) {
            const float b0 = __shfl_sync(kFull, pr[w][1][0], src);
            const float b1 = __shfl_sync(kFull, pr[w][1][0], src + 4);
            const float b2 = __shfl_sync(kFull, pr[w][1][1], src);
            const float b3 = __shfl_sync(kFull, pr[w][1][1], src + 4);
            if (hb & 1) a0 = b0, a1 = b1, a2 = b2, a3 = b3;
          }
          pv[w][0] = on ? a0 : 0.0f;
          pv[w][1] = on ? a1 : 0.0f;
          pv[w][2] = on ? a2 : 0.0f;
          pv[w][3] = on ? a3 : 0.0f;
        }
      }
      if (!packed) {
#pragma unroll
        for (int w = 0; w < W; ++w) {
          const uint32_t b0 = pack_part<BF>(pv[w][0], pv[w][1], 0);
          const uint32_t b1 = pack_part<BF>(pv[w][2], pv[w][3], 0);
          const int lr = rb0[w] + (lane & 7) + 8 * (lane >> 4);
          const uint8_t* rowp = sv + lr * RB;
          const int lsw = swz(lane & 7), half = (lane >> 3) & 1;
#pragma unroll
          for (int j = 0; j < MT; ++j) {
            uint32_t a0, a1, a2, a3;
            ldsm_x4_trans(rowp + 16 * ((2 * j + half) ^ lsw), a0, a1, a2, a3);
            mma_rows<BF>(vacc[j], a0, a1, a2, a3, b0, b1);
          }
        }
      } else if constexpr (PK > 0) {
        const uint8_t* rec[W][4];
#pragma unroll
        for (int w = 0; w < W; ++w) {
          const int ra = rb0[w] + 2 * t;
          rec[w][0] = sv + vmis + ra * vrb;
          rec[w][1] = sv + vmis + (ra + 1) * vrb;
          rec[w][2] = sv + vmis + (ra + 8) * vrb;
          rec[w][3] = sv + vmis + (ra + 9) * vrb;
        }
        if constexpr (MF) {
          // f16 metadata: each pair of codes (rows 2t, 2t + 1 or 2t + 8, 2t + 9 of one channel)
          // becomes its dequantized fp16 values c * scale + lo in one fp16 fma (the row pair's
          // scales and zero-points gathered into half2 by one permute each), B = fp16(p) for
          // every block: FlashAttention over the dequantized cache, one rounding per operand
          uint32_t pb[W][2];
#pragma unroll
          for (int w = 0; w < W; ++w) {
            pb[w][0] = pack_part(pv[w][0], pv[w][1], 0);
            pb[w][1] = pack_part(pv[w][2], pv[w][3], 0);
          }
          // the lane-unit map (LaneValues): each row's codes in one or two loads, its (lo, scale)
          // once per warp-tile
          using LC = LaneCodes<D, KB>;
          const int mo = vcb + 4 * (FIX ? LC::group(g, 32) : LC::group(g, p.pk.group_size));
#pragma unroll
          for (int w = 0; w < W; ++w) {  // one warp-tile's codes live at a time (registers)
            LaneValues<D, KB> lv;
            lv.load(rec[w], g, mo);
#pragma unroll
            for (int c = 0; c < NCH; ++c) {
              uint32_t e[4], f[4];  // m-tile 2c: channels +0, +1; m-tile 2c + 1: +2, +3
              lv.unit(c, e, f);
              mma_16816(vacc[2 * c], e[0], e[1], e[2], e[3], pb[w][0], pb[w][1]);
              mma_16816(vacc[2 * c + 1], f[0], f[1], f[2], f[3], pb[w][0], pb[w][1]);
            }
          }
        } else {
          // the block map: lane g's byte (KB = 2) or halfword (KB = 4) of each block's codes
          const int wo = KB == 2 ? 4 * (g >> 2) : 4 * (g >> 1);
          const int bstride = 4 * KB;  // bytes of a 32-channel block's codes
          // KB = 2: byte g & 3 of rows ra and ra + 1 at bytes 0 and 2; KB = 4: the halfword
          // (g & 1) of the word of rows ra and ra + 1 in the two halves
          const uint32_t psel = static_cast<uint32_t>((g & 3) | ((4 + (g & 3)) << 8));
          const uint32_t qsel = (g & 1) ? 0x7632u : 0x5410u;
          float pu[W][4];  // p * 2^S (exact)
          {
            const float up = __int_as_float((268 - exv) << 23);  // 2^S, S = 141 - exv
#pragma unroll
            for (int w = 0; w < W; ++w)
#pragma unroll
              for (int r = 0; r < 4; ++r) pu[w][r] = pv[w][r] * up;
          }
#pragma unroll
          for (int c = 0; c < NCH; ++c) {
            uint32_t e[W][4], f[W][4];
            float lo[W][4], sc[W][4];
            float smax = 0.0f;
#pragma unroll
            for (int w = 0; w < W; ++w) {
              const uint32_t ya =
                  __byte_perm(lds32(rec[w][0] + bstride * c + wo),
                              lds32(rec[w][1] + bstride * c + wo), KB == 2 ? psel : qsel);
              const uint32_t yc =
                  __byte_perm(lds32(rec[w][2] + bstride * c + wo),
                              lds32(rec[w][3] + bstride * c + wo), KB == 2 ? psel : qsel);
              // m-tile 2c: channels +0 (x1) and +1 (x4); m-tile 2c + 1: +2 (x16) and +3 (x64)
              value_code_pairs<KB, false>(ya, yc, e[w], f[w]);
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                meta_a<MF>(rec[w][r], vcb, p.pk.v_meta, grpc[c], lo[w][r], sc[w][r]);
                smax = fmaxf(smax, sc[w][r]);
              }
            }
            // p * scale <= the largest scale seen (p <= 1): 2^S puts that in [2^14, 2^15), so the
            // fp16 operands stay normal and finite whatever the scales (the same S for every lane);
            // a scale of a larger binade (rare after the first tile) raises S for the whole warp
            if (__any_sync(kFull, smax >= __int_as_float((exv + 1) << 23))) {
              float m = fmaxf(smax, __shfl_xor_sync(kFull, smax, 1));
              m = fmaxf(m, __shfl_xor_sync(kFull, m, 2));  // the lanes t share the rows of a tile
              const int ex = max(exv, min(max((__float_as_int(m) >> 23) & 0xff, 15), 250));
              if (ex > exv) {
                const float fs = ldexpf(1.0f, exv - ex);  // exact, or below 2^-126 of the new
#pragma unroll
                for (int j = 0; j < MT; ++j)
#pragma unroll
                  for (int i = 0; i < 4; ++i) vacc[j][i] *= fs;
#pragma unroll
                for (int w = 0; w < W; ++w)
#pragma unroll
                  for (int r = 0; r < 4; ++r) pu[w][r] *= fs;
                exv = ex;
              }
            }
#pragma unroll
            for (int w = 0; w < W; ++w) {
              const uint32_t bb0 = pack_part(pu[w][0] * sc[w][0], pu[w][1] * sc[w][1], 0);
              const uint32_t bb1 = pack_part(pu[w][2] * sc[w][2], pu[w][3] * sc[w][3], 0);
              mma_16816(vacc[2 * c], e[w][0], e[w][1], e[w][2], e[w][3], bb0, bb1);
              mma_16816(vacc[2 * c + 1], f[w][0], f[w][1], f[w][2], f[w][3], bb0, bb1);
              if constexpr (!MF) {
                float s = vb[c];
                s = fmaf(pv[w][0], lo[w][0], s);
                s = fmaf(pv[w][1], lo[w][1], s);
                s = fmaf(pv[w][2], lo[w][2], s);
                s = fmaf(pv[w][3], lo[w][3], s);
                vb[c] = s;
              }
            }
          }
        }
      }
    };
    for (int wt = warp; wt < n_wt; wt += 2 * kWarps) {
      if (wt + kWarps < n_wt)
        step(wt, std::integral_constant<int, 2>{});
      else
        step(wt, std::integral_constant<int, 1>{});
    }
    __syncthreads();  // the stage is refilled next iteration
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- merge the warps: [warps][G] max and sum, [warps][G][D] accumulators, [warps][G][NCH] bias
  float* wm = reinterpret_cast<float*>(stages);
  float* wl = wm + kWarps * G;
  float* wacc = wl + kWarps * G;
  if constexpr (PK == 1) {
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
      float s = vb[c];
      s += __shfl_xor_sync(kFull, s, 1);
      s += __shfl_xor_sync(kFull, s, 2);
      if (t == 0 && partb == 0 && hb < G) sbias[(warp * G + hb) * NCH + c] = packed ? s : 0.0f;
    }
  }
#pragma unroll
  for (int hl = 0; hl < HL; ++hl) {
    float l = l_run[hl];
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l += __shfl_xor_sync(kFull, l, o);
    const int h = (2 * t + hl) / CPH;
    if (g == 0 && h < G) {
      wm[warp * G + h] = m_run[hl];
      wl[warp * G + h] = l;
    }
    if (h < G) {
      float* dst = wacc + (warp * G + h) * D;
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        // rows g, g + 8 of m-tile j, column 2 t + hl (CPH 2: + the zero part column 2 t + 1)
        float v0 = CPH == 2 ? vacc[j][0] + vacc[j][1] : vacc[j][hl];
        float v1 = CPH == 2 ? vacc[j][2] + vacc[j][3] : vacc[j][2 + hl];
        if (!MF && packed) {                                  // undo 2^S of the block (exact)
          const float dn = __int_as_float((exv - 14) << 23);  // 2^-S
          v0 *= dn;
          v1 *= dn;
        }
        if (!packed) {
          dst[merge_slot(h, 16 * j + g)] = v0;
          dst[merge_slot(h, 16 * j + g + 8)] = v1;
        } else {
          const int c = j >> 1, mu = j & 1;
          const int ch = MF ? LaneCodes<D, KB>::channel(g, c, 2 * mu) : 32 * c + 4 * g + 2 * mu;
          if constexpr (KB == 2 && !MF) {  // undo the in-place code scales 1, 4, 16, 64 (exact)
            dst[merge_slot(h, ch)] = v0 * (mu ? 0.0625f : 1.0f);
            dst[merge_slot(h, ch + 1)] = v1 * (mu ? 0.015625f : 0.25f);
          } else {
            dst[merge_slot(h, ch)] = v0;
            dst[merge_slot(h, ch + 1)] = v1;
          }
        }
      }
    }
  }
  __syncthreads();
  write_partials<D, G, true>(p, bh, split, wm, wl, wacc, PK == 1 && packed ? sbias : nullptr, tid);
}

}  // namespace vq::cuda::decode_mma

#include "cuda/decode_attention_mma16.cuh"

namespace vq::cuda::decode_mma {

// One block of the kernel: G = 16 (rows alone, PK 0, or fixed group-32 records, PK 3) takes the
// heads-in-M block of decode_attention_mma16.cuh, every other group decode_mma_block.
template <int D, int G, int PK, int KB, bool BF>
__device__ __forceinline__ void run_mma_block(const DecodeParams& p, const int b, uint64_t* bars) {
  if constexpr (G == 16) {
    decode_mma16_block<D, PK, KB, BF>(p, b, bars);
  } else {
    decode_mma_block<D, G, PK, KB, BF>(p, b, bars);
  }
}

// BATCH: a batched launch reads sequence blockIdx.z's own parameters from its kernel parameter
// (DecodeBatchArg, decode_attention.cuh), with batch index 0; a single launch reads its one
// DecodeParams. f16 rows (PK == 0) read them in place, constant-bank reads: staged in shared
// memory they cost f16 rows 18% at 8 x 32K (313 against 261 us; docs/results/gpu/run10_decode/c6)
// and the engine's batched full-cache decode 15% (docs/results/gpu/run12_s13/d1). Packed rows
// stage them in shared memory first: read in place, at a dynamic index, they cost the engine's
// K2V2 decode 5-7% at 8 x 32K (same calls, d1 and d2).
template <bool BATCH>
using MmaArg = std::conditional_t<BATCH, DecodeBatchArg, DecodeParams>;

template <int D, int G, int PK, int KB, bool BF, bool BATCH>
__global__ void __launch_bounds__(kThreads,
                                  PK == 0 ? 2 : (G <= 4 ? kPackedMinBlocks : kPackedMinBlocksWide))
    decode_mma_kernel(const __grid_constant__ MmaArg<BATCH> P) {
  constexpr int kStages = mma_stages<PK, KB>();
  // packed tiles arrive by bulk copies (sm_90), one mbarrier per stage
  __shared__ __align__(8) uint64_t bars[kStages];
  if (PK > 0 && decode_impl::kBulkCopy && threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) decode_impl::mbar_init(&bars[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (BATCH && PK > 0) {
    __shared__ __align__(16) DecodeParams sp;
    decode_impl::stage_params(P.seq[blockIdx.z], 0, sp);  // its barrier publishes the init
    run_mma_block<D, G, PK, KB, BF>(sp, 0, bars);
  } else if constexpr (BATCH) {
    __syncthreads();  // the barriers' init
    run_mma_block<D, G, PK, KB, BF>(P.seq[blockIdx.z], 0, bars);
  } else {
    __syncthreads();  // the barriers' init
    run_mma_block<D, G, PK, KB, BF>(P, static_cast<int>(blockIdx.z), bars);
  }
}

template <int D, int G, int PK, int KB, bool BF>
int mma_smem_bytes(const DecodeParams& p) {
  return mma_stages<PK, KB>() * 2 * p.stage_half_bytes + mma_extra_smem<D, G>();
}

// The kernel instance of p's launch kind (p.seqs: batched) with its shared-memory attributes set,
// passed to f with its bytes of dynamic shared memory and std::bool_constant<batched>.
template <int D, int G, int PK, int KB, bool BF, class F>
void with_mma_kernel(const DecodeParams& p, F&& f) {
  const int smem = mma_smem_bytes<D, G, PK, KB, BF>(p);
  auto prepare = [&](auto kern, auto batched) {
    VQ_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    VQ_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    f(kern, smem, batched);
  };
  if (p.seqs) {
    prepare(decode_mma_kernel<D, G, PK, KB, BF, true>, std::true_type{});
  } else {
    prepare(decode_mma_kernel<D, G, PK, KB, BF, false>, std::false_type{});
  }
}

template <int D, int G, int PK, int KB, bool BF>
void launch_mma_dg(const DecodeParams& p, const DecodeBatchArg* batch, cudaStream_t s) {
  VQ_CHECK(!p.seqs || (batch && p.batch <= kDecodeBatchInline),
           "[decode_attention] internal: a batched tensor-core launch takes at most " +
               std::to_string(kDecodeBatchInline) + " sequences' parameters by value but got " +
               std::to_string(p.batch) + (batch ? "" : " and none"));
  const dim3 grid = decode_impl::split_grid(p, p.n_splits, p.batch);
  with_mma_kernel<D, G, PK, KB, BF>(p, [&](auto kern, int smem, auto batched) {
    if constexpr (decltype(batched)::value) {
      kern<<<grid, kThreads, smem, s>>>(*batch);
    } else {
      kern<<<grid, kThreads, smem, s>>>(p);
    }
  });
  VQ_CUDA_LAUNCH_CHECK(decode_mma_kernel);
}

template <int D, int G, int PK, int KB, bool BF>
int blocks_per_sm_dg(const DecodeParams& p) {
  int n = 0;
  with_mma_kernel<D, G, PK, KB, BF>(p, [&](auto kern, int smem, auto) {
    VQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, kThreads, smem));
  });
  return n;
}

// Launch (or, with query, the resident blocks per SM) of one (PK, KB, BF) for the view's D and G.
template <int PK, int KB, bool BF>
int mma_dispatch(const DecodeParams& p, const DecodeBatchArg* batch, cudaStream_t s, bool query);

#define VQ_DECODE_MMA_INSTANTIATE(PK, KB, BF)                                                      \
  template <>                                                                                      \
  int mma_dispatch<PK, KB, BF>(const DecodeParams& p, const DecodeBatchArg* batch, cudaStream_t s, \
                               bool query) {                                                       \
    auto pick = [&](auto launch, auto occ) { return query ? occ(p) : (launch(p, batch, s), 0); };  \
    const int D = p.head_dim, G = p.group;                                                         \
    if constexpr (PK == 0 || PK == 3) {                                                            \
      if (G == 16 && D == 64)                                                                      \
        return pick(launch_mma_dg<64, 16, PK, KB, BF>, blocks_per_sm_dg<64, 16, PK, KB, BF>);      \
      if (G == 16)                                                                                 \
        return pick(launch_mma_dg<128, 16, PK, KB, BF>, blocks_per_sm_dg<128, 16, PK, KB, BF>);    \
    }                                                                                              \
    if (D == 64) {                                                                                 \
      if (G == 1)                                                                                  \
        return pick(launch_mma_dg<64, 1, PK, KB, BF>, blocks_per_sm_dg<64, 1, PK, KB, BF>);        \
      if (G == 2)                                                                                  \
        return pick(launch_mma_dg<64, 2, PK, KB, BF>, blocks_per_sm_dg<64, 2, PK, KB, BF>);        \
      if (G == 4)                                                                                  \
        return pick(launch_mma_dg<64, 4, PK, KB, BF>, blocks_per_sm_dg<64, 4, PK, KB, BF>);        \
      return pick(launch_mma_dg<64, 8, PK, KB, BF>, blocks_per_sm_dg<64, 8, PK, KB, BF>);          \
    }                                                                                              \
    if (G == 1)                                                                                    \
      return pick(launch_mma_dg<128, 1, PK, KB, BF>, blocks_per_sm_dg<128, 1, PK, KB, BF>);        \
    if (G == 2)                                                                                    \
      return pick(launch_mma_dg<128, 2, PK, KB, BF>, blocks_per_sm_dg<128, 2, PK, KB, BF>);        \
    if (G == 4)                                                                                    \
      return pick(launch_mma_dg<128, 4, PK, KB, BF>, blocks_per_sm_dg<128, 4, PK, KB, BF>);        \
    return pick(launch_mma_dg<128, 8, PK, KB, BF>, blocks_per_sm_dg<128, 8, PK, KB, BF>);          \
  }

}  // namespace vq::cuda::decode_mma
