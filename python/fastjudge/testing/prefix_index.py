"""Plain-Python prefix index: the same radix tree and LRU rules as the C++ one.

:mod:`fastjudge.runtime.prefix_index` states the contract; :class:`PrefixIndexPython` keeps the
same node layout, so slots, matches, evictions, statistics and errors (including
:class:`~fastjudge.runtime.prefix_index.CacheFullError`) are identical.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from fastjudge.runtime.prefix_index import CacheFullError

from .int_arrays import as_int_array

__all__ = ["PrefixIndexPython"]


class _Node:
    __slots__ = ("label", "children", "parent", "depth", "slot", "nbytes", "refcount")

    def __init__(self, label: tuple[int, ...], parent: _Node | None, depth: int) -> None:
        self.label = label  # edge tokens from the parent; empty only at the root
        self.children: dict[int, _Node] = {}  # first label token -> node
        self.parent = parent
        self.depth = depth  # tokens from the root through the end of label
        self.slot = -1  # the entry ending here, if >= 0
        self.nbytes = 0
        self.refcount = 0


class PrefixIndexPython:
    """Plain-Python radix tree with the same behaviour, results and errors as
    :class:`PrefixIndex` (same node layout and LRU rules). Not thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        capacity_bytes = operator.index(capacity_bytes)
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be non-negative, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._root = _Node((), None, 0)
        self._slots: dict[int, _Node] = {}
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # refcount 0 only, oldest first
        self._evicted: list[int] = []
        self._bytes_used = 0
        self._evictable_bytes = 0
        self._next_slot = 0
        self._hits = 0
        self._misses = 0

    # -- stats ---------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def bytes_used(self) -> int:
        return self._bytes_used

    @property
    def num_entries(self) -> int:
        return len(self._slots)

    @property
    def hits(self) -> int:
        return self._hits

    @property
    def misses(self) -> int:
        return self._misses

    @property
    def hit_rate(self) -> float:
        total = self._hits + self._misses
        return 0.0 if total == 0 else self._hits / total

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, slot: int) -> bool:
        return operator.index(slot) in self._slots

    def __repr__(self) -> str:
        return (
            f"PrefixIndexPython(capacity_bytes={self._capacity}, "
            f"bytes_used={self._bytes_used}, num_entries={len(self._slots)})"
        )

    # -- lookups -------------------------------------------------------------------------

    def match(self, tokens: np.ndarray | Sequence[int]) -> tuple[int, int]:
        """(slot, length) of the longest cached entry that is a prefix of ``tokens``."""
        return self._match(_as_token_tuple(tokens, "tokens"))

    def match_many(
        self,
        tokens: np.ndarray | Iterable[np.ndarray | Sequence[int]],
        offsets: np.ndarray | Sequence[int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``match`` for each query in order; returns int64 arrays (slots, lengths)."""
        if offsets is not None:
            flat = _as_token_tuple(tokens, "tokens")
            offs = _as_token_tuple(offsets, "offsets")
            if not offs:
                raise ValueError("offsets must have at least one entry")
            if offs[0] != 0:
                raise ValueError(f"offsets must start at 0, got {offs[0]}")
            for i in range(len(offs) - 1):
                if offs[i] > offs[i + 1]:
                    raise ValueError(
                        f"offsets must be non-decreasing, but offsets[{i}]={offs[i]} > "
                        f"offsets[{i + 1}]={offs[i + 1]}"
                    )
            if offs[-1] != len(flat):
                raise ValueError(f"offsets must end at len(tokens)={len(flat)}, got {offs[-1]}")
            queries = (flat[a:b] for a, b in zip(offs[:-1], offs[1:]))
        else:
            if isinstance(tokens, np.ndarray) and tokens.ndim == 1:
                raise ValueError(
                    "a flat tokens array needs offsets; pass offsets or a sequence of 1-D arrays"
                )
            # Check every query before matching any, then convert one at a time: holding
            # all of them as tuples would cost memory and garbage-collector time.
            arrays = [as_int_array(q, f"tokens[{i}]") for i, q in enumerate(tokens)]
            queries = (tuple(arr.tolist()) for arr in arrays)
        results = [self._match(q) for q in queries]
        slots = np.array([s for s, _ in results], dtype=np.int64)
        lengths = np.array([n for _, n in results], dtype=np.int64)
        return slots, lengths

    def _match(self, toks: tuple[int, ...]) -> tuple[int, int]:
        best = None
        node = self._root
        pos, n = 0, len(toks)
        while pos < n:
            node = node.children.get(toks[pos])
            if node is None:
                break
            end = pos + len(node.label)
            # A partial edge cannot hold a whole entry, and nothing below it can either.
            if end > n or toks[pos:end] != node.label:
                break
            pos = end
            if node.slot >= 0:
                best = node
        if best is None:
            self._misses += 1
            return -1, 0
        self._hits += 1
        self._touch(best)
        return best.slot, best.depth

    def _find_exact(self, toks: tuple[int, ...]) -> _Node | None:
        node = self._root
        pos, n = 0, len(toks)
        while pos < n:
            node = node.children.get(toks[pos])
            if node is None:
                return None
            end = pos + len(node.label)
            if end > n or toks[pos:end] != node.label:
                return None
            pos = end
        return node if node.slot >= 0 else None

    # -- updates -------------------------------------------------------------------------

    def insert(self, tokens: np.ndarray | Sequence[int], nbytes: int) -> int:
        """Register a cached prefix whose state costs ``nbytes``; returns its slot."""
        toks = _as_token_tuple(tokens, "tokens")
        nbytes = operator.index(nbytes)
        if not toks:
            raise ValueError("tokens must not be empty")
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        existing = self._find_exact(toks)
        if existing is not None:
            self._touch(existing)
            return existing.slot
        if nbytes > self._capacity:
            raise CacheFullError(
                f"an entry of {nbytes} bytes exceeds capacity_bytes={self._capacity}"
            )
        pinned = self._bytes_used - self._evictable_bytes
        if nbytes > self._capacity - pinned:
            raise CacheFullError(
                f"an entry of {nbytes} bytes does not fit: {pinned} of "
                f"capacity_bytes={self._capacity} are pinned by acquired entries"
            )
        while nbytes > self._capacity - self._bytes_used:
            _, victim = next(iter(self._lru.items()))
            self._evicted.append(victim.slot)
            self._drop_entry(victim)

        node = self._add_path(toks)
        node.slot = self._next_slot
        self._next_slot += 1
        node.nbytes = nbytes
        node.refcount = 0
        self._slots[node.slot] = node
        self._bytes_used += nbytes
        self._evictable_bytes += nbytes
        self._lru[node.slot] = node
        return node.slot

    def take_evicted(self) -> np.ndarray:
        """int64 array of slots evicted by ``insert`` since the last call, oldest first."""
        evicted, self._evicted = self._evicted, []
        return np.array(evicted, dtype=np.int64)

    def acquire(self, slot: int) -> None:
        node = self._node_of(slot)
        if node.refcount == 0:
            del self._lru[node.slot]
            self._evictable_bytes -= node.nbytes
        node.refcount += 1

    def release(self, slot: int) -> None:
        node = self._node_of(slot)
        if node.refcount == 0:
            raise ValueError(f"slot {node.slot} is not acquired (refcount 0)")
        node.refcount -= 1
        if node.refcount == 0:
            self._lru[node.slot] = node
            self._evictable_bytes += node.nbytes

    def refcount(self, slot: int) -> int:
        return self._node_of(slot).refcount

    def remove(self, slot: int) -> None:
        node = self._node_of(slot)
        if node.refcount > 0:
            raise ValueError(
                f"slot {node.slot} is acquired (refcount {node.refcount}); "
                "release it before removing"
            )
        self._drop_entry(node)

    # -- internals -----------------------------------------------------------------------

    def _node_of(self, slot: int) -> _Node:
        slot = operator.index(slot)
        node = self._slots.get(slot)
        if node is None:
            raise KeyError(f"slot {slot} is not in the index")
        return node

    def _touch(self, node: _Node) -> None:
        if node.refcount == 0:
            self._lru.move_to_end(node.slot)

    def _add_path(self, toks: tuple[int, ...]) -> _Node:
        """The node ending exactly at ``toks``, creating or splitting nodes as needed."""
        node = self._root
        pos, n = 0, len(toks)
        while pos < n:
            nxt = node.children.get(toks[pos])
            if nxt is None:
                leaf = _Node(toks[pos:], node, n)
                node.children[toks[pos]] = leaf
                return leaf
            label = nxt.label
            if toks[pos : pos + len(label)] == label:  # the usual case, compared in C
                common = len(label)
            else:
                limit = min(len(label), n - pos)
                common = 1  # the child was found by its first token
                while common < limit and label[common] == toks[pos + common]:
                    common += 1
            node = nxt if common == len(label) else self._split(nxt, common)
            pos += common
        return node

    def _split(self, node: _Node, keep: int) -> _Node:
        """Cut ``node``'s edge after ``keep`` tokens; the new upper node is returned."""
        parent = node.parent
        mid = _Node(node.label[:keep], parent, parent.depth + keep)
        parent.children[mid.label[0]] = mid
        node.label = node.label[keep:]
        node.parent = mid
        mid.children[node.label[0]] = node
        return mid

    def _drop_entry(self, node: _Node) -> None:
        if node.refcount == 0:
            del self._lru[node.slot]
            self._evictable_bytes -= node.nbytes
        self._bytes_used -= node.nbytes
        del self._slots[node.slot]
        node.slot, node.nbytes, node.refcount = -1, 0, 0
        # Restore the tree shape: delete childless nodes without an entry upward, and merge
        # a node left with one child and no entry into that child.
        while node is not self._root and node.slot < 0:
            parent = node.parent
            if not node.children:
                del parent.children[node.label[0]]
                node = parent
            elif len(node.children) == 1:
                (only,) = node.children.values()
                only.label = node.label + only.label
                only.parent = parent
                parent.children[node.label[0]] = only
                return
            else:
                return


def _as_token_tuple(values: np.ndarray | Sequence[int], name: str) -> tuple[int, ...]:
    return tuple(as_int_array(values, name).tolist())
