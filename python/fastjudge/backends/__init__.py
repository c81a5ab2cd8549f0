"""Model backends. One interface, no metric logic:

* ``encode_prompt(text) -> np.ndarray``: the model input ids for a prompt;
* ``shared_prefix_len(ids, prefix_text) -> int``: how many leading prompt tokens may be served
  from a cached prefix state (0 where no exact reuse exists);
* ``response_ids(text) -> list[int]``: ids of ``text`` as the start of the model's response;
* ``decode(ids) -> str``;
* ``cost(request) -> int``: tokens a request occupies in a batch (what the planner packs);
* ``run(batch) -> list[Output]``: execute one planned batch;
* ``max_input_tokens``, ``default_batch_tokens``.
"""

from __future__ import annotations

import os

from .loading import CheckpointError, read_config


def load_backend(model: str | os.PathLike, backend: str = "torch", device: str = "auto", dtype=None,
                 allow_pickle: bool = False, max_input_tokens: int | None = None):
    """Open a judge checkpoint with the backend that fits its architecture. ``backend="trtllm"``:
    ``model`` is a ``fastjudge build`` output directory (see ``backends/trtllm.py``)."""
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
        return TorchT5Backend(model, **options)
    if model_type in QWEN_MODEL_TYPES:
        return TorchQwenBackend(model, **options)
    supported = ", ".join(T5_MODEL_TYPES + QWEN_MODEL_TYPES)
    raise CheckpointError(f"{model}: model_type {model_type!r} is not supported by the torch backend "
                          f"(supported: {supported})")


__all__ = ["load_backend", "CheckpointError"]
