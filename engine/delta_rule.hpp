// The gated delta rule one token at a time (Gated DeltaNet's decoding steps), on the CPU, in
// place on the recurrent state.
//
// Standard library only, like the rest of the engine. The step is four passes over a state of
// B x value heads x dk x dv floats when written as tensor ops (forget, read under the key, write
// the correction, read under the query), each streaming the whole state through memory: 64 rows
// of 16 heads of 128 x 128 (67 MB) took 13 ms a layer that way. Here each head's state is read and
// written once per token and its second pass hits the cache.
#pragma once

#include <cstdint>

#include "strided_rows.hpp"

namespace fastjudge {

// For each row b < B, value head h < Hv (served by key head h / (Hv / Hk)) and token t < S in
// order, with M = memory[b, h] (dk x dv, row-major):
//   M <- decay[b, t, h] * M;  u = beta[b, t, h] * (v[b, t, h] - M^T k[b, t, hk]);
//   M <- M + k u^T;  out[b, t, h] = M^T q[b, t, hk]
// memory [B, Hv, dk, dv], query and key [B, S, Hk, dk] (queries scaled, both normalised by the
// caller), value [B, S, Hv, dv], decay and beta [B, S, Hv], out [B, S, Hv, dv], all float32;
// query, key and value strided (a layer's views, read in place), the rest contiguous. Sums over
// dk run in increasing order, in float32. threads > 1 splits the B x Hv heads among threads
// when the state is large enough to pay for them.
void recurrent_delta_rule(float* memory, const StridedRows<float>& query, const StridedRows<float>& key,
                          const StridedRows<float>& value, const float* decay, const float* beta, float* out,
                          int64_t B, int64_t S, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int threads);

// The gated delta rule over a prompt (prefill, suffix passes of many tokens), chunk tokens at a
// time, in place on the state: the result of recurrent_delta_rule over the same tokens, each
// chunk's tokens at once. For a chunk of n tokens from state M0, with G_i the running sum of
// the log-decays g inside it (decay from token j to token i: exp(G_i - G_j)), the corrections
// U solve the unit lower-triangular system
//   U_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) U_j = beta_i (v_i - exp(G_i) M0^T k_i),
// (forward substitution, row blocks of earlier rows as one product), then
//   out_i = exp(G_i) M0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) U_j,
//   M = exp(G_{n-1}) M0 + sum_j exp(G_{n-1} - G_j) k_j U_j^T.
// Every product runs on a thread's chunk held in cache (the key head's queries and keys, its
// value heads' states one after another), register-blocked. Decay exponents are clamped below
// at exp_floor (and differences above at 0), as the tensor-op form clamps them.
// memory [B, Hv, dk, dv] (the start state, not read and zeroed when fresh), query and key
// [B, S, Hk, dk] (raw when normalise: L2-normalised here with l2_eps under the root; queries
// also scaled by 1 / sqrt(dk)), value [B, S, Hv, dv], g (log-decays) and beta [B, S, Hv], out
// [B, S, Hv, dv]: float32; query, key and value strided (read in place), the rest contiguous.
// dv a multiple of 16, chunk in [1, kMaxChunk].
constexpr int64_t kMaxChunk = 256;
void chunked_delta_rule(float* memory, const StridedRows<float>& query, const StridedRows<float>& key,
                        const StridedRows<float>& value, const float* g, const float* beta, float* out, int64_t B,
                        int64_t S, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t chunk, bool fresh,
                        bool normalise, float l2_eps, float exp_floor, int threads);

// A Gated DeltaNet layer's few-token step between its two projections, for each row b < B and
// token t < S in order (what the layer's tensor ops compute there, each value held in the model's
// element type T where they hold it):
//   the input projection's row [conv inputs C | z (Hv x dv) | b (Hv) | a (Hv)], C = 2 Hk dk + Hv dv;
//   causal depthwise conv over the row's last K - 1 inputs (the conv state; zeros when fresh) and
//   the new ones, SiLU; queries and keys L2-normalised, queries scaled by 1 / dk and keys by
//   1 / sqrt(dk) in all; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) (both 0 on a
//   padding token, t >= counts[b]: the state is left as it is); the gated delta rule on the
//   recurrent state (memory, float32, zeroed first when fresh); the gated RMSNorm of its output
//   (eps), scaled by gated_norm and multiplied by silu(z): out [B, S, Hv x dv];
//   the conv state [B, K - 1, C] then holds each row's last K - 1 real inputs.
// taps [K, C]; dt_bias, neg_A [Hv], gated_norm [dv] float32 (their values in the model's type
// where the model holds them so); projected [B, S, width] contiguous. With first (deltanet_step
// only): the rows' real tokens packed, row b's at rows first[b] .. first[b] + counts[b] - 1 of
// projected and out, and no padding token anywhere (nothing else of out is written).
struct DeltaNetStep {
  int64_t B, S, K, Hk, Hv, dk, dv;
  float eps, l2_eps;
  bool fresh;
  const int64_t* counts;
  const float *dt_bias, *neg_A, *gated_norm;
  const int64_t* first = nullptr;
};

void deltanet_step(const DeltaNetStep& step, const float* projected, float* conv_state, const float* taps,
                   float* memory, float* out, int threads);
void deltanet_step(const DeltaNetStep& step, const uint16_t* projected, uint16_t* conv_state, const uint16_t* taps,
                   float* memory, uint16_t* out, int threads);
// The same layer over a prompt or a multi-token step (prefill, suffix passes): the conv over
// each token's window summed in float32 (as a convolution op sums it, no product rounded) and held
// in T, SiLU held in T; the rule chunk tokens at a time (chunked_delta_rule, queries and keys
// normalised there with l2_eps, decay exponents clamped at exp_floor; dv a multiple of 16, chunk
// in [1, kMaxChunk]); the gates and the gated norm as deltanet_step computes them. At most 16
// conv taps (std::invalid_argument otherwise).
void deltanet_prompt(const DeltaNetStep& step, const float* projected, float* conv_state, const float* taps,
                     float* memory, float* out, int64_t chunk, float exp_floor, int threads);
void deltanet_prompt(const DeltaNetStep& step, const uint16_t* projected, uint16_t* conv_state,
                     const uint16_t* taps, float* memory, uint16_t* out, int64_t chunk, float exp_floor,
                     int threads);

}  // namespace fastjudge
