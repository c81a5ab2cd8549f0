"""Which requests run their shared prefix once, and which run as whole prompts.

A request's shared prefix (``Request.prefix_len``) can run two ways, with the same result:

* **prefix route**: the prefix runs once in a pass of its own (prefixes of one length together),
  its state is cached, and each request sharing it continues from a copy of that state in the
  suffix pass (rows of any prefixes batched together);
* **whole route**: the request runs from its first token in the suffix pass.

The prefix route saves ``(n - 1) * P`` tokens for ``n`` requests sharing a ``P``-token prefix,
and costs one more forward pass (its fixed cost: launches, per-layer work that does not scale
with tokens) plus state copies. Per prefix this estimates both in tokens,

    prefix route:  P + pass_tokens + sum(S_i)        (only sum(S_i) when the state is cached)
    whole route:   n * P + sum(S_i)

and runs whole when that is cheaper: ``(n - 1) * P < pass_tokens`` for a prefix not cached, i.e.
always for a prefix only one request of the call has. ``pass_tokens`` is a pass's fixed cost in
tokens of work, measured per device (``benchmarks/bench_prefix_route.py``).

Calls are not independent: LAVE's demonstrations are the prefix of every item of every call,
and VisExMEM's image and caption the prefix of each of its later stages. A judge that knows its
prefix will be asked for again marks the request (``Request.keep_prefix``): its prefix takes the
prefix route and is cached whatever this call's count.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Callable, Sequence

from ...runtime.prefix_cache import PrefixCache
from ...runtime.requests import Request

#: A forward pass's fixed cost in prompt tokens' work, eager, by device type. CPU: measured
#: (``benchmarks/bench_prefix_route.py``, the ``mini`` Qwen3.5, float32, 2 cores); CUDA: an
#: estimate (a pass of a small judge costs about as much as a few thousand tokens there).
PASS_TOKENS = {"cpu": 64, "cuda": 2048}


def route(requests: Sequence[Request], prefix_key: Callable[[Request], bytes], cache: PrefixCache,
          pass_tokens: int) -> list[Request]:
    """``requests`` with ``prefix_len`` (and ``prefix_images``) set to 0 where the whole route is
    the cheaper one (module docstring), the others unchanged. ``prefix_key``: a request's prefix
    identity (tokens and images), as the cache keys it; ``cache``: says whether one is cached."""
    keys = [prefix_key(r) if r.prefix_len else None for r in requests]
    sharing = Counter(k for k in keys if k is not None)
    kept = {k for r, k in zip(requests, keys) if k is not None and r.keep_prefix}
    whole: dict[bytes, bool] = {}
    for r, key in zip(requests, keys):
        if key is None or key in whole:
            continue
        whole[key] = key not in kept and key not in cache and (sharing[key] - 1) * r.prefix_len < pass_tokens
    return [replace(r, prefix_len=0, prefix_images=0) if key is not None and whole[key] else r
            for r, key in zip(requests, keys)]
