// What tensor parallelism over several GPUs needs from the CUDA backend (veloxquant/cuda.h holds
// the rest): the visible devices, the current device (and a guard that sets it), whether the build
// has NCCL, and the two device communicators: NCCL over one device per rank, and the reference that
// runs N simulated ranks on one device (the sharding's test on one GPU). Without VQ_CUDA: no
// devices, no NCCL, and the rest refuses (src/cuda/no_cuda.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "veloxquant/communicator.h"

namespace vq::cuda {

using Stream = void*;  // a cudaStream_t (as in veloxquant/cuda.h)

// CUDA devices visible to this process (0 without a CUDA build, a driver or a device).
int device_count();
// cudaSetDevice / cudaGetDevice (vq::Error on failure).
void set_device(int device);
int current_device();
// Makes `device` the calling thread's current device for the guard's life (no call when it already
// is), then makes the previous one current again if it no longer is (never throws from there).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_;
};
// True when the library was built with NCCL (-DVQ_NCCL=ON and CMake found it).
bool has_nccl();
// The NCCL sum all-reduce (veloxquant/communicator.h) over one device per rank, driven by this
// process (ncclCommInitAll; one ncclAllReduce per rank inside a group, each on its rank's
// stream; buffers are device pointers on the rank's device). NCCL's summation order (ring or
// tree) is its own: the tensor-parallel bound's cross-rank term holds for any order. Without
// NCCL in the build: vq::Error "[cuda] ... NCCL".
std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<int>& devices,
                                                     const std::vector<Stream>& streams);

// N simulated ranks on the current device: every buffer is a device pointer there, and one
// kernel on `stream` (src/cuda/rank_sum.cu) sums element i over the ranks in rank order,
// ((b_0 + b_1) + b_2) + ... in fp32 round-to-nearest, the order of make_reference_communicator
// (veloxquant/tensor_parallel.h), and writes it to every buffer. 1 <= N <= 64, else vq::Error.
std::unique_ptr<Communicator> make_device_reference_communicator(int64_t n_ranks, Stream stream);

}  // namespace vq::cuda
