// CPU kernels of the forward pass (private to the runtime; tests include it from src/).
//
// matmul computes Y[T, N] = X[T, K] . W[N, K]^T (+ bias[N]) with X fp32 (row stride ldx), W
// row-major in fp32, fp16 or bf16 read in place (never converted as a whole), Y fp32 (row stride
// ldy). The optimised version (AVX-512 when compiled for it, else a portable loop) tiles 4 weight
// rows x 4 tokens in registers, blocks tokens so a block of X stays in L2 while every weight row
// is read once per block, and splits the output rows over OpenMP threads. matmul_reference is
// the scalar oracle (products of fp32 values, double accumulation).
#pragma once

#include <cstdint>

#include "veloxquant/dtype.h"

namespace vq::kernels {

void matmul(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w, DType w_dtype,
            int64_t n, const float* bias, float* y, int64_t ldy);

void matmul_reference(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w,
                      DType w_dtype, int64_t n, const float* bias, float* y, int64_t ldy);

// out[i] = x[i] / sqrt(mean(x^2) + eps) * weight[i], sum of squares in double.
void rmsnorm(const float* x, const float* weight, int64_t n, double eps, float* out);

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)).
void swiglu(const float* gate, const float* up, int64_t n, float* out);

}  // namespace vq::kernels
