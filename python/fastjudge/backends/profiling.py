"""The engine's profiler labels, and its labelled device-to-host copy.

Stages carry ``torch.profiler.record_function`` labels, so a profile (``bench.step_profile``,
the benchmarks) reads where time goes without wrapping engine functions: :data:`DECODE_LABEL`
around a decoding loop, :data:`PREFIX_LABEL` around shared prefixes run once (their snapshots
cached), :data:`PREFILL_LABEL` around the rest of the prompts (suffixes, the T5 encoder),
:data:`STEP_LABEL` around each decoding step's model call (a call that runs several steps,
the CPU engine's runs of greedy steps, adds an empty one for each after its first:
:func:`count_run_steps`), :data:`VISION_LABEL` around the vision tower. A decoding step makes
one copy to the host (the chosen ids, with any tracked logits); on a GPU the copy is a
synchronisation the profiler shows as a memcpy, on the CPU a ``.cpu()`` has no event of its
own, so :data:`COPY_LABEL` is what counts it there.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

COPY_LABEL = "fastjudge::to_host"
DECODE_LABEL = "fastjudge::decode"
PREFIX_LABEL = "fastjudge::prefix"
PREFILL_LABEL = "fastjudge::prefill"
STEP_LABEL = "fastjudge::step"
VISION_LABEL = "fastjudge::vision"


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, as one labelled copy."""
    with record_function(COPY_LABEL):
        return t.cpu()


def count_run_steps(n: int) -> None:
    """Under the profiler, an empty :data:`STEP_LABEL` for each of ``n`` steps that ran inside
    the labelled call before (a run of steps in one call): a profile counts one a step."""
    if torch.autograd._profiler_enabled():
        for _ in range(n):
            with record_function(STEP_LABEL):
                pass
