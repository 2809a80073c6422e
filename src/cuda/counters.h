// Process-wide counts of the runtime calls that stall the host or the device: stream
// synchronisations (explicit, and those of the synchronous host <-> device copies), cudaMalloc
// and cudaFree (the latter waits for the device). The engine's phase timing (PhaseEvents,
// model_ops.cuh) attributes them to the phases of a step, so `veloxquant bench --phases` shows
// which phase of a decode step waits and how often. Relaxed atomics: counts, not ordering.
#pragma once

#include <atomic>
#include <cstdint>

namespace vq::cuda::detail {

struct RuntimeCounts {
  int64_t syncs = 0, mallocs = 0, frees = 0;
};

inline std::atomic<int64_t> g_syncs{0}, g_mallocs{0}, g_frees{0};

inline void count_sync() {
  g_syncs.fetch_add(1, std::memory_order_relaxed);
}
inline void count_malloc() {
  g_mallocs.fetch_add(1, std::memory_order_relaxed);
}
inline void count_free() {
  g_frees.fetch_add(1, std::memory_order_relaxed);
}
inline RuntimeCounts runtime_counts() {
  return {g_syncs.load(std::memory_order_relaxed), g_mallocs.load(std::memory_order_relaxed),
          g_frees.load(std::memory_order_relaxed)};
}

}  // namespace vq::cuda::detail
