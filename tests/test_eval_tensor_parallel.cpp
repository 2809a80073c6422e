// The evaluation engine on N tensor-parallel ranks (EvalSettings::tensor_parallel, CPU simulated
// ranks): eval_text on the shipped model (2 KV heads, N = 2) gives the N = 1 figures within the
// bound of the sharded pass's fp32 reordering (tests/util/tp_bound.h), the same byte and row
// figures, the same passkey answers and needle survival; and the refusals (N not dividing the KV
// heads, tp_simulate on the CPU, attn-error, snapkv:scoring=external, P = 1); the JSON report
// records N.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/report.h"
#include "util/test_util.h"
#include "util/tp_bound.h"
#include "veloxquant/error.h"
#include "veloxquant/eval.h"
#include "veloxquant/generate.h"
#include "veloxquant/model.h"
#include "veloxquant/tokenizer.h"

namespace vq {
namespace {

constexpr int kQuantBits = 8;  // SKVQ codes at 8 bits: the bound's quantization-step term

const Model* shipped() {
  static const std::unique_ptr<Model> m = [] {
    const std::string dir = test::source_path("models/vq-mini-llama");
    return std::filesystem::exists(dir + "/config.json") ? Model::load(dir) : nullptr;
  }();
  return m.get();
}

#define REQUIRE_SHIPPED() \
  if (!shipped()) GTEST_SKIP() << "models/vq-mini-llama has no model (config.json absent)"

EvalSettings settings(int64_t n) {
  EvalSettings s;
  s.prefill_step = 64;
  s.kv_dtype = DType::kF32;  // the bound assumes K/V reach the caches unrounded (tp_bound.h)
  s.progress = false;
  s.tensor_parallel = n;
  return s;
}

std::vector<std::vector<int32_t>> docs() {
  return load_token_rows_u16(test::source_path("data/eval/heldout_ids.u16"),
                             shipped()->config().max_position_embeddings);
}

TextEvalOptions text_options() {
  TextEvalOptions o;
  o.prefill = 64;
  o.decode = 16;
  o.max_docs = 1;
  return o;
}

// The largest over the scored steps of the sharded logit bound: eval's CPU protocol (prefill of
// P - 1 tokens, T decode steps; eval/common.cpp) rerun through Model::forward for each step's
// largest |logit|.
double step_bound(const CacheConfig& cfg, const std::vector<int32_t>& ids, int quant_bits) {
  const Model& m = *shipped();
  const TextEvalOptions o = text_options();
  const EvalSettings s = settings(1);
  auto caches = m.make_caches(cfg);
  ForwardScratch scratch;
  prefill(m, ids.data(), o.prefill - 1, caches, s.prefill_step, s.kv_dtype, nullptr, &scratch);
  ForwardOptions fo;
  fo.kv_dtype = s.kv_dtype;
  fo.logits = ForwardOptions::Logits::kLast;
  std::vector<float> lg;
  double worst = 0;
  for (int64_t t = 0; t < o.decode; ++t) {
    m.forward(&ids[static_cast<size_t>(o.prefill - 1 + t)], 1, 1, caches, fo, &lg, &scratch);
    double mx = 0;
    for (float x : lg) mx = std::max(mx, static_cast<double>(std::abs(x)));
    worst = std::max(worst, test::sharded_logit_bound(m.config(), 2, mx, quant_bits));
  }
  return worst;
}

// |Δ ln ppl| = |Δ mean NLL| <= mean over tokens of |Δ log softmax| <= 2 max |Δ logit| = 2 δ.
// KL_t = sum_i p_i (lp_i - lq_i) (p: the full cache's distribution, q: the method's). With
// |Δ lp_i| <= e = 2 δ_full and |Δ lq_i| <= h = 2 δ_method, |p'_i - p_i| <= p_i (e^e - 1), so
// |Δ KL_t| <= (e^e - 1) sum_i p_i |lp'_i - lq'_i| + e + h, and
// sum_i p_i |lp_i - lq_i| <= KL_t + 2 TV <= KL_t + sqrt(2 KL_t) (log x <= x - 1, then Pinsker).
// The mean over tokens, sqrt concave: |Δ kld_mean| <= (e^e - 1)(K + sqrt(2 K) + e + h) + e + h
// with K the N = 1 kld_mean.
double kld_bound(double kld1, double d_full, double d_method) {
  const double e = 2 * d_full, h = 2 * d_method;
  return std::expm1(e) * (kld1 + std::sqrt(2 * kld1) + e + h) + e + h;
}

TEST(EvalTensorParallel, TwoRanksGiveTheOneRankFigures) {
  REQUIRE_SHIPPED();
  const auto d = docs();
  const std::string g = std::to_string(std::min<int64_t>(shipped()->config().head_dim, 32));
  const std::string b = std::to_string(kQuantBits);
  const auto methods = parse_eval_methods("full,skvq:bits_key=" + b + ":bits_value=" + b +
                                          ":group_size=" + g + ":window=16:n_sink=2");
  const TextEvalOptions o = text_options();
  const TextEvalResult r1 = eval_text(*shipped(), d, methods, o, settings(1));
  const TextEvalResult r2 = eval_text(*shipped(), d, methods, o, settings(2));
  const double df = step_bound(methods[0].cfg, d[0], 0);
  const double dq = step_bound(methods[1].cfg, d[0], kQuantBits);
  const double bounds[] = {df, dq};

  // The N = 2 figures come from the sharded pass: its reordered sums move some logit.
  EXPECT_NE(r2.ppl_full, r1.ppl_full);
  EXPECT_LE(std::abs(std::log(r2.ppl_full) - std::log(r1.ppl_full)), 2 * df);
  EXPECT_EQ(r2.mem_full.bytes_accounted, r1.mem_full.bytes_accounted);
  EXPECT_EQ(r2.mem_full.fp16_bytes, r1.mem_full.fp16_bytes);
  EXPECT_EQ(r2.mem_full.rows_kept, r1.mem_full.rows_kept);
  EXPECT_EQ(r2.mem_full.context, r1.mem_full.context);
  ASSERT_EQ(r2.rows.size(), 2u);
  for (size_t k = 0; k < r2.rows.size(); ++k) {
    const TextEvalRow &a = r1.rows[k], &c = r2.rows[k];
    SCOPED_TRACE(a.label);
    EXPECT_EQ(c.n_tokens, a.n_tokens);
    EXPECT_LE(std::abs(c.nll - a.nll), 2 * bounds[k]);
    EXPECT_LE(std::abs(c.kld_mean - a.kld_mean), kld_bound(a.kld_mean, df, bounds[k]));
    EXPECT_EQ(c.mem.bytes_accounted, a.mem.bytes_accounted);
    EXPECT_EQ(c.mem.rows_kept, a.mem.rows_kept);
    EXPECT_EQ(c.rows_end, a.rows_end);
    std::printf("  %s: |d nll| %.3g (bound %.3g), |d kld| %.3g (bound %.3g)\n", a.label.c_str(),
                std::abs(c.nll - a.nll), 2 * bounds[k], std::abs(c.kld_mean - a.kld_mean),
                kld_bound(a.kld_mean, df, bounds[k]));
  }
  // `full` on the ranks against the baseline on the same ranks: the same arithmetic.
  EXPECT_EQ(r2.rows[0].kld_mean, 0.0);
  // The JSON report says how many ranks ran it (tools/cli/report.h), and reads back.
  const TextEvalResult back = text_result_from_json(render(r2, ReportFormat::kJson));
  EXPECT_EQ(back.settings.tensor_parallel, 2);
  EXPECT_EQ(text_result_from_json(render(r1, ReportFormat::kJson)).settings.tensor_parallel, 1);
}

TEST(EvalTensorParallel, TwoRanksGiveTheSamePasskeyAnswers) {
  REQUIRE_SHIPPED();
  const std::string dir = test::source_path("models/vq-mini-llama");
  const Tokenizer tok = Tokenizer::from_file(dir + "/tokenizer.json");
  const auto prompts = load_passkey_jsonl(test::source_path("data/eval/passkey.jsonl"));
  PasskeyOptions o;
  o.max_prompts = 2;
  o.lengths = {512};
  const auto methods = parse_eval_methods("snapkv:budget=128:scoring=query");
  EvalSettings s1 = settings(1), s2 = settings(2);
  s1.prefill_step = s2.prefill_step = 512;
  const PasskeyResult r1 = eval_passkey(*shipped(), tok, prompts, methods, o, s1);
  const PasskeyResult r2 = eval_passkey(*shipped(), tok, prompts, methods, o, s2);
  ASSERT_EQ(r2.n_prompts, 2);
  const PasskeyRow* rows1[] = {&r1.full, &r1.rows[0]};
  const PasskeyRow* rows2[] = {&r2.full, &r2.rows[0]};
  for (int k = 0; k < 2; ++k) {
    SCOPED_TRACE(rows1[k]->label);
    for (auto mode : {&PasskeyRow::aware, &PasskeyRow::agnostic}) {
      const PasskeyModeScore &a = rows1[k]->*mode, &c = rows2[k]->*mode;
      EXPECT_EQ(c.total, 2);
      EXPECT_EQ(c.correct, a.correct);
      EXPECT_EQ(c.by_depth, a.by_depth);
      // SnapKV's kept rows are the same positions (a selection the sharding changed would show).
      EXPECT_EQ(c.needle_rows_kept_sum, a.needle_rows_kept_sum);
      EXPECT_EQ(c.needle_heads_whole_sum, a.needle_heads_whole_sum);
    }
    EXPECT_EQ(rows2[k]->mem.bytes_accounted, rows1[k]->mem.bytes_accounted);
  }
  // The full cache retrieves the 512-token keys (tests/test_eval.cpp's shipped smoke test).
  EXPECT_EQ(r2.full.aware.correct, 2);
}

TEST(EvalTensorParallel, WhatCannotRunShardedIsRefused) {
  REQUIRE_SHIPPED();
  const auto d = docs();
  const auto full = parse_eval_methods("full");
  const TextEvalOptions o = text_options();
  EXPECT_NE(test::error_of([&] {
              eval_text(*shipped(), d, full, o, settings(3));
            }).find("expected N to divide the model's 2 KV heads"),
            std::string::npos);
  EvalSettings sim = settings(2);
  sim.tp_simulate = true;
  EXPECT_NE(test::error_of([&] {
              eval_text(*shipped(), d, full, o, sim);
            }).find("[eval] tp_simulate: expected device cuda"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] {
              eval_attn_error(*shipped(), d, full, o, settings(2));
            }).find("[attn-error] tensor_parallel: expected 1 (without tp_simulate) but got 2"),
            std::string::npos);
  const std::string ext = test::error_of([&] {
    eval_text(*shipped(), d,
              parse_eval_methods("full,snapkv:budget=16:scoring=external:evict_at=prompt_end"), o,
              settings(2));
  });
  EXPECT_NE(ext.find("[eval] tensor_parallel 2: expected a method without scoring=external but "
                     "got snapkv:budget=16:scoring=external:evict_at=prompt_end"),
            std::string::npos)
      << ext;
  EXPECT_NE(ext.find("use --tensor-parallel 1"), std::string::npos) << ext;
  TextEvalOptions p1 = o;
  p1.prefill = 1;
  EXPECT_NE(test::error_of([&] {
              eval_text(*shipped(), d, full, p1, settings(2));
            }).find("[eval] tensor_parallel 2: expected a prompt of at least one token"),
            std::string::npos);
}

}  // namespace
}  // namespace vq
