// make_cuda_engine where it cannot run: a CPU-only build, or a CUDA build on a machine without a
// device, refuses with vq::Error "[engine] ..." saying which is missing (engine.h), before
// anything is allocated. On a machine with a device this is tests/cuda/test_cuda_engine.cpp's
// job: skipped.
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
    EXPECT_EQ(msg.rfind("[engine] expected ", 0), 0u) << msg;
#ifdef VQ_HAVE_CUDA
    EXPECT_NE(msg.find("CUDA device"), std::string::npos) << msg;
#else
    EXPECT_NE(msg.find("CPU-only build"), std::string::npos) << msg;
    EXPECT_NE(msg.find("-DVQ_CUDA=ON"), std::string::npos) << msg;
#endif
  }
}

}  // namespace
}  // namespace vq
