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

Requests that run whole may still begin alike: VisExMEM's prompts all open with the same intro
before their own image and caption, a judge's prompts with the same template. Among them
:func:`share_common_prefixes` finds the beginnings several have in common (sorted, a group's
common beginning is the least common length of neighbours) and gives a group that beginning as
its prefix where the same rule says it pays: ``(n - 1) * L >= pass_tokens`` for ``n`` requests
beginning with the same ``L`` tokens, choosing for each group between sharing its common
beginning and letting its subgroups share their longer ones, whichever saves more tokens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

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


# groups nested deeper than this share the beginning they have at this depth (a bound on the
# recursion; real prompts nest a few levels: a template, an intro, a caption)
MAX_SHARE_DEPTH = 32


def share_common_prefixes(requests: Sequence[Request], shareable: Callable[[Request], int],
                          pass_tokens: int) -> list[Request]:
    """``requests`` with a prefix given to those without one (``prefix_len == 0``) that begin
    with the same tokens as others, where running that beginning once pays (module
    docstring); the others unchanged. ``shareable(r)``: how many of ``r``'s first tokens may
    be a prefix (fewer than its prompt, none from its first image on: an image's tokens are
    placeholders, equal whatever the image)."""
    limits = {i: min(shareable(r), len(r.prompt_ids) - 1) for i, r in enumerate(requests) if not r.prefix_len}
    free = sorted((i for i, n in limits.items() if n > 0),
                  key=lambda i: np.asarray(requests[i].prompt_ids[:limits[i]], dtype=np.int64).tobytes())
    if len(free) < 2:
        return list(requests)
    # sorted, requests that begin alike are neighbours: a run's common beginning is the least
    # common length of neighbours within it
    common = [_common_length(requests[a].prompt_ids[:limits[a]], requests[b].prompt_ids[:limits[b]])
              for a, b in zip(free, free[1:])]
    shared: dict[int, int] = {}
    for first, last, length in _best_groups(common, 0, len(free) - 1, pass_tokens, 0)[1]:
        shared.update((i, length) for i in free[first:last + 1])
    return [replace(r, prefix_len=shared[i]) if i in shared else r for i, r in enumerate(requests)]


def _common_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _best_groups(common: list[int], first: int, last: int, pass_tokens: int,
                 depth: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Tokens saved and the groups (first, last, shared length) of sorted requests ``first ..
    last`` (``common[k]``: what requests ``k`` and ``k + 1`` begin with alike): all of them
    sharing their common beginning, or each run that begins with more in common sharing its own,
    whichever saves more."""
    length = min(common[first:last])
    here = (last - first) * length - pass_tokens if length else 0
    if depth >= MAX_SHARE_DEPTH:
        return (here, [(first, last, length)]) if here >= 0 and length else (0, [])
    saved, groups, start = 0, [], first
    for k in range(first, last + 1):  # runs split where neighbours have only ``length`` in common
        if k == last or common[k] == length:
            if k > start:
                s, g = _best_groups(common, start, k, pass_tokens, depth + 1)
                saved, groups = saved + s, groups + g
            start = k + 1
    if length and here >= 0 and here >= saved:
        return here, [(first, last, length)]
    return saved, groups
