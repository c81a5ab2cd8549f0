#include "step_ops.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cpu_parallel.hpp"
#include "vector_math.hpp"

namespace fastjudge {
namespace {

template <typename T>
__attribute__((always_inline)) inline void add_into(T* x, const T* y, int64_t n) {
  const int64_t full = n / kLanes * kLanes;
  for (int64_t i = 0; i < full; i += kLanes) store_floats(x + i, load_floats(x + i) + load_floats(y + i));
  for (int64_t i = full; i < n; ++i) from_float(to_float(x[i]) + to_float(y[i]), x + i);
}

// the ISA clones, one per element type (target_clones does not take templates)
FASTJUDGE_CLONES void add_f32(float* x, const float* y, int64_t n) { add_into(x, y, n); }
FASTJUDGE_CLONES void add_bf16(uint16_t* x, const uint16_t* y, int64_t n) { add_into(x, y, n); }

template <typename T>
int64_t greedy_pick(const T* row, int64_t V) {
  int64_t best = 0;
  float top = to_float(row[0]);
  if (std::isnan(top)) return 0;
  for (int64_t v = 1; v < V; ++v) {
    const float x = to_float(row[v]);
    if (std::isnan(x)) return v;
    if (x > top) top = x, best = v;
  }
  return best;
}

template <typename T>
void picks_of(const T* logits, int64_t B, int64_t V, int64_t* picks, int threads) {
  constexpr int64_t kLogitsPerThread = 1 << 16;
  parallel_ranges(B, std::min<int64_t>(threads, B * V / kLogitsPerThread + 1), 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) picks[b] = greedy_pick(logits + b * V, V);
  });
}

template <typename T>
void keep_of(const T* logits, int64_t B, int64_t V, const TrackedLogits& tracked, int64_t s, int64_t steps) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < tracked.count; ++i) {
      tracked.logits[(b * steps + s) * tracked.count + i] = to_float(logits[b * V + tracked.ids[i]]);
    }
  }
}

}  // namespace

void check_tracked(const TrackedLogits& tracked, int64_t V) {
  for (int64_t i = 0; i < tracked.count; ++i) {
    if (tracked.ids[i] < 0 || tracked.ids[i] >= V) throw std::invalid_argument("a tracked id past the head");
  }
}

void keep_tracked(const float* logits, int64_t B, int64_t V, const TrackedLogits& tracked, int64_t s,
                  int64_t steps) {
  keep_of(logits, B, V, tracked, s, steps);
}

void keep_tracked(const uint16_t* logits, int64_t B, int64_t V, const TrackedLogits& tracked, int64_t s,
                  int64_t steps) {
  keep_of(logits, B, V, tracked, s, steps);
}

void greedy_picks(const float* logits, int64_t B, int64_t V, int64_t* picks, int threads) {
  picks_of(logits, B, V, picks, threads);
}

void greedy_picks(const uint16_t* logits, int64_t B, int64_t V, int64_t* picks, int threads) {
  picks_of(logits, B, V, picks, threads);
}

bool run_ends(const RunLimits& limits, int64_t s, const int64_t* chosen, int64_t B) {
  if (s + 1 >= limits.steps) return true;
  const int64_t* stops_end = limits.stops + limits.stop_count;
  for (int64_t b = 0; b < B; ++b) {
    if (s + 1 >= limits.room[b] || std::find(limits.stops, stops_end, chosen[b]) != stops_end) return true;
  }
  return false;
}

void add(float* x, const float* y, int64_t n) { add_f32(x, y, n); }
void add(uint16_t* x, const uint16_t* y, int64_t n) { add_bf16(x, y, n); }

}  // namespace fastjudge
