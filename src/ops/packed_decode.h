// Decode attention directly on packed codes (docs/design.md §4): the key logits and the value
// accumulation of one tile of packed rows, computed from the codes and the per-group metadata
// without dequantizing a row. One kernel per (instruction set, bit width), chosen once per
// segment by packed_keys_kernel / packed_values_kernel; vq::attention (fused_attention.cpp) runs
// the online softmax around them.
//
// A stored row of group g holds x_i = c_i s_g + lo_g (transformed channel order), so for a query
// q' = P R q (transformed once per step) with group sums qsum_g = sum_{i in g} q'_i:
//   logit = sum_g [ s_g (sum_{i in g} q'_i c_i) + lo_g qsum_g ]      (scale once per group)
//   acc_i += (p s_g) c_i,   acc_lo_g += p lo_g                         (weight scaled once per
//   group)
// in fp32 throughout: codes are small integers (exact in fp32), the products and sums round.
#pragma once

#include <cstdint>

#include "veloxquant/packed.h"

namespace vq::detail {

// Instruction sets a kernel can be built for, in increasing order.
// kAvx2Int8: kAvx2's kernels with the keys of 1-, 2- and 4-bit codes on int8 queries
// (packed_keys_avx2_int8; PackedKernel::int8_query). set_attention_isa(kAvx2) keeps fp32 keys.
// kAvx512Vnni: AVX-512 with VNNI, whose key kernels run on int8 queries (see below).
// kAvx512Bf16: kAvx512Vnni's kernels with the values of 2- and 4-bit codes as bf16 dot products
// (AVX-512 BF16 and VBMI; PackedKernel::bf16_values). set_attention_isa(kAvx512Vnni) keeps the
// fp32 values.
enum class CpuIsa : uint8_t { kPortable, kAvx2, kAvx2Int8, kAvx512, kAvx512Vnni, kAvx512Bf16 };
const char* isa_name(CpuIsa isa);
// The best instruction set of this CPU that this build has kernels for (checked once).
CpuIsa detected_isa();
// The one vq::attention takes by default: detected_isa(), but kAvx512Vnni (fp32 values) in place
// of kAvx512Bf16 on CPUs other than AMD's. The bf16 values took 0.86-0.93x the fp32 values' time
// on a Zen 5 (docs/results/cpu/packed_decode_s19_bf16.txt) and were slower in 7 of 8 pairs on an
// Intel Emerald Rapids (the H200 host, docs/results/gpu/run18_s19/j7, 1.11-1.28x; not profiled).
CpuIsa default_isa();
// The instruction set vq::attention uses for packed decode: default_isa() unless set by
// set_attention_isa (tests and benchmarks compare the paths; a request above detected_isa() is
// capped to it) until reset_attention_isa. Process-wide.
CpuIsa attention_isa();
void set_attention_isa(CpuIsa isa);
void reset_attention_isa();

// The packed rows of one tile: rows[0 .. n_rows) (indices into the tile) of records at
// rec0 + t * stride, distinct, in any order; but the kernels take rows[n_rows - 1] - rows[0] ==
// n_rows - 1 to mean the run rows[0], rows[0] + 1, ..., which holds for the increasing lists
// vq::attention passes (a tile's visible rows).
struct PackedTile {
  const uint8_t* rec0 = nullptr;
  int64_t stride = 0;
  const int32_t* rows = nullptr;
  int64_t n_rows = 0;
};

// rows[0 .. n) read as one run of consecutive records (the convention above); n >= 1.
inline bool one_run(const int32_t* rows, int64_t n) {
  return rows[n - 1] - rows[0] == n - 1;
}

// logits[m * ld + t] = sum_g s_g (q[m] . c_t)_g + lo_g qsum[m * n_groups + g] for every listed
// row t and query m < n_q (q: [n_q, D] transformed, qsum: [n_q, n_groups]).
// prep: what the kernel's prepare function made of q and qsum (kernels without one ignore it).
using PackedKeysFn = void (*)(const PackedRowFormat& f, const PackedTile& tile, const float* q,
                              const float* qsum, int64_t n_q, float* logits, int64_t ld,
                              const void* prep);
// Per segment and step: the queries in the kernel's own form, into prep (prep_bytes(f, n_q)).
using PackedPrepFn = void (*)(const PackedRowFormat& f, const float* q, const float* qsum,
                              int64_t n_q, void* prep);
using PackedPrepBytesFn = int64_t (*)(const PackedRowFormat& f, int64_t n_q);
// acc[m * D + i] += sum_t p[m * ld + t] s_{t,g(i)} c_{t,i} and
// acc_lo[m * n_groups + g] += sum_t p[m * ld + t] lo_{t,g} over the listed rows t.
// scratch: at least packed_values_scratch(n_groups, n_q) floats.
using PackedValuesFn = void (*)(const PackedRowFormat& f, const PackedTile& tile, const float* p,
                                int64_t ld, int64_t n_q, float* acc, float* acc_lo, float* scratch);

// Scratch floats a values kernel may use for a tile of up to 32 rows.
inline int64_t packed_values_scratch(int64_t n_groups, int64_t n_q) {
  const int64_t mp = (n_q + 3) / 4 * 4;
  return 32 * mp + 48 * n_groups * mp + n_groups * mp;
}

struct PackedKernel {
  PackedKeysFn keys = nullptr;
  PackedValuesFn values = nullptr;
  CpuIsa isa = CpuIsa::kPortable;
  PackedPrepFn prepare = nullptr;  // null: keys reads q and qsum directly
  PackedPrepBytesFn prep_bytes = nullptr;
  // The key kernel rounds each query group to int8: q'_i ~ sq_g * q8_i, sq_g = max_{i in g}
  // |q'_i| / 127, q8_i = rne(q'_i / sq_g), so |q'_i - sq_g q8_i| <= sq_g (1/2 + 127 u); the
  // integer dot products are exact (packed_decode_vnni.cpp, packed_decode_avx2_keys.cpp).
  bool int8_query = false;
  // The values kernel rounds each weight p s_g (fp32) to bf16 and sums in fp32 (vdpbf16ps):
  // |acc - exact| <= (u_b + u + u_b u) sum_t |p s_g c| + gamma_{n+1} (|acc0| + (1 + u_b + 2 u)
  // sum_t |p s_g c|) + n 2^-126 2^B per channel, u_b = 2^-8 (packed_decode_bf16.cpp derives it).
  bool bf16_values = false;
};

// The kernels for records of format f on instruction set isa (at most isa: a format the SIMD
// kernels do not cover, e.g. 1.5-bit codes, 3-bit codes or a group size that is not a multiple of
// the vector width, gets the portable kernel). Never null.
PackedKernel packed_kernel(const PackedRowFormat& f, CpuIsa isa);

// Per instruction set (packed_decode_{portable,avx2,avx512}.cpp): the kernel for f, or
// {nullptr, nullptr} when the set does not cover f or was not built.
PackedKernel packed_kernel_portable(const PackedRowFormat& f);
PackedKernel packed_kernel_avx2(const PackedRowFormat& f);
PackedKernel packed_kernel_avx512(const PackedRowFormat& f);
// Keys only (values: packed_kernel_avx512's).
PackedKernel packed_kernel_vnni(const PackedRowFormat& f);
// Keys only, on int8 queries with AVX2 (packed_decode_avx2_keys.cpp): keys, prepare, prep_bytes
// and int8_query set, or {} where f is not covered (it needs fp16 metadata, 1-, 2- or 4-bit
// codes, at most 4 groups) or the set was not built. packed_kernel takes it on kAvx2Int8 with
// packed_kernel_avx2's values.
PackedKernel packed_keys_avx2_int8(const PackedRowFormat& f);
// Values only, row-major over 8-byte code blocks with AVX2 (packed_decode_avx2_values.cpp): the
// fp32 SIMD kernel's accumulators bit for bit, acc_lo in another order; null where f is not
// covered (2- and 4-bit codes, fp16 metadata, groups of whole blocks, at most 16 groups).
PackedValuesFn packed_values_avx2_rows(const PackedRowFormat& f);
// Values only, bf16 dot products (packed_decode_bf16.cpp): null where f is not covered (2- and
// 4-bit codes, fp16 metadata) or the set was not built.
PackedValuesFn packed_values_bf16(const PackedRowFormat& f);

}  // namespace vq::detail
