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

}  // namespace fastjudge
