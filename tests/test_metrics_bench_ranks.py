"""T2IScoreScore's rank/sep meta-metrics and Cohen's kappa in ``fastjudge.metrics.image_text_meta_eval``,
against the upstream definitions.

* rank/sep: the T2IScoreScore repository (michaelsaxon/T2IScoreScore),
  ``src/T2IScoreScore/evaluators/base.py`` (``WalkMetricEvaluator.get_walks`` and
  ``process_graph``: one node per error count from an error-free node, per-walk statistic, walks
  weighted by their scores; ``NodePairMetricEvaluator.evaluate_node_pairs``: node pairs with
  different error counts, NaN statistics skipped, 0 without pairs), ``evaluators/spearman.py``
  (``SpearmanEvaluator.evaluate_walk``: scipy's Spearman rho, 0 when undefined),
  ``evaluators/ks_test.py`` (``KSTestEvaluator.evaluate_node_pair``: scipy's ``ks_2samp``
  statistic) and ``run/compute_metrics.py`` (``compute_metrics``: the rank evaluator with
  ``scaled_avg=True, invert_scores=True``, SEG values averaged by pandas' NaN-skipping mean).
  The reference below restates that procedure on scipy; the known values are the upstream
  test's (``tests/test_evaluators.py``, ``test_dataframe_api``).
* kappa: scikit-learn's ``cohen_kappa_score`` (``sklearn/metrics/_classification.py``), its
  arithmetic transcribed below (confusion matrix, expected = outer product of the marginals
  over the total, weight matrix from label positions, ``1 - sum(w * O) / sum(w * E)``), its
  known values from ``sklearn/metrics/tests/test_classification.py`` (``test_cohen_kappa``),
  and scikit-learn itself (a test dependency).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict

import numpy as np
import pytest

from fastjudge.metrics.image_text_meta_eval import cohen_kappa, ts2_rank, ts2_sep

scipy_stats = pytest.importorskip("scipy.stats")


# -- T2IScoreScore --------------------------------------------------------------------------------
def _errors(node: str) -> int:
    return int("".join(c for c in node if c.isdigit()))


def reference_rank(nodes, scores, weighted=True) -> float:
    """One SEG's ordering score, restated from the upstream evaluators on scipy."""
    by_node = defaultdict(list)
    for n, s in zip(nodes, scores):
        by_node[n].append(s)
    levels = defaultdict(list)
    for n in dict.fromkeys(nodes):
        levels[_errors(n)].append(n)
    walks = [[n] for n in levels.get(0, [])]
    for level in range(1, max(levels) + 1):
        if level in levels:
            walks = [w + [n] for w in walks for n in levels[level]]
    values, counts = [], []
    for walk in walks:
        pairs = [(_errors(n), s) for n in walk for s in by_node[n] if not math.isnan(s)]
        if len(pairs) <= 1:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy warns on constant input (rho is NaN)
            rho = scipy_stats.spearmanr([x for x, _ in pairs], [y for _, y in pairs])[0]
        values.append(-(0.0 if math.isnan(rho) else rho))
        counts.append(len(pairs))
    if not values:
        return math.nan
    return sum(v * c for v, c in zip(values, counts)) / sum(counts) if weighted else sum(values) / len(values)


def reference_sep(nodes, scores) -> float:
    """One SEG's separation score, restated from the upstream evaluators on scipy."""
    by_node = defaultdict(list)
    for n, s in zip(nodes, scores):
        by_node[n].append(s)
    ordered = sorted(by_node, key=_errors)
    stats = []
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if _errors(a) != _errors(b):
                d = scipy_stats.ks_2samp(by_node[a], by_node[b])[0]
                if not math.isnan(d):
                    stats.append(d)
    return sum(stats) / len(stats) if stats else 0.0


def reference_mean(per_graph) -> float:
    defined = [v for v in per_graph if not math.isnan(v)]
    return float(np.mean(defined)) if defined else math.nan


# The upstream test's example: one SEG of 12 images (blip1 with DSG questions, from the paper).
EXAMPLE_NODES = ["0", "1a", "1a", "1a", "1a", "1a", "2", "2", "2", "1b", "1b", "1b"]
EXAMPLE_SCORES = [1, 0.6, 0.8, 0.6, 0.6, 0.6, 0.2, 0.2, 0.6, 0.8, 1, 0.8]


def test_ts2_upstream_example():
    assert ts2_sep(EXAMPLE_SCORES, EXAMPLE_NODES) == pytest.approx(0.8667, abs=1e-3)
    assert ts2_rank(EXAMPLE_SCORES, EXAMPLE_NODES) == pytest.approx(0.8606, abs=1e-3)
    assert ts2_rank(EXAMPLE_SCORES, EXAMPLE_NODES, weighted=False) == pytest.approx(0.8663, abs=1e-3)
    nodes, scores = EXAMPLE_NODES, EXAMPLE_SCORES
    assert ts2_rank(scores, nodes) == pytest.approx(reference_rank(nodes, scores), abs=1e-12)
    assert ts2_sep(scores, nodes) == pytest.approx(reference_sep(nodes, scores), abs=1e-12)


def _random_seg(rng, graph: int):
    """A random SEG: up to 4 error counts, up to 3 nodes each, 1-4 images per node, some ties,
    some missing scores; now and then no error-free node, or a single error count."""
    start = 1 if rng.random() < 0.15 else 0
    top = start + int(rng.integers(0, 4))
    nodes = []
    for level in range(start, top + 1):
        for letter in "abc"[: int(rng.integers(1, 4))]:
            nodes += [f"{level}{letter}"] * int(rng.integers(1, 5))
    scores = np.round(rng.random(len(nodes)), 1)  # ties
    scores[rng.random(len(nodes)) < 0.08] = np.nan
    if rng.random() < 0.1:
        scores[:] = 0.5  # a constant metric
    return nodes, scores.tolist(), [graph] * len(nodes)


def test_ts2_equals_the_upstream_procedure_on_scipy():
    rng = np.random.default_rng(3)
    segs = [_random_seg(rng, g) for g in range(60)]
    nodes = [n for seg in segs for n in seg[0]]
    scores = [s for seg in segs for s in seg[1]]
    graphs = [g for seg in segs for g in seg[2]]
    for weighted in (True, False):
        want = reference_mean([reference_rank(n, s, weighted) for n, s, _ in segs])
        assert ts2_rank(scores, nodes, graphs, weighted=weighted) == pytest.approx(want, abs=1e-12)
    want = reference_mean([reference_sep(n, s) for n, s, _ in segs])
    assert ts2_sep(scores, nodes, graphs) == pytest.approx(want, abs=1e-12)
    for n, s, _ in segs[:20]:  # SEG by SEG, NaN where the SEG has no walk
        np.testing.assert_allclose(ts2_rank(s, n), reference_rank(n, s), atol=1e-12)
        assert ts2_sep(s, n) == pytest.approx(reference_sep(n, s), abs=1e-12)


def test_ts2_edges():
    assert ts2_rank([0.9, 0.5, 0.1], ["0", "1", "2"]) == pytest.approx(1.0)  # fewer errors, higher scores
    assert ts2_sep([0.9, 0.5, 0.1], ["0", "1", "2"]) == pytest.approx(1.0)
    assert math.isnan(ts2_rank([0.3, 0.2], ["1a", "2a"]))  # no error-free node: no walk
    assert ts2_sep([0.3, 0.2], ["1a", "1b"]) == 0.0  # one error count: no pair
    with pytest.raises(ValueError, match="no error count"):
        ts2_rank([0.1], ["root"])
    with pytest.raises(ValueError, match="equally long"):
        ts2_sep([0.1, 0.2], ["0"])


# -- Cohen's kappa ------------------------------------------------------------------------------
def transcribed_kappa(y1, y2, labels=None, weights=None) -> float:
    """scikit-learn's cohen_kappa_score arithmetic, without sample weights."""
    labels = sorted(set(y1) | set(y2)) if labels is None else list(labels)
    index = {label: i for i, label in enumerate(labels)}
    k = len(labels)
    confusion = np.zeros((k, k), dtype=np.int64)
    for a, b in zip(y1, y2):
        if a in index and b in index:
            confusion[index[a], index[b]] += 1
    sum0, sum1 = confusion.sum(axis=0), confusion.sum(axis=1)
    expected = np.outer(sum0, sum1) / np.sum(sum0)
    if weights is None:
        w_mat = np.ones((k, k), dtype=int)
        w_mat.flat[:: k + 1] = 0
    else:
        w_mat = np.zeros((k, k), dtype=int) + np.arange(k)
        w_mat = np.abs(w_mat - w_mat.T) if weights == "linear" else (w_mat - w_mat.T) ** 2
    return float(1 - np.sum(w_mat * confusion) / np.sum(w_mat * expected))


def test_kappa_known_values():
    y1 = [0] * 40 + [1] * 60
    y2 = [0] * 20 + [1] * 20 + [0] * 10 + [1] * 50
    kappa = cohen_kappa(y1, y2)
    assert kappa == pytest.approx(0.348, abs=5e-4) and kappa == cohen_kappa(y2, y1)
    assert cohen_kappa(y1 + [2] * 4, y2 + [2] * 4, labels=[0, 1]) == kappa  # items outside labels left out
    assert cohen_kappa(y1, y1) == pytest.approx(1.0)
    y1 = [0] * 46 + [1] * 44 + [2] * 10
    assert cohen_kappa(y1, [0] * 52 + [1] * 32 + [2] * 16) == pytest.approx(0.8013, abs=5e-5)
    y2 = [0] * 50 + [1] * 40 + [2] * 10
    assert cohen_kappa(y1, y2) == pytest.approx(0.9315, abs=5e-5)
    assert cohen_kappa(y1, y2, weights="linear") == pytest.approx(0.9412, abs=5e-5)
    assert cohen_kappa(y1, y2, weights="quadratic") == pytest.approx(0.9541, abs=5e-5)


@pytest.mark.parametrize("weights", [None, "linear", "quadratic"])
def test_kappa_equals_scikit_learn(weights):
    from sklearn.metrics import cohen_kappa_score  # the test extra installs scikit-learn
    rng = np.random.default_rng(7)
    for trial in range(40):
        n, k = int(rng.integers(2, 60)), int(rng.integers(2, 6))
        a = rng.integers(0, k, n).tolist()
        b = [x if rng.random() < 0.6 else int(rng.integers(0, k)) for x in a]
        labels = list(range(k + 1)) if trial % 4 == 0 else None  # a category nobody used
        want = transcribed_kappa(a, b, labels, weights)
        got = cohen_kappa(a, b, weights=weights, labels=labels)
        assert got == pytest.approx(want, abs=1e-12) or (math.isnan(got) and math.isnan(want))
        if not math.isnan(want):
            assert got == pytest.approx(cohen_kappa_score(a, b, labels=labels, weights=weights), abs=1e-12)
    names = ["yes", "no", "no", "yes", "unsure"]
    want = transcribed_kappa(names, names[::-1], None, weights)
    assert cohen_kappa(names, names[::-1], weights) == pytest.approx(want)


def test_kappa_undefined_and_bad_input():
    assert math.isnan(cohen_kappa([1, 1, 1], [1, 1, 1]))  # one label for both: no chance disagreement
    with pytest.raises(ValueError, match="weights"):
        cohen_kappa([1, 2], [1, 2], weights="cubic")
    with pytest.raises(ValueError, match="one length"):
        cohen_kappa([1, 2], [1])
