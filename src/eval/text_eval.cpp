// Perplexity, KL divergence and attention-output error under compressed caches (docs/design.md §5
// §1, §2, §4), with the text protocol of veloxquant/eval.h: prefill x[0, P-1) in chunks, then T
// decode steps feeding x[P-1 .. P+T-2], step t scoring x[P+t].
//
// Per document the full cache runs first and keeps its logits [T, vocab] (fp32, as the model
// produced them); each method then runs the same steps and every scored token is compared with
// the stored full-cache logits: NLL of the target, KL(p_full || p_method) and top-1 agreement,
// all from log-softmax in double. Identical logits give KL = 0 and the same NLL bit for bit, so
// the full cache listed as a method reports delta = 0 exactly (a check of determinism).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>

#include "eval/eval_internal.h"
#include "veloxquant/error.h"
#include "veloxquant/eval.h"
#include "veloxquant/model.h"

namespace vq {

using eval_detail::Caches;

namespace {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

void check_text_inputs(const Model& model, const std::vector<std::vector<int32_t>>& docs,
                       const TextEvalOptions& opts, int64_t n_docs) {
  VQ_CHECK(opts.prefill >= 1,
           "[eval] expected prefill P >= 1 but got " + std::to_string(opts.prefill));
  VQ_CHECK(opts.decode >= 1,
           "[eval] expected decode T >= 1 but got " + std::to_string(opts.decode));
  VQ_CHECK(n_docs >= 1, "[eval] expected at least one document but got 0");
  const int64_t need = opts.prefill + opts.decode;
  const int64_t max_pos = model.config().max_position_embeddings;
  VQ_CHECK(max_pos <= 0 || need <= max_pos,
           "[eval] expected P + T <= the model's max_position_embeddings " +
               std::to_string(max_pos) + " but got " + std::to_string(need));
  for (int64_t d = 0; d < n_docs; ++d)
    VQ_CHECK(static_cast<int64_t>(docs[static_cast<size_t>(d)].size()) >= need,
             "[eval] expected documents of at least P + T = " + std::to_string(need) +
                 " tokens but document " + std::to_string(d) + " has " +
                 std::to_string(docs[static_cast<size_t>(d)].size()));
}

int64_t doc_count(const std::vector<std::vector<int32_t>>& docs, int64_t max_docs) {
  const int64_t n = static_cast<int64_t>(docs.size());
  return max_docs > 0 ? std::min(n, max_docs) : n;
}

CacheConfig full_config() {
  CacheConfig c;
  c.method = "full";
  return c;
}

}  // namespace

std::vector<std::vector<int32_t>> load_token_rows_u16(const std::string& path, int64_t row_len) {
  VQ_CHECK(row_len >= 1, "[eval] expected row_len >= 1 but got " + std::to_string(row_len));
  std::ifstream in(path, std::ios::binary);
  VQ_CHECK(in.is_open(), "[eval] expected a readable token file but could not open '" + path + "'");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t row_bytes = static_cast<size_t>(row_len) * 2;
  VQ_CHECK(!bytes.empty() && bytes.size() % row_bytes == 0,
           "[eval] expected '" + path + "' to hold whole rows of " + std::to_string(row_len) +
               " uint16 ids but it has " + std::to_string(bytes.size()) + " bytes");
  std::vector<std::vector<int32_t>> rows(bytes.size() / row_bytes);
  for (size_t r = 0; r < rows.size(); ++r) {
    rows[r].resize(static_cast<size_t>(row_len));
    for (int64_t i = 0; i < row_len; ++i) {
      const auto lo = static_cast<uint8_t>(bytes[r * row_bytes + 2 * i]);
      const auto hi = static_cast<uint8_t>(bytes[r * row_bytes + 2 * i + 1]);
      rows[r][static_cast<size_t>(i)] = static_cast<int32_t>(lo | (hi << 8));
    }
  }
  return rows;
}

TextEvalResult eval_text(const Model& model, const std::vector<std::vector<int32_t>>& docs,
                         const std::vector<EvalMethod>& methods, const TextEvalOptions& opts,
                         const EvalSettings& settings) {
  const int64_t n_docs = doc_count(docs, opts.max_docs);
  check_text_inputs(model, docs, opts, n_docs);
  const int64_t V = model.config().vocab_size;
  const int64_t P = opts.prefill, T = opts.decode;

  TextEvalResult res;
  res.options = opts;
  res.settings = settings;
  res.n_docs = n_docs;
  res.rows.resize(methods.size());
  for (size_t m = 0; m < methods.size(); ++m) {
    res.rows[m].label = methods[m].label;
    res.rows[m].family = methods[m].family;
  }
  std::vector<double> nll_sum(methods.size(), 0.0), top1_sum(methods.size(), 0.0);
  std::vector<double> rows_end_sum(methods.size(), 0.0);
  std::vector<std::vector<double>> kls(methods.size());
  std::vector<std::vector<MemoryFigures>> mems(methods.size());
  double nll_full = 0;
  std::vector<MemoryFigures> mem_full;

  ForwardScratch scratch;
  std::vector<float> logits;
  std::vector<float> full_logits(static_cast<size_t>(T * V));
  std::vector<int64_t> full_top(static_cast<size_t>(T));
  std::vector<double> lp_f, lp_m;
  eval_detail::Progress prog(settings.progress, opts.kld ? "kld" : "ppl");
  const int64_t mem_step = memory_step(opts);

  // Runs P-1 prefill tokens and T decode steps; calls score(t, logits) after each step.
  // On settings.device (one engine for every sequence of the run; null on the CPU with one rank).
  const std::unique_ptr<Engine> engine = eval_detail::make_eval_engine(model, settings, methods);
  auto run = [&](const CacheConfig& cfg, auto&& score, MemoryFigures* mem, double* rows_end,
                 const std::vector<int32_t>& ids) {
    eval_detail::EvalSeq seq(model, engine.get(), cfg, settings, scratch);
    seq.prefill(ids.data(), P - 1, nullptr);
    for (int64_t t = 0; t < T; ++t) {
      seq.decode(ids[static_cast<size_t>(P - 1 + t)], &logits);
      if (t == mem_step) *mem = seq.memory();
      score(t, logits.data());
    }
    *rows_end = seq.memory().rows_kept;
  };

  for (int64_t d = 0; d < n_docs; ++d) {
    const std::vector<int32_t>& ids = docs[static_cast<size_t>(d)];
    // Baseline: the full cache, logits kept.
    MemoryFigures mf;
    double rows_end_full = 0;
    run(
        full_config(),
        [&](int64_t t, const float* lg) {
          std::copy(lg, lg + V, full_logits.begin() + t * V);
          full_top[static_cast<size_t>(t)] = eval_detail::argmax(lg, V);
          eval_detail::log_softmax(lg, V, lp_f);
          nll_full -= lp_f[static_cast<size_t>(ids[static_cast<size_t>(P + t)])];
        },
        &mf, &rows_end_full, ids);
    mem_full.push_back(mf);
    res.rows_end_full += rows_end_full / static_cast<double>(n_docs);
    prog.line("doc " + std::to_string(d + 1) + "/" + std::to_string(n_docs) + " full done", true);

    for (size_t m = 0; m < methods.size(); ++m) {
      MemoryFigures mm;
      double rows_end = 0;
      run(
          config_for_context(methods[m], P),
          [&](int64_t t, const float* lg) {
            eval_detail::log_softmax(lg, V, lp_m);
            nll_sum[m] -= lp_m[static_cast<size_t>(ids[static_cast<size_t>(P + t)])];
            if (eval_detail::argmax(lg, V) == full_top[static_cast<size_t>(t)]) top1_sum[m] += 1;
            if (opts.kld) {
              eval_detail::log_softmax(full_logits.data() + t * V, V, lp_f);
              double kl = 0;
              for (int64_t i = 0; i < V; ++i) {
                const double lf = lp_f[static_cast<size_t>(i)];
                kl += std::exp(lf) * (lf - lp_m[static_cast<size_t>(i)]);
              }
              kls[m].push_back(kl);
            }
          },
          &mm, &rows_end, ids);
      mems[m].push_back(mm);
      rows_end_sum[m] += rows_end;
      prog.line("doc " + std::to_string(d + 1) + "/" + std::to_string(n_docs) + " " +
                methods[m].label + " running ppl " +
                fmt("%.4f", std::exp(nll_sum[m] / static_cast<double>((d + 1) * T))) + " (full " +
                fmt("%.4f", std::exp(nll_full / static_cast<double>((d + 1) * T))) + ")");
    }
  }

  // Memory at the context of memory_step(opts): mean over documents (every document has the same
  // P, so the figures of a method only differ by allocation history; the mean keeps integers exact
  // when they agree).
  auto mean_mem = [](const std::vector<MemoryFigures>& v) {
    MemoryFigures m;
    if (v.empty()) return m;
    double rows = 0, acc = 0, res = 0, fp = 0;
    for (const auto& x : v) {
      rows += x.rows_kept;
      acc += static_cast<double>(x.bytes_accounted);
      res += static_cast<double>(x.bytes_resident);
      fp += static_cast<double>(x.fp16_bytes);
    }
    const double n = static_cast<double>(v.size());
    m.context = v.front().context;
    m.rows_kept = rows / n;
    m.bytes_accounted = static_cast<int64_t>(std::llround(acc / n));
    m.bytes_resident = static_cast<int64_t>(std::llround(res / n));
    m.fp16_bytes = static_cast<int64_t>(std::llround(fp / n));
    return m;
  };
  const double n_tok = static_cast<double>(n_docs * T);
  res.ppl_full = std::exp(nll_full / n_tok);
  res.mem_full = mean_mem(mem_full);
  for (size_t m = 0; m < methods.size(); ++m) {
    TextEvalRow& r = res.rows[m];
    r.n_docs = n_docs;
    r.n_tokens = n_docs * T;
    r.nll = nll_sum[m] / n_tok;
    r.ppl = std::exp(r.nll);
    r.delta_ppl_pct = 100.0 * (r.ppl / res.ppl_full - 1.0);
    r.top1_agree = top1_sum[m] / n_tok;
    if (opts.kld && !kls[m].empty()) {
      double s = 0;
      for (double k : kls[m]) s += k;
      r.kld_mean = s / static_cast<double>(kls[m].size());
      // Nearest-rank 99th percentile: the ceil(0.99 n)-th smallest value.
      std::vector<double> sorted = kls[m];
      const size_t rank = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(sorted.size())));
      std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(rank - 1),
                       sorted.end());
      r.kld_p99 = sorted[rank - 1];
    } else {
      r.kld_mean = std::nan("");
      r.kld_p99 = std::nan("");
    }
    r.mem = mean_mem(mems[m]);
    r.rows_end = rows_end_sum[m] / static_cast<double>(n_docs);
  }
  return res;
}

AttnErrorResult eval_attn_error(const Model& model, const std::vector<std::vector<int32_t>>& docs,
                                const std::vector<EvalMethod>& methods, const TextEvalOptions& opts,
                                const EvalSettings& settings) {
  const int64_t n_docs = doc_count(docs, opts.max_docs);
  check_text_inputs(model, docs, opts, n_docs);
  const int64_t P = opts.prefill, T = opts.decode;
  const int64_t L = model.config().n_layers, Hq = model.config().n_heads;
  VQ_CHECK(settings.tensor_parallel == 1 && !settings.tp_simulate,
           "[attn-error] tensor_parallel: expected 1 (without tp_simulate) but got " +
               std::to_string(settings.tensor_parallel) +
               (settings.tp_simulate ? " with tp_simulate" : "") +
               " (the attention-error tap wraps the per-layer caches of one Model::forward, "
               "which holds every head; sharded ranks each hold a slice); use --tensor-parallel 1");
  // On the CUDA engine the engine taps its own caches (Engine::set_attention_tap: a device full
  // cache per layer as the shadow, both views attended on the device with the layer's queries,
  // the sums added on the host); on the CPU the TapCache of eval_internal.h wraps Model::forward's.
  const std::unique_ptr<Engine> engine = eval_detail::make_eval_engine(model, settings, methods);

  AttnErrorResult res;
  res.options = opts;
  res.settings = settings;
  res.n_docs = n_docs;
  res.n_layers = L;
  res.n_heads = Hq;
  ForwardScratch scratch;
  std::vector<float> logits;
  eval_detail::Progress prog(settings.progress, "attn-error");

  for (const EvalMethod& method : methods) {
    AttnErrorRow row;
    row.label = method.label;
    row.family = method.family;
    std::vector<eval_detail::AttnErrorSums> sums(static_cast<size_t>(L));
    double rows = 0, acc = 0, resid = 0, fp = 0;
    for (int64_t d = 0; d < n_docs; ++d) {
      const std::vector<int32_t>& ids = docs[static_cast<size_t>(d)];
      if (engine) {
        AttentionTap tap;
        {
          eval_detail::EvalSeq seq(model, engine.get(), config_for_context(method, P), settings,
                                   scratch);
          seq.set_attention_tap(&tap);
          seq.prefill(ids.data(), P - 1, nullptr);
          tap.active = true;
          for (int64_t t = 0; t < T; ++t) {
            seq.decode(ids[static_cast<size_t>(P - 1 + t)], &logits);
            if (t == memory_step(opts)) {
              const MemoryFigures m = seq.memory();
              row.mem.context = m.context;
              rows += m.rows_kept;
              acc += static_cast<double>(m.bytes_accounted);
              resid += static_cast<double>(m.bytes_resident);
              fp += static_cast<double>(m.fp16_bytes);
            }
          }
        }  // the sequence (and the engine's pointer to tap) is gone here
        for (int64_t l = 0; l < L; ++l) {
          eval_detail::AttnErrorSums& s = sums[static_cast<size_t>(l)];
          const auto& e = tap.err2[static_cast<size_t>(l)];
          const auto& r = tap.ref2[static_cast<size_t>(l)];
          if (s.err2.empty()) {
            s.err2.assign(e.size(), 0.0);
            s.ref2.assign(r.size(), 0.0);
          }
          for (size_t h = 0; h < e.size(); ++h) {
            s.err2[h] += e[h];
            s.ref2[h] += r[h];
          }
        }
        prog.line(method.label + " doc " + std::to_string(d + 1) + "/" + std::to_string(n_docs),
                  true);
        continue;
      }
      Caches inner = model.make_caches(config_for_context(method, P));
      Caches caches;
      std::vector<eval_detail::TapCache*> taps;
      for (int64_t l = 0; l < L; ++l) {
        auto tap = std::make_unique<eval_detail::TapCache>(std::move(inner[static_cast<size_t>(l)]),
                                                           &sums[static_cast<size_t>(l)],
                                                           model.config().sliding_window);
        taps.push_back(tap.get());
        caches.push_back(std::move(tap));
      }
      eval_detail::prefill(model, ids.data(), P - 1, caches, settings.prefill_step, settings,
                           scratch, nullptr);
      for (auto* t : taps) t->active = true;
      for (int64_t t = 0; t < T; ++t) {
        eval_detail::decode_step(model, ids[static_cast<size_t>(P - 1 + t)], caches, settings,
                                 scratch, &logits);
        if (t == memory_step(opts)) {
          const MemoryFigures m = eval_detail::memory_of(caches);
          row.mem.context = m.context;
          rows += m.rows_kept;
          acc += static_cast<double>(m.bytes_accounted);
          resid += static_cast<double>(m.bytes_resident);
          fp += static_cast<double>(m.fp16_bytes);
        }
      }
      prog.line(method.label + " doc " + std::to_string(d + 1) + "/" + std::to_string(n_docs),
                true);
    }
    const double n = static_cast<double>(n_docs);
    row.mem.rows_kept = rows / n;
    row.mem.bytes_accounted = static_cast<int64_t>(std::llround(acc / n));
    row.mem.bytes_resident = static_cast<int64_t>(std::llround(resid / n));
    row.mem.fp16_bytes = static_cast<int64_t>(std::llround(fp / n));
    double mean = 0;
    for (int64_t l = 0; l < L; ++l) {
      const auto& s = sums[static_cast<size_t>(l)];
      double e = 0, r = 0;
      std::vector<double> heads;
      for (size_t h = 0; h < s.err2.size(); ++h) {
        e += s.err2[h];
        r += s.ref2[h];
        heads.push_back(s.ref2[h] > 0 ? std::sqrt(s.err2[h] / s.ref2[h]) : 0.0);
      }
      const double rel = r > 0 ? std::sqrt(e / r) : 0.0;
      row.layer_rel_l2.push_back(rel);
      row.head_rel_l2.push_back(heads);
      mean += rel;
    }
    row.mean_rel_l2 = L ? mean / static_cast<double>(L) : 0.0;
    res.rows.push_back(row);
  }
  return res;
}

}  // namespace vq
