// Prefix index: a radix tree (compressed trie over token ids) from cached token prefixes to
// cache slots, with a byte budget, reference counts and LRU eviction.
//
// A decoder-only judge runs a shared prompt prefix once and keeps the model state it
// produced in a cache slot; this index finds, for a new prompt, the longest cached prefix
// it can resume from. Only whole entries count: an entry matches when its full token
// sequence is a prefix of the query, so a partial match along an edge or a tree node that
// carries no entry never does.
//
// Standard library only, so it can be unit-tested and reused outside the Python module. Not
// thread-safe: the Python binding serialises calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace fastjudge {

// insert() cannot make room: the entry is larger than the whole budget, or evicting every
// unpinned entry would still leave too little. Thrown before anything is evicted.
class CacheFull : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A slot id that is not in the index: never issued, evicted, or removed.
class UnknownSlot : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct PrefixMatch {
  int64_t slot;    // -1 when nothing matches
  int64_t length;  // tokens of the matched entry, 0 when nothing matches
};

// Slot ids are issued 0, 1, 2, ... and never reused, so a stale id is always an error
// rather than a silent alias of a newer entry.
//
// Recency: entries with refcount 0 sit in one LRU list and eviction takes its oldest. An
// entry becomes most recent when it is inserted (or re-inserted), when match returns it,
// and when its last reference is released (it was in use until then). Acquired entries
// leave the list, so they are never evicted.
//
// Every operation costs O(length of its token sequence) plus O(1) per node touched;
// eviction adds the same per evicted entry.
class PrefixIndex {
 public:
  // Throws std::invalid_argument if capacity_bytes < 0.
  explicit PrefixIndex(int64_t capacity_bytes);

  // Registers the n tokens as a cached prefix whose state costs nbytes and returns its new
  // slot. If exactly these tokens are cached already, returns that slot instead (its size
  // stays as first inserted; nbytes is ignored) and marks it most recent. Otherwise evicts
  // least-recently-used unpinned entries until bytes_used + nbytes <= capacity_bytes; the
  // evicted slots are queued for take_evicted(). Throws std::invalid_argument on n == 0 or
  // nbytes < 0, and CacheFull (leaving the index unchanged) if the entry cannot fit.
  int64_t insert(const int64_t* tokens, std::size_t n, int64_t nbytes);

  // The entry with the longest token sequence that is a prefix of tokens[0, n), marked
  // most recent; {-1, 0} if none. Counts one hit or one miss.
  PrefixMatch match(const int64_t* tokens, std::size_t n);

  // Reference counts. An entry with refcount > 0 is never evicted and cannot be removed.
  // Unknown slots throw UnknownSlot; release() of an entry with refcount 0 throws
  // std::invalid_argument.
  void acquire(int64_t slot);
  void release(int64_t slot);
  int64_t refcount(int64_t slot) const;
  bool contains(int64_t slot) const;

  // Drops an entry with refcount 0 (throws std::invalid_argument otherwise, UnknownSlot
  // for an unknown slot). Removed slots are not reported by take_evicted().
  void remove(int64_t slot);

  // Slots evicted by insert() since the last call, oldest eviction first; clears the queue.
  std::vector<int64_t> take_evicted();

  int64_t capacity_bytes() const { return capacity_; }
  int64_t bytes_used() const { return bytes_used_; }
  int64_t num_entries() const { return static_cast<int64_t>(slot_node_.size()); }
  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }

 private:
  static constexpr uint32_t kNone = UINT32_MAX;
  static constexpr uint32_t kRoot = 0;

  struct Node {
    std::vector<int64_t> label;                       // edge tokens; empty only at the root
    std::unordered_map<int64_t, uint32_t> children;   // first label token -> node
    uint32_t parent = kNone;
    int64_t depth = 0;  // tokens from the root through the end of label
    // The entry ending at this node, if slot >= 0.
    int64_t slot = -1;
    int64_t nbytes = 0;
    int64_t refcount = 0;
    uint32_t lru_prev = kNone;  // links in the LRU list (entries with refcount 0)
    uint32_t lru_next = kNone;
  };

  uint32_t node_of(int64_t slot) const;  // throws UnknownSlot
  uint32_t find_exact(const int64_t* tokens, std::size_t n) const;
  uint32_t child_of(uint32_t node, int64_t token) const;
  uint32_t add_path(const int64_t* tokens, std::size_t n);
  uint32_t new_node(uint32_t parent, const int64_t* begin, const int64_t* end);
  uint32_t split(uint32_t node, std::size_t keep);
  void drop_entry(uint32_t node);
  void prune(uint32_t node);
  void free_node(uint32_t node);
  void lru_push_back(uint32_t node);
  void lru_unlink(uint32_t node);
  void touch(uint32_t node);

  std::vector<Node> nodes_;            // nodes_[kRoot] is the root
  std::vector<uint32_t> free_nodes_;   // recycled indices into nodes_
  std::unordered_map<int64_t, uint32_t> slot_node_;
  uint32_t lru_head_ = kNone;  // least recently used, evicted first
  uint32_t lru_tail_ = kNone;
  std::vector<int64_t> evicted_;
  int64_t capacity_;
  int64_t bytes_used_ = 0;
  int64_t evictable_bytes_ = 0;  // bytes of entries with refcount 0
  int64_t next_slot_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

}  // namespace fastjudge
