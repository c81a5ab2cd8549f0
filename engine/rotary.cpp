#include "rotary.hpp"

#include <algorithm>
#include <type_traits>

#include "cpu_parallel.hpp"
#include "vector_math.hpp"

namespace fastjudge {
namespace {

// One thread for each 64 Ki elements: below that a wake-up of the team costs more than its share.
constexpr int64_t kElementsPerThread = 1 << 16;

// rows [first, last) of N * H: first half x1 c - x2 s, second half x2 c + x1 s (c and s the
// position's values at each element's own index)
template <typename T>
__attribute__((always_inline)) inline void rotate_rows(const T* x, int64_t row_stride, int64_t head_stride,
                                                       const float* cos, const float* sin, T* out, int64_t H,
                                                       int64_t D, int64_t P, int64_t first, int64_t last) {
  const int64_t half = D / 2, full = half / kLanes * kLanes;
  for (int64_t row = first; row < last; ++row) {
    const int64_t n = row / H, h = row % H;
    const T* src = x + n * row_stride + h * head_stride;
    const float* c = cos + (n % P) * D;
    const float* s = sin + (n % P) * D;
    T* dst = out + row * D;
    for (int64_t j = 0; j < full; j += kLanes) {
      const Floats a = load_floats(src + j), b = load_floats(src + half + j);
      store_floats(dst + j, a * load(c + j) - b * load(s + j));
      store_floats(dst + half + j, b * load(c + half + j) + a * load(s + half + j));
    }
    for (int64_t j = full; j < half; ++j) {
      const float a = to_float(src[j]), b = to_float(src[half + j]);
      from_float(a * c[j] - b * s[j], dst + j);
      from_float(b * c[half + j] + a * s[half + j], dst + half + j);
    }
  }
}

FASTJUDGE_CLONES
void rotate_rows_f32(const float* x, int64_t row_stride, int64_t head_stride, const float* cos, const float* sin,
                     float* out, int64_t H, int64_t D, int64_t P, int64_t first, int64_t last) {
  rotate_rows(x, row_stride, head_stride, cos, sin, out, H, D, P, first, last);
}

FASTJUDGE_CLONES
void rotate_rows_bf16(const uint16_t* x, int64_t row_stride, int64_t head_stride, const float* cos, const float* sin,
                      uint16_t* out, int64_t H, int64_t D, int64_t P, int64_t first, int64_t last) {
  rotate_rows(x, row_stride, head_stride, cos, sin, out, H, D, P, first, last);
}

}  // namespace

template <typename T>
void rotate_halves(const T* x, int64_t row_stride, int64_t head_stride, const float* cos, const float* sin, T* out,
                   int64_t N, int64_t H, int64_t D, int64_t P, int threads) {
  const int64_t rows = N * H;
  if (rows == 0 || D == 0) return;
  const int64_t workers = std::min<int64_t>(threads, rows * D / kElementsPerThread + 1);
  parallel_ranges(rows, workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (std::is_same_v<T, float>) {
      rotate_rows_f32(x, row_stride, head_stride, cos, sin, out, H, D, P, first, last);
    } else {
      rotate_rows_bf16(x, row_stride, head_stride, cos, sin, out, H, D, P, first, last);
    }
  });
}

template void rotate_halves<float>(const float*, int64_t, int64_t, const float*, const float*, float*, int64_t,
                                   int64_t, int64_t, int64_t, int);
template void rotate_halves<uint16_t>(const uint16_t*, int64_t, int64_t, const float*, const float*, uint16_t*,
                                      int64_t, int64_t, int64_t, int64_t, int);

}  // namespace fastjudge
