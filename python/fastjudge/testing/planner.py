"""Pure-Python batch planner: the same sort-and-pack as the C++ one, as a plain loop.

See :mod:`fastjudge.runtime.planner` for the strategy; this version returns the same batches
and raises the same errors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastjudge.runtime.planner import DEFAULT_MAX_BATCH_SIZE

from .int_arrays import as_int_array

__all__ = ["plan_batches_python"]


def plan_batches_python(
    lengths: np.ndarray | Sequence[int],
    max_batch_tokens: int,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    group_ids: np.ndarray | Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Pure-Python loop version of :func:`~fastjudge.runtime.planner.plan_batches`, with the
    same output and errors."""
    lens = as_int_array(lengths, "lengths").tolist()
    if max_batch_tokens <= 0:
        raise ValueError(f"max_batch_tokens must be positive, got {max_batch_tokens}")
    if max_batch_size <= 0:
        raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
    if group_ids is None:
        groups = [0] * len(lens)
    else:
        groups = as_int_array(group_ids, "group_ids").tolist()
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
