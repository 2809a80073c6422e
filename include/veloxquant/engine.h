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
  // within the declared bound: a check of the sharding); the CUDA engine needs N visible devices
  // and a build with NCCL, and refuses otherwise naming what is missing.
  int64_t tensor_parallel = 1;
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
  virtual int64_t add_sequence() = 0;
  // Frees the sequence's caches (their memory goes back to the device at once).
  virtual void remove_sequence(int64_t seq) = 0;
  virtual int64_t offset(int64_t seq) const = 0;
  // The sequence's cache memory summed over layers (generate.h CacheMemory).
  virtual CacheMemory memory(int64_t seq) const = 0;

  // Runs the chunks together. *logits gets [n, vocab] fp32, one row per chunk with logits = true,
  // in chunk order (resized; untouched when n = 0).
  virtual void step(std::span<const SeqChunk> chunks, std::vector<float>* logits) = 0;

  // Hooks for `veloxquant bench` (the decode bound and the peak-memory column); the CUDA engine
  // overrides both. copy_bandwidth(): bytes per second of a large copy on the engine's device,
  // measured now (the CPU engine: a memcpy of 256 MiB, host_copy_bandwidth). peak_memory_bytes():
  // the most device memory the engine held at once since it was made; 0 = not tracked (the CPU
  // engine: the caches' peak is in the scheduler's totals, the process's in its peak RSS).
  virtual double copy_bandwidth() { return host_copy_bandwidth(); }
  virtual int64_t peak_memory_bytes() const { return 0; }

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
// heads (make_shard_plan), N <= the visible devices ("[engine] --tensor-parallel N: expected at
// most D (the CUDA devices visible) but got N"), and for N > 1 a build with NCCL and the
// engine's multi-device path. vq::Error naming what is missing.
void check_cuda_tensor_parallel(const ModelConfig& c, int64_t n, int device_count, bool nccl);

// make_cpu_engine or make_cuda_engine.
std::unique_ptr<Engine> make_engine(Device d, const Model& model, const EngineOptions& opts);

}  // namespace vq
