"""Fault injection: a real backend that raises on chosen ``run`` calls, to drill the failure
handling of every entry point (:mod:`fastjudge.runtime.failures`) without a GPU.

    backend = FaultyBackend(TorchT5Backend(path), oom_on_calls={2})   # OOM once, on call 2
    backend = FaultyBackend(real, oom_above_rows=4)                   # OOM on every batch > 4
    backend = FaultyBackend(real, errors=3, error="RuntimeError")     # 3 generic failures
    judge = LaveJudge(backend)

Everything but ``run`` is the real backend's. Calls are counted from 1; ``log`` records each
call as (rows, tokens, what was raised or None).
"""

from __future__ import annotations

import threading
from typing import Sequence

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (fault injected)"
CUDA_ERROR = "CUDA error: an illegal memory access was encountered (fault injected)"
GENERIC = "backend lost its connection (fault injected)"


class FaultyBackend:
    """``backend`` whose ``run`` raises:

    * ``oom_on_calls``: a CUDA out-of-memory ``RuntimeError`` on these call numbers;
    * ``oom_above_rows`` / ``oom_above_tokens``: one on every batch with more rows / more
      tokens (the sum of ``backend.cost``) than that;
    * ``errors``: a ``RuntimeError(message)`` on the next ``errors`` calls from call
      ``errors_from`` (``message`` defaults to a generic one; :data:`CUDA_ERROR` for a device
      error).
    """

    def __init__(self, backend, oom_on_calls: Sequence[int] = (), oom_above_rows: int | None = None,
                 oom_above_tokens: int | None = None, errors: int = 0, errors_from: int = 1,
                 message: str = GENERIC):
        self._backend = backend
        self.oom_on_calls = set(oom_on_calls)
        self.oom_above_rows = oom_above_rows
        self.oom_above_tokens = oom_above_tokens
        self.errors = errors
        self.errors_from = errors_from
        self.message = message
        self.calls = 0
        self.log: list[tuple[int, int, str | None]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def _fault(self, call: int, rows: int, tokens: int) -> str | None:
        if call in self.oom_on_calls:
            return CUDA_OOM
        if self.oom_above_rows is not None and rows > self.oom_above_rows:
            return CUDA_OOM
        if self.oom_above_tokens is not None and tokens > self.oom_above_tokens:
            return CUDA_OOM
        if self.errors_from <= call < self.errors_from + self.errors:
            return self.message
        return None

    def run(self, batch):
        with self._lock:
            self.calls += 1
            call = self.calls
        tokens = sum(int(self._backend.cost(r)) for r in batch)
        fault = self._fault(call, len(batch), tokens)
        self.log.append((len(batch), tokens, fault))
        if fault is not None:
            raise RuntimeError(fault)
        return self._backend.run(batch)


def faulty_lave_judge(model_dir: str, faults: dict, options: dict | None = None):
    """A :class:`~fastjudge.LaveJudge` on ``model_dir`` whose backend is a
    :class:`FaultyBackend` with ``faults`` (``options``: :class:`~fastjudge.EngineOptions`
    fields such as ``device`` / ``dtype`` / ``max_batch_tokens``, and the judge's
    ``num_shots``); picklable as a ``functools.partial``, so that Ray actors build their judge
    with it (``run_job(..., build_judge=partial(faulty_lave_judge, ...))``)."""
    from ..backends import load_backend
    from ..engine_options import EngineOptions
    from ..judges.lave import LaveJudge

    options = dict(options or {})
    judge_options = {k: options.pop(k) for k in ("num_shots",) if k in options}
    engine = EngineOptions(**options)  # device, dtype, max_batch_tokens, ...
    return LaveJudge(FaultyBackend(load_backend(model_dir, engine), **faults), engine=engine, **judge_options)
