// The all-reduce of simulated tensor-parallel ranks on one device (veloxquant/multi_gpu.h
// make_device_reference_communicator): every rank's fp32 buffer lives on the current device;
// one kernel sums element i over the ranks in rank order, ((b_0 + b_1) + b_2) + ..., rounded to
// nearest in fp32 at each addition (__fadd_rn: no contraction), and writes the sum back to every
// buffer, so each rank sees exactly what make_reference_communicator
// (src/model/tensor_parallel.cpp) computes on the host.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <string>

#include "cuda/check.h"
#include "veloxquant/error.h"
#include "veloxquant/multi_gpu.h"

namespace vq::cuda {

namespace {

constexpr int kMaxRanks = 64;  // the kernel's argument holds the pointers (512 bytes)

struct RankPtrs {
  float* p[kMaxRanks];
};

__global__ void rank_sum_kernel(RankPtrs b, int n_ranks, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = b.p[0][i];
    for (int r = 1; r < n_ranks; ++r) s = __fadd_rn(s, b.p[r][i]);
    for (int r = 0; r < n_ranks; ++r) b.p[r][i] = s;
  }
}

class DeviceReferenceCommunicator final : public Communicator {
 public:
  DeviceReferenceCommunicator(int64_t n, Stream s) : n_(n), stream_(s) {
    VQ_CHECK(n >= 1 && n <= kMaxRanks, "[cuda] make_device_reference_communicator: expected 1 to " +
                                           std::to_string(kMaxRanks) + " ranks but got " +
                                           std::to_string(n));
  }
  int64_t size() const override { return n_; }
  std::string name() const override { return "device-reference"; }
  void all_reduce_sum(std::span<float* const> bufs, int64_t n) override {
    VQ_CHECK(static_cast<int64_t>(bufs.size()) == n_ && n >= 0,
             "[cuda] all_reduce_sum: expected " + std::to_string(n_) +
                 " buffers and n >= 0 but got " + std::to_string(bufs.size()) + " buffers, n " +
                 std::to_string(n));
    if (n == 0 || n_ == 1) return;
    RankPtrs p{};
    for (int64_t r = 0; r < n_; ++r) p.p[r] = bufs[static_cast<size_t>(r)];
    const int64_t blocks = std::min<int64_t>((n + 255) / 256, 65535);
    rank_sum_kernel<<<static_cast<unsigned>(blocks), 256, 0, detail::to_stream(stream_)>>>(
        p, static_cast<int>(n_), n);
    VQ_CUDA_LAUNCH_CHECK("rank_sum");
  }

 private:
  int64_t n_;
  Stream stream_;
};

}  // namespace

std::unique_ptr<Communicator> make_device_reference_communicator(int64_t n_ranks, Stream s) {
  return std::make_unique<DeviceReferenceCommunicator>(n_ranks, s);
}

}  // namespace vq::cuda
