"""Claim structure and scores: repair of the decomposition's part graph, and the global score
from claim support (the paper's Table 9 aggregates)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

AGGREGATES = ("mean", "geometric", "harmonic", "min")
LINK_FIELDS = ("parent_part_id", "head_part_id", "target_part_id")


def aggregate(supports: Sequence[float], how: str = "mean") -> float:
    """The global score from claim supports (the paper's Table 9 alternatives)."""
    s = np.asarray(supports, dtype=np.float64)
    if s.size == 0:
        raise ValueError("no claim supports to aggregate")
    if how == "mean":
        return float(s.mean())
    if how == "min":
        return float(s.min())
    if how == "geometric":
        return 0.0 if (s <= 0).any() else float(np.exp(np.log(s).mean()))
    if how == "harmonic":
        return 0.0 if (s <= 0).any() else float(s.size / (1.0 / s).sum())
    raise ValueError(f"aggregate must be one of {AGGREGATES}, got {how!r}")


def validate_parts(parts: Sequence[dict]) -> tuple[list[dict], list[str]]:
    """Parts with a usable link structure, and what was repaired: a repeated part id drops the
    later part; a link to an unknown id, to the part itself, or one that closes a cycle (along
    parent/head/target links) is set to null."""
    problems, seen, kept = [], set(), []
    for p in parts:
        if p["part_id"] in seen:
            problems.append(f"part id {p['part_id']} repeated; later part dropped")
            continue
        seen.add(p["part_id"])
        kept.append(dict(p))
    for p in kept:
        for f in LINK_FIELDS:
            target = p.get(f)
            if target is None:
                continue
            if target == p["part_id"]:
                problems.append(f"{p['part_id']}.{f} links to itself; set to null")
                p[f] = None
            elif target not in seen:
                problems.append(f"{p['part_id']}.{f} links to unknown part {target}; set to null")
                p[f] = None
    # Cycles: add links one at a time, refusing any that would close a cycle (depth-first
    # reachability over the links kept so far), in part order -- deterministic.
    edges: dict[str, set[str]] = {p["part_id"]: set() for p in kept}

    def reaches(a: str, b: str) -> bool:
        stack, visited = [a], set()
        while stack:
            n = stack.pop()
            if n == b:
                return True
            if n not in visited:
                visited.add(n)
                stack.extend(edges[n])
        return False

    for p in kept:
        for f in LINK_FIELDS:
            target = p.get(f)
            if target is None:
                continue
            if reaches(target, p["part_id"]):
                problems.append(f"{p['part_id']}.{f} -> {target} closes a cycle; set to null")
                p[f] = None
            else:
                edges[p["part_id"]].add(target)
    return kept, problems
