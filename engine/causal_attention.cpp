#include "causal_attention.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "amx_product.hpp"
#include "cpu_parallel.hpp"
#include "small_product.hpp"
#include "vector_math.hpp"


namespace fastjudge {
namespace {

// A register block of the micro-kernel: kRows rows of kCols columns (16 accumulators), and the
// query tokens a tile takes (two blocks of rows).
constexpr int kRows = 8;
constexpr int kCols = 2 * kLanes;
constexpr int kTile = 2 * kRows;

// One thread for each 4 MFLOP of attention: below that a thread's start costs more than its share.
constexpr double kFlopsPerThread = 4e6;
// ... and, for a decoding step's few tokens, one for each 256 KiB of keys and values they read
constexpr double kKeyBytesPerThread = 256 * 1024;

inline int64_t round_up(int64_t n, int64_t step) { return (n + step - 1) / step * step; }

// c[r][w] (= or +=) sum over k < depth of a[r * lda + k] * b[k * ldb + w] for r < kRows, w < kCols,
// in increasing k: the query-key scores (a = queries, b = keys transposed) and the weighted values
// (a = softmax weights, b = values) alike
__attribute__((always_inline)) inline void block_product(const float* a, int64_t lda, const float* b, int64_t ldb,
                                                         int64_t depth, float* c, int64_t ldc, bool accumulate) {
  Floats acc[kRows][2] = {};
  if (accumulate) {
    for (int r = 0; r < kRows; ++r) acc[r][0] = load(c + r * ldc), acc[r][1] = load(c + r * ldc + kLanes);
  }
  for (int64_t k = 0; k < depth; ++k) {
    const Floats b0 = load(b + k * ldb), b1 = load(b + k * ldb + kLanes);
    for (int r = 0; r < kRows; ++r) {
      const float ar = a[r * lda + k];
      acc[r][0] += ar * b0;
      acc[r][1] += ar * b1;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    store(c + r * ldc, acc[r][0]);
    store(c + r * ldc + kLanes, acc[r][1]);
  }
}

// Rows of a register block: kRows where the build has AVX-512's 32 registers (kWide), else
// product()'s narrow blocks of kNarrowRows (AVX2's 16 registers would spill block_product's 16
// accumulators); a tile of query tokens is two blocks
template <bool kWide>
constexpr int64_t kBlockRows = kWide ? kRows : kNarrowRows;

// c[r][0 .. cols) (= or +=; cols a multiple of kCols) for r < kBlockRows<kWide>, as
// block_product: the same sums in the same order whichever blocks compute them
template <bool kWide>
__attribute__((always_inline)) inline void block_rows(const float* a, int64_t lda, const float* b, int64_t ldb,
                                                      int64_t depth, float* c, int64_t ldc, int64_t cols,
                                                      bool accumulate = false) {
  if constexpr (kWide) {
    for (int64_t j0 = 0; j0 < cols; j0 += kCols) block_product(a, lda, b + j0, ldb, depth, c + j0, ldc, accumulate);
  } else {
    product<false, false, float, kProductRows, true>(a, lda, b, ldb, c, ldc, kNarrowRows, depth, cols, accumulate);
  }
}

// A tile's products go chunk by chunk, kChunk keys at a time (a chunk of the keys' columns for
// the scores, of the values' rows for the weighted sum), each chunk for every block of the tile's
// rows in turn: the later blocks find in L1 the lines the first read (16 KiB of a 64-dim head),
// where a block over all the keys read each of them from L2 again, and the keys are packed a
// chunk's columns together, so a block's steps stay within four pages (keys transposed over the
// whole prompt put each step on its own page: 64 of them for a block, more than the L1 TLB held).
constexpr int64_t kChunk = 64;
// Keys (and values) ahead of the one being packed whose rows are fetched meanwhile
constexpr int64_t kPackAhead = 8;

// softmax weights of one query row over its visible keys j <= last, in place on scale x scores,
// zero from last + 1 to width (a multiple of kLanes); returns 1 / their sum. kWide: built for
// AVX-512, 16 lanes at a time; else 8 (LaneVector)
template <bool kWide>
__attribute__((always_inline)) inline float softmax_row(float* row, int64_t last, int64_t width, float scale) {
  using V = LaneVector<kWide>;
  constexpr int64_t lanes = kLanesOf<V>;
  const int64_t visible = last + 1, full = visible / lanes * lanes;
  V top = V{} - __builtin_inff();
  for (int64_t j = 0; j < full; j += lanes) {
    const V x = load_as<V>(row + j) * scale;
    top = x > top ? x : top;
  }
  float m = top[0];
  for (int w = 1; w < lanes; ++w) m = std::max(m, top[w]);
  for (int64_t j = full; j < visible; ++j) m = std::max(m, row[j] * scale);
  for (int64_t j = visible; j < width; ++j) row[j] = -__builtin_inff();  // masked: exp gives 0 below
  V total{};
  for (int64_t j = 0; j < width; j += lanes) {
    const V x = load_as<V>(row + j) * scale - m;
    V p = exp_nonpositive(x);
    p = x == V{} - __builtin_inff() ? V{} : p;
    store_as(row + j, p);
    total += p;
  }
  float sum = 0.0f;
  for (int w = 0; w < lanes; ++w) sum += total[w];
  return 1.0f / sum;
}

// The scores of query head h's token at position `position` (its offset plus t) against keys
// j < visible: scale x score plus the bias of the key's distance, bias[h][position - j]; the
// softmax then takes them with scale 1
inline void add_distance_bias(const CausalProblem& p, int64_t h, int64_t position, float* w, int64_t visible) {
  const float* bias = p.bias + h * p.bias_stride + position;
  for (int64_t j = 0; j < visible; ++j) w[j] = w[j] * p.scale + bias[-j];
}

// One (row, key head) pair: its row b and key head hk, its cached keys, its real tokens and the
// keys any of its queries sees (none when it has no real token)
struct Pair {
  int64_t b, hk, offset, real, seen;
};

// the pair's bookkeeping, with the outputs of its padding tokens written as zeros
template <typename T>
Pair start_pair(const CausalProblem& p, int64_t pair, T* out) {
  const int64_t b = pair / p.Hkv, hk = pair % p.Hkv, group = p.H / p.Hkv;
  const int64_t offset = p.offsets ? p.offsets[b] : 0, real = p.counts ? p.counts[b] : p.S;
  for (int64_t t = real; t < p.S; ++t)
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) std::fill_n(out + ((b * p.S + t) * p.H + h) * p.dim, p.dim, T{});
  return {b, hk, offset, real, real ? p.last_key(offset, real - 1) + 1 : 0};
}

// tile(h, t0, rows, width) for each tile of kTokens query tokens (rows of them) of each of the
// pair's query heads h; width: the tile's keys, whole register blocks
template <int64_t kTokens = kTile, typename Tile>
__attribute__((always_inline)) inline void for_each_tile(const CausalProblem& p, const Pair& pr, Tile tile) {
  const int64_t group = p.H / p.Hkv;
  for (int64_t h = pr.hk * group; h < (pr.hk + 1) * group; ++h) {
    for (int64_t t0 = 0; t0 < pr.real; t0 += kTokens) {
      const int64_t rows = std::min<int64_t>(kTokens, pr.real - t0);
      tile(h, t0, rows, round_up(p.last_key(pr.offset, t0 + rows - 1) + 1, kCols));
    }
  }
}

// The pairs a thread packs and attends, in an order where the rows that share a prefix snapshot's
// columns follow each other for a key head (CausalProblem::shared_from; order null: the pairs'
// own order, each packing all its keys). A pair whose shared columns the buffers already hold
// (packed by an earlier pair of the same snapshot and key head) packs only its keys past them:
// the buffers then hold what packing all of them would, and every output keeps its bits.
struct PairOrder {
  const int64_t* order = nullptr;
  int64_t held_source = -1, held_hk = -1;  // whose shared columns the buffers hold

  int64_t pair(int64_t i) const { return order ? order[i] : i; }
  // the first key pair `pr` of problem p packs
  int64_t first_key(const CausalProblem& p, const Pair& pr) const {
    return order && p.shared_from[pr.b] == held_source && pr.hk == held_hk ? p.shared_columns : 0;
  }
  // after `pr` packed keys [from, seen)
  void packed(const CausalProblem& p, const Pair& pr, int64_t from) {
    if (!order || from > 0) return;
    const bool holds = pr.seen >= p.shared_columns;
    held_source = holds ? p.shared_from[pr.b] : -1, held_hk = holds ? pr.hk : -1;
  }
};

// Register blocks of query tokens a tile takes: two of AVX-512's eight rows; four of AVX2's six,
// so each chunk of keys read into L1 serves three more blocks (two blocks a tile: a prompt of
// 1,200 tokens, T5-small's heads, one thread, 45.6-52.1 -> 38.5-49.5 ms; six: no better than four)
template <bool kWide>
constexpr int64_t kTileBlocks = kWide ? 2 : 4;

// (row, key head) pairs [first, last): their keys and values packed once in float32, then every
// tile of kTileBlocks register blocks of query tokens of each of the grouped query heads
template <bool kWide, typename T>
__attribute__((always_inline)) inline void attend_pairs(const CausalProblem& p, const StridedRows<T>& query,
                                                        const StridedRows<T>& key, const StridedRows<T>& value,
                                                        T* out, int64_t first, int64_t last, PairOrder in) {
  const int64_t S = p.S, dim = p.dim;
  constexpr int64_t kRowsHere = kBlockRows<kWide>, kTileHere = kTileBlocks<kWide> * kRowsHere;
  // keys transposed in chunks of kChunk columns, [W / kChunk][dim][kChunk]; the scores
  // [rows][ldk], ldk an odd number of register blocks (rows a multiple of 256 bytes apart fall
  // into a few cache sets)
  int64_t ldk = round_up(p.W, kCols);
  if ((ldk / kCols) % 2 == 0) ldk += kCols;
  const int64_t ldv = round_up(dim, kCols);  // values [W][ldv], zero past dim
  std::vector<float> keys(static_cast<std::size_t>(round_up(p.W, kChunk) * dim), 0.0f);
  std::vector<float> values(static_cast<std::size_t>(p.W * ldv), 0.0f);
  std::vector<float> queries(static_cast<std::size_t>(kTileHere * dim), 0.0f);
  std::vector<float> weights(static_cast<std::size_t>(kTileHere * ldk), 0.0f);
  std::vector<float> sums(static_cast<std::size_t>(kTileHere * ldv));
  for (int64_t i = first; i < last; ++i) {
    const Pair pr = start_pair(p, in.pair(i), out);
    const int64_t b = pr.b, hk = pr.hk, offset = pr.offset, from = in.first_key(p, pr);
    for (int64_t j = from; j < pr.seen; ++j) {
      const T* k = key.row(b, j, hk);
      const T* v = value.row(b, j, hk);
      if (j + kPackAhead < pr.seen) {  // rows far apart: the hardware's stream would not fetch them
        const char* k_ahead = reinterpret_cast<const char*>(key.row(b, j + kPackAhead, hk));
        const char* v_ahead = reinterpret_cast<const char*>(value.row(b, j + kPackAhead, hk));
        for (int64_t at = 0; at < dim * int64_t(sizeof(T)); at += 64) {
          __builtin_prefetch(k_ahead + at);
          __builtin_prefetch(v_ahead + at);
        }
      }
      float* column = keys.data() + j / kChunk * kChunk * dim + j % kChunk;
      for (int64_t d = 0; d < dim; ++d) column[d * kChunk] = to_float(k[d]);
      for (int64_t d = 0; d < dim; ++d) values[j * ldv + d] = to_float(v[d]);
    }
    in.packed(p, pr, from);
    // (inlined: a lambda left out of line would be built for the baseline ISA, not this clone's)
    for_each_tile<kTileHere>(p, pr, [&](int64_t h, int64_t t0, int64_t rows, int64_t width)
                             __attribute__((always_inline)) {
      for (int64_t r = 0; r < rows; ++r) {
        const T* q = query.row(b, t0 + r, h);
        for (int64_t d = 0; d < dim; ++d) queries[r * dim + d] = to_float(q[d]);
      }
      float* scores = weights.data();
      for (int64_t c0 = 0; c0 < width; c0 += kChunk)
        for (int64_t r0 = 0; r0 < rows; r0 += kRowsHere)
          block_rows<kWide>(queries.data() + r0 * dim, dim, keys.data() + c0 * dim, kChunk, dim, scores + r0 * ldk + c0,
                            ldk, std::min(kChunk, width - c0));
      float inverse[kTileHere];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t last = p.last_key(offset, t0 + r);
        if (p.bias) add_distance_bias(p, h, offset + t0 + r, scores + r * ldk, last + 1);
        inverse[r] = softmax_row<kWide>(scores + r * ldk, last, width, p.bias ? 1.0f : p.scale);
      }
      for (int64_t r = rows; r < round_up(rows, kRowsHere); ++r) std::fill(scores + r * ldk, scores + r * ldk + width, 0.0f);
      // each block's rows: the keys every row of the block sees, as one product (its sums go on
      // from chunk to chunk); then each row's share of the block's own diagonal, so no value
      // past a row's last key is ever read for it (a zero weight times a NaN would still be NaN)
      auto before = [&](int64_t r0) { return std::min(offset + t0 + r0, p.W); };
      const int64_t deepest = before(round_up(rows, kRowsHere) - kRowsHere);  // the last block's
      for (int64_t k0 = 0; k0 == 0 || k0 < deepest; k0 += kChunk) {
        for (int64_t r0 = 0; r0 < rows; r0 += kRowsHere) {
          const int64_t depth = std::min(kChunk, before(r0) - k0);
          if (k0 == 0 || depth > 0)  // (every block's sums are written once, as zeros where it sees no key)
            block_rows<kWide>(scores + r0 * ldk + k0, ldk, values.data() + k0 * ldv, ldv, std::max<int64_t>(depth, 0),
                              sums.data() + r0 * ldv, ldv, ldv, k0 > 0);
        }
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kRowsHere) {
        const int64_t before_block = before(r0);
        for (int64_t r = r0; r < std::min(rows, r0 + kRowsHere); ++r) {
          float* o = sums.data() + r * ldv;
          for (int64_t j = before_block; j <= p.last_key(offset, t0 + r); ++j) {
            const float w = scores[r * ldk + j];
            const float* vj = values.data() + j * ldv;
            for (int64_t d = 0; d < ldv; ++d) o[d] += w * vj[d];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* o = out + ((b * S + t0 + r) * p.H + h) * dim;
        for (int64_t d = 0; d < dim; ++d) from_float(sums[r * ldv + d] * inverse[r], o + d);
      }
    });
  }
}

// Few new tokens a row (decoding and jump-forward steps, at most kFewTokens): a (row, key head)
// pair's grouped query rows, 16 at a time, take their scores against the keys read in place,
// with no packing pass (which would cost as much as the products themselves for a handful of
// queries). Up to kLaneSumRows query rows: each key's products with a query summed across
// lanes (few_row_scores); more: one product with the keys as its rows and the queries
// transposed as its 16 columns (a key's dims against all rows at once). Then a softmax per
// query row, its weights normalised (and, where bfloat16 attention takes bfloat16 dot products,
// rounded to bfloat16 as there), and the weighted values: the keys every row sees as a second
// product, each row's own later keys after. No value past a row's last key is read for it, and a
// later key's score never reaches its softmax. bfloat16 keys and values are widened to float32
// in registers as they load, except the keys of the transposed product, which go through
// float32 blocks of kBlockKeys rows (converting every block through a buffer made the context of
// a bfloat16 decoding step compute-bound: 0.76 ms for 11 MB at 16 rows).
constexpr int64_t kBlockKeys = 64;
constexpr int64_t kLaneSumRows = 4;

// the most real tokens a row of the problem has
inline int64_t real_max(const CausalProblem& p) {
  if (!p.counts) return p.S;
  int64_t most = 0;
  for (int64_t b = 0; b < p.B; ++b) most = std::max(most, p.counts[b]);
  return most;
}

// Asks for the first keys and values a pair sees (up to kFetchBytes of each) to be brought into
// cache while the pair before it computes: a decoding step's few queries do little work on each
// key, and a row's cached keys are seldom in cache (a step's weights stream through it), so
// otherwise each pair would wait on its keys' first reads. Only the first: the hardware streams
// the rest of a long row once it is read in order, and fetching all of it would push the current
// pair's keys out of the cache.
constexpr int64_t kFetchBytes = 4096;

template <typename T>
__attribute__((always_inline)) inline void fetch_keys(const CausalProblem& p, const StridedRows<T>& key,
                                                      const StridedRows<T>& value, int64_t pair) {
  constexpr int64_t kLine = 64;
  const int64_t b = pair / p.Hkv, hk = pair % p.Hkv, real = p.counts ? p.counts[b] : p.S;
  if (real == 0) return;
  const int64_t bytes = p.dim * int64_t(sizeof(T));
  const int64_t seen = std::min(p.last_key(p.offsets[b], real - 1) + 1, std::max<int64_t>(1, kFetchBytes / bytes));
  for (int64_t j = 0; j < seen; ++j) {
    const char* k = reinterpret_cast<const char*>(key.row(b, j, hk));
    const char* v = reinterpret_cast<const char*>(value.row(b, j, hk));
    for (int64_t at = 0; at < bytes; at += kLine) {
      __builtin_prefetch(k + at);
      __builtin_prefetch(v + at);
    }
  }
}

// The scores of R query rows (row r at q + r * dim) against m keys (key k at keys + k * ldk,
// float32 or bfloat16), into w[r * ldw + k]: each the sum of the row's products with the key lane
// by lane over dim / 16 vectors in increasing order, then across its lanes. One lane_sums call
// (whose tree is the same for each of its 16 vectors: a row's bits do not depend on R) sums
// 16 / R keys of every row, so each key vector is loaded once for all R rows, and its 16 sums
// stay in registers (a loop over a runtime count of keys kept them in memory).
template <int R, bool kZmm, typename K>
__attribute__((always_inline)) inline void few_row_scores(const float* q, int64_t dim, const K* keys, int64_t ldk,
                                                          int64_t m, float* w, int64_t ldw) {
  constexpr int kKeys = kLanes / R;
  int64_t k0 = 0;
  for (; k0 + kKeys <= m; k0 += kKeys) {
    const K* block = keys + k0 * ldk;
    Floats acc[kLanes] = {};  // indexed by constants only: held in registers
#pragma GCC unroll 16
    for (int k = 0; k < kKeys; ++k) {
      for (int64_t d = 0; d < dim; d += kLanes) {
        Floats kd = load_floats(block + k * ldk + d);
        if constexpr (R > 1) hold<kZmm>(kd);
        for (int r = 0; r < R; ++r) acc[r * kKeys + k] += load(q + r * dim + d) * kd;
      }
    }
    float sums[kLanes];
    store(sums, lane_sums(acc));
    for (int r = 0; r < R; ++r) std::copy_n(sums + r * kKeys, kKeys, w + r * ldw + k0);
  }
  if (k0 == m) return;
  const int n = static_cast<int>(m - k0);
  Floats acc[kLanes] = {};
  for (int k = 0; k < n; ++k)
    for (int64_t d = 0; d < dim; d += kLanes)
      for (int r = 0; r < R; ++r) acc[r * kKeys + k] += load(q + r * dim + d) * load_floats(keys + (k0 + k) * ldk + d);
  float sums[kLanes];
  store(sums, lane_sums(acc));
  for (int r = 0; r < R; ++r) std::copy_n(sums + r * kKeys, n, w + r * ldw + k0);
}

// few_row_scores built for AVX2: the same products in vectors of 8 lanes (Floats8; 16-lane
// accumulators would live in memory there), summed across their lanes by the 8-lane tree, 8 / R
// keys a call (two for three rows): a row's bits again do not depend on R. A whole block takes
// a vector of every key for each vector of the R queries, the queries held in registers for all
// its keys' FMAs where the build has 256-bit registers (kYmm: hold8): R + 8 / R loads for 8
// FMAs, where a key's dims in turn reloaded the queries for each (1 + R loads for R FMAs).
template <int R, bool kYmm, typename K>
__attribute__((always_inline)) inline void narrow_row_scores(const float* q, int64_t dim, const K* keys, int64_t ldk,
                                                             int64_t m, float* w, int64_t ldw) {
  constexpr int kKeys = 8 / R;
  for (int64_t k0 = 0; k0 < m; k0 += kKeys) {
    const K* block = keys + k0 * ldk;
    const int n = static_cast<int>(std::min<int64_t>(kKeys, m - k0));
    Floats8 acc[8] = {};  // indexed by constants only where the block is whole: held in registers
    if (n == kKeys) {
      for (int64_t d = 0; d < dim; d += 8) {
        Floats8 qd[R];
        for (int r = 0; r < R; ++r) {
          Floats8 x = load8(q + r * dim + d);
          hold8<kYmm>(x);
          qd[r] = x;
        }
        for (int k = 0; k < kKeys; ++k) {
          const Floats8 kd = load8(block + k * ldk + d);
          for (int r = 0; r < R; ++r) acc[folded_vector(r * kKeys + k)] += qd[r] * kd;
        }
      }
    } else {
      for (int k = 0; k < n; ++k)
        for (int64_t d = 0; d < dim; d += 8)
          for (int r = 0; r < R; ++r) acc[folded_vector(r * kKeys + k)] += load8(q + r * dim + d) * load8(block + k * ldk + d);
    }
    float sums[8];
    store_as(sums, folded_lane_sums(acc));  // row r's sums at r * kKeys
    if (n == kKeys) {  // a constant count: each row's sums stored straight from the register
      for (int r = 0; r < R; ++r) std::copy_n(sums + r * kKeys, kKeys, w + r * ldw + k0);
    } else {
      for (int r = 0; r < R; ++r) std::copy_n(sums + r * kKeys, n, w + r * ldw + k0);
    }
  }
}

template <bool kZmm, bool kYmm, typename K>
__attribute__((always_inline)) inline void few_row_scores(int64_t rows, const float* q, int64_t dim,
                                                          const K* keys, int64_t ldk, int64_t m, float* w,
                                                          int64_t ldw) {
  if constexpr (!kZmm) {
    switch (rows) {
      case 1: return narrow_row_scores<1, kYmm>(q, dim, keys, ldk, m, w, ldw);
      case 2: return narrow_row_scores<2, kYmm>(q, dim, keys, ldk, m, w, ldw);
      case 3: return narrow_row_scores<3, kYmm>(q, dim, keys, ldk, m, w, ldw);
      default: return narrow_row_scores<4, kYmm>(q, dim, keys, ldk, m, w, ldw);
    }
  }
  switch (rows) {
    case 1: return few_row_scores<1, kZmm>(q, dim, keys, ldk, m, w, ldw);
    case 2: return few_row_scores<2, kZmm>(q, dim, keys, ldk, m, w, ldw);
    case 3: return few_row_scores<3, kZmm>(q, dim, keys, ldk, m, w, ldw);
    default: return few_row_scores<4, kZmm>(q, dim, keys, ldk, m, w, ldw);
  }
}

template <bool kZmm, bool kYmm, typename T>
__attribute__((always_inline)) inline void attend_few_pairs(const CausalProblem& p, const StridedRows<T>& query,
                                                            const StridedRows<T>& key, const StridedRows<T>& value,
                                                            T* out, bool round_weights, int64_t first, int64_t last) {
  constexpr bool wide = std::is_same_v<T, float>;
  const int64_t S = p.S, dim = p.dim, group = p.H / p.Hkv, ldw = round_up(p.W, kLanes);
  // scratch left uninitialised (every entry is written before it is read): zeroing the score
  // rows cost a step of one row over a few hundred keys more than its products
  const std::unique_ptr<float[]> queries(new float[kLanes * dim]), sums(new float[kLanes * dim]);
  const std::unique_ptr<float[]> weights(new float[kLanes * ldw]);
  const std::unique_ptr<float[]> scores(new float[group * real_max(p) > kLaneSumRows ? ldw * kLanes : 0]);
  const std::unique_ptr<float[]> block(new float[wide ? 0 : kBlockKeys * dim]);
  // rows [j0, j0 + n) of keys in float32: in place, or converted into block
  auto rows_of = [&](const StridedRows<T>& x, int64_t b, int64_t hk, int64_t j0, int64_t n)
      __attribute__((always_inline)) -> std::pair<const float*, int64_t> {
    if constexpr (wide) {
      return {x.row(b, j0, hk), x.token};
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const T* src = x.row(b, j0 + j, hk);
        for (int64_t d = 0; d < dim; d += kLanes) store(block.get() + j * dim + d, load_bf16(src + d));
      }
      return {block.get(), dim};
    }
  };
  for (int64_t pair = first; pair < last; ++pair) {
    const Pair pr = start_pair(p, pair, out);
    const int64_t b = pr.b, hk = pr.hk, offset = pr.offset, real = pr.real;
    if (pair + 1 < last) fetch_keys(p, key, value, pair + 1);
    // query row r: head hk * group + r / real, token r % real
    for (int64_t r0 = 0; r0 < group * real; r0 += kLanes) {
      const int64_t rows = std::min<int64_t>(kLanes, group * real - r0);
      const bool lanes = rows <= kLaneSumRows;
      int64_t seen = 0, common = p.W;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = hk * group + (r0 + r) / real, t = (r0 + r) % real;
        const T* q = query.row(b, t, h);
        for (int64_t d = 0; d < dim; ++d) queries[r * dim + d] = to_float(q[d]);
        seen = std::max(seen, p.last_key(offset, t) + 1);
        common = std::min(common, p.last_key(offset, t) + 1);
      }
      if (!lanes) {  // the queries transposed: [dim][16], zero past the group's rows
        std::fill_n(sums.get(), kLanes * dim, 0.0f);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t d = 0; d < dim; ++d) sums[d * kLanes + r] = queries[r * dim + d];
      }
      for (int64_t j0 = 0; j0 < seen; j0 += kBlockKeys) {
        const int64_t n = std::min(kBlockKeys, seen - j0);
        if (!lanes) {
          const auto [keys, ldk] = rows_of(key, b, hk, j0, n);
          product<kZmm>(keys, ldk, sums.get(), kLanes, scores.get() + j0 * kLanes, kLanes, n, dim, kLanes, false);
          continue;
        }
        few_row_scores<kZmm, kYmm>(rows, queries.get(), dim, key.row(b, j0, hk), key.token, n, weights.get() + j0,
                                   ldw);
      }
      const int64_t width = round_up(seen, kLanes);
      for (int64_t r = 0; r < rows; ++r) {
        float* w = weights.get() + r * ldw;
        if (!lanes) {
          for (int64_t j = 0; j < seen; ++j) w[j] = scores[j * kLanes + r];
        }
        const int64_t t = (r0 + r) % real, visible = p.last_key(offset, t) + 1;
        if (p.bias) add_distance_bias(p, hk * group + (r0 + r) / real, offset + t, w, visible);
        const float inverse = softmax_row<kZmm>(w, visible - 1, width, p.bias ? 1.0f : p.scale);
        for (int64_t j = 0; j < visible; ++j) w[j] = round_weights ? rounded<uint16_t>(w[j] * inverse) : w[j] * inverse;
      }
      // the values read where they lie (bfloat16 ones widened in registers as they load)
      product<kZmm>(weights.get(), ldw, value.row(b, 0, hk), value.token, sums.get(), dim, rows, common, dim, false);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = hk * group + (r0 + r) / real, t = (r0 + r) % real;
        float* o = sums.get() + r * dim;
        for (int64_t j = common; j <= p.last_key(offset, t); ++j) {
          const float w = weights[r * ldw + j];
          const T* v = value.row(b, j, hk);
          for (int64_t d = 0; d < dim; ++d) o[d] += w * to_float(v[d]);
        }
        T* dst = out + ((b * S + t) * p.H + h) * dim;
        for (int64_t d = 0; d < dim; ++d) from_float(o[d], dst + d);
      }
    }
  }
}

// Rows of a few-token step that share their first keys (CausalProblem::shared_from): a key head
// and up to kSharedRows rows that read one row's shared columns, rows order[first .. last). The
// shared keys and values are read block by block for all of them while the block is in cache.
constexpr int64_t kSharedRows = 8;

struct SharedUnit {
  int64_t hk, first, last;
};

// attend_few_pairs for SharedUnits [first, last), with its arithmetic: each score is a
// few_row_scores sum (whose bits do not depend on which keys or rows it is computed with), each
// softmax runs over the row's whole score row as there, and each weighted sum adds its keys'
// terms in increasing order (the shared blocks, then the row's own keys) as one product over
// the row's own values would: every output has the bits attend_few_pairs gives it.
template <bool kZmm, bool kYmm, typename T>
__attribute__((always_inline)) inline void attend_few_shared(const CausalProblem& p, const StridedRows<T>& query,
                                                             const StridedRows<T>& key, const StridedRows<T>& value,
                                                             T* out, bool round_weights, const int64_t* order,
                                                             const SharedUnit* units, int64_t first, int64_t last) {
  const int64_t S = p.S, dim = p.dim, group = p.H / p.Hkv, ldw = round_up(p.W, kLanes), C = p.shared_columns;
  constexpr int64_t kMostRows = kSharedRows * kLaneSumRows;  // query rows of a unit
  const std::unique_ptr<float[]> queries(new float[kMostRows * dim]), sums(new float[kMostRows * dim]);
  const std::unique_ptr<float[]> weights(new float[kMostRows * ldw]);
  for (int64_t u = first; u < last; ++u) {
    const SharedUnit& unit = units[u];
    const int64_t hk = unit.hk, rows_in = unit.last - unit.first, from = p.shared_from[order[unit.first]];
    Pair pairs[kSharedRows];
    int64_t base[kSharedRows + 1] = {0};  // row i's queries: base[i] .. base[i + 1] (head-major, as there)
    for (int64_t i = 0; i < rows_in; ++i) {
      const int64_t b = order[unit.first + i];
      const Pair pr = pairs[i] = start_pair(p, b * p.Hkv + hk, out);
      for (int64_t r = 0; r < group * pr.real; ++r) {
        const T* q = query.row(b, r % pr.real, hk * group + r / pr.real);
        for (int64_t d = 0; d < dim; ++d) queries[(base[i] + r) * dim + d] = to_float(q[d]);
      }
      base[i + 1] = base[i] + group * pr.real;
    }
    for (int64_t j0 = 0; j0 < C; j0 += kBlockKeys) {  // the shared keys, each block for every row
      const int64_t n = std::min(kBlockKeys, C - j0);
      // consecutive rows' queries (contiguous, as are their score rows) in calls of up to
      // kLaneSumRows: each key vector loaded once for all of them
      for (int64_t r0 = 0; r0 < base[rows_in];) {
        const int64_t rows = std::min(kLaneSumRows, base[rows_in] - r0);
        few_row_scores<kZmm, kYmm>(rows, queries.get() + r0 * dim, dim, key.row(from, j0, hk), key.token, n,
                             weights.get() + r0 * ldw + j0, ldw);
        r0 += rows;
      }
    }
    for (int64_t i = 0; i < rows_in; ++i) {  // each row's own keys, then its softmaxes
      const Pair& pr = pairs[i];
      const int64_t rows = base[i + 1] - base[i];
      if (rows == 0) continue;
      float* w = weights.get() + base[i] * ldw;
      for (int64_t j0 = C; j0 < pr.seen; j0 += kBlockKeys) {
        few_row_scores<kZmm, kYmm>(rows, queries.get() + base[i] * dim, dim, key.row(pr.b, j0, hk), key.token,
                             std::min(kBlockKeys, pr.seen - j0), w + j0, ldw);
      }
      const int64_t width = round_up(pr.seen, kLanes);
      for (int64_t r = 0; r < rows; ++r) {
        float* row = w + r * ldw;
        const int64_t visible = p.last_key(pr.offset, r % pr.real) + 1;
        const float inverse = softmax_row<kZmm>(row, visible - 1, width, p.scale);
        for (int64_t j = 0; j < visible; ++j) {
          row[j] = round_weights ? rounded<uint16_t>(row[j] * inverse) : row[j] * inverse;
        }
      }
    }
    for (int64_t j0 = 0; j0 < C; j0 += kBlockKeys) {  // the shared values, each block for every query
      // six query rows a register block where the build has 32 registers: each block of values
      // read once for six instead of four
      product<kZmm, false, T, kZmm ? 6 : kProductRows>(weights.get() + j0, ldw, value.row(from, j0, hk), value.token,
                                                       sums.get(), dim, base[rows_in], std::min(kBlockKeys, C - j0),
                                                       dim, j0 > 0);
    }
    for (int64_t i = 0; i < rows_in; ++i) {  // each row's own values: those all its queries see, then the rest
      const Pair& pr = pairs[i];
      const int64_t rows = base[i + 1] - base[i];
      if (rows == 0) continue;
      const int64_t common = p.last_key(pr.offset, 0) + 1;
      float* w = weights.get() + base[i] * ldw;
      product<kZmm>(w + C, ldw, value.row(pr.b, C, hk), value.token, sums.get() + base[i] * dim, dim, rows, common - C,
                    dim, true);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = hk * group + r / pr.real, t = r % pr.real;
        float* o = sums.get() + (base[i] + r) * dim;
        for (int64_t j = common; j <= p.last_key(pr.offset, t); ++j) {
          const float wj = w[r * ldw + j];
          const T* v = value.row(pr.b, j, hk);
          for (int64_t d = 0; d < dim; ++d) o[d] += wj * to_float(v[d]);
        }
        T* dst = out + ((pr.b * S + t) * p.H + h) * dim;
        for (int64_t d = 0; d < dim; ++d) from_float(o[d], dst + d);
      }
    }
  }
}


// Whether a problem's rows can take their shared keys from one another: a sharing given, no bias
// and every row's cached keys past the shared ones, read from a row of the problem; for the
// few-token path (attend_few_shared) also at most kLaneSumRows queries of a key head a row (the
// lane-sum scores, whose bits do not depend on the rows beside them)
inline bool reads_shared(const CausalProblem& p, bool few) {
  if (!p.offsets || !p.shared_from || p.shared_columns <= 0 || p.bias || p.shared_columns > p.W) return false;
  if (few && p.H / p.Hkv * real_max(p) > kLaneSumRows) return false;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t from = p.shared_from[b];
    if (from < 0 || from >= p.B || p.offsets[b] < p.shared_columns || p.offsets[from] < p.shared_columns) {
      return false;
    }
  }
  return true;
}

// The rows in order of the row they read shared keys from
inline std::vector<int64_t> rows_by_source(const CausalProblem& p) {
  std::vector<int64_t> order(static_cast<std::size_t>(p.B));
  for (int64_t b = 0; b < p.B; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return p.shared_from[x] < p.shared_from[y]; });
  return order;
}

// The units of rows_by_source's order: for each key head, runs of at most kSharedRows rows that
// read the same row's shared keys
inline std::vector<SharedUnit> shared_units(const CausalProblem& p, const std::vector<int64_t>& order) {
  std::vector<SharedUnit> units;
  for (int64_t hk = 0; hk < p.Hkv; ++hk) {
    for (int64_t i = 0; i < p.B;) {
      int64_t j = i + 1;
      while (j < p.B && j - i < kSharedRows && p.shared_from[order[j]] == p.shared_from[order[i]]) ++j;
      units.push_back({hk, i, j});
      i = j;
    }
  }
  return units;
}

// the few-token kernels' arguments, for their builds (FASTJUDGE_VERSIONED_YMM): pairs [first, last)
// (attend_few_pairs), or with order and units, SharedUnits [first, last) (attend_few_shared)
template <typename T>
struct FewPairs {
  const CausalProblem& p;
  const StridedRows<T>&query, &key, &value;
  T* out;
  bool round_weights;
  int64_t first, last;
  const int64_t* order = nullptr;
  const SharedUnit* units = nullptr;
};

template <bool kZmm, bool kYmm, typename T>
__attribute__((always_inline)) inline void attend_few(const FewPairs<T>& a) {
  if (a.units) {
    attend_few_shared<kZmm, kYmm>(a.p, a.query, a.key, a.value, a.out, a.round_weights, a.order, a.units, a.first,
                                  a.last);
  } else {
    attend_few_pairs<kZmm, kYmm>(a.p, a.query, a.key, a.value, a.out, a.round_weights, a.first, a.last);
  }
}

FASTJUDGE_VERSIONED_YMM(attend_few_f32, attend_few, FewPairs<float>)
FASTJUDGE_VERSIONED_YMM(attend_few_bf16, attend_few, FewPairs<uint16_t>)

// the packing kernel's arguments, for its builds (FASTJUDGE_VERSIONED): pairs [first, last)
template <typename T>
struct PromptPairs {
  const CausalProblem& p;
  const StridedRows<T>&query, &key, &value;
  T* out;
  int64_t first, last;
  PairOrder in;
};

template <bool kWide, typename T>
__attribute__((always_inline)) inline void attend_prompt(const PromptPairs<T>& a) {
  attend_pairs<kWide>(a.p, a.query, a.key, a.value, a.out, a.first, a.last, a.in);
}

FASTJUDGE_VERSIONED(attend_pairs_f32, attend_prompt, PromptPairs<float>)
FASTJUDGE_VERSIONED(attend_pairs_bf16, attend_prompt, PromptPairs<uint16_t>)

#ifdef FASTJUDGE_BF16_DOT
// bfloat16 inputs on CPUs with AVX512-BF16: both products as bfloat16 dot products (vdpbf16ps:
// pairs of bfloat16 products summed into float32 lanes, twice the multiply-adds of a float32
// FMA). Scores take the exact bfloat16 queries and keys; the weighted values take the softmax
// weights normalised and rounded to bfloat16, as transformers' eager path and SDPA round them
// (softmax in float32, then the query's dtype), not the float32 weights of the portable path.

// c[r][0 .. 16 V) = sum over pairs k < depth of the two-element dot products of a[r * lda + k]
// (two bfloat16 in 32 bits) with b[k * ldb + w] (ditto), r < R, in increasing k
template <int R, int V>
FASTJUDGE_BF16_TARGET inline void block_dot(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                                            int64_t depth, float* c, int64_t ldc) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < depth; ++k) {
    __m512bh bv[V];
    for (int v = 0; v < V; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + k * ldb + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * lda + k]));
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(c + r * ldc + v * kLanes, acc[r][v]);
}

// kDotRows rows of c[r][0 .. columns) (columns a multiple of 32) by block_dot: blocks of four
// vectors of columns, then one of two where 32 are left. Four rows by four vectors load half a
// vector a product (a broadcast of a row's pair, a vector of b), where eight rows by two loaded
// five eighths (a prompt of 4 x 512 tokens, mini's heads, bfloat16, two threads, alternating
// builds: 2.30-2.42 -> 2.24-2.30 ms). Every output sums the same pairs in the same order
// whichever block computes it: the same bits.
constexpr int kDotRows = 4;
FASTJUDGE_BF16_TARGET inline void rows_dot(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                                           int64_t depth, float* c, int64_t ldc, int64_t columns) {
  int64_t j0 = 0;
  for (; j0 + 4 * kLanes <= columns; j0 += 4 * kLanes) block_dot<kDotRows, 4>(a, lda, b + j0, ldb, depth, c + j0, ldc);
  if (j0 < columns) block_dot<kDotRows, 2>(a, lda, b + j0, ldb, depth, c + j0, ldc);
}

inline uint32_t bf16_pair(uint16_t low, uint16_t high) { return low | static_cast<uint32_t>(high) << 16; }

// add_distance_bias 16 keys at a time: the bias of keys j .. j + 15 lies at descending addresses,
// loaded as one vector and reversed
FASTJUDGE_BF16_TARGET inline void add_distance_bias_avx512(const CausalProblem& p, int64_t h, int64_t position,
                                                           float* w, int64_t visible) {
  const float* bias = p.bias + h * p.bias_stride + position;
  const __m512i reverse = _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 scale = _mm512_set1_ps(p.scale);
  int64_t j = 0;
  for (; j + kLanes <= visible; j += kLanes) {
    const __m512 b = _mm512_permutexvar_ps(reverse, _mm512_loadu_ps(bias - j - (kLanes - 1)));
    _mm512_storeu_ps(w + j, _mm512_fmadd_ps(_mm512_loadu_ps(w + j), scale, b));
  }
  for (; j < visible; ++j) w[j] = w[j] * p.scale + bias[-j];
}

// attend_pairs for bfloat16 by dot products: keys packed [dim / 2][ldk] as pairs of consecutive
// dims, values [W / 2][ldv] as pairs of consecutive keys, queries and weights as pairs too
FASTJUDGE_BF16_TARGET void attend_pairs_dot(const CausalProblem& p, const StridedRows<uint16_t>& query,
                                            const StridedRows<uint16_t>& key, const StridedRows<uint16_t>& value,
                                            uint16_t* out, int64_t first, int64_t last, PairOrder in) {
  const int64_t S = p.S, dim = p.dim, half = (dim + 1) / 2;
  int64_t ldk = round_up(p.W, kCols);
  if ((ldk / kCols) % 2 == 0) ldk += kCols;
  const int64_t ldv = round_up(dim, kCols);
  // AMX tiles (where the CPU has them; dims a multiple of 32): each tile of query tokens as one
  // product of 16 rows by all its keys' columns, then by all its keys' pairs of values, the weights
  // past a row's last key zero (so the values of a tile's width of keys are read: zero past the
  // pair's own, never an earlier pair's)
  const bool tiles = half % kTilePairs == 0 && amx_products();
  if (tiles) amx_configure(kTileRows);
  const int64_t value_pairs = tiles ? round_up(p.W, kCols) / 2 : (p.W + 1) / 2;
  std::vector<uint32_t> keys(static_cast<std::size_t>(half * ldk), 0u);
  std::vector<uint32_t> values(static_cast<std::size_t>(value_pairs * ldv), 0u);
  std::vector<uint32_t> queries(static_cast<std::size_t>(kTile * half), 0u);
  std::vector<uint32_t> pairs(static_cast<std::size_t>(kTile * ldk / 2 + kTile), 0u);
  std::vector<float> weights(static_cast<std::size_t>(kTile * ldk), 0.0f);
  std::vector<float> sums(static_cast<std::size_t>(kTile * ldv));
  const int64_t ldp = ldk / 2 + 1;  // weight pairs a row
  int64_t packed_pairs = 0;  // the value pairs any pair has written (zero past them)
  for (int64_t i = first; i < last; ++i) {
    const Pair pr = start_pair(p, in.pair(i), out);
    const int64_t b = pr.b, hk = pr.hk, offset = pr.offset, seen = pr.seen, from = in.first_key(p, pr);
    for (int64_t j = from; j < seen; ++j) {
      const uint16_t* k = key.row(b, j, hk);
      for (int64_t d = 0; d < half; ++d) keys[d * ldk + j] = bf16_pair(k[2 * d], 2 * d + 1 < dim ? k[2 * d + 1] : 0);
    }
    for (int64_t j = from / 2 * 2; j < seen; j += 2) {  // values in pairs of keys: a straddling pair again
      const uint16_t* v0 = value.row(b, j, hk);
      const uint16_t* v1 = j + 1 < seen ? value.row(b, j + 1, hk) : nullptr;
      uint32_t* row = values.data() + (j / 2) * ldv;
      for (int64_t d = 0; d < dim; ++d) row[d] = bf16_pair(v0[d], v1 ? v1[d] : 0);
    }
    const int64_t own_pairs = (seen + 1) / 2;
    if (tiles && packed_pairs > own_pairs)  // an earlier pair's values past this one's: zero again
      std::fill(values.begin() + own_pairs * ldv, values.begin() + packed_pairs * ldv, 0u);
    packed_pairs = std::max(packed_pairs, own_pairs);
    in.packed(p, pr, from);
    // (inlined: a lambda left out of line would be built for the baseline ISA, not this clone's)
    for_each_tile(p, pr, [&](int64_t h, int64_t t0, int64_t rows, int64_t width)
                             __attribute__((always_inline)) {
      for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* q = query.row(b, t0 + r, h);
        for (int64_t d = 0; d < half; ++d) queries[r * half + d] = bf16_pair(q[2 * d], 2 * d + 1 < dim ? q[2 * d + 1] : 0);
      }
      float* scores = weights.data();
      if (tiles) {  // rows past `rows` hold an earlier tile's queries: their scores are never read
        amx_tile_product(queries.data(), half, keys.data(), ldk, half, scores, ldk, width);
      } else {
        for (int64_t r0 = 0; r0 < rows; r0 += kDotRows)
          rows_dot(queries.data() + r0 * half, half, keys.data(), ldk, half, scores + r0 * ldk, ldk, width);
      }
      for (int64_t r = 0; r < rows; ++r) {  // weights normalised, then rounded to bfloat16 in pairs
        float* w = scores + r * ldk;
        const int64_t last = p.last_key(offset, t0 + r);
        if (p.bias) add_distance_bias_avx512(p, h, offset + t0 + r, w, last + 1);
        const float inverse = softmax_row<true>(w, last, width, p.bias ? 1.0f : p.scale);
        uint32_t* wp = pairs.data() + r * ldp;
        for (int64_t j = 0; j < width; j += kLanes) store_bf16_pairs(wp + j / 2, load(w + j) * inverse);
      }
      for (int64_t r = rows; r < round_up(rows, kRows); ++r) std::fill_n(pairs.data() + r * ldp, ldp, 0u);
      if (tiles) amx_tile_product(pairs.data(), ldp, values.data(), ldv, width / 2, sums.data(), ldv, ldv);
      for (int64_t r0 = 0; r0 < rows && !tiles; r0 += kDotRows) {
        // the key pairs every row of the block sees, as one product (key offset + t0 + r0 and
        // those before it: visible to all of the block's rows); then each row's remaining keys
        const int64_t common = std::min(offset + t0 + r0 + 1, p.W) / 2;
        rows_dot(pairs.data() + r0 * ldp, ldp, values.data(), ldv, common, sums.data() + r0 * ldv, ldv, ldv);
        for (int64_t r = r0; r < std::min(rows, r0 + kDotRows); ++r) {
          float* o = sums.data() + r * ldv;
          const uint32_t* wp = pairs.data() + r * ldp;
          for (int64_t j = 2 * common; j <= p.last_key(offset, t0 + r); ++j) {
            const float w = to_float(static_cast<uint16_t>(j % 2 ? wp[j / 2] >> 16 : wp[j / 2] & 0xffffu));
            const uint16_t* vj = value.row(b, j, hk);
            for (int64_t d = 0; d < dim; ++d) o[d] += w * to_float(vj[d]);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t* o = out + ((b * S + t0 + r) * p.H + h) * dim;
        for (int64_t d = 0; d < dim; ++d) from_float(sums[r * ldv + d], o + d);
      }
    });
  }
  if (tiles) amx_release();
}

#endif

std::atomic<bool> bf16_dot_wanted{true};

template <typename T>
void attend(const CausalProblem& p, const StridedRows<T>& query, const StridedRows<T>& key,
            const StridedRows<T>& value, T* out, int threads) {
  const int64_t pairs = p.B * p.Hkv;
  if (pairs == 0 || p.S == 0 || p.dim == 0) return;
  // two products, each query over its visible keys (at most W, the causal half past the offset)
  const double flops = 4.0 * p.B * p.H * p.S * p.dim * std::max<double>(1.0, p.W - p.S / 2.0);
  double work = flops / kFlopsPerThread;
  [[maybe_unused]] const bool dot = bf16_dot_products();
  // a few new tokens after cached keys: no packing pass (attend_few_pairs)
  const bool few = p.offsets && p.S <= kFewTokens && p.dim % kLanes == 0;
  if (few) {  // little work on each key, read from memory: a thread for each kKeyBytesPerThread too
    double keys = 0.0;
    for (int64_t b = 0; b < p.B; ++b) keys += static_cast<double>(std::min(p.offsets[b] + p.S, p.W));
    work = std::max(work, 2.0 * p.Hkv * keys * p.dim * sizeof(T) / kKeyBytesPerThread);
  }
  const int64_t workers = std::min<int64_t>(threads, static_cast<int64_t>(work) + 1);
  if (p.bias && !p.offsets) throw std::invalid_argument("a position bias needs offsets");
  const bool shared = reads_shared(p, few);
  if (few && shared) {
    const std::vector<int64_t> order = rows_by_source(p);
    const std::vector<SharedUnit> units = shared_units(p, order);
    parallel_ranges(static_cast<int64_t>(units.size()), workers, 1, [&](int64_t first, int64_t last) {
      if constexpr (std::is_same_v<T, float>) {
        attend_few_f32({p, query, key, value, out, false, first, last, order.data(), units.data()});
      } else {
        attend_few_bf16({p, query, key, value, out, dot, first, last, order.data(), units.data()});
      }
    });
    return;
  }
  // packing pairs: those of a key head that share a snapshot's columns one after another, each
  // packing them only where the one before has not
  std::vector<int64_t> order;
  if (!few && shared) {
    const std::vector<int64_t> rows = rows_by_source(p);
    for (int64_t hk = 0; hk < p.Hkv; ++hk)
      for (const int64_t b : rows) order.push_back(b * p.Hkv + hk);
  }
  const PairOrder in{order.empty() ? nullptr : order.data()};
  parallel_ranges(pairs, workers, 1, [&](int64_t first, int64_t last) {
    if (few) {
      if constexpr (std::is_same_v<T, float>) {
        attend_few_f32({p, query, key, value, out, false, first, last});
      } else {
        attend_few_bf16({p, query, key, value, out, dot, first, last});
      }
      return;
    }
    if constexpr (std::is_same_v<T, float>) {
      attend_pairs_f32({p, query, key, value, out, first, last, in});
    } else {
#ifdef FASTJUDGE_BF16_DOT
      if (dot) {
        attend_pairs_dot(p, query, key, value, out, first, last, in);
        return;
      }
#endif
      attend_pairs_bf16({p, query, key, value, out, first, last, in});
    }
  });
}

}  // namespace

bool bf16_dot_products() { return bf16_dot_wanted.load() && cpu_has_bf16_dot(); }

bool bf16_dot_products(bool wanted) {
  bf16_dot_wanted.store(wanted);
  return bf16_dot_products();
}

void causal_attention(const CausalProblem& problem, const StridedRows<float>& query, const StridedRows<float>& key,
                      const StridedRows<float>& value, float* out, int threads) {
  attend(problem, query, key, value, out, threads);
}

void causal_attention(const CausalProblem& problem, const StridedRows<uint16_t>& query,
                      const StridedRows<uint16_t>& key, const StridedRows<uint16_t>& value, uint16_t* out,
                      int threads) {
  attend(problem, query, key, value, out, threads);
}

}  // namespace fastjudge
