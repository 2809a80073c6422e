// The NCCL all-reduce of tensor parallelism (veloxquant/cuda.h make_nccl_communicator) against
// the in-process reference (veloxquant/tensor_parallel.h) on every visible device. Skipped with
// fewer than two devices or a build without NCCL (-DVQ_NCCL=ON).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "veloxquant/cuda.h"
#include "veloxquant/multi_gpu.h"
#include "veloxquant/tensor_parallel.h"

namespace vq {
namespace {

TEST(NcclCommunicator, SumsMatchTheReference) {
  const int n = cuda::device_count();
  if (n < 2 || !cuda::has_nccl()) GTEST_SKIP() << n << " device(s), NCCL " << cuda::has_nccl();
  const int64_t len = 100003;  // not a multiple of any chunking
  std::vector<int> devices(static_cast<size_t>(n));
  std::vector<cuda::Stream> streams(static_cast<size_t>(n), nullptr);
  std::vector<std::vector<float>> host(static_cast<size_t>(n));
  std::vector<cuda::DeviceBuffer> dev;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int r = 0; r < n; ++r) {
    devices[static_cast<size_t>(r)] = r;
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    auto& h = host[static_cast<size_t>(r)];
    h.resize(static_cast<size_t>(len));
    for (auto& x : h) x = nd(rng);
    dev.emplace_back(static_cast<size_t>(len) * sizeof(float));
    dev.back().upload(h.data(), h.size() * sizeof(float));
  }
  auto comm = cuda::make_nccl_communicator(devices, streams);
  std::vector<float*> bufs;
  for (auto& d : dev) bufs.push_back(static_cast<float*>(d.data()));
  comm->all_reduce_sum(bufs, len);
  // Reference, and the bound: any summation order of n terms is within (n - 1) u of the exact
  // sum times the sum of magnitudes, so two orders differ by at most 2 (n - 1) u sum|b_r|.
  std::vector<float*> hbufs;
  auto ref = host;
  for (auto& h : ref) hbufs.push_back(h.data());
  make_reference_communicator(n)->all_reduce_sum(hbufs, len);
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    std::vector<float> got(static_cast<size_t>(len));
    dev[static_cast<size_t>(r)].download(got.data(), got.size() * sizeof(float));
    for (int64_t i = 0; i < len; ++i) {
      double mag = 0;
      for (int q = 0; q < n; ++q)
        mag += std::abs(host[static_cast<size_t>(q)][static_cast<size_t>(i)]);
      ASSERT_LE(std::abs(got[static_cast<size_t>(i)] - ref[0][static_cast<size_t>(i)]),
                2.0 * (n - 1) * std::ldexp(1.0, -24) * mag)
          << "rank " << r << " element " << i;
    }
  }
}

}  // namespace
}  // namespace vq
