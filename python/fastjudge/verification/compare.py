"""Comparing two paths' results on the same items: what agrees, by how much the values
differ, and whether that is within tolerance.

A judge's results are read as *outputs* (:class:`Output`), each one kind of thing the judge
reports, keyed per item (or per claim: ``"ID/P2"``):

* ``match`` outputs must be identical (ratings, decisions, which items fail): the count and
  share identical; a disagreement on a near-tie -- where the reference's own probabilities of
  the two outcomes differ by no more than the probability tolerance -- is listed as such and
  does not fail the check;
* ``value`` outputs are probabilities and scores: the largest and median |difference| (a
  vector, as LAVE's three rating probabilities, counts its largest entry), for scores also
  Spearman's rank correlation of the two paths; where they follow generated text (LAVE's
  rationale, VisExMEM's claims and evidence), only where that text is identical on both sides;
* ``generated`` outputs are what greedy decoding wrote and the judge reads on (VisExMEM's
  decomposition and evidence selection): the identical count, and for each differing item
  where the two first diverge; the share identical must reach ``Tolerance.generated``
  (None: reported, not checked -- bfloat16, where greedy text follows the rounding's
  near-ties);
* ``text`` outputs (rationales, explanations) are reported as identical counts and first
  divergences only: greedy text follows the model's near-ties and is judged through the
  ratings it leads to.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

TOP_DIFFERENCES = 5  # items listed per output


@dataclass(frozen=True)
class Tolerance:
    """``max_abs``: largest |difference| allowed on probabilities and scores (None: reported,
    not checked); ``min_agreement``: share of ``match`` units that must be identical;
    ``generated``: share of ``generated`` units (generated claims, evidence) that must be
    identical (None: reported with their first divergence, not checked)."""

    max_abs: float | None
    min_agreement: float = 1.0
    basis: str = ""
    generated: float | None = 1.0


# Defaults per dtype (docs/verification.md says where each figure comes from).
FLOAT32 = Tolerance(1e-4, 1.0, "float32: the test suite's bound (probabilities within 1e-4 of transformers)")
BFLOAT16 = Tolerance(0.05, 1.0, "bfloat16: above the largest difference measured between fastjudge and "
                                "transformers, both in bfloat16, on the tiny checkpoints (docs/verification.md); "
                                "generated stages reported with their first divergence, not checked",
                     generated=None)
FP8_BUILD = Tolerance(None, 0.98, "FP8 build: rating agreement >= 98 %, the builders' threshold; "
                                  "probabilities and generated stages reported, not checked", generated=None)


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
    kind: str  # "match", "value", "score" (a value with Spearman), "generated", "text"
    units: Callable[[Any], dict]
    margin: Callable[[Any, str, Any, Any], float] | None = None
    # compared only on the items where gate(ours, theirs) holds: values that follow generated
    # text (a rationale, VisExMEM's claims) mean the same thing only after the same text
    gate: Callable[[Any, Any], bool] | None = None
    # and only on the units where same(ours, theirs, suffix) holds: a claim's decision follows
    # that claim's own text and evidence, not the other claims'
    same: Callable[[Any, Any, str], bool] | None = None


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


def _same_parts(a, b) -> bool:
    return _decomposition(a) == _decomposition(b)


def _claim_input(r, suffix) -> tuple | None:
    """What one claim's verification prompt holds besides the image and caption: its text and
    its selected evidence (the crops follow from the boxes)."""
    c = next((c for c in r.claims or () if _claim_key(c) == suffix), None)
    return None if c is None else (c.text, tuple(c.evidence_ids or ()), tuple(map(tuple, c.evidence_boxes or ())))


def _same_claim_input(a, b, suffix) -> bool:
    return _claim_input(a, suffix) == _claim_input(b, suffix)


def _support_margin(ref, suffix, a, b) -> float:
    """A yes/no decision's margin: |P(yes) - P(no)| of the reference's claim."""
    claim = next((c for c in ref.claims or () if _claim_key(c) == suffix), None)
    return math.inf if claim is None or claim.support is None else abs(2 * claim.support - 1)


CLAIM_FIELDS = ("part_id", "text", "type", "parent_part_id", "head_part_id", "target_part_id")


def _claim_structure(r) -> tuple:
    return tuple(tuple(getattr(c, f) for f in CLAIM_FIELDS) + (tuple(c.evidence_ids or ()),)
                 for c in (r.claims or ()))


def _decomposition(r) -> tuple | None:
    """The generated parts of a result (ids, texts, types, links), None for an item error."""
    if r.error is not None:
        return None
    return tuple(tuple(getattr(c, f) for f in CLAIM_FIELDS) for c in (r.claims or ()))


def _evidence(r) -> dict:
    return {_claim_key(c): tuple(c.evidence_ids or ()) for c in (r.claims or ())} if r.error is None else {}


def first_divergence(a, b) -> str:
    """Where two generated values first differ, in words: the claim and field of two claim
    structures (tuples of tuples), the character offset of two texts, else both values."""
    if isinstance(a, str) and isinstance(b, str):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        start = max(0, k - 12)
        return (f"char {k}: fastjudge {a[start:k + 12]!r}, reference {b[start:k + 12]!r}"
                + (" (one ends there)" if k == min(len(a), len(b)) else ""))
    if isinstance(a, tuple) and isinstance(b, tuple) and all(isinstance(x, tuple) for x in a + b):
        for n, (x, y) in enumerate(zip(a, b), start=1):
            if x != y:
                for f, (u, v) in enumerate(zip(x, y)):
                    if u != v:
                        name = CLAIM_FIELDS[f] if f < len(CLAIM_FIELDS) else "evidence_ids"
                        where = first_divergence(u, v) if name == "text" and isinstance(u, str) and \
                            isinstance(v, str) else f"fastjudge {_short(u)!r}, reference {_short(v)!r}"
                        return f"claim {n} {name}: {where}"
                return f"claim {n}: fastjudge {_short(x)!r}, reference {_short(y)!r}"
        return f"claim count: fastjudge {len(a)}, reference {len(b)}"
    if isinstance(a, tuple) and isinstance(b, tuple):  # evidence ids
        return f"fastjudge {list(a)}, reference {list(b)}"
    return f"fastjudge {_short(a)!r}, reference {_short(b)!r}"


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
        # the generated stages: the decomposition, then each claim's evidence selection
        Output("claims", "generated", lambda r: _one(_decomposition(r))),
        Output("evidence", "generated", _evidence, gate=_same_parts),
        # a claim's decision and support wherever its text and evidence agree
        Output("decision", "match", lambda r: {_claim_key(c): c.decision for c in r.claims or ()},
               _support_margin, same=_same_claim_input),
        Output("support", "value", lambda r: {_claim_key(c): c.support for c in r.claims or ()},
               same=_same_claim_input),
        Output("score", "score", lambda r: _one(r.score), gate=_same_claims),
        Output("explanation", "text", lambda r: {**_one(r.explanation),
                                                 **{_claim_key(c): c.explanation for c in r.claims or ()}},
               gate=_same_claims),
    ),
}


# "single-response" writes the decisions themselves in one generated response: a claim's decision
# there follows everything written before it, so it is compared only where all claims agree
SINGLE_RESPONSE = tuple(replace(o, gate=_same_claims, same=None) if o.name in ("decision", "support") else o
                        for o in OUTPUTS["visexmem"])


def outputs_for(judge: str, mode: str | None = None) -> tuple[Output, ...]:
    return SINGLE_RESPONSE if judge == "visexmem" and mode == "single-response" else OUTPUTS[judge]


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
    skipped: int = 0  # units left out: what they follow (a claim's text, evidence) differs
    checked: bool = True  # False: reported only (texts; generated stages without a tolerance)
    max_abs: float | None = None
    median_abs: float | None = None
    spearman: float | None = None
    passed: bool = True
    worst: list = field(default_factory=list)  # [{"id", "fastjudge", "reference", "diff"}]


def compare_output(output: Output, ids, ours, theirs, tolerance: Tolerance) -> OutputReport:
    """One output of the two paths' results (``ours``, ``theirs``: aligned with ``ids``)."""
    rep = OutputReport(output.name, output.kind)
    rep.checked = output.kind != "text" and not (output.kind == "generated" and tolerance.generated is None) \
        and not (output.kind in ("value", "score") and tolerance.max_abs is None)
    rows = []  # (key, ours, theirs, reference result)
    for ident, a, b in zip(ids, ours, theirs):
        if output.gate is not None and not output.gate(a, b):
            continue  # different generated text: its own output lists the item
        ua, ub = output.units(a), output.units(b)
        for suffix in dict.fromkeys([*ua, *ub]):
            x, y = ua.get(suffix), ub.get(suffix)
            if x is None and y is None:
                continue
            if output.same is not None and not output.same(a, b, suffix):
                rep.skipped += 1  # its text or evidence differ: the generated outputs list it
                continue
            if output.kind in ("value", "score") and (x is None or y is None):
                continue  # a value one side lacks: its item's disagreement shows in a match output
            rows.append((f"{ident}{suffix}", x, y, b, suffix))
    rep.units = len(rows)
    if output.kind in ("match", "generated", "text"):
        differing = []
        for key, x, y, ref, suffix in rows:
            if x == y:
                rep.identical += 1
                continue
            tie = output.margin is not None and tolerance.max_abs is not None and \
                output.margin(ref, suffix, x, y) <= tolerance.max_abs
            rep.near_ties += tie
            seen = {"first_divergence": first_divergence(x, y)} if output.kind != "match" else \
                {"fastjudge": _short(x), "reference": _short(y)}
            differing.append({"id": key, **seen, **({"near_tie": True} if tie else {})})
        rep.worst = differing[:TOP_DIFFERENCES]
        need = tolerance.min_agreement if output.kind == "match" else \
            tolerance.generated if output.kind == "generated" else None
        if need is not None and rows:
            agree = (rep.identical + rep.near_ties) / len(rows)
            rep.passed = agree >= need - 1e-12
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


def compare(judge: str, ids, ours, theirs, tolerance: Tolerance, mode: str | None = None) -> list[OutputReport]:
    return [compare_output(o, ids, ours, theirs, tolerance) for o in outputs_for(judge, mode)]


def as_dict(reports: list[OutputReport]) -> list[dict]:
    return [asdict(r) for r in reports]
