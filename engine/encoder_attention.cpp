#include "encoder_attention.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "amx_product.hpp"
#include "causal_attention.hpp"
#include "cpu_parallel.hpp"
#include "small_product.hpp"
#include "vector_math.hpp"

namespace fastjudge {
namespace {

// Query rows a unit of work takes (its outputs stay in cache across the key blocks), and keys a
// block (64 keys of d_model 512: 128 KiB of float32, in the L2 cache for the weighted sum right
// after the scores).
constexpr int64_t kGroupRows = 16;
constexpr int64_t kBlockKeys = 64;

// One thread for each 4 MFLOP: below that a thread's start costs more than its share.
constexpr double kFlopsPerThread = 4e6;
// ... and one for each 256 KiB of weights a map reads
constexpr double kWeightBytesPerThread = 256 * 1024;

// scores[q * kBlockKeys + j] = queries[q] . keys[j] for q < rows (a multiple of kQueries; the
// queries zero past the real ones), j < n: a register block of kKeys keys by kQueries queries at a
// time (16 or 24 accumulators: built for AVX-512's 32 registers), each pair's products summed
// over the lanes at the end (lane_sums, whose tree is the same for every vector: a score's bits
// do not depend on the block). A last short block of keys repeats its last key (its scores are
// never read). ahead: how far on the next block's keys lie (0: none), fetched into L2 a line at a
// time as this block's are read.
template <int kQueries, int kKeys>
__attribute__((always_inline)) inline void block_scores(const float* queries, int64_t rows, const float* keys,
                                                        int64_t ldk, int64_t n, int64_t dim, float* scores,
                                                        int64_t ahead) {
  constexpr int kAcc = kKeys * kQueries;
  static_assert(kAcc == kLanes || kAcc == kLanes + kLanes / 2, "16 or 24 accumulators");
  for (int64_t k0 = 0; k0 < n; k0 += kKeys) {
    const float* key[kKeys];
    for (int k = 0; k < kKeys; ++k) key[k] = keys + std::min<int64_t>(k0 + k, n - 1) * ldk;
    for (int64_t q0 = 0; q0 < rows; q0 += kQueries) {
      Floats acc[kLanes * 2] = {};  // the first kAcc used; the rest zero for the second lane_sums
      for (int64_t d = 0; d < dim; d += kLanes) {
        Floats q[kQueries];
        for (int i = 0; i < kQueries; ++i) {
          q[i] = load(queries + (q0 + i) * dim + d);
          hold<true>(q[i]);
        }
        for (int k = 0; k < kKeys; ++k) {
          if (ahead && q0 == 0) __builtin_prefetch(key[k] + d + ahead, 0, 2);
          Floats kv = load(key[k] + d);
          hold<true>(kv);
          for (int i = 0; i < kQueries; ++i) acc[k * kQueries + i] += kv * q[i];
        }
      }
      float sums[2 * kLanes];
      store(sums, lane_sums(*reinterpret_cast<const Floats(*)[kLanes]>(acc)));
      if constexpr (kAcc > kLanes) store(sums + kLanes, lane_sums(*reinterpret_cast<const Floats(*)[kLanes]>(acc + kLanes)));
      for (int k = 0; k < kKeys && k0 + k < n; ++k)
        for (int i = 0; i < kQueries; ++i) scores[(q0 + i) * kBlockKeys + k0 + k] = sums[k * kQueries + i];
    }
  }
}

// One register block of narrow_block_scores: queries [q0, q0 + kQueries) by the keys key[0,
// kKeys), 8-lane accumulators (kQueries * kKeys <= 12) summed across their lanes by the 8-lane
// tree; each vector read once for all the FMAs that take it: the one held across the block's
// loads (kYmm, hold8) where GCC would fold it into each FMA, a load apiece.
template <int kQueries, int kKeys, bool kYmm>
__attribute__((always_inline)) inline void narrow_scores_block(const float* queries, const float* const* key,
                                                               int64_t q0, int64_t k0, int64_t n, int64_t dim,
                                                               float* scores, int64_t ahead) {
  constexpr int kAcc = kQueries * kKeys;
  static_assert(kAcc <= 12, "12 accumulators, with the vectors they take, fill AVX2's 16 registers");
  Floats8 acc[16] = {};  // the first kAcc used; the rest zero for the second lane_sums
  for (int64_t d = 0; d < dim; d += 8) {
    Floats8 k[kKeys];
    for (int j = 0; j < kKeys; ++j) {
      if (ahead && q0 == 0 && d % kLanes == 0) __builtin_prefetch(key[j] + d + ahead, 0, 2);
      Floats8 kj = load8(key[j] + d);
      hold8<kYmm>(kj);  // held as a temporary: held in the array, it went through the stack
      k[j] = kj;
    }
    for (int i = 0; i < kQueries; ++i) {
      Floats8 q = load8(queries + (q0 + i) * dim + d);
      if constexpr (kKeys > 1) hold8<kYmm>(q);
      for (int j = 0; j < kKeys; ++j) acc[j * kQueries + i] += q * k[j];
    }
  }
  float sums[16];
  store_as(sums, lane_sums(*reinterpret_cast<const Floats8(*)[8]>(acc)));
  if constexpr (kAcc > 8) store_as(sums + 8, lane_sums(*reinterpret_cast<const Floats8(*)[8]>(acc + 8)));
  for (int j = 0; j < kKeys && k0 + j < n; ++j)
    for (int i = 0; i < kQueries; ++i) scores[(q0 + i) * kBlockKeys + k0 + j] = sums[j * kQueries + i];
}

// block_scores built for AVX2 (16 registers of 8 lanes): six queries by two keys a register
// block (12 accumulators: enough FMAs in flight to cover their latency, and the keys read once
// for six queries; Flan-T5-small's six heads of a decoding step take one), the rows past the
// last six two by four (8 accumulators); rows a multiple of two. A score's bits do not depend on
// the block (every sum over d in the same order, the same lane tree).
template <bool kYmm>
__attribute__((always_inline)) inline void narrow_block_scores(const float* queries, int64_t rows, const float* keys,
                                                               int64_t ldk, int64_t n, int64_t dim, float* scores,
                                                               int64_t ahead) {
  const int64_t sixes = rows / 6 * 6;
  for (int64_t k0 = 0; k0 < n; k0 += 2) {
    const float* key[2] = {keys + k0 * ldk, keys + std::min<int64_t>(k0 + 1, n - 1) * ldk};
    for (int64_t q0 = 0; q0 < sixes; q0 += 6)
      narrow_scores_block<6, 2, kYmm>(queries, key, q0, k0, n, dim, scores, ahead);
  }
  if (sixes == rows) return;
  for (int64_t k0 = 0; k0 < n; k0 += 4) {
    const float* key[4];
    for (int j = 0; j < 4; ++j) key[j] = keys + std::min<int64_t>(k0 + j, n - 1) * ldk;
    for (int64_t q0 = sixes; q0 < rows; q0 += 2)
      narrow_scores_block<2, 4, kYmm>(queries, key, q0, k0, n, dim, scores, sixes ? 0 : ahead);
  }
}

// A group's online softmax between blocks: each row's running maximum and total, and its
// weighted sums (sum_rows rows of dim, zeroed)
struct RunningSoftmax {
  float top[kGroupRows], total[kGroupRows];
  RunningSoftmax(int64_t rows, float* sums, int64_t sum_rows, int64_t dim) {
    std::fill_n(top, rows, -__builtin_inff());
    std::fill_n(total, rows, 0.0f);
    std::fill_n(sums, sum_rows * dim, 0.0f);
  }
};

// The online softmax of a block's scores [rows][kBlockKeys] (n of them real) for each query row:
// each turned into its weight against the row's running maximum top[r] (the block's past n set
// to zero), the running total and the row's weighted sums [rows][dim] rescaled where the maximum
// grows. kWide: built for AVX-512, 16 lanes at a time; else 8 (LaneVector).
template <bool kWide>
__attribute__((always_inline)) inline void online_softmax(float* scores, int64_t rows, int64_t n, float scale,
                                                          float* top, float* total, float* sums, int64_t dim) {
  using V = LaneVector<kWide>;
  constexpr int kWidth = kLanesOf<V>;
  const V lowest = V{} - __builtin_inff();
  for (int64_t r = 0; r < rows; ++r) {
    float* w = scores + r * kBlockKeys;
    for (int64_t j = n; j < kBlockKeys; ++j) w[j] = -__builtin_inff();
    V most = lowest;
    for (int64_t j = 0; j < kBlockKeys; j += kWidth) {
      const V x = load_as<V>(w + j) * scale;
      most = x > most ? x : most;
    }
    float m = top[r];
    for (int i = 0; i < kWidth; ++i) m = std::max(m, most[i]);
    if (m > top[r] && top[r] > -__builtin_inff()) {  // earlier weights were against a lower maximum
      const float shrink = exp_nonpositive(V{} + (top[r] - m))[0];
      total[r] *= shrink;
      for (int64_t d = 0; d < dim; d += kWidth) store_as(sums + r * dim + d, load_as<V>(sums + r * dim + d) * shrink);
    }
    top[r] = m;
    V added{};
    for (int64_t j = 0; j < kBlockKeys; j += kWidth) {
      const V x = load_as<V>(w + j) * scale - m;
      const V p = x == lowest ? V{} : exp_nonpositive(x);
      store_as(w + j, p);
      added += p;
    }
    for (int i = 0; i < kWidth; ++i) total[r] += added[i];
  }
}

// The group's outputs: each row's weighted sums over its total, stored as O (rounded once)
template <typename O>
__attribute__((always_inline)) inline void write_group(const float* sums, const float* total, int64_t rows,
                                                       int64_t dim, O* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    for (int64_t d = 0; d < dim; d += kLanes) store_floats(out + r * dim + d, load(sums + r * dim + d) * inverse);
  }
}

// One row's group of query rows [r0, r0 + rows) over its first `length` states (queries of type
// Q, states T, outputs O: float32 or bfloat16 bits each); next: the first state the thread's
// next group reads (null: none). kZmm: built for AVX-512; kYmm: a build with 256-bit registers
// (FASTJUDGE_VERSIONED_YMM).
template <bool kZmm, bool kYmm, typename Q, typename T, typename O>
__attribute__((always_inline)) inline void attend_group(const StridedRows<Q>& query, const StridedRows<T>& states,
                                                        int64_t length, O* out, int64_t b, int64_t r0, int64_t rows,
                                                        int64_t R, int64_t dim, float scale, float* queries,
                                                        float* sums, float* scores, float* block, const T* next) {
  constexpr bool wide = std::is_same_v<T, float>;
  // four queries a register block where they fill it, else two (six rows: no padded row); two
  // in the AVX2 build (narrow_block_scores)
  const bool fours = kZmm && (rows % 4 == 0 || rows > 8);
  const int64_t padded = fours ? (rows + 3) / 4 * 4 : (rows + 1) / 2 * 2;
  for (int64_t r = 0; r < padded; ++r) {
    for (int64_t d = 0; d < dim; d += kLanes)
      store(queries + r * dim + d, r < rows ? load_floats(query.row(b, r0 + r, 0) + d) : Floats{});
  }
  RunningSoftmax running(rows, sums, rows, dim);
  for (int64_t j0 = 0; j0 < length; j0 += kBlockKeys) {
    const int64_t n = std::min(kBlockKeys, length - j0);
    const float* keys;
    int64_t ldk;
    if constexpr (wide) {
      keys = states.row(b, j0, 0), ldk = states.token;
    } else {  // the block in float32, once for both products
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < dim; d += kLanes) store(block + j * dim + d, load_bf16(states.row(b, j0 + j, 0) + d));
      keys = block, ldk = dim;
    }
    // the next block's states, fetched into L2 while this one computes (float32 states are read in
    // place): fetched into L1, the next block's 128 KiB pushed out the one being read (16 rows over
    // 1,200 states, every layer's cross-attention, in-process alternation: 25.5 -> 22.2 ms). The
    // last block fetches the next group's first (64 rows over 128 states, streamed from memory:
    // -8 %; nothing fetched at all: +9 %)
    int64_t ahead = 0;
    if constexpr (wide) ahead = j0 + kBlockKeys < length ? kBlockKeys * ldk : next ? next - keys : 0;
    // a decoding step's six heads (Flan-T5-small's) against four float32 keys at a time, each key
    // read once for all six: every layer's cross-attention of 16 rows over 1,200 states 18.4-28.6
    // -> 14.6-25.8 ms; over bfloat16 states (converted into a buffer first) it was 2 % slower
    if constexpr (!kZmm) {
      narrow_block_scores<kYmm>(queries, padded, keys, ldk, n, dim, scores, ahead);
    } else if (wide && padded == 6) {
      if constexpr (wide) block_scores<6, 4>(queries, padded, keys, ldk, n, dim, scores, ahead);
    } else if (fours) {
      block_scores<4, 4>(queries, padded, keys, ldk, n, dim, scores, ahead);
    } else {
      block_scores<2, 8>(queries, padded, keys, ldk, n, dim, scores, ahead);
    }
    online_softmax<kZmm>(scores, rows, n, scale, running.top, running.total, sums, dim);
    // six rows a register block where the build has 32 registers: a decoding step's six heads
    // read the block's states once
    product<kZmm, false, float, kZmm ? 6 : kProductRows>(scores, kBlockKeys, keys, ldk, sums, dim, rows, n, dim, true);
  }
  write_group(sums, running.total, rows, dim, out + (b * R + r0) * dim);
}

// One call's attention: queries of type Q over states T into outputs O
template <typename Q, typename T, typename O>
struct Attend {
  const StridedRows<Q>& query;
  const StridedRows<T>& states;
  const int64_t* lengths;
  O* out;
  int64_t R, dim;
  float scale;
  int64_t group;  // query rows a unit takes (at most kGroupRows)
  int64_t units;
  bool reverse;
  int64_t first, last;
};

// units [first, last) of `units`, in reverse order where asked (the last unit first): unit u is
// row u / groups, its (u % groups)-th group of query rows
template <bool kZmm, bool kYmm, typename Q, typename T, typename O>
__attribute__((always_inline)) inline void attend_units(const Attend<Q, T, O>& a) {
  const int64_t groups = (a.R + a.group - 1) / a.group, dim = a.dim;
  const std::unique_ptr<float[]> queries(new float[kGroupRows * dim]), sums(new float[kGroupRows * dim]);
  const std::unique_ptr<float[]> scores(new float[kGroupRows * kBlockKeys]);
  const std::unique_ptr<float[]> block(new float[std::is_same_v<T, float> ? 0 : kBlockKeys * dim]);
  const auto unit = [&](int64_t i) { return a.reverse ? a.units - 1 - i : i; };
  for (int64_t i = a.first; i < a.last; ++i) {
    const int64_t u = unit(i), b = u / groups, r0 = (u % groups) * a.group;
    const T* next = i + 1 < a.last ? a.states.row(unit(i + 1) / groups, 0, 0) : nullptr;
    attend_group<kZmm, kYmm>(a.query, a.states, a.lengths[b], a.out, b, r0, std::min(a.group, a.R - r0), a.R, dim,
                             a.scale, queries.get(), sums.get(), scores.get(), block.get(), next);
  }
}

using AttendF32 = Attend<float, float, float>;
// float32 queries and outputs over bfloat16 states (the fused cross-attention of a bfloat16 model)
using AttendMixed = Attend<float, uint16_t, float>;
using AttendBF16 = Attend<uint16_t, uint16_t, uint16_t>;
FASTJUDGE_VERSIONED_YMM(attend_units_f32, attend_units, AttendF32)
FASTJUDGE_VERSIONED_YMM(attend_units_mixed, attend_units, AttendMixed)
FASTJUDGE_VERSIONED_YMM(attend_units_bf16, attend_units, AttendBF16)

#ifdef FASTJUDGE_BF16_DOT
// Bfloat16 attention on CPUs with AVX512-BF16 (bf16_dot_products()): both products as bfloat16
// dot products (vdpbf16ps: two exact bfloat16 products added into each float32 lane, twice the
// multiply-adds of a float32 FMA), the states read in place, never widened. Each block's softmax
// weights are rounded to bfloat16 before the weighted sum, as transformers' eager path rounds
// its attention weights; the scores, the softmax and the running sums stay float32.

// scores[q * kBlockKeys + j] = queries[q] . keys[j] for q < rows (a multiple of kQueries), j < n,
// over bfloat16 rows of dim (a multiple of 32): kQueries queries by four keys a register block,
// each pair's 32-element dot products summed over the lanes at the end; ahead as block_scores
template <int kQueries>
FASTJUDGE_BF16_TARGET inline void block_scores_dot(const uint16_t* queries, int64_t rows, const uint16_t* keys,
                                                   int64_t ldk, int64_t n, int64_t dim, float* scores,
                                                   int64_t ahead) {
  constexpr int kKeys = 4, kAcc = kKeys * kQueries;
  for (int64_t k0 = 0; k0 < n; k0 += kKeys) {
    const uint16_t* key[kKeys];
    for (int k = 0; k < kKeys; ++k) key[k] = keys + std::min<int64_t>(k0 + k, n - 1) * ldk;
    for (int64_t q0 = 0; q0 < rows; q0 += kQueries) {
      Floats acc[kLanes * 2] = {};  // the first kAcc used; the rest zero for the second lane_sums
      for (int64_t d = 0; d < dim; d += 2 * kLanes) {
        __m512bh q[kQueries];
        for (int i = 0; i < kQueries; ++i) {
          q[i] = (__m512bh)_mm512_loadu_si512(queries + (q0 + i) * dim + d);
          asm("" : "+v"(q[i]));  // in a register for the four keys' products, not loaded for each
        }
        for (int k = 0; k < kKeys; ++k) {
          if (ahead && q0 == 0) __builtin_prefetch(key[k] + d + ahead, 0, 2);
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(key[k] + d);
          for (int i = 0; i < kQueries; ++i)
            acc[k * kQueries + i] = (Floats)_mm512_dpbf16_ps((__m512)acc[k * kQueries + i], kv, q[i]);
        }
      }
      float sums[2 * kLanes];
      store(sums, lane_sums(*reinterpret_cast<const Floats(*)[kLanes]>(acc)));
      if constexpr (kAcc > kLanes) store(sums + kLanes, lane_sums(*reinterpret_cast<const Floats(*)[kLanes]>(acc + kLanes)));
      for (int k = 0; k < kKeys && k0 + k < n; ++k)
        for (int i = 0; i < kQueries; ++i) scores[(q0 + i) * kBlockKeys + k0 + k] = sums[k * kQueries + i];
    }
  }
}

// A block's n states (bfloat16 rows of dim, a multiple of 32) as pairs of consecutive keys:
// pairs[p * dim + d] holds key 2p's element d in its low half and key 2p + 1's in its high half
// (zero past the n-th key: a state past a row's length is never read)
FASTJUDGE_BF16_TARGET inline void pack_key_pairs(const uint16_t* keys, int64_t ldk, int64_t n, int64_t dim,
                                                 uint32_t* pairs) {
  // the pairs of an even and an odd word's halves (dims 0, 2, .. and 1, 3, .. of 32) merged back in order
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512i low = _mm512_set1_epi32(0xffff);
  for (int64_t p = 0; 2 * p < n; ++p) {
    const uint16_t* k0 = keys + 2 * p * ldk;
    const uint16_t* k1 = 2 * p + 1 < n ? k0 + ldk : nullptr;
    for (int64_t d = 0; d < dim; d += 2 * kLanes) {
      const __m512i a = _mm512_loadu_si512(k0 + d);
      const __m512i b = k1 ? _mm512_loadu_si512(k1 + d) : _mm512_setzero_si512();
      const __m512i even = _mm512_or_si512(_mm512_and_si512(a, low), _mm512_slli_epi32(b, 16));
      const __m512i odd = _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_andnot_si512(low, b));
      _mm512_storeu_si512(pairs + p * dim + d, _mm512_permutex2var_epi32(even, first, odd));
      _mm512_storeu_si512(pairs + p * dim + d + kLanes, _mm512_permutex2var_epi32(even, second, odd));
    }
  }
}

// Each row's block weights [rows][kBlockKeys] rounded to bfloat16, as pairs of consecutive keys
// [padded][kBlockKeys / 2] (rows past `rows` zero)
FASTJUDGE_BF16_TARGET inline void weight_pairs(const float* weights, int64_t rows, int64_t padded,
                                               uint32_t* pairs) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < kBlockKeys; j += kLanes)
      store_bf16_pairs(pairs + r * (kBlockKeys / 2) + j / 2, load(weights + r * kBlockKeys + j));
  std::fill(pairs + rows * (kBlockKeys / 2), pairs + padded * (kBlockKeys / 2), 0u);
}

// sums[r][d] += sum over key pairs p < count of weights[r][p] . states[p][d] (pairs of bfloat16
// each) for r < rows (a multiple of kRows), d < dim: kRows rows by NV vectors a register block,
// in increasing p
template <int kRows, int NV>
FASTJUDGE_BF16_TARGET inline void weighted_pairs_tile(const uint32_t* weights, const uint32_t* states, int64_t count,
                                                      int64_t dim, float* sums) {
  __m512 acc[kRows][NV];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_loadu_ps(sums + r * dim + v * kLanes);
  for (int64_t p = 0; p < count; ++p) {
    __m512bh s[NV];
    for (int v = 0; v < NV; ++v) s[v] = (__m512bh)_mm512_loadu_si512(states + p * dim + v * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[r * (kBlockKeys / 2) + p]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w, s[v]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(sums + r * dim + v * kLanes, acc[r][v]);
}

template <int kRows>
FASTJUDGE_BF16_TARGET inline void weighted_pairs(const uint32_t* weights, int64_t rows, const uint32_t* states,
                                                 int64_t count, int64_t dim, float* sums) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const uint32_t* w = weights + r0 * (kBlockKeys / 2);
    int64_t d = 0;
    for (; d + 4 * kLanes <= dim; d += 4 * kLanes)
      weighted_pairs_tile<kRows, 4>(w, states + d, count, dim, sums + r0 * dim + d);
    for (; d < dim; d += 2 * kLanes) weighted_pairs_tile<kRows, 2>(w, states + d, count, dim, sums + r0 * dim + d);
  }
}

// What the dot-product groups of one thread hold: the group's queries as bfloat16, its weights
// and the block's states as pairs, its scores and sums in float32
struct DotScratch {
  std::vector<uint16_t> queries;
  std::vector<uint32_t> weights, states;
  std::vector<float> scores, sums;
  // on AMX tiles: the queries as pairs of dims transposed [dim / 2][kTileRows], a block's scores
  // as keys by queries, and a last block's keys padded to kBlockKeys with zeros
  std::vector<uint32_t> query_pairs;
  std::vector<float> key_scores;
  std::vector<uint16_t> last_keys;
  explicit DotScratch(int64_t dim)
      : queries(kDotRows * dim), weights(kDotRows * kBlockKeys / 2), states(kBlockKeys / 2 * dim),
        scores(kDotRows * kBlockKeys), sums(kDotRows * dim), query_pairs(dim / 2 * kTileRows),
        key_scores(kBlockKeys * kTileRows), last_keys(kBlockKeys * dim) {}
  static constexpr int64_t kDotRows = kGroupRows + 2;  // a group's rows padded to a multiple of six
};

static_assert(kGroupRows <= kTileRows, "a group's rows fill one tile");

// attend_group on AMX tiles (dim a multiple of 32, states rows of whole 32-bit words): a block's
// scores as its keys by the group's queries (the keys read in place as the tiles' first operand,
// the queries as pairs of dims transposed once a group as their second: each score the sum a
// query-by-key product gives it), then the weighted values as the group's rows (padded to 16 with
// zero weights) by the block's key pairs, added into the running sums
FASTJUDGE_BF16_TARGET void attend_group_tiles(const StridedRows<uint16_t>& query,
                                              const StridedRows<uint16_t>& states, int64_t length, uint16_t* out,
                                              int64_t b, int64_t r0, int64_t rows, int64_t R, int64_t dim,
                                              float scale, DotScratch& s) {
  const int64_t half = dim / 2;
  std::fill(s.query_pairs.begin(), s.query_pairs.end(), 0u);
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(query.row(b, r0 + r, 0));
    for (int64_t p = 0; p < half; ++p) s.query_pairs[p * kTileRows + r] = q[p];
  }
  RunningSoftmax running(rows, s.sums.data(), kTileRows, dim);
  for (int64_t j0 = 0; j0 < length; j0 += kBlockKeys) {
    const int64_t n = std::min(kBlockKeys, length - j0);
    const uint16_t* keys = states.row(b, j0, 0);
    int64_t ldk = states.token;
    if (n < kBlockKeys) {  // the tiles read whole blocks of 16 keys: none past the states' end
      for (int64_t j = 0; j < n; ++j) std::copy_n(keys + j * ldk, dim, s.last_keys.data() + j * dim);
      std::fill(s.last_keys.begin() + n * dim, s.last_keys.end(), uint16_t{0});
      keys = s.last_keys.data(), ldk = dim;
    }
    const uint32_t* key_words = reinterpret_cast<const uint32_t*>(keys);
    for (int64_t k0 = 0; k0 < n; k0 += kTileRows)
      amx_tile_product(key_words + k0 * ldk / 2, ldk / 2, s.query_pairs.data(), kTileRows, half,
                       s.key_scores.data() + k0 * kTileRows, kTileRows, kTileRows);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) s.scores[r * kBlockKeys + j] = s.key_scores[j * kTileRows + r];
    online_softmax<true>(s.scores.data(), rows, n, scale, running.top, running.total, s.sums.data(), dim);
    weight_pairs(s.scores.data(), rows, kTileRows, s.weights.data());
    pack_key_pairs(keys, ldk, n, dim, s.states.data());
    std::fill(s.states.begin() + (n + 1) / 2 * dim, s.states.end(), 0u);  // zero weights' values: zero
    amx_tile_product(s.weights.data(), kBlockKeys / 2, s.states.data(), dim, kBlockKeys / 2, s.sums.data(), dim, dim,
                     true);
  }
  write_group(s.sums.data(), running.total, rows, dim, out + (b * R + r0) * dim);
}

// attend_group by bfloat16 dot products (dim a multiple of 32)
FASTJUDGE_BF16_TARGET void attend_group_dot(const StridedRows<uint16_t>& query, const StridedRows<uint16_t>& states,
                                            int64_t length, uint16_t* out, int64_t b, int64_t r0, int64_t rows,
                                            int64_t R, int64_t dim, float scale, DotScratch& s) {
  // six rows a register block where they fill it (a decoding step's six heads), else four
  const bool sixes = rows % 6 == 0;
  const int64_t padded = sixes ? rows : (rows + 3) / 4 * 4;
  for (int64_t r = 0; r < rows; ++r) std::copy_n(query.row(b, r0 + r, 0), dim, s.queries.data() + r * dim);
  std::fill(s.queries.data() + rows * dim, s.queries.data() + padded * dim, uint16_t{0});
  RunningSoftmax running(rows, s.sums.data(), padded, dim);
  for (int64_t j0 = 0; j0 < length; j0 += kBlockKeys) {
    const int64_t n = std::min(kBlockKeys, length - j0);
    const uint16_t* keys = states.row(b, j0, 0);
    const int64_t ahead = j0 + kBlockKeys < length ? kBlockKeys * states.token : 0;
    if (sixes) {
      block_scores_dot<6>(s.queries.data(), padded, keys, states.token, n, dim, s.scores.data(), ahead);
    } else {
      block_scores_dot<4>(s.queries.data(), padded, keys, states.token, n, dim, s.scores.data(), ahead);
    }
    online_softmax<true>(s.scores.data(), rows, n, scale, running.top, running.total, s.sums.data(), dim);
    weight_pairs(s.scores.data(), rows, padded, s.weights.data());
    pack_key_pairs(keys, states.token, n, dim, s.states.data());
    if (sixes) {
      weighted_pairs<6>(s.weights.data(), padded, s.states.data(), (n + 1) / 2, dim, s.sums.data());
    } else {
      weighted_pairs<4>(s.weights.data(), padded, s.states.data(), (n + 1) / 2, dim, s.sums.data());
    }
  }
  write_group(s.sums.data(), running.total, rows, dim, out + (b * R + r0) * dim);
}

FASTJUDGE_BF16_TARGET void attend_units_dot(const AttendBF16& a) {
  const int64_t groups = (a.R + a.group - 1) / a.group;
  DotScratch scratch(a.dim);
  const bool tiles = a.states.token % 2 == 0 && a.query.token % 2 == 0 && a.query.head % 2 == 0 &&
                     reinterpret_cast<uintptr_t>(a.states.data) % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(a.query.data) % 4 == 0 && amx_products();
  if (tiles) amx_configure(kTileRows);
  for (int64_t i = a.first; i < a.last; ++i) {
    const int64_t u = a.reverse ? a.units - 1 - i : i;
    const int64_t b = u / groups, r0 = (u % groups) * a.group;
    const auto attend = tiles ? attend_group_tiles : attend_group_dot;
    attend(a.query, a.states, a.lengths[b], a.out, b, r0, std::min(a.group, a.R - r0), a.R, a.dim, a.scale, scratch);
  }
  if (tiles) amx_release();
}
#endif

// Whether attention over bfloat16 states of dim takes the dot products
inline bool dot_products_for(int64_t dim) {
#ifdef FASTJUDGE_BF16_DOT
  return dim % (2 * kLanes) == 0 && bf16_dot_products();
#else
  (void)dim;
  return false;
#endif
}

// The units [first, last) of a bfloat16 attention: by dot products where `dot`, else in float32
void attend_units_bf16_states(const AttendBF16& a, bool dot) {
#ifdef FASTJUDGE_BF16_DOT
  if (dot) return attend_units_dot(a);
#endif
  (void)dot;
  attend_units_bf16(a);
}

// T5's per-head maps around the attention. A unit of work is one head-position pair (head h =
// pair / P, position p = pair % P) and one slice of the weights it reads (64 columns of w_k[h],
// four rows of w_v[h]), taken against every row in blocks of kMapRows: the slice stays in L1
// while the rows pass over it.
constexpr int64_t kMapRows = 4;
constexpr int64_t kMapColumns = 4 * kLanes;
constexpr int kMapOutputs = kLanes / kMapRows;  // four k a unit of the map back
// Rows up to which a map fetches its next unit's weights ahead (past them it is compute-bound;
// one block of kMapRows has no later block to gain from it)
constexpr int64_t kMapFetchRows = 32;

// queries into model space: q[b, h * P + p, c0 ..] = sum over k < dk of x[b, p, h, k] w[h, k, c0 ..]
// for rows [b0, b0 + rows), in register blocks of four rows by NV vectors of columns (rows past
// the block's repeat its last one, never stored); fetch: a line of each of the next unit's weight
// rows, fetched into L2 at every k (null: none)
template <int NV, typename T>
__attribute__((always_inline)) inline void map_query_block(const T* x, const T* w, float* q, int64_t b0, int64_t rows,
                                                           int64_t P, int64_t H, int64_t dk, int64_t dim, int64_t h,
                                                           int64_t p, int64_t c0, const char* fetch) {
  const T* xr[kMapRows];
  for (int r = 0; r < kMapRows; ++r) xr[r] = x + ((std::min<int64_t>(b0 + r, b0 + rows - 1) * P + p) * H + h) * dk;
  Floats acc[kMapRows][NV] = {};
  for (int64_t k = 0; k < dk; ++k) {
    if (fetch) __builtin_prefetch(fetch + k * dim * sizeof(T), 0, 2);
    Floats wk[NV];
    for (int v = 0; v < NV; ++v) wk[v] = load_floats(w + (h * dk + k) * dim + c0 + v * kLanes);
    for (int r = 0; r < kMapRows; ++r) {
      const float a = to_float(xr[r][k]);
      for (int v = 0; v < NV; ++v) acc[r][v] += a * wk[v];
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int v = 0; v < NV; ++v) store(q + ((b0 + r) * H * P + h * P + p) * dim + c0 + v * kLanes, acc[r][v]);
}

// map_query_block<1> built for AVX2: its accumulators as halves of 8 lanes (Floats8: eight
// registers; 16-lane ones would live in memory there), the same sums
template <typename T>
__attribute__((always_inline)) inline void narrow_query_block(const T* x, const T* w, float* q, int64_t b0,
                                                              int64_t rows, int64_t P, int64_t H, int64_t dk,
                                                              int64_t dim, int64_t h, int64_t p, int64_t c0,
                                                              const char* fetch) {
  const T* xr[kMapRows];
  for (int r = 0; r < kMapRows; ++r) xr[r] = x + ((std::min<int64_t>(b0 + r, b0 + rows - 1) * P + p) * H + h) * dk;
  Floats8 acc[kMapRows][2] = {};
  for (int64_t k = 0; k < dk; ++k) {
    if (fetch) __builtin_prefetch(fetch + k * dim * sizeof(T), 0, 2);
    const T* wk = w + (h * dk + k) * dim + c0;
    const Floats8 w0 = load8(wk), w1 = load8(wk + 8);
    for (int r = 0; r < kMapRows; ++r) {
      const float a = to_float(xr[r][k]);
      acc[r][0] += a * w0;
      acc[r][1] += a * w1;
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int v = 0; v < 2; ++v) store_as(q + ((b0 + r) * H * P + h * P + p) * dim + c0 + 8 * v, acc[r][v]);
}

// The units [first, last) of a queries' map, each of its row blocks in turn: unit u is the head-
// position pair u / slices (head h = pair / P, position p = pair % P) and its (u % slices)-th
// kMapColumns columns from c0 (`wide` of them), and block(b0, rows, h, p, c0, wide, fetch) takes
// rows [b0, b0 + rows). The weights w hold `depth` rows of dim a head. A few rows read the unit's
// weights from memory: the next unit's (the same head's next columns, or the next head's first)
// are fetched while these compute, a line of each of its rows per row block (fetch), so its
// first block does not wait on them.
template <typename W, typename Block>
__attribute__((always_inline)) inline void query_map_units(const W* w, int64_t depth, int64_t B, int64_t P,
                                                           int64_t H, int64_t dim, int64_t first, int64_t last,
                                                           Block&& block) {
  const int64_t slices = (dim + kMapColumns - 1) / kMapColumns;
  for (int64_t u = first; u < last; ++u) {
    const int64_t pair = u / slices, h = pair / P, p = pair % P;
    const int64_t c0 = (u % slices) * kMapColumns, wide = std::min(kMapColumns, dim - c0);
    const int64_t next_c0 = c0 + kMapColumns < dim ? c0 + kMapColumns : 0;
    const int64_t next_h = next_c0 ? h : (pair + 1) / P;
    const W* next = u + 1 < last && next_h < H ? w + next_h * depth * dim + next_c0 : nullptr;
    for (int64_t b0 = 0, line = 0; b0 < B; b0 += kMapRows, ++line) {
      const char* fetch = next && line * kLanes < kMapColumns && B > kMapRows && B <= kMapFetchRows
                              ? reinterpret_cast<const char*>(next + line * kLanes) : nullptr;
      block(b0, std::min(kMapRows, B - b0), h, p, c0, wide, fetch);
    }
  }
}

// A queries' map of T: the arguments of map_queries
template <typename T>
struct QueryMap {
  const T* x;
  const T* w;
  float* q;
  int64_t B, P, H, dk, dim, first, last;
};

template <bool kZmm, typename T>
__attribute__((always_inline)) inline void map_queries(const QueryMap<T>& m) {
  const T* x = m.x;
  const T* w = m.w;
  float* q = m.q;
  const int64_t P = m.P, H = m.H, dk = m.dk, dim = m.dim;
  // (inlined: a lambda left out of line would be built for the baseline ISA, not this clone's)
  query_map_units(w, dk, m.B, P, H, dim, m.first, m.last,
                  [&](int64_t b0, int64_t rows, int64_t h, int64_t p, int64_t c0, int64_t wide, const char* fetch)
                      __attribute__((always_inline)) {
                        if (kZmm && wide == kMapColumns) {
                          map_query_block<4>(x, w, q, b0, rows, P, H, dk, dim, h, p, c0, fetch);
                          return;
                        }
                        for (int64_t c = c0; c < c0 + wide; c += kLanes) {
                          const char* ahead = c == c0 ? fetch : nullptr;
                          if constexpr (kZmm) {
                            map_query_block<1>(x, w, q, b0, rows, P, H, dk, dim, h, p, c, ahead);
                          } else {
                            narrow_query_block(x, w, q, b0, rows, P, H, dk, dim, h, p, c, ahead);
                          }
                        }
                      });
}

// The units [first, last) of the contexts' map back to head space, each of its row blocks in
// turn: unit u is the head-position pair u / slices (head h, position p) and its (u % slices)-th
// kMapOutputs values of k from k0; products(cr, wr, fetch, fetch_step, sums) sums the block's
// context rows cr[r] (of dim; rows past B repeat the last) against the unit's weight rows wr[k]
// (k past dk repeat the last) into sums[r * kMapOutputs + k], fetching the line at fetch + i *
// fetch_step at each of its `steps` column steps; the sums are then stored in out[b, p, h, k],
// rounded once. The next unit's weight rows (the next kMapOutputs rows of w, or the next head's
// first) are fetched while these compute, as the queries' map fetches.
template <typename C, typename T, typename Products>
__attribute__((always_inline)) inline void context_map_units(const C* ctx, const T* w, T* out, int64_t B, int64_t P,
                                                             int64_t H, int64_t dk, int64_t dim, int64_t steps,
                                                             int64_t first, int64_t last, Products&& products) {
  constexpr int kOut = kMapOutputs;
  const int64_t slices = (dk + kOut - 1) / kOut;
  for (int64_t u = first; u < last; ++u) {
    const int64_t pair = u / slices, h = pair / P, p = pair % P, k0 = (u % slices) * kOut;
    const T* wr[kOut];
    for (int k = 0; k < kOut; ++k) wr[k] = w + (h * dk + std::min<int64_t>(k0 + k, dk - 1)) * dim;
    const int64_t next_k = k0 + kOut < dk ? k0 + kOut : 0, next_h = next_k ? h : (pair + 1) / P;
    const char* next = u + 1 < last && next_h < H ? reinterpret_cast<const char*>(w + (next_h * dk + next_k) * dim)
                                                  : nullptr;
    const int64_t fetch_bytes = kOut * dim * static_cast<int64_t>(sizeof(T)), blocks = (B + kMapRows - 1) / kMapRows;
    for (int64_t b0 = 0, block = 0; b0 < B; b0 += kMapRows, ++block) {
      const int64_t rows = std::min(kMapRows, B - b0);
      const char* fetch = next && B > kMapRows && B <= kMapFetchRows ? next + block * fetch_bytes / blocks : nullptr;
      const C* cr[kMapRows];
      for (int r = 0; r < kMapRows; ++r)
        cr[r] = ctx + (std::min<int64_t>(b0 + r, b0 + rows - 1) * H * P + h * P + p) * dim;
      float sums[kLanes];
      products(cr, wr, fetch, fetch_bytes / blocks / std::max<int64_t>(1, steps), sums);
      for (int64_t r = 0; r < rows; ++r)
        for (int k = 0; k < kOut && k0 + k < dk; ++k)
          from_float(sums[r * kOut + k], out + (((b0 + r) * P + p) * H + h) * dk + k0 + k);
    }
  }
}

// A contexts' map back to head space into T: the arguments of map_contexts
template <typename T>
struct ContextMap {
  const float* ctx;
  const T* w;
  T* out;
  int64_t B, P, H, dk, dim, first, last;
};

// contexts back to head space: out[b, p, h, k] = ctx[b, h * P + p, :] . w[h, k, :] for the unit's
// four k, four rows by four k at a time, each pair's products summed over the lanes at the end.
// Built for AVX2 (not kZmm): in vectors of 8 lanes, two k at a time (eight accumulators, the four
// rows' contexts held in registers for both: kYmm), summed by the 8-lane tree.
template <bool kZmm, bool kYmm, typename T>
__attribute__((always_inline)) inline void map_contexts(const ContextMap<T>& m) {
  const int64_t dim = m.dim;
  context_map_units(m.ctx, m.w, m.out, m.B, m.P, m.H, m.dk, dim, dim / kLanes, m.first, m.last,
                    [&](const float* const* cr, const T* const* wr, const char* fetch, int64_t fetch_step,
                        float* sums) __attribute__((always_inline)) {
                      if constexpr (kZmm) {
                        Floats acc[kMapRows * kMapOutputs] = {};
                        for (int64_t d = 0; d < dim; d += kLanes) {
                          if (fetch) __builtin_prefetch(fetch + d / kLanes * fetch_step, 0, 2);
                          Floats c[kMapRows];
                          for (int r = 0; r < kMapRows; ++r) c[r] = load(cr[r] + d);
                          for (int k = 0; k < kMapOutputs; ++k) {
                            const Floats wk = load_floats(wr[k] + d);
                            for (int r = 0; r < kMapRows; ++r) acc[r * kMapOutputs + k] += c[r] * wk;
                          }
                        }
                        store(sums, lane_sums(acc));
                      } else {
                        constexpr int kPair = 2;
                        for (int k0 = 0; k0 < kMapOutputs; k0 += kPair) {
                          Floats8 acc[kMapRows * kPair] = {};
                          for (int64_t d = 0; d < dim; d += 8) {
                            if (fetch && k0 == 0 && d % kLanes == 0)
                              __builtin_prefetch(fetch + d / kLanes * fetch_step, 0, 2);
                            Floats8 c[kMapRows];
                            for (int r = 0; r < kMapRows; ++r) {
                              Floats8 x = load8(cr[r] + d);
                              hold8<kYmm>(x);
                              c[r] = x;
                            }
                            for (int k = 0; k < kPair; ++k) {
                              const Floats8 wk = load8(wr[k0 + k] + d);
                              for (int r = 0; r < kMapRows; ++r) acc[r * kPair + k] += c[r] * wk;
                            }
                          }
                          float pair[kMapRows * kPair];
                          store_as(pair, lane_sums(acc));
                          for (int r = 0; r < kMapRows; ++r)
                            for (int k = 0; k < kPair; ++k) sums[r * kMapOutputs + k0 + k] = pair[r * kPair + k];
                        }
                      }
                    });
}

using QueryMapF32 = QueryMap<float>;
using QueryMapBF16 = QueryMap<uint16_t>;
using ContextMapF32 = ContextMap<float>;
using ContextMapBF16 = ContextMap<uint16_t>;
FASTJUDGE_VERSIONED(map_queries_f32, map_queries, QueryMapF32)
FASTJUDGE_VERSIONED(map_queries_bf16, map_queries, QueryMapBF16)
FASTJUDGE_VERSIONED_YMM(map_contexts_f32, map_contexts, ContextMapF32)
FASTJUDGE_VERSIONED_YMM(map_contexts_bf16, map_contexts, ContextMapBF16)

#ifdef FASTJUDGE_BF16_DOT
// The maps on bfloat16 dot products (a bfloat16 model where bf16_dot_products(), d_kv even, dim
// a multiple of 32): queries into model space from the key weights' pairs of consecutive d_kv
// rows (pair_key_weights), x read as pairs of consecutive k, each query rounded to bfloat16 once;
// contexts (bfloat16) back to head space against the value weights' rows as they are.

// map_query_block by dot products: fetch steps a line of the next unit's pair rows at each pair
template <int NV>
FASTJUDGE_BF16_TARGET inline void map_query_block_dot(const uint16_t* x, const uint32_t* pairs, uint16_t* q,
                                                      int64_t b0, int64_t rows, int64_t P, int64_t H, int64_t dk,
                                                      int64_t dim, int64_t h, int64_t p, int64_t c0,
                                                      const char* fetch) {
  const int64_t half = dk / 2;
  const uint16_t* xr[kMapRows];
  for (int r = 0; r < kMapRows; ++r) xr[r] = x + ((std::min<int64_t>(b0 + r, b0 + rows - 1) * P + p) * H + h) * dk;
  __m512 acc[kMapRows][NV];
  for (int r = 0; r < kMapRows; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < half; ++i) {
    if (fetch) __builtin_prefetch(fetch + i * dim * static_cast<int64_t>(sizeof(uint32_t)), 0, 2);
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) {
      w[v] = (__m512bh)_mm512_loadu_si512(pairs + (h * half + i) * dim + c0 + v * kLanes);
      asm("" : "+v"(w[v]));
    }
    for (int r = 0; r < kMapRows; ++r) {
      uint32_t word;
      std::memcpy(&word, xr[r] + 2 * i, sizeof word);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, w[v]);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int v = 0; v < NV; ++v)
      store_floats(q + ((b0 + r) * H * P + h * P + p) * dim + c0 + v * kLanes, (Floats)acc[r][v]);
}

FASTJUDGE_BF16_TARGET void map_queries_dot(const uint16_t* x, const uint32_t* pairs, uint16_t* q, int64_t B,
                                           int64_t P, int64_t H, int64_t dk, int64_t dim, int64_t first,
                                           int64_t last) {
  query_map_units(pairs, dk / 2, B, P, H, dim, first, last,
                  [&](int64_t b0, int64_t rows, int64_t h, int64_t p, int64_t c0, int64_t wide, const char* fetch)
                      FASTJUDGE_BF16_TARGET {
                        if (wide == kMapColumns) {
                          map_query_block_dot<4>(x, pairs, q, b0, rows, P, H, dk, dim, h, p, c0, fetch);
                        } else {
                          for (int64_t c = c0; c < c0 + wide; c += 2 * kLanes)
                            map_query_block_dot<2>(x, pairs, q, b0, rows, P, H, dk, dim, h, p, c,
                                                   c == c0 ? fetch : nullptr);
                        }
                      });
}

// map_contexts by dot products over bfloat16 contexts
FASTJUDGE_BF16_TARGET void map_contexts_dot(const uint16_t* ctx, const uint16_t* w, uint16_t* out, int64_t B,
                                            int64_t P, int64_t H, int64_t dk, int64_t dim, int64_t first,
                                            int64_t last) {
  context_map_units(ctx, w, out, B, P, H, dk, dim, dim / (2 * kLanes), first, last,
                    [&](const uint16_t* const* cr, const uint16_t* const* wr, const char* fetch, int64_t fetch_step,
                        float* sums) FASTJUDGE_BF16_TARGET {
                      Floats acc[kMapRows * kMapOutputs] = {};
                      for (int64_t d = 0; d < dim; d += 2 * kLanes) {
                        if (fetch) __builtin_prefetch(fetch + d / (2 * kLanes) * fetch_step, 0, 2);
                        __m512bh c[kMapRows];
                        for (int r = 0; r < kMapRows; ++r) {
                          c[r] = (__m512bh)_mm512_loadu_si512(cr[r] + d);
                          asm("" : "+v"(c[r]));
                        }
                        for (int k = 0; k < kMapOutputs; ++k) {
                          const __m512bh wk = (__m512bh)_mm512_loadu_si512(wr[k] + d);
                          for (int r = 0; r < kMapRows; ++r)
                            acc[r * kMapOutputs + k] =
                                (Floats)_mm512_dpbf16_ps((__m512)acc[r * kMapOutputs + k], c[r], wk);
                        }
                      }
                      store(sums, lane_sums(acc));
                    });
}
#endif

// threads for `flops` of work: one for each kFlopsPerThread, at most `threads`
int64_t workers_for(double flops, int threads) {
  return std::min<int64_t>(threads, static_cast<int64_t>(flops / kFlopsPerThread) + 1);
}

}  // namespace

// Query rows a unit of the attention takes: kGroupRows, or fewer where B rows of R query rows
// would leave some of `workers` threads idle (a one-row decoding step's heads on one thread).
// Each group reads its row's states itself, and a query's bits do not depend on its group (its
// own lane sums, softmax and weighted sums).
inline int64_t group_rows(int64_t B, int64_t R, int64_t workers) {
  const int64_t groups = std::min(R, std::max((R + kGroupRows - 1) / kGroupRows, (workers + B - 1) / B));
  return (R + groups - 1) / groups;
}

bool reassociated_pairs_usable(int64_t dk, int64_t dim) {
  return cpu_has_bf16_dot() && dk % 2 == 0 && dim % (2 * kLanes) == 0;
}

void pair_key_weights(const uint16_t* w_k, int64_t H, int64_t dk, int64_t dim, uint32_t* pairs) {
#ifdef FASTJUDGE_BF16_DOT
  if (reassociated_pairs_usable(dk, dim)) {
    for (int64_t h = 0; h < H; ++h) pack_key_pairs(w_k + h * dk * dim, dim, dk, dim, pairs + h * (dk / 2) * dim);
    return;
  }
#endif
  (void)w_k, (void)H, (void)pairs;
  throw std::invalid_argument("the key weights' pairs need AVX512-BF16, an even d_kv and dim a multiple of 32");
}

namespace {

// How a reassociated attention's work splits: the maps' threads (a map's weights, H x dk x dim,
// stream from memory at a decoding step's few rows: a thread for each kWeightBytesPerThread of
// them too), the attention's threads, query rows a unit and units
struct ReassociatedSplit {
  int64_t map_workers, workers, group, units;

  ReassociatedSplit(const int64_t* lengths, int64_t B, int64_t H, int64_t P, int64_t dk, int64_t dim,
                    std::size_t type_bytes, int threads) {
    const int64_t R = H * P;
    const double map_bytes = static_cast<double>(H * dk * dim) * static_cast<double>(type_bytes);
    map_workers = std::min<int64_t>(threads, static_cast<int64_t>(std::max(2.0 * B * R * dk * dim / kFlopsPerThread,
                                                                             map_bytes / kWeightBytesPerThread)) + 1);
    double keys = 0.0;
    for (int64_t b = 0; b < B; ++b) keys += static_cast<double>(lengths[b]);
    workers = workers_for(4.0 * R * dim * keys, threads), group = group_rows(B, R, workers);
    units = B * ((R + group - 1) / group);
  }
};

#ifdef FASTJUDGE_BF16_DOT
// reassociated_attention of a bfloat16 model on dot products: the queries in model space and the
// contexts as bfloat16 (kept from call to call, they only grow), the key weights' pairs given or
// made here
void reassociated_dot(const uint16_t* xq, const uint16_t* w_k, const uint32_t* w_k_pairs, const uint16_t* w_v,
                      const StridedRows<uint16_t>& states, const int64_t* lengths, uint16_t* out, int64_t B, int64_t P,
                      int64_t H, int64_t dk, int64_t dim, float scale, bool reverse, const ReassociatedSplit& split) {
  const int64_t R = H * P;
  thread_local std::vector<uint16_t> scratch;
  thread_local std::vector<uint32_t> own_pairs;
  const auto held = static_cast<std::size_t>(2 * B * R * dim);
  if (scratch.size() < held) scratch.resize(held);
  if (!w_k_pairs) {
    own_pairs.resize(static_cast<std::size_t>(H * dk / 2 * dim));
    pair_key_weights(w_k, H, dk, dim, own_pairs.data());
    w_k_pairs = own_pairs.data();
  }
  uint16_t* q = scratch.data();
  uint16_t* ctx = q + B * R * dim;
  parallel_ranges(R * ((dim + kMapColumns - 1) / kMapColumns), split.map_workers, 1, [&](int64_t first, int64_t last) {
    map_queries_dot(xq, w_k_pairs, q, B, P, H, dk, dim, first, last);
  });
  const StridedRows<uint16_t> queries{q, R * dim, dim, 0};
  parallel_ranges(split.units, split.workers, 1, [&](int64_t first, int64_t last) {
    attend_units_dot(AttendBF16{queries, states, lengths, ctx, R, dim, scale, split.group, split.units, reverse, first,
                                last});
  });
  parallel_ranges(R * ((dk + kMapOutputs - 1) / kMapOutputs), split.map_workers, 1, [&](int64_t first, int64_t last) {
    map_contexts_dot(ctx, w_v, out, B, P, H, dk, dim, first, last);
  });
}
#endif

}  // namespace

template <typename T>
void reassociated_attention(const T* xq, const T* w_k, const T* w_v, const StridedRows<T>& states,
                            const int64_t* lengths, T* out, int64_t B, int64_t P, int64_t H, int64_t dk, int64_t dim,
                            float scale, bool reverse, int threads, const uint32_t* w_k_pairs) {
  const int64_t R = H * P;
  if (B == 0 || R == 0 || dk == 0) return;
  const ReassociatedSplit split(lengths, B, H, P, dk, dim, sizeof(T), threads);
  constexpr bool wide = std::is_same_v<T, float>;
#ifdef FASTJUDGE_BF16_DOT
  if constexpr (!wide) {
    if (reassociated_pairs_usable(dk, dim) && bf16_dot_products()) {
      reassociated_dot(xq, w_k, w_k_pairs, w_v, states, lengths, out, B, P, H, dk, dim, scale, reverse, split);
      return;
    }
  }
#endif
  (void)w_k_pairs;
  // the queries in model space and the contexts, float32, kept from call to call (they only grow)
  thread_local std::vector<float> scratch;
  const auto held = static_cast<std::size_t>(2 * B * R * dim);
  if (scratch.size() < held) scratch.resize(held);
  float* q = scratch.data();
  float* ctx = q + B * R * dim;
  const int64_t map_workers = split.map_workers, group = split.group, units = split.units;
  parallel_ranges(R * ((dim + kMapColumns - 1) / kMapColumns), map_workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (wide) {
      map_queries_f32(QueryMapF32{xq, w_k, q, B, P, H, dk, dim, first, last});
    } else {
      map_queries_bf16(QueryMapBF16{xq, w_k, q, B, P, H, dk, dim, first, last});
    }
  });
  const StridedRows<float> queries{q, R * dim, dim, 0};
  parallel_ranges(units, split.workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (wide) {
      attend_units_f32(AttendF32{queries, states, lengths, ctx, R, dim, scale, group, units, reverse, first, last});
    } else {
      attend_units_mixed(AttendMixed{queries, states, lengths, ctx, R, dim, scale, group, units, reverse, first, last});
    }
  });
  parallel_ranges(R * ((dk + kMapOutputs - 1) / kMapOutputs), map_workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (wide) {
      map_contexts_f32(ContextMapF32{ctx, w_v, out, B, P, H, dk, dim, first, last});
    } else {
      map_contexts_bf16(ContextMapBF16{ctx, w_v, out, B, P, H, dk, dim, first, last});
    }
  });
}

template void reassociated_attention<float>(const float*, const float*, const float*, const StridedRows<float>&,
                                            const int64_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                            float, bool, int, const uint32_t*);
template void reassociated_attention<uint16_t>(const uint16_t*, const uint16_t*, const uint16_t*,
                                               const StridedRows<uint16_t>&, const int64_t*, uint16_t*, int64_t,
                                               int64_t, int64_t, int64_t, int64_t, float, bool, int, const uint32_t*);

template <typename T>
void encoder_attention(const StridedRows<T>& query, const StridedRows<T>& states, const int64_t* lengths, T* out,
                       int64_t B, int64_t R, int64_t dim, float scale, bool reverse, int threads) {
  if (B == 0 || R == 0 || dim == 0) return;
  double keys = 0.0;
  for (int64_t b = 0; b < B; ++b) keys += static_cast<double>(lengths[b]);
  const int64_t workers = workers_for(4.0 * R * dim * keys, threads), group = group_rows(B, R, workers);
  const int64_t units = B * ((R + group - 1) / group);
  [[maybe_unused]] const bool dot = !std::is_same_v<T, float> && dot_products_for(dim);
  parallel_ranges(units, workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (std::is_same_v<T, float>) {
      attend_units_f32(AttendF32{query, states, lengths, out, R, dim, scale, group, units, reverse, first, last});
    } else {
      attend_units_bf16_states(
          AttendBF16{query, states, lengths, out, R, dim, scale, group, units, reverse, first, last}, dot);
    }
  });
}

template void encoder_attention<float>(const StridedRows<float>&, const StridedRows<float>&, const int64_t*, float*,
                                       int64_t, int64_t, int64_t, float, bool, int);
template void encoder_attention<uint16_t>(const StridedRows<uint16_t>&, const StridedRows<uint16_t>&,
                                          const int64_t*, uint16_t*, int64_t, int64_t, int64_t, float, bool, int);

}  // namespace fastjudge
