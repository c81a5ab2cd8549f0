// A Qwen decoding step (Qwen3.5's gated attention and Gated DeltaNet layers, Qwen3's attention
// layers) as one engine call on the CPU: the embeddings, every layer and the residual stream, on
// weights packed once (dense.hpp) and on the state pool's buffers, which live at fixed addresses
// for the model's lifetime and are bound once, so a step hands over only its tokens.
//
// Standard library only, like the rest of the engine. Written as tensor ops, a step of the mini
// Qwen3.5 is some two hundred dispatched ops, each with its own Python and dispatch cost (a few
// microseconds), against kernels of a few microseconds to tens of microseconds each at a decoding
// step's size: on two cores the host spent about as long between the kernels as in them. Here
// the same kernels (projections, RMSNorm, the DeltaNet step, few-token attention) run back to
// back, and the ops between them (rotary, K/V writes, the output gate, residual adds) are loops
// over the step's rows.
#pragma once

#include <cstdint>
#include <vector>

#include "dense.hpp"
#include "step_ops.hpp"

namespace fastjudge {

// One decoder layer: its norms (float32 [d], zero-centred ones already as 1 + w), the gated MLP
// (silu), and either full attention or a Gated DeltaNet mixer, with the pool buffers it updates.
struct QwenStepLayer {
  bool attention = false;
  const float *in_norm = nullptr, *post_norm = nullptr;
  PackedWeight gate, up, down;
  // full attention: qkv's outputs are the queries (H x hd), keys (Hkv x hd), the output gate
  // (H x hd, Qwen3.5 only) and values (Hkv x hd); qk_norm [H + Hkv, hd] the per-head norms of
  // queries, then keys; keys and values the pool's [slots, Hkv, capacity + 1, hd]
  PackedWeight qkv, o;
  const float* qk_norm = nullptr;
  void *keys = nullptr, *values = nullptr;
  // Gated DeltaNet (delta_rule.hpp's deltanet_step): the input projection, taps [K, C] (the
  // model's type), dt_bias, neg_A [Hv] and gated_norm [dv] float32; the pool's conv state
  // [slots, K - 1, C] (the model's type) and recurrent state [slots, Hv, dk, dv] (float32)
  PackedWeight in_proj, out;
  const void* taps = nullptr;
  const float *dt_bias = nullptr, *neg_A = nullptr, *gated_norm = nullptr;
  void* conv_state = nullptr;
  float* memory = nullptr;
};

struct QwenStepModel {
  int64_t d = 0, inner = 0, vocab = 0;
  int64_t H = 0, Hkv = 0, hd = 0, rotary_half = 0;  // attention heads; rotary over 2 x rotary_half dims
  bool output_gate = false;                         // Qwen3.5: attention output times sigmoid(gate)
  int64_t lin_k_heads = 0, lin_k_dim = 0, lin_v_heads = 0, lin_v_dim = 0, conv_kernel = 0;
  float eps = 0.0f, l2_eps = 0.0f;
  int64_t slots = 0, capacity = 0;
  const void* embed = nullptr;  // [vocab, d], the model's type
  int64_t *lengths = nullptr, *positions = nullptr;  // the pool's [slots]: keys held, next position
  std::vector<QwenStepLayer> layers;
  // the greedy pick's head (qwen_decode_run): the final norm [d] float32 and the output
  // projection (d inputs, one output a token); unset where only qwen_decode_step runs
  const float* final_norm = nullptr;
  PackedWeight head;
};

// The step's input: tokens [B, S] (row b's first counts[b] real, the rest padding) continuing
// slots start .. start + B - 1; the rotary tables cos, sin [positions, hd] in the model's type
// (rotate-half's sign folded into sin, cos 1 and sin 0 past the rotary dims), as the model's
// tensor ops compute them for a text position.
struct QwenStepInput {
  const int64_t* tokens = nullptr;
  const int64_t* counts = nullptr;
  int64_t B = 0, S = 0, start = 0;
  const void *cos = nullptr, *sin = nullptr;
  int64_t table_positions = 0;
  // rows whose first shared_columns keys and values are the same in every attention layer (one
  // prefix snapshot's): row b may read them from row shared_from[b] of the step (null: each
  // reads its own; CausalProblem::shared_from)
  int64_t shared_columns = 0;
  const int64_t* shared_from = nullptr;
};

// Working buffers a decoder keeps from step to step, each [rows, width] of the model's type: they
// only grow, so steady decoding neither allocates nor clears memory
template <typename T>
struct QwenStepBuffers {
  std::vector<T> x, normed, mixed, wide, heads, attended;  // heads: rotated queries and keys
  std::vector<T> logits;                                   // the greedy pick's [B, head outputs]
  std::vector<int64_t> columns, rope_rows;                 // each real token's K/V column and rotary row
  std::vector<int64_t> first, token_rows;  // each row's first real token (packed), each real token's row
};

struct QwenStepScratch {
  QwenStepBuffers<float> f32;
  QwenStepBuffers<uint16_t> bf16;
};

// Runs the step: out [B, S, d] (the model's type; the last layer's residual stream, before the
// final norm; zeros at padding, which no layer computes) and, in place, each layer's state for the
// rows' real tokens (K/V at column lengths[slot] + t, the DeltaNet states), then lengths and
// positions advanced by counts. Each value is held in the model's type where the tensor-op step holds it
// (residual adds, norms, rotary, the output gate each rounded once). Few-token attention reads
// the keys in place (causal_attention.hpp). Throws std::invalid_argument on tokens outside the
// vocabulary or positions past the tables or the pool's capacity, before anything is written.
void qwen_decode_step(const QwenStepModel& model, const QwenStepInput& input, float* out, QwenStepScratch& scratch,
                      int threads);
void qwen_decode_step(const QwenStepModel& model, const QwenStepInput& input, uint16_t* out,
                      QwenStepScratch& scratch, int threads);

// Greedy decoding's steps back to back, the host away between them. Each step is the step above,
// then greedy decoding's pick: each row's last real token's output (column counts[b] - 1; zeros
// where counts[b] is 0) into hidden [B, d], and the index of the largest of its
// logits (final norm, then the head, in the model's type; the first of equal ones, as torch's
// argmax of the same logits) into column s of picks [B, steps] (row-major; columns past the steps
// run untouched), and the logits of the tracked ids (as float32) into tracked.logits [B, steps,
// tracked.count]. The first step feeds input's tokens, each later one every row's pick of the
// step before (one token a row), as far as `limits` allow (step_ops.hpp). Returns the steps run.
// Throws std::invalid_argument where the model has no head, on a tracked id outside its outputs,
// or as the step does (the steps before it have run).
int64_t qwen_decode_run(const QwenStepModel& model, const QwenStepInput& input, const RunLimits& limits,
                        const TrackedLogits& tracked, float* hidden, int64_t* picks, QwenStepScratch& scratch,
                        int threads);
int64_t qwen_decode_run(const QwenStepModel& model, const QwenStepInput& input, const RunLimits& limits,
                        const TrackedLogits& tracked, uint16_t* hidden, int64_t* picks, QwenStepScratch& scratch,
                        int threads);

}  // namespace fastjudge
