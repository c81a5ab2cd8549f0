"""What one decoding step costs the host: reads of device values (each a device->host
synchronisation on a GPU), aten ops issued, and time spent outside aten ops.

A GPU runs a step's kernels while the host queues the next ones, until the host needs a value:
every read of a tensor's contents into Python (``.tolist()``, ``.item()``, ``int(t)``,
``.numpy()``, a copy to the CPU) waits for everything queued before it. A batched step should
read once (the chosen ids) whatever its row count, and issue as many ops for 64 rows as for one.

:func:`profile_steps` runs a callable that performs ``steps`` decoding steps four times: to warm
up; under a ``TorchFunctionMode`` that sees every Python-level read of a tensor's values (the
profiler alone cannot: ``.tolist()`` of a CPU tensor issues no aten op); under
``torch.profiler`` (aten op counts, ``aten::_local_scalar_dense`` events, time inside and outside
top-level aten ops); and timed with nothing attached. The callable must run the same steps each
time (rebuild its state inside, or make the state reusable).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

#: Tensor methods that hand a tensor's values to Python or NumPy.
VALUE_READS = frozenset({"tolist", "item", "numpy", "__array__", "__int__", "__float__", "__bool__",
                         "__index__", "__complex__"})
#: Tensor methods that copy to the CPU (a device->host transfer when the source is elsewhere).
HOST_COPIES = frozenset({"cpu", "to", "copy_"})
#: The aten op behind every scalar read (``aten::item``, ``int(t)``, ``bool(t)`` end in it).
SCALAR_READ_OP = "aten::_local_scalar_dense"


@dataclass
class StepProfile:
    """Per-step figures of ``steps`` decoding steps."""

    steps: int
    host_syncs: float  # reads of device values into Python (device->host transfers on a GPU)
    aten_ops: float  # aten ops the profiler recorded, nested ones included
    python_ms: float  # profiled run's time outside top-level aten ops: interpreter and framework
    # (the profiler adds its own bookkeeping to it, a little per op)
    wall_ms: float  # wall time of a step, unprofiled
    aten_ms: float  # CPU time inside top-level aten ops
    scalar_reads: float  # aten::_local_scalar_dense events (scalar reads among host_syncs)
    reads_by_kind: dict[str, int] = field(default_factory=dict)  # totals over all steps

    def row(self) -> str:
        return (f"{self.host_syncs:8.2f} {self.aten_ops:10.1f} {self.python_ms:10.3f} "
                f"{self.wall_ms:10.3f}")

    HEADER = f"{'syncs':>8} {'aten ops':>10} {'python ms':>10} {'wall ms':>10}"


class _HostReads(TorchFunctionMode):
    """Counts Python-level reads of tensor values. On a device other than the CPU only reads of
    tensors on that device count, and copies from it to the CPU; with ``device`` the CPU (host
    and device are one) every read counts: each would be a transfer for a tensor on a GPU."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.on_cpu = device.type == "cpu"
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in VALUE_READS and args and isinstance(args[0], torch.Tensor):
            if self.on_cpu or args[0].device.type != "cpu":
                self.counts[name] += 1
        elif name in HOST_COPIES and args and isinstance(args[0], torch.Tensor) and not self.on_cpu:
            if self._to_host(name, args, kwargs):
                self.counts[name] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _to_host(name: str, args, kwargs) -> bool:
        src = args[0]
        if name == "cpu":
            return src.device.type != "cpu"
        if name == "copy_":  # dst.copy_(src)
            other = args[1] if len(args) > 1 else kwargs.get("src")
            return src.device.type == "cpu" and isinstance(other, torch.Tensor) and other.device.type != "cpu"
        target = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                target = a
            elif isinstance(a, torch.Tensor):
                target = a.device
        return target is not None and torch.device(target).type == "cpu" and src.device.type != "cpu"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _top_level_aten(events) -> list:
    """aten events with no aten event above them (the ops the code itself issued)."""
    out = []
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            out.append(e)
    return out


def profile_steps(run: Callable[[], object], steps: int, device: torch.device | str = "cpu") -> StepProfile:
    """Per-step host syncs, aten ops and Python-side time of ``run()``, which performs ``steps``
    decoding steps on ``device``."""
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    device = torch.device(device)
    run()  # warm-up: caches, allocator, lazy initialisation
    reads = _HostReads(device)
    with reads:  # its own run: the mode's Python overhead must not reach the timings
        run()
        _synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run()
        _synchronize(device)
        profiled = time.perf_counter() - t0
    t0 = time.perf_counter()
    run()
    _synchronize(device)
    wall = time.perf_counter() - t0
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    scalar = sum(1 for e in aten if e.name == SCALAR_READ_OP)
    aten_s = sum(e.cpu_time_total for e in _top_level_aten(events)) / 1e6
    return StepProfile(steps=steps, host_syncs=sum(reads.counts.values()) / steps,
                       aten_ops=len(aten) / steps, python_ms=1e3 * max(profiled - aten_s, 0.0) / steps,
                       wall_ms=1e3 * wall / steps, aten_ms=1e3 * aten_s / steps,
                       scalar_reads=scalar / steps, reads_by_kind=dict(reads.counts))


def t5_decode_runner(model, prompts, steps: int, track: torch.Tensor | None = None) -> Callable[[], None]:
    """A callable running ``steps`` greedy T5 rationale steps (``t5_decode.step`` + ``_pick``,
    the host bookkeeping of ``decode_greedy`` included) of one row per prompt (token id arrays),
    all rows live throughout (no early exit, no refill: every step has the same rows)."""
    import numpy as np

    from ..backends import t5_decode

    dev = model.w.embed.device
    s = model.s
    with torch.inference_mode():
        lengths = [len(p) for p in prompts]
        enc = model.encode(torch.from_numpy(np.concatenate(prompts)).to(dev), lengths)
        states = list(enc.split(lengths))
        slots = t5_decode.Slots(model, len(prompts), max(lengths), steps, dev)
        slots.add(model, list(range(len(prompts))), states, s.decoder_start_token_id)
        bias = model.decoder_bias(steps)
        causal = torch.ones(steps, steps, dtype=torch.bool, device=dev).tril()
        self_mask = bias.masked_fill(~causal, float("-inf"))

    @torch.inference_mode()
    def run() -> None:
        slots.pos = [0] * slots.live
        slots.token = [s.decoder_start_token_id] * slots.live
        for _ in range(steps):
            for j, picked in enumerate(t5_decode._pick(t5_decode.step(model, slots, self_mask), track)):
                slots.pos[j] += 1
                slots.token[j] = int(picked[0])

    return run
