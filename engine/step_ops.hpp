// What the engine's whole decoding steps (qwen_step.hpp, t5_step.hpp) do between their kernels:
// the residual stream's adds, and working buffers that only grow.
#pragma once

#include <cstdint>
#include <vector>

namespace fastjudge {

// x <- x + y over n values, each sum rounded once to x's type (float32, or bfloat16 bits)
void add(float* x, const float* y, int64_t n);
void add(uint16_t* x, const uint16_t* y, int64_t n);

// v holds at least n values (grown, never shrunk or cleared: steady decoding allocates nothing)
template <typename T>
void hold(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

}  // namespace fastjudge
