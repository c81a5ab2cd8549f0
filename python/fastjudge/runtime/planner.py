"""Batch planning: split judge requests into padded batches under a token budget.

Every forward pass needs a plan first, and planning runs on the host while the device
waits. A Python loop over a million requests takes seconds, which is longer than the
device needs for many of those batches, so the planner lives in C++ (``fastjudge._engine``)
where it costs milliseconds, runs without the GIL and exchanges whole numpy arrays instead
of per-request Python objects. That keeps host overhead far below device time.

Strategy (sort-and-pack), identical in the C++ planner and its plain-Python twin:

* requests are split by group id (requests sharing a cached prefix slot); groups appear in
  the order of their first request, and a batch never mixes groups;
* within a group, requests are sorted by length descending, ties by index ascending, so
  similar lengths share a batch and padding stays small;
* batches are packed greedily: a new batch starts when one more row would make
  ``rows * longest > max_batch_tokens`` or ``rows > max_batch_size``.

:func:`fastjudge.testing.plan_batches_python` is a plain-Python version of the same
algorithm: the reference in tests and the baseline in ``benchmarks/bench_planner.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastjudge import _engine

from ..engine_options import DEFAULT_MAX_BATCH_SIZE

__all__ = [
    "DEFAULT_MAX_BATCH_SIZE",
    "padded_tokens",
    "plan_batches",
]

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
