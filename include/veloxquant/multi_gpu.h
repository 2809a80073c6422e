// What tensor parallelism over several GPUs needs from the CUDA backend (veloxquant/cuda.h holds
// the rest): the visible devices, whether the build has NCCL, and the NCCL all-reduce. Without
// VQ_CUDA: no devices, no NCCL, and make_nccl_communicator refuses (src/cuda/no_cuda.cpp).
#pragma once

#include <memory>
#include <vector>

#include "veloxquant/communicator.h"

namespace vq::cuda {

using Stream = void*;  // a cudaStream_t (as in veloxquant/cuda.h)

// CUDA devices visible to this process (0 without a CUDA build, a driver or a device).
int device_count();
// True when the library was built with NCCL (-DVQ_NCCL=ON and CMake found it).
bool has_nccl();
// The NCCL sum all-reduce (veloxquant/communicator.h) over one device per rank, driven by this
// process (ncclCommInitAll; one ncclAllReduce per rank inside a group, each on its rank's
// stream; buffers are device pointers on the rank's device). NCCL's summation order (ring or
// tree) is its own: the tensor-parallel bound's cross-rank term holds for any order. Without
// NCCL in the build: vq::Error "[cuda] ... NCCL".
std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<int>& devices,
                                                     const std::vector<Stream>& streams);

}  // namespace vq::cuda
