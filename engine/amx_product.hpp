// bfloat16 products on AMX tiles (Intel's Advanced Matrix Extensions: AMX-TILE and AMX-BF16),
// for the engine's projection panels where the CPU has them.
//
// A panel's bfloat16 input pairs ([pairs][64] 32-bit words, each two weights of consecutive
// inputs) are already the layout a tile multiply reads its second operand in (16 pair rows of
// 16 columns, 64 bytes a row), so a tile product reads the panels the AVX512-BF16 kernels read,
// as they are. One TDPBF16PS multiplies 16 rows by 16 pairs by 16 columns (8,192 multiply-adds)
// where a vdpbf16ps does 32: on two cores of the Xeon measured, oneDNN's linear (which runs on
// the tiles) did 16-256 rows x 512 -> 2,048 at 450-1,700 GFLOP/s against 170-200 for the
// AVX512-BF16 kernel (docs/benchmarks.md).
#pragma once

#include <cstdint>

namespace fastjudge {

// pairs a tile product takes at once: its first operand's 64-byte rows
constexpr int64_t kTilePairs = 16;
// rows a tile product takes at once
constexpr int64_t kTileRows = 16;

// Whether this CPU has AMX-BF16 and the kernel lets this process use its tile data (Linux asks
// each process to request it: done here, once), and amx_products(false) has not turned them off.
bool amx_products();
// Turns the tile products on or off (for comparisons; on by default where the CPU has them);
// returns amx_products().
bool amx_products(bool wanted);

// Sets this thread's tiles up for the products below: once per call, before its first product
// (the tiles are the thread's state, and oneDNN's GEMMs on the same thread set up their own).
// rows: the most rows a product of the call takes (16 from 16 on; fewer make cheaper tiles)
void amx_configure(int64_t rows);

// c [rows', 64] = a [rows', pairs] x panel [pairs][64] over pairs in increasing order, in
// float32, rows' = rows rounded up to the configured rows (the rows of a past `rows` are read and
// their outputs written: the caller pads both); a's rows lda words apart; pairs a multiple of
// kTilePairs. Needs amx_products() and amx_configure(rows) on this thread.
void amx_pair_product(const uint32_t* a, int64_t lda, const uint32_t* panel, int64_t pairs, int64_t rows, float* c);

// c [16][columns] (rows ldc floats apart; accumulate: += its values) = a [16][pairs] (lda words
// apart) by b [pairs][columns] (ldb words apart), each output a float32 sum over pairs in
// increasing order; pairs and columns multiples of 16. Needs amx_products() and
// amx_configure(kTileRows) on this thread.
void amx_tile_product(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t pairs, float* c,
                      int64_t ldc, int64_t columns, bool accumulate = false);

// Gives this thread's tile state back to the OS (after a call's last tile product: a thread
// holding tile state saves and restores 8 KiB at each context switch)
void amx_release();

}  // namespace fastjudge
