// Tests of CacheConfig (veloxquant/cache_config.h): every field's bad values are refused with a
// message naming the field and the value, the boundaries are accepted, and the three sources
// (set_field, JSON, compact spec) parse, refuse unknown keys and wrong types, and round-trip.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

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
      {"snap_scoring", "3", [](CacheConfig& c) { c.snap_scoring = static_cast<SnapScoring>(3); }},
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
      {"skvq_value_clip_floor", "0.2", [](CacheConfig& c) { c.skvq_value_clip_floor = 0.2; }},
      {"skvq_value_clip_floor", "0.9", [](CacheConfig& c) { c.skvq_value_clip_floor = 0.9; }},
      {"skvq_value_clip_floor", "nan", [nan](CacheConfig& c) { c.skvq_value_clip_floor = nan; }},
      {"skvq_value_clip_floor", "0.1",  // checked even when the search is off
       [](CacheConfig& c) {
         c.skvq_clip_search = false;
         c.skvq_value_clip_floor = 0.1;
       }},
      {"skvq_max_ctx", "-1", [](CacheConfig& c) { c.skvq_max_ctx = -1; }},
      {"skvq_meta", "3", [](CacheConfig& c) { c.skvq_meta = static_cast<MetaType>(3); }},
      {"skvq_recent", "-4", [](CacheConfig& c) { c.skvq_recent = -4; }},
      {"skvq_rotation", "5", [](CacheConfig& c) { c.skvq_rotation = static_cast<Rotation>(5); }},
      {"skvq_protect", "1", [](CacheConfig& c) { c.skvq_protect = 1; }},
      {"skvq_protect", "-0.01", [](CacheConfig& c) { c.skvq_protect = -0.01; }},
      {"skvq_protect", "nan", [nan](CacheConfig& c) { c.skvq_protect = nan; }},
      {"skvq_protect_scoring", "3",
       [](CacheConfig& c) { c.skvq_protect_scoring = static_cast<SnapScoring>(3); }},
      {"skvq_protect_obs_window", "0", [](CacheConfig& c) { c.skvq_protect_obs_window = 0; }},
      {"skvq_protect_pool_kernel", "4", [](CacheConfig& c) { c.skvq_protect_pool_kernel = 4; }},
      {"skvq_protect", "0.01",  // protected rows are the skvq cache's
       [](CacheConfig& c) {
         c.method = "snapkv+skvq";
         c.skvq_protect = 0.01;
       }},
      {"streaming_n_sink", "-1", [](CacheConfig& c) { c.streaming_n_sink = -1; }},
      {"streaming_window", "0", [](CacheConfig& c) { c.streaming_window = 0; }},
      // Per-layer lists: each entry as its single field, by its index.
      {"skvq_layer_bits_key entry 1", "2.5",
       [](CacheConfig& c) { c.skvq_layer_bits_key = "2/2.5/3"; }},
      {"skvq_layer_bits_key entry 0", "'x'", [](CacheConfig& c) { c.skvq_layer_bits_key = "x/2"; }},
      {"per-layer list '2//3'", "an empty entry 1",
       [](CacheConfig& c) { c.skvq_layer_bits_key = "2//3"; }},
      {"per-layer list '2/'", "an empty entry 1",
       [](CacheConfig& c) { c.skvq_layer_bits_key = "2/"; }},
      {"skvq_layer_key_rows entry 2", "124",
       [](CacheConfig& c) {
         c.skvq_key_axis = QuantAxis::kChannel;
         c.skvq_layer_key_rows = "32/0/124";  // chunk 0 holds 128 - 5 rows
       }},
      {"skvq_layer_key_rows entry 0", "32",  // token-axis keys have no runs
       [](CacheConfig& c) { c.skvq_layer_key_rows = "32/32"; }},
      {"skvq_layer_bits_value entry 2", "9",
       [](CacheConfig& c) { c.skvq_layer_bits_value = "2/3/9"; }},
      {"per-layer list '/2'", "an empty entry 0",
       [](CacheConfig& c) { c.skvq_layer_bits_value = "/2"; }},
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

TEST(CacheConfig, PerLayerKeyListsGiveEachLayerItsEntry) {
  CacheConfig c = parse_cache_arg(
      "skvq:bits_key=2:key_axis=channel:key_rows=32:layer_bits_key=3/2/1.5:layer_key_rows=16/64/0");
  EXPECT_EQ(c.skvq_layer_bits_key, "3/2/1.5");
  const double bits[] = {3, 2, 1.5};
  const int64_t rows[] = {16, 64, 0};
  for (int64_t l = 0; l < 3; ++l) {
    EXPECT_EQ(skvq_key_bits_of(c, l), bits[l]) << l;
    EXPECT_EQ(skvq_key_rows_of(c, l), rows[l]) << l;
  }
  EXPECT_EQ(skvq_layer_list_size(c.skvq_layer_bits_key), 3);
  EXPECT_EQ(skvq_layer_list_size(""), 0);
  // A layer past the list is refused, naming the list.
  const std::string msg = error_of([&] { (void)skvq_key_bits_of(c, 3); });
  EXPECT_EQ(msg,
            "[cache_config] skvq_layer_bits_key: expected an entry for layer 3 but got 3 entries "
            "('3/2/1.5')");
  // Empty lists: every layer takes the single fields.
  c.skvq_layer_bits_key.clear();
  c.skvq_layer_key_rows.clear();
  EXPECT_EQ(skvq_key_bits_of(c, 7), 2.0);
  EXPECT_EQ(skvq_key_rows_of(c, 7), 32);
  // Only SKVQ methods read the lists.
  EXPECT_NE(
      error_of([] { (void)parse_cache_arg("snapkv:layer_bits_key=2"); }).find("layer_bits_key"),
      std::string::npos);
}

TEST(CacheConfig, PerLayerValueBitsGiveEachLayerItsEntry) {
  CacheConfig c = parse_cache_arg("skvq:bits_value=2:layer_bits_value=3/2/4:layer_bits_key=2/4/2");
  EXPECT_EQ(c.skvq_layer_bits_value, "3/2/4");
  const double vbits[] = {3, 2, 4}, kbits[] = {2, 4, 2};
  for (int64_t l = 0; l < 3; ++l) {
    EXPECT_EQ(skvq_value_bits_of(c, l), vbits[l]) << l;
    EXPECT_EQ(skvq_key_bits_of(c, l), kbits[l]) << l;  // the two lists are independent
  }
  EXPECT_EQ(error_of([&] { (void)skvq_value_bits_of(c, 3); }),
            "[cache_config] skvq_layer_bits_value: expected an entry for layer 3 but got 3 "
            "entries ('3/2/4')");
  c.skvq_layer_bits_value.clear();
  EXPECT_EQ(skvq_value_bits_of(c, 9), 2.0);
  EXPECT_NE(
      error_of([] { (void)parse_cache_arg("snapkv:layer_bits_value=2"); }).find("layer_bits_value"),
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

// Text settings go into JSON: bytes that are not UTF-8 are refused by name (the fuzzer's
// crash-592ee7ce: a method name ending in byte 0xE3 made config_to_json throw nlohmann's
// type_error instead), nothing stored changes, and UTF-8 text of any plane round-trips.
TEST(CacheConfig, TextSettingsMustBeUtf8) {
  CacheConfig c;
  const std::string before = config_to_json(c);
  for (const std::string& bad :
       {std::string("12ab\xE3"), std::string("\xFF"),
        std::string("a\xC0\xAF"
                    "b"),
        std::string("\xED\xA0\x80"), std::string("\xF4\x90\x80\x80"), std::string("ok\x80")}) {
    for (const char* key : {"method", "skvq_query_moments_file", "skvq_perm_file"}) {
      const std::string e = error_of([&] { set_field(c, key, bad); });
      EXPECT_NE(e.find(std::string("[cache_config] ") + key + ": expected UTF-8 text"),
                std::string::npos)
          << e;
      EXPECT_NE(e.find("not UTF-8 at byte"), std::string::npos) << e;
    }
  }
  EXPECT_NE(error_of([&] { set_field(c, "method", "12ab\xE3"); }).find("'12ab\\xE3'"),
            std::string::npos);
  EXPECT_EQ(config_to_json(c), before);  // nothing changed by any refusal
  // a config assigned member by member is refused by validate, with the same message
  CacheConfig direct;
  direct.method = "skvq";
  direct.skvq_perm_file = std::string("perm\xE9.bin");
  EXPECT_NE(error_of([&] { validate(direct); })
                .find("[cache_config] skvq_perm_file: expected UTF-8 text (settings are written "
                      "as JSON) but got 'perm\\xE9.bin', not UTF-8 at byte 4"),
            std::string::npos)
      << error_of([&] { validate(direct); });
  const std::string text =
      "caf\xC3\xA9/\xE6\x97\xA5\xF0\x9F\x98\x80"
      ".bin";  // é, 日, an emoji
  set_field(c, "skvq_query_moments_file", text);
  EXPECT_EQ(c.skvq_query_moments_file, text);
  c.method = "skvq";
  set_field(c, "skvq_key_axis", "channel");  // where the moments file is read
  EXPECT_EQ(config_from_json(config_to_json(c)).skvq_query_moments_file, text);
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
  c.skvq_value_clip_floor = 0.3;
  c.skvq_max_ctx = 4096;
  c.skvq_meta = MetaType::kF32;
  c.skvq_recent = 32;
  c.skvq_rotation = Rotation::kHadamard;
  c.skvq_rotate_values = true;
  c.skvq_rotation_seed = 0xfedcba9876543210ull;
  c.skvq_perm_file = "p.bin";
  c.skvq_key_axis = QuantAxis::kChannel;
  c.skvq_key_rows = 24;
  c.skvq_layer_bits_key = "3/2/1.5";
  c.skvq_layer_key_rows = "8/0/61";
  c.skvq_layer_bits_value = "4/2/3";
  c.skvq_query_moments_file = "moments.bin";
  c.skvq_protect_scoring = SnapScoring::kExternal;
  c.skvq_protect_obs_window = 9;
  c.skvq_protect_pool_kernel = 5;
  c.skvq_protect_values = false;
  c.streaming_n_sink = 1;
  c.streaming_window = 77;
  const std::string text = config_to_json(c);
  const CacheConfig back = config_from_json(text);
  EXPECT_EQ(config_to_json(back), text);
  EXPECT_EQ(back.skvq_rotation_seed, 0xfedcba9876543210ull);
  EXPECT_EQ(back.skvq_clip_alpha, 0.9);
  EXPECT_EQ(back.skvq_value_clip_floor, 0.3);
  EXPECT_EQ(parse_cache_arg("skvq:value_clip_floor=0.5").skvq_value_clip_floor, 0.5);
  CacheConfig st;
  st.method = "streaming";
  st.head_dim = 64;
  st.streaming_n_sink = 1;
  st.streaming_window = 77;
  const std::string st_text = config_to_json(st);
  EXPECT_EQ(config_to_json(config_from_json(st_text)), st_text);
  // Decode-time eviction: snapkv's alone.
  CacheConfig sn;
  sn.method = "snapkv";
  sn.snap_decode_budget = 100;
  sn.snap_decode_every = 7;
  const std::string sn_text = config_to_json(sn);
  EXPECT_EQ(config_to_json(config_from_json(sn_text)), sn_text);
  // Protected rows: skvq's alone (snapkv+skvq refuses a fraction).
  CacheConfig sk;
  sk.method = "skvq";
  sk.skvq_protect = 0.0125;
  const std::string sk_text = config_to_json(sk);
  EXPECT_EQ(config_to_json(config_from_json(sk_text)), sk_text);
  EXPECT_EQ(config_from_json(sk_text).skvq_protect, 0.0125);
  // A config's JSON holds the method, head_dim and the method's own fields (issue 17: no other
  // method's settings); over snapkv+skvq and streaming every field appears and differs from its
  // default (so the round trips cover it).
  EXPECT_EQ(nlohmann::json::parse(config_to_json(CacheConfig{})).size(), 2u);  // full
  CacheConfig dflt;
  dflt.method = "snapkv+skvq";
  const auto d_both = nlohmann::json::parse(config_to_json(dflt));
  dflt.method = "streaming";
  const auto d_st = nlohmann::json::parse(config_to_json(dflt));
  dflt.method = "snapkv";
  const auto d_sn = nlohmann::json::parse(config_to_json(dflt));
  std::set<std::string> keys;
  for (const auto& [t, d] :
       {std::pair{text, d_both}, std::pair{st_text, d_st}, std::pair{sn_text, d_sn}}) {
    const auto j = nlohmann::json::parse(t);
    for (const auto& [k, v] : j.items()) {
      keys.insert(k);
      if (k != "method" && (t != sn_text || k.rfind("snap_decode_", 0) == 0) &&
          !(t == text && k == "skvq_protect")) {
        EXPECT_NE(v, d.at(k)) << k;
      }
    }
  }
  EXPECT_EQ(keys.size(), 42u);
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

// ---- issue 17: bounded integer fields, one parser, clear messages ---------------------------

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

TEST(CacheConfig, EveryIntegerFieldHasAnUpperBound) {
  // Positions fit int32: every row-count field stops at kMaxCacheRows; head_dim and the group
  // size at kMaxCacheHeadDim. Above the cap is refused naming the field and the cap; at the cap
  // is accepted.
  struct Case {
    const char* field;
    int64_t CacheConfig::*m;
    int64_t cap;
  };
  const Case cases[] = {
      {"head_dim", &CacheConfig::head_dim, kMaxCacheHeadDim},
      {"snap_budget", &CacheConfig::snap_budget, kMaxCacheRows},
      {"snap_obs_window", &CacheConfig::snap_obs_window, kMaxCacheRows},
      {"snap_n_sink", &CacheConfig::snap_n_sink, kMaxCacheRows},
      {"snap_pool_kernel", &CacheConfig::snap_pool_kernel, kMaxCacheRows},  // odd
      {"skvq_group_size", &CacheConfig::skvq_group_size, kMaxCacheHeadDim},
      {"skvq_window", &CacheConfig::skvq_window, kMaxCacheRows},
      {"skvq_max_ctx", &CacheConfig::skvq_max_ctx, kMaxCacheRows},
      {"skvq_recent", &CacheConfig::skvq_recent, kMaxCacheRows},
      {"skvq_protect_obs_window", &CacheConfig::skvq_protect_obs_window, kMaxCacheRows},
      {"skvq_protect_pool_kernel", &CacheConfig::skvq_protect_pool_kernel, kMaxCacheRows},  // odd
      {"streaming_n_sink", &CacheConfig::streaming_n_sink, kMaxCacheRows},
      {"streaming_window", &CacheConfig::streaming_window, kMaxCacheRows},
  };
  for (const auto& k : cases) {
    CacheConfig ok;
    ok.*k.m = k.cap;
    EXPECT_NO_THROW(validate(ok)) << k.field;
    for (const int64_t bad : {k.cap + 2, int64_t{4611686018427387904}, kI64Max}) {
      CacheConfig c;
      c.*k.m = bad;
      const std::string f = k.field;
      if ((f == "snap_pool_kernel" || f == "skvq_protect_pool_kernel") && bad % 2 == 0)
        c.*k.m = bad - 1;  // odd
      const std::string msg = error_of([&] { validate(c); });
      EXPECT_EQ(msg.rfind(std::string("[cache_config] ") + k.field +
                              ": expected <= " + std::to_string(k.cap),
                          0),
                0u)
          << msg;
      EXPECT_NE(msg.find("but got " + std::to_string(c.*k.m)), std::string::npos) << msg;
    }
  }
}

// The values of the issue's crashes, through each source (--cache-opt, spec, JSON): refused
// before a cache exists.
TEST(CacheConfig, OverflowingValuesOfTheIssueAreRefusedFromEverySource) {
  struct Case {
    const char* method;
    const char* option;  // short key
    const char* field;
    const char* value;
  };
  const Case cases[] = {
      {"snapkv+skvq", "recent", "skvq_recent", "9223372036854775807"},     // SIGSEGV past the tail
      {"skvq", "recent", "skvq_recent", "9223372036854775807"},            // flush loop forever
      {"streaming", "window", "streaming_window", "4611686018427387904"},  // heap corruption
      {"streaming", "window", "streaming_window", "9223372036854775807"},  // steady_capacity UB
      {"skvq", "window", "skvq_window", "9223372036854775807"},
      {"skvq", "max_ctx", "skvq_max_ctx", "9223372036854775807"},
      {"snapkv", "budget", "snap_budget", "9223372036854775807"},
      {"streaming", "n_sink", "streaming_n_sink", "4611686018427387904"},
  };
  for (const auto& k : cases) {
    const std::string want = std::string("[cache_config] ") + k.field + ": expected <= ";
    CacheConfig c = parse_cache_arg(k.method);
    const std::string before = config_to_json(c);
    apply_cache_option(c, std::string(k.option) + "=" + k.value);
    std::string msg = error_of([&] { check_cache_config(c); });
    EXPECT_EQ(msg.rfind(want, 0), 0u) << k.method << " " << k.option << ": " << msg;
    msg =
        error_of([&] { parse_cache_arg(std::string(k.method) + ":" + k.option + "=" + k.value); });
    EXPECT_EQ(msg.rfind(want, 0), 0u) << msg;
    msg = error_of([&] {
      config_from_json(std::string(R"({"method": ")") + k.method + R"(", ")" + k.field +
                       "\": " + k.value + "}");
    });
    EXPECT_EQ(msg.rfind(want, 0), 0u) << msg;
    msg = error_of([&] {  // a method-less file (the method comes from --cache)
      config_from_json(std::string("{\"") + k.field + "\": " + k.value + "}");
    });
    EXPECT_EQ(msg.rfind(want, 0), 0u) << msg;
    EXPECT_EQ(config_to_json(parse_cache_arg(k.method)), before);
  }
}

TEST(CacheConfig, CacheArgTakesAMethodOrACompactSpec) {
  // `--cache skvq:bits_key=3` (the README's compact spec) was refused as an unknown method.
  CacheConfig c = parse_cache_arg("skvq:bits_key=3");
  EXPECT_EQ(c.method, "skvq");
  EXPECT_EQ(c.skvq_bits_key, 3.0);
  EXPECT_EQ(parse_cache_arg("snapkv").method, "snapkv");
  // On top of a config from a file: the spec's assignments win, the rest stays.
  CacheConfig f = config_from_json(R"({"skvq_window": 64, "skvq_bits_value": 4})");
  apply_cache_arg(f, "skvq:bits_key=3");
  EXPECT_EQ(f.method, "skvq");
  EXPECT_EQ(f.skvq_window, 64);
  EXPECT_EQ(f.skvq_bits_value, 4.0);
  EXPECT_EQ(f.skvq_bits_key, 3.0);
  check_cache_config(f);
  // A refused spec leaves the config as it was.
  const std::string before = config_to_json(f);
  EXPECT_THROW(apply_cache_arg(f, "snapkv:budget=8:bogus=1"), Error);
  EXPECT_THROW(apply_cache_arg(f, "h2o"), Error);
  EXPECT_EQ(config_to_json(f), before);
}

TEST(CacheConfig, OptionsFollowTheSpecsKeyRule) {
  CacheConfig both = parse_cache_arg("snapkv+skvq");
  // `n_sink` is ambiguous for snapkv+skvq in an option as in a spec (it set SnapKV's silently).
  for (const std::string& msg :
       {error_of([&] { apply_cache_option(both, "n_sink=2"); }),
        error_of([&] { parse_cache_arg("snapkv+skvq:n_sink=2"); }),
        error_of([&] { config_from_json(R"({"method": "snapkv+skvq", "n_sink": 2})"); })}) {
    EXPECT_NE(msg.find("key 'n_sink' is ambiguous for method snapkv+skvq"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("snap_n_sink, skvq_n_sink"), std::string::npos) << msg;
  }
  EXPECT_EQ(both.snap_n_sink, 4);
  EXPECT_EQ(both.skvq_n_sink, 5);
  apply_cache_option(both, "snap_n_sink=2");
  apply_cache_option(both, "skvq-n-sink=3");
  apply_cache_option(both, "budget=64");
  apply_cache_option(both, "bits_key=4");
  apply_cache_option(both, "head_dim=64");
  EXPECT_EQ(both.snap_n_sink, 2);
  EXPECT_EQ(both.skvq_n_sink, 3);
  EXPECT_EQ(both.snap_budget, 64);
  EXPECT_EQ(both.skvq_bits_key, 4.0);
  EXPECT_EQ(both.head_dim, 64);
  check_cache_config(both);

  // Another method's field, full or short name, is refused naming the key, the method and the
  // keys it allows (it was accepted silently).
  CacheConfig full = parse_cache_arg("full");
  const std::string before = config_to_json(full);
  std::string msg = error_of([&] { apply_cache_option(full, "snap_budget=64"); });
  EXPECT_EQ(msg,
            "[cache_config] key 'snap_budget': expected a key of method full (head_dim) but got a "
            "field of snapkv, snapkv+skvq");
  msg = error_of([&] { apply_cache_option(full, "budget=64"); });
  EXPECT_NE(msg.find("unknown key 'budget' for method full"), std::string::npos) << msg;
  EXPECT_NE(msg.find("snap_budget of snapkv, snapkv+skvq"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected one of head_dim"), std::string::npos) << msg;
  EXPECT_EQ(config_to_json(full), before);
  CacheConfig st = parse_cache_arg("streaming");
  msg = error_of([&] { apply_cache_option(st, "skvq_bits_key=4"); });
  EXPECT_NE(msg.find("expected a key of method streaming (head_dim, streaming_n_sink, "
                     "streaming_window (or without the prefix streaming_))"),
            std::string::npos)
      << msg;
  msg = error_of([&] { parse_cache_arg("skvq:snap_budget=3"); });
  EXPECT_NE(msg.find("key 'snap_budget': expected a key of method skvq"), std::string::npos);
  msg = error_of([&] { config_from_json(R"({"method": "full", "snap_budget": 64})"); });
  EXPECT_NE(msg.find("key 'snap_budget': expected a key of method full"), std::string::npos);
  msg = error_of([&] { apply_cache_option(st, "windw=3"); });
  EXPECT_NE(msg.find("unknown key 'windw' for method streaming (did you mean: streaming_window?)"),
            std::string::npos)
      << msg;
  EXPECT_THROW(apply_cache_option(st, "method=skvq"), Error);  // the method comes from --cache
  EXPECT_THROW(apply_cache_option(st, "window"), Error);       // not key=value

  // A method-less file then a --cache of another method: the file's fields that the method does
  // not read are refused when the config is complete.
  CacheConfig f = config_from_json(R"({"snap_budget": 64})");
  apply_cache_arg(f, "skvq");
  msg = error_of([&] { check_cache_config(f); });
  EXPECT_EQ(msg.rfind("[cache_config] snap_budget: expected no setting with method skvq", 0), 0u)
      << msg;
  EXPECT_NE(msg.find("but got 64"), std::string::npos) << msg;
  // A file with a method whose config --cache switches: the same rule.
  CacheConfig g = config_from_json(R"({"method": "streaming", "window": 100})");
  EXPECT_EQ(g.streaming_window, 100);  // short keys in JSON with a method
  apply_cache_arg(g, "snapkv");
  EXPECT_THROW(check_cache_config(g), Error);
}

TEST(CacheConfig, SinksMustLeaveRoomInTheSnapBudget) {
  // snap_n_sink=10 with snap_budget=2 kept no scored row, silently.
  for (const char* method : {"snapkv", "snapkv+skvq"}) {
    CacheConfig c = parse_cache_arg(method);
    apply_cache_option(c, "snap_n_sink=10");
    apply_cache_option(c, "snap_budget=2");  // options apply in any order; the check is at the end
    const std::string msg = error_of([&] { check_cache_config(c); });
    EXPECT_EQ(msg.rfind("[cache_config] snap_n_sink: expected < snap_budget (2", 0), 0u) << msg;
    EXPECT_NE(msg.find("but got 10"), std::string::npos) << msg;
    apply_cache_option(c, "snap_n_sink=1");
    EXPECT_NO_THROW(check_cache_config(c));
    EXPECT_THROW(parse_cache_arg(std::string(method) + ":snap_budget=4"), Error);  // 4 sinks
    EXPECT_NO_THROW(parse_cache_arg(std::string(method) + ":snap_budget=5"));
  }
  // Not a rule of methods without SnapKV, nor of validate() (the caches accept it from code).
  EXPECT_NO_THROW(parse_cache_arg("full"));
  CacheConfig code;
  code.method = "snapkv";
  code.snap_budget = 1;
  EXPECT_NO_THROW(validate(code));
}

TEST(CacheConfig, BadValueUnderAShortKeyNamesTheFieldAndWhatIsAllowed) {
  // These were reported as "unknown key".
  struct Case {
    const char* method;
    const char* option;
    const char* needle;
  };
  const Case cases[] = {
      {"skvq", "bits_key=four",
       "[cache_config] skvq_bits_key: expected a finite number but got 'four' (key 'bits_key'); "
       "allowed: an integer in 1..8 or 1.5"},
      {"snapkv", "budget=12abc",
       "[cache_config] snap_budget: expected an integer but got '12abc' (key 'budget'); allowed: "
       "1..2147483647"},
      {"skvq", "meta=int4",
       "[cache_config] skvq_meta: expected one of float16, float32, fp8_e4m3 but got 'int4' (key "
       "'meta')"},
      {"snapkv+skvq", "window=-", "skvq_window: expected an integer but got '-'"},
      {"streaming", "window=", "streaming_window: expected an integer but got ''"},
      {"snapkv", "keep_window=maybe", "snap_keep_window: expected a bool"},
  };
  for (const auto& k : cases) {
    CacheConfig c = parse_cache_arg(k.method);
    const std::string before = config_to_json(c);
    const std::string msg = error_of([&] { apply_cache_option(c, k.option); });
    EXPECT_NE(msg.find(k.needle), std::string::npos) << k.option << " -> " << msg;
    EXPECT_EQ(msg.find("unknown key"), std::string::npos) << msg;
    EXPECT_EQ(config_to_json(c), before);
    const std::string spec_msg =
        error_of([&] { parse_cache_arg(std::string(k.method) + ":" + k.option); });
    EXPECT_NE(spec_msg.find(k.needle), std::string::npos) << spec_msg;
  }
}

TEST(CacheConfig, EnumNamesForMessages) {
  EXPECT_EQ(cache_enum_name("skvq_meta", 2), "fp8_e4m3");
  EXPECT_EQ(cache_enum_name("snap_pool", 1), "avg");
  EXPECT_EQ(cache_enum_name("snap_evict_at", 7), "code 7");
  EXPECT_THROW(cache_enum_name("snap_budget", 0), Error);
  EXPECT_EQ(cache_method_fields("full"), std::vector<std::string>{});
  EXPECT_EQ(cache_method_fields("streaming"),
            (std::vector<std::string>{"streaming_n_sink", "streaming_window"}));
  EXPECT_EQ(cache_method_fields("snapkv+skvq").size(), 36u);
  EXPECT_EQ(cache_method_fields("skvq").size(), 27u);
  EXPECT_EQ(cache_enum_name("skvq_key_axis", 1), "channel");
}

}  // namespace
}  // namespace vq
