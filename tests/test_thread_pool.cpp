// The worker pool of src/ops/thread_pool.h: every unit runs exactly once (1..4 threads, guided
// and one-at-a-time claims, loop sizes around the ticket's 2^20-unit job limit, thousands of
// back-to-back jobs; parallel_for_if), nested calls and calls from several threads at once run
// to completion.
#include "ops/thread_pool.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <thread>
#include <vector>

namespace vq {
namespace {

struct Threads {  // omp_set_num_threads for one scope
  int old;
  explicit Threads(int n) : old(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~Threads() { omp_set_num_threads(old); }
};

TEST(ThreadPool, EveryUnitRunsOnce) {
  for (int threads : {1, 2, 4})
    for (ops::Claim claim : {ops::Claim::kGuided, ops::Claim::kOne}) {
      Threads t(threads);
      for (int64_t n : {0, 1, 2, 3, 17, 1000, (1 << 20) + 5}) {
        std::vector<std::atomic<uint8_t>> hits(static_cast<size_t>(n));
        ops::parallel_for(
            n, [&](int64_t i) { hits[static_cast<size_t>(i)].fetch_add(1); }, claim);
        int64_t bad = 0;
        for (auto& h : hits) bad += h.load() != 1;
        EXPECT_EQ(bad, 0) << "threads " << threads << " n " << n << " claim "
                          << static_cast<int>(claim);
      }
    }
}

TEST(ThreadPool, ParallelForIfRunsSeriallyInOrderWhenNotAsked) {
  Threads t(4);
  std::vector<int64_t> order;
  ops::parallel_for_if(false, 50, [&](int64_t i) { order.push_back(i); });
  ASSERT_EQ(order.size(), 50u);
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
  std::vector<std::atomic<uint8_t>> hits(1000);
  ops::parallel_for_if(true, 1000, [&](int64_t i) { hits[static_cast<size_t>(i)].fetch_add(1); });
  int64_t bad = 0;
  for (auto& h : hits) bad += h.load() != 1;
  EXPECT_EQ(bad, 0);
}

TEST(ThreadPool, ManyBackToBackJobs) {
  Threads t(2);
  std::atomic<int64_t> sum{0};
  for (int job = 0; job < 20000; ++job)
    ops::parallel_for(
        job % 5 + 2, [&](int64_t i) { sum.fetch_add(i + 1); },
        job % 2 ? ops::Claim::kOne : ops::Claim::kGuided);
  int64_t want = 0;
  for (int job = 0; job < 20000; ++job) {
    const int64_t n = job % 5 + 2;
    want += n * (n + 1) / 2;
  }
  EXPECT_EQ(sum.load(), want);
}

TEST(ThreadPool, NestedAndConcurrentCallsComplete) {
  Threads t(2);
  std::atomic<int64_t> count{0};
  ops::parallel_for(8, [&](int64_t) {
    EXPECT_EQ(ops::pool_threads(), 1);  // inside a unit: serial
    ops::parallel_for(10, [&](int64_t) { count.fetch_add(1); });
  });
  EXPECT_EQ(count.load(), 80);
  std::atomic<int64_t> a{0}, b{0};
  std::thread other([&] {
    for (int j = 0; j < 500; ++j) ops::parallel_for(7, [&](int64_t) { a.fetch_add(1); });
  });
  for (int j = 0; j < 500; ++j) ops::parallel_for(9, [&](int64_t) { b.fetch_add(1); });
  other.join();
  EXPECT_EQ(a.load(), 3500);
  EXPECT_EQ(b.load(), 4500);
}

}  // namespace
}  // namespace vq
