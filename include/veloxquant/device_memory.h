// Device memory an allocation takes: what CacheStats::bytes_resident reports for a device store
// (src/cuda/device_cache_common.cpp) and the memory planner counts (memory_plan.h). Host-only
// arithmetic, in every build.
#pragma once

#include <cstdint>

namespace vq::cuda {

// A DeviceBuffer (veloxquant/cuda.h) of `bytes`: its cudaMalloc of whole 16-byte words plus a
// spare one, and above 1 MiB whole 2 MiB pages, as the driver hands them out (measured on an
// H200 with cudaMemGetInfo over 64 allocations each: 12 MiB + 32 bytes takes 14 MiB, 1 MiB + 32
// bytes 2 MiB, 4 MiB + 32 bytes 6 MiB, 1 MiB and 12 MiB themselves). 0 for none.
constexpr int64_t device_alloc_bytes(int64_t bytes) {
  if (bytes <= 0) return 0;
  const int64_t alloc = (bytes + 15) / 16 * 16 + 16;
  constexpr int64_t kMiB = int64_t{1} << 20;
  return alloc > kMiB ? (alloc + 2 * kMiB - 1) / (2 * kMiB) * (2 * kMiB) : alloc;
}

}  // namespace vq::cuda
