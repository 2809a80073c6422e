// `veloxquant compare`: every cache method on one long prompt, side by side: each method's greedy
// answer and its KV cache bytes against fp16 (the quick start's main job, scripts/quickstart.sh).
//
//   veloxquant compare [--model DIR] [--methods SPEC,SPEC,...]
//                      (--passkey FILE [--passkey-id N] | --prompt TEXT | --prompt-file FILE)
//                      [--max-tokens N] [--prefill-step N] [--threads N]
//
// --passkey takes one prompt of a passkey JSONL (data/eval/passkey.jsonl by default; the longest
// prompt with its needle at mid-depth unless --passkey-id), generates as many tokens as the
// answer has, and marks each method's answer correct or not. Specs as in `eval` (keep=F budgets
// are F of the prompt). The engine is compare_methods (veloxquant/eval.h); the table is
// render_compare (cli/report.h).
#include <omp.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "cli/report.h"
#include "commands.h"
#include "veloxquant/error.h"
#include "veloxquant/eval.h"
#include "veloxquant/model.h"
#include "veloxquant/tokenizer.h"

namespace vq::cli {

namespace {

// The default line-up: the uncompressed cache, each method family at settings that keep the
// shipped model's passkey answer (docs/RESULTS.md), and a sliding window of the same size as
// SnapKV's to show what choosing rows buys.
const char* const kDefaultMethods =
    "full,"
    "streaming:keep=0.25,"
    "snapkv:keep=0.25:scoring=query:pool_kernel=15:keep_window=true:evict_at=prompt_end,"
    "skvq:bits_key=4:bits_value=4,"
    "snapkv+skvq:keep=0.5:scoring=query:pool_kernel=7:keep_window=true:evict_at=prompt_end:"
    "bits_key=4:bits_value=4";

struct CompareArgs {
  std::string model_dir = "models/vq-mini-llama";
  std::string methods = kDefaultMethods;
  std::string passkey, prompt, prompt_file;
  int64_t passkey_id = -1;  // -1: the longest prompt, needle nearest mid-depth
  int64_t max_tokens = 0;   // 0: the answer's tokens (passkey) or 24
  int64_t prefill_step = 512;
  int64_t threads = 0;
  bool quiet = false;
};

std::string read_file(const std::string& path) {
  VQ_CHECK(!std::filesystem::is_directory(path),
           "[compare] --prompt-file: expected a file but '" + path + "' is a directory");
  std::ifstream in(path, std::ios::binary);
  VQ_CHECK(in.is_open(), "[compare] expected a readable file but could not open '" + path + "'");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

const PasskeyPrompt& pick_passkey(const std::vector<PasskeyPrompt>& all, int64_t id) {
  if (id >= 0) {
    for (const auto& p : all)
      if (p.id == id) return p;
    throw Error("[compare] --passkey-id: expected an id of the prompt file but got " +
                std::to_string(id));
  }
  const PasskeyPrompt* best = &all.front();
  for (const auto& p : all) {
    const bool longer = p.target_length > best->target_length;
    const bool as_long_nearer_mid = p.target_length == best->target_length &&
                                    std::abs(p.depth - 0.5) < std::abs(best->depth - 0.5);
    if (longer || as_long_nearer_mid) best = &p;
  }
  return *best;
}

int run_compare(const CompareArgs& a) {
  const int n_sources = !a.passkey.empty() + !a.prompt.empty() + !a.prompt_file.empty();
  VQ_CHECK(n_sources == 1,
           "[compare] expected exactly one of --passkey, --prompt, --prompt-file but got " +
               std::to_string(n_sources));
  const int64_t cores = omp_get_num_procs();
  VQ_CHECK(a.threads >= 0 && a.threads <= cores,
           "[compare] --threads: expected 0 (all cores) or 1 .. " + std::to_string(cores) +
               " (this machine's cores) but got " + std::to_string(a.threads));
  if (a.threads > 0) omp_set_num_threads(static_cast<int>(a.threads));
  const auto methods = parse_eval_methods(a.methods);
  const auto model = Model::load(a.model_dir);
  const Tokenizer tok = Tokenizer::from_file(a.model_dir + "/tokenizer.json");

  std::string text, expected, about;
  if (!a.passkey.empty()) {
    const auto prompts = load_passkey_jsonl(a.passkey);
    const PasskeyPrompt& p = pick_passkey(prompts, a.passkey_id);
    text = p.prompt;
    expected = p.answer;
    about = a.passkey + " prompt " + std::to_string(p.id) + ": the pass key " + p.answer +
            " is hidden at " + std::to_string(std::lround(p.depth * 100)) + "% of the filler";
  } else {
    text = a.prompt.empty() ? read_file(a.prompt_file) : a.prompt;
    about = a.prompt.empty() ? a.prompt_file : "--prompt";
  }
  const std::vector<int32_t> ids = tok.encode(text, /*add_special_tokens=*/true);
  CompareOptions o;
  o.max_tokens = a.max_tokens > 0 ? a.max_tokens
                 : !expected.empty()
                     ? static_cast<int64_t>(tok.encode(" " + expected, false).size())
                     : 24;
  EvalSettings st;
  st.prefill_step = a.prefill_step;
  st.progress = !a.quiet;
  st.model_name = std::filesystem::path(a.model_dir).filename().string();
  const CompareResult r = compare_methods(*model, ids, methods, o, st);

  std::vector<std::string> answers;
  for (const auto& row : r.rows) answers.push_back(tok.decode(row.tokens, true));
  std::printf("%s · a %lld-token prompt (%s) · greedy, %lld new tokens per method\n\n",
              st.model_name.c_str(), static_cast<long long>(r.prompt_tokens), about.c_str(),
              static_cast<long long>(o.max_tokens));
  const std::string table = render_compare(r, answers, expected);
  std::fwrite(table.data(), 1, table.size(), stdout);
  std::printf(
      "\nKV cache: bytes the method stores after the last token (summed over layers, metadata "
      "included); vs fp16: against every token's K and V at 2 bytes per element; resident: the "
      "bytes allocated, growth slack included.\n");
  std::fflush(stdout);
  return 0;
}

}  // namespace

void add_compare_command(CLI::App& app, int* status) {
  static CompareArgs a;
  auto* c = app.add_subcommand(
      "compare", "every cache method on one long prompt: answers and KV memory side by side");
  c->add_option("--model", a.model_dir, "model directory")->capture_default_str();
  c->add_option("--methods", a.methods, "comma-separated cache specs (as in eval)")
      ->capture_default_str();
  c->add_option("--passkey", a.passkey, "a passkey JSONL (e.g. data/eval/passkey.jsonl)");
  c->add_option("--passkey-id", a.passkey_id,
                "the prompt's id (default: the longest, needle nearest mid-depth)");
  c->add_option("--prompt", a.prompt, "prompt text");
  c->add_option("--prompt-file", a.prompt_file, "file with the prompt text");
  c->add_option("--max-tokens", a.max_tokens,
                "tokens to generate (default: the pass key's tokens, or 24)");
  c->add_option("--prefill-step", a.prefill_step, "prefill chunk length")->capture_default_str();
  c->add_option("--threads", a.threads, "OpenMP threads (0 = all cores)")->capture_default_str();
  c->add_flag("--quiet", a.quiet, "no progress lines on stderr");
  c->callback([status] { *status = run_compare(a); });
}

}  // namespace vq::cli
