"""Meta-evaluation statistics in numpy (no scipy at runtime).

* :func:`spearman`, :func:`kendall` (tau-b): equal to ``scipy.stats.spearmanr`` /
  ``scipy.stats.kendalltau`` (default ``variant="b"``) to ~1e-15, ties included; ``nan`` for a
  constant input, as scipy.
* :func:`bootstrap_replicates` / :func:`bootstrap_ci`: percentile bootstrap of a correlation with
  human scores, vectorized over resamples (5000 resamples of 22k items in a few seconds).

Whether one metric's correlation is significantly better than another's is
:mod:`.significance`, on the bootstrap replicates computed here; the human scores themselves
(LAVE's rule for 5 binary ratings) and inter-annotator agreement are :mod:`.human_ratings`.

Bootstrap resamples: ``numpy.random.default_rng(seed)`` draws, chunk after chunk, ``n`` indices
with replacement per resample; the chunk size depends only on ``n``, so a seed gives the same
resamples for the same number of items whatever the metrics or statistics computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

__all__ = ["spearman", "kendall", "rankdata", "bootstrap_replicates", "bootstrap_ci",
           "BootstrapCI", "percentile_ci", "resample_indices", "STATS", "STAT_FUNCTIONS"]

STATS = ("spearman", "kendall")

# Resamples per chunk are chosen so that a chunk's index matrix stays near this many entries.
_CHUNK_ELEMENTS = 1 << 21
# The vectorized Kendall bootstrap builds a (resamples x distinct-x x distinct-y) table per chunk;
# above this many cells per resample it falls back to one O(n log^2 n) tau per resample.
_KENDALL_TABLE_CELLS = 1 << 20
# Up to this many items the Kendall count tables fit int32 (all partial sums <= n * n < 2**31).
_INT32_MAX_N = 46340


# --- input handling ----------------------------------------------------------------------------
def _vector(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return a


def _pair(x, y) -> tuple[np.ndarray, np.ndarray]:
    x, y = _vector(x, "x"), _vector(y, "y")
    if x.shape != y.shape:
        raise ValueError(f"x and y differ in length ({x.size} vs {y.size})")
    return x, y


def _dense(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct sorted values and the group (0..g-1) of every element."""
    values, inverse = np.unique(a, return_inverse=True)
    return values, inverse.reshape(-1)


def rankdata(a) -> np.ndarray:
    """Average ranks (1-based), ties get the mean of their ranks (``scipy.stats.rankdata``)."""
    a = _vector(a, "a")
    _, inv = _dense(a)
    counts = np.bincount(inv)
    upper = np.cumsum(counts)
    return (upper - (counts - 1) / 2.0)[inv]


# --- correlations ------------------------------------------------------------------------------
def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson's r with ``numpy.corrcoef``'s arithmetic (covariance / sd_x / sd_y)."""
    xm = x - x.mean()
    ym = y - y.mean()
    dof = x.size - 1
    sx = math.sqrt(float(np.dot(xm, xm)) / dof)
    sy = math.sqrt(float(np.dot(ym, ym)) / dof)
    if sx == 0.0 or sy == 0.0:
        return math.nan
    return float(max(-1.0, min(1.0, float(np.dot(xm, ym)) / dof / sx / sy)))


def spearman(x, y) -> float:
    """Spearman's rho: Pearson correlation of average ranks; ``nan`` if either is constant."""
    x, y = _pair(x, y)
    if x.size < 2:
        return math.nan
    return _pearson(rankdata(x), rankdata(y))


def _discordant_pairs(y: np.ndarray) -> int:
    """Pairs i < j with y[i] > y[j] (inversions), by bottom-up merging: at each level every
    element of a right block counts the elements of its left block that are larger, with one
    ``searchsorted`` for all blocks (block id added to the keys)."""
    n = y.size
    y = y.astype(np.int64)
    scale = int(y.max()) + 2 if n else 1
    inversions = 0
    width = 1
    while width < n:
        block = np.arange(n, dtype=np.int64) // width  # blocks are sorted inside
        pair = block // 2
        is_left = (block % 2) == 0
        keys = pair * scale + y
        left_keys = keys[is_left]
        right_keys = keys[~is_left]
        if right_keys.size:
            # left elements of the same pair that are > the right element
            ends = np.searchsorted(left_keys, (pair[~is_left] + 1) * scale, side="left")
            pos = np.searchsorted(left_keys, right_keys, side="right")
            inversions += int((ends - pos).sum())
        # merge each pair of blocks (stable sort by key keeps blocks in place)
        y = y[np.argsort(keys, kind="stable")]
        width *= 2
    return inversions


def _tie_pairs(groups: np.ndarray) -> int:
    counts = np.bincount(groups).astype(np.int64)
    return int((counts * (counts - 1) // 2).sum())


def kendall(x, y) -> float:
    """Kendall's tau-b (ties in either variable corrected); ``nan`` if either is constant."""
    x, y = _pair(x, y)
    n = x.size
    if n < 2:
        return math.nan
    _, gx = _dense(x)
    _, gy = _dense(y)
    order = np.lexsort((gy, gx))  # by x, then y
    sx, sy = gx[order], gy[order]
    dis = _discordant_pairs(sy)  # pairs tied in x are sorted by y, so never counted
    joint = sx.astype(np.int64) * (int(gy.max()) + 1) + sy
    tot = n * (n - 1) // 2
    xtie, ytie, ntie = _tie_pairs(gx), _tie_pairs(gy), _tie_pairs(np.unique(joint, return_inverse=True)[1])
    if xtie == tot or ytie == tot:
        return math.nan
    con_minus_dis = tot - xtie - ytie + ntie - 2 * dis
    tau = con_minus_dis / np.sqrt(tot - xtie) / np.sqrt(tot - ytie)
    return float(min(1.0, max(-1.0, tau)))


STAT_FUNCTIONS = {"spearman": spearman, "kendall": kendall}


# --- bootstrap ---------------------------------------------------------------------------------
def _chunk_rows(n: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(n, 1))


def resample_indices(n: int, n_boot: int, seed: int = 0) -> Iterable[np.ndarray]:
    """The bootstrap resamples, as (rows, n) index arrays, chunk after chunk."""
    rng = np.random.default_rng(seed)
    rows = _chunk_rows(n)
    done = 0
    while done < n_boot:
        b = min(rows, n_boot - done)
        yield rng.integers(0, n, size=(b, n))
        done += b


class _Grouping:
    """Items grouped by equal value: sorting order, group starts, group of each item."""

    def __init__(self, values: np.ndarray):
        self.values, self.group = _dense(values)
        self.size = self.values.size
        self.order = np.argsort(self.group, kind="stable")
        counts = np.bincount(self.group, minlength=self.size)
        self.starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        self.singletons = self.size == self.group.size

    def sums(self, counts: np.ndarray, counts_f: np.ndarray) -> np.ndarray:
        """Per resample (rows of ``counts``; ``counts_f`` the same as float64), how many draws
        fell in each group, as float64 (exact: counts are far below 2**53)."""
        if self.singletons:
            return counts_f[:, self.order]
        return np.add.reduceat(counts_f[:, self.order], self.starts, axis=1)


def _avg_ranks(group_counts: np.ndarray) -> np.ndarray:
    """Average rank of each value group within each resample (groups in sorted order)."""
    return np.cumsum(group_counts, axis=1) - (group_counts - 1.0) / 2.0


class _MetricSide:
    """Per metric: its value groups and the (metric group, human group) cells that occur.
    Cells are sorted by key ``gx * n_human_groups + gy``, hence grouped by metric value."""

    def __init__(self, scores: np.ndarray, gy: _Grouping):
        self.gx = _Grouping(scores)
        key = self.gx.group.astype(np.int64) * gy.size + gy.group
        self.joint = _Grouping(key)
        cell = self.joint.values.astype(np.int64)
        self.jx, self.jy = cell // gy.size, cell % gy.size
        # cells of one metric value are contiguous; when every metric value has one cell, the
        # cell counts are the metric-group counts
        self.x_identity = self.joint.size == self.gx.size
        self.x_starts = np.flatnonzero(np.r_[True, self.jx[1:] != self.jx[:-1]])
        self.table_ok = self.gx.size * gy.size <= _KENDALL_TABLE_CELLS


def _spearman_chunk(cj: np.ndarray, n: int, side: _MetricSide, dy: np.ndarray,
                    syy: np.ndarray) -> np.ndarray:
    """Spearman rho of every resample in a chunk from the cell counts ``cj`` (resamples x
    cells): ranks are per value group, the covariance a sum over cells."""
    cx = cj if side.x_identity else np.add.reduceat(cj, side.x_starts, axis=1)
    dx = _avg_ranks(cx) - (n + 1) / 2.0
    sxx = np.einsum("ij,ij->i", cx, dx * dx)
    wx = cj * (dx if side.x_identity else dx[:, side.jx])
    sxy = np.einsum("ij,ij->i", wx, dy[:, side.jy])
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = sxy / np.sqrt(sxx) / np.sqrt(syy)
    return np.clip(rho, -1.0, 1.0)


def _kendall_chunk(cj: np.ndarray, n: int, side: _MetricSide, n_y: int) -> np.ndarray:
    """Kendall tau-b of every resample in a chunk from its (y group x x group) count table:
    S = sum over cells of t * (draws with larger x and larger y - draws with larger x and
    smaller y); integer arithmetic, so exact."""
    b = cj.shape[0]
    n_x = side.gx.size
    # every partial sum below is at most n * n: int32 is exact up to n = 46340 and halves the
    # memory traffic
    dtype = np.int32 if n <= _INT32_MAX_N else np.int64
    t = np.zeros((b, n_y, n_x), dtype=dtype)
    t.reshape(b, n_y * n_x)[:, side.jy * n_x + side.jx] = cj
    ry = t.sum(axis=2, dtype=np.int64)
    # above[., c, a] = draws in y group c with x group > a
    above = np.cumsum(t, axis=2, dtype=dtype)
    np.subtract(ry[:, :, None].astype(dtype), above, out=above)
    up = np.cumsum(above, axis=1, dtype=dtype)  # y group <= c
    diff = up[:, -1:, :] - up  # draws with larger x and y group > c
    diff -= up  # minus those with y group < c (= up - above) ...
    diff += above  # ... so diff = larger_y - smaller_y
    s = np.einsum("ijk,ijk->i", t, diff).astype(np.int64)  # |s| <= n * n / 2: no overflow
    tot = n * (n - 1) // 2
    rx = t.sum(axis=1, dtype=np.int64)
    xtie = (rx * (rx - 1) // 2).sum(axis=1)
    ytie = (ry * (ry - 1) // 2).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        tau = s / np.sqrt(tot - xtie) / np.sqrt(tot - ytie)
    return np.clip(tau, -1.0, 1.0)


def bootstrap_replicates(metric_scores, human_scores, stats: Sequence[str] = ("spearman",),
                         n_boot: int = 5000, seed: int = 0) -> dict[str, np.ndarray]:
    """Correlations of one or more metrics with human scores on ``n_boot`` bootstrap resamples
    of the items (the same resamples for every metric and statistic).

    ``metric_scores``: shape (n,) or (k, n); ``human_scores``: (n,). Returns ``{stat: array of
    shape (k, n_boot)}`` (``(n_boot,)`` for a 1-D input); a resample where a variable is constant
    gives ``nan``. Ranks are computed per resample from how many times each distinct value was
    drawn, so no resample is ever sorted: the cost is O(n_boot * n) for Spearman, and for
    Kendall O(n_boot * distinct metric values * distinct human values) -- small when the human
    scores take few values (LAVE's take 3); otherwise one O(n log^2 n) tau per resample.
    """
    for s in stats:
        if s not in STATS:
            raise ValueError(f"unknown statistic {s!r}; choose from {STATS}")
    h = _vector(human_scores, "human_scores")
    m = np.asarray(metric_scores, dtype=np.float64)
    one = m.ndim == 1
    m = np.atleast_2d(m)
    if m.ndim != 2 or m.shape[1] != h.size:
        raise ValueError(f"metric scores of shape {np.shape(metric_scores)} do not match "
                         f"{h.size} human scores")
    if not np.all(np.isfinite(m)):
        raise ValueError("metric scores contain NaN or infinite values")
    if n_boot < 1:
        raise ValueError("n_boot must be >= 1")
    n, k = h.size, m.shape[0]
    out = {s: np.full((k, n_boot), np.nan) for s in stats}
    if n >= 2:
        gy = _Grouping(h)
        sides = [_MetricSide(row, gy) for row in m]
        done = 0
        for idx in resample_indices(n, n_boot, seed):
            b = idx.shape[0]
            counts = np.bincount((idx + (np.arange(b) * n)[:, None]).ravel(),
                                 minlength=b * n).reshape(b, n)
            counts_f = counts.astype(np.float64)
            cy = gy.sums(counts, counts_f)
            dy = _avg_ranks(cy) - (n + 1) / 2.0
            syy = np.einsum("ij,ij->i", cy, dy * dy)
            for j, side in enumerate(sides):
                cj = side.joint.sums(counts, counts_f)
                if "spearman" in stats:
                    out["spearman"][j, done:done + b] = _spearman_chunk(cj, n, side, dy, syy)
                if "kendall" not in stats:
                    continue
                if side.table_ok:
                    sub = max(1, _CHUNK_ELEMENTS // (side.gx.size * gy.size))
                    for s0 in range(0, b, sub):
                        out["kendall"][j, done + s0:done + min(b, s0 + sub)] = _kendall_chunk(
                            cj[s0:s0 + sub], n, side, gy.size)
                else:  # both variables nearly continuous: one O(n log^2 n) tau per resample
                    for r in range(b):
                        out["kendall"][j, done + r] = kendall(m[j][idx[r]], h[idx[r]])
            done += b
    return {s: v[0] if one else v for s, v in out.items()}


@dataclass
class BootstrapCI:
    stat: str
    estimate: float  # on all items
    low: float
    high: float
    confidence: float
    n_boot: int
    seed: int
    replicates: np.ndarray = field(repr=False)


def percentile_ci(replicates: np.ndarray, confidence: float) -> tuple[float, float]:
    r = replicates[np.isfinite(replicates)]
    if r.size == 0:
        return math.nan, math.nan
    tail = (1.0 - confidence) / 2.0 * 100.0
    lo, hi = np.percentile(r, [tail, 100.0 - tail])
    return float(lo), float(hi)


def bootstrap_ci(metric_scores, human_scores, stat: str = "spearman", n: int = 5000, seed: int = 0,
                 confidence: float = 0.95) -> BootstrapCI:
    """Percentile bootstrap confidence interval of the metric's correlation with human scores
    (``stat`` = "spearman" or "kendall"), over ``n`` resamples of the items. Resamples where a
    variable is constant (only possible for tiny inputs) are left out of the percentiles."""
    if stat not in STATS:
        raise ValueError(f"unknown statistic {stat!r}; choose from {STATS}")
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1)")
    reps = bootstrap_replicates(metric_scores, human_scores, (stat,), n, seed)[stat]
    lo, hi = percentile_ci(reps, confidence)
    return BootstrapCI(stat, STAT_FUNCTIONS[stat](metric_scores, human_scores), lo, hi, confidence,
                       n, seed, reps)
