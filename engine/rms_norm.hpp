// RMSNorm of rows on the CPU, each in one pass: out = (x / sqrt(mean(x^2) + eps)) * weight, in
// float32 (x read as float32, the product rounded once to x's type), what torch's RMSNorm on the
// CPU computes with one op a step (mean of squares, add, rsqrt, two products); a decoding step's
// norms are a dozen of those ops each otherwise.
#pragma once

#include <cstdint>

namespace fastjudge {

// x [N, H, D]: row (n, h) at n * row_stride + h * head_stride, contiguous within; weight [H, D]
// (H = 1: one weight for every row) float32; out [N, H, D] C-contiguous. T float or uint16_t
// (bfloat16 bits). round_first: x / sqrt(mean(x^2) + eps) rounded to T before it is multiplied by
// the weight and rounded again, as T5's layer norm computes (transformers' T5LayerNorm casts the
// normalised states to the weight's dtype, then multiplies); else one rounding, as Qwen's norms.
template <typename T>
void rms_norm(const T* x, int64_t row_stride, int64_t head_stride, const float* weight, T* out, int64_t N,
              int64_t H, int64_t D, float eps, int threads, bool round_first = false);

}  // namespace fastjudge
