// A register-blocked product of small row-major matrices, C (= or +=) A B, for the engine's CPU
// kernels: blocks of up to kProductRows rows by four vectors of columns (16 accumulators), each row's
// sum over the depth in increasing order.
#pragma once

#include <algorithm>
#include <cstdint>

#include "vector_math.hpp"

namespace fastjudge {

// Rows of a register block (with up to four vectors of columns: 16 accumulators).
constexpr int kProductRows = 4;
constexpr int kMaxVectors = 4;
// Rows of a register block of one vector of columns, for AVX2's 16 registers (see product())
constexpr int kNarrowRows = 6;
// Rows that AVX2's product() takes in wider blocks of whole rows of B (narrow_few_rows)
constexpr int kNarrowFewRows = 2;

// c[r][:NV lanes] (= or +=) sum over k < depth of a[r * lda + k] * b[k * ldb + :], r < R, in
// increasing k (b float32, or bfloat16 bits widened as they load); with kFetch, the line at
// fetch + k * fetch_step is fetched into L2 at each k; kZmm: built for AVX-512 (hold())
template <int R, int NV, bool kZmm = false, bool kFetch = false, typename TB = float>
__attribute__((always_inline)) inline void tile(const float* a, int64_t lda, const TB* b, int64_t ldb, float* c,
                                                int64_t ldc, int64_t depth, bool accumulate,
                                                const char* fetch = nullptr, int64_t fetch_step = 0) {
  Floats acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? load(c + r * ldc + v * kLanes) : Floats{};
  for (int64_t k = 0; k < depth; ++k) {
    if constexpr (kFetch) __builtin_prefetch(fetch + k * fetch_step, 0, 2);
    Floats bk[NV];
    for (int v = 0; v < NV; ++v) {
      bk[v] = load_floats(b + k * ldb + v * kLanes);
      if constexpr (R > 1) hold<kZmm>(bk[v]);
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (kZmm && NV > 1) {
        const Floats ar = held_broadcast(a + r * lda + k);
        for (int v = 0; v < NV; ++v) acc[r][v] += ar * bk[v];
      } else {
        const float ar = a[r * lda + k];
        for (int v = 0; v < NV; ++v) acc[r][v] += ar * bk[v];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(c + r * ldc + v * kLanes, acc[r][v]);
}

// tile<R, NH / 2> built for AVX2: its accumulators in NH vectors of 8 lanes a row (Floats8), R NH
// registers (NH 2 for product's blocks of kNarrowRows rows, up to 8 for one or two rows)
template <int R, bool kFetch = false, typename TB = float, int NH = 2>
__attribute__((always_inline)) inline void narrow_tile(const float* a, int64_t lda, const TB* b, int64_t ldb, float* c,
                                                       int64_t ldc, int64_t depth, bool accumulate,
                                                       const char* fetch = nullptr, int64_t fetch_step = 0) {
  Floats8 acc[R][NH];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NH; ++v) acc[r][v] = accumulate ? load8(c + r * ldc + 8 * v) : Floats8{};
  for (int64_t k = 0; k < depth; ++k) {
    if constexpr (kFetch) __builtin_prefetch(fetch + k * fetch_step, 0, 2);
    Floats8 bk[NH];
    for (int v = 0; v < NH; ++v) bk[v] = load8(b + k * ldb + 8 * v);
    for (int r = 0; r < R; ++r) {
      const float ar = a[r * lda + k];
      for (int v = 0; v < NH; ++v) acc[r][v] += ar * bk[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NH; ++v) store_as(c + r * ldc + 8 * v, acc[r][v]);
}

// product() of one or two rows built for AVX2, without fetching: blocks of 64 columns for one
// row (8 accumulators), 32 for two, the last narrower: B's loads shared by fewer FMAs otherwise
// (a 16-column block of one row loads two vectors of B for its two FMAs)
template <typename TB>
__attribute__((always_inline)) inline void narrow_few_rows(const float* A, int64_t lda, const TB* B, int64_t ldb,
                                                           float* C, int64_t ldc, int64_t rows, int64_t depth,
                                                           int64_t cols, bool accumulate) {
  for (int64_t c0 = 0; c0 < cols;) {
    const int64_t left = cols - c0;
    if (rows == 1 && left >= 64) {
      narrow_tile<1, false, TB, 8>(A, lda, B + c0, ldb, C + c0, ldc, depth, accumulate);
      c0 += 64;
    } else if (left >= 32) {
      if (rows == 1) {
        narrow_tile<1, false, TB, 4>(A, lda, B + c0, ldb, C + c0, ldc, depth, accumulate);
      } else {
        narrow_tile<2, false, TB, 4>(A, lda, B + c0, ldb, C + c0, ldc, depth, accumulate);
      }
      c0 += 32;
    } else {
      if (rows == 1) {
        narrow_tile<1, false, TB>(A, lda, B + c0, ldb, C + c0, ldc, depth, accumulate);
      } else {
        narrow_tile<2, false, TB>(A, lda, B + c0, ldb, C + c0, ldc, depth, accumulate);
      }
      c0 += kLanes;
    }
  }
}

// tile<R, vectors> for vectors <= kMaxV (1: the narrow blocks of product(), narrow_tile)
template <int R, int kMaxV, bool kZmm = false, bool kFetch = false, typename TB = float>
__attribute__((always_inline)) inline void tile_columns(int vectors, const float* a, int64_t lda, const TB* b,
                                                        int64_t ldb, float* c, int64_t ldc, int64_t depth,
                                                        bool accumulate, const char* fetch, int64_t fetch_step) {
  if constexpr (kMaxV == 1) {
    return narrow_tile<R, kFetch, TB>(a, lda, b, ldb, c, ldc, depth, accumulate, fetch, fetch_step);
  }
  switch (vectors) {
    case 1: return tile<R, 1, kZmm, kFetch, TB>(a, lda, b, ldb, c, ldc, depth, accumulate, fetch, fetch_step);
    case 2: return tile<R, 2, kZmm, kFetch, TB>(a, lda, b, ldb, c, ldc, depth, accumulate, fetch, fetch_step);
    case 3: return tile<R, 3, kZmm, kFetch, TB>(a, lda, b, ldb, c, ldc, depth, accumulate, fetch, fetch_step);
    default: return tile<R, 4, kZmm, kFetch, TB>(a, lda, b, ldb, c, ldc, depth, accumulate, fetch, fetch_step);
  }
}

// C (= or +=) A B for A [rows, depth] (row stride lda), B [depth, cols] (ldb; float32, or
// bfloat16 bits), C [rows, cols] (ldc), cols a multiple of kLanes. lower: A is zero right of its
// diagonal, so the rows from i0 on sum only k < i0 + kTileRows. kFetch: the fetch_bytes from fetch on are fetched into L2
// while the blocks compute, evenly over their steps (a stream the next call will read). kZmm:
// built for AVX-512 (hold()). kTileRows: rows of a register block, 4, or 6 where the build has
// AVX-512's 32 registers (24 accumulators: B read once for six rows, four loads for 24 FMAs).
// kNarrow (the default without kZmm): built for AVX2's sixteen 8-lane registers, where blocks of
// four 16-lane vectors would need 32 registers for their accumulators alone and spill: blocks of
// kNarrowRows rows by one vector (narrow_tile: 12 registers of accumulators, two of B, one
// broadcast); one or two rows (without kFetch) in wider blocks (narrow_few_rows).
// The blocking changes no sum's order: the bits are the same.
template <bool kZmm = false, bool kFetch = false, typename TB = float, int kTileRows = kProductRows,
          bool kNarrow = !kZmm>
__attribute__((always_inline)) inline void product(const float* A, int64_t lda, const TB* B, int64_t ldb,
                                                   float* C, int64_t ldc, int64_t rows, int64_t depth, int64_t cols,
                                                   bool accumulate, bool lower = false, const char* fetch = nullptr,
                                                   int64_t fetch_bytes = 0) {
  static_assert(kTileRows == kProductRows || (kTileRows == 6 && kZmm), "six-row blocks need 32 registers");
  if constexpr (kNarrow && !kFetch) {
    if (rows > 0 && rows <= kNarrowFewRows && !lower) return narrow_few_rows(A, lda, B, ldb, C, ldc, rows, depth, cols, accumulate);
  }
  // a vector of 16 lanes takes two of the 16 registers of AVX2: blocks of one vector
  constexpr int kRowsHere = kNarrow ? kNarrowRows : kTileRows, kVectors = kNarrow ? 1 : kMaxVectors;
  int64_t fetch_step = 0;
  if constexpr (kFetch) {
    const int64_t steps = (cols + kVectors * kLanes - 1) / (kVectors * kLanes) *
                          ((rows + kRowsHere - 1) / kRowsHere) * depth;
    fetch_step = std::max<int64_t>(1, fetch_bytes / std::max<int64_t>(1, steps));
  }
  for (int64_t c0 = 0; c0 < cols; c0 += kVectors * kLanes) {
    const int vectors = static_cast<int>(std::min<int64_t>(kVectors, (cols - c0) / kLanes));
    for (int64_t i0 = 0; i0 < rows; i0 += kRowsHere) {
      const int64_t r = std::min<int64_t>(kRowsHere, rows - i0);
      const int64_t k = lower ? std::min(depth, i0 + r) : depth;
      const float* a = A + i0 * lda;
      float* c = C + i0 * ldc + c0;
      switch (r) {
        case 1: tile_columns<1, kVectors, kZmm, kFetch, TB>(vectors, a, lda, B + c0, ldb, c, ldc, k, accumulate, fetch, fetch_step); break;
        case 2: tile_columns<2, kVectors, kZmm, kFetch, TB>(vectors, a, lda, B + c0, ldb, c, ldc, k, accumulate, fetch, fetch_step); break;
        case 3: tile_columns<3, kVectors, kZmm, kFetch, TB>(vectors, a, lda, B + c0, ldb, c, ldc, k, accumulate, fetch, fetch_step); break;
        case 4: tile_columns<4, kVectors, kZmm, kFetch, TB>(vectors, a, lda, B + c0, ldb, c, ldc, k, accumulate, fetch, fetch_step); break;
        default:
          if constexpr (kRowsHere == 6) {
            if (r == 5) {
              tile_columns<5, kVectors, kZmm, kFetch, TB>(vectors, a, lda, B + c0, ldb, c, ldc, k, accumulate, fetch, fetch_step);
            } else {
              tile_columns<6, kVectors, kZmm, kFetch, TB>(vectors, a, lda, B + c0, ldb, c, ldc, k, accumulate, fetch, fetch_step);
            }
          }
          break;
      }
      if constexpr (kFetch) fetch += k * fetch_step;
    }
  }
}

}  // namespace fastjudge
