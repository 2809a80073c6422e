// The memory planner: how many sequences of a given context fit in a device's memory, per cache
// method, computed from shapes alone (nothing is allocated), so a batch that cannot fit is refused
// before anything is.
//
// Per sequence, the caches' bytes summed over layers at their peak over the sequence's life, with
// the byte formulas the caches report (CacheStats::bytes_accounted, docs/design.md §C2-§C5) at
// every point a caller can read them: after each prefill chunk (prefill_chunks(prompt, step)),
// after end_prompt, after each decode step (prompt + 1 .. prompt + max_new_tokens - 1 tokens: the
// last generated token is never fed back). The figure equals the caches' reported peak for full,
// streaming, snapkv and skvq; for snapkv+skvq it is an upper bound (which kept rows stay packed
// depends on the scores; the bound counts the most full-precision rows the flush rule allows:
// skvq_n_sink sinks + skvq_window + skvq_recent - 1 tail rows). The resident bytes add the
// allocation slack of the row stores: the growth rule of the full and SnapKV stores (x1.25,
// rounded up to 256 rows) on their full-precision rows, and one prefill chunk of fp16 rows that a
// call holds before it evicts or flushes; for the SKVQ methods the packed run at its largest
// capacity (reserved, or grown x1.5 in steps of 64 rows on a backend with one packed run, the
// CUDA one), the full-precision store's doubling rule replayed in the storage dtype, and once per
// sequence the old store a growth copy holds (one layer's at a time).
//
// Weights: the checkpoint's bytes (Model::checkpoint_bytes; uploaded once in their file dtype).
// Workspace: the forward pass's fp32 activations for a step of `step_tokens` tokens (the prefill
// chunk budget) plus the logits of max_batch sequences.
// With tensor parallelism the figures are one device's: its ranks' caches (each rank's formulas
// over its heads: every byte formula above is a sum over heads), its ranks' workspaces and the
// weights the caller names; a batch that does not fit on a device is refused before allocation.
#pragma once

#include <cstdint>
#include <string>

#include "veloxquant/cache_config.h"
#include "veloxquant/dtype.h"
#include "veloxquant/model.h"

namespace vq {

struct MemoryPlanRequest {
  ModelConfig model;
  CacheConfig cache;
  DType kv_dtype = DType::kF16;  // K/V handed to the caches (the full cache stores this dtype)
  int64_t prompt_tokens = 0;     // >= 1
  int64_t max_new_tokens = 0;    // >= 0
  int64_t prefill_step = 512;    // tokens per prefill chunk (and per step across sequences)
  int64_t weight_bytes = 0;      // the checkpoint's bytes
  int64_t device_bytes = 0;      // memory the weights, workspace and caches may use
  int64_t max_batch = 1;         // sequences decoded together (the logits rows of a step)
  // Tensor parallelism (veloxquant/tensor_parallel.h): N ranks (must divide the KV heads), each
  // holding n_kv_heads / N heads of every cache and the activations of its shard (query heads,
  // KV heads and intermediate columns / N, hidden and logits whole). ranks_per_device: 1 (one
  // device per rank: the plan is one device's, the largest rank's) or N (EngineOptions::
  // tp_simulate: every rank on one device). The plan is then per device: weight_bytes must be
  // that device's weights (device_weight_bytes, tensor_parallel.h) and device_bytes its memory.
  int64_t tensor_parallel = 1;
  int64_t ranks_per_device = 1;
  // The engine reserves each sequence's whole context at creation (the CUDA engine's
  // Engine::reserve, reserves_capacity()): a full cache then holds exactly context_tokens rows
  // rounded up to its 256-row step, so cache_bytes_resident is exactly what that store's two
  // device allocations hold (no growth slack); an skvq cache's packed run holds exactly the
  // records of the whole context (skvq_packed_rows) rounded up to 64 rows, counted exactly (its
  // full-precision rows keep their slack). false: the skvq packed run's growth is counted (x1.5
  // capacity, plus the old run a growth copy holds, once), as is snapkv+skvq's always.
  bool reserve_capacity = false;
};

struct MemoryPlan {
  // Per sequence, summed over layers.
  int64_t cache_bytes_peak = 0;      // bytes_accounted at its peak (see above)
  bool cache_bytes_exact = false;    // true: equals the caches' peak; false: an upper bound
  int64_t cache_bytes_resident = 0;  // bound on bytes_resident at any time (allocation slack)
  int64_t cache_bytes_prompt = 0;    // bytes_accounted after the last prefill chunk
  int64_t context_tokens = 0;  // tokens the caches see: prompt + max_new_tokens - 1 (>= prompt)
  int64_t weight_bytes = 0;
  int64_t workspace_bytes = 0;
  // Sequences that fit at once: (device - weights - workspace) / cache_bytes_resident, >= 0.
  int64_t max_sequences = 0;
  std::string summary() const;  // one line: the figures above in MiB
};

// Errors (vq::Error "[memory_plan] ..."): tensor_parallel not dividing the KV heads,
// ranks_per_device neither 1 nor tensor_parallel, prompt_tokens < 1, max_new_tokens < 0,
// prefill_step < 1, max_batch < 1, negative byte counts, a context past the model's
// max_position_embeddings, an invalid cache config.
MemoryPlan plan_memory(const MemoryPlanRequest& req);

// Refuses (vq::Error naming the figures) a batch of `n_sequences` that does not fit:
// "[memory_plan] expected at most <max> sequences of <context> tokens with <method> to fit in
// <device> MiB (weights <w> MiB + workspace <x> MiB + <c> MiB per sequence) but got <n>".
void check_fits(const MemoryPlan& plan, const MemoryPlanRequest& req, int64_t n_sequences);

// The forward pass's activation bytes for a call of `tokens` tokens (fp32 buffers of
// ForwardScratch, model.h) plus `logit_rows` rows of fp32 logits.
int64_t activation_bytes(const ModelConfig& m, int64_t tokens, int64_t logit_rows);

}  // namespace vq
