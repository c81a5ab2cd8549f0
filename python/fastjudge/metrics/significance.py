"""The LAVE paper's significance test between two metrics' correlations with the same human
scores, in numpy (no scipy at runtime).

:func:`compare_correlations` bootstraps both metrics on the *same* 5000 resamples
(:func:`.stats.bootstrap_replicates`) and runs a t-test at the 5% level on the two sets of
bootstrap correlations; :func:`compare_replicates` does the same from replicates already
computed (``fastjudge meta-eval`` computes them once per group for every pair of metrics).

The t-tests: :func:`t_sf` equals ``scipy.stats.t.sf``, :func:`paired_t_test`
``scipy.stats.ttest_rel`` and :func:`student_t_test` ``scipy.stats.ttest_ind`` (equal
variances), to ~1e-9 relative in the p-value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .stats import STAT_FUNCTIONS, STATS, _vector, bootstrap_replicates, percentile_ci

__all__ = ["compare_correlations", "compare_replicates", "CorrelationComparison", "TESTS",
           "t_sf", "paired_t_test", "student_t_test"]

TESTS = ("paired", "independent", "bootstrap")


# --- Student's t distribution and t-tests ------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
           + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """Survival function P(T > t) of Student's t distribution."""
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t > 0 else 1.0 - tail


def paired_t_test(a, b) -> tuple[float, float]:
    """Two-sided paired t-test (``scipy.stats.ttest_rel``): ``(t, p)``."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    d = d[np.isfinite(d)]
    if d.size < 2:
        return math.nan, math.nan
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0.0:
        return (math.nan, 1.0) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0)
    t = mean / (sd / math.sqrt(d.size))
    return t, min(1.0, 2.0 * t_sf(abs(t), d.size - 1))


def student_t_test(a, b) -> tuple[float, float]:
    """Two-sided two-sample t-test with equal variances (``scipy.stats.ttest_ind``): ``(t, p)``."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    na, nb = a.size, b.size
    if na < 2 or nb < 2:
        return math.nan, math.nan
    df = na + nb - 2
    pooled = ((na - 1) * a.var(ddof=1) + (nb - 1) * b.var(ddof=1)) / df
    diff = float(a.mean() - b.mean())
    se = math.sqrt(pooled * (1.0 / na + 1.0 / nb))
    if se == 0.0:
        return (math.nan, 1.0) if diff == 0.0 else (math.copysign(math.inf, diff), 0.0)
    t = diff / se
    return t, min(1.0, 2.0 * t_sf(abs(t), df))


# --- comparing two metrics ---------------------------------------------------------------------
@dataclass
class CorrelationComparison:
    """Metric A vs metric B on the same human scores."""

    stat: str
    a: float  # correlations on all items
    b: float
    mean_diff: float  # mean over resamples of (A - B)
    diff_low: float  # percentile CI of A - B
    diff_high: float
    t: float
    p_value: float  # of the test (the t-test, or p_bootstrap for test="bootstrap")
    p_bootstrap: float  # two-sided: 2 * min(P(A - B <= 0), P(A - B >= 0)) over resamples
    significant: bool  # p_value < alpha
    better: str | None  # "a" or "b" when significant, else None
    test: str
    n_boot: int


def compare_replicates(rep_a: np.ndarray, rep_b: np.ndarray, a: float, b: float, stat: str,
                       alpha: float = 0.05, test: str = "paired",
                       confidence: float = 0.95) -> CorrelationComparison:
    """The comparison from already computed bootstrap replicates (same resamples)."""
    if test not in TESTS:
        raise ValueError(f"test must be one of {TESTS}, got {test!r}")
    d = rep_a - rep_b
    d = d[np.isfinite(d)]
    lo, hi = percentile_ci(d, confidence)
    p_boot = float(min(1.0, 2.0 * min((d <= 0).mean(), (d >= 0).mean()))) if d.size else math.nan
    if test == "paired":
        t, p = paired_t_test(rep_a, rep_b)
    elif test == "independent":
        t, p = student_t_test(rep_a, rep_b)
    else:
        t, p = math.nan, p_boot
    mean_diff = float(d.mean()) if d.size else math.nan
    significant = bool(p < alpha) if not math.isnan(p) else False
    better = None
    if significant:
        better = "a" if mean_diff > 0 else "b"
    return CorrelationComparison(stat, a, b, mean_diff, lo, hi, t, p, p_boot, significant,
                                 better, test, int(rep_a.size))


def compare_correlations(metric_a, metric_b, human_scores, stat: str = "spearman",
                         n: int = 5000, seed: int = 0, alpha: float = 0.05,
                         test: str = "paired") -> CorrelationComparison:
    """Is metric A's correlation with the human scores significantly different from metric B's?

    As in the LAVE paper: bootstrap with ``n`` = 5000 resamples (the same resamples for both
    metrics) and a t-test at ``alpha`` = 5% between the two sets of bootstrap correlations --
    ``test="paired"`` (``ttest_rel``, default, as the resamples are shared) or
    ``"independent"`` (``ttest_ind``). With thousands of replicates either t-test calls very
    small differences significant, so ``p_bootstrap`` (two-sided bootstrap p-value of A - B) and
    the CI of the difference are reported too; ``test="bootstrap"`` decides on ``p_bootstrap``.
    """
    if stat not in STATS:
        raise ValueError(f"unknown statistic {stat!r}; choose from {STATS}")
    a_scores, b_scores = _vector(metric_a, "metric_a"), _vector(metric_b, "metric_b")
    reps = bootstrap_replicates(np.stack([a_scores, b_scores]), human_scores, (stat,), n, seed)[stat]
    f = STAT_FUNCTIONS[stat]
    return compare_replicates(reps[0], reps[1], f(a_scores, human_scores),
                              f(b_scores, human_scores), stat, alpha, test)
