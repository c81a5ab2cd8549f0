"""Which requests run their shared prefix once, and which run as whole prompts.

A request's shared prefix (``Request.prefix_len``) can run two ways, with the same result:

* **prefix route**: the prefix runs once in its own pass, its state is cached, and every request
  sharing it continues from a copy of that state in a second pass (its suffix);
* **whole route**: the request runs from its first token, batched with other whole prompts.

The prefix route saves ``(n - 1) * P`` tokens for ``n`` requests sharing a ``P``-token prefix,
and costs one more forward pass (its fixed cost: launches, per-layer work that does not scale
with tokens) plus state copies; and only requests of one prefix share its suffix batch, so a
prefix nobody else shares leaves a batch of one row. The whole route runs every token of every
prompt, but in one pass and batched across prefixes. Per prefix this estimates both in tokens,

    prefix route:  P + pass_tokens + sum(S_i)        (0 + sum(S_i) when the state is cached)
    whole route:   n * P + sum(S_i)

and runs whole when that is cheaper: ``(n - 1) * P < pass_tokens`` for a prefix not cached,
i.e. always for a prefix only one request has. ``pass_tokens`` is a pass's fixed cost in tokens
of work, measured per device (``benchmarks/bench_prefix_route.py``).

A prefix that ran whole is remembered (``RecentPrefixes``), so a prefix that comes back in a later
call (a stream of one-item calls with the same demonstrations) takes the prefix route and is
cached from then on; the first call has paid only what the prefix route would have.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import replace
from typing import Callable, Sequence

from ...runtime.requests import Request

#: A forward pass's fixed cost in prompt tokens' work, eager, by device type. CPU: measured
#: (``benchmarks/bench_prefix_route.py``, the ``mini`` Qwen3.5, float32, 2 cores); CUDA: a pass of
#: a small judge costs about as much as a few thousand tokens, so sharing pays later there.
PASS_TOKENS = {"cpu": 64, "cuda": 2048}


class RecentPrefixes:
    """Digests of the last ``capacity`` prefixes that ran whole (bounded memory)."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._seen

    def add(self, key: bytes) -> None:
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)


def digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()


def route(requests: Sequence[Request], prefix_key: Callable[[Request], bytes], cached: Callable[[bytes], bool],
          recent: RecentPrefixes, pass_tokens: int) -> list[Request]:
    """``requests`` with ``prefix_len`` (and ``prefix_images``) set to 0 where the whole route is
    the cheaper one (module docstring); the others unchanged. ``prefix_key``: a request's
    prefix identity (tokens and images); ``cached``: whether its state is in the cache."""
    keys = [prefix_key(r) if r.prefix_len else None for r in requests]
    sharing = Counter(k for k in keys if k is not None)
    whole: dict[bytes, bool] = {}
    for r, key in zip(requests, keys):
        if key is None or key in whole:
            continue
        name = digest(key)
        whole[key] = (not cached(key) and name not in recent and (sharing[key] - 1) * r.prefix_len < pass_tokens)
        if whole[key]:
            recent.add(name)
    return [replace(r, prefix_len=0, prefix_images=0) if key is not None and whole[key] else r
            for r, key in zip(requests, keys)]
