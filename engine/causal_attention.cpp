#include "causal_attention.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_parallel.hpp"
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

inline int64_t round_up(int64_t n, int64_t step) { return (n + step - 1) / step * step; }

// c[r][w] = sum over k < depth of a[r * lda + k] * b[k * ldb + w] for r < kRows, w < kCols, in
// increasing k: the query-key scores (a = queries, b = keys transposed) and the weighted values
// (a = softmax weights, b = values) alike
__attribute__((always_inline)) inline void block_product(const float* a, int64_t lda, const float* b, int64_t ldb,
                                                         int64_t depth, float* c, int64_t ldc) {
  Floats acc[kRows][2] = {};
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

// softmax weights of one query row over its visible keys j <= last, in place on scale x scores,
// zero from last + 1 to width (a multiple of kLanes); returns 1 / their sum
inline float softmax_row(float* row, int64_t last, int64_t width, float scale) {
  const int64_t visible = last + 1, full = visible / kLanes * kLanes;
  Floats top = splat(-__builtin_inff());
  for (int64_t j = 0; j < full; j += kLanes) {
    const Floats x = load(row + j) * scale;
    top = x > top ? x : top;
  }
  float m = top[0];
  for (int w = 1; w < kLanes; ++w) m = std::max(m, top[w]);
  for (int64_t j = full; j < visible; ++j) m = std::max(m, row[j] * scale);
  for (int64_t j = visible; j < width; ++j) row[j] = -__builtin_inff();  // masked: exp gives 0 below
  Floats total{};
  for (int64_t j = 0; j < width; j += kLanes) {
    const Floats x = load(row + j) * scale - m;
    Floats p = exp_nonpositive(x);
    p = x == splat(-__builtin_inff()) ? Floats{} : p;
    store(row + j, p);
    total += p;
  }
  float sum = 0.0f;
  for (int w = 0; w < kLanes; ++w) sum += total[w];
  return 1.0f / sum;
}

// (row, key head) pairs [first, last): their keys and values packed once in float32, then every
// tile of kTile query tokens of each of the grouped query heads
template <typename T>
__attribute__((always_inline)) inline void attend_pairs(const CausalProblem& p, const StridedRows<T>& query, const StridedRows<T>& key,
                                   const StridedRows<T>& value, T* out, int64_t first, int64_t last) {
  const int64_t S = p.S, dim = p.dim, group = p.H / p.Hkv;
  // keys transposed [dim][ldk], ldk an odd number of register blocks: rows a multiple of 256
  // bytes apart would fall into a few cache sets as the product walks down them
  int64_t ldk = round_up(p.W, kCols);
  if ((ldk / kCols) % 2 == 0) ldk += kCols;
  const int64_t ldv = round_up(dim, kCols);  // values [W][ldv], zero past dim
  std::vector<float> keys(static_cast<std::size_t>(dim * ldk), 0.0f);
  std::vector<float> values(static_cast<std::size_t>(p.W * ldv), 0.0f);
  std::vector<float> queries(static_cast<std::size_t>(kTile * dim), 0.0f);
  std::vector<float> weights(static_cast<std::size_t>(kTile * ldk), 0.0f);
  std::vector<float> sums(static_cast<std::size_t>(kTile * ldv));
  for (int64_t pair = first; pair < last; ++pair) {
    const int64_t b = pair / p.Hkv, hk = pair % p.Hkv;
    const int64_t offset = p.offsets ? p.offsets[b] : 0;
    const int64_t real = p.counts ? p.counts[b] : S;  // the row's real tokens; padding outputs are zeros
    for (int64_t t = real; t < S; ++t)
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) std::fill_n(out + ((b * S + t) * p.H + h) * dim, dim, T{});
    if (real == 0) continue;
    const int64_t seen = p.last_key(offset, real - 1) + 1;  // the keys any of the row's queries sees
    for (int64_t j = 0; j < seen; ++j) {
      const T* k = key.row(b, j, hk);
      const T* v = value.row(b, j, hk);
      for (int64_t d = 0; d < dim; ++d) keys[d * ldk + j] = to_float(k[d]);
      for (int64_t d = 0; d < dim; ++d) values[j * ldv + d] = to_float(v[d]);
    }
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t t0 = 0; t0 < real; t0 += kTile) {
        const int64_t rows = std::min<int64_t>(kTile, real - t0);
        const int64_t width = round_up(p.last_key(offset, t0 + rows - 1) + 1, kCols);
        for (int64_t r = 0; r < rows; ++r) {
          const T* q = query.row(b, t0 + r, h);
          for (int64_t d = 0; d < dim; ++d) queries[r * dim + d] = to_float(q[d]);
        }
        float* scores = weights.data();
        for (int64_t r0 = 0; r0 < rows; r0 += kRows)
          for (int64_t j0 = 0; j0 < width; j0 += kCols)
            block_product(queries.data() + r0 * dim, dim, keys.data() + j0, ldk, dim, scores + r0 * ldk + j0, ldk);
        float inverse[kTile];
        for (int64_t r = 0; r < rows; ++r)
          inverse[r] = softmax_row(scores + r * ldk, p.last_key(offset, t0 + r), width, p.scale);
        for (int64_t r = rows; r < round_up(rows, kRows); ++r) std::fill(scores + r * ldk, scores + r * ldk + width, 0.0f);
        for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
          // the keys every row of the block sees, as one product; then each row's share of the
          // block's own diagonal, so no value past a row's last key is ever read for it (a zero
          // weight times a NaN would still be NaN)
          const int64_t before = std::min(offset + t0 + r0, p.W);
          for (int64_t d0 = 0; d0 < dim; d0 += kCols)
            block_product(scores + r0 * ldk, ldk, values.data() + d0, ldv, before, sums.data() + r0 * ldv + d0, ldv);
          for (int64_t r = r0; r < std::min(rows, r0 + kRows); ++r) {
            float* o = sums.data() + r * ldv;
            for (int64_t j = before; j <= p.last_key(offset, t0 + r); ++j) {
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
      }
    }
  }
}

// the ISA clones, one per element type (target_clones does not take templates)
FASTJUDGE_CLONES
void attend_pairs_f32(const CausalProblem& p, const StridedRows<float>& query, const StridedRows<float>& key,
                      const StridedRows<float>& value, float* out, int64_t first, int64_t last) {
  attend_pairs(p, query, key, value, out, first, last);
}

FASTJUDGE_CLONES
void attend_pairs_bf16(const CausalProblem& p, const StridedRows<uint16_t>& query, const StridedRows<uint16_t>& key,
                       const StridedRows<uint16_t>& value, uint16_t* out, int64_t first, int64_t last) {
  attend_pairs(p, query, key, value, out, first, last);
}

template <typename T>
void attend(const CausalProblem& p, const StridedRows<T>& query, const StridedRows<T>& key,
            const StridedRows<T>& value, T* out, int threads) {
  const int64_t pairs = p.B * p.Hkv;
  if (pairs == 0 || p.S == 0 || p.dim == 0) return;
  // two products, each query over its visible keys (at most W, the causal half past the offset)
  const double flops = 4.0 * p.B * p.H * p.S * p.dim * std::max<double>(1.0, p.W - p.S / 2.0);
  const int64_t workers = std::min<int64_t>(threads, static_cast<int64_t>(flops / kFlopsPerThread) + 1);
  parallel_ranges(pairs, workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (std::is_same_v<T, float>) {
      attend_pairs_f32(p, query, key, value, out, first, last);
    } else {
      attend_pairs_bf16(p, query, key, value, out, first, last);
    }
  });
}

}  // namespace

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
