// Kernels and launchers of model_ops.cuh (the CUDA engine's forward ops) and its cuBLAS wrapper.
// Elementwise kernels run one thread per element (grid-stride loops); the RMSNorm runs one block
// per row with the squares summed in double, as kernels::rmsnorm does. RoPE and the residual adds
// use __fmul_rn / __fadd_rn so nvcc never contracts them into FMAs: the rotation is the same
// fp32 arithmetic as vq::apply_rope, term by term. Output dtypes are picked at run time (a
// uniform branch per store): f32, f16 or bf16, rounded to nearest even.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <string>

#include "cuda/check.h"
#include "cuda/model_ops.cuh"

namespace vq::cuda {

namespace {

constexpr int kF32 = static_cast<int>(DType::kF32);
constexpr int kF16 = static_cast<int>(DType::kF16);

__device__ __forceinline__ float load_f32(const void* base, int64_t i, int dt) {
  if (dt == kF32) return static_cast<const float*>(base)[i];
  if (dt == kF16) return __half2float(static_cast<const __half*>(base)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
}

__device__ __forceinline__ void store_f32(void* base, int64_t i, float v, int dt) {
  if (dt == kF32)
    static_cast<float*>(base)[i] = v;
  else if (dt == kF16)
    static_cast<__half*>(base)[i] = __float2half_rn(v);
  else
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
}

unsigned grid_for(int64_t total) {
  const int64_t blocks = (total + 255) / 256;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

#define VQ_GRID_STRIDE(e, total)                                                             \
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < (total); \
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)

__global__ void embed_rows_kernel(const int32_t* tokens, int64_t n_tokens, const void* table,
                                  int dt, int64_t hidden, float* x) {
  VQ_GRID_STRIDE(e, n_tokens * hidden) {
    const int64_t t = e / hidden, i = e % hidden;
    x[e] = load_f32(table, static_cast<int64_t>(tokens[t]) * hidden + i, dt);
  }
}

// One block of 256 threads per output row. Each thread takes the row's elements j = tid, tid +
// 256, ... in that order (the sum order, and so the result, is fixed by the block size), kU of
// them per round: all of a round's loads are issued before its stores (restrict pointers: x, add,
// weight and out are distinct buffers), so a thread waits for memory once per round instead of
// once per element.
__global__ void __launch_bounds__(256) add_rmsnorm_kernel(AddNormParams p, int out_dt) {
  constexpr int kU = 8;
  const int64_t r = blockIdx.x, n = p.hidden, step = blockDim.x;
  const int64_t i = p.rows ? p.rows[r] : r;
  float* __restrict__ x = p.x + i * n;
  const float* __restrict__ add = p.add ? p.add + i * n : nullptr;
  const float* __restrict__ weight = p.weight;
  double ss = 0.0;
  for (int64_t j0 = threadIdx.x; j0 < n; j0 += kU * step) {
    float v[kU], a[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t j = j0 + u * step;
      v[u] = j < n ? x[j] : 0.0f;
      a[u] = add && j < n ? add[j] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t j = j0 + u * step;
      if (j >= n) break;
      if (add) {
        v[u] = __fadd_rn(v[u], a[u]);
        x[j] = v[u];
      }
      ss += static_cast<double>(v[u]) * v[u];
    }
  }
  // Block sum: warp shuffles, then one partial per warp in shared memory.
  __shared__ double part[32];
  __shared__ float inv_s;
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_down_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double tot = 0.0;
    for (unsigned w = 0; w < (blockDim.x + 31) / 32; ++w) tot += part[w];
    inv_s = static_cast<float>(1.0 / sqrt(tot / static_cast<double>(n) + p.eps));
  }
  __syncthreads();
  const float inv = inv_s;
  for (int64_t j0 = threadIdx.x; j0 < n; j0 += kU * step) {
    float v[kU], wv[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t j = j0 + u * step;
      v[u] = j < n ? x[j] : 0.0f;
      wv[u] = j < n ? weight[j] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t j = j0 + u * step;
      if (j >= n) break;
      store_f32(p.out, r * n + j, __fmul_rn(wv[u], __fmul_rn(v[u], inv)), out_dt);
    }
  }
}

// One thread per (token, head, rotation pair); heads [0, H_q) are q, then H_kv of k, then H_kv
// of v (v is only laid out head-major, not rotated).
__global__ void qkv_rope_kernel(QkvRopeParams p, int kv_dt) {
  const int64_t D = p.head_dim, half = D / 2;
  const int64_t Hq = p.n_q_heads, Hkv = p.n_kv_heads, H_all = Hq + 2 * Hkv;
  VQ_GRID_STRIDE(e, p.tok.n_tokens * H_all * half) {
    const int64_t i = e % half;
    const int64_t hh = (e / half) % H_all;
    const int64_t t = e / (half * H_all);
    const int64_t i1 = p.rope_style == 0 ? i : 2 * i;
    const int64_t i2 = p.rope_style == 0 ? i + half : 2 * i + 1;
    const float* src;
    const float* bias;
    int64_t h, H;
    if (hh < Hq) {
      src = p.q, bias = p.q_bias, h = hh, H = Hq;
    } else if (hh < Hq + Hkv) {
      src = p.k, bias = p.k_bias, h = hh - Hq, H = Hkv;
    } else {
      src = p.v, bias = p.v_bias, h = hh - Hq - Hkv, H = Hkv;
    }
    const int64_t src_row = p.row_stride > 0 ? t * p.row_stride + h * D : (t * H + h) * D;
    float a = src[src_row + i1], b = src[src_row + i2];
    if (bias) {
      a = __fadd_rn(a, bias[h * D + i1]);
      b = __fadd_rn(b, bias[h * D + i2]);
    }
    if (hh < Hq + Hkv) {
      const int64_t pos = p.tok.pos[t];
      const float c = p.cos[pos * half + i], sn = p.sin[pos * half + i];
      const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sn));
      const float rb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sn));
      a = ra, b = rb;
    }
    const int64_t start = p.tok.start[t], len = p.tok.len[t];
    const int64_t row = (start * H + h * len + (t - start)) * D;
    if (hh < Hq) {
      p.q_out[row + i1] = a;
      p.q_out[row + i2] = b;
    } else {
      void* dst = hh < Hq + Hkv ? p.k_out : p.v_out;
      store_f32(dst, row + i1, a, kv_dt);
      store_f32(dst, row + i2, b, kv_dt);
    }
  }
}

__global__ void heads_to_tokens_kernel(const float* attn, StepTokens tok, int64_t H, int64_t D,
                                       void* out, int out_dt) {
  VQ_GRID_STRIDE(e, tok.n_tokens * H * D) {
    const int64_t d = e % D, h = (e / D) % H, t = e / (D * H);
    const int64_t start = tok.start[t], len = tok.len[t];
    store_f32(out, e, attn[(start * H + h * len + (t - start)) * D + d], out_dt);
  }
}

__global__ void swiglu_kernel(const float* gate, const float* up, const float* gate_bias,
                              const float* up_bias, int64_t n_tokens, int64_t n, int64_t in_stride,
                              void* out, int out_dt) {
  VQ_GRID_STRIDE(e, n_tokens * n) {
    const int64_t in = (e / n) * in_stride + e % n;
    float g = gate[in], u = up[in];
    if (gate_bias) g = __fadd_rn(g, gate_bias[e % n]);
    if (up_bias) u = __fadd_rn(u, up_bias[e % n]);
    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
    store_f32(out, e, __fmul_rn(silu, u), out_dt);
  }
}

__global__ void add_bias_kernel(float* y, const float* bias, int64_t n_tokens, int64_t n) {
  VQ_GRID_STRIDE(e, n_tokens * n) y[e] = __fadd_rn(y[e], bias[e % n]);
}

// One block per row: each thread scans a strided slice keeping (value, id) with NaN as -inf and
// the lower id on ties, then a shared-memory tree reduction under the same rule; finite: any
// thread saw a finite logit anywhere in the row.
constexpr int kArgmaxThreads = 1024;
__global__ void argmax_rows_kernel(const float* logits, int64_t vocab, int64_t n_vocab,
                                   int32_t* out) {
  const float* row = logits + blockIdx.x * vocab;
  float best = -INFINITY;
  int64_t best_i = INT64_MAX;
  int finite = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float x = row[i];
    finite |= isfinite(x) ? 1 : 0;
    if (i >= n_vocab) continue;
    const float v = isnan(x) ? -INFINITY : x;
    if (v > best || (v == best && i < best_i)) best = v, best_i = i;
  }
  __shared__ float sv[kArgmaxThreads];
  __shared__ int64_t si[kArgmaxThreads];
  finite = __syncthreads_or(finite);
  sv[threadIdx.x] = best;
  si[threadIdx.x] = best_i;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      const float v = sv[threadIdx.x + w];
      const int64_t i = si[threadIdx.x + w];
      if (v > sv[threadIdx.x] || (v == sv[threadIdx.x] && i < si[threadIdx.x]))
        sv[threadIdx.x] = v, si[threadIdx.x] = i;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = finite ? static_cast<int32_t>(si[0]) : -1;
}

__global__ void fill_uniform_kernel(void* out, int dt, int64_t n, uint64_t seed) {
  VQ_GRID_STRIDE(e, n) {
    uint64_t z = seed + static_cast<uint64_t>(e) * 0x9E3779B97F4A7C15ull;  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
    store_f32(out, e, (u - 0.5f) * 3.4641016f, dt);
  }
}

// to_sub: dst[kv * sub + j] = src[kv * group + r * sub + j]; else the reverse.
cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      throw Error(std::string("[gemm] expected operands f32, f16 or bf16 but got ") +
                  dtype_name(t));
  }
}

void check_blas(cublasStatus_t st, const char* call) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("[gemm] expected ") + call + " to succeed but got status " +
                std::to_string(static_cast<int>(st)) + " (" + cublasGetStatusString(st) + ")");
}

}  // namespace

void embed_rows(const int32_t* tokens, int64_t n_tokens, const void* table, DType table_t,
                int64_t hidden, float* x, Stream s) {
  if (n_tokens * hidden <= 0) return;
  embed_rows_kernel<<<grid_for(n_tokens * hidden), 256, 0, detail::to_stream(s)>>>(
      tokens, n_tokens, table, static_cast<int>(table_t), hidden, x);
  VQ_CUDA_LAUNCH_CHECK("embed_rows");
}

void add_rmsnorm(const AddNormParams& p, Stream s) {
  if (p.n_rows <= 0) return;
  VQ_CHECK(p.n_rows <= INT_MAX,
           "[add_rmsnorm] expected at most 2^31 - 1 rows but got " + std::to_string(p.n_rows));
  add_rmsnorm_kernel<<<static_cast<unsigned>(p.n_rows), 256, 0, detail::to_stream(s)>>>(
      p, static_cast<int>(p.out_t));
  VQ_CUDA_LAUNCH_CHECK("add_rmsnorm");
}

void qkv_rope(const QkvRopeParams& p, Stream s) {
  const int64_t total = p.tok.n_tokens * (p.n_q_heads + 2 * p.n_kv_heads) * (p.head_dim / 2);
  if (total <= 0) return;
  qkv_rope_kernel<<<grid_for(total), 256, 0, detail::to_stream(s)>>>(p, static_cast<int>(p.kv_t));
  VQ_CUDA_LAUNCH_CHECK("qkv_rope");
}

void heads_to_tokens(const float* attn, const StepTokens& tok, int64_t n_heads, int64_t head_dim,
                     void* out, DType out_t, Stream s) {
  const int64_t total = tok.n_tokens * n_heads * head_dim;
  if (total <= 0) return;
  heads_to_tokens_kernel<<<grid_for(total), 256, 0, detail::to_stream(s)>>>(
      attn, tok, n_heads, head_dim, out, static_cast<int>(out_t));
  VQ_CUDA_LAUNCH_CHECK("heads_to_tokens");
}

void swiglu(const float* gate, const float* up, const float* gate_bias, const float* up_bias,
            int64_t n_tokens, int64_t n, void* out, DType out_t, Stream s, int64_t in_stride) {
  if (n_tokens * n <= 0) return;
  swiglu_kernel<<<grid_for(n_tokens * n), 256, 0, detail::to_stream(s)>>>(
      gate, up, gate_bias, up_bias, n_tokens, n, in_stride > 0 ? in_stride : n, out,
      static_cast<int>(out_t));
  VQ_CUDA_LAUNCH_CHECK("swiglu");
}

void add_bias(float* y, const float* bias, int64_t n_tokens, int64_t n, Stream s) {
  if (n_tokens * n <= 0 || !bias) return;
  add_bias_kernel<<<grid_for(n_tokens * n), 256, 0, detail::to_stream(s)>>>(y, bias, n_tokens, n);
  VQ_CUDA_LAUNCH_CHECK("add_bias");
}

Blas::Blas(Stream s) {
  cublasHandle_t h = nullptr;
  check_blas(cublasCreate(&h), "cublasCreate");
  handle_ = h;
  check_blas(cublasSetStream(h, detail::to_stream(s)), "cublasSetStream");
  // Pure fp32 accumulation: no TF32 for f32 operands, no reduced-precision split-K reductions.
  check_blas(cublasSetMathMode(
                 h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                              CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
             "cublasSetMathMode");
}

Blas::~Blas() {
  if (handle_) (void)cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

void Blas::gemm(const void* w, DType t, int64_t out, int64_t in, const void* x, int64_t n_tokens,
                float* y) {
  if (out <= 0 || n_tokens <= 0) return;
  VQ_CHECK(out <= INT_MAX && in <= INT_MAX && n_tokens <= INT_MAX,
           "[gemm] expected out, in and tokens below 2^31 but got " + std::to_string(out) + ", " +
               std::to_string(in) + ", " + std::to_string(n_tokens));
  const cudaDataType_t ab = cuda_type(t);
  const float alpha = 1.0f, beta = 0.0f;
  // Row-major y[T, out] = x[T, in] w[out, in]^T is column-major y^T[out, T] = w^T x^T, where the
  // row-major w is a column-major [in, out] matrix (transposed: op T) and x a [in, T] one.
  check_blas(
      cublasGemmEx(static_cast<cublasHandle_t>(handle_), CUBLAS_OP_T, CUBLAS_OP_N,
                   static_cast<int>(out), static_cast<int>(n_tokens), static_cast<int>(in), &alpha,
                   w, ab, static_cast<int>(in), x, ab, static_cast<int>(in), &beta, y, CUDA_R_32F,
                   static_cast<int>(out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

void argmax_rows(const float* logits, int64_t n_rows, int64_t vocab, int64_t n_vocab, int32_t* out,
                 Stream s) {
  if (n_rows <= 0) return;
  VQ_CHECK(n_vocab >= 1 && n_vocab <= vocab && vocab <= INT_MAX && n_rows <= INT_MAX,
           "[argmax_rows] expected 1 <= n_vocab <= vocab < 2^31 and rows < 2^31 but got n_vocab " +
               std::to_string(n_vocab) + ", vocab " + std::to_string(vocab) + ", rows " +
               std::to_string(n_rows));
  argmax_rows_kernel<<<static_cast<unsigned>(n_rows), kArgmaxThreads, 0, detail::to_stream(s)>>>(
      logits, vocab, n_vocab, out);
  VQ_CUDA_LAUNCH_CHECK("argmax_rows");
}

void fill_uniform(void* out, DType t, int64_t n, uint64_t seed, Stream s) {
  if (n <= 0) return;
  fill_uniform_kernel<<<grid_for(n), 256, 0, detail::to_stream(s)>>>(out, static_cast<int>(t), n,
                                                                     seed);
  VQ_CUDA_LAUNCH_CHECK("fill_uniform");
}

PhaseEvents::~PhaseEvents() {
  for (void* e : events_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

void PhaseEvents::mark(int phase, Stream s) {
  if (used_ == events_.size()) {
    cudaEvent_t e = nullptr;
    VQ_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  VQ_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(events_[used_]), detail::to_stream(s)));
  if (phases_.size() <= used_) {
    phases_.resize(used_ + 1);
    host_s_.resize(used_ + 1);
    counts_.resize(used_ + 1);
  }
  phases_[used_] = phase;
  host_s_[used_] =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  counts_[used_] = detail::runtime_counts();
  ++used_;
}

void PhaseEvents::collect(std::vector<double>* gpu_ms, std::vector<double>* host_ms,
                          std::vector<PhaseCounts>* counts) {
  if (used_ == 0) return;
  VQ_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(events_[used_ - 1])));
  for (size_t i = 0; i + 1 < used_; ++i) {
    float ms = 0.0f;
    VQ_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[i]),
                                       static_cast<cudaEvent_t>(events_[i + 1])));
    const size_t p = static_cast<size_t>(phases_[i]);
    if (gpu_ms->size() <= p) gpu_ms->resize(p + 1, 0.0);
    if (host_ms->size() <= p) host_ms->resize(p + 1, 0.0);
    (*gpu_ms)[p] += ms;
    (*host_ms)[p] += 1e3 * (host_s_[i + 1] - host_s_[i]);
    if (counts) {
      if (counts->size() <= p) counts->resize(p + 1);
      const detail::RuntimeCounts &a = counts_[i], &b = counts_[i + 1];
      (*counts)[p].syncs += b.syncs - a.syncs;
      (*counts)[p].mallocs += b.mallocs - a.mallocs;
      (*counts)[p].frees += b.frees - a.frees;
    }
  }
  used_ = 0;
}

Stream create_stream() {
  cudaStream_t st = nullptr;
  VQ_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  return st;
}

void destroy_stream(Stream s) {
  if (s) (void)cudaStreamDestroy(detail::to_stream(s));
}

void copy_to_device(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes == 0) return;
  VQ_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, detail::to_stream(s)));
}

void copy_to_host(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes == 0) return;
  VQ_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, detail::to_stream(s)));
  synchronize(s);
}

void device_memory(size_t* free_bytes, size_t* total_bytes) {
  VQ_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
}

double device_copy_bandwidth(int64_t bytes, Stream s) {
  VQ_CHECK(bytes > 0,
           "[device_copy_bandwidth] expected bytes > 0 but got " + std::to_string(bytes));
  const size_t n = static_cast<size_t>(bytes);
  void* a = nullptr;
  void* b = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  const cudaStream_t st = detail::to_stream(s);
  double best = 0.0;
  auto cleanup = [&] {
    if (e0) (void)cudaEventDestroy(e0);
    if (e1) (void)cudaEventDestroy(e1);
    if (a) (void)cudaFree(a);
    if (b) (void)cudaFree(b);
  };
  try {
    VQ_CUDA_CHECK(cudaMalloc(&a, n));
    VQ_CUDA_CHECK(cudaMalloc(&b, n));
    VQ_CUDA_CHECK(cudaMemsetAsync(a, 1, n, st));
    VQ_CUDA_CHECK(cudaEventCreate(&e0));
    VQ_CUDA_CHECK(cudaEventCreate(&e1));
    for (int rep = 0; rep < 6; ++rep) {  // the first one warms up
      VQ_CUDA_CHECK(cudaEventRecord(e0, st));
      VQ_CUDA_CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, st));
      VQ_CUDA_CHECK(cudaEventRecord(e1, st));
      VQ_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0.0f;
      VQ_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (rep > 0 && ms > 0.0f) best = std::max(best, 2.0 * static_cast<double>(n) / (ms * 1e-3));
    }
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  return best;
}

}  // namespace vq::cuda
