#include "step_ops.hpp"

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

}  // namespace

void add(float* x, const float* y, int64_t n) { add_f32(x, y, n); }
void add(uint16_t* x, const uint16_t* y, int64_t n) { add_bf16(x, y, n); }

}  // namespace fastjudge
