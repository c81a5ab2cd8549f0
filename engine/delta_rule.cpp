#include "delta_rule.hpp"

#include <algorithm>
#include <cmath>
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

// One head's rule for one token on columns [j0, j0 + 16 NV) of its state M (dk x dv), each
// column's arithmetic that of update_head's loops below, in the same order: the columns' sums
// stay in registers through the rows (summed in memory, each row's sums waited on the store of
// the row before), and the block's rows are still in cache for the second pass.
template <int NV>
__attribute__((always_inline)) inline void update_columns(float* M, const float* q, const float* k, const float* v,
                                                          float decay, float beta, float* out, int64_t dk,
                                                          int64_t dv, int64_t j0) {
  Floats read[NV] = {}, u[NV], sums[NV] = {};
  for (int64_t i = 0; i < dk; ++i) {  // forget, and read what the memory holds under k
    float* m = M + i * dv + j0;
    for (int n = 0; n < NV; ++n) {
      const Floats x = load(m + n * kLanes) * decay;
      store(m + n * kLanes, x);
      read[n] += k[i] * x;
    }
  }
  for (int n = 0; n < NV; ++n) u[n] = (load(v + j0 + n * kLanes) - read[n]) * beta;
  for (int64_t i = 0; i < dk; ++i) {  // write the correction under k, read under q
    float* m = M + i * dv + j0;
    for (int n = 0; n < NV; ++n) {
      const Floats x = load(m + n * kLanes) + k[i] * u[n];
      store(m + n * kLanes, x);
      sums[n] += q[i] * x;
    }
  }
  for (int n = 0; n < NV; ++n) store(out + j0 + n * kLanes, sums[n]);
}

// One head's rule for one token, in place on its state M (dk x dv): M <- decay M; u = beta (v -
// M^T k); M <- M + k u^T; out = M^T q. Two passes over M (by blocks of 64 columns where dv is
// a multiple of 16), the second while it is still in cache; no sum runs across vector lanes.
// read and u: dv floats of scratch.
__attribute__((always_inline)) inline void update_head(float* M, const float* q, const float* k, const float* v,
                                                       float decay, float beta, float* out, float* read, float* u,
                                                       int64_t dk, int64_t dv) {
  if (dv % kLanes == 0) {
    int64_t j0 = 0;
    for (; j0 + 4 * kLanes <= dv; j0 += 4 * kLanes) update_columns<4>(M, q, k, v, decay, beta, out, dk, dv, j0);
    for (; j0 < dv; j0 += kLanes) update_columns<1>(M, q, k, v, decay, beta, out, dk, dv, j0);
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

// heads [first, last) of the B x Hv grid
FASTJUDGE_CLONES
void run_heads(const Step& s, int64_t first, int64_t last) {
  const int64_t G = s.Hv / s.Hk, dk = s.dk, dv = s.dv;
  std::vector<float> scratch(static_cast<std::size_t>(2 * dv));
  for (int64_t job = first; job < last; ++job) {
    const int64_t b = job / s.Hv, h = job % s.Hv, hk = h / G;
    float* M = s.memory + job * dk * dv;
    for (int64_t t = 0; t < s.S; ++t) {
      const int64_t bt = b * s.S + t;
      update_head(M, s.query.row(b, t, hk), s.key.row(b, t, hk), s.value.row(b, t, h), s.decay[bt * s.Hv + h],
                  s.beta[bt * s.Hv + h], s.out + (bt * s.Hv + h) * dv, scratch.data(), scratch.data() + dv, dk, dv);
    }
  }
}

// sum of squares of x[0 .. n), in float32
inline float sum_of_squares(const float* x, int64_t n) {
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) total += x[j] * x[j];
  return total;
}

// rows [first, last) of a DeltaNet layer's step (DeltaNetStep); vectors of channels padded to
// whole vectors with zeros
template <typename T>
__attribute__((always_inline)) inline void deltanet_rows(const DeltaNetStep& s, const T* projected, T* conv_state,
                                                         const T* taps, float* memory, T* out, int64_t first,
                                                         int64_t last) {
  const int64_t S = s.S, K = s.K, Hk = s.Hk, Hv = s.Hv, dk = s.dk, dv = s.dv, G = Hv / Hk;
  const int64_t C = 2 * Hk * dk + Hv * dv, width = C + Hv * dv + 2 * Hv;
  const int64_t Cp = whole_vectors(C), dvp = whole_vectors(dv);
  std::vector<float> window(static_cast<std::size_t>((K - 1 + S) * Cp), 0.0f);
  std::vector<float> kernel(static_cast<std::size_t>(K * Cp), 0.0f), act(static_cast<std::size_t>(Cp));
  std::vector<float> vectors(static_cast<std::size_t>(4 * dvp), 0.0f), scratch(static_cast<std::size_t>(2 * dv));
  float *core = vectors.data(), *gate = core + dvp, *weight = gate + dvp, *result = weight + dvp;
  float *read = scratch.data(), *u = read + dv;
  for (int64_t j = 0; j < K; ++j)
    for (int64_t c = 0; c < C; ++c) kernel[j * Cp + c] = to_float(taps[j * C + c]);
  std::copy(s.gated_norm, s.gated_norm + dv, weight);
  const float q_scale = 1.0f / static_cast<float>(dk), k_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  const float l2_eps = s.l2_eps / static_cast<float>(dk);
  for (int64_t b = first; b < last; ++b) {
    float* M = memory + b * Hv * dk * dv;
    T* state = conv_state + b * (K - 1) * C;
    if (s.fresh) std::fill(M, M + Hv * dk * dv, 0.0f);
    // the conv window: the row's last K - 1 inputs (none when fresh), then this step's
    for (int64_t i = 0; i < K - 1; ++i)
      for (int64_t c = 0; c < C; ++c) window[i * Cp + c] = s.fresh ? 0.0f : to_float(state[i * C + c]);
    for (int64_t t = 0; t < S; ++t)
      for (int64_t c = 0; c < C; ++c) window[(K - 1 + t) * Cp + c] = to_float(projected[(b * S + t) * width + c]);
    const int64_t count = s.counts[b];
    for (int64_t t = 0; t < S; ++t) {
      const T* row = projected + (b * S + t) * width;
      const bool real = t < count;
      // causal depthwise conv and SiLU, each product, the sum and the activation held in T as
      // the tensor ops hold them
      for (int64_t c = 0; c < Cp; c += kLanes) {
        Floats total{};
        for (int64_t j = 0; j < K; ++j)
          total += rounded<T>(load(window.data() + (t + j) * Cp + c) * load(kernel.data() + j * Cp + c));
        store(act.data() + c, rounded<T>(silu(rounded<T>(total))));
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
        const float a = to_float(row[C + Hv * dv + Hv + h]) + s.dt_bias[h];
        const float softplus = a > 20.0f ? a : std::log1p(std::exp(a));
        const float g = real ? s.neg_A[h] * softplus : 0.0f;
        const float beta = real ? rounded<T>(1.0f / (1.0f + std::exp(-to_float(row[C + Hv * dv + h])))) : 0.0f;
        update_head(M + h * dk * dv, act.data() + hk * dk, act.data() + (Hk + hk) * dk,
                    act.data() + 2 * Hk * dk + h * dv, std::exp(g), beta, core, read, u, dk, dv);
        // gated RMSNorm: the output normalised in float32 from its value in T, scaled by the
        // weight (float32: as one RMSNorm with its weight; bfloat16: the norm and the product
        // each rounded, as two tensor ops round them), times silu(z)
        for (int64_t j = 0; j < dvp; j += kLanes) store(core + j, rounded<T>(load(core + j)));
        const float inverse = 1.0f / std::sqrt(sum_of_squares(core, dv) / static_cast<float>(dv) + s.eps);
        for (int64_t j = 0; j < dv; ++j) gate[j] = to_float(row[C + h * dv + j]);
        for (int64_t j = 0; j < dvp; j += kLanes) {
          const Floats x = load(core + j) * inverse, w = load(weight + j);
          const Floats normed = std::is_same_v<T, float> ? x * w : rounded<T>(rounded<T>(x) * w);
          store(result + j, normed * silu(load(gate + j)));
        }
        T* o = out + ((b * S + t) * Hv + h) * dv;
        for (int64_t j = 0; j < dv; ++j) from_float(result[j], o + j);
      }
    }
    // the row's new conv state: its last K - 1 real inputs (window rows count .. count + K - 2)
    for (int64_t i = 0; i < K - 1; ++i)
      for (int64_t c = 0; c < C; ++c) from_float(window[(count + i) * Cp + c], state + i * C + c);
  }
}

FASTJUDGE_CLONES
void deltanet_rows_f32(const DeltaNetStep& s, const float* projected, float* conv_state, const float* taps,
                       float* memory, float* out, int64_t first, int64_t last) {
  deltanet_rows(s, projected, conv_state, taps, memory, out, first, last);
}

FASTJUDGE_CLONES
void deltanet_rows_bf16(const DeltaNetStep& s, const uint16_t* projected, uint16_t* conv_state, const uint16_t* taps,
                        float* memory, uint16_t* out, int64_t first, int64_t last) {
  deltanet_rows(s, projected, conv_state, taps, memory, out, first, last);
}

template <typename T>
void deltanet(const DeltaNetStep& s, const T* projected, T* conv_state, const T* taps, float* memory, T* out,
              int threads) {
  if (s.B == 0 || s.S == 0) return;
  const int64_t workers = std::min<int64_t>(threads, s.B * s.Hv * s.dk * s.dv / kStepFloatsPerThread);
  parallel_ranges(s.B, workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (std::is_same_v<T, float>) {
      deltanet_rows_f32(s, projected, conv_state, taps, memory, out, first, last);
    } else {
      deltanet_rows_bf16(s, projected, conv_state, taps, memory, out, first, last);
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
                  [&](int64_t first, int64_t last) { run_heads(s, first, last); });
}

void deltanet_step(const DeltaNetStep& step, const float* projected, float* conv_state, const float* taps,
                   float* memory, float* out, int threads) {
  deltanet(step, projected, conv_state, taps, memory, out, threads);
}

void deltanet_step(const DeltaNetStep& step, const uint16_t* projected, uint16_t* conv_state, const uint16_t* taps,
                   float* memory, uint16_t* out, int threads) {
  deltanet(step, projected, conv_state, taps, memory, out, threads);
}

}  // namespace fastjudge
