// Rotary position embedding of rows in the rotate-half pairing (element i of the first half with
// i + D / 2), in one pass: what the vision tower's queries and keys take before attention, as
// transformers computes it (x cos + rotate_half(x) sin in float32, back to x's type), where
// torch's ops take five passes over them.
#pragma once

#include <cstdint>

namespace fastjudge {

// x [N, H, D]: row (n, h) at n * row_stride + h * head_stride, contiguous within; cos and sin
// [P, D] float32, row n taking position n % P; out [N, H, D] C-contiguous. D even. Each output
// rounds its two products and their sum apart (the file is built without contraction), then
// once more to T. T float or uint16_t (bfloat16 bits).
template <typename T>
void rotate_halves(const T* x, int64_t row_stride, int64_t head_stride, const float* cos, const float* sin, T* out,
                   int64_t N, int64_t H, int64_t D, int64_t P, int threads);

}  // namespace fastjudge
