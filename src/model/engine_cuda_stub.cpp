// make_cuda_engine for builds without the CUDA engine (VQ_CUDA off, or src/model/engine_cuda.cpp
// not there yet): refuses with a vq::Error saying the build has no CUDA. CMakeLists.txt compiles
// this file exactly when it does not compile src/model/engine_cuda.cpp.
#include "veloxquant/engine.h"
#include "veloxquant/error.h"

namespace vq {

std::unique_ptr<Engine> make_cuda_engine(const Model&, const EngineOptions&) {
  throw Error(
      "[engine] device cuda: expected a build with the CUDA engine but this build has none "
      "(configure with -DVQ_CUDA=ON); use --device cpu");
}

}  // namespace vq
