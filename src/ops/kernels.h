// CPU kernels of the forward pass (private to the runtime; tests include it from src/).
//
// matmul computes Y[T, N] = X[T, K] . W[N, K]^T (+ bias[N]) with X fp32 (row stride ldx), W
// row-major in fp32, fp16 or bf16 read in place (never converted as a whole), Y fp32 (row stride
// ldy). The optimised versions (AVX-512 when compiled for it, else AVX2 where the CPU has it,
// else a portable loop) use dot-product register tiles for a few tokens and packed-panel outer
// products for many (see kernels.cpp), and split the output rows over the worker pool.
// matmul_reference is the scalar oracle (products of fp32 values, double accumulation).
//
// Precision::kBF16 (opt-in; ForwardOptions::matmul) changes the arithmetic of products with bf16
// weights only: X is rounded to bf16 (round to nearest even, as vcvtne2ps2bf16: NaN stays a
// quiet NaN, fp32 subnormals become signed zeros) and the bf16 x bf16 products (exact in fp32)
// are summed in fp32, with vdpbf16ps where the CPU has avx512_bf16 (runtime check) and else by
// the exact kernels run on the rounded X (same products, fp32 sums). fp32/fp16 weights always
// take the exact path. matmul_bf16_reference is its scalar oracle (rounded X, double sums).
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

enum class Precision : uint8_t { kExact, kBF16 };

// Several products of the same X in one parallel region (q/k/v, gate/up): one fork/join
// instead of one per product, which matters for single-token decode.
void matmul_multi(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const MatmulOut* outs,
                  int n_outs, Precision prec = Precision::kExact);

void matmul(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w, DType w_dtype,
            int64_t n, const float* bias, float* y, int64_t ldy,
            Precision prec = Precision::kExact);

void matmul_reference(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w,
                      DType w_dtype, int64_t n, const float* bias, float* y, int64_t ldy);

// y = bf16(X) . W^T (+ bias): X rounded by bf16_round, products and sums in double.
void matmul_bf16_reference(const float* x, int64_t n_tokens, int64_t k, int64_t ldx, const void* w,
                           DType w_dtype, int64_t n, const float* bias, float* y, int64_t ldy);

// fp32 -> bf16 bits as vcvtne2ps2bf16: round to nearest even; NaN -> quiet NaN (sign and top
// payload kept); zero and subnormal inputs -> signed zero; +-inf kept.
uint16_t bf16_round(float x);
// out[i] = bf16_round(x[i]); the vector instruction where the CPU has it.
void round_to_bf16(const float* x, int64_t n, uint16_t* out);

// Instruction sets of matmul's kernels, in increasing order. matmul_isa() is the best this build
// and CPU have (kAvx512 in builds compiled for AVX-512; kAvx2 chosen at run time, matmul_avx2.h;
// else the portable loop) unless cap_matmul_isa lowered it (tests compare the paths; a cap above
// the best changes nothing; process-wide). Every set obeys the exact-mode bound in kernels.cpp.
enum class MatmulIsa : uint8_t { kPortable, kAvx2, kAvx512 };
MatmulIsa matmul_isa();
void cap_matmul_isa(MatmulIsa cap);
const char* matmul_isa_name(MatmulIsa isa);

// Whether kBF16 runs vdpbf16ps (the CPU has avx512_bf16, the build has AVX-512, matmul_isa() is
// kAvx512, and the portable path is not forced). force_portable_bf16(true) makes kBF16 take the
// portable path (tests).
bool bf16_dot_active();
void force_portable_bf16(bool on);

// out[i] = x[i] / sqrt(mean(x^2) + eps) * weight[i], sum of squares in double.
void rmsnorm(const float* x, const float* weight, int64_t n, double eps, float* out);

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)); out may alias gate. AVX-512
// builds evaluate it as g / (1 + e) or g e / (1 + e) with e = exp(-|g|) from a polynomial
// (<= 1.41 u), within 3.5 u of the exact value (u = 2^-24).
void swiglu(const float* gate, const float* up, int64_t n, float* out);

}  // namespace vq::kernels
