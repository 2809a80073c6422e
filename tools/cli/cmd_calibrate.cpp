// `veloxquant calibrate`: writes an SKVQ permutation file (JSON, see veloxquant/skvq_cache.h)
// from a calibration text: the text is tokenized, prefilled through the model with full caches,
// and each layer's recorded keys and values give one channel permutation per KV head. Use the
// file with the cache option skvq_perm_file (e.g. --cache-opt perm_file=perms.json).
// With --query-moments FILE it writes the layers' query second moments instead (binary, see
// veloxquant/query_moments.h; both files when --out is given too), for the cache option
// skvq_query_moments_file (e.g. skvq:key_axis=channel:query_moments_file=FILE).
#include <cstdio>
#include <string>

#include "commands.h"
#include "options.h"
#include "veloxquant/calibrate.h"
#include "veloxquant/error.h"
#include "veloxquant/model.h"
#include "veloxquant/tokenizer.h"

namespace vq::cli {
namespace {

struct CalibrateArgs {
  std::string model_dir;
  std::string text_file;
  std::string out = "skvq_perms.json";
  bool out_given = false;
  std::string moments_out;
  int64_t max_tokens = 2048;
};

int run_calibrate(const CalibrateArgs& a) {
  std::string dir = a.model_dir.empty() ? find_shipped_model() : a.model_dir;
  if (dir.empty()) throw Error("[calibrate] --model: no model folder given and none shipped");
  const std::string text = read_text_file(a.text_file, "calibrate", "--text-file");
  const auto model = Model::load(dir);
  const Tokenizer tok = Tokenizer::from_file(dir + "/tokenizer.json");
  check_tokenizer_vocab(tok.vocab_size(), model->config(), dir + "/tokenizer.json");
  std::vector<int32_t> ids = tok.encode(text);
  int64_t limit = a.max_tokens;
  if (model->config().max_position_embeddings > 0)
    limit = std::min(limit, model->config().max_position_embeddings);
  if (static_cast<int64_t>(ids.size()) > limit) ids.resize(static_cast<size_t>(limit));
  if (!a.moments_out.empty()) {
    const QueryMomentSet qm = calibrate_query_moments(*model, ids);
    save_query_moment_file(a.moments_out, qm);
    std::printf(
        "wrote %s: query moments of %zu layers, %lld KV heads, head_dim %lld, from %zu "
        "calibration tokens\n",
        a.moments_out.c_str(), qm.layers.size(), static_cast<long long>(qm.n_kv_heads),
        static_cast<long long>(qm.head_dim), ids.size());
    if (!a.out_given) return 0;
  }
  const SkvqPermSet perms = calibrate_skvq_perms(*model, ids);
  save_skvq_perm_file(a.out, perms);
  std::printf("wrote %s: %zu layers, %lld KV heads, head_dim %lld, from %zu calibration tokens\n",
              a.out.c_str(), perms.key.size(), static_cast<long long>(perms.n_kv_heads),
              static_cast<long long>(perms.head_dim), ids.size());
  return 0;
}

}  // namespace

void add_calibrate_command(CLI::App& app, int* status) {
  auto* a = new CalibrateArgs();  // lives as long as the app (process)
  auto* cmd = app.add_subcommand(
      "calibrate", "SKVQ channel permutations or query moments from a calibration text");
  cmd->add_option("--model", a->model_dir, "model folder (default: the shipped model)");
  cmd->add_option("--text-file", a->text_file, "calibration text (UTF-8)")->required();
  cmd->add_option("--out", a->out, "permutation file to write")->each([a](const std::string&) {
    a->out_given = true;
  });
  cmd->add_option("--query-moments", a->moments_out,
                  "write the query-moment file (skvq_query_moments_file) here instead of the "
                  "permutation file (both with --out)");
  add_int_option(cmd, "--max-tokens", &a->max_tokens, 1, 1 << 20, "calibration tokens at most",
                 "calibrate");
  cmd->callback([a, status] { *status = run_calibrate(*a); });
}

}  // namespace vq::cli
