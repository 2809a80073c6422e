// Model loading: config.json + safetensors weights (Hugging Face names), checked tensor by tensor.
//
// Weights stay in the mapped file in their dtype (fp32, fp16 or bf16); only the 1-D norm weights
// and biases are copied to fp32 (a few KB per layer). Names: model.embed_tokens.weight [V, H],
// model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight [H],
// model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias), model.layers.{i}.mlp.{gate,up,
// down}_proj.weight (+ .bias), model.norm.weight [H], lm_head.weight [V, H] unless tied.
// After loading (LoadOptions): tensors the config leaves unused are refused, and every used
// weight is scanned for NaN/Inf by its exponent bits.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <set>

#include "veloxquant/error.h"
#include "veloxquant/model.h"
#include "veloxquant/safetensors.h"

namespace vq {

struct Model::Store {
  Safetensors st;
};

Model::~Model() = default;

namespace {

// Tensors the model uses, in load order (for the finiteness and unused-tensor checks).
using UsedTensors = std::vector<const TensorRef*>;

Linear linear_from(const Safetensors& st, const std::string& name, int64_t out, int64_t in,
                   bool with_bias, UsedTensors& used) {
  const TensorRef& w = st.get(name + ".weight", {out, in});
  used.push_back(&w);
  Linear l;
  l.w = w.data;
  l.dtype = w.dtype;
  l.out = out;
  l.in = in;
  if (with_bias) {
    const TensorRef& b = st.get(name + ".bias", {out});
    used.push_back(&b);
    l.bias.resize(static_cast<size_t>(out));
    to_f32(b.data, b.dtype, l.bias.data(), l.bias.size());
  }
  return l;
}

std::vector<float> vector_from(const Safetensors& st, const std::string& name, int64_t n,
                               UsedTensors& used) {
  const TensorRef& t = st.get(name, {n});
  used.push_back(&t);
  std::vector<float> v(static_cast<size_t>(n));
  to_f32(t.data, t.dtype, v.data(), v.size());
  return v;
}

uint64_t linear_bytes(const Linear& l) {
  return static_cast<uint64_t>(l.out) * static_cast<uint64_t>(l.in) * dtype_size(l.dtype);
}

// Index of the first NaN or Inf element of data [n] in dtype t (all exponent bits set), or -1.
// Split over the OpenMP threads; the smallest bad index wins so the message is deterministic.
int64_t first_non_finite(const void* data, DType t, int64_t n) {
  int64_t first = n;
  if (t == DType::kF32) {
    const uint32_t* u = static_cast<const uint32_t*>(data);
#pragma omp parallel for schedule(static) reduction(min : first) if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i)
      if ((u[i] & 0x7F800000u) == 0x7F800000u && i < first) first = i;
  } else {
    // fp16: exponent 0x7C00; bf16: 0x7F80.
    const uint16_t mask = t == DType::kF16 ? 0x7C00u : 0x7F80u;
    const uint16_t* u = static_cast<const uint16_t*>(data);
#pragma omp parallel for schedule(static) reduction(min : first) if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i)
      if ((u[i] & mask) == mask && i < first) first = i;
  }
  return first == n ? -1 : first;
}

void check_finite(const TensorRef& t) {
  const int64_t bad = first_non_finite(t.data, t.dtype, t.numel());
  if (bad < 0) return;
  const float v = t.at(static_cast<size_t>(bad));
  throw Error("[model] tensor '" + t.name + "' in " + t.file +
              ": expected finite weights but element " + std::to_string(bad) + " is " +
              (std::isnan(v) ? "nan"
               : v > 0       ? "inf"
                             : "-inf") +
              " (LoadOptions::check_finite = false / --no-check-weights skips this check)");
}

// Checkpoint tensors that are neither used nor ignorable (see LoadOptions::allow_unused_tensors).
void check_no_unused(const Safetensors& st, const UsedTensors& used, const ModelConfig& c,
                     const std::string& dir) {
  std::set<std::string> used_names;
  for (const TensorRef* t : used) used_names.insert(t->name);
  const std::string inv_freq = ".rotary_emb.inv_freq";
  std::vector<std::string> unused;
  for (const std::string& n : st.names()) {
    if (used_names.count(n)) continue;
    if (c.tie_word_embeddings && n == "lm_head.weight") continue;
    if (n.size() >= inv_freq.size() &&
        n.compare(n.size() - inv_freq.size(), inv_freq.size(), inv_freq) == 0)
      continue;
    unused.push_back(n);
  }
  if (unused.empty()) return;
  std::string list;
  const size_t shown = std::min<size_t>(unused.size(), 5);
  for (size_t i = 0; i < shown; ++i) list += (i ? ", " : "") + unused[i];
  if (unused.size() > shown) list += ", ... (" + std::to_string(unused.size() - shown) + " more)";
  throw Error("[model] " + dir + ": expected every checkpoint tensor to be used by config.json (" +
              std::to_string(c.n_layers) + " layers) but " + std::to_string(unused.size()) +
              " are not: " + list +
              " (a config that does not match the checkpoint? LoadOptions::allow_unused_tensors "
              "accepts them)");
}

}  // namespace

uint64_t scratch_bytes(const ForwardScratch& s) {
  uint64_t b = 0;
  for (const auto* v : {&s.x, &s.h, &s.q, &s.k, &s.v, &s.qh, &s.attn, &s.attn_t, &s.gate, &s.up,
                        &s.logits_in, &s.cos_t, &s.sin_t, &s.kf, &s.vf})
    b += v->capacity() * sizeof(float);
  b += (s.k16.capacity() + s.v16.capacity()) * sizeof(uint16_t);
  return b;
}

void check_tokenizer_vocab(int64_t tokenizer_vocab, const ModelConfig& cfg,
                           const std::string& what) {
  VQ_CHECK(tokenizer_vocab <= cfg.vocab_size,
           "[model] expected a tokenizer of at most " + std::to_string(cfg.vocab_size) +
               " ids (the model's vocab_size) but " + what + " has " +
               std::to_string(tokenizer_vocab) +
               ": its ids at or above the model's vocab_size have no embedding row");
}

std::unique_ptr<Model> Model::load(const std::string& dir, const LoadOptions& opts) {
  std::unique_ptr<Model> m(new Model());
  m->dir_ = dir;
  m->cfg_ = load_model_config(dir);
  m->store_ = std::make_unique<Store>();
  m->store_->st = Safetensors::open_dir(dir);
  const Safetensors& st = m->store_->st;
  const ModelConfig& c = m->cfg_;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
  UsedTensors used;

  m->embed_ = linear_from(st, "model.embed_tokens", c.vocab_size, H, false, used);
  m->lm_head_ =
      c.tie_word_embeddings ? m->embed_ : linear_from(st, "lm_head", c.vocab_size, H, false, used);
  m->final_norm_ = vector_from(st, "model.norm.weight", H, used);
  m->layers_.resize(static_cast<size_t>(c.n_layers));
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer& L = m->layers_[static_cast<size_t>(i)];
    L.attn_norm = vector_from(st, p + "input_layernorm.weight", H, used);
    L.mlp_norm = vector_from(st, p + "post_attention_layernorm.weight", H, used);
    L.q = linear_from(st, p + "self_attn.q_proj", c.n_heads * D, H, c.qkv_bias, used);
    L.k = linear_from(st, p + "self_attn.k_proj", c.n_kv_heads * D, H, c.qkv_bias, used);
    L.v = linear_from(st, p + "self_attn.v_proj", c.n_kv_heads * D, H, c.qkv_bias, used);
    L.o = linear_from(st, p + "self_attn.o_proj", H, c.n_heads * D, c.o_bias, used);
    L.gate = linear_from(st, p + "mlp.gate_proj", I, H, c.mlp_bias, used);
    L.up = linear_from(st, p + "mlp.up_proj", I, H, c.mlp_bias, used);
    L.down = linear_from(st, p + "mlp.down_proj", H, I, c.mlp_bias, used);
  }
  m->inv_freq_ = rope_inv_freq(c.rope, D);
  if (!opts.allow_unused_tensors) check_no_unused(st, used, c, dir);
  if (opts.check_finite)
    for (const TensorRef* t : used) check_finite(*t);
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
