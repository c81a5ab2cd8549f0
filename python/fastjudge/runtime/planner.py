"""Batch planning: split judge requests into padded batches under a token budget.

Every forward pass needs a plan first, and planning runs on the host while the device
waits. A Python loop over a million requests takes seconds, which is longer than the
device needs for many of those batches, so the planner lives in C++ (``fastjudge._engine``)
where it costs milliseconds, runs without the GIL and exchanges whole numpy arrays instead
of per-request Python objects. That keeps host overhead far below device time.

Strategy (sort-and-pack), identical in both implementations here:

* requests are split by group id (requests sharing a cached prefix slot); groups appear in
  the order of their first request, and a batch never mixes groups;
* within a group, requests are sorted by length descending, ties by index ascending, so
  similar lengths share a batch and padding stays small;
* batches are packed greedily: a new batch starts when one more row would make
  ``rows * longest > max_batch_tokens`` or ``rows > max_batch_size``.

``plan_batches_python`` is a plain-Python version of the same algorithm: the reference in
tests and the baseline in ``benchmarks/bench_planner.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastjudge import _engine

__all__ = [
    "DEFAULT_MAX_BATCH_SIZE",
    "padded_tokens",
    "plan_batches",
    "plan_batches_python",
]

#: Default row cap per batch. Large enough that the token budget is the binding limit for
#: typical judge prompts (300-1200 tokens under a 16k-64k budget), small enough to bound
#: per-batch KV-cache and logits memory when prompts are very short.
DEFAULT_MAX_BATCH_SIZE = 64


def plan_batches(
    lengths: np.ndarray | Sequence[int],
    max_batch_tokens: int,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    group_ids: np.ndarray | Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Plan batches in C++; returns a list of int64 index arrays into ``lengths``.

    ``lengths`` and ``group_ids`` are 1-D integer array-likes of equal length. Each batch
    satisfies ``len(batch) * max(lengths[batch]) <= max_batch_tokens`` and
    ``len(batch) <= max_batch_size`` (default :data:`DEFAULT_MAX_BATCH_SIZE`). Raises
    ``ValueError`` on invalid arguments. The arrays are views into one shared buffer.
    """
    order, offsets = _engine.plan_batches(lengths, max_batch_tokens, max_batch_size, group_ids)
    bounds = offsets.tolist()
    return [order[start:end] for start, end in zip(bounds[:-1], bounds[1:])]


def plan_batches_python(
    lengths: np.ndarray | Sequence[int],
    max_batch_tokens: int,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    group_ids: np.ndarray | Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Pure-Python loop version of :func:`plan_batches`, with the same output and errors."""
    lens = _as_int_list(lengths, "lengths")
    if max_batch_tokens <= 0:
        raise ValueError(f"max_batch_tokens must be positive, got {max_batch_tokens}")
    if max_batch_size <= 0:
        raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
    if group_ids is None:
        groups = [0] * len(lens)
    else:
        groups = _as_int_list(group_ids, "group_ids")
        if len(groups) != len(lens):
            raise ValueError(
                f"group_ids has {len(groups)} entries but lengths has {len(lens)}"
            )
    for i, length in enumerate(lens):
        if length < 0:
            raise ValueError(
                f"lengths must be non-negative, but request {i} has length {length}"
            )
        if length > max_batch_tokens:
            raise ValueError(
                f"request {i} has length {length}, which exceeds "
                f"max_batch_tokens={max_batch_tokens}"
            )

    rank: dict[int, int] = {}
    for g in groups:
        rank.setdefault(g, len(rank))
    # sorted() is stable, so equal keys keep ascending index order.
    order = sorted(range(len(lens)), key=lambda i: (rank[groups[i]], -lens[i]))

    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        # Sorted descending, so the batch's first row stays its longest.
        if current and (
            groups[i] != groups[current[0]]
            or len(current) + 1 > max_batch_size
            or (len(current) + 1) * longest > max_batch_tokens
        ):
            batches.append(current)
            current = []
        if not current:
            longest = lens[i]
        current.append(i)
    if current:
        batches.append(current)
    return [np.array(b, dtype=np.int64) for b in batches]


def padded_tokens(
    lengths: np.ndarray | Sequence[int], batches: Sequence[Sequence[int]]
) -> int:
    """Tokens the batches occupy once padded: sum of ``rows * longest`` over batches."""
    lens = np.asarray(lengths, dtype=np.int64)
    total = 0
    for batch in batches:
        rows = np.asarray(batch, dtype=np.int64)
        if rows.size:
            total += rows.size * int(lens[rows].max())
    return total


def _as_int_list(values: np.ndarray | Sequence[int], name: str) -> list[int]:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got {arr.ndim}-D")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return [int(v) for v in arr.tolist()]
