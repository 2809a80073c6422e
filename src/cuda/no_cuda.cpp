// CUDA stubs for builds without VQ_CUDA: the backend reports itself unavailable.
#include "veloxquant/cuda.h"

namespace vq::cuda {

bool is_available() { return false; }

}  // namespace vq::cuda
