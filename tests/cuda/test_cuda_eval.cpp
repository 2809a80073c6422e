// The evaluation engine on the CUDA engine (EvalSettings::device = kCuda, src/eval/common.cpp
// EvalSeq) against the same evaluation on the CPU, on the shipped model (models/vq-mini-llama,
// bf16 weights, L = 6 layers): ppl/kld and passkey. Skipped cleanly without a device or model.
//
// Declared tolerances. The CPU side runs MatmulPrecision::kBF16: the same operands rounded to
// bf16 at the same 4L + 1 sites as the engine (test_cuda_engine.cpp's header), so the two differ
// only by fp32 summation order inside the products (|dy| <= k 2^-24 sum|x_i w_i| for k-term sums,
// k <= 1024 here: ~6e-5 relative) and the attention kernels' fp32 arithmetic. A scored token's
// log-probability moves by at most 2 max|dz| (log-softmax is 1-Lipschitz in the max norm for
// each of its two terms), so the mean NLL, and ppl to first order, move by at most 2 max|dz|;
// with max|dz| at the 6e-5 relative level and max|z| ~ 20 on this model that is ~2e-3 nats in the
// worst case with every error aligned, and sums over ~10^3 scored tokens of unaligned errors
// cancel to far below it. The acceptance, perplexity within 0.01 % (1e-4 relative), is
// asserted for the full cache and the methods that keep K/V in fp16 rows (snapkv, streaming):
// their selections are exact functions of the same scores up to near ties, and none flipped in
// the runs recorded in docs/results/gpu/engine/. Quantized caches (skvq) hold codes that flip on
// tiny key differences (test_cuda_engine.cpp's header): they get the same triangle argument as
// there, |ppl_gpu(M) - ppl_cpu(M)| <= 2 |ppl_cpu(M) - ppl_cpu(full)| + 1e-4 ppl_cpu(M): the GPU's
// compression error no larger than the CPU's own. Memory figures (context, rows kept, bytes
// accounted) are exact and must be equal (snapkv+skvq's fp16/packed split follows its selection:
// printed, not compared). Passkey: the same correct counts per mode, length and depth for every
// method, and the same needle survival for the full cache (1.0: every row kept).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "util/test_util.h"
#include "veloxquant/error.h"
#include "veloxquant/eval.h"
#include "veloxquant/model.h"
#include "veloxquant/tokenizer.h"

namespace vq {
namespace {

struct Fixture {
  std::unique_ptr<Model> model;
  std::string dir, why;
};

const Fixture& fixture() {
  static Fixture f = [] {
    Fixture x;
    x.dir = find_shipped_model();
    if (x.dir.empty()) x.dir = test::source_path("models/vq-mini-llama");
    if (!std::ifstream(x.dir + "/config.json")) {
      x.why = "no shipped model at " + x.dir;
      return x;
    }
    x.model = Model::load(x.dir);
    return x;
  }();
  return f;
}

#define SKIP_WITHOUT_MODEL() \
  SKIP_WITHOUT_DEVICE();     \
  if (!fixture().why.empty()) GTEST_SKIP() << fixture().why;

const char* kMethods =
    "snapkv:budget=128:obs_window=16,streaming:budget=128,skvq:bits_key=4:bits_value=4,"
    "snapkv+skvq:budget=128";

EvalSettings settings(Device d) {
  EvalSettings st;
  st.device = d;
  st.matmul = MatmulPrecision::kBF16;  // the CPU's arithmetic class of the engine (see header)
  st.progress = false;
  st.prefill_step = 128;
  return st;
}

bool keeps_fp16_rows(const std::string& family) {
  return family == "full" || family == "snapkv" || family == "streaming";
}

TEST(CudaEval, TextFiguresMatchCpu) {
  SKIP_WITHOUT_MODEL();
  const Model& m = *fixture().model;
  const auto docs = load_token_rows_u16(test::source_path("data/eval/heldout_ids.u16"),
                                        m.config().max_position_embeddings);
  TextEvalOptions o;
  o.prefill = 512;
  o.decode = 128;
  o.max_docs = 3;
  const auto methods = parse_eval_methods(kMethods);
  const TextEvalResult cpu = eval_text(m, docs, methods, o, settings(Device::kCpu));
  const TextEvalResult gpu = eval_text(m, docs, methods, o, settings(Device::kCuda));
  const double rel_full = gpu.ppl_full / cpu.ppl_full - 1.0;
  std::printf("full: ppl cpu %.6f gpu %.6f (rel %.2e)\n", cpu.ppl_full, gpu.ppl_full, rel_full);
  EXPECT_LE(std::fabs(rel_full), 1e-4);
  EXPECT_EQ(gpu.mem_full.bytes_accounted, cpu.mem_full.bytes_accounted);
  EXPECT_EQ(gpu.mem_full.rows_kept, cpu.mem_full.rows_kept);
  ASSERT_EQ(gpu.rows.size(), cpu.rows.size());
  for (size_t i = 0; i < cpu.rows.size(); ++i) {
    const TextEvalRow &c = cpu.rows[i], &g = gpu.rows[i];
    const double rel = g.ppl / c.ppl - 1.0;
    std::printf(
        "%s: ppl cpu %.6f gpu %.6f (rel %.2e) kld cpu %.3e gpu %.3e top1 %.4f %.4f "
        "bytes %lld %lld rows %.2f %.2f\n",
        c.label.c_str(), c.ppl, g.ppl, rel, c.kld_mean, g.kld_mean, c.top1_agree, g.top1_agree,
        static_cast<long long>(c.mem.bytes_accounted),
        static_cast<long long>(g.mem.bytes_accounted), c.mem.rows_kept, g.mem.rows_kept);
    EXPECT_EQ(g.mem.context, c.mem.context) << c.label;
    EXPECT_EQ(g.mem.rows_kept, c.mem.rows_kept) << c.label;
    EXPECT_EQ(g.rows_end, c.rows_end) << c.label;
    if (c.family != "snapkv+skvq") {
      EXPECT_EQ(g.mem.bytes_accounted, c.mem.bytes_accounted) << c.label;
    }
    if (keeps_fp16_rows(c.family)) {
      EXPECT_LE(std::fabs(rel), 1e-4) << c.label;
    } else {
      const double own = std::fabs(c.ppl - cpu.ppl_full);
      EXPECT_LE(std::fabs(g.ppl - c.ppl), 2.0 * own + 1e-4 * c.ppl) << c.label;
    }
  }
}

void expect_same_scores(const PasskeyModeScore& c, const PasskeyModeScore& g,
                        const std::string& what) {
  EXPECT_EQ(g.correct, c.correct) << what;
  EXPECT_EQ(g.total, c.total) << what;
  EXPECT_EQ(g.by_length, c.by_length) << what;
  EXPECT_EQ(g.by_depth, c.by_depth) << what;
}

TEST(CudaEval, PasskeyAnswersMatchCpu) {
  SKIP_WITHOUT_MODEL();
  const Model& m = *fixture().model;
  const Tokenizer tok = Tokenizer::from_file(fixture().dir + "/tokenizer.json");
  const auto prompts = load_passkey_jsonl(test::source_path("data/eval/passkey.jsonl"));
  PasskeyOptions o;
  o.max_prompts = 24;
  const auto methods = parse_eval_methods(kMethods);
  const PasskeyResult cpu = eval_passkey(m, tok, prompts, methods, o, settings(Device::kCpu));
  const PasskeyResult gpu = eval_passkey(m, tok, prompts, methods, o, settings(Device::kCuda));
  expect_same_scores(cpu.full.aware, gpu.full.aware, "full aware");
  expect_same_scores(cpu.full.agnostic, gpu.full.agnostic, "full agnostic");
  EXPECT_EQ(gpu.full.aware.needle_rows_kept(), cpu.full.aware.needle_rows_kept());
  EXPECT_EQ(gpu.full.mem.bytes_accounted, cpu.full.mem.bytes_accounted);
  ASSERT_EQ(gpu.rows.size(), cpu.rows.size());
  for (size_t i = 0; i < cpu.rows.size(); ++i) {
    const PasskeyRow &c = cpu.rows[i], &g = gpu.rows[i];
    std::printf(
        "%s: aware cpu %lld gpu %lld, agnostic cpu %lld gpu %lld of %lld; needle rows "
        "kept cpu %.4f gpu %.4f\n",
        c.label.c_str(), static_cast<long long>(c.aware.correct),
        static_cast<long long>(g.aware.correct), static_cast<long long>(c.agnostic.correct),
        static_cast<long long>(g.agnostic.correct), static_cast<long long>(c.aware.total),
        c.aware.needle_rows_kept(), g.aware.needle_rows_kept());
    expect_same_scores(c.aware, g.aware, c.label + " aware");
    expect_same_scores(c.agnostic, g.agnostic, c.label + " agnostic");
  }
}

TEST(CudaEval, RefusesWhatOnlyTheCpuRuns) {
  SKIP_WITHOUT_MODEL();
  const Model& m = *fixture().model;
  const auto docs = load_token_rows_u16(test::source_path("data/eval/heldout_ids.u16"),
                                        m.config().max_position_embeddings);
  TextEvalOptions o;
  o.prefill = 64;
  o.decode = 4;
  o.max_docs = 1;
  EXPECT_THROW(eval_attn_error(m, docs, parse_eval_methods("full"), o, settings(Device::kCuda)),
               Error);
  EXPECT_THROW(
      eval_text(m, docs,
                parse_eval_methods("snapkv:budget=32:scoring=external:evict_at=prompt_end"), o,
                settings(Device::kCuda)),
      Error);
  o.prefill = 1;  // P - 1 = 0 prompt tokens: an engine step needs at least one
  EXPECT_THROW(eval_text(m, docs, parse_eval_methods("full"), o, settings(Device::kCuda)), Error);
}

}  // namespace
}  // namespace vq
