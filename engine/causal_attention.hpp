// Causal softmax attention of many new tokens a row (a prefill's or a suffix pass's attention
// layers), on the CPU.
//
// Standard library and compiler intrinsics only, like the rest of the engine. Each (row, key
// head) pair packs its keys (transposed) and values once, then every query tile of its grouped
// query heads takes scores against the keys up to its last token, an exact softmax in float32
// over each query's visible keys and the weighted sum of values: two small products per tile
// through one register-blocked micro-kernel, no work above the causal diagonal past one tile,
// and nothing for torch's SDPA to split into blocks (its CPU kernel skips only whole 512-key
// blocks). Float32 products by default; bfloat16 inputs on CPUs with AVX512-BF16 take bfloat16
// dot products, keys and values packed as bfloat16 pairs (bf16_dot_products below).
#pragma once

#include <cstdint>

#include "strided_rows.hpp"

namespace fastjudge {

// Query token t of row b sees the keys j <= min(offset_b + t, W - 1): its row's cached keys
// (offset_b of them: a prefix snapshot) and the new ones up to its own. offsets null: none
// cached, W = S (causal attention over a prompt). counts: each row's real tokens (later ones
// are padding, their outputs zeros, nothing computed for them); null: all S. bias: an additive
// bias by distance (T5's relative position bias), the score of query token t of head h on key j
// being scale * q . k + bias[h * bias_stride + offset_b + t - j]; only with offsets. A T5 decoding
// step's self-attention takes it with its cached keys as the offsets; T5's encoder attention,
// where each query sees all n keys of its sequence, as one row whose n queries come after its n
// keys (offset n - 1: query t sees keys j <= n - 1 + t, all of them), the bias of a key's
// relative position j - t at n - 1 + t - j.
constexpr int64_t kFewTokens = 4;  // rows of at most this many new tokens take the few-token path

struct CausalProblem {
  int64_t B, S, W, H, Hkv, dim;
  float scale;
  const int64_t* offsets;
  const int64_t* counts;
  const float* bias = nullptr;
  int64_t bias_stride = 0;
  // Rows that hold the same first shared_columns keys and values (loaded from one prefix
  // snapshot): row b may read them from row shared_from[b] instead of its own (null: each row
  // reads its own). Used by the few-token path where each row's queries of a key head are at
  // most four, there is no bias and every row's cached keys reach past shared_columns: a block of shared
  // keys or values is then read from memory once for all the rows that share it, with the same
  // bits as each row reading its own.
  int64_t shared_columns = 0;
  const int64_t* shared_from = nullptr;

  int64_t last_key(int64_t offset, int64_t t) const { return t + offset < W ? t + offset : W - 1; }
};

// out[b, t, h] = sum over visible j of softmax_j(scale * q[b, t, h] . k[b, j, hk]) v[b, j, hk] with
// hk = h / (H / Hkv): query [B, S, H, dim], key and value [B, W, Hkv, dim], out [B, S, H, dim]
// (C-contiguous, written), all float32 or all bfloat16 (as uint16 bits; arithmetic in float32,
// the output rounded to nearest even). threads > 1 splits the B x Hkv pairs among threads.
// Throws std::invalid_argument for a bias the few-token path does not take.
void causal_attention(const CausalProblem& problem, const StridedRows<float>& query, const StridedRows<float>& key,
                      const StridedRows<float>& value, float* out, int threads);
void causal_attention(const CausalProblem& problem, const StridedRows<uint16_t>& query,
                      const StridedRows<uint16_t>& key, const StridedRows<uint16_t>& value, uint16_t* out,
                      int threads);

// Whether bfloat16 attention takes bfloat16 dot products (AVX512-BF16, where the CPU has it:
// weights rounded to bfloat16 before the weighted sum, as transformers' eager path rounds them)
// or the portable float32 path (float32 weights); the second form sets the wish and returns the
// outcome.
bool bf16_dot_products();
bool bf16_dot_products(bool wanted);

}  // namespace fastjudge
