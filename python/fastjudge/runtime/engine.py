"""The :class:`Engine`: what a judge runs its requests on.

It holds the backend (opened once from the checkpoint, as the :class:`EngineOptions` say) and
the batching limits resolved once from the options and the backend's defaults. Judges hand it
their requests (:meth:`Engine.run`); when a system failure makes the failure handling retry
with smaller batches, it shrinks the engine's limits for the retry (:meth:`Engine.scaled`),
never a judge's attributes.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Sequence

from ..engine_options import EngineOptions
from .requests import Output, Request
from .scheduler import run_requests


class Engine:
    def __init__(self, backend, options: EngineOptions):
        from ..backends import check_backend

        check_backend(backend)
        self.backend, self.options = backend, options
        self.codec = backend.codec
        self.max_batch_tokens = options.max_batch_tokens or backend.default_batch_tokens
        self.max_batch_size = options.max_batch_size

    @classmethod
    def open(cls, model, options: EngineOptions | None = None, image: str | None = None) -> "Engine":
        """``model``: a checkpoint directory (opened with the backend that fits its
        architecture) or a backend object already open (which keeps its own settings).
        ``image``: the judge's name, when it needs a multimodal checkpoint."""
        from ..backends import load_backend

        options = EngineOptions() if options is None else options
        if not isinstance(options, EngineOptions):
            raise TypeError(f"engine must be an EngineOptions, got {type(options).__name__}")
        backend = load_backend(model, options) if isinstance(model, (str, os.PathLike)) else model
        engine = cls(backend, options)
        if image and engine.codec.image_config is None:
            raise ValueError(f"{image} needs a Qwen3.5 vision-language checkpoint with a vision tower "
                             "and a preprocessor_config.json")
        return engine

    @property
    def max_input_tokens(self) -> int:
        return self.backend.max_input_tokens

    def run(self, requests: Sequence[Request]) -> Iterator[list[Output]]:
        """The outputs of each planned batch as soon as it finishes (``runtime.scheduler``)."""
        return run_requests(self.backend, requests, self.max_batch_tokens, self.max_batch_size)

    @contextmanager
    def scaled(self, scale: float):
        """The batching limits times ``scale`` (at least 1 each) until the block ends."""
        saved = self.max_batch_tokens, self.max_batch_size
        if scale < 1:
            self.max_batch_tokens = max(1, int(saved[0] * scale))
            self.max_batch_size = max(1, int(saved[1] * scale))
        try:
            yield self
        finally:
            self.max_batch_tokens, self.max_batch_size = saved
