"""Byte-budgeted cache of prefix states, indexed by the C++ radix tree.

The index (``fastjudge._engine.PrefixIndex``) owns lookup, reference counts and LRU eviction;
this class keeps the tensors behind each slot and frees those the index evicts. A state in use
by a running batch is acquired, so it is never evicted under it. It also remembers prefixes
that ran without being cached (digests of the last ``remember``), so that the owner can cache a
prefix the second time it sees one (``backends.qwen.routing``).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict

import numpy as np

from .prefix_index import CacheFullError, PrefixIndex

log = logging.getLogger("fastjudge")


class PrefixCache:
    def __init__(self, capacity_bytes: int, remember: int = 1 << 16):
        self.index = PrefixIndex(int(capacity_bytes))
        self.remember = remember
        self._uncached: OrderedDict[bytes, None] = OrderedDict()  # digests, least recent first
        self.states: dict[int, object] = {}
        self._slots: dict[bytes, int] = {}  # cached keys' bytes -> slot: membership without a lookup
        self._keys: dict[int, bytes] = {}

    def __contains__(self, key: bytes) -> bool:
        """Whether the state of the prefix whose ids' bytes are ``key`` is cached (no hit or
        miss counted, nothing acquired)."""
        return key in self._slots

    def seen_uncached(self, key: bytes) -> bool:
        """Whether the prefix whose ids' bytes are ``key`` ran uncached recently (:meth:`ran_uncached`)."""
        return _digest(key) in self._uncached

    def ran_uncached(self, key: bytes) -> None:
        """Remember that this prefix ran without being cached (the last ``remember`` are kept)."""
        name = _digest(key)
        self._uncached[name] = None
        self._uncached.move_to_end(name)
        while len(self._uncached) > self.remember:
            self._uncached.popitem(last=False)

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


def _digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()
