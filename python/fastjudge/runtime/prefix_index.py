"""Prefix index: find the longest cached prompt prefix so its model state can be reused.

Decoder-only judges share long prompt heads (instructions and demonstrations) across many
requests. The owner runs such a prefix once, keeps the model state it produced (KV cache
or recurrent state) in a cache slot, and registers the prefix here. For each new prompt,
:meth:`PrefixIndex.match` returns the slot to resume from and how many tokens it covers;
:meth:`PrefixIndex.match_many` does that for a whole batch of prompts in one call, so the
planner can group requests by slot (``plan_batches(..., group_ids=slots)``).

The index is a radix tree (a compressed trie over token ids) in C++ (``fastjudge._engine``);
every operation walks it in O(length of the token sequence).
:class:`fastjudge.testing.PrefixIndexPython` is a plain-Python version of the same structure
with identical behaviour: the reference in tests and the baseline in
``benchmarks/bench_planner.py``.

Contract (both implementations):

* ``PrefixIndex(capacity_bytes)``: an empty index with a byte budget (>= 0).
* ``insert(tokens, nbytes) -> slot``: registers ``tokens`` (a non-empty 1-D integer array)
  as a cached prefix whose state costs ``nbytes`` (>= 0). Slot ids are issued 0, 1, 2, ...
  and never reused, so a stale id is an error rather than an alias of a newer entry. If
  exactly these tokens are cached already, their slot comes back instead (the entry keeps
  the size it was first inserted with). Otherwise entries with refcount 0 are evicted,
  least recently used first, until ``bytes_used + nbytes <= capacity_bytes``.
  If the entry cannot fit even with every unpinned entry evicted (``nbytes >
  capacity_bytes``, or acquired entries hold too much), :class:`CacheFullError` is raised
  and nothing is evicted.
* ``take_evicted() -> int64 array``: the slots evicted by ``insert`` since the last call,
  oldest eviction first, so the owner can free the state behind them. Call it after
  inserting; slots dropped with ``remove`` are not reported.
* ``match(tokens) -> (slot, length)``: the cached entry with the longest token sequence
  that is a prefix of ``tokens`` (only whole entries count), or ``(-1, 0)``. Counts one
  hit or miss. An empty query is a miss.
* ``match_many(list_of_arrays)`` or ``match_many(flat, offsets)`` -> int64 arrays
  ``(slots, lengths)``: exactly ``match`` applied to each query in order (query ``i`` is
  ``flat[offsets[i]:offsets[i + 1]]``; ``offsets[0] == 0``, non-decreasing, ``offsets[-1]
  == len(flat)``). The C++ version runs without the GIL.
* ``acquire(slot)`` / ``release(slot)``: reference counts; an entry with refcount > 0 is
  never evicted. ``release`` at refcount 0 raises ``ValueError``.
* ``remove(slot)``: drops an entry with refcount 0 (``ValueError`` while acquired).
* ``refcount(slot)``, ``slot in index``, ``len(index)``.
* Stats: ``capacity_bytes``, ``bytes_used``, ``num_entries``, ``hits``, ``misses``,
  ``hit_rate`` (``hits / (hits + misses)``, 0.0 before any match).

Recency: entries with refcount 0 form one LRU list. An entry becomes most recent when it
is inserted or re-inserted, when ``match`` returns it (only the longest match, not the
shorter entries along the way), and when its last reference is released. Acquired entries
leave the list until then.

Errors: ``KeyError`` for a slot that is not in the index (never issued, evicted or
removed); ``ValueError`` for malformed arguments and the refcount misuses above;
:class:`CacheFullError` (a ``RuntimeError``) when an insert cannot fit. Token arrays may
have any integer dtype and are compared as int64.

The C++ index is safe to share between Python threads (calls are serialised).
"""

from __future__ import annotations

from fastjudge import _engine

__all__ = ["CacheFullError", "PrefixIndex"]

#: Radix-tree prefix index in C++; see the module docstring for the contract.
PrefixIndex = _engine.PrefixIndex

#: Raised by ``insert`` when the entry cannot fit in the budget; nothing was evicted.
CacheFullError = _engine.CacheFullError
