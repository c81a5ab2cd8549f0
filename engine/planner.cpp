#include "planner.hpp"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

namespace fastjudge {
namespace {

// Sorting dominates planning, and at 1M requests memory traffic dominates sorting. So the
// sort key (group rank, length descending) and the request index are packed into one int64
// and radix sorted: 8 bytes per request and a pass count set by the key range (token lengths
// and group counts take one to three passes) instead of log n. Keys too wide to pack
// (lengths spread over most of the int64 range) fall back to a comparison sort with the
// same order.

constexpr int kDigitBits = 11;  // 2048 counters stay in L1
constexpr uint64_t kDigitMask = (uint64_t{1} << kDigitBits) - 1;
constexpr int kPackedBits = 63;  // packed keys stay non-negative as int64

int bit_width(uint64_t x) {
  int bits = 0;
  for (; x != 0; x >>= 1) ++bits;
  return bits;
}

uint64_t low_mask(int bits) { return bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1; }

// Stable LSD radix sort of packed keys on their bits from low_bit up. The bits below
// low_bit hold the request index; keys are built in index order, so stability alone breaks
// ties by index and those bits need no passes.
void radix_sort(std::vector<int64_t>& keys, int low_bit) {
  const std::size_t n = keys.size();
  if (n < 2) return;
  uint64_t varying = 0;  // bits that differ somewhere; constant digits need no pass
  for (int64_t k : keys) varying |= static_cast<uint64_t>(k ^ keys[0]);
  std::vector<int64_t> scratch;
  std::vector<std::size_t> start(kDigitMask + 1);
  for (int shift = low_bit; shift < 64 && (varying >> shift) != 0; shift += kDigitBits) {
    if (((varying >> shift) & kDigitMask) == 0) continue;
    auto digit = [shift](int64_t k) { return (static_cast<uint64_t>(k) >> shift) & kDigitMask; };
    scratch.resize(n);
    std::fill(start.begin(), start.end(), 0);
    for (int64_t k : keys) ++start[digit(k)];
    std::size_t sum = 0;
    for (std::size_t& c : start) sum += std::exchange(c, sum);
    for (int64_t k : keys) scratch[start[digit(k)]++] = k;
    keys.swap(scratch);
  }
}

uint64_t mix(uint64_t x) {  // splitmix64 finalizer: spreads clustered ids over the table
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Writes each request's group rank (groups numbered by first appearance) into rank, which
// has n entries; returns the number of groups.
uint64_t group_ranks(const int64_t* group_ids, std::size_t n, std::vector<int64_t>& rank) {
  int64_t next_rank = 0;
  const auto [lo, hi] = std::minmax_element(group_ids, group_ids + n);
  const uint64_t span = static_cast<uint64_t>(*hi) - static_cast<uint64_t>(*lo);
  if (span < 2 * static_cast<uint64_t>(n)) {
    // Dense ids (slot numbers, the usual case): a direct lookup table.
    std::vector<int64_t> table(span + 1, -1);
    for (std::size_t i = 0; i < n; ++i) {
      int64_t& r = table[static_cast<uint64_t>(group_ids[i]) - static_cast<uint64_t>(*lo)];
      if (r < 0) r = next_rank++;
      rank[i] = r;
    }
    return static_cast<uint64_t>(next_rank);
  }

  // Sparse ids (hashes, arbitrary keys): open addressing that doubles at half load, so the
  // table grows with the number of groups, not requests, and stays in cache for thousands.
  struct Slot {
    int64_t id;
    int64_t rank;  // < 0: empty
  };
  std::vector<Slot> table(1024, Slot{0, -1});
  auto slot_for = [&table](int64_t id) -> Slot& {
    const std::size_t mask = table.size() - 1;
    std::size_t pos = mix(static_cast<uint64_t>(id)) & mask;
    while (table[pos].rank >= 0 && table[pos].id != id) pos = (pos + 1) & mask;
    return table[pos];
  };
  for (std::size_t i = 0; i < n; ++i) {
    Slot& slot = slot_for(group_ids[i]);
    if (slot.rank < 0) slot = {group_ids[i], next_rank++};
    rank[i] = slot.rank;
    if (2 * static_cast<std::size_t>(next_rank) > table.size()) {
      std::vector<Slot> old(2 * table.size(), Slot{0, -1});
      old.swap(table);
      for (const Slot& s : old) {
        if (s.rank >= 0) slot_for(s.id) = s;
      }
    }
  }
  return static_cast<uint64_t>(next_rank);
}

// Checks the arguments; returns the shortest and longest length.
std::pair<int64_t, int64_t> validate(const int64_t* lengths, std::size_t n,
                                     int64_t max_batch_tokens, int64_t max_batch_size) {
  if (max_batch_tokens <= 0) {
    throw std::invalid_argument("max_batch_tokens must be positive, got " +
                                std::to_string(max_batch_tokens));
  }
  if (max_batch_size <= 0) {
    throw std::invalid_argument("max_batch_size must be positive, got " +
                                std::to_string(max_batch_size));
  }
  int64_t shortest = max_batch_tokens;
  int64_t longest = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (lengths[i] < 0) {
      throw std::invalid_argument("lengths must be non-negative, but request " +
                                  std::to_string(i) + " has length " +
                                  std::to_string(lengths[i]));
    }
    if (lengths[i] > max_batch_tokens) {
      throw std::invalid_argument("request " + std::to_string(i) + " has length " +
                                  std::to_string(lengths[i]) +
                                  ", which exceeds max_batch_tokens=" +
                                  std::to_string(max_batch_tokens));
    }
    shortest = std::min(shortest, lengths[i]);
    longest = std::max(longest, lengths[i]);
  }
  return {shortest, longest};
}

}  // namespace

BatchPlan plan_batches(const int64_t* lengths, std::size_t n, int64_t max_batch_tokens,
                       int64_t max_batch_size, const int64_t* group_ids) {
  const auto [shortest, longest] = validate(lengths, n, max_batch_tokens, max_batch_size);
  BatchPlan plan;
  plan.offsets.push_back(0);
  if (n == 0) return plan;

  const int index_bits = bit_width(n - 1);
  // Holds each request's group rank first, then its packed sort key.
  std::vector<int64_t> keys(n, 0);
  const uint64_t groups =
      group_ids != nullptr ? group_ranks(group_ids, n, keys) : 1;

  // Order by (group rank, length descending, index).
  const int length_bits = bit_width(static_cast<uint64_t>(longest - shortest));
  const int group_shift = length_bits + index_bits;
  const bool packed = bit_width(groups - 1) + group_shift <= kPackedBits;
  std::vector<int64_t> rank;  // only kept when the key does not pack
  if (packed) {
    for (std::size_t i = 0; i < n; ++i) {
      const auto shortfall = static_cast<uint64_t>(longest - lengths[i]);  // 0 = longest
      keys[i] = static_cast<int64_t>((static_cast<uint64_t>(keys[i]) << group_shift) |
                                     (shortfall << index_bits) | i);
    }
    radix_sort(keys, index_bits);
  } else {
    rank.swap(keys);
    keys.resize(n);
    std::iota(keys.begin(), keys.end(), int64_t{0});
    std::stable_sort(keys.begin(), keys.end(), [&](int64_t a, int64_t b) {
      return rank[a] != rank[b] ? rank[a] < rank[b] : lengths[a] > lengths[b];
    });
  }
  const int64_t index_mask = static_cast<int64_t>(low_mask(index_bits));
  auto index_at = [&](std::size_t k) { return packed ? keys[k] & index_mask : keys[k]; };
  auto group_at = [&](std::size_t k) {
    return packed ? static_cast<uint64_t>(keys[k]) >> group_shift
                  : static_cast<uint64_t>(rank[keys[k]]);
  };

  for (std::size_t k = 0; k < n;) {
    // The first row of a batch is its longest. Dividing instead of multiplying rows * longest
    // cannot overflow, and length <= max_batch_tokens leaves room for at least one row.
    const int64_t first = lengths[index_at(k)];
    const int64_t cap =
        first == 0 ? max_batch_size : std::min(max_batch_size, max_batch_tokens / first);
    const std::size_t limit =
        static_cast<uint64_t>(cap) >= n - k ? n : k + static_cast<std::size_t>(cap);
    const uint64_t group = group_at(k);
    std::size_t end = k + 1;
    while (end < limit && group_at(end) == group) ++end;
    plan.offsets.push_back(static_cast<int64_t>(end));
    k = end;
  }

  if (packed) {
    for (int64_t& k : keys) k &= index_mask;
  }
  plan.order = std::move(keys);
  return plan;
}

}  // namespace fastjudge
