"""Comparing two paths' results on the same items: what agrees, by how much the values
differ, and whether that is within tolerance.

A judge's results are read as *outputs* (:class:`Output`), each one kind of thing the judge
reports, keyed per item (or per claim: ``"ID/P2"``):

* ``match`` outputs must be identical (ratings, decisions, which items fail, VisExMEM's
  claims): the count and share identical; a disagreement on a near-tie -- where the
  reference's own probabilities of the two outcomes differ by no more than the probability
  tolerance -- is listed as such and does not fail the check;
* ``value`` outputs are probabilities and scores: the largest and median |difference| (a
  vector, as LAVE's three rating probabilities, counts its largest entry), for scores also
  Spearman's rank correlation of the two paths; where they follow generated text (LAVE's
  rationale, VisExMEM's claims), only on the items whose text is identical on both sides;
* ``text`` outputs (rationales, explanations) are reported as identical counts only: greedy
  text follows the model's near-ties and is judged through the ratings it leads to.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

TOP_DIFFERENCES = 5  # items listed per output


@dataclass(frozen=True)
class Tolerance:
    """``max_abs``: largest |difference| allowed on probabilities and scores (None: reported,
    not checked); ``min_agreement``: share of ``match`` units that must be identical."""

    max_abs: float | None
    min_agreement: float = 1.0
    basis: str = ""


# Defaults per dtype (docs/verification.md says where each figure comes from).
FLOAT32 = Tolerance(1e-4, 1.0, "float32: the test suite's bound (probabilities within 1e-4 of transformers)")
BFLOAT16 = Tolerance(0.05, 1.0, "bfloat16: above the largest difference measured between fastjudge and "
                                "transformers, both in bfloat16, on the tiny checkpoints (docs/verification.md)")
FP8_BUILD = Tolerance(None, 0.98, "FP8 build: rating agreement >= 98 %, the builders' threshold; "
                                  "probabilities reported, not checked")


def default_tolerance(dtype, build: bool = False) -> Tolerance:
    if build:
        return FP8_BUILD
    return FLOAT32 if "float32" in str(dtype) else BFLOAT16


@dataclass(frozen=True)
class Output:
    """One output of a judge: ``units(result)`` -> {key suffix: value} (None values skipped);
    ``margin(reference_result, suffix, a, b)``: how far apart the reference put outcomes ``a``
    and ``b`` of the unit ``suffix`` (``match`` outputs with a probability behind them)."""

    name: str
    kind: str  # "match", "value", "score" (a value with Spearman), "text"
    units: Callable[[Any], dict]
    margin: Callable[[Any, str, Any, Any], float] | None = None
    # compared only on the items where gate(ours, theirs) holds: values that follow generated
    # text (a rationale, VisExMEM's claims) mean the same thing only after the same text
    gate: Callable[[Any, Any], bool] | None = None


def _one(value) -> dict:
    return {"": value}


def _lave_margin(ref, suffix, a, b) -> float:
    if ref.probs is None or a is None or b is None:
        return math.inf
    return abs(ref.probs[a - 1] - ref.probs[b - 1])


def _claim_key(c) -> str:
    return f"/{c.part_id}"


def _same_rationale(a, b) -> bool:
    return a.rationale == b.rationale


def _same_claims(a, b) -> bool:
    return _claim_structure(a) == _claim_structure(b)


def _support_margin(ref, suffix, a, b) -> float:
    """A yes/no decision's margin: |P(yes) - P(no)| of the reference's claim."""
    claim = next((c for c in ref.claims or () if _claim_key(c) == suffix), None)
    return math.inf if claim is None or claim.support is None else abs(2 * claim.support - 1)


def _claim_structure(r) -> tuple:
    return tuple((c.part_id, c.text, c.type, c.parent_part_id, c.head_part_id, c.target_part_id,
                  tuple(c.evidence_ids or ())) for c in (r.claims or ()))


OUTPUTS: dict[str, tuple[Output, ...]] = {
    "lave": (
        Output("error", "match", lambda r: _one(r.error is not None)),
        Output("rating", "match", lambda r: _one(r.rating), _lave_margin),
        Output("probs", "value", lambda r: _one(r.probs), gate=_same_rationale),
        Output("soft_score", "score", lambda r: _one(r.soft_score), gate=_same_rationale),
        Output("rationale", "text", lambda r: _one(r.rationale)),
    ),
    "holistic": (
        Output("error", "match", lambda r: _one(r.error is not None)),
        Output("decision", "match", lambda r: _one(r.decision),
               lambda ref, suffix, a, b: abs(ref.probs[0] - ref.probs[1]) if ref.probs else math.inf),
        Output("probs", "value", lambda r: _one(r.probs or None)),
        Output("score", "score", lambda r: _one(r.score)),
    ),
    "visexmem": (
        Output("error", "match", lambda r: _one(r.error is not None)),
        Output("claims", "match", lambda r: _one(_claim_structure(r) if r.error is None else None)),
        Output("decision", "match", lambda r: {_claim_key(c): c.decision for c in r.claims or ()},
               _support_margin, gate=_same_claims),
        Output("support", "value", lambda r: {_claim_key(c): c.support for c in r.claims or ()}, gate=_same_claims),
        Output("score", "score", lambda r: _one(r.score)),
        Output("explanation", "text", lambda r: {**_one(r.explanation),
                                                 **{_claim_key(c): c.explanation for c in r.claims or ()}},
               gate=_same_claims),
    ),
}


def _gap(a, b) -> float:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return math.inf
        return max((abs(float(x) - float(y)) for x, y in zip(a, b)), default=0.0)
    return abs(float(a) - float(b))


def spearman(xs, ys) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None with fewer than two pairs or
    a constant side."""
    if len(xs) < 2:
        return None
    from ..metrics.stats import spearman as rho_of

    rho = rho_of(xs, ys)
    return None if rho is None or math.isnan(rho) else float(rho)


def _short(value, width: int = 60):
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return [round(float(v), 6) for v in value]
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= width else text[: width - 1] + "…"


@dataclass
class OutputReport:
    name: str
    kind: str
    units: int = 0  # compared on both sides
    identical: int = 0
    near_ties: int = 0
    max_abs: float | None = None
    median_abs: float | None = None
    spearman: float | None = None
    passed: bool = True
    worst: list = field(default_factory=list)  # [{"id", "fastjudge", "reference", "diff"}]


def compare_output(output: Output, ids, ours, theirs, tolerance: Tolerance) -> OutputReport:
    """One output of the two paths' results (``ours``, ``theirs``: aligned with ``ids``)."""
    rep = OutputReport(output.name, output.kind)
    rows = []  # (key, ours, theirs, reference result)
    for ident, a, b in zip(ids, ours, theirs):
        if output.gate is not None and not output.gate(a, b):
            continue  # different generated text: its own output lists the item
        ua, ub = output.units(a), output.units(b)
        for suffix in dict.fromkeys([*ua, *ub]):
            x, y = ua.get(suffix), ub.get(suffix)
            if x is None and y is None:
                continue
            if output.kind in ("value", "score") and (x is None or y is None):
                continue  # a value one side lacks: its item's disagreement shows in a match output
            rows.append((f"{ident}{suffix}", x, y, b, suffix))
    rep.units = len(rows)
    if output.kind in ("match", "text"):
        differing = []
        for key, x, y, ref, suffix in rows:
            if x == y:
                rep.identical += 1
                continue
            tie = output.margin is not None and tolerance.max_abs is not None and \
                output.margin(ref, suffix, x, y) <= tolerance.max_abs
            rep.near_ties += tie
            differing.append({"id": key, "fastjudge": _short(x), "reference": _short(y),
                              **({"near_tie": True} if tie else {})})
        rep.worst = differing[:TOP_DIFFERENCES]
        if output.kind == "match" and rows:
            agree = (rep.identical + rep.near_ties) / len(rows)
            rep.passed = agree >= tolerance.min_agreement - 1e-12
        return rep
    gaps = sorted(((_gap(x, y), key, x, y) for key, x, y, _, _ in rows), key=lambda g: -g[0])
    if gaps:
        rep.max_abs = gaps[0][0]
        rep.median_abs = statistics.median(g[0] for g in gaps)
        rep.identical = sum(g[0] == 0 for g in gaps)
        rep.worst = [{"id": key, "fastjudge": _short(x), "reference": _short(y), "diff": d}
                     for d, key, x, y in gaps[:TOP_DIFFERENCES] if d > 0]
        if tolerance.max_abs is not None:
            rep.passed = rep.max_abs <= tolerance.max_abs
    if output.kind == "score":
        rep.spearman = spearman([float(r[1]) for r in rows], [float(r[2]) for r in rows])
    return rep


def compare(judge: str, ids, ours, theirs, tolerance: Tolerance) -> list[OutputReport]:
    return [compare_output(o, ids, ours, theirs, tolerance) for o in OUTPUTS[judge]]


def as_dict(reports: list[OutputReport]) -> list[dict]:
    return [asdict(r) for r in reports]
