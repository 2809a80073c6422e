// Reports of the evaluation engine (the CLI's, see cli/report.h): Markdown tables (default), JSON
// and CSV for the text (ppl/kld), attention-error and passkey results; peer rows (tools/peers/*.py
// JSON) merged into the text and passkey tables marked "peer"; chart specs for the SVG writer.
// Memory columns everywhere: rows kept per (b, h) (mean over layers), bytes accounted and resident
// summed over layers, and their ratios to fp16 at the same context.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/report.h"
#include "veloxquant/error.h"
#include "veloxquant/eval.h"

namespace vq {

namespace {

using json = nlohmann::json;

std::string f(const char* fmt, double v) {
  if (std::isnan(v)) return "—";
  char b[64];
  std::snprintf(b, sizeof(b), fmt, v);
  return b;
}

json num_or_null(double v) {
  return std::isfinite(v) ? json(v) : json(nullptr);
}

std::string md_row(const std::vector<std::string>& cells) {
  std::string s = "|";
  for (const auto& c : cells) s += " " + c + " |";
  return s + "\n";
}

std::string md_header(const std::vector<std::string>& cells) {
  std::string s = md_row(cells) + "|";
  for (size_t i = 0; i < cells.size(); ++i) s += i == 0 ? " --- |" : " ---: |";
  return s + "\n";
}

std::string csv_cell(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string o = "\"";
  for (char c : s) o += c == '"' ? std::string("\"\"") : std::string(1, c);
  return o + "\"";
}

std::string csv_row(const std::vector<std::string>& cells) {
  std::string s;
  for (size_t i = 0; i < cells.size(); ++i) {
    if (i) s += ',';
    s += csv_cell(cells[i]);
  }
  return s + "\n";
}

std::string g(double v) {
  if (!std::isfinite(v)) return "";
  char b[64];
  std::snprintf(b, sizeof(b), "%.10g", v);
  return b;
}

std::string i64(int64_t v) {
  return std::to_string(v);
}

json mem_json(const MemoryFigures& m) {
  return json{{"context", m.context},
              {"rows_kept", m.rows_kept},
              {"bytes_accounted", m.bytes_accounted},
              {"bytes_resident", m.bytes_resident},
              {"fp16_bytes", m.fp16_bytes},
              {"ratio_to_fp16", m.ratio_to_fp16()},
              {"resident_to_fp16", m.resident_to_fp16()}};
}

std::vector<std::string> mem_cells(const MemoryFigures& m) {
  return {f("%.1f", m.rows_kept), i64(m.bytes_accounted), i64(m.bytes_resident),
          f("%.4f", m.ratio_to_fp16()), f("%.4f", m.resident_to_fp16())};
}

std::vector<std::string> mem_csv(const MemoryFigures& m) {
  return {i64(m.context),    g(m.rows_kept),       i64(m.bytes_accounted), i64(m.bytes_resident),
          i64(m.fp16_bytes), g(m.ratio_to_fp16()), g(m.resident_to_fp16())};
}

const std::vector<std::string> kMemCsvHeader = {"context",         "rows_kept",  "bytes_accounted",
                                                "bytes_resident",  "fp16_bytes", "ratio_to_fp16",
                                                "resident_to_fp16"};

// Where the text tables' memory figures were taken (memory_step in veloxquant/eval.h).
std::string memory_caption(const TextEvalOptions& o, int64_t context) {
  if (memory_step(o) == 0) return "Memory at context P = " + i64(context);
  return "Memory after the last scored token, context P + T - 1 = " + i64(context) +
         " (P < T: at context P the figures would describe a cache most scored tokens never saw)";
}

json settings_json(const EvalSettings& s) {
  return json{{"model", s.model_name},
              {"prefill_step", s.prefill_step},
              {"kv_dtype", dtype_name(s.kv_dtype)},
              {"matmul", s.matmul == MatmulPrecision::kBF16 ? "bf16" : "exact"},
              {"device", device_name(s.device)},
              {"tensor_parallel", s.tensor_parallel},
              {"tp_simulate", s.tp_simulate}};
}

std::string peer_val(const PeerRow& p, const std::string& k, const char* fmt, double scale = 1) {
  auto it = p.values.find(k);
  return it == p.values.end() ? "—" : f(fmt, it->second * scale);
}

json peers_json(const std::vector<PeerRow>& rows, const std::string& tool) {
  json a = json::array();
  for (const auto& p : rows) {
    json o{{"label", p.label}, {"tool", tool}};
    for (const auto& [k, v] : p.values) o[k] = v;
    for (const auto& [k, v] : p.notes) o[k] = v;
    a.push_back(o);
  }
  return a;
}

}  // namespace

// ---- peers --------------------------------------------------------------------------------------

PeerRows load_peer_rows(const std::string& path) {
  std::ifstream in(path);
  VQ_CHECK(in.is_open(),
           "[eval] expected a readable peer JSON file but could not open '" + path + "'");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  PeerRows out;
  try {
    const json j = json::parse(text);
    out.tool = j.value("tool", std::string("peer"));
    auto read = [&](const char* key, std::vector<PeerRow>& dst) {
      if (!j.contains(key)) return;
      for (const auto& r : j.at(key)) {
        PeerRow p;
        p.label = r.at("label").get<std::string>();
        for (auto it = r.begin(); it != r.end(); ++it) {
          if (it.key() == "label") continue;
          if (it->is_number())
            p.values[it.key()] = it->get<double>();
          else if (it->is_string())
            p.notes[it.key()] = it->get<std::string>();
        }
        dst.push_back(std::move(p));
      }
    };
    read("text", out.text);
    read("passkey", out.passkey);
  } catch (const json::exception& e) {
    throw Error("[eval] peer file '" + path +
                "': expected {tool, text: [...], passkey: [...]} "
                "but got an error: " +
                std::string(e.what()));
  }
  return out;
}

void append_peer_rows(PeerRows& into, const PeerRows& more) {
  into.tool = into.tool.empty() ? more.tool : into.tool + ", " + more.tool;
  auto tag = [&](std::vector<PeerRow> rows) {
    for (auto& r : rows)
      if (!r.notes.count("tool")) r.notes["tool"] = more.tool;
    return rows;
  };
  for (auto& r : tag(more.text)) into.text.push_back(r);
  for (auto& r : tag(more.passkey)) into.passkey.push_back(r);
}

// ---- text (ppl / kld) ---------------------------------------------------------------------------

std::string render(const TextEvalResult& r, ReportFormat fmt, const PeerRows* peers) {
  const bool kld = r.options.kld;
  if (fmt == ReportFormat::kJson) {
    json j{{"kind", kld ? "kld" : "ppl"},  {"settings", settings_json(r.settings)},
           {"prefill", r.options.prefill}, {"decode", r.options.decode},
           {"n_docs", r.n_docs},           {"ppl_full", r.ppl_full},
           {"full", mem_json(r.mem_full)}, {"rows_end_full", r.rows_end_full}};
    json rows = json::array();
    for (const auto& x : r.rows)
      rows.push_back(json{{"label", x.label},
                          {"family", x.family},
                          {"n_docs", x.n_docs},
                          {"n_tokens", x.n_tokens},
                          {"nll", x.nll},
                          {"ppl", x.ppl},
                          {"delta_ppl_pct", x.delta_ppl_pct},
                          {"kld_mean", num_or_null(x.kld_mean)},
                          {"kld_p99", num_or_null(x.kld_p99)},
                          {"top1_agree", x.top1_agree},
                          {"rows_end", x.rows_end},
                          {"memory", mem_json(x.mem)}});
    j["rows"] = rows;
    if (peers) j["peers"] = peers_json(peers->text, peers->tool);
    return j.dump(2) + "\n";
  }
  if (fmt == ReportFormat::kCsv) {
    std::vector<std::string> h = {"label",   "family",     "n_docs",        "n_tokens",
                                  "nll",     "ppl",        "delta_ppl_pct", "kld_mean",
                                  "kld_p99", "top1_agree", "rows_end"};
    h.insert(h.end(), kMemCsvHeader.begin(), kMemCsvHeader.end());
    std::string o = csv_row(h);
    auto line = [&](const std::string& label, const std::string& fam, double nll, double ppl,
                    double d, double km, double kp, double top1, double rows_end,
                    const MemoryFigures& m) {
      std::vector<std::string> c = {
          label,  fam,     i64(r.n_docs), i64(r.n_docs * r.options.decode),
          g(nll), g(ppl),  g(d),          g(km),
          g(kp),  g(top1), g(rows_end)};
      const auto mc = mem_csv(m);
      c.insert(c.end(), mc.begin(), mc.end());
      o += csv_row(c);
    };
    line("full (baseline)", "full", std::log(r.ppl_full), r.ppl_full, 0.0, kld ? 0.0 : NAN,
         kld ? 0.0 : NAN, 1.0, r.rows_end_full, r.mem_full);
    for (const auto& x : r.rows)
      line(x.label, x.family, x.nll, x.ppl, x.delta_ppl_pct, x.kld_mean, x.kld_p99, x.top1_agree,
           x.rows_end, x.mem);
    return o;
  }
  std::string o;
  o += "Model " + r.settings.model_name + " · P = " + i64(r.options.prefill) +
       " context tokens, T = " + i64(r.options.decode) + " scored tokens per document, " +
       i64(r.n_docs) + " documents (" + i64(r.n_docs * r.options.decode) +
       " scored tokens) · prefill chunks of " + i64(r.settings.prefill_step) + " · K/V handed to " +
       "the caches in " + dtype_name(r.settings.kv_dtype) + " · full-cache perplexity " +
       f("%.4f", r.ppl_full) + "\n\n" + memory_caption(r.options, r.mem_full.context) +
       " (summed over layers; rows per (b, h)); rows@end after the last scored token.\n\n";
  std::vector<std::string> h = {"method", "ppl", "Δppl %"};
  if (kld) {
    h.push_back("KL mean");
    h.push_back("KL p99");
  }
  for (const char* c : {"top-1 agree", "rows kept", "rows@end", "bytes accounted", "bytes resident",
                        "ratio to fp16", "bits / element", "resident / fp16"})
    h.push_back(c);
  o += md_header(h);
  auto row = [&](const std::string& label, double ppl, double d, double km, double kp, double top1,
                 double rows_end, const MemoryFigures& m) {
    std::vector<std::string> c = {label, f("%.4f", ppl), f("%+.3f", d)};
    if (kld) {
      c.push_back(f("%.5f", km));
      c.push_back(f("%.5f", kp));
    }
    c.push_back(f("%.4f", top1));
    const auto mc = mem_cells(m);
    c.push_back(mc[0]);
    c.push_back(f("%.1f", rows_end));
    c.insert(c.end(), mc.begin() + 1, mc.begin() + 4);
    // Bits per cached element, metadata included (accounted bytes over K+V elements of every
    // token seen, so eviction lowers it too).
    c.push_back(f("%.3f", 16.0 * m.ratio_to_fp16()));
    c.push_back(mc[4]);
    o += md_row(c);
  };
  row("full (baseline)", r.ppl_full, 0.0, 0.0, 0.0, 1.0, r.rows_end_full, r.mem_full);
  for (const auto& x : r.rows)
    row("`" + x.label + "`", x.ppl, x.delta_ppl_pct, x.kld_mean, x.kld_p99, x.top1_agree,
        x.rows_end, x.mem);
  if (peers)
    for (const auto& p : peers->text) {
      std::vector<std::string> c = {"peer: " + p.label, peer_val(p, "ppl", "%.4f"),
                                    peer_val(p, "delta_ppl_pct", "%+.3f")};
      if (kld) {
        c.push_back(peer_val(p, "kld_mean", "%.5f"));
        c.push_back(peer_val(p, "kld_p99", "%.5f"));
      }
      c.push_back(peer_val(p, "top1_agree", "%.4f"));
      c.push_back(peer_val(p, "rows_kept", "%.1f"));
      c.push_back("—");
      c.push_back(peer_val(p, "bytes_accounted", "%.0f"));
      c.push_back("—");
      c.push_back(peer_val(p, "ratio_to_fp16", "%.4f"));
      c.push_back(p.has("bits_per_element") ? peer_val(p, "bits_per_element", "%.3f")
                                            : peer_val(p, "ratio_to_fp16", "%.3f", 16.0));
      c.push_back("—");
      o += md_row(c);
    }
  return o;
}

// ---- attention error ----------------------------------------------------------------------------

std::string render(const AttnErrorResult& r, ReportFormat fmt) {
  if (fmt == ReportFormat::kJson) {
    json j{{"kind", "attn-error"},         {"settings", settings_json(r.settings)},
           {"prefill", r.options.prefill}, {"decode", r.options.decode},
           {"n_docs", r.n_docs},           {"n_layers", r.n_layers},
           {"n_heads", r.n_heads}};
    json rows = json::array();
    for (const auto& x : r.rows)
      rows.push_back(json{{"label", x.label},
                          {"family", x.family},
                          {"layer_rel_l2", x.layer_rel_l2},
                          {"head_rel_l2", x.head_rel_l2},
                          {"mean_rel_l2", x.mean_rel_l2},
                          {"memory", mem_json(x.mem)}});
    j["rows"] = rows;
    return j.dump(2) + "\n";
  }
  std::vector<std::string> h = {"label", "family"};
  for (int64_t l = 0; l < r.n_layers; ++l) h.push_back("L" + i64(l));
  h.push_back("mean");
  if (fmt == ReportFormat::kCsv) {
    h.insert(h.end(), kMemCsvHeader.begin(), kMemCsvHeader.end());
    std::string o = csv_row(h);
    for (const auto& x : r.rows) {
      std::vector<std::string> c = {x.label, x.family};
      for (double v : x.layer_rel_l2) c.push_back(g(v));
      c.push_back(g(x.mean_rel_l2));
      const auto mc = mem_csv(x.mem);
      c.insert(c.end(), mc.begin(), mc.end());
      o += csv_row(c);
    }
    return o;
  }
  std::string o = "Model " + r.settings.model_name +
                  " · relative L2 error of the attention output per layer (all query heads of " +
                  "the T decode steps), compressed cache vs a full-precision shadow cache on the " +
                  "same queries · P = " + i64(r.options.prefill) +
                  ", T = " + i64(r.options.decode) + ", " + i64(r.n_docs) + " documents · " +
                  memory_caption(r.options, r.rows.empty() ? 0 : r.rows[0].mem.context) + "\n\n";
  std::vector<std::string> mh = {"method"};
  for (int64_t l = 0; l < r.n_layers; ++l) mh.push_back("L" + i64(l));
  for (const char* c : {"mean", "worst head", "rows kept", "bytes accounted", "bytes resident",
                        "ratio to fp16", "resident / fp16"})
    mh.push_back(c);
  o += md_header(mh);
  for (const auto& x : r.rows) {
    std::vector<std::string> c = {"`" + x.label + "`"};
    for (double v : x.layer_rel_l2) c.push_back(f("%.4f", v));
    c.push_back(f("%.4f", x.mean_rel_l2));
    double worst = -1;
    std::string where;
    for (size_t l = 0; l < x.head_rel_l2.size(); ++l)
      for (size_t hh = 0; hh < x.head_rel_l2[l].size(); ++hh)
        if (x.head_rel_l2[l][hh] > worst) {
          worst = x.head_rel_l2[l][hh];
          where = std::string("L");
          where += std::to_string(l);
          where += 'h';
          where += std::to_string(hh);
        }
    std::string worst_cell = "—";
    if (worst >= 0) {
      worst_cell = f("%.4f", worst);
      worst_cell += " (";
      worst_cell += where;
      worst_cell += ')';
    }
    c.push_back(worst_cell);
    const auto mc = mem_cells(x.mem);
    c.insert(c.end(), mc.begin(), mc.end());
    o += md_row(c);
  }
  return o;
}

// ---- passkey ------------------------------------------------------------------------------------

namespace {

json mode_json(const PasskeyModeScore& s) {
  json bl = json::object(), bd = json::object();
  for (const auto& [k, v] : s.by_length)
    bl[std::to_string(k)] = json{{"correct", v.first}, {"total", v.second}};
  for (const auto& [k, v] : s.by_depth)
    bd[std::to_string(k)] = json{{"correct", v.first}, {"total", v.second}};
  return json{{"correct", s.correct},
              {"total", s.total},
              {"accuracy", s.accuracy()},
              {"by_length", bl},
              {"by_depth", bd},
              {"needle_prompts", s.needle_prompts},
              {"needle_rows_kept_sum", s.needle_rows_kept_sum},
              {"needle_heads_whole_sum", s.needle_heads_whole_sum}};
}

std::string pct(int64_t c, int64_t t) {
  return t ? f("%.1f", 100.0 * c / t) : "—";
}

}  // namespace

std::string render(const PasskeyResult& r, ReportFormat fmt, const PeerRows* peers) {
  std::vector<const PasskeyRow*> all = {&r.full};
  for (const auto& x : r.rows) all.push_back(&x);
  std::vector<int64_t> lengths, depths;
  for (const auto& [k, v] : (r.options.question_aware ? r.full.aware : r.full.agnostic).by_length)
    lengths.push_back(k);
  for (const auto& [k, v] : (r.options.question_aware ? r.full.aware : r.full.agnostic).by_depth)
    depths.push_back(k);
  std::vector<std::pair<std::string, const PasskeyModeScore PasskeyRow::*>> modes;
  if (r.options.question_aware) modes.push_back({"aware", &PasskeyRow::aware});
  if (r.options.question_agnostic) modes.push_back({"agnostic", &PasskeyRow::agnostic});

  if (fmt == ReportFormat::kJson) {
    json j{
        {"kind", "passkey"}, {"settings", settings_json(r.settings)}, {"n_prompts", r.n_prompts}};
    json rows = json::array();
    for (const PasskeyRow* x : all) {
      json o{{"label", x->label}, {"family", x->family}, {"memory", mem_json(x->mem)}};
      for (const auto& [name, ptr] : modes) o[name] = mode_json(x->*ptr);
      rows.push_back(o);
    }
    j["rows"] = rows;
    if (peers) j["peers"] = peers_json(peers->passkey, peers->tool);
    return j.dump(2) + "\n";
  }
  if (fmt == ReportFormat::kCsv) {
    std::vector<std::string> h = {"label", "family"};
    for (const auto& [name, ptr] : modes) {
      h.push_back(name + "_accuracy");
      for (int64_t L : lengths) h.push_back(name + "_len" + i64(L));
      for (int64_t d : depths) h.push_back(name + "_depth" + i64(d));
    }
    h.insert(h.end(), kMemCsvHeader.begin(), kMemCsvHeader.end());
    std::string o = csv_row(h);
    for (const PasskeyRow* x : all) {
      std::vector<std::string> c = {x->label, x->family};
      for (const auto& [name, ptr] : modes) {
        const PasskeyModeScore& s = x->*ptr;
        c.push_back(g(s.accuracy()));
        for (int64_t L : lengths) {
          auto it = s.by_length.find(L);
          c.push_back(it == s.by_length.end() ? ""
                                              : g(double(it->second.first) / it->second.second));
        }
        for (int64_t d : depths) {
          auto it = s.by_depth.find(d);
          c.push_back(it == s.by_depth.end() ? ""
                                             : g(double(it->second.first) / it->second.second));
        }
      }
      const auto mc = mem_csv(x->mem);
      c.insert(c.end(), mc.begin(), mc.end());
      o += csv_row(c);
    }
    return o;
  }
  std::string o = "Model " + r.settings.model_name + " · passkey exact match (%), " +
                  i64(r.n_prompts) + " prompts · prefill chunks of " +
                  i64(r.settings.prefill_step) +
                  " · aware = question prefilled with the context and compressed with it; " +
                  "agnostic = context compressed first, question fed afterwards · memory at " +
                  "the longest prompt (" + i64(r.full.mem.context) + " tokens)\n\n";
  std::vector<std::string> h = {"method"};
  for (const auto& [name, ptr] : modes) {
    h.push_back(name + " all");
    for (int64_t L : lengths) h.push_back(name + " " + i64(L));
  }
  for (const char* c :
       {"rows kept", "bytes accounted", "bytes resident", "ratio to fp16", "resident / fp16"})
    h.push_back(c);
  o += md_header(h);
  for (const PasskeyRow* x : all) {
    std::vector<std::string> c = {x == &r.full ? x->label : "`" + x->label + "`"};
    for (const auto& [name, ptr] : modes) {
      const PasskeyModeScore& s = x->*ptr;
      c.push_back(pct(s.correct, s.total));
      for (int64_t L : lengths) {
        auto it = s.by_length.find(L);
        c.push_back(it == s.by_length.end() ? "—" : pct(it->second.first, it->second.second));
      }
    }
    const auto mc = mem_cells(x->mem);
    c.insert(c.end(), mc.begin(), mc.end());
    o += md_row(c);
  }
  if (peers)
    for (const auto& p : peers->passkey) {
      std::vector<std::string> c = {"peer: " + p.label};
      for (const auto& [name, ptr] : modes) {
        c.push_back(peer_val(p, name, "%.1f", 100.0));
        for (int64_t L : lengths) c.push_back(peer_val(p, name + "_len" + i64(L), "%.1f", 100.0));
      }
      c.push_back(peer_val(p, "rows_kept", "%.1f"));
      c.push_back("—");
      c.push_back("—");
      c.push_back(peer_val(p, "ratio_to_fp16", "%.4f"));
      c.push_back("—");
      o += md_row(c);
    }
  // By depth.
  o += "\nBy needle depth (% of filler before the needle):\n\n";
  std::vector<std::string> hd = {"method"};
  for (const auto& [name, ptr] : modes)
    for (int64_t d : depths) hd.push_back(name + " " + i64(d) + "%");
  o += md_header(hd);
  for (const PasskeyRow* x : all) {
    std::vector<std::string> c = {x == &r.full ? x->label : "`" + x->label + "`"};
    for (const auto& [name, ptr] : modes) {
      const PasskeyModeScore& s = x->*ptr;
      for (int64_t d : depths) {
        auto it = s.by_depth.find(d);
        c.push_back(it == s.by_depth.end() ? "—" : pct(it->second.first, it->second.second));
      }
    }
    o += md_row(c);
  }
  // Needle survival (only when measured).
  bool any_needle = false;
  for (const PasskeyRow* x : all)
    for (const auto& [name, ptr] : modes) any_needle = any_needle || (x->*ptr).needle_prompts > 0;
  if (any_needle) {
    const PasskeyModeScore& cov = r.options.question_aware ? r.full.aware : r.full.agnostic;
    o += "\nNeedle survival right after the context was compressed, over every (layer, KV head): "
         "% of the key's rows still stored (the tokens whose text overlaps the key), and % of "
         "heads keeping at least one occurrence of the key whole; over the " +
         i64(cov.needle_prompts) + " of " + i64(cov.total) +
         " prompts whose key was found in the context:\n\n";
    std::vector<std::string> hn = {"method"};
    for (const auto& [name, ptr] : modes) {
      hn.push_back(name + " digit rows kept");
      hn.push_back(name + " heads with a whole key");
    }
    o += md_header(hn);
    for (const PasskeyRow* x : all) {
      std::vector<std::string> c = {x == &r.full ? x->label : "`" + x->label + "`"};
      for (const auto& [name, ptr] : modes) {
        const PasskeyModeScore& s = x->*ptr;
        c.push_back(s.needle_prompts ? f("%.1f", 100.0 * s.needle_rows_kept()) : "—");
        c.push_back(s.needle_prompts ? f("%.1f", 100.0 * s.needle_heads_whole()) : "—");
      }
      o += md_row(c);
    }
  }
  return o;
}

// ---- side by side (compare)
// ----------------------------------------------------------------------

namespace {

std::string human_bytes(int64_t b) {
  if (b < 1024) return i64(b) + " B";
  if (b < 1024 * 1024) return f("%.1f KiB", static_cast<double>(b) / 1024.0);
  return f("%.2f MiB", static_cast<double>(b) / (1024.0 * 1024.0));
}

std::string one_line(const std::string& s) {
  std::string o;
  for (char c : s) o += (c == '\n' || c == '\r' || c == '\t') ? ' ' : c == '|' ? '/' : c;
  const size_t a = o.find_first_not_of(' ');
  if (a == std::string::npos) return "(nothing)";
  const size_t b = o.find_last_not_of(' ');
  o = o.substr(a, b - a + 1);
  return o.size() > 60 ? o.substr(0, 57) + "..." : o;
}

}  // namespace

std::string render_compare(const CompareResult& r, const std::vector<std::string>& answers,
                           const std::string& expected) {
  VQ_CHECK(answers.size() == r.rows.size(), "[compare] expected one answer per method (" +
                                                std::to_string(r.rows.size()) + ") but got " +
                                                std::to_string(answers.size()));
  std::vector<std::string> h = {"method", "answer"};
  if (!expected.empty()) h.push_back("correct");
  for (const char* c : {"KV cache", "vs fp16", "resident / fp16"}) h.push_back(c);
  std::string o = md_header(h);
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const CompareRow& x = r.rows[i];
    const MemoryFigures& m = x.mem;
    std::vector<std::string> c = {"`" + x.label + "`", one_line(answers[i])};
    if (!expected.empty())
      c.push_back(answers[i].find(expected) != std::string::npos ? "yes" : "NO");
    c.push_back(human_bytes(m.bytes_accounted));
    const double ratio = m.ratio_to_fp16();
    c.push_back(ratio < 0.995 && ratio > 0
                    ? f("%.3f", ratio) + " (" + f("%.1fx", 1.0 / ratio) + " smaller)"
                    : f("%.3f", ratio));
    c.push_back(f("%.3f", m.resident_to_fp16()));
    o += md_row(c);
  }
  return o;
}

// ---- charts -------------------------------------------------------------------------------------

namespace {

std::string short_label(const std::string& label, const std::string& family) {
  if (label.size() > family.size() + 1 && label.compare(0, family.size(), family) == 0)
    return label.substr(family.size() + 1);
  return label;
}

std::string trim_number(const std::string& v) {
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  if (end == v.c_str() || *end != '\0') return v;
  char b[32];
  std::snprintf(b, sizeof(b), "%g", d);
  return b;
}

std::string peer_series(const PeerRow& p, const PeerRows& peers) {
  std::string tool = p.notes.count("tool") ? p.notes.at("tool") : peers.tool;
  const size_t paren = tool.find(" (");
  if (paren != std::string::npos) tool = tool.substr(0, paren);
  return "peer: " + tool;
}

ChartSeries& series_for(ChartSpec& c, const std::string& name) {
  for (auto& s : c.series)
    if (s.name == name) return s;
  c.series.push_back(ChartSeries{name, {}});
  return c.series.back();
}

}  // namespace

std::string chart_label(const std::string& label, const std::string& family) {
  const std::string rest = short_label(label, family);
  if (rest == label && label == family) return label;
  std::vector<std::pair<std::string, std::string>> kv;
  std::string bits_key, bits_value;
  size_t a = 0;
  while (a <= rest.size()) {
    const size_t b = std::min(rest.find(':', a), rest.size());
    const std::string item = rest.substr(a, b - a);
    a = b + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string k = eq == std::string::npos ? item : item.substr(0, eq);
    const std::string v = eq == std::string::npos ? "" : item.substr(eq + 1);
    if (k == "bits_key")
      bits_key = v;
    else if (k == "bits_value")
      bits_value = v;
    else
      kv.push_back({k, v});
  }
  std::vector<std::string> parts;
  if (!bits_key.empty() || !bits_value.empty())
    parts.push_back("K" + (bits_key.empty() ? std::string("2") : bits_key) + "V" +
                    (bits_value.empty() ? std::string("2") : bits_value));
  for (const auto& [k, v] : kv) {
    if (k == "keep") {
      char* end = nullptr;
      const double x = std::strtod(v.c_str(), &end);
      parts.insert(parts.begin(), *end == '\0' ? trim_number(f("%.1f", 100.0 * x)) + "%" : v);
    } else if (k == "budget") {
      parts.insert(parts.begin(), v + " rows");
    } else if (k == "scoring") {
      parts.push_back(v == "query" ? "q" : v == "key_proxy" ? "kproxy" : v);
    } else if (k == "pool_kernel") {
      parts.push_back("pool" + v);
    } else if (k == "keep_window") {
      if (v == "true" || v == "1") parts.push_back("keepobs");
    } else if (k == "evict_at") {
      parts.push_back(v == "prompt_end" ? "end" : v == "prefill_call" ? "perchunk" : v);
    } else if (k == "rotation") {
      parts.push_back(v == "hadamard" ? "H" : v);
    } else if (k == "obs_window") {
      parts.push_back("obs" + v);
    } else if (k == "window") {
      parts.push_back("w" + v);
    } else if (k == "group_size") {
      parts.push_back("g" + v);
    } else {
      parts.push_back(v.empty() ? k : k + "=" + v);
    }
  }
  std::string o;
  for (const auto& p : parts) o += (o.empty() ? "" : " ") + p;
  return o.empty() ? family : o;
}

ChartSpec filter_series(ChartSpec spec, const std::vector<std::string>& prefixes) {
  if (prefixes.empty()) return spec;
  std::vector<ChartSeries> kept;
  for (auto& s : spec.series)
    for (const auto& p : prefixes)
      if (s.name.compare(0, p.size(), p) == 0) {
        kept.push_back(std::move(s));
        break;
      }
  spec.series = std::move(kept);
  return spec;
}

ChartSpec chart_ppl_vs_memory(const TextEvalResult& text, const PeerRows* peers) {
  ChartSpec c;
  c.title = "Δ perplexity vs KV memory (" + text.settings.model_name +
            ", P=" + std::to_string(text.options.prefill) +
            ", T=" + std::to_string(text.options.decode) + ", " + std::to_string(text.n_docs) +
            " docs)";
  c.x_label =
      "KV bytes accounted / fp16 at context " + std::to_string(text.mem_full.context) + " (log)";
  c.y_label = "Δ perplexity vs full cache (%)";
  c.log_x = true;
  c.pareto = true;  // lower memory, lower delta
  series_for(c, "full").points.push_back({1.0, 0.0, "full"});
  for (const auto& r : text.rows)
    series_for(c, r.family)
        .points.push_back({r.mem.ratio_to_fp16(), r.delta_ppl_pct, chart_label(r.label, r.family)});
  if (peers)
    for (const auto& p : peers->text)
      if (p.has("ratio_to_fp16") && p.has("delta_ppl_pct"))
        series_for(c, peer_series(p, *peers))
            .points.push_back(
                {p.values.at("ratio_to_fp16"), p.values.at("delta_ppl_pct"), p.label});
  return c;
}

ChartSpec chart_passkey_vs_memory(const PasskeyResult& pk, bool aware, const PeerRows* peers) {
  ChartSpec c;
  c.title = std::string("Passkey accuracy (question-") + (aware ? "aware" : "agnostic") +
            ") vs KV memory (" + pk.settings.model_name + ", " + std::to_string(pk.n_prompts) +
            " prompts)";
  c.x_label = "KV bytes accounted / fp16 at the longest prompt (log)";
  c.y_label = "exact match (%)";
  c.log_x = true;
  c.pareto = true;  // lower memory, higher accuracy
  c.higher_is_better = true;
  auto acc = [&](const PasskeyRow& r) {
    return 100.0 * (aware ? r.aware.accuracy() : r.agnostic.accuracy());
  };
  series_for(c, "full").points.push_back({1.0, acc(pk.full), "full"});
  for (const auto& r : pk.rows)
    series_for(c, r.family)
        .points.push_back({r.mem.ratio_to_fp16(), acc(r), chart_label(r.label, r.family)});
  const std::string key = aware ? "aware" : "agnostic";
  if (peers)
    for (const auto& p : peers->passkey)
      if (p.has("ratio_to_fp16") && p.has(key))
        series_for(c, peer_series(p, *peers))
            .points.push_back({p.values.at("ratio_to_fp16"), 100.0 * p.values.at(key), p.label});
  return c;
}

}  // namespace vq

// ---- JSON back to results -----------------------------------------------------------------------

namespace vq {

namespace {

MemoryFigures mem_from(const nlohmann::json& j) {
  MemoryFigures m;
  m.context = j.at("context").get<int64_t>();
  m.rows_kept = j.at("rows_kept").get<double>();
  m.bytes_accounted = j.at("bytes_accounted").get<int64_t>();
  m.bytes_resident = j.at("bytes_resident").get<int64_t>();
  m.fp16_bytes = j.at("fp16_bytes").get<int64_t>();
  return m;
}

EvalSettings settings_from(const nlohmann::json& j) {
  EvalSettings s;
  s.model_name = j.at("model").get<std::string>();
  s.prefill_step = j.at("prefill_step").get<int64_t>();
  s.kv_dtype = dtype_from_string(j.at("kv_dtype").get<std::string>());
  // Files written before the mode existed were all computed exact.
  const std::string mm = j.value("matmul", std::string("exact"));
  VQ_CHECK(mm == "exact" || mm == "bf16",
           "[eval] settings.matmul: expected exact or bf16 but got '" + mm + "'");
  s.matmul = mm == "bf16" ? MatmulPrecision::kBF16 : MatmulPrecision::kExact;
  // Files written before eval ran on the GPU were all computed on the CPU.
  s.device = parse_device(j.value("device", std::string("cpu")));
  // Files written before eval took --tensor-parallel ran on one rank.
  s.tensor_parallel = j.value("tensor_parallel", int64_t{1});
  s.tp_simulate = j.value("tp_simulate", false);
  s.progress = false;
  return s;
}

double num_or_nan(const nlohmann::json& j) {
  return j.is_null() ? std::nan("") : j.get<double>();
}

PasskeyModeScore mode_from(const nlohmann::json& j) {
  PasskeyModeScore s;
  s.correct = j.at("correct").get<int64_t>();
  s.total = j.at("total").get<int64_t>();
  for (auto it = j.at("by_length").begin(); it != j.at("by_length").end(); ++it)
    s.by_length[std::stoll(it.key())] = {it->at("correct").get<int64_t>(),
                                         it->at("total").get<int64_t>()};
  for (auto it = j.at("by_depth").begin(); it != j.at("by_depth").end(); ++it)
    s.by_depth[std::stoll(it.key())] = {it->at("correct").get<int64_t>(),
                                        it->at("total").get<int64_t>()};
  // Absent in results written before needle survival was measured.
  s.needle_prompts = j.value("needle_prompts", int64_t{0});
  s.needle_rows_kept_sum = j.value("needle_rows_kept_sum", 0.0);
  s.needle_heads_whole_sum = j.value("needle_heads_whole_sum", 0.0);
  return s;
}

}  // namespace

TextEvalResult text_result_from_json(const std::string& text) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    VQ_CHECK(j.at("kind") == "ppl" || j.at("kind") == "kld",
             "[eval] expected a ppl/kld result JSON but got kind " + j.at("kind").dump());
    TextEvalResult r;
    r.settings = settings_from(j.at("settings"));
    r.options.prefill = j.at("prefill").get<int64_t>();
    r.options.decode = j.at("decode").get<int64_t>();
    r.options.kld = j.at("kind") == "kld";
    r.n_docs = j.at("n_docs").get<int64_t>();
    r.options.max_docs = r.n_docs;
    r.ppl_full = j.at("ppl_full").get<double>();
    r.mem_full = mem_from(j.at("full"));
    r.rows_end_full = j.at("rows_end_full").get<double>();
    for (const auto& x : j.at("rows")) {
      TextEvalRow row;
      row.label = x.at("label").get<std::string>();
      row.family = x.at("family").get<std::string>();
      row.n_docs = x.at("n_docs").get<int64_t>();
      row.n_tokens = x.at("n_tokens").get<int64_t>();
      row.nll = x.at("nll").get<double>();
      row.ppl = x.at("ppl").get<double>();
      row.delta_ppl_pct = x.at("delta_ppl_pct").get<double>();
      row.kld_mean = num_or_nan(x.at("kld_mean"));
      row.kld_p99 = num_or_nan(x.at("kld_p99"));
      row.top1_agree = x.at("top1_agree").get<double>();
      row.rows_end = x.at("rows_end").get<double>();
      row.mem = mem_from(x.at("memory"));
      r.rows.push_back(row);
    }
    return r;
  } catch (const nlohmann::json::exception& e) {
    throw Error("[eval] expected a ppl/kld result JSON but got an error: " + std::string(e.what()));
  }
}

PasskeyResult passkey_result_from_json(const std::string& text) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    VQ_CHECK(j.at("kind") == "passkey",
             "[eval] expected a passkey result JSON but got kind " + j.at("kind").dump());
    PasskeyResult r;
    r.settings = settings_from(j.at("settings"));
    r.n_prompts = j.at("n_prompts").get<int64_t>();
    const auto& rows = j.at("rows");
    VQ_CHECK(!rows.empty(), "[eval] expected the full-cache row in the passkey JSON but got none");
    r.options.question_aware = rows[0].contains("aware");
    r.options.question_agnostic = rows[0].contains("agnostic");
    for (size_t i = 0; i < rows.size(); ++i) {
      PasskeyRow row;
      row.label = rows[i].at("label").get<std::string>();
      row.family = rows[i].at("family").get<std::string>();
      row.mem = mem_from(rows[i].at("memory"));
      if (rows[i].contains("aware")) row.aware = mode_from(rows[i].at("aware"));
      if (rows[i].contains("agnostic")) row.agnostic = mode_from(rows[i].at("agnostic"));
      if (i == 0)
        r.full = row;
      else
        r.rows.push_back(row);
    }
    return r;
  } catch (const nlohmann::json::exception& e) {
    throw Error("[eval] expected a passkey result JSON but got an error: " + std::string(e.what()));
  }
}

}  // namespace vq
