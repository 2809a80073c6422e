// Walsh-Hadamard rotation of head vectors: a fast in-place normalised transform (O(D log D)) and
// the seeded random sign vector that makes it a random orthonormal rotation.
//
// x: one row of D fp32 channels. A head_dim that is not a power of two is transformed in blocks:
// the block size is the largest power of two dividing D (D = 96 -> three blocks of 32), each block
// normalised by 1/sqrt(block), so the whole map stays orthonormal (block diagonal). Odd D would
// give blocks of 1 (a bare sign flip); callers that need real mixing refuse it.
// Rotation R = H_norm * diag(signs): rotate(x) = H_norm(signs .* x); R^T: unrotate(y) =
// signs .* H_norm(y) (H_norm is symmetric and its own inverse).
#pragma once

#include <cstdint>
#include <vector>

namespace vq {

// Largest power of two dividing d (d >= 1).
int64_t hadamard_block(int64_t d);

// In place: every block of `block` consecutive values becomes H_block * x / sqrt(block).
// block must be a power of two dividing d.
void fwht_normalized(float* x, int64_t d, int64_t block);

// x <- R x and x <- R^T x with R = H_norm diag(signs); signs: [d] of +-1.
void hadamard_rotate(float* x, const float* signs, int64_t d, int64_t block);
void hadamard_unrotate(float* x, const float* signs, int64_t d, int64_t block);

// n values of +-1, deterministic for seed (splitmix64 stream, one bit per value).
std::vector<float> hadamard_signs(uint64_t seed, int64_t n);

// Dense reference matrix of R (row-major d x d, double), built from the Sylvester definition
// H[i][j] = (-1)^popcount(i & j) / sqrt(block) per block: the oracle for the fast transform.
std::vector<double> hadamard_matrix_reference(int64_t d, int64_t block, const float* signs);

}  // namespace vq
