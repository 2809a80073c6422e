// CPU kernels of the forward pass (private to the runtime; tests include it from src/).
//
// matmul computes Y[T, N] = X[T, K] . W[N, K]^T (+ bias[N]) with X fp32 (row stride ldx), W
// row-major in fp32, fp16 or bf16 read in place (never converted as a whole), Y fp32 (row stride
// ldy). The optimised version (AVX-512 when compiled for it, else a portable loop) uses dot-
// product register tiles for a few tokens and packed-panel outer products for many (see
// kernels.cpp), and splits the output rows over OpenMP threads. matmul_reference is the scalar
// oracle (products of fp32 values, double accumulation).
#pragma once

#include <cstdint>

#include "veloxquant/dtype.h"

namespace vq::kernels {

// One output of matmul_multi: y[T, n] (row stride ldy) = X . W[n, K]^T (+ bias[n]).
struct MatmulOut {
  const void* w = nullptr;
  DType dtype = DType::kF32;
  int64_t n = 0;
  const float* bias = nullptr;
  float* y = nullptr;
  int64_t ldy = 0;
};

// Several products of the same X in one parallel region (q/k/v, gate/up): one fork/join
// instead of one per product, which matters for single-token decode.
void matmul_multi(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const MatmulOut* outs,
                  int n_outs);

void matmul(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w, DType w_dtype,
            int64_t n, const float* bias, float* y, int64_t ldy);

void matmul_reference(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w,
                      DType w_dtype, int64_t n, const float* bias, float* y, int64_t ldy);

// out[i] = x[i] / sqrt(mean(x^2) + eps) * weight[i], sum of squares in double.
void rmsnorm(const float* x, const float* weight, int64_t n, double eps, float* out);

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)); out may alias gate. AVX-512
// builds evaluate it as g / (1 + e) or g e / (1 + e) with e = exp(-|g|) from a polynomial
// (<= 1.41 u), within 3.5 u of the exact value (u = 2^-24).
void swiglu(const float* gate, const float* up, int64_t n, float* out);

}  // namespace vq::kernels
