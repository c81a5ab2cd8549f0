#include "cpu_parallel.hpp"

#include <mutex>

#if defined(__unix__)
#include <dlfcn.h>
#endif

namespace fastjudge {

namespace {

// The first OpenMP runtime among those a framework may have loaded (GNU, LLVM, Intel: all three
// export the GNU entry points), looked up without loading anything.
OpenMPRuntime find_openmp() {
  OpenMPRuntime found;
#if defined(__unix__)
  for (const char* name : {"libgomp.so.1", "libomp.so", "libiomp5.so"}) {
    void* lib = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) continue;
    found.parallel = reinterpret_cast<decltype(found.parallel)>(dlsym(lib, "GOMP_parallel"));
    found.thread_num = reinterpret_cast<decltype(found.thread_num)>(dlsym(lib, "omp_get_thread_num"));
    found.num_threads = reinterpret_cast<decltype(found.num_threads)>(dlsym(lib, "omp_get_num_threads"));
    if (found.parallel && found.thread_num && found.num_threads) return found;  // kept loaded: never closed
    found = OpenMPRuntime{};
    dlclose(lib);
  }
#endif
  return found;
}

}  // namespace

OpenMPRuntime process_openmp() {
  // a runtime once found stays (it is never unloaded); none found is looked for again next time,
  // as the framework may load one after the engine's first call
  static std::mutex lock;
  static OpenMPRuntime runtime;
  std::lock_guard<std::mutex> hold(lock);
  if (!runtime.parallel) runtime = find_openmp();
  return runtime;
}

}  // namespace fastjudge
