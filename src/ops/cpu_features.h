// Run-time CPU checks shared by the kernels chosen at run time (matmul_avx2.cpp,
// packed_decode.cpp). F16C is read from CPUID directly: clang's __builtin_cpu_supports does not
// know the name.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

namespace vq::detail {

// AVX2, FMA and F16C (the AVX2 kernels' target), as the OS enables them.
inline bool cpu_has_avx2_fma_f16c() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return false;
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
#else
  return false;
#endif
}

}  // namespace vq::detail
