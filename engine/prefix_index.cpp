#include "prefix_index.hpp"

#include <algorithm>
#include <string>
#include <utility>

namespace fastjudge {

// Tree shape: every node but the root has a non-empty label, and the children of a node
// start with distinct tokens. Apart from the root, a node without an entry has at least
// two children (a path with no entry and no branch would be merged into one edge), so the
// tree has fewer than twice as many nodes as entries.

PrefixIndex::PrefixIndex(int64_t capacity_bytes) : capacity_(capacity_bytes) {
  if (capacity_bytes < 0) {
    throw std::invalid_argument("capacity_bytes must be non-negative, got " +
                                std::to_string(capacity_bytes));
  }
  nodes_.emplace_back();  // the root: empty label, never an entry
}

uint32_t PrefixIndex::child_of(uint32_t node, int64_t token) const {
  const auto& children = nodes_[node].children;
  const auto it = children.find(token);
  return it == children.end() ? kNone : it->second;
}

uint32_t PrefixIndex::node_of(int64_t slot) const {
  const auto it = slot_node_.find(slot);
  if (it == slot_node_.end()) {
    throw UnknownSlot("slot " + std::to_string(slot) + " is not in the index");
  }
  return it->second;
}

uint32_t PrefixIndex::find_exact(const int64_t* tokens, std::size_t n) const {
  uint32_t node = kRoot;
  std::size_t pos = 0;
  while (pos < n) {
    node = child_of(node, tokens[pos]);
    if (node == kNone) return kNone;
    const std::vector<int64_t>& label = nodes_[node].label;
    if (label.size() > n - pos || !std::equal(label.begin(), label.end(), tokens + pos)) {
      return kNone;
    }
    pos += label.size();
  }
  return nodes_[node].slot >= 0 ? node : kNone;
}

PrefixMatch PrefixIndex::match(const int64_t* tokens, std::size_t n) {
  uint32_t best = kNone;
  uint32_t node = kRoot;
  std::size_t pos = 0;
  while (pos < n) {
    node = child_of(node, tokens[pos]);
    if (node == kNone) break;
    const std::vector<int64_t>& label = nodes_[node].label;
    // A partial edge cannot hold a whole entry, and nothing below it can either.
    if (label.size() > n - pos || !std::equal(label.begin(), label.end(), tokens + pos)) break;
    pos += label.size();
    if (nodes_[node].slot >= 0) best = node;
  }
  if (best == kNone) {
    ++misses_;
    return {-1, 0};
  }
  ++hits_;
  touch(best);
  return {nodes_[best].slot, nodes_[best].depth};
}

int64_t PrefixIndex::insert(const int64_t* tokens, std::size_t n, int64_t nbytes) {
  if (n == 0) throw std::invalid_argument("tokens must not be empty");
  if (nbytes < 0) {
    throw std::invalid_argument("nbytes must be non-negative, got " + std::to_string(nbytes));
  }
  if (const uint32_t existing = find_exact(tokens, n); existing != kNone) {
    touch(existing);
    return nodes_[existing].slot;
  }
  // Decide before evicting anything, so a failed insert leaves the index as it was.
  if (nbytes > capacity_) {
    throw CacheFull("an entry of " + std::to_string(nbytes) +
                    " bytes exceeds capacity_bytes=" + std::to_string(capacity_));
  }
  const int64_t pinned = bytes_used_ - evictable_bytes_;
  if (nbytes > capacity_ - pinned) {
    throw CacheFull("an entry of " + std::to_string(nbytes) + " bytes does not fit: " +
                    std::to_string(pinned) + " of capacity_bytes=" +
                    std::to_string(capacity_) + " are pinned by acquired entries");
  }
  // bytes_used_ <= capacity_ always holds, so neither side can overflow.
  while (nbytes > capacity_ - bytes_used_) {
    const uint32_t victim = lru_head_;  // not kNone: the check above leaves enough evictable
    evicted_.push_back(nodes_[victim].slot);
    drop_entry(victim);
  }

  const uint32_t node = add_path(tokens, n);
  Node& entry = nodes_[node];
  entry.slot = next_slot_++;
  entry.nbytes = nbytes;
  entry.refcount = 0;
  slot_node_.emplace(entry.slot, node);
  bytes_used_ += nbytes;
  evictable_bytes_ += nbytes;
  lru_push_back(node);
  return entry.slot;
}

// Returns the node ending exactly at tokens[0, n), creating or splitting nodes as needed.
uint32_t PrefixIndex::add_path(const int64_t* tokens, std::size_t n) {
  uint32_t node = kRoot;
  std::size_t pos = 0;
  while (pos < n) {
    const uint32_t next = child_of(node, tokens[pos]);
    if (next == kNone) return new_node(node, tokens + pos, tokens + n);
    const std::vector<int64_t>& label = nodes_[next].label;
    const std::size_t limit = std::min(label.size(), n - pos);
    const std::size_t common = static_cast<std::size_t>(
        std::mismatch(label.begin(), label.begin() + static_cast<std::ptrdiff_t>(limit),
                      tokens + pos)
            .first -
        label.begin());
    // common >= 1: the child was found by its first token.
    node = common == label.size() ? next : split(next, common);
    pos += common;
  }
  return node;
}

uint32_t PrefixIndex::new_node(uint32_t parent, const int64_t* begin, const int64_t* end) {
  uint32_t index;
  if (!free_nodes_.empty()) {
    index = free_nodes_.back();
    free_nodes_.pop_back();
  } else {
    index = static_cast<uint32_t>(nodes_.size());
    nodes_.emplace_back();  // may move nodes: take references only after this
  }
  Node& node = nodes_[index];
  node.label.assign(begin, end);
  node.parent = parent;
  node.depth = nodes_[parent].depth + static_cast<int64_t>(end - begin);
  nodes_[parent].children[*begin] = index;
  return index;
}

// Cuts node's edge after its first `keep` tokens: a new node takes that head (and node's
// place under the parent), node keeps the rest below it. Returns the new node.
uint32_t PrefixIndex::split(uint32_t node, std::size_t keep) {
  const uint32_t parent = nodes_[node].parent;
  // Copy the head first: new_node may move the node storage.
  const std::vector<int64_t> head(nodes_[node].label.begin(),
                                  nodes_[node].label.begin() + static_cast<std::ptrdiff_t>(keep));
  const uint32_t mid = new_node(parent, head.data(), head.data() + head.size());
  Node& lower = nodes_[node];
  lower.label.erase(lower.label.begin(), lower.label.begin() + static_cast<std::ptrdiff_t>(keep));
  lower.parent = mid;
  nodes_[mid].children[lower.label.front()] = node;
  return mid;
}

void PrefixIndex::drop_entry(uint32_t node) {
  Node& entry = nodes_[node];
  if (entry.refcount == 0) {
    lru_unlink(node);
    evictable_bytes_ -= entry.nbytes;
  }
  bytes_used_ -= entry.nbytes;
  slot_node_.erase(entry.slot);
  entry.slot = -1;
  entry.nbytes = 0;
  entry.refcount = 0;
  prune(node);
}

// Restores the tree shape after node lost its entry: deletes childless nodes without an
// entry upward, and merges a node left with one child and no entry into that child.
void PrefixIndex::prune(uint32_t node) {
  while (node != kRoot && nodes_[node].slot < 0) {
    Node& current = nodes_[node];
    const uint32_t parent = current.parent;
    if (current.children.empty()) {
      nodes_[parent].children.erase(current.label.front());
      free_node(node);
      node = parent;
    } else if (current.children.size() == 1) {
      const uint32_t only = current.children.begin()->second;
      Node& below = nodes_[only];
      below.label.insert(below.label.begin(), current.label.begin(), current.label.end());
      below.parent = parent;
      nodes_[parent].children[current.label.front()] = only;
      free_node(node);
      return;
    } else {
      return;
    }
  }
}

void PrefixIndex::free_node(uint32_t node) {
  nodes_[node] = Node{};  // releases the label and child table memory
  free_nodes_.push_back(node);
}

void PrefixIndex::lru_push_back(uint32_t node) {
  Node& n = nodes_[node];
  n.lru_prev = lru_tail_;
  n.lru_next = kNone;
  if (lru_tail_ != kNone) {
    nodes_[lru_tail_].lru_next = node;
  } else {
    lru_head_ = node;
  }
  lru_tail_ = node;
}

void PrefixIndex::lru_unlink(uint32_t node) {
  Node& n = nodes_[node];
  if (n.lru_prev != kNone) {
    nodes_[n.lru_prev].lru_next = n.lru_next;
  } else {
    lru_head_ = n.lru_next;
  }
  if (n.lru_next != kNone) {
    nodes_[n.lru_next].lru_prev = n.lru_prev;
  } else {
    lru_tail_ = n.lru_prev;
  }
  n.lru_prev = n.lru_next = kNone;
}

void PrefixIndex::touch(uint32_t node) {
  if (nodes_[node].refcount == 0 && lru_tail_ != node) {
    lru_unlink(node);
    lru_push_back(node);
  }
}

void PrefixIndex::acquire(int64_t slot) {
  const uint32_t node = node_of(slot);
  Node& entry = nodes_[node];
  if (entry.refcount == 0) {
    lru_unlink(node);
    evictable_bytes_ -= entry.nbytes;
  }
  ++entry.refcount;
}

void PrefixIndex::release(int64_t slot) {
  const uint32_t node = node_of(slot);
  Node& entry = nodes_[node];
  if (entry.refcount == 0) {
    throw std::invalid_argument("slot " + std::to_string(slot) +
                                " is not acquired (refcount 0)");
  }
  if (--entry.refcount == 0) {
    lru_push_back(node);
    evictable_bytes_ += entry.nbytes;
  }
}

int64_t PrefixIndex::refcount(int64_t slot) const { return nodes_[node_of(slot)].refcount; }

bool PrefixIndex::contains(int64_t slot) const { return slot_node_.count(slot) != 0; }

void PrefixIndex::remove(int64_t slot) {
  const uint32_t node = node_of(slot);
  if (nodes_[node].refcount > 0) {
    throw std::invalid_argument("slot " + std::to_string(slot) + " is acquired (refcount " +
                                std::to_string(nodes_[node].refcount) +
                                "); release it before removing");
  }
  drop_entry(node);
}

std::vector<int64_t> PrefixIndex::take_evicted() {
  std::vector<int64_t> out;
  out.swap(evicted_);
  return out;
}

}  // namespace fastjudge
