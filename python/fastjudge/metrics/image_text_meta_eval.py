"""Image-text benchmark meta-evaluation: the scores benchmarks use to rank image-text metrics
against human judgments, and readers for their files.

* :func:`pairwise_accuracy` / :func:`tie_calibrated_pairwise_accuracy` -- Deutsch, Foster and
  Freitag, "Ties Matter: Meta-Evaluating Modern Metrics with Pairwise Accuracy and Tie
  Calibration", EMNLP 2023 (``acc_eq``): over all pairs of items, the fraction the metric orders
  as the humans do, a pair tied by both counting as correct; tie calibration picks the metric
  tie threshold epsilon that maximizes it. Used as "PAcc" on TIFA160 and GenAI-Bench (VQAScore,
  Lin et al., ECCV 2024); grouping pairs by prompt gives "within-prompt" pairwise accuracy.
* :func:`winoground_scores` -- Thrush et al., "Winoground: Probing Vision and Language Models
  for Visio-Linguistic Compositionality", CVPR 2022, Sec. 3 (text, image and group scores;
  EqBen's group score is the same definition).
* :func:`spearman_by_benchmark` -- Spearman's rho per benchmark (e.g. "SRCC" on
  T2I-CompBench++), via :func:`fastjudge.metrics.stats.spearman`.
* :func:`cohen_kappa` -- Cohen's kappa between two raters (a metric's labels and the humans'),
  unweighted or with linear or quadratic weights, as scikit-learn's ``cohen_kappa_score``
  (e.g. ProtoBias' kappa; quadratic-weighted kappa for ordinal ratings).
* :func:`ts2_rank` / :func:`ts2_sep` -- T2IScoreScore's ordering and separation scores over
  semantic error graphs (defined in :mod:`.error_graphs`).

File layouts (JSONL):

* scored items (:func:`read_scored_items`): ``{"id", "score", "human_score"}`` plus an optional
  group field (``"prompt_id"`` for within-prompt accuracy, ``"benchmark"`` for
  :func:`spearman_by_benchmark`); the field names are parameters.
* Winoground-style items (:func:`read_winoground`): ``{"id", "c0_i0", "c0_i1", "c1_i0",
  "c1_i1"}`` where ``cX_iY`` is the metric's score of caption X with image Y, or
  ``{"id", "scores": [[c0_i0, c0_i1], [c1_i0, c1_i1]]}``.

Malformed rows are returned as ``problems`` naming their line number, not raised.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .error_graphs import ts2_rank, ts2_sep
from .stats import _vector, spearman

__all__ = ["pairwise_accuracy", "tie_calibrated_pairwise_accuracy", "winoground_scores",
           "spearman_by_benchmark", "cohen_kappa", "ts2_rank", "ts2_sep", "ScoredItems",
           "read_scored_items", "WinogroundItems", "read_winoground"]

KAPPA_WEIGHTS = (None, "linear", "quadratic")

_PAIR_BLOCK = 1 << 22  # pairs handled at once


def _group_members(n: int, groups) -> list[np.ndarray]:
    if groups is None:
        return [np.arange(n)]
    if len(groups) != n:
        raise ValueError(f"groups has {len(groups)} entries for {n} items")
    members = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    return [np.array(v) for v in members.values()]


def _pair_blocks(idx: np.ndarray):
    """All pairs (i < j) of ``idx`` in blocks of rows: yields (left, right) index arrays."""
    n = idx.size
    rows = max(1, _PAIR_BLOCK // max(n, 1))
    for r0 in range(0, n - 1, rows):
        r = np.arange(r0, min(n - 1, r0 + rows))
        ii, jj = np.nonzero(np.arange(n)[None, :] > r[:, None])
        yield idx[r[ii]], idx[jj]


def _check(metric, human) -> tuple[np.ndarray, np.ndarray]:
    m, h = _vector(metric, "metric"), _vector(human, "human")
    if m.shape != h.shape:
        raise ValueError(f"metric and human differ in length ({m.size} vs {h.size})")
    return m, h


def pairwise_accuracy(metric, human, groups: Sequence | None = None, tie_epsilon: float = 0.0,
                      average: str = "pairs") -> float:
    """Pairwise accuracy ``acc_eq`` (Deutsch et al., 2023): over all pairs of items (within the
    same group when ``groups`` is given, e.g. the prompt id), a pair is correct when the metric
    and the humans order it the same way or both tie it; the metric ties a pair when its scores
    differ by at most ``tie_epsilon``. ``average="pairs"`` pools all pairs; ``"groups"`` averages
    the per-group accuracies (groups with fewer than 2 items are skipped)."""
    if average not in ("pairs", "groups"):
        raise ValueError("average must be 'pairs' or 'groups'")
    m, h = _check(metric, human)
    correct_total = pairs_total = 0
    per_group = []
    for idx in _group_members(m.size, groups):
        correct = pairs = 0
        for a, b in _pair_blocks(idx):
            dm, dh = m[a] - m[b], h[a] - h[b]
            sm = np.where(np.abs(dm) <= tie_epsilon, 0.0, np.sign(dm))
            correct += int((sm == np.sign(dh)).sum())
            pairs += a.size
        if pairs:
            per_group.append(correct / pairs)
        correct_total += correct
        pairs_total += pairs
    if not pairs_total:
        return math.nan
    return correct_total / pairs_total if average == "pairs" else float(np.mean(per_group))


def tie_calibrated_pairwise_accuracy(metric, human, groups: Sequence | None = None
                                     ) -> tuple[float, float]:
    """``(accuracy, epsilon)``: :func:`pairwise_accuracy` (pooled pairs) at the tie threshold
    that maximizes it (Deutsch et al., 2023, tie calibration); candidates are 0 and every
    absolute metric difference of a pair, and the smallest best threshold is returned. Memory
    is O(number of pairs)."""
    m, h = _check(metric, human)
    gaps, concordant, human_tie = [], [], []
    for idx in _group_members(m.size, groups):
        for a, b in _pair_blocks(idx):
            dm, dh = m[a] - m[b], h[a] - h[b]
            gaps.append(np.abs(dm))
            concordant.append((np.sign(dm) == np.sign(dh)) & (dh != 0))
            human_tie.append(dh == 0)
    if not gaps:
        return math.nan, 0.0
    gap = np.concatenate(gaps)
    conc = np.concatenate(concordant)
    htie = np.concatenate(human_tie)
    order = np.argsort(gap, kind="stable")
    gap, conc, htie = gap[order], conc[order], htie[order]
    # at threshold gap[k] (inclusive), pairs 0..last index with that gap are tied
    last = np.r_[gap[1:] != gap[:-1], True]
    tied_conc = np.cumsum(conc)[last]
    tied_htie = np.cumsum(htie)[last]
    candidates = gap[last]
    correct = conc.sum() - tied_conc + tied_htie
    # epsilon below every gap (only if no pair has gap 0): nothing tied
    base = int(conc.sum()) if candidates[0] > 0 else None
    best = int(np.argmax(correct))
    if base is not None and base >= correct[best]:
        return base / gap.size, 0.0
    return float(correct[best]) / gap.size, float(candidates[best])


def winoground_scores(scores) -> dict[str, float]:
    """Winoground text, image and group scores (Thrush et al., 2022, Sec. 3) from ``scores`` of
    shape (n, 2, 2) where ``scores[k, c, i]`` is the metric's score of caption ``c`` with image
    ``i`` of example ``k``:

    * text: ``s(C0, I0) > s(C1, I0)`` and ``s(C1, I1) > s(C0, I1)`` (the right caption wins for
      each image);
    * image: ``s(C0, I0) > s(C0, I1)`` and ``s(C1, I1) > s(C1, I0)`` (the right image wins for
      each caption);
    * group: both. Ties count as wrong (strict inequalities). Values are fractions in [0, 1].
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 3 or s.shape[1:] != (2, 2):
        raise ValueError(f"scores must have shape (n, 2, 2), got {s.shape}")
    if s.shape[0] == 0:
        return {"text": math.nan, "image": math.nan, "group": math.nan, "n": 0}
    c0i0, c0i1, c1i0, c1i1 = s[:, 0, 0], s[:, 0, 1], s[:, 1, 0], s[:, 1, 1]
    text = (c0i0 > c1i0) & (c1i1 > c0i1)
    image = (c0i0 > c0i1) & (c1i1 > c1i0)
    return {"text": float(text.mean()), "image": float(image.mean()),
            "group": float((text & image).mean()), "n": int(s.shape[0])}


def spearman_by_benchmark(metric, human, benchmarks: Sequence) -> dict[str, dict]:
    """Spearman's rho between metric and human scores separately for every benchmark:
    ``{benchmark: {"n": items, "spearman": rho}}``, benchmarks in sorted order."""
    m, h = _check(metric, human)
    if len(benchmarks) != m.size:
        raise ValueError(f"benchmarks has {len(benchmarks)} entries for {m.size} items")
    members = defaultdict(list)
    for i, b in enumerate(benchmarks):
        members[str(b)].append(i)
    return {b: {"n": len(ix), "spearman": spearman(m[ix], h[ix])}
            for b, ix in sorted(members.items())}


def cohen_kappa(a: Sequence, b: Sequence, weights: str | None = None, labels: Sequence | None = None) -> float:
    """Cohen's kappa between two raters' labels of the same items, as scikit-learn's
    ``cohen_kappa_score``: ``1 - sum(W * O) / sum(W * E)`` with ``O`` the counts of label pairs,
    ``E`` the counts expected from each rater's label frequencies alone, and ``W`` zero on the
    diagonal and one elsewhere (``weights=None``), ``|i - j|`` (``"linear"``) or ``(i - j)**2``
    (``"quadratic"``), where ``i``, ``j`` are positions in ``labels``: weighted kappa treats the
    labels as ordered, evenly spaced categories. ``labels``: the categories in order (default:
    the distinct labels of both raters, sorted); items with a label outside them are left out,
    as scikit-learn does. NaN when undefined (no disagreement is possible by chance, e.g. both
    raters always give one same label)."""
    if weights not in KAPPA_WEIGHTS:
        raise ValueError(f"weights must be one of {KAPPA_WEIGHTS}, got {weights!r}")
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
        raise ValueError(f"a and b must be non-empty label sequences of one length ({a.size} vs {b.size})")
    if labels is None:
        labels = np.unique(np.concatenate([a, b]))
    position = {label: i for i, label in enumerate(np.asarray(labels).tolist())}
    ia = np.array([position.get(v, -1) for v in a.tolist()])
    ib = np.array([position.get(v, -1) for v in b.tolist()])
    both = (ia >= 0) & (ib >= 0)
    k = len(position)
    observed = np.bincount(ia[both] * k + ib[both], minlength=k * k).reshape(k, k).astype(np.float64)
    expected = np.outer(observed.sum(axis=1), observed.sum(axis=0)) / max(observed.sum(), 1.0)
    distance = np.abs(np.subtract.outer(np.arange(k), np.arange(k))).astype(np.float64)
    w = {None: (distance > 0).astype(np.float64), "linear": distance, "quadratic": distance ** 2}[weights]
    chance = float((w * expected).sum())
    return 1.0 - float((w * observed).sum()) / chance if chance > 0 else math.nan


# --- readers ---------------------------------------------------------------------------------
def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class ScoredItems:
    ids: list[str] = field(default_factory=list)
    metric: np.ndarray = None
    human: np.ndarray = None
    groups: list | None = None
    problems: list[str] = field(default_factory=list)


def read_scored_items(path, score_field: str = "score", human_field: str = "human_score",
                      group_field: str | None = None) -> ScoredItems:
    """Rows ``{"id", <score_field>, <human_field>[, <group_field>]}``; rows missing a number (or
    the group field, when asked for) become ``problems`` naming their line."""
    from ..io.jsonl import read_jsonl

    out = ScoredItems(groups=[] if group_field else None)
    metric, human = [], []
    for line in read_jsonl(path):
        if line.error:
            out.problems.append(f"{path}: {line.error}")
            continue
        item = line.item
        bad = [f for f in (score_field, human_field) if not _is_number(item.get(f))]
        if bad:
            out.problems.append(f"{path}: line {line.line_no}: {', '.join(bad)} must be numbers")
            continue
        if group_field and item.get(group_field) is None:
            out.problems.append(f"{path}: line {line.line_no}: missing {group_field}")
            continue
        out.ids.append(line.id)
        metric.append(float(item[score_field]))
        human.append(float(item[human_field]))
        if group_field:
            out.groups.append(str(item[group_field]))
    out.metric, out.human = np.array(metric), np.array(human)
    return out


@dataclass
class WinogroundItems:
    ids: list[str] = field(default_factory=list)
    scores: np.ndarray = None  # (n, 2, 2): [caption, image]
    problems: list[str] = field(default_factory=list)


_WINO_KEYS = ("c0_i0", "c0_i1", "c1_i0", "c1_i1")


def read_winoground(path) -> WinogroundItems:
    """Winoground-style rows (see the module docstring) -> scores of shape (n, 2, 2)."""
    from ..io.jsonl import read_jsonl

    out = WinogroundItems()
    rows = []
    for line in read_jsonl(path):
        if line.error:
            out.problems.append(f"{path}: {line.error}")
            continue
        item = line.item
        if "scores" in item:
            s = item["scores"]
            ok = (isinstance(s, list) and len(s) == 2
                  and all(isinstance(r, list) and len(r) == 2 and all(map(_is_number, r)) for r in s))
            if not ok:
                out.problems.append(f"{path}: line {line.line_no}: scores must be "
                                    f"[[c0_i0, c0_i1], [c1_i0, c1_i1]] numbers")
                continue
            rows.append([[float(v) for v in r] for r in s])
        else:
            missing = [k for k in _WINO_KEYS if not _is_number(item.get(k))]
            if missing:
                out.problems.append(f"{path}: line {line.line_no}: {', '.join(missing)} must be "
                                    f"numbers")
                continue
            rows.append([[float(item["c0_i0"]), float(item["c0_i1"])],
                         [float(item["c1_i0"]), float(item["c1_i1"])]])
        out.ids.append(line.id)
    out.scores = np.array(rows, dtype=np.float64).reshape(-1, 2, 2)
    return out
