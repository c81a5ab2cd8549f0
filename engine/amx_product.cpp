#include "amx_product.hpp"

#include <algorithm>
#include <atomic>
#include <stdexcept>

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define FASTJUDGE_AMX 1
#define FASTJUDGE_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#endif

namespace fastjudge {
namespace {

std::atomic<bool> amx_wanted{true};

#ifdef FASTJUDGE_AMX
// Linux's arch_prctl request for a dynamically enabled state component, and the tile data's
constexpr int kArchRequestPermission = 0x1023;
constexpr int kTileDataComponent = 18;

bool cpu_and_os_have_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  return tile && bf16 && syscall(SYS_arch_prctl, kArchRequestPermission, kTileDataComponent) == 0;
}

// The tile configuration's memory layout (palette 1): tile t holds rows[t] rows of colsb[t] bytes
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: sums of `rows` rows (16 where a call has more) by 16 columns; 4 and 5: those rows by
// 16 input pairs; 6 and 7: 16 pair rows by 16 columns of a panel
FASTJUDGE_AMX_TARGET void configure(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 6 ? static_cast<uint8_t>(rows) : kTileRows;
    config.colsb[t] = 64;
  }
  // ldtilecfg by hand: GCC's _tile_loadconfig tells the compiler it reads a pointer's 8 bytes,
  // which lets it drop the stores of the rest
  asm volatile("ldtilecfg %0" ::"m"(config));
}

constexpr int64_t kPanelBytes = 64 * sizeof(uint32_t);  // a panel row: 64 columns of pairs

// c [16][N * 16] (row stride ldc floats; = or +=) = a [16][pairs] (lda words) by b [pairs][N * 16]
// (ldb words): tiles 0 .. N-1 hold the sums, 4 a's 16 pairs at a step, 6 and 7 b's in turn (a
// load need not wait for the multiply reading the other)
template <int N>
FASTJUDGE_AMX_TARGET __attribute__((always_inline)) inline void tile_row(const uint32_t* a, int64_t lda,
                                                                        const uint32_t* b, int64_t ldb, int64_t pairs,
                                                                        float* c, int64_t ldc,
                                                                        bool accumulate = false) {
  const int64_t a_stride = lda * 4, b_stride = ldb * 4, c_stride = ldc * 4;
  if (accumulate) {
    _tile_loadd(0, c, c_stride);
    if constexpr (N > 1) _tile_loadd(1, c + 16, c_stride);
    if constexpr (N > 2) _tile_loadd(2, c + 32, c_stride);
    if constexpr (N > 3) _tile_loadd(3, c + 48, c_stride);
  } else {
    _tile_zero(0);
    if constexpr (N > 1) _tile_zero(1);
    if constexpr (N > 2) _tile_zero(2);
    if constexpr (N > 3) _tile_zero(3);
  }
  for (int64_t i = 0; i < pairs; i += kTilePairs) {
    const uint32_t* bi = b + i * ldb;
    _tile_loadd(4, a + i, a_stride);
    _tile_loadd(6, bi, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (N > 1) {
      _tile_loadd(7, bi + 16, b_stride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (N > 2) {
      _tile_loadd(6, bi + 32, b_stride);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (N > 3) {
      _tile_loadd(7, bi + 48, b_stride);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  _tile_stored(0, c, c_stride);
  if constexpr (N > 1) _tile_stored(1, c + 16, c_stride);
  if constexpr (N > 2) _tile_stored(2, c + 32, c_stride);
  if constexpr (N > 3) _tile_stored(3, c + 48, c_stride);
}

// c [32, 64] = two blocks of rows by the panel, one half of its columns at a time: each step
// loads two tiles of inputs and two of weights for four multiplies (tile_row<4>: five for four)
FASTJUDGE_AMX_TARGET void two_blocks(const uint32_t* a, int64_t lda, const uint32_t* panel, int64_t pairs,
                                     float* c) {
  const int64_t a_stride = lda * static_cast<int64_t>(sizeof(uint32_t));
  const uint32_t* a1 = a + kTileRows * lda;
  for (int64_t half = 0; half < 64; half += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < pairs; i += kTilePairs) {
      const uint32_t* b = panel + i * 64 + half;
      _tile_loadd(4, a + i, a_stride);
      _tile_loadd(6, b, kPanelBytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + 16, kPanelBytes);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a1 + i, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    float* ch = c + half;
    _tile_stored(0, ch, kPanelBytes);
    _tile_stored(1, ch + 16, kPanelBytes);
    _tile_stored(2, ch + kTileRows * 64, kPanelBytes);
    _tile_stored(3, ch + kTileRows * 64 + 16, kPanelBytes);
  }
}
#endif

}  // namespace

bool amx_products() {
#ifdef FASTJUDGE_AMX
  static const bool has = cpu_and_os_have_amx();
  return has && amx_wanted.load();
#else
  return false;
#endif
}

bool amx_products(bool wanted) {
  amx_wanted.store(wanted);
  return amx_products();
}

#ifdef FASTJUDGE_AMX
FASTJUDGE_AMX_TARGET void amx_configure(int64_t rows) {
  configure(std::min(rows, kTileRows));
}

FASTJUDGE_AMX_TARGET void amx_pair_product(const uint32_t* a, int64_t lda, const uint32_t* panel, int64_t pairs,
                                           int64_t rows, float* c) {
  int64_t r0 = 0;
  for (; r0 + kTileRows < rows; r0 += 2 * kTileRows) two_blocks(a + r0 * lda, lda, panel, pairs, c + r0 * 64);
  if (r0 < rows) tile_row<4>(a + r0 * lda, lda, panel, 64, pairs, c + r0 * 64, 64);
}

FASTJUDGE_AMX_TARGET void amx_tile_product(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                                           int64_t pairs, float* c, int64_t ldc, int64_t columns, bool accumulate) {
  int64_t c0 = 0;
  for (; c0 + 64 <= columns; c0 += 64) tile_row<4>(a, lda, b + c0, ldb, pairs, c + c0, ldc, accumulate);
  switch ((columns - c0) / 16) {
    case 3: tile_row<3>(a, lda, b + c0, ldb, pairs, c + c0, ldc, accumulate); break;
    case 2: tile_row<2>(a, lda, b + c0, ldb, pairs, c + c0, ldc, accumulate); break;
    case 1: tile_row<1>(a, lda, b + c0, ldb, pairs, c + c0, ldc, accumulate); break;
    default: break;
  }
}

FASTJUDGE_AMX_TARGET void amx_release() {
  _tile_release();
}
#else
void amx_pair_product(const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t, float*) {
  throw std::logic_error("this build has no AMX tile products");
}
void amx_tile_product(const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t, float*, int64_t, int64_t, bool) {
  throw std::logic_error("this build has no AMX tile products");
}
void amx_configure(int64_t) {
  throw std::logic_error("this build has no AMX tile products");
}
void amx_release() {}
#endif

}  // namespace fastjudge
