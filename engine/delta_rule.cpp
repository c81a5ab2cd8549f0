#include "delta_rule.hpp"

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "cpu_parallel.hpp"
#include "vector_math.hpp"

namespace fastjudge {
namespace {

// One thread for each 4 MB of state (16 rows of 16 heads of 128 x 128 take four): below that a
// thread's start costs more than the share of the state it would stream.
constexpr int64_t kFloatsPerThread = 1 << 20;
// The few-token step's rows: one thread for each 256 KB of state (the step also runs the conv,
// norms and gates of its rows, and the threads are the process's OpenMP team, which costs
// microseconds to wake)
constexpr int64_t kStepFloatsPerThread = 1 << 16;

struct Step {
  float* memory;
  const StridedRows<float>& query, &key, &value;
  const float *decay, *beta;
  float* out;
  int64_t S, Hk, Hv, dk, dv;
};

// One head's rule for one token on columns [j0, j0 + W NV) of its state M (dk x dv), W the lanes
// of V (Floats, or Floats8 in code built for AVX2, whose 16-lane vectors would live in memory),
// each column's arithmetic that of update_head's loops below, in the same order: the columns'
// sums stay in registers through the rows (summed in memory, each row's sums waited on the store
// of the row before), and the block's rows are still in cache for the second pass.
template <typename V, int NV>
__attribute__((always_inline)) inline void update_columns(float* M, const float* q, const float* k, const float* v,
                                                          float decay, float beta, float* out, int64_t dk,
                                                          int64_t dv, int64_t j0) {
  constexpr int W = kLanesOf<V>;
  V read[NV] = {}, u[NV], sums[NV] = {};
  for (int64_t i = 0; i < dk; ++i) {  // forget, and read what the memory holds under k
    float* m = M + i * dv + j0;
    const float ki = k[i];  // read once: the stores to m could alias it for all the compiler knows
    for (int n = 0; n < NV; ++n) {
      const V x = load_as<V>(m + n * W) * decay;
      store_as(m + n * W, x);
      read[n] += ki * x;
    }
  }
  for (int n = 0; n < NV; ++n) u[n] = (load_as<V>(v + j0 + n * W) - read[n]) * beta;
  for (int64_t i = 0; i < dk; ++i) {  // write the correction under k, read under q
    float* m = M + i * dv + j0;
    const float ki = k[i], qi = q[i];
    for (int n = 0; n < NV; ++n) {
      const V x = load_as<V>(m + n * W) + ki * u[n];
      store_as(m + n * W, x);
      sums[n] += qi * x;
    }
  }
  for (int n = 0; n < NV; ++n) store_as(out + j0 + n * W, sums[n]);
}

// One head's rule for one token, in place on its state M (dk x dv): M <- decay M; u = beta (v -
// M^T k); M <- M + k u^T; out = M^T q. Two passes over M (by blocks of four vectors of columns
// where dv is a multiple of 16), the second while it is still in cache; no sum runs across vector
// lanes, so the bits do not depend on the vectors' width (kWide: built for AVX-512). read and u:
// dv floats of scratch.
template <bool kWide>
__attribute__((always_inline)) inline void update_head(float* M, const float* q, const float* k, const float* v,
                                                       float decay, float beta, float* out, float* read, float* u,
                                                       int64_t dk, int64_t dv) {
  using V = LaneVector<kWide>;
  constexpr int64_t W = kLanesOf<V>;
  if (dv % kLanes == 0) {
    int64_t j0 = 0;
    for (; j0 + 4 * W <= dv; j0 += 4 * W) update_columns<V, 4>(M, q, k, v, decay, beta, out, dk, dv, j0);
    for (; j0 < dv; j0 += W) update_columns<V, 1>(M, q, k, v, decay, beta, out, dk, dv, j0);
    return;
  }
  std::fill(read, read + dv, 0.0f);
  for (int64_t i = 0; i < dk; ++i) {  // forget, and read what the memory holds under k
    float* m = M + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; ++j) {
      m[j] *= decay;
      read[j] += ki * m[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) u[j] = (v[j] - read[j]) * beta;
  std::fill(out, out + dv, 0.0f);
  for (int64_t i = 0; i < dk; ++i) {  // write the correction under k, read under q
    float* m = M + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; ++j) {
      m[j] += ki * u[j];
      out[j] += qi * m[j];
    }
  }
}

// heads [first, last) of the B x Hv grid, for the builds (FASTJUDGE_VERSIONED)
struct HeadRange {
  const Step& s;
  int64_t first, last;
};

template <bool kWide>
__attribute__((always_inline)) inline void run_heads(const HeadRange& a) {
  const Step& s = a.s;
  const int64_t G = s.Hv / s.Hk, dk = s.dk, dv = s.dv;
  std::vector<float> scratch(static_cast<std::size_t>(2 * dv));
  for (int64_t job = a.first; job < a.last; ++job) {
    const int64_t b = job / s.Hv, h = job % s.Hv, hk = h / G;
    float* M = s.memory + job * dk * dv;
    for (int64_t t = 0; t < s.S; ++t) {
      const int64_t bt = b * s.S + t;
      update_head<kWide>(M, s.query.row(b, t, hk), s.key.row(b, t, hk), s.value.row(b, t, h),
                         s.decay[bt * s.Hv + h], s.beta[bt * s.Hv + h], s.out + (bt * s.Hv + h) * dv,
                         scratch.data(), scratch.data() + dv, dk, dv);
    }
  }
}

FASTJUDGE_VERSIONED(run_heads_any, run_heads, HeadRange)

// sum of squares of x[0 .. n), in float32
inline float sum_of_squares(const float* x, int64_t n) {
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) total += x[j] * x[j];
  return total;
}

// A token's gates for value head h, from its projected row [conv inputs C | z | b | a]:
// g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) held in T, both 0 on padding
template <typename T>
__attribute__((always_inline)) inline void token_gates(const DeltaNetStep& s, const T* row, int64_t C, int64_t h,
                                                       bool real, float& g, float& beta) {
  const int64_t Hv = s.Hv, dv = s.dv;
  const float a = to_float(row[C + Hv * dv + Hv + h]) + s.dt_bias[h];
  const float softplus = a > 20.0f ? a : std::log1p(std::exp(a));
  g = real ? s.neg_A[h] * softplus : 0.0f;
  beta = real ? rounded<T>(1.0f / (1.0f + std::exp(-to_float(row[C + Hv * dv + h])))) : 0.0f;
}

// The gated RMSNorm of one value head's rule output core [dvp] (zeros past dv; overwritten):
// normalised in float32 from its value in T (its squares summed lane by lane, then across the
// 16 lanes by halves), scaled by the weight (float32: as one RMSNorm with its weight; bfloat16:
// the norm and the product each rounded, as two tensor ops round them), times silu(z) (z [dv] in
// T), into o [dv]; gate: dvp floats of scratch, zeros past dv. kWide: built for AVX-512, 16 lanes
// at a time; else 8, lanes 0-7 and 8-15 of the squares summed apart (the same sums in the same
// order: the same bits).
template <bool kWide, typename T>
__attribute__((always_inline)) inline void gated_rms_norm(float* core, const T* z, const float* weight, float eps,
                                                          int64_t dv, int64_t dvp, float* gate, T* o) {
  using V = LaneVector<kWide>;
  constexpr int W = kLanesOf<V>, kParts = kLanes / W;
  V squares[kParts] = {};
  for (int64_t j = 0; j < dvp; j += kLanes) {
    for (int h = 0; h < kParts; ++h) {
      const V x = rounded<T>(load_as<V>(core + j + h * W));
      store_as(core + j + h * W, x);
      squares[h] += x * x;
    }
  }
  float lanes[kLanes];
  for (int h = 0; h < kParts; ++h) store_as(lanes + h * W, squares[h]);
  for (int width = kLanes / 2; width > 0; width /= 2) {  // a tree across the lanes: 4 steps deep, not 16
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  }
  const float inverse = 1.0f / std::sqrt(lanes[0] / static_cast<float>(dv) + eps);
  const int64_t whole = dv / kLanes * kLanes;
  for (int64_t j = 0; j < whole; j += kLanes) store(gate + j, load_floats(z + j));
  for (int64_t j = whole; j < dv; ++j) gate[j] = to_float(z[j]);
  for (int64_t j = 0; j < dvp; j += W) {
    const V x = load_as<V>(core + j) * inverse, w = load_as<V>(weight + j);
    const V normed = std::is_same_v<T, float> ? x * w : rounded<T>(rounded<T>(x) * w);
    store_as(core + j, normed * silu(load_as<V>(gate + j)));
  }
  for (int64_t j = 0; j < whole; j += kLanes) store_floats(o + j, load(core + j));
  for (int64_t j = whole; j < dv; ++j) from_float(core[j], o + j);
}

// A DeltaNet layer's step over rows [first, last) (DeltaNetStep), for the builds
// (FASTJUDGE_VERSIONED)
template <typename T>
struct StepRows {
  const DeltaNetStep& s;
  const T* projected;
  T* conv_state;
  const T* taps;
  float* memory;
  T* out;
  int64_t first, last;
};

// the rows of a StepRows; vectors of channels padded to whole vectors with zeros. kWide: built
// for AVX-512, 16 lanes at a time; else 8 (each lane's arithmetic the same)
template <bool kWide, typename T>
__attribute__((always_inline)) inline void deltanet_rows(const StepRows<T>& a) {
  using V = LaneVector<kWide>;
  constexpr int64_t W = kLanesOf<V>;
  const DeltaNetStep& s = a.s;
  const T* projected = a.projected;
  const int64_t S = s.S, K = s.K, Hk = s.Hk, Hv = s.Hv, dk = s.dk, dv = s.dv, G = Hv / Hk;
  const int64_t C = 2 * Hk * dk + Hv * dv, width = C + Hv * dv + 2 * Hv;
  const int64_t Cp = whole_vectors(C), dvp = whole_vectors(dv);
  std::vector<float> window(static_cast<std::size_t>((K - 1 + S) * Cp), 0.0f);
  std::vector<float> kernel(static_cast<std::size_t>(K * Cp), 0.0f), act(static_cast<std::size_t>(Cp));
  std::vector<float> vectors(static_cast<std::size_t>(3 * dvp), 0.0f), scratch(static_cast<std::size_t>(2 * dv));
  float *core = vectors.data(), *gate = core + dvp, *weight = gate + dvp;
  float *read = scratch.data(), *u = read + dv;
  for (int64_t j = 0; j < K; ++j)
    for (int64_t c = 0; c < C; ++c) kernel[j * Cp + c] = to_float(a.taps[j * C + c]);
  std::copy(s.gated_norm, s.gated_norm + dv, weight);
  const float q_scale = 1.0f / static_cast<float>(dk), k_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  const float l2_eps = s.l2_eps / static_cast<float>(dk);
  for (int64_t b = a.first; b < a.last; ++b) {
    float* M = a.memory + b * Hv * dk * dv;
    T* state = a.conv_state + b * (K - 1) * C;
    if (s.fresh) std::fill(M, M + Hv * dk * dv, 0.0f);
    // the conv window: the row's last K - 1 inputs (none when fresh), then this step's
    for (int64_t i = 0; i < K - 1; ++i)
      for (int64_t c = 0; c < C; ++c) window[i * Cp + c] = s.fresh ? 0.0f : to_float(state[i * C + c]);
    // the row's tokens: packed (its real ones) or [B, S] (padding included)
    const int64_t count = s.counts[b], tokens = s.first ? count : S, at = s.first ? s.first[b] : b * S;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t c = 0; c < C; ++c) window[(K - 1 + t) * Cp + c] = to_float(projected[(at + t) * width + c]);
    for (int64_t t = 0; t < tokens; ++t) {
      const T* row = projected + (at + t) * width;
      const bool real = t < count;
      // causal depthwise conv and SiLU, each product, the sum and the activation held in T as
      // the tensor ops hold them
      for (int64_t c = 0; c < Cp; c += W) {
        V total{};
        for (int64_t j = 0; j < K; ++j)
          total += rounded<T>(load_as<V>(window.data() + (t + j) * Cp + c) * load_as<V>(kernel.data() + j * Cp + c));
        store_as(act.data() + c, rounded<T>(silu(rounded<T>(total))));
      }
      // queries and keys: RMS-normalised with eps / dk (an L2 norm times sqrt(dk)), then the L2
      // norm's and the rule's scales: queries 1 / dk, keys 1 / sqrt(dk)
      for (int64_t part = 0; part < 2 * Hk; ++part) {
        float* x = act.data() + part * dk;
        const float inverse = 1.0f / std::sqrt(sum_of_squares(x, dk) / static_cast<float>(dk) + l2_eps);
        const float scale = part < Hk ? q_scale : k_scale;
        for (int64_t j = 0; j < dk; ++j) x[j] = x[j] * inverse * scale;
      }
      for (int64_t h = 0; h < Hv; ++h) {
        const int64_t hk = h / G;
        float g, beta;
        token_gates(s, row, C, h, real, g, beta);
        update_head<kWide>(M + h * dk * dv, act.data() + hk * dk, act.data() + (Hk + hk) * dk,
                           act.data() + 2 * Hk * dk + h * dv, std::exp(g), beta, core, read, u, dk, dv);
        gated_rms_norm<kWide>(core, row + C + h * dv, weight, s.eps, dv, dvp, gate,
                              a.out + ((at + t) * Hv + h) * dv);
      }
    }
    // the row's new conv state: its last K - 1 real inputs (window rows count .. count + K - 2)
    for (int64_t i = 0; i < K - 1; ++i)
      for (int64_t c = 0; c < C; ++c) from_float(window[(count + i) * Cp + c], state + i * C + c);
  }
}

using StepRowsF32 = StepRows<float>;
using StepRowsBF16 = StepRows<uint16_t>;
FASTJUDGE_VERSIONED(deltanet_rows_f32, deltanet_rows, StepRowsF32)
FASTJUDGE_VERSIONED(deltanet_rows_bf16, deltanet_rows, StepRowsBF16)

template <typename T>
void deltanet(const DeltaNetStep& s, const T* projected, T* conv_state, const T* taps, float* memory, T* out,
              int threads) {
  if (s.B == 0 || s.S == 0) return;
  const int64_t workers = std::min<int64_t>(threads, s.B * s.Hv * s.dk * s.dv / kStepFloatsPerThread);
  parallel_ranges(s.B, workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (std::is_same_v<T, float>) {
      deltanet_rows_f32(StepRowsF32{s, projected, conv_state, taps, memory, out, first, last});
    } else {
      deltanet_rows_bf16(StepRowsBF16{s, projected, conv_state, taps, memory, out, first, last});
    }
  });
}

// The chunked form's conv reads each token's inputs through this many pointers at most
constexpr int64_t kMaxTaps = 16;

// The chunked form's conv and gates over tokens [first, last) of the B x S (for the builds:
// FASTJUDGE_VERSIONED): each token's causal depthwise conv over its row's inputs t - K + 1 .. t
// (those before the first from the conv state; zeros when fresh), its sum in float32 held in T,
// then SiLU held in T, into inputs [N, C] as float32 (the rule's queries, keys and values); its
// gates into g and beta [N, Hv]. kernel [K, Cp]: the taps in float32, channels padded to whole
// vectors.
template <typename T>
struct ConvTokens {
  const DeltaNetStep& s;
  const T* projected;
  const T* conv_state;
  const float* kernel;
  float *inputs, *g, *beta;
  int64_t first, last;
};

// kWide: built for AVX-512, 16 lanes at a time; else 8 (each channel's arithmetic the same)
template <bool kWide, typename T>
__attribute__((always_inline)) inline void conv_tokens(const ConvTokens<T>& a) {
  using V = LaneVector<kWide>;
  constexpr int64_t W = kLanesOf<V>;
  const DeltaNetStep& s = a.s;
  const int64_t S = s.S, K = s.K, Hv = s.Hv, C = 2 * s.Hk * s.dk + Hv * s.dv, width = C + Hv * s.dv + 2 * Hv;
  const int64_t Cp = whole_vectors(C);
  const float* kernel = a.kernel;
  const T* sources[kMaxTaps];
  float tail[W];
  for (int64_t n = a.first; n < a.last; ++n) {
    const int64_t b = n / S, t = n % S;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t at = t - (K - 1) + j;  // a new input, or (negative) one of the conv state's
      sources[j] = at >= 0 ? a.projected + (b * S + at) * width
                 : s.fresh ? nullptr : a.conv_state + (b * (K - 1) + (K - 1) + at) * C;
    }
    float* act = a.inputs + n * C;
    // four vectors of channels at a time: their SiLUs' long chains (an exponential, a division)
    // overlap, where one vector at a time waits on each
    constexpr int64_t kBlock = 4 * W;
    const int64_t blocked = C / kBlock * kBlock;
    for (int64_t c = 0; c < blocked; c += kBlock) {
      V total[4] = {};
      for (int64_t j = 0; j < K; ++j) {
        if (sources[j] == nullptr) continue;
        for (int u = 0; u < 4; ++u) {
          total[u] += load_lanes<V>(sources[j] + c + u * W) * load_as<V>(kernel + j * Cp + c + u * W);
        }
      }
      for (int u = 0; u < 4; ++u) store_as(act + c + u * W, rounded<T>(silu(rounded<T>(total[u]))));
    }
    for (int64_t c = blocked; c < C; c += W) {
      const int64_t lanes = std::min<int64_t>(W, C - c);
      V total{};
      for (int64_t j = 0; j < K; ++j) {
        if (sources[j] == nullptr) continue;
        V x;
        if (lanes == W) {
          x = load_lanes<V>(sources[j] + c);
        } else {
          std::fill(tail, tail + W, 0.0f);
          for (int64_t i = 0; i < lanes; ++i) tail[i] = to_float(sources[j][c + i]);
          x = load_as<V>(tail);
        }
        total += x * load_as<V>(kernel + j * Cp + c);
      }
      const V y = rounded<T>(silu(rounded<T>(total)));
      if (lanes == W) {
        store_as(act + c, y);
      } else {
        store_as(tail, y);
        std::copy(tail, tail + lanes, act + c);
      }
    }
    const T* row = a.projected + n * width;
    for (int64_t h = 0; h < Hv; ++h)
      token_gates(s, row, C, h, t < s.counts[b], a.g[n * Hv + h], a.beta[n * Hv + h]);
  }
}

using ConvTokensF32 = ConvTokens<float>;
using ConvTokensBF16 = ConvTokens<uint16_t>;
FASTJUDGE_VERSIONED(conv_tokens_f32, conv_tokens, ConvTokensF32)
FASTJUDGE_VERSIONED(conv_tokens_bf16, conv_tokens, ConvTokensBF16)

// The gated norms of value heads [first, last) of the N x Hv (for the builds:
// FASTJUDGE_VERSIONED): core [N, Hv, dv] (float32, dv a multiple of kLanes; overwritten) into
// out [N, Hv dv]
template <typename T>
struct NormHeads {
  const DeltaNetStep& s;
  const T* projected;
  float* core;
  const float* weight;
  T* out;
  int64_t first, last;
};

template <bool kWide, typename T>
__attribute__((always_inline)) inline void gated_norm_heads(const NormHeads<T>& a) {
  const DeltaNetStep& s = a.s;
  const int64_t Hv = s.Hv, dv = s.dv, C = 2 * s.Hk * s.dk + Hv * dv, width = C + Hv * dv + 2 * Hv;
  std::vector<float> gate(static_cast<std::size_t>(dv), 0.0f);
  for (int64_t head = a.first; head < a.last; ++head) {
    const int64_t n = head / Hv, h = head % Hv;
    gated_rms_norm<kWide>(a.core + head * dv, a.projected + n * width + C + h * dv, a.weight, s.eps, dv, dv,
                          gate.data(), a.out + head * dv);
  }
}

using NormHeadsF32 = NormHeads<float>;
using NormHeadsBF16 = NormHeads<uint16_t>;
FASTJUDGE_VERSIONED(gated_norm_heads_f32, gated_norm_heads, NormHeadsF32)
FASTJUDGE_VERSIONED(gated_norm_heads_bf16, gated_norm_heads, NormHeadsBF16)

// The many-token form of deltanet_step: the conv and gates of every token at once (threads over
// tokens), each row's new conv state, the chunked rule over float32 queries, keys and values,
// then the gated norms (threads over heads)
template <typename T>
void deltanet_chunked(const DeltaNetStep& s, const T* projected, T* conv_state, const T* taps, float* memory, T* out,
                      int64_t chunk, float exp_floor, int threads) {
  const int64_t B = s.B, S = s.S, K = s.K, Hk = s.Hk, Hv = s.Hv, dk = s.dk, dv = s.dv, N = B * S;
  const int64_t C = 2 * Hk * dk + Hv * dv, width = C + Hv * dv + 2 * Hv, Cp = whole_vectors(C);
  if (K > kMaxTaps) throw std::invalid_argument("deltanet_prompt: at most 16 conv taps");
  if (s.first) throw std::invalid_argument("deltanet_prompt: tokens are [B, S], never packed");
  if (N == 0) return;
  std::vector<float> kernel(static_cast<std::size_t>(K * Cp), 0.0f);
  for (int64_t j = 0; j < K; ++j)
    for (int64_t c = 0; c < C; ++c) kernel[j * Cp + c] = to_float(taps[j * C + c]);
  // written whole before they are read: no zeroing pass
  std::unique_ptr<float[]> inputs(new float[N * C]), gates(new float[2 * N * Hv]), core(new float[N * Hv * dv]);
  float *g = gates.get(), *beta = g + N * Hv;
  const int64_t conv_workers = std::max<int64_t>(1, std::min<int64_t>(threads, N * C / kStepFloatsPerThread));
  parallel_ranges(N, conv_workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (std::is_same_v<T, float>) {
      conv_tokens_f32(ConvTokensF32{s, projected, conv_state, kernel.data(), inputs.get(), g, beta, first, last});
    } else {
      conv_tokens_bf16(ConvTokensBF16{s, projected, conv_state, kernel.data(), inputs.get(), g, beta, first, last});
    }
  });
  // each row's new conv state: its window rows count .. count + K - 2 (the window: the conv
  // state's K - 1 rows, then the new inputs), in increasing order, so that a row of the old
  // state is read before it is overwritten
  for (int64_t b = 0; b < B; ++b) {
    T* state = conv_state + b * (K - 1) * C;
    for (int64_t i = 0; i < K - 1; ++i) {
      const int64_t w = s.counts[b] + i;
      if (w >= K - 1) {
        std::copy(projected + (b * S + w - (K - 1)) * width, projected + (b * S + w - (K - 1)) * width + C,
                  state + i * C);
      } else if (s.fresh) {
        std::fill(state + i * C, state + (i + 1) * C, T{});
      } else if (w != i) {
        std::copy(state + w * C, state + (w + 1) * C, state + i * C);
      }
    }
  }
  const float* x = inputs.get();
  const StridedRows<float> query{x, S * C, C, dk}, key{x + Hk * dk, S * C, C, dk};
  const StridedRows<float> value{x + 2 * Hk * dk, S * C, C, dv};
  chunked_delta_rule(memory, query, key, value, g, beta, core.get(), B, S, Hk, Hv, dk, dv, chunk, s.fresh, true,
                     s.l2_eps, exp_floor, threads);
  std::vector<float> weight(s.gated_norm, s.gated_norm + dv);
  const int64_t norm_workers = std::max<int64_t>(1, std::min<int64_t>(threads, N * Hv * dv / kStepFloatsPerThread));
  parallel_ranges(N * Hv, norm_workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (std::is_same_v<T, float>) {
      gated_norm_heads_f32(NormHeadsF32{s, projected, core.get(), weight.data(), out, first, last});
    } else {
      gated_norm_heads_bf16(NormHeadsBF16{s, projected, core.get(), weight.data(), out, first, last});
    }
  });
}

}  // namespace

void recurrent_delta_rule(float* memory, const StridedRows<float>& query, const StridedRows<float>& key,
                          const StridedRows<float>& value, const float* decay, const float* beta, float* out,
                          int64_t B, int64_t S, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int threads) {
  const Step s{memory, query, key, value, decay, beta, out, S, Hk, Hv, dk, dv};
  const int64_t heads = B * Hv;
  if (heads == 0 || S == 0) return;
  parallel_ranges(heads, std::min<int64_t>(threads, heads * dk * dv / kFloatsPerThread), 1,
                  [&](int64_t first, int64_t last) { run_heads_any(HeadRange{s, first, last}); });
}

void deltanet_step(const DeltaNetStep& step, const float* projected, float* conv_state, const float* taps,
                   float* memory, float* out, int threads) {
  deltanet(step, projected, conv_state, taps, memory, out, threads);
}

void deltanet_step(const DeltaNetStep& step, const uint16_t* projected, uint16_t* conv_state, const uint16_t* taps,
                   float* memory, uint16_t* out, int threads) {
  deltanet(step, projected, conv_state, taps, memory, out, threads);
}

void deltanet_prompt(const DeltaNetStep& step, const float* projected, float* conv_state, const float* taps,
                     float* memory, float* out, int64_t chunk, float exp_floor, int threads) {
  deltanet_chunked(step, projected, conv_state, taps, memory, out, chunk, exp_floor, threads);
}

void deltanet_prompt(const DeltaNetStep& step, const uint16_t* projected, uint16_t* conv_state,
                     const uint16_t* taps, float* memory, uint16_t* out, int64_t chunk, float exp_floor,
                     int threads) {
  deltanet_chunked(step, projected, conv_state, taps, memory, out, chunk, exp_floor, threads);
}

}  // namespace fastjudge
