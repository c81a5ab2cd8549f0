// A [B, S, heads, dim] array read in place by the engine's kernels: a layer's views (slices of
// a fused projection's output, transposes) are handed over as they are, with no copies.
#pragma once

#include <cstdint>

namespace fastjudge {

// Element strides over the first three dimensions; each row (the last dimension) contiguous.
template <typename T>
struct StridedRows {
  const T* data;
  int64_t batch, token, head;

  const T* row(int64_t b, int64_t t, int64_t h) const { return data + b * batch + t * token + h * head; }
};

}  // namespace fastjudge
