// Tests of CacheConfig (veloxquant/cache_config.h): every field's bad values are refused with a
// message naming the field and the value, the boundaries are accepted, and the three sources
// (set_field, JSON, compact spec) parse, refuse unknown keys and wrong types, and round-trip.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>

#include "veloxquant/cache_config.h"
#include "veloxquant/error.h"

namespace vq {
namespace {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

struct BadCase {
  std::string field;
  std::string value_text;  // how the value appears in the message
  std::function<void(CacheConfig&)> set;
};

TEST(CacheConfig, DefaultsAreValidAndMethodsListed) {
  EXPECT_NO_THROW(validate(CacheConfig{}));
  EXPECT_EQ(cache_methods(),
            (std::vector<std::string>{"full", "snapkv", "skvq", "snapkv+skvq", "streaming"}));
  for (const auto& m : cache_methods()) {
    CacheConfig c;
    c.method = m;
    EXPECT_NO_THROW(validate(c)) << m;
  }
}

TEST(CacheConfig, EveryBadValueIsRefusedNamingTheField) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<BadCase> cases = {
      {"method", "'nope'", [](CacheConfig& c) { c.method = "nope"; }},
      {"method", "''", [](CacheConfig& c) { c.method = ""; }},
      {"head_dim", "0", [](CacheConfig& c) { c.head_dim = 0; }},
      {"snap_budget", "0", [](CacheConfig& c) { c.snap_budget = 0; }},
      {"snap_budget", "-1", [](CacheConfig& c) { c.snap_budget = -1; }},
      {"snap_obs_window", "0", [](CacheConfig& c) { c.snap_obs_window = 0; }},
      {"snap_n_sink", "-1", [](CacheConfig& c) { c.snap_n_sink = -1; }},
      {"snap_dtype", "7", [](CacheConfig& c) { c.snap_dtype = static_cast<SnapDType>(7); }},
      {"snap_scoring", "2", [](CacheConfig& c) { c.snap_scoring = static_cast<SnapScoring>(2); }},
      {"snap_pool_kernel", "0", [](CacheConfig& c) { c.snap_pool_kernel = 0; }},
      {"snap_pool_kernel", "4", [](CacheConfig& c) { c.snap_pool_kernel = 4; }},
      {"snap_pool_kernel", "-3", [](CacheConfig& c) { c.snap_pool_kernel = -3; }},
      {"snap_pool", "9", [](CacheConfig& c) { c.snap_pool = static_cast<PoolKind>(9); }},
      {"skvq_bits_key", "0", [](CacheConfig& c) { c.skvq_bits_key = 0; }},
      {"skvq_bits_key", "9", [](CacheConfig& c) { c.skvq_bits_key = 9; }},
      {"skvq_bits_key", "2.5", [](CacheConfig& c) { c.skvq_bits_key = 2.5; }},
      {"skvq_bits_key", "nan", [nan](CacheConfig& c) { c.skvq_bits_key = nan; }},
      {"skvq_bits_value", "1.25", [](CacheConfig& c) { c.skvq_bits_value = 1.25; }},
      {"skvq_bits_value", "-2", [](CacheConfig& c) { c.skvq_bits_value = -2; }},
      {"skvq_group_size", "0", [](CacheConfig& c) { c.skvq_group_size = 0; }},
      {"skvq_window", "1", [](CacheConfig& c) { c.skvq_window = 1; }},
      {"skvq_n_sink", "-1", [](CacheConfig& c) { c.skvq_n_sink = -1; }},
      {"skvq_n_sink", "128", [](CacheConfig& c) { c.skvq_n_sink = 128; }},  // == window
      {"skvq_n_sink", "9",
       [](CacheConfig& c) {
         c.skvq_window = 8;
         c.skvq_n_sink = 9;
       }},
      {"skvq_clip_alpha", "0", [](CacheConfig& c) { c.skvq_clip_alpha = 0; }},
      {"skvq_clip_alpha", "1.01", [](CacheConfig& c) { c.skvq_clip_alpha = 1.01; }},
      {"skvq_clip_alpha", "-0.5", [](CacheConfig& c) { c.skvq_clip_alpha = -0.5; }},
      {"skvq_clip_alpha", "nan", [nan](CacheConfig& c) { c.skvq_clip_alpha = nan; }},
      {"skvq_clip_alpha", "2",  // checked even when the search ignores it
       [](CacheConfig& c) {
         c.skvq_clip_search = true;
         c.skvq_clip_alpha = 2;
       }},
      {"skvq_max_ctx", "-1", [](CacheConfig& c) { c.skvq_max_ctx = -1; }},
      {"skvq_meta", "3", [](CacheConfig& c) { c.skvq_meta = static_cast<MetaType>(3); }},
      {"skvq_recent", "-4", [](CacheConfig& c) { c.skvq_recent = -4; }},
      {"skvq_rotation", "5", [](CacheConfig& c) { c.skvq_rotation = static_cast<Rotation>(5); }},
      {"streaming_n_sink", "-1", [](CacheConfig& c) { c.streaming_n_sink = -1; }},
      {"streaming_window", "0", [](CacheConfig& c) { c.streaming_window = 0; }},
  };
  for (const auto& bc : cases) {
    CacheConfig c;
    bc.set(c);
    const std::string msg = error_of([&] { validate(c); });
    EXPECT_EQ(msg.rfind("[cache_config] " + bc.field + ": expected ", 0), 0u) << msg;
    EXPECT_NE(msg.find("but got " + bc.value_text), std::string::npos) << msg;
  }
  // The method message lists the choices.
  CacheConfig c;
  c.method = "snap";
  EXPECT_NE(error_of([&] {
              validate(c);
            }).find("expected one of full, snapkv, skvq, snapkv+skvq, streaming"),
            std::string::npos);
}

TEST(CacheConfig, BoundariesAreAccepted) {
  const std::vector<std::function<void(CacheConfig&)>> ok = {
      [](CacheConfig& c) { c.snap_budget = 1; },
      [](CacheConfig& c) { c.snap_obs_window = 1; },
      [](CacheConfig& c) { c.snap_n_sink = 0; },
      [](CacheConfig& c) { c.snap_pool_kernel = 7; },
      [](CacheConfig& c) { c.skvq_bits_key = 1; },
      [](CacheConfig& c) { c.skvq_bits_key = 8; },
      [](CacheConfig& c) { c.skvq_bits_value = 1.5; },
      [](CacheConfig& c) { c.skvq_group_size = 1; },
      [](CacheConfig& c) {
        c.skvq_window = 2;
        c.skvq_n_sink = 1;
      },
      [](CacheConfig& c) { c.skvq_n_sink = 0; },
      [](CacheConfig& c) { c.skvq_clip_alpha = 1.0; },
      [](CacheConfig& c) { c.skvq_clip_alpha = 1e-9; },
      [](CacheConfig& c) { c.skvq_max_ctx = 0; },
      [](CacheConfig& c) { c.streaming_window = 1; },
      [](CacheConfig& c) { c.streaming_n_sink = 0; },
      [](CacheConfig& c) { c.head_dim = 1; },
      // Not this helper's rule: a non-power-of-two head_dim with hadamard is left to skvq.
      [](CacheConfig& c) {
        c.head_dim = 96;
        c.skvq_rotation = Rotation::kHadamard;
      },
  };
  for (size_t i = 0; i < ok.size(); ++i) {
    CacheConfig c;
    ok[i](c);
    EXPECT_NO_THROW(validate(c)) << "case " << i;
  }
}

TEST(CacheConfig, SetFieldParsesEveryKind) {
  CacheConfig c;
  set_field(c, "snap-budget", "256");
  set_field(c, "snap_obs_window", "16");
  set_field(c, "skvq-bits-value", "1.5");
  set_field(c, "snap_keep_window", "on");
  set_field(c, "skvq_reorder", "0");
  set_field(c, "skvq_clip_search", "FALSE");
  set_field(c, "snap_dtype", "bfloat16");
  set_field(c, "snap_scoring", "query");
  set_field(c, "snap_pool", "avg");
  set_field(c, "snap_evict_at", "prompt_end");
  set_field(c, "skvq_meta", "fp8_e4m3");
  set_field(c, "skvq_rotation", "hadamard");
  set_field(c, "skvq_rotation_seed", "0xff");
  set_field(c, "skvq_perm_file", "perms/layer0.bin");
  set_field(c, "method", "snapkv+skvq");
  EXPECT_EQ(c.snap_budget, 256);
  EXPECT_EQ(c.snap_obs_window, 16);
  EXPECT_EQ(c.skvq_bits_value, 1.5);
  EXPECT_TRUE(c.snap_keep_window);
  EXPECT_FALSE(c.skvq_reorder);
  EXPECT_FALSE(c.skvq_clip_search);
  EXPECT_EQ(c.snap_dtype, SnapDType::kBFloat16);
  EXPECT_EQ(c.snap_scoring, SnapScoring::kQuery);
  EXPECT_EQ(c.snap_pool, PoolKind::kAvg);
  EXPECT_EQ(c.snap_evict_at, SnapEvictAt::kPromptEnd);
  EXPECT_THROW(set_field(c, "snap_evict_at", "at_the_end"), Error);
  EXPECT_EQ(c.snap_evict_at, SnapEvictAt::kPromptEnd);  // nothing changed by the refusal
  EXPECT_EQ(c.skvq_meta, MetaType::kFP8E4M3);
  EXPECT_EQ(c.skvq_rotation, Rotation::kHadamard);
  EXPECT_EQ(c.skvq_rotation_seed, 255u);
  EXPECT_EQ(c.skvq_perm_file, "perms/layer0.bin");
  EXPECT_EQ(c.method, "snapkv+skvq");
  set_field(c, "skvq_rotation_seed", "18446744073709551615");
  EXPECT_EQ(c.skvq_rotation_seed, 18446744073709551615ull);
}

TEST(CacheConfig, SetFieldRefusesMalformedValuesAndUnknownKeys) {
  CacheConfig c;
  const std::string before = config_to_json(c);
  EXPECT_EQ(error_of([&] { set_field(c, "snap_budget", "12x"); }),
            "[cache_config] snap_budget: expected an integer but got '12x'");
  EXPECT_NE(error_of([&] { set_field(c, "snap_budget", ""); }).find("snap_budget"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              set_field(c, "snap_budget", "99999999999999999999");
            }).find("expected an integer"),
            std::string::npos);
  EXPECT_NE(error_of([&] { set_field(c, "skvq_bits_key", "two"); }).find("skvq_bits_key"),
            std::string::npos);
  EXPECT_NE(error_of([&] { set_field(c, "skvq_bits_key", "inf"); }).find("a finite number"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              set_field(c, "snap_keep_window", "yes");
            }).find("snap_keep_window: expected a bool (true/false/1/0/on/off) but got 'yes'"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              set_field(c, "snap_dtype", "float32");
            }).find("snap_dtype: expected one of auto, float16, bfloat16 but got 'float32'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { set_field(c, "skvq_rotation_seed", "-1"); }).find("skvq_rotation_seed"),
            std::string::npos);
  const std::string unknown = error_of([&] { set_field(c, "snap_budgte", "1"); });
  EXPECT_NE(unknown.find("unknown key 'snap_budgte'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("did you mean: snap_budget"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("valid keys: method, head_dim, snap_budget"), std::string::npos);
  EXPECT_NE(unknown.find("streaming_window"), std::string::npos);
  EXPECT_EQ(config_to_json(c), before);  // nothing changed by any refusal
}

TEST(CacheConfig, JsonRoundTripsEveryField) {
  CacheConfig c;
  c.method = "snapkv+skvq";
  c.head_dim = 64;
  c.snap_budget = 100;
  c.snap_obs_window = 8;
  c.snap_n_sink = 2;
  c.snap_dtype = SnapDType::kFloat16;
  c.snap_scoring = SnapScoring::kQuery;
  c.snap_pool_kernel = 5;
  c.snap_pool = PoolKind::kAvg;
  c.snap_keep_window = true;
  c.snap_evict_at = SnapEvictAt::kPromptEnd;
  c.skvq_bits_key = 4;
  c.skvq_bits_value = 1.5;
  c.skvq_group_size = 16;
  c.skvq_window = 64;
  c.skvq_n_sink = 3;
  c.skvq_reorder = false;
  c.skvq_clip_search = false;
  c.skvq_clip_alpha = 0.9;
  c.skvq_max_ctx = 4096;
  c.skvq_meta = MetaType::kF32;
  c.skvq_recent = 32;
  c.skvq_rotation = Rotation::kHadamard;
  c.skvq_rotate_values = true;
  c.skvq_rotation_seed = 0xfedcba9876543210ull;
  c.skvq_perm_file = "p.bin";
  c.streaming_n_sink = 1;
  c.streaming_window = 77;
  const std::string text = config_to_json(c);
  const CacheConfig back = config_from_json(text);
  EXPECT_EQ(config_to_json(back), text);
  EXPECT_EQ(back.skvq_rotation_seed, 0xfedcba9876543210ull);
  EXPECT_EQ(back.skvq_clip_alpha, 0.9);
  // Every field appears in the JSON, and differs from the default (so the round trip covers it).
  const auto j = nlohmann::json::parse(text);
  const auto d = nlohmann::json::parse(config_to_json(CacheConfig{}));
  EXPECT_EQ(j.size(), 28u);
  for (const auto& [k, v] : j.items()) EXPECT_NE(v, d.at(k)) << k;
}

TEST(CacheConfig, JsonRefusesUnknownKeysWrongTypesAndBadValues) {
  const CacheConfig c = config_from_json(R"({"method": "snapkv", "snap_budget": 64})");
  EXPECT_EQ(c.method, "snapkv");
  EXPECT_EQ(c.snap_budget, 64);
  EXPECT_EQ(c.snap_obs_window, 32);  // untouched fields keep their defaults
  EXPECT_EQ(config_from_json(R"({"snap-budget": 3})").snap_budget, 3);
  EXPECT_EQ(config_from_json(R"({"skvq_bits_key": 3})").skvq_bits_key, 3.0);  // int -> double

  struct Bad {
    const char* json;
    const char* needle;
  };
  const Bad bad[] = {
      {R"({"snap_budgets": 1})", "unknown key 'snap_budgets'"},
      {R"({"snap_budget": "12"})", "snap_budget: expected an integer but got \"12\""},
      {R"({"snap_budget": 12.5})", "snap_budget: expected an integer but got 12.5"},
      {R"({"snap_budget": true})", "snap_budget: expected an integer but got true"},
      {R"({"snap_budget": 18446744073709551615})", "fits int64"},
      {R"({"snap_keep_window": 1})", "snap_keep_window: expected a bool"},
      {R"({"snap_pool": 0})", "snap_pool: expected a string"},
      {R"({"snap_pool": "median"})", "snap_pool: expected one of max, avg but got 'median'"},
      {R"({"skvq_bits_key": "2"})", "skvq_bits_key: expected a number"},
      {R"({"skvq_rotation_seed": -1})", "skvq_rotation_seed: expected an unsigned integer"},
      {R"({"method": 3})", "method: expected a string"},
      {R"({"snap_budget": 0})", "snap_budget: expected >= 1 but got 0"},
      {R"({"method": "h2o"})", "method: expected one of full, snapkv, skvq"},
      {R"({"snap_budget": 1, "snap-budget": 2})", "got it twice"},
      {R"([1, 2])", "expected a JSON object but got array"},
      {R"({"snap_budget": )", "invalid JSON"},
  };
  for (const auto& b : bad) {
    const std::string msg = error_of([&] { config_from_json(b.json); });
    EXPECT_NE(msg.find(b.needle), std::string::npos) << b.json << " -> " << msg;
    EXPECT_EQ(msg.rfind("[cache_config]", 0), 0u) << msg;
  }
}

TEST(CacheConfig, SpecGivesShortKeysTheMethodsPrefix) {
  const CacheConfig s = config_from_spec("snapkv:budget=256:obs_window=16");
  EXPECT_EQ(s.method, "snapkv");
  EXPECT_EQ(s.snap_budget, 256);
  EXPECT_EQ(s.snap_obs_window, 16);
  const CacheConfig full_names = config_from_spec("snapkv:snap_budget=8:head-dim=64");
  EXPECT_EQ(full_names.snap_budget, 8);
  EXPECT_EQ(full_names.head_dim, 64);
  const CacheConfig q = config_from_spec("skvq:bits_key=4:bits-value=1.5:window=64:n_sink=3");
  EXPECT_EQ(q.skvq_bits_key, 4);
  EXPECT_EQ(q.skvq_bits_value, 1.5);
  EXPECT_EQ(q.skvq_window, 64);
  EXPECT_EQ(q.skvq_n_sink, 3);
  const CacheConfig both = config_from_spec("snapkv+skvq:budget=64:bits_key=3:skvq_n_sink=2");
  EXPECT_EQ(both.snap_budget, 64);
  EXPECT_EQ(both.skvq_bits_key, 3);
  EXPECT_EQ(both.skvq_n_sink, 2);
  const CacheConfig st = config_from_spec("streaming:window=100:n_sink=2");
  EXPECT_EQ(st.streaming_window, 100);
  EXPECT_EQ(st.streaming_n_sink, 2);
  EXPECT_EQ(config_from_spec("full").method, "full");

  struct Bad {
    const char* spec;
    const char* needle;
  };
  const Bad bad[] = {
      {"snapkv+skvq:n_sink=2", "ambiguous"},
      {"bogus:budget=1", "expected one of full, snapkv, skvq, snapkv+skvq, streaming"},
      {"budget=3", "expected the method first"},
      {"", "expected the method first"},
      {"snapkv:budget", "expected key=value"},
      {"snapkv::budget=1", "expected key=value"},
      {"snapkv:budget=0", "snap_budget: expected >= 1 but got 0"},
      {"snapkv:budget=1:budget=2", "got it twice"},
      {"snapkv:method=full", "method only before the first ':'"},
      {"full:budget=4", "unknown key 'budget'"},  // no prefix for full
      {"skvq:bits_key=3.5", "skvq_bits_key: expected an integer in 1..8 or exactly 1.5"},
  };
  for (const auto& b : bad) {
    const std::string msg = error_of([&] { config_from_spec(b.spec); });
    EXPECT_NE(msg.find(b.needle), std::string::npos) << b.spec << " -> " << msg;
  }
}

}  // namespace
}  // namespace vq
