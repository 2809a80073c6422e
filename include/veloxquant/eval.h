// The evaluation engine (docs/design.md §5): memory against quality for several cache methods on
// one model, in one run, always against the full-precision cache on the same tokens.
//
// Text protocol (ppl, kld, attn-error): a document is a row of token ids x[0 .. P+T-1]. The first
// P-1 tokens are prefilled in chunks of prefill_step; then T decode steps feed x[P-1 .. P+T-2] one
// at a time, and step t's logits score x[P+t]. So every scored token is predicted by a decode step
// that attends to the compressed cache (a deferred-eviction cache returns its un-evicted rows to
// the prefill call itself, so a token predicted by the prefill would not see the compression),
// and the context when the first token is scored is exactly P tokens.
// Memory figures are taken after decode step memory_step() (summed over layers; rows are per
// (b, h), averaged over layers): the first step, context P, when P >= T (the scored tokens then
// see at most twice P; the step also frees buffers a deferred-eviction cache kept alive for the
// prefill's view); the last step, context P + T - 1, when P < T (with -P 1, which scores every
// position, figures at context 1 would describe a cache no later token sees). rows_end is the
// rows per (b, h) after the last step.
// The engine returns the structs below; rendering them (Markdown, CSV, JSON, SVG charts) is the
// CLI's job (tools/cli/report.h).
// Passkey: prompts (JSONL) are encoded with the tokenizer; greedy decoding of as many tokens as the
// answer " <digits>" has; exact match of the decoded text (whitespace-stripped) with the key.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/cache_config.h"
#include "veloxquant/dtype.h"
#include "veloxquant/engine.h"
#include "veloxquant/model.h"

namespace vq {

class Model;
class Tokenizer;

// One method of a comparison: the spec as written (label) and the config it parses to.
struct EvalMethod {
  std::string label;   // e.g. "snapkv:budget=256:scoring=query"
  std::string family;  // the method name before the first ':' ("snapkv", "skvq", ...)
  CacheConfig cfg;
  // > 0: the budget is this fraction of each sequence's context (see config_for_context).
  double keep_fraction = 0;
};

// Comma-separated specs, each parsed by config_from_spec. Two extensions:
//  - "streaming:budget=N" means sinks + window = N rows (window = N - n_sink), so budgets compare
//    with SnapKV's, which count the sinks;
//  - "keep=F" (0 < F <= 1; snapkv, snapkv+skvq, streaming) sets the budget per sequence to
//    max(1, round(F * n_context)) rows: the kept fraction kvpress-style presses are stated in
//    (kvpress's compression_ratio = 1 - F).
// Empty or malformed entries: vq::Error naming the entry.
std::vector<EvalMethod> parse_eval_methods(const std::string& list);

// The config a sequence whose compressed context has n_context tokens runs with (cfg unchanged
// unless keep_fraction > 0). n_context: P for ppl/kld/attn-error; the prompt (context + question)
// in question-aware passkey, the context alone in question-agnostic passkey.
CacheConfig config_for_context(const EvalMethod& m, int64_t n_context);

// Memory of one method's caches at one context, summed over layers.
struct MemoryFigures {
  int64_t context = 0;              // tokens seen when measured
  double rows_kept = 0;             // rows stored per (b, h), mean over layers
  int64_t bytes_accounted = 0;      // the methods' byte formulas
  int64_t bytes_resident = 0;       // what the caches really hold (allocation slack included)
  int64_t fp16_bytes = 0;           // K+V of every token seen at 2 bytes per element
  double ratio_to_fp16() const;     // accounted / fp16
  double resident_to_fp16() const;  // resident / fp16
};

struct EvalSettings {
  int64_t prefill_step = 512;                        // chunk length of every prefill
  DType kv_dtype = DType::kF16;                      // dtype of the K/V blocks handed to the caches
  MatmulPrecision matmul = MatmulPrecision::kExact;  // ForwardOptions::matmul of every forward
  bool progress = true;                              // progress lines on stderr
  // Methods whose caches take external scores (snapkv:scoring=external) prefill through
  // prefill_reconstruct (veloxquant/reconstruct.h) with this repeat prompt (token ids, no BOS;
  // the CLI's --recon-prompt) and chunk.
  std::vector<int32_t> recon_repeat_ids;
  int64_t recon_chunk = 128;
  std::string model_name;  // shown in reports
  // kCpu: Model::forward over per-layer caches. kCuda: every sequence (the full cache's and each
  // method's) runs on one CUDA engine (engine.h make_cuda_engine, K/V in kv_dtype; matmul does not
  // apply) with the same prefill chunks, end_prompt and decode steps; eval_attn_error and
  // snapkv:scoring=external (prefill_reconstruct) are CPU only and refused there, as is P = 1.
  Device device = Device::kCpu;
  // EngineOptions::tensor_parallel and tp_simulate (veloxquant/engine.h). N > 1 runs every
  // sequence on an engine of N ranks, on the CPU too (its simulated ranks, K/V in kv_dtype and
  // matmul as above; the figures match N = 1 within the sharded pass's fp32 reordering,
  // tests/test_eval_tensor_parallel.cpp); N = 1 on the CPU is the Model::forward path above.
  // Refused with vq::Error before any work: N not dividing the KV heads, tp_simulate without
  // kCuda, and with N > 1 eval_attn_error, snapkv:scoring=external and P = 1 (as on kCuda).
  int64_t tensor_parallel = 1;
  bool tp_simulate = false;
};

// ---- perplexity and KL divergence ---------------------------------------------------------------

struct TextEvalOptions {
  int64_t prefill = 1536;  // P: context tokens before the first scored token
  int64_t decode = 512;    // T: scored tokens, one decode step each
  int64_t max_docs = 0;    // 0 = every document
  bool kld = true;         // keep the full cache's distributions and compute KL divergences
};

// The decode step (0-based) after which the memory figures are taken: 0 if P >= T, else T - 1.
int64_t memory_step(const TextEvalOptions& opts);

struct TextEvalRow {
  std::string label, family;
  int64_t n_docs = 0, n_tokens = 0;
  double nll = 0;            // mean negative log-likelihood (nats) over the scored tokens
  double ppl = 0;            // exp(nll)
  double delta_ppl_pct = 0;  // 100 * (ppl / ppl_full - 1)
  double kld_mean = 0;       // mean over scored tokens of KL(p_full || p_method), nats
  double kld_p99 = 0;        // 99th percentile (nearest rank) of the same
  double top1_agree = 0;     // fraction of scored tokens whose argmax equals the full cache's
  MemoryFigures mem;         // after decode step memory_step(options)
  double rows_end = 0;       // rows per (b, h) after the last step (context P + T - 1)
};

struct TextEvalResult {
  TextEvalOptions options;
  EvalSettings settings;
  double ppl_full = 0;
  int64_t n_docs = 0;
  MemoryFigures mem_full;
  double rows_end_full = 0;
  std::vector<TextEvalRow> rows;  // one per method, in the order given
};

// Rows of token ids [n_rows, row_len] stored little-endian uint16 (data/eval/heldout_ids.u16).
std::vector<std::vector<int32_t>> load_token_rows_u16(const std::string& path, int64_t row_len);

// Runs the full cache and every method on each document (side by side, document by document).
// Documents shorter than P + T are refused (vq::Error naming the document).
TextEvalResult eval_text(const Model& model, const std::vector<std::vector<int32_t>>& docs,
                         const std::vector<EvalMethod>& methods, const TextEvalOptions& opts,
                         const EvalSettings& settings);

// ---- attention-output error ---------------------------------------------------------------------

struct AttnErrorRow {
  std::string label, family;
  // Per layer: sqrt(sum ||o_method - o_full||^2) / sqrt(sum ||o_full||^2) over every decode
  // step's attention output (all query heads), o_full computed over a full-precision shadow cache
  // fed the same K/V blocks and queried with the same queries.
  std::vector<double> layer_rel_l2;
  std::vector<std::vector<double>> head_rel_l2;  // [layer][query head]
  double mean_rel_l2 = 0;                        // mean over layers
  MemoryFigures mem;                             // after decode step memory_step(options)
};

struct AttnErrorResult {
  TextEvalOptions options;
  EvalSettings settings;
  int64_t n_docs = 0, n_layers = 0, n_heads = 0;
  std::vector<AttnErrorRow> rows;
};

AttnErrorResult eval_attn_error(const Model& model, const std::vector<std::vector<int32_t>>& docs,
                                const std::vector<EvalMethod>& methods, const TextEvalOptions& opts,
                                const EvalSettings& settings);

// ---- passkey retrieval --------------------------------------------------------------------------

struct PasskeyPrompt {
  int64_t id = 0;
  std::string prompt;  // context + question, ends right before the answer
  std::string answer;  // the key's digits
  int64_t length = 0;  // tokens (as written by the generator)
  double depth = 0;    // fraction of filler before the needle
  int64_t target_length = 0;
  std::string question;  // the prompt's own question ("" = PasskeyOptions::question)
};

// One JSON object per line (data/eval/passkey.jsonl): "prompt" (string) and "answer" (non-empty
// string) required; "target_length" or "length" (integer >= 1, the length bucket) required;
// "depth" (number in [0, 1]) required; "id" (integer, default: the line's index among prompts)
// and "question" (non-empty string: this prompt's question, see PasskeyOptions::question)
// optional; other fields are ignored. A missing or mistyped field is refused with a vq::Error
// naming the file, the line and the field.
std::vector<PasskeyPrompt> load_passkey_jsonl(const std::string& path);

struct PasskeyOptions {
  int64_t max_prompts = 0;        // 0 = all; else an even spread over the (filtered) list
  std::vector<int64_t> lengths;   // keep only these target lengths (empty = all)
  bool question_aware = true;     // whole prompt prefilled and compressed
  bool question_agnostic = true;  // context compressed before the question is seen
  // The question of prompts without their own "question" field. A prompt is split at the last
  // occurrence of its question (context before, question from there on); a prompt whose own
  // question does not occur in it is the context, and the question follows it.
  std::string question = " What is the pass key?";
};

struct PasskeyModeScore {
  int64_t correct = 0, total = 0;
  std::map<int64_t, std::pair<int64_t, int64_t>> by_length;  // target_length -> (correct, total)
  std::map<int64_t, std::pair<int64_t, int64_t>> by_depth;   // depth in % -> (correct, total)
  // Needle survival, measured right after the context was compressed (before any answer step):
  // over every (layer, KV head), the fraction of the key's rows still stored (the tokens whose
  // text overlaps an occurrence of the key in the context, its leading space included), and
  // whether at least one occurrence survives whole. Summed over prompts whose key was found in
  // the context (needle_prompts of them; total - needle_prompts had no occurrence to follow).
  double needle_rows_kept_sum = 0, needle_heads_whole_sum = 0;
  int64_t needle_prompts = 0;
  double accuracy() const { return total ? static_cast<double>(correct) / total : 0.0; }
  double needle_rows_kept() const {
    return needle_prompts ? needle_rows_kept_sum / needle_prompts : 0;
  }
  double needle_heads_whole() const {
    return needle_prompts ? needle_heads_whole_sum / needle_prompts : 0;
  }
};

struct PasskeyRow {
  std::string label, family;
  PasskeyModeScore aware, agnostic;
  MemoryFigures mem;  // question-aware mode, the longest prompt, after its first answer step
};

struct PasskeyResult {
  PasskeyOptions options;
  EvalSettings settings;
  int64_t n_prompts = 0;
  PasskeyRow full;               // the full cache, always run
  std::vector<PasskeyRow> rows;  // one per method
};

// Question-aware: the whole prompt is prefilled in chunks (the compression sees the question);
// the answer is decoded greedily. Question-agnostic: the context (the prompt up to the question)
// is prefilled in chunks, then the question tokens are fed one decode step each (S == 1: the
// compression of the context happened before any question token and no later eviction can use
// the question as its observation window), then the answer is decoded greedily.
PasskeyResult eval_passkey(const Model& model, const Tokenizer& tokenizer,
                           const std::vector<PasskeyPrompt>& prompts,
                           const std::vector<EvalMethod>& methods, const PasskeyOptions& opts,
                           const EvalSettings& settings);

// ---- side by side on one prompt -----------------------------------------------------------------

struct CompareOptions {
  int64_t max_tokens = 16;  // greedy tokens generated per method
  bool stop_at_eos = true;
};

struct CompareRow {
  std::string label, family;
  std::vector<int32_t> tokens;  // the greedy continuation (a stop token included)
  MemoryFigures mem;            // after the last generated token
  double prefill_seconds = 0, decode_seconds = 0;
};

struct CompareResult {
  CompareOptions options;
  EvalSettings settings;
  int64_t prompt_tokens = 0;
  std::vector<CompareRow> rows;  // one per method, in the order given
};

// Each method generates greedily from the same prompt through vq::generate (the product's
// prefill schedule and decode loop); keep=F budgets are F of the prompt. Errors: empty prompt or
// method list, max_tokens < 1, prompt + max_tokens beyond the model's positions.
CompareResult compare_methods(const Model& model, const std::vector<int32_t>& prompt,
                              const std::vector<EvalMethod>& methods, const CompareOptions& opts,
                              const EvalSettings& settings);

}  // namespace vq
