// Model loading: config.json + safetensors weights (Hugging Face names), checked tensor by tensor.
//
// Weights stay in the mapped file in their dtype (fp32, fp16 or bf16); only the 1-D norm weights
// and biases are copied to fp32 (a few KB per layer). Names: model.embed_tokens.weight [V, H],
// model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight [H],
// model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias), model.layers.{i}.mlp.{gate,up,
// down}_proj.weight (+ .bias), model.norm.weight [H], lm_head.weight [V, H] unless tied.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "veloxquant/error.h"
#include "veloxquant/model.h"
#include "veloxquant/safetensors.h"

namespace vq {

struct Model::Store {
  Safetensors st;
};

Model::~Model() = default;

namespace {

Linear linear_from(const Safetensors& st, const std::string& name, int64_t out, int64_t in,
                   bool with_bias) {
  const TensorRef& w = st.get(name + ".weight", {out, in});
  Linear l;
  l.w = w.data;
  l.dtype = w.dtype;
  l.out = out;
  l.in = in;
  if (with_bias) {
    const TensorRef& b = st.get(name + ".bias", {out});
    l.bias.resize(static_cast<size_t>(out));
    to_f32(b.data, b.dtype, l.bias.data(), l.bias.size());
  }
  return l;
}

std::vector<float> vector_from(const Safetensors& st, const std::string& name, int64_t n) {
  const TensorRef& t = st.get(name, {n});
  std::vector<float> v(static_cast<size_t>(n));
  to_f32(t.data, t.dtype, v.data(), v.size());
  return v;
}

uint64_t linear_bytes(const Linear& l) {
  return static_cast<uint64_t>(l.out) * static_cast<uint64_t>(l.in) * dtype_size(l.dtype);
}

}  // namespace

std::unique_ptr<Model> Model::load(const std::string& dir) {
  std::unique_ptr<Model> m(new Model());
  m->dir_ = dir;
  m->cfg_ = load_model_config(dir);
  m->store_ = std::make_unique<Store>();
  m->store_->st = Safetensors::open_dir(dir);
  const Safetensors& st = m->store_->st;
  const ModelConfig& c = m->cfg_;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size;

  m->embed_ = linear_from(st, "model.embed_tokens", c.vocab_size, H, false);
  m->lm_head_ =
      c.tie_word_embeddings ? m->embed_ : linear_from(st, "lm_head", c.vocab_size, H, false);
  m->final_norm_ = vector_from(st, "model.norm.weight", H);
  m->layers_.resize(static_cast<size_t>(c.n_layers));
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer& L = m->layers_[static_cast<size_t>(i)];
    L.attn_norm = vector_from(st, p + "input_layernorm.weight", H);
    L.mlp_norm = vector_from(st, p + "post_attention_layernorm.weight", H);
    L.q = linear_from(st, p + "self_attn.q_proj", c.n_heads * D, H, c.qkv_bias);
    L.k = linear_from(st, p + "self_attn.k_proj", c.n_kv_heads * D, H, c.qkv_bias);
    L.v = linear_from(st, p + "self_attn.v_proj", c.n_kv_heads * D, H, c.qkv_bias);
    L.o = linear_from(st, p + "self_attn.o_proj", H, c.n_heads * D, c.o_bias);
    L.gate = linear_from(st, p + "mlp.gate_proj", I, H, c.mlp_bias);
    L.up = linear_from(st, p + "mlp.up_proj", I, H, c.mlp_bias);
    L.down = linear_from(st, p + "mlp.down_proj", H, I, c.mlp_bias);
  }
  m->inv_freq_ = rope_inv_freq(c.rope, D);
  return m;
}

std::string find_shipped_model(const std::string& name) {
  namespace fs = std::filesystem;
  std::error_code ec;
  auto ok = [&](const fs::path& p) { return fs::exists(p / "config.json", ec); };
  if (const char* env = std::getenv("VQ_MODEL_DIR"); env && *env) return ok(env) ? env : "";
  if (ok(fs::path("models") / name)) return (fs::path("models") / name).string();
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n > 0) {
    buf[n] = '\0';
    fs::path dir = fs::path(buf).parent_path();
    for (int up = 0; up <= 4 && !dir.empty(); ++up, dir = dir.parent_path()) {
      if (ok(dir / "models" / name)) return (dir / "models" / name).string();
      if (dir == dir.root_path()) break;
    }
  }
  return "";
}

ModelCacheShape Model::cache_shape() const {
  ModelCacheShape s;
  s.n_kv_heads.assign(static_cast<size_t>(cfg_.n_layers), cfg_.n_kv_heads);
  s.head_dim.assign(static_cast<size_t>(cfg_.n_layers), cfg_.head_dim);
  return s;
}

std::vector<std::unique_ptr<KVCache>> Model::make_caches(const CacheConfig& cfg) const {
  return build_caches(cache_shape(), cfg);
}

uint64_t Model::weight_bytes_per_token() const {
  uint64_t b = 0;
  for (const Layer& L : layers_)
    for (const Linear* l : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down}) b += linear_bytes(*l);
  b += linear_bytes(lm_head_);
  b += static_cast<uint64_t>(cfg_.hidden_size) * dtype_size(embed_.dtype);  // one embedding row
  return b;
}

uint64_t Model::checkpoint_bytes() const {
  return store_->st.tensor_bytes();
}

}  // namespace vq
