// The forward pass: matmul kernel vs its scalar reference over awkward shapes and every weight
// dtype; the whole model vs an independent double-precision dense forward written here; the
// metamorphic checks (chunked prefill == one-shot, decode after prefill == last row of the whole
// prefill, batch 2 == two batch-1 runs, sharded == single file); model loading refusals (missing
// or misshapen tensor, unknown model_type, malformed config) naming the culprit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "ops/kernels.h"
#include "util/tiny_model.h"
#include "veloxquant/builder.h"
#include "veloxquant/error.h"
#include "veloxquant/model.h"
#include "veloxquant/safetensors.h"

namespace vq {
namespace {

constexpr double kU = 1.0 / 16777216.0;  // fp32 unit roundoff 2^-24

// ---------------------------------------------------------------------------------------------
// matmul kernel

TEST(Matmul, MatchesReferenceOverShapesAndDtypes) {
  std::mt19937_64 rng(42);
  std::normal_distribution<float> dist(0, 1);
  struct Shape {
    int64_t t, k, n;
  };
  std::vector<Shape> shapes;
  for (int64_t T : {1, 2, 3, 4, 5, 13, 17, 70})
    for (int64_t K : {1, 15, 16, 17, 64, 100})
      for (int64_t N : {1, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33, 70}) shapes.push_back({T, K, N});
  shapes.push_back({5, 2100, 40});  // K past one packed K-block (2048)
  shapes.push_back({1, 2100, 9});
  for (DType wt : {DType::kF32, DType::kF16, DType::kBF16})
    for (const Shape& sh : shapes) {
      const int64_t T = sh.t, K = sh.k, N = sh.n;
      const int64_t ldx = K + 3, ldy = N + 2;  // strided rows
      std::vector<float> x(static_cast<size_t>(T * ldx)), wf(static_cast<size_t>(N * K));
      std::vector<float> bias(static_cast<size_t>(N));
      for (float& v : x) v = dist(rng);
      for (float& v : wf) v = dist(rng);
      for (float& v : bias) v = dist(rng);
      std::vector<uint8_t> w(wf.size() * dtype_size(wt));
      from_f32(wf.data(), w.data(), wt, wf.size());
      const bool with_bias = (T + K + N) % 2 == 0;
      const float* b = with_bias ? bias.data() : nullptr;
      std::vector<float> y(static_cast<size_t>(T * ldy), -7.0f), r = y;
      kernels::matmul(x.data(), T, K, ldx, w.data(), wt, N, b, y.data(), ldy);
      kernels::matmul_reference(x.data(), T, K, ldx, w.data(), wt, N, b, r.data(), ldy);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t n = 0; n < N; ++n) {
          // Both kernel formulations sum fp32 products with FMAs, one rounding per step: the
          // dot-product path over <= K/16 steps per lane plus a 6-level tree, the packed path over
          // K sequential steps in one lane; plus the bias. So |error| <= (K + 6) * u *
          // (sum |x w| + |bias|), and the reference (double, rounded once) adds u * |y|.
          double mag = with_bias ? std::abs(bias[static_cast<size_t>(n)]) : 0.0;
          for (int64_t i = 0; i < K; ++i)
            mag += std::abs(static_cast<double>(x[static_cast<size_t>(t * ldx + i)]) *
                            load_f32(w.data(), wt, static_cast<size_t>(n * K + i)));
          const double tol = (static_cast<double>(K) + 7) * kU * mag;
          ASSERT_NEAR(y[static_cast<size_t>(t * ldy + n)], r[static_cast<size_t>(t * ldy + n)], tol)
              << dtype_name(wt) << " T=" << T << " K=" << K << " N=" << N << " t=" << t
              << " n=" << n;
        }
        // Padding between rows untouched.
        for (int64_t n = N; n < ldy; ++n) ASSERT_EQ(y[static_cast<size_t>(t * ldy + n)], -7.0f);
      }
    }
}

TEST(Matmul, TokenResultIndependentOfTiling) {
  // Within one formulation a token's outputs must not depend on how many tokens share the call
  // or where it sits in a tile (the same summation order in every micro-kernel shape): the
  // decode path for 1-3 tokens, the packed path from 4 tokens on. This is what makes chunked
  // prefill in chunks of >= 4 tokens bit-identical to one-shot prefill.
  std::mt19937_64 rng(5);
  std::normal_distribution<float> dist(0, 1);
  const int64_t K = 88, N = 37, T = 29;
  std::vector<float> x(static_cast<size_t>(T * K)), w(static_cast<size_t>(N * K));
  for (float& v : x) v = dist(rng);
  for (float& v : w) v = dist(rng);
  std::vector<float> all(static_cast<size_t>(T * N)), part(static_cast<size_t>(T * N));
  kernels::matmul(x.data(), T, K, K, w.data(), DType::kF32, N, nullptr, all.data(), N);
  for (int64_t len : {4, 5, 12, 13, 25})
    for (int64_t t0 = 0; t0 + len <= T; t0 += 3) {
      kernels::matmul(x.data() + t0 * K, len, K, K, w.data(), DType::kF32, N, nullptr, part.data(),
                      N);
      for (int64_t i = 0; i < len * N; ++i)
        ASSERT_EQ(part[static_cast<size_t>(i)], all[static_cast<size_t>(t0 * N + i)])
            << "len " << len << " t0 " << t0;
    }
  std::vector<float> three(static_cast<size_t>(3 * N)), one(static_cast<size_t>(N));
  kernels::matmul(x.data(), 3, K, K, w.data(), DType::kF32, N, nullptr, three.data(), N);
  for (int64_t t = 0; t < 3; ++t) {
    kernels::matmul(x.data() + t * K, 1, K, K, w.data(), DType::kF32, N, nullptr, one.data(), N);
    for (int64_t n = 0; n < N; ++n)
      ASSERT_EQ(one[static_cast<size_t>(n)], three[static_cast<size_t>(t * N + n)]);
  }
}

TEST(Matmul, MultiEqualsSeparateCalls) {
  // matmul_multi runs the same units as separate matmul calls, only in one parallel region.
  std::mt19937_64 rng(8);
  std::normal_distribution<float> dist(0, 1);
  const int64_t K = 40;
  const DType types[3] = {DType::kBF16, DType::kF32, DType::kF16};
  const int64_t ns[3] = {37, 8, 70};
  for (int64_t T : {1, 2, 3, 4, 13}) {
    std::vector<float> x(static_cast<size_t>(T * K));
    for (float& v : x) v = dist(rng);
    std::vector<std::vector<uint8_t>> w(3);
    std::vector<std::vector<float>> y(3), ref(3), bias(3);
    kernels::MatmulOut outs[3];
    for (int i = 0; i < 3; ++i) {
      std::vector<float> wf(static_cast<size_t>(ns[i] * K));
      for (float& v : wf) v = dist(rng);
      w[i].resize(wf.size() * dtype_size(types[i]));
      from_f32(wf.data(), w[i].data(), types[i], wf.size());
      bias[i].resize(static_cast<size_t>(ns[i]));
      for (float& v : bias[i]) v = dist(rng);
      y[i].assign(static_cast<size_t>(T * ns[i]), 0.0f);
      ref[i] = y[i];
      outs[i] = {w[i].data(), types[i], ns[i], i == 1 ? bias[i].data() : nullptr,
                 y[i].data(), ns[i]};
      kernels::matmul(x.data(), T, K, K, w[i].data(), types[i], ns[i], outs[i].bias, ref[i].data(),
                      ns[i]);
    }
    kernels::matmul_multi(x.data(), T, K, K, outs, 3);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(y[i], ref[i]) << "T " << T << " output " << i;
  }
}

TEST(Kernels, RmsNormAndSwiglu) {
  const std::vector<float> x = {1.0f, -2.0f, 3.0f, 0.5f}, w = {1.0f, 0.5f, 2.0f, -1.0f};
  std::vector<float> out(4);
  kernels::rmsnorm(x.data(), w.data(), 4, 1e-5, out.data());
  const double ms = (1 + 4 + 9 + 0.25) / 4.0;
  for (size_t i = 0; i < 4; ++i)
    EXPECT_NEAR(out[i], w[i] * x[i] / std::sqrt(ms + 1e-5), 4 * kU * std::abs(w[i] * x[i]));
  const std::vector<float> g = {-3.0f, 0.0f, 2.5f}, u = {2.0f, 5.0f, -1.0f};
  std::vector<float> s(3);
  kernels::swiglu(g.data(), u.data(), 3, s.data());
  for (size_t i = 0; i < 3; ++i) {
    const double e = g[i] / (1 + std::exp(-static_cast<double>(g[i]))) * u[i];
    EXPECT_NEAR(s[i], e, 8 * kU * std::abs(e) + 1e-30);  // exp, add, divide, multiply in fp32
  }
}

// The vectorised RMSNorm and SwiGLU over lengths with ragged tails, against double references.
TEST(Kernels, RmsNormAndSwigluLongRows) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int64_t n : {1, 15, 16, 17, 384, 1024, 1037}) {
    std::vector<float> x(static_cast<size_t>(n)), w(x.size()), out(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = nd(rng);
      w[i] = nd(rng);
    }
    kernels::rmsnorm(x.data(), w.data(), n, 1e-5, out.data());
    double ss = 0;
    for (float v : x) ss += double(v) * v;
    const double inv = 1.0 / std::sqrt(ss / double(n) + 1e-5);
    for (size_t i = 0; i < x.size(); ++i) {
      // inv rounded to fp32, then two fp32 products: 3 roundings (+ the double sum, ~n 2^-53).
      const double e = double(w[i]) * x[i] * inv;
      ASSERT_NEAR(out[i], e, 4 * kU * std::abs(e)) << "n " << n << " i " << i;
    }
    // Gates over the whole range: large negative ones flush e^g to 0, large positive give g.
    std::vector<float> g(x.size()), u(x.size()), s(x.size());
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = i % 7 == 0 ? nd(rng) * 40.0f : nd(rng);
      u[i] = nd(rng);
    }
    kernels::swiglu(g.data(), u.data(), n, s.data());
    for (size_t i = 0; i < g.size(); ++i) {
      const double e = g[i] / (1 + std::exp(-static_cast<double>(g[i]))) * u[i];
      // exp within 1.41 u (enters the sigmoid with a factor <= 1), then 1 + e, the division,
      // the product with g (g < 0) and with up: 1.41 + 4 * 0.5 = 3.41 u; 1e-30 absolute for
      // the flushed exp (|g| e^-87 < 1e-30 for |g| < 1e7).
      ASSERT_NEAR(s[i], e, 3.5 * kU * std::abs(e) + 1e-30) << "n " << n << " g " << g[i];
    }
    kernels::swiglu(g.data(), u.data(), n, g.data());  // in place (the forward pass does this)
    EXPECT_EQ(g, s);
  }
}

// ---------------------------------------------------------------------------------------------
// An independent dense forward in double over the checkpoint, every position attending to all
// earlier ones (no cache). Returns logits [S, vocab].

std::vector<double> dense_reference(const std::string& dir, const std::vector<int32_t>& ids) {
  const ModelConfig c = load_model_config(dir);
  const Safetensors st = Safetensors::open_dir(dir);
  const int64_t S = static_cast<int64_t>(ids.size()), H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.n_heads, Hkv = c.n_kv_heads, I = c.intermediate_size, V = c.vocab_size;
  auto W = [&](const std::string& name) { return &st.get(name); };
  auto matvec = [&](const TensorRef* w, const TensorRef* b, const std::vector<double>& x) {
    const int64_t out = w->shape[0], in = w->shape[1];
    std::vector<double> y(static_cast<size_t>(out));
    for (int64_t o = 0; o < out; ++o) {
      double s = b ? b->at(static_cast<size_t>(o)) : 0.0;
      for (int64_t i = 0; i < in; ++i)
        s += w->at(static_cast<size_t>(o * in + i)) * x[static_cast<size_t>(i)];
      y[static_cast<size_t>(o)] = s;
    }
    return y;
  };
  auto norm = [&](const std::vector<double>& x, const TensorRef* w) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + c.rms_norm_eps);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w->at(i);
    return y;
  };
  auto rope = [&](std::vector<double>& v, int64_t heads, int64_t pos) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < D / 2; ++i) {
        const double th = static_cast<double>(pos) * std::pow(c.rope.theta, -2.0 * i / D);
        double& a = v[static_cast<size_t>(h * D + i)];
        double& b = v[static_cast<size_t>(h * D + i + D / 2)];
        const double a0 = a, b0 = b;
        a = a0 * std::cos(th) - b0 * std::sin(th);
        b = b0 * std::cos(th) + a0 * std::sin(th);
      }
  };
  std::vector<std::vector<double>> x(static_cast<size_t>(S));
  const TensorRef* emb = W("model.embed_tokens.weight");
  for (int64_t s = 0; s < S; ++s) {
    x[static_cast<size_t>(s)].resize(static_cast<size_t>(H));
    for (int64_t i = 0; i < H; ++i)
      x[static_cast<size_t>(s)][static_cast<size_t>(i)] =
          emb->at(static_cast<size_t>(ids[static_cast<size_t>(s)] * H + i));
  }
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    auto bias = [&](const std::string& n) { return st.contains(n) ? W(n) : nullptr; };
    std::vector<std::vector<double>> q(static_cast<size_t>(S)), k(static_cast<size_t>(S)),
        v(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) {
      const auto h = norm(x[static_cast<size_t>(s)], W(p + "input_layernorm.weight"));
      q[static_cast<size_t>(s)] =
          matvec(W(p + "self_attn.q_proj.weight"), bias(p + "self_attn.q_proj.bias"), h);
      k[static_cast<size_t>(s)] =
          matvec(W(p + "self_attn.k_proj.weight"), bias(p + "self_attn.k_proj.bias"), h);
      v[static_cast<size_t>(s)] =
          matvec(W(p + "self_attn.v_proj.weight"), bias(p + "self_attn.v_proj.bias"), h);
      rope(q[static_cast<size_t>(s)], Hq, s);
      rope(k[static_cast<size_t>(s)], Hkv, s);
    }
    for (int64_t s = 0; s < S; ++s) {
      std::vector<double> att(static_cast<size_t>(Hq * D), 0.0);
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const int64_t hk = hq / (Hq / Hkv);
        std::vector<double> logit(static_cast<size_t>(s + 1));
        double mx = -1e300;
        for (int64_t j = 0; j <= s; ++j) {
          double d = 0;
          for (int64_t i = 0; i < D; ++i)
            d += q[static_cast<size_t>(s)][static_cast<size_t>(hq * D + i)] *
                 k[static_cast<size_t>(j)][static_cast<size_t>(hk * D + i)];
          logit[static_cast<size_t>(j)] = d / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, logit[static_cast<size_t>(j)]);
        }
        double den = 0;
        for (double& lg : logit) den += (lg = std::exp(lg - mx));
        for (int64_t j = 0; j <= s; ++j)
          for (int64_t i = 0; i < D; ++i)
            att[static_cast<size_t>(hq * D + i)] +=
                logit[static_cast<size_t>(j)] / den *
                v[static_cast<size_t>(j)][static_cast<size_t>(hk * D + i)];
      }
      const auto o =
          matvec(W(p + "self_attn.o_proj.weight"), bias(p + "self_attn.o_proj.bias"), att);
      for (int64_t i = 0; i < H; ++i)
        x[static_cast<size_t>(s)][static_cast<size_t>(i)] += o[static_cast<size_t>(i)];
      const auto h = norm(x[static_cast<size_t>(s)], W(p + "post_attention_layernorm.weight"));
      auto g = matvec(W(p + "mlp.gate_proj.weight"), nullptr, h);
      const auto u = matvec(W(p + "mlp.up_proj.weight"), nullptr, h);
      for (int64_t i = 0; i < I; ++i) {
        const double gv = g[static_cast<size_t>(i)];
        g[static_cast<size_t>(i)] = gv / (1 + std::exp(-gv)) * u[static_cast<size_t>(i)];
      }
      const auto d = matvec(W(p + "mlp.down_proj.weight"), nullptr, g);
      for (int64_t i = 0; i < H; ++i)
        x[static_cast<size_t>(s)][static_cast<size_t>(i)] += d[static_cast<size_t>(i)];
    }
  }
  const TensorRef* head = c.tie_word_embeddings ? emb : W("lm_head.weight");
  std::vector<double> out(static_cast<size_t>(S * V));
  for (int64_t s = 0; s < S; ++s) {
    const auto h = norm(x[static_cast<size_t>(s)], W("model.norm.weight"));
    const auto lg = matvec(head, nullptr, h);
    std::copy(lg.begin(), lg.end(), out.begin() + s * V);
  }
  return out;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return ids;
}

std::vector<std::unique_ptr<KVCache>> full_caches(const Model& m) {
  CacheConfig cfg;
  cfg.method = "full";
  return m.make_caches(cfg);
}

// Logits of every position, fed in the given chunk lengths (fp32 K/V: the cache is exact).
std::vector<float> run_chunks(const Model& m, const std::vector<int32_t>& ids,
                              const std::vector<int64_t>& chunks, DType kv = DType::kF32) {
  auto caches = full_caches(m);
  ForwardOptions fo;
  fo.kv_dtype = kv;
  fo.logits = ForwardOptions::Logits::kAll;
  std::vector<float> all, part;
  int64_t done = 0;
  for (int64_t n : chunks) {
    m.forward(ids.data() + done, 1, n, caches, fo, &part);
    all.insert(all.end(), part.begin(), part.end());
    done += n;
  }
  EXPECT_EQ(done, static_cast<int64_t>(ids.size()));
  return all;
}

struct ForwardCase {
  std::string name;
  test::TinyModelSpec spec;
};

std::vector<ForwardCase> forward_cases() {
  std::vector<ForwardCase> cs;
  cs.push_back({"llama_f32_gqa", {}});
  test::TinyModelSpec q;
  q.model_type = "qwen2";
  q.tie_word_embeddings = true;
  q.n_kv_heads = 1;  // GQA ratio 4
  cs.push_back({"qwen2_bias_tied", q});
  test::TinyModelSpec b;
  b.dtype = DType::kBF16;
  b.explicit_head_dim = true;
  b.head_dim = 32;   // head_dim != hidden / heads
  b.n_kv_heads = 4;  // MHA
  cs.push_back({"llama_bf16_headdim32", b});
  test::TinyModelSpec f;
  f.model_type = "mistral";
  f.dtype = DType::kF16;
  cs.push_back({"mistral_f16", f});
  return cs;
}

TEST(Forward, MatchesDenseDoubleReference) {
  for (const auto& fc : forward_cases()) {
    SCOPED_TRACE(fc.name);
    const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-fwd"), fc.spec);
    const auto m = Model::load(dir);
    const auto ids = random_ids(41, fc.spec.vocab_size, 11);
    const std::vector<float> got = run_chunks(*m, ids, {41});
    const std::vector<double> ref = dense_reference(dir, ids);
    ASSERT_EQ(got.size(), ref.size());
    // Tolerance: our pass is fp32 (weights exact in fp32, K/V kept fp32); the reference double.
    // Every stage is a sum of at most K = max(hidden, intermediate) = 88 terms or a softmax over
    // <= 41 keys, each erring by at most ~K/16 + 7 roundings (the kernel's lanes) relative to
    // its sum of absolute terms, and two layers chain about 12 such stages: about
    // 12 * 13 * 2^-24 ~ 1e-5 relative to the magnitudes involved. The fp32 RoPE angle adds
    // 3 * 40 * 2^-24 relative. The logits' absolute terms sum to a few times their RMS, so we
    // allow 1e-4 x the row's largest |logit| (10x headroom over the estimate).
    const int64_t V = fc.spec.vocab_size;
    double used = 0;
    for (int64_t s = 0; s < 41; ++s) {
      double mx = 0;
      for (int64_t v = 0; v < V; ++v)
        mx = std::max(mx, std::abs(ref[static_cast<size_t>(s * V + v)]));
      ASSERT_GT(mx, 0.1);  // the reference is not degenerate
      for (int64_t v = 0; v < V; ++v) {
        const double err =
            std::abs(got[static_cast<size_t>(s * V + v)] - ref[static_cast<size_t>(s * V + v)]);
        used = std::max(used, err / (1e-4 * mx));
        ASSERT_LE(err, 1e-4 * mx) << "position " << s << " token " << v;
      }
    }
    std::printf("  %s: max error %.1f%% of tolerance\n", fc.name.c_str(), 100 * used);
    std::filesystem::remove_all(dir);
  }
}

TEST(Forward, ChunkedPrefillEqualsOneShot) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-fwd"));
  const auto m = Model::load(dir);
  const auto ids = random_ids(75, 320, 3);
  const std::vector<float> one = run_chunks(*m, ids, {75});
  // With the full cache and fp32 K/V, a token's projections do not depend on its chunk-mates
  // as long as every chunk has >= 4 tokens (Matmul.TokenResultIndependentOfTiling), RoPE uses
  // the same absolute positions and attention reads the same keys in the same order, so those
  // logits are identical. Chunks of 1-3 tokens take the decode matmul path, whose summation
  // order differs (each projection within (K + 6) * 2^-24 of its terms' magnitude, K <= 88),
  // and the attention kernel may block its online softmax over n <= 75 keys differently
  // (~n * 2^-24): ~160 * 2^-24 relative per stage, through 2 layers with a gain of a few
  // (<= 8): we allow 16 * 75 * 2^-24 (= 1200 * 2^-24) of the largest |logit|.
  for (const std::vector<int64_t>& chunks : std::vector<std::vector<int64_t>>{
           {1, 74}, {32, 32, 11}, {10, 20, 30, 15}, {74, 1}, std::vector<int64_t>(75, 1)}) {
    const std::vector<float> got = run_chunks(*m, ids, chunks);
    ASSERT_EQ(got.size(), one.size());
    float mx = 0;
    for (float v : one) mx = std::max(mx, std::abs(v));
    double worst = 0;
    for (size_t i = 0; i < one.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(got[i] - one[i])));
    EXPECT_LE(worst, 75 * kU * 16 * mx) << "chunks of " << chunks.size();
    std::printf("  %zu chunks: max |difference| %.3g (%.1f%% of tolerance)\n", chunks.size(), worst,
                100 * worst / (75 * kU * 16 * mx));
  }
  std::filesystem::remove_all(dir);
}

TEST(Forward, DecodeAfterPrefillEqualsLastRowOfWholePrefill) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-fwd"));
  const auto m = Model::load(dir);
  const auto ids = random_ids(50, 320, 8);
  for (DType kv : {DType::kF32, DType::kF16}) {
    const std::vector<float> whole = run_chunks(*m, ids, {50}, kv);
    auto caches = full_caches(*m);
    ForwardOptions fo;
    fo.kv_dtype = kv;
    fo.logits = ForwardOptions::Logits::kNone;
    m->forward(ids.data(), 1, 49, caches, fo, nullptr);
    fo.logits = ForwardOptions::Logits::kLast;
    std::vector<float> last;
    m->forward(ids.data() + 49, 1, 1, caches, fo, &last);
    ASSERT_EQ(last.size(), 320u);
    float mx = 0;
    for (float v : last) mx = std::max(mx, std::abs(v));
    for (size_t v = 0; v < 320; ++v)  // same allowance as ChunkedPrefillEqualsOneShot
      ASSERT_NEAR(last[v], whole[49 * 320 + v], 50 * kU * 16 * mx) << dtype_name(kv) << " " << v;
  }
  std::filesystem::remove_all(dir);
}

TEST(Forward, BatchOfTwoEqualsTwoSingleRuns) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-fwd"));
  const auto m = Model::load(dir);
  const auto a = random_ids(20, 320, 1), b = random_ids(20, 320, 2);
  std::vector<int32_t> ab = a;
  ab.insert(ab.end(), b.begin(), b.end());
  CacheConfig cfg;
  auto caches = m->make_caches(cfg);
  ForwardOptions fo;
  fo.kv_dtype = DType::kF32;
  fo.logits = ForwardOptions::Logits::kAll;
  std::vector<float> both;
  m->forward(ab.data(), 2, 20, caches, fo, &both);
  const auto la = run_chunks(*m, a, {20}), lb = run_chunks(*m, b, {20});
  ASSERT_EQ(both.size(), la.size() + lb.size());
  float mx = 0;
  for (float v : both) mx = std::max(mx, std::abs(v));
  for (size_t i = 0; i < la.size(); ++i) {  // allowance of ChunkedPrefillEqualsOneShot
    ASSERT_NEAR(both[i], la[i], 20 * kU * 16 * mx);
    ASSERT_NEAR(both[la.size() + i], lb[i], 20 * kU * 16 * mx);
  }
  // A decode step for both sequences at once.
  const int32_t next[2] = {5, 9};
  std::vector<float> step;
  fo.logits = ForwardOptions::Logits::kLast;
  m->forward(next, 2, 1, caches, fo, &step);
  EXPECT_EQ(step.size(), 2u * 320u);
  std::filesystem::remove_all(dir);
}

TEST(Forward, ShardedCheckpointEqualsSingleFile) {
  test::TinyModelSpec spec;
  const std::string d1 = test::write_tiny_model(test::make_temp_dir("vq-fwd"), spec);
  spec.n_shards = 3;
  const std::string d3 = test::write_tiny_model(test::make_temp_dir("vq-fwd"), spec);
  ASSERT_TRUE(std::filesystem::exists(d3 + "/model.safetensors.index.json"));
  const auto ids = random_ids(12, 320, 4);
  const auto l1 = run_chunks(*Model::load(d1), ids, {12});
  const auto l3 = run_chunks(*Model::load(d3), ids, {12});
  EXPECT_EQ(l1, l3);  // same bytes, same code: identical
  std::filesystem::remove_all(d1);
  std::filesystem::remove_all(d3);
}

TEST(Forward, BadInputsRefused) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-fwd"));
  const auto m = Model::load(dir);
  auto caches = full_caches(*m);
  ForwardOptions fo;
  std::vector<float> out;
  const int32_t bad[2] = {3, 320};
  EXPECT_THROW(m->forward(bad, 1, 2, caches, fo, &out), Error);
  EXPECT_EQ(caches[0]->offset(), 0);  // nothing stored
  const int32_t ok[1] = {3};
  EXPECT_THROW(m->forward(ok, 1, 0, caches, fo, &out), Error);
  std::vector<std::unique_ptr<KVCache>> too_few;
  too_few.push_back(make_cache(CacheConfig{}));
  EXPECT_THROW(m->forward(ok, 1, 1, too_few, fo, &out), Error);
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Loading refusals

void rewrite_without(const std::string& dir, const std::string& drop, const std::string& reshape) {
  const std::string path = dir + "/model.safetensors";
  std::vector<TensorToWrite> ts;
  {
    const Safetensors st = Safetensors::open_file(path);
    for (const auto& name : st.names()) {
      if (name == drop) continue;
      const TensorRef& r = st.get(name);
      TensorToWrite w{name, r.dtype, r.shape, {}};
      const auto* p = static_cast<const uint8_t*>(r.data);
      w.bytes.assign(p, p + r.nbytes);
      if (name == reshape) {  // transpose the declared shape of a 2-D tensor
        std::swap(w.shape[0], w.shape[1]);
      }
      ts.push_back(std::move(w));
    }
  }
  save_safetensors(path + ".tmp", ts);
  std::filesystem::rename(path + ".tmp", path);
}

void expect_load_refused(const std::string& dir, std::initializer_list<const char*> needles) {
  try {
    Model::load(dir);
    FAIL() << "expected a vq::Error";
  } catch (const Error& e) {
    for (const char* n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << "\n lacks " << n;
  }
}

TEST(ModelLoad, MissingOrMisshapenTensorRefused) {
  {
    const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-load"));
    rewrite_without(dir, "model.layers.1.mlp.up_proj.weight", "");
    expect_load_refused(dir, {"tensor 'model.layers.1.mlp.up_proj.weight' not found"});
    std::filesystem::remove_all(dir);
  }
  {
    const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-load"));
    rewrite_without(dir, "", "model.layers.0.self_attn.k_proj.weight");
    expect_load_refused(dir, {"tensor 'model.layers.0.self_attn.k_proj.weight'",
                              "expected shape [32, 64] but got [64, 32]"});
    std::filesystem::remove_all(dir);
  }
  {
    test::TinyModelSpec spec;  // untied config without lm_head.weight
    const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-load"), spec);
    rewrite_without(dir, "lm_head.weight", "");
    expect_load_refused(dir, {"tensor 'lm_head.weight' not found"});
    std::filesystem::remove_all(dir);
  }
  {
    test::TinyModelSpec spec;
    spec.model_type = "qwen2";  // q/k/v biases required
    const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-load"), spec);
    rewrite_without(dir, "model.layers.0.self_attn.v_proj.bias", "");
    expect_load_refused(dir, {"model.layers.0.self_attn.v_proj.bias"});
    std::filesystem::remove_all(dir);
  }
}

TEST(ModelLoad, BadConfigOrFilesRefused) {
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-load"));
  const std::string good = test::tiny_model_config_json({});
  std::string bad = good;
  bad.replace(bad.find("\"llama\""), 7, "\"falcon\"");
  std::ofstream(dir + "/config.json") << bad;
  expect_load_refused(dir, {"model_type", "expected one of llama, mistral, qwen2", "falcon"});
  std::ofstream(dir + "/config.json") << "{ not json";
  expect_load_refused(dir, {"config.json", "not valid JSON"});
  std::filesystem::remove(dir + "/config.json");
  expect_load_refused(dir, {"cannot read", "config.json"});
  std::ofstream(dir + "/config.json") << good;
  std::filesystem::resize_file(dir + "/model.safetensors",
                               std::filesystem::file_size(dir + "/model.safetensors") - 100);
  expect_load_refused(dir, {"[safetensors]", "runs past the data section"});
  std::filesystem::remove(dir + "/model.safetensors");
  expect_load_refused(dir, {"expected model.safetensors"});
  std::filesystem::remove_all(dir);
}

// NaN/Inf weights are refused at load naming the tensor and the element (every dtype), unless
// LoadOptions::check_finite is off.
TEST(ModelLoad, NonFiniteWeightsRefusedUnlessOptedOut) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(t));
    test::TinyModelSpec spec;
    spec.dtype = t;
    const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-load-nan"), spec);
    ASSERT_NO_THROW(Model::load(dir));
    test::poke_tiny_model_weight(dir, "model.layers.1.mlp.down_proj.weight", 17, std::nanf(""));
    expect_load_refused(dir, {"model.layers.1.mlp.down_proj.weight", "expected finite weights",
                              "element 17 is nan", "--no-check-weights"});
    LoadOptions lo;
    lo.check_finite = false;
    EXPECT_NO_THROW(Model::load(dir, lo));
    test::poke_tiny_model_weight(dir, "model.layers.1.mlp.down_proj.weight", 17, 0.5f);
    test::poke_tiny_model_weight(dir, "model.norm.weight", 5, -INFINITY);
    expect_load_refused(dir, {"model.norm.weight", "element 5 is -inf"});
    std::filesystem::remove_all(dir);
  }
}

// A config that uses fewer layers than the checkpoint holds is refused naming the unused
// tensors (a few of them), unless LoadOptions::allow_unused_tensors.
TEST(ModelLoad, UnusedCheckpointTensorsRefused) {
  test::TinyModelSpec spec;
  spec.n_layers = 3;
  const std::string dir = test::write_tiny_model(test::make_temp_dir("vq-load-unused"), spec);
  ASSERT_NO_THROW(Model::load(dir));
  spec.n_layers = 2;
  std::ofstream(dir + "/config.json") << test::tiny_model_config_json(spec);
  expect_load_refused(dir, {"expected every checkpoint tensor to be used", "(2 layers)",
                            "9 are not", "model.layers.2.", "(4 more)"});
  LoadOptions lo;
  lo.allow_unused_tensors = true;
  EXPECT_EQ(Model::load(dir, lo)->config().n_layers, 2);
  std::filesystem::remove_all(dir);
}

// A tokenizer with ids the model cannot embed is refused naming both sizes; a smaller one (a
// padded model vocabulary) is accepted.
TEST(ModelLoad, TokenizerLargerThanTheModelRefused) {
  ModelConfig c;
  c.vocab_size = 320;
  EXPECT_NO_THROW(check_tokenizer_vocab(320, c));
  EXPECT_NO_THROW(check_tokenizer_vocab(300, c));
  try {
    check_tokenizer_vocab(512, c, "tok.json");
    FAIL() << "a 512-id tokenizer on a 320-id model was accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("at most 320 ids"), std::string::npos) << m;
    EXPECT_NE(m.find("tok.json has 512"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace vq
