// What the engine's CPU kernels compute with: 16-lane float32 vectors (GCC/Clang vector
// extensions, built for each ISA clone), a vectorised exp, and bfloat16 <-> float32.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

// The helpers that take and return vectors are inlined into each clone, so no call passes them
// by the ABI GCC warns of.
#pragma GCC diagnostic ignored "-Wpsabi"

// bfloat16 dot products (vdpbf16ps: pairs of bfloat16 products summed into float32 lanes), built
// where the compiler targets x86-64 and run where the CPU has AVX512-BF16 (cpu_has_bf16_dot)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FASTJUDGE_BF16_DOT 1
#define FASTJUDGE_BF16_TARGET __attribute__((target("avx512f,avx512bf16")))
#endif

namespace fastjudge {

// Whether this CPU runs the bfloat16 dot-product kernels, checked once
inline bool cpu_has_bf16_dot() {
#ifdef FASTJUDGE_BF16_DOT
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// 16 float32 lanes: one 512-bit register (two 256-bit ones in the AVX2 clone)
typedef float Floats __attribute__((vector_size(64)));
typedef int32_t Ints __attribute__((vector_size(64)));
constexpr int kLanes = 16;

// In a body built for AVX-512 (kZmm), keeps v in a register for the FMAs that read it: GCC
// otherwise folds the load of a vector that several FMAs read into each of them, and a core that
// loads one 64-byte vector a cycle then waits on its loads (the reassociated cross-attention's
// scores: 18 loads for 16 FMAs). Elsewhere (no 64-byte registers) it does nothing.
template <bool kZmm>
__attribute__((always_inline)) inline void hold(Floats& v) {
  if constexpr (kZmm) asm("" : "+v"(v));
}

inline Floats load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }

// 8 float32 lanes: one AVX2 register. Register blocks built for AVX2 hold their accumulators in
// these: GCC keeps an array of 16-lane vectors, two registers each there, in memory, moving
// every accumulator through the stack at every step (the engine's float32 projection ran at
// 6 GFLOP/s on two Zen 3 cores where oneDNN ran at 100).
typedef float Floats8 __attribute__((vector_size(32)));
typedef uint16_t Halves8 __attribute__((vector_size(16)));
typedef uint32_t Words8 __attribute__((vector_size(32)));

// hold() for a vector of 8 lanes, in a build with 256-bit registers (kYmm: the AVX2 and
// AVX-512 builds; the baseline build cannot hold one in a register): GCC otherwise reads a
// vector that several FMAs take from memory in each of them (a key of the cross-attention's
// scores: ten loads for eight FMAs, 22 % slower)
template <bool kYmm>
__attribute__((always_inline)) inline void hold8(Floats8& v) {
  if constexpr (kYmm) asm("" : "+x"(v));
}

// A vector of V's lanes at p, and stored at p (V: Floats or Floats8)
template <typename V>
__attribute__((always_inline)) inline V load_as(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
__attribute__((always_inline)) inline void store_as(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

inline Floats8 load8(const float* p) { return load_as<Floats8>(p); }

// 8 bfloat16 values (their bits) as float32 lanes
inline Floats8 load8(const uint16_t* p) {
  Halves8 h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<Floats8>(__builtin_convertvector(h, Words8) << 16);
}

typedef uint16_t Halves __attribute__((vector_size(32)));
typedef uint32_t Words __attribute__((vector_size(64)));

// 16 bfloat16 values (their bits) as float32 lanes: each pattern moved to the high half
inline Floats load_bf16(const uint16_t* p) {
  Halves h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<Floats>(__builtin_convertvector(h, Words) << 16);
}

// the sums of 16 vectors' lanes, lane i holding the sum of v[i]'s (a transpose-and-add tree:
// pairs of vectors fold their halves, then quarters, eighths and lanes, 45 operations in all)
inline Floats lane_sums(const Floats (&v)[16]) {
  Floats b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// The sums of 8 vectors' lanes (code built for AVX2), each by the same tree (halves, then
// quarters, then pairs), lane i holding v[folded_vector(i)]'s: v0 v2 v4 v6 | v1 v3 v5 v7. Past
// the halves each fold stays within 128-bit lanes (shufps, one cycle; folds across them took a
// vpermd apiece); callers that index their vectors by folded_vector take the sums in place.
constexpr int folded_vector(int lane) { return lane < 4 ? 2 * lane : 2 * (lane - 4) + 1; }

inline Floats8 folded_lane_sums(const Floats8 (&v)[8]) {
  Floats8 b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 9, 11, 5, 7, 13, 15);
}

// lane_sums for 8 vectors of 8 lanes: lane i holds the sum of v[i]'s (folded_lane_sums, in order)
inline Floats8 lane_sums(const Floats8 (&v)[8]) {
  const Floats8 f = folded_lane_sums(v);
  return __builtin_shufflevector(f, f, 0, 4, 1, 5, 2, 6, 3, 7);
}

// *p in every lane of a register, for FMAs that each read it: one broadcast, which the compiler
// can neither fold into each FMA (a load apiece) nor build lane by lane. Only in bodies built for
// AVX-512.
__attribute__((always_inline)) inline Floats held_broadcast(const float* p) {
  Floats v;
  asm("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
  return v;
}

// n rounded up to whole vectors of lanes
inline int64_t whole_vectors(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// exp(x) for x <= 0, to about one float32 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// Taylor polynomial to degree 7 (error below 6e-9), 2^n from the exponent bits. Below -87 it
// returns exp(-87) ~ 1.6e-38 in place of a subnormal: nothing a sum that holds 1 can tell.
// V: Floats, or Floats8 in code built for AVX2 (GCC turns the selects of a 16-lane vector into
// one scalar comparison a lane there).
template <typename V>
__attribute__((always_inline)) inline V exp_nonpositive(V x) {
  using Lanes = decltype(x < x);  // the signed integer vector of V's lanes
  const V lowest = V{} - 87.0f;
  x = x < lowest ? lowest : x;
  const V round = V{} + 12582912.0f;  // 1.5 x 2^23: adding it rounds to an integer
  const V n = (x * 1.44269504088896341f + round) - round;
  const V r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  V p = V{} + 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Lanes bits = (__builtin_convertvector(n, Lanes) + 127) << 23;
  return p * reinterpret_cast<V>(bits);
}

// x / (1 + exp(-x)) (SiLU) and 1 / (1 + exp(-x)) (the logistic sigmoid), through exp of -|x|,
// on Floats or Floats8 (exp_nonpositive); forced inline: left out of line, an AVX-512 clone's call
// went to a copy built for the baseline ISA, its vector passed through memory
template <typename V>
__attribute__((always_inline)) inline V sigmoid(V x) {
  const V e = exp_nonpositive(x < V{} ? x : -x);
  return (x < V{} ? e : V{} + 1.0f) / (1.0f + e);
}

template <typename V>
__attribute__((always_inline)) inline V silu(V x) {
  return x * sigmoid(x);
}

// The vector lane-wise code of a kernel built for AVX-512 (kWide) or for AVX2 takes: 16 lanes,
// or 8 (on AVX2 GCC turns each comparison or select of a 16-lane vector into scalar code)
template <bool kWide>
using LaneVector = std::conditional_t<kWide, Floats, Floats8>;

// The float32 lanes of a vector type V (Floats: 16, Floats8: 8)
template <typename V>
constexpr int64_t kLanesOf = sizeof(V) / sizeof(float);

inline float to_float(float x) { return x; }

inline float to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

inline void from_float(float x, float* out) { *out = x; }

// round to nearest even; a NaN stays a (quiet) NaN
inline void from_float(float x, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *out = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}

// x as the element type T holds it (float32: itself; bfloat16: rounded to nearest even)
template <typename T>
inline float rounded(float x) {
  T held;
  from_float(x, &held);
  return to_float(held);
}

typedef uint32_t Bits __attribute__((vector_size(64)));

// rounded() of a vector's lanes at once (U: its unsigned lanes): bfloat16's rounding on the bit
// patterns (a NaN stays a quiet NaN)
template <typename T, typename U, typename V>
__attribute__((always_inline)) inline V rounded_lanes(V x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const U bits = reinterpret_cast<U>(x);
    const U nearest = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const U quiet = (bits | 0x400000u) & 0xffff0000u;
    return reinterpret_cast<V>((bits & 0x7fffffffu) > 0x7f800000u ? quiet : nearest);
  }
}

template <typename T>
inline Floats rounded(Floats x) {
  return rounded_lanes<T, Bits>(x);
}

template <typename T>
inline Floats8 rounded(Floats8 x) {
  return rounded_lanes<T, Words8>(x);
}


#ifdef FASTJUDGE_BF16_DOT
// 16 float32 lanes rounded to bfloat16 as 8 pairs of consecutive lanes (lane 2i in pair i's
// low half, 2i + 1 in its high half): what a bfloat16 dot product takes, by the CPU's own
// conversion (vcvtneps2bf16: to nearest even, a NaN quieted, as rounded<uint16_t>; it flushes
// subnormal inputs, which the engine's ranges never produce: FlushSubnormals). Ten vector
// operations a store by hand took a tenth of a bfloat16 prompt's attention time.
FASTJUDGE_BF16_TARGET inline void store_bf16_pairs(uint32_t* pairs, Floats x) {
  __m512 v;
  std::memcpy(&v, &x, sizeof v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#endif

// 16 values of T (float32, or bfloat16 bits) as float32 lanes
inline Floats load_floats(const float* p) { return load(p); }
inline Floats load_floats(const uint16_t* p) { return load_bf16(p); }

// V's lanes (Floats or Floats8) of T values as float32
template <typename V>
__attribute__((always_inline)) inline V load_lanes(const float* p) {
  return load_as<V>(p);
}

template <typename V>
__attribute__((always_inline)) inline V load_lanes(const uint16_t* p) {
  if constexpr (std::is_same_v<V, Floats>) {
    return load_bf16(p);
  } else {
    return load8(p);
  }
}

// 16 float32 lanes stored as T, each rounded once (bfloat16: to nearest even)
inline void store_floats(float* p, Floats v) { store(p, v); }
inline void store_floats(uint16_t* p, Floats v) {
  const Halves h = __builtin_convertvector(reinterpret_cast<Bits>(rounded<uint16_t>(v)) >> 16, Halves);
  std::memcpy(p, &h, sizeof h);
}

// V's lanes (Floats or Floats8) stored as T, each rounded once (bfloat16: to nearest even)
template <typename V>
__attribute__((always_inline)) inline void store_lanes(float* p, V v) {
  store_as(p, v);
}

template <typename V>
__attribute__((always_inline)) inline void store_lanes(uint16_t* p, V v) {
  if constexpr (std::is_same_v<V, Floats>) {
    store_floats(p, v);
  } else {
    const Halves8 h = __builtin_convertvector(reinterpret_cast<Words8>(rounded<uint16_t>(v)) >> 16, Halves8);
    std::memcpy(p, &h, sizeof h);
  }
}

}  // namespace fastjudge
