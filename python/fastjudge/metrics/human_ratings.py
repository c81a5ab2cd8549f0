"""Human judgments: LAVE's human score from 5 binary ratings (:func:`human_score`) and
Krippendorff's alpha for inter-annotator agreement (:func:`krippendorff_alpha`), in numpy.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["human_score", "krippendorff_alpha"]


def human_score(ratings: Sequence) -> float:
    """LAVE's human score from 5 binary ratings (1 = correct): 1.0 if at least 4 annotators
    rate the answer correct, 0.5 if 2 or 3 do, else 0.0 (Mañas et al., Sec. 4)."""
    if isinstance(ratings, (str, bytes)) or not hasattr(ratings, "__len__"):
        raise ValueError("ratings must be a list of 5 binary ratings")
    if len(ratings) != 5:
        raise ValueError(f"expected 5 binary ratings, got {len(ratings)}")
    correct = 0
    for r in ratings:
        if isinstance(r, bool) or r in (0, 1):
            correct += int(r)
        else:
            raise ValueError(f"ratings must be 0/1 or true/false, got {r!r}")
    return 1.0 if correct >= 4 else 0.5 if correct >= 2 else 0.0


def _units_matrix(ratings) -> np.ndarray:
    """Ragged or rectangular ratings -> (units, max coders) float array, NaN for missing."""
    rows = [list(r) for r in ratings]
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        for j, v in enumerate(r):
            if v is not None:
                out[i, j] = float(v)
    return out


def krippendorff_alpha(ratings, level: str = "nominal") -> float:
    """Krippendorff's alpha for inter-annotator agreement.

    ``ratings``: one row per unit (item), holding the values its annotators gave (rows may differ
    in length; ``None``/NaN = missing), e.g. the 5 binary ratings per answer. ``level``:
    ``"nominal"`` (binary/categorical; disagreement 1 for different values) or ``"interval"``
    (squared difference). Units with fewer than 2 values are not pairable and are ignored.
    ``alpha = 1 - D_o / D_e`` from the coincidence matrix (Krippendorff, "Computing
    Krippendorff's Alpha-Reliability", 2011); ``nan`` when there is no variation at all.
    """
    if level not in ("nominal", "interval", "binary"):
        raise ValueError("level must be 'nominal' (or 'binary') or 'interval'")
    if isinstance(ratings, np.ndarray) and ratings.ndim == 2:
        data = ratings.astype(np.float64)
    else:
        data = _units_matrix(ratings)
    if data.ndim != 2:
        raise ValueError("ratings must be a list of per-unit rating lists")
    present = ~np.isnan(data)
    m = present.sum(axis=1)
    pairable = m >= 2
    data, present, m = data[pairable], present[pairable], m[pairable].astype(np.float64)
    n = m.sum()
    if n < 2:
        return math.nan
    if level == "interval":
        v = np.where(present, data, 0.0)
        s1, s2 = v.sum(axis=1), (v * v).sum(axis=1)
        # sum over ordered pairs of a unit's values of (v_i - v_j)^2 = 2 m S2 - 2 S1^2
        observed = ((2.0 * m * s2 - 2.0 * s1 * s1) / (m - 1.0)).sum()
        t1, t2 = s1.sum(), s2.sum()
        expected = 2.0 * n * t2 - 2.0 * t1 * t1
    else:
        values, inv = np.unique(data[present], return_inverse=True)
        counts = np.zeros(data.shape[0] * values.size)
        rows = np.nonzero(present)[0]
        np.add.at(counts, rows * values.size + inv.reshape(-1), 1.0)
        counts = counts.reshape(data.shape[0], values.size)
        # ordered pairs of different values within each unit: m^2 - sum_c n_uc^2
        observed = ((m * m - (counts * counts).sum(axis=1)) / (m - 1.0)).sum()
        nc = counts.sum(axis=0)
        expected = n * n - (nc * nc).sum()
    if expected == 0.0:
        return math.nan
    return float(1.0 - (n - 1.0) * observed / expected)
