// Many sequences on one engine (engine.h, batch_generate.h, memory_plan.h), on the CPU engine and
// a tiny random model: every sequence of a ragged batch gets exactly the tokens vq::generate gives
// it alone (greedy and seeded sampling, every cache method, continuous admission); the engine's
// refusals change nothing; the planner's per-sequence figure equals the caches' reported peak
// (bytes_accounted after every step; an upper bound for snapkv+skvq) and bounds their resident
// bytes; requests that cannot fit are refused before any sequence is added.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "util/cpu_delegate_backend.h"
#include "util/test_util.h"
#include "util/tiny_model.h"
#include "veloxquant/batch_generate.h"
#include "veloxquant/cuda.h"
#include "veloxquant/engine.h"
#include "veloxquant/error.h"
#include "veloxquant/full_cache.h"
#include "veloxquant/generate.h"
#include "veloxquant/group_quant.h"
#include "veloxquant/memory_plan.h"
#include "veloxquant/model.h"
#include "veloxquant/prefill_schedule.h"
#include "veloxquant/skvq_cache.h"

namespace vq {
namespace {

std::vector<int32_t> random_ids(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % 300);  // below the eos id 319
  return ids;
}

// Small settings so eviction and quantization happen within short prompts.
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

class BatchTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(test::write_tiny_model(test::make_temp_dir("vq-batch")));
    model_ = Model::load(*dir_).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::string* dir_;
  static Model* model_;
};
std::string* BatchTest::dir_ = nullptr;
Model* BatchTest::model_ = nullptr;

TEST(Engine, DeviceNames) {
  EXPECT_EQ(parse_device("cpu"), Device::kCpu);
  EXPECT_EQ(parse_device("cuda"), Device::kCuda);
  EXPECT_STREQ(device_name(Device::kCuda), "cuda");
  try {
    parse_device("gpu");
    FAIL() << "gpu accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected cpu or cuda but got 'gpu'"), std::string::npos);
  }
  EXPECT_GT(Engine::host_copy_bandwidth(int64_t{8} << 20), 0.0);
}

TEST_F(BatchTest, CudaEngineWithoutDeviceIsRefused) {
  if (cuda::is_available()) GTEST_SKIP() << "a CUDA device is present";
  try {
    make_engine(Device::kCuda, *model_, EngineOptions{});
    FAIL() << "a CUDA engine without a device";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[engine]"), std::string::npos) << e.what();
  }
}

TEST_F(BatchTest, EngineRefusalsChangeNothing) {
  const auto eng = make_cpu_engine(*model_, EngineOptions{});
  const int64_t a = eng->add_sequence(), b = eng->add_sequence();
  EXPECT_NE(a, b);
  const auto ids = random_ids(10, 1);
  std::vector<float> logits;
  eng->step(std::vector<SeqChunk>{{a, std::span(ids).first(4), true, false}}, &logits);
  ASSERT_EQ(logits.size(), 320u);
  const std::vector<int32_t> bad = {5, 320};
  const std::vector<int32_t> empty;
  std::vector<std::vector<SeqChunk>> refused = {
      {{b, std::span(ids), true, false}, {99, std::span(ids), true, false}},   // unknown id
      {{b, std::span(ids), true, false}, {b, std::span(ids), true, false}},    // repeated
      {{a, std::span(ids), true, false}, {b, std::span(empty), true, false}},  // empty chunk
      {{a, std::span(ids), true, false}, {b, std::span(bad), true, false}},    // token id
  };
  for (const auto& step : refused) {
    EXPECT_THROW(eng->step(step, &logits), Error);
    EXPECT_EQ(eng->offset(a), 4);
    EXPECT_EQ(eng->offset(b), 0);
  }
  eng->remove_sequence(b);
  EXPECT_THROW(eng->offset(b), Error);
  EXPECT_THROW(eng->remove_sequence(b), Error);
  EXPECT_EQ(eng->add_sequence(), b + 1);  // ids are never reused
}

// step_greedy (the default: step() then vq::argmax) gives the ids of step()'s logits, -1 never
// for finite logits; a sequence added with its own config runs that config, equal to an engine
// made with it (rows, bytes, stored positions); a refused config adds nothing.
TEST_F(BatchTest, StepGreedyAndPerSequenceConfig) {
  const auto eng = make_cpu_engine(*model_, EngineOptions{});
  const auto ids = random_ids(40, 3);
  const int64_t a = eng->add_sequence(), b = eng->add_sequence();
  std::vector<float> logits;
  std::vector<int32_t> picked;
  eng->step(std::vector<SeqChunk>{{a, std::span(ids), true, true}}, &logits);
  eng->step_greedy(std::vector<SeqChunk>{{b, std::span(ids), true, true}}, 300, &picked);
  ASSERT_EQ(picked.size(), 1u);
  EXPECT_EQ(picked[0], argmax(logits.data(), 300));
  EXPECT_THROW(eng->step_greedy({}, 321, &picked), Error);
  EXPECT_THROW(eng->step_greedy({}, 0, &picked), Error);

  const CacheConfig snap = small_config("snapkv");
  const int64_t c = eng->add_sequence(snap);
  EngineOptions eo;
  eo.cache = snap;
  const auto own = make_cpu_engine(*model_, eo);
  const int64_t d = own->add_sequence();
  eng->step(std::vector<SeqChunk>{{c, std::span(ids), false, true}}, nullptr);
  own->step(std::vector<SeqChunk>{{d, std::span(ids), false, true}}, nullptr);
  EXPECT_EQ(eng->memory(c).rows_kept_per_head, snap.snap_budget);
  EXPECT_EQ(eng->memory(c).bytes_accounted, own->memory(d).bytes_accounted);
  EXPECT_EQ(eng->memory(a).rows_kept_per_head, 40);  // the engine's own config: full
  for (int64_t l = 0; l < model_->config().n_layers; ++l)
    EXPECT_EQ(eng->stored_positions(c, l, 0), own->stored_positions(d, l, 0));
  EXPECT_THROW(eng->stored_positions(c, -1, 0), Error);
  EXPECT_THROW(eng->stored_positions(c, 0, model_->config().n_kv_heads), Error);
  CacheConfig bad = snap;
  bad.snap_budget = 0;
  EXPECT_THROW(eng->add_sequence(bad), Error);
  EXPECT_EQ(eng->add_sequence(), c + 1) << "a refused config adds no sequence";
}

// fill_synthetic leaves the caches of a prompt of n tokens (tokens seen, rows per method,
// positions 0..n-1 for the full cache) with no forward; a decode step then continues at n; it
// refuses a non-empty sequence and bad sizes before any change.
TEST_F(BatchTest, FillSyntheticLeavesAPromptsCaches) {
  for (const char* method : {"full", "snapkv", "skvq", "snapkv+skvq", "streaming"}) {
    SCOPED_TRACE(method);
    EngineOptions eo;
    eo.cache = small_config(method);
    const auto eng = make_cpu_engine(*model_, eo);
    const int64_t a = eng->add_sequence();
    eng->fill_synthetic(a, 50, 16, 7);
    EXPECT_EQ(eng->offset(a), 50);
    const CacheMemory m = eng->memory(a);
    EXPECT_EQ(m.tokens_seen, 50);
    const int64_t expect_rows = std::string(method) == "full" || std::string(method) == "skvq" ? 50
                                : std::string(method) == "streaming"                           ? 26
                                                                                               : 24;
    EXPECT_EQ(m.rows_kept_per_head, expect_rows);
    if (std::string(method) == "full") {
      std::vector<int32_t> all(50);
      for (int32_t i = 0; i < 50; ++i) all[static_cast<size_t>(i)] = i;
      EXPECT_EQ(eng->stored_positions(a, 1, 0), all);
    }
    const std::vector<int32_t> tok = {5};
    std::vector<int32_t> picked;
    eng->step_greedy(std::vector<SeqChunk>{{a, std::span(tok), true, false}}, 320, &picked);
    EXPECT_EQ(eng->offset(a), 51);
    ASSERT_EQ(picked.size(), 1u);
    EXPECT_GE(picked[0], 0);
    EXPECT_THROW(eng->fill_synthetic(a, 10, 4, 0), Error);  // not empty
    const int64_t b = eng->add_sequence();
    EXPECT_THROW(eng->fill_synthetic(b, 0, 4, 0), Error);
    EXPECT_THROW(eng->fill_synthetic(b, 10, 0, 0), Error);
    EXPECT_THROW(eng->fill_synthetic(b, model_->config().max_position_embeddings + 1, 64, 0),
                 Error);
    EXPECT_EQ(eng->offset(b), 0);
  }
}

// Engine::warm_up's row counts (every count up to kWarmUpEveryRowUpTo, then the largest) and
// refusals; the CPU engine has nothing to warm (0 s, no sequence changes), and batch_generate
// gives the same tokens with it as without it.
TEST_F(BatchTest, WarmUpRowCountsAndCpuNoOp) {
  EXPECT_TRUE(warm_up_row_counts(0).empty());
  EXPECT_EQ(warm_up_row_counts(3, 512), (std::vector<int64_t>{1, 2, 3}));
  const std::vector<int64_t> every = warm_up_row_counts(kWarmUpEveryRowUpTo);
  ASSERT_EQ(static_cast<int64_t>(every.size()), kWarmUpEveryRowUpTo);
  for (size_t i = 0; i < every.size(); ++i) EXPECT_EQ(every[i], static_cast<int64_t>(i) + 1);
  const std::vector<int64_t> big = warm_up_row_counts(1000);
  ASSERT_EQ(static_cast<int64_t>(big.size()), kWarmUpEveryRowUpTo + 1);
  EXPECT_EQ(big[big.size() - 2], kWarmUpEveryRowUpTo);
  EXPECT_EQ(big.back(), 1000);
  for (auto [rows, prefill] : {std::pair<int64_t, int64_t>{-1, 0}, {2, -5}}) {
    try {
      (void)warm_up_row_counts(rows, prefill);
      ADD_FAILURE() << "accepted " << rows << ", " << prefill;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "[engine] warm_up: expected max_rows >= 0 and prefill_tokens >= 0 but got " +
                    std::to_string(rows) + " and " + std::to_string(prefill)),
                std::string::npos)
          << e.what();
    }
  }

  const auto eng = make_cpu_engine(*model_, EngineOptions{});
  const int64_t a = eng->add_sequence();
  const auto ids = random_ids(20, 4);
  eng->step(std::vector<SeqChunk>{{a, std::span(ids), false, true}}, nullptr);
  const CacheMemory before = eng->memory(a);
  EXPECT_EQ(eng->warm_up(8, 16), 0.0);
  EXPECT_THROW(eng->warm_up(-1), Error);
  EXPECT_EQ(eng->offset(a), 20);
  EXPECT_EQ(eng->memory(a).bytes_resident, before.bytes_resident);
  EXPECT_EQ(eng->memory(a).tokens_seen, before.tokens_seen);

  const std::vector<BatchPrompt> prompts = {{random_ids(30, 5), -1}, {random_ids(9, 6), 3}};
  BatchGenerateOptions o;
  o.gen.max_tokens = 6;
  o.gen.prefill_step_size = 16;
  std::vector<BatchGenerateResult> runs;
  for (bool warm : {false, true}) {
    o.warm_up = warm;
    runs.push_back(batch_generate(*make_cpu_engine(*model_, EngineOptions{}), prompts, o));
    EXPECT_EQ(runs.back().warm_up_seconds, 0.0);
  }
  for (size_t i = 0; i < prompts.size(); ++i)
    EXPECT_EQ(runs[0].results[i].tokens, runs[1].results[i].tokens) << "prompt " << i;
}

// SeqChunk::end_prompt: a prompt-end SnapKV eviction runs right after the chunk (the budget's
// rows stay), and only for the sequence that asked.
TEST_F(BatchTest, EndPromptFlagEvictsThatSequence) {
  for (const char* method : {"snapkv", "snapkv+skvq"}) {
    SCOPED_TRACE(method);
    EngineOptions eo;
    eo.cache = small_config(method);
    eo.cache.snap_evict_at = SnapEvictAt::kPromptEnd;
    const auto eng = make_cpu_engine(*model_, eo);
    const int64_t a = eng->add_sequence(), b = eng->add_sequence();
    const auto ids = random_ids(70, 9);
    std::vector<float> logits;
    eng->step(
        std::vector<SeqChunk>{{a, std::span(ids), true, true}, {b, std::span(ids), true, false}},
        &logits);
    ASSERT_EQ(logits.size(), 2u * 320u);
    EXPECT_EQ(eng->memory(a).rows_kept_per_head, 24);
    EXPECT_EQ(eng->memory(b).rows_kept_per_head, 70);
    EXPECT_EQ(eng->memory(a).tokens_seen, 70);
    // Same prompt, same caches before the eviction: the same logits for both rows.
    for (size_t v = 0; v < 320; ++v) ASSERT_EQ(logits[v], logits[320 + v]);
  }
}

TEST(EngineMaxPosition, PositionsPastTheModelAreRefused) {
  test::TinyModelSpec spec;
  spec.max_position_embeddings = 12;
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-batch-pos"), spec);
  {
    const auto model = Model::load(dir);
    const auto eng = make_cpu_engine(*model, EngineOptions{});
    const int64_t s = eng->add_sequence();
    const auto ids = random_ids(13, 2);
    std::vector<float> logits;
    try {
      eng->step(std::vector<SeqChunk>{{s, std::span(ids), true, false}}, &logits);
      FAIL() << "13 positions accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_position_embeddings 12"), std::string::npos);
    }
    EXPECT_EQ(eng->offset(s), 0);
    eng->step(std::vector<SeqChunk>{{s, std::span(ids).first(12), true, false}}, &logits);
    EXPECT_EQ(eng->offset(s), 12);

    // A batch: the prompt at the limit stops with max_position, as generate does.
    BatchGenerateOptions o;
    o.gen.max_tokens = 5;
    const std::vector<BatchPrompt> prompts = {{random_ids(10, 3), -1}, {random_ids(12, 4), -1}};
    const auto r = batch_generate(*eng, prompts, o);
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto caches = model->make_caches(CacheConfig{});
      GenerateOptions g = o.gen;
      g.sampling.seed += i;
      const GenerateResult alone = generate(*model, prompts[i].ids, caches, g);
      EXPECT_EQ(r.results[i].tokens, alone.tokens);
      EXPECT_EQ(r.results[i].stop_reason, alone.stop_reason);
    }
    EXPECT_EQ(r.results[0].stop_reason, "max_position");
    EXPECT_EQ(r.results[0].tokens.size(), 2u);
    EXPECT_TRUE(r.results[1].tokens.empty());
  }
  std::filesystem::remove_all(dir);
}

// Each sequence of a ragged batch gets exactly what generate gives it alone: every method,
// greedy and seeded sampling, every sequence live at once and continuous admission (max_batch 2
// of 5 prompts), per-prompt max_tokens, a stop id that really stops some sequences.
TEST_F(BatchTest, RaggedBatchEqualsGenerateAlone) {
  const std::vector<int64_t> lengths = {70, 5, 33, 1, 48};
  std::vector<BatchPrompt> prompts;
  for (size_t i = 0; i < lengths.size(); ++i)
    prompts.push_back({random_ids(lengths[i], 10 + i), i == 2 ? 7 : -1});
  prompts[4].max_tokens = 0;
  for (const std::string& method : cache_methods()) {
    for (bool sampled : {false, true}) {
      for (int64_t max_batch : {8, 2}) {
        SCOPED_TRACE(method + (sampled ? " sampled" : " greedy") + " max_batch " +
                     std::to_string(max_batch));
        EngineOptions eo;
        eo.cache = small_config(method);
        const auto eng = make_cpu_engine(*model_, eo);
        BatchGenerateOptions o;
        o.gen.max_tokens = 20;
        o.gen.prefill_step_size = 16;
        if (sampled) o.gen.sampling = {0.9f, 40, 0.95f, 77};
        o.max_batch = max_batch;
        // A stop id the first prompt produces alone (so stopping really happens).
        {
          auto caches = model_->make_caches(eo.cache);
          GenerateOptions g = o.gen;
          g.stop_at_eos = false;
          const auto free_run = generate(*model_, prompts[0].ids, caches, g).tokens;
          o.gen.stop_ids = {free_run[5]};
        }
        const BatchGenerateResult r = batch_generate(*eng, prompts, o);
        EXPECT_EQ(r.max_live, std::min<int64_t>(max_batch, 5));
        int64_t eos = 0, decode_rows = 0;
        for (size_t i = 0; i < prompts.size(); ++i) {
          auto caches = model_->make_caches(eo.cache);
          GenerateOptions g = o.gen;
          g.sampling.seed += i;
          if (prompts[i].max_tokens >= 0) g.max_tokens = prompts[i].max_tokens;
          const GenerateResult alone = generate(*model_, prompts[i].ids, caches, g);
          EXPECT_EQ(r.results[i].tokens, alone.tokens) << "prompt " << i;
          EXPECT_EQ(r.results[i].stop_reason, alone.stop_reason) << "prompt " << i;
          EXPECT_EQ(r.results[i].decode_steps, alone.decode_steps) << "prompt " << i;
          EXPECT_EQ(r.results[i].prompt_tokens, lengths[i]);
          eos += alone.stop_reason == "eos";
          decode_rows += alone.decode_steps;
        }
        EXPECT_GE(eos, 1) << "the stop id stops at least the first prompt";
        EXPECT_EQ(r.prefill_tokens, 70 + 5 + 33 + 1 + 48);
        EXPECT_EQ(r.decode_tokens, decode_rows);
        EXPECT_GT(r.peak_cache_bytes_resident, 0);
        // Every sequence was removed: the engine holds none (ids are not reused, the next is new).
        EXPECT_EQ(eng->add_sequence(), 5);
      }
    }
  }
}

TEST_F(BatchTest, BatchRefusalsAddNoSequence) {
  const auto eng = make_cpu_engine(*model_, EngineOptions{});
  BatchGenerateOptions o;
  const std::vector<BatchPrompt> none;
  EXPECT_THROW(batch_generate(*eng, none, o), Error);
  const std::vector<BatchPrompt> empty = {{random_ids(4, 1), -1}, {{}, -1}};
  EXPECT_THROW(batch_generate(*eng, empty, o), Error);
  const std::vector<BatchPrompt> bad = {{{1, 2, 400}, -1}};
  EXPECT_THROW(batch_generate(*eng, bad, o), Error);
  const std::vector<BatchPrompt> ok = {{random_ids(40, 1), -1}, {random_ids(30, 2), -1}};
  o.max_batch = 0;
  EXPECT_THROW(batch_generate(*eng, ok, o), Error);
  o.max_batch = 2;
  o.gen.max_tokens = -1;
  EXPECT_THROW(batch_generate(*eng, ok, o), Error);
  o.gen.max_tokens = 8;
  // Memory: weights alone fill the device.
  o.weight_bytes = static_cast<int64_t>(model_->checkpoint_bytes());
  o.device_bytes = o.weight_bytes;
  try {
    batch_generate(*eng, ok, o);
    FAIL() << "a batch that cannot fit was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[memory_plan] expected at most 0 sequences"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(eng->add_sequence(), 0) << "no sequence was added by a refused request";
}

// Per-layer lists of another length than the model's layers are refused by the planner, naming
// the list (as build_caches and the CUDA engine do), rather than planned from their first entries.
TEST_F(BatchTest, PlannerRefusesPerLayerListsOfAnotherLength) {
  const int64_t L = model_->config().n_layers;
  MemoryPlanRequest req;
  req.model = model_->config();
  req.cache = small_config("skvq");
  req.prompt_tokens = 64;
  req.max_new_tokens = 8;
  req.prefill_step = 32;
  for (const int64_t n : {L - 1, L + 1}) {
    std::string list = "4";
    for (int64_t l = 1; l < n; ++l) list += "/2";
    req.cache.skvq_layer_bits_key = list;
    try {
      (void)plan_memory(req);
      ADD_FAILURE() << "a list of " << n << " entries was planned";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), "[memory_plan] skvq_layer_bits_key: expected " +
                                           std::to_string(L) + " entries (one per layer) but got " +
                                           std::to_string(n) + " ('" + list + "')");
    }
  }
  std::string list = "4";
  for (int64_t l = 1; l < L; ++l) list += "/2";
  req.cache.skvq_layer_bits_key = list;
  EXPECT_FALSE(plan_memory(req).cache_bytes_exact);
  // Value lists: refused alike; planned at their widest entry, so between the caches of every
  // layer at the narrowest and at the widest entry.
  req.cache.skvq_layer_bits_key.clear();
  req.cache.skvq_layer_bits_value = list + "/2";
  try {
    (void)plan_memory(req);
    ADD_FAILURE() << "a value list of " << L + 1 << " entries was planned";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "[memory_plan] skvq_layer_bits_value: expected " +
                                         std::to_string(L) + " entries (one per layer) but got " +
                                         std::to_string(L + 1) + " ('" + list + "/2')");
  }
  req.cache.skvq_layer_bits_value = list;
  const MemoryPlan mixed = plan_memory(req);
  EXPECT_FALSE(mixed.cache_bytes_exact);
  req.cache.skvq_layer_bits_value.clear();
  req.cache.skvq_bits_value = 2;
  const int64_t narrow = plan_memory(req).cache_bytes_peak;
  req.cache.skvq_bits_value = 4;
  const int64_t wide = plan_memory(req).cache_bytes_peak;
  EXPECT_LT(narrow, wide);
  EXPECT_LE(mixed.cache_bytes_peak, wide);
  EXPECT_GT(mixed.cache_bytes_peak, narrow);
}

// The planner caps admission: room for exactly two sequences of the longest request keeps at
// most two live (and the batch still completes); require_full_batch refuses three.
TEST_F(BatchTest, PlannerCapsAdmission) {
  EngineOptions eo;
  eo.cache = small_config("full");
  const auto eng = make_cpu_engine(*model_, eo);
  std::vector<BatchPrompt> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back({random_ids(30 + i, 20 + i), -1});
  BatchGenerateOptions o;
  o.gen.max_tokens = 6;
  o.gen.prefill_step_size = 16;
  o.max_batch = 3;
  o.weight_bytes = static_cast<int64_t>(model_->checkpoint_bytes());
  MemoryPlanRequest req;
  req.model = model_->config();
  req.cache = eo.cache;
  req.prompt_tokens = 33;
  req.max_new_tokens = 6;
  req.prefill_step = 16;
  req.weight_bytes = o.weight_bytes;
  req.max_batch = 3;
  const MemoryPlan one = plan_memory(req);
  o.device_bytes = one.weight_bytes + one.workspace_bytes + 2 * one.cache_bytes_resident + 1;
  const auto r = batch_generate(*eng, prompts, o);
  EXPECT_EQ(r.plan.max_sequences, 2);
  EXPECT_EQ(r.max_live, 2);
  for (const auto& x : r.results) EXPECT_EQ(x.tokens.size(), 6u);
  o.require_full_batch = true;
  EXPECT_THROW(batch_generate(*eng, prompts, o), Error);
}

struct PlanCase {
  std::string method;
  int64_t prompt, step, gen;
  std::function<void(CacheConfig&)> tweak;
};

// The planner's figure against the caches' own: one sequence run on the CPU engine (prefill
// chunks, end_prompt, decode steps), stats read after every step.
TEST_F(BatchTest, PlannerEqualsTheCachesPeak) {
  std::vector<PlanCase> cases;
  for (const std::string& m : cache_methods()) {
    cases.push_back({m, 70, 32, 20, [](CacheConfig&) {}});
    cases.push_back({m, 200, 64, 40, [](CacheConfig&) {}});
    cases.push_back({m, 17, 5, 1, [](CacheConfig&) {}});
    cases.push_back({m, 100, 33, 30, [](CacheConfig& c) {
                       c.snap_evict_at = SnapEvictAt::kPromptEnd;
                       c.skvq_recent = 5;
                     }});
  }
  // Per-layer key bits (4 in layer 0, 2 after): planned at the largest, an upper bound.
  const int64_t n_layers = model_->config().n_layers;
  cases.push_back({"skvq", 200, 64, 40, [n_layers](CacheConfig& c) {
                     c.skvq_layer_bits_key = "4";
                     for (int64_t l = 1; l < n_layers; ++l) c.skvq_layer_bits_key += "/2";
                   }});
  // Channel-axis keys (one (lo, scale) per channel over a chunk or over runs of skvq_key_rows
  // rows): the channel-axis byte formula, not the token-axis one.
  for (const char* m : {"skvq", "snapkv+skvq"})
    for (int64_t rows : {0, 7})
      cases.push_back({m, 90, 32, 40, [rows](CacheConfig& c) {
                         c.skvq_key_axis = QuantAxis::kChannel;
                         c.skvq_key_rows = rows;
                         c.skvq_group_size = 32;
                         c.snap_evict_at = SnapEvictAt::kPromptEnd;  // snapkv+skvq needs it
                       }});
  for (const PlanCase& pc : cases) {
    for (DType kv : {DType::kF16, DType::kF32}) {
      CacheConfig cc = small_config(pc.method);
      pc.tweak(cc);
      if (pc.method != "snapkv" && pc.method != "snapkv+skvq")
        cc.snap_evict_at = SnapEvictAt::kPrefillCall;
      if (pc.method.find("skvq") == std::string::npos) cc.skvq_recent = 0;
      SCOPED_TRACE(pc.method + " prompt " + std::to_string(pc.prompt) + " step " +
                   std::to_string(pc.step) + " gen " + std::to_string(pc.gen) + " kv " +
                   dtype_name(kv) +
                   (cc.snap_evict_at == SnapEvictAt::kPromptEnd ? " prompt_end" : ""));
      EngineOptions eo;
      eo.cache = cc;
      eo.kv_dtype = kv;
      const auto eng = make_cpu_engine(*model_, eo);
      const int64_t s = eng->add_sequence();
      const auto ids = random_ids(pc.prompt, 5);
      int64_t peak_acc = 0, peak_res = 0, prompt_acc = 0, done = 0;
      auto record = [&] {
        const CacheMemory m = eng->memory(s);
        peak_acc = std::max(peak_acc, m.bytes_accounted);
        peak_res = std::max(peak_res, m.bytes_resident);
      };
      std::vector<float> logits;
      const auto chunks = prefill_chunks(pc.prompt, pc.step);
      for (size_t i = 0; i < chunks.size(); ++i) {
        const bool last = i + 1 == chunks.size();
        // No end_prompt flag: the stats are read before it (a prompt-end SnapKV eviction then
        // runs at the first decode call, KVCache::end_prompt's contract).
        eng->step(std::vector<SeqChunk>{{s, std::span(ids).subspan(done, chunks[i]), last, false}},
                  &logits);
        done += chunks[i];
        record();
        if (last) prompt_acc = eng->memory(s).bytes_accounted;
      }
      std::vector<int32_t> tok = {7};
      for (int64_t i = 1; i < pc.gen; ++i) {
        eng->step(std::vector<SeqChunk>{{s, std::span(tok), true, false}}, &logits);
        record();
      }
      MemoryPlanRequest req;
      req.model = model_->config();
      req.cache = cc;
      req.kv_dtype = kv;
      req.prompt_tokens = pc.prompt;
      req.max_new_tokens = pc.gen;
      req.prefill_step = pc.step;
      const MemoryPlan p = plan_memory(req);
      EXPECT_EQ(p.context_tokens, pc.prompt + pc.gen - 1);
      if (pc.method == "snapkv+skvq" || !cc.skvq_layer_bits_key.empty()) {
        EXPECT_FALSE(p.cache_bytes_exact);
        EXPECT_GE(p.cache_bytes_peak, peak_acc);
      } else {
        EXPECT_TRUE(p.cache_bytes_exact);
        EXPECT_EQ(p.cache_bytes_peak, peak_acc);
        EXPECT_EQ(p.cache_bytes_prompt, prompt_acc);
      }
      EXPECT_GE(p.cache_bytes_resident, peak_res);
      EXPECT_GT(peak_acc, 0);
    }
  }
}

// snapkv+skvq with channel-axis keys: the planner's packed bytes per row are the chunk formula
// (skvq_channel_bytes for keys, whose (lo, scale) per channel a chunk's rows share, plus the
// values' token formula) over the chunk's rows, not the token-axis key formula per row (which,
// with small key groups, counts up to 2 metadata elements per 8 channels for every row). A long
// decode makes the last point the peak: 2 sinks + the largest tail (span - 1 rows) in full
// precision, the rest packed, the permutations.
TEST_F(BatchTest, PlannerCountsChannelAxisKeysByTheChunkFormula) {
  const ModelConfig& mc = model_->config();
  CacheConfig cc = small_config("snapkv+skvq");
  cc.snap_evict_at = SnapEvictAt::kPromptEnd;
  cc.skvq_window = 64;
  cc.skvq_key_axis = QuantAxis::kChannel;
  MemoryPlanRequest req;
  req.model = mc;
  req.cache = cc;
  req.prompt_tokens = 40;
  req.max_new_tokens = 400;
  req.prefill_step = 64;
  const MemoryPlan p = plan_memory(req);
  const int64_t H = mc.n_kv_heads, d = mc.head_dim, w = cc.skvq_window;
  const PackedRowFormat fk = make_channel_row_format(d, cc.skvq_bits_key, w, cc.skvq_meta);
  const int64_t chunk =
      skvq_channel_bytes(w, fk).total() +
      skvq_compressed_bytes(w, d, cc.skvq_bits_value, cc.skvq_group_size, cc.skvq_meta).total();
  const int64_t prow = (chunk + w - 1) / w * H;
  const int64_t rows = cc.snap_budget + req.max_new_tokens - 1;  // after the eviction
  const int64_t fp = cc.skvq_n_sink + w - 1;                     // sinks + the largest tail
  const int64_t fp_row = 2 * H * d * 2, perm = 2 * H * d * 4;
  EXPECT_EQ(p.cache_bytes_peak, (fp * fp_row + (rows - fp) * prow + perm) * mc.n_layers);
  // the token-axis key formula per row is larger here (the figure this test guards against)
  const int64_t token_row =
      skvq_compressed_bytes(1, d, cc.skvq_bits_key, cc.skvq_group_size, cc.skvq_meta).total() +
      skvq_compressed_bytes(1, d, cc.skvq_bits_value, cc.skvq_group_size, cc.skvq_meta).total();
  EXPECT_GT(token_row * H, prow);
}

// reserve_capacity (the CUDA engine's Engine::reserve): a full cache that reserved the planner's
// context_tokens (FullCache::reserve, what the engine hands each layer's cache) holds, at every
// point of the sequence's life, exactly the planner's resident figure per layer: one store, no
// growth (the device engine's figure: tests/cuda/test_cuda_engine.cpp). Without the reservation the
// planner's figure is a bound with growth slack, larger.
TEST_F(BatchTest, PlannerCountsExactlyWhatAFullCacheReserves) {
  struct Life {
    int64_t prompt, step, gen;
  };
  const ModelConfig& mc = model_->config();
  for (const Life& lf : {Life{70, 32, 20}, Life{300, 64, 1}, Life{17, 5, 300}}) {
    SCOPED_TRACE("prompt " + std::to_string(lf.prompt) + " gen " + std::to_string(lf.gen));
    MemoryPlanRequest req;
    req.model = mc;
    req.cache = small_config("full");
    req.kv_dtype = DType::kF16;
    req.prompt_tokens = lf.prompt;
    req.max_new_tokens = lf.gen;
    req.prefill_step = lf.step;
    const MemoryPlan grow = plan_memory(req);
    req.reserve_capacity = true;
    const MemoryPlan p = plan_memory(req);
    FullCache c;
    c.reserve(p.context_tokens);
    int64_t done = 0;
    auto feed = [&](int64_t n) {
      const Tensor k = test::random_tensor(DType::kF16, 1, mc.n_kv_heads, n, mc.head_dim,
                                           static_cast<uint64_t>(done + 1));
      c.update_and_fetch(k.view(), k.view());
      done += n;
      // the device store's K and V buffers each hold one spare 16-byte word (DeviceBuffer) that
      // the host store does not: the only difference
      EXPECT_EQ((c.stats().bytes_resident + 2 * 16) * mc.n_layers, p.cache_bytes_resident) << done;
    };
    for (int64_t n : prefill_chunks(lf.prompt, lf.step)) feed(n);
    for (int64_t i = 1; i < lf.gen; ++i) feed(1);
    EXPECT_EQ(done, p.context_tokens);
    EXPECT_EQ(p.cache_bytes_peak, grow.cache_bytes_peak);  // the same rows accounted
    EXPECT_GT(grow.cache_bytes_resident, p.cache_bytes_resident);
  }
}

// SKVQ on the layout the CUDA backend asks for (one packed run per cache, grown x1.5 in steps of
// 64 rows unless reserved; a CPU backend that asks for it, tests/util/cpu_delegate_backend.h):
// one layer's cache fed a long-ish life (prefill chunks, then decode steps), its resident bytes
// (CacheStats::bytes_resident, what the engine's CacheMemory sums) never pass the planner's
// figure, for K2V2, K4V4 and channel-axis keys, with and without the reservation the planner is
// told about (reserve_capacity: SkvqCache::reserve of context_tokens). The accounted peak is the
// planner's exactly; reserved, the packed run is made once, with the context's records rounded
// up to 64, and the plan is below the growing one's.
class OneRunBackend final : public test::CpuDelegateBackend {
 public:
  bool one_packed_run() const override { return true; }
};

TEST_F(BatchTest, PlannerBoundsAGrowingOrReservedSkvqRun) {
  struct Life {
    int64_t prompt, step, gen;
  };
  struct Bits {
    const char* name;
    double k, v;
    bool channel;
  };
  const ModelConfig& mc = model_->config();
  const OneRunBackend one_run;
  for (const Bits& bits : {Bits{"K2V2", 2, 2, false}, Bits{"K4V4", 4, 4, false},
                           Bits{"K2V2 channel keys", 2, 2, true}})
    for (const Life& lf : {Life{700, 64, 300}, Life{300, 33, 500}, Life{2000, 512, 17}})
      for (bool reserve : {false, true}) {
        SCOPED_TRACE(std::string(bits.name) + " prompt " + std::to_string(lf.prompt) + " step " +
                     std::to_string(lf.step) + " gen " + std::to_string(lf.gen) +
                     (reserve ? " reserved" : " growing"));
        CacheConfig cc = small_config("skvq");
        cc.skvq_bits_key = bits.k;
        cc.skvq_bits_value = bits.v;
        if (bits.channel) {
          cc.skvq_key_axis = QuantAxis::kChannel;
          cc.skvq_group_size = 32;
        }
        MemoryPlanRequest req;
        req.model = mc;
        req.cache = cc;
        req.kv_dtype = DType::kF16;
        req.prompt_tokens = lf.prompt;
        req.max_new_tokens = lf.gen;
        req.prefill_step = lf.step;
        req.reserve_capacity = reserve;
        const MemoryPlan p = plan_memory(req);
        cc.head_dim = mc.head_dim;
        SkvqCache c(cc, one_run);
        if (reserve) c.reserve(p.context_tokens);
        const int64_t want_cap =
            round_up(std::max<int64_t>(skvq_packed_rows(cc, p.context_tokens), 64), 64);
        int64_t done = 0, peak_acc = 0, peak_res = 0, caps = 0, last_cap = 0;
        auto feed = [&](int64_t n) {
          const Tensor k = test::random_tensor(DType::kF16, 1, mc.n_kv_heads, n, mc.head_dim,
                                               static_cast<uint64_t>(done + 1));
          c.update_and_fetch(k.view(), k.view());
          done += n;
          const CacheStats st = c.stats();
          peak_acc = std::max(peak_acc, st.bytes_accounted * mc.n_layers);
          peak_res = std::max(peak_res, st.bytes_resident * mc.n_layers);
          ASSERT_LE(st.bytes_resident * mc.n_layers, p.cache_bytes_resident) << "after " << done;
          if (c.packed_capacity() != last_cap) ++caps, last_cap = c.packed_capacity();
          if (reserve && c.quantized_tokens() > 0) {
            ASSERT_EQ(c.packed_capacity(), want_cap);
          }
        };
        for (int64_t n : prefill_chunks(lf.prompt, lf.step)) feed(n);
        for (int64_t i = 1; i < lf.gen; ++i) feed(1);
        EXPECT_EQ(done, p.context_tokens);
        EXPECT_TRUE(p.cache_bytes_exact);
        EXPECT_EQ(p.cache_bytes_peak, peak_acc);
        if (reserve) {
          EXPECT_EQ(caps, 1);  // one run, made at the first flush, never copied
          req.reserve_capacity = false;
          EXPECT_LT(p.cache_bytes_resident, plan_memory(req).cache_bytes_resident);
        } else {
          EXPECT_GT(caps, 1);  // it grew
        }
        std::printf("[plan] %s %lld/%lld/%lld %s: resident %lld <= plan %lld (accounted %lld)\n",
                    bits.name, static_cast<long long>(lf.prompt), static_cast<long long>(lf.step),
                    static_cast<long long>(lf.gen), reserve ? "reserved" : "growing",
                    static_cast<long long>(peak_res),
                    static_cast<long long>(p.cache_bytes_resident),
                    static_cast<long long>(peak_acc));
      }
}

// The workspace figure covers the forward pass's buffers for a chunk (ForwardScratch capacity).
TEST_F(BatchTest, WorkspaceCoversTheForwardBuffers) {
  for (DType kv : {DType::kF16, DType::kF32}) {
    auto caches = model_->make_caches(CacheConfig{});
    ForwardScratch scratch;
    std::vector<float> logits;
    ForwardOptions fo;
    fo.kv_dtype = kv;
    const auto ids = random_ids(48, 3);
    model_->forward(ids.data(), 1, 48, caches, fo, &logits, &scratch);
    const auto used = static_cast<int64_t>(scratch_bytes(scratch));
    EXPECT_GE(activation_bytes(model_->config(), 48, 1), used);
    EXPECT_LE(activation_bytes(model_->config(), 48, 1), 2 * used);  // not a blanket figure
  }
}

TEST(MemoryPlan, RefusesBadRequests) {
  ModelConfig m;
  m.n_layers = 2;
  m.n_kv_heads = 2;
  m.head_dim = 16;
  m.hidden_size = 64;
  m.n_heads = 4;
  m.vocab_size = 100;
  m.intermediate_size = 88;
  m.max_position_embeddings = 100;
  MemoryPlanRequest r;
  r.model = m;
  r.prompt_tokens = 0;
  EXPECT_THROW(plan_memory(r), Error);
  r.prompt_tokens = 90;
  r.max_new_tokens = 12;  // 101 positions
  EXPECT_THROW(plan_memory(r), Error);
  r.max_new_tokens = 11;
  EXPECT_NO_THROW(plan_memory(r));
  r.prefill_step = 0;
  EXPECT_THROW(plan_memory(r), Error);
  r.prefill_step = 16;
  r.cache.method = "bogus";
  EXPECT_THROW(plan_memory(r), Error);
}

}  // namespace
}  // namespace vq
