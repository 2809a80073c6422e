// make_cuda_engine where it cannot run: a CPU-only build (src/model/engine_cuda_stub.cpp), or a
// CUDA build on a machine without a device (src/model/engine_cuda.cpp), refuses with vq::Error
// "[engine] device cuda: expected ..." saying which is missing (engine.h) and pointing to
// --device cpu, before anything is allocated. On a machine with a device this is
// tests/cuda/test_cuda_engine.cpp's job: skipped.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "util/test_util.h"
#include "veloxquant/cuda.h"
#include "veloxquant/engine.h"
#include "veloxquant/error.h"

namespace vq {
namespace {

TEST(EngineCudaRefusal, SaysWhatIsMissing) {
  if (cuda::is_available()) GTEST_SKIP() << "a CUDA device is present";
  const std::string dir = test::source_path("models/vq-mini-llama");
  if (!std::filesystem::exists(dir + "/config.json")) GTEST_SKIP() << "no shipped model";
  const auto model = Model::load(dir);
  try {
    (void)make_cuda_engine(*model, EngineOptions{});
    FAIL() << "expected a refusal";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[engine] device cuda: expected ", 0), 0u) << msg;
    EXPECT_NE(msg.find("--device cpu"), std::string::npos) << msg;
#ifdef VQ_HAVE_CUDA
    EXPECT_NE(msg.find("a CUDA device but none was found"), std::string::npos) << msg;
#else
    EXPECT_NE(msg.find("-DVQ_CUDA=ON"), std::string::npos) << msg;
#endif
  }
}

}  // namespace
}  // namespace vq
