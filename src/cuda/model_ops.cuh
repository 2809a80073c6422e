// The model forward's own device ops (the CUDA engine, src/model/engine_cuda.cpp): embedding
// gather, RMSNorm fused with the residual add, q/k/v bias + RoPE + head-major layout, the
// attention output back to token-major, SwiGLU, bias add, head gather/scatter for decode
// sub-groups, and the matrix products through cuBLAS (no home-made GEMM). Host launchers only
// (the kernels are static in model_ops.cu); without VQ_CUDA every entry point throws
// (src/cuda/no_cuda.cpp). Work is queued on the caller's stream.
//
// Layouts of one engine step of T tokens made of chunks (one chunk per sequence):
// - token-major activations [T, n] (row t = token t of the step, chunks one after another);
// - head-major per chunk: chunk c (tokens start_c .. start_c + len_c - 1) holds [H, len_c, D]
//   at element start_c * H * D, i.e. exactly the [1, H, S, D] tensor of that sequence.
// dtypes are vq::DType: operands of the products f32 / f16 / bf16, everything else fp32.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/counters.h"
#include "veloxquant/cuda.h"
#include "veloxquant/dtype.h"

namespace vq::cuda {

// Per-token bookkeeping of a step: device int32 arrays [T].
struct StepTokens {
  const int32_t* pos = nullptr;    // position of token t (row of the RoPE tables)
  const int32_t* start = nullptr;  // first token of t's chunk
  const int32_t* len = nullptr;    // tokens of t's chunk
  int64_t n_tokens = 0;
};

// x[t, :] = fp32(table[tokens[t], :]): tokens device [T], table device [vocab, hidden] of dtype
// table_t (f32 / f16 / bf16, widening exact), x device [T, hidden] fp32.
void embed_rows(const int32_t* tokens, int64_t n_tokens, const void* table, DType table_t,
                int64_t hidden, float* x, Stream s);

// Residual add fused with RMSNorm, row r of the output from row i = rows ? rows[r] : r:
// x[i] += add[i] (when add), then out[r] = weight * (x[i] * inv), inv = fp32(1 / sqrt(mean(x[i]^2)
// + eps)) with the squares summed in double (kernels::rmsnorm's arithmetic), rounded to out_t.
struct AddNormParams {
  float* x = nullptr;             // device [*, hidden] fp32, updated in place
  const float* add = nullptr;     // device [*, hidden] fp32 or nullptr
  const int32_t* rows = nullptr;  // device [n_rows] or nullptr (identity)
  int64_t n_rows = 0, hidden = 0;
  const float* weight = nullptr;  // device [hidden]
  double eps = 1e-6;
  void* out = nullptr;  // device [n_rows, hidden] of out_t
  DType out_t = DType::kF32;
};
void add_rmsnorm(const AddNormParams& p, Stream s);

// q/k/v products (+ bias) -> RoPE at each token's position -> head-major per chunk. q_out fp32;
// k_out / v_out in kv_t (rounded to nearest even). RoPE pairs (i, i + D/2) (rope_style 0,
// RopeStyle::kHalfSplit) or (2i, 2i + 1) (1, kInterleaved) with the host's fp32 cos/sin tables,
// the same fp32 operations as vq::apply_rope.
struct QkvRopeParams {
  const float* q = nullptr;  // device [T, H_q * D] (rows row_stride apart)
  const float* k = nullptr;  // device [T, H_kv * D]
  const float* v = nullptr;  // device [T, H_kv * D]
  // Elements between consecutive token rows of q, k and v: 0 = each its own contiguous matrix;
  // (H_q + 2 H_kv) D when they are the column blocks of one fused q|k|v product.
  int64_t row_stride = 0;
  const float* q_bias = nullptr;  // device [H_q * D] or nullptr
  const float* k_bias = nullptr;  // device [H_kv * D] or nullptr
  const float* v_bias = nullptr;  // device [H_kv * D] or nullptr
  const float* cos = nullptr;     // device [positions, D / 2]
  const float* sin = nullptr;     // device [positions, D / 2]
  StepTokens tok;
  int64_t n_q_heads = 0, n_kv_heads = 0, head_dim = 0;
  int rope_style = 0;
  float* q_out = nullptr;  // device, per chunk [H_q, S, D]
  void* k_out = nullptr;   // device, per chunk [H_kv, S, D] of kv_t
  void* v_out = nullptr;
  DType kv_t = DType::kF16;
};
void qkv_rope(const QkvRopeParams& p, Stream s);

// attn device per chunk [H, S, D] fp32 -> out device [T, H * D] of out_t.
void heads_to_tokens(const float* attn, const StepTokens& tok, int64_t n_heads, int64_t head_dim,
                     void* out, DType out_t, Stream s);

// out[t, i] = silu(g) * u with g = gate[t, i] (+ gate_bias[i]), u = up[t, i] (+ up_bias[i]),
// silu(g) = g / (1 + exp(-g)) in fp32, rounded to out_t. gate, up device [T, n] fp32 with rows
// in_stride elements apart (0 = n; 2n for the column blocks of one fused gate|up product); out
// [T, n] contiguous.
void swiglu(const float* gate, const float* up, const float* gate_bias, const float* up_bias,
            int64_t n_tokens, int64_t n, void* out, DType out_t, Stream s, int64_t in_stride = 0);

// y[t, i] += bias[i]: y device [n_tokens, n] fp32.
void add_bias(float* y, const float* bias, int64_t n_tokens, int64_t n, Stream s);

// cuBLAS on one stream. gemm: y[n_tokens, out] fp32 = x[n_tokens, in] . w[out, in]^T, x and w of
// dtype t (both f16, both bf16 or both f32), fp32 accumulation (CUBLAS_COMPUTE_32F: no TF32, no
// reduced-precision reduction).
class Blas {
 public:
  explicit Blas(Stream s);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  void gemm(const void* w, DType t, int64_t out, int64_t in, const void* x, int64_t n_tokens,
            float* y);

 private:
  void* handle_ = nullptr;
};

// Greedy choice per row on the device (Engine::step_greedy): out[r] = the argmax of
// logits[r, 0 .. n_vocab) with vq::argmax's rule (generate.h: NaN counts as -inf, ties go to the
// lower id), or -1 when none of logits[r, 0 .. vocab) is finite. logits device [n_rows, vocab]
// fp32, out device [n_rows] int32. Exact (comparisons only).
void argmax_rows(const float* logits, int64_t n_rows, int64_t vocab, int64_t n_vocab, int32_t* out,
                 Stream s);

// out[i] = (u - 0.5) 2 sqrt(3), u = the top 24 bits of splitmix64(seed + i) / 2^24: uniform on
// [-sqrt 3, sqrt 3) (unit variance), rounded to t (Engine::fill_synthetic's values).
void fill_uniform(void* out, DType t, int64_t n, uint64_t seed, Stream s);

// Stream synchronisations, cudaMalloc and cudaFree calls of the backend (src/cuda/counters.h).
struct PhaseCounts {
  int64_t syncs = 0, mallocs = 0, frees = 0;
};

// Phase timing (the engine's EngineOptions::time_phases): mark(phase, s) records a CUDA event on
// s (and the host clock, and the runtime call counts) where `phase` begins; collect() waits for
// the last mark and adds, for each mark but the last, the device and host milliseconds up to the
// next mark into gpu_ms[phase] / host_ms[phase] (and the calls made meanwhile into
// counts[phase], when given), then forgets the marks. Events are pooled and reused.
class PhaseEvents {
 public:
  PhaseEvents() = default;
  ~PhaseEvents();
  PhaseEvents(const PhaseEvents&) = delete;
  PhaseEvents& operator=(const PhaseEvents&) = delete;
  void mark(int phase, Stream s);
  void collect(std::vector<double>* gpu_ms, std::vector<double>* host_ms,
               std::vector<PhaseCounts>* counts = nullptr);

 private:
  std::vector<void*> events_;  // cudaEvent_t, pooled
  std::vector<int> phases_;
  std::vector<double> host_s_;  // steady clock seconds at each mark
  std::vector<detail::RuntimeCounts> counts_;
  size_t used_ = 0;
};

// A new non-blocking stream, and its destruction (nullptr: nothing).
Stream create_stream();
void destroy_stream(Stream s);
// Asynchronous copies on s (host memory pageable: the call returns once it is staged).
void copy_to_device(void* dst, const void* src, size_t bytes, Stream s);
// Copies device -> host and waits for s.
void copy_to_host(void* dst, const void* src, size_t bytes, Stream s);
// cudaMemGetInfo of the current device.
void device_memory(size_t* free_bytes, size_t* total_bytes);
// Copy bandwidth of the current device: the best of a few device-to-device copies of `bytes`
// (two fresh buffers, timed with events on s), as read + write bytes per second (2 x bytes /
// seconds), the measure Engine::host_copy_bandwidth gives for the host.
double device_copy_bandwidth(int64_t bytes, Stream s);

}  // namespace vq::cuda
