"""How tensors cross into the engine's CPU kernels (``fastjudge._engine``): which tensors they
take, and as what. The kernels work on host memory outside torch, through numpy views of the
tensors' own memory (no copies), and release the GIL while they run."""

from __future__ import annotations

import numpy as np
import torch

ENGINE_DTYPES = (torch.float32, torch.bfloat16)  # what the attention and DeltaNet step kernels take


def engine_takes(x: torch.Tensor) -> bool:
    """Whether the engine's CPU kernels can take ``x``: CPU tensors in eager code only (a traced
    graph keeps the tensor ops)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def engine_array(t: torch.Tensor) -> np.ndarray:
    """``t`` as the engine reads it: a numpy view of the same memory (bfloat16, which numpy
    lacks, as its 16-bit patterns)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
