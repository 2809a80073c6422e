// Many prompts through one Engine (engine.h): continuous batching with per-sequence sampling.
//
// Admission: up to max_batch sequences live at once, and no more than the memory planner allows
// (memory_plan.h, when device_bytes > 0); a finished sequence is removed from the engine (its
// caches freed) and the next waiting prompt starts, in prompt order.
// Steps: while a live sequence is still prefilling, a prefill step runs whole chunks of the
// prefilling sequences (each sequence's chunks are prefill_chunks(prompt, prefill_step_size), the
// schedule vq::generate uses, so SnapKV evicts at the same points) in admission order while their
// tokens fit the step budget of prefill_step_size tokens (always at least one chunk); its last
// chunk asks for logits and calls end_prompt. Otherwise one decode step runs the last token of
// every decoding sequence in one Engine::step. Before the first step, Engine::warm_up
// (BatchGenerateOptions::warm_up) makes the first use of the steps' product shapes.
// Per sequence, generation follows vq::generate exactly (generate.h): its own Sampler with seed
// sampling.seed + prompt index, stop ids (or the model's eos ids), max_tokens (per prompt or the
// default), the max_position_embeddings stop, sample_vocab, non-finite logits refused. With the
// CPU engine each sequence therefore gets the tokens vq::generate gives it alone.
// Each prompt's GenerateResult: tokens, prompt_tokens, stop_reason and decode_steps as vq::generate
// gives them; prefill_seconds / decode_seconds the time of the steps the sequence was in (shared
// with the other sequences of those steps); cache_bytes_prompt the caches' resident bytes after
// the last prefill chunk and its end_prompt, cache_bytes_end before the sequence is removed;
// activation_bytes 0 (the engine's).
// Refusals (vq::Error, before any sequence is added to the engine): no prompts, an empty prompt,
// a token id outside the vocabulary, a prompt past max_position_embeddings, max_tokens < 0,
// max_batch < 1, and a batch the planner says cannot fit.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/engine.h"
#include "veloxquant/generate.h"
#include "veloxquant/memory_plan.h"

namespace vq {

struct BatchPrompt {
  std::vector<int32_t> ids;
  int64_t max_tokens = -1;  // < 0: BatchGenerateOptions::gen.max_tokens
};

struct BatchGenerateOptions {
  // max_tokens, prefill_step_size (also the prefill step's token budget), sampling (seed +
  // prompt index per sequence), stop_ids, stop_at_eos, sample_vocab. kv_dtype and matmul are the
  // engine's (EngineOptions); on_token and on_prefill_progress are not used (see below).
  GenerateOptions gen;
  int64_t max_batch = 8;  // sequences live at once at most
  // Memory the planner may give the weights, workspace and caches; 0 = no memory limit.
  int64_t device_bytes = 0;
  // the checkpoint's bytes (Model::checkpoint_bytes); with tensor parallelism the busiest
  // device's (device_weight_bytes, tensor_parallel.h): the plan is per device
  int64_t weight_bytes = 0;
  // true: min(max_batch, prompts) sequences must fit at once or the request is refused (bench);
  // false: admission is capped at what fits and only a request of which not one fits is refused.
  bool require_full_batch = false;
  // Called with (prompt index, token) for each generated token; return false to stop that
  // sequence (stop_reason "callback").
  std::function<bool(int64_t, int32_t)> on_token;
  // Engine::warm_up before the first step, for decode steps of up to the sequences live at once
  // and prefill steps of min(prefill_step_size, longest prompt) tokens (its time in
  // BatchGenerateResult::warm_up_seconds, in no step's). false: each shape's first use falls in
  // the step that first runs it (for comparison; the same tokens either way).
  bool warm_up = true;
};

struct BatchGenerateResult {
  std::vector<GenerateResult> results;          // one per prompt, in prompt order
  int64_t prefill_tokens = 0;                   // prompt tokens of every sequence
  int64_t decode_tokens = 0;                    // decode forward rows (sum of decode_steps)
  int64_t prefill_steps = 0, decode_steps = 0;  // Engine::step calls of each kind
  double prefill_seconds = 0;                   // time in prefill steps (with their sampling)
  double decode_seconds = 0;                    // time in decode steps (with their sampling)
  // The first decode step's time (in decode_seconds too): the caches' first growth past the
  // prompt (the full cache reallocates and copies its rows there, when not reserved) falls in
  // it, and without warm-up cuBLAS's first use of the decode step's product shapes.
  double first_decode_step_seconds = 0;
  double warm_up_seconds = 0;  // Engine::warm_up's time (BatchGenerateOptions::warm_up), else 0
  int64_t max_live = 0;        // most sequences live at once
  // The live sequences' cache bytes summed, at their most after any step (CacheMemory).
  int64_t peak_cache_bytes_resident = 0;
  int64_t peak_cache_bytes_accounted = 0;
  // Sum over decode steps of the live sequences' bytes_accounted after the step: about the cache
  // bytes the decode steps read (the decode bound of `veloxquant bench`).
  int64_t decode_cache_bytes = 0;
  MemoryPlan plan;  // the plan admission used (zeros when device_bytes == 0)

  double prefill_tokens_per_s() const {
    return prefill_seconds > 0 ? static_cast<double>(prefill_tokens) / prefill_seconds : 0.0;
  }
  double decode_tokens_per_s() const {
    return decode_seconds > 0 ? static_cast<double>(decode_tokens) / decode_seconds : 0.0;
  }
  // Decode tokens/s of the steps after the first (0 with fewer than two steps): the steady rate
  // once the caches have grown past the prompt. Assumes every decode step has the same number of
  // sequences (bench: all live at once).
  double steady_decode_tokens_per_s() const {
    const double s = decode_seconds - first_decode_step_seconds;
    return decode_steps > 1 && s > 0
               ? static_cast<double>(decode_tokens) * static_cast<double>(decode_steps - 1) /
                     static_cast<double>(decode_steps) / s
               : 0.0;
  }
};

BatchGenerateResult batch_generate(Engine& engine, std::span<const BatchPrompt> prompts,
                                   const BatchGenerateOptions& opts);

}  // namespace vq
