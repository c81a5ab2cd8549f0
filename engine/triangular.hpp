// Inverse of unit lower-triangular matrices: the chunked Gated DeltaNet rule's per-chunk
// system (I + L)^-1, on the CPU.
//
// Standard library only, like the rest of the engine. The chunk systems are many small
// matrices (C <= 64; a 16-row batch of 60-token prompts has 64 of them per layer), where a
// batched-GEMM block inversion spends its time in per-matrix overhead and a LAPACK solve in
// per-call overhead; this runs the forward substitution itself, 16 matrices at a time.
#pragma once

#include <cstdint>

namespace fastjudge {

// out[m] = (I + L_m)^-1 for L_m the strictly lower triangle of system[m], m < n: n contiguous
// row-major C x C float32 matrices in and out (the diagonal and upper triangle of system are
// never read; out holds ones on its diagonal and zeros above). Row by row, each entry is
// X[i][j] = -L[i][j] - sum_{j < k < i} L[i][k] X[k][j], summed in increasing k: the recurrence
// of the reference implementation's row loop. threads > 1 splits the matrices among that
// many threads when there are enough of them. Throws std::invalid_argument on a negative n or
// C, or C over kMaxUnitLowerSize.
void unit_lower_inverse(const float* system, float* out, int64_t n, int64_t C, int threads);

// The largest C taken: scratch grows with C^2, and the delta rule's chunks are at most 64.
constexpr int64_t kMaxUnitLowerSize = 256;

}  // namespace fastjudge
