"""Triton kernels, installed as ``fastjudge.kernels``.

Each kernel has one file with its launcher and a torch reference of the same math (the CPU
fallback and the test oracle), and its ``@triton.jit`` functions in a ``*_triton.py`` file
beside it, imported on the kernel's first use: this package imports on machines without
Triton, and ``TRITON_INTERPRET`` is read when a kernel is first needed.

- `choice_head`: final RMSNorm + the K candidate rows of the LM head (+ full-vocabulary
  log-sum-exp without ``[B, V]`` logits) -> ``choice_logits``, ``choice_logprobs``,
  ``choice_head.choice_head`` (both at once).
- `crop_encode`: crop + Qwen smart-resize (antialiased) + normalize + patchify of evidence boxes
  into the vision tower's patch layout -> ``crop_encode.crop_encode``, ``CropEncodeConfig``.

Dispatch: Triton on CUDA tensors when Triton is installed, the torch reference otherwise;
``FASTJUDGE_FORCE_TRITON=1`` (with ``TRITON_INTERPRET=1``) runs the kernels on CPU tensors in the
Triton interpreter; every entry point also takes ``impl="auto" | "torch" | "triton"``.
"""

# The functions named like their modules (choice_head.choice_head, crop_encode.crop_encode) are
# not re-exported: `fastjudge.kernels.crop_encode` stays the module.
from . import choice_head, crop_encode, dispatch  # noqa: E402
from .choice_head import ChoiceHead, choice_logits, choice_logprobs  # noqa: E402
from .crop_encode import CropEncodeConfig, smart_resize  # noqa: E402
from .dispatch import triton_available

__all__ = ["triton_available", "dispatch", "choice_head", "crop_encode", "ChoiceHead", "choice_logits",
           "choice_logprobs", "CropEncodeConfig", "smart_resize"]
