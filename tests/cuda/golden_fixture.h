// The shipped model (models/vq-mini-llama) and the golden prompts (tests/data/golden/golden.json,
// all but "passkey") loaded once per GPU test program that compares engines on them
// (test_cuda_engine.cpp, test_cuda_tensor_parallel.cpp); SKIP_WITHOUT_MODEL() skips cleanly
// without a device or without either file, naming what is missing.
#pragma once

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "util/test_util.h"
#include "veloxquant/model.h"

namespace vq::test {

struct GoldenFixture {
  std::unique_ptr<Model> model;
  std::vector<std::vector<int32_t>> prompts;  // golden.json prompt ids: short, medium, long
  std::string why;                            // non-empty: skip
};

inline const GoldenFixture& golden_fixture() {
  static GoldenFixture f = [] {
    GoldenFixture x;
    std::string dir = find_shipped_model();
    if (dir.empty()) dir = source_path("models/vq-mini-llama");
    const std::string golden = source_path("tests/data/golden/golden.json");
    std::ifstream in(golden);
    if (!in || !std::ifstream(dir + "/config.json")) {
      x.why = "no shipped model or golden prompts (" + dir + ", " + golden + ")";
      return x;
    }
    const auto j = nlohmann::json::parse(in);
    for (const auto& p : j.at("prompts"))
      if (p.at("name") != "passkey") x.prompts.push_back(p.at("ids").get<std::vector<int32_t>>());
    x.model = Model::load(dir);
    return x;
  }();
  return f;
}

}  // namespace vq::test

#define SKIP_WITHOUT_MODEL() \
  SKIP_WITHOUT_DEVICE();     \
  if (!::vq::test::golden_fixture().why.empty()) GTEST_SKIP() << ::vq::test::golden_fixture().why;
