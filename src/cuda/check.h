// One error-checking path for every CUDA runtime call of the backend: VQ_CUDA_CHECK(call) turns a
// failure into vq::Error "[cuda] <call> failed at file:line: <name>: <message>", and
// VQ_CUDA_LAUNCH_CHECK(op) checks cudaGetLastError() after a kernel launch. Host-only header,
// usable from .cpp files (C++ compiler) and .cu files (nvcc) alike. The library never exits.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "veloxquant/error.h"

namespace vq::cuda::detail {

[[noreturn]] void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line);

inline cudaStream_t to_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}

}  // namespace vq::cuda::detail

#define VQ_CUDA_CHECK(call)                                                          \
  do {                                                                               \
    const cudaError_t vq_cuda_err_ = (call);                                         \
    if (vq_cuda_err_ != cudaSuccess)                                                 \
      ::vq::cuda::detail::throw_cuda_error(vq_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)

#define VQ_CUDA_LAUNCH_CHECK(op) VQ_CUDA_CHECK(cudaGetLastError())
