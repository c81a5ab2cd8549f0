#include "attention_inputs.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_parallel.hpp"
#include "rms_norm.hpp"
#include "vector_math.hpp"

namespace fastjudge {
namespace {

// One thread for each 64 Ki values: below that a wake-up of the team costs more than its share.
constexpr int64_t kValuesPerThread = 1 << 16;

// o <- o * sigmoid(g) over n values (a multiple of 16), the sigmoid rounded to T first (as
// `o * torch.sigmoid(gate)`); four vectors at a time where n allows: their sigmoids' long chains
// (an exponential, a division) overlap, where one vector at a time waits on each. kWide: built
// for AVX-512, 16 lanes a vector; else 8 (on AVX2 the sigmoid's selects of 16 lanes are scalar
// code). Each value's arithmetic is the same either way.
template <bool kWide, typename T>
__attribute__((always_inline)) inline void gate_into(T* o, const T* g, int64_t n) {
  using V = LaneVector<kWide>;
  constexpr int64_t W = kLanesOf<V>;
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    V y[4];
    for (int u = 0; u < 4; ++u)
      y[u] = load_lanes<V>(o + i + u * W) * rounded<T>(sigmoid(load_lanes<V>(g + i + u * W)));
    for (int u = 0; u < 4; ++u) store_lanes(o + i + u * W, y[u]);
  }
  for (; i < n; i += W) store_lanes(o + i, load_lanes<V>(o + i) * rounded<T>(sigmoid(load_lanes<V>(g + i))));
}

// The output gates of rows [first, last): row t's n values of o against its gates at g + t *
// gate_stride (for the builds: FASTJUDGE_VERSIONED)
template <typename T>
struct GateRows {
  T* o;
  const T* g;
  int64_t gate_stride, n, first, last;
};

template <bool kWide, typename T>
__attribute__((always_inline)) inline void gate_rows(const GateRows<T>& a) {
  for (int64_t t = a.first; t < a.last; ++t) gate_into<kWide>(a.o + t * a.n, a.g + t * a.gate_stride, a.n);
}

// Rotary embedding of `heads` rows of hd values from x into out (out != x): out = x * cos, then
// out[i] + x[half + i] * sin[i] on the first half of the rotary dims and out[half + i] + x[i] *
// sin[half + i] on the second (sin carries rotate-half's sign), each step rounded to T; dims past
// 2 half pass through as x * 1. hd a multiple of 16.
template <typename T>
__attribute__((always_inline)) inline void rotate_rows(const T* x, const T* cos, const T* sin, T* out,
                                                       int64_t heads, int64_t hd, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    const T* src = x + h * hd;
    T* dst = out + h * hd;
    for (int64_t i = 0; i < hd; i += kLanes) store_floats(dst + i, load_floats(src + i) * load_floats(cos + i));
    // the rotated pairs a vector at a time, then one by one (the same arithmetic)
    int64_t i = 0;
    for (; i + kLanes <= half; i += kLanes) {
      const Floats low = load_floats(src + i), high = load_floats(src + half + i);
      store_floats(dst + i, load_floats(dst + i) + high * load_floats(sin + i));
      store_floats(dst + half + i, load_floats(dst + half + i) + low * load_floats(sin + half + i));
    }
    for (; i < half; ++i) {
      from_float(to_float(dst[i]) + to_float(src[half + i]) * to_float(sin[i]), dst + i);
      from_float(to_float(dst[half + i]) + to_float(src[i]) * to_float(sin[half + i]), dst + half + i);
    }
  }
}

// The ISA builds, one per element type (target_clones does not take templates)
using GateRowsF32 = GateRows<float>;
using GateRowsBF16 = GateRows<uint16_t>;
FASTJUDGE_VERSIONED(gate_f32, gate_rows, GateRowsF32)
FASTJUDGE_VERSIONED(gate_bf16, gate_rows, GateRowsBF16)
FASTJUDGE_CLONES void rotate_f32(const float* x, const float* cos, const float* sin, float* out, int64_t heads,
                                 int64_t hd, int64_t half) {
  rotate_rows(x, cos, sin, out, heads, hd, half);
}
FASTJUDGE_CLONES void rotate_bf16(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, uint16_t* out,
                                  int64_t heads, int64_t hd, int64_t half) {
  rotate_rows(x, cos, sin, out, heads, hd, half);
}

void gate(const GateRows<float>& rows) { gate_f32(rows); }
void gate(const GateRows<uint16_t>& rows) { gate_bf16(rows); }
void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t heads, int64_t hd, int64_t half) {
  rotate_f32(x, cos, sin, out, heads, hd, half);
}
void rotate(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, uint16_t* out, int64_t heads, int64_t hd,
            int64_t half) {
  rotate_bf16(x, cos, sin, out, heads, hd, half);
}

// tokens [first, last) of an attention layer's inputs; normed: (H + Hkv) hd values of scratch
template <typename T>
void inputs_of_tokens(const AttentionInputs<T>& in, T* normed, int64_t first, int64_t last) {
  const int64_t heads = in.H + in.Hkv, hd = in.hd;
  for (int64_t n = first; n < last; ++n) {
    const T* row = in.qkv + n * in.width;
    rms_norm(row, in.width, hd, in.qk_norm, normed, 1, heads, hd, in.eps, 1);
    T* rotated = in.rotated + n * heads * hd;
    const int64_t rope = in.rope_rows ? in.rope_rows[n] : n;
    rotate(normed, in.cos + rope * hd, in.sin + rope * hd, rotated, heads, hd, in.half);
    // the pool's last column is its scratch, where padding goes and nothing is read: not
    // written here (several threads' padding tokens would write it at once)
    if (in.where[n] == in.columns - 1) continue;
    const int64_t b = in.token_rows ? in.token_rows[n] : n / in.S;
    for (int64_t h = 0; h < in.Hkv; ++h) {
      const int64_t at = ((b * in.Hkv + h) * in.columns + in.where[n]) * hd;
      std::memcpy(in.keys + at, rotated + (in.H + h) * hd, hd * sizeof(T));
      std::memcpy(in.values + at, row + in.values_at + h * hd, hd * sizeof(T));
    }
  }
}

template <typename T>
void all_inputs(const AttentionInputs<T>& in, int threads) {
  const int64_t N = in.B * in.S, heads = in.H + in.Hkv;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, N * heads * in.hd / kValuesPerThread));
  parallel_ranges(N, workers, 1, [&](int64_t first, int64_t last) {
    std::vector<T> normed(static_cast<std::size_t>(heads * in.hd));
    inputs_of_tokens(in, normed.data(), first, last);
  });
}

template <typename T>
void all_gates(T* o, const T* g, int64_t gate_stride, int64_t N, int64_t n, int threads) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, N * n / kValuesPerThread));
  parallel_ranges(N, workers, 1,
                  [&](int64_t first, int64_t last) { gate(GateRows<T>{o, g, gate_stride, n, first, last}); });
}

}  // namespace

void attention_inputs(const AttentionInputs<float>& in, int threads) { all_inputs(in, threads); }
void attention_inputs(const AttentionInputs<uint16_t>& in, int threads) { all_inputs(in, threads); }

void output_gate(float* o, const float* g, int64_t gate_stride, int64_t N, int64_t n, int threads) {
  all_gates(o, g, gate_stride, N, n, threads);
}
void output_gate(uint16_t* o, const uint16_t* g, int64_t gate_stride, int64_t N, int64_t n, int threads) {
  all_gates(o, g, gate_stride, N, n, threads);
}

}  // namespace fastjudge
