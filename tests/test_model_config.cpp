// config.json parsing for llama / mistral / qwen2 (both transformers 4 and 5 layouts), the refusal
// of unknown or malformed configs, RoPE frequencies (plain, linear, llama3) against formulas
// written out here, and RoPE rotation in both pairings against a direct double-precision formula.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

#include "util/tiny_model.h"
#include "veloxquant/error.h"
#include "veloxquant/model.h"

namespace vq {
namespace {

// The shape-relevant fields of Llama-3.2-1B's published config.json.
const char* kLlama32Config = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "use_cache": true, "vocab_size": 128256})";

void expect_refused(const std::string& text, std::initializer_list<const char*> needles) {
  try {
    model_config_from_json(text);
    FAIL() << "expected a vq::Error for " << text;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[model_config]"), std::string::npos) << msg;
    for (const char* n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << msg << "\n  lacks: " << n;
  }
}

TEST(ModelConfig, Llama32Shapes) {
  const ModelConfig c = model_config_from_json(kLlama32Config);
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 8192);
  EXPECT_EQ(c.n_layers, 16);
  EXPECT_EQ(c.n_heads, 32);
  EXPECT_EQ(c.n_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_EQ(c.rope.scaling, RopeScaling::kLlama3);
  EXPECT_DOUBLE_EQ(c.rope.factor, 32.0);
  EXPECT_EQ(c.rope.original_max_position, 8192);
  EXPECT_EQ(c.rope.style, RopeStyle::kHalfSplit);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.bos_token_id, 128000);
  ASSERT_EQ(c.eos_token_ids.size(), 1u);
  EXPECT_EQ(c.eos_token_ids[0], 128001);
}

TEST(ModelConfig, MistralQwen2AndDefaults) {
  const ModelConfig m = model_config_from_json(R"({"model_type":"mistral","vocab_size":32000,
    "hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,
    "num_key_value_heads":8,"sliding_window":4096,"rope_theta":1000000.0,
    "eos_token_id":[2,3]})");
  EXPECT_EQ(m.head_dim, 128);  // hidden / heads when head_dim is absent
  EXPECT_EQ(m.sliding_window, 4096);
  EXPECT_EQ(m.eos_token_ids, (std::vector<int32_t>{2, 3}));
  EXPECT_DOUBLE_EQ(m.rms_norm_eps, 1e-6);
  EXPECT_FALSE(m.tie_word_embeddings);
  EXPECT_EQ(model_config_from_json(R"({"model_type":"mistral","vocab_size":8,"hidden_size":8,
    "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"sliding_window":null})")
                .sliding_window,
            0);

  const ModelConfig q = model_config_from_json(R"({"model_type":"qwen2","vocab_size":151936,
    "hidden_size":896,"intermediate_size":4864,"num_hidden_layers":24,"num_attention_heads":14,
    "num_key_value_heads":2,"tie_word_embeddings":true,"use_sliding_window":false,
    "sliding_window":32768,"max_window_layers":21})");
  EXPECT_TRUE(q.qkv_bias);
  EXPECT_FALSE(q.o_bias);
  EXPECT_EQ(q.head_dim, 64);
  EXPECT_EQ(q.sliding_window, 0);
  EXPECT_EQ(q.n_kv_heads, 2);

  // Explicit head_dim that differs from hidden / heads (e.g. Qwen3-like shapes).
  const ModelConfig h = model_config_from_json(R"({"model_type":"llama","vocab_size":10,
    "hidden_size":64,"intermediate_size":32,"num_hidden_layers":1,"num_attention_heads":4,
    "head_dim":32,"attention_bias":true,"mlp_bias":true})");
  EXPECT_EQ(h.head_dim, 32);
  EXPECT_EQ(h.n_kv_heads, 4);  // defaults to num_attention_heads
  EXPECT_TRUE(h.qkv_bias && h.o_bias && h.mlp_bias);
}

TEST(ModelConfig, Transformers5RopeParameters) {
  const ModelConfig c = model_config_from_json(R"({"model_type":"llama","vocab_size":10,
    "hidden_size":64,"intermediate_size":32,"num_hidden_layers":1,"num_attention_heads":4,
    "rope_parameters":{"rope_theta":50000.0,"rope_type":"default"}})");
  EXPECT_DOUBLE_EQ(c.rope.theta, 50000.0);
  EXPECT_EQ(c.rope.scaling, RopeScaling::kNone);
  const ModelConfig l = model_config_from_json(R"({"model_type":"llama","vocab_size":10,
    "hidden_size":64,"intermediate_size":32,"num_hidden_layers":1,"num_attention_heads":4,
    "rope_parameters":{"rope_theta":500000.0,"rope_type":"llama3","factor":8.0,
    "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}})");
  EXPECT_EQ(l.rope.scaling, RopeScaling::kLlama3);
  EXPECT_DOUBLE_EQ(l.rope.factor, 8.0);
}

TEST(ModelConfig, UnknownAndMalformedRefused) {
  expect_refused(R"({"model_type":"gpt2","vocab_size":10})",
                 {"model_type", "expected one of llama, mistral, qwen2", "\"gpt2\""});
  expect_refused(R"({"vocab_size":10})", {"model_type", "llama, mistral, qwen2"});
  expect_refused("{\"model_type\": \"llama\"", {"not valid JSON"});
  // Where and why (issue 17: the message used to be only "not valid JSON").
  expect_refused("{\"model_type\": \"llama\",\n \"vocab_size\": 10,}",
                 {"not valid JSON: parse error at line 2, column 19:",
                  "unexpected '}'; expected string literal", "(byte 43)"});
  expect_refused("{\"model_type\": \"llama\", \"rope_theta\": 1e400}",
                 {"not valid JSON: number overflow parsing '1e400'"});
  expect_refused("[]", {"expected a JSON object"});
  const std::string base = R"("model_type":"llama","vocab_size":10,"intermediate_size":32,
    "num_hidden_layers":1)";
  expect_refused("{" + base + R"(,"num_attention_heads":4})", {"hidden_size", "missing"});
  expect_refused("{" + base + R"(,"hidden_size":"64","num_attention_heads":4})",
                 {"hidden_size", "positive integer", "\"64\""});
  expect_refused("{" + base + R"(,"hidden_size":-64,"num_attention_heads":4})",
                 {"hidden_size", "-64"});
  expect_refused("{" + base + R"(,"hidden_size":2097152,"num_attention_heads":4})",
                 {"hidden_size", "<= 1048576", "2097152"});
  expect_refused(R"({"model_type":"llama","vocab_size":4294967296,"hidden_size":64,
    "intermediate_size":32,"num_hidden_layers":1,"num_attention_heads":4})",
                 {"vocab_size", "<= 2147483647"});
  expect_refused("{" + base + R"(,"hidden_size":64,"num_attention_heads":4,
    "num_key_value_heads":3})",
                 {"num_key_value_heads", "divisor of num_attention_heads (4)", "3"});
  expect_refused("{" + base + R"(,"hidden_size":66,"num_attention_heads":4})",
                 {"hidden_size", "multiple of num_attention_heads"});
  expect_refused("{" + base + R"(,"hidden_size":64,"num_attention_heads":4,"head_dim":15})",
                 {"head_dim", "even"});
  expect_refused("{" + base + R"(,"hidden_size":64,"num_attention_heads":4,
    "hidden_act":"gelu"})",
                 {"hidden_act", "silu", "gelu"});
  expect_refused("{" + base + R"(,"hidden_size":64,"num_attention_heads":4,
    "rope_scaling":{"rope_type":"yarn","factor":4.0}})",
                 {"rope_scaling.rope_type", "default, linear, llama3", "yarn"});
  expect_refused("{" + base + R"(,"hidden_size":64,"num_attention_heads":4,
    "rope_scaling":{"rope_type":"llama3","factor":8.0}})",
                 {"original_max_position_embeddings"});
  expect_refused("{" + base + R"(,"hidden_size":64,"num_attention_heads":4,"rope_theta":-1})",
                 {"rope_theta"});
  expect_refused("{" + base + R"(,"hidden_size":64,"num_attention_heads":4,
    "tie_word_embeddings":"yes"})",
                 {"tie_word_embeddings", "true or false"});
  expect_refused("{" + base + R"(,"hidden_size":64,"num_attention_heads":4,"eos_token_id":99})",
                 {"eos_token_id", "vocab_size"});
  expect_refused(R"({"model_type":"qwen2","vocab_size":10,"hidden_size":64,
    "intermediate_size":32,"num_hidden_layers":1,"num_attention_heads":4,
    "use_sliding_window":true})",
                 {"use_sliding_window"});
}

TEST(ModelConfig, TinyModelConfigRoundTrip) {
  test::TinyModelSpec spec;
  spec.explicit_head_dim = true;
  spec.head_dim = 8;
  const ModelConfig c = model_config_from_json(test::tiny_model_config_json(spec));
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.n_kv_heads, spec.n_kv_heads);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{static_cast<int32_t>(spec.vocab_size - 1)}));
}

TEST(Rope, InvFreqMatchesFormulas) {
  RopeConfig r;
  r.theta = 10000.0;
  const int64_t D = 64;
  const std::vector<float> f = rope_inv_freq(r, D);
  ASSERT_EQ(f.size(), 32u);
  for (int64_t i = 0; i < 32; ++i) {
    const double expect = std::pow(10000.0, -2.0 * static_cast<double>(i) / D);
    // fp32 rounding of the exponent (relative 2^-24 on 2i/D, times ln(theta) ~ 9.2 in the
    // power) and of the power and the reciprocal: a few ulp, so 8 * 2^-24 * 9.2 relative.
    EXPECT_NEAR(f[static_cast<size_t>(i)], expect, expect * 8 * 9.3 / 16777216.0) << i;
  }
  RopeConfig lin = r;
  lin.scaling = RopeScaling::kLinear;
  lin.factor = 4.0;
  const std::vector<float> fl = rope_inv_freq(lin, D);
  for (size_t i = 0; i < f.size(); ++i) EXPECT_FLOAT_EQ(fl[i], f[i] / 4.0f);

  // llama3: wavelengths below old_ctx / high_freq_factor kept, above old_ctx / low_freq_factor
  // divided by factor, in between interpolated (written out independently here).
  RopeConfig l3 = r;
  l3.theta = 500000.0;
  l3.scaling = RopeScaling::kLlama3;
  l3.factor = 32.0;
  l3.low_freq_factor = 1.0;
  l3.high_freq_factor = 4.0;
  l3.original_max_position = 8192;
  RopeConfig plain = l3;
  plain.scaling = RopeScaling::kNone;
  const std::vector<float> f3 = rope_inv_freq(l3, D), f0 = rope_inv_freq(plain, D);
  int kept = 0, divided = 0, mixed = 0;
  for (size_t i = 0; i < f3.size(); ++i) {
    const double wl = 2 * M_PI / f0[i];
    double expect;
    if (wl < 8192.0 / 4.0) {
      expect = f0[i];
      ++kept;
    } else if (wl > 8192.0 / 1.0) {
      expect = f0[i] / 32.0;
      ++divided;
    } else {
      const double sm = (8192.0 / wl - 1.0) / 3.0;
      expect = (1 - sm) * f0[i] / 32.0 + sm * f0[i];
      ++mixed;
    }
    EXPECT_NEAR(f3[i], expect, std::abs(expect) * 4.0 / 16777216.0) << i;  // fp32 rounding
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(mixed, 0);
}

TEST(Rope, HalfSplitMatchesDirectFormula) {
  const int64_t D = 64, n_heads = 3;
  RopeConfig r;
  const std::vector<float> inv = rope_inv_freq(r, D);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> dist(0, 1);
  for (int64_t pos : {0, 1, 7, 100, 1000, 4095}) {
    std::vector<float> x(static_cast<size_t>(n_heads * D));
    for (float& v : x) v = dist(rng);
    std::vector<float> y = x, cs(D / 2), sn(D / 2);
    rope_cos_sin(inv, pos, cs.data(), sn.data());
    apply_rope(y.data(), n_heads, D, cs.data(), sn.data(), RopeStyle::kHalfSplit);
    for (int64_t h = 0; h < n_heads; ++h)
      for (int64_t i = 0; i < D / 2; ++i) {
        const double th = static_cast<double>(pos) * std::pow(10000.0, -2.0 * i / D);
        const double a = x[h * D + i], b = x[h * D + i + D / 2];
        const double e0 = a * std::cos(th) - b * std::sin(th);
        const double e1 = b * std::cos(th) + a * std::sin(th);
        // The angle is formed in fp32 (as Hugging Face does): inv_freq carries two roundings
        // (the power and the reciprocal, 2^-24 relative each) and the product one more, so
        // |d angle| <= 3 * th * 2^-24; each output moves by at most (|a| + |b|) * d angle, plus
        // the fp32 rounding of cos/sin, the two products and the sum (4 * 2^-24 * (|a| + |b|)).
        const double tol = (std::abs(a) + std::abs(b)) * (3 * th + 4) / 16777216.0;
        EXPECT_NEAR(y[h * D + i], e0, tol) << "pos " << pos << " i " << i;
        EXPECT_NEAR(y[h * D + i + D / 2], e1, tol) << "pos " << pos << " i " << i;
      }
  }
}

TEST(Rope, InterleavedIsHalfSplitOnPermutedChannels) {
  // Metamorphic: interleaved RoPE on x equals half-split RoPE on x with channels 2i -> i and
  // 2i+1 -> i + D/2, permuted back (exactly: the same products in the same order).
  const int64_t D = 32;
  const std::vector<float> inv = rope_inv_freq(RopeConfig{}, D);
  std::vector<float> cs(D / 2), sn(D / 2);
  rope_cos_sin(inv, 37, cs.data(), sn.data());
  std::mt19937_64 rng(9);
  std::normal_distribution<float> dist(0, 1);
  std::vector<float> x(D), p(D);
  for (float& v : x) v = dist(rng);
  for (int64_t i = 0; i < D / 2; ++i) {
    p[i] = x[2 * i];
    p[i + D / 2] = x[2 * i + 1];
  }
  apply_rope(x.data(), 1, D, cs.data(), sn.data(), RopeStyle::kInterleaved);
  apply_rope(p.data(), 1, D, cs.data(), sn.data(), RopeStyle::kHalfSplit);
  for (int64_t i = 0; i < D / 2; ++i) {
    EXPECT_EQ(x[2 * i], p[i]);
    EXPECT_EQ(x[2 * i + 1], p[i + D / 2]);
  }
  // And position 0 is the identity.
  std::vector<float> c0(D / 2), s0(D / 2), z = p;
  rope_cos_sin(inv, 0, c0.data(), s0.data());
  apply_rope(z.data(), 1, D, c0.data(), s0.data(), RopeStyle::kHalfSplit);
  EXPECT_EQ(z, p);
}

}  // namespace
}  // namespace vq
