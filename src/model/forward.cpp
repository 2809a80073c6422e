// The forward pass of a Llama-family decoder over one KV cache per layer.
//
// Per call: tokens [B, S] -> x [B*S, hidden] (token-major, t = b * S + s). Per layer:
// h = RMSNorm(x); q/k/v = h W^T (+bias) as [T, heads * head_dim]; RoPE (RopeStyle::kHalfSplit)
// at positions offset + s, where offset = cache.offset() read BEFORE update_and_fetch; q is laid
// out [B, H_q, S, D] fp32, k and v [B, H_kv, S, D] in ForwardOptions::kv_dtype; the cache
// returns the view (stored rows ++ these rows, per-row positions) and attention runs over it
// (query head qh reads KV head qh / (H_q / H_kv)); o_proj, residual; RMSNorm, SwiGLU MLP,
// residual. Then the final norm and the logits of the requested positions.
// Threads: the matrix products and attention split their own work; the per-token steps
// (RMSNorm fused with the residual add, RoPE with the head-major copies, SwiGLU) are split over
// tokens when a call has at least kParallelTokens tokens (prefill), so no core idles through
// them; each token's arithmetic is the same either way. All of them run on one worker pool
// (ops/thread_pool.h).
// ForwardOptions::matmul picks the matrix products' arithmetic (kernels::Precision) for every
// product of this call, the logits included.

#include <algorithm>
#include <cmath>
#include <cstring>

#include "model/forward_parts.h"
#include "ops/kernels.h"
#include "ops/thread_pool.h"
#include "veloxquant/attention.h"
#include "veloxquant/error.h"
#include "veloxquant/model.h"

namespace vq {

namespace {

constexpr int64_t kParallelTokens = 8;  // per-token steps run on every thread from this many

void linear(const Linear& l, const float* x, int64_t n_tokens, float* y, kernels::Precision p) {
  kernels::matmul(x, n_tokens, l.in, l.in, l.w, l.dtype, l.out,
                  l.bias.empty() ? nullptr : l.bias.data(), y, l.out, p);
}

kernels::MatmulOut out_of(const Linear& l, float* y) {
  return {l.w, l.dtype, l.out, l.bias.empty() ? nullptr : l.bias.data(), y, l.out};
}

// f(t) for every token t, on the worker pool (ops/thread_pool.h, the matrix products' and
// attention's threads) in blocks of kParallelTokens tokens when par; serial otherwise (decode
// pays nothing). One pool for every loop of a step: no OpenMP team spinning beside it.
template <typename F>
void for_tokens(int64_t n_tokens, bool par, const F& f) {
  if (par) {
    const int64_t n_blocks = (n_tokens + kParallelTokens - 1) / kParallelTokens;
    ops::parallel_for(n_blocks, [&](int64_t blk) {
      const int64_t t1 = std::min(n_tokens, (blk + 1) * kParallelTokens);
      for (int64_t t = blk * kParallelTokens; t < t1; ++t) f(t);
    });
  } else {
    for (int64_t t = 0; t < n_tokens; ++t) f(t);
  }
}

template <typename T>
T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

}  // namespace

namespace fwd {

LayerSlice layer_slice(const Model::Layer& L, int64_t n_heads, int64_t n_kv_heads) {
  return {&L.attn_norm, &L.mlp_norm, &L.q,    &L.k,    &L.v,      &L.o,
          &L.gate,      &L.up,       &L.down, n_heads, n_kv_heads};
}

int64_t check_call(const ModelConfig& c, const int32_t* tokens, int64_t batch, int64_t seq,
                   const std::vector<std::unique_ptr<KVCache>>& caches) {
  VQ_CHECK(batch >= 1 && seq >= 1, "[forward] expected batch >= 1 and seq >= 1 but got batch " +
                                       std::to_string(batch) + ", seq " + std::to_string(seq));
  VQ_CHECK(static_cast<int64_t>(caches.size()) == c.n_layers,
           "[forward] expected one cache per layer (" + std::to_string(c.n_layers) + ") but got " +
               std::to_string(caches.size()));
  for (int64_t i = 0; i < batch * seq; ++i)
    VQ_CHECK(tokens[i] >= 0 && tokens[i] < c.vocab_size,
             "[forward] expected token ids in [0, " + std::to_string(c.vocab_size) + ") but got " +
                 std::to_string(tokens[i]) + " at index " + std::to_string(i));
  VQ_CHECK(caches[0] != nullptr, "[forward] expected a cache for layer 0 but got nullptr");
  const int64_t offset = caches[0]->offset();
  for (size_t l = 0; l < caches.size(); ++l)
    VQ_CHECK(caches[l] && caches[l]->offset() == offset,
             "[forward] expected every layer's cache at offset " + std::to_string(offset) +
                 " but layer " + std::to_string(l) + " is at " +
                 (caches[l] ? std::to_string(caches[l]->offset()) : std::string("nullptr")));
  return offset;
}

Step begin(const Model& m, const int32_t* tokens, int64_t batch, int64_t seq, int64_t offset,
           const ForwardOptions& opts, ForwardScratch& s) {
  const ModelConfig& c = m.config();
  Step st;
  st.cfg = &c;
  st.batch = batch;
  st.seq = seq;
  st.tokens = batch * seq;
  st.offset = offset;
  st.par = st.tokens >= kParallelTokens;
  st.mp = opts.matmul == MatmulPrecision::kBF16 ? kernels::Precision::kBF16
                                                : kernels::Precision::kExact;
  st.kv_dtype = opts.kv_dtype;
  st.pass_queries = opts.pass_queries;
  const int64_t Hd = c.hidden_size, D = c.head_dim, half = D / 2;
  float* x = grow(s.x, static_cast<size_t>(st.tokens * Hd));
  float* cos_t = grow(s.cos_t, static_cast<size_t>(seq * half));
  float* sin_t = grow(s.sin_t, static_cast<size_t>(seq * half));
  // Embeddings.
  const Linear& embed = m.embedding();
  const size_t emb_es = dtype_size(embed.dtype);
  for (int64_t t = 0; t < st.tokens; ++t)
    to_f32(static_cast<const char*>(embed.w) + static_cast<size_t>(tokens[t]) * Hd * emb_es,
           embed.dtype, x + t * Hd, static_cast<size_t>(Hd));
  // RoPE tables for this call's positions, shared by every layer and head.
  for (int64_t si = 0; si < seq; ++si)
    rope_cos_sin(m.inv_freq(), offset + si, cos_t + si * half, sin_t + si * half);
  st.cos_t = cos_t;
  st.sin_t = sin_t;
  st.ap.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  st.ap.window = c.sliding_window;
  st.ap.q_pos0 = offset;
  return st;
}

void norm_in(const Step& st, ForwardScratch& s, bool add, const std::vector<float>& w) {
  const ModelConfig& c = *st.cfg;
  const int64_t Hd = c.hidden_size;
  float* x = s.x.data();
  float* h = grow(s.h, static_cast<size_t>(st.tokens * Hd));
  for_tokens(st.tokens, st.par, [&](int64_t t) {
    if (add)
      for (int64_t i = 0; i < Hd; ++i) x[t * Hd + i] += h[t * Hd + i];
    kernels::rmsnorm(x + t * Hd, w.data(), Hd, c.rms_norm_eps, h + t * Hd);
  });
}

void attention(const Step& st, const LayerSlice& L, KVCache& cache, ForwardScratch& s) {
  const ModelConfig& c = *st.cfg;
  const int64_t T = st.tokens, seq = st.seq, batch = st.batch, Hd = c.hidden_size;
  const int64_t D = c.head_dim, half = D / 2, Hq = L.n_heads, Hkv = L.n_kv_heads;
  const size_t uT = static_cast<size_t>(T);
  float* h = grow(s.h, uT * std::max(Hd, Hq * D));
  float* q = grow(s.q, uT * Hq * D);
  float* k = grow(s.k, uT * Hkv * D);
  float* v = grow(s.v, uT * Hkv * D);
  float* qh = grow(s.qh, uT * Hq * D);
  float* attn = grow(s.attn, uT * Hq * D);
  float* attn_t = grow(s.attn_t, uT * Hq * D);
  // Head-major K/V blocks [B, H_kv, S, D] handed to the cache, in the cache dtype.
  const DType kv_t = st.kv_dtype;
  const size_t kv_elems = uT * Hkv * D;
  void* kbuf;
  void* vbuf;
  if (kv_t == DType::kF32) {
    kbuf = grow(s.kf, kv_elems);
    vbuf = grow(s.vf, kv_elems);
  } else {
    kbuf = grow(s.k16, kv_elems);
    vbuf = grow(s.v16, kv_elems);
  }
  const TensorView q_view = TensorView::contiguous(qh, DType::kF32, batch, Hq, seq, D);
  const TensorView k_view = TensorView::contiguous(kbuf, kv_t, batch, Hkv, seq, D);
  const TensorView v_view = TensorView::contiguous(vbuf, kv_t, batch, Hkv, seq, D);

  const kernels::MatmulOut qkv[3] = {out_of(*L.q, q), out_of(*L.k, k), out_of(*L.v, v)};
  kernels::matmul_multi(h, T, Hd, Hd, qkv, 3, st.mp);
  // RoPE, then token-major [T, heads, D] -> head-major [B, heads, S, D].
  const float* cos_t = st.cos_t;
  const float* sin_t = st.sin_t;
  for_tokens(T, st.par, [&](int64_t t) {
    const int64_t b = t / seq, si = t % seq;
    apply_rope(q + t * Hq * D, Hq, D, cos_t + si * half, sin_t + si * half, c.rope.style);
    apply_rope(k + t * Hkv * D, Hkv, D, cos_t + si * half, sin_t + si * half, c.rope.style);
    for (int64_t hh = 0; hh < Hq; ++hh)
      std::memcpy(qh + ((b * Hq + hh) * seq + si) * D, q + (t * Hq + hh) * D,
                  static_cast<size_t>(D) * sizeof(float));
    for (int64_t hh = 0; hh < Hkv; ++hh) {
      const size_t dst = static_cast<size_t>(((b * Hkv + hh) * seq + si) * D);
      const float* ks = k + (t * Hkv + hh) * D;
      const float* vs = v + (t * Hkv + hh) * D;
      if (kv_t == DType::kF32) {
        std::memcpy(static_cast<float*>(kbuf) + dst, ks, static_cast<size_t>(D) * sizeof(float));
        std::memcpy(static_cast<float*>(vbuf) + dst, vs, static_cast<size_t>(D) * sizeof(float));
      } else {
        from_f32(ks, static_cast<uint16_t*>(kbuf) + dst, kv_t, static_cast<size_t>(D));
        from_f32(vs, static_cast<uint16_t*>(vbuf) + dst, kv_t, static_cast<size_t>(D));
      }
    }
  });
  UpdateOptions uo;
  uo.queries = st.pass_queries ? &q_view : nullptr;
  const CacheView view = cache.update_and_fetch(k_view, v_view, uo);
  vq::attention(q_view, view, st.ap, attn);
  // [B, H_q, S, D] -> [T, H_q * D]
  for_tokens(T, st.par, [&](int64_t t) {
    const int64_t b = t / seq, si = t % seq;
    for (int64_t hh = 0; hh < Hq; ++hh)
      std::memcpy(attn_t + (t * Hq + hh) * D, attn + ((b * Hq + hh) * seq + si) * D,
                  static_cast<size_t>(D) * sizeof(float));
  });
  linear(*L.o, attn_t, T, h, st.mp);
}

void mlp(const Step& st, const LayerSlice& L, ForwardScratch& s) {
  const int64_t T = st.tokens, Hd = st.cfg->hidden_size, I = L.gate->out;
  const size_t uT = static_cast<size_t>(T);
  float* h = grow(s.h, uT * Hd);
  float* gate = grow(s.gate, uT * I);
  float* up = grow(s.up, uT * I);
  const kernels::MatmulOut gate_up[2] = {out_of(*L.gate, gate), out_of(*L.up, up)};
  kernels::matmul_multi(h, T, Hd, Hd, gate_up, 2, st.mp);
  for_tokens(T, st.par,
             [&](int64_t t) { kernels::swiglu(gate + t * I, up + t * I, I, gate + t * I); });
  linear(*L.down, gate, T, h, st.mp);
}

void finish(const Model& m, const Step& st, const ForwardOptions& opts, ForwardScratch& s,
            std::vector<float>* logits) {
  const ModelConfig& c = *st.cfg;
  const int64_t Hd = c.hidden_size, T = st.tokens, seq = st.seq, batch = st.batch;
  float* x = s.x.data();
  // The last layer's MLP output.
  if (c.n_layers > 0) {
    const float* h = s.h.data();
    for_tokens(T, st.par, [&](int64_t t) {
      for (int64_t i = 0; i < Hd; ++i) x[t * Hd + i] += h[t * Hd + i];
    });
  }
  if (opts.logits == ForwardOptions::Logits::kNone || logits == nullptr) return;
  const bool all = opts.logits == ForwardOptions::Logits::kAll;
  const int64_t per_seq = all ? seq : 1;
  const int64_t n_out = batch * per_seq;
  float* fin = grow(s.logits_in, static_cast<size_t>(n_out * Hd));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < per_seq; ++j) {
      const int64_t t = b * seq + (all ? j : seq - 1);
      kernels::rmsnorm(x + t * Hd, m.final_norm().data(), Hd, c.rms_norm_eps,
                       fin + (b * per_seq + j) * Hd);
    }
  logits->resize(static_cast<size_t>(n_out * c.vocab_size));
  linear(m.lm_head(), fin, n_out, logits->data(), st.mp);
}

}  // namespace fwd

void Model::forward(const int32_t* tokens, int64_t batch, int64_t seq,
                    const std::vector<std::unique_ptr<KVCache>>& caches, const ForwardOptions& opts,
                    std::vector<float>* logits, ForwardScratch* scratch) const {
  const int64_t offset = fwd::check_call(cfg_, tokens, batch, seq, caches);
  ForwardScratch local;
  ForwardScratch& s = scratch ? *scratch : local;
  const fwd::Step st = fwd::begin(*this, tokens, batch, seq, offset, opts, s);
  for (int64_t li = 0; li < cfg_.n_layers; ++li) {
    const fwd::LayerSlice L =
        fwd::layer_slice(layers_[static_cast<size_t>(li)], cfg_.n_heads, cfg_.n_kv_heads);
    fwd::norm_in(st, s, li > 0, *L.attn_norm);
    fwd::attention(st, L, *caches[static_cast<size_t>(li)], s);
    fwd::norm_in(st, s, true, *L.mlp_norm);
    fwd::mlp(st, L, s);
  }
  fwd::finish(*this, st, opts, s, logits);
}

}  // namespace vq
