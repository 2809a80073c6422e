// A persistent worker pool for the decode step's parallel loops (matrix products, attention):
// parallel_for(n, f) runs f(0) .. f(n - 1) on the calling thread and the pool's workers, units
// claimed from a shared counter, so a worker that is descheduled (a busy machine) holds up only
// what it claimed: the others, the caller included, take the rest. Claim::kGuided (the default,
// for many small units of equal cost: matrix products, per-token steps) claims shrinking runs,
// at most 1 / (2 threads) of what is left and down to one unit (thread_pool.cpp), so a loop costs
// few claims; Claim::kOne claims one unit at a time (few large units, or units of unequal cost
// handed out largest first: attention).
// Idle workers spin briefly (kSpinMicros) for the next loop, then sleep on a condition variable,
// so no thread burns a core while other programs need it (the default OpenMP wait policy spins
// far longer at every region's end). Threads per call: omp_get_max_threads() (OMP_NUM_THREADS,
// omp_set_num_threads), workers created on first need. A call from inside a pool unit or an
// OpenMP parallel region runs serially on its thread. f must not throw.
#pragma once

#include <cstdint>
#include <type_traits>

namespace vq::ops {

enum class Claim : uint8_t { kGuided, kOne };

namespace detail {
void parallel_for_impl(int64_t n, void (*fn)(void*, int64_t), void* ctx, Claim claim);
}

// The threads a parallel_for would use now (1 inside a pool unit or an OpenMP region).
int pool_threads();

template <typename F>
void parallel_for(int64_t n, F&& f, Claim claim = Claim::kGuided) {
  using Fn = std::remove_reference_t<F>;
  detail::parallel_for_impl(
      n, [](void* c, int64_t i) { (*static_cast<Fn*>(c))(i); },
      const_cast<void*>(static_cast<const void*>(&f)), claim);
}

// parallel_for when par, else f(0) .. f(n - 1) in order on this thread (loops too small to be
// worth the pool's hand-off).
template <typename F>
void parallel_for_if(bool par, int64_t n, F&& f, Claim claim = Claim::kGuided) {
  if (par) {
    parallel_for(n, f, claim);
  } else {
    for (int64_t i = 0; i < n; ++i) f(i);
  }
}

}  // namespace vq::ops
