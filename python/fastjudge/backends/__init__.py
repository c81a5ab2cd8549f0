"""Model backends: run planned batches of requests, knowing no metric. Each satisfies the
``Backend`` protocol (``backends/protocol.py``) and carries the checkpoint's prompt codec
(``fastjudge.codec``), which judges use to build requests and read outputs.

* ``t5``: Flan-T5 / T5 v1.1 (encoder-decoder) in plain PyTorch;
* ``qwen``: Qwen3.5 / Qwen3 (decoder-only, text and vision) in plain PyTorch with exact
  shared-prefix reuse;
* ``trtllm``: ``fastjudge build`` outputs on TensorRT-LLM (``manifest`` reads their manifest).

Shared by the torch backends: ``loading`` (checkpoints), ``fp8`` (FP8 weights), ``compiled``
(compiled steps), ``profiling`` (profiler labels and the labelled device-to-host copy),
``cpu_memory`` (malloc thresholds for CPU forwards). ``EngineOptions`` reaches
a backend whole: each reads the fields it has.
"""

from __future__ import annotations

import os

import torch

from ..engine_options import EngineOptions
from .loading import CheckpointError, one_line, read_config
from .protocol import Backend, check_backend


def load_backend(model: str | os.PathLike, engine: EngineOptions | None = None):
    """Open a judge checkpoint with the backend that fits its architecture, as ``engine`` says
    (default: ``EngineOptions()``). ``engine.backend="trtllm"``: ``model`` is a
    ``fastjudge build`` output directory (see ``backends/trtllm.py``)."""
    engine = EngineOptions() if engine is None else engine
    if engine.backend == "trtllm":
        from .trtllm import TrtllmBackend

        kv = {} if engine.gpu_memory_fraction is None else {
            "kv_cache_free_gpu_memory_fraction": engine.gpu_memory_fraction}
        return TrtllmBackend(model, max_input_tokens=engine.max_input_tokens, **kv)
    model_type = read_config(model).get("model_type")
    from .qwen.backend import QWEN_MODEL_TYPES, TorchQwenBackend
    from .t5.backend import T5_MODEL_TYPES, TorchT5Backend

    if model_type in T5_MODEL_TYPES:
        return _open_checkpoint(TorchT5Backend, model, engine)
    if model_type in QWEN_MODEL_TYPES:
        return _open_checkpoint(TorchQwenBackend, model, engine)
    supported = ", ".join(T5_MODEL_TYPES + QWEN_MODEL_TYPES)
    raise CheckpointError(f"{model}: model_type {model_type!r} is not supported by the torch backend "
                          f"(supported: {supported})")


def _open_checkpoint(backend_class, model: str | os.PathLike, engine: EngineOptions):
    """The backend on ``model``; every failure to load it a :class:`CheckpointError` naming the
    checkpoint (the shape checks name the file and tensor; what slips past them -- a vision
    tower or tokenizer files that do not load -- is named here by the directory)."""
    try:
        return backend_class(model, engine)
    except CheckpointError as bad:
        if str(model) in str(bad):  # already names the checkpoint
            raise
        raise CheckpointError(f"{model}: {bad}") from None
    except (torch.OutOfMemoryError, ImportError):
        raise  # the machine or the installation, not the checkpoint
    except Exception as bad:  # noqa: BLE001 - whatever the files make the loaders raise
        raise CheckpointError(f"{model}: cannot be loaded ({one_line(bad)})") from bad


__all__ = ["load_backend", "EngineOptions", "CheckpointError", "Backend", "check_backend"]
