// Chooses the packed decode kernels (packed_decode.h) for a record format and this CPU.
#include "ops/packed_decode.h"

#include "ops/cpu_features.h"

#include <atomic>

namespace vq::detail {

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kPortable:
      return "portable";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx2Int8:
      return "avx2int8";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx512Vnni:
      return "avx512vnni";
    case CpuIsa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "?";
}

CpuIsa detected_isa() {
  static const CpuIsa isa = [] {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
      if (!__builtin_cpu_supports("avx512vnni")) return CpuIsa::kAvx512;
      return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi")
                 ? CpuIsa::kAvx512Bf16
                 : CpuIsa::kAvx512Vnni;
    }
    if (cpu_has_avx2_fma_f16c()) return CpuIsa::kAvx2Int8;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::kAvx2;
#endif
    return CpuIsa::kPortable;
  }();
  return isa;
}

namespace {
std::atomic<int> g_isa{-1};  // -1: detected_isa()
}  // namespace

CpuIsa default_isa() {
  static const CpuIsa isa = [] {
    const CpuIsa best = detected_isa();
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (best == CpuIsa::kAvx512Bf16 && !__builtin_cpu_is("amd")) return CpuIsa::kAvx512Vnni;
#endif
    return best;
  }();
  return isa;
}

CpuIsa attention_isa() {
  const int v = g_isa.load(std::memory_order_relaxed);
  return v < 0 ? default_isa() : static_cast<CpuIsa>(v);
}

void reset_attention_isa() {
  g_isa.store(-1, std::memory_order_relaxed);
}

void set_attention_isa(CpuIsa isa) {
  const CpuIsa capped = isa < detected_isa() ? isa : detected_isa();
  g_isa.store(static_cast<int>(capped), std::memory_order_relaxed);
}

PackedKernel packed_kernel(const PackedRowFormat& f, CpuIsa isa) {
  if (isa >= CpuIsa::kAvx512Bf16) {
    PackedKernel k = packed_kernel(f, CpuIsa::kAvx512Vnni);
    if (k.values)
      if (PackedValuesFn v = packed_values_bf16(f)) {
        k.values = v;
        k.bf16_values = true;
      }
    return k;
  }
  if (isa >= CpuIsa::kAvx512Vnni) {
    const PackedKernel k = packed_kernel_vnni(f), v = packed_kernel_avx512(f);
    if (k.keys && v.values) {
      PackedKernel out = k;
      out.values = v.values;
      return out;
    }
  }
  if (isa >= CpuIsa::kAvx512) {
    const PackedKernel k = packed_kernel_avx512(f);
    if (k.keys) return k;
  }
  if (isa >= CpuIsa::kAvx2) {
    PackedKernel k = packed_kernel_avx2(f);
    if (k.keys) {
      if (PackedValuesFn v = packed_values_avx2_rows(f)) k.values = v;
      const PackedKernel ik = isa >= CpuIsa::kAvx2Int8 ? packed_keys_avx2_int8(f) : PackedKernel{};
      if (ik.keys) {
        k.keys = ik.keys;
        k.prepare = ik.prepare;
        k.prep_bytes = ik.prep_bytes;
        k.int8_query = true;
      }
      return k;
    }
  }
  return packed_kernel_portable(f);
}

}  // namespace vq::detail
