#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_parallel.hpp"
#include "delta_rule.hpp"
#include "small_product.hpp"
#include "vector_math.hpp"

namespace fastjudge {
namespace {

// One thread for each 2 MFLOP of the rule: below that a wake-up of the team costs more than
// the share of work it takes.
constexpr double kFlopsPerThread = 2e6;

struct Chunked {
  float* memory;
  const StridedRows<float>& query, &key, &value;
  const float *g, *beta;
  float* out;
  int64_t S, Hk, Hv, dk, dv, C;
  bool fresh, normalise;
  float l2_eps, exp_floor;
};

// A thread's scratch for one chunk: queries and keys [C, dk], keys transposed [dk, Cw], their
// products [C, Cw] (Cw: C in whole vectors), and per value head the triangular system, the
// decayed scores, the corrections U, the start state's reads under keys and queries, and the
// decayed keys that write the end state.
struct Scratch {
  int64_t Cw;
  std::vector<float> q, k, kt, kk, qk, system, scores, u, reads, k_end, cum, start, to_end;

  Scratch(int64_t C, int64_t dk, int64_t dv) : Cw(whole_vectors(C)) {
    q.resize(C * dk), k.resize(C * dk), kt.assign(dk * Cw, 0.0f), k_end.assign(dk * Cw, 0.0f);
    kk.resize(C * Cw), qk.resize(C * Cw), system.resize(C * Cw), scores.resize(C * Cw);
    u.resize(C * dv), reads.resize(2 * C * dv), cum.resize(Cw), start.resize(C), to_end.resize(C);
  }
};

// x[0 .. d) times scale, or L2-normalised (|x|^2 + eps under the root) and then times scale
__attribute__((always_inline)) inline void scaled_row(const float* x, float* dst, int64_t d, float scale, bool normalise, float eps) {
  float factor = scale;
  if (normalise) {
    float squares = 0.0f;
    for (int64_t j = 0; j < d; ++j) squares += x[j] * x[j];
    factor = scale / std::sqrt(squares + eps);
  }
  for (int64_t j = 0; j < d; ++j) dst[j] = x[j] * factor;
}

// product() with register blocks for AVX-512 (kWide) or for AVX2's 16 registers
template <bool kWide, typename... Args>
__attribute__((always_inline)) inline void fitted_product(Args... args) {
  product<false, false, float, kProductRows, !kWide>(args...);
}

// One value head's chunk of n tokens from t0: the corrections, the outputs, the state's update
// (see delta_rule.hpp for the algebra)
template <bool kWide>
__attribute__((always_inline)) inline void head_chunk(const Chunked& s, Scratch& w, int64_t b, int64_t h, int64_t t0,
                                                      int64_t n, bool from_zero) {
  const int64_t dk = s.dk, dv = s.dv, Cw = w.Cw;
  float* M = s.memory + (b * s.Hv + h) * dk * dv;
  const float* g = s.g + (b * s.S + t0) * s.Hv + h;
  const float* beta = s.beta + (b * s.S + t0) * s.Hv + h;
  // G_i: the running log-decay inside the chunk; past n, G_{n-1} (their decays are never used)
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) w.cum[i] = total += g[i * s.Hv];
  std::fill(w.cum.begin() + n, w.cum.end(), total);
  for (int64_t i = 0; i < n; ++i) {
    w.start[i] = std::exp(std::max(w.cum[i], s.exp_floor));  // how much of M token i still sees
    w.to_end[i] = std::exp(std::max(total - w.cum[i], s.exp_floor));
  }
  // the unit lower-triangular system's strict lower part, negated (-beta_i decay_ij k_i.k_j,
  // j < i), and the decayed query-key scores (j <= i); zero elsewhere
  using V = LaneVector<kWide>;
  using Lanes = decltype(V{} < V{});
  constexpr int64_t lanes = kLanesOf<V>;
  const V floor = V{} + s.exp_floor, zero{};
  Lanes lane;
  for (int j = 0; j < lanes; ++j) lane[j] = j;
  for (int64_t i = 0; i < n; ++i) {
    const V gi = V{} + w.cum[i], bi = V{} + -beta[i * s.Hv];
    for (int64_t j = 0; j < Cw; j += lanes) {
      V x = gi - load_as<V>(w.cum.data() + j);
      x = x < floor ? floor : x;
      x = x > zero ? zero : x;
      const V decay = exp_nonpositive(x);
      const Lanes col = lane + static_cast<int32_t>(j);
      const Lanes row = Lanes{} + static_cast<int32_t>(i);
      store_as(w.system.data() + i * Cw + j, col < row ? bi * load_as<V>(w.kk.data() + i * Cw + j) * decay : zero);
      store_as(w.scores.data() + i * Cw + j, col <= row ? load_as<V>(w.qk.data() + i * Cw + j) * decay : zero);
    }
  }
  // right-hand sides: beta_i (v_i - exp(G_i) M^T k_i); and exp(G_i) M^T q_i into the outputs
  float* key_reads = w.reads.data();
  float* query_reads = w.reads.data() + n * dv;
  if (!from_zero) {
    fitted_product<kWide>(w.k.data(), dk, M, dv, key_reads, dv, n, dk, dv, false);
    fitted_product<kWide>(w.q.data(), dk, M, dv, query_reads, dv, n, dk, dv, false);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* v = s.value.row(b, t0 + i, h);
    float* u = w.u.data() + i * dv;
    float* o = s.out + ((b * s.S + t0 + i) * s.Hv + h) * dv;
    const float bi = beta[i * s.Hv], ei = w.start[i];
    if (from_zero) {
      for (int64_t j = 0; j < dv; ++j) u[j] = bi * v[j];
      std::fill(o, o + dv, 0.0f);
    } else {
      for (int64_t j = 0; j < dv; ++j) u[j] = bi * (v[j] - ei * key_reads[i * dv + j]);
      for (int64_t j = 0; j < dv; ++j) o[j] = ei * query_reads[i * dv + j];
    }
  }
  // forward substitution: U_i = rhs_i - sum_{j<i} beta_i decay_ij (k_i.k_j) U_j; the earlier row
  // blocks' part as one product, then within the block row by row
  for (int64_t i0 = 0; i0 < n; i0 += kProductRows) {
    const int64_t r = std::min<int64_t>(kProductRows, n - i0);
    if (i0 > 0) {
      fitted_product<kWide>(w.system.data() + i0 * Cw, Cw, w.u.data(), dv, w.u.data() + i0 * dv, dv, r, i0, dv, true);
    }
    for (int64_t i = i0 + 1; i < i0 + r; ++i) {
      float* ui = w.u.data() + i * dv;
      for (int64_t j = i0; j < i; ++j) {
        const float a = w.system[i * Cw + j];
        const float* uj = w.u.data() + j * dv;
        for (int64_t c = 0; c < dv; ++c) ui[c] += a * uj[c];
      }
    }
  }
  // outputs: + sum_{j<=i} decay_ij (q_i.k_j) U_j
  float* outputs = s.out + ((b * s.S + t0) * s.Hv + h) * dv;
  fitted_product<kWide>(w.scores.data(), Cw, w.u.data(), dv, outputs, s.Hv * dv, n, n, dv, true, true);
  // the end state: exp(G_{n-1}) M + sum_j exp(G_{n-1} - G_j) k_j U_j^T
  for (int64_t a = 0; a < dk; ++a)
    for (int64_t j = 0; j < n; ++j) w.k_end[a * Cw + j] = w.kt[a * Cw + j] * w.to_end[j];
  if (from_zero) {
    fitted_product<kWide>(w.k_end.data(), Cw, w.u.data(), dv, M, dv, dk, n, dv, false);
  } else {
    const float decay = std::exp(total);
    for (int64_t j = 0; j < dk * dv; ++j) M[j] *= decay;
    fitted_product<kWide>(w.k_end.data(), Cw, w.u.data(), dv, M, dv, dk, n, dv, true);
  }
}

// key heads [first, last) of the B x Hk grid, every chunk in order, the key head's value heads
// one after another within each chunk
struct KeyHeads {
  const Chunked& s;
  int64_t first, last;
};

template <bool kWide>
__attribute__((always_inline)) inline void run_key_heads(const KeyHeads& jobs) {
  const Chunked& s = jobs.s;
  const int64_t first = jobs.first, last = jobs.last;
  const int64_t dk = s.dk, G = s.Hv / s.Hk;
  Scratch w(s.C, dk, s.dv);
  const int64_t Cw = w.Cw;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t job = first; job < last; ++job) {
    const int64_t b = job / s.Hk, hk = job % s.Hk;
    for (int64_t t0 = 0; t0 < s.S; t0 += s.C) {
      const int64_t n = std::min(s.C, s.S - t0);
      for (int64_t i = 0; i < n; ++i) {
        scaled_row(s.query.row(b, t0 + i, hk), w.q.data() + i * dk, dk, q_scale, s.normalise, s.l2_eps);
        scaled_row(s.key.row(b, t0 + i, hk), w.k.data() + i * dk, dk, 1.0f, s.normalise, s.l2_eps);
      }
      for (int64_t a = 0; a < dk; ++a) {
        for (int64_t j = 0; j < n; ++j) w.kt[a * Cw + j] = w.k[j * dk + a];
        std::fill(w.kt.begin() + a * Cw + n, w.kt.begin() + (a + 1) * Cw, 0.0f);
      }
      // products with the keys, shared by the key head's value heads
      fitted_product<kWide>(w.k.data(), dk, w.kt.data(), Cw, w.kk.data(), Cw, n, dk, Cw, false);
      fitted_product<kWide>(w.q.data(), dk, w.kt.data(), Cw, w.qk.data(), Cw, n, dk, Cw, false);
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) head_chunk<kWide>(s, w, b, h, t0, n, s.fresh && t0 == 0);
    }
  }
}

FASTJUDGE_VERSIONED(run_key_heads_any, run_key_heads, KeyHeads)

}  // namespace

void chunked_delta_rule(float* memory, const StridedRows<float>& query, const StridedRows<float>& key,
                        const StridedRows<float>& value, const float* g, const float* beta, float* out, int64_t B,
                        int64_t S, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t chunk, bool fresh,
                        bool normalise, float l2_eps, float exp_floor, int threads) {
  if (chunk < 1 || chunk > kMaxChunk) {
    throw std::invalid_argument("chunked_delta_rule: chunk must lie in [1, " + std::to_string(kMaxChunk) + "]");
  }
  if (dv % kLanes != 0) throw std::invalid_argument("chunked_delta_rule: dv must be a multiple of 16");
  const Chunked s{memory, query, key, value, g, beta, out, S, Hk, Hv, dk, dv, chunk, fresh, normalise, l2_eps,
                  exp_floor};
  const int64_t jobs = B * Hk;
  if (jobs == 0) return;
  if (S == 0) {
    if (fresh) std::fill(memory, memory + B * Hv * dk * dv, 0.0f);
    return;
  }
  // per token and value head: the products with keys and queries (shared), the state's reads and
  // write, the substitution and the scores' product
  const double flops = 2.0 * B * S * Hv * (chunk * (dk + dv) + 3.0 * dk * dv);
  const int64_t workers = std::min<int64_t>(threads, static_cast<int64_t>(flops / kFlopsPerThread) + 1);
  parallel_ranges(jobs, workers, 1, [&](int64_t first, int64_t last) { run_key_heads_any({s, first, last}); });
}

}  // namespace fastjudge
