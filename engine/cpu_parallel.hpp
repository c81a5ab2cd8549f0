// What the engine's CPU kernels share: their vector-ISA clones and their split over threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <system_error>
#include <thread>
#include <vector>

// GCC and Clang on x86-64 Linux build a hot loop for AVX-512, AVX2 and the baseline ISA and pick
// one at load time (ifunc), so the module stays portable.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define FASTJUDGE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FASTJUDGE_CLONES
#endif

namespace fastjudge {

// run(first, last) over [0, n) in `workers` contiguous ranges of whole `grain`-item units, the
// calling thread taking the first; fewer than two workers run it inline. An exception in any
// range (std::bad_alloc for scratch) reaches the caller after every thread has finished, as
// it would from one thread (Python sees MemoryError), instead of ending the process.
template <typename Run>
void parallel_ranges(int64_t n, int64_t workers, int64_t grain, Run run) {
  const int64_t units = (n + grain - 1) / grain;
  workers = std::max<int64_t>(1, std::min(workers, units));
  if (workers == 1) {
    run(int64_t{0}, n);
    return;
  }
  const int64_t per = (units + workers - 1) / workers * grain;
  std::vector<std::exception_ptr> failed(static_cast<std::size_t>(workers));
  auto guarded = [&](int64_t w, int64_t first, int64_t last) {
    try {
      run(first, last);
    } catch (...) {
      failed[static_cast<std::size_t>(w)] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(workers));  // no reallocation while threads run
  for (int64_t w = 1; w < workers; ++w) {
    const int64_t first = w * per, last = std::min(n, first + per);
    if (first >= last) continue;
    try {
      pool.emplace_back(guarded, w, first, last);
    } catch (const std::system_error&) {  // no thread to be had: this range runs here
      guarded(w, first, last);
    }
  }
  guarded(0, 0, std::min(n, per));
  for (auto& t : pool) t.join();
  for (const auto& e : failed) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace fastjudge
