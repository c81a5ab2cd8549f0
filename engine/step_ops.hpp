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
// The logits a run keeps of a few ids at every step (LAVE's rating tokens): ids [count], and
// logits [B, steps, count] float32, written
struct TrackedLogits {
  const int64_t* ids = nullptr;
  int64_t count = 0;
  float* logits = nullptr;
};
// std::invalid_argument where a tracked id lies outside V logits
void check_tracked(const TrackedLogits& tracked, int64_t V);
// each row's logits of the tracked ids (of logits [B, V], float32 or bfloat16 bits) into
// tracked.logits at step s of `steps`
void keep_tracked(const float* logits, int64_t B, int64_t V, const TrackedLogits& tracked, int64_t s,
                  int64_t steps);
void keep_tracked(const uint16_t* logits, int64_t B, int64_t V, const TrackedLogits& tracked, int64_t s,
                  int64_t steps);
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
// A run of steps on `input` (a step's input: its rows B, tokens [B, S] and counts [B]): step s is
// pick(in, s, chosen), which runs a step on `in` and writes each row's pick into chosen [B]; the
// picks go to column s of picks [B, limits.steps], and each later step feeds them (one token a
// row). Returns the steps run.
template <typename Input, typename Pick>
int64_t run_steps(const Input& input, const RunLimits& limits, int64_t* picks, Pick pick) {
  const int64_t B = input.B;
  std::vector<int64_t> chosen(B), fed(B), ones(B, 1);
  Input in = input;
  for (int64_t s = 0;; ++s) {
    pick(in, s, chosen.data());
    for (int64_t b = 0; b < B; ++b) picks[b * limits.steps + s] = chosen[b];
    if (run_ends(limits, s, chosen.data(), B)) return s + 1;
    fed = chosen;
    in.tokens = fed.data(), in.S = 1, in.counts = ones.data();
  }
}

// v holds at least n values (grown, never shrunk or cleared: steady decoding allocates nothing)
template <typename T>
void hold(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

}  // namespace fastjudge
