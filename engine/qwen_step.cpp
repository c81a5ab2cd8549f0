#include "qwen_step.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attention_inputs.hpp"
#include "causal_attention.hpp"
#include "cpu_parallel.hpp"
#include "delta_rule.hpp"
#include "dense.hpp"
#include "rms_norm.hpp"
#include "step_ops.hpp"
#include "vector_math.hpp"

// This file is built without floating-point contraction (CMakeLists.txt): `a + b * c` is a
// product rounded, then a sum rounded, as torch's elementwise ops compute it, never one fused
// multiply-add.

namespace fastjudge {
namespace {

template <typename T>
class Step {
 public:
  Step(const QwenStepModel& m, const QwenStepInput& in, QwenStepBuffers<T>& buffers, int threads)
      : m_(m), in_(in), threads_(threads), buf_(buffers) {}

  // the step's output rows [B * S, d] into out, zeros at padding
  void run(T* out) {
    layers();
    const int64_t S = in_.S, d = m_.d;
    for (int64_t b = 0; b < in_.B; ++b) {
      for (int64_t t = 0; t < S; ++t) {
        T* row = out + (b * S + t) * d;
        if (t < in_.counts[b]) {
          std::memcpy(row, &buf_.x[(buf_.first[b] + t) * d], d * sizeof(T));
        } else {
          std::fill_n(row, d, T{});
        }
      }
    }
  }

  // each row's last real token: its hidden state into hidden [B, d], the greedy pick of its
  // logits into picks [B] and the tracked ids' logits at step s of `steps`; the final norm and
  // the head as the model's own ops run them on those rows (the engine's RMSNorm and projection:
  // the same bits at any row count)
  void pick(T* hidden, int64_t* picks, const TrackedLogits& tracked, int64_t s, int64_t steps) {
    if (!m_.final_norm || !m_.head.panels) throw std::invalid_argument("the decoder has no head");
    check_tracked(tracked, m_.head.out);
    layers();
    const int64_t B = in_.B, d = m_.d, V = m_.head.out;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t count = in_.counts[b];
      if (count > 0) {
        std::memcpy(hidden + b * d, &buf_.x[(buf_.first[b] + count - 1) * d], d * sizeof(T));
      } else {
        std::fill_n(hidden + b * d, d, T{});
      }
    }
    rms_norm(hidden, d, d, m_.final_norm, buf_.normed.data(), B, 1, d, m_.eps, threads_);
    hold(buf_.logits, B * V);
    project(buf_.normed.data(), B, m_.head, buf_.logits.data(), threads_);
    greedy_picks(buf_.logits.data(), B, V, picks, threads_);
    keep_tracked(buf_.logits.data(), B, V, tracked, s, steps);
  }

 private:
  // The rows' real tokens are packed (row b's t < counts[b] at first[b] + t), and every norm,
  // projection and add runs on them alone: jump-forward's steps of a few tokens a row were about
  // half padding. Only the few-token attention reads its queries in [B, S] (attend).
  void layers() {
    check();
    const int64_t N = in_.B * in_.S, d = m_.d;
    hold(buf_.first, in_.B);
    hold(buf_.token_rows, N);
    hold(buf_.columns, N);
    hold(buf_.rope_rows, N);
    // each real token's row, K/V column (its row's next) and rotary row (its position), the
    // same in every attention layer
    real_ = 0;
    for (int64_t b = 0; b < in_.B; ++b) {
      buf_.first[b] = real_;
      const int64_t length = m_.lengths[in_.start + b], position = m_.positions[in_.start + b];
      for (int64_t t = 0; t < in_.counts[b]; ++t) {
        buf_.token_rows[real_ + t] = b;
        buf_.columns[real_ + t] = length + t;
        buf_.rope_rows[real_ + t] = position + t;
      }
      real_ += in_.counts[b];
    }
    const int64_t R = real_;
    const int64_t qkv_width = m_.H * m_.hd * (m_.output_gate ? 2 : 1) + 2 * m_.Hkv * m_.hd;
    int64_t wide = m_.inner;
    for (const QwenStepLayer& layer : m_.layers) {
      wide = std::max(wide, layer.attention ? layer.qkv.out : layer.in_proj.out);
    }
    hold(buf_.x, N * d);
    hold(buf_.normed, N * d);
    hold(buf_.mixed, N * d);
    hold(buf_.wide, N * std::max(wide, qkv_width));
    hold(buf_.heads, N * (m_.H + m_.Hkv) * m_.hd);
    hold(buf_.attended, N * std::max((m_.H + m_.Hkv) * m_.hd, m_.lin_v_heads * m_.lin_v_dim));
    const T* embed = static_cast<const T*>(m_.embed);
    for (int64_t b = 0; b < in_.B; ++b) {
      for (int64_t t = 0; t < in_.counts[b]; ++t) {
        std::memcpy(&buf_.x[(buf_.first[b] + t) * d], embed + in_.tokens[b * in_.S + t] * d, d * sizeof(T));
      }
    }
    for (const QwenStepLayer& layer : m_.layers) {
      rms_norm(buf_.x.data(), d, d, layer.in_norm, buf_.normed.data(), R, 1, d, m_.eps, threads_);
      if (layer.attention) {
        attend(layer);
      } else {
        deltanet(layer);
      }
      add(buf_.x.data(), buf_.mixed.data(), R * d);
      rms_norm(buf_.x.data(), d, d, layer.post_norm, buf_.normed.data(), R, 1, d, m_.eps, threads_);
      gated_dense_product(buf_.normed.data(), d, static_cast<const PanelWord<T>*>(layer.gate.panels),
                          static_cast<const PanelWord<T>*>(layer.up.panels), buf_.wide.data(), R, d, m_.inner,
                          GateActivation::kSilu, threads_);
      project(buf_.wide.data(), R, layer.down, buf_.mixed.data(), threads_);
      add(buf_.x.data(), buf_.mixed.data(), R * d);
    }
    for (int64_t b = 0; b < in_.B; ++b) {
      m_.lengths[in_.start + b] += in_.counts[b];
      m_.positions[in_.start + b] += in_.counts[b];
    }
  }

  // Everything the step reads, before anything is written
  void check() const {
    if (in_.start < 0 || in_.start + in_.B > m_.slots) throw std::invalid_argument("rows past the pool's slots");
    for (int64_t n = 0; n < in_.B * in_.S; ++n) {
      if (in_.tokens[n] < 0 || in_.tokens[n] >= m_.vocab) {
        throw std::invalid_argument("token " + std::to_string(in_.tokens[n]) + " outside the vocabulary");
      }
    }
    for (int64_t b = 0; b < in_.B; ++b) {
      const int64_t slot = in_.start + b;
      if (in_.counts[b] < 0 || in_.counts[b] > in_.S) throw std::invalid_argument("counts must lie in [0, S]");
      if (m_.lengths[slot] < 0 || m_.lengths[slot] + in_.counts[b] > m_.capacity) {
        throw std::invalid_argument("a row's keys would pass the pool's capacity");
      }
      if (m_.positions[slot] < 0 || m_.positions[slot] + in_.S > in_.table_positions) {
        throw std::invalid_argument("a row's positions pass the rotary tables");
      }
    }
  }

  void attend(const QwenStepLayer& layer) {
    const int64_t B = in_.B, S = in_.S, R = real_, H = m_.H, Hkv = m_.Hkv, hd = m_.hd, heads = H + Hkv;
    const int64_t width = layer.qkv.out, gate_at = heads * hd, values_at = width - Hkv * hd;
    T* qkv = buf_.wide.data();
    project(buf_.normed.data(), R, layer.qkv, qkv, threads_);
    // the queries' and keys' norms and rotary and the K/V writes (at the columns layers() set) as
    // a prompt's pass runs them
    const int64_t column = m_.capacity + 1, row_floats = Hkv * column * hd;
    T* rotated = buf_.heads.data();
    T* keys = static_cast<T*>(layer.keys) + in_.start * row_floats;
    T* values = static_cast<T*>(layer.values) + in_.start * row_floats;
    AttentionInputs<T> inputs{qkv, width, values_at, layer.qk_norm, m_.eps, static_cast<const T*>(in_.cos),
                              static_cast<const T*>(in_.sin), m_.rotary_half, rotated, keys, values,
                              buf_.columns.data(), R, 1, H, Hkv, hd, column, buf_.rope_rows.data(),
                              buf_.token_rows.data()};
    attention_inputs(inputs, threads_);
    // the rotated tokens to their [B, S] places for the attention (in place, the last first:
    // a token never moves back, so none overwrites one still to move)
    for (int64_t b = B - 1; b >= 0 && R < B * S; --b) {
      for (int64_t t = in_.counts[b] - 1; t >= 0; --t) {
        std::memmove(rotated + (b * S + t) * heads * hd, rotated + (buf_.first[b] + t) * heads * hd,
                     heads * hd * sizeof(T));
      }
    }
    CausalProblem problem{B, S, column, H, Hkv, hd, static_cast<float>(std::pow(double(hd), -0.5)),
                          m_.lengths + in_.start, in_.counts};
    problem.shared_columns = in_.shared_columns, problem.shared_from = in_.shared_from;
    const StridedRows<T> q{rotated, S * heads * hd, heads * hd, hd};
    const StridedRows<T> k{keys, row_floats, hd, column * hd};
    const StridedRows<T> v{values, row_floats, hd, column * hd};
    T* attended = buf_.attended.data();
    causal_attention(problem, q, k, v, attended, threads_);
    // the real tokens' outputs packed again (in place, the first first: a token never moves on)
    for (int64_t b = 0; b < B && R < B * S; ++b) {
      for (int64_t t = 0; t < in_.counts[b]; ++t) {
        std::memmove(attended + (buf_.first[b] + t) * H * hd, attended + (b * S + t) * H * hd, H * hd * sizeof(T));
      }
    }
    if (m_.output_gate) output_gate(attended, qkv + gate_at, width, R, H * hd, threads_);
    project(attended, R, layer.o, buf_.mixed.data(), threads_);
  }

  void deltanet(const QwenStepLayer& layer) {
    const int64_t Hv = m_.lin_v_heads, dk = m_.lin_k_dim, dv = m_.lin_v_dim, K = m_.conv_kernel;
    const int64_t C = 2 * m_.lin_k_heads * dk + Hv * dv;
    T* projected = buf_.wide.data();
    project(buf_.normed.data(), real_, layer.in_proj, projected, threads_);
    const DeltaNetStep step{in_.B, in_.S, K, m_.lin_k_heads, Hv, dk, dv, m_.eps, m_.l2_eps, false, in_.counts,
                            layer.dt_bias, layer.neg_A, layer.gated_norm, buf_.first.data()};
    T* conv_state = static_cast<T*>(layer.conv_state) + in_.start * (K - 1) * C;
    float* memory = layer.memory + in_.start * Hv * dk * dv;
    deltanet_step(step, projected, conv_state, static_cast<const T*>(layer.taps), memory, buf_.attended.data(),
                  threads_);
    project(buf_.attended.data(), real_, layer.out, buf_.mixed.data(), threads_);
  }

  const QwenStepModel& m_;
  const QwenStepInput& in_;
  int threads_;
  QwenStepBuffers<T>& buf_;
  int64_t real_ = 0;  // the step's real tokens (layers())
};

}  // namespace

void qwen_decode_step(const QwenStepModel& model, const QwenStepInput& input, float* out, QwenStepScratch& scratch,
                      int threads) {
  Step<float>(model, input, scratch.f32, threads).run(out);
}

void qwen_decode_step(const QwenStepModel& model, const QwenStepInput& input, uint16_t* out,
                      QwenStepScratch& scratch, int threads) {
  if (!bf16_dense_available()) throw std::runtime_error("bfloat16 steps need AVX512-BF16");
  Step<uint16_t>(model, input, scratch.bf16, threads).run(out);
}

int64_t qwen_decode_run(const QwenStepModel& model, const QwenStepInput& input, const RunLimits& limits,
                        const TrackedLogits& tracked, float* hidden, int64_t* picks, QwenStepScratch& scratch,
                        int threads) {
  return run_steps(input, limits, picks, [&](const QwenStepInput& in, int64_t s, int64_t* chosen) {
    Step<float>(model, in, scratch.f32, threads).pick(hidden, chosen, tracked, s, limits.steps);
  });
}

int64_t qwen_decode_run(const QwenStepModel& model, const QwenStepInput& input, const RunLimits& limits,
                        const TrackedLogits& tracked, uint16_t* hidden, int64_t* picks, QwenStepScratch& scratch,
                        int threads) {
  if (!bf16_dense_available()) throw std::runtime_error("bfloat16 steps need AVX512-BF16");
  return run_steps(input, limits, picks, [&](const QwenStepInput& in, int64_t s, int64_t* chosen) {
    Step<uint16_t>(model, in, scratch.bf16, threads).pick(hidden, chosen, tracked, s, limits.steps);
  });
}

}  // namespace fastjudge
