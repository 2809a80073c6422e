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
// DeviceKVCache::update_and_fetch (queries passed for SnapKV query scoring), then attention over
// the view: prefill_attention for chunks of several tokens, the planned decode kernels for single
// tokens (planned at the first layer of a step, re-planned only when a later layer's view has
// another shape; a query-head group the decode kernels do not take runs as sub-groups of the
// largest power of two dividing it); o_proj, residual, RMSNorm, gate|up (one product), SwiGLU,
// down_proj, residual (docs/design.md §C1 for the cache contract). Logits: the final RMSNorm and
// lm_head on the requested rows only, then one copy to the host (the step's only host sync);
// step_greedy picks each row's argmax on the device and copies only the ids.
// Scratch buffers grow to the largest step and are reused. No CUDA graphs: every step's kernel
// arguments are made on the host (cache offsets and row counts, view pointers, decode plans), so a
// captured graph would be stale at the next step and capturing costs what launching does
// (docs/results/gpu/engine/run2/README.md measured where a step goes). Built only with
// VQ_CUDA (src/model/engine_cuda_stub.cpp refuses otherwise).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "cuda/model_ops.cuh"
#include "veloxquant/cuda.h"
#include "veloxquant/cuda_cache.h"
#include "veloxquant/engine.h"
#include "veloxquant/error.h"
#include "veloxquant/multi_gpu.h"

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

struct Sequence {
  CacheConfig cache;                                         // its caches' config
  std::vector<std::unique_ptr<cuda::DeviceKVCache>> caches;  // one per layer
  int64_t offset = 0;
  // The decode plan of this sequence's last single-token chunk and the key it was made for
  // (view shape, q_pos0, query heads): reused by every layer whose view has that key.
  cuda::DecodePlan plan;
  std::vector<int64_t> plan_key;
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
      : model_(model), cfg_(model.config()), opts_(opts) {
    const ModelConfig& c = cfg_;
    VQ_CHECK(is_float_dtype(opts.kv_dtype),
             std::string("[engine] kv_dtype: expected float32, float16 or bfloat16 but got ") +
                 dtype_name(opts.kv_dtype));
    VQ_CHECK(c.head_dim == 64 || c.head_dim == 128,
             "[engine] expected head_dim 64 or 128 (the CUDA attention kernels) but got " +
                 std::to_string(c.head_dim));
    size_t total = 0;
    cuda::device_memory(&free_at_start_, &total);
    stream_ = cuda::create_stream();
    try {
      // The cache config is refused here (make_device_cache validates it as the CPU builder
      // does), not at the first add_sequence().
      (void)cuda::make_device_cache(opts.cache, 1, c.n_kv_heads, c.head_dim, stream_);
      blas_ = std::make_unique<cuda::Blas>(stream_);
      upload_weights();
      ensure_rope(c.max_position_embeddings > 0
                      ? std::min(c.max_position_embeddings, kRopeRowsAtStart)
                      : kRopeRowsAtStart);
      cuda::synchronize(stream_);
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
    Sequence s;
    s.cache = cache;
    s.caches.reserve(static_cast<size_t>(cfg_.n_layers));
    // the first make_device_cache validates the config (as the CPU builder does) before any
    // allocation of this sequence
    for (int64_t l = 0; l < cfg_.n_layers; ++l)
      s.caches.push_back(
          cuda::make_device_cache(cache, 1, cfg_.n_kv_heads, cfg_.head_dim, stream_));
    const int64_t id = next_id_++;
    seqs_.emplace(id, std::move(s));
    sample_memory();
    return id;
  }

  void remove_sequence(int64_t seq) override {
    auto it = find(seq, "remove_sequence");
    seqs_.erase(it);  // the caches' cudaFree (device-synchronising) returns their memory
  }

  int64_t offset(int64_t seq) const override { return find(seq, "offset")->second.offset; }

  CacheMemory memory(int64_t seq) const override {
    const Sequence& s = find(seq, "memory")->second;
    CacheMemory m;
    m.n_layers = static_cast<int64_t>(s.caches.size());
    for (size_t i = 0; i < s.caches.size(); ++i) {
      const CacheStats st = s.caches[i]->stats();
      if (i == 0) {
        m.method = st.method;
        m.tokens_seen = st.tokens_seen;
        m.rows_kept_per_head = st.rows_stored;
      }
      m.rows_kept += st.rows_stored * cfg_.n_kv_heads;
      m.bytes_accounted += st.bytes_accounted;
      m.bytes_resident += st.bytes_resident;
      m.fp16_bytes += st.fp16_bytes;
    }
    if (s.caches.empty()) m.method = opts_.cache.method;
    return m;
  }

  // Device K/V (kv_dtype) and fp32 queries from cuda::fill_uniform, one stream per (seed,
  // sequence, layer, chunk, K/V/Q), handed to each layer's cache in `chunk`-row calls; the three
  // blocks live in buffers of their own for the call (not the step scratch, which a chunk of a
  // whole long prompt would grow to gigabytes).
  void fill_synthetic(int64_t seq, int64_t n_tokens, int64_t chunk, uint64_t seed) override {
    Sequence& s = find(seq, "fill_synthetic")->second;
    check_synthetic(cfg_, s.offset, n_tokens, chunk);
    const int64_t Hkv = cfg_.n_kv_heads, Hq = cfg_.n_heads, D = cfg_.head_dim;
    const size_t rows = static_cast<size_t>(std::min(chunk, n_tokens));
    DeviceBuffer kh(rows * static_cast<size_t>(Hkv * D) * dtype_size(opts_.kv_dtype)),
        vh(kh.size()), qh(rows * static_cast<size_t>(Hq * D) * 4);
    for (int64_t l = 0; l < cfg_.n_layers; ++l)
      for (int64_t at = 0, c = 0; at < n_tokens; at += chunk, ++c) {
        const int64_t n = std::min(chunk, n_tokens - at);
        const uint64_t base = seed * 0x100000001B3ull + static_cast<uint64_t>(seq) * 0x1000193ull +
                              static_cast<uint64_t>(l) * 0x10001ull + static_cast<uint64_t>(c) * 7;
        cuda::fill_uniform(kh.data(), opts_.kv_dtype, Hkv * n * D, base * 3, stream_);
        cuda::fill_uniform(vh.data(), opts_.kv_dtype, Hkv * n * D, base * 3 + 1, stream_);
        cuda::fill_uniform(qh.data(), DType::kF32, Hq * n * D, base * 3 + 2, stream_);
        const TensorView qv = TensorView::contiguous(qh.data(), DType::kF32, 1, Hq, n, D);
        cuda::DeviceUpdateOptions uo;
        uo.queries = &qv;
        s.caches[static_cast<size_t>(l)]->update_and_fetch(
            TensorView::contiguous(kh.data(), opts_.kv_dtype, 1, Hkv, n, D),
            TensorView::contiguous(vh.data(), opts_.kv_dtype, 1, Hkv, n, D), uo);
      }
    for (auto& cache : s.caches) cache->end_prompt();
    s.offset = n_tokens;
    cuda::synchronize(stream_);  // before the blocks' buffers are freed
    sample_memory();
  }

  std::vector<int32_t> stored_positions(int64_t seq, int64_t layer, int64_t head) const override {
    const Sequence& s = find(seq, "stored_positions")->second;
    check_layer_head(cfg_, layer, head);
    return s.caches[static_cast<size_t>(layer)]->stored_positions(0, head);
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

  // bench's hooks (engine.h): the device's copy bandwidth, measured now with two 256 MiB buffers
  // (64 MiB when those do not fit), and the peak of the device memory in use since the engine was
  // made, over what was in use before it: cudaMemGetInfo sampled after construction, each
  // add_sequence and each step (scratch a kernel takes and returns inside one step is not seen).
  double copy_bandwidth() override {
    cuda::synchronize(stream_);
    try {
      return cuda::device_copy_bandwidth(int64_t{256} << 20, stream_);
    } catch (const Error&) {
      return cuda::device_copy_bandwidth(int64_t{64} << 20, stream_);
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
        out.push_back(t);
      }
    return out;
  }

 private:
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

  void sample_memory() {
    size_t free_now = 0, total = 0;
    cuda::device_memory(&free_now, &total);
    if (free_now < free_at_start_)
      peak_bytes_ = std::max(peak_bytes_, static_cast<int64_t>(free_at_start_ - free_now));
  }

  // Frees everything the engine holds; never throws (a failed sync still frees).
  void release() noexcept {
    try {
      if (stream_) cuda::synchronize(stream_);
    } catch (...) {
    }
    seqs_.clear();
    blas_.reset();
    cuda::destroy_stream(stream_);
    stream_ = nullptr;
  }

  // The device copy of a weight (shared when the host pointer and dtype were uploaded before).
  const void* upload_matrix(const Linear& l, DType as) {
    const auto key = std::make_pair(l.w, as);
    if (auto it = pool_.find(key); it != pool_.end()) return it->second.data();
    const size_t n = static_cast<size_t>(l.out * l.in);
    DeviceBuffer b;
    if (as == l.dtype) {
      b = DeviceBuffer(n * dtype_size(l.dtype));
      b.upload(l.w, n * dtype_size(l.dtype), 0, stream_);
    } else {  // widened to f32 (exact)
      std::vector<float> f(n);
      to_f32(l.w, l.dtype, f.data(), n);
      b = DeviceBuffer::from_vector(f, stream_);
    }
    const void* p = b.data();
    pool_.emplace(key, std::move(b));
    return p;
  }

  // Uploads the matrices of a group (same `in`) as one [sum out, in] matrix of dtype `as` into
  // *buf; the DevLinears point into it (biases uploaded each on its own).
  void upload_group(std::initializer_list<std::pair<const Linear*, DevLinear*>> g, DType as,
                    DeviceBuffer* buf) {
    const size_t es = dtype_size(as);
    size_t total = 0;
    for (const auto& [l, d] : g) total += static_cast<size_t>(l->out * l->in) * es;
    *buf = DeviceBuffer(total);
    size_t at = 0;
    for (const auto& [l, d] : g) {
      const size_t n = static_cast<size_t>(l->out * l->in);
      if (as == l->dtype) {
        buf->upload(l->w, n * es, at, stream_);
      } else {  // widened to f32 (exact)
        std::vector<float> f(n);
        to_f32(l->w, l->dtype, f.data(), n);
        buf->upload(f.data(), n * es, at, stream_);
      }
      d->w = static_cast<const char*>(buf->data()) + at;
      d->t = as;
      d->out = l->out;
      d->in = l->in;
      if (!l->bias.empty()) d->bias = DeviceBuffer::from_vector(l->bias, stream_);
      at += n * es;
    }
  }

  DevLinear upload_linear(const Linear& l, DType as) {
    DevLinear d;
    d.w = upload_matrix(l, as);
    d.t = as;
    d.out = l.out;
    d.in = l.in;
    if (!l.bias.empty()) d.bias = DeviceBuffer::from_vector(l.bias, stream_);
    return d;
  }

  static DType group_dtype(std::initializer_list<const Linear*> g) {
    const DType t = (*g.begin())->dtype;
    for (const Linear* l : g)
      if (l->dtype != t) return DType::kF32;
    return t;
  }

  void upload_weights() {
    for (const Model::Layer& L : model_.layers()) {
      DevLayer d;
      d.attn_norm = DeviceBuffer::from_vector(L.attn_norm, stream_);
      d.mlp_norm = DeviceBuffer::from_vector(L.mlp_norm, stream_);
      d.qkv_t = group_dtype({&L.q, &L.k, &L.v});
      d.gate_up_t = group_dtype({&L.gate, &L.up});
      upload_group({{&L.q, &d.q}, {&L.k, &d.k}, {&L.v, &d.v}}, d.qkv_t, &d.qkv_w);
      d.o = upload_linear(L.o, L.o.dtype);
      upload_group({{&L.gate, &d.gate}, {&L.up, &d.up}}, d.gate_up_t, &d.gate_up_w);
      d.down = upload_linear(L.down, L.down.dtype);
      layers_.push_back(std::move(d));
    }
    const Linear& e = model_.embedding();
    embed_ = upload_matrix(e, e.dtype);
    embed_t_ = e.dtype;
    lm_head_ = upload_linear(model_.lm_head(), model_.lm_head().dtype);
    final_norm_ = DeviceBuffer::from_vector(model_.final_norm(), stream_);
  }

  // RoPE tables [rows, D/2] covering positions [0, n): grown by doubling (recomputed on the host
  // with rope_cos_sin, the CPU's values, positions in parallel, then uploaded). The constructor
  // makes them for the first kRopeRowsAtStart positions (or max_position_embeddings if smaller),
  // so a step rarely pays for a table (bench --phases measured 100-130 ms once at position
  // 32768 when they grew in a decode step).
  static constexpr int64_t kRopeRowsAtStart = int64_t{1} << 17;
  void ensure_rope(int64_t n) {
    if (n <= rope_rows_) return;
    int64_t rows = std::max<int64_t>(rope_rows_ * 2, 256);
    while (rows < n) rows *= 2;
    if (cfg_.max_position_embeddings > 0) rows = std::min(rows, cfg_.max_position_embeddings);
    rows = std::max(rows, n);
    const int64_t half = cfg_.head_dim / 2;
    std::vector<float> cs(static_cast<size_t>(rows * half)), sn(cs.size());
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < rows; ++p)
      rope_cos_sin(model_.inv_freq(), p, cs.data() + p * half, sn.data() + p * half);
    rope_cos_ = DeviceBuffer::from_vector(cs, stream_);
    rope_sin_ = DeviceBuffer::from_vector(sn, stream_);
    rope_rows_ = rows;
  }

  // Scratch for steps of up to n_tokens tokens and n_out logit rows.
  void ensure_scratch(int64_t n_tokens, int64_t n_out) {
    const ModelConfig& c = cfg_;
    const size_t T = static_cast<size_t>(n_tokens);
    auto grow = [](DeviceBuffer& b, size_t bytes) {
      if (b.size() < bytes || !b.data()) {
        b = DeviceBuffer();
        b = DeviceBuffer(bytes);
      }
    };
    const size_t Hd = static_cast<size_t>(c.hidden_size),
                 I = static_cast<size_t>(c.intermediate_size);
    const size_t qd = static_cast<size_t>(c.n_heads * c.head_dim);
    const size_t kd = static_cast<size_t>(c.n_kv_heads * c.head_dim);
    if (n_tokens > tok_cap_) {
      grow(x_, T * Hd * 4);
      grow(h_, T * Hd * 4);
      grow(qkv_, T * (qd + 2 * kd) * 4);
      grow(qh_, T * qd * 4);
      grow(kh_, T * kd * dtype_size(opts_.kv_dtype));
      grow(vh_, T * kd * dtype_size(opts_.kv_dtype));
      grow(attn_, T * qd * 4);
      grow(op_, T * std::max({Hd, qd, I}) * 4);
      grow(gu_, T * 2 * I * 4);
      tok_cap_ = n_tokens;
    }
    grow(ints_, (4 * T + static_cast<size_t>(n_out)) * 4);
    if (n_out > out_cap_) {
      grow(logits_, static_cast<size_t>(n_out) * static_cast<size_t>(c.vocab_size) * 4);
      out_cap_ = n_out;
    }
    if (!qsub_.data()) {
      qsub_ = DeviceBuffer(qd * 4);
      osub_ = DeviceBuffer(qd * 4);
    }
  }

  void decode(Sequence& s, const cuda::DeviceCacheView& view, const AttentionParams& ap,
              const float* q, float* out);
  // step() (tokens == nullptr: the logit rows to *logits, if not null) or step_greedy() (each
  // logit row's argmax over [0, n_vocab) to *tokens).
  void run_step(std::span<const SeqChunk> chunks, std::vector<float>* logits,
                std::vector<int32_t>* tokens, int64_t n_vocab);
  // time_phases: closes the step's last phase and adds its marks to the step kind's sums.
  void finish_timing(std::span<const SeqChunk> chunks, int64_t n_tokens);

  const Model& model_;
  ModelConfig cfg_;
  EngineOptions opts_;
  cuda::Stream stream_ = nullptr;
  std::unique_ptr<cuda::Blas> blas_;
  cuda::DecodeWorkspace ws_;
  std::map<std::pair<const void*, DType>, DeviceBuffer> pool_;  // weights by host pointer, dtype
  std::vector<DevLayer> layers_;
  const void* embed_ = nullptr;
  DType embed_t_ = DType::kF32;
  DevLinear lm_head_;
  DeviceBuffer final_norm_;
  DeviceBuffer rope_cos_, rope_sin_;
  int64_t rope_rows_ = 0;
  // Scratch (grown, never shrunk): x, h [T, hidden]; qkv [T, H_q D + 2 H_kv D] the fused
  // product's output; qh [T H_q D] and kh, vh [T H_kv D] head-major per chunk; attn like qh; op
  // the product operand (largest of the operands); gu [T, 2 intermediate] the fused gate|up
  // output; ints the step's int32 tokens, positions, chunk starts, chunk lengths, logit rows;
  // logits [n_out, vocab]; qsub / osub one decode sub-group's queries and outputs.
  DeviceBuffer x_, h_, qkv_, qh_, kh_, vh_, attn_, op_, gu_, ints_, logits_, qsub_, osub_;
  DeviceBuffer greedy_;  // step_greedy's ids [n_out] int32
  int64_t tok_cap_ = 0, out_cap_ = 0;
  // EngineOptions::time_phases: the marks of the current step; milliseconds per phase summed over
  // steps, [0] prefill/mixed steps, [1] decode steps (every chunk one token).
  cuda::PhaseEvents phases_;
  std::vector<double> phase_gpu_ms_[2], phase_host_ms_[2];
  int64_t steps_[2] = {0, 0};
  void mark(int phase) {
    if (opts_.time_phases) phases_.mark(phase, stream_);
  }
  SeqMap seqs_;
  int64_t next_id_ = 0;
  size_t free_at_start_ = 0;  // cudaMemGetInfo's free bytes before the engine allocated
  int64_t peak_bytes_ = 0;
};

void CudaEngine::decode(Sequence& s, const cuda::DeviceCacheView& view, const AttentionParams& ap,
                        const float* q, float* out) {
  const int64_t Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads, D = cfg_.head_dim;
  const int64_t G = Hq / Hkv;
  int64_t sub = 8;
  while (G % sub != 0) sub /= 2;
  const int64_t nq = Hkv * sub;
  std::vector<int64_t> key = plan_key(view, ap.q_pos0, nq);
  if (key != s.plan_key) {
    s.plan = cuda::decode_attention_plan(ws_.context(), nq, view, ap);
    s.plan_key = std::move(key);
  }
  if (sub == G) {
    cuda::decode_attention_run(s.plan, q, view, out, ws_, stream_);
    return;
  }
  for (int64_t r = 0; r < G / sub; ++r) {
    cuda::gather_heads(q, Hkv, G, sub, r, D, qsub_.as<float>(), stream_);
    cuda::decode_attention_run(s.plan, qsub_.as<float>(), view, osub_.as<float>(), ws_, stream_);
    cuda::scatter_heads(osub_.as<float>(), Hkv, G, sub, r, D, out, stream_);
  }
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
    T += n;
    if (ch.logits) ++n_out;
  }
  if (chunks.empty()) {
    if (tokens) tokens->clear();
    return;
  }

  // ---- the step's int32 data: tokens, positions, chunk starts, chunk lengths, logit rows
  mark(kPhEmbed);
  ensure_scratch(T, n_out);
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
  ensure_rope(max_pos);
  int32_t* d_ints = ints_.as<int32_t>();
  cuda::copy_to_device(d_ints, ints.data(), ints.size() * 4, stream_);
  cuda::StepTokens st;
  st.pos = d_ints + T;
  st.start = d_ints + 2 * T;
  st.len = d_ints + 3 * T;
  st.n_tokens = T;

  const int64_t Hd = c.hidden_size, D = c.head_dim, Hq = c.n_heads, Hkv = c.n_kv_heads;
  const int64_t I = c.intermediate_size;
  const size_t kv_es = dtype_size(opts_.kv_dtype);
  float* x = x_.as<float>();
  float* h = h_.as<float>();
  cuda::embed_rows(d_ints, T, embed_, embed_t_, Hd, x, stream_);

  AttentionParams ap;
  ap.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  ap.window = c.sliding_window;

  for (int64_t li = 0; li < c.n_layers; ++li) {
    const DevLayer& L = layers_[static_cast<size_t>(li)];
    mark(kPhNorm);
    cuda::AddNormParams an;
    an.x = x;
    an.add = li > 0 ? h : nullptr;
    an.n_rows = T;
    an.hidden = Hd;
    an.weight = L.attn_norm.as<float>();
    an.eps = c.rms_norm_eps;
    an.out = op_.data();
    an.out_t = L.qkv_t;
    cuda::add_rmsnorm(an, stream_);
    mark(kPhQkv);
    // one product over the fused q|k|v rows: [T, qd + 2 kd] fp32, rows qkv_cols apart
    const int64_t qkv_cols = L.q.out + L.k.out + L.v.out;
    blas_->gemm(L.q.w, L.q.t, qkv_cols, L.q.in, op_.data(), T, qkv_.as<float>());
    mark(kPhRope);
    cuda::QkvRopeParams rp;
    rp.q = qkv_.as<float>();
    rp.k = qkv_.as<float>() + L.q.out;
    rp.v = qkv_.as<float>() + L.q.out + L.k.out;
    rp.row_stride = qkv_cols;
    rp.q_bias = L.q.bias_ptr();
    rp.k_bias = L.k.bias_ptr();
    rp.v_bias = L.v.bias_ptr();
    rp.cos = rope_cos_.as<float>();
    rp.sin = rope_sin_.as<float>();
    rp.tok = st;
    rp.n_q_heads = Hq;
    rp.n_kv_heads = Hkv;
    rp.head_dim = D;
    rp.rope_style = c.rope.style == RopeStyle::kHalfSplit ? 0 : 1;
    rp.q_out = qh_.as<float>();
    rp.k_out = kh_.data();
    rp.v_out = vh_.data();
    rp.kv_t = opts_.kv_dtype;
    cuda::qkv_rope(rp, stream_);

    // Attention per sequence over its own cache.
    for (size_t i = 0; i < chunks.size(); ++i) {
      Sequence& s = seqs_.at(chunks[i].seq);
      const int64_t n = static_cast<int64_t>(chunks[i].tokens.size()), t0 = chunk_start[i];
      char* kb = static_cast<char*>(kh_.data()) + static_cast<size_t>(t0 * Hkv * D) * kv_es;
      char* vb = static_cast<char*>(vh_.data()) + static_cast<size_t>(t0 * Hkv * D) * kv_es;
      float* qb = qh_.as<float>() + t0 * Hq * D;
      float* ob = attn_.as<float>() + t0 * Hq * D;
      const TensorView kv_k = TensorView::contiguous(kb, opts_.kv_dtype, 1, Hkv, n, D);
      const TensorView kv_v = TensorView::contiguous(vb, opts_.kv_dtype, 1, Hkv, n, D);
      const TensorView qv = TensorView::contiguous(qb, DType::kF32, 1, Hq, n, D);
      cuda::DeviceUpdateOptions uo;
      uo.queries = &qv;
      mark(kPhCache);
      const cuda::DeviceCacheView view =
          s.caches[static_cast<size_t>(li)]->update_and_fetch(kv_k, kv_v, uo);
      ap.q_pos0 = s.offset;
      mark(kPhAttn);
      if (n == 1)
        decode(s, view, ap, qb, ob);
      else
        cuda::prefill_attention(qb, Hq, n, view, ap, ob, stream_);
    }
    mark(kPhOProj);
    cuda::heads_to_tokens(attn_.as<float>(), st, Hq, D, op_.data(), L.o.t, stream_);
    blas_->gemm(L.o.w, L.o.t, L.o.out, L.o.in, op_.data(), T, h);
    cuda::add_bias(h, L.o.bias_ptr(), T, Hd, stream_);

    mark(kPhNorm);
    an.add = h;
    an.weight = L.mlp_norm.as<float>();
    an.out_t = L.gate_up_t;
    cuda::add_rmsnorm(an, stream_);
    mark(kPhMlp);
    // one product over the fused gate|up rows: [T, 2I] fp32
    blas_->gemm(L.gate.w, L.gate.t, 2 * I, L.gate.in, op_.data(), T, gu_.as<float>());
    cuda::swiglu(gu_.as<float>(), gu_.as<float>() + I, L.gate.bias_ptr(), L.up.bias_ptr(), T, I,
                 op_.data(), L.down.t, stream_, 2 * I);
    blas_->gemm(L.down.w, L.down.t, L.down.out, L.down.in, op_.data(), T, h);
    cuda::add_bias(h, L.down.bias_ptr(), T, Hd, stream_);
  }

  for (size_t i = 0; i < chunks.size(); ++i) {
    Sequence& s = seqs_.at(chunks[i].seq);
    s.offset += static_cast<int64_t>(chunks[i].tokens.size());
    if (chunks[i].end_prompt)
      for (auto& cache : s.caches) cache->end_prompt();
  }
  sample_memory();
  if (n_out == 0) {
    if (tokens) tokens->clear();
    finish_timing(chunks, T);
    return;
  }

  // The last layer's MLP output joins the residual on the logit rows only, then the final norm
  // and lm_head over those rows.
  mark(kPhLogits);
  cuda::AddNormParams an;
  an.x = x;
  an.add = c.n_layers > 0 ? h : nullptr;
  an.rows = d_ints + 4 * T;
  an.n_rows = n_out;
  an.hidden = Hd;
  an.weight = final_norm_.as<float>();
  an.eps = c.rms_norm_eps;
  an.out = op_.data();
  an.out_t = lm_head_.t;
  cuda::add_rmsnorm(an, stream_);
  blas_->gemm(lm_head_.w, lm_head_.t, lm_head_.out, lm_head_.in, op_.data(), n_out,
              logits_.as<float>());
  mark(kPhToHost);
  if (tokens) {
    if (greedy_.size() < static_cast<size_t>(n_out) * 4) greedy_ = DeviceBuffer(n_out * 4);
    cuda::argmax_rows(logits_.as<float>(), n_out, c.vocab_size, n_vocab, greedy_.as<int32_t>(),
                      stream_);
    tokens->resize(static_cast<size_t>(n_out));
    cuda::copy_to_host(tokens->data(), greedy_.data(), tokens->size() * 4, stream_);
  } else if (logits) {
    logits->resize(static_cast<size_t>(n_out * c.vocab_size));
    cuda::copy_to_host(logits->data(), logits_.data(), logits->size() * 4, stream_);
  } else {
    cuda::synchronize(stream_);
  }
  finish_timing(chunks, T);
}

void CudaEngine::finish_timing(std::span<const SeqChunk> chunks, int64_t n_tokens) {
  if (!opts_.time_phases) return;
  const int kind = n_tokens == static_cast<int64_t>(chunks.size()) ? 1 : 0;
  phases_.mark(kPhCount, stream_);  // the end of the last phase
  phases_.collect(&phase_gpu_ms_[kind], &phase_host_ms_[kind]);
  phase_gpu_ms_[kind].resize(kPhCount, 0.0);
  phase_host_ms_[kind].resize(kPhCount, 0.0);
  ++steps_[kind];
}

}  // namespace

std::unique_ptr<Engine> make_cuda_engine(const Model& model, const EngineOptions& opts) {
  VQ_CHECK(cuda::is_available(),
           "[engine] device cuda: expected a CUDA device but none was found (no device or no "
           "driver); use --device cpu");
  check_cuda_tensor_parallel(model.config(), opts.tensor_parallel, cuda::device_count(),
                             cuda::has_nccl());
  return std::make_unique<CudaEngine>(model, opts);
}

}  // namespace vq
