// What the engine's CPU kernels share: their vector-ISA clones and their split over threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

// GCC and Clang on x86-64 Linux build a hot loop for AVX-512, AVX2 and the baseline ISA and pick
// one at load time (ifunc), so the module stays portable. The AVX2 clone targets x86-64-v3
// (AVX2 with FMA, picked by the CPU's features): "avx2" alone has no FMA, so its clone split
// every multiply-add into a multiply and an add (twice the instructions, another rounding);
// "arch=haswell" would be picked only on that one Intel family.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define FASTJUDGE_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#define FASTJUDGE_VERSIONS 1
#else
#define FASTJUDGE_CLONES
#define FASTJUDGE_VERSIONS 0
#endif

// FASTJUDGE_VERSIONED(name, body, Args) defines void name(const Args&) as body<true> built for
// AVX-512 and body<false> built for AVX2 and for the baseline ISA, one picked at load time (C++
// function multiversioning): a clone whose body knows it has AVX-512 registers, which hold()
// (vector_math.hpp) needs.
#if FASTJUDGE_VERSIONS
#define FASTJUDGE_VERSIONED(name, body, Args)                                          \
  __attribute__((target("avx512f"))) void name(const Args& a) { body<true>(a); }  \
  __attribute__((target("arch=x86-64-v3"))) void name(const Args& a) { body<false>(a); } \
  __attribute__((target("default"))) void name(const Args& a) { body<false>(a); }
// FASTJUDGE_VERSIONED_YMM(name, body, Args): the same, with a second flag, kYmm, true in the
// AVX-512 and AVX2 builds (body<true, true>, body<false, true>) and false in the baseline one
// (body<false, false>): a body that keeps 8-lane vectors in registers (hold8()) needs to know
// that its build has 256-bit registers.
#define FASTJUDGE_VERSIONED_YMM(name, body, Args)                                          \
  __attribute__((target("avx512f"))) void name(const Args& a) { body<true, true>(a); }       \
  __attribute__((target("arch=x86-64-v3"))) void name(const Args& a) { body<false, true>(a); } \
  __attribute__((target("default"))) void name(const Args& a) { body<false, false>(a); }
#else
#define FASTJUDGE_VERSIONED(name, body, Args) \
  void name(const Args& a) { body<false>(a); }
#define FASTJUDGE_VERSIONED_YMM(name, body, Args) \
  void name(const Args& a) { body<false, false>(a); }
#endif

namespace fastjudge {

// The OpenMP runtime already loaded in this process (torch's CPU build brings libgomp), found at
// run time and never linked: the engine's ranges then run on the same team of threads as the
// framework's own ops. Threads of our own would compete with that team, whose idle workers spin
// for a while after every op: on two cores a two-thread kernel run right after a GEMM took as long
// as on one thread (4.1 ms alone, 8.5 ms after a GEMM). Null members where no runtime is loaded.
struct OpenMPRuntime {
  void (*parallel)(void (*body)(void*), void* data, unsigned threads, unsigned flags) = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;
};

OpenMPRuntime process_openmp();

// While alive, this thread's float32 arithmetic treats subnormal inputs as zero and flushes
// subnormal results to zero (MXCSR's DAZ and FTZ bits), restored on exit. Products of
// exp(-80)-sized factors (a fast-forgetting Gated DeltaNet head's decays, a softmax's far tail)
// land in the subnormal range, where on Intel cores each multiply or add takes a microcode assist of a
// hundred cycles: such a prompt ran its chunked delta rule 20-50x slower. The values lost are
// below 1.2e-38, under the last bit of any sum they join; the bfloat16 dot products and tiles
// flush them whatever MXCSR says.
class FlushSubnormals {
 public:
#if defined(__SSE__)
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kDazFtz); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }
#else
  FlushSubnormals() = default;
#endif
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
#if defined(__SSE__)
  static constexpr unsigned kDazFtz = 0x8040;  // flush to zero (bit 15), denormals are zero (bit 6)
  unsigned saved_;
#endif
};

// run(first, last) over [0, n) in at most `workers` contiguous ranges of whole `grain`-item units,
// the calling thread taking the first: on the process's OpenMP team where one is loaded, else on
// threads of our own; fewer than two workers run it inline. Every range runs with subnormals
// flushed (FlushSubnormals): the engine's kernels all split their work here. An exception in any range
// (std::bad_alloc for scratch) reaches the caller after every range has finished, as it would
// from one thread (Python sees MemoryError), instead of ending the process.
template <typename Run>
void parallel_ranges(int64_t n, int64_t workers, int64_t grain, Run run) {
  const int64_t units = (n + grain - 1) / grain;
  workers = std::max<int64_t>(1, std::min(workers, units));
  if (workers == 1) {
    const FlushSubnormals flush;
    run(int64_t{0}, n);
    return;
  }
  std::vector<std::exception_ptr> failed(static_cast<std::size_t>(workers));
  // the w-th of `count` ranges, in whole units
  auto guarded = [&](int64_t w, int64_t count) {
    const int64_t per = (units + count - 1) / count * grain;
    const int64_t first = w * per, last = std::min(n, first + per);
    if (first >= last) return;
    const FlushSubnormals flush;
    try {
      run(first, last);
    } catch (...) {
      failed[static_cast<std::size_t>(w)] = std::current_exception();
    }
  };
  const OpenMPRuntime omp = process_openmp();
  if (omp.parallel) {
    struct Team {
      decltype(guarded)& body;
      const OpenMPRuntime& omp;
      int64_t workers;
    } team{guarded, omp, workers};
    // the team may be smaller than asked for (nested regions, a thread limit): its members split
    // the whole range among themselves
    omp.parallel(
        [](void* data) {
          Team& t = *static_cast<Team*>(data);
          const int64_t count = std::min<int64_t>(t.workers, t.omp.num_threads());
          const int64_t w = t.omp.thread_num();
          if (w < count) t.body(w, count);
        },
        &team, static_cast<unsigned>(workers), 0);
  } else {
    std::vector<std::thread> pool;
    pool.reserve(static_cast<std::size_t>(workers));  // no reallocation while threads run
    for (int64_t w = 1; w < workers; ++w) {
      try {
        pool.emplace_back(guarded, w, workers);
      } catch (const std::system_error&) {  // no thread to be had: this range runs here
        guarded(w, workers);
      }
    }
    guarded(0, workers);
    for (auto& t : pool) t.join();
  }
  for (const auto& e : failed) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace fastjudge
