// Stream-ordered scratch memory for the temporaries of one operation: cudaMallocAsync on a stream,
// cudaFreeAsync on the same stream when it goes out of scope. Work queued on the stream before
// the free still reads it, and nothing waits: a DeviceBuffer's cudaFree waits for the whole
// device, and freeing one early needs a stream synchronisation first. Sized like DeviceBuffer
// (whole 16-byte words plus one spare) so kernels may read whole words at its end. Host-only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda/check.h"

namespace vq::cuda::detail {

class StreamScratch {
 public:
  StreamScratch(size_t bytes, cudaStream_t st) : st_(st) {
    if (bytes > 0) VQ_CUDA_CHECK(cudaMallocAsync(&p_, (bytes + 15) / 16 * 16 + 16, st));
  }
  ~StreamScratch() {
    if (p_) (void)cudaFreeAsync(p_, st_);  // never throws from a destructor
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;

  void* data() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  cudaStream_t st_ = nullptr;
};

}  // namespace vq::cuda::detail
