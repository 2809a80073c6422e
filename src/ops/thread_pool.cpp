// The persistent worker pool of thread_pool.h.
//
// One job at a time (parallel_for is called from one thread; nested calls run serially). The job
// is a 64-bit ticket: generation (24 bits) | unit count n (20 bits) | next unit (20 bits), and the
// function and context published before the ticket (release). A thread claims units [i, i + c)
// by a compare-and-swap of the ticket from (g, n, i) to (g, n, i + c): success proves job g was
// still open, and a job's fields are only rewritten after every unit of it is done, so the
// function it read belongs to its ticket. Loops of more than 2^20 units are cut into several jobs.
// Claim::kGuided: c = ceil(left / (kClaimDiv * threads)), so a loop of n units costs about
// kClaimDiv * threads * ln(n) claims instead of n (every claim moves the ticket's cache line
// between cores; a decode step's matrix products are hundreds of sub-microsecond units), and a
// descheduled thread holds up at most 1 / (kClaimDiv * threads) of a loop; Claim::kOne: c = 1.
// Which thread runs a unit never changes what the unit computes.
#include "ops/thread_pool.h"

#include <omp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace vq::ops {
namespace {

constexpr int64_t kSpinMicros = 100;  // idle spin before a worker sleeps
constexpr uint64_t kClaimDiv = 2;     // claims of at most 1 / (kClaimDiv * threads) of what is left
constexpr uint64_t kIdxBits = 20, kIdxMask = (uint64_t{1} << kIdxBits) - 1;

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

thread_local bool t_in_unit = false;  // this thread is running a pool unit

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void run(int64_t n, int threads, void (*fn)(void*, int64_t), void* ctx, Claim claim) {
    grow(threads - 1);
    // kOne: a share of a whole job or more, so every claim is one unit
    share_.store(claim == Claim::kOne ? kIdxMask : kClaimDiv * static_cast<uint64_t>(threads),
                 std::memory_order_relaxed);
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    gen_ = (gen_ + 1) & 0xffffff;
    const uint64_t t0 = (gen_ << (2 * kIdxBits)) | (static_cast<uint64_t>(n) << kIdxBits);
    ticket_.store(t0, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    work(t0);  // the caller takes units too
    // Wait for units still running on workers (at most one each): spin briefly, then block until
    // the worker that finishes the last unit wakes us. (Yielding instead can lose whole
    // scheduler time slices on a loaded machine.)
    for (int spins = 0; spins < 2048; ++spins) {
      if (done_.load(std::memory_order_acquire) >= n) return;
      cpu_relax();
    }
    std::unique_lock<std::mutex> lk(done_mu_);
    waiting_.store(true, std::memory_order_seq_cst);
    done_cv_.wait(lk, [&] { return done_.load(std::memory_order_seq_cst) >= n; });
    waiting_.store(false, std::memory_order_relaxed);
  }

 private:
  static bool open(uint64_t t) { return (t & kIdxMask) < ((t >> kIdxBits) & kIdxMask); }

  // Claims and runs units of the job of ticket t until none is left.
  void work(uint64_t t) {
    while (open(t)) {
      void (*fn)(void*, int64_t) = fn_.load(std::memory_order_relaxed);
      void* ctx = ctx_.load(std::memory_order_relaxed);
      const uint64_t share = share_.load(std::memory_order_relaxed);
      const uint64_t i = t & kIdxMask, left = ((t >> kIdxBits) & kIdxMask) - i;
      const uint64_t c = (left + share - 1) / share;  // >= 1: the job is open
      if (!ticket_.compare_exchange_weak(t, t + c, std::memory_order_acq_rel,
                                         std::memory_order_acquire))
        continue;  // t now holds the current ticket
      t_in_unit = true;
      for (uint64_t k = 0; k < c; ++k) fn(ctx, static_cast<int64_t>(i + k));
      t_in_unit = false;
      const int64_t n = static_cast<int64_t>((t >> kIdxBits) & kIdxMask);
      if (done_.fetch_add(static_cast<int64_t>(c), std::memory_order_seq_cst) +
                  static_cast<int64_t>(c) ==
              n &&
          waiting_.load(std::memory_order_seq_cst)) {
        std::lock_guard<std::mutex> lk(done_mu_);  // the caller is blocked (or about to be)
        done_cv_.notify_one();
      }
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void grow(int workers) {
    while (static_cast<int>(threads_.size()) < workers) threads_.emplace_back([this] { worker(); });
  }

  void worker() {
    using Clock = std::chrono::steady_clock;
    while (!stop_.load(std::memory_order_relaxed)) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      if (open(t)) {
        work(t);
        continue;
      }
      // Spin for the next job, then sleep until one is published.
      const auto t0 = Clock::now();
      bool found = false;
      for (int i = 0; !found; ++i) {
        cpu_relax();
        found = open(ticket_.load(std::memory_order_acquire));
        if ((i & 63) == 63 && Clock::now() - t0 > std::chrono::microseconds(kSpinMicros)) break;
      }
      if (found) continue;
      std::unique_lock<std::mutex> lk(mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      cv_.wait(lk, [&] { return stop_.load() || open(ticket_.load(std::memory_order_seq_cst)); });
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  std::atomic<uint64_t> ticket_{0};
  std::atomic<void (*)(void*, int64_t)> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<uint64_t> share_{kIdxMask};  // claims of ceil(left / share_) units
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> waiting_{false};  // the caller blocks on done_cv_ for the last units
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  uint64_t gen_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
};

Pool& pool() {
  static Pool p;
  return p;
}

std::mutex& caller_mutex() {  // one job at a time if several threads call in
  static std::mutex m;
  return m;
}

}  // namespace

int pool_threads() {
  if (t_in_unit || omp_in_parallel()) return 1;
  return omp_get_max_threads();
}

namespace detail {

void parallel_for_impl(int64_t n, void (*fn)(void*, int64_t), void* ctx, Claim claim) {
  const int threads = pool_threads();
  if (n <= 0) return;
  if (n == 1 || threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
    return;
  }
  std::unique_lock<std::mutex> lk(caller_mutex(), std::try_to_lock);
  if (!lk.owns_lock()) {  // another thread's job is running: do this one here
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
    return;
  }
  for (int64_t i0 = 0; i0 < n; i0 += static_cast<int64_t>(kIdxMask)) {
    const int64_t m = std::min<int64_t>(n - i0, static_cast<int64_t>(kIdxMask));
    if (i0 == 0) {
      pool().run(m, threads, fn, ctx, claim);
    } else {  // offset the units of later pieces
      struct Off {
        void (*fn)(void*, int64_t);
        void* ctx;
        int64_t i0;
      } off{fn, ctx, i0};
      pool().run(
          m, threads,
          [](void* c, int64_t i) {
            const Off& o = *static_cast<const Off*>(c);
            o.fn(o.ctx, o.i0 + i);
          },
          &off, claim);
    }
  }
}

}  // namespace detail
}  // namespace vq::ops
