// The CUDA backend's public entry points. Without VQ_CUDA every entry point reports the backend
// unavailable (src/cuda/no_cuda.cpp).
#pragma once

namespace vq::cuda {

// True when the library was built with CUDA and a device is present.
bool is_available();

}  // namespace vq::cuda
