"""Dynamic batching across concurrent asyncio callers.

One background worker thread owns the judge. Callers (any number of coroutines, on one or more
event loops) enqueue examples and await futures. The worker waits for the first queued item,
then keeps collecting until ``max_wait_ms`` has passed or about ``max_batch_tokens`` worth of
requests is queued, runs the merged list through ``judge.stream`` (so the C++ planner packs
items of different callers together), and resolves each caller's future on its own loop with
``loop.call_soon_threadsafe``. Results carry the caller's own ``index``.

Failures (:mod:`.failures`): the worker runs each batch with
:func:`~.failures.resilient_stream`, so out of memory splits the batch, other failures are
retried ``retries`` times, and an item that fails alone while others score gets an error result
(:class:`~.failures.FailedItem`). A failure no item explains reaches each unfinished caller of
the batch as :class:`~.failures.SystemFailure` (never as a result), is counted in
``system_failures``, and the worker goes on with the next batch.

Cancelling a caller drops its still-queued items; results of its items already in a running
batch are discarded. Other callers are never affected. The queue is bounded: a submission that
would exceed ``max_queue_items`` raises :class:`QueueFullError` and enqueues nothing.

    import asyncio
    from fastjudge import LaveJudge, VQAExample

    judge = LaveJudge("/models/flan-t5-xl")
    async def main():
        items = [VQAExample("What sport is this?", ["skiing"], "ski")]
        print(await judge.ascore(items))
        async for r in judge.astream(items):
            print(r.index, r.score)
    asyncio.run(main())
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from typing import AsyncIterator, Iterable, Sequence

from .failures import RetryPolicy, SystemFailure, describe, resilient_stream

__all__ = ["AsyncBatcher", "QueueFullError", "SystemFailure"]


class QueueFullError(RuntimeError):
    """The batcher's queue cannot take the submitted items (``max_queue_items`` reached)."""


class _Item:
    __slots__ = ("example", "index", "future", "loop", "dropped")

    def __init__(self, example, index: int, future: asyncio.Future, loop):
        self.example = example
        self.index = index
        self.future = future
        self.loop = loop
        self.dropped = False


def _resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():  # cancelled by its caller meanwhile: discard
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _post(item: _Item, result=None, error: BaseException | None = None) -> None:
    try:
        item.loop.call_soon_threadsafe(_resolve, item.future, result, error)
    except RuntimeError:  # the caller's event loop is closed: nobody is waiting
        pass


class AsyncBatcher:
    """Dynamic batcher in front of a judge with a ``stream(examples)`` method yielding results
    that have an ``index`` into ``examples`` and ``prompt_tokens`` (``LaveJudge``)."""

    def __init__(self, judge, max_wait_ms: float = 5, max_queue_items: int = 10000,
                 max_batch_tokens: int | None = None, retries: int = 2, backoff_s: float = 0.5):
        if max_queue_items < 1:
            raise ValueError("max_queue_items must be >= 1")
        if max_wait_ms < 0:
            raise ValueError("max_wait_ms must be >= 0")
        self.judge = judge
        self.max_wait_s = max_wait_ms / 1000
        self.max_queue_items = int(max_queue_items)
        self.max_batch_tokens = int(max_batch_tokens or getattr(judge, "max_batch_tokens", 0)
                                    or 65536)
        self._queue: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._avg_tokens = 1024.0  # running estimate of prompt tokens per item
        self.policy = RetryPolicy(retries=retries, backoff_s=backoff_s)
        # counters (read by the server's /metrics)
        self.items_done = 0
        self.batches_done = 0
        self.running = 0
        self.system_failures = 0  # batches failed by a system failure
        self.last_system_failure: tuple[float, str] | None = None  # (time.time(), message)

    # -- state ---------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the server is shutting down)."""
        return self._closed

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._worker, name="fastjudge-batcher",
                                            daemon=True)
            self._thread.start()

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the worker after the batch it is running; queued items get an error."""
        with self._cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for item in pending:
            _post(item, None, RuntimeError("batcher closed"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- callers -------------------------------------------------------------------------------
    def submit(self, examples: Iterable) -> list[asyncio.Future]:
        """Enqueue ``examples`` (all or nothing); one future per example, on the running loop.
        Raises QueueFullError when the queue cannot take them all."""
        loop = asyncio.get_running_loop()
        examples = list(examples)
        items = [_Item(e, i, loop.create_future(), loop) for i, e in enumerate(examples)]
        if not items:
            return []
        with self._cond:
            if self._closed:
                raise RuntimeError("batcher is closed")
            free = self.max_queue_items - len(self._queue)
            if len(items) > free:
                raise QueueFullError(
                    f"queue full: {len(items)} items submitted, {max(free, 0)} of "
                    f"{self.max_queue_items} slots free; retry later")
            self._queue.extend(items)
            self._start()
            self._cond.notify_all()
        return [it.future for it in items]

    def cancel(self, futures: Sequence[asyncio.Future]) -> None:
        """Cancel ``futures`` and drop their items that are still queued."""
        ids = set()
        for f in futures:
            if not f.done():
                f.cancel()
            ids.add(id(f))
        with self._cond:
            if any(id(it.future) in ids for it in self._queue):
                self._queue = deque(it for it in self._queue if id(it.future) not in ids)

    async def score(self, examples: Iterable) -> list:
        """Results in input order."""
        futures = self.submit(examples)
        try:
            return list(await asyncio.gather(*futures))
        except BaseException:
            self.cancel(futures)
            raise

    async def stream(self, examples: Iterable) -> AsyncIterator:
        """Results as they finish (each with its ``index`` into ``examples``)."""
        futures = self.submit(examples)
        async for r in self.stream_futures(futures):
            yield r

    async def stream_futures(self, futures: Sequence[asyncio.Future]) -> AsyncIterator:
        """Results of already submitted ``futures`` as they finish; leaving early (break,
        cancellation, an exception) cancels the rest."""
        try:
            for f in asyncio.as_completed(futures):
                yield await f
        finally:
            self.cancel(futures)

    # -- worker --------------------------------------------------------------------------------
    def _take(self) -> list[_Item] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            deadline = time.monotonic() + self.max_wait_s
            while not self._closed:
                if len(self._queue) * self._avg_tokens >= self.max_batch_tokens:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            limit = max(1, int(self.max_batch_tokens // max(self._avg_tokens, 1.0)))
            batch = []
            while self._queue and len(batch) < limit:
                batch.append(self._queue.popleft())
            self.running = len(batch)
            return batch

    def _worker(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            batch = [it for it in batch if not it.future.done()]  # drop cancelled callers
            try:
                if batch:
                    self._run(batch)
            finally:
                self.running = 0
                self.batches_done += 1

    def _run(self, batch: list[_Item]) -> None:
        finished = [False] * len(batch)
        try:
            for r in resilient_stream(self.judge, [it.example for it in batch], self.policy):
                item = batch[r.index]
                finished[r.index] = True
                if getattr(r, "prompt_tokens", 0):
                    self._avg_tokens = 0.9 * self._avg_tokens + 0.1 * r.prompt_tokens
                self.items_done += 1
                if not item.future.done():
                    _post(item, dataclasses.replace(r, index=item.index))
        except Exception as bad:  # fails this batch's unfinished callers, not the worker
            failure = bad if isinstance(bad, SystemFailure) else SystemFailure(describe(bad))
            self.system_failures += 1
            self.last_system_failure = (time.time(), str(failure))
            for item, done in zip(batch, finished):
                if not done:
                    _post(item, None, failure)
