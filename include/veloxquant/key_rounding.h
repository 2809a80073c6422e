// Query-weighted rounding of channel-axis key rows (skvq_query_moments_file, docs/design.md §C4).
//
// A key row k is stored as codes c_i on fixed per-channel grids (lo_i, s_i) (the chunk's clip
// search, group_quant.h). Rounding each channel to nearest minimises |k - k^| channel by channel;
// what attention sees is the logit error q . (k - k^), whose mean square over the queries of the
// head is e^T M e with M = E[q q^T] (the head's query second moments, e = k - k^). Error feedback
// (the GPTQ order of operations, applied to one key row instead of a weight row) chooses the
// codes channel by channel and moves each channel's rounding error onto the channels not yet
// rounded, in the proportions that make that quadratic form small:
//   U = the upper Cholesky factor of A^-1, A = M + damp * mean(diag M) * I   (U^T U = A^-1)
//   w = k (fp64); for i = 0 .. d-1:
//     c_i = clamp(nearbyint((w_i - lo_i) / s_i), 0, levels)
//     e   = (w_i - (c_i s_i + lo_i)) / U_ii
//     w_j -= e U_ij for every j > i
// in fp64 (round to nearest even), a channel whose (w_i - lo_i) / s_i is not finite keeping its
// round-to-nearest code and feeding back nothing. With M a multiple of I (no preferred query
// direction) U is diagonal and the codes are the round-to-nearest ones. The metadata never
// changes: only which of the grid's levels each code takes.
#pragma once

#include <cstdint>
#include <vector>

namespace vq {

// The damping of A above (GPTQ's default): keeps A well conditioned where a head's queries span
// few directions.
inline constexpr double kKeyRoundingDamp = 0.01;

// U (d x d row-major, upper triangular) for the moments m (d x d, symmetric). Throws vq::Error
// when an entry is not finite, a diagonal entry is <= 0, or A is not positive definite.
std::vector<double> key_rounding_factor(const double* m, int64_t d, double damp = kKeyRoundingDamp);

// The moments of head vectors in the stored channel order: m' = P R m R^T P^T for the rotation
// R = hadamard_rotate with signs (nullptr: none) and the permutation P (stored j = channel
// perm[j]; nullptr: none). R is built by rotating the unit vectors in fp32 (its entries
// +-2^-k/2 rounded once), the products in fp64.
std::vector<double> stored_order_moments(const double* m, int64_t d, const float* signs,
                                         int64_t rot_block, const int32_t* perm);

// The codes of a chunk of n key rows (x [n, d], stored channel order) by the feedback above on
// the per-channel grids lo[d], scale[d] (as stored), with `levels` the largest code; codes_t
// [d, n] (channel-major) holds the round-to-nearest codes on entry and the feedback ones on
// return.
void key_feedback_codes(const float* x, int64_t n, int64_t d, const float* lo, const float* scale,
                        int levels, const double* u, uint8_t* codes_t);

}  // namespace vq
