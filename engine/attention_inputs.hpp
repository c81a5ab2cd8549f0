// What a Qwen attention layer does around its attention, on the CPU: the queries' and keys'
// per-head norms and rotary embedding, the keys and values written into the state pool, and
// Qwen3.5's output gate. A decoding step (qwen_step.cpp) runs them on its few tokens; a prompt's
// pass calls them on all of its tokens at once, where torch's ops take some ten dispatched passes
// (a norm, three for the rotary, two scattered writes, the gate's sigmoid and product).
//
// Each value is rounded where the layer's tensor ops round it (the file is built without
// floating-point contraction): a product rounded, then a sum rounded, never one fused
// multiply-add.
#pragma once

#include <cstdint>

namespace fastjudge {

// An attention layer's inputs over B rows of S tokens (N = B S; a prompt's pass, a decoding
// step), from the fused projection's rows qkv [N, width]: the queries (H heads of hd) and the
// keys (Hkv heads) side by side from column 0, the values (Hkv heads) from column values_at.
// Queries and keys RMS-normalised per head (qk_norm [H + Hkv, hd] float32, eps) and rotated (cos
// and sin tables of rows of hd in T, token n taking row rope_rows[n], or row n where rope_rows
// is null; half: half the rotary dims) into rotated [N, H + Hkv, hd]; each token's rotated key
// and its value written into the pool's keys and values [B, Hkv, columns, hd] of its row, at
// column where[n]; a token whose column is the last (the pool's scratch column, where padding
// goes) writes nothing there. Token n is row n / S's, or row token_rows[n]'s where the rows' tokens
// are packed (a decoding step's real tokens one after another, no padding: B S tokens in all).
template <typename T>
struct AttentionInputs {
  const T* qkv;
  int64_t width, values_at;
  const float* qk_norm;
  float eps;
  const T *cos, *sin;
  int64_t half;
  T* rotated;
  T *keys, *values;
  const int64_t* where;
  int64_t B, S, H, Hkv, hd, columns;
  const int64_t* rope_rows = nullptr;
  const int64_t* token_rows = nullptr;
};
void attention_inputs(const AttentionInputs<float>& in, int threads);
void attention_inputs(const AttentionInputs<uint16_t>& in, int threads);

// The output gate over N tokens: o [N, n] (contiguous) times sigmoid of gate rows [N, n] at
// gate_stride elements apart (a slice of the fused projection's rows); n a multiple of 16.
void output_gate(float* o, const float* g, int64_t gate_stride, int64_t N, int64_t n, int threads);
void output_gate(uint16_t* o, const uint16_t* g, int64_t gate_stride, int64_t N, int64_t n, int threads);

}  // namespace fastjudge
