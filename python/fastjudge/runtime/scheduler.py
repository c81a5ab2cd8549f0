"""The scheduling loop: plan requests into batches on the host, run them, hand back outputs.

Planning is done by the C++ planner (``fastjudge._engine``) over each request's token cost;
requests of different output kinds never share a batch, since a batch runs one code path.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from ..engine_options import DEFAULT_MAX_BATCH_SIZE
from .planner import plan_batches
from .requests import Choice, Output, Request


def _groups(backend, requests: Sequence[Request]) -> np.ndarray:
    """Group id per request; the planner never mixes groups in a batch. Choice requests go
    together (candidate sets may differ within a batch), Text requests by identical spec (one
    decoding loop per batch), and, for backends that reuse prefix state, by shared prefix."""
    ids: dict[object, int] = {}
    keys = ((Choice if isinstance(r.spec, Choice) else r.spec, backend.group_key(r)) for r in requests)
    return np.fromiter((ids.setdefault(k, len(ids)) for k in keys), dtype=np.int64,
                       count=len(requests))


def run_requests(backend, requests: Sequence[Request], max_batch_tokens: int,
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> Iterator[list[Output]]:
    """Yield the outputs of each batch as soon as it finishes (longest requests first)."""
    if not requests:
        return
    if hasattr(backend, "route"):  # a backend that reuses prefixes decides which run whole
        requests = backend.route(requests)
    costs = np.fromiter((backend.cost(r) for r in requests), dtype=np.int64, count=len(requests))
    # A request longer than the batch budget still runs, alone in its batch.
    budget = max(int(max_batch_tokens), int(costs.max()))
    for batch in plan_batches(costs, budget, max_batch_size, group_ids=_groups(backend, requests)):
        yield backend.run([requests[i] for i in batch])
