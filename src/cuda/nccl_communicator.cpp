// The NCCL all-reduce (veloxquant/cuda.h make_nccl_communicator): one communicator per rank made
// together by ncclCommInitAll in this process, one device per rank. all_reduce_sum queues one
// in-place ncclAllReduce(fp32, sum) per rank on the rank's stream inside ncclGroupStart/End (the
// form NCCL requires when one thread drives several devices) and returns without waiting; the
// rank's later work on the same stream sees the sums. Compiled only with VQ_NCCL.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>
#include <vector>

#include "cuda/check.h"
#include "veloxquant/cuda.h"
#include "veloxquant/error.h"
#include "veloxquant/multi_gpu.h"

namespace vq::cuda {

namespace {

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess)
    throw Error(std::string("[cuda] NCCL ") + what + ": " + ncclGetErrorString(r));
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const std::vector<int>& devices, const std::vector<Stream>& streams)
      : devices_(devices), streams_(streams), comms_(devices.size(), nullptr) {
    VQ_CHECK(!devices.empty() && streams.size() == devices.size(),
             "[cuda] make_nccl_communicator: expected one stream per device (>= 1 device) but "
             "got " +
                 std::to_string(devices.size()) + " devices and " + std::to_string(streams.size()) +
                 " streams");
    int count = 0;
    VQ_CUDA_CHECK(cudaGetDeviceCount(&count));
    for (int d : devices)
      VQ_CHECK(d >= 0 && d < count, "[cuda] make_nccl_communicator: expected device ids in [0, " +
                                        std::to_string(count) + ") but got " + std::to_string(d));
    nccl_check(ncclCommInitAll(comms_.data(), static_cast<int>(devices.size()), devices.data()),
               "ncclCommInitAll");
  }
  ~NcclCommunicator() override {
    for (ncclComm_t c : comms_)
      if (c) ncclCommDestroy(c);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int64_t size() const override { return static_cast<int64_t>(comms_.size()); }
  std::string name() const override { return "nccl"; }

  void all_reduce_sum(std::span<float* const> bufs, int64_t n) override {
    VQ_CHECK(bufs.size() == comms_.size() && n >= 0,
             "[cuda] all_reduce_sum: expected " + std::to_string(comms_.size()) +
                 " buffers and n >= 0 but got " + std::to_string(bufs.size()) + " buffers, n " +
                 std::to_string(n));
    if (n == 0) return;
    int prev = 0;
    VQ_CUDA_CHECK(cudaGetDevice(&prev));
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (size_t r = 0; r < comms_.size(); ++r) {
      VQ_CUDA_CHECK(cudaSetDevice(devices_[r]));
      nccl_check(ncclAllReduce(bufs[r], bufs[r], static_cast<size_t>(n), ncclFloat32, ncclSum,
                               comms_[r], static_cast<cudaStream_t>(streams_[r])),
                 "ncclAllReduce");
    }
    nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    VQ_CUDA_CHECK(cudaSetDevice(prev));
  }

 private:
  std::vector<int> devices_;
  std::vector<Stream> streams_;
  std::vector<ncclComm_t> comms_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<int>& devices,
                                                     const std::vector<Stream>& streams) {
  return std::make_unique<NcclCommunicator>(devices, streams);
}

}  // namespace vq::cuda
