#include "encoder_attention.hpp"

#include <algorithm>
#include <memory>
#include <type_traits>

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

// scores[q * kBlockKeys + j] = queries[q] . keys[j] for q < rows (a multiple of kQueries; the
// queries zero past the real ones), j < n: a register block of 16 / kQueries keys by kQueries
// queries at a time (16 accumulators), each pair's products summed over the lanes at the end. A
// last short block of keys repeats its last key (its scores are never read). ahead: how far on
// the next block's keys lie (0: none), fetched into cache a line at a time as this block's are
// read.
template <int kQueries>
__attribute__((always_inline)) inline void block_scores(const float* queries, int64_t rows, const float* keys,
                                                        int64_t ldk, int64_t n, int64_t dim, float* scores,
                                                        int64_t ahead) {
  constexpr int kKeys = kLanes / kQueries;
  for (int64_t k0 = 0; k0 < n; k0 += kKeys) {
    const float* key[kKeys];
    for (int k = 0; k < kKeys; ++k) key[k] = keys + std::min<int64_t>(k0 + k, n - 1) * ldk;
    for (int64_t q0 = 0; q0 < rows; q0 += kQueries) {
      Floats acc[kKeys * kQueries] = {};
      for (int64_t d = 0; d < dim; d += kLanes) {
        Floats q[kQueries];
        for (int i = 0; i < kQueries; ++i) q[i] = load(queries + (q0 + i) * dim + d);
        for (int k = 0; k < kKeys; ++k) {
          if (ahead && q0 == 0) __builtin_prefetch(key[k] + d + ahead);
          const Floats kv = load(key[k] + d);
          for (int i = 0; i < kQueries; ++i) acc[k * kQueries + i] += kv * q[i];
        }
      }
      float sums[kLanes];
      store(sums, lane_sums(acc));
      for (int k = 0; k < kKeys && k0 + k < n; ++k)
        for (int i = 0; i < kQueries; ++i) scores[(q0 + i) * kBlockKeys + k0 + k] = sums[k * kQueries + i];
    }
  }
}

// One row's group of query rows [r0, r0 + rows) over its first `length` states.
template <typename T>
__attribute__((always_inline)) inline void attend_group(const StridedRows<T>& query, const StridedRows<T>& states,
                                                        int64_t length, T* out, int64_t b, int64_t r0, int64_t rows,
                                                        int64_t R, int64_t dim, float scale, float* queries,
                                                        float* sums, float* scores, float* block) {
  constexpr bool wide = std::is_same_v<T, float>;
  // four queries a register block where they fill it, else two (six rows: no padded row)
  const bool fours = rows % 4 == 0 || rows > 8;
  const int64_t padded = fours ? (rows + 3) / 4 * 4 : (rows + 1) / 2 * 2;
  for (int64_t r = 0; r < padded; ++r) {
    for (int64_t d = 0; d < dim; d += kLanes)
      store(queries + r * dim + d, r < rows ? load_floats(query.row(b, r0 + r, 0) + d) : Floats{});
  }
  std::fill_n(sums, rows * dim, 0.0f);
  float top[kGroupRows], total[kGroupRows];
  std::fill_n(top, rows, -__builtin_inff());
  std::fill_n(total, rows, 0.0f);
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
    // the next block's states, fetched while this one computes (float32 states are read in place)
    const int64_t ahead = wide && j0 + kBlockKeys < length ? kBlockKeys * ldk : 0;
    if (fours) {
      block_scores<4>(queries, padded, keys, ldk, n, dim, scores, ahead);
    } else {
      block_scores<2>(queries, padded, keys, ldk, n, dim, scores, ahead);
    }
    for (int64_t r = 0; r < rows; ++r) {  // the online softmax: weights against the running maximum
      float* w = scores + r * kBlockKeys;
      for (int64_t j = n; j < kBlockKeys; ++j) w[j] = -__builtin_inff();
      Floats most = splat(-__builtin_inff());
      for (int64_t j = 0; j < kBlockKeys; j += kLanes) {
        const Floats x = load(w + j) * scale;
        most = x > most ? x : most;
      }
      float m = top[r];
      for (int i = 0; i < kLanes; ++i) m = std::max(m, most[i]);
      if (m > top[r] && top[r] > -__builtin_inff()) {  // earlier weights were against a lower maximum
        const float shrink = exp_nonpositive(splat(top[r] - m))[0];
        total[r] *= shrink;
        for (int64_t d = 0; d < dim; d += kLanes) store(sums + r * dim + d, load(sums + r * dim + d) * shrink);
      }
      top[r] = m;
      Floats added{};
      for (int64_t j = 0; j < kBlockKeys; j += kLanes) {
        const Floats x = load(w + j) * scale - m;
        const Floats p = x == splat(-__builtin_inff()) ? Floats{} : exp_nonpositive(x);
        store(w + j, p);
        added += p;
      }
      for (int i = 0; i < kLanes; ++i) total[r] += added[i];
    }
    product(scores, kBlockKeys, keys, ldk, sums, dim, rows, n, dim, true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + (b * R + r0 + r) * dim;
    const float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    for (int64_t d = 0; d < dim; d += kLanes) store_floats(o + d, load(sums + r * dim + d) * inverse);
  }
}

// units [first, last) of `units`, in reverse order where asked (the last unit first): unit u is
// row u / groups, its (u % groups)-th group of query rows
template <typename T>
__attribute__((always_inline)) inline void attend_units(const StridedRows<T>& query, const StridedRows<T>& states,
                                                        const int64_t* lengths, T* out, int64_t R, int64_t dim,
                                                        float scale, int64_t units, bool reverse, int64_t first,
                                                        int64_t last) {
  const int64_t groups = (R + kGroupRows - 1) / kGroupRows;
  const std::unique_ptr<float[]> queries(new float[kGroupRows * dim]), sums(new float[kGroupRows * dim]);
  const std::unique_ptr<float[]> scores(new float[kGroupRows * kBlockKeys]);
  const std::unique_ptr<float[]> block(new float[std::is_same_v<T, float> ? 0 : kBlockKeys * dim]);
  for (int64_t i = first; i < last; ++i) {
    const int64_t u = reverse ? units - 1 - i : i;
    const int64_t b = u / groups, r0 = (u % groups) * kGroupRows;
    attend_group(query, states, lengths[b], out, b, r0, std::min(kGroupRows, R - r0), R, dim, scale, queries.get(),
                 sums.get(), scores.get(), block.get());
  }
}

FASTJUDGE_CLONES
void attend_units_f32(const StridedRows<float>& query, const StridedRows<float>& states, const int64_t* lengths,
                      float* out, int64_t R, int64_t dim, float scale, int64_t units, bool reverse,
                      int64_t first, int64_t last) {
  attend_units(query, states, lengths, out, R, dim, scale, units, reverse, first, last);
}

FASTJUDGE_CLONES
void attend_units_bf16(const StridedRows<uint16_t>& query, const StridedRows<uint16_t>& states,
                       const int64_t* lengths, uint16_t* out, int64_t R, int64_t dim, float scale, int64_t units,
                       bool reverse, int64_t first, int64_t last) {
  attend_units(query, states, lengths, out, R, dim, scale, units, reverse, first, last);
}

}  // namespace

template <typename T>
void encoder_attention(const StridedRows<T>& query, const StridedRows<T>& states, const int64_t* lengths, T* out,
                       int64_t B, int64_t R, int64_t dim, float scale, bool reverse, int threads) {
  if (B == 0 || R == 0 || dim == 0) return;
  const int64_t units = B * ((R + kGroupRows - 1) / kGroupRows);
  double keys = 0.0;
  for (int64_t b = 0; b < B; ++b) keys += static_cast<double>(lengths[b]);
  const double flops = 4.0 * R * dim * keys;
  const int64_t workers = std::min<int64_t>(threads, static_cast<int64_t>(flops / kFlopsPerThread) + 1);
  parallel_ranges(units, workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (std::is_same_v<T, float>) {
      attend_units_f32(query, states, lengths, out, R, dim, scale, units, reverse, first, last);
    } else {
      attend_units_bf16(query, states, lengths, out, R, dim, scale, units, reverse, first, last);
    }
  });
}

template void encoder_attention<float>(const StridedRows<float>&, const StridedRows<float>&, const int64_t*, float*,
                                       int64_t, int64_t, int64_t, float, bool, int);
template void encoder_attention<uint16_t>(const StridedRows<uint16_t>&, const StridedRows<uint16_t>&,
                                          const int64_t*, uint16_t*, int64_t, int64_t, int64_t, float, bool, int);

}  // namespace fastjudge
