// Many sequences at once on one device: an Engine holds one model (on the CPU, or uploaded to a
// CUDA device) and the KV caches of every live sequence. step() runs the model over a chunk of
// tokens of each of several sequences together: the matrix products over all their tokens at
// once, attention per sequence over its own caches (its own rows, positions, SnapKV selection and
// SKVQ frontier), and returns each sequence's last-token logits. The batch scheduler
// (batch_generate.h) and the memory planner (memory_plan.h) sit on top.
//
// Contract shared by both engines (docs/design.md §C1 for the caches):
// - a sequence id is valid from add_sequence() until remove_sequence(); its caches start empty
//   (offset 0) with the engine's CacheConfig, one per layer, batch 1;
// - a step's chunks name distinct sequences; chunk i's tokens continue sequence i at its offset;
// - end_prompt = true calls end_prompt on that sequence's caches after the chunk (SnapKV's
//   prompt-end eviction), exactly as vq::prefill does after its last chunk;
// - bad input (unknown or repeated id, empty chunk, a token id outside the vocabulary, a position
//   past max_position_embeddings) is refused with vq::Error before any cache changes.
// With EngineOptions::tensor_parallel = N > 1, a sequence's caches are N ranks' caches of its
// KV heads (memory() sums them) and the CPU engine's step is ShardedModel::forward.
// Numerics: the CPU engine is Model::forward per sequence (its declared arithmetic, model.h);
// the CUDA engine uses bf16/fp16 operands with fp32 accumulation (cuBLAS) and the CUDA caches'
// attention (cuda.h), within the bounds its tests declare against the CPU engine.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/cache_config.h"
#include "veloxquant/generate.h"
#include "veloxquant/model.h"

namespace vq {

enum class Device : uint8_t { kCpu, kCuda };

// "cpu" or "cuda"; anything else: vq::Error naming the value and the accepted ones.
Device parse_device(const std::string& name);
const char* device_name(Device d);

struct EngineOptions {
  CacheConfig cache;             // every sequence's cache method and options
  DType kv_dtype = DType::kF16;  // K/V handed to the caches (ForwardOptions::kv_dtype)
  MatmulPrecision matmul = MatmulPrecision::kExact;  // CPU engine only
  // Ranks of tensor parallelism (veloxquant/tensor_parallel.h); must divide the KV heads. The
  // CPU engine runs N > 1 as simulated ranks with the reference all-reduce (same tokens, logits
  // within the declared bound: a check of the sharding); the CUDA engine runs rank r on device r
  // with NCCL's all-reduce (N visible devices and a build with NCCL, refused otherwise naming
  // what is missing), or with tp_simulate N simulated ranks on the current device.
  int64_t tensor_parallel = 1;
  // CUDA engine, a test/diagnostic switch (`--tp-simulate`): the N ranks share the current device
  // and one stream, each with its own weight shard, caches and scratch, and their all-reduce sums
  // in rank order on the device (cuda::make_device_reference_communicator), so the sharded
  // engine runs on one GPU. Costs N replicated embeddings and N times the launches; no speed-up.
  bool tp_simulate = false;
  // CUDA engine: time each phase of step() with CUDA events (phase_times(); `bench --phases`).
  // Results are unchanged; each step then waits for its last event (one host sync per step).
  bool time_phases = false;
  // CUDA engine: the single-token chunks of a step attend in one decode launch per layer (and
  // rank) for all of them (cuda::decode_attention_run_batch), each planned for its share of the
  // launch's blocks. false: one launch per sequence, each planned for a launch of its own (for
  // comparison; the split counts differ, so the outputs differ in fp32 rounding only).
  bool batch_decode = true;
  // CUDA engine: Engine::reserve sizes a sequence's caches for its whole length up front
  // (reserves_capacity() true). false: reserve() does nothing and the caches grow on demand.
  bool reserve_capacity = true;
  // CUDA engine: the caches' row writes of a step's layer are recorded and launched together,
  // up to 24 per launch (cuda::RowWriteBatch, veloxquant/cuda_row_writes.h), before the layer's
  // attention. false: each write launches on its own (for comparison; the same bytes either way).
  bool batch_cache_writes = true;
};

// Time spent in one phase of the steps of one kind (EngineOptions::time_phases): gpu_seconds is
// the sum over steps of the device time between the event that opens the phase and the next one
// (so the phases of a step add up to its device time, host gaps included where the device waited
// for the host); host_seconds the host's time between the same two points.
struct PhaseTime {
  std::string phase;
  bool decode = false;  // steps whose chunks are all single tokens, else prefill/mixed steps
  int64_t steps = 0;
  double gpu_seconds = 0, host_seconds = 0;
  // Calls in the phase that wait (summed over the steps): stream synchronisations (also those of
  // synchronous host <-> device copies), device allocations and frees (cudaFree waits for the
  // device). The CUDA engine's counts (src/cuda/counters.h); 0 elsewhere.
  int64_t syncs = 0, mallocs = 0, frees = 0;
};

// `eval attn-error` on an engine (Engine::set_attention_tap, src/eval/text_eval.cpp): the
// attention-output error of a sequence's caches against a full-precision shadow of the same rows.
// Per layer l and query head h, over the steps taken while `active` (every query of the step's
// chunk): err2[l][h] += sum ||o_c - o_f||^2 and ref2[l][h] += sum ||o_f||^2, o_c the attention of
// the layer's rotated queries over the sequence's cache view, o_f over the shadow's (scale
// 1/sqrt(D), the model's sliding window, the chunk's positions). The shadow is fed every step,
// active or not. The engine sizes err2 and ref2 to [n_layers][n_heads] (zeros) when the tap is
// set and only adds to them.
struct AttentionTap {
  bool active = false;
  std::vector<std::vector<double>> err2, ref2;
};

struct SeqChunk {
  int64_t seq = 0;                  // id from add_sequence()
  std::span<const int32_t> tokens;  // appended at the sequence's offset; at least one
  bool logits = true;               // return the logits of the chunk's last token
  bool end_prompt = false;          // end_prompt() on the sequence's caches after the chunk
};

class Engine {
 public:
  virtual ~Engine() = default;

  virtual Device device() const = 0;
  virtual const ModelConfig& config() const = 0;
  virtual const EngineOptions& options() const = 0;

  // A new sequence with empty caches; returns its id (never reused by this engine).
  int64_t add_sequence() { return add_sequence(options().cache); }
  // The same with caches of another config than options().cache (the evaluation engine runs every
  // method of a comparison on one engine). A config the engine's caches refuse is refused with
  // vq::Error naming what was wrong, before anything is allocated.
  virtual int64_t add_sequence(const CacheConfig& cache) = 0;
  // Before a sequence's first step: its caches reserve room for `tokens` tokens (prompt + new
  // tokens - 1, memory_plan.h context_tokens) at their first allocation, so no growth copy
  // follows (the full cache's store, the skvq cache's packed run; other methods size themselves).
  // Results are unchanged. Engines for
  // which reserves_capacity() is false ignore it (the planner then counts growth slack).
  virtual void reserve(int64_t seq, int64_t tokens) {
    (void)seq;
    (void)tokens;
  }
  virtual bool reserves_capacity() const { return false; }
  // Frees the sequence's caches (their memory goes back to the device at once).
  virtual void remove_sequence(int64_t seq) = 0;
  virtual int64_t offset(int64_t seq) const = 0;
  // The sequence's cache memory summed over layers (generate.h CacheMemory).
  virtual CacheMemory memory(int64_t seq) const = 0;
  // The positions the sequence's cache of `layer` stores for KV head `head`, ascending
  // (KVCache::stored_positions of batch row 0); out-of-range layer or head: vq::Error.
  virtual std::vector<int32_t> stored_positions(int64_t seq, int64_t layer, int64_t head) const = 0;

  // Before a run's first step (batch_generate, bench): the first use of every matrix-product
  // shape the run's steps can take, done now so that no step pays it. The CUDA engine runs each
  // product of a decode step of m rows (fused q|k|v, o_proj, gate|up, down_proj, lm_head) for
  // every m in warm_up_row_counts(max_rows), and with prefill_tokens > 0 the four layer products
  // of a prefill step of that many tokens, on its scratch buffers: cuBLAS's lazy kernel loading
  // and its choice of kernel per shape then land here (the first decode step at 8 x 32K of an
  // 8B model paid 89 ms of it, docs/results/gpu/engine/run6/README.md). No sequence, cache or
  // offset changes, and later steps give the same results bit for bit (the same kernels run on
  // the same shapes). Returns the seconds it took, the device's work included; shapes already
  // warmed cost nothing. The CPU engine has nothing to warm: 0. max_rows or prefill_tokens < 0:
  // vq::Error before anything runs.
  virtual double warm_up(int64_t max_rows, int64_t prefill_tokens = 0);

  // Runs the chunks together. *logits gets [n, vocab] fp32, one row per chunk with logits = true,
  // in chunk order (resized; untouched when n = 0).
  virtual void step(std::span<const SeqChunk> chunks, std::vector<float>* logits) = 0;
  // step() for greedy decoding: *tokens gets one id per chunk with logits = true, in chunk order:
  // the argmax of that row's logits over ids [0, n_vocab) by vq::argmax's rule (generate.h: NaN
  // as -inf, ties to the lower id), or -1 when none of the row's vocab_size logits is finite.
  // The CUDA engine picks on the device and copies only the ids; this default calls step() and
  // vq::argmax on the host. n_vocab outside [1, vocab_size]: vq::Error before anything runs.
  virtual void step_greedy(std::span<const SeqChunk> chunks, int64_t n_vocab,
                           std::vector<int32_t>* tokens);

  // Context-reconstruction scores for the sequence's prompt (scoring=external, reconstruct.h:
  // snapkv with snap_scoring = external, skvq with skvq_protect_scoring = external): scores
  // [layer][1, n_kv_heads, n] fp32, n the prompt's length, as prefill_reconstruct returns them.
  // Kept until the step whose chunk of this sequence has end_prompt = true and ends at offset n,
  // then handed to each layer's caches (KVCache::set_external_scores; ranks: their heads' rows)
  // just before end_prompt(). A step with such a chunk ending at another offset is refused
  // before any change. Refused (vq::Error, nothing kept) for a sequence whose caches take no
  // external scores, past its prompt (end_prompt done) or with a shape other than
  // [n_layers][n_kv_heads * n], n >= 1. The default refuses: engines without the hook.
  virtual void set_external_scores(int64_t seq, std::vector<std::vector<float>> scores);

  // `eval attn-error` (AttentionTap above): from the sequence's next step on, its every layer
  // also feeds a full-precision shadow cache and, while tap->active, adds the attention-output
  // error to *tap (which must outlive the sequence or a later set_attention_tap(seq, nullptr)).
  // Only on an empty sequence (offset 0: the shadow must hold every row); nullptr removes the
  // tap and its shadow. The default refuses: engines without the hook (the CPU's attn-error taps
  // Model::forward's caches instead, src/eval/text_eval.cpp).
  virtual void set_attention_tap(int64_t seq, AttentionTap* tap);

  // `bench --synthetic-prefill` only: appends n_tokens positions of pseudo-random K/V (uniform on
  // [-sqrt 3, sqrt 3): unit variance; queries alike for SnapKV query scoring) to every layer of
  // the sequence's caches in calls of `chunk` rows, with no model forward, then end_prompt(): the
  // caches hold what a prompt of n_tokens leaves (rows, positions, SnapKV selection, SKVQ
  // frontier) with other values, so decode can be timed at batches whose real prefill would take
  // minutes. The sequence must be empty; n_tokens, chunk >= 1 and within the model's positions,
  // else vq::Error before any change. Deterministic for (engine kind, seed, sequence id, layer).
  virtual void fill_synthetic(int64_t seq, int64_t n_tokens, int64_t chunk, uint64_t seed) = 0;

  // Hooks for `veloxquant bench` (the decode bound and the peak-memory column); the CUDA engine
  // overrides both. copy_bandwidth(): bytes per second of a large copy on the engine's device,
  // measured now (the CPU engine: a memcpy of 256 MiB, host_copy_bandwidth). peak_memory_bytes():
  // the most device memory the engine held at once since it was made; 0 = not tracked (the CPU
  // engine: the caches' peak is in the scheduler's totals, the process's in its peak RSS).
  virtual double copy_bandwidth() { return host_copy_bandwidth(); }
  virtual int64_t peak_memory_bytes() const { return 0; }
  // Per-phase times since the engine was made, in step order of the phases (decode steps' first);
  // empty unless EngineOptions::time_phases on the CUDA engine.
  virtual std::vector<PhaseTime> phase_times() const { return {}; }

  // Best of a few memcpy's of `bytes` between two host buffers: read + write bytes per second
  // (2 x bytes / seconds), the CPU's copy bandwidth.
  static double host_copy_bandwidth(int64_t bytes = int64_t{256} << 20);
};

// The CPU engine: Model::forward per sequence over its own caches (model.h). `model` must outlive
// the engine.
std::unique_ptr<Engine> make_cpu_engine(const Model& model, const EngineOptions& opts);

// The CUDA engine: uploads the model's weights once in their file dtype; `model` must outlive the
// engine. Without a CUDA build or a device: vq::Error "[engine] ..." saying which is missing.
std::unique_ptr<Engine> make_cuda_engine(const Model& model, const EngineOptions& opts);

// The CUDA engine's tensor-parallel checks, made before anything is uploaded: N divides the KV
// heads (make_shard_plan); with `simulate` (EngineOptions::tp_simulate) one visible device is
// enough; otherwise N <= the visible devices ("[engine] --tensor-parallel N: expected at most D
// (the CUDA devices visible) but got N ...") and for N > 1 a build with NCCL. vq::Error naming
// what is missing.
void check_cuda_tensor_parallel(const ModelConfig& c, int64_t n, int device_count, bool nccl,
                                bool simulate = false);
// vq::Error unless layer is in [0, n_layers) and head in [0, n_kv_heads) (both engines'
// stored_positions).
void check_layer_head(const ModelConfig& c, int64_t layer, int64_t head);

// fill_synthetic's refusals (both engines): an empty sequence (offset 0), n_tokens and chunk
// >= 1, n_tokens within max_position_embeddings.
void check_synthetic(const ModelConfig& c, int64_t offset, int64_t n_tokens, int64_t chunk);

// vq::Error unless n_vocab is in [1, vocab_size] (step_greedy's check).
void check_greedy_vocab(const ModelConfig& c, int64_t n_vocab);

// The decode-step row counts Engine::warm_up(max_rows) warms, ascending: every count in
// [1, min(max_rows, kWarmUpEveryRowUpTo)], then max_rows itself when it is larger (a run's
// first decode steps have all its sequences; only the counts between kWarmUpEveryRowUpTo and
// max_rows that a shrinking batch passes through are left to their first use). Empty for 0;
// max_rows or prefill_tokens < 0: vq::Error naming the value (warm_up's check).
inline constexpr int64_t kWarmUpEveryRowUpTo = 256;
std::vector<int64_t> warm_up_row_counts(int64_t max_rows, int64_t prefill_tokens = 0);

// make_cpu_engine or make_cuda_engine.
std::unique_ptr<Engine> make_engine(Device d, const Model& model, const EngineOptions& opts);

}  // namespace vq
