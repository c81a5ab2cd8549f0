// Linear projections y = x W^T in float32 on the CPU, on weights packed once into panels of 64
// output columns: panels[p, k, c] = W[64 p + c, k] (zero past the last output), so a register
// block streams a panel's rows in order. Each output is its row's dot product with a weight row,
// summed over k in increasing order, in float32.
//
// Standard library only, like the rest of the engine. Measured against oneDNN's prepacked linear
// (the GEMM torch's CPU weight prepacking runs) on a 2-core AVX-512 machine, two threads: as fast
// from 64 rows up to 2,048 (within 2 %), and faster at a decoding step's few rows, where oneDNN's
// call costs about 15 us before any work (256 x 1536 weights: 1 row 32 -> 17 us, 16 rows 81 -> 63
// us).
#pragma once

#include <cstdint>
#include <optional>
#include <type_traits>

namespace fastjudge {

constexpr int64_t kPanelColumns = 64;

// What a gated projection applies to its gate before multiplying the up projection's output, or a
// float32 projection to its output.
enum class GateActivation { kSilu = 0, kGeluTanh = 1, kRelu = 2 };

// out [M, N] = x [M, K] W^T; x rows row_stride apart (contiguous within a row), out contiguous.
void dense_product(const float* x, int64_t row_stride, const float* panels, float* out, int64_t M, int64_t K,
                   int64_t N, int threads);

// out [M, N] = act(x W^T + bias): bias [N] added where not null, then the activation where given,
// each panel's outputs while they are in cache (the sum's bits as dense_product's, the bias added
// in one rounding as a separate add would).
void dense_product(const float* x, int64_t row_stride, const float* panels, float* out, int64_t M, int64_t K,
                   int64_t N, const float* bias, std::optional<GateActivation> activation, int threads);

// out [M, N] = act(x Wg^T) * (x Wu^T), each panel of the gate and the up weight together.
void gated_dense_product(const float* x, int64_t row_stride, const float* gate_panels, const float* up_panels,
                         float* out, int64_t M, int64_t K, int64_t N, GateActivation activation, int threads);

// bfloat16 (as 16-bit patterns) on CPUs with AVX512-BF16: the products as bfloat16 dot products
// (vdpbf16ps: each pair of exact products added into float32 lanes, inputs k = 2i + 1 then 2i,
// as oneDNN's bfloat16 GEMM adds them), each output rounded once to bfloat16. Panels hold pairs
// of inputs: pair_panels[p, i, c] = (W[64 p + c, 2 i], W[64 p + c, 2 i + 1]) in one 32-bit word
// (zero past the last output and input). Gated: act(gate) rounded to bfloat16, times the up
// projection's float32 sum, rounded (what oneDNN's two fused linears compute). Where the CPU has
// AMX-BF16 and K is a multiple of 32, the products run on AMX tiles instead (amx_product.hpp:
// each pair's two products added in one fused step, as oneDNN's tile GEMM adds them), at every
// row count, so that a row's bits never depend on the rows beside it.
bool bf16_dense_available();
void dense_product(const uint16_t* x, int64_t row_stride, const uint32_t* pair_panels, uint16_t* out, int64_t M,
                   int64_t K, int64_t N, int threads);
void gated_dense_product(const uint16_t* x, int64_t row_stride, const uint32_t* gate_panels, const uint32_t* up_panels,
                         uint16_t* out, int64_t M, int64_t K, int64_t N, GateActivation activation, int threads);


// A projection's weight as panels bound once (float32, or bfloat16 input pairs as 32-bit words):
// `in` inputs, `out` outputs.
struct PackedWeight {
  const void* panels = nullptr;
  int64_t in = 0, out = 0;
};

// The panels' element for a model type T: float32 weights, or bfloat16 input pairs in 32-bit words
template <typename T>
using PanelWord = std::conditional_t<std::is_same_v<T, float>, float, uint32_t>;

// out [rows, w.out] = x [rows, w.in] (contiguous) W^T
template <typename T>
void project(const T* x, int64_t rows, const PackedWeight& w, T* out, int threads) {
  dense_product(x, w.in, static_cast<const PanelWord<T>*>(w.panels), out, rows, w.in, w.out, threads);
}

}  // namespace fastjudge
