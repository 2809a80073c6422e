// The shard plan, the reference communicator, the sharded weights and the sharded forward pass
// (veloxquant/tensor_parallel.h). The forward pass runs the stages of Model::forward
// (src/model/forward_parts.h) once per rank over the rank's slice, all-reducing the partial
// o_proj and down_proj outputs between them.
#include "veloxquant/tensor_parallel.h"

#include <cstring>

#include "model/forward_parts.h"
#include "veloxquant/builder.h"
#include "veloxquant/error.h"

namespace vq {

namespace {

std::string list(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}

// Rows [first, first + count) of l: contiguous in the [out, in] matrix, no copy.
Linear row_slice(const Linear& l, int64_t first, int64_t count) {
  Linear r = l;
  r.w = static_cast<const char*>(l.w) + static_cast<size_t>(first * l.in) * dtype_size(l.dtype);
  r.out = count;
  if (!l.bias.empty()) r.bias.assign(l.bias.begin() + first, l.bias.begin() + first + count);
  return r;
}

// Columns [first, first + count) of l copied into `store` (file dtype); the bias only when
// keep_bias.
Linear col_slice(const Linear& l, int64_t first, int64_t count, bool keep_bias,
                 std::vector<char>& store) {
  const size_t es = dtype_size(l.dtype);
  store.resize(static_cast<size_t>(l.out * count) * es);
  for (int64_t o = 0; o < l.out; ++o)
    std::memcpy(store.data() + static_cast<size_t>(o * count) * es,
                static_cast<const char*>(l.w) + static_cast<size_t>(o * l.in + first) * es,
                static_cast<size_t>(count) * es);
  Linear r = l;
  r.w = store.data();
  r.in = count;
  if (!keep_bias) r.bias.clear();
  return r;
}

class ReferenceCommunicator final : public Communicator {
 public:
  explicit ReferenceCommunicator(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  std::string name() const override { return "reference"; }
  void all_reduce_sum(std::span<float* const> bufs, int64_t n) override {
    VQ_CHECK(static_cast<int64_t>(bufs.size()) == n_ && n >= 0,
             "[tensor_parallel] all_reduce_sum: expected " + std::to_string(n_) +
                 " buffers and n >= 0 but got " + std::to_string(bufs.size()) + " buffers, n " +
                 std::to_string(n));
    for (int64_t i = 0; i < n; ++i) {
      float s = bufs[0][i];
      for (int64_t r = 1; r < n_; ++r) s += bufs[static_cast<size_t>(r)][i];
      for (int64_t r = 0; r < n_; ++r) bufs[static_cast<size_t>(r)][i] = s;
    }
  }

 private:
  int64_t n_;
};

}  // namespace

std::vector<int64_t> tensor_parallel_sizes(const ModelConfig& c) {
  std::vector<int64_t> out;
  for (int64_t n = 1; n <= c.n_kv_heads; ++n)
    if (c.n_kv_heads % n == 0) out.push_back(n);
  return out;
}

ShardPlan make_shard_plan(const ModelConfig& c, int64_t n_ranks) {
  VQ_CHECK(
      n_ranks >= 1 && c.n_kv_heads >= 1 && n_ranks <= c.n_kv_heads && c.n_kv_heads % n_ranks == 0,
      "[tensor_parallel] expected N to divide the model's " + std::to_string(c.n_kv_heads) +
          " KV heads (" + std::to_string(c.n_heads) + " query heads), N in {" +
          list(tensor_parallel_sizes(c)) + "}, but got N = " + std::to_string(n_ranks));
  ShardPlan p;
  p.n_ranks = n_ranks;
  p.n_heads = c.n_heads;
  p.n_kv_heads = c.n_kv_heads;
  p.intermediate = c.intermediate_size;
  p.n_layers = c.n_layers;
  const int64_t kv = c.n_kv_heads / n_ranks, q = c.n_heads / n_ranks;
  const int64_t base = c.intermediate_size / n_ranks, extra = c.intermediate_size % n_ranks;
  int64_t i0 = 0;
  for (int64_t r = 0; r < n_ranks; ++r) {
    RankShard s;
    s.kv_heads = {r * kv, kv};
    s.q_heads = {r * q, q};
    s.intermediate = {i0, base + (r < extra ? 1 : 0)};
    i0 += s.intermediate.count;
    p.ranks.push_back(s);
  }
  return p;
}

CacheConfig rank_cache_config(const ShardPlan& plan, int64_t rank, const CacheConfig& cfg) {
  VQ_CHECK(rank >= 0 && rank < plan.n_ranks, "[tensor_parallel] expected a rank in 0.." +
                                                 std::to_string(plan.n_ranks - 1) + " but got " +
                                                 std::to_string(rank));
  VQ_CHECK(plan.n_ranks == 1 || cfg.snap_scoring != SnapScoring::kExternal ||
               (cfg.method != "snapkv" && cfg.method != "snapkv+skvq"),
           "[tensor_parallel] snap_scoring: expected key_proxy or query with N = " +
               std::to_string(plan.n_ranks) +
               " but got external (the caller's scores cover every head at once; no engine "
               "hands them to sharded caches)");
  VQ_CHECK(plan.n_ranks == 1 || cfg.skvq_protect_scoring != SnapScoring::kExternal ||
               cfg.method != "skvq" || cfg.skvq_protect == 0.0,
           "[tensor_parallel] skvq_protect_scoring: expected key_proxy or query with N = " +
               std::to_string(plan.n_ranks) +
               " but got external (the caller's scores cover every head at once; no engine "
               "hands them to sharded caches)");
  VQ_CHECK(plan.n_ranks == 1 || cfg.method != "snapkv+skvq" ||
               cfg.snap_evict_at == SnapEvictAt::kPromptEnd,
           "[tensor_parallel] snap_evict_at: expected prompt_end for snapkv+skvq with N = " +
               std::to_string(plan.n_ranks) +
               " but got prefill_call (an eviction that meets packed rows keeps the layer's "
               "packed-row count the largest over its heads, so one head's selection decides "
               "when another head's rows are quantized; prompt_end evicts before any row is "
               "packed)");
  CacheConfig c = cfg;
  c.kv_head_first = plan.ranks[static_cast<size_t>(rank)].kv_heads.first;
  c.kv_heads_total = plan.n_kv_heads;
  return c;
}

std::unique_ptr<Communicator> make_reference_communicator(int64_t n_ranks) {
  VQ_CHECK(n_ranks >= 1, "[tensor_parallel] expected a communicator of N >= 1 ranks but got " +
                             std::to_string(n_ranks));
  return std::make_unique<ReferenceCommunicator>(n_ranks);
}

struct ShardedModel::Weights {
  std::vector<std::vector<Model::Layer>> layers;  // [rank][layer]
  std::vector<std::vector<char>> store;           // column slices' bytes
};

ShardedModel::ShardedModel(const Model& model, int64_t n_ranks)
    : model_(model), plan_(make_shard_plan(model.config(), n_ranks)), w_(new Weights) {
  const ModelConfig& c = model.config();
  const int64_t D = c.head_dim;
  w_->store.reserve(static_cast<size_t>(2 * n_ranks * c.n_layers));
  for (int64_t r = 0; r < n_ranks; ++r) {
    const RankShard& s = plan_.ranks[static_cast<size_t>(r)];
    std::vector<Model::Layer> mine;
    for (const Model::Layer& L : model.layers()) {
      Model::Layer m;
      m.attn_norm = L.attn_norm;
      m.mlp_norm = L.mlp_norm;
      m.q = row_slice(L.q, s.q_heads.first * D, s.q_heads.count * D);
      m.k = row_slice(L.k, s.kv_heads.first * D, s.kv_heads.count * D);
      m.v = row_slice(L.v, s.kv_heads.first * D, s.kv_heads.count * D);
      m.o = col_slice(L.o, s.q_heads.first * D, s.q_heads.count * D, r == 0,
                      w_->store.emplace_back());
      m.gate = row_slice(L.gate, s.intermediate.first, s.intermediate.count);
      m.up = row_slice(L.up, s.intermediate.first, s.intermediate.count);
      m.down = col_slice(L.down, s.intermediate.first, s.intermediate.count, r == 0,
                         w_->store.emplace_back());
      mine.push_back(std::move(m));
    }
    w_->layers.push_back(std::move(mine));
  }
}

ShardedModel::~ShardedModel() = default;

const std::vector<Model::Layer>& ShardedModel::rank_layers(int64_t rank) const {
  VQ_CHECK(rank >= 0 && rank < plan_.n_ranks,
           "[tensor_parallel] rank_layers: expected a rank in 0.." +
               std::to_string(plan_.n_ranks - 1) + " but got " + std::to_string(rank));
  return w_->layers[static_cast<size_t>(rank)];
}

int64_t device_weight_bytes(const Model& model, int64_t n_ranks, bool simulate) {
  if (n_ranks == 1) return static_cast<int64_t>(model.checkpoint_bytes());
  const ShardPlan plan = make_shard_plan(model.config(), n_ranks);
  const int64_t D = model.config().head_dim;
  auto bytes = [](const Linear& l, int64_t out, int64_t in, DType as) {
    return out * in * static_cast<int64_t>(dtype_size(as)) + (l.bias.empty() ? 0 : 4 * out);
  };
  auto group = [](std::initializer_list<const Linear*> g) {
    for (const Linear* l : g)
      if (l->dtype != (*g.begin())->dtype) return DType::kF32;
    return (*g.begin())->dtype;
  };
  int64_t total = 0, largest = 0;
  for (int64_t r = 0; r < n_ranks; ++r) {
    const RankShard& sh = plan.ranks[static_cast<size_t>(r)];
    const int64_t q = sh.q_heads.count * D, kv = sh.kv_heads.count * D, I = sh.intermediate.count;
    int64_t b = 0;
    for (const Model::Layer& L : model.layers()) {
      const DType qkv = group({&L.q, &L.k, &L.v}), gu = group({&L.gate, &L.up});
      b += bytes(L.q, q, L.q.in, qkv) + bytes(L.k, kv, L.k.in, qkv) + bytes(L.v, kv, L.v.in, qkv);
      b += bytes(L.gate, I, L.gate.in, gu) + bytes(L.up, I, L.up.in, gu);
      b += L.o.out * q * static_cast<int64_t>(dtype_size(L.o.dtype)) +
           L.down.out * I * static_cast<int64_t>(dtype_size(L.down.dtype));
      if (r == 0) b += 4 * static_cast<int64_t>(L.o.bias.size() + L.down.bias.size());
      b += 4 * static_cast<int64_t>(L.attn_norm.size() + L.mlp_norm.size());
    }
    const Linear& e = model.embedding();
    b += e.out * e.in * static_cast<int64_t>(dtype_size(e.dtype));
    if (r == 0) {
      const Linear& h = model.lm_head();
      if (h.w != e.w) b += h.out * h.in * static_cast<int64_t>(dtype_size(h.dtype));
      b += 4 * static_cast<int64_t>(model.final_norm().size() + h.bias.size());
    }
    total += b;
    largest = std::max(largest, b);
  }
  return simulate ? total : largest;
}

RankCaches ShardedModel::make_caches(const CacheConfig& cfg) const {
  RankCaches out;
  ModelCacheShape shape = model_.cache_shape();
  for (int64_t r = 0; r < plan_.n_ranks; ++r) {
    for (auto& h : shape.n_kv_heads) h = plan_.n_kv_heads / plan_.n_ranks;
    out.push_back(build_caches(shape, rank_cache_config(plan_, r, cfg)));
  }
  return out;
}

void ShardedModel::forward(const int32_t* tokens, int64_t batch, int64_t seq,
                           const RankCaches& caches, const ForwardOptions& opts, Communicator& comm,
                           std::vector<float>* logits, std::vector<ForwardScratch>* scratch) const {
  const ModelConfig& c = model_.config();
  const int64_t N = plan_.n_ranks;
  const auto uN = static_cast<size_t>(N);
  VQ_CHECK(comm.size() == N && static_cast<int64_t>(caches.size()) == N,
           "[tensor_parallel] forward: expected a communicator and caches of " + std::to_string(N) +
               " ranks but got " + std::to_string(comm.size()) + " and " +
               std::to_string(caches.size()));
  const int64_t offset = fwd::check_call(c, tokens, batch, seq, caches[0]);
  for (size_t r = 1; r < uN; ++r)
    VQ_CHECK(fwd::check_call(c, tokens, batch, seq, caches[r]) == offset,
             "[tensor_parallel] forward: expected every rank's caches at offset " +
                 std::to_string(offset) + " but rank " + std::to_string(r) + " differs");
  std::vector<ForwardScratch> local;
  std::vector<ForwardScratch>& s = scratch ? *scratch : local;
  if (s.size() < uN) s.resize(uN);
  std::vector<fwd::Step> st;
  for (size_t r = 0; r < uN; ++r)
    st.push_back(fwd::begin(model_, tokens, batch, seq, offset, opts, s[r]));
  std::vector<float*> bufs(uN);
  const int64_t n = batch * seq * c.hidden_size;
  for (int64_t li = 0; li < c.n_layers; ++li) {
    const auto l = static_cast<size_t>(li);
    for (size_t r = 0; r < uN; ++r) {
      const RankShard& sh = plan_.ranks[r];
      const fwd::LayerSlice ls =
          fwd::layer_slice(w_->layers[r][l], sh.q_heads.count, sh.kv_heads.count);
      fwd::norm_in(st[r], s[r], li > 0, *ls.attn_norm);
      fwd::attention(st[r], ls, *caches[r][l], s[r]);
      bufs[r] = s[r].h.data();
    }
    comm.all_reduce_sum(bufs, n);
    for (size_t r = 0; r < uN; ++r) {
      const fwd::LayerSlice ls = fwd::layer_slice(w_->layers[r][l], 0, 0);
      fwd::norm_in(st[r], s[r], true, *ls.mlp_norm);
      fwd::mlp(st[r], ls, s[r]);
      bufs[r] = s[r].h.data();
    }
    comm.all_reduce_sum(bufs, n);
  }
  // Every rank's residual stream is the same; rank 0's gives the logits.
  fwd::finish(model_, st[0], opts, s[0], logits);
}

}  // namespace vq
