// What the engine's whole decoding steps (qwen_step.hpp, t5_step.hpp) do between their kernels:
// the residual stream's adds, working buffers that only grow, greedy picks and how long a run of
// steps goes.
#pragma once

#include <cstdint>
#include <vector>

namespace fastjudge {

// x <- x + y over n values, each sum rounded once to x's type (float32, or bfloat16 bits)
void add(float* x, const float* y, int64_t n);
void add(uint16_t* x, const uint16_t* y, int64_t n);

// picks[b] = the index of row b's largest of V logits (logits [B, V], float32 or bfloat16 bits),
// as torch's argmax picks it: the first of equal maxima, the first NaN where a row has one
void greedy_picks(const float* logits, int64_t B, int64_t V, int64_t* picks, int threads);
void greedy_picks(const uint16_t* logits, int64_t B, int64_t V, int64_t* picks, int threads);
// How far a run of greedy decoding steps may go without the host (qwen_decode_run,
// t5_decode_run): at most `steps` steps, ending after the step where any row picks one of the
// stop ids or its last allowed token (room[b], each at least 1: the tokens row b may still pick,
// the run's first among them). A row that ends leaves the batch, which the host then reshapes
// (rows leave, others join), so the run stops there for every row.
struct RunLimits {
  int64_t steps = 1;
  const int64_t* room = nullptr;
  const int64_t* stops = nullptr;
  int64_t stop_count = 0;
};
// whether a run ends after its step s, whose picks of B rows are `chosen`
bool run_ends(const RunLimits& limits, int64_t s, const int64_t* chosen, int64_t B);
// v holds at least n values (grown, never shrunk or cleared: steady decoding allocates nothing)
template <typename T>
void hold(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

}  // namespace fastjudge
