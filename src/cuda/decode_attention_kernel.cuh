// Internal: the split kernel of fused decode attention, templated on the head dim D, the GQA group
// G = H_q / H_kv, and the key/value code bits KB/VB (0/0: full-precision segments only).
// Included by the instance files decode_attention_k*.cu, one per (KB, VB), so the instances
// compile in parallel; decode_attention.cu holds the combine kernel and the dispatcher.
//
// One block = 4 warps = one (split, kv head, batch). The split's rows of ONE segment stream
// through a 3-stage cp.async pipeline of byte ranges (tile_rows rows of K and of V per stage,
// copied as aligned 16-byte words, so packed records of any stride and alignment arrive as is).
// Each warp takes warp-tiles of 8 rows: (1) logits of the 8 rows for all G heads, LPR lanes per
// row, lane `sub` owning pieces of 8 channels at 8*(sub + k*LPR) (q for those channels in
// registers, pre-scaled by scale*log2 e); a transposed shuffle reduction leaves one head's sum per
// lane; (2) an online-softmax step per head (running max and sum per warp, exp2, lazy rescale
// only when a max grows); (3) the value accumulation with the same lane -> channel map.
// Packed rows are read in place: a piece's codes c_j and its group's (lo, scale) give
//   logit += scale * sum_j q'_j c_j + lo * sum_j q'_j        (q' = P R q, transformed once)
//   acc'_j += (p * scale) c_j,   bias += p * lo             (acc' in stored order)
// and the combine kernel un-permutes / un-rotates the value accumulator once per query head.
// Step (1) runs on the tensor cores (mma.m16n8k16, fp32 accumulation, queries rounded once to
// fp16) for fp16 rows and 2-bit codes in groups of a multiple of 32; see mma_logits below.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/check.h"
#include "cuda/decode_attention.cuh"
#include "veloxquant/packed.h"

namespace vq::cuda::decode_impl {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kStages = 3;
constexpr int kWarpTile = 8;                        // rows per online-softmax step of a warp
constexpr int kHalfBytes = kDecodeStageBytes + 32;  // one stage of K (or V) + alignment slack
constexpr unsigned kFull = 0xffffffffu;

constexpr int log2i(int x) {
  return x <= 1 ? 0 : 1 + log2i(x / 2);
}
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

// Lane geometry of one (D, G) instance: q and the accumulator take G * CPL registers each (<= 64).
template <int D, int G>
struct Geo {
  // lanes per row: G * CPL <= 32 q (and accumulator) registers where 8-channel pieces allow it
  // (G = 8 keeps 64), at least D / 16 lanes (at most 16 channels per lane).
  static constexpr int LPR_W = (D * G / 32 > D / 16) ? D * G / 32 : D / 16;
  static constexpr int LPR = LPR_W < D / 8 ? LPR_W : D / 8;
  static constexpr int CPL = D / LPR;   // channels per lane
  static constexpr int NP = CPL / 8;    // 8-channel pieces
  static constexpr int RPS = 32 / LPR;  // rows per warp step
  static constexpr int STEPS = kWarpTile / RPS;
  static constexpr int TSTEPS = log2i(G) < log2i(LPR) ? log2i(G) : log2i(LPR);
  static_assert(CPL % 8 == 0 && NP >= 1 && RPS >= 1 && kWarpTile % RPS == 0, "lane geometry");
  static_assert(LPR >= G, "one head per lane after the transposed reduction");
};

// Dynamic shared memory of the split kernel.
template <int D, int G>
constexpr int split_smem_bytes() {
  return kStages * 2 * kHalfBytes + G * D * 4 + kWarps * kWarpTile * G * 4 + D * 32 +
         16 * (D / 32) * 4 + 16 * 4;  // + the tensor-core query fragments (below)
}

// ---- small device helpers --------------------------------------------------------------------

// The parameter block a block runs with, copied into shared memory sp by the whole block: a
// batched launch's sequence z (DecodeParams::seqs), else the launch's own P. Read from shared
// memory (not through a pointer that may be the kernel parameter or global memory) the
// parameters stay as cheap to reload as the kernel parameter was: measured with ptxas, no
// register spills where reading through the pointer spilled up to 192 bytes.
__device__ __forceinline__ void stage_params(const DecodeParams& P, unsigned z, DecodeParams& sp) {
  static_assert(sizeof(DecodeParams) % 4 == 0);
  const DecodeParams& src = P.seqs ? P.seqs[z] : P;
  const int* s4 = reinterpret_cast<const int*>(&src);
  int* d4 = reinterpret_cast<int*>(&sp);
  for (unsigned i = threadIdx.x; i < sizeof(DecodeParams) / 4; i += blockDim.x) d4[i] = s4[i];
  __syncthreads();
}

// Index [b, stored KV head] of block head kvh (DecodeParams::kv_rep blocks share a stored head):
// where its rows and positions sit in a segment's [B, H_kv, capacity] arrays.
__device__ __forceinline__ int64_t kv_bh(const DecodeParams& p, int b, int kvh) {
  return static_cast<int64_t>(b) * (p.n_kv_heads / p.kv_rep) + kvh / p.kv_rep;
}

// The grid's x index counts (split, block of the stored head) pairs, the kv_rep blocks of one
// split next to each other: the later ones read the rows the first brought into L2. y is the
// stored head. Returns the split; kvh gets the block head (kv_rep * y + its block).
__device__ __forceinline__ int block_split(const DecodeParams& p, int& kvh) {
  const int x = static_cast<int>(blockIdx.x);
  kvh = static_cast<int>(blockIdx.y) * p.kv_rep + x % p.kv_rep;
  return x / p.kv_rep;
}

// The split kernels' grid: (n_splits * kv_rep, H_kv stored heads, z) for n_splits splits.
inline dim3 split_grid(const DecodeParams& p, int n_splits, int z) {
  return dim3(static_cast<unsigned>(n_splits * p.kv_rep),
              static_cast<unsigned>(p.n_kv_heads / p.kv_rep), static_cast<unsigned>(z));
}

// Programmatic dependent launch (sm_90): the split kernels let the combine grid launch at their
// entry; the combine waits for their completion (and memory) before reading the partials.

__device__ __forceinline__ void grid_dependency_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gmem_src));
}
// Hopper's bulk copies (TMA without a tensor map) into shared memory, completing on an mbarrier:
// one thread arms the barrier with the bytes it expects and issues the copies; every thread
// waits on the barrier's phase. Addresses and sizes are multiples of 16 bytes. sm_90 and later;
// kBulkCopy says whether this compilation has them (the callers keep cp.async otherwise).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kBulkCopy = true;
#else
constexpr bool kBulkCopy = false;
#endif
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
#endif
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes,
                                              uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
#endif
}
// The byte range [src, src + n) as one bulk copy of whole aligned 16-byte words into dst (16-byte
// aligned shared memory), starting at src rounded down to 16, completing on bar; thread 0 of the
// block issues it. Returns the bytes the copy moves (for the barrier's expected count).
__device__ __forceinline__ uint32_t bulk_range_bytes(const uint8_t* src, int n) {
  const int mis = static_cast<int>(reinterpret_cast<uintptr_t>(src) & 15);
  return static_cast<uint32_t>((mis + n + 15) & ~15);
}
__device__ __forceinline__ void bulk_range(uint8_t* dst, const uint8_t* src, uint32_t bytes,
                                           uint64_t* bar) {
  const uint8_t* s0 = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src) &
                                                       ~static_cast<uintptr_t>(15));
  bulk_copy_g2s(dst, s0, bytes, bar);
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Copies the byte range [src, src + n) into dst (16-byte aligned shared memory) as whole aligned
// 16-byte words starting at src rounded down to 16; returns that rounding (src - aligned start).
__device__ __forceinline__ int copy_range(uint8_t* dst, const uint8_t* src, int64_t n, int tid) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(src);
  const uintptr_t a0 = a & ~static_cast<uintptr_t>(15);
  const int mis = static_cast<int>(a - a0);
  const int n16 = static_cast<int>((static_cast<int64_t>(mis) + n + 15) >> 4);
  const uint8_t* s0 = reinterpret_cast<const uint8_t*>(a0);
  for (int i = tid; i < n16; i += kThreads) cp_async16(dst + 16 * i, s0 + 16 * i);
  return mis;
}

__device__ __forceinline__ int misalign16(const uint8_t* p) {
  return static_cast<int>(reinterpret_cast<uintptr_t>(p) & 15);
}

// 4 bytes at any byte offset of 4-byte aligned shared memory.
__device__ __forceinline__ uint32_t lds_u32_any(const uint8_t* base, uint32_t off) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(base + (off & ~3u));
  return __funnelshift_r(w[0], w[1], (off & 3u) * 8u);
}

// The KB / VB of the any-bits instance (decode_attention_kany.cu): codes of any CodeSpec (1..8
// bits, or three levels five to a byte) for keys and values alike, the spec read at run time
// from DecodePackedParams::k_bits_x2 / v_bits_x2, each code read as a plain integer float
// (load_codes_any below); views whose bit pair has no instance of its own take it.
constexpr int kAnyBits = 16;

// Codes decode to floats without shifting them down: code j of a piece is read in place as
// c_j * 2^code_exp<BITS>(j) (the masked bits OR-ed into the mantissa of 2^23, minus 2^23, all
// exact below 2^23), and the query is pre-scaled by 2^-code_exp, so every product q_j c_j is
// bit-identical to the unscaled one. 8-bit codes are byte-permuted into place (exponent 0).
template <int BITS>
__host__ __device__ constexpr int code_exp(int j) {
  return BITS == 2 ? 2 * j : (BITS == 4 ? 4 * (j % 4) : 0);
}
// 2^-code_exp<BITS>(j) as a compile-time float (a multiplication by it is exact).
template <int BITS>
__host__ __device__ constexpr float code_unscale(int j) {
  float f = 1.0f;
  for (int e = 0; e < code_exp<BITS>(j); ++e) f *= 0.5f;
  return f;
}

// Metadata decoders (packed.h's host/device codecs) on the low bits of a loaded word.
__device__ __forceinline__ float fp8e4m3_to_f32(uint32_t c) {
  return fp8_e4m3_decode(c);  // callers pass the byte masked
}

__device__ __forceinline__ float f16_bits_to_f32(uint32_t h) {
  return fp16_bits_to_f32(static_cast<uint16_t>(h & 0xffffu));
}

// (lo, scale) of group g of a record at byte offset rec of base; meta: 0 f16, 1 f32, 2 fp8.
__device__ __forceinline__ void load_meta(const uint8_t* base, uint32_t rec, int code_bytes,
                                          int meta, int g, float& lo, float& sc) {
  if (meta == 0) {
    const uint32_t w = lds_u32_any(base, rec + code_bytes + 4 * g);
    lo = f16_bits_to_f32(w);
    sc = f16_bits_to_f32(w >> 16);
  } else if (meta == 1) {
    lo = __uint_as_float(lds_u32_any(base, rec + code_bytes + 8 * g));
    sc = __uint_as_float(lds_u32_any(base, rec + code_bytes + 8 * g + 4));
  } else {
    const uint32_t w = lds_u32_any(base, rec + code_bytes + 2 * g);
    lo = fp8e4m3_to_f32(w & 0xffu);
    sc = fp8e4m3_to_f32((w >> 8) & 0xffu);
  }
}

// The 8 codes of piece `piece` (channels 8*piece .. 8*piece+7) of a record at offset rec, as
// exact integer floats, for any code spec (packed.h: b-bit codes at bits [j b, j b + b) of a
// little-endian stream, so 8 codes are the b bytes at piece * b; three-level codes are the
// base-3 digits j % 5 of byte j / 5).
__device__ __forceinline__ void load_codes_any(const uint8_t* base, uint32_t rec, int piece,
                                               int bits_x2, float (&c)[8]) {
  if (bits_x2 == 3) {  // packed.h's own reader: base-3 digit i % 5 of byte i / 5
    CodeSpec spec;
    spec.bits_x2 = 3;
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = static_cast<float>(code_at(base + rec, 8 * piece + j, spec));
    return;
  }
  const int b = bits_x2 / 2;
  const uint32_t off = rec + static_cast<uint32_t>(piece * b);
  const uint64_t w = static_cast<uint64_t>(lds_u32_any(base, off)) |
                     (static_cast<uint64_t>(lds_u32_any(base, off + 4)) << 32);
  const uint32_t mask = (1u << b) - 1u;
#pragma unroll
  for (int j = 0; j < 8; ++j) c[j] = static_cast<float>(static_cast<uint32_t>(w >> (j * b)) & mask);
}

// The 8 codes of piece `piece` (channels 8*piece .. 8*piece+7) of a record at offset rec, as
// c_j * 2^code_exp<BITS>(j) (kAnyBits: load_codes_any with the run's bits_x2, exponent 0).
template <int BITS>
__device__ __forceinline__ void load_codes(const uint8_t* base, uint32_t rec, int piece,
                                           float (&c)[8], int bits_x2 = 0) {
  const uint32_t off = rec + static_cast<uint32_t>(piece * BITS);  // 8 codes = BITS bytes
  if constexpr (BITS == kAnyBits) {
    (void)off;
    load_codes_any(base, rec, piece, bits_x2, c);
  } else if constexpr (BITS == 8) {
    const uint32_t w0 = lds_u32_any(base, off), w1 = lds_u32_any(base, off + 4);
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // bytes [c, 0, 0, 0x4B] = 2^23 + c
      c[j] = __uint_as_float(__byte_perm(w0, 0x4B000000u, 0x7440u + j)) - 8388608.0f;
      c[j + 4] = __uint_as_float(__byte_perm(w1, 0x4B000000u, 0x7440u + j)) - 8388608.0f;
    }
  } else if constexpr (BITS == 4) {
    const uint32_t w = lds_u32_any(base, off);
    const uint32_t hi = w >> 16;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      c[j] = __uint_as_float((w & (0xFu << (4 * j))) | 0x4B000000u) - 8388608.0f;
      c[j + 4] = __uint_as_float((hi & (0xFu << (4 * j))) | 0x4B000000u) - 8388608.0f;
    }
  } else {
    static_assert(BITS == 2, "code bits 2, 4 or 8");
    const uint32_t w = lds_u32_any(base, off);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      c[j] = __uint_as_float((w & (0x3u << (2 * j))) | 0x4B000000u) - 8388608.0f;
  }
}

// 8 full-precision elements at byte offset off (16-byte aligned) of a row of dtype dt.
__device__ __forceinline__ void load_fp8x(const uint8_t* base, uint32_t off, int dt,
                                          float (&x)[8]) {
  if (dt == 1) {  // f16
    const uint4 u = *reinterpret_cast<const uint4*>(base + off);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  } else if (dt == 2) {  // bf16
    const uint4 u = *reinterpret_cast<const uint4*>(base + off);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {  // f32: the piece is 32 bytes
    const float4 a = *reinterpret_cast<const float4*>(base + off);
    const float4 b = *reinterpret_cast<const float4*>(base + off + 16);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  }
}

// Transposed reduction of G partial sums over the LPR lanes of a row: every step hands half of
// the remaining heads to the partner lane, so G heads cost G/2 + G/4 + ... shuffles instead of
// G * log2(LPR); the rest is a plain butterfly. Returns the head whose full sum v[0] now holds.
template <int G, int LPR, int TSTEPS>
__device__ __forceinline__ int reduce_heads(float (&v)[G], int sub) {
  int head0 = 0;
#pragma unroll
  for (int s = 0; s < TSTEPS; ++s) {
    const int o = LPR >> (s + 1);
    const int half = G >> (s + 1);
    const bool upper = (sub & o) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half];
      const float keep = upper ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(kFull, send, o);
    }
    if (upper) head0 += half;
  }
#pragma unroll
  for (int o = LPR >> (TSTEPS + 1); o >= 1; o >>= 1) v[0] += __shfl_xor_sync(kFull, v[0], o);
  return head0;
}

// In-place rotation of G query vectors in shared memory for a packed segment: x <- P (R x),
// R = H_norm diag(signs) blockwise (hadamard.h), P the stored-channel gather. tmp: G*D floats.
template <int D, int G>
__device__ void transform_queries(float* qs, float* tmp, const DecodePackedParams& pk, int kvh,
                                  int tid) {
  if (pk.k_signs) {
    const float* sg = pk.k_signs + static_cast<int64_t>(kvh) * D;
    for (int i = tid; i < G * D; i += kThreads) qs[i] *= sg[i % D];
    __syncthreads();
    for (int span = 1; span < pk.k_rot_block; span *= 2) {
      for (int i = tid; i < G * D / 2; i += kThreads) {
        const int h = i / (D / 2), jj = i % (D / 2);
        const int lo = (jj / span) * 2 * span + (jj % span);
        float* x = qs + h * D;
        const float a = x[lo], c = x[lo + span];
        x[lo] = a + c;
        x[lo + span] = a - c;
      }
      __syncthreads();
    }
    for (int i = tid; i < G * D; i += kThreads) qs[i] *= pk.k_rot_norm;
    __syncthreads();
  }
  if (pk.k_perm) {
    const int32_t* pm = pk.k_perm + static_cast<int64_t>(kvh) * D;
    for (int i = tid; i < G * D; i += kThreads) tmp[i] = qs[(i / D) * D + pm[i % D]];
    __syncthreads();
    for (int i = tid; i < G * D; i += kThreads) qs[i] = tmp[i];
    __syncthreads();
  }
}

// ---- tensor-core key logits (fp16 rows, 2-bit packed rows with groups of a multiple of 32) ----
// One warp-tile of 8 rows is the N = 8 side of mma.m16n8k16 (fp32 accumulation); the M = 16
// side holds the queries: row m = 2 h + part is head h's query scaled by sigma_h = 2^e (largest
// |q| in [2^11, 2^12)), part 0 its fp16 rounding (one rounding, 2^-11 relative: FlashAttention
// numerics, docs/design.md section 4), part 1 zero (once the lo part of an exact split); rows of
// heads >= G are zero. Codes are exact small integers in fp16 and fp16 keys are exact, so each
// product is exact in fp32; the chunk sums of the zero-point fold are sums of the rounded q.
// K index k of k-step s of chunk c (32 channels) maps to channel 32 c + 8 t + 4 s + 2 (k >= 8)
// + k % 2 with t = (k % 8) / 2, the same map for A (queries) and B (keys), so lane (g, t) reads
// 8 contiguous channels of row g per chunk (one 16-byte load for fp16, 16 bits of 2-bit codes).
// C: lane (g, t) gets rows n = 2t, 2t+1 of query rows m = g and g + 8; the parts are added by
// one shuffle (lane ^ 4). Packed: per chunk, logit += scale_n C / sigma + lo_n * sum_chunk q.

// Shared memory of the query fragments (after the logit buffer): qf [D/32 chunks][2 steps][32
// lanes] uint4, then qcm[16][D/32] (chunk sums of q for part-0 rows, else 0), then sinv[16]
// (1/sigma, or 0 for rows of no head): D * 32 + 2 * D + 64 bytes (split_smem_bytes).

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_half2(float lo_elem, float hi_elem) {
  const __half2 h = __halves2half2(__float2half_rn(lo_elem), __float2half_rn(hi_elem));
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Fills the fragments from the (scaled, transformed) queries qs[G][D]; smax: kWarps*2 floats of
// scratch. Ends without a barrier: the caller's next __syncthreads publishes qf, qcm and sinv.
template <int D, int G>
__device__ void build_mma_queries(const float* qs, uint32_t* qf, float* qcm, float* sinv,
                                  float* smax, int tid) {
  constexpr int NCH = D / 32;
  const int lane = tid & 31, warp = tid >> 5;
  for (int h = warp; h < G; h += kWarps) {
    float mx = 0.0f;
    for (int d = lane; d < D; d += 32) mx = fmaxf(mx, fabsf(qs[h * D + d]));
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    if (lane == 0) smax[h] = mx;
  }
  __syncthreads();
  auto sigma = [&](int h) {
    const float mx = smax[h];
    if (!(mx > 0.0f) || !(mx < INFINITY)) return 1.0f;
    int e = 0;
    frexpf(mx, &e);  // mx = f 2^e, f in [0.5, 1)
    return ldexpf(1.0f, max(-100, min(100, 12 - e)));
  };
  for (int i = tid; i < NCH * 2 * 32 * 4; i += kThreads) {
    const int r = i & 3, ln = (i >> 2) & 31, s = (i >> 7) & 1, c = i >> 8;
    const int g = ln >> 2, t = ln & 3;
    const int m = (r & 1) ? g + 8 : g;
    const int h = m >> 1, part = m & 1;
    const int ch = 32 * c + 8 * t + 4 * s + ((r >> 1) ? 2 : 0);
    uint32_t w = 0;
    if (h < G) {
      const float sg = sigma(h);
      const float v0 = qs[h * D + ch] * sg, v1 = qs[h * D + ch + 1] * sg;
      w = part == 0 ? pack_half2(v0, v1) : 0u;  // part-1 rows (former lo parts) stay zero
    }
    qf[i] = w;
  }
  for (int i = tid; i < 16 * NCH; i += kThreads) {
    const int m = i / NCH, c = i % NCH, h = m >> 1;
    float s = 0.0f;
    if (h < G && (m & 1) == 0) {  // sums of the fp16 operands (q sigma rounded, then / sigma)
      const float sg = sigma(h), si = 1.0f / sg;
      for (int j = 0; j < 32; ++j)
        s += __half2float(__float2half_rn(qs[h * D + 32 * c + j] * sg)) * si;
    }
    qcm[i] = s;
  }
  if (tid < 16) sinv[tid] = (tid >> 1) < G ? 1.0f / sigma(tid >> 1) : 0.0f;
}

// Logits of warp-tile rows 0..7 starting at byte offset rec0 (row stride krb) of the stage
// sk: out[j][q] for rows n = 2t + j and query rows m = g (q = 0) and g + 8 (q = 1), before the
// part shuffle. PACKED: 2-bit codes with (lo, scale) groups of gs (a multiple of 32) channels.
template <int D, bool PACKED>
__device__ __forceinline__ void mma_logits(const uint8_t* sk, uint32_t rec0, int krb,
                                           const uint32_t* qf, const float* qcm, float s0, float s1,
                                           const DecodePackedParams& pk, int lane,
                                           float (&out)[2][2]) {
  constexpr int NCH = D / 32;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t rec_g = rec0 + static_cast<uint32_t>(g * krb);
  const uint32_t rec_n0 = rec0 + static_cast<uint32_t>(2 * t * krb);
  const uint32_t rec_n1 = rec_n0 + static_cast<uint32_t>(krb);
  const uint4* qv = reinterpret_cast<const uint4*>(qf);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  out[0][0] = out[0][1] = out[1][0] = out[1][1] = 0.0f;
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const uint4 qa = qv[(2 * c) * 32 + lane], qb = qv[(2 * c + 1) * 32 + lane];
    if constexpr (!PACKED) {
      const uint4 kx = *reinterpret_cast<const uint4*>(sk + rec_g + 2 * (32 * c + 8 * t));
      mma_16816(acc, qa.x, qa.y, qa.z, qa.w, kx.x, kx.y);
      mma_16816(acc, qb.x, qb.y, qb.z, qb.w, kx.z, kx.w);
    } else {
      const uint32_t x = lds_u32_any(sk, rec_g + static_cast<uint32_t>(8 * c + 2 * t)) & 0xffffu;
      const uint32_t y = x | (x << 14);  // low half: code i at bit 2i, high half: code i + 1
      uint32_t b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t u = ((y >> (4 * i)) & 0x00030003u) | 0x64006400u;  // 1024 + c (fp16)
        const __half2 v =
            __hsub2(*reinterpret_cast<const __half2*>(&u),
                    __halves2half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400)));
        b[i] = *reinterpret_cast<const uint32_t*>(&v);
      }
      float cc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma_16816(cc, qa.x, qa.y, qa.z, qa.w, b[0], b[1]);
      mma_16816(cc, qb.x, qb.y, qb.z, qb.w, b[2], b[3]);
      const int grp = (32 * c) / pk.group_size;
      float lo0, sc0, lo1, sc1;
      load_meta(sk, rec_n0, pk.k_code_bytes, pk.k_meta, grp, lo0, sc0);
      load_meta(sk, rec_n1, pk.k_code_bytes, pk.k_meta, grp, lo1, sc1);
      const float qc0 = qcm[g * NCH + c], qc1 = qcm[(g + 8) * NCH + c];
      out[0][0] = fmaf(sc0 * s0, cc[0], fmaf(lo0, qc0, out[0][0]));
      out[1][0] = fmaf(sc1 * s0, cc[1], fmaf(lo1, qc0, out[1][0]));
      out[0][1] = fmaf(sc0 * s1, cc[2], fmaf(lo0, qc1, out[0][1]));
      out[1][1] = fmaf(sc1 * s1, cc[3], fmaf(lo1, qc1, out[1][1]));
    }
  }
  if constexpr (!PACKED) {
    out[0][0] = acc[0] * s0;
    out[1][0] = acc[1] * s0;
    out[0][1] = acc[2] * s1;
    out[1][1] = acc[3] * s1;
  }
}

// ---- the split kernel -------------------------------------------------------------------------

// Resident blocks the register budget aims for: 4 (<= 128 registers) where q and the accumulator
// take 32 registers each, else whatever fits.
template <int D, int G>
constexpr int min_blocks() {
  return Geo<D, G>::CPL * G <= 32 ? 4 : 1;
}

// The sum of the 32 values of chunk i % (D / 32) of head i / (D / 32) in qs [heads][D], in fp32,
// starting at value i % 32 and wrapping: the consecutive threads of a block's chunk-sum loop then
// read 32 different banks (in channel order all would read one: 16- to 32-way conflicts).
__device__ __forceinline__ float chunk_sum(const float* qs, int D, int i) {
  const float* x = qs + (i / (D / 32)) * D + 32 * (i % (D / 32));
  float s = 0.0f;
  for (int j = 0; j < 32; ++j) s += x[(i + j) & 31];
  return s;
}

// Where a tensor-core block keeps channel d of head h in its [warps][G][D] merge buffer: d with
// bits 0-4 XORed by the head's bits 0-2 and d's bits 5-6 (a bijection of each 32-channel block),
// so that the lanes of one merge store, which hold channels 32 or 16 apart or heads D apart (the
// same bank unswizzled: up to 32-way conflicts), write different banks (D >= 32).
__device__ __forceinline__ int merge_slot(int h, int d) {
  return d ^ ((((h >> 2) & 1) << 4) | ((h & 3) << 2) | ((d >> 5) & 3));
}

// The block's partials of split `split` from its warps' [warps][G] maxima wm and sums wl and
// [warps][G][D] accumulators wacc (+ bias [warps][G][D / 32] by 32-channel block, if given): one
// log-sum-exp merge per head and channel, written to p.part_acc / p.part_ml. SWZ: wacc holds
// channel d of head h at merge_slot(h, d).
template <int D, int G, bool SWZ = false>
__device__ __forceinline__ void write_partials(const DecodeParams& p, int64_t bh, int split,
                                               const float* wm, const float* wl, const float* wacc,
                                               const float* bias, int tid) {
  for (int i = tid; i < G * D; i += kThreads) {
    const int h = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, wm[w * G + h]);
    float a = 0.0f, l = 0.0f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(wm[w * G + h] - mx);
        float x = wacc[(w * G + h) * D + (SWZ ? merge_slot(h, d) : d)];
        if (bias) x += bias[(w * G + h) * (D / 32) + d / 32];
        a += x * f;
        l += wl[w * G + h] * f;
      }
    }
    const int64_t row = (bh * G + h) * p.n_splits + split;
    p.part_acc[row * D + d] = a;
    if (d == 0) {
      p.part_ml[2 * row] = mx;
      p.part_ml[2 * row + 1] = l;
    }
  }
}

template <int D, int G, int KB, int VB>
__global__ void __launch_bounds__(kThreads, min_blocks<D, G>())
    decode_split_kernel(const __grid_constant__ DecodeParams P) {
  // a batched launch (P.seqs): sequence blockIdx.z's own parameters, its batch index 0
  __shared__ __align__(16) DecodeParams sp;
  stage_params(P, blockIdx.z, sp);
  const DecodeParams& p = sp;
  using Gm = Geo<D, G>;
  constexpr int LPR = Gm::LPR, NP = Gm::NP, RPS = Gm::RPS, STEPS = Gm::STEPS;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* stages = smem;
  float* qs = reinterpret_cast<float*>(smem + kStages * 2 * kHalfBytes);  // [G][D]
  float* sbuf = qs + G * D;                                               // [warps][8][G]

  grid_dependency_trigger();
  int kvh = 0;
  const int split = block_split(p, kvh), b = P.seqs ? 0 : blockIdx.z;
  if (split >= p.n_splits) return;  // batched: past this sequence's splits
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % LPR, rs = lane / LPR;

  int si = 0;
  while (si + 1 < p.n_segments && split >= p.seg[si + 1].split_begin) ++si;
  const DecodeSegmentParams& sg = p.seg[si];
  const bool packed = KB > 0 && sg.packed != 0;
  const int64_t r_begin = static_cast<int64_t>(split - sg.split_begin) * sg.rows_per_split;
  const int64_t r_end = min64(sg.n_rows, r_begin + sg.rows_per_split);
  const int64_t bh = static_cast<int64_t>(b) * p.n_kv_heads + kvh, kbh = kv_bh(p, b, kvh);
  const int krb = sg.k_row_bytes, vrb = sg.v_row_bytes, TR = sg.tile_rows;
  const uint8_t* kbase = sg.k + kbh * sg.capacity * krb;
  const uint8_t* vbase = sg.v + kbh * sg.capacity * vrb;
  const int32_t* pos = sg.positions ? sg.positions + kbh * sg.capacity : nullptr;

  // ---- queries of the G heads of this kv head, transformed for packed keys, into registers
  const float* qg = p.q + (bh * G) * D;
  for (int i = tid; i < G * D; i += kThreads) qs[i] = qg[i] * p.scale_log2;
  __syncthreads();
  if (packed && (p.pk.k_signs || p.pk.k_perm))
    transform_queries<D, G>(qs, reinterpret_cast<float*>(stages), p.pk, kvh / p.kv_rep, tid);
  // tensor-core logits for fp16 rows and 2-bit codes in groups of a multiple of 32 channels
  uint32_t* qf = reinterpret_cast<uint32_t*>(sbuf + kWarps * kWarpTile * G);
  float* qcm = reinterpret_cast<float*>(qf + D * 8);
  float* sinv = qcm + 16 * (D / 32);
  const bool k_mma = packed ? (KB == 2 && p.pk.group_size % 32 == 0) : (sg.dtype == 1);
  if (k_mma) build_mma_queries<D, G>(qs, qf, qcm, sinv, sbuf, tid);
  float qr[G][NP][8];
  float qsum[G][NP];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const float4* src = reinterpret_cast<const float4*>(qs + h * D + 8 * (sub + k * LPR));
      const float4 a = src[0], c = src[1];
      qr[h][k][0] = a.x, qr[h][k][1] = a.y, qr[h][k][2] = a.z, qr[h][k][3] = a.w;
      qr[h][k][4] = c.x, qr[h][k][5] = c.y, qr[h][k][6] = c.z, qr[h][k][7] = c.w;
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) s += qr[h][k][j];
      qsum[h][k] = s;
      if constexpr (KB > 0) {
        if (packed) {  // codes arrive as c_j * 2^code_exp: scale q by 2^-code_exp (exact)
#pragma unroll
          for (int j = 0; j < 8; ++j) qr[h][k][j] *= code_unscale<KB>(j);
        }
      }
    }
  int grp[NP];  // metadata group of each piece
#pragma unroll
  for (int k = 0; k < NP; ++k) grp[k] = (8 * (sub + k * LPR)) / p.pk.group_size;
  __syncthreads();  // the stage area served as scratch of the transform

  const float sinv0 = k_mma ? sinv[lane >> 2] : 0.0f, sinv1 = k_mma ? sinv[(lane >> 2) + 8] : 0.0f;
  float m_run = -INFINITY, l_run = 0.0f;  // head lane % G of this warp
  float acc[G][NP][8];
  float vbias[G][NP];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      vbias[h][k] = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[h][k][j] = 0.0f;
    }

  const int64_t n_split_rows = r_end - r_begin;
  const int n_tiles = static_cast<int>((n_split_rows + TR - 1) / TR);
  auto issue = [&](int t) {
    const int64_t r0 = r_begin + static_cast<int64_t>(t) * TR;
    const int64_t nr = min64(TR, r_end - r0);
    uint8_t* sk = stages + (t % kStages) * 2 * kHalfBytes;
    copy_range(sk, kbase + r0 * krb, nr * krb, tid);
    copy_range(sk + kHalfBytes, vbase + r0 * vrb, nr * vrb, tid);
  };
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < n_tiles) issue(t);
    cp_async_commit();
  }

  float* sw = sbuf + warp * kWarpTile * G;  // this warp's [8][G] logits, then probabilities
  constexpr int NPAIR = kWarpTile * G;
  constexpr int PPL = (NPAIR + 31) / 32;
  constexpr int kWriterMask = (LPR >> Gm::TSTEPS) - 1;

  for (int t = 0; t < n_tiles; ++t) {
    if (t + kStages - 1 < n_tiles) issue(t + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncthreads();

    const int64_t r0 = r_begin + static_cast<int64_t>(t) * TR;
    const int nr = static_cast<int>(min64(TR, r_end - r0));
    const uint8_t* sk = stages + (t % kStages) * 2 * kHalfBytes;
    const uint8_t* sv = sk + kHalfBytes;
    const uint32_t kmis = static_cast<uint32_t>(misalign16(kbase + r0 * krb));
    const uint32_t vmis = static_cast<uint32_t>(misalign16(vbase + r0 * vrb));
    const int n_wt = (nr + kWarpTile - 1) / kWarpTile;

    for (int wt = warp; wt < n_wt; wt += kWarps) {
      // (1) logits of the warp-tile's 8 rows
      if (k_mma) {
        float lg[2][2];
        const uint32_t rec0 = kmis + static_cast<uint32_t>(wt * kWarpTile * krb);
        if constexpr (KB == 2) {
          if (packed) {
            mma_logits<D, true>(sk, rec0, krb, qf, qcm, sinv0, sinv1, p.pk, lane, lg);
          } else {
            mma_logits<D, false>(sk, rec0, krb, qf, qcm, sinv0, sinv1, p.pk, lane, lg);
          }
        } else {
          mma_logits<D, false>(sk, rec0, krb, qf, qcm, sinv0, sinv1, p.pk, lane, lg);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int q2 = 0; q2 < 2; ++q2) lg[j][q2] += __shfl_xor_sync(kFull, lg[j][q2], 4);
        const int g = lane >> 2, t = lane & 3;
        if ((g & 1) == 0) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int n = 2 * t + j;
            const int rl = wt * kWarpTile + n;
            bool vis = false;
            if (rl < nr) {
              const int64_t pj = pos ? static_cast<int64_t>(pos[r0 + rl]) : sg.first_pos + r0 + rl;
              vis = pj <= p.q_pos && (p.window <= 0 || p.q_pos < pj + p.window);
            }
#pragma unroll
            for (int q2 = 0; q2 < 2; ++q2) {
              const int h = (g + 8 * q2) >> 1;
              if (h < G) sw[n * G + h] = vis ? lg[j][q2] : -INFINITY;
            }
          }
        }
      }
#pragma unroll
      for (int st = 0; st < STEPS; ++st) {
        if (k_mma) break;
        const int rl = wt * kWarpTile + st * RPS + rs;
        const bool valid = rl < nr;
        const uint32_t rec = kmis + static_cast<uint32_t>(rl * krb);
        float part[G];
#pragma unroll
        for (int h = 0; h < G; ++h) part[h] = 0.0f;
        if constexpr (KB > 0) {
          if (packed) {
#pragma unroll
            for (int k = 0; k < NP; ++k) {
              const int piece = sub + k * LPR;
              float c[8], lo, sc;
              load_codes<KB>(sk, rec, piece, c, p.pk.k_bits_x2);
              load_meta(sk, rec, p.pk.k_code_bytes, p.pk.k_meta, grp[k], lo, sc);
#pragma unroll
              for (int h = 0; h < G; ++h) {
                float d = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) d = fmaf(qr[h][k][j], c[j], d);
                part[h] = fmaf(sc, d, fmaf(lo, qsum[h][k], part[h]));
              }
            }
          }
        }
        if (!packed) {
#pragma unroll
          for (int k = 0; k < NP; ++k) {
            float x[8];
            load_fp8x(sk, rec + static_cast<uint32_t>(8 * (sub + k * LPR) * (krb / D)), sg.dtype,
                      x);
#pragma unroll
            for (int h = 0; h < G; ++h) {
              float d = part[h];
#pragma unroll
              for (int j = 0; j < 8; ++j) d = fmaf(qr[h][k][j], x[j], d);
              part[h] = d;
            }
          }
        }
        const int head = reduce_heads<G, LPR, Gm::TSTEPS>(part, sub);
        bool vis = false;
        if (valid) {
          const int64_t pj = pos ? static_cast<int64_t>(pos[r0 + rl]) : sg.first_pos + r0 + rl;
          vis = pj <= p.q_pos && (p.window <= 0 || p.q_pos < pj + p.window);
        }
        if ((sub & kWriterMask) == 0) sw[(st * RPS + rs) * G + head] = vis ? part[0] : -INFINITY;
      }
      __syncwarp();

      // (2) online softmax over the 8 rows, per head (head = lane % G)
      float val[PPL];
      float tmax = -INFINITY;
#pragma unroll
      for (int k = 0; k < PPL; ++k) {
        const int pi = k * 32 + lane;
        val[k] = pi < NPAIR ? sw[pi] : -INFINITY;
        tmax = fmaxf(tmax, val[k]);
      }
#pragma unroll
      for (int o = G; o < 32; o <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, o));
      const float m_new = fmaxf(m_run, tmax);
      const bool none = m_new == -INFINITY;
      const float alpha = none ? 1.0f : exp2f(m_run - m_new);
      float psum = 0.0f;
#pragma unroll
      for (int k = 0; k < PPL; ++k) {
        const int pi = k * 32 + lane;
        const float pr = none ? 0.0f : exp2f(val[k] - m_new);
        if (pi < NPAIR) sw[pi] = pr;
        psum += pr;
      }
#pragma unroll
      for (int o = G; o < 32; o <<= 1) psum += __shfl_xor_sync(kFull, psum, o);
      l_run = l_run * alpha + psum;
      m_run = m_new;
      float al[G];
      bool rescale = false;
#pragma unroll
      for (int h = 0; h < G; ++h) {
        al[h] = __shfl_sync(kFull, alpha, h);
        rescale |= al[h] != 1.0f;
      }
      if (rescale) {
#pragma unroll
        for (int h = 0; h < G; ++h)
#pragma unroll
          for (int k = 0; k < NP; ++k) {
            vbias[h][k] *= al[h];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[h][k][j] *= al[h];
          }
      }
      __syncwarp();

      // (3) values
#pragma unroll
      for (int st = 0; st < STEPS; ++st) {
        const int rl = wt * kWarpTile + st * RPS + rs;
        float pv[G];
        bool any = false;
#pragma unroll
        for (int h = 0; h < G; ++h) {
          pv[h] = sw[(st * RPS + rs) * G + h];
          any |= pv[h] != 0.0f;
        }
        if (!any) continue;  // invisible or padding row (p == 0 for every head)
        const uint32_t rec = vmis + static_cast<uint32_t>(rl * vrb);
        if constexpr (VB > 0) {
          if (packed) {
#pragma unroll
            for (int k = 0; k < NP; ++k) {
              const int piece = sub + k * LPR;
              float c[8], lo, sc;
              load_codes<VB>(sv, rec, piece, c, p.pk.v_bits_x2);
              load_meta(sv, rec, p.pk.v_code_bytes, p.pk.v_meta, grp[k], lo, sc);
#pragma unroll
              for (int h = 0; h < G; ++h) {
                const float w = pv[h] * sc;
                vbias[h][k] = fmaf(pv[h], lo, vbias[h][k]);
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[h][k][j] = fmaf(w, c[j], acc[h][k][j]);
              }
            }
          }
        }
        if (!packed) {
#pragma unroll
          for (int k = 0; k < NP; ++k) {
            float x[8];
            load_fp8x(sv, rec + static_cast<uint32_t>(8 * (sub + k * LPR) * (vrb / D)), sg.dtype,
                      x);
#pragma unroll
            for (int h = 0; h < G; ++h)
#pragma unroll
              for (int j = 0; j < 8; ++j) acc[h][k][j] = fmaf(pv[h], x[j], acc[h][k][j]);
          }
        }
      }
      __syncwarp();
    }
    __syncthreads();  // the stage is refilled next iteration
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- reduce the row slots of each warp, then the warps, into this split's partial
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int k = 0; k < NP; ++k)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float a = acc[h][k][j];
        if constexpr (VB > 0) {
          if (packed) a *= code_unscale<VB>(j);  // exact: undo the in-place code scale
        }
        a += vbias[h][k];
#pragma unroll
        for (int o = LPR; o < 32; o <<= 1) a += __shfl_xor_sync(kFull, a, o);
        acc[h][k][j] = a;
      }
  float* wm = reinterpret_cast<float*>(stages);  // [warps][G]
  float* wl = wm + kWarps * G;                   // [warps][G]
  float* wacc = wl + kWarps * G;                 // [warps][G][D]
  if (lane < G) {
    wm[warp * G + lane] = m_run;
    wl[warp * G + lane] = l_run;
  }
  if (rs == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
      for (int k = 0; k < NP; ++k)
#pragma unroll
        for (int j = 0; j < 8; ++j)
          wacc[(warp * G + h) * D + 8 * (sub + k * LPR) + j] = acc[h][k][j];
  }
  __syncthreads();
  write_partials<D, G>(p, bh, split, wm, wl, wacc, nullptr, tid);
}

// Launches the split kernel of one (KB, VB) for the view's D and G (decode_attention_k*.cu).
template <int KB, int VB>
void launch_split(const DecodeParams& p, cudaStream_t s);

template <int D, int G, int KB, int VB>
void launch_split_dg(const DecodeParams& p, cudaStream_t s) {
  constexpr int smem = split_smem_bytes<D, G>();
  auto kern = decode_split_kernel<D, G, KB, VB>;
  VQ_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid = split_grid(p, p.n_splits, p.batch);
  kern<<<grid, kThreads, smem, s>>>(p);
  VQ_CUDA_LAUNCH_CHECK(decode_split_kernel);
}

template <int D, int KB, int VB>
void launch_split_d(const DecodeParams& p, cudaStream_t s) {
  switch (p.group) {
    case 1:
      return launch_split_dg<D, 1, KB, VB>(p, s);
    case 2:
      return launch_split_dg<D, 2, KB, VB>(p, s);
    case 4:
      return launch_split_dg<D, 4, KB, VB>(p, s);
    case 8:
      return launch_split_dg<D, 8, KB, VB>(p, s);
    default:
      throw Error("[decode_attention] internal: expected 1, 2, 4 or 8 query heads per block, got " +
                  std::to_string(p.group));
  }
}

#define VQ_DECODE_INSTANTIATE(KB, VB)                                              \
  template <>                                                                      \
  void launch_split<KB, VB>(const DecodeParams& p, cudaStream_t s) {               \
    switch (p.head_dim) {                                                          \
      case 64:                                                                     \
        return launch_split_d<64, KB, VB>(p, s);                                   \
      case 128:                                                                    \
        return launch_split_d<128, KB, VB>(p, s);                                  \
      default:                                                                     \
        throw Error("[decode_attention] expected head_dim in {64, 128} but got " + \
                    std::to_string(p.head_dim));                                   \
    }                                                                              \
  }

}  // namespace vq::cuda::decode_impl
