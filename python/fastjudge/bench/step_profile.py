"""What one decoding step costs the host: synchronisations, aten ops and wall time per step,
counted under ``torch.profiler``.

A GPU runs a step's kernels while the host queues the next ones, until the host needs a value:
every ``int(tensor)`` / ``.item()`` (an ``aten::_local_scalar_dense`` event) and every copy to
the host waits for everything queued before it, and every aten op is a kernel launch. A step
shaped for the GPU costs the same few launches and one copy whatever its row count.

:func:`profile_decoding` runs a callable under the profiler and reads the engine's own labels
(``backends.profiling``): it counts only what happens inside the decoding loops
(``DECODE_LABEL``) and outside the prompt work in them (``PREFILL_LABEL``: a row's prompt runs
once, not per step), divided by the steps taken (``STEP_LABEL`` events):

* ``syncs``: ``aten::_local_scalar_dense`` / ``aten::item`` events plus the engine's labelled
  host copies (``backends.profiling``: on the CPU a ``.cpu()`` has no event of its own);
* ``ops``: top-level aten ops (those not issued from inside another aten op): the launches;
* ``step_ops``: of those, the ones inside the model's step (``STEP_LABEL``), without the loop's
  own work around it (picking tokens, rows leaving and joining);
* ``views``: of those, the ops that only make another view of a tensor's memory (``VIEW_OPS``:
  no kernel on any device; on the CPU every tensor handed to the engine's kernels is viewed
  through numpy, which issues ``detach``, ``resolve_conj`` and ``resolve_neg``);
* ``ms``: wall time per step (compute included).
"""

from __future__ import annotations

from typing import Callable

from torch.profiler import ProfilerActivity, profile

from ..backends.profiling import COPY_LABEL, DECODE_LABEL, PREFILL_LABEL, STEP_LABEL

SYNC_EVENTS = frozenset({"aten::_local_scalar_dense", "aten::item", COPY_LABEL})
# ops that return a view or an alias of their input's memory: no kernel runs
VIEW_OPS = frozenset(f"aten::{name}" for name in (
    "alias", "as_strided", "chunk", "detach", "expand", "narrow", "permute", "resolve_conj", "resolve_neg",
    "select", "slice", "split", "split_with_sizes", "squeeze", "t", "transpose", "unbind", "unfold", "unsqueeze",
    "view", "view_as"))


def _spans(events, label: str) -> list[tuple[float, float]]:
    return [(e.time_range.start, e.time_range.end) for e in events if e.name == label]


def _inside(t: float, spans) -> bool:
    return any(a <= t <= b for a, b in spans)


def count_steps(events) -> dict:
    """Per-step ``syncs``, ``ops`` and ``ms`` of profiler ``events`` (module notes)."""
    decode, prefill = _spans(events, DECODE_LABEL), _spans(events, PREFILL_LABEL)
    step_spans = _spans(events, STEP_LABEL)
    syncs = ops = views = step_ops = 0
    for e in events:
        t = e.time_range.start
        if not _inside(t, decode) or _inside(t, prefill):
            continue
        syncs += e.name in SYNC_EVENTS
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        top = e.name.startswith("aten::") and parent is None
        ops += top
        views += top and e.name in VIEW_OPS
        step_ops += top and _inside(t, step_spans)
    wall = sum(b - a for a, b in decode) - sum(b - a for a, b in prefill if _inside(a, decode))
    steps = max(sum(_inside(a, decode) for a, _ in step_spans), 1)
    return dict(steps=steps, syncs=syncs / steps, ops=ops / steps, step_ops=step_ops / steps, views=views / steps,
                ms=wall / 1000 / steps)


def profile_decoding(run: Callable[[], object]) -> dict:
    """:func:`count_steps` of ``run()`` (any torch backend's decoding)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return count_steps(prof.events())


def stage_seconds(events, labels) -> dict[str, float]:
    """Seconds inside each of the engine's ``labels`` in profiler ``events``, a label's time
    without the labelled stages nested in it (a vision-tower call inside a prefix prefill
    counts as vision only)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.name in labels)
    seconds = dict.fromkeys(labels, 0.0)
    for i, (start, end, name) in enumerate(spans):
        nested = [(a, b) for a, b, _ in spans[i + 1:] if start <= a and b <= end]
        inner = sum(b - a for a, b in nested if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in nested))
        seconds[name] += (end - start - inner) / 1e6
    return seconds
