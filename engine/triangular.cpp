#include "triangular.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_parallel.hpp"

namespace fastjudge {
namespace {

// Matrices per group: one float32 lane of a 512-bit register each, so every scalar step of the
// substitution becomes one vector operation over 16 matrices (no short, variable-length loops
// over a row's first j entries). kBlock entries of a row are built together: independent
// accumulators hide the multiply-add latency.
constexpr int kLanes = 16;
constexpr int kBlock = 4;

// The substitution over one group held lane-minor: lower[(i * stride + k) * kLanes + w] is
// L_w[i][k] (zero on and above the diagonal and in unused lanes), inverse the same layout for
// X_w without its unit diagonal. Entries past a row's end (j >= i in a block) come out zero:
// their L entries and every X[k][j] with j >= k are zero, and adding a * 0 leaves a sum as it is.
FASTJUDGE_CLONES
void substitute(const float* lower, float* inverse, int64_t C, int64_t stride) {
  for (int64_t i = 1; i < C; ++i) {
    const float* li = lower + i * stride * kLanes;
    float* row = inverse + i * stride * kLanes;
    for (int64_t j0 = 0; j0 < i; j0 += kBlock) {
      float acc[kBlock][kLanes];
      for (int b = 0; b < kBlock; ++b)
        for (int w = 0; w < kLanes; ++w) acc[b][w] = -li[(j0 + b) * kLanes + w];
      for (int64_t k = j0 + 1; k < i; ++k) {
        const float* a = li + k * kLanes;
        const float* x = inverse + (k * stride + j0) * kLanes;
        for (int b = 0; b < kBlock; ++b)
          for (int w = 0; w < kLanes; ++w) acc[b][w] -= a[w] * x[b * kLanes + w];
      }
      for (int b = 0; b < kBlock; ++b)
        for (int w = 0; w < kLanes; ++w) row[(j0 + b) * kLanes + w] = acc[b][w];
    }
  }
}

// Matrices [first, last) of the batch, kLanes at a time, through scratch of this thread's own.
void invert_range(const float* system, float* out, int64_t first, int64_t last, int64_t C) {
  // a row padded to whole blocks, and off multiples of 16 entries: rows 4 KiB apart (C = 64)
  // would share cache sets (64 x 64 took twice as long as 60 x 60)
  int64_t stride = (C + kBlock - 1) / kBlock * kBlock;
  if (stride % 16 == 0) stride += kBlock;
  const int64_t size = C * C;
  std::vector<float> lower(static_cast<std::size_t>(C * stride * kLanes));
  std::vector<float> inverse(lower.size());
  for (int64_t m0 = first; m0 < last; m0 += kLanes) {
    const int64_t lanes = std::min<int64_t>(kLanes, last - m0);
    std::fill(lower.begin(), lower.end(), 0.0f);
    std::fill(inverse.begin(), inverse.end(), 0.0f);
    for (int64_t w = 0; w < lanes; ++w) {
      for (int64_t i = 1; i < C; ++i) {
        const float* src = system + (m0 + w) * size + i * C;
        float* dst = lower.data() + i * stride * kLanes + w;
        for (int64_t k = 0; k < i; ++k) dst[k * kLanes] = src[k];
      }
    }
    substitute(lower.data(), inverse.data(), C, stride);
    for (int64_t w = 0; w < lanes; ++w) {
      float* X = out + (m0 + w) * size;
      for (int64_t i = 0; i < C; ++i) {
        float* row = X + i * C;
        const float* src = inverse.data() + i * stride * kLanes + w;
        for (int64_t j = 0; j < i; ++j) row[j] = src[j * kLanes];
        row[i] = 1.0f;
        std::fill(row + i + 1, row + C, 0.0f);
      }
    }
  }
}

}  // namespace

void unit_lower_inverse(const float* system, float* out, int64_t n, int64_t C, int threads) {
  if (n < 0 || C < 0) throw std::invalid_argument("unit_lower_inverse: negative size");
  if (C > kMaxUnitLowerSize) {
    throw std::invalid_argument("unit_lower_inverse: C = " + std::to_string(C) + " is over " +
                                std::to_string(kMaxUnitLowerSize));
  }
  if (n == 0 || C == 0) return;
  // whole groups per thread, and only where each thread gets at least two (a thread's start
  // costs about what one group of 32 x 32 matrices does)
  const int64_t groups = (n + kLanes - 1) / kLanes;
  parallel_ranges(n, std::min<int64_t>(threads, groups / 2), kLanes,
                  [&](int64_t first, int64_t last) { invert_range(system, out, first, last, C); });
}

}  // namespace fastjudge
