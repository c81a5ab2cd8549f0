#include "rms_norm.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cpu_parallel.hpp"
#include "vector_math.hpp"

namespace fastjudge {
namespace {

// One thread for each 64 Ki elements: below that a wake-up of the team costs more than its share.
constexpr int64_t kElementsPerThread = 1 << 16;

template <typename T>
__attribute__((always_inline)) inline void rms_rows(const T* x, int64_t row_stride, int64_t head_stride,
                                                    const float* weight, T* out, int64_t H, int64_t D, float eps,
                                                    int64_t first, int64_t last) {
  const int64_t full = D / kLanes * kLanes;
  for (int64_t row = first; row < last; ++row) {
    const int64_t n = row / H, h = row % H;
    const T* src = x + n * row_stride + h * head_stride;
    const float* w = weight + h * D;
    T* dst = out + row * D;
    Floats squares{};
    for (int64_t j = 0; j < full; j += kLanes) {
      const Floats v = load_floats(src + j);
      squares += v * v;
    }
    float total = 0.0f;
    for (int l = 0; l < kLanes; ++l) total += squares[l];
    for (int64_t j = full; j < D; ++j) total += to_float(src[j]) * to_float(src[j]);
    const float inverse = 1.0f / std::sqrt(total / static_cast<float>(D) + eps);
    for (int64_t j = 0; j < full; j += kLanes) {
      store_floats(dst + j, load_floats(src + j) * inverse * load(w + j));
    }
    for (int64_t j = full; j < D; ++j) from_float(to_float(src[j]) * inverse * w[j], dst + j);
  }
}

FASTJUDGE_CLONES
void rms_rows_f32(const float* x, int64_t row_stride, int64_t head_stride, const float* weight, float* out, int64_t H,
                  int64_t D, float eps, int64_t first, int64_t last) {
  rms_rows(x, row_stride, head_stride, weight, out, H, D, eps, first, last);
}

FASTJUDGE_CLONES
void rms_rows_bf16(const uint16_t* x, int64_t row_stride, int64_t head_stride, const float* weight, uint16_t* out,
                   int64_t H, int64_t D, float eps, int64_t first, int64_t last) {
  rms_rows(x, row_stride, head_stride, weight, out, H, D, eps, first, last);
}

}  // namespace

template <typename T>
void rms_norm(const T* x, int64_t row_stride, int64_t head_stride, const float* weight, T* out, int64_t N,
              int64_t H, int64_t D, float eps, int threads) {
  const int64_t rows = N * H;
  if (rows == 0 || D == 0) return;
  const int64_t workers = std::min<int64_t>(threads, rows * D / kElementsPerThread + 1);
  parallel_ranges(rows, workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (std::is_same_v<T, float>) {
      rms_rows_f32(x, row_stride, head_stride, weight, out, H, D, eps, first, last);
    } else {
      rms_rows_bf16(x, row_stride, head_stride, weight, out, H, D, eps, first, last);
    }
  });
}

template void rms_norm<float>(const float*, int64_t, int64_t, const float*, float*, int64_t, int64_t, int64_t, float,
                              int);
template void rms_norm<uint16_t>(const uint16_t*, int64_t, int64_t, const float*, uint16_t*, int64_t, int64_t, int64_t,
                                 float, int);

}  // namespace fastjudge
