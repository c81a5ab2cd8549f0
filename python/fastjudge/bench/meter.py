"""What ``fastjudge bench`` measures, and on what: a backend wrapper that times and counts each
batch it runs, batch-latency percentiles, peak memory, and the device's name.

The counts come from the runtime's own data at the one place every judge's work passes
through, ``Backend.run`` (``runtime.scheduler.run_requests`` calls it once per planned batch):

* prompt tokens: ``Request.num_tokens`` of every request run (prompt plus forced response
  start), whether or not a backend reuses a cached prefix state for part of it;
* generated tokens: ``len(Output.token_ids)`` of every output (tokens written by decoding, EOS
  not included; a score-only ``Choice`` step generates none);
* tokens computed: the backend's own counter of tokens run through the model
  (``TorchQwenBackend.tokens_computed``: its real, non-padding tokens, so a cached prefix is
  not counted again), where the backend keeps one;
* decode counters: the change in the backend's ``decode_stats`` (a dict of running totals, such
  as tokens forced by jump-forward decoding), where it keeps them.

Counting costs a few additions per batch, none per token, so the hot path is untouched.
"""

from __future__ import annotations

import platform
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


@dataclass
class BatchCounts:
    """Totals over the batches run since the last :meth:`MeteredBackend.reset`."""

    latencies: list[float] = field(default_factory=list)  # seconds per batch, in run order
    prompt_tokens: int = 0
    generated_tokens: int = 0

    @property
    def batches(self) -> int:
        return len(self.latencies)


class MeteredBackend:
    """A backend (anything with the ``Backend`` protocol) whose ``run`` is timed and counted;
    every other attribute is the wrapped backend's. ``on_batch(counts)``: called after each
    batch (the progress bar's batch count)."""

    def __init__(self, backend, on_batch: Callable[[BatchCounts], None] | None = None):
        self.backend = backend
        self.on_batch = on_batch
        self.counts = BatchCounts()
        self._sync = _synchronizer(getattr(backend, "device", None))

    def __getattr__(self, name):
        # only reached for names this wrapper does not define: codec, cost, group_key, ...
        backend = self.__dict__.get("backend")
        if backend is None:
            raise AttributeError(name)
        return getattr(backend, name)

    def reset(self) -> BatchCounts:
        """Start counting afresh; returns the counts so far."""
        done, self.counts = self.counts, BatchCounts()
        return done

    def computed_tokens(self) -> int | None:
        """The backend's counter of tokens run through the model, or None without one."""
        value = getattr(self.backend, "tokens_computed", None)
        return int(value) if isinstance(value, (int, np.integer)) else None

    def decode_stats(self) -> dict | None:
        """A copy of the backend's decode counters (``decode_stats``), or None without them."""
        stats = getattr(self.backend, "decode_stats", None)
        return dict(stats) if isinstance(stats, dict) else None

    def run(self, batch: Sequence) -> list:
        start = time.perf_counter()
        outputs = self.backend.run(batch)
        self._sync()  # a batch's time is its device time too, not just its launch
        self.counts.latencies.append(time.perf_counter() - start)
        self.counts.prompt_tokens += sum(r.num_tokens for r in batch)
        self.counts.generated_tokens += sum(len(o.token_ids) for o in outputs)
        if self.on_batch is not None:
            self.on_batch(self.counts)
        return outputs


def counter_change(before: dict | None, after: dict | None) -> dict | None:
    """What each numeric counter of ``after`` gained since ``before`` (a counter new since then
    counts from 0); None when the backend keeps none."""
    if after is None:
        return None
    before = before or {}
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}


def _synchronizer(device) -> Callable[[], None]:
    """A CUDA synchronize for a CUDA backend (outputs already come back as host arrays, so this
    is a formality that keeps the timing honest should that change); a no-op elsewhere."""
    if getattr(device, "type", None) == "cuda":
        import torch

        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def percentile_ms(latencies: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of batch latencies in milliseconds (linear interpolation between
    order statistics, numpy's default); None without batches."""
    if not latencies:
        return None
    return float(np.percentile(np.asarray(latencies) * 1e3, q))


def is_cuda(device) -> bool:
    return getattr(device, "type", str(device or "")).startswith("cuda")


def reset_peak_memory(device) -> None:
    """CUDA's peak counter restarts here; a process's peak RSS cannot be reset."""
    if is_cuda(device):
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device, torch_allocated: bool = True) -> tuple[int, str]:
    """(bytes, what they are): CUDA ``max_memory_allocated`` since the last reset, or the
    process's peak resident set size (``getrusage``: all of the process's life, model loading
    included). ``torch_allocated=False`` (a backend whose memory is not torch's, TensorRT-LLM):
    the memory in use on the CUDA device now, by every process."""
    if is_cuda(device):
        import torch

        if not torch_allocated:
            free, total = torch.cuda.mem_get_info(device)
            return int(total - free), "cuda_device_used"
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return int(peak if sys.platform == "darwin" else peak * 1024), "cpu_peak_rss"


def device_name(device) -> str:
    """The CUDA device's name, or the CPU's model name."""
    if is_cuda(device):
        import torch

        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
