// Hopper warpgroup matrix products (wgmma.mma_async, sm_90a only) and mbarriers, device code
// only: the shared memory descriptor of a 128-byte-swizzled tile, fences, commit and wait, and the
// m64n128k16 products with fp32 accumulators for fp16 and bf16 operands that prefill_wg.cu uses. A
// tile of 16-bit rows is kept as column blocks of 64 channels, each [rows][128 bytes], 16-byte
// chunk c of row r at chunk c ^ (r & 7) (wg_off): the canonical 128-byte swizzle both for K-major
// operands (rows are M or N, channels are K: groups of 8 rows 1024 bytes apart) and for MN-major
// ones (rows are K: column blocks LBO bytes apart, groups of 8 rows 1024 bytes apart). Accumulator
// fragments: warp w of the warpgroup holds rows 16 w + g and 16 w + g + 8 (lane = 4 g + t4),
// element 4 j + e at column 8 j + 2 t4 + (e & 1), row + 8 (e >> 1): mma.m16n8k16's C layout per
// 8 columns; a register A fragment is mma.m16n8k16's A layout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace vq::cuda {

// Byte offset of channel c (even) of row r in a tile of R rows laid out as above.
template <int R>
__device__ __forceinline__ int wg_off(int r, int c) {
  return (c >> 6) * (R * 128) + r * 128 + 16 * (((c >> 3) & 7) ^ (r & 7)) + 2 * (c & 7);
}

// Descriptor of a 128-byte-swizzled operand starting at p (shared memory; its 1024-byte atom
// aligned, or p offset by k * 32 bytes within a row for the k-th 16-channel step of a K-major
// operand), lbo and sbo in bytes.
__device__ __forceinline__ uint64_t wg_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return static_cast<uint64_t>((a & 0x3FFFFu) >> 4) |
         static_cast<uint64_t>((lbo >> 4) & 0x3FFFu) << 16 |
         static_cast<uint64_t>((sbo >> 4) & 0x3FFFu) << 32 | static_cast<uint64_t>(1) << 62;
}

__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (stores, cp.async) made visible to the async proxy that
// wgmma reads through; called by every writer before the barrier the readers wait on.
__device__ __forceinline__ void wg_fence_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Ties the compiler's view of accumulator registers to this point (after a wait, before a
// fence): no read or write of them moves across it.
template <int R>
__device__ __forceinline__ void wg_pin(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory mbarriers (sm_90): init (one thread, before a block barrier), arrive (release
// at CTA scope) and wait for the completion of the phase of parity `parity` (acquire).
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(a)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(a),
      "r"(parity)
      : "memory");
}

#define VQ_WG_R32                                                               \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
  "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define VQ_WG_R64                                                            \
  VQ_WG_R32                                                                  \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "   \
  "%60, %61, %62, %63"
#define VQ_WG_D32(d)                                                                              \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define VQ_WG_D64(d)                                                                             \
  VQ_WG_D32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),    \
      "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), \
      "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), \
      "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), \
      "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// d (+)= A B, A and B K-major in shared memory; acc 0: d = A B.
#define VQ_WG_SS(N, TY, RL, DL, PA, PB, PP)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #PP                                       \
               ", 0;\n"                                                                       \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" RL "}, %" #PA \
               ", %" #PB ", p, 1, 1, 0, 0;\n}\n"                                              \
               : DL                                                                           \
               : "l"(a), "l"(b), "r"(acc))
// d (+)= A B, A in registers (4 per thread), B MN-major (transposed) in shared memory.
#define VQ_WG_RS(N, TY, RL, DL, AL, PB, PP)                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #PP                                      \
               ", 0;\n"                                                                      \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" RL "}, {" AL \
               "}, %" #PB ", p, 1, 1, 1;\n}\n"                                               \
               : DL                                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc))

// m64n128k16 (the N of both products of prefill_wg.cu).
template <bool BF16>
__device__ __forceinline__ void wg_mma_ss(float (&d)[64], uint64_t a, uint64_t b, int acc) {
  if constexpr (BF16)
    VQ_WG_SS(128, "bf16", VQ_WG_R64, VQ_WG_D64(d), 64, 65, 66);
  else
    VQ_WG_SS(128, "f16", VQ_WG_R64, VQ_WG_D64(d), 64, 65, 66);
}

template <bool BF16>
__device__ __forceinline__ void wg_mma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b,
                                          int acc) {
  if constexpr (BF16)
    VQ_WG_RS(128, "bf16", VQ_WG_R64, VQ_WG_D64(d), "%64, %65, %66, %67", 68, 69);
  else
    VQ_WG_RS(128, "f16", VQ_WG_R64, VQ_WG_D64(d), "%64, %65, %66, %67", 68, 69);
}

#undef VQ_WG_SS
#undef VQ_WG_RS
#undef VQ_WG_D64
#undef VQ_WG_D32
#undef VQ_WG_R64
#undef VQ_WG_R32

}  // namespace vq::cuda
