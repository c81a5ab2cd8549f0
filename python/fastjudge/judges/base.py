"""What every judge shares: results in input order from ``stream``, and the asyncio API over
one dynamic batcher per judge."""

from __future__ import annotations

from typing import Iterable

from ..engine_options import EngineOptions
from ..runtime.engine import Engine


class Judge:
    """Base of the judges. A subclass provides ``stream(examples)`` yielding results that carry
    ``index`` (position in ``examples``) and ``prompt_tokens``; :meth:`_open` sets the engine
    and the model every judge has."""

    def _open(self, model, engine: EngineOptions | None, image: str | None = None) -> None:
        """``self.engine`` (an :class:`Engine` on ``model`` as the options ``engine`` say),
        ``self.backend`` and ``self.codec``."""
        self.engine = Engine.open(model, engine, image)
        self.backend, self.codec = self.engine.backend, self.engine.codec

    @property
    def options(self) -> EngineOptions:
        return self.engine.options

    @property
    def max_batch_tokens(self) -> int:
        """The engine's batching limit (read, not copied: a failure retry may shrink it)."""
        return self.engine.max_batch_tokens

    @property
    def max_batch_size(self) -> int:
        return self.engine.max_batch_size

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
