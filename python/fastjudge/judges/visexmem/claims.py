"""Claim structure and scores: an example's own claims as parts, repair of the part graph, and
the global score from claim support (the paper's Table 9 aggregates)."""

from __future__ import annotations

from typing import Mapping, Sequence

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


def given_parts(claims, max_claims: int, max_chars: int) -> list[dict]:
    """An example's own claims (which replace the decomposition) as parts. Each claim is a string
    (its text; id ``P<position>``, no type, no links) or a dict with ``text`` and, optionally,
    ``part_id``, ``type`` and the link fields. The bounds of generated claims apply: at most
    ``max_claims`` claims, each text of at most ``max_chars`` characters (whitespace runs count
    as one space), and so each id and type. ValueError names what is wrong: these are the
    claims the user means to score, so none is dropped or cut. Links are repaired later by
    :func:`validate_parts`."""
    if isinstance(claims, (str, bytes)) or not isinstance(claims, Sequence):
        raise ValueError("claims must be a list of strings or of objects with a text")
    if not claims:
        raise ValueError("claims is empty (leave it out to decompose the text)")
    if len(claims) > max_claims:
        raise ValueError(f"{len(claims)} claims given; at most max_claims={max_claims}")
    parts, ids = [], set()
    for k, claim in enumerate(claims, start=1):
        fields = {"text": claim} if isinstance(claim, str) else claim
        if not isinstance(fields, Mapping):
            raise ValueError(f"claim {k} must be a string or an object with a text")
        unknown = set(fields) - {"part_id", "text", "type", *LINK_FIELDS}
        if unknown:
            raise ValueError(f"claim {k} has unknown field(s) {', '.join(sorted(map(str, unknown)))}")
        part = {"part_id": fields.get("part_id", f"P{k}"), "text": fields.get("text"),
                "type": fields.get("type"), **{f: fields.get(f) for f in LINK_FIELDS}}
        if not isinstance(part["text"], str) or not part["text"].split():
            raise ValueError(f"claim {k} needs a non-empty text")
        part["text"] = " ".join(part["text"].split())
        if len(part["text"]) > max_chars:
            raise ValueError(f"claim {k} is {len(part['text'])} characters; at most max_claim_chars={max_chars}")
        if not isinstance(part["part_id"], str) or not part["part_id"]:
            raise ValueError(f"claim {k}: part_id must be a non-empty string")
        for f in ("part_id", "type", *LINK_FIELDS):
            if part[f] is not None and not isinstance(part[f], str):
                raise ValueError(f"claim {k}: {f} must be a string or null")
            if part[f] is not None and len(part[f]) > max_chars:
                raise ValueError(f"claim {k}: {f} is over max_claim_chars={max_chars} characters")
        if part["part_id"] in ids:
            raise ValueError(f"claim {k}: part_id {part['part_id']} repeated")
        ids.add(part["part_id"])
        parts.append(part)
    return parts


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
