#include "t5_step.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "causal_attention.hpp"
#include "encoder_attention.hpp"
#include "rms_norm.hpp"
#include "step_ops.hpp"
#include "vector_math.hpp"

namespace fastjudge {
namespace {

// T5's layer norm rounds the normalised states to the model's type before the weight multiplies
// them (rms_norm's round_first)
constexpr bool kT5Norm = true;

// float32 copies of T values (exact), and T roundings of float32 ones
template <typename T>
void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <typename T>
void narrow(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) from_float(src[i], dst + i);
}

template <typename T>
class Step {
 public:
  Step(const T5StepModel& m, const T5StepInput& in, T5StepBuffers<T>& buffers, int threads)
      : m_(m), in_(in), threads_(threads), buf_(buffers), N_(in.B * in.S), inner_(m.H * m.dk) {}

  void run(T* out) {
    layers();
    std::memcpy(out, buf_.x.data(), N_ * m_.d * sizeof(T));
  }

  // the step, then each row's last real token's logits (final norm, head_scale, head) and its
  // greedy pick into picks [B]; the tracked ids' logits at step s of `steps`
  void pick(int64_t* picks, const TrackedLogits& tracked, int64_t s, int64_t steps) {
    if (!m_.final_norm || !m_.head.panels) throw std::invalid_argument("the decoder has no head");
    check_tracked(tracked, m_.head.out);
    layers();
    const int64_t B = in_.B, S = in_.S, d = m_.d, V = m_.head.out;
    T* last = buf_.mixed.data();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t t = in_.counts[b] > 0 ? in_.counts[b] - 1 : S - 1;  // as a [-1] index picks
      std::memcpy(last + b * d, &buf_.x[(b * S + t) * d], d * sizeof(T));
    }
    rms_norm(last, d, d, m_.final_norm, buf_.normed.data(), B, 1, d, m_.eps, threads_, kT5Norm);
    if (m_.head_scale != 1.0f) {
      for (int64_t i = 0; i < B * d; ++i) from_float(to_float(buf_.normed[i]) * m_.head_scale, &buf_.normed[i]);
    }
    hold(buf_.logits, B * V);
    project(buf_.normed.data(), B, m_.head, buf_.logits.data(), threads_);
    greedy_picks(buf_.logits.data(), B, V, picks, threads_);
    keep_tracked(buf_.logits.data(), B, V, tracked, s, steps);
  }

 private:
  static constexpr bool kWide = std::is_same_v<T, float>;

  void layers() {
    check();
    const int64_t d = m_.d;
    hold(buf_.x, N_ * d);
    hold(buf_.normed, N_ * d);
    hold(buf_.mixed, N_ * d);
    hold(buf_.wide, N_ * std::max(3 * inner_, m_.d_ff));
    hold(buf_.heads, 2 * N_ * inner_);
    hold(buf_.queries, N_ * 3 * inner_);
    hold(buf_.attended, N_ * inner_);
    hold(buf_.last_keys, in_.B);
    const T* embed = static_cast<const T*>(m_.embed);
    for (int64_t n = 0; n < N_; ++n) std::memcpy(&buf_.x[n * d], embed + in_.tokens[n] * d, d * sizeof(T));
    for (int64_t b = 0; b < in_.B; ++b) buf_.last_keys[b] = m_.enc_lengths[in_.start + b] - 1;
    for (std::size_t i = 0; i < m_.layers.size(); ++i) {
      const T5StepLayer& layer = m_.layers[i];
      self_attention(layer, static_cast<int64_t>(i));
      cross_attention(layer, static_cast<int64_t>(i));
      rms_norm(buf_.x.data(), d, d, layer.ff_norm, buf_.normed.data(), N_, 1, d, m_.eps, threads_, kT5Norm);
      gated_dense_product(buf_.normed.data(), d, static_cast<const PanelWord<T>*>(layer.gate.panels),
                          static_cast<const PanelWord<T>*>(layer.up.panels), buf_.wide.data(), N_, d, m_.d_ff,
                          m_.activation, threads_);
      project(buf_.wide.data(), N_, layer.down, buf_.mixed.data(), threads_);
      add(buf_.x.data(), buf_.mixed.data(), N_ * d);
    }
    for (int64_t b = 0; b < in_.B; ++b) m_.dec_lengths[in_.start + b] += in_.counts[b];
  }

  // Everything the step reads, before anything is written
  void check() const {
    if (in_.S > kFewTokens) throw std::invalid_argument("a step takes at most 4 tokens a row");
    if (in_.start < 0 || in_.start + in_.B > m_.slots) throw std::invalid_argument("rows past the pool's slots");
    if (in_.projected && in_.start + in_.B > m_.cross_slots) {
      throw std::invalid_argument("rows past the projected K/V's slots");
    }
    for (int64_t n = 0; n < N_; ++n) {
      if (in_.tokens[n] < 0 || in_.tokens[n] >= m_.vocab) {
        throw std::invalid_argument("token " + std::to_string(in_.tokens[n]) + " outside the vocabulary");
      }
    }
    for (int64_t b = 0; b < in_.B; ++b) {
      const int64_t slot = in_.start + b;
      if (in_.counts[b] < 0 || in_.counts[b] > in_.S) throw std::invalid_argument("counts must lie in [0, S]");
      if (m_.dec_lengths[slot] < 0 || m_.dec_lengths[slot] + in_.counts[b] > m_.capacity) {
        throw std::invalid_argument("a row's positions would pass the pool's capacity");
      }
      if (m_.enc_lengths[slot] < 1 || m_.enc_lengths[slot] > m_.enc_capacity) {
        throw std::invalid_argument("a row's encoder length must lie in [1, enc_capacity]");
      }
    }
  }

  // x += o(attention over the row's decoder positions, bias by distance, causal)
  void self_attention(const T5StepLayer& layer, int64_t index) {
    const int64_t B = in_.B, S = in_.S, H = m_.H, dk = m_.dk, qkv_width = 3 * inner_;
    const int64_t column = m_.capacity + 1, layer_floats = 2 * H * column * dk;
    const int64_t slot_floats = static_cast<int64_t>(m_.layers.size()) * layer_floats;
    rms_norm(buf_.x.data(), m_.d, m_.d, layer.norm, buf_.normed.data(), N_, 1, m_.d, m_.eps, threads_, kT5Norm);
    project(buf_.normed.data(), N_, layer.qkv, buf_.wide.data(), threads_);
    // queries, keys and values in float32, the K/V's type (read in place where T is float32)
    const float* qkv;
    if constexpr (kWide) {
      qkv = buf_.wide.data();
    } else {
      widen(buf_.wide.data(), buf_.queries.data(), N_ * qkv_width);
      qkv = buf_.queries.data();
    }
    float* keys = m_.kv + in_.start * slot_floats + index * layer_floats;
    float* values = keys + H * column * dk;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t length = m_.dec_lengths[in_.start + b];
      for (int64_t t = 0; t < in_.counts[b]; ++t) {
        const float* row = qkv + (b * S + t) * qkv_width;
        for (int64_t h = 0; h < H; ++h) {
          const int64_t at = b * slot_floats + (h * column + length + t) * dk;
          std::memcpy(keys + at, row + inner_ + h * dk, dk * sizeof(float));
          std::memcpy(values + at, row + 2 * inner_ + h * dk, dk * sizeof(float));
        }
      }
    }
    CausalProblem problem{B, S, column, H, H, dk, 1.0f, m_.dec_lengths + in_.start, in_.counts};
    problem.bias = m_.bias, problem.bias_stride = column;
    const StridedRows<float> q{qkv, S * qkv_width, qkv_width, dk};
    const StridedRows<float> k{keys, slot_floats, dk, column * dk};
    const StridedRows<float> v{values, slot_floats, dk, column * dk};
    float* attended = buf_.attended.data();
    causal_attention(problem, q, k, v, attended, threads_);
    attend_out(attended, layer.o);
  }

  // x += x_o(cross-attention of x_q's queries over each row's encoder states)
  void cross_attention(const T5StepLayer& layer, int64_t index) {
    const int64_t B = in_.B, S = in_.S, H = m_.H, dk = m_.dk, d = m_.d;
    rms_norm(buf_.x.data(), d, d, layer.x_norm, buf_.normed.data(), N_, 1, d, m_.eps, threads_, kT5Norm);
    T* xq = buf_.heads.data();
    T* context = xq + N_ * inner_;
    project(buf_.normed.data(), N_, layer.x_q, xq, threads_);
    if (!in_.projected) {
      const T* mem = static_cast<const T*>(m_.mem) + in_.start * m_.enc_capacity * d;
      const StridedRows<T> states{mem, m_.enc_capacity * d, d, 0};
      reassociated_attention<T>(xq, static_cast<const T*>(layer.x_k), static_cast<const T*>(layer.x_v), states,
                                m_.enc_lengths + in_.start, context, B, S, H, dk, d, 1.0f, index % 2 == 1,
                                threads_, layer.x_k_pairs);
    } else {
      // each head's positions as that head's query rows [B, 1, H * S, dk], every one seeing its
      // row's whole prompt (the last key as the offset of one token)
      float* q = buf_.queries.data();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < S; ++t)
          for (int64_t h = 0; h < H; ++h) widen(xq + ((b * S + t) * H + h) * dk, q + ((b * H + h) * S + t) * dk, dk);
      const int64_t layer_floats = 2 * H * m_.enc_capacity * dk;
      const int64_t slot_floats = static_cast<int64_t>(m_.layers.size()) * layer_floats;
      const float* keys = m_.xkv + in_.start * slot_floats + index * layer_floats;
      const CausalProblem problem{B, 1, m_.enc_capacity, H * S, H, dk, 1.0f, buf_.last_keys.data(), nullptr};
      const StridedRows<float> rows{q, H * S * dk, H * S * dk, dk};
      const StridedRows<float> k{keys, slot_floats, dk, m_.enc_capacity * dk};
      const StridedRows<float> v{keys + H * m_.enc_capacity * dk, slot_floats, dk, m_.enc_capacity * dk};
      float* attended = buf_.attended.data();
      causal_attention(problem, rows, k, v, attended, threads_);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < S; ++t)
          for (int64_t h = 0; h < H; ++h) {
            narrow(attended + ((b * H + h) * S + t) * dk, context + ((b * S + t) * H + h) * dk, dk);
          }
    }
    project(context, N_, layer.x_o, buf_.mixed.data(), threads_);
    add(buf_.x.data(), buf_.mixed.data(), N_ * d);
  }

  // x += o(attended), the float32 attention output rounded to T first
  void attend_out(const float* attended, const PackedWeight& o) {
    const T* heads;
    if constexpr (kWide) {
      heads = attended;
    } else {
      narrow(attended, buf_.heads.data(), N_ * inner_);
      heads = buf_.heads.data();
    }
    project(heads, N_, o, buf_.mixed.data(), threads_);
    add(buf_.x.data(), buf_.mixed.data(), N_ * m_.d);
  }

  const T5StepModel& m_;
  const T5StepInput& in_;
  int threads_;
  T5StepBuffers<T>& buf_;
  const int64_t N_, inner_;
};

template <typename T>
int64_t decode_run(const T5StepModel& model, const T5StepInput& input, const RunLimits& limits,
                   const TrackedLogits& tracked, int64_t* picks, T5StepBuffers<T>& buffers, int threads) {
  return run_steps(input, limits, picks, [&](const T5StepInput& in, int64_t s, int64_t* chosen) {
    Step<T>(model, in, buffers, threads).pick(chosen, tracked, s, limits.steps);
  });
}

}  // namespace

int64_t t5_decode_run(const T5StepModel& model, const T5StepInput& input, const RunLimits& limits,
                      const TrackedLogits& tracked, int64_t* picks, bool bf16, T5StepScratch& scratch, int threads) {
  if (!bf16) return decode_run(model, input, limits, tracked, picks, scratch.f32, threads);
  if (!bf16_dense_available()) throw std::runtime_error("bfloat16 steps need AVX512-BF16");
  return decode_run(model, input, limits, tracked, picks, scratch.bf16, threads);
}

void t5_decode_step(const T5StepModel& model, const T5StepInput& input, float* out, T5StepScratch& scratch,
                    int threads) {
  Step<float>(model, input, scratch.f32, threads).run(out);
}

void t5_decode_step(const T5StepModel& model, const T5StepInput& input, uint16_t* out, T5StepScratch& scratch,
                    int threads) {
  if (!bf16_dense_available()) throw std::runtime_error("bfloat16 steps need AVX512-BF16");
  Step<uint16_t>(model, input, scratch.bf16, threads).run(out);
}

}  // namespace fastjudge
