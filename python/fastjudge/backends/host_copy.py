"""The engine's device-to-host copies, labelled for the profiler.

A decoding step makes one copy to the host (the chosen ids, with any tracked logits). On a GPU
the copy is a synchronisation the profiler shows as a memcpy; on the CPU a ``.cpu()`` has no
event of its own, so the label is what lets ``bench.step_profile`` count it there too.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

COPY_LABEL = "fastjudge::to_host"


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, as one labelled copy."""
    with record_function(COPY_LABEL):
        return t.cpu()
