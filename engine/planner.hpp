// Batch planner: groups requests into padded batches under a token budget.
//
// Standard library only, so it can be unit-tested and reused outside the Python module.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fastjudge {

// A plan as one permutation plus boundaries: batch b is order[offsets[b] .. offsets[b + 1]).
// Two flat arrays hand over to numpy without per-batch allocations.
struct BatchPlan {
  std::vector<int64_t> order;    // indices into the input, every request exactly once
  std::vector<int64_t> offsets;  // size = number of batches + 1, offsets[0] == 0
};

// Sort-and-pack. Within a group (requests sharing a group id; one group when group_ids is
// null), requests are ordered by length descending, ties by index ascending, and packed
// greedily: a batch closes when one more row would exceed max_batch_size rows or
// rows * longest > max_batch_tokens. Groups come out in order of first appearance, so the
// result is a pure function of the input.
//
// group_ids, when not null, has n entries. Throws std::invalid_argument on a non-positive
// budget, a negative length, or a request longer than max_batch_tokens.
BatchPlan plan_batches(const int64_t* lengths, std::size_t n, int64_t max_batch_tokens,
                       int64_t max_batch_size, const int64_t* group_ids);

}  // namespace fastjudge
