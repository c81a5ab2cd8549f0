"""Byte-budgeted cache of prefix states, indexed by the C++ radix tree.

The index (``fastjudge._engine.PrefixIndex``) owns lookup, reference counts and LRU eviction;
this class keeps the tensors behind each slot and frees those the index evicts. A state in use
by a running batch is acquired, so it is never evicted under it.
"""

from __future__ import annotations

import logging

import numpy as np

from .prefix_index import CacheFullError, PrefixIndex

log = logging.getLogger("fastjudge")


class PrefixCache:
    def __init__(self, capacity_bytes: int):
        self.index = PrefixIndex(int(capacity_bytes))
        self.states: dict[int, object] = {}
        self._slots: dict[bytes, int] = {}  # cached keys' bytes -> slot: membership without a lookup
        self._keys: dict[int, bytes] = {}

    def __contains__(self, key: bytes) -> bool:
        """Whether the state of the prefix whose ids' bytes are ``key`` is cached (no hit or
        miss counted, nothing acquired)."""
        return key in self._slots

    def lookup(self, ids: np.ndarray):
        """``(slot, state)`` for exactly these prefix tokens, acquired; ``(None, None)`` if absent."""
        slot, length = self.index.match(ids)
        if slot >= 0 and length == len(ids):
            self.index.acquire(slot)
            return slot, self.states[slot]
        return None, None

    def insert(self, ids: np.ndarray, state) -> int | None:
        """Cache ``state`` for ``ids`` and acquire it; ``None`` when it cannot fit (the caller
        then uses the state uncached)."""
        try:
            slot = self.index.insert(ids, state.nbytes)
        except CacheFullError as full:
            log.warning("fastjudge: prefix state not cached (%s)", full)
            return None
        for evicted in self.index.take_evicted():
            self.states.pop(int(evicted), None)
            self._slots.pop(self._keys.pop(int(evicted), b""), None)
        self.states[slot] = state
        self._keys[slot] = key = np.asarray(ids, dtype=np.int64).tobytes()
        self._slots[key] = slot
        self.index.acquire(slot)
        return slot

    def release(self, slot: int) -> None:
        self.index.release(slot)

    @property
    def hit_rate(self) -> float:
        return self.index.hit_rate

    @property
    def bytes_used(self) -> int:
        return self.index.bytes_used

    def __len__(self) -> int:
        return len(self.states)

