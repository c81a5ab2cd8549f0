"""Argument checks the C++ core applies to integer array arguments, repeated in Python."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def as_int_array(values: np.ndarray | Sequence[int], name: str) -> np.ndarray:
    """``values`` as a 1-D integer array; ``ValueError`` naming ``name`` otherwise."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got {arr.ndim}-D")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr
