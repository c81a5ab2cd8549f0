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
struct NormRows {
  const T* x;
  int64_t row_stride, head_stride;
  const float* weight;
  T* out;
  int64_t H, D;
  float eps;
  bool round_first;
  int64_t first, last;
};

// Rows [first, last) of H heads of D values each. The squares are summed in 16 lanes, lane l
// taking every 16th value, then lane after lane: code built for AVX2 keeps the 16 lanes as two
// 8-lane halves in registers (a 16-lane vector there went through the stack at every step) and
// sums them in the same order, so both builds give the same bits.
template <bool kWide, typename T>
__attribute__((always_inline)) inline void rms_rows(const NormRows<T>& a) {
  using V = LaneVector<kWide>;
  constexpr int64_t kParts = kLanes / kLanesOf<V>;
  const int64_t D = a.D, full = D / kLanes * kLanes;
  for (int64_t row = a.first; row < a.last; ++row) {
    const int64_t n = row / a.H, h = row % a.H;
    const T* src = a.x + n * a.row_stride + h * a.head_stride;
    const float* w = a.weight + h * D;
    T* dst = a.out + row * D;
    V squares[kParts] = {};
    for (int64_t j = 0; j < full; j += kLanes) {
      for (int64_t part = 0; part < kParts; ++part) {
        const V v = load_lanes<V>(src + j + part * kLanesOf<V>);
        squares[part] += v * v;
      }
    }
    float total = 0.0f;
    for (int64_t part = 0; part < kParts; ++part)
      for (int64_t l = 0; l < kLanesOf<V>; ++l) total += squares[part][l];
    for (int64_t j = full; j < D; ++j) total += to_float(src[j]) * to_float(src[j]);
    const float inverse = 1.0f / std::sqrt(total / static_cast<float>(D) + a.eps);
    if (a.round_first) {
      for (int64_t j = 0; j < full; j += kLanesOf<V>)
        store_lanes(dst + j, rounded<T>(load_lanes<V>(src + j) * inverse) * load_as<V>(w + j));
      for (int64_t j = full; j < D; ++j) from_float(rounded<T>(to_float(src[j]) * inverse) * w[j], dst + j);
      continue;
    }
    for (int64_t j = 0; j < full; j += kLanesOf<V>) {
      store_lanes(dst + j, load_lanes<V>(src + j) * inverse * load_as<V>(w + j));
    }
    for (int64_t j = full; j < D; ++j) from_float(to_float(src[j]) * inverse * w[j], dst + j);
  }
}

FASTJUDGE_VERSIONED(rms_rows_f32, rms_rows, NormRows<float>)
FASTJUDGE_VERSIONED(rms_rows_bf16, rms_rows, NormRows<uint16_t>)

}  // namespace

template <typename T>
void rms_norm(const T* x, int64_t row_stride, int64_t head_stride, const float* weight, T* out, int64_t N,
              int64_t H, int64_t D, float eps, int threads, bool round_first) {
  const int64_t rows = N * H;
  if (rows == 0 || D == 0) return;
  const int64_t workers = std::min<int64_t>(threads, rows * D / kElementsPerThread + 1);
  parallel_ranges(rows, workers, 1, [&](int64_t first, int64_t last) {
    const NormRows<T> rows_of{x, row_stride, head_stride, weight, out, H, D, eps, round_first, first, last};
    if constexpr (std::is_same_v<T, float>) {
      rms_rows_f32(rows_of);
    } else {
      rms_rows_bf16(rows_of);
    }
  });
}

template void rms_norm<float>(const float*, int64_t, int64_t, const float*, float*, int64_t, int64_t, int64_t, float,
                              int, bool);
template void rms_norm<uint16_t>(const uint16_t*, int64_t, int64_t, const float*, uint16_t*, int64_t, int64_t, int64_t,
                                 float, int, bool);

}  // namespace fastjudge
