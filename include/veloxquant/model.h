// Llama-family models on the CPU: config.json parsing (llama, mistral, qwen2), weight loading from
// safetensors (kept in their file dtype, memory-mapped) and the forward pass through one KV cache
// per layer.
//
// Activations are fp32 and token-major: x[t, hidden] with t = b * S + s. Per layer the forward
// pass hands the cache K/V blocks [B, H_kv, S, head_dim] (ForwardOptions::kv_dtype) rotated at the
// cache's offset(), then attends over the view it returns with queries [B, H_q, S, head_dim].
// RoPE pairs channel i with channel i + head_dim/2 (RopeStyle::kHalfSplit, Hugging Face's
// rotate_half layout); RopeStyle::kInterleaved (pairs 2i, 2i+1) exists for completeness.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/builder.h"
#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/dtype.h"

namespace vq {

enum class RopeStyle : uint8_t {
  kHalfSplit,    // (x[i], x[i + D/2]) rotate together: Hugging Face Llama/Mistral/Qwen2, GPT-NeoX
  kInterleaved,  // (x[2i], x[2i + 1]) rotate together: original Meta Llama, GPT-J
};

enum class RopeScaling : uint8_t { kNone, kLinear, kLlama3 };

struct RopeConfig {
  double theta = 10000.0;
  RopeStyle style = RopeStyle::kHalfSplit;
  RopeScaling scaling = RopeScaling::kNone;
  double factor = 1.0;            // linear: positions / factor; llama3: long-wavelength divisor
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  int64_t original_max_position = 8192;  // llama3
};

struct ModelConfig {
  std::string model_type;  // "llama", "mistral" or "qwen2"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;     // query heads
  int64_t n_kv_heads = 0;  // n_heads % n_kv_heads == 0 (GQA)
  int64_t head_dim = 0;    // config's head_dim when given, else hidden_size / n_heads
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  int64_t max_position_embeddings = 0;
  int64_t sliding_window = 0;  // 0 = none (mistral's sliding_window, qwen2's when enabled)
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // qwen2; llama's attention_bias
  bool o_bias = false;    // llama's attention_bias also biases o_proj
  bool mlp_bias = false;  // llama's mlp_bias
  int64_t bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;
};

const std::vector<std::string>& supported_model_types();

// Parses a Hugging Face config.json text. Throws vq::Error naming the field: unknown model_type
// (listing the supported ones), a missing or mistyped field, an unsupported hidden_act or
// rope_scaling type, inconsistent head counts. Accepts rope parameters both at top level
// (rope_theta, rope_scaling) and in transformers 5's "rope_parameters" object.
ModelConfig model_config_from_json(const std::string& text,
                                   const std::string& origin = "config.json");
// Reads <dir>/config.json.
ModelConfig load_model_config(const std::string& dir);

// Where the shipped model lives: $VQ_MODEL_DIR if set, else models/<name> under the current
// directory, else models/<name> in a parent (up to 4 levels) of the running executable's
// folder (a build folder inside the source tree). Returns "" when none has a config.json.
std::string find_shipped_model(const std::string& name = "vq-mini-llama");

// --- RoPE ---------------------------------------------------------------------------------------
// Inverse frequencies [head_dim / 2] in fp32 as Hugging Face computes them:
// inv_freq[i] = 1 / theta^(2i / head_dim), then the llama3 or linear scaling.
std::vector<float> rope_inv_freq(const RopeConfig& rope, int64_t head_dim);
// cos and sin [head_dim / 2] at one position: angle = fp32(pos) * inv_freq[i] rounded to fp32
// (as Hugging Face does), cos/sin evaluated in double and rounded.
void rope_cos_sin(const std::vector<float>& inv_freq, int64_t pos, float* cos_out, float* sin_out);
// Rotates x [n_heads, head_dim] in place with the cos/sin [head_dim / 2] of its position.
void apply_rope(float* x, int64_t n_heads, int64_t head_dim, const float* cos_v, const float* sin_v,
                RopeStyle style);

// --- Model --------------------------------------------------------------------------------------

// A weight matrix [out, in] row-major in its file dtype, read in place.
struct Linear {
  const void* w = nullptr;
  DType dtype = DType::kF32;
  int64_t out = 0, in = 0;
  std::vector<float> bias;  // [out] or empty
};

// Arithmetic of the products of activations with bf16 weight matrices (q/k/v/o, gate/up/down,
// lm_head; prefill and decode alike). kExact: activations fp32, weights widened exactly, fp32
// FMAs. kBF16 (opt-in): activations rounded to bf16 (nearest even, as vcvtne2ps2bf16), exact
// bf16 x bf16 products summed in fp32 (vdpbf16ps on avx512_bf16 CPUs, else a portable path with
// the same rounded activations): about twice the arithmetic rate, llama.cpp's arithmetic on bf16
// weights. fp32/fp16 weights, attention, norms, RoPE and softmax are exact in both.
enum class MatmulPrecision : uint8_t { kExact, kBF16 };

struct ForwardOptions {
  // dtype of the K/V blocks handed to the caches. fp16 is the default (what a deployed cache
  // holds, and what the byte figures count); fp32 keeps the cache exact for golden tests.
  DType kv_dtype = DType::kF16;
  enum class Logits : uint8_t { kAll, kLast, kNone };
  Logits logits = Logits::kLast;  // which positions of each sequence get logits
  // Hand this call's queries to the caches (UpdateOptions::queries; SnapKV query scoring).
  bool pass_queries = true;
  MatmulPrecision matmul = MatmulPrecision::kExact;
};

// Reusable buffers for forward(); keep one per generation loop to avoid reallocations.
struct ForwardScratch {
  std::vector<float> x, h, q, k, v, qh, attn, attn_t, gate, up, logits_in, cos_t, sin_t, kf, vf;
  std::vector<uint16_t> k16, v16;
};

// Checks Model::load makes beyond presence, dtype and shape.
struct LoadOptions {
  // Every weight the model uses is scanned for NaN and Inf (refused naming the tensor, the file
  // and the first bad element). One read of the checkpoint, split over the OpenMP threads
  // (about 0.1 s for models/vq-mini-llama); false skips it (the CLI's --no-check-weights).
  bool check_finite = true;
  // Tensors of the checkpoint that the config does not use (a config with fewer layers than
  // the checkpoint, a bias the config does not enable) are refused, naming a few of them,
  // unless this is true. Always ignored: lm_head.weight when the embeddings are tied and
  // *.rotary_emb.inv_freq buffers (RoPE is computed from the config).
  bool allow_unused_tensors = false;
};

// Buffers of ForwardScratch in bytes (their capacity): the activations of the largest forward
// call made with it (the prefill chunk).
uint64_t scratch_bytes(const ForwardScratch& s);

// Refuses a tokenizer the model cannot serve: tokenizer_vocab (Tokenizer::vocab_size(), one past
// its largest id) above the model's vocab_size means ids the embedding has no row for:
// "[model] expected a tokenizer of at most <model vocab> ids (the model's vocab_size) but
// <what> has <n>". A tokenizer smaller than the model is accepted (models pad their vocabulary);
// generation then samples only ids the tokenizer has (GenerateOptions::sample_vocab).
void check_tokenizer_vocab(int64_t tokenizer_vocab, const ModelConfig& cfg,
                           const std::string& what = "the tokenizer");

class Model {
 public:
  // Loads <dir>/config.json and the safetensors weights. Every tensor is checked for presence,
  // dtype (F32/F16/BF16) and shape; a missing or misshapen one is refused naming it with
  // expected vs found. Then the LoadOptions checks: finiteness and no unused tensors.
  static std::unique_ptr<Model> load(const std::string& dir, const LoadOptions& opts = {});
  ~Model();

  const ModelConfig& config() const { return cfg_; }
  const std::string& dir() const { return dir_; }
  ModelCacheShape cache_shape() const;
  // build_caches(cache_shape(), cfg).
  std::vector<std::unique_ptr<KVCache>> make_caches(const CacheConfig& cfg) const;
  // Bytes of weights a decode step reads (every matrix once, one embedding row; tied lm_head
  // counted once as a matrix).
  uint64_t weight_bytes_per_token() const;
  // Bytes of all tensors in the checkpoint.
  uint64_t checkpoint_bytes() const;

  // tokens [B, S] (row-major) -> logits [B, S, vocab] (Logits::kAll) or [B, 1, vocab] (kLast),
  // fp32. The caches (one per layer) all advance by S; they must share the same offset().
  void forward(const int32_t* tokens, int64_t batch, int64_t seq,
               const std::vector<std::unique_ptr<KVCache>>& caches, const ForwardOptions& opts,
               std::vector<float>* logits, ForwardScratch* scratch = nullptr) const;

  struct Layer {
    std::vector<float> attn_norm, mlp_norm;  // [hidden] fp32 copies (small)
    Linear q, k, v, o, gate, up, down;
  };
  // The weights as loaded (file dtype, read in place), for engines that upload them
  // (src/model/engine_cuda.cpp); lm_head() is embedding() when the embeddings are tied.
  const std::vector<Layer>& layers() const { return layers_; }
  const Linear& embedding() const { return embed_; }
  const Linear& lm_head() const { return lm_head_; }
  const std::vector<float>& final_norm() const { return final_norm_; }
  // rope_inv_freq(config().rope, head_dim): what forward() rotates with.
  const std::vector<float>& inv_freq() const { return inv_freq_; }

 private:
  Model() = default;
  struct Store;
  std::unique_ptr<Store> store_;  // the mapped checkpoint
  std::string dir_;
  ModelConfig cfg_;
  std::vector<Layer> layers_;
  Linear embed_;    // [vocab, hidden]
  Linear lm_head_;  // [vocab, hidden] (the embedding when tied)
  std::vector<float> final_norm_;
  std::vector<float> inv_freq_;
};

}  // namespace vq
