#include "dense.hpp"

#include <algorithm>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_product.hpp"
#include "cpu_parallel.hpp"
#include "small_product.hpp"
#include "vector_math.hpp"

namespace fastjudge {
namespace {

// Rows a unit of work takes: with a panel of up to 64 x K floats, a group's inputs and the panel
// stay in the core's cache while its register blocks run.
constexpr int64_t kRowGroup = 64;
// One thread for each 1 MFLOP: below that a wake-up of the team costs more than its share.
constexpr double kFlopsPerThread = 1e6;
// ... and one for each 256 KiB of weights: a few rows' product is bound by reading them from memory
constexpr double kWeightBytesPerThread = 256 * 1024;
// A group of a few rows (a decoding step's) reads a panel in slices of kSliceDepth inputs (or
// bfloat16 input pairs: 64 x 64 words, 16 KiB, held in L1 while each of its row blocks reads
// them), and fetches the weights ahead into L2 while it computes (bfloat16 kFetchSlices slices,
// float32 kFetchSlicesF32): its panels stream from memory once, spread over the compute. Reading
// each panel whole, row block after row block, stalled the first block on memory while the later
// ones found it in L2 (Flan-T5-small's decoder projections at 16 rows, float32: 4.6-4.9 -> 4.1 ms
// a step, 3.3 ms with the weights in cache). One row block has no reuse to wait for and reads
// the panel whole. float32: the first row group of a call streams its panels at any row count
// (panel_product; under AVX2 a call of more groups reads split copies instead, split_products);
// bfloat16: groups of up to kStreamedRows rows do, larger ones (taken for compute-bound, and not
// measured on an AVX512-BF16 CPU since float32's change) read it whole.
constexpr int64_t kSliceDepth = 64;
constexpr int64_t kFetchSlices = 4;
constexpr int64_t kStreamedRows = 32;
// float32 fetches one slice ahead, not four. Four slices are a whole panel at 256 inputs: a
// thread's first panel of a call came from memory as it was read, and its last fetched the next
// thread's panel or past the weights, which nothing would read. The mini Qwen3.5's and
// Flan-T5-small's decoding-step projections, two threads, the two distances alternating in one
// process (medians of 12-20 rounds): Qwen 8 rows -9 to -16 %, 16 rows -12 to -14 %, 32 rows -13 %;
// T5 8 rows -13 %, 16 rows -6 %; one thread, Qwen 8 and 32 rows -7 %; two slices ahead -7 to -9 %,
// eight +15 to +33 %. (bfloat16 keeps four: not measured on an AVX512-BF16 CPU since.)
constexpr int64_t kFetchSlicesF32 = 1;

template <typename X, typename W>
struct Problem {
  const X* x;
  int64_t row_stride;
  const W *panels, *up_panels;
  X* out;
  int64_t M, K, N;
  GateActivation activation;
  // float32, ungated: out = act(x W^T + bias), bias [N] where not null, act where activate
  const float* bias = nullptr;
  bool activate = false;
};

template <typename V>
__attribute__((always_inline)) inline V activate(V g, GateActivation activation) {
  switch (activation) {
    case GateActivation::kSilu:
      return silu(g);
    case GateActivation::kGeluTanh: {
      // 0.5 g (1 + tanh(y)) = g sigmoid(2 y), y = sqrt(2 / pi) (g + 0.044715 g^3)
      const V y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
      return g * sigmoid(y + y);
    }
    default:
      return g > V{} ? g : V{};
  }
}

// out [rows, 64] (row stride ldc) = x [rows, K] panel (a panel's successor lies right after it:
// the stream fetched ahead runs on into the next panel, which the next unit reads); first: the
// call's first row group, which reads the panel from memory (later groups find it in cache);
// kWide: built for AVX-512's registers (blocks of four vectors), else for AVX2's (product's
// narrow blocks)
template <bool kWide>
__attribute__((always_inline)) inline void panel_product(const float* x, int64_t row_stride, const float* panel,
                                                         int64_t K, float* out, int64_t ldc, int64_t rows,
                                                         bool first) {
  // rows that one register block takes read the panel whole; under AVX2 that is only one or two
  // (product's 64- and 32-column blocks, each a whole 256-byte row of the panel an input). More
  // rows there take blocks of 16 columns, passes over the panel each reading a line of every 256
  // bytes: the first group streams it in slices instead (two threads, alternating in one
  // process: the mini Qwen3.5's decoding-step projections 3 rows -35 %, 4 rows -37 % (one thread
  // -46 %), Flan-T5-small's 4 rows -42 %; the whole steps at 48 / 64 / 128 / 256 rows (weights
  // read whole before) -21 / -15 / -6 / -4 %, Flan-T5-small's at 48 / 64 rows -24 / -20 %). A
  // group after it reads the panel from cache, whole: slices cost 6 % there.
  constexpr int64_t kWholeRows = kWide ? kProductRows : kNarrowFewRows;
  if (rows <= kWholeRows || !first) {
    product<false, false, float, kProductRows, !kWide>(x, row_stride, panel, kPanelColumns, out, ldc, rows, K,
                                                        kPanelColumns, false);
    return;
  }
  constexpr int64_t ahead = kFetchSlicesF32 * kSliceDepth * kPanelColumns * sizeof(float);
  for (int64_t k0 = 0; k0 < K; k0 += kSliceDepth) {
    const int64_t depth = std::min(kSliceDepth, K - k0);
    const float* slice = panel + k0 * kPanelColumns;
    product<false, true, float, kProductRows, !kWide>(x + k0, row_stride, slice, kPanelColumns, out, ldc, rows,
                                                       depth, kPanelColumns, k0 > 0, false,
                                                       reinterpret_cast<const char*>(slice) + ahead,
                                                       depth * kPanelColumns * sizeof(float));
  }
}

// out[r][0, cols) = act(out[r][c] + bias[c]) for r < rows (row stride ldc), as Problem's
// epilogue says; applied to a panel's outputs while they are in cache (a last partial vector
// through a padded copy)
template <typename V>
__attribute__((always_inline)) inline void finish_outputs(float* out, int64_t ldc, int64_t rows, int64_t cols,
                                                          const float* bias, bool apply, GateActivation activation) {
  constexpr int64_t lanes = kLanesOf<V>;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += lanes) {
      const int64_t n = std::min(lanes, cols - c);
      float* o = out + r * ldc + c;
      const float* b = bias ? bias + c : nullptr;
      alignas(64) float tail[lanes] = {}, tail_bias[lanes] = {};
      if (n < lanes) {
        std::copy(o, o + n, tail);
        if (b) std::copy(b, b + n, tail_bias);
        o = tail;
        b = b ? tail_bias : nullptr;
      }
      V v = load_as<V>(o);
      if (b) v = v + load_as<V>(b);
      if (apply) v = activate(v, activation);
      store_as(o, v);
      if (n < lanes) std::copy(tail, tail + n, out + r * ldc + c);
    }
  }
}

// AVX2's register blocks (narrow_tile) take kSubColumns of a panel's 64 columns: a line of each
// 256-byte row. A call of more than one row group gives each thread a copy of the panel it works
// on in sub-panels ([64 / kSubColumns][K][kSubColumns], each block's columns a line after the
// next) and takes each kNarrowRows-row block of inputs against every column of the panel (and of
// its up panel) in turn, while the block's inputs are in L1. Reading the panel in place, pass by
// 16-column pass over every row block, touched one line in four of each row (a quarter of L1's
// sets) and read each row block from L2 again for every pass. Two threads, the two paths
// alternating in one process: Flan-T5-small's gated MLP (3,920 rows) -14 % / -21 % in a fast / slow
// phase of the machine, Qwen3.5-mini's (2,048) -3 to -15 %; plain products -6 to -17 % in fast
// phases, -7 to +12 % in slow ones; LAVE end to end -6 to -7 %. Both give each output the same
// sum in the same order: the same bits.
constexpr int64_t kSubColumns = 16;

// panel [K][kPanelColumns] -> sub [kPanelColumns / kSubColumns][K][kSubColumns], the panel read in order
__attribute__((always_inline)) inline void split_panel(const float* panel, int64_t K, float* sub) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t c = 0; c < kPanelColumns; c += kSubColumns)
      std::memcpy(sub + c * K + k * kSubColumns, panel + k * kPanelColumns + c, kSubColumns * sizeof(float));
}

// outs[w][r][0, 64) (row stride ldo) = x [rows, K] times the w-th panel split at sub + w * K * 64,
// w < count: each block of kNarrowRows rows against every sub-panel of every panel (forced inline, as
// the rest: left out of line, a function is built for the baseline ISA, not the caller's clone)
__attribute__((always_inline)) inline void split_products(const float* x, int64_t row_stride, const float* sub,
                                                          int64_t K, int64_t rows, int count, float* const* outs,
                                                          int64_t ldo) {
  for (int64_t i0 = 0; i0 < rows; i0 += kNarrowRows) {
    const int64_t block = std::min<int64_t>(kNarrowRows, rows - i0);
    for (int w = 0; w < count; ++w)
      for (int64_t c = 0; c < kPanelColumns; c += kSubColumns)
        product<false, false, float, kProductRows, true>(x + i0 * row_stride, row_stride,
                                                         sub + (w * kPanelColumns + c) * K, kSubColumns,
                                                         outs[w] + i0 * ldo + c, ldo, block, K, kSubColumns, false);
  }
}

struct Units {
  const Problem<float, float>& s;
  int64_t first, last;
};

// units [first, last) of the panels x row-groups grid (panel-major: consecutive units share a
// panel); a panel cut short (N not a multiple of 64) or a gated one goes through scratch. AVX2,
// more than one row group: whole panels through this thread's split copy (split_products).
template <bool kWide>
__attribute__((always_inline)) inline void run_units(const Units& u) {
  const Problem<float, float>& s = u.s;
  const int64_t first = u.first, last = u.last;
  const int64_t groups = (s.M + kRowGroup - 1) / kRowGroup, K = s.K;
  const int count = s.up_panels ? 2 : 1;
  std::vector<float> scratch;
  thread_local std::vector<float> sub;  // kept from call to call: no fresh pages each time
  int64_t held = -1;                    // the panel sub holds
  for (int64_t unit = first; unit < last; ++unit) {
    const int64_t p = unit / groups, r0 = unit % groups * kRowGroup;
    const int64_t rows = std::min(kRowGroup, s.M - r0), c0 = p * kPanelColumns;
    const int64_t cols = std::min(kPanelColumns, s.N - c0);
    const float* x = s.x + r0 * s.row_stride;
    const float* panel = s.panels + p * K * kPanelColumns;
    const float* up_panel = s.up_panels ? s.up_panels + p * K * kPanelColumns : nullptr;
    float* out = s.out + r0 * s.N + c0;
    using V = LaneVector<kWide>;
    const bool finish = s.bias || s.activate;
    const bool split = !kWide && groups > 1 && cols == kPanelColumns;
    if (split && held != p) {
      sub.resize(static_cast<std::size_t>(count * K * kPanelColumns));
      split_panel(panel, K, sub.data());
      if (up_panel) split_panel(up_panel, K, sub.data() + K * kPanelColumns);
      held = p;
    }
    if (!s.up_panels && cols == kPanelColumns) {
      if (split) {
        split_products(x, s.row_stride, sub.data(), K, rows, 1, &out, s.N);
      } else {
        panel_product<kWide>(x, s.row_stride, panel, K, out, s.N, rows, r0 == 0);
      }
      if (finish) finish_outputs<V>(out, s.N, rows, cols, s.bias ? s.bias + c0 : nullptr, s.activate, s.activation);
      continue;
    }
    scratch.resize(static_cast<std::size_t>(2 * kRowGroup * kPanelColumns));
    float *gate = scratch.data(), *up = gate + kRowGroup * kPanelColumns;
    if (split) {
      float* const outs[2] = {gate, up};
      split_products(x, s.row_stride, sub.data(), K, rows, count, outs, kPanelColumns);
    } else {
      panel_product<kWide>(x, s.row_stride, panel, K, gate, kPanelColumns, rows, r0 == 0);
      if (up_panel) panel_product<kWide>(x, s.row_stride, up_panel, K, up, kPanelColumns, rows, r0 == 0);
    }
    if (s.up_panels) {
      for (int64_t i = 0; i < rows * kPanelColumns; i += kLanesOf<V>)
        store_as(gate + i, activate(load_as<V>(gate + i), s.activation) * load_as<V>(up + i));
    }
    for (int64_t r = 0; r < rows; ++r) std::copy(gate + r * kPanelColumns, gate + r * kPanelColumns + cols, out + r * s.N);
    if (finish) finish_outputs<V>(out, s.N, rows, cols, s.bias ? s.bias + c0 : nullptr, s.activate, s.activation);
  }
}

FASTJUDGE_VERSIONED(run_units_f32, run_units, Units)

#ifdef FASTJUDGE_BF16_DOT
// c[r][0 .. 64) (= or +=) sum over pairs i < pairs of the two-element dot products of
// a[r * lda + i] with b[i * 64 + :], r < R, in increasing i; with kFetch, the line at
// fetch + i * fetch_step is fetched into L2 at each i
template <int R, bool kFetch>
FASTJUDGE_BF16_TARGET __attribute__((always_inline)) inline void pair_tile(const uint32_t* a, int64_t lda,
                                                                           const uint32_t* b, int64_t pairs,
                                                                           float* c, bool accumulate,
                                                                           const char* fetch, int64_t fetch_step) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      acc[r][v] = accumulate ? _mm512_loadu_ps(c + r * kPanelColumns + v * kLanes) : _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    if constexpr (kFetch) __builtin_prefetch(fetch + i * fetch_step, 0, 2);
    __m512bh bi[4];
    for (int v = 0; v < 4; ++v) bi[v] = (__m512bh)_mm512_loadu_si512(b + i * kPanelColumns + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * lda + i]));
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bi[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(c + r * kPanelColumns + v * kLanes, acc[r][v]);
}

// c [rows, 64] (= or +=) the product of rows < kRowGroup of input pairs (rows lda apart) with a
// panel's `pairs` pair rows; kFetch: fetch_bytes from fetch on are fetched into L2 over its steps
template <bool kFetch>
FASTJUDGE_BF16_TARGET __attribute__((always_inline)) inline void pair_rows(const uint32_t* a, int64_t lda,
                                                                           const uint32_t* panel, int64_t pairs,
                                                                           int64_t rows, float* c, bool accumulate,
                                                                           const char* fetch, int64_t fetch_bytes) {
  const int64_t fetch_step =
      kFetch ? std::max<int64_t>(1, fetch_bytes / ((rows + kProductRows - 1) / kProductRows * pairs)) : 0;
  for (int64_t r0 = 0; r0 < rows; r0 += kProductRows) {
    const uint32_t* ar = a + r0 * lda;
    float* cr = c + r0 * kPanelColumns;
    switch (std::min<int64_t>(kProductRows, rows - r0)) {
      case 1: pair_tile<1, kFetch>(ar, lda, panel, pairs, cr, accumulate, fetch, fetch_step); break;
      case 2: pair_tile<2, kFetch>(ar, lda, panel, pairs, cr, accumulate, fetch, fetch_step); break;
      case 3: pair_tile<3, kFetch>(ar, lda, panel, pairs, cr, accumulate, fetch, fetch_step); break;
      default: pair_tile<4, kFetch>(ar, lda, panel, pairs, cr, accumulate, fetch, fetch_step); break;
    }
    if constexpr (kFetch) fetch += pairs * fetch_step;
  }
}

// c [rows, 64] = a panel's product for rows < kRowGroup of input pairs (rows lda apart): as
// panel_product, a few rows in slices with the stream fetched ahead
FASTJUDGE_BF16_TARGET void pair_product(const uint32_t* a, int64_t lda, const uint32_t* panel, int64_t pairs,
                                        int64_t rows, float* c) {
  if (rows <= kProductRows || rows > kStreamedRows) {
    pair_rows<false>(a, lda, panel, pairs, rows, c, false, nullptr, 0);
    return;
  }
  constexpr int64_t ahead = kFetchSlices * kSliceDepth * kPanelColumns * sizeof(uint32_t);
  for (int64_t i0 = 0; i0 < pairs; i0 += kSliceDepth) {
    const int64_t depth = std::min(kSliceDepth, pairs - i0);
    const uint32_t* slice = panel + i0 * kPanelColumns;
    pair_rows<true>(a + i0, lda, slice, depth, rows, c, i0 > 0, reinterpret_cast<const char*>(slice) + ahead,
                    depth * kPanelColumns * sizeof(uint32_t));
  }
}

// Which panel and row group a unit is. Panels go in runs whose weights fit in half the L2 of a
// core (kRunBytes), each run's row groups in turn, each group through the run's panels: a group's
// inputs are read from L2 for every panel of a run, the run's weights from L2 for every group.
// Panel after panel, each through every group, read the whole input from L3 for every panel
// (3,920 x 512 -> 1,024 on AMX tiles: 16 times 4 MiB).
constexpr int64_t kRunBytes = 1 << 20;

struct UnitOrder {
  int64_t panels, groups, run;

  UnitOrder(int64_t N, int64_t groups, int64_t panel_bytes)
      : panels((N + kPanelColumns - 1) / kPanelColumns), groups(groups),
        run(std::max<int64_t>(1, kRunBytes / panel_bytes)) {}

  std::pair<int64_t, int64_t> operator()(int64_t unit) const {
    const int64_t first = unit / (groups * run) * run;  // the run's first panel
    const int64_t width = std::min(run, panels - first), at = unit - first * groups;
    return {first + at % width, at / width};
  }
};

// the bfloat16 form of run_units: each row group's inputs as pairs once, then its panels
FASTJUDGE_BF16_TARGET void run_units_bf16(const Problem<uint16_t, uint32_t>& s, int64_t first, int64_t last) {
  const int64_t groups = (s.M + kRowGroup - 1) / kRowGroup, pairs = (s.K + 1) / 2;
  // AMX tiles take 16 rows and pairs at a time: rows past a group's are read (from x, whose
  // rows are zero or an earlier group's finite inputs) and their sums dropped
  const bool tiles = pairs % kTilePairs == 0 && amx_products();
  const auto product = tiles ? amx_pair_product : pair_product;
  if (tiles) amx_configure(s.M);
  std::vector<uint32_t> x(static_cast<std::size_t>(kRowGroup * pairs));
  std::vector<float> sums(static_cast<std::size_t>(2 * kRowGroup * kPanelColumns));
  float *gate = sums.data(), *up = gate + kRowGroup * kPanelColumns;
  // a whole group's rows of even K are already the tiles' pairs (two bfloat16 inputs a word): the
  // tiles read them in place. A call of many groups copied each group again for every panel (its
  // units go panel by panel): 3,920 x 512 -> 1,024 took 5.8 ms, now 2.4-3.0 (oneDNN 1.7-1.8).
  const bool in_place = tiles && s.K % 2 == 0 && s.row_stride % 2 == 0;
  int64_t loaded = -1;  // the row group whose pairs x holds
  const UnitOrder order(s.N, groups, pairs * kPanelColumns * sizeof(uint32_t) * (s.up_panels ? 2 : 1));
  for (int64_t unit = first; unit < last; ++unit) {
    const auto [p, group] = order(unit);
    const int64_t r0 = group * kRowGroup;
    const int64_t rows = std::min(kRowGroup, s.M - r0), c0 = p * kPanelColumns;
    const int64_t cols = std::min(kPanelColumns, s.N - c0);
    const uint32_t* a = reinterpret_cast<const uint32_t*>(s.x + r0 * s.row_stride);
    int64_t lda = s.row_stride / 2;
    if (!in_place || rows < kRowGroup) {  // a last group's tiles read past its rows: from the copy
      if (group != loaded) {
        for (int64_t r = 0; r < rows; ++r) {
          const uint16_t* src = s.x + (r0 + r) * s.row_stride;
          uint32_t* dst = x.data() + r * pairs;
          std::memcpy(dst, src, static_cast<std::size_t>(s.K / 2) * sizeof(uint32_t));
          if (s.K % 2) dst[pairs - 1] = src[s.K - 1];
        }
        loaded = group;
      }
      a = x.data(), lda = pairs;
    }
    product(a, lda, s.panels + p * pairs * kPanelColumns, pairs, rows, gate);
    if (s.up_panels) {
      product(a, lda, s.up_panels + p * pairs * kPanelColumns, pairs, rows, up);
      for (int64_t i = 0; i < rows * kPanelColumns; i += kLanes)
        store(gate + i, rounded<uint16_t>(activate(load(gate + i), s.activation)) * load(up + i));
    }
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* o = s.out + (r0 + r) * s.N + c0;
      const float* sum = gate + r * kPanelColumns;
      int64_t c = 0;
      for (; c + kLanes <= cols; c += kLanes) store_floats(o + c, load(sum + c));  // rounded as from_float
      for (; c < cols; ++c) from_float(sum[c], o + c);
    }
  }
  if (tiles) amx_release();
}
#endif

template <typename X, typename W>
void run(const Problem<X, W>& s, int threads) {
  if (s.M == 0 || s.N == 0) return;
  const int64_t panels = (s.N + kPanelColumns - 1) / kPanelColumns;
  const int64_t units = panels * ((s.M + kRowGroup - 1) / kRowGroup);
  const double flops = 2.0 * s.M * s.K * s.N * (s.up_panels ? 2 : 1);
  const double bytes = double(s.K) * s.N * sizeof(W) * (s.up_panels ? 2 : 1);
  const int64_t workers = std::min<int64_t>(
      threads, static_cast<int64_t>(std::max(flops / kFlopsPerThread, bytes / kWeightBytesPerThread)) + 1);
  parallel_ranges(units, workers, 1, [&](int64_t first, int64_t last) {
    if constexpr (std::is_same_v<X, float>) {
      run_units_f32({s, first, last});
    } else {
#ifdef FASTJUDGE_BF16_DOT
      run_units_bf16(s, first, last);
#endif
    }
  });
}

}  // namespace

void dense_product(const float* x, int64_t row_stride, const float* panels, float* out, int64_t M, int64_t K,
                   int64_t N, int threads) {
  run(Problem<float, float>{x, row_stride, panels, nullptr, out, M, K, N, GateActivation::kSilu}, threads);
}

void dense_product(const float* x, int64_t row_stride, const float* panels, float* out, int64_t M, int64_t K,
                   int64_t N, const float* bias, std::optional<GateActivation> activation, int threads) {
  run(Problem<float, float>{x, row_stride, panels, nullptr, out, M, K, N,
                            activation.value_or(GateActivation::kSilu), bias, activation.has_value()},
      threads);
}

void gated_dense_product(const float* x, int64_t row_stride, const float* gate_panels, const float* up_panels,
                         float* out, int64_t M, int64_t K, int64_t N, GateActivation activation, int threads) {
  run(Problem<float, float>{x, row_stride, gate_panels, up_panels, out, M, K, N, activation}, threads);
}

bool bf16_dense_available() { return cpu_has_bf16_dot(); }

void dense_product(const uint16_t* x, int64_t row_stride, const uint32_t* pair_panels, uint16_t* out, int64_t M,
                   int64_t K, int64_t N, int threads) {
  if (!cpu_has_bf16_dot()) throw std::runtime_error("this CPU has no AVX512-BF16 dot products");
  run(Problem<uint16_t, uint32_t>{x, row_stride, pair_panels, nullptr, out, M, K, N, GateActivation::kSilu},
      threads);
}

void gated_dense_product(const uint16_t* x, int64_t row_stride, const uint32_t* gate_panels, const uint32_t* up_panels,
                         uint16_t* out, int64_t M, int64_t K, int64_t N, GateActivation activation, int threads) {
  if (!cpu_has_bf16_dot()) throw std::runtime_error("this CPU has no AVX512-BF16 dot products");
  run(Problem<uint16_t, uint32_t>{x, row_stride, gate_panels, up_panels, out, M, K, N, activation}, threads);
}

}  // namespace fastjudge
