// Tensor parallelism (Megatron-style) for the Llama-family forward pass: a layer's query and KV
// heads and its MLP columns split over N ranks, with a sum all-reduce after o_proj and after
// down_proj; every rank holds its heads' KV caches.
//
// The split (ShardPlan): rank r holds KV heads [r * H_kv / N, (r + 1) * H_kv / N) and their query
// heads (GQA groups stay whole), the rows of q/k/v for those heads, o_proj's input columns for
// its query heads, and a contiguous share of the MLP's intermediate columns (gate/up rows,
// down_proj's input columns; the first I % N ranks get one more). N must divide H_kv. The
// residual stream, norms, embeddings and lm_head are replicated; the biases of o_proj and
// down_proj are added by rank 0 only.
//
// Caches: every method's work is per KV head (SnapKV scores and selects per head from its own
// query group; SKVQ groups lie within a head's row, channel permutations and clip searches are
// per head, the Hadamard rotation is per head with signs taken at the head's global index
// (CacheConfig::kv_head_first), calibrated permutations are sliced from the file; streaming and
// full keep every head alike), so rank r's cache is exactly the single-device cache restricted
// to its heads (tests/test_tensor_parallel.cpp checks this bit for bit for every method).
// Options that would cross heads, refused for N > 1 (rank_cache_config):
// - snapkv+skvq with snap_evict_at=prefill_call: an eviction that meets packed rows keeps the
//   layer's packed-row count rectangular (the largest over its heads, src/kv/skvq_store.cpp
//   Store::keep), so one head's selection decides which of another head's rows are quantized
//   early. prompt_end evicts before any row is packed. (A second multi-token prompt on a
//   prompt_end sequence after rows were packed meets the same rule: the ranks then quantize
//   early by their own heads' largest count, at most as many rows as one device would.)
// - snap_scoring=external: the caller's scores cover every head at once through KVCache, which
//   the engines do not expose.
//
// Processes: one process drives every rank, one device per rank (the reference communicator
// runs the ranks in turn on the CPU; the CUDA engine, src/model/engine_cuda.cpp, uses NCCL's
// single-process form, ncclCommInitAll and one ncclAllReduce per rank inside a group, or with
// EngineOptions::tp_simulate runs the ranks on one device with a rank-order device all-reduce).
// Why: the scheduler, tokenizer, sampler, memory planner and the CLI stay single, so
// `--tensor-parallel N` needs no launcher and batch_generate.h runs unchanged on top; the cost is
// one host thread launching every device's kernels in turn (the engine captures no CUDA graphs:
// engine_cuda.cpp says why).
//
// Numerics: a rank's partial o_proj/down_proj sums run over its K / N input columns in the
// kernel's fp32 order, then the all-reduce adds the N partials in rank order in fp32. Against
// the single-device sum over K, each result is within (gamma(K) + gamma(K / N + N - 1)) times
// the sum of its terms' magnitudes, gamma(n) = n u / (1 - n u), u = 2^-24; the tests carry that
// through the layers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/communicator.h"
#include "veloxquant/model.h"

namespace vq {

struct ShardRange {
  int64_t first = 0, count = 0;
};

struct RankShard {
  ShardRange q_heads, kv_heads, intermediate;
};

struct ShardPlan {
  int64_t n_ranks = 1;
  int64_t n_heads = 0, n_kv_heads = 0, intermediate = 0, n_layers = 0;
  std::vector<RankShard> ranks;
};

// The N that divide the model's KV heads, ascending.
std::vector<int64_t> tensor_parallel_sizes(const ModelConfig& c);

// The plan for n_ranks; vq::Error "[tensor_parallel] ..." naming N, the model's query and KV
// heads and the allowed N when N < 1 or N does not divide the KV heads.
ShardPlan make_shard_plan(const ModelConfig& c, int64_t n_ranks);

// rank's share of the caches' configuration: kv_head_first and kv_heads_total set. Refuses
// (vq::Error) an option that crosses heads when the plan has several ranks.
CacheConfig rank_cache_config(const ShardPlan& plan, int64_t rank, const CacheConfig& cfg);

// In-process reference: sum = ((b_0 + b_1) + b_2) + ... in fp32, rank order, for every element;
// then copied to every buffer.
std::unique_ptr<Communicator> make_reference_communicator(int64_t n_ranks);

// Per-rank caches: caches[rank][layer].
using RankCaches = std::vector<std::vector<std::unique_ptr<KVCache>>>;

// The model's weights split by a plan, on the host: row slices point into the model's mapped
// checkpoint, column slices (o_proj, down_proj) are copied once, in the file dtype. `model`
// must outlive it.
class ShardedModel {
 public:
  ShardedModel(const Model& model, int64_t n_ranks);
  ~ShardedModel();

  const Model& model() const { return model_; }
  const ShardPlan& plan() const { return plan_; }
  // Rank r's layers: its slices of every layer's weights (norms replicated), the CUDA engine's
  // upload source.
  const std::vector<Model::Layer>& rank_layers(int64_t rank) const;
  // One cache per layer per rank (rank_cache_config of each rank).
  RankCaches make_caches(const CacheConfig& cfg) const;

  // Model::forward as N ranks over their caches, all-reducing through comm (size() == N):
  // every rank computes the replicated stages, rank 0's residual stream gives the logits.
  // scratch: one per rank (resized), or nullptr.
  void forward(const int32_t* tokens, int64_t batch, int64_t seq, const RankCaches& caches,
               const ForwardOptions& opts, Communicator& comm, std::vector<float>* logits,
               std::vector<ForwardScratch>* scratch = nullptr) const;

 private:
  struct Weights;
  const Model& model_;
  ShardPlan plan_;
  std::unique_ptr<Weights> w_;
};

// The weight bytes the CUDA engine uploads to its busiest device for N ranks (the memory
// planner's MemoryPlanRequest::weight_bytes): N = 1, the checkpoint's bytes
// (Model::checkpoint_bytes); N > 1, per rank its slices of every layer's matrices in their file
// dtype (a q/k/v or gate/up group of mixed dtypes widened to fp32, as the engine does), its
// biases and the norms in fp32, the embedding, and on rank 0 the final norm and lm_head (none
// when tied); the largest rank, or with `simulate` (every rank on one device) their sum.
int64_t device_weight_bytes(const Model& model, int64_t n_ranks, bool simulate);

// Sharded state, one file with a rank table: one frame (binary_io.h, method "tensor_parallel")
// holding N, the
// model's layers, query and KV heads, each rank's KV head range and its layers' cache frames.
// load_sharded_state is all-or-nothing: a file of another N, head split, layer count or cache
// method is refused naming expected and got, and `caches` are left as they were.
void save_sharded_state(std::ostream& out, const ShardPlan& plan, const RankCaches& caches);
void load_sharded_state(std::istream& in, const ShardPlan& plan, RankCaches& caches);

}  // namespace vq
