// The CUDA engine (engine.h): the Llama-family forward of forward.cpp on one device, over the
// GPU-resident caches of cuda_cache.h, for many sequences at once.
//
// Weights are uploaded once in their file dtype (a tied lm_head shares the embedding's buffer);
// when the matrices read by one operand (q/k/v, or gate/up) do not share a dtype, that group is
// widened to f32 on upload. One step of T tokens (the chunks one after another, token-major):
// x [T, hidden] fp32 residual; per layer h = RMSNorm(x) written in the group's dtype (the product
// operand: bf16/f16 activations, fp32 for f32 weights), q|k|v = h W^T through one cuBLAS
// product over the group's rows uploaded as one matrix, fp32 outputs, bias + RoPE (host cos/sin
// tables, rope_cos_sin) into head-major per chunk: q fp32 [H_q, S, D], k/v [H_kv, S, D] in
// EngineOptions::kv_dtype; per chunk its sequence's
// DeviceKVCache::update_and_fetch (queries passed for SnapKV query scoring; the caches' row
// writes of all the chunks recorded and launched together before any attention reads them,
// EngineOptions::batch_cache_writes, veloxquant/cuda_row_writes.h), then attention over the view:
// prefill_attention for chunks of several tokens, the planned decode kernels for single tokens
// (planned at the first layer of a step, re-planned only when a later layer's view has another
// shape; when n sequences decode, each one's plan takes its share of whole waves of blocks over all
// n, and all n run in ONE split launch and one combine per layer and rank (per balanced piece of
// at most 32 sequences),
// cuda::decode_attention_run_batch, EngineOptions::batch_decode; a query-head group past 8 or
// not a power of two runs as DecodePlan::kv_rep blocks per KV head inside the same launch);
// o_proj, residual, RMSNorm, gate|up (one product), SwiGLU,
// down_proj, residual (docs/design.md §C1 for the cache contract). Logits: the final RMSNorm and
// lm_head on the requested rows only, then one copy to the host (the step's only host sync);
// step_greedy picks each row's argmax on the device and copies only the ids.
// Engine::reserve sizes a sequence's caches for its whole length before its first step (the full
// cache's one store, FullCache::reserve; the skvq cache's packed run, SkvqCache::reserve; the
// planner counts both exactly, reserve_capacity), so no growth copy lands on a decode step. Scratch
// buffers grow to the largest step and are reused.
//
// Engine::warm_up (batch_generate and bench call it before a run's first step): cuBLAS loads a
// kernel on its first launch (lazy module loading) and chooses a kernel per product shape at that
// shape's first use, which cost the first decode step 70 ms in q/k/v and 19 ms in o_proj at
// 8 x 32K of an 8B model (docs/results/gpu/engine/run6/README.md); a decode step's shapes depend
// on its row count m (its sequences), which batch_generate shrinks as sequences finish. warm_up
// runs the step's own product calls (qkv_product .. lm_head_product: the same handle, shapes,
// dtypes and weight pointers) on the scratch for every m in warm_up_row_counts (1 .. 256, then
// the maximum) and for the prefill step's token count, once per distinct layer shape (layer 0's
// for a uniform model); the products write only scratch that every step rewrites before reading.
// Cost on paper for Llama-3-8B in bf16: a row count reads q|k|v 50 MB, o_proj 34 MB, gate|up
// 235 MB, down_proj 117 MB and lm_head 1,051 MB, 1.49 GB, about 0.4 ms at the 3.7-4.2 TB/s
// measured, and does 1.49 m GFLOP, under that read time up to m of about 250 at the H200's bf16
// rate: about 0.1 s for 1 .. 256 (146 counts, a batch_generate at the largest K2V2 batch: 55 ms),
// 3 ms at 8 rows, plus each distinct kernel's one load, which a run reaching that count pays
// anyway. Chosen over bucketing (padding a step's rows up to a few sizes): padding changes which
// kernel a row count runs (logits differ from today's in fp32 rounding) and costs the padded
// rows' products on every step, while warming every count costs a fraction of one decode step
// once. A prefill step of T tokens: its four layer products, 2 T x 218 M flops for the 8B (0.3
// ms at T = 512, about 20 ms at 32768; one layer of one prefill step).
// No CUDA graphs: every step's kernel
// arguments are made on the host (cache offsets and row counts, view pointers, decode plans), so a
// captured graph would be stale at the next step and capturing costs what launching does
// (docs/results/gpu/engine/run2/README.md measured where a step goes). Built only with
// VQ_CUDA (src/model/engine_cuda_stub.cpp refuses otherwise).
//
// Tensor parallelism (EngineOptions::tensor_parallel = N > 1, veloxquant/tensor_parallel.h):
// the engine holds N ranks, each with its own stream, cuBLAS handle, decode workspace, scratch and
// its shard of the weights (ShardedModel's slices: q/k/v and gate/up by output rows, o_proj and
// down_proj by input columns, their biases on rank 0), and every sequence holds N caches per
// layer, rank r's for its KV heads (rank_cache_config). A layer runs its attention half on every
// rank, the sum all-reduce of the partial o_proj outputs, its MLP half on every rank and the
// all-reduce of the partial down_proj outputs; the residual stream, norms and embedding are
// replicated, and rank 0 alone makes the logits. One process drives every rank: with
// EngineOptions::tp_simulate the N ranks share the current device and one stream and the sums
// run in rank order (cuda::make_device_reference_communicator), otherwise rank r runs on device r
// with its own stream and NCCL (cuda::make_nccl_communicator: ncclCommInitAll, one ncclAllReduce
// per rank inside a group). Why one process: the scheduler, sampler, memory planner and CLI stay
// single and batch_generate.h runs unchanged on top; the cost is one host thread launching every
// device's kernels in turn. N = 1 runs the single-device path unchanged (no communicator).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "cuda/device_cache_scores.h"
#include "cuda/model_ops.cuh"
#include "veloxquant/builder.h"
#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/cuda_row_writes.h"
#include "veloxquant/engine.h"
#include "veloxquant/error.h"
#include "veloxquant/multi_gpu.h"
#include "veloxquant/tensor_parallel.h"

namespace vq {

namespace {

using cuda::DeviceBuffer;

// A weight matrix on the device: w points into the engine's weight pool.
struct DevLinear {
  const void* w = nullptr;  // device [out, in] of dtype t
  DType t = DType::kF32;
  int64_t out = 0, in = 0;
  DeviceBuffer bias;  // device [out] fp32, or empty
  const float* bias_ptr() const { return bias.data() ? bias.as<float>() : nullptr; }
};

struct DevLayer {
  DeviceBuffer attn_norm, mlp_norm;  // device [hidden] fp32
  DevLinear q, k, v, o, gate, up, down;
  DType qkv_t = DType::kF32, gate_up_t = DType::kF32;  // operand dtypes of the two groups
  // q|k|v and gate|up as one matrix each (rows of q, then k, then v): one product per group;
  // q.w .. v.w (gate.w, up.w) point into these buffers.
  DeviceBuffer qkv_w, gate_up_w;
};

// One rank's share of a sequence: its caches (one per layer, the rank's KV heads) and the decode
// plan of its last single-token chunk with the key it was made for (view shape, q_pos0, query
// heads), reused by every layer whose view has that key.
struct RankSeq {
  std::vector<std::unique_ptr<cuda::DeviceKVCache>> caches;
  cuda::DecodePlan plan;
  std::vector<int64_t> plan_key;
  // Engine::set_attention_tap: a full cache per layer (the rank's KV heads, kv_dtype rows) fed
  // the same blocks, and the two attention outputs of a tapped chunk [H_q, n, D] fp32.
  std::vector<std::unique_ptr<cuda::DeviceKVCache>> shadow;
  DeviceBuffer tap_c, tap_f;
};

struct Sequence {
  CacheConfig cache;           // its caches' config (before rank_cache_config)
  std::vector<RankSeq> ranks;  // one per rank
  int64_t offset = 0;
  bool prompt_ended = false;  // a chunk with end_prompt ran
  // Engine::set_external_scores: [layer][1, n_kv_heads, ext_rows], handed over at end_prompt.
  std::vector<std::vector<float>> ext_scores;
  int64_t ext_rows = 0;
  AttentionTap* tap = nullptr;  // Engine::set_attention_tap
  std::vector<float> tap_host;  // a tapped chunk's two outputs on the host
};

// One rank's device state: its device and stream (shared by simulated ranks), its shard of the
// weights (rank 0 also the final norm and lm_head), its RoPE tables and its scratch.
struct Rank {
  int device = 0;
  int64_t hq = 0, hkv = 0, inter = 0;  // query heads, KV heads, intermediate columns it holds
  int64_t kv_first = 0;                // its first KV head
  cuda::Stream stream = nullptr;
  std::unique_ptr<cuda::Blas> blas;
  cuda::DecodeWorkspace ws;
  std::map<std::pair<const void*, DType>, DeviceBuffer> pool;  // weights by host pointer, dtype
  std::vector<DevLayer> layers;
  const void* embed = nullptr;
  DType embed_t = DType::kF32;
  DevLinear lm_head;
  DeviceBuffer final_norm;
  DeviceBuffer rope_cos, rope_sin;
  int64_t rope_rows = 0;
  // Scratch (grown, never shrunk): x, h [T, hidden]; qkv [T, hq D + 2 hkv D] the fused
  // product's output; qh [T hq D] and kh, vh [T hkv D] head-major per chunk; attn like qh; op
  // the product operand (largest of the operands); gu [T, 2 inter] the fused gate|up output;
  // ints the step's int32 tokens, positions, chunk starts, chunk lengths, logit rows; logits
  // [n_out, vocab].
  DeviceBuffer x, h, qkv, qh, kh, vh, attn, op, gu, ints, logits;
  DeviceBuffer greedy;  // step_greedy's ids [n_out] int32
  int64_t tok_cap = 0, out_cap = 0;
};

// What a decode plan depends on (decode_plan.cpp match_plan): per non-empty segment its rows,
// capacity, representation, dtype / formats and transforms; plus the query position and heads.
std::vector<int64_t> plan_key(const cuda::DeviceCacheView& view, int64_t q_pos0, int64_t n_q) {
  std::vector<int64_t> k = {q_pos0, n_q};
  for (const cuda::DeviceSegment& sg : view.segments()) {
    if (sg.n_rows == 0) continue;
    k.insert(k.end(), {sg.n_rows, sg.capacity, sg.positions != nullptr, sg.packed,
                       static_cast<int64_t>(sg.dtype)});
    if (sg.packed) {
      int64_t f[6];
      std::memcpy(f, &sg.k_fmt, sizeof(sg.k_fmt));
      std::memcpy(reinterpret_cast<char*>(f) + sizeof(sg.k_fmt), &sg.v_fmt, sizeof(sg.v_fmt));
      k.insert(k.end(), f, f + 6);
      k.insert(k.end(), {sg.k_perm != nullptr, sg.v_perm != nullptr, sg.k_signs != nullptr,
                         sg.v_signs != nullptr, sg.k_rot_block, sg.v_rot_block});
    }
  }
  return k;
}
static_assert(2 * sizeof(PackedRowFormat) == 6 * sizeof(int64_t));

// The phases of a step timed by EngineOptions::time_phases, in order (kPhaseNames).
enum Phase : int {
  kPhEmbed,
  kPhNorm,
  kPhQkv,
  kPhRope,
  kPhCache,
  kPhAttn,
  kPhOProj,
  kPhMlp,
  kPhLogits,
  kPhToHost,
  kPhCount
};
constexpr const char* kPhaseNames[kPhCount] = {"embed + host setup",
                                               "rmsnorm (x2 per layer)",
                                               "q/k/v products",
                                               "bias + rope",
                                               "cache update",
                                               "attention",
                                               "o_proj",
                                               "mlp products + swiglu",
                                               "final norm + lm_head",
                                               "logits to host"};

bool is_float_dtype(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16;
}

class CudaEngine final : public Engine {
 public:
  CudaEngine(const Model& model, const EngineOptions& opts)
      : model_(model),
        cfg_(model.config()),
        opts_(opts),
        plan_(make_shard_plan(model.config(), opts.tensor_parallel)) {
    const ModelConfig& c = cfg_;
    VQ_CHECK(is_float_dtype(opts.kv_dtype),
             std::string("[engine] kv_dtype: expected float32, float16 or bfloat16 but got ") +
                 dtype_name(opts.kv_dtype));
    VQ_CHECK(c.head_dim == 64 || c.head_dim == 128,
             "[engine] expected head_dim 64 or 128 (the CUDA attention kernels) but got " +
                 std::to_string(c.head_dim));
    check_layer_lists(opts.cache);  // before any allocation
    const int64_t N = plan_.n_ranks;
    const int first_device = cuda::current_device();
    try {
      if (N > 1) sharded_ = std::make_unique<ShardedModel>(model, N);
      for (int64_t r = 0; r < N; ++r) {
        auto R = std::make_unique<Rank>();
        const RankShard& sh = plan_.ranks[static_cast<size_t>(r)];
        R->device = opts.tp_simulate ? first_device : static_cast<int>(r);
        R->hq = sh.q_heads.count;
        R->hkv = sh.kv_heads.count;
        R->inter = sh.intermediate.count;
        R->kv_first = sh.kv_heads.first;
        cuda::set_device(R->device);
        if (r == 0 || !opts.tp_simulate) {
          size_t free_b = 0, total = 0;
          cuda::device_memory(&free_b, &total);
          free_at_start_.push_back(free_b);
          streams_.push_back(cuda::create_stream());
        }
        R->stream = streams_.back();
        // The cache config is refused here (make_device_cache validates it as the CPU builder
        // does, each layer's entries of the per-layer lists and of skvq_perm_file included;
        // rank_cache_config refuses what crosses heads), not at the first add_sequence(). A
        // cache allocates nothing on the device until its first rows.
        const CacheConfig rc = rank_cache_config(plan_, r, opts.cache);
        for (int64_t l = 0; l < c.n_layers; ++l)
          (void)cuda::make_device_cache(rc, 1, R->hkv, c.head_dim, R->stream, l);
        R->blas = std::make_unique<cuda::Blas>(R->stream);
        upload_weights(*R, N > 1 ? sharded_->rank_layers(r) : model_.layers(), r == 0);
        ensure_rope(*R, c.max_position_embeddings > 0
                            ? std::min(c.max_position_embeddings, kRopeRowsAtStart)
                            : kRopeRowsAtStart);
        ranks_.push_back(std::move(R));
      }
      if (N > 1) {
        if (opts.tp_simulate) {
          comm_ = cuda::make_device_reference_communicator(N, streams_[0]);
        } else {
          std::vector<int> devices;
          for (const auto& R : ranks_) devices.push_back(R->device);
          comm_ = cuda::make_nccl_communicator(devices, streams_);
        }
      }
      for (const auto& R : ranks_) {
        cuda::set_device(R->device);
        cuda::synchronize(R->stream);
      }
      cuda::set_device(first_device);
      sample_memory();
    } catch (...) {
      release();
      throw;
    }
  }

  ~CudaEngine() override { release(); }

  Device device() const override { return Device::kCuda; }
  const ModelConfig& config() const override { return cfg_; }
  const EngineOptions& options() const override { return opts_; }

  using Engine::add_sequence;
  int64_t add_sequence(const CacheConfig& cache) override {
    check_layer_lists(cache);
    std::vector<CacheConfig> rc;  // every rank's config first: refusals before any allocation
    for (int64_t r = 0; r < plan_.n_ranks; ++r) rc.push_back(rank_cache_config(plan_, r, cache));
    Sequence s;
    s.cache = cache;
    s.ranks.resize(ranks_.size());
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const Rank& R = *ranks_[r];
      cuda::DeviceGuard at(R.device);
      s.ranks[r].caches.reserve(static_cast<size_t>(cfg_.n_layers));
      // the first make_device_cache validates the config (as the CPU builder does) before any
      // allocation of this sequence; layer l's cache takes entry l of the per-layer lists (a
      // cache allocates nothing until its first rows, so a later layer's refusal frees nothing)
      for (int64_t l = 0; l < cfg_.n_layers; ++l)
        s.ranks[r].caches.push_back(
            cuda::make_device_cache(rc[r], 1, R.hkv, cfg_.head_dim, R.stream, l));
    }
    const int64_t id = next_id_++;
    seqs_.emplace(id, std::move(s));
    sample_memory();
    return id;
  }

  // Every layer's and rank's cache of the sequence (DeviceKVCache::reserve); sampled at its first
  // allocation, so the engine's peak is unchanged until then.
  void reserve(int64_t seq, int64_t tokens) override {
    Sequence& s = find(seq, "reserve")->second;
    VQ_CHECK(tokens >= 0,
             "[engine] reserve: expected tokens >= 0 but got " + std::to_string(tokens));
    if (!opts_.reserve_capacity) return;
    for (RankSeq& rs : s.ranks)
      for (auto& c : rs.caches) c->reserve(tokens);
  }
  bool reserves_capacity() const override { return opts_.reserve_capacity; }

  void remove_sequence(int64_t seq) override {
    auto it = find(seq, "remove_sequence");
    free_caches(it->second);
    seqs_.erase(it);  // the caches' cudaFree (device-synchronising) returns their memory
  }

  int64_t offset(int64_t seq) const override { return find(seq, "offset")->second.offset; }

  // Summed over ranks and layers; rows_kept_per_head from rank 0's first layer (every head of a
  // layer keeps as many rows).
  CacheMemory memory(int64_t seq) const override {
    const Sequence& s = find(seq, "memory")->second;
    CacheMemory m;
    m.n_layers = cfg_.n_layers;
    m.method = opts_.cache.method;
    for (size_t r = 0; r < s.ranks.size(); ++r) {
      const auto& caches = s.ranks[r].caches;
      for (size_t i = 0; i < caches.size(); ++i) {
        const CacheStats st = caches[i]->stats();
        if (r == 0 && i == 0) {
          m.method = st.method;
          m.tokens_seen = st.tokens_seen;
          m.rows_kept_per_head = st.rows_stored;
        }
        m.rows_kept += st.rows_stored * ranks_[r]->hkv;
        m.bytes_accounted += st.bytes_accounted;
        m.bytes_resident += st.bytes_resident;
        m.fp16_bytes += st.fp16_bytes;
      }
    }
    return m;
  }

  // Device K/V (kv_dtype) and fp32 queries from cuda::fill_uniform, one stream per (seed,
  // sequence, layer, chunk, K/V/Q), handed to each layer's cache in `chunk`-row calls; the three
  // blocks live in buffers of their own for the call (not the step scratch, which a chunk of a
  // whole long prompt would grow to gigabytes). Every rank draws the whole layer's blocks and
  // hands its caches the rows of its heads (contiguous in [1, H, n, D]), so the ranks together
  // hold what one device holds for the same seed.
  void fill_synthetic(int64_t seq, int64_t n_tokens, int64_t chunk, uint64_t seed) override {
    Sequence& s = find(seq, "fill_synthetic")->second;
    check_synthetic(cfg_, s.offset, n_tokens, chunk);
    const int64_t Hkv = cfg_.n_kv_heads, Hq = cfg_.n_heads, D = cfg_.head_dim;
    const int64_t G = Hq / Hkv;
    const size_t kv_es = dtype_size(opts_.kv_dtype);
    const size_t rows = static_cast<size_t>(std::min(chunk, n_tokens));
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const Rank& R = *ranks_[r];
      cuda::DeviceGuard at(R.device);
      DeviceBuffer kh(rows * static_cast<size_t>(Hkv * D) * kv_es), vh(kh.size()),
          qh(rows * static_cast<size_t>(Hq * D) * 4);
      for (int64_t l = 0; l < cfg_.n_layers; ++l)
        for (int64_t a = 0, c = 0; a < n_tokens; a += chunk, ++c) {
          const int64_t n = std::min(chunk, n_tokens - a);
          const uint64_t base =
              seed * 0x100000001B3ull + static_cast<uint64_t>(seq) * 0x1000193ull +
              static_cast<uint64_t>(l) * 0x10001ull + static_cast<uint64_t>(c) * 7;
          cuda::fill_uniform(kh.data(), opts_.kv_dtype, Hkv * n * D, base * 3, R.stream);
          cuda::fill_uniform(vh.data(), opts_.kv_dtype, Hkv * n * D, base * 3 + 1, R.stream);
          cuda::fill_uniform(qh.data(), DType::kF32, Hq * n * D, base * 3 + 2, R.stream);
          const size_t k0 = static_cast<size_t>(R.kv_first * n * D);
          const TensorView qv = TensorView::contiguous(qh.as<float>() + R.kv_first * G * n * D,
                                                       DType::kF32, 1, R.hq, n, D);
          cuda::DeviceUpdateOptions uo;
          uo.queries = &qv;
          s.ranks[r].caches[static_cast<size_t>(l)]->update_and_fetch(
              TensorView::contiguous(kh.as<char>() + k0 * kv_es, opts_.kv_dtype, 1, R.hkv, n, D),
              TensorView::contiguous(vh.as<char>() + k0 * kv_es, opts_.kv_dtype, 1, R.hkv, n, D),
              uo);
        }
      for (auto& cache : s.ranks[r].caches) cache->end_prompt();
      cuda::synchronize(R.stream);  // before the blocks' buffers are freed
    }
    s.offset = n_tokens;
    sample_memory();
  }

  void set_external_scores(int64_t seq, std::vector<std::vector<float>> scores) override {
    Sequence& s = find(seq, "set_external_scores")->second;
    const cuda::DeviceKVCache& c0 = *s.ranks[0].caches[0];
    VQ_CHECK(cuda::takes_external_scores(c0),
             "[engine] set_external_scores: expected a sequence whose caches take external scores "
             "(snapkv or snapkv+skvq with snap_scoring=external, skvq with "
             "skvq_protect_scoring=external) but "
             "sequence " +
                 std::to_string(seq) + " has method " + s.cache.method);
    VQ_CHECK(!s.prompt_ended,
             "[engine] set_external_scores: expected a sequence before its "
             "prompt's end but sequence " +
                 std::to_string(seq) + " ended its prompt");
    const int64_t Hkv = cfg_.n_kv_heads;
    const int64_t per = scores.empty() ? 0 : static_cast<int64_t>(scores[0].size());
    bool ok = static_cast<int64_t>(scores.size()) == cfg_.n_layers && per >= Hkv && per % Hkv == 0;
    for (const auto& l : scores) ok = ok && static_cast<int64_t>(l.size()) == per;
    VQ_CHECK(ok, "[engine] set_external_scores: expected scores [" + std::to_string(cfg_.n_layers) +
                     " layers][" + std::to_string(Hkv) + " KV heads x n rows], n >= 1, but got " +
                     std::to_string(scores.size()) + " layers of " + std::to_string(per) +
                     " values");
    s.ext_rows = per / Hkv;
    s.ext_scores = std::move(scores);
  }

  // The shadow caches are made here (config "full", the rank's heads); their rows are allocated
  // at the first step like any cache's.
  void set_attention_tap(int64_t seq, AttentionTap* tap) override {
    Sequence& s = find(seq, "set_attention_tap")->second;
    if (tap == nullptr) {
      s.tap = nullptr;
      free_shadow(s);
      return;
    }
    VQ_CHECK(s.offset == 0,
             "[engine] set_attention_tap: expected an empty sequence (the shadow "
             "must see every row) but sequence " +
                 std::to_string(seq) + " holds " + std::to_string(s.offset) + " tokens");
    CacheConfig full;
    full.method = "full";
    free_shadow(s);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const Rank& R = *ranks_[r];
      cuda::DeviceGuard at(R.device);
      for (int64_t l = 0; l < cfg_.n_layers; ++l)
        s.ranks[r].shadow.push_back(
            cuda::make_device_cache(full, 1, R.hkv, cfg_.head_dim, R.stream, l));
    }
    tap->err2.assign(static_cast<size_t>(cfg_.n_layers),
                     std::vector<double>(static_cast<size_t>(cfg_.n_heads), 0.0));
    tap->ref2 = tap->err2;
    s.tap = tap;
  }

  std::vector<int32_t> stored_positions(int64_t seq, int64_t layer, int64_t head) const override {
    const Sequence& s = find(seq, "stored_positions")->second;
    check_layer_head(cfg_, layer, head);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const Rank& R = *ranks_[r];
      if (head < R.kv_first || head >= R.kv_first + R.hkv) continue;
      cuda::DeviceGuard at(R.device);
      return s.ranks[r].caches[static_cast<size_t>(layer)]->stored_positions(0, head - R.kv_first);
    }
    return {};  // unreachable: the ranks' heads cover [0, n_kv_heads)
  }

  void step(std::span<const SeqChunk> chunks, std::vector<float>* logits) override {
    run_step(chunks, logits, nullptr, 0);
  }
  // The argmax of each logit row on the device (cuda::argmax_rows); only the ids come back.
  void step_greedy(std::span<const SeqChunk> chunks, int64_t n_vocab,
                   std::vector<int32_t>* tokens) override {
    check_greedy_vocab(cfg_, n_vocab);
    run_step(chunks, nullptr, tokens, n_vocab);
  }

  // Engine::warm_up: on every rank the products of each distinct layer shape (warm_layers), and
  // on rank 0 lm_head, at each row count not warmed before, then the prefill step's layer
  // products; every rank's stream synchronised before the time is taken.
  double warm_up(int64_t max_rows, int64_t prefill_tokens) override {
    std::vector<int64_t> rows;
    for (int64_t m : warm_up_row_counts(max_rows, prefill_tokens))
      if (!warm_rows_.count(m)) rows.push_back(m);
    const bool prefill = prefill_tokens > 0 && !warm_prefill_.count(prefill_tokens);
    if (rows.empty() && !prefill) return 0.0;
    const auto t0 = std::chrono::steady_clock::now();
    const cuda::DeviceGuard restore(ranks_[0]->device);
    const int64_t most_rows = rows.empty() ? 0 : rows.back();
    for (size_t r = 0; r < ranks_.size(); ++r) {
      Rank& R = *ranks_[r];
      cuda::set_device(R.device);
      ensure_scratch(R, std::max(most_rows, prefill ? prefill_tokens : 0), most_rows, r == 0);
      R.op.fill_zero(R.stream);  // defined operands; their values do not matter
      const std::vector<size_t> layers = warm_layers(R);
      for (int64_t m : rows) {
        for (size_t li : layers) layer_products(R, R.layers[li], m);
        if (r == 0) lm_head_product(R, m);
      }
      if (prefill)
        for (size_t li : layers) layer_products(R, R.layers[li], prefill_tokens);
    }
    for (const auto& R : ranks_) {
      cuda::set_device(R->device);
      cuda::synchronize(R->stream);
    }
    warm_rows_.insert(rows.begin(), rows.end());
    if (prefill) warm_prefill_.insert(prefill_tokens);
    sample_memory();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // bench's hooks (engine.h): rank 0's device's copy bandwidth, measured now with two 256 MiB
  // buffers (64 MiB when those do not fit), and the peak of the device memory in use since the
  // engine was made, over what was in use before it, the largest over the engine's devices:
  // cudaMemGetInfo sampled after construction, each add_sequence and each step (scratch a kernel
  // takes and returns inside one step is not seen).
  double copy_bandwidth() override {
    const Rank& R = *ranks_[0];
    cuda::DeviceGuard at(R.device);
    cuda::synchronize(R.stream);
    try {
      return cuda::device_copy_bandwidth(int64_t{256} << 20, R.stream);
    } catch (const Error&) {
      return cuda::device_copy_bandwidth(int64_t{64} << 20, R.stream);
    }
  }
  int64_t peak_memory_bytes() const override { return peak_bytes_; }

  std::vector<PhaseTime> phase_times() const override {
    std::vector<PhaseTime> out;
    for (int kind = 1; kind >= 0; --kind)
      for (int p = 0; p < kPhCount; ++p) {
        const auto& g = phase_gpu_ms_[kind];
        if (steps_[kind] == 0 || static_cast<size_t>(p) >= g.size()) continue;
        PhaseTime t;
        t.phase = kPhaseNames[p];
        t.decode = kind == 1;
        t.steps = steps_[kind];
        t.gpu_seconds = g[static_cast<size_t>(p)] * 1e-3;
        t.host_seconds = phase_host_ms_[kind][static_cast<size_t>(p)] * 1e-3;
        const cuda::PhaseCounts& c = phase_counts_[kind][static_cast<size_t>(p)];
        t.syncs = c.syncs;
        t.mallocs = c.mallocs;
        t.frees = c.frees;
        out.push_back(t);
      }
    return out;
  }

 private:
  // Per-layer SKVQ lists hold one entry per layer of the model (the CPU's build_caches rule and
  // message; a longer list is a spec for another model). Each layer's packed formats are then
  // those of the single fields at that layer's values, which the device kernels read like any
  // single-field config: token-axis keys fused for the (key, value) bit pairs of
  // src/cuda/decode_plan.cpp fused_format and dequantized into fp32 scratch otherwise,
  // channel-axis keys at any bits by the channel kernel, and every format by prefill
  // (src/cuda/prefill_api.cpp); so no layer's combination is refused beyond validate(). Layers of
  // different formats get their own decode plans (plan_key holds the formats).
  void check_layer_lists(const CacheConfig& cache) const {
    vq::check_layer_lists(cache, cfg_.n_layers, "engine");
  }

  using SeqMap = std::map<int64_t, Sequence>;

  SeqMap::iterator find(int64_t seq, const char* op) {
    auto it = seqs_.find(seq);
    VQ_CHECK(it != seqs_.end(), std::string("[engine] ") + op +
                                    ": expected the id of a live sequence but got " +
                                    std::to_string(seq));
    return it;
  }
  SeqMap::const_iterator find(int64_t seq, const char* op) const {
    auto it = seqs_.find(seq);
    VQ_CHECK(it != seqs_.end(), std::string("[engine] ") + op +
                                    ": expected the id of a live sequence but got " +
                                    std::to_string(seq));
    return it;
  }

  // One sample per device the engine uses (free_at_start_[d]: device d's free bytes before the
  // engine; simulated ranks use one device).
  void sample_memory() {
    for (size_t d = 0; d < free_at_start_.size(); ++d) {
      cuda::DeviceGuard at(ranks_[opts_.tp_simulate ? 0 : d]->device);
      size_t free_now = 0, total = 0;
      cuda::device_memory(&free_now, &total);
      if (free_now < free_at_start_[d])
        peak_bytes_ = std::max(peak_bytes_, static_cast<int64_t>(free_at_start_[d] - free_now));
    }
  }

  // Frees everything the engine holds, each rank's on its device; never throws (a failed sync
  // still frees).
  void release() noexcept {
    for (const auto& R : ranks_) {
      try {
        cuda::DeviceGuard at(R->device);
        cuda::synchronize(R->stream);
      } catch (...) {
      }
    }
    for (auto& [id, s] : seqs_) free_caches(s);
    seqs_.clear();
    comm_.reset();
    for (auto& R : ranks_) {
      try {
        cuda::DeviceGuard at(R->device);
        R.reset();
      } catch (...) {
      }
    }
    ranks_.clear();
    for (cuda::Stream s : streams_) cuda::destroy_stream(s);
    streams_.clear();
  }

  // Frees a sequence's caches, each rank's with its device current.
  void free_caches(Sequence& s) noexcept {
    free_shadow(s);
    for (size_t r = 0; r < s.ranks.size() && r < ranks_.size(); ++r) {
      try {
        cuda::DeviceGuard at(ranks_[r]->device);
        s.ranks[r].caches.clear();
      } catch (...) {
      }
    }
  }
  // Frees a sequence's attention-tap shadow caches and outputs.
  void free_shadow(Sequence& s) noexcept {
    for (size_t r = 0; r < s.ranks.size() && r < ranks_.size(); ++r) {
      try {
        cuda::DeviceGuard at(ranks_[r]->device);
        cuda::synchronize(ranks_[r]->stream);
        s.ranks[r].shadow.clear();
        s.ranks[r].tap_c = DeviceBuffer();
        s.ranks[r].tap_f = DeviceBuffer();
      } catch (...) {
      }
    }
  }

  // The device copy of a weight (shared when the host pointer and dtype were uploaded before).
  static const void* upload_matrix(Rank& R, const Linear& l, DType as) {
    const auto key = std::make_pair(l.w, as);
    if (auto it = R.pool.find(key); it != R.pool.end()) return it->second.data();
    const size_t n = static_cast<size_t>(l.out * l.in);
    DeviceBuffer b;
    if (as == l.dtype) {
      b = DeviceBuffer(n * dtype_size(l.dtype));
      b.upload(l.w, n * dtype_size(l.dtype), 0, R.stream);
    } else {  // widened to f32 (exact)
      std::vector<float> f(n);
      to_f32(l.w, l.dtype, f.data(), n);
      b = DeviceBuffer::from_vector(f, R.stream);
    }
    const void* p = b.data();
    R.pool.emplace(key, std::move(b));
    return p;
  }

  // Uploads the matrices of a group (same `in`) as one [sum out, in] matrix of dtype `as` into
  // *buf; the DevLinears point into it (biases uploaded each on its own).
  static void upload_group(Rank& R, std::initializer_list<std::pair<const Linear*, DevLinear*>> g,
                           DType as, DeviceBuffer* buf) {
    const size_t es = dtype_size(as);
    size_t total = 0;
    for (const auto& [l, d] : g) total += static_cast<size_t>(l->out * l->in) * es;
    *buf = DeviceBuffer(total);
    size_t at = 0;
    for (const auto& [l, d] : g) {
      const size_t n = static_cast<size_t>(l->out * l->in);
      if (as == l->dtype) {
        buf->upload(l->w, n * es, at, R.stream);
      } else {  // widened to f32 (exact)
        std::vector<float> f(n);
        to_f32(l->w, l->dtype, f.data(), n);
        buf->upload(f.data(), n * es, at, R.stream);
      }
      d->w = static_cast<const char*>(buf->data()) + at;
      d->t = as;
      d->out = l->out;
      d->in = l->in;
      if (!l->bias.empty()) d->bias = DeviceBuffer::from_vector(l->bias, R.stream);
      at += n * es;
    }
  }

  static DevLinear upload_linear(Rank& R, const Linear& l, DType as) {
    DevLinear d;
    d.w = upload_matrix(R, l, as);
    d.t = as;
    d.out = l.out;
    d.in = l.in;
    if (!l.bias.empty()) d.bias = DeviceBuffer::from_vector(l.bias, R.stream);
    return d;
  }

  static DType group_dtype(std::initializer_list<const Linear*> g) {
    const DType t = (*g.begin())->dtype;
    for (const Linear* l : g)
      if (l->dtype != t) return DType::kF32;
    return t;
  }

  // The rank's layers (the model's own for N = 1, ShardedModel's slices otherwise), the
  // embedding, and with `head` the final norm and lm_head.
  void upload_weights(Rank& R, const std::vector<Model::Layer>& layers, bool head) {
    for (const Model::Layer& L : layers) {
      DevLayer d;
      d.attn_norm = DeviceBuffer::from_vector(L.attn_norm, R.stream);
      d.mlp_norm = DeviceBuffer::from_vector(L.mlp_norm, R.stream);
      d.qkv_t = group_dtype({&L.q, &L.k, &L.v});
      d.gate_up_t = group_dtype({&L.gate, &L.up});
      upload_group(R, {{&L.q, &d.q}, {&L.k, &d.k}, {&L.v, &d.v}}, d.qkv_t, &d.qkv_w);
      d.o = upload_linear(R, L.o, L.o.dtype);
      upload_group(R, {{&L.gate, &d.gate}, {&L.up, &d.up}}, d.gate_up_t, &d.gate_up_w);
      d.down = upload_linear(R, L.down, L.down.dtype);
      R.layers.push_back(std::move(d));
    }
    const Linear& e = model_.embedding();
    R.embed = upload_matrix(R, e, e.dtype);
    R.embed_t = e.dtype;
    if (!head) return;
    R.lm_head = upload_linear(R, model_.lm_head(), model_.lm_head().dtype);
    R.final_norm = DeviceBuffer::from_vector(model_.final_norm(), R.stream);
  }

  // RoPE tables [rows, D/2] covering positions [0, n): grown by doubling (recomputed on the host
  // with rope_cos_sin, the CPU's values, positions in parallel, then uploaded). The constructor
  // makes them for the first kRopeRowsAtStart positions (or max_position_embeddings if smaller),
  // so a step rarely pays for a table (bench --phases measured 100-130 ms once at position
  // 32768 when they grew in a decode step).
  static constexpr int64_t kRopeRowsAtStart = int64_t{1} << 17;
  void ensure_rope(Rank& R, int64_t n) {
    if (n <= R.rope_rows) return;
    int64_t rows = std::max<int64_t>(R.rope_rows * 2, 256);
    while (rows < n) rows *= 2;
    if (cfg_.max_position_embeddings > 0) rows = std::min(rows, cfg_.max_position_embeddings);
    rows = std::max(rows, n);
    const int64_t half = cfg_.head_dim / 2;
    std::vector<float> cs(static_cast<size_t>(rows * half)), sn(cs.size());
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < rows; ++p)
      rope_cos_sin(model_.inv_freq(), p, cs.data() + p * half, sn.data() + p * half);
    R.rope_cos = DeviceBuffer::from_vector(cs, R.stream);
    R.rope_sin = DeviceBuffer::from_vector(sn, R.stream);
    R.rope_rows = rows;
  }

  // The rank's scratch for steps of up to n_tokens tokens and n_out logit rows (logits: rank 0).
  void ensure_scratch(Rank& R, int64_t n_tokens, int64_t n_out, bool head) {
    const ModelConfig& c = cfg_;
    const size_t T = static_cast<size_t>(n_tokens);
    auto grow = [](DeviceBuffer& b, size_t bytes) {
      if (b.size() < bytes || !b.data()) {
        b = DeviceBuffer();
        b = DeviceBuffer(bytes);
      }
    };
    const size_t Hd = static_cast<size_t>(c.hidden_size), I = static_cast<size_t>(R.inter);
    const size_t qd = static_cast<size_t>(R.hq * c.head_dim);
    const size_t kd = static_cast<size_t>(R.hkv * c.head_dim);
    if (n_tokens > R.tok_cap) {
      grow(R.x, T * Hd * 4);
      grow(R.h, T * Hd * 4);
      grow(R.qkv, T * (qd + 2 * kd) * 4);
      grow(R.qh, T * qd * 4);
      grow(R.kh, T * kd * dtype_size(opts_.kv_dtype));
      grow(R.vh, T * kd * dtype_size(opts_.kv_dtype));
      grow(R.attn, T * qd * 4);
      grow(R.op, T * std::max({Hd, qd, I}) * 4);
      grow(R.gu, T * 2 * I * 4);
      R.tok_cap = n_tokens;
    }
    grow(R.ints, (4 * T + static_cast<size_t>(n_out)) * 4);
    if (head && n_out > R.out_cap) {
      grow(R.logits, static_cast<size_t>(n_out) * static_cast<size_t>(c.vocab_size) * 4);
      R.out_cap = n_out;
    }
  }

  // The step's matrix products over T rows (lm_head: the n_out logit rows), each from R.op
  // into the scratch the step reads it from: q|k|v into R.qkv, o_proj and down_proj into R.h,
  // gate|up into R.gu, lm_head into R.logits. warm_up makes the same calls.
  static void qkv_product(Rank& R, const DevLayer& L, int64_t T) {
    R.blas->gemm(L.q.w, L.q.t, L.q.out + L.k.out + L.v.out, L.q.in, R.op.data(), T,
                 R.qkv.as<float>());
  }
  static void o_product(Rank& R, const DevLayer& L, int64_t T) {
    R.blas->gemm(L.o.w, L.o.t, L.o.out, L.o.in, R.op.data(), T, R.h.as<float>());
  }
  static void gate_up_product(Rank& R, const DevLayer& L, int64_t T) {
    R.blas->gemm(L.gate.w, L.gate.t, 2 * R.inter, L.gate.in, R.op.data(), T, R.gu.as<float>());
  }
  static void down_product(Rank& R, const DevLayer& L, int64_t T) {
    R.blas->gemm(L.down.w, L.down.t, L.down.out, L.down.in, R.op.data(), T, R.h.as<float>());
  }
  static void lm_head_product(Rank& R0, int64_t n_out) {
    R0.blas->gemm(R0.lm_head.w, R0.lm_head.t, R0.lm_head.out, R0.lm_head.in, R0.op.data(), n_out,
                  R0.logits.as<float>());
  }
  static void layer_products(Rank& R, const DevLayer& L, int64_t T) {
    qkv_product(R, L, T);
    o_product(R, L, T);
    gate_up_product(R, L, T);
    down_product(R, L, T);
  }
  // The rank's first layer of each distinct product shape (dtypes and [out, in] of the four
  // products): [0] for a model whose layers all have one shape.
  static std::vector<size_t> warm_layers(const Rank& R) {
    std::set<std::vector<int64_t>> seen;
    std::vector<size_t> out;
    for (size_t li = 0; li < R.layers.size(); ++li) {
      const DevLayer& L = R.layers[li];
      std::vector<int64_t> key;
      for (const DevLinear* l : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down})
        key.insert(key.end(), {static_cast<int64_t>(l->t), l->out, l->in});
      if (seen.insert(std::move(key)).second) out.push_back(li);
    }
    return out;
  }

  // The plan of s over view for a step of n_dec single-token chunks (re-made only when its key
  // changes): with n_dec > 1 its splits are sized for one batched launch of the step's sequences
  // (whole waves of blocks over all of them, not one wave per sequence).
  const cuda::DecodePlan& decode_plan(Rank& R, RankSeq& s, const cuda::DeviceCacheView& view,
                                      const AttentionParams& ap, int64_t nq, int64_t n_dec);
  // step() (tokens == nullptr: the logit rows to *logits, if not null) or step_greedy() (each
  // logit row's argmax over [0, n_vocab) to *tokens).
  void run_step(std::span<const SeqChunk> chunks, std::vector<float>* logits,
                std::vector<int32_t>* tokens, int64_t n_vocab);
  // One layer's attention half on rank r (norm, q/k/v, RoPE, caches, attention, o_proj into
  // R.h: the rank's partial sum) and its MLP half (norm, gate|up, SwiGLU, down_proj into R.h).
  void attention_half(size_t r, int64_t li, std::span<const SeqChunk> chunks,
                      const std::vector<int64_t>& chunk_start, const cuda::StepTokens& st,
                      AttentionParams ap);
  void mlp_half(size_t r, int64_t li, int64_t T);
  // Engine::set_attention_tap for one chunk of s in layer li on rank r: the shadow takes the
  // chunk's blocks; while the tap is active, both views are attended with the chunk's queries
  // (cuda::prefill_attention, one kernel for both: identical views give identical outputs) and
  // the sums added on the host (synchronises the rank's stream). Pending row writes are launched
  // first (writes).
  void tap_attention(size_t r, int64_t li, Sequence& s, const cuda::DeviceCacheView& view,
                     const TensorView& k, const TensorView& v, const float* q, int64_t n,
                     const AttentionParams& ap, cuda::RowWriteBatch* writes);
  // The rank's residual x += h (when add) and RMSNorm(x) * weight into R.op as out_t, T rows.
  void add_norm(Rank& R, int64_t T, bool add, const DeviceBuffer& weight, DType out_t);
  // The sum all-reduce of every rank's R.h [T, hidden] (nothing for N = 1).
  void all_reduce_h(int64_t T);
  // time_phases: closes the step's last phase and adds its marks to the step kind's sums.
  void finish_timing(std::span<const SeqChunk> chunks, int64_t n_tokens);

  const Model& model_;
  ModelConfig cfg_;
  EngineOptions opts_;
  ShardPlan plan_;
  std::unique_ptr<ShardedModel> sharded_;  // N > 1: the ranks' host slices (before ranks_)
  std::vector<cuda::Stream> streams_;      // one per device used (simulated ranks share one)
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<Communicator> comm_;  // N > 1
  // EngineOptions::time_phases: the marks of the current step (rank 0's, on its stream: with
  // N > 1 the other ranks' work and the all-reduces fall into the phase open at the time);
  // milliseconds per phase summed over steps, [0] prefill/mixed steps, [1] decode steps (every
  // chunk one token).
  cuda::PhaseEvents phases_;
  std::vector<double> phase_gpu_ms_[2], phase_host_ms_[2];
  std::vector<cuda::PhaseCounts> phase_counts_[2];
  int64_t steps_[2] = {0, 0};
  void mark(size_t r, int phase) {
    if (opts_.time_phases && r == 0) phases_.mark(phase, ranks_[0]->stream);
  }
  SeqMap seqs_;
  int64_t next_id_ = 0;
  // Row counts and prefill token counts warm_up has run (on every rank).
  std::set<int64_t> warm_rows_, warm_prefill_;
  std::vector<size_t> free_at_start_;  // cudaMemGetInfo's free bytes per device before the engine
  int64_t peak_bytes_ = 0;
};

const cuda::DecodePlan& CudaEngine::decode_plan(Rank& R, RankSeq& s,
                                                const cuda::DeviceCacheView& view,
                                                const AttentionParams& ap, int64_t nq,
                                                int64_t n_dec) {
  std::vector<int64_t> key = plan_key(view, ap.q_pos0, nq);
  key.push_back(n_dec);
  if (key != s.plan_key) {
    s.plan = cuda::decode_attention_plan(R.ws.context(), nq, view, ap);
    // a plan that runs alone (channel-axis keys, dequantized segments) keeps a single launch's
    // splits: sized for a shared launch it would fill a fraction of the device on its own
    if (n_dec > 1 && cuda::decode_plan_joins_batch(s.plan)) {
      // One launch per piece of the n_dec sequences (decode_batch_pieces: at most 32 each,
      // balanced): k splits per (sequence, kv head), the smallest k whose per_launch * H_kv * k
      // blocks fill at least 85 % of the whole waves they take (a wave: one sequence's default
      // target), so neither a short last wave nor needless partials.
      const int64_t per_launch =
          (n_dec + cuda::decode_batch_pieces(n_dec) - 1) / cuda::decode_batch_pieces(n_dec);
      // the kernels' heads: kv_rep blocks per KV head (query-head groups past 8 or odd)
      const int64_t hv = R.hkv * s.plan.kv_rep;
      const int64_t wave = std::max<int64_t>(1, s.plan.target_blocks), units = per_launch * hv;
      int64_t k = 1;
      for (int64_t c = 1; c <= 64; ++c) {
        const int64_t t = units * c, waves = (t + wave - 1) / wave;
        k = c;
        if (100 * t >= 85 * waves * wave) break;
      }
      cuda::DecodePlanOptions opt;
      opt.target_blocks = hv * k;
      s.plan = cuda::decode_attention_plan(R.ws.context(), nq, view, ap, opt);
    }
    s.plan_key = std::move(key);
  }
  return s.plan;
}

void CudaEngine::attention_half(size_t r, int64_t li, std::span<const SeqChunk> chunks,
                                const std::vector<int64_t>& chunk_start, const cuda::StepTokens& st,
                                AttentionParams ap) {
  Rank& R = *ranks_[r];
  const ModelConfig& c = cfg_;
  const int64_t T = st.n_tokens, Hd = c.hidden_size, D = c.head_dim, Hq = R.hq, Hkv = R.hkv;
  const size_t kv_es = dtype_size(opts_.kv_dtype);
  const DevLayer& L = R.layers[static_cast<size_t>(li)];
  mark(r, kPhNorm);
  add_norm(R, T, li > 0, L.attn_norm, L.qkv_t);
  mark(r, kPhQkv);
  // one product over the fused q|k|v rows: [T, qd + 2 kd] fp32, rows qkv_cols apart
  const int64_t qkv_cols = L.q.out + L.k.out + L.v.out;
  qkv_product(R, L, T);
  mark(r, kPhRope);
  cuda::QkvRopeParams rp;
  rp.q = R.qkv.as<float>();
  rp.k = R.qkv.as<float>() + L.q.out;
  rp.v = R.qkv.as<float>() + L.q.out + L.k.out;
  rp.row_stride = qkv_cols;
  rp.q_bias = L.q.bias_ptr();
  rp.k_bias = L.k.bias_ptr();
  rp.v_bias = L.v.bias_ptr();
  rp.cos = R.rope_cos.as<float>();
  rp.sin = R.rope_sin.as<float>();
  rp.tok = st;
  rp.n_q_heads = Hq;
  rp.n_kv_heads = Hkv;
  rp.head_dim = D;
  rp.rope_style = c.rope.style == RopeStyle::kHalfSplit ? 0 : 1;
  rp.q_out = R.qh.as<float>();
  rp.k_out = R.kh.data();
  rp.v_out = R.vh.data();
  rp.kv_t = opts_.kv_dtype;
  cuda::qkv_rope(rp, R.stream);

  // Attention per sequence over its own cache; the single-token chunks in one batched decode
  // launch after the loop.
  int64_t n_single = 0;
  for (const SeqChunk& ch : chunks) n_single += ch.tokens.size() == 1 ? 1 : 0;
  // sequences one batched launch takes (1: each its own launch)
  const int64_t n_dec = opts_.batch_decode ? n_single : std::min<int64_t>(n_single, 1);
  std::vector<cuda::DeviceCacheView> dec_views;  // stable storage: the items point into it
  dec_views.reserve(static_cast<size_t>(n_single));
  std::vector<cuda::DecodeBatchItem> dec_items;
  // The caches' row writes recorded and launched together (EngineOptions::batch_cache_writes),
  // flushed before any attention reads them.
  std::optional<cuda::RowWriteBatch> writes;
  if (opts_.batch_cache_writes) writes.emplace(R.stream);
  for (size_t i = 0; i < chunks.size(); ++i) {
    Sequence& s = seqs_.at(chunks[i].seq);
    RankSeq& rs = s.ranks[r];
    const int64_t n = static_cast<int64_t>(chunks[i].tokens.size()), t0 = chunk_start[i];
    char* kb = R.kh.as<char>() + static_cast<size_t>(t0 * Hkv * D) * kv_es;
    char* vb = R.vh.as<char>() + static_cast<size_t>(t0 * Hkv * D) * kv_es;
    float* qb = R.qh.as<float>() + t0 * Hq * D;
    float* ob = R.attn.as<float>() + t0 * Hq * D;
    const TensorView kv_k = TensorView::contiguous(kb, opts_.kv_dtype, 1, Hkv, n, D);
    const TensorView kv_v = TensorView::contiguous(vb, opts_.kv_dtype, 1, Hkv, n, D);
    const TensorView qv = TensorView::contiguous(qb, DType::kF32, 1, Hq, n, D);
    cuda::DeviceUpdateOptions uo;
    uo.queries = &qv;
    mark(r, kPhCache);
    cuda::DeviceCacheView view =
        rs.caches[static_cast<size_t>(li)]->update_and_fetch(kv_k, kv_v, uo);
    ap.q_pos0 = s.offset;
    if (s.tap) tap_attention(r, li, s, view, kv_k, kv_v, qb, n, ap, writes ? &*writes : nullptr);
    mark(r, kPhAttn);
    if (n == 1) {
      dec_views.push_back(std::move(view));  // kept until the batched run below
      const cuda::DecodePlan& plan = decode_plan(R, rs, dec_views.back(), ap, Hq, n_dec);
      if (opts_.batch_decode) {
        dec_items.push_back({&plan, qb, &dec_views.back(), ob});
      } else {
        cuda::decode_attention_run(plan, qb, dec_views.back(), ob, R.ws, R.stream);
      }
    } else {
      if (writes) writes->flush();
      cuda::prefill_attention(qb, Hq, n, view, ap, ob, R.stream);
    }
  }
  if (writes) {
    mark(r, kPhCache);
    writes->flush();
    mark(r, kPhAttn);
  }
  if (!dec_items.empty()) cuda::decode_attention_run_batch(dec_items, R.ws, R.stream);
  mark(r, kPhOProj);
  cuda::heads_to_tokens(R.attn.as<float>(), st, Hq, D, R.op.data(), L.o.t, R.stream);
  o_product(R, L, T);
  cuda::add_bias(R.h.as<float>(), L.o.bias_ptr(), T, Hd, R.stream);
}

void CudaEngine::tap_attention(size_t r, int64_t li, Sequence& s, const cuda::DeviceCacheView& view,
                               const TensorView& k, const TensorView& v, const float* q, int64_t n,
                               const AttentionParams& ap, cuda::RowWriteBatch* writes) {
  Rank& R = *ranks_[r];
  RankSeq& rs = s.ranks[r];
  const cuda::DeviceCacheView full = rs.shadow[static_cast<size_t>(li)]->update_and_fetch(k, v);
  if (!s.tap->active) return;
  if (writes) writes->flush();
  const int64_t Hq = R.hq, D = cfg_.head_dim;
  const size_t count = static_cast<size_t>(Hq * n * D);
  if (rs.tap_c.size() < count * 4) {
    rs.tap_c = DeviceBuffer(count * 4);
    rs.tap_f = DeviceBuffer(count * 4);
  }
  cuda::prefill_attention(q, Hq, n, view, ap, rs.tap_c.as<float>(), R.stream);
  cuda::prefill_attention(q, Hq, n, full, ap, rs.tap_f.as<float>(), R.stream);
  s.tap_host.resize(2 * count);
  cuda::copy_to_host(s.tap_host.data(), rs.tap_c.data(), count * 4, R.stream);
  cuda::copy_to_host(s.tap_host.data() + count, rs.tap_f.data(), count * 4, R.stream);
  // the rank's query heads are the model's [kv_first G, (kv_first + hkv) G)
  const int64_t h0 = R.kv_first * (cfg_.n_heads / cfg_.n_kv_heads);
  std::vector<double>& err2 = s.tap->err2[static_cast<size_t>(li)];
  std::vector<double>& ref2 = s.tap->ref2[static_cast<size_t>(li)];
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t i = 0; i < n * D; ++i) {
      const size_t at = static_cast<size_t>(h * n * D + i);
      const double c = s.tap_host[at], f = s.tap_host[count + at];
      err2[static_cast<size_t>(h0 + h)] += (c - f) * (c - f);
      ref2[static_cast<size_t>(h0 + h)] += f * f;
    }
}

void CudaEngine::add_norm(Rank& R, int64_t T, bool add, const DeviceBuffer& weight, DType out_t) {
  cuda::AddNormParams an;
  an.x = R.x.as<float>();
  an.add = add ? R.h.as<float>() : nullptr;
  an.n_rows = T;
  an.hidden = cfg_.hidden_size;
  an.weight = weight.as<float>();
  an.eps = cfg_.rms_norm_eps;
  an.out = R.op.data();
  an.out_t = out_t;
  cuda::add_rmsnorm(an, R.stream);
}

void CudaEngine::mlp_half(size_t r, int64_t li, int64_t T) {
  Rank& R = *ranks_[r];
  const ModelConfig& c = cfg_;
  const int64_t Hd = c.hidden_size, I = R.inter;
  const DevLayer& L = R.layers[static_cast<size_t>(li)];
  mark(r, kPhNorm);
  add_norm(R, T, true, L.mlp_norm, L.gate_up_t);
  mark(r, kPhMlp);
  // one product over the fused gate|up rows: [T, 2I] fp32
  gate_up_product(R, L, T);
  cuda::swiglu(R.gu.as<float>(), R.gu.as<float>() + I, L.gate.bias_ptr(), L.up.bias_ptr(), T, I,
               R.op.data(), L.down.t, R.stream, 2 * I);
  down_product(R, L, T);
  cuda::add_bias(R.h.as<float>(), L.down.bias_ptr(), T, Hd, R.stream);
}

void CudaEngine::all_reduce_h(int64_t T) {
  if (!comm_) return;
  std::vector<float*> bufs;
  for (const auto& R : ranks_) bufs.push_back(R->h.as<float>());
  comm_->all_reduce_sum(bufs, T * cfg_.hidden_size);
}

void CudaEngine::run_step(std::span<const SeqChunk> chunks, std::vector<float>* logits,
                          std::vector<int32_t>* tokens, int64_t n_vocab) {
  const ModelConfig& c = cfg_;
  // ---- refusals, before anything changes
  std::set<int64_t> seen;
  int64_t T = 0, n_out = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const SeqChunk& ch = chunks[i];
    const Sequence& s = find(ch.seq, "step")->second;
    VQ_CHECK(seen.insert(ch.seq).second, "[engine] step: expected distinct sequences but chunk " +
                                             std::to_string(i) + " repeats sequence " +
                                             std::to_string(ch.seq));
    const int64_t n = static_cast<int64_t>(ch.tokens.size());
    VQ_CHECK(n >= 1, "[engine] step: expected at least one token per chunk but chunk " +
                         std::to_string(i) + " (sequence " + std::to_string(ch.seq) + ") is empty");
    for (int64_t j = 0; j < n; ++j)
      VQ_CHECK(ch.tokens[j] >= 0 && ch.tokens[j] < c.vocab_size,
               "[engine] step: expected token ids in [0, " + std::to_string(c.vocab_size) +
                   ") but chunk " + std::to_string(i) + " has " + std::to_string(ch.tokens[j]) +
                   " at index " + std::to_string(j));
    VQ_CHECK(c.max_position_embeddings <= 0 || s.offset + n <= c.max_position_embeddings,
             "[engine] step: expected positions below max_position_embeddings (" +
                 std::to_string(c.max_position_embeddings) + ") but sequence " +
                 std::to_string(ch.seq) + " at offset " + std::to_string(s.offset) + " + " +
                 std::to_string(n) + " tokens reaches position " +
                 std::to_string(s.offset + n - 1));
    const CacheConfig& cc = s.cache;
    if ((cc.method == "skvq" || cc.method == "snapkv+skvq") && cc.skvq_max_ctx > 0)
      VQ_CHECK(s.offset + n <= cc.skvq_max_ctx,
               "[engine] step: skvq_max_ctx: expected at most " + std::to_string(cc.skvq_max_ctx) +
                   " tokens but sequence " + std::to_string(ch.seq) + " would hold " +
                   std::to_string(s.offset + n));
    if (ch.end_prompt && !s.ext_scores.empty())
      VQ_CHECK(s.offset + n == s.ext_rows,
               "[engine] step: expected the prompt of sequence " + std::to_string(ch.seq) +
                   " to end at its external scores' " + std::to_string(s.ext_rows) +
                   " rows (set_external_scores) but this chunk ends it at " +
                   std::to_string(s.offset + n));
    T += n;
    if (ch.logits) ++n_out;
  }
  if (chunks.empty()) {
    if (tokens) tokens->clear();
    return;
  }
  const cuda::DeviceGuard restore(ranks_[0]->device);

  // ---- the step's int32 data: tokens, positions, chunk starts, chunk lengths, logit rows
  mark(0, kPhEmbed);
  std::vector<int32_t> ints(static_cast<size_t>(4 * T + n_out));
  int32_t* tok = ints.data();
  int32_t* pos = tok + T;
  int32_t* start = pos + T;
  int32_t* len = start + T;
  int32_t* rows = len + T;
  std::vector<int64_t> chunk_start(chunks.size());
  int64_t t = 0, o = 0, max_pos = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const SeqChunk& ch = chunks[i];
    const int64_t n = static_cast<int64_t>(ch.tokens.size());
    const int64_t off = seqs_.at(ch.seq).offset;
    chunk_start[i] = t;
    for (int64_t j = 0; j < n; ++j, ++t) {
      tok[t] = ch.tokens[j];
      pos[t] = static_cast<int32_t>(off + j);
      start[t] = static_cast<int32_t>(chunk_start[i]);
      len[t] = static_cast<int32_t>(n);
    }
    if (ch.logits) rows[o++] = static_cast<int32_t>(t - 1);
    max_pos = std::max(max_pos, off + n);
  }
  // Every rank: its scratch, RoPE rows, the step's ints and the embedding of its residual.
  std::vector<cuda::StepTokens> st(ranks_.size());
  for (size_t r = 0; r < ranks_.size(); ++r) {
    Rank& R = *ranks_[r];
    cuda::set_device(R.device);
    ensure_scratch(R, T, n_out, r == 0);
    ensure_rope(R, max_pos);
    int32_t* d_ints = R.ints.as<int32_t>();
    cuda::copy_to_device(d_ints, ints.data(), ints.size() * 4, R.stream);
    st[r].pos = d_ints + T;
    st[r].start = d_ints + 2 * T;
    st[r].len = d_ints + 3 * T;
    st[r].n_tokens = T;
    cuda::embed_rows(d_ints, T, R.embed, R.embed_t, c.hidden_size, R.x.as<float>(), R.stream);
  }

  AttentionParams ap;
  ap.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  ap.window = c.sliding_window;

  for (int64_t li = 0; li < c.n_layers; ++li) {
    for (size_t r = 0; r < ranks_.size(); ++r) {
      cuda::set_device(ranks_[r]->device);
      attention_half(r, li, chunks, chunk_start, st[r], ap);
    }
    all_reduce_h(T);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      cuda::set_device(ranks_[r]->device);
      mlp_half(r, li, T);
    }
    all_reduce_h(T);
  }

  for (size_t i = 0; i < chunks.size(); ++i) {
    Sequence& s = seqs_.at(chunks[i].seq);
    s.offset += static_cast<int64_t>(chunks[i].tokens.size());
    if (chunks[i].end_prompt) {
      for (size_t r = 0; r < s.ranks.size(); ++r) {
        cuda::set_device(ranks_[r]->device);
        const Rank& R = *ranks_[r];
        for (size_t l = 0; l < s.ranks[r].caches.size(); ++l) {
          cuda::DeviceKVCache& cache = *s.ranks[r].caches[l];
          if (!s.ext_scores.empty())  // the rank's KV heads' rows of [1, n_kv_heads, ext_rows]
            cuda::set_external_scores(cache, s.ext_scores[l].data() + R.kv_first * s.ext_rows, 1,
                                      R.hkv, s.ext_rows);
          cache.end_prompt();
        }
      }
      s.prompt_ended = true;
      s.ext_scores.clear();
    }
  }
  Rank& R0 = *ranks_[0];
  cuda::set_device(R0.device);
  sample_memory();
  if (n_out == 0) {
    if (tokens) tokens->clear();
    finish_timing(chunks, T);
    return;
  }

  // The last layer's MLP output joins the residual on the logit rows only, then the final norm
  // and lm_head over those rows (rank 0: every rank's residual is the same).
  mark(0, kPhLogits);
  cuda::AddNormParams an;
  an.x = R0.x.as<float>();
  an.add = c.n_layers > 0 ? R0.h.as<float>() : nullptr;
  an.rows = R0.ints.as<int32_t>() + 4 * T;
  an.n_rows = n_out;
  an.hidden = c.hidden_size;
  an.weight = R0.final_norm.as<float>();
  an.eps = c.rms_norm_eps;
  an.out = R0.op.data();
  an.out_t = R0.lm_head.t;
  cuda::add_rmsnorm(an, R0.stream);
  lm_head_product(R0, n_out);
  mark(0, kPhToHost);
  if (tokens) {
    if (R0.greedy.size() < static_cast<size_t>(n_out) * 4) R0.greedy = DeviceBuffer(n_out * 4);
    cuda::argmax_rows(R0.logits.as<float>(), n_out, c.vocab_size, n_vocab, R0.greedy.as<int32_t>(),
                      R0.stream);
    tokens->resize(static_cast<size_t>(n_out));
    cuda::copy_to_host(tokens->data(), R0.greedy.data(), tokens->size() * 4, R0.stream);
  } else if (logits) {
    logits->resize(static_cast<size_t>(n_out * c.vocab_size));
    cuda::copy_to_host(logits->data(), R0.logits.data(), logits->size() * 4, R0.stream);
  } else {
    cuda::synchronize(R0.stream);
  }
  // Other devices' work of this step (their last all-reduce) ends before the next step.
  for (size_t r = 1; r < ranks_.size(); ++r)
    if (ranks_[r]->stream != R0.stream) {
      cuda::set_device(ranks_[r]->device);
      cuda::synchronize(ranks_[r]->stream);
    }
  finish_timing(chunks, T);
}

void CudaEngine::finish_timing(std::span<const SeqChunk> chunks, int64_t n_tokens) {
  if (!opts_.time_phases) return;
  const int kind = n_tokens == static_cast<int64_t>(chunks.size()) ? 1 : 0;
  phases_.mark(kPhCount, ranks_[0]->stream);  // the end of the last phase
  phases_.collect(&phase_gpu_ms_[kind], &phase_host_ms_[kind], &phase_counts_[kind]);
  phase_gpu_ms_[kind].resize(kPhCount, 0.0);
  phase_host_ms_[kind].resize(kPhCount, 0.0);
  phase_counts_[kind].resize(kPhCount);
  ++steps_[kind];
}

}  // namespace

std::unique_ptr<Engine> make_cuda_engine(const Model& model, const EngineOptions& opts) {
  VQ_CHECK(cuda::is_available(),
           "[engine] device cuda: expected a CUDA device but none was found (no device or no "
           "driver); use --device cpu");
  check_cuda_tensor_parallel(model.config(), opts.tensor_parallel, cuda::device_count(),
                             cuda::has_nccl(), opts.tp_simulate);
  return std::make_unique<CudaEngine>(model, opts);
}

}  // namespace vq
