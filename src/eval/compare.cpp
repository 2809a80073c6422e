// Side-by-side generation (veloxquant/eval.h, compare_methods): one prompt, one greedy
// continuation per cache method through vq::generate (so the prefill schedule and the decode loop
// are the product's), and each method's cache memory after the last generated token.
// `keep=F` specs get their budget from the prompt's length (config_for_context).
#include <chrono>

#include "eval/eval_internal.h"
#include "veloxquant/error.h"
#include "veloxquant/eval.h"
#include "veloxquant/generate.h"

namespace vq {

CompareResult compare_methods(const Model& model, const std::vector<int32_t>& prompt,
                              const std::vector<EvalMethod>& methods, const CompareOptions& opts,
                              const EvalSettings& settings) {
  VQ_CHECK(!prompt.empty(), "[compare] expected a prompt of at least one token but got none");
  VQ_CHECK(opts.max_tokens >= 1,
           "[compare] max_tokens: expected >= 1 but got " + std::to_string(opts.max_tokens));
  VQ_CHECK(!methods.empty(), "[compare] expected at least one method but got none");
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  const int64_t max_pos = model.config().max_position_embeddings;
  VQ_CHECK(max_pos <= 0 || n_prompt + opts.max_tokens <= max_pos,
           "[compare] expected prompt + max_tokens within the model's " + std::to_string(max_pos) +
               " positions but got " + std::to_string(n_prompt) + " + " +
               std::to_string(opts.max_tokens));
  CompareResult res;
  res.settings = settings;
  res.options = opts;
  res.prompt_tokens = n_prompt;
  eval_detail::Progress prog(settings.progress, "compare");
  for (const EvalMethod& m : methods) {
    const auto caches = model.make_caches(config_for_context(m, n_prompt));
    GenerateOptions go;
    go.max_tokens = opts.max_tokens;
    go.prefill_step_size = settings.prefill_step;
    go.stop_at_eos = opts.stop_at_eos;
    go.kv_dtype = settings.kv_dtype;
    go.matmul = settings.matmul;
    const GenerateResult g = generate(model, prompt, caches, go);
    CompareRow row;
    row.label = m.label;
    row.family = m.family;
    row.tokens = g.tokens;
    row.mem = eval_detail::memory_of(caches);
    row.prefill_seconds = g.prefill_seconds;
    row.decode_seconds = g.decode_seconds;
    res.rows.push_back(std::move(row));
    prog.line(m.label + " done", true);
  }
  return res;
}

}  // namespace vq
