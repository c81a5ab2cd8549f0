"""Compiled step functions: the ``compile`` engine option, shape buckets, and the bookkeeping of
compile time.

At judge-sized models a decoding step is a few hundred small kernels, so what the host spends
issuing them is the cost. ``torch.compile`` fuses the step's elementwise work into fewer
kernels; on CUDA, ``mode="reduce-overhead"`` also records each shape's step as a CUDA graph and
replays it with one launch. Both specialise on shapes, so rows are padded to a few batch sizes
(:data:`ROW_BUCKETS`, as vLLM's CUDA-graph batch sizes) and multi-token widths to powers of
two: a judge meets a handful of shapes, each compiled once per process.

``compile``: ``"on"``, ``"off"`` or ``"auto"``: on for CUDA devices, off on the CPU, where
compiled steps of judge-sized models were measured slower than eager ones (docs/engine.md,
compiled steps).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..engine_options import COMPILE_MODES
from .compile_cache import use_persistent_compile_cache

log = logging.getLogger("fastjudge")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CAPACITY_QUANTUM = 64  # token capacities round up to this, so caches of nearby sizes share a shape
# Compilations a compiled step may keep per code object. Dynamo's default keeps 8 and runs every
# later shape eagerly (so on CUDA without its graph), with one warning; a judge meets up to
# len(ROW_BUCKETS) row counts x a handful of widths x its pool's capacities.
RECOMPILE_LIMIT = 256


def compile_enabled(option: str | bool | None, device: torch.device) -> bool:
    """Whether ``option`` (``"on"`` / ``"off"`` / ``"auto"``; booleans and None accepted)
    compiles on ``device``."""
    if option is None or option is True or option is False:
        return bool(option) if option is not None else device.type == "cuda"
    if option not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {option!r}")
    return option == "on" or (option == "auto" and device.type == "cuda")


def row_bucket(n: int) -> int:
    """The padded row count of a step of ``n`` rows."""
    return next((b for b in ROW_BUCKETS if b >= n), n)


def width_bucket(k: int) -> int:
    """The padded token width of a multi-token step of ``k`` tokens."""
    return 1 << max(k - 1, 0).bit_length()


def round_capacity(n: int) -> int:
    return -(-n // CAPACITY_QUANTUM) * CAPACITY_QUANTUM


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo keep at least ``limit`` compilations of one function (process-wide: dynamo's
    limits are global; only ever raised, never lowered)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, limit)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, limit)


class CompiledFunction:
    """``fn`` through ``torch.compile`` (CUDA graphs per shape on CUDA), with the seconds spent
    in the first call of each new shape (compilation, and the graph recording) added to
    ``seconds`` and logged. ``dynamic``: as ``torch.compile``'s (False: one compilation per
    shape; None: a dimension seen with two sizes is recompiled once as symbolic)."""

    def __init__(self, fn: Callable, device: torch.device, name: str, dynamic: bool | None = False):
        mode = "reduce-overhead" if device.type == "cuda" else None
        use_persistent_compile_cache()  # a later process reuses what this one compiles
        raise_recompile_limit(RECOMPILE_LIMIT)
        self.fn = torch.compile(fn, mode=mode, dynamic=dynamic)
        self.name = name
        self.seconds = 0.0
        self._seen: set = set()

    def __call__(self, shape_key, *args, **kwargs):
        if shape_key in self._seen:
            return self.fn(*args, **kwargs)
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        spent = time.perf_counter() - start
        self._seen.add(shape_key)
        self.seconds += spent
        log.info("fastjudge: compiled %s for shape %s in %.1f s", self.name, shape_key, spent)
        return out
