"""Prefix index: C++ engine vs. the plain-Python radix tree vs. a brute-force model."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from fastjudge import _engine
from fastjudge.runtime.prefix_index import CacheFullError, PrefixIndex
from fastjudge.testing import PrefixIndexPython

INDEXES = [PrefixIndex, PrefixIndexPython]


class ModelIndex:
    """The contract spelled out literally: a list of entries, scanned on every call."""

    def __init__(self, capacity_bytes):
        self.capacity_bytes = capacity_bytes
        self.entries = {}  # slot -> [tokens, nbytes, refcount]
        self.lru = []  # slots with refcount 0, least recently used first
        self.evicted = []
        self.next_slot = 0
        self.hits = 0
        self.misses = 0

    @property
    def bytes_used(self):
        return sum(e[1] for e in self.entries.values())

    def use(self, slot):
        if slot in self.lru:
            self.lru.remove(slot)
            self.lru.append(slot)

    def insert(self, tokens, nbytes):
        tokens = tuple(tokens)
        if not tokens or nbytes < 0:
            raise ValueError
        for slot, (toks, _, _) in self.entries.items():
            if toks == tokens:
                self.use(slot)
                return slot
        pinned = sum(e[1] for e in self.entries.values() if e[2] > 0)
        if pinned + nbytes > self.capacity_bytes:
            raise CacheFullError
        while self.bytes_used + nbytes > self.capacity_bytes:
            victim = self.lru.pop(0)
            assert self.entries[victim][2] == 0
            del self.entries[victim]
            self.evicted.append(victim)
        slot = self.next_slot
        self.next_slot += 1
        self.entries[slot] = [tokens, nbytes, 0]
        self.lru.append(slot)
        return slot

    def match(self, tokens):
        tokens = tuple(tokens)
        found = [(len(t), s) for s, (t, _, _) in self.entries.items() if tokens[: len(t)] == t]
        if not found:
            self.misses += 1
            return -1, 0
        self.hits += 1
        length, slot = max(found)  # two prefixes of one length are the same entry
        self.use(slot)
        return slot, length

    def entry(self, slot):
        if slot not in self.entries:
            raise KeyError(slot)
        return self.entries[slot]

    def acquire(self, slot):
        e = self.entry(slot)
        if e[2] == 0:
            self.lru.remove(slot)
        e[2] += 1

    def release(self, slot):
        e = self.entry(slot)
        if e[2] == 0:
            raise ValueError
        e[2] -= 1
        if e[2] == 0:
            self.lru.append(slot)

    def remove(self, slot):
        if self.entry(slot)[2] > 0:
            raise ValueError
        del self.entries[slot]
        self.lru.remove(slot)

    def take_evicted(self):
        out, self.evicted = self.evicted, []
        return out


def outcome(fn, *args):
    """A comparable result: the return value as plain Python, or (error type, message)."""
    try:
        result = fn(*args)
    except (ValueError, KeyError, CacheFullError) as error:
        return type(error), str(error)
    if isinstance(result, np.ndarray):
        return result.tolist()
    if isinstance(result, tuple) and any(isinstance(r, np.ndarray) for r in result):
        return tuple(r.tolist() for r in result)
    return result


def same(engine, python, model, method, *args):
    """Runs method on all three; C++ and Python must agree exactly, the model on value or
    error type (it raises bare exceptions)."""
    got = outcome(getattr(engine, method), *args)
    assert got == outcome(getattr(python, method), *args), method
    expected = outcome(getattr(model, method), *args)
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], type):
        assert isinstance(expected, tuple) and expected[0] is got[0], (method, got, expected)
    else:
        assert got == expected, (method, got, expected)
    return got


# Three token values make prefixes overlap, split edges and merge back constantly.
token_lists = st.lists(st.integers(0, 2), min_size=0, max_size=7)
as_arrays = st.sampled_from(["list", np.int32, np.int64, np.uint8])


def encode(tokens, kind):
    return list(tokens) if kind == "list" else np.asarray(tokens, dtype=kind)


class PrefixIndexMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(0, 30))
    def start(self, capacity):
        self.engine = PrefixIndex(capacity)
        self.python = PrefixIndexPython(capacity)
        self.model = ModelIndex(capacity)

    def both(self, method, *args):
        return same(self.engine, self.python, self.model, method, *args)

    def some_slot(self, data):
        return data.draw(st.integers(-1, self.model.next_slot))

    @rule(tokens=token_lists, nbytes=st.integers(-1, 12), kind=as_arrays)
    def insert(self, tokens, nbytes, kind):
        self.both("insert", encode(tokens, kind), nbytes)

    @rule(tokens=token_lists, kind=as_arrays)
    def match(self, tokens, kind):
        self.both("match", encode(tokens, kind))

    @rule(queries=st.lists(token_lists, max_size=5), flat=st.booleans())
    def match_many(self, queries, flat):
        expected = [self.model.match(q) for q in queries]
        if flat:
            offsets = np.cumsum([0] + [len(q) for q in queries])
            tokens = np.array([t for q in queries for t in q], dtype=np.int64)
            args = (tokens, offsets)
        else:
            args = ([np.asarray(q, dtype=np.int64) for q in queries],)
        got = outcome(self.engine.match_many, *args)
        assert got == outcome(self.python.match_many, *args)
        assert got == ([s for s, _ in expected], [n for _, n in expected])

    @rule(data=st.data())
    def acquire(self, data):
        self.both("acquire", self.some_slot(data))

    @rule(data=st.data())
    def release(self, data):
        self.both("release", self.some_slot(data))

    @rule(data=st.data())
    def remove(self, data):
        self.both("remove", self.some_slot(data))

    @rule(data=st.data())
    def refcount(self, data):
        slot = self.some_slot(data)
        got = outcome(self.engine.refcount, slot)
        assert got == outcome(self.python.refcount, slot)
        if slot in self.model.entries:
            assert got == self.model.entries[slot][2]
        else:
            assert got[0] is KeyError

    @rule()
    def take_evicted(self):
        self.both("take_evicted")

    @precondition(lambda self: self.model.entries)
    @rule(data=st.data())
    def match_an_entry(self, data):
        # Queries built from cached entries reach the long matches random ones rarely do.
        slot = data.draw(st.sampled_from(sorted(self.model.entries)))
        extra = data.draw(token_lists)
        self.both("match", list(self.model.entries[slot][0]) + extra)

    @invariant()
    def stats_agree(self):
        for name in ["capacity_bytes", "bytes_used", "num_entries", "hits", "misses", "hit_rate"]:
            value = getattr(self.engine, name)
            assert value == getattr(self.python, name), name
            if name != "num_entries" and name != "hit_rate":
                assert value == getattr(self.model, name), name
        assert len(self.engine) == len(self.python) == len(self.model.entries)
        assert self.engine.bytes_used <= self.engine.capacity_bytes

    @invariant()
    def python_tree_is_compressed(self):
        # White-box: the C++ tree has the same shape rules, which keep it O(entries) nodes.
        stack = [self.python._root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.label and child.label[0] == first and child.parent is node
                assert child.depth == node.depth + len(child.label)
                assert child.slot >= 0 or len(child.children) >= 2
                stack.append(child)

    @invariant()
    def entries_agree(self):
        # Every live slot (pinned ones included) is present, every other issued one absent.
        for slot in range(-1, self.model.next_slot + 1):
            live = slot in self.model.entries
            assert (slot in self.engine) == (slot in self.python) == live


TestPrefixIndexStateful = PrefixIndexMachine.TestCase
TestPrefixIndexStateful.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---------------------------------------------------------------------------------------
# Properties of match alone
# ---------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    entries=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=12),
    queries=st.lists(st.lists(st.integers(0, 3), max_size=10), max_size=12),
)
def test_match_is_longest_cached_prefix(entries, queries):
    cached = {}
    for make in INDEXES:
        index = make(1 << 20)
        slots = {tuple(e): index.insert(np.array(e), 1) for e in entries}
        results = []
        for q in queries:
            slot, length = index.match(np.array(q, dtype=np.int64))
            prefixes = [tuple(e) for e in slots if tuple(q[: len(e)]) == tuple(e)]
            if prefixes:
                best = max(prefixes, key=len)
                assert (slot, length) == (slots[best], len(best))
            else:
                assert (slot, length) == (-1, 0)
            results.append((slot, length))
        assert index.hits == sum(s >= 0 for s, _ in results)
        assert index.misses == len(queries) - index.hits
        cached[make] = results
    assert cached[PrefixIndex] == cached[PrefixIndexPython]


# ---------------------------------------------------------------------------------------
# Worked examples
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", INDEXES)
def test_whole_entries_only(make):
    index = make(100)
    a = index.insert([1, 2, 3], 10)
    b = index.insert([1, 2, 3, 4, 5], 10)
    c = index.insert([7], 10)
    assert (a, b, c) == (0, 1, 2)
    assert index.match([1, 2, 3, 4, 5, 6]) == (b, 5)
    assert index.match([1, 2, 3, 4]) == (a, 3)  # [1..5] is not a prefix, [1, 2, 3] is
    assert index.match([1, 2]) == (-1, 0)  # inside an edge: no whole entry
    assert index.match([7, 1]) == (c, 1)
    assert index.match([]) == (-1, 0)
    assert (index.hits, index.misses) == (3, 2)
    assert index.hit_rate == pytest.approx(0.6)
    # Removing the middle of a path merges edges; matching is unaffected otherwise.
    index.remove(a)
    assert index.match([1, 2, 3, 4]) == (-1, 0)
    assert index.match([1, 2, 3, 4, 5]) == (b, 5)
    assert index.insert([1, 2], 3) == 3  # splits the merged edge again
    assert index.match([1, 2, 3, 4]) == (3, 2)
    assert (index.num_entries, index.bytes_used) == (3, 23)


@pytest.mark.parametrize("make", INDEXES)
def test_reinsert_returns_slot_and_refreshes_recency(make):
    index = make(20)
    a = index.insert([1, 1], 10)
    b = index.insert([2, 2], 10)
    assert index.insert(np.array([1, 1], dtype=np.int32), 999) == a  # nbytes ignored
    assert index.bytes_used == 20
    index.insert([3], 10)  # evicts b, now the least recently used
    assert index.take_evicted().tolist() == [b]
    assert a in index and b not in index


@pytest.mark.parametrize("make", INDEXES)
def test_eviction_under_tiny_budget(make):
    index = make(10)
    assert index.capacity_bytes == 10 and index.hit_rate == 0.0
    a = index.insert([1, 2], 4)
    b = index.insert([1, 3], 4)
    assert index.match([1, 2, 9]) == (a, 2)  # a is now more recent than b
    c = index.insert([1], 4)
    evicted = index.take_evicted()
    assert evicted.dtype == np.int64 and evicted.tolist() == [b]
    assert index.take_evicted().tolist() == []
    assert (index.num_entries, index.bytes_used) == (2, 8)

    # Pinned entries are never evicted; a failed insert evicts nothing.
    index.acquire(a)
    pinned = "8 bytes does not fit: 4 of capacity_bytes=10 are pinned"
    with pytest.raises(CacheFullError, match=pinned):
        index.insert([5], 8)
    assert c in index and index.take_evicted().tolist() == []
    d = index.insert([5], 6)  # room once c goes
    assert index.take_evicted().tolist() == [c]
    with pytest.raises(CacheFullError, match="11 bytes exceeds capacity_bytes=10"):
        index.insert([6], 11)

    # Releasing makes an entry most recent; several evictions come out oldest first, and
    # eviction stops as soon as the entry fits (the free entry e survives).
    index.release(a)
    e = index.insert([7], 0)
    index.insert([8], 10)
    assert index.take_evicted().tolist() == [d, a]
    assert e in index and index.bytes_used == 10 and index.num_entries == 2


@pytest.mark.parametrize("make", INDEXES)
def test_zero_capacity_holds_free_entries(make):
    index = make(0)
    slot = index.insert([4, 4], 0)
    assert index.match([4, 4, 4]) == (slot, 2)
    with pytest.raises(CacheFullError):
        index.insert([5], 1)
    assert slot in index


@pytest.mark.parametrize("make", INDEXES)
def test_refcounts(make):
    index = make(10)
    slot = index.insert([1], 5)
    index.acquire(slot)
    index.acquire(slot)
    assert index.refcount(slot) == 2
    with pytest.raises(ValueError, match=r"slot 0 is acquired \(refcount 2\); release it"):
        index.remove(slot)
    index.release(slot)
    index.release(slot)
    with pytest.raises(ValueError, match=r"slot 0 is not acquired \(refcount 0\)"):
        index.release(slot)
    index.remove(slot)
    assert slot not in index and len(index) == 0 and index.bytes_used == 0
    assert index.insert([1], 5) == 1  # slot ids are never reused
    assert index.take_evicted().tolist() == []  # remove is not an eviction


@pytest.mark.parametrize("make", INDEXES)
@pytest.mark.parametrize("method", ["acquire", "release", "remove", "refcount"])
def test_unknown_slots(make, method):
    index = make(10)
    index.insert([1], 6)
    index.insert([2], 6)  # evicts slot 0
    for slot in [0, 2, -1, 10**12]:
        with pytest.raises(KeyError, match=f"slot {slot} is not in the index"):
            getattr(index, method)(slot)


@pytest.mark.parametrize("make", INDEXES)
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda ix: ix.insert([], 1), "tokens must not be empty"),
        (lambda ix: ix.insert(np.array([], dtype=np.int64), 1), "tokens must not be empty"),
        (lambda ix: ix.insert([1], -1), "nbytes must be non-negative, got -1"),
        (lambda ix: ix.insert(np.ones((2, 2), int), 1), "tokens must be a 1-D array, got 2-D"),
        (lambda ix: ix.insert(np.array([1.0, 2.0]), 1), "tokens must hold integers, got dtype"),
        (lambda ix: ix.match(np.int64(3)), "tokens must be a 1-D array, got 0-D"),
        (lambda ix: ix.match([True, False]), "tokens must hold integers, got dtype bool"),
        (lambda ix: ix.match_many(np.array([1, 2])), "a flat tokens array needs offsets"),
        (lambda ix: ix.match_many([[1], [0.5]]), r"tokens\[1\] must hold integers"),
        (lambda ix: ix.match_many([1, 2], []), "offsets must have at least one entry"),
        (lambda ix: ix.match_many([1, 2], [1, 2]), "offsets must start at 0, got 1"),
        (lambda ix: ix.match_many([1, 2], [0, 2, 1, 2]), r"offsets\[1\]=2 > offsets\[2\]=1"),
        (lambda ix: ix.match_many([1, 2], [0, 1]), r"offsets must end at len\(tokens\)=2, got 1"),
        (lambda ix: ix.match_many([1, 2], [[0, 2]]), "offsets must be a 1-D array, got 2-D"),
    ],
)
def test_invalid_arguments(make, call, message):
    index = make(10)
    with pytest.raises(ValueError, match=message):
        call(index)
    assert index.hits == index.misses == index.num_entries == 0


@pytest.mark.parametrize("make", INDEXES)
def test_negative_capacity(make):
    with pytest.raises(ValueError, match="capacity_bytes must be non-negative, got -1"):
        make(-1)


@pytest.mark.parametrize("make", INDEXES)
def test_match_many_forms(make):
    index = make(100)
    index.insert([1, 2], 1)
    index.insert([1, 2, 3], 1)
    queries = [[1, 2, 3, 4], [1], [], [1, 2, 5], [9]]
    slots, lengths = index.match_many([np.array(q, dtype=np.int32) for q in queries])
    assert slots.dtype == np.int64 and lengths.dtype == np.int64
    assert slots.tolist() == [1, -1, -1, 0, -1] and lengths.tolist() == [3, 0, 0, 2, 0]
    flat = np.array([t for q in queries for t in q], dtype=np.int64)
    offsets = np.cumsum([0] + [len(q) for q in queries])
    again = index.match_many(flat, offsets)
    assert again[0].tolist() == slots.tolist() and again[1].tolist() == lengths.tolist()
    assert index.match_many(np.ones((3, 2), dtype=np.int64))[0].tolist() == [-1, -1, -1]
    assert index.match_many([])[0].tolist() == []
    assert index.match_many(np.array([], dtype=np.int64), [0])[0].tolist() == []
    assert (index.hits, index.misses) == (4, 9)


def test_engine_types_and_repr():
    index = _engine.PrefixIndex(64)
    assert PrefixIndex is _engine.PrefixIndex and issubclass(CacheFullError, RuntimeError)
    slot = index.insert(np.array([3, 1, 4], dtype=np.uint16), 8)
    assert isinstance(slot, int)
    assert index.match(np.array([3, 1, 4, 1], dtype=np.int8)) == (slot, 3)
    assert repr(index) == "PrefixIndex(capacity_bytes=64, bytes_used=8, num_entries=1)"


# ---------------------------------------------------------------------------------------
# Larger, LAVE-shaped workload: a few shared heads, many tails, constant eviction
# ---------------------------------------------------------------------------------------


def test_engine_matches_python_large():
    rng = np.random.default_rng(0)
    demos = [rng.integers(0, 50, 40) for _ in range(2)]
    heads = [np.concatenate([demos[i % 2], rng.integers(0, 50, 10)]) for i in range(20)]
    prefixes = [np.concatenate([heads[rng.integers(20)], rng.integers(0, 4, rng.integers(0, 6))])
                for _ in range(3000)]
    engine, python = PrefixIndex(40 * 60), PrefixIndexPython(40 * 60)
    pinned = []
    for i, p in enumerate(prefixes):
        nbytes = len(p)
        assert outcome(engine.insert, p, nbytes) == outcome(python.insert, p, nbytes)
        query = np.concatenate([prefixes[rng.integers(i + 1)], rng.integers(0, 4, 3)])
        assert engine.match(query) == python.match(query)
        if i % 7 == 0:
            slot = int(rng.integers(0, i + 1))
            got = outcome(engine.acquire, slot)
            assert got == outcome(python.acquire, slot)
            if got is None:  # not evicted yet
                pinned.append(slot)
        if i % 11 == 0 and pinned:
            slot = pinned.pop(0)
            engine.release(slot), python.release(slot)
        if i % 13 == 0:
            assert engine.take_evicted().tolist() == python.take_evicted().tolist()
        assert engine.bytes_used == python.bytes_used <= engine.capacity_bytes
    assert engine.match_many(prefixes)[0].tolist() == python.match_many(prefixes)[0].tolist()
    assert (engine.hits, engine.misses, engine.num_entries) == (
        python.hits, python.misses, python.num_entries)
    assert all(slot in engine for slot in pinned)


def test_engine_concurrent_threads():
    """match_many runs without the GIL; inserts from another thread must not corrupt it."""
    index = PrefixIndex(1 << 30)
    queries = [np.arange(i % 50, i % 50 + 30) for i in range(2000)]
    errors = []

    def reader():
        try:
            for _ in range(20):
                index.match_many(queries)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(2000):
        index.insert(np.arange(i % 50, i % 50 + 1 + i % 29), 1)
    thread.join()
    assert not errors
    assert index.num_entries == 50 * 29  # every (start, length) pair occurs
    assert index.hits + index.misses == 20 * len(queries)
