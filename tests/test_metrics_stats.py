"""Correlations vs scipy (ties included), vectorized bootstrap vs per-resample computation,
determinism by seed, the LAVE significance test, Krippendorff's alpha on hand-computed and
published cases, LAVE's human score, and the benchmark scores (pairwise accuracy, Winoground)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from fastjudge.metrics import image_text_meta_eval as bench
from fastjudge.metrics import significance, stats
from fastjudge.metrics.human_ratings import human_score, krippendorff_alpha
from fastjudge.metrics.significance import compare_correlations
from fastjudge.metrics.stats import bootstrap_ci, bootstrap_replicates, kendall, spearman

TOL = 1e-12


def close_or_both_nan(a, b, tol=TOL):
    if math.isnan(b):
        return math.isnan(a)
    return abs(a - b) <= tol


# --- correlations ------------------------------------------------------------------------------
tied = st.lists(st.integers(0, 4).map(float), min_size=2, max_size=60)
untied_pairs = st.integers(2, 80).flatmap(lambda n: st.tuples(
    st.permutations(list(range(n))), st.permutations(list(range(n)))))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_correlations_match_scipy_with_ties(data):
    x = data.draw(tied)
    y = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=len(x), max_size=len(x)))
    with _quiet():
        rho = scipy.stats.spearmanr(x, y).statistic
        tau = scipy.stats.kendalltau(x, y).statistic
    assert close_or_both_nan(spearman(x, y), rho)
    assert close_or_both_nan(kendall(x, y), tau)


@settings(max_examples=100, deadline=None)
@given(untied_pairs)
def test_correlations_match_scipy_untied(pair):
    x, y = np.array(pair[0], float), np.array(pair[1], float)
    assert abs(spearman(x, y) - scipy.stats.spearmanr(x, y).statistic) <= TOL
    assert abs(kendall(x, y) - scipy.stats.kendalltau(x, y).statistic) <= TOL


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=3, max_size=200))
def test_kendall_continuous_vs_scipy(x):
    rng = np.random.default_rng(len(x))
    x = np.array(x)
    y = x + rng.normal(scale=np.std(x) + 1.0, size=x.size)
    with _quiet():
        rho, tau = scipy.stats.spearmanr(x, y).statistic, scipy.stats.kendalltau(x, y).statistic
    assert close_or_both_nan(spearman(x, y), rho)
    assert close_or_both_nan(kendall(x, y), tau)


def test_larger_inputs_vs_scipy():
    rng = np.random.default_rng(1)
    for n in (1000, 5003):
        h = rng.choice([0.0, 0.5, 1.0], n)
        m = np.round(h + rng.normal(scale=0.7, size=n), 1)
        assert abs(spearman(m, h) - scipy.stats.spearmanr(m, h).statistic) <= TOL
        assert abs(kendall(m, h) - scipy.stats.kendalltau(m, h).statistic) <= TOL
        c = rng.normal(size=n)
        assert abs(kendall(c, m) - scipy.stats.kendalltau(c, m).statistic) <= TOL


def test_constant_and_invalid_inputs():
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert math.isnan(kendall([1, 2, 3], [2, 2, 2]))
    assert math.isnan(spearman([1], [2]))
    assert spearman([1, 2, 3], [1, 2, 3]) == 1.0
    assert kendall([1, 2, 3], [3, 2, 1]) == -1.0
    with pytest.raises(ValueError, match="length"):
        spearman([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="NaN"):
        kendall([1, float("nan")], [1, 2])


def test_rankdata_matches_scipy():
    a = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    assert np.array_equal(stats.rankdata(a), scipy.stats.rankdata(a))


# --- bootstrap ---------------------------------------------------------------------------------
def _data(n, seed=0, continuous=False):
    rng = np.random.default_rng(seed)
    h = rng.choice([0.0, 0.5, 1.0], n)
    m = rng.normal(size=n) + h if continuous else np.round(h + rng.normal(scale=0.5, size=n), 1)
    return m, h


@pytest.mark.parametrize("continuous", [False, True])
def test_bootstrap_equals_per_resample_correlations(continuous):
    n, boot = 257, 60
    m, h = _data(n, 3, continuous)
    m2 = -m + np.random.default_rng(9).normal(size=n)
    reps = bootstrap_replicates(np.stack([m, m2]), h, ("spearman", "kendall"), boot, seed=7)
    idx = np.concatenate(list(stats.resample_indices(n, boot, 7)))
    assert idx.shape == (boot, n)
    for j, metric in enumerate((m, m2)):
        for r in range(boot):
            x, y = metric[idx[r]], h[idx[r]]
            assert abs(reps["spearman"][j, r] - scipy.stats.spearmanr(x, y).statistic) <= TOL
            assert abs(reps["kendall"][j, r] - scipy.stats.kendalltau(x, y).statistic) <= TOL


def test_bootstrap_kendall_fallback_path(monkeypatch):
    """Both variables nearly continuous: one tau per resample; same values as the table path."""
    m, h = _data(120, 4, continuous=True)
    h = h + np.random.default_rng(5).normal(scale=0.01, size=h.size)
    table = bootstrap_replicates(m, h, ("kendall",), 30, seed=2)["kendall"]
    monkeypatch.setattr(stats, "_KENDALL_TABLE_CELLS", 1)
    loop = bootstrap_replicates(m, h, ("kendall",), 30, seed=2)["kendall"]
    assert np.allclose(table, loop, atol=TOL, rtol=0)


def test_bootstrap_kendall_int64_tables(monkeypatch):
    m, h = _data(150, 6)
    small = bootstrap_replicates(m, h, ("kendall",), 40, seed=5)["kendall"]
    monkeypatch.setattr(stats, "_INT32_MAX_N", 0)
    assert np.array_equal(bootstrap_replicates(m, h, ("kendall",), 40, seed=5)["kendall"], small)


def test_bootstrap_many_human_groups():
    """More than a few distinct human values (e.g. averaged ratings) take the general paths."""
    rng = np.random.default_rng(11)
    h = rng.integers(0, 100, 300).astype(float)
    m = h + rng.normal(scale=30, size=300)
    reps = bootstrap_replicates(m, h, ("spearman", "kendall"), 10, seed=1)
    idx = next(iter(stats.resample_indices(300, 10, 1)))
    for r in range(10):
        assert abs(reps["spearman"][r] - spearman(m[idx[r]], h[idx[r]])) <= TOL
        assert abs(reps["kendall"][r] - kendall(m[idx[r]], h[idx[r]])) <= TOL


def test_bootstrap_deterministic_by_seed():
    m, h = _data(500)
    a = bootstrap_ci(m, h, n=400, seed=3)
    b = bootstrap_ci(m, h, n=400, seed=3)
    c = bootstrap_ci(m, h, n=400, seed=4)
    assert np.array_equal(a.replicates, b.replicates) and (a.low, a.high) == (b.low, b.high)
    assert not np.array_equal(a.replicates, c.replicates)
    # the same resamples whatever else is computed alongside
    both = bootstrap_replicates(np.stack([m, h]), h, ("kendall", "spearman"), 400, seed=3)
    assert np.array_equal(both["spearman"][0], a.replicates)


def test_bootstrap_ci_fields():
    m, h = _data(800)
    ci = bootstrap_ci(m, h, stat="kendall", n=300, seed=0)
    assert ci.stat == "kendall" and ci.n_boot == 300 and ci.confidence == 0.95
    assert ci.estimate == pytest.approx(scipy.stats.kendalltau(m, h).statistic, abs=TOL)
    assert ci.low < ci.estimate < ci.high
    assert (ci.low, ci.high) == tuple(np.percentile(ci.replicates, [2.5, 97.5]))
    with pytest.raises(ValueError, match="statistic"):
        bootstrap_ci(m, h, stat="pearson")


def test_bootstrap_tiny_input_constant_resamples():
    reps = bootstrap_replicates([0.0, 1.0], [0.0, 1.0], ("spearman", "kendall"), 200, seed=0)
    # resamples that drew the same item twice are constant -> nan; the rest are 1.0
    for v in reps.values():
        one = np.abs(v - 1.0) <= TOL
        assert np.all(np.isnan(v) | one) and np.isnan(v).any() and one.any()
    ci = bootstrap_ci([0.0, 1.0], [0.0, 1.0], n=200)
    assert ci.low == pytest.approx(1.0, abs=TOL) and ci.high == pytest.approx(1.0, abs=TOL)


# --- significance ------------------------------------------------------------------------------
def test_t_distribution_and_tests_match_scipy():
    for df in (1, 3, 17.5, 4999):
        for t in (0.0, 0.3, 1.96, 4.0, 40.0, -2.5):
            assert significance.t_sf(t, df) == pytest.approx(scipy.stats.t.sf(t, df), rel=1e-9,
                                                             abs=1e-300)
    rng = np.random.default_rng(0)
    a = rng.normal(size=300)
    b = a + rng.normal(scale=0.2, size=300) + 0.02
    t, p = significance.paired_t_test(a, b)
    ref = scipy.stats.ttest_rel(a, b)
    assert t == pytest.approx(ref.statistic, rel=1e-12) and p == pytest.approx(ref.pvalue, rel=1e-9)
    t, p = significance.student_t_test(a, b)
    ref = scipy.stats.ttest_ind(a, b)
    assert t == pytest.approx(ref.statistic, rel=1e-12) and p == pytest.approx(ref.pvalue, rel=1e-9)


def test_compare_correlations():
    rng = np.random.default_rng(2)
    n = 1500
    h = rng.choice([0.0, 0.5, 1.0], n)
    good = h + rng.normal(scale=0.4, size=n)
    bad = h + rng.normal(scale=1.5, size=n)
    c = compare_correlations(good, bad, h, n=500, seed=1)
    assert c.significant and c.better == "a" and c.a > c.b and c.test == "paired"
    assert c.diff_low > 0 and c.p_bootstrap == 0.0
    reps = bootstrap_replicates(np.stack([good, bad]), h, ("spearman",), 500, 1)["spearman"]
    ref = scipy.stats.ttest_rel(reps[0], reps[1])
    assert c.t == pytest.approx(ref.statistic, rel=1e-12)
    assert c.mean_diff == pytest.approx(float(np.mean(reps[0] - reps[1])))
    assert compare_correlations(bad, good, h, n=500, seed=1).better == "b"
    same = compare_correlations(good, good, h, n=100)
    assert not same.significant and same.p_value == 1.0 and same.better is None
    ind = compare_correlations(good, bad, h, n=500, seed=1, test="independent")
    assert ind.t == pytest.approx(scipy.stats.ttest_ind(reps[0], reps[1]).statistic, rel=1e-12)
    boot = compare_correlations(good, bad, h, stat="kendall", n=300, test="bootstrap")
    assert boot.p_value == boot.p_bootstrap and boot.significant
    with pytest.raises(ValueError, match="test"):
        compare_correlations(good, bad, h, n=10, test="wilcoxon")


# --- human judgments ---------------------------------------------------------------------------
@pytest.mark.parametrize("ratings, expected", [
    ([1, 1, 1, 1, 1], 1.0), ([1, 1, 1, 1, 0], 1.0), ([0, 1, 1, 0, 1], 0.5), ([1, 1, 0, 0, 0], 0.5),
    ([1, 0, 0, 0, 0], 0.0), ([0, 0, 0, 0, 0], 0.0), ([True, True, True, True, False], 1.0),
])
def test_human_score(ratings, expected):
    assert human_score(ratings) == expected


@pytest.mark.parametrize("bad", [[1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 2, 0, 0], "11110",
                                 [1, 1, 0.5, 0, 0], None])
def test_human_score_rejects(bad):
    with pytest.raises(ValueError):
        human_score(bad)


def test_krippendorff_hand_computed():
    # 4 units x 2 coders, binary. Values: five 1s, three 0s (n = 8). One unit disagrees:
    # o_01 = o_10 = 1, D_o = 2/8; D_e = 2*5*3 / (8*7); alpha = 1 - 0.25 * 56/30 = 16/30.
    assert krippendorff_alpha([[1, 1], [0, 0], [1, 0], [1, 1]]) == pytest.approx(16 / 30, abs=1e-15)
    # interval: units (1,2), (3,3), (2,4). D_o = (2*1 + 0 + 2*4) / 6; D_e = 2*6*5.5 / 30;
    # alpha = 1 - (10/6) / 2.2 = 8/33
    assert krippendorff_alpha([[1, 2], [3, 3], [2, 4]], "interval") == pytest.approx(8 / 33, abs=1e-15)
    # perfect agreement with variation -> 1; a unit with one value is not pairable
    assert krippendorff_alpha([[1, 1, 1], [0, 0], [1, None], [0]]) == 1.0
    # no variation at all -> undefined
    assert math.isnan(krippendorff_alpha([[1, 1], [1, 1]]))
    # systematic disagreement on binary data -> negative
    assert krippendorff_alpha([[0, 1], [1, 0], [0, 1], [1, 0]]) < 0


def test_krippendorff_published_example():
    """Krippendorff (2011), "Computing Krippendorff's Alpha-Reliability": 4 coders, 12 units,
    missing values; alpha = 0.743 (nominal), 0.849 (interval)."""
    N = None
    coders = [[1, 2, 3, 3, 2, 1, 4, 1, 2, N, N, N],
              [1, 2, 3, 3, 2, 2, 4, 1, 2, 5, N, 3],
              [N, 3, 3, 3, 2, 3, 4, 2, 2, 5, 1, N],
              [1, 2, 3, 3, 2, 4, 4, 1, 2, 5, 1, N]]
    units = [list(u) for u in zip(*coders)]
    assert round(krippendorff_alpha(units, "nominal"), 3) == 0.743
    assert round(krippendorff_alpha(units, "interval"), 3) == 0.849
    as_array = np.array([[np.nan if v is None else v for v in u] for u in units])
    assert krippendorff_alpha(as_array, "nominal") == krippendorff_alpha(units, "nominal")


# --- benchmark scores ---------------------------------------------------------------------------
def _pairs_oracle(m, h, eps=0.0, groups=None):
    correct = total = 0
    for i in range(len(m)):
        for j in range(i + 1, len(m)):
            if groups is not None and groups[i] != groups[j]:
                continue
            dm = 0 if abs(m[i] - m[j]) <= eps else np.sign(m[i] - m[j])
            correct += dm == np.sign(h[i] - h[j])
            total += 1
    return correct / total


def test_pairwise_accuracy():
    m = [0.9, 0.5, 0.5, 0.1]
    h = [1.0, 0.5, 1.0, 0.0]
    # pairs: (0,1) ok, (0,2) human tie / metric not -> wrong, (0,3) ok, (1,2) metric tie, human
    # not -> wrong, (1,3) ok, (2,3) ok  -> 4/6
    assert bench.pairwise_accuracy(m, h) == pytest.approx(4 / 6)
    # epsilon 0.45 ties (0,1), (0,2), (1,3), (2,3) too: correct (0,2), (0,3) -> 2/6
    assert bench.pairwise_accuracy(m, h, tie_epsilon=0.45) == pytest.approx(2 / 6)
    rng = np.random.default_rng(0)
    m, h = rng.integers(0, 5, 40) / 4, rng.integers(0, 3, 40) / 2
    groups = rng.integers(0, 4, 40)
    assert bench.pairwise_accuracy(m, h) == pytest.approx(_pairs_oracle(m, h))
    assert bench.pairwise_accuracy(m, h, groups=groups) == pytest.approx(_pairs_oracle(m, h, 0, groups))
    macro = bench.pairwise_accuracy(m, h, groups=groups, average="groups")
    per = [_pairs_oracle(m[groups == g], h[groups == g]) for g in range(4)]
    assert macro == pytest.approx(np.mean(per))


def test_tie_calibration():
    rng = np.random.default_rng(1)
    h = rng.integers(0, 3, 60).astype(float)
    m = h + rng.normal(scale=0.3, size=60)
    acc, eps = bench.tie_calibrated_pairwise_accuracy(m, h)
    assert acc == pytest.approx(bench.pairwise_accuracy(m, h, tie_epsilon=eps))
    gaps = np.unique(np.abs(m[:, None] - m[None, :]))
    best = max(bench.pairwise_accuracy(m, h, tie_epsilon=g) for g in np.r_[0.0, gaps[::25]])
    assert acc >= best - 1e-15 and acc > bench.pairwise_accuracy(m, h)
    # no human ties: nothing to gain from metric ties
    x = np.arange(10.0)
    assert bench.tie_calibrated_pairwise_accuracy(x, x) == (1.0, 0.0)


def test_winoground_scores():
    s = np.array([
        [[0.9, 0.1], [0.2, 0.8]],  # all right
        [[0.6, 0.1], [0.7, 0.9]],  # text wrong (c1 beats c0 on i0), image right
        [[0.5, 0.6], [0.1, 0.7]],  # text right, image wrong (c0 prefers i1)
        [[0.5, 0.5], [0.5, 0.5]],  # ties count as wrong
    ])
    r = bench.winoground_scores(s)
    assert r == {"text": 0.5, "image": 0.5, "group": 0.25, "n": 4}
    with pytest.raises(ValueError, match="shape"):
        bench.winoground_scores(np.zeros((3, 2)))


def test_spearman_by_benchmark_and_readers(tmp_path):
    path = tmp_path / "items.jsonl"
    rows = [{"id": i, "score": float(i % 7), "human_score": float(i % 5), "benchmark": "ab"[i % 2]}
            for i in range(30)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    text += '{"id": "x", "score": "high", "human_score": 1}\n{oops\n'
    path.write_text(text)
    items = bench.read_scored_items(path, group_field="benchmark")
    assert len(items.ids) == 30 and len(items.problems) == 2
    assert "line 31" in items.problems[0] and "score" in items.problems[0]
    assert "line 32" in items.problems[1]
    res = bench.spearman_by_benchmark(items.metric, items.human, items.groups)
    for b in "ab":
        sel = [r for r in rows if r["benchmark"] == b]
        ref = scipy.stats.spearmanr([r["score"] for r in sel], [r["human_score"] for r in sel])
        assert res[b]["n"] == 15 and res[b]["spearman"] == pytest.approx(ref.statistic, abs=TOL)

    wino = tmp_path / "wino.jsonl"
    wino.write_text(
        json.dumps({"id": "a", "c0_i0": 0.9, "c0_i1": 0.1, "c1_i0": 0.2, "c1_i1": 0.8}) + "\n"
        + json.dumps({"id": "b", "scores": [[0.9, 0.1], [0.95, 0.8]]}) + "\n"
        + json.dumps({"id": "c", "c0_i0": 0.9}) + "\n")
    w = bench.read_winoground(wino)
    assert w.ids == ["a", "b"] and w.scores.shape == (2, 2, 2)
    assert len(w.problems) == 1 and "line 3" in w.problems[0] and "c0_i1" in w.problems[0]
    assert bench.winoground_scores(w.scores)["group"] == 0.5


class _quiet:
    """Silence scipy's constant-input warnings."""

    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)
