// Tensor parallelism on the CPU (veloxquant/tensor_parallel.h): the shard plan and its refusals,
// the reference all-reduce, every cache method's rank caches against the single-device cache
// restricted to the rank's heads (bit for bit), the sharded forward pass against Model::forward
// for N = 1, 2 and the model's largest N (prefill, decode, greedy tokens), sharded state
// save/load, and the engines' --tensor-parallel checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <sstream>

#include "util/test_util.h"
#include "util/tiny_model.h"
#include "util/tp_bound.h"
#include "veloxquant/attention.h"
#include "veloxquant/builder.h"
#include "veloxquant/engine.h"
#include "veloxquant/error.h"
#include "veloxquant/memory_plan.h"
#include "veloxquant/skvq_cache.h"
#include "veloxquant/tensor_parallel.h"

namespace vq {
namespace {

constexpr double kU = test::kFp32Roundoff;

using test::error_of;

ModelConfig config_with(int64_t heads, int64_t kv_heads) {
  ModelConfig c;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.intermediate_size = 1027;
  c.n_layers = 3;
  return c;
}

TEST(TensorParallel, PlanSplitsHeadsAndColumns) {
  const ModelConfig c = config_with(32, 8);
  EXPECT_EQ(tensor_parallel_sizes(c), (std::vector<int64_t>{1, 2, 4, 8}));
  for (int64_t n : {1, 2, 4, 8}) {
    const ShardPlan p = make_shard_plan(c, n);
    ASSERT_EQ(static_cast<int64_t>(p.ranks.size()), n);
    int64_t q = 0, kv = 0, inter = 0;
    for (const RankShard& s : p.ranks) {  // contiguous, covering, GQA groups whole
      EXPECT_EQ(s.q_heads.first, q);
      EXPECT_EQ(s.kv_heads.first, kv);
      EXPECT_EQ(s.intermediate.first, inter);
      EXPECT_EQ(s.q_heads.count, s.kv_heads.count * 4);
      EXPECT_LE(std::abs(s.intermediate.count - 1027 / n), 1);
      q += s.q_heads.count;
      kv += s.kv_heads.count;
      inter += s.intermediate.count;
    }
    EXPECT_EQ(q, 32);
    EXPECT_EQ(kv, 8);
    EXPECT_EQ(inter, 1027);
  }
}

TEST(TensorParallel, PlanRefusesNThatDoesNotDivideTheKvHeads) {
  const ModelConfig c = config_with(6, 2);
  for (int64_t n : {0, 3, 4, -1}) {
    const std::string e = error_of([&] { make_shard_plan(c, n); });
    EXPECT_NE(e.find("N = " + std::to_string(n)), std::string::npos) << e;
    EXPECT_NE(e.find("2 KV heads"), std::string::npos) << e;
    EXPECT_NE(e.find("6 query heads"), std::string::npos) << e;
    EXPECT_NE(e.find("N in {1, 2}"), std::string::npos) << e;
  }
}

TEST(TensorParallel, ReferenceAllReduceSumsInRankOrder) {
  auto comm = make_reference_communicator(3);
  EXPECT_EQ(comm->size(), 3);
  // 1 + 2^-24 + 2^-24 is 1 in rank order (each addition rounds back to 1) but would be
  // 1 + 2^-23 summed from the small end: the order is part of the contract.
  std::vector<float> a{1.0f, 2.0f}, b{static_cast<float>(kU), -1.0f},
      c{static_cast<float>(kU), 0.5f};
  float* bufs[3] = {a.data(), b.data(), c.data()};
  comm->all_reduce_sum(bufs, 2);
  for (const auto* v : {&a, &b, &c}) {
    EXPECT_EQ((*v)[0], 1.0f);
    EXPECT_EQ((*v)[1], 1.5f);
  }
  float* two[2] = {a.data(), b.data()};
  const std::string e = error_of([&] { comm->all_reduce_sum(two, 2); });
  EXPECT_NE(e.find("expected 3 buffers"), std::string::npos) << e;
}

// ---- caches: a rank's cache is the single-device cache restricted to its heads --------------

struct CacheCase {
  std::string name;
  std::string spec;
  bool perm_file = false;
};

std::vector<CacheCase> cache_cases() {
  return {
      {"full", "full"},
      {"streaming", "streaming:n_sink=2:window=9"},
      {"snapkv_key_proxy", "snapkv:budget=12:obs_window=4:n_sink=2:pool_kernel=3"},
      {"snapkv_query_prompt_end",
       "snapkv:budget=12:obs_window=4:n_sink=2:scoring=query:evict_at=prompt_end"},
      {"skvq_reorder", "skvq:bits_key=2:bits_value=2:group_size=8:window=8:n_sink=2"},
      {"skvq_rotation",
       "skvq:bits_key=4:bits_value=2:group_size=8:window=8:n_sink=2:"
       "rotation=hadamard:rotate_values=true"},
      {"skvq_channel_axis",
       "skvq:bits_key=2:bits_value=4:group_size=16:window=8:n_sink=2:"
       "key_axis=channel:recent=3"},
      {"skvq_perm_file", "skvq:bits_key=2:bits_value=2:group_size=8:window=8:n_sink=2", true},
      {"snapkv+skvq",
       "snapkv+skvq:snap_budget=14:obs_window=4:snap_n_sink=2:bits_key=2:"
       "bits_value=2:group_size=8:skvq_window=8:skvq_n_sink=2:evict_at=prompt_end"},
      {"snapkv+skvq_rotation_query",
       "snapkv+skvq:snap_budget=14:obs_window=4:snap_n_sink=2:"
       "bits_key=2:bits_value=2:group_size=8:skvq_window=8:"
       "skvq_n_sink=2:rotation=hadamard:scoring=query:evict_at=prompt_end"},
  };
}

// Heads [h0, h0 + n) of a [B, H, S, D] view (strides kept).
TensorView heads_of(const TensorView& t, int64_t h0, int64_t n) {
  TensorView v = t;
  v.data = t.row(0, h0, 0);
  v.shape[1] = n;
  return v;
}

TEST(TensorParallel, RankCachesAreTheSingleCacheRestrictedToTheirHeads) {
  const int64_t B = 1, H = 4, G = 2, D = 16;  // 4 KV heads, 8 query heads
  const std::string dir = test::make_temp_dir("vq-tp-perm");
  const std::string perm_path = dir + "/perms.json";
  {
    SkvqPermSet ps;
    ps.n_kv_heads = H;
    ps.head_dim = D;
    std::mt19937_64 rng(5);
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<int32_t> p;
      for (int64_t h = 0; h < H; ++h) {
        std::vector<int32_t> one(D);
        for (int64_t j = 0; j < D; ++j) one[j] = static_cast<int32_t>(j);
        std::shuffle(one.begin(), one.end(), rng);
        p.insert(p.end(), one.begin(), one.end());
      }
      (kv == 0 ? ps.key : ps.value).push_back(p);
    }
    save_skvq_perm_file(perm_path, ps);
  }
  ModelConfig mc = config_with(H * G, H);
  // Calls: a prompt in three chunks, the prompt's end, then single-token decode steps.
  const std::vector<int64_t> calls{11, 7, 13, 0, 1, 1, 1, 1, 1, 1, 1, 1};
  for (const CacheCase& cc : cache_cases()) {
    SCOPED_TRACE(cc.name);
    CacheConfig cfg = parse_cache_arg(cc.spec);
    cfg.head_dim = D;
    if (cc.perm_file) cfg.skvq_perm_file = perm_path;
    for (int64_t n : {2, 4}) {
      SCOPED_TRACE("N = " + std::to_string(n));
      const ShardPlan plan = make_shard_plan(mc, n);
      auto single = make_cache(cfg);
      std::vector<std::unique_ptr<KVCache>> ranks;
      for (int64_t r = 0; r < n; ++r) ranks.push_back(make_cache(rank_cache_config(plan, r, cfg)));
      const int64_t hr = H / n;
      int64_t pos = 0;
      uint64_t seed = 100;
      for (int64_t s : calls) {
        if (s == 0) {
          single->end_prompt();
          for (auto& c : ranks) c->end_prompt();
          continue;
        }
        const Tensor k = test::random_tensor(DType::kF16, B, H, s, D, ++seed);
        const Tensor v = test::random_tensor(DType::kF16, B, H, s, D, ++seed);
        const Tensor q = test::random_tensor(DType::kF32, B, H * G, s, D, ++seed);
        UpdateOptions uo;
        const TensorView qv = q.view();
        uo.queries = &qv;
        AttentionParams ap;
        ap.q_pos0 = pos;
        const CacheView view = single->update_and_fetch(k.view(), v.view(), uo);
        std::vector<float> out(static_cast<size_t>(B * H * G * s * D));
        attention(qv, view, ap, out.data());
        int64_t bytes = 0;
        for (int64_t r = 0; r < n; ++r) {
          const TensorView qr = heads_of(qv, r * hr * G, hr * G);
          UpdateOptions ur;
          ur.queries = &qr;
          KVCache& c = *ranks[static_cast<size_t>(r)];
          const CacheView rv = c.update_and_fetch(heads_of(k.view(), r * hr, hr),
                                                  heads_of(v.view(), r * hr, hr), ur);
          std::vector<float> ro(static_cast<size_t>(B * hr * G * s * D));
          attention(qr, rv, ap, ro.data());
          // Attention is per query head: the rank's heads' outputs are the same bits.
          const float* want = out.data() + r * hr * G * s * D;
          ASSERT_TRUE(std::equal(ro.begin(), ro.end(), want)) << "rank " << r << " at " << pos;
          for (int64_t h = 0; h < hr; ++h)
            ASSERT_EQ(c.stored_positions(0, h), single->stored_positions(0, r * hr + h));
          ASSERT_EQ(c.stored_rows(), single->stored_rows());
          bytes += c.stats().bytes_accounted;
        }
        // Every method's byte formula is a sum over heads.
        ASSERT_EQ(bytes, single->stats().bytes_accounted) << "at " << pos;
        pos += s;
      }
      if (const auto* sq = dynamic_cast<const SkvqCache*>(single.get())) {
        for (int64_t r = 0; r < n; ++r) {
          const auto* rq = dynamic_cast<const SkvqCache*>(ranks[static_cast<size_t>(r)].get());
          ASSERT_NE(rq, nullptr);
          const auto slice = [&](const auto& all) {
            using V = std::decay_t<decltype(all)>;
            return all.empty() ? V{} : V(all.begin() + r * hr * D, all.begin() + (r + 1) * hr * D);
          };
          EXPECT_EQ(rq->key_perms(), slice(sq->key_perms()));
          EXPECT_EQ(rq->rotation_signs(), slice(sq->rotation_signs()));
        }
      }
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(TensorParallel, OptionsThatCrossHeadsAreRefusedForSeveralRanks) {
  const ShardPlan one = make_shard_plan(config_with(8, 4), 1);
  const ShardPlan two = make_shard_plan(config_with(8, 4), 2);
  const std::vector<std::pair<std::string, std::string>> cases{
      {"snapkv:scoring=external:evict_at=prompt_end", "snap_scoring"},
      {"snapkv+skvq", "snap_evict_at: expected prompt_end"}};
  for (const auto& [spec, field] : cases) {
    const CacheConfig cfg = parse_cache_arg(spec);
    EXPECT_NO_THROW(rank_cache_config(one, 0, cfg));
    const std::string e = error_of([&] { rank_cache_config(two, 1, cfg); });
    EXPECT_NE(e.find(field), std::string::npos) << e;
    EXPECT_NE(e.find("N = 2"), std::string::npos) << e;
  }
}

// ---- the sharded forward pass -----------------------------------------------------------------

struct ModelCase {
  std::string name;
  std::unique_ptr<Model> model;
  std::string dir;  // removed at the end when temporary
};

// 8-bit codes for the quantized methods: see logit_bound.
constexpr int kQuantBits = 8;

std::vector<std::string> method_specs(int64_t head_dim) {
  const std::string g = std::to_string(std::min<int64_t>(head_dim, 32));
  const std::string b = std::to_string(kQuantBits);
  return {"full", "streaming:n_sink=2:window=20",
          "snapkv:budget=24:obs_window=6:n_sink=2:evict_at=prompt_end",
          "skvq:bits_key=" + b + ":bits_value=" + b + ":group_size=" + g + ":window=16:n_sink=2",
          "snapkv+skvq:snap_budget=26:obs_window=6:snap_n_sink=2:bits_key=" + b + ":bits_value=" +
              b + ":group_size=" + g + ":skvq_window=16:skvq_n_sink=2:evict_at=prompt_end"};
}

bool quantized(const std::string& spec) {
  return spec.find("skvq") != std::string::npos;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return ids;
}

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// Prefill in chunks (the prompt's end after the last), then greedy decode; each step's
// last-token logits. forward(tokens, n) runs one call.
template <typename F>
std::vector<std::vector<float>> run_greedy(const std::vector<int32_t>& prompt, int64_t decode,
                                           const F& forward, const std::function<void()>& end,
                                           std::vector<int32_t>* tokens) {
  std::vector<std::vector<float>> out;
  std::vector<float> lg;
  for (size_t i = 0; i < prompt.size(); i += 17) {
    const int64_t n = std::min<int64_t>(17, static_cast<int64_t>(prompt.size() - i));
    forward(prompt.data() + i, n, &lg);
    out.push_back(lg);
  }
  end();
  for (int64_t s = 0; s < decode; ++s) {
    const int32_t t = argmax(lg);
    tokens->push_back(t);
    forward(&t, 1, &lg);
    out.push_back(lg);
  }
  return out;
}

// The bound of tests/util/tp_bound.h, at kQuantBits for the quantized methods.
double logit_bound(const ModelConfig& c, int64_t n, double max_logit, bool quant) {
  return test::sharded_logit_bound(c, n, max_logit, quant ? kQuantBits : 0);
}

void check_sharded_logits(const Model& m, const std::string& label) {
  const ModelConfig& c = m.config();
  const auto prompt = random_ids(36, c.vocab_size, 21);
  const int64_t decode = 5;
  for (const std::string& spec : method_specs(c.head_dim)) {
    SCOPED_TRACE(label + " " + spec);
    CacheConfig cfg = parse_cache_arg(spec);
    ForwardOptions fo;
    fo.kv_dtype = DType::kF32;  // no fp16 rounding of K/V between the two runs' ulps
    auto single = m.make_caches(cfg);
    std::vector<int32_t> want_tokens;
    ForwardScratch ss;
    const auto want = run_greedy(
        prompt, decode,
        [&](const int32_t* t, int64_t n, std::vector<float>* lg) {
          m.forward(t, 1, n, single, fo, lg, &ss);
        },
        [&] {
          for (auto& x : single) x->end_prompt();
        },
        &want_tokens);
    for (int64_t n : tensor_parallel_sizes(c)) {
      SCOPED_TRACE("N = " + std::to_string(n));
      const ShardedModel sm(m, n);
      auto comm = make_reference_communicator(n);
      RankCaches rc = sm.make_caches(cfg);
      std::vector<ForwardScratch> scratch;
      std::vector<int32_t> got_tokens;
      const auto got = run_greedy(
          prompt, decode,
          [&](const int32_t* t, int64_t k, std::vector<float>* lg) {
            sm.forward(t, 1, k, rc, fo, *comm, lg, &scratch);
          },
          [&] {
            for (auto& r : rc)
              for (auto& x : r) x->end_prompt();
          },
          &got_tokens);
      EXPECT_EQ(got_tokens, want_tokens);
      ASSERT_EQ(got.size(), want.size());
      double used = 0;
      for (size_t s = 0; s < want.size(); ++s) {
        ASSERT_EQ(got[s].size(), want[s].size());
        double mx = 0, worst = 0;
        for (size_t i = 0; i < want[s].size(); ++i) {
          mx = std::max(mx, static_cast<double>(std::abs(want[s][i])));
          worst = std::max(worst, static_cast<double>(std::abs(got[s][i] - want[s][i])));
        }
        if (n == 1) {  // one rank: the same sums in the same order
          ASSERT_EQ(worst, 0.0) << "step " << s;
          continue;
        }
        const double tol = logit_bound(c, n, mx, quantized(spec));
        ASSERT_LE(worst, tol) << "step " << s;
        used = std::max(used, worst / tol);
      }
      // The kept rows (positions) of every rank's heads equal the single device's.
      for (int64_t r = 0; r < n; ++r)
        for (int64_t l = 0; l < c.n_layers; ++l)
          for (int64_t h = 0; h < c.n_kv_heads / n; ++h)
            ASSERT_EQ(
                rc[static_cast<size_t>(r)][static_cast<size_t>(l)]->stored_positions(0, h),
                single[static_cast<size_t>(l)]->stored_positions(0, r * (c.n_kv_heads / n) + h));
      if (n > 1)
        std::printf("  %s %s N=%lld: %.1f%% of the bound\n", label.c_str(), spec.c_str(),
                    static_cast<long long>(n), 100 * used);
    }
  }
}

TEST(TensorParallel, ShippedModelShardsGiveTheSingleDeviceLogits) {
  const std::string dir = find_shipped_model();
  if (dir.empty()) GTEST_SKIP() << "models/vq-mini-llama not found";
  const auto m = Model::load(dir);
  ASSERT_EQ(m->config().n_kv_heads, 2);
  check_sharded_logits(*m, "vq-mini-llama");
}

test::TinyModelSpec many_kv_heads() {
  test::TinyModelSpec s;
  s.n_heads = 8;
  s.n_kv_heads = 4;
  s.explicit_head_dim = true;
  s.head_dim = 16;
  s.intermediate_size = 90;  // not a multiple of 4: uneven MLP shares
  s.model_type = "qwen2";    // q/k/v biases sliced with their rows
  return s;
}

TEST(TensorParallel, RandomModelWithFourKvHeadsShards) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-tp"), many_kv_heads());
  const auto m = Model::load(dir);
  check_sharded_logits(*m, "tiny-4kv");
  std::filesystem::remove_all(dir);
}

// ---- sharded state ----------------------------------------------------------------------------

std::string state_bytes(const ShardPlan& p, const RankCaches& rc) {
  std::ostringstream os;
  save_sharded_state(os, p, rc);
  return os.str();
}

TEST(TensorParallel, ShardedStateSavesAndLoadsAllOrNothing) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-tp"), many_kv_heads());
  const auto m = Model::load(dir);
  const auto prompt = random_ids(40, m->config().vocab_size, 3);
  const CacheConfig cfg = parse_cache_arg(method_specs(16)[4]);  // snapkv+skvq
  ForwardOptions fo;
  const ShardedModel sm(*m, 2);
  auto comm = make_reference_communicator(2);
  RankCaches a = sm.make_caches(cfg);
  std::vector<float> la, lb;
  sm.forward(prompt.data(), 1, 40, a, fo, *comm, &la);
  for (auto& r : a)
    for (auto& x : r) x->end_prompt();
  const std::string saved = state_bytes(sm.plan(), a);

  // Loaded into fresh caches, decoding continues with the same logits, bit for bit.
  RankCaches b = sm.make_caches(cfg);
  std::istringstream in(saved);
  load_sharded_state(in, sm.plan(), b);
  EXPECT_EQ(state_bytes(sm.plan(), b), saved);
  const int32_t t = argmax(la);
  sm.forward(&t, 1, 1, a, fo, *comm, &la);
  sm.forward(&t, 1, 1, b, fo, *comm, &lb);
  EXPECT_EQ(la, lb);

  // Another N: refused naming both splits, nothing changed.
  const ShardedModel s4(*m, 4);
  RankCaches c4 = s4.make_caches(cfg);
  const std::string before4 = state_bytes(s4.plan(), c4);
  std::istringstream in4(saved);
  std::string e = error_of([&] { load_sharded_state(in4, s4.plan(), c4); });
  EXPECT_NE(e.find("expected a state sharded as N = 4"), std::string::npos) << e;
  EXPECT_NE(e.find("the file holds N = 2"), std::string::npos) << e;
  EXPECT_NE(e.find("KV heads per rank 0+2, 2+2"), std::string::npos) << e;
  EXPECT_EQ(state_bytes(s4.plan(), c4), before4);

  // Another head split with the same N (a plan edited by hand): refused.
  ShardPlan odd = sm.plan();
  odd.ranks[0].kv_heads = {0, 1};
  odd.ranks[1].kv_heads = {1, 3};
  std::istringstream in_odd(saved);
  e = error_of([&] { load_sharded_state(in_odd, odd, b); });
  EXPECT_NE(e.find("0+1, 1+3"), std::string::npos) << e;

  // Another cache method: the frames are refused halfway, the ones loaded are put back.
  RankCaches full = sm.make_caches(parse_cache_arg("full"));
  std::vector<float> lf;
  sm.forward(prompt.data(), 1, 5, full, fo, *comm, &lf);
  const std::string before_full = state_bytes(sm.plan(), full);
  std::istringstream in_full(saved);
  e = error_of([&] { load_sharded_state(in_full, sm.plan(), full); });
  EXPECT_NE(e.find("rank 0, layer 0"), std::string::npos) << e;
  EXPECT_NE(e.find("nothing was changed"), std::string::npos) << e;
  EXPECT_EQ(state_bytes(sm.plan(), full), before_full);

  // A truncated file: refused by the frame check.
  std::istringstream cut(saved.substr(0, saved.size() / 2));
  e = error_of([&] { load_sharded_state(cut, sm.plan(), b); });
  EXPECT_NE(e.find("[load_state]"), std::string::npos) << e;
  EXPECT_EQ(state_bytes(sm.plan(), b), state_bytes(sm.plan(), a));
  std::filesystem::remove_all(dir);
}

// ---- engines ------------------------------------------------------------------------------------

TEST(TensorParallel, CpuEngineRunsSimulatedRanks) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-tp"), many_kv_heads());
  const auto m = Model::load(dir);
  const auto prompt = random_ids(30, m->config().vocab_size, 9);
  for (const std::string& spec : method_specs(16)) {
    SCOPED_TRACE(spec);
    EngineOptions eo;
    eo.cache = parse_cache_arg(spec);
    eo.kv_dtype = DType::kF32;
    eo.tensor_parallel = 4;
    auto engine = make_cpu_engine(*m, eo);
    const int64_t s = engine->add_sequence();
    std::vector<float> got;
    const SeqChunk ch{s, prompt, true, true};
    engine->step({&ch, 1}, &got);
    // The same as ShardedModel::forward itself.
    const ShardedModel sm(*m, 4);
    auto comm = make_reference_communicator(4);
    RankCaches rc = sm.make_caches(eo.cache);
    ForwardOptions fo;
    fo.kv_dtype = DType::kF32;
    std::vector<float> want;
    sm.forward(prompt.data(), 1, 30, rc, fo, *comm, &want);
    EXPECT_EQ(got, want);
    // Memory: the ranks' sum is the single-device figure (every formula is per head).
    eo.tensor_parallel = 1;
    auto one = make_cpu_engine(*m, eo);
    const int64_t s1 = one->add_sequence();
    const SeqChunk c1{s1, prompt, true, true};
    one->step({&c1, 1}, &want);
    EXPECT_EQ(engine->memory(s).bytes_accounted, one->memory(s1).bytes_accounted);
    EXPECT_EQ(engine->memory(s).rows_kept, one->memory(s1).rows_kept);
    EXPECT_EQ(engine->offset(s), 30);
  }
  EngineOptions bad;
  bad.tensor_parallel = 3;
  const std::string e = error_of([&] { make_cpu_engine(*m, bad); });
  EXPECT_NE(e.find("N = 3"), std::string::npos) << e;
  std::filesystem::remove_all(dir);
}

TEST(TensorParallel, CudaChecksNameDevicesAndNccl) {
  const ModelConfig c = config_with(6, 2);
  EXPECT_NO_THROW(check_cuda_tensor_parallel(c, 1, 1, false));
  std::string e = error_of([&] { check_cuda_tensor_parallel(c, 2, 1, true); });
  EXPECT_NE(e.find("--tensor-parallel 2: expected at most 1 (the CUDA devices visible)"),
            std::string::npos)
      << e;
  e = error_of([&] { check_cuda_tensor_parallel(c, 2, 2, false); });
  EXPECT_NE(e.find("NCCL"), std::string::npos) << e;
  e = error_of([&] { check_cuda_tensor_parallel(c, 3, 8, true); });
  EXPECT_NE(e.find("N in {1, 2}"), std::string::npos) << e;
  // N > 1 over real devices with NCCL passes; --tp-simulate needs one device and no NCCL, and
  // still refuses an N that does not divide the KV heads.
  EXPECT_NO_THROW(check_cuda_tensor_parallel(c, 2, 2, true));
  EXPECT_NO_THROW(check_cuda_tensor_parallel(c, 2, 1, false, true));
  e = error_of([&] { check_cuda_tensor_parallel(c, 2, 0, false, true); });
  EXPECT_NE(e.find("--tp-simulate: expected a CUDA device"), std::string::npos) << e;
  e = error_of([&] { check_cuda_tensor_parallel(c, 3, 1, false, true); });
  EXPECT_NE(e.find("N in {1, 2}"), std::string::npos) << e;
}

}  // namespace
}  // namespace vq

namespace vq {
namespace {

// ---- the per-device memory planner (memory_plan.h with tensor_parallel)
// ---------------------------

// Every cache byte formula is a sum over KV heads, so a rank's caches are exactly 1/N of one
// device's and the simulated ranks' device holds exactly one device's; a rank's workspace is
// smaller; N that does not divide the KV heads and a ranks_per_device other than 1 or N are
// refused.
TEST(TensorParallel, MemoryPlanIsPerDevice) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-tp"), many_kv_heads());
  const auto m = Model::load(dir);
  const ModelConfig& c = m->config();
  for (const std::string& spec : method_specs(c.head_dim)) {
    SCOPED_TRACE(spec);
    MemoryPlanRequest req;
    req.model = c;
    req.cache = parse_cache_arg(spec);
    req.prompt_tokens = 100;
    req.max_new_tokens = 20;
    req.prefill_step = 32;
    req.weight_bytes = device_weight_bytes(*m, 1, false);
    req.device_bytes = int64_t{64} << 20;
    req.max_batch = 4;
    const MemoryPlan one = plan_memory(req);
    for (int64_t n : {2, 4}) {
      req.tensor_parallel = n;
      req.ranks_per_device = 1;
      req.weight_bytes = device_weight_bytes(*m, n, false);
      const MemoryPlan rank = plan_memory(req);
      EXPECT_EQ(rank.cache_bytes_peak * n, one.cache_bytes_peak);
      EXPECT_EQ(rank.cache_bytes_prompt * n, one.cache_bytes_prompt);
      EXPECT_LT(rank.workspace_bytes, one.workspace_bytes);
      EXPECT_LT(rank.weight_bytes, one.weight_bytes);
      EXPECT_GE(rank.max_sequences, one.max_sequences);
      req.ranks_per_device = n;
      req.weight_bytes = device_weight_bytes(*m, n, true);
      const MemoryPlan sim = plan_memory(req);
      EXPECT_EQ(sim.cache_bytes_peak, one.cache_bytes_peak);
      EXPECT_EQ(sim.cache_bytes_resident, rank.cache_bytes_resident * n);
      EXPECT_EQ(sim.workspace_bytes, rank.workspace_bytes * n);
    }
    req.tensor_parallel = 3;
    req.ranks_per_device = 1;
    std::string e = error_of([&] { plan_memory(req); });
    EXPECT_NE(e.find("N in {1, 2, 4}"), std::string::npos) << e;
    req.tensor_parallel = 2;
    req.ranks_per_device = 3;
    e = error_of([&] { plan_memory(req); });
    EXPECT_NE(e.find("ranks_per_device: expected 1"), std::string::npos) << e;
  }
  std::filesystem::remove_all(dir);
}

// device_weight_bytes: N = 1 is the checkpoint; the simulated device holds every rank's slices,
// i.e. each layer's matrices once (at their uploaded dtype), the biases once, and the embedding
// and norms once per rank, plus rank 0's final norm and (untied) lm_head; a rank's device holds
// between 1/N of that and all of it.
TEST(TensorParallel, DeviceWeightBytesCountEveryRanksUpload) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-tp"), many_kv_heads());
  const auto m = Model::load(dir);
  EXPECT_EQ(device_weight_bytes(*m, 1, false), static_cast<int64_t>(m->checkpoint_bytes()));
  auto mat = [](const Linear& l) {
    return l.out * l.in * static_cast<int64_t>(dtype_size(l.dtype)) +
           4 * static_cast<int64_t>(l.bias.size());
  };
  for (int64_t n : {2, 4}) {
    int64_t want = 0;
    for (const Model::Layer& L : m->layers())
      want += mat(L.q) + mat(L.k) + mat(L.v) + mat(L.o) + mat(L.gate) + mat(L.up) + mat(L.down) +
              n * 4 * static_cast<int64_t>(L.attn_norm.size() + L.mlp_norm.size());
    const Linear& e = m->embedding();
    want += n * e.out * e.in * static_cast<int64_t>(dtype_size(e.dtype)) +
            4 * static_cast<int64_t>(m->final_norm().size());
    if (m->lm_head().w != e.w) want += mat(m->lm_head());
    EXPECT_EQ(device_weight_bytes(*m, n, true), want) << "N = " << n;
    const int64_t largest = device_weight_bytes(*m, n, false);
    EXPECT_GE(largest * n, want);
    EXPECT_LT(largest, want);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace vq
