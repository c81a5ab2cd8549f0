"""What every judge shares: results in input order from ``stream``, and the asyncio API over
one dynamic batcher per judge."""

from __future__ import annotations

import os
from typing import Iterable

from ..engine_options import EngineOptions


def open_backend(model, engine: EngineOptions | None = None, image: str | None = None):
    """A judge's backend: ``model`` is a checkpoint directory (opened as ``engine`` says, with
    the backend that fits its architecture) or a backend object already open (which keeps its
    own settings). ``image``: the judge's name, when it needs a multimodal checkpoint."""
    from ..backends import check_backend, load_backend

    if isinstance(model, (str, os.PathLike)):
        model = load_backend(model, engine)
    check_backend(model)
    if image and model.codec.image_config is None:
        raise ValueError(f"{image} needs a Qwen3.5 vision-language checkpoint with a vision tower "
                         "and a preprocessor_config.json")
    return model


class Judge:
    """Base of the judges. A subclass provides ``stream(examples)`` yielding results that carry
    ``index`` (position in ``examples``) and ``prompt_tokens``; :meth:`_open` sets the engine
    and the model every judge has."""

    def _open(self, model, engine: EngineOptions | None, image: str | None = None) -> None:
        """``self.engine``, ``self.backend`` (see :func:`open_backend`), ``self.codec`` and the
        batching limits ``self.max_batch_tokens`` / ``self.max_batch_size``."""
        self.engine = EngineOptions() if engine is None else engine
        if not isinstance(self.engine, EngineOptions):
            raise TypeError(f"engine must be an EngineOptions, got {type(engine).__name__}")
        self.backend = open_backend(model, self.engine, image)
        self.codec = self.backend.codec
        self.max_batch_tokens = self.engine.max_batch_tokens or self.backend.default_batch_tokens
        self.max_batch_size = self.engine.max_batch_size

    def stream(self, examples: Iterable):
        raise NotImplementedError

    def score(self, examples: Iterable) -> list:
        """Results in input order."""
        return sorted(self.stream(examples), key=lambda r: r.index)

    # -- async (dynamic batching across concurrent callers) ------------------------------------
    def batcher(self, max_wait_ms: float = 5, max_queue_items: int = 10000):
        """The judge's dynamic batcher (``fastjudge.runtime.async_batcher.AsyncBatcher``),
        created on first use; later calls return the same one (arguments then ignored)."""
        existing = getattr(self, "_async_batcher", None)
        if existing is None:
            from ..runtime.async_batcher import AsyncBatcher

            existing = self._async_batcher = AsyncBatcher(
                self, max_wait_ms=max_wait_ms, max_queue_items=max_queue_items)
        return existing

    async def ascore(self, examples: Iterable) -> list:
        """``score`` for asyncio: results in input order; concurrent callers share batches."""
        return await self.batcher().score(examples)

    async def astream(self, examples: Iterable):
        """``stream`` for asyncio: results as they finish, each with ``.index``."""
        async for result in self.batcher().stream(examples):
            yield result
