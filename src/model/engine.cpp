// The CPU engine (veloxquant/engine.h): one vector of per-layer caches per sequence (batch 1,
// Model::make_caches), step() = Model::forward per chunk over that sequence's caches, so every
// sequence computes exactly what vq::generate computes for it alone. With tensor_parallel N > 1
// a sequence holds N ranks' caches and step() is ShardedModel::forward with the reference
// all-reduce (veloxquant/tensor_parallel.h). Also parse_device,
// device_name, make_engine and the host copy bandwidth (the CPU decode bound of `bench`).
//
// A step is checked whole (ids, repeats, empty chunks, token ids, positions) before any forward
// call, so a refused step changes no cache.
#include "veloxquant/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>

#include "veloxquant/error.h"
#include "veloxquant/tensor_parallel.h"

namespace vq {

void check_layer_head(const ModelConfig& c, int64_t layer, int64_t head) {
  VQ_CHECK(layer >= 0 && layer < c.n_layers && head >= 0 && head < c.n_kv_heads,
           "[engine] stored_positions: expected layer in [0, " + std::to_string(c.n_layers) +
               ") and head in [0, " + std::to_string(c.n_kv_heads) + ") but got layer " +
               std::to_string(layer) + ", head " + std::to_string(head));
}

Device parse_device(const std::string& name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") return Device::kCuda;
  throw Error("[engine] device: expected cpu or cuda but got '" + name + "'");
}

const char* device_name(Device d) {
  return d == Device::kCuda ? "cuda" : "cpu";
}

void check_synthetic(const ModelConfig& c, int64_t offset, int64_t n_tokens, int64_t chunk) {
  VQ_CHECK(offset == 0, "[engine] fill_synthetic: expected an empty sequence but it holds " +
                            std::to_string(offset) + " tokens");
  VQ_CHECK(n_tokens >= 1 && chunk >= 1,
           "[engine] fill_synthetic: expected n_tokens >= 1 and chunk >= 1 but got " +
               std::to_string(n_tokens) + " and " + std::to_string(chunk));
  VQ_CHECK(c.max_position_embeddings <= 0 || n_tokens <= c.max_position_embeddings,
           "[engine] fill_synthetic: expected at most max_position_embeddings (" +
               std::to_string(c.max_position_embeddings) + ") tokens but got " +
               std::to_string(n_tokens));
}

void check_greedy_vocab(const ModelConfig& c, int64_t n_vocab) {
  VQ_CHECK(n_vocab >= 1 && n_vocab <= c.vocab_size,
           "[engine] step_greedy: expected n_vocab in [1, " + std::to_string(c.vocab_size) +
               "] but got " + std::to_string(n_vocab));
}

std::vector<int64_t> warm_up_row_counts(int64_t max_rows, int64_t prefill_tokens) {
  VQ_CHECK(max_rows >= 0 && prefill_tokens >= 0,
           "[engine] warm_up: expected max_rows >= 0 and prefill_tokens >= 0 but got " +
               std::to_string(max_rows) + " and " + std::to_string(prefill_tokens));
  std::vector<int64_t> rows;
  for (int64_t m = 1; m <= std::min(max_rows, kWarmUpEveryRowUpTo); ++m) rows.push_back(m);
  if (max_rows > kWarmUpEveryRowUpTo) rows.push_back(max_rows);
  return rows;
}

double Engine::warm_up(int64_t max_rows, int64_t prefill_tokens) {
  (void)warm_up_row_counts(max_rows, prefill_tokens);  // the same refusals as the CUDA engine
  return 0.0;
}

void Engine::step_greedy(std::span<const SeqChunk> chunks, int64_t n_vocab,
                         std::vector<int32_t>* tokens) {
  const int64_t V = config().vocab_size;
  check_greedy_vocab(config(), n_vocab);
  std::vector<float> logits;
  step(chunks, &logits);
  tokens->clear();
  for (size_t r = 0; r * static_cast<size_t>(V) < logits.size(); ++r) {
    const float* row = logits.data() + r * static_cast<size_t>(V);
    const bool finite = std::any_of(row, row + V, [](float x) { return std::isfinite(x); });
    tokens->push_back(finite ? argmax(row, n_vocab) : -1);
  }
}

void Engine::set_external_scores(int64_t seq, std::vector<std::vector<float>> scores) {
  (void)seq;
  (void)scores;
  throw Error(std::string("[engine] set_external_scores: expected an engine that hands external "
                          "scores to its caches (the CUDA engine) but got the ") +
              device_name(device()) + " engine with tensor_parallel " +
              std::to_string(options().tensor_parallel));
}

void Engine::set_attention_tap(int64_t seq, AttentionTap* tap) {
  (void)seq;
  (void)tap;
  throw Error(std::string("[engine] set_attention_tap: expected an engine with the attention "
                          "tap (the CUDA engine) but got the ") +
              device_name(device()) + " engine with tensor_parallel " +
              std::to_string(options().tensor_parallel));
}

double Engine::host_copy_bandwidth(int64_t bytes) {
  VQ_CHECK(bytes >= 1,
           "[engine] host_copy_bandwidth: expected bytes >= 1 but got " + std::to_string(bytes));
  const size_t n = static_cast<size_t>(bytes);
  std::vector<char> src(n, 1), dst(n, 0);  // both touched: no first-touch page faults timed
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    src[static_cast<size_t>(rep) % n] = static_cast<char>(rep);  // not a copy of a constant
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0) best = std::max(best, 2.0 * static_cast<double>(bytes) / s);
  }
  return best;
}

namespace {

class CpuEngine final : public Engine {
 public:
  CpuEngine(const Model& model, const EngineOptions& opts) : model_(model), opts_(opts) {
    validate(opts_.cache);  // refused before any sequence exists
    plan_ = make_shard_plan(model.config(), opts_.tensor_parallel);
    for (int64_t r = 0; r < plan_.n_ranks; ++r) rank_cache_config(plan_, r, opts_.cache);
    if (plan_.n_ranks > 1) {
      tp_ = std::make_unique<ShardedModel>(model, plan_.n_ranks);
      comm_ = make_reference_communicator(plan_.n_ranks);
    }
  }

  Device device() const override { return Device::kCpu; }
  const ModelConfig& config() const override { return model_.config(); }
  const EngineOptions& options() const override { return opts_; }

  using Engine::add_sequence;
  int64_t add_sequence(const CacheConfig& cache) override {
    validate(cache);
    const int64_t id = next_id_++;
    RankCaches caches;
    if (tp_) {
      for (int64_t r = 0; r < plan_.n_ranks; ++r) rank_cache_config(plan_, r, cache);
      caches = tp_->make_caches(cache);
    } else {
      caches.push_back(model_.make_caches(cache));
    }
    seqs_.emplace(id, std::move(caches));
    return id;
  }

  void remove_sequence(int64_t seq) override {
    auto it = find(seq, "remove_sequence");
    seqs_.erase(it);
  }

  int64_t offset(int64_t seq) const override {
    const auto& caches = find(seq, "offset")->second[0];
    return caches.empty() ? 0 : caches[0]->offset();
  }

  CacheMemory memory(int64_t seq) const override {
    const RankCaches& ranks = find(seq, "memory")->second;
    const int64_t heads = model_.config().n_kv_heads / static_cast<int64_t>(ranks.size());
    CacheMemory m = cache_memory(ranks[0], heads);
    for (size_t r = 1; r < ranks.size(); ++r) {
      const CacheMemory o = cache_memory(ranks[r], heads);
      m.rows_kept += o.rows_kept;
      m.bytes_accounted += o.bytes_accounted;
      m.bytes_resident += o.bytes_resident;
      m.fp16_bytes += o.fp16_bytes;
    }
    return m;
  }

  std::vector<int32_t> stored_positions(int64_t seq, int64_t layer, int64_t head) const override {
    const Caches& ranks = find(seq, "stored_positions")->second;
    check_layer_head(model_.config(), layer, head);
    // Rank r holds the KV heads [r H/N, (r + 1) H/N) (make_shard_plan).
    const int64_t per_rank = model_.config().n_kv_heads / static_cast<int64_t>(ranks.size());
    return ranks[static_cast<size_t>(head / per_rank)][static_cast<size_t>(layer)]
        ->stored_positions(0, head % per_rank);
  }

  // Host K/V/Q blocks [1, H, n, D] fp32 from mt19937_64(seed, id, layer), uniform on
  // [-sqrt 3, sqrt 3), handed to each layer's cache in `chunk`-row calls.
  void fill_synthetic(int64_t seq, int64_t n_tokens, int64_t chunk, uint64_t seed) override {
    const Caches& ranks = find(seq, "fill_synthetic")->second;
    const ModelConfig& c = model_.config();
    check_synthetic(c, offset(seq), n_tokens, chunk);
    VQ_CHECK(ranks.size() == 1,
             "[engine] fill_synthetic: expected tensor_parallel 1 (a benchmark "
             "fill of one device's caches) but got " +
                 std::to_string(ranks.size()));
    const auto& caches = ranks[0];
    const int64_t Hkv = c.n_kv_heads, Hq = c.n_heads, D = c.head_dim;
    const DType kt = opts_.kv_dtype;  // K/V as Model::forward hands them to the caches
    std::vector<float> k, v, q;
    std::vector<uint8_t> kb, vb;
    for (int64_t l = 0; l < c.n_layers; ++l) {
      std::mt19937_64 rng(seed ^ (static_cast<uint64_t>(seq) << 20) ^ static_cast<uint64_t>(l));
      std::uniform_real_distribution<float> u(-std::sqrt(3.0f), std::sqrt(3.0f));
      for (int64_t at = 0; at < n_tokens; at += chunk) {
        const int64_t n = std::min(chunk, n_tokens - at);
        for (auto* b : {&k, &v}) {
          b->resize(static_cast<size_t>(Hkv * n * D));
          for (float& x : *b) x = u(rng);
        }
        q.resize(static_cast<size_t>(Hq * n * D));
        for (float& x : q) x = u(rng);
        kb.resize(k.size() * dtype_size(kt));
        vb.resize(v.size() * dtype_size(kt));
        from_f32(k.data(), kb.data(), kt, k.size());
        from_f32(v.data(), vb.data(), kt, v.size());
        const TensorView qv = TensorView::contiguous(q.data(), DType::kF32, 1, Hq, n, D);
        UpdateOptions uo;
        uo.queries = &qv;
        caches[static_cast<size_t>(l)]->update_and_fetch(
            TensorView::contiguous(kb.data(), kt, 1, Hkv, n, D),
            TensorView::contiguous(vb.data(), kt, 1, Hkv, n, D), uo);
      }
    }
    for (const auto& cache : caches) cache->end_prompt();
  }

  void step(std::span<const SeqChunk> chunks, std::vector<float>* logits) override {
    const ModelConfig& c = model_.config();
    // Check everything first: nothing changes on a refused step.
    std::set<int64_t> seen;
    int64_t n_logits = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const SeqChunk& ch = chunks[i];
      const std::string where = "chunk " + std::to_string(i);
      VQ_CHECK(seqs_.count(ch.seq) == 1, "[engine] step: expected a live sequence id in " + where +
                                             " but got " + std::to_string(ch.seq));
      VQ_CHECK(seen.insert(ch.seq).second, "[engine] step: expected distinct sequences but " +
                                               where + " repeats sequence " +
                                               std::to_string(ch.seq));
      VQ_CHECK(!ch.tokens.empty(), "[engine] step: expected at least one token in " + where +
                                       " (sequence " + std::to_string(ch.seq) + ") but got none");
      for (size_t t = 0; t < ch.tokens.size(); ++t)
        VQ_CHECK(ch.tokens[t] >= 0 && ch.tokens[t] < c.vocab_size,
                 "[engine] step: expected token ids in [0, " + std::to_string(c.vocab_size) +
                     ") but got " + std::to_string(ch.tokens[t]) + " at token " +
                     std::to_string(t) + " of " + where);
      const int64_t end = offset(ch.seq) + static_cast<int64_t>(ch.tokens.size());
      if (c.max_position_embeddings > 0)
        VQ_CHECK(end <= c.max_position_embeddings,
                 "[engine] step: expected positions below the model's max_position_embeddings " +
                     std::to_string(c.max_position_embeddings) + " but " + where + " (sequence " +
                     std::to_string(ch.seq) + ") would take positions up to " +
                     std::to_string(end - 1));
      n_logits += ch.logits ? 1 : 0;
    }
    if (n_logits > 0 && logits) logits->resize(static_cast<size_t>(n_logits * c.vocab_size));
    ForwardOptions fo;
    fo.kv_dtype = opts_.kv_dtype;
    fo.matmul = opts_.matmul;
    int64_t row = 0;
    for (const SeqChunk& ch : chunks) {
      const auto& caches = seqs_.at(ch.seq);
      const bool want = ch.logits && logits != nullptr;
      fo.logits = want ? ForwardOptions::Logits::kLast : ForwardOptions::Logits::kNone;
      const auto n = static_cast<int64_t>(ch.tokens.size());
      if (tp_)
        tp_->forward(ch.tokens.data(), 1, n, caches, fo, *comm_, want ? &out_ : nullptr,
                     &rank_scratch_);
      else
        model_.forward(ch.tokens.data(), 1, n, caches[0], fo, want ? &out_ : nullptr, &scratch_);
      if (want) {
        std::copy(out_.begin(), out_.begin() + c.vocab_size,
                  logits->begin() + static_cast<std::ptrdiff_t>(row * c.vocab_size));
      }
      if (ch.logits) ++row;
      if (ch.end_prompt)
        for (const auto& rank : caches)
          for (const auto& cache : rank) cache->end_prompt();
    }
  }

 private:
  using Caches = RankCaches;  // [rank][layer]; one rank without tensor parallelism

  std::map<int64_t, Caches>::const_iterator find(int64_t seq, const char* op) const {
    auto it = seqs_.find(seq);
    VQ_CHECK(it != seqs_.end(), std::string("[engine] ") + op +
                                    ": expected a live sequence id but got " + std::to_string(seq));
    return it;
  }
  std::map<int64_t, Caches>::iterator find(int64_t seq, const char* op) {
    auto it = seqs_.find(seq);
    VQ_CHECK(it != seqs_.end(), std::string("[engine] ") + op +
                                    ": expected a live sequence id but got " + std::to_string(seq));
    return it;
  }

  const Model& model_;
  EngineOptions opts_;
  std::map<int64_t, Caches> seqs_;
  int64_t next_id_ = 0;
  ForwardScratch scratch_;
  std::vector<float> out_;
  ShardPlan plan_;
  std::unique_ptr<ShardedModel> tp_;  // tensor_parallel > 1
  std::unique_ptr<Communicator> comm_;
  std::vector<ForwardScratch> rank_scratch_;
};

}  // namespace

void check_cuda_tensor_parallel(const ModelConfig& c, int64_t n, int device_count, bool nccl,
                                bool simulate) {
  make_shard_plan(c, n);  // N divides the KV heads
  const std::string opt = "[engine] --tensor-parallel " + std::to_string(n) + ": ";
  if (simulate) {
    VQ_CHECK(device_count >= 1, opt + "--tp-simulate: expected a CUDA device to run the " +
                                    std::to_string(n) + " simulated ranks on but none is visible");
    return;
  }
  VQ_CHECK(n <= device_count,
           opt + "expected at most " + std::to_string(device_count) +
               " (the CUDA devices visible) but got " + std::to_string(n) +
               " (--tp-simulate runs N simulated ranks on one device, a check of the sharding)");
  if (n == 1) return;
  VQ_CHECK(nccl, opt +
                     "expected a build with NCCL for more than one device but this build has "
                     "none (configure with -DVQ_CUDA=ON -DVQ_NCCL=ON: CMake looks for "
                     "nccl.h and libnccl under NCCL_ROOT, the toolkit and the system folders)");
}

std::unique_ptr<Engine> make_cpu_engine(const Model& model, const EngineOptions& opts) {
  return std::make_unique<CpuEngine>(model, opts);
}

std::unique_ptr<Engine> make_engine(Device d, const Model& model, const EngineOptions& opts) {
  return d == Device::kCuda ? make_cuda_engine(model, opts) : make_cpu_engine(model, opts);
}

}  // namespace vq
