"""What one decoding step costs the host: synchronisations, aten ops and wall time per step,
counted under ``torch.profiler``.

A GPU runs a step's kernels while the host queues the next ones, until the host needs a value:
every ``int(tensor)`` / ``.item()`` (an ``aten::_local_scalar_dense`` event) and every copy to
the host waits for everything queued before it, and every aten op is a kernel launch. A step
shaped for the GPU costs the same few launches and one copy whatever its row count.

:func:`profile_decoding` runs a callable under the profiler with a decode function and its
prefill function wrapped in labelled ranges, and counts only what happens inside the decode
ranges and outside the prefill ranges (a row's prompt runs once, not per step), divided by the
decode steps:

* ``syncs``: ``aten::_local_scalar_dense`` / ``aten::item`` events plus the engine's labelled
  host copies (``backends.host_copy``: on the CPU a ``.cpu()`` has no event of its own);
* ``ops``: top-level aten ops (those not issued from inside another aten op): the launches;
* ``ms``: wall time per step (compute included).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

from torch.profiler import ProfilerActivity, profile, record_function

from ..backends.host_copy import COPY_LABEL

SYNC_EVENTS = frozenset({"aten::_local_scalar_dense", "aten::item", COPY_LABEL})
DECODE_LABEL, PREFILL_LABEL = "step_profile::decode", "step_profile::prefill"


@contextlib.contextmanager
def labelled(owner, name: str, label: str):
    """``owner.name`` (a function or method) wrapped in a profiler range ``label`` meanwhile."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        with record_function(label):
            return original(*args, **kwargs)

    setattr(owner, name, wrapped)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _spans(events, label: str) -> list[tuple[float, float]]:
    return [(e.time_range.start, e.time_range.end) for e in events if e.name == label]


def _inside(t: float, spans) -> bool:
    return any(a <= t <= b for a, b in spans)


def count_steps(events, steps: int) -> dict:
    """Per-step ``syncs``, ``ops`` and ``ms`` of profiler ``events`` (module notes)."""
    decode, prefill = _spans(events, DECODE_LABEL), _spans(events, PREFILL_LABEL)
    syncs = ops = 0
    for e in events:
        t = e.time_range.start
        if not _inside(t, decode) or _inside(t, prefill):
            continue
        syncs += e.name in SYNC_EVENTS
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        ops += e.name.startswith("aten::") and parent is None
    wall = sum(b - a for a, b in decode) - sum(b - a for a, b in prefill if _inside(a, decode))
    steps = max(steps, 1)
    return dict(steps=steps, syncs=syncs / steps, ops=ops / steps, ms=wall / 1000 / steps)


def profile_decoding(run: Callable[[], object], decode: tuple, prefill: Sequence[tuple],
                     steps: Callable[[], int]) -> dict:
    """:func:`count_steps` of ``run()``. ``decode``: ``(owner, name)`` of the decode function
    as its caller looks it up; ``prefill``: such pairs of the prompt work inside it;
    ``steps()``: the decode steps ``run`` took, read after it."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(labelled(*decode, DECODE_LABEL))
        for owner, name in prefill:
            stack.enter_context(labelled(owner, name, PREFILL_LABEL))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    return count_steps(prof.events(), steps())


def profile_qwen_decoding(run: Callable[[], object], backend) -> dict:
    """:func:`profile_decoding` of ``run()`` on the torch Qwen backend ``backend``: its decode
    loop, its suffix prefill left out, its own step counter."""
    from ..backends import torch_qwen

    backend.reset_decode_stats()
    return profile_decoding(run, (torch_qwen, "decode_greedy"), [(torch_qwen.TorchQwenBackend, "_prefill_suffixes")],
                            lambda: backend.decode_stats["decode_steps"])


def profile_t5_decoding(run: Callable[[], object]) -> dict:
    """:func:`profile_decoding` of ``run()`` on the torch T5 backend: its decode loop, the
    encoder left out, the steps counted as they are taken."""
    from ..backends import t5_decode, torch_t5

    steps = []
    original = t5_decode.step

    def counted(*args, **kwargs):
        steps.append(1)
        return original(*args, **kwargs)

    t5_decode.step = counted
    try:
        return profile_decoding(run, (torch_t5, "decode_greedy"), [(t5_decode.T5Model, "encode")],
                                lambda: len(steps))
    finally:
        t5_decode.step = original
