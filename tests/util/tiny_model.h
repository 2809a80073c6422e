// Deterministic writer of tiny random-initialised Llama-family checkpoints for tests: config.json
// (Hugging Face field names), model.safetensors (or shards) and, when asked, a minimal
// byte-level tokenizer.json (256 byte tokens + a few merges, vocab padded to the model's).
//
// Weights are N(0, init_std) from a seeded std::mt19937_64, norm weights 1 + N(0, 0.1); the same
// spec and seed always give the same bytes.
#pragma once

#include <cstdint>
#include <string>

#include "veloxquant/dtype.h"

namespace vq::test {

struct TinyModelSpec {
  std::string model_type = "llama";  // llama | mistral | qwen2 (qwen2 gets q/k/v biases)
  int64_t vocab_size = 320;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 88;  // not a multiple of 16: exercises the kernel tails
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 2;
  int64_t head_dim = 16;  // written to config.json only when explicit_head_dim
  bool explicit_head_dim = false;
  DType dtype = DType::kF32;
  bool tie_word_embeddings = false;
  double rope_theta = 10000.0;
  bool llama3_rope_scaling = false;
  int64_t max_position_embeddings = 4096;
  int64_t eos_token_id = -1;  // -1: vocab_size - 1 (the tokenizer's <|eos|>)
  float init_std = 0.25f;
  uint64_t seed = 1234;
  int n_shards = 1;  // > 1 writes model-0000k-of-0000n.safetensors + index
  bool write_tokenizer = true;
};

// A fresh, empty directory under the system temp dir (unique per call).
std::string make_temp_dir(const std::string& prefix);

// Writes the checkpoint into dir (created if needed) and returns dir.
std::string write_tiny_model(const std::string& dir, const TinyModelSpec& spec = {});

// The eos id spec resolves to.
int64_t tiny_model_eos(const TinyModelSpec& spec);

// The config.json text write_tiny_model writes for spec.
std::string tiny_model_config_json(const TinyModelSpec& spec);

// Overwrites element `index` of tensor `name` in <dir>/model.safetensors (a one-file checkpoint)
// with value, in the tensor's dtype (e.g. a NaN or Inf for the load-time finiteness checks).
void poke_tiny_model_weight(const std::string& dir, const std::string& name, int64_t index,
                            float value);

}  // namespace vq::test
