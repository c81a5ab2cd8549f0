"""Slot bookkeeping shared by the state pools: which rows move when others leave, and the one
batched move that carries them.

Live rows sit in the leading slots of a pool, so a step runs on leading slices. When rows leave,
the last live rows take the freed slots (highest freed slot first, so every row moved in is one
that stays); the moves are planned on the host and made as one gather per buffer, whatever the
number of rows.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch


def compact(live: int, leaving: Iterable[int]) -> list[int]:
    """For each slot that stays live after the rows in slots ``leaving`` free theirs, the slot its
    row comes from (``origin[j] == j`` for a row that does not move)."""
    origin = list(range(live))
    for j in sorted(set(leaving), reverse=True):
        last = len(origin) - 1
        if j != last:
            origin[j] = origin[last]
        origin.pop()
    return origin


def move_rows(buffers: Iterable[torch.Tensor], host: Iterable[np.ndarray], src: list[int], dst: list[int]) -> None:
    """Rows ``src`` of every device buffer and host array into rows ``dst``: one gather per buffer
    (every source read before any row is written)."""
    buffers = list(buffers)
    device = buffers[0].device
    s = torch.tensor(src).to(device, non_blocking=True)
    d = torch.tensor(dst).to(device, non_blocking=True)
    for t in buffers:
        t[d] = t[s]
    for a in host:
        a[dst] = a[src]
