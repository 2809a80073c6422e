// config.json for the Llama family (llama, mistral, qwen2) -> ModelConfig, and RoPE frequencies.
//
// Field names and defaults follow Hugging Face transformers' LlamaConfig / MistralConfig /
// Qwen2Config. Rope parameters are read from the top level (rope_theta, rope_scaling: transformers
// 4.x) or from "rope_parameters" (transformers 5.x). Every error names the field and what was
// expected: "[model_config] config.json: num_attention_heads: expected a positive integer but
// got "x"".
#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/json_text.h"
#include "veloxquant/error.h"
#include "veloxquant/model.h"

namespace vq {

namespace {

using json = nlohmann::json;

struct Reader {
  const json& root;
  std::string origin;

  [[noreturn]] void fail(const std::string& field, const std::string& msg) const {
    throw Error("[model_config] " + origin + ": " + field + ": " + msg);
  }
  static std::string shown(const json& v) {
    std::string s = v.dump();
    if (s.size() > 60) s = s.substr(0, 57) + "...";
    return s;
  }
  bool has(const json& obj, const std::string& key) const {
    return obj.contains(key) && !obj[key].is_null();
  }
  // Sizes are capped far above any real model (2^31 for vocab and positions, 2^20 for widths,
  // 2^16 for layers and heads) so nothing downstream allocates from a hostile config.
  int64_t positive_int(const json& obj, const std::string& key, const std::string& field,
                       int64_t max = int64_t{1} << 31) const {
    if (!has(obj, key)) fail(field, "expected a positive integer but it is missing");
    const json& v = obj[key];
    if (!v.is_number_integer() || v.get<int64_t>() <= 0)
      fail(field, "expected a positive integer but got " + shown(v));
    if (v.get<int64_t>() > max)
      fail(field, "expected a positive integer <= " + std::to_string(max) + " but got " + shown(v));
    return v.get<int64_t>();
  }
  int64_t positive_int_or(const json& obj, const std::string& key, int64_t dflt,
                          int64_t max = int64_t{1} << 31) const {
    return has(obj, key) ? positive_int(obj, key, key, max) : dflt;
  }
  double number_or(const json& obj, const std::string& key, double dflt, const std::string& field,
                   bool positive = true) const {
    if (!has(obj, key)) return dflt;
    const json& v = obj[key];
    if (!v.is_number()) fail(field, "expected a number but got " + shown(v));
    const double x = v.get<double>();
    if (!std::isfinite(x) || (positive && x <= 0))
      fail(field, std::string("expected a finite ") + (positive ? "positive " : "") +
                      "number but got " + shown(v));
    return x;
  }
  bool bool_or(const json& obj, const std::string& key, bool dflt) const {
    if (!has(obj, key)) return dflt;
    if (!obj[key].is_boolean()) fail(key, "expected true or false but got " + shown(obj[key]));
    return obj[key].get<bool>();
  }
  std::vector<int32_t> token_ids(const std::string& key) const {
    std::vector<int32_t> out;
    if (!has(root, key)) return out;
    const json& v = root[key];
    auto one = [&](const json& x) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX)
        fail(key, "expected a token id (non-negative integer) but got " + shown(x));
      out.push_back(static_cast<int32_t>(x.get<int64_t>()));
    };
    if (v.is_array()) {
      for (const json& x : v) one(x);
    } else {
      one(v);
    }
    return out;
  }
};

void parse_rope(const Reader& r, const json& src, const std::string& prefix, RopeConfig* rope) {
  // src holds rope_type/type and the scaling fields (rope_scaling or rope_parameters).
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (r.has(src, key)) {
      if (!src[key].is_string())
        r.fail(prefix + key, "expected a string but got " + Reader::shown(src[key]));
      type = src[key].get<std::string>();
      break;
    }
  }
  if (type == "default") {
    rope->scaling = RopeScaling::kNone;
  } else if (type == "linear") {
    rope->scaling = RopeScaling::kLinear;
    rope->factor = r.number_or(src, "factor", 0.0, prefix + "factor");
    if (rope->factor <= 0) r.fail(prefix + "factor", "expected a positive number for linear");
  } else if (type == "llama3") {
    rope->scaling = RopeScaling::kLlama3;
    if (!r.has(src, "factor")) r.fail(prefix + "factor", "expected a number for llama3 scaling");
    rope->factor = r.number_or(src, "factor", 1.0, prefix + "factor");
    rope->low_freq_factor = r.number_or(src, "low_freq_factor", 1.0, prefix + "low_freq_factor");
    rope->high_freq_factor = r.number_or(src, "high_freq_factor", 4.0, prefix + "high_freq_factor");
    if (!(rope->high_freq_factor > rope->low_freq_factor))
      r.fail(prefix + "high_freq_factor", "expected > low_freq_factor (" +
                                              std::to_string(rope->low_freq_factor) + ") but got " +
                                              std::to_string(rope->high_freq_factor));
    if (!r.has(src, "original_max_position_embeddings"))
      r.fail(prefix + "original_max_position_embeddings",
             "expected a positive integer for llama3 scaling but it is missing");
    rope->original_max_position = r.positive_int(src, "original_max_position_embeddings",
                                                 prefix + "original_max_position_embeddings");
  } else {
    r.fail(prefix + "rope_type",
           "expected one of default, linear, llama3 but got \"" + type + "\"");
  }
}

}  // namespace

const std::vector<std::string>& supported_model_types() {
  static const std::vector<std::string> kTypes = {"llama", "mistral", "qwen2"};
  return kTypes;
}

ModelConfig model_config_from_json(const std::string& text, const std::string& origin) {
  // Nesting is bounded by the parser's own iteration (nlohmann parses iteratively); a config is
  // small, so no size cap beyond the caller's file read.
  const json root = detail::parse_json_text(
      text.data(), text.data() + text.size(),
      [&](const std::string& m) { throw Error("[model_config] " + origin + ": " + m); });
  if (!root.is_object())
    throw Error("[model_config] " + origin + ": expected a JSON object but got " +
                std::string(root.type_name()));
  const Reader r{root, origin};
  ModelConfig c;

  std::string supported;
  for (const auto& t : supported_model_types()) supported += (supported.empty() ? "" : ", ") + t;
  if (!r.has(root, "model_type") || !root["model_type"].is_string())
    r.fail("model_type", "expected one of " + supported + " but got " +
                             (r.has(root, "model_type") ? Reader::shown(root["model_type"])
                                                        : std::string("nothing")));
  c.model_type = root["model_type"].get<std::string>();
  bool known = false;
  for (const auto& t : supported_model_types()) known = known || t == c.model_type;
  if (!known)
    r.fail("model_type", "expected one of " + supported + " but got \"" + c.model_type + "\"");

  c.vocab_size = r.positive_int(root, "vocab_size", "vocab_size", INT32_MAX);
  constexpr int64_t kWidth = int64_t{1} << 20, kCount = int64_t{1} << 16;
  c.hidden_size = r.positive_int(root, "hidden_size", "hidden_size", kWidth);
  c.intermediate_size = r.positive_int(root, "intermediate_size", "intermediate_size", kWidth);
  c.n_layers = r.positive_int(root, "num_hidden_layers", "num_hidden_layers", kCount);
  c.n_heads = r.positive_int(root, "num_attention_heads", "num_attention_heads", kCount);
  c.n_kv_heads = r.positive_int_or(root, "num_key_value_heads", c.n_heads, kCount);
  if (c.n_heads % c.n_kv_heads != 0)
    r.fail("num_key_value_heads", "expected a divisor of num_attention_heads (" +
                                      std::to_string(c.n_heads) + ") but got " +
                                      std::to_string(c.n_kv_heads));
  if (r.has(root, "head_dim")) {
    c.head_dim = r.positive_int(root, "head_dim", "head_dim", kWidth);
  } else {
    if (c.hidden_size % c.n_heads != 0)
      r.fail("hidden_size", "expected a multiple of num_attention_heads (" +
                                std::to_string(c.n_heads) + ") when head_dim is absent but got " +
                                std::to_string(c.hidden_size));
    c.head_dim = c.hidden_size / c.n_heads;
  }
  if (c.head_dim % 2 != 0)
    r.fail("head_dim",
           "expected an even number (RoPE rotates pairs) but got " + std::to_string(c.head_dim));

  c.rms_norm_eps = r.number_or(root, "rms_norm_eps", 1e-6, "rms_norm_eps");
  c.max_position_embeddings = r.positive_int_or(root, "max_position_embeddings", 0);

  const std::string act = r.has(root, "hidden_act") && root["hidden_act"].is_string()
                              ? root["hidden_act"].get<std::string>()
                              : (r.has(root, "hidden_act") ? std::string("?") : "silu");
  if (act != "silu")
    r.fail("hidden_act", "expected \"silu\" (SwiGLU MLP) but got " +
                             Reader::shown(root.value("hidden_act", json())));

  // RoPE: transformers 5 nests everything in rope_parameters; 4.x has rope_theta + rope_scaling.
  if (r.has(root, "rope_parameters")) {
    const json& rp = root["rope_parameters"];
    if (!rp.is_object())
      r.fail("rope_parameters", "expected an object but got " + Reader::shown(rp));
    c.rope.theta =
        r.number_or(rp, "rope_theta", r.number_or(root, "rope_theta", 10000.0, "rope_theta"),
                    "rope_parameters.rope_theta");
    parse_rope(r, rp, "rope_parameters.", &c.rope);
  } else {
    c.rope.theta = r.number_or(root, "rope_theta", 10000.0, "rope_theta");
    if (r.has(root, "rope_scaling")) {
      if (!root["rope_scaling"].is_object())
        r.fail("rope_scaling",
               "expected an object or null but got " + Reader::shown(root["rope_scaling"]));
      parse_rope(r, root["rope_scaling"], "rope_scaling.", &c.rope);
    }
  }

  c.tie_word_embeddings = r.bool_or(root, "tie_word_embeddings", false);
  if (c.model_type == "qwen2") {
    c.qkv_bias = true;
    if (r.bool_or(root, "use_sliding_window", false))
      r.fail("use_sliding_window",
             "expected false (per-layer sliding windows of qwen2 are not "
             "supported) but got true");
  } else if (c.model_type == "llama") {
    c.qkv_bias = c.o_bias = r.bool_or(root, "attention_bias", false);
    c.mlp_bias = r.bool_or(root, "mlp_bias", false);
  } else if (c.model_type == "mistral") {
    if (r.has(root, "sliding_window"))
      c.sliding_window = r.positive_int(root, "sliding_window", "sliding_window");
  }

  const std::vector<int32_t> bos = r.token_ids("bos_token_id");
  if (bos.size() > 1) r.fail("bos_token_id", "expected one token id");
  c.bos_token_id = bos.empty() ? -1 : bos[0];
  c.eos_token_ids = r.token_ids("eos_token_id");
  for (int32_t id : c.eos_token_ids)
    if (id >= c.vocab_size)
      r.fail("eos_token_id", "expected ids < vocab_size (" + std::to_string(c.vocab_size) +
                                 ") but got " + std::to_string(id));
  return c;
}

ModelConfig load_model_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("[model_config] cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return model_config_from_json(ss.str(), path);
}

std::vector<float> rope_inv_freq(const RopeConfig& rope, int64_t head_dim) {
  VQ_CHECK(head_dim > 0 && head_dim % 2 == 0,
           "[rope_inv_freq] expected an even head_dim but got " + std::to_string(head_dim));
  const int64_t half = head_dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    // Hugging Face: 1.0 / (base ** (arange(0, dim, 2).float() / dim)) in fp32.
    const float expo = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    const float p = static_cast<float>(std::pow(rope.theta, static_cast<double>(expo)));
    inv[static_cast<size_t>(i)] = 1.0f / p;
  }
  if (rope.scaling == RopeScaling::kLinear) {
    for (float& f : inv) f = static_cast<float>(f / rope.factor);
  } else if (rope.scaling == RopeScaling::kLlama3) {
    // Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    const double old_ctx = static_cast<double>(rope.original_max_position);
    const double low_wavelen = old_ctx / rope.low_freq_factor;
    const double high_wavelen = old_ctx / rope.high_freq_factor;
    for (float& f : inv) {
      const double wavelen = 2.0 * M_PI / f;
      if (wavelen < high_wavelen) continue;
      if (wavelen > low_wavelen) {
        f = static_cast<float>(f / rope.factor);
      } else {
        const double smooth = (old_ctx / wavelen - rope.low_freq_factor) /
                              (rope.high_freq_factor - rope.low_freq_factor);
        f = static_cast<float>((1.0 - smooth) * f / rope.factor + smooth * f);
      }
    }
  }
  return inv;
}

void rope_cos_sin(const std::vector<float>& inv_freq, int64_t pos, float* cos_out, float* sin_out) {
  const float p = static_cast<float>(pos);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float angle = p * inv_freq[i];  // fp32 product, as in Hugging Face
    cos_out[i] = static_cast<float>(std::cos(static_cast<double>(angle)));
    sin_out[i] = static_cast<float>(std::sin(static_cast<double>(angle)));
  }
}

void apply_rope(float* x, int64_t n_heads, int64_t head_dim, const float* cos_v, const float* sin_v,
                RopeStyle style) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * head_dim;
    if (style == RopeStyle::kHalfSplit) {
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos_v[i] - b * sin_v[i];
        v[i + half] = b * cos_v[i] + a * sin_v[i];
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cos_v[i] - b * sin_v[i];
        v[2 * i + 1] = b * cos_v[i] + a * sin_v[i];
      }
    }
  }
}

}  // namespace vq
