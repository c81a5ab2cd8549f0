#include "dense.hpp"

#include <algorithm>
#include <vector>

#include "cpu_parallel.hpp"
#include "small_product.hpp"
#include "vector_math.hpp"

namespace fastjudge {
namespace {

// Rows a unit of work takes: with a panel of up to 64 x K floats, a group's inputs and the panel
// stay in the core's cache while its register blocks run.
constexpr int64_t kRowGroup = 64;
// One thread for each 1 MFLOP: below that a wake-up of the team costs more than its share.
constexpr double kFlopsPerThread = 1e6;

struct Problem {
  const float* x;
  int64_t row_stride;
  const float *panels, *up_panels;
  float* out;
  int64_t M, K, N;
  GateActivation activation;
};

__attribute__((always_inline)) inline Floats activate(Floats g, GateActivation activation) {
  switch (activation) {
    case GateActivation::kSilu:
      return silu(g);
    case GateActivation::kGeluTanh: {
      // 0.5 g (1 + tanh(y)) = g sigmoid(2 y), y = sqrt(2 / pi) (g + 0.044715 g^3)
      const Floats y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
      return g * sigmoid(y + y);
    }
    default:
      return g > splat(0.0f) ? g : splat(0.0f);
  }
}

// units [first, last) of the panels x row-groups grid (panel-major: consecutive units share a
// panel); a panel cut short (N not a multiple of 64) or a gated one goes through scratch
FASTJUDGE_CLONES
void run_units(const Problem& s, int64_t first, int64_t last) {
  const int64_t groups = (s.M + kRowGroup - 1) / kRowGroup, K = s.K;
  std::vector<float> scratch;
  for (int64_t unit = first; unit < last; ++unit) {
    const int64_t p = unit / groups, r0 = unit % groups * kRowGroup;
    const int64_t rows = std::min(kRowGroup, s.M - r0), c0 = p * kPanelColumns;
    const int64_t cols = std::min(kPanelColumns, s.N - c0);
    const float* x = s.x + r0 * s.row_stride;
    const float* panel = s.panels + p * K * kPanelColumns;
    float* out = s.out + r0 * s.N + c0;
    if (!s.up_panels && cols == kPanelColumns) {
      product(x, s.row_stride, panel, kPanelColumns, out, s.N, rows, K, kPanelColumns, false);
      continue;
    }
    scratch.resize(static_cast<std::size_t>(2 * kRowGroup * kPanelColumns));
    float *gate = scratch.data(), *up = gate + kRowGroup * kPanelColumns;
    product(x, s.row_stride, panel, kPanelColumns, gate, kPanelColumns, rows, K, kPanelColumns, false);
    if (s.up_panels) {
      product(x, s.row_stride, s.up_panels + p * K * kPanelColumns, kPanelColumns, up, kPanelColumns, rows, K,
              kPanelColumns, false);
      for (int64_t i = 0; i < rows * kPanelColumns; i += kLanes)
        store(gate + i, activate(load(gate + i), s.activation) * load(up + i));
    }
    for (int64_t r = 0; r < rows; ++r) std::copy(gate + r * kPanelColumns, gate + r * kPanelColumns + cols, out + r * s.N);
  }
}

void run(const Problem& s, int threads) {
  if (s.M == 0 || s.N == 0) return;
  const int64_t panels = (s.N + kPanelColumns - 1) / kPanelColumns;
  const int64_t units = panels * ((s.M + kRowGroup - 1) / kRowGroup);
  const double flops = 2.0 * s.M * s.K * s.N * (s.up_panels ? 2 : 1);
  const int64_t workers = std::min<int64_t>(threads, static_cast<int64_t>(flops / kFlopsPerThread) + 1);
  parallel_ranges(units, workers, 1, [&](int64_t first, int64_t last) { run_units(s, first, last); });
}

}  // namespace

void dense_product(const float* x, int64_t row_stride, const float* panels, float* out, int64_t M, int64_t K,
                   int64_t N, int threads) {
  run(Problem{x, row_stride, panels, nullptr, out, M, K, N, GateActivation::kSilu}, threads);
}

void gated_dense_product(const float* x, int64_t row_stride, const float* gate_panels, const float* up_panels,
                         float* out, int64_t M, int64_t K, int64_t N, GateActivation activation, int threads) {
  run(Problem{x, row_stride, gate_panels, up_panels, out, M, K, N, activation}, threads);
}

}  // namespace fastjudge
