// Attention of a few query rows over a row's encoder states that are both its keys and its
// values (T5's cross-attention reassociated: every head's query mapped into model space attends
// over the encoder states themselves), on the CPU.
//
// Each row's states are read once: blocks of keys take the queries' scores (four keys by four
// queries a register block, summed across lanes), an online softmax (the running maximum and
// sum, earlier sums rescaled when the maximum grows, as flash attention merges key blocks)
// turns them into weights, and the same block, still in cache, is summed into the outputs with
// them. Two passes over the states (scores, then values, as SDPA makes them) read them twice,
// and a long prompt's states do not stay in cache between the two.
#pragma once

#include <cstdint>

#include "strided_rows.hpp"

namespace fastjudge {

// out[b, r] = sum over j < lengths[b] of softmax_j(scale * q[b, r] . s[b, j]) s[b, j]: query
// [B, R, 1, dim] and states [B, L, 1, dim] read in place (contiguous rows), out [B, R, dim]
// C-contiguous; float32 or bfloat16 (as uint16 bits; arithmetic in float32, the output rounded
// once). dim a multiple of 16; a row with no keys gets zeros. threads > 1 splits the rows'
// groups of 16 queries among threads. reverse: the rows in reverse order (the same results):
// calls that alternate it over the same states start on those the last call read most
// recently, still in cache when all of them are not.
template <typename T>
void encoder_attention(const StridedRows<T>& query, const StridedRows<T>& states, const int64_t* lengths, T* out,
                       int64_t B, int64_t R, int64_t dim, float scale, bool reverse, int threads);

// T5's whole reassociated cross-attention for each row b and position p: its heads' queries
// xq[b, p, h] (each of d_kv) mapped into model space through the key weights, q = w_k[h]^T
// xq[b, p, h]; the attention above over the row's states; each context mapped back through the
// value weights, out[b, p, h] = w_v[h] ctx. xq, out [B, P, H, dk] and w_k, w_v [H, dk, dim]
// C-contiguous, of one type T (float32 or bfloat16 bits); out rounded once. The queries and
// contexts between the three steps (kept by the calling thread from call to call) are float32,
// or for bfloat16 where bf16_dot_products() (dk even, dim a multiple of 32) bfloat16, each
// rounded once, every product a bfloat16 dot product; the queries' map then reads w_k_pairs,
// w_k's pairs of d_kv rows (pair_key_weights), made here from w_k where null.
template <typename T>
void reassociated_attention(const T* xq, const T* w_k, const T* w_v, const StridedRows<T>& states,
                            const int64_t* lengths, T* out, int64_t B, int64_t P, int64_t H, int64_t dk, int64_t dim,
                            float scale, bool reverse, int threads, const uint32_t* w_k_pairs = nullptr);

// Whether a bfloat16 model of d_kv dk and width dim can map its queries on dot products (the
// CPU has AVX512-BF16, dk even, dim a multiple of 32)
bool reassociated_pairs_usable(int64_t dk, int64_t dim);

// Bfloat16 key weights w_k [H, dk, dim] as pairs of consecutive d_kv rows, pairs [H, dk / 2,
// dim] (32-bit words: row 2i's element in the low half, row 2i + 1's in the high half). Throws
// std::invalid_argument where reassociated_pairs_usable(dk, dim) is false.
void pair_key_weights(const uint16_t* w_k, int64_t H, int64_t dk, int64_t dim, uint32_t* pairs);

}  // namespace fastjudge
