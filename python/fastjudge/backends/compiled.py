"""Compiled step functions: the ``compile`` engine option, shape buckets, and the bookkeeping of
compile time.

At judge-sized models a decoding step is a few hundred small kernels, so what the host spends
issuing them is the cost. ``torch.compile`` fuses the step's elementwise work into fewer
kernels; on CUDA, ``mode="reduce-overhead"`` also records each shape's step as a CUDA graph and
replays it with one launch. Both specialise on shapes, so rows are padded to a few batch sizes
(:data:`ROW_BUCKETS`, as vLLM's CUDA-graph batch sizes) and multi-token widths to powers of
two: a judge meets a handful of shapes, each compiled once per process.

``compile``: ``"on"``, ``"off"`` or ``"auto"``: on for CUDA devices; on the CPU, where the first
calls' compile costs far more than a short job's steps, the Qwen backend starts eager and
compiles once the job has run long enough for compiling to pay (:class:`CompileWhenItPays`; see
docs/engine.md).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from ..engine_options import COMPILE_MODES
from .compile_cache import compile_cache_warm, use_persistent_compile_cache

log = logging.getLogger("fastjudge")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

#: The Qwen forward on the CPU (``benchmarks/bench_compiled.py --shape mini --rows 16``, 2 cores,
#: docs/engine.md#compiled-steps): eager step time over compiled step time (the lowest measured),
#: and the seconds compiling a judge's shapes cost with an empty and with a filled persistent
#: compile cache.
CPU_COMPILED_SPEEDUP = 1.4
CPU_COMPILE_SECONDS = {"cold": 160.0, "warm": 25.0}
CAPACITY_QUANTUM = 64  # token capacities round up to this, so caches of nearby sizes share a shape


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


class CompiledFunction:
    """``fn`` through ``torch.compile`` (CUDA graphs per shape on CUDA), with the seconds spent
    in the first call of each new shape (compilation, and the graph recording) added to
    ``seconds`` and logged. ``dynamic``: as ``torch.compile``'s (False: one compilation per
    shape; None: a dimension seen with two sizes is recompiled once as symbolic)."""

    def __init__(self, fn: Callable, device: torch.device, name: str, dynamic: bool | None = False):
        mode = "reduce-overhead" if device.type == "cuda" else None
        use_persistent_compile_cache()  # a later process reuses what this one compiles
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


class CompileWhenItPays:
    """``compile="auto"`` where compiling is slow (the CPU). A job's length is not known when it
    starts, so its steps run eagerly while their seconds are summed; once what compiled steps
    would have saved so far (``eager_seconds * (1 - 1 / speedup)``) reaches what compiling is
    expected to cost, :meth:`due` says so and the owner compiles. The ski-rental rule: whatever
    the job's length, it pays at most about twice what the better of "never compile" and
    "compile at once" would have cost it; a short job never compiles."""

    def __init__(self, speedup: float, compile_seconds: float):
        self.saving = 1.0 - 1.0 / speedup
        self.compile_seconds = compile_seconds
        self.eager_seconds = 0.0

    @classmethod
    def for_cpu(cls) -> "CompileWhenItPays":
        warm = compile_cache_warm()
        return cls(CPU_COMPILED_SPEEDUP, CPU_COMPILE_SECONDS["warm" if warm else "cold"])

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Adds the block's wall time to the eager seconds (eager CPU steps end when they return)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.eager_seconds += time.perf_counter() - start

    def due(self) -> bool:
        return self.eager_seconds * self.saving >= self.compile_seconds
