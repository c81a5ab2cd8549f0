"""Batch planner: C++ engine vs. the pure-Python planner vs. an independent reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastjudge import _engine
from fastjudge.runtime.planner import DEFAULT_MAX_BATCH_SIZE, padded_tokens, plan_batches
from fastjudge.testing import plan_batches_python

PLANNERS = [plan_batches, plan_batches_python]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def reference_sort_and_pack(lengths, max_batch_tokens, max_batch_size, group_ids=None):
    """The contract spelled out literally and slowly; only used to bound padding."""
    n = len(lengths)
    groups = [0] * n if group_ids is None else list(group_ids)
    batches = []
    for g in dict.fromkeys(groups):  # first-appearance order
        members = sorted((i for i in range(n) if groups[i] == g), key=lambda i: (-lengths[i], i))
        batch = []
        for i in members:
            grown = batch + [i]
            if batch and (
                len(grown) > max_batch_size
                or len(grown) * max(lengths[j] for j in grown) > max_batch_tokens
            ):
                batches.append(batch)
                grown = [i]
            batch = grown
        if batch:
            batches.append(batch)
    return batches


@st.composite
def problems(draw):
    """(lengths, max_batch_tokens, max_batch_size, group_ids or None), small but varied.

    Covers ties (few distinct lengths), zero lengths, dense / sparse / full-range group ids
    and lengths so spread out that the engine cannot pack its sort key.
    """
    n = draw(st.integers(0, 40))
    if draw(st.integers(0, 9)) == 0:
        max_batch_tokens = draw(st.integers(2**61, INT64_MAX))
        lengths = draw(st.lists(st.integers(0, max_batch_tokens), min_size=n, max_size=n))
    else:
        max_batch_tokens = draw(st.integers(1, 400))
        top = draw(st.integers(0, max_batch_tokens))
        lengths = draw(st.lists(st.integers(0, top), min_size=n, max_size=n))
    max_batch_size = draw(st.one_of(st.integers(1, 10), st.just(INT64_MAX)))
    kind = draw(st.sampled_from(["none", "dense", "sparse", "full"]))
    if kind == "none":
        group_ids = None
    elif kind == "full":
        group_ids = draw(st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=n, max_size=n))
        if n:  # make some of them collide
            distinct = draw(st.integers(1, n))
            group_ids = [group_ids[i % distinct] for i in range(n)]
    else:
        scale = 1 if kind == "dense" else draw(st.sampled_from([7919, 2**40, 2**60]))
        group_ids = [scale * g for g in draw(st.lists(st.integers(-2, 3), min_size=n, max_size=n))]
    return lengths, max_batch_tokens, max_batch_size, group_ids


def as_lists(batches):
    return [b.tolist() for b in batches]


def check_invariants(lengths, max_batch_tokens, max_batch_size, group_ids, batches):
    n = len(lengths)
    groups = [0] * n if group_ids is None else list(group_ids)
    for b in batches:
        assert isinstance(b, np.ndarray) and b.dtype == np.int64 and b.ndim == 1
    flat = [i for b in batches for i in b.tolist()]
    assert sorted(flat) == list(range(n)), "each request exactly once"
    for b in batches:
        rows = b.tolist()
        assert 1 <= len(rows) <= max_batch_size
        assert len(rows) * max(lengths[i] for i in rows) <= max_batch_tokens
        assert len({groups[i] for i in rows}) == 1, "batch mixes groups"
    # Groups are contiguous runs of batches, in order of first appearance.
    batch_groups = [groups[b[0]] for b in batches]
    runs = [g for k, g in enumerate(batch_groups) if k == 0 or g != batch_groups[k - 1]]
    assert runs == list(dict.fromkeys(groups))
    # Within a group, lengths never increase (longest batches first), ties by index.
    for a, b in zip(flat, flat[1:]):
        if groups[a] == groups[b]:
            assert (-lengths[a], a) < (-lengths[b], b)


def to_arrays(lengths, group_ids):
    return (
        np.asarray(lengths, dtype=np.int64),
        None if group_ids is None else np.asarray(group_ids, dtype=np.int64),
    )


# ---------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(problems())
def test_engine_matches_python_planner(problem):
    lengths, tokens, size, group_ids = problem
    arr, groups = to_arrays(lengths, group_ids)
    got = plan_batches(arr, tokens, size, groups)
    assert as_lists(got) == as_lists(plan_batches_python(lengths, tokens, size, group_ids))


@pytest.mark.parametrize("planner", PLANNERS)
@settings(max_examples=150, deadline=None)
@given(problem=problems())
def test_invariants(planner, problem):
    lengths, tokens, size, group_ids = problem
    arr, groups = to_arrays(lengths, group_ids)
    check_invariants(lengths, tokens, size, group_ids, planner(arr, tokens, size, groups))


@pytest.mark.parametrize("planner", PLANNERS)
@settings(max_examples=150, deadline=None)
@given(problem=problems())
def test_padding_no_worse_than_sort_and_pack(planner, problem):
    lengths, tokens, size, group_ids = problem
    arr, groups = to_arrays(lengths, group_ids)
    ours = padded_tokens(lengths, planner(arr, tokens, size, groups))
    assert ours <= padded_tokens(lengths, reference_sort_and_pack(lengths, tokens, size, group_ids))


@settings(max_examples=100, deadline=None)
@given(problems())
def test_deterministic(problem):
    lengths, tokens, size, group_ids = problem
    arr, groups = to_arrays(lengths, group_ids)
    first = as_lists(plan_batches(arr, tokens, size, groups))
    again = to_arrays(list(lengths), None if group_ids is None else list(group_ids))
    assert as_lists(plan_batches(again[0], tokens, size, again[1])) == first


# Larger inputs reach what the tiny hypothesis cases cannot: several radix passes and a
# sparse-id hash table that has to grow.
@pytest.mark.parametrize(
    "n, groups",
    [
        (20_000, None),
        (20_000, "dense"),
        (20_000, "sparse"),
        (5_000, "distinct"),
    ],
)
def test_engine_matches_python_planner_large(n, groups):
    rng = np.random.default_rng(n + len(str(groups)))
    lengths = rng.integers(0, 5000, n)
    group_ids = {
        None: None,
        "dense": rng.integers(0, 300, n),
        "sparse": rng.integers(INT64_MIN, INT64_MAX, 300, dtype=np.int64)[rng.integers(0, 300, n)],
        "distinct": rng.integers(INT64_MIN, INT64_MAX, n, dtype=np.int64),
    }[groups]
    got = plan_batches(lengths, 20_000, 32, group_ids)
    assert as_lists(got) == as_lists(plan_batches_python(lengths, 20_000, 32, group_ids))
    check_invariants(lengths.tolist(), 20_000, 32, None if group_ids is None else group_ids.tolist(), got)


# ---------------------------------------------------------------------------------------
# Worked examples
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("planner", PLANNERS)
def test_worked_examples(planner):
    # Sorted 1,3 (300), 2 (200), 0 (100): 2 * 300 fills the budget exactly.
    assert as_lists(planner([100, 300, 200, 300], 600, 8)) == [[1, 3], [2, 0]]
    # Group 2 = {0, 2, 4} first (it appears first), then group 1 = {1, 3}.
    assert as_lists(planner([5, 1, 3, 5, 0], 10, 3, [2, 1, 2, 1, 2])) == [[0, 2], [4], [3, 1]]
    # Zero-length requests cost no tokens but still take rows.
    assert as_lists(planner([0] * 5, 1, 2)) == [[0, 1], [2, 3], [4]]
    # Budgets near the int64 limit must not overflow rows * longest.
    assert as_lists(planner([2**62, 2**62, 1], INT64_MAX, INT64_MAX)) == [[0], [1], [2]]


@pytest.mark.parametrize("planner", PLANNERS)
def test_group_order_is_first_appearance(planner):
    batches = planner([1, 9, 1, 9, 5, 5], 100, 10, [7, 3, 7, 3, 9, 3])
    assert as_lists(batches) == [[0, 2], [1, 3, 5], [4]]


@pytest.mark.parametrize("planner", PLANNERS)
def test_default_max_batch_size(planner):
    batches = planner(np.zeros(2 * DEFAULT_MAX_BATCH_SIZE + 2, dtype=np.int64), 1)
    assert [len(b) for b in batches] == [DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_BATCH_SIZE, 2]


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("empty", [[], np.array([], dtype=np.int64), np.array([], dtype=float)])
def test_empty_input(planner, empty):
    assert planner(empty, 10) == []
    assert planner(empty, 10, 4, []) == []


def test_engine_raw_output():
    order, offsets = _engine.plan_batches(np.array([5, 1, 3, 5, 0]), 10, 3)
    assert order.dtype == np.int64 and offsets.dtype == np.int64
    assert order.tolist() == [0, 3, 2, 1, 4]
    assert offsets.tolist() == [0, 2, 5]
    order, offsets = _engine.plan_batches(np.array([], dtype=np.int64), 10, 3)
    assert order.tolist() == [] and offsets.tolist() == [0]


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint16, np.uint64, np.int64])
def test_any_integer_dtype(dtype):
    lengths = np.array([3, 7, 1, 7, 0, 2], dtype=dtype)
    groups = np.array([1, 0, 1, 0, 1, 1], dtype=dtype)
    expected = [[1, 3], [0, 5], [2, 4]]  # two rows per batch, longest first
    assert as_lists(plan_batches(lengths, 14, 2)) == expected
    assert as_lists(plan_batches(lengths.tolist(), 14, 2)) == expected
    # Group 1 (seen first): 3+2 fill 8 tokens, then 1+0; group 0: 7 and 7 alone.
    assert as_lists(plan_batches(lengths, 8, 4, groups)) == [[0, 5], [2, 4], [1], [3]]


def test_padded_tokens():
    lengths = [4, 1, 3, 0]
    assert padded_tokens(lengths, [np.array([0, 1]), np.array([2, 3])]) == 2 * 4 + 2 * 3
    assert padded_tokens(lengths, [[3]]) == 0
    assert padded_tokens(lengths, []) == 0


# ---------------------------------------------------------------------------------------
# Invalid arguments
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize(
    "args, message",
    [
        (([3, 1, -4], 10, 4), "request 2 has length -4"),
        (([3, 11, 2], 10, 4), "request 1 has length 11, which exceeds max_batch_tokens=10"),
        (([3], 0, 4), "max_batch_tokens must be positive, got 0"),
        (([3], -5, 4), "max_batch_tokens must be positive, got -5"),
        (([3], 10, 0), "max_batch_size must be positive, got 0"),
        (([3], 10, -1), "max_batch_size must be positive, got -1"),
        (([3, 4, 5], 10, 4, [1, 2]), "group_ids has 2 entries but lengths has 3"),
        ((np.ones((2, 2), dtype=np.int64), 10, 4), "lengths must be a 1-D array, got 2-D"),
        ((np.int64(5), 10, 4), "lengths must be a 1-D array, got 0-D"),
        (([1, 2], 10, 4, np.ones((2, 1), dtype=np.int64)), "group_ids must be a 1-D array"),
        ((np.array([1.5, 2.0]), 10, 4), "lengths must hold integers"),
        (([1, 2], 10, 4, [0.5, 1.0]), "group_ids must hold integers"),
    ],
)
def test_invalid_arguments(planner, args, message):
    with pytest.raises(ValueError, match=message):
        planner(*args)


def test_invalid_arguments_raw_engine():
    with pytest.raises(ValueError, match="request 0 has length 99"):
        _engine.plan_batches(np.array([99]), 10, 4)
    with pytest.raises(ValueError, match="group_ids has 1 entries but lengths has 2"):
        _engine.plan_batches(np.array([1, 2]), 10, 4, np.array([0]))
