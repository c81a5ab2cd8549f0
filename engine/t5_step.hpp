// A T5 decoder step (self-attention with the relative position bias, cross-attention over each
// row's encoder states, the gated feed-forward) as one engine call on the CPU, on weights packed
// once (dense.hpp) and on the state pool's buffers, which live at fixed addresses for the pool's
// lifetime and are bound once, so a step hands over only its tokens.
//
// Written as tensor ops, a step of Flan-T5-small's decoder is some three hundred dispatched ops
// (about 120 kernels and 180 views), each costing the host a few microseconds; the self-
// attention alone builds its bias-and-causal mask and runs SDPA over it. Here the same kernels
// (projections, RMSNorm, the reassociated or per-head cross-attention) run back to back, the
// self-attention on the few-token attention kernel with the bias added by distance, and the ops
// between them (K/V writes, residual adds, casts) are loops over the step's rows.
#pragma once

#include <cstdint>
#include <vector>

#include "dense.hpp"
#include "step_ops.hpp"

namespace fastjudge {

// One decoder layer: its three norms (float32 [d]), the self-attention's fused qkv and o, the
// cross-attention's x_q and x_o with the key and value weights [H, dk, d] (the model's type) that
// the reassociated form maps through (a bfloat16 model's keys also as pairs of d_kv rows,
// pair_key_weights, where its maps take them; else null), and the gated feed-forward.
struct T5StepLayer {
  const float *norm = nullptr, *x_norm = nullptr, *ff_norm = nullptr;
  PackedWeight qkv, o, x_q, x_o, gate, up, down;
  const void *x_k = nullptr, *x_v = nullptr;
  const uint32_t* x_k_pairs = nullptr;
};

struct T5StepModel {
  int64_t d = 0, H = 0, dk = 0, d_ff = 0, vocab = 0;
  GateActivation activation = GateActivation::kGeluTanh;
  float eps = 0.0f;
  const void* embed = nullptr;  // [vocab, d], the model's type
  // the self-attention's bias by distance [H, capacity + 1] float32: bias[h, n] for a key n
  // positions before its query (the decoder's causal buckets of the model's bias table)
  const float* bias = nullptr;
  // the pool: slots, the decoder positions a row holds (capacity; column `capacity` of the K/V is
  // the tensor ops' scratch), encoder states [slots, enc_capacity, d] (the model's type), the
  // self-attention K/V [slots, layers, 2, H, capacity + 1, dk] float32, the projected cross-
  // attention K/V [cross_slots, layers, 2, H, enc_capacity, dk] float32, and each row's encoder
  // and decoder lengths (int64 [slots]; the decoder's advance with each step)
  int64_t slots = 0, capacity = 0, enc_capacity = 0, cross_slots = 0;
  const void* mem = nullptr;
  float *kv = nullptr, *xkv = nullptr;
  const int64_t* enc_lengths = nullptr;
  int64_t* dec_lengths = nullptr;
  std::vector<T5StepLayer> layers;
  // the greedy pick's head (t5_decode_run): the final norm [d] float32, the factor its output
  // takes before the head (d^-0.5 where T5 ties the head to the embeddings, else 1) and the LM
  // head (d inputs, one output a token); unset where only t5_decode_step runs
  const float* final_norm = nullptr;
  float head_scale = 1.0f;
  PackedWeight head;
};

// The step's input: tokens [B, S] (row b's first counts[b] real, the rest padding) continuing
// slots start .. start + B - 1; projected: cross-attention per head over the projected K/V
// (every row then within cross_slots), else reassociated over the encoder states.
struct T5StepInput {
  const int64_t* tokens = nullptr;
  const int64_t* counts = nullptr;
  int64_t B = 0, S = 0, start = 0;
  bool projected = false;
};

// Working buffers a decoder keeps from step to step (they only grow)
template <typename T>
struct T5StepBuffers {
  std::vector<T> x, normed, mixed, wide, heads;
  std::vector<float> queries, attended;  // the attention's float32 side
  std::vector<int64_t> last_keys;
  std::vector<T> logits;  // the greedy pick's [B, head outputs]
};

struct T5StepScratch {
  T5StepBuffers<float> f32;
  T5StepBuffers<uint16_t> bf16;
};

// Runs the step: out [B, S, d] (the model's type; the last layer's output, before the final
// norm) and, in place, each layer's self-attention K/V for the real tokens (column dec_lengths +
// t; padding writes nothing and its outputs are not the tensor ops'), then dec_lengths advanced
// by counts. Each value is rounded to the model's type where the tensor-op step rounds it
// (projections, residual adds, norms, the attention outputs); the attention runs in float32
// (the pool's K/V type) and reads the K/V and encoder states in place. Throws
// std::invalid_argument on tokens outside the vocabulary, rows past the slots (or the projected
// K/V's), or positions past the capacity, before anything is written.
void t5_decode_step(const T5StepModel& model, const T5StepInput& input, float* out, T5StepScratch& scratch,
                    int threads);
void t5_decode_step(const T5StepModel& model, const T5StepInput& input, uint16_t* out, T5StepScratch& scratch,
                    int threads);

// Greedy decoding's steps back to back, the host away between them. Each step is the step above,
// then greedy decoding's pick of each row from its last real token's output: the final norm,
// times head_scale, the head (each rounded to the model's type, as the tensor ops' logits are)
// and the index of the largest logit (the first of equal ones, the first NaN, as torch's argmax)
// into column s of picks [B, steps] (row-major; columns past the steps run untouched), and the
// logits of the tracked ids (as float32) into tracked.logits [B, steps, tracked.count]. The first
// step feeds input's tokens, each later one every row's pick of the step before, as far as
// `limits` allow (step_ops.hpp). bf16: the model's type is bfloat16 (its embeddings', panels' and
// encoder states'), else float32. Returns the steps run. Throws std::invalid_argument where the
// model has no head, on a tracked id outside its outputs, or as the step does (the steps before
// it have run).
int64_t t5_decode_run(const T5StepModel& model, const T5StepInput& input, const RunLimits& limits,
                      const TrackedLogits& tracked, int64_t* picks, bool bf16, T5StepScratch& scratch, int threads);

}  // namespace fastjudge
