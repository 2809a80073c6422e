// `veloxquant eval`: memory against quality for several cache methods in one run (docs/design.md
// §5).
//
//   eval ppl        perplexity (P-token context, T teacher-forced decode steps), delta vs full
//   eval kld        the same plus KL divergence from the full cache (mean, p99), top-1 agreement
//   eval passkey    exact-match passkey accuracy by length and depth, question-aware/-agnostic
//   eval attn-error per-layer relative L2 error of the attention output vs the full cache
//   eval sweep      kld + passkey in one go, writing tables (md/json/csv) and SVG charts to a
//   folder eval report     re-renders saved sweep JSON (tables + charts), optionally with peer rows
// Every subcommand takes --methods "full,snapkv:budget=256,skvq:bits_key=4:bits_value=4,...";
// progress goes to stderr, the table to stdout (Markdown; --json or --csv) or --out FILE.
// --matmul bf16 runs every forward pass with ForwardOptions::matmul = kBF16 (the tables' model
// name gets " (bf16 matmul)"); --threads N bounds the OpenMP threads (1 .. the machine's cores);
// passkey's --question sets the question of prompt sets worded otherwise. --tensor-parallel N
// (ppl, kld, passkey, sweep) runs every sequence on an engine of N ranks (EvalSettings::
// tensor_parallel): on the CPU its simulated ranks, on cuda one device per rank or, with
// --tp-simulate, N simulated ranks on one device; checked (check_tensor_parallel) once the model
// is loaded, before any evaluation. attn-error takes 1 only.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "cli/report.h"
#include "commands.h"
#include "options.h"
#include "veloxquant/engine.h"
#include "veloxquant/error.h"
#include "veloxquant/eval.h"
#include "veloxquant/model.h"
#include "veloxquant/tokenizer.h"

namespace vq::cli {

namespace {

// The repeat prompt of the reconstruction pass (docs/RESULTS.md: question-agnostic eviction).
constexpr const char* kDefaultReconPrompt = " Repeat the text above.";

struct Common {
  std::string model_dir = "models/vq-mini-llama";
  std::string methods;
  bool json = false, csv = false, quiet = false;
  std::string out;
  int64_t prefill_step = 512;
  std::string kv_dtype = "float16";
  std::string matmul = "exact";
  std::vector<std::string> peers;
  int64_t threads = 0;  // 0 = every core
  std::string device = "cpu";
  std::string recon_prompt = kDefaultReconPrompt;
  int64_t recon_chunk = 128;
  int64_t tensor_parallel = 1;
  bool tp_simulate = false;  // --tp-simulate
};

// --device: cpu or cuda (one CUDA engine per evaluation, EvalSettings::device; checked_device
// refuses cuda without a build or device before anything loads); attn-error takes one rank only
// (its tap sums every query head of one forward pass).
Device eval_device(const Common& a, bool multi_rank_ok) {
  const Device d = checked_device(a.device, multi_rank_ok ? "eval" : "eval attn-error");
  VQ_CHECK(multi_rank_ok || (a.tensor_parallel == 1 && !a.tp_simulate),
           "[eval attn-error] --tensor-parallel: expected 1 (without --tp-simulate) but got " +
               std::to_string(a.tensor_parallel) + (a.tp_simulate ? " --tp-simulate" : "") +
               " (the attention-error tap wraps the per-layer caches of one Model::forward); "
               "use --tensor-parallel 1");
  return d;
}

struct TextArgs {
  std::string data = "data/eval/heldout_ids.u16";
  int64_t row_len = 0;  // 0 = the model's max_position_embeddings
  int64_t prefill = 1536, decode = 512, docs = 0;
};

struct PasskeyArgs {
  std::string data = "data/eval/passkey.jsonl";
  int64_t prompts = 0;
  std::vector<int64_t> lengths;
  std::string mode = "both";
  std::string question;  // "" = PasskeyOptions' default
};

void add_common(CLI::App* c, Common& a, bool with_methods = true) {
  c->add_option("--model", a.model_dir, "model directory (config.json, safetensors, tokenizer)")
      ->capture_default_str();
  if (with_methods)
    c->add_option("--methods", a.methods,
                  "comma-separated cache specs, e.g. full,snapkv:budget=256,skvq:bits_key=4")
        ->required();
  c->add_flag("--json", a.json, "print JSON instead of Markdown");
  c->add_flag("--csv", a.csv, "print CSV instead of Markdown");
  c->add_option("--out", a.out, "write the table to this file instead of stdout");
  add_int_option(c, "--prefill-step", &a.prefill_step, 1, kMaxTokenCount,
                 "prefill chunk length (prefill_step_size)", "eval");
  c->add_option("--recon-prompt", a.recon_prompt,
                "repeat prompt of the reconstruction pass of snapkv:scoring=external (text, "
                "encoded without BOS; \"\" = none)")
      ->capture_default_str();
  add_int_option(c, "--recon-chunk", &a.recon_chunk, 1, kMaxTokenCount,
                 "prompt tokens re-read per reconstruction pass (snapkv:scoring=external)", "eval");
  c->add_option(
       "--matmul", a.matmul,
       "matrix-product arithmetic: exact (fp32) or bf16 (activations rounded to bf16, fp32 "
       "sums; bf16 weights only)")
      ->check(CLI::IsMember({"exact", "bf16"}))
      ->capture_default_str();
  c->add_option("--kv-dtype", a.kv_dtype, "dtype of K/V blocks handed to the caches")
      ->capture_default_str();
  c->add_flag("--quiet", a.quiet, "no progress lines on stderr");
  c->add_option("--device", a.device, "cpu or cuda")->capture_default_str();
  c->add_option("--threads", a.threads, "OpenMP threads (0 = all cores; at most the cores)")
      ->capture_default_str();
  add_tensor_parallel_option(c, &a.tensor_parallel, "eval", &a.tp_simulate);
  c->add_option("--peers", a.peers, "peer rows (JSON from tools/peers/*.py) to add to the tables");
}

void add_text(CLI::App* c, TextArgs& a) {
  c->add_option("--data", a.data, "token rows, little-endian uint16 [n_docs, row_len]")
      ->capture_default_str();
  add_int_option(c, "--row-len", &a.row_len, 0, kMaxTokenCount,
                 "tokens per row of --data (0 = model context)", "eval");
  add_int_option(c, "--prefill,-P", &a.prefill, 0, kMaxTokenCount,
                 "context tokens P before the first scored token", "eval");
  add_int_option(c, "--decode,-T", &a.decode, 0, kMaxTokenCount,
                 "scored tokens T (one decode step each)", "eval");
  add_int_option(c, "--docs", &a.docs, 0, kMaxTokenCount, "use at most N documents (0 = all)",
                 "eval");
}

void add_passkey(CLI::App* c, PasskeyArgs& a) {
  c->add_option("--data", a.data, "passkey prompts (JSONL)")->capture_default_str();
  add_int_option(c, "--prompts", &a.prompts, 0, kMaxTokenCount,
                 "use at most N prompts, spread evenly (0 = all)", "eval");
  add_int_list_option(c, "--lengths", &a.lengths, 1, kMaxTokenCount,
                      "only these target lengths (e.g. 512,1024)", "eval");
  c->add_option("--mode", a.mode, "aware | agnostic | both")
      ->check(CLI::IsMember({"aware", "agnostic", "both"}))
      ->capture_default_str();
  c->add_option("--question", a.question,
                "the question text of prompts without a \"question\" field (each prompt is split "
                "at its last occurrence; default \" What is the pass key?\")");
}

// --threads: 0 keeps OpenMP's default (every core); 1 .. the machine's cores sets the count.
// Checked before anything is loaded.
void apply_threads(const Common& a) {
  const int64_t cores = omp_get_num_procs();
  VQ_CHECK(a.threads >= 0 && a.threads <= cores,
           "[eval] --threads: expected 0 (all cores) or 1 .. " + std::to_string(cores) +
               " (this machine's cores) but got " + std::to_string(a.threads));
  if (a.threads > 0) omp_set_num_threads(static_cast<int>(a.threads));
}

ReportFormat format_of(const Common& a) {
  VQ_CHECK(!(a.json && a.csv), "[eval] expected at most one of --json and --csv but got both");
  return a.json ? ReportFormat::kJson : a.csv ? ReportFormat::kCsv : ReportFormat::kMarkdown;
}

EvalSettings settings_of(const Common& a, Device dev = Device::kCpu) {
  EvalSettings s;
  s.device = dev;
  s.prefill_step = a.prefill_step;
  s.kv_dtype = dtype_from_string(a.kv_dtype);
  s.progress = !a.quiet;
  s.model_name = std::filesystem::path(a.model_dir).filename().string();
  if (s.model_name.empty()) s.model_name = a.model_dir;
  // The settings carry the matrix-product mode into every forward call and into the JSON; the
  // model name in the tables says so too.
  VQ_CHECK(a.matmul == "exact" || a.matmul == "bf16",
           "[eval] --matmul: expected exact or bf16 but got " + a.matmul);
  s.matmul = a.matmul == "bf16" ? MatmulPrecision::kBF16 : MatmulPrecision::kExact;
  if (a.matmul == "bf16") s.model_name += " (bf16 matmul)";
  if (dev == Device::kCuda) s.model_name += " (cuda engine)";  // the tables say where it ran
  if (a.tensor_parallel > 1)
    s.model_name += " (tensor-parallel " + std::to_string(a.tensor_parallel) + ")";
  s.tensor_parallel = a.tensor_parallel;
  s.tp_simulate = a.tp_simulate;
  s.recon_chunk = a.recon_chunk;
  if (!a.recon_prompt.empty()) {
    const Tokenizer tok = Tokenizer::from_file(a.model_dir + "/tokenizer.json");
    s.recon_repeat_ids = tok.encode(a.recon_prompt, false);
  }
  return s;
}

std::unique_ptr<PeerRows> peers_of(const Common& a) {
  if (a.peers.empty()) return nullptr;
  auto p = std::make_unique<PeerRows>();
  for (const auto& path : a.peers) append_peer_rows(*p, load_peer_rows(path));
  return p;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream o(path, std::ios::binary | std::ios::trunc);
  VQ_CHECK(o.is_open(), "[eval] expected a writable file but could not open '" + path + "'");
  o << text;
  o.close();
  VQ_CHECK(!o.fail(), "[eval] expected to write '" + path + "' but the write failed");
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  VQ_CHECK(in.is_open(), "[eval] expected a readable file but could not open '" + path + "'");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void emit(const Common& a, const std::string& text) {
  if (a.out.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  } else {
    write_text(a.out, text);
  }
}

std::vector<std::vector<int32_t>> load_docs(const Model& m, const TextArgs& t) {
  const int64_t row_len = t.row_len > 0 ? t.row_len : m.config().max_position_embeddings;
  return load_token_rows_u16(t.data, row_len);
}

TextEvalOptions text_opts(const TextArgs& t, bool kld) {
  TextEvalOptions o;
  o.prefill = t.prefill;
  o.decode = t.decode;
  o.max_docs = t.docs;
  o.kld = kld;
  return o;
}

PasskeyOptions passkey_opts(const PasskeyArgs& p) {
  PasskeyOptions o;
  o.max_prompts = p.prompts;
  o.lengths = p.lengths;
  o.question_aware = p.mode != "agnostic";
  o.question_agnostic = p.mode != "aware";
  if (!p.question.empty()) o.question = p.question;
  return o;
}

// Chart selection: series whose names start with one of these (empty = all), and a tag appended
// to the file names so several selections can sit in one folder.
struct ChartArgs {
  std::vector<std::string> series;
  std::string tag;
};

void write_charts(const std::string& dir, const TextEvalResult* text, const PasskeyResult* pk,
                  const PeerRows* peers, const ChartArgs& ca) {
  const std::string sfx = ca.tag.empty() ? "" : "_" + ca.tag;
  if (text)
    write_text(dir + "/chart_ppl_vs_memory" + sfx + ".svg",
               render_svg_chart(filter_series(chart_ppl_vs_memory(*text, peers), ca.series)));
  if (pk && pk->options.question_aware)
    write_text(
        dir + "/chart_passkey_aware_vs_memory" + sfx + ".svg",
        render_svg_chart(filter_series(chart_passkey_vs_memory(*pk, true, peers), ca.series)));
  if (pk && pk->options.question_agnostic)
    write_text(
        dir + "/chart_passkey_agnostic_vs_memory" + sfx + ".svg",
        render_svg_chart(filter_series(chart_passkey_vs_memory(*pk, false, peers), ca.series)));
}

void add_chart_args(CLI::App* c, ChartArgs& a) {
  c->add_option("--chart-series", a.series,
                "only chart series whose names start with these (e.g. full,snapkv,'peer: kvpress')")
      ->delimiter(',');
  c->add_option("--chart-tag", a.tag, "suffix for the chart file names");
}

void write_all_formats(const std::string& stem, const TextEvalResult* text, const PasskeyResult* pk,
                       const PeerRows* peers) {
  for (auto [fmt, ext] :
       {std::pair{ReportFormat::kMarkdown, ".md"}, std::pair{ReportFormat::kJson, ".json"},
        std::pair{ReportFormat::kCsv, ".csv"}}) {
    // JSON keeps only our own rows so it can be re-read; peers go in md and csv tables.
    const PeerRows* p = fmt == ReportFormat::kJson ? nullptr : peers;
    write_text(stem + ext, text ? render(*text, fmt, p) : render(*pk, fmt, p));
  }
}

}  // namespace

void add_eval_command(CLI::App& app, int* status) {
  auto* cmd = app.add_subcommand("eval", "memory against quality for several cache methods");
  cmd->require_subcommand(1);

  // State lives as long as the app (callbacks run during parse).
  static Common common;
  static TextArgs text;
  static PasskeyArgs pk;
  static std::string out_dir = "eval-out";
  static std::string report_text, report_passkey;
  static ChartArgs charts;

  auto text_cmd = [&](const char* name, const char* help, bool kld) {
    auto* c = cmd->add_subcommand(name, help);
    add_common(c, common);
    add_text(c, text);
    c->callback([status, kld] {
      const Device dev = eval_device(common, true);
      apply_threads(common);
      const auto model = Model::load(common.model_dir);
      check_tensor_parallel(model->config(), dev, common.tensor_parallel, "eval",
                            common.tp_simulate);
      const auto docs = load_docs(*model, text);
      const auto methods = parse_eval_methods(common.methods);
      const auto peers = peers_of(common);
      const TextEvalResult r =
          eval_text(*model, docs, methods, text_opts(text, kld), settings_of(common, dev));
      emit(common, render(r, format_of(common), peers.get()));
      *status = 0;
    });
  };
  text_cmd("ppl", "perplexity under each cache (P context, T decode steps), delta vs full", false);
  text_cmd("kld", "perplexity + KL divergence from the full cache (mean, p99)", true);

  auto* ae = cmd->add_subcommand("attn-error", "per-layer relative L2 error of attention outputs");
  add_common(ae, common);
  add_text(ae, text);
  ae->callback([status] {
    const Device dev = eval_device(common, false);
    apply_threads(common);
    const auto model = Model::load(common.model_dir);
    const auto docs = load_docs(*model, text);
    const auto methods = parse_eval_methods(common.methods);
    const AttnErrorResult r =
        eval_attn_error(*model, docs, methods, text_opts(text, false), settings_of(common, dev));
    emit(common, render(r, format_of(common)));
    *status = 0;
  });

  auto* pc = cmd->add_subcommand("passkey", "passkey accuracy by length and depth, two modes");
  add_common(pc, common);
  add_passkey(pc, pk);
  pc->callback([status] {
    const Device dev = eval_device(common, true);
    apply_threads(common);
    const auto model = Model::load(common.model_dir);
    check_tensor_parallel(model->config(), dev, common.tensor_parallel, "eval", common.tp_simulate);
    const Tokenizer tok = Tokenizer::from_file(common.model_dir + "/tokenizer.json");
    check_tokenizer_vocab(tok.vocab_size(), model->config(), common.model_dir + "/tokenizer.json");
    const auto prompts = load_passkey_jsonl(pk.data);
    const auto methods = parse_eval_methods(common.methods);
    const auto peers = peers_of(common);
    const PasskeyResult r =
        eval_passkey(*model, tok, prompts, methods, passkey_opts(pk), settings_of(common, dev));
    emit(common, render(r, format_of(common), peers.get()));
    *status = 0;
  });

  auto* sw = cmd->add_subcommand(
      "sweep", "kld + passkey for the methods; tables (md/json/csv) and SVG charts in --out-dir");
  add_common(sw, common);
  sw->add_option("--text-data", text.data, "token rows for ppl/kld")->capture_default_str();
  add_int_option(sw, "--prefill,-P", &text.prefill, 0, kMaxTokenCount, "context tokens P", "eval");
  add_int_option(sw, "--decode,-T", &text.decode, 0, kMaxTokenCount, "scored tokens T", "eval");
  add_int_option(sw, "--docs", &text.docs, 0, kMaxTokenCount, "documents for ppl/kld (0 = all)",
                 "eval");
  sw->add_option("--passkey-data", pk.data, "passkey prompts (JSONL)")->capture_default_str();
  add_int_option(sw, "--prompts", &pk.prompts, 0, kMaxTokenCount, "passkey prompts (0 = all)",
                 "eval");
  add_int_list_option(sw, "--lengths", &pk.lengths, 1, kMaxTokenCount,
                      "only these passkey target lengths", "eval");
  sw->add_option("--question", pk.question, "passkey question text (see eval passkey --help)");
  sw->add_option("--out-dir", out_dir, "folder for the tables and charts")->capture_default_str();
  add_chart_args(sw, charts);
  sw->callback([status] {
    const Device dev = eval_device(common, true);
    apply_threads(common);
    std::filesystem::create_directories(out_dir);
    const auto model = Model::load(common.model_dir);
    check_tensor_parallel(model->config(), dev, common.tensor_parallel, "eval", common.tp_simulate);
    const Tokenizer tok = Tokenizer::from_file(common.model_dir + "/tokenizer.json");
    check_tokenizer_vocab(tok.vocab_size(), model->config(), common.model_dir + "/tokenizer.json");
    const auto methods = parse_eval_methods(common.methods);
    const auto peers = peers_of(common);
    const EvalSettings st = settings_of(common, dev);
    const auto docs = load_docs(*model, text);
    const TextEvalResult tr = eval_text(*model, docs, methods, text_opts(text, true), st);
    write_all_formats(out_dir + "/text", &tr, nullptr, peers.get());
    const auto prompts = load_passkey_jsonl(pk.data);
    const PasskeyResult pr = eval_passkey(*model, tok, prompts, methods, passkey_opts(pk), st);
    write_all_formats(out_dir + "/passkey", nullptr, &pr, peers.get());
    write_charts(out_dir, &tr, &pr, peers.get(), charts);
    emit(common, render(tr, ReportFormat::kMarkdown, peers.get()) + "\n" +
                     render(pr, ReportFormat::kMarkdown, peers.get()));
    *status = 0;
  });

  auto* rp = cmd->add_subcommand(
      "report", "re-render saved result JSON (tables + charts), optionally with --peers rows");
  add_common(rp, common, /*with_methods=*/false);
  rp->add_option("--text-json", report_text, "a ppl/kld result JSON (eval kld --json)");
  rp->add_option("--passkey-json", report_passkey, "a passkey result JSON (eval passkey --json)");
  rp->add_option("--out-dir", out_dir, "folder for the re-rendered tables and charts")
      ->capture_default_str();
  add_chart_args(rp, charts);
  rp->callback([status] {
    VQ_CHECK(!report_text.empty() || !report_passkey.empty(),
             "[eval report] expected --text-json and/or --passkey-json but got neither");
    std::filesystem::create_directories(out_dir);
    const auto peers = peers_of(common);
    std::string md;
    std::unique_ptr<TextEvalResult> tr;
    std::unique_ptr<PasskeyResult> pr;
    if (!report_text.empty()) {
      tr = std::make_unique<TextEvalResult>(text_result_from_json(read_text(report_text)));
      write_text(out_dir + "/text.md", render(*tr, ReportFormat::kMarkdown, peers.get()));
      write_text(out_dir + "/text.csv", render(*tr, ReportFormat::kCsv, peers.get()));
      md += render(*tr, ReportFormat::kMarkdown, peers.get());
    }
    if (!report_passkey.empty()) {
      pr = std::make_unique<PasskeyResult>(passkey_result_from_json(read_text(report_passkey)));
      write_text(out_dir + "/passkey.md", render(*pr, ReportFormat::kMarkdown, peers.get()));
      write_text(out_dir + "/passkey.csv", render(*pr, ReportFormat::kCsv, peers.get()));
      md += (md.empty() ? "" : "\n") + render(*pr, ReportFormat::kMarkdown, peers.get());
    }
    write_charts(out_dir, tr.get(), pr.get(), peers.get(), charts);
    emit(common, md);
    *status = 0;
  });
}

}  // namespace vq::cli
