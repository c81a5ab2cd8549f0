"""Model backends: run planned batches of requests, knowing no metric. Each satisfies the
``Backend`` protocol (``backends/protocol.py``) and carries the checkpoint's prompt codec
(``fastjudge.codec``), which judges use to build requests and read outputs.

* ``torch_t5``: Flan-T5 / T5 v1.1 (encoder-decoder) in plain PyTorch;
* ``torch_qwen``: Qwen3.5 / Qwen3 (decoder-only, text and vision) in plain PyTorch with exact
  shared-prefix reuse (``qwen_model``: the math, ``qwen_decode``: greedy decoding,
  ``caches``: prefix keys and image embeddings, ``qwen_vision``: the vision tower);
* ``trtllm``: ``fastjudge build`` outputs on TensorRT-LLM (``manifest`` reads their manifest).
"""

from __future__ import annotations

import os

import torch

from .loading import CheckpointError, one_line, read_config
from .protocol import Backend, check_backend


def load_backend(model: str | os.PathLike, backend: str = "torch", device: str = "auto", dtype=None,
                 allow_pickle: bool = False, max_input_tokens: int | None = None, jump_forward: bool = True):
    """Open a judge checkpoint with the backend that fits its architecture. ``backend="trtllm"``:
    ``model`` is a ``fastjudge build`` output directory (see ``backends/trtllm.py``).
    ``jump_forward``: the Qwen backend's jump-forward JSON decoding (``qwen_decode``)."""
    if backend == "trtllm":
        from .trtllm import TrtllmBackend

        return TrtllmBackend(model, max_input_tokens=max_input_tokens)
    if backend != "torch":
        raise ValueError(f"unknown backend {backend!r}; available: 'torch', 'trtllm'")
    model_type = read_config(model).get("model_type")
    from .torch_qwen import QWEN_MODEL_TYPES, TorchQwenBackend
    from .torch_t5 import T5_MODEL_TYPES, TorchT5Backend

    options = dict(device=device, dtype=dtype, allow_pickle=allow_pickle,
                   max_input_tokens=max_input_tokens)
    if model_type in T5_MODEL_TYPES:
        return _open_checkpoint(TorchT5Backend, model, options)
    if model_type in QWEN_MODEL_TYPES:
        return _open_checkpoint(TorchQwenBackend, model, {**options, "jump_forward": jump_forward})
    supported = ", ".join(T5_MODEL_TYPES + QWEN_MODEL_TYPES)
    raise CheckpointError(f"{model}: model_type {model_type!r} is not supported by the torch backend "
                          f"(supported: {supported})")


def _open_checkpoint(backend_class, model: str | os.PathLike, options: dict):
    """The backend on ``model``; every failure to load it a :class:`CheckpointError` naming the
    checkpoint (the shape checks name the file and tensor; what slips past them -- a vision
    tower or tokenizer files that do not load -- is named here by the directory)."""
    try:
        return backend_class(model, **options)
    except CheckpointError as bad:
        if str(model) in str(bad):  # already names the checkpoint
            raise
        raise CheckpointError(f"{model}: {bad}") from None
    except (torch.OutOfMemoryError, ImportError):
        raise  # the machine or the installation, not the checkpoint
    except Exception as bad:  # noqa: BLE001 - whatever the files make the loaders raise
        raise CheckpointError(f"{model}: cannot be loaded ({one_line(bad)})") from bad


__all__ = ["load_backend", "CheckpointError", "Backend", "check_backend"]
