"""Triton kernels, installed as ``fastjudge.kernels``.

Each kernel lives in one file with its launcher and a torch reference of the same math, so
the reference doubles as the CPU fallback and the test oracle. Triton itself is imported
lazily by each kernel file: this package imports on machines without Triton.
"""

import importlib.util


def triton_available() -> bool:
    """Whether Triton is installed (kernels then run compiled on CUDA, or interpreted on CPU
    under TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


__all__ = ["triton_available"]
