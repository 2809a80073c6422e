// The collective that tensor parallelism needs (veloxquant/tensor_parallel.h): a sum all-reduce
// over fp32 buffers, one per rank, driven by one process that holds every rank (one device per
// rank). Implementations: the in-process reference (src/model/tensor_parallel.cpp) and NCCL
// (src/cuda/nccl_communicator.cpp, builds with VQ_NCCL).
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace vq {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int64_t size() const = 0;
  virtual std::string name() const = 0;
  // bufs.size() == size(), each of n floats where the implementation keeps rank data (host
  // memory for the reference, rank r's device for NCCL). After the call every buffer holds the
  // elementwise sum over ranks. vq::Error on a wrong count.
  virtual void all_reduce_sum(std::span<float* const> bufs, int64_t n) = 0;
};

}  // namespace vq
