"""Which implementation a kernel entry point runs: Triton on CUDA tensors when Triton is
installed, the torch reference otherwise; ``FASTJUDGE_FORCE_TRITON=1`` with
``TRITON_INTERPRET=1`` runs the Triton kernels on CPU tensors in Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os

IMPLS = ("auto", "torch", "triton")


def triton_available() -> bool:
    """Whether Triton is installed (kernels then run compiled on CUDA, or interpreted on CPU
    under TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(device, impl: str) -> bool:
    """``impl``: "auto" (the rule above), "torch" or "triton"."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if impl != "auto":
        return impl == "triton"
    if not triton_available():
        return False
    return device.type == "cuda" or (os.environ.get("FASTJUDGE_FORCE_TRITON", "0") == "1" and interpreting())
