"""T2IScoreScore's meta-metrics over semantic error graphs (Saxon et al., "Who Evaluates the
Evaluations? Objectively Scoring Text-to-Image Prompt Coherence Metrics with T2IScoreScore",
NeurIPS 2024 Datasets and Benchmarks): how well a metric orders (``rank``) and separates
(``sep``) images of one prompt by their number of semantic errors. Computed as the benchmark's
own evaluators do.

A semantic error graph (SEG) is one prompt's images, each in a node; a node id carries the
error count of its images in its digits (``"0"``, ``"1a"``, ``"1b"``, ``"2"``), several images
per node.

* :func:`ts2_rank`: in each SEG, every walk that takes one node per error count, from a node
  with no error up through every error count present; per walk, minus Spearman's rho between
  the error counts and the metric's scores of the walk's images (0 when either is constant); per
  SEG, the walks' mean weighted by their number of images (``weighted=False``: plain mean). A
  SEG without an error-free node has no walk and no value.
* :func:`ts2_sep`: in each SEG, the two-sample Kolmogorov-Smirnov statistic between the scores
  of every pair of nodes whose error counts differ, averaged over the pairs (0 for a SEG with
  one error count).

Both average the SEGs that have a value. A missing score (NaN) leaves its image out of a walk
and the pairs of its node out of ``sep`` (where the benchmark's statistic is NaN as well).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Sequence

import numpy as np

from .stats import spearman

__all__ = ["ts2_rank", "ts2_sep"]


def _error_count(node) -> int:
    digits = "".join(ch for ch in str(node) if ch.isdigit())
    if not digits:
        raise ValueError(f"node id {node!r} has no error count (no digits)")
    return int(digits)


def _graphs(metric, nodes: Sequence, graphs: Sequence | None) -> list[dict[object, np.ndarray]]:
    """Per SEG: the scores of each node."""
    m = np.asarray(metric, dtype=np.float64)
    if m.ndim != 1 or len(nodes) != m.size or (graphs is not None and len(graphs) != m.size):
        raise ValueError(f"metric, nodes and graphs must be equally long one-dimensional sequences "
                         f"({m.size} scores, {len(nodes)} nodes"
                         + (f", {len(graphs)} graph ids)" if graphs is not None else ")"))
    if np.isinf(m).any():
        raise ValueError("metric contains infinite values")
    by_graph: dict[object, dict[object, list[float]]] = defaultdict(lambda: defaultdict(list))
    for i, node in enumerate(nodes):
        by_graph[None if graphs is None else graphs[i]][node].append(m[i])
    return [{node: np.array(v) for node, v in seg.items()} for seg in by_graph.values()]


def _mean_defined(values: list[float]) -> float:
    defined = [v for v in values if not math.isnan(v)]
    return float(np.mean(defined)) if defined else math.nan


def _seg_rank(seg: dict[object, np.ndarray], weighted: bool) -> float:
    levels: dict[int, list] = defaultdict(list)
    for node in seg:
        levels[_error_count(node)].append(node)
    if 0 not in levels:
        return math.nan
    values, weights = [], []
    for walk in itertools.product(*(levels[k] for k in sorted(levels))):
        counts = np.concatenate([np.full(seg[n].size, _error_count(n)) for n in walk])
        scores = np.concatenate([seg[n] for n in walk])
        kept = ~np.isnan(scores)
        if kept.sum() <= 1:
            continue
        rho = spearman(counts[kept], scores[kept])
        values.append(0.0 if math.isnan(rho) else -rho)
        weights.append(int(kept.sum()))
    if not values:
        return math.nan
    return float(np.average(values, weights=weights if weighted else None))


def _ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical
    distribution functions."""
    a, b = np.sort(a), np.sort(b)
    at = np.concatenate([a, b])
    gap = np.searchsorted(a, at, side="right") / a.size - np.searchsorted(b, at, side="right") / b.size
    return float(np.abs(gap).max())


def _seg_sep(seg: dict[object, np.ndarray]) -> float:
    nodes = sorted(seg, key=_error_count)
    stats = [_ks_statistic(seg[x], seg[y]) for x, y in itertools.combinations(nodes, 2)
             if _error_count(x) != _error_count(y) and not (np.isnan(seg[x]).any() or np.isnan(seg[y]).any())]
    return float(np.mean(stats)) if stats else 0.0


def ts2_rank(metric, nodes: Sequence, graphs: Sequence | None = None, weighted: bool = True) -> float:
    """T2IScoreScore's ordering score (see the module docstring), averaged over the SEGs:
    ``metric[i]`` is the score of image ``i``, ``nodes[i]`` its node id, ``graphs[i]`` its SEG
    (None: one SEG). Higher is better; 1 when every walk orders its images exactly as their
    error counts, fewer errors scoring higher. NaN when no SEG has a walk."""
    return _mean_defined([_seg_rank(seg, weighted) for seg in _graphs(metric, nodes, graphs)])


def ts2_sep(metric, nodes: Sequence, graphs: Sequence | None = None) -> float:
    """T2IScoreScore's separation score (see the module docstring), averaged over the SEGs;
    arguments as :func:`ts2_rank`. In [0, 1], higher is better."""
    return _mean_defined([_seg_sep(seg) for seg in _graphs(metric, nodes, graphs)])
