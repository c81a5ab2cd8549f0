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
// C-contiguous, of one type T (float32 or bfloat16 bits); the queries and contexts stay float32
// between the three steps (kept by the calling thread from call to call), out rounded once.
template <typename T>
void reassociated_attention(const T* xq, const T* w_k, const T* w_v, const StridedRows<T>& states,
                            const int64_t* lengths, T* out, int64_t B, int64_t P, int64_t H, int64_t dk, int64_t dim,
                            float scale, bool reverse, int threads);

}  // namespace fastjudge
