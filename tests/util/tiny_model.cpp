// Tiny random-initialised Llama-family checkpoints for tests (see tiny_model.h).
#include "util/tiny_model.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>

#include "veloxquant/error.h"
#include "veloxquant/safetensors.h"

namespace vq::test {

namespace {

using json = nlohmann::json;

TensorToWrite random_tensor_bytes(const std::string& name, std::vector<int64_t> shape, DType t,
                                  std::mt19937_64& rng, float mean, float stddev) {
  TensorToWrite out;
  out.name = name;
  out.dtype = t;
  out.shape = std::move(shape);
  size_t n = 1;
  for (int64_t d : out.shape) n *= static_cast<size_t>(d);
  std::vector<float> v(n);
  std::normal_distribution<float> dist(mean, stddev);
  for (float& x : v) x = dist(rng);
  out.bytes.resize(n * dtype_size(t));
  from_f32(v.data(), out.bytes.data(), t, n);
  return out;
}

// A byte-level BPE tokenizer.json in the Hugging Face layout: tokens 0..255 are the GPT-2
// byte-to-unicode characters, then a few merges of common ASCII pairs, then special "<|pad_k|>"
// fillers up to vocab_size; the eos id's slot is "<|eos|>" when it lies in the filler range.
json tiny_tokenizer_json(const TinyModelSpec& spec) {
  VQ_CHECK(spec.vocab_size > 256, "[write_tiny_model] a tokenizer needs vocab_size > 256 but got " +
                                      std::to_string(spec.vocab_size));
  // GPT-2 bytes_to_unicode.
  std::vector<int> bs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
  std::vector<int> cs = bs;
  int extra = 0;
  for (int b = 0; b < 256; ++b)
    if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
      bs.push_back(b);
      cs.push_back(256 + extra++);
    }
  std::vector<std::string> byte_str(256);
  for (size_t i = 0; i < bs.size(); ++i) {
    const int c = cs[i];
    std::string u;
    if (c < 0x80) {
      u.push_back(static_cast<char>(c));
    } else {
      u.push_back(static_cast<char>(0xC0 | (c >> 6)));
      u.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
    byte_str[static_cast<size_t>(bs[i])] = u;
  }
  json vocab = json::object();
  int64_t next = 0;
  for (int b = 0; b < 256; ++b) vocab[byte_str[static_cast<size_t>(b)]] = next++;
  json merges = json::array();
  const char* pairs[][2] = {{"t", "h"},   {"th", "e"}, {"a", "n"}, {"i", "n"},
                            {"e", "r"},   {"o", "n"},  {"Ġ", "t"}, {"Ġt", "h"},
                            {"Ġth", "e"}, {"Ġ", "a"},  {"r", "e"}};
  for (const auto& p : pairs) {
    if (next >= spec.vocab_size - 1) break;
    const std::string merged = std::string(p[0]) + p[1];
    if (vocab.contains(merged)) continue;
    vocab[merged] = next++;
    merges.push_back(std::string(p[0]) + " " + p[1]);
  }
  json added = json::array();
  while (next < spec.vocab_size) {
    const bool is_eos = next == tiny_model_eos(spec);
    const std::string name = is_eos ? "<|eos|>" : "<|pad_" + std::to_string(next) + "|>";
    vocab[name] = next;
    added.push_back({{"id", next},
                     {"content", name},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
    ++next;
  }
  json tok = {{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", added},
              {"normalizer", nullptr},
              {"pre_tokenizer",
               {{"type", "ByteLevel"},
                {"add_prefix_space", false},
                {"trim_offsets", true},
                {"use_regex", true}}},
              {"post_processor", nullptr},
              {"decoder",
               {{"type", "ByteLevel"},
                {"add_prefix_space", true},
                {"trim_offsets", true},
                {"use_regex", true}}},
              {"model",
               {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", merges}}}};
  return tok;
}

}  // namespace

int64_t tiny_model_eos(const TinyModelSpec& spec) {
  return spec.eos_token_id >= 0 ? spec.eos_token_id : spec.vocab_size - 1;
}

std::string make_temp_dir(const std::string& prefix) {
  static std::atomic<int> counter{0};
  namespace fs = std::filesystem;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const fs::path p = fs::temp_directory_path() / (prefix + "-" + std::to_string(::getpid()) +
                                                    "-" + std::to_string(counter.fetch_add(1)));
    std::error_code ec;
    if (fs::create_directory(p, ec)) return p.string();
  }
  throw Error("[make_temp_dir] cannot create a directory for " + prefix);
}

std::string tiny_model_config_json(const TinyModelSpec& s) {
  json c = {{"architectures",
             {s.model_type == "qwen2"     ? "Qwen2ForCausalLM"
              : s.model_type == "mistral" ? "MistralForCausalLM"
                                          : "LlamaForCausalLM"}},
            {"model_type", s.model_type},
            {"vocab_size", s.vocab_size},
            {"hidden_size", s.hidden_size},
            {"intermediate_size", s.intermediate_size},
            {"num_hidden_layers", s.n_layers},
            {"num_attention_heads", s.n_heads},
            {"num_key_value_heads", s.n_kv_heads},
            {"hidden_act", "silu"},
            {"max_position_embeddings", s.max_position_embeddings},
            {"rms_norm_eps", 1e-5},
            {"rope_theta", s.rope_theta},
            {"tie_word_embeddings", s.tie_word_embeddings},
            {"bos_token_id", 0},
            {"eos_token_id", tiny_model_eos(s)},
            {"torch_dtype", s.dtype == DType::kBF16  ? "bfloat16"
                            : s.dtype == DType::kF16 ? "float16"
                                                     : "float32"}};
  if (s.explicit_head_dim) c["head_dim"] = s.head_dim;
  if (s.llama3_rope_scaling)
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 64}};
  if (s.model_type == "mistral") c["sliding_window"] = nullptr;
  return c.dump(2);
}

std::string write_tiny_model(const std::string& dir, const TinyModelSpec& s) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  const int64_t D = s.explicit_head_dim ? s.head_dim : s.hidden_size / s.n_heads;
  VQ_CHECK(s.explicit_head_dim || s.hidden_size % s.n_heads == 0,
           "[write_tiny_model] hidden_size must be a multiple of n_heads without head_dim");
  std::mt19937_64 rng(s.seed);
  const float w = s.init_std;
  const DType t = s.dtype;
  const int64_t H = s.hidden_size, I = s.intermediate_size;
  std::vector<TensorToWrite> ts;
  ts.push_back(random_tensor_bytes("model.embed_tokens.weight", {s.vocab_size, H}, t, rng, 0, 1));
  for (int64_t l = 0; l < s.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    ts.push_back(random_tensor_bytes(p + "input_layernorm.weight", {H}, t, rng, 1, 0.1f));
    ts.push_back(
        random_tensor_bytes(p + "self_attn.q_proj.weight", {s.n_heads * D, H}, t, rng, 0, w));
    ts.push_back(
        random_tensor_bytes(p + "self_attn.k_proj.weight", {s.n_kv_heads * D, H}, t, rng, 0, w));
    ts.push_back(
        random_tensor_bytes(p + "self_attn.v_proj.weight", {s.n_kv_heads * D, H}, t, rng, 0, w));
    if (s.model_type == "qwen2") {
      ts.push_back(random_tensor_bytes(p + "self_attn.q_proj.bias", {s.n_heads * D}, t, rng, 0, w));
      ts.push_back(
          random_tensor_bytes(p + "self_attn.k_proj.bias", {s.n_kv_heads * D}, t, rng, 0, w));
      ts.push_back(
          random_tensor_bytes(p + "self_attn.v_proj.bias", {s.n_kv_heads * D}, t, rng, 0, w));
    }
    ts.push_back(
        random_tensor_bytes(p + "self_attn.o_proj.weight", {H, s.n_heads * D}, t, rng, 0, w));
    ts.push_back(random_tensor_bytes(p + "post_attention_layernorm.weight", {H}, t, rng, 1, 0.1f));
    ts.push_back(random_tensor_bytes(p + "mlp.gate_proj.weight", {I, H}, t, rng, 0, w));
    ts.push_back(random_tensor_bytes(p + "mlp.up_proj.weight", {I, H}, t, rng, 0, w));
    ts.push_back(random_tensor_bytes(p + "mlp.down_proj.weight", {H, I}, t, rng, 0, w));
  }
  ts.push_back(random_tensor_bytes("model.norm.weight", {H}, t, rng, 1, 0.1f));
  if (!s.tie_word_embeddings)
    ts.push_back(random_tensor_bytes("lm_head.weight", {s.vocab_size, H}, t, rng, 0, w));

  if (s.n_shards <= 1) {
    save_safetensors(dir + "/model.safetensors", ts, {{"format", "pt"}});
  } else {
    json weight_map = json::object();
    const size_t per =
        (ts.size() + static_cast<size_t>(s.n_shards) - 1) / static_cast<size_t>(s.n_shards);
    for (int k = 0; k < s.n_shards; ++k) {
      char name[64];
      std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", k + 1, s.n_shards);
      std::vector<TensorToWrite> part;
      for (size_t i = static_cast<size_t>(k) * per; i < std::min(ts.size(), (k + 1) * per); ++i) {
        part.push_back(ts[i]);
        weight_map[ts[i].name] = name;
      }
      save_safetensors(dir + "/" + name, part, {{"format", "pt"}});
    }
    std::ofstream(dir + "/model.safetensors.index.json")
        << json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump(2);
  }
  std::ofstream(dir + "/config.json") << tiny_model_config_json(s);
  if (s.write_tokenizer) std::ofstream(dir + "/tokenizer.json") << tiny_tokenizer_json(s).dump(1);
  return dir;
}

void poke_tiny_model_weight(const std::string& dir, const std::string& name, int64_t index,
                            float value) {
  const std::string path = dir + "/model.safetensors";
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  VQ_CHECK(f.is_open(), "[poke_tiny_model_weight] cannot open " + path);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const SafetensorsHeader h = parse_safetensors_header(bytes.data(), bytes.size(), path);
  for (const SafetensorsEntry& e : h.entries) {
    if (e.name != name) continue;
    const size_t es = dtype_size(e.dtype);
    VQ_CHECK(index >= 0 && static_cast<uint64_t>(index) * es < e.nbytes(),
             "[poke_tiny_model_weight] index " + std::to_string(index) + " outside " + name);
    uint8_t elem[4];
    from_f32(&value, elem, e.dtype, 1);
    f.clear();
    f.seekp(
        static_cast<std::streamoff>(h.data_offset + e.begin + static_cast<uint64_t>(index) * es));
    f.write(reinterpret_cast<const char*>(elem), static_cast<std::streamsize>(es));
    VQ_CHECK(f.good(), "[poke_tiny_model_weight] write to " + path + " failed");
    return;
  }
  throw Error("[poke_tiny_model_weight] no tensor " + name + " in " + path);
}

}  // namespace vq::test
