// Generation: prefill chunk schedule, argmax and the seeded sampler (filters, determinism, draw
// frequencies), the decode loop (EOS, max tokens, callbacks, timings), greedy generation equal to
// a hand-written forward loop, and every cache method end to end on a tiny model, with the
// exactness checks: SnapKV with budget >= length, SKVQ that never flushes and streaming with a
// window >= length give exactly the full cache's tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include "util/tiny_model.h"
#include "veloxquant/builder.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/error.h"
#include "veloxquant/generate.h"
#include "veloxquant/model.h"
#include "veloxquant/tokenizer.h"

namespace vq {
namespace {

// The one prefill schedule (veloxquant/prefill_schedule.h): chunks of exactly `step`, then the
// remainder (the cut the evaluation engine and docs/results/ use; generate() used to balance
// the chunks, 344 + 343 + 343 for 1030 tokens at 512).
TEST(Prefill, ChunksOfStepThenTheRemainder) {
  EXPECT_EQ(prefill_chunks(0, 512), std::vector<int64_t>{});
  EXPECT_EQ(prefill_chunks(5, 512), std::vector<int64_t>{5});
  EXPECT_EQ(prefill_chunks(512, 512), std::vector<int64_t>{512});
  EXPECT_EQ(prefill_chunks(1030, 512), (std::vector<int64_t>{512, 512, 6}));
  EXPECT_EQ(prefill_chunks(20, 7), (std::vector<int64_t>{7, 7, 6}));
  EXPECT_EQ(prefill_chunks(20, 8), (std::vector<int64_t>{8, 8, 4}));
  EXPECT_EQ(prefill_chunks(7, 1), std::vector<int64_t>(7, 1));
  for (int64_t n = 1; n < 300; n += 7)
    for (int64_t step : {1, 2, 16, 31, 64, 512}) {
      const auto c = prefill_chunks(n, step);
      int64_t sum = 0;
      for (size_t i = 0; i < c.size(); ++i) {
        sum += c[i];
        if (i + 1 < c.size()) {
          EXPECT_EQ(c[i], step);
        }
        EXPECT_GE(c[i], 1);
        EXPECT_LE(c[i], step);
      }
      EXPECT_EQ(sum, n);
      EXPECT_EQ(static_cast<int64_t>(c.size()), (n + step - 1) / step);  // fewest chunks
    }
  // No overflow at the ends of int64 (n + step - 1 would wrap).
  EXPECT_EQ(prefill_chunks(3, INT64_MAX), std::vector<int64_t>{3});
  EXPECT_EQ(prefill_chunks(INT64_MAX, INT64_MAX), std::vector<int64_t>{INT64_MAX});
  EXPECT_THROW(prefill_chunks(10, 0), Error);
  EXPECT_THROW(prefill_chunks(-1, 8), Error);
}

TEST(Sampler, ArgmaxTiesAndNaN) {
  const float nan = std::nanf("");
  const std::vector<float> a = {1.0f, 3.0f, 3.0f, -1.0f};
  EXPECT_EQ(argmax(a.data(), 4), 1);
  const std::vector<float> b = {nan, -5.0f, nan, -2.0f};
  EXPECT_EQ(argmax(b.data(), 4), 3);
  const std::vector<float> c = {nan, nan};
  EXPECT_EQ(argmax(c.data(), 2), 0);
  const float ninf = -INFINITY;
  const std::vector<float> d = {ninf, ninf, ninf};
  EXPECT_EQ(argmax(d.data(), 3), 0);
}

TEST(Sampler, FiltersMatchTheirDefinitions) {
  const std::vector<float> logits = {2.0f, 1.0f, 0.5f, 3.0f, -1.0f, 0.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  // Plain softmax.
  {
    const auto d = Sampler(p).distribution(logits.data(), 6);
    double z = 0;
    for (float l : logits) z += std::exp(static_cast<double>(l));
    for (size_t i = 0; i < 6; ++i)
      EXPECT_NEAR(d[i], std::exp(static_cast<double>(logits[i])) / z, 1e-15);
  }
  // top-k 2 keeps ids 3 and 0.
  {
    SamplingParams q = p;
    q.top_k = 2;
    const auto d = Sampler(q).distribution(logits.data(), 6);
    const double z = std::exp(3.0) + std::exp(2.0);
    EXPECT_NEAR(d[3], std::exp(3.0) / z, 1e-15);
    EXPECT_NEAR(d[0], std::exp(2.0) / z, 1e-15);
    EXPECT_EQ(d[1] + d[2] + d[4] + d[5], 0.0);
  }
  // top-p: probabilities sorted are p3 ~ .574, p0 ~ .211, p1 ~ .078, ...; top_p 0.7 needs {3, 0}.
  {
    SamplingParams q = p;
    q.top_p = 0.7f;
    const auto d = Sampler(q).distribution(logits.data(), 6);
    EXPECT_GT(d[3], 0);
    EXPECT_GT(d[0], 0);
    EXPECT_EQ(d[1] + d[2] + d[4] + d[5], 0.0);
    EXPECT_NEAR(d[3] + d[0], 1.0, 1e-15);
    q.top_p = 0.5f;  // the top token alone reaches it
    const auto e = Sampler(q).distribution(logits.data(), 6);
    EXPECT_EQ(e[3], 1.0);
  }
  // Temperature sharpens: T = 0.5 squares the odds.
  {
    SamplingParams q = p;
    q.temperature = 0.5f;
    const auto d = Sampler(q).distribution(logits.data(), 6);
    EXPECT_NEAR(d[3] / d[0], std::exp(2.0), 1e-12);
  }
  // Greedy.
  SamplingParams g;
  Sampler sg(g);
  EXPECT_EQ(sg.sample(logits.data(), 6), 3);
  // Bad parameters.
  SamplingParams bad = p;
  bad.top_p = 0.0f;
  EXPECT_THROW(Sampler{bad}, Error);
  bad = p;
  bad.top_k = -1;
  EXPECT_THROW(Sampler{bad}, Error);
}

TEST(Sampler, SeededDrawsFollowTheDistribution) {
  const std::vector<float> logits = {1.0f, 0.0f, 2.0f, -0.5f, 1.5f};
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_k = 4;
  p.seed = 99;
  Sampler s1(p), s2(p);
  const auto dist = s1.distribution(logits.data(), 5);
  const int n = 40000;
  std::map<int32_t, int> count;
  for (int i = 0; i < n; ++i) {
    const int32_t a = s1.sample(logits.data(), 5);
    ASSERT_EQ(a, s2.sample(logits.data(), 5));  // same seed, same draws
    ++count[a];
  }
  EXPECT_EQ(count[3], 0);  // filtered by top-k
  for (int32_t i = 0; i < 5; ++i) {
    // Binomial count: 5 standard deviations sqrt(p (1-p) / n) (a false failure ~ 1e-6).
    const double pi = dist[static_cast<size_t>(i)];
    EXPECT_NEAR(count[i] / static_cast<double>(n), pi, 5 * std::sqrt(pi * (1 - pi) / n) + 1e-12)
        << i;
  }
  p.seed = 100;
  Sampler s3(p);
  int differ = 0;
  Sampler s4(SamplingParams{p.temperature, p.top_k, p.top_p, 99});
  for (int i = 0; i < 100; ++i)
    differ += s3.sample(logits.data(), 5) != s4.sample(logits.data(), 5);
  EXPECT_GT(differ, 0);  // another seed, other draws
}

class GenerateTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(test::write_tiny_model(test::make_temp_dir("vq-gen")));
    model_ = Model::load(*dir_).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::vector<int32_t> prompt(int64_t n, uint64_t seed = 1) {
    std::mt19937_64 rng(seed);
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (auto& id : ids) id = static_cast<int32_t>(rng() % 300);  // below the eos id 319
    return ids;
  }
  static std::string* dir_;
  static Model* model_;
};
std::string* GenerateTest::dir_ = nullptr;
Model* GenerateTest::model_ = nullptr;

TEST_F(GenerateTest, GreedyEqualsHandWrittenLoop) {
  const auto ids = prompt(30);
  CacheConfig full;
  auto caches = model_->make_caches(full);
  GenerateOptions o;
  o.max_tokens = 12;
  o.stop_at_eos = false;
  o.kv_dtype = DType::kF32;
  o.prefill_step_size = 7;
  const GenerateResult r = generate(*model_, ids, caches, o);
  ASSERT_EQ(r.tokens.size(), 12u);
  EXPECT_EQ(r.stop_reason, "max_tokens");
  EXPECT_EQ(r.prompt_tokens, 30);
  EXPECT_EQ(r.decode_steps, 11);
  EXPECT_EQ(caches[0]->offset(), 30 + 11);

  auto c2 = model_->make_caches(full);
  ForwardOptions fo;
  fo.kv_dtype = DType::kF32;
  std::vector<float> logits;
  model_->forward(ids.data(), 1, 30, c2, fo, &logits);
  std::vector<int32_t> expect;
  for (int i = 0; i < 12; ++i) {
    expect.push_back(argmax(logits.data(), 320));
    model_->forward(&expect.back(), 1, 1, c2, fo, &logits);
  }
  EXPECT_EQ(r.tokens, expect);
  // Not a degenerate model: the continuation is not one repeated token.
  EXPECT_GT(std::set<int32_t>(expect.begin(), expect.end()).size(), 1u);
}

TEST_F(GenerateTest, StopsOnEosMaxTokensAndCallback) {
  const auto ids = prompt(20);
  CacheConfig full;
  GenerateOptions o;
  o.max_tokens = 10;
  o.stop_at_eos = false;
  auto caches = model_->make_caches(full);
  const auto free_run = generate(*model_, ids, caches, o).tokens;
  ASSERT_EQ(free_run.size(), 10u);

  // Make the 4th generated token a stop id: generation ends right after producing it.
  o.stop_at_eos = true;
  o.stop_ids = {free_run[3]};
  if (std::find(free_run.begin(), free_run.begin() + 3, free_run[3]) == free_run.begin() + 3) {
    caches = model_->make_caches(full);
    const auto r = generate(*model_, ids, caches, o);
    EXPECT_EQ(r.stop_reason, "eos");
    EXPECT_EQ(r.tokens, std::vector<int32_t>(free_run.begin(), free_run.begin() + 4));
  }
  // Callback: streams every token, can stop.
  o.stop_ids.clear();
  o.stop_at_eos = false;
  std::vector<int32_t> streamed;
  o.on_token = [&](int32_t t) {
    streamed.push_back(t);
    return streamed.size() < 5;
  };
  std::vector<std::pair<int64_t, int64_t>> progress;
  o.on_prefill_progress = [&](int64_t done, int64_t total) { progress.emplace_back(done, total); };
  o.prefill_step_size = 8;
  caches = model_->make_caches(full);
  const auto r = generate(*model_, ids, caches, o);
  EXPECT_EQ(r.stop_reason, "callback");
  EXPECT_EQ(streamed, r.tokens);
  EXPECT_EQ(r.tokens, std::vector<int32_t>(free_run.begin(), free_run.begin() + 5));
  EXPECT_EQ(progress, (std::vector<std::pair<int64_t, int64_t>>{{8, 20}, {16, 20}, {20, 20}}));
  EXPECT_GT(r.prefill_seconds, 0.0);
  EXPECT_GT(r.decode_tokens_per_s(), 0.0);
  // max_tokens 0: prefill only.
  o.max_tokens = 0;
  o.on_token = nullptr;
  caches = model_->make_caches(full);
  EXPECT_TRUE(generate(*model_, ids, caches, o).tokens.empty());
  EXPECT_EQ(caches[0]->offset(), 20);
  // Bad input.
  EXPECT_THROW(generate(*model_, std::vector<int32_t>{}, caches, o), Error);
}

TEST_F(GenerateTest, TinyTokenizerRoundTripsThroughGeneration) {
  // The tiny model's tokenizer.json loads, covers the model's vocabulary, and text goes
  // prompt -> ids -> generated ids -> text with the streaming decoder equal to a full decode.
  const Tokenizer tok = Tokenizer::from_file(*dir_ + "/tokenizer.json");
  EXPECT_EQ(tok.vocab_size(), 320);
  const std::string text = "the theatre in the rain, caf\xC3\xA9 \xE4\xB8\xAD 42";
  const std::vector<int32_t> ids = tok.encode(text, false);
  EXPECT_EQ(tok.decode(ids), text);    // byte-level: lossless
  EXPECT_LT(ids.size(), text.size());  // the merges apply ("th", "the", ...)
  auto caches = model_->make_caches(CacheConfig{});
  GenerateOptions o;
  o.max_tokens = 16;
  o.stop_at_eos = false;
  StreamDecoder stream(tok);
  std::string streamed;
  o.on_token = [&](int32_t id) {
    streamed += stream.push(id);
    return true;
  };
  const GenerateResult r = generate(*model_, ids, caches, o);
  streamed += stream.flush();
  EXPECT_EQ(streamed, tok.decode(r.tokens));
}

TEST_F(GenerateTest, PrefillStepDoesNotChangeGreedyTokens) {
  const auto ids = prompt(45, 3);
  CacheConfig full;
  GenerateOptions o;
  o.max_tokens = 8;
  o.stop_at_eos = false;
  o.kv_dtype = DType::kF32;
  std::vector<int32_t> first;
  for (int64_t step : {45, 512, 16, 5, 1}) {
    o.prefill_step_size = step;
    auto caches = model_->make_caches(full);
    const auto t = generate(*model_, ids, caches, o).tokens;
    if (first.empty()) first = t;
    EXPECT_EQ(t, first) << "prefill_step_size " << step;
  }
}

// Every method of the config, with small settings so eviction and quantization really happen
// within a 70-token prompt. A method this build does not construct yet is skipped by name.
CacheConfig small_config(const std::string& method) {
  CacheConfig c;
  c.method = method;
  c.snap_budget = 24;
  c.snap_obs_window = 8;
  c.snap_n_sink = 2;
  c.skvq_window = 16;
  c.skvq_group_size = 8;
  c.skvq_n_sink = 2;
  c.streaming_n_sink = 2;
  c.streaming_window = 24;
  return c;
}

std::vector<std::unique_ptr<KVCache>> build_or_skip(const Model& m, const CacheConfig& c,
                                                    bool* skipped) {
  *skipped = false;
  try {
    return m.make_caches(c);
  } catch (const Error& e) {
    if (std::string(e.what()).find("not available in this build") == std::string::npos) throw;
    *skipped = true;
    return {};
  }
}

TEST_F(GenerateTest, EveryCacheMethodRunsEndToEnd) {
  const auto ids = prompt(70, 5);
  std::vector<std::string> skipped;
  for (const std::string& method : cache_methods()) {
    for (bool query_scoring : {false, true}) {
      if (query_scoring && method.find("snapkv") == std::string::npos) continue;
      SCOPED_TRACE(method + (query_scoring ? " (query scoring)" : ""));
      CacheConfig c = small_config(method);
      if (query_scoring) c.snap_scoring = SnapScoring::kQuery;
      bool skip = false;
      auto caches = build_or_skip(*model_, c, &skip);
      if (skip) {
        skipped.push_back(method);
        continue;
      }
      GenerateOptions o;
      o.max_tokens = 20;
      o.stop_at_eos = false;
      o.prefill_step_size = 32;  // three chunks: 24, 23, 23
      const GenerateResult r = generate(*model_, ids, caches, o);
      ASSERT_EQ(r.tokens.size(), 20u);
      for (int32_t t : r.tokens) EXPECT_TRUE(t >= 0 && t < 320);
      const CacheMemory mem = cache_memory(caches, 1 * model_->config().n_kv_heads);
      EXPECT_EQ(mem.method, method);
      EXPECT_EQ(mem.n_layers, 2);
      EXPECT_EQ(mem.tokens_seen, 70 + 19);
      EXPECT_GT(mem.bytes_accounted, 0);
      EXPECT_GT(mem.bytes_resident, 0);
      // fp16 equivalent of every token seen: 89 tokens x 2 heads x 16 x 2 (K, V) x 2 bytes x 2
      // layers.
      EXPECT_EQ(mem.fp16_bytes, 89 * 2 * 16 * 2 * 2 * 2);
      if (method != "full") {
        EXPECT_LT(mem.ratio_to_fp16(), 1.0) << "a compressing cache compresses at these settings";
      } else {
        EXPECT_EQ(mem.rows_kept, 89 * 2 * 2);
      }
    }
  }
  if (!skipped.empty()) {
    std::string names;
    for (const auto& s : skipped) names += " " + s;
    GTEST_SKIP() << "cache methods not available in this build yet:" << names;
  }
}

// snap_evict_at = prompt_end through generate(): the prompt is selected once, when prefill ends.
// With one prefill chunk that is the same selection the default schedule makes right after it,
// so the tokens are identical; with chunks the rows stay until the prompt ends (none evicted by
// an early chunk), and the stored rows afterwards are the budget plus the decode steps.
TEST_F(GenerateTest, PromptEndEvictionInGenerate) {
  const auto ids = prompt(70, 11);
  for (const char* method : {"snapkv", "snapkv+skvq"}) {
    SCOPED_TRACE(method);
    CacheConfig c = small_config(method);
    c.snap_scoring = SnapScoring::kQuery;
    CacheConfig pe = c;
    pe.snap_evict_at = SnapEvictAt::kPromptEnd;
    GenerateOptions o;
    o.max_tokens = 12;
    o.stop_at_eos = false;
    o.prefill_step_size = 128;  // one chunk
    auto a = model_->make_caches(c), b = model_->make_caches(pe);
    EXPECT_EQ(generate(*model_, ids, a, o).tokens, generate(*model_, ids, b, o).tokens);
    o.prefill_step_size = 32;  // three chunks: 24, 23, 23
    auto chunked = model_->make_caches(pe);
    const GenerateResult r = generate(*model_, ids, chunked, o);
    ASSERT_EQ(r.tokens.size(), 12u);
    for (const auto& cache : chunked) EXPECT_EQ(cache->stored_rows(), c.snap_budget + 11);
  }
}

TEST_F(GenerateTest, LosslessSettingsGiveTheFullCacheTokens) {
  const auto ids = prompt(60, 6);
  GenerateOptions o;
  o.max_tokens = 24;
  o.stop_at_eos = false;
  o.prefill_step_size = 25;  // chunks 20, 20, 20: SnapKV selects after each
  auto full = model_->make_caches(CacheConfig{});
  const auto expect = generate(*model_, ids, full, o).tokens;
  std::vector<std::string> skipped;
  auto check = [&](CacheConfig c, const std::string& what) {
    SCOPED_TRACE(what);
    bool skip = false;
    auto caches = build_or_skip(*model_, c, &skip);
    if (skip) {
      skipped.push_back(c.method);
      return;
    }
    EXPECT_EQ(generate(*model_, ids, caches, o).tokens, expect);
  };
  CacheConfig snap = small_config("snapkv");
  snap.snap_budget = 60 + 24;  // >= every length this run reaches: nothing is ever evicted
  check(snap, "snapkv budget >= length");
  snap.snap_scoring = SnapScoring::kQuery;
  check(snap, "snapkv budget >= length, query scoring");
  CacheConfig skvq = small_config("skvq");
  skvq.skvq_window = 128;  // > 60 + 24: no chunk is ever flushed, every row stays exact
  check(skvq, "skvq without a flush");
  CacheConfig both = small_config("snapkv+skvq");
  both.snap_budget = 100;
  both.skvq_window = 128;
  check(both, "snapkv+skvq lossless");
  CacheConfig st = small_config("streaming");
  st.streaming_window = 128;
  check(st, "streaming window >= length");
  if (!skipped.empty()) {
    std::string names;
    for (const auto& s : skipped) names += " " + s;
    GTEST_SKIP() << "cache methods not available in this build yet:" << names;
  }
}

// A step near INT64_MAX: ceil(n / step) used to be computed as (n + step - 1) / step, which
// overflows (SIGFPE or a huge allocation in the CLI).
TEST(Prefill, HugeStepDoesNotOverflow) {
  EXPECT_EQ(prefill_chunks(5, INT64_MAX), std::vector<int64_t>{5});
  EXPECT_EQ(prefill_chunks(2049, INT64_MAX - 1), std::vector<int64_t>{2049});
  EXPECT_EQ(prefill_chunks(INT64_MAX, INT64_MAX), std::vector<int64_t>{INT64_MAX});
  // Chunks of `step`, then the remainder (veloxquant/prefill_schedule.h).
  EXPECT_EQ(prefill_chunks(INT64_MAX - 2, INT64_MAX / 2 + 1),
            (std::vector<int64_t>{INT64_MAX / 2 + 1, INT64_MAX - 2 - (INT64_MAX / 2 + 1)}));
}

// A tiny model whose max_position_embeddings is 48: prompts past it are refused, generation
// stops before a token would take position 48.
TEST_F(GenerateTest, PositionsBoundedByTheModel) {
  test::TinyModelSpec spec;
  spec.max_position_embeddings = 48;
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-gen-pos"), spec);
  const auto model = Model::load(dir);
  GenerateOptions o;
  o.max_tokens = 100;
  o.stop_at_eos = false;
  {
    auto caches = model->make_caches(CacheConfig{});
    try {
      generate(*model, prompt(49), caches, o);
      ADD_FAILURE() << "a 49-token prompt on a 48-position model was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_position_embeddings 48"), std::string::npos)
          << e.what();
    }
    EXPECT_EQ(caches[0]->offset(), 0) << "refused before any forward call";
  }
  {
    auto caches = model->make_caches(CacheConfig{});
    const GenerateResult r = generate(*model, prompt(40), caches, o);
    EXPECT_EQ(r.tokens.size(), 8u);  // positions 40..47
    EXPECT_EQ(r.stop_reason, "max_position");
    EXPECT_EQ(caches[0]->offset(), 47);  // the last token is sampled, never forwarded
  }
  {
    auto caches = model->make_caches(CacheConfig{});
    const GenerateResult r = generate(*model, prompt(48), caches, o);
    EXPECT_TRUE(r.tokens.empty());
    EXPECT_EQ(r.stop_reason, "max_position");
  }
  {  // a cached context counts: 30 cached + 20 new > 48
    auto caches = model->make_caches(CacheConfig{});
    o.max_tokens = 1;
    generate(*model, prompt(30), caches, o);
    EXPECT_THROW(generate(*model, prompt(20), caches, o), Error);
  }
  std::filesystem::remove_all(dir);
}

// NaN weights make every logit NaN: generation is refused with a message instead of argmax
// returning token 0 for every step.
TEST_F(GenerateTest, NonFiniteLogitsRefused) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-gen-nan"));
  test::poke_tiny_model_weight(dir, "model.norm.weight", 3, std::nanf(""));
  LoadOptions lo;
  lo.check_finite = false;  // the load-time check would refuse it (test_model_config)
  const auto model = Model::load(dir, lo);
  auto caches = model->make_caches(CacheConfig{});
  GenerateOptions o;
  o.max_tokens = 5;
  try {
    const GenerateResult r = generate(*model, prompt(10), caches, o);
    ADD_FAILURE() << "all-NaN logits gave " << r.tokens.size() << " tokens, first "
                  << (r.tokens.empty() ? -1 : r.tokens[0]);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected finite logits"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// sample_vocab keeps generation to ids a smaller tokenizer can decode.
TEST_F(GenerateTest, SampleVocabBoundsTheIds) {
  const auto ids = prompt(12);
  GenerateOptions o;
  o.max_tokens = 16;
  o.stop_at_eos = false;
  auto c1 = model_->make_caches(CacheConfig{});
  const GenerateResult all = generate(*model_, ids, c1, o);
  const int32_t top = *std::max_element(all.tokens.begin(), all.tokens.end());
  ASSERT_GT(top, 0);
  o.sample_vocab = top;  // the largest id greedy picks is now out of reach
  auto c2 = model_->make_caches(CacheConfig{});
  const GenerateResult bounded = generate(*model_, ids, c2, o);
  for (int32_t t : bounded.tokens) EXPECT_LT(t, top);
  o.sample_vocab = 321;
  EXPECT_THROW(generate(*model_, ids, c2, o), Error);
}

// The memory parts: activation buffers grow with the prefill chunk, the caches' bytes are
// reported at the prompt's end and at the run's end.
TEST_F(GenerateTest, MemoryPartsFollowThePrefillStep) {
  const auto ids = prompt(64);
  GenerateOptions o;
  o.max_tokens = 2;
  o.stop_at_eos = false;
  o.prefill_step_size = 64;
  auto c1 = model_->make_caches(CacheConfig{});
  const GenerateResult big = generate(*model_, ids, c1, o);
  o.prefill_step_size = 8;
  auto c2 = model_->make_caches(CacheConfig{});
  const GenerateResult small = generate(*model_, ids, c2, o);
  EXPECT_GT(big.activation_bytes, 4 * small.activation_bytes);
  EXPECT_GT(small.activation_bytes, 0);
  // The full cache holds 64 rows per head and layer of fp16 K and V at least (capacity slack
  // allowed): 2 layers x 2 KV heads x 64 rows x 16 dims x 2 (K, V) x 2 bytes.
  EXPECT_GE(small.cache_bytes_prompt, 2 * 2 * 64 * 16 * 2 * 2);
  EXPECT_GE(big.cache_bytes_end, big.cache_bytes_prompt);  // one more row after decode
  EXPECT_EQ(big.cache_bytes_peak(), big.cache_bytes_end);
}

}  // namespace
}  // namespace vq
