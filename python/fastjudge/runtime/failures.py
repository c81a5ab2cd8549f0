"""Two kinds of failure, kept apart by every entry point (file jobs, ``rescore``, Ray actors,
the server, the asyncio API).

* An **item error** belongs to one item's input (a bad field, an unreadable image, a prompt too
  long): the judge reports it on that item's result, or, when the judge raises, an item that
  fails *alone* while the items around it score gets a :class:`FailedItem`. It is that item's
  result row.
* A **system failure** (out of memory on any device, a CUDA or driver error, a backend exception
  no single item explains, a worker that died) is never an item's result: it is retried and,
  when retrying does not help, raised as :class:`SystemFailure` for the caller to stop (a file
  job) or to answer 503 (the server).

:func:`resilient_stream` runs a judge's ``stream`` under these rules:

* **Out of memory**: free what the engine holds (``torch.cuda.empty_cache`` where CUDA is in
  use), split the unfinished items in two halves with half the judge's batch budget each, and go
  on down to one item; an item that still runs out of memory alone gets an item error naming its
  size.
* **A CUDA / driver error or a dead worker**: retry the unfinished items ``retries`` times, the
  pause doubling from ``backoff_s``; then :class:`SystemFailure`.
* **Any other exception**: retried the same way; if it persists, the items run again in halves
  (no more pauses) to find the items it belongs to. Items that fail alone are item errors only
  when other items scored in those runs: when none did, no item explains the failure, and it is
  a :class:`SystemFailure` (so a batch of one item whose failure persists is one too, and so
  is a failure on :data:`GIVE_UP_ALONE` items alone before any item scores).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import sys
import time
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence

log = logging.getLogger("fastjudge")

OUT_OF_MEMORY, DEVICE, OTHER = "out of memory", "device", "other"

# Lower-cased pieces of the messages that the runtimes put in these failures: PyTorch's CUDA /
# HIP / MPS allocators, cuBLAS, the CPU allocator and TensorRT-LLM all say "out of memory" or
# one of these.
_OOM_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory",
              "cublas_status_alloc_failed", "failed to allocate")
_DEVICE_WORDS = ("cuda error", "cuda driver", "cublas_status", "cudnn_status", "cudnn error",
                 "nccl error", "device-side assert", "illegal memory access", "ecc error",
                 "hip error", "unspecified launch failure", "no cuda gpus are available")
# Ray's exceptions for a worker, an actor or a node that is gone (matched by name: Ray is optional)
_DEAD_WORKER_TYPES = {"RayActorError", "ActorDiedError", "ActorUnavailableError",
                      "WorkerCrashedError", "NodeDiedError", "OwnerDiedError", "ObjectLostError",
                      "RaySystemError", "LocalRayletDiedError"}


# Narrowing a persistent failure down stops once this many items failed alone and none scored:
# a backend that fails on everything would otherwise cost two calls per item.
GIVE_UP_ALONE = 4


class SystemFailure(RuntimeError):
    """A failure that is no item's (see the module docstring), after its retries."""


@dataclasses.dataclass
class FailedItem:
    """The result of an item whose failure is its own (it failed alone, or ran out of memory
    alone)."""

    index: int
    id: Any
    error: str


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """``retries``: how many times a batch that failed (not out of memory) runs again;
    ``backoff_s``: the pause before the first retry, doubled for each next one."""

    retries: int = 2
    backoff_s: float = 0.5
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self):
        if self.retries < 0:
            raise ValueError("retries must be >= 0")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def classify(exc: BaseException) -> str:
    """:data:`OUT_OF_MEMORY`, :data:`DEVICE` (CUDA / driver error, dead worker) or
    :data:`OTHER`; the exception's causes count too."""
    kind = OTHER
    for e in _chain(exc):
        name = type(e).__name__
        text = str(e).lower()
        if isinstance(e, MemoryError) or name == "OutOfMemoryError" or \
                any(w in text for w in _OOM_WORDS):
            return OUT_OF_MEMORY
        if name in _DEAD_WORKER_TYPES or name == "AcceleratorError" or \
                any(w in text for w in _DEVICE_WORDS):
            kind = DEVICE
    return kind


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def free_device_memory() -> None:
    """Give back what the engine's allocator caches, once the failed batch's tensors are
    unreachable (a CUDA out-of-memory often leaves most of the memory cached, not used)."""
    gc.collect()
    torch = sys.modules.get("torch")  # never import torch just for this
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _judges(judge) -> Iterator[Any]:
    """The judge and the judges it wraps (``.judge``), each of which may plan batches."""
    seen = set()
    while judge is not None and id(judge) not in seen:
        seen.add(id(judge))
        yield judge
        judge = getattr(judge, "judge", None)


@contextmanager
def scaled_budget(judge, scale: float):
    """The batching limits of the engines of the judge (and of the judges it wraps) times
    ``scale`` (at least 1) until the block ends (``Engine.scaled``)."""
    from .engine import Engine

    with ExitStack() as stack:
        engines = {id(e): e for e in (getattr(j, "engine", None) for j in _judges(judge)) if isinstance(e, Engine)}
        for engine in engines.values():
            stack.enter_context(engine.scaled(scale))
        yield


def prompt_tokens(judge, example) -> int | None:
    """The prompt tokens of ``example`` where the judge (or one it wraps) builds text prompts
    (``build_prompt`` and a ``codec``), else None."""
    for j in _judges(judge):
        build, codec = getattr(j, "build_prompt", None), getattr(j, "codec", None)
        if build is not None and codec is not None:
            try:
                return len(codec.encode_prompt(build(example)))
            except Exception:  # noqa: BLE001 - a size is a courtesy; the error stands without
                return None
    return None


def item_size(judge, example) -> str:
    """How big an item is, for the error of one that runs out of memory alone: its prompt
    tokens where they can be counted, else its text's characters."""
    tokens = prompt_tokens(judge, example)
    if tokens is not None:
        return f"{tokens} prompt tokens"
    fields = dataclasses.astuple(example) if dataclasses.is_dataclass(example) else (example,)
    chars = sum(len(x) for x in fields if isinstance(x, str))
    return f"{chars} characters of text"


def _with_index(result, index: int):
    """A copy of ``result`` (a dataclass or any object with attributes) with ``index``."""
    if dataclasses.is_dataclass(result):
        return dataclasses.replace(result, index=index)
    result = copy.copy(result)
    result.index = index
    return result


class _Run:
    """One :func:`resilient_stream` call."""

    def __init__(self, judge, examples: list, policy: RetryPolicy):
        self.judge, self.examples, self.policy = judge, examples, policy
        self.scored = 0  # results without an error: the judge and its device do work

    def _try(self, indices: list[int], finished: set, scale: float):
        """Yield the judge's results for ``indices`` (their ``index`` mapped back); return the
        exception it raised, or None. ``finished`` collects the indices done."""
        try:
            with scaled_budget(self.judge, scale):
                for r in self.judge.stream([self.examples[i] for i in indices]):
                    original = indices[r.index]
                    finished.add(original)
                    if getattr(r, "error", None) is None:
                        self.scored += 1
                    yield r if original == r.index else _with_index(r, original)
        except Exception as bad:  # noqa: BLE001 - sorted by classify()
            return bad
        return None

    def _failed_alone(self, index: int, reason: str) -> FailedItem:
        ident = getattr(self.examples[index], "id", None)
        log.warning("item %r failed alone: %s", ident, reason)
        return FailedItem(index, ident, reason)

    def _out_of_memory(self, index: int, message: str) -> FailedItem:
        size = item_size(self.judge, self.examples[index])
        return self._failed_alone(index, f"out of memory when scored alone ({size}): {message}")

    def run(self, indices: list[int], scale: float = 1.0) -> Iterator:
        attempt = 0
        while indices:
            finished: set = set()
            failure = yield from self._try(indices, finished, scale)
            if failure is None:
                return
            indices = [i for i in indices if i not in finished]
            kind, message = classify(failure), describe(failure)
            failure = None  # its traceback holds the batch's tensors
            if not indices:
                return
            if kind == OUT_OF_MEMORY:
                free_device_memory()
                log.warning("out of memory on %d item(s); running them in halves", len(indices))
                if len(indices) == 1:
                    yield self._out_of_memory(indices[0], message)
                    return
                half = (len(indices) + 1) // 2
                yield from self.run(indices[:half], scale / 2)
                yield from self.run(indices[half:], scale / 2)
                return
            if attempt < self.policy.retries:
                pause = self.policy.backoff_s * 2 ** attempt
                attempt += 1
                log.warning("%s on %d item(s); retry %d of %d in %.1f s", message, len(indices),
                            attempt, self.policy.retries, pause)
                self.policy.sleep(pause)
                continue
            if kind == DEVICE:
                raise SystemFailure(f"{message} (after {attempt} retries)")
            yield from self._isolate(indices, message, scale)
            return

    def _isolate(self, indices: list[int], message: str, scale: float) -> Iterator:
        """The items in halves, down to single ones, without pauses: those that fail alone are
        item errors if some other item scored meanwhile, else the failure is the system's."""
        alone: list[tuple[int, str]] = []
        scored_before = self.scored
        parts = [indices]
        while parts:
            part = parts.pop()
            finished: set = set()
            failure = yield from self._try(part, finished, scale)
            if failure is None:
                continue
            rest = [i for i in part if i not in finished]
            kind, reason = classify(failure), describe(failure)
            failure = None
            if kind == DEVICE:
                raise SystemFailure(reason)
            if kind == OUT_OF_MEMORY:
                free_device_memory()
                if len(rest) == 1:
                    yield self._out_of_memory(rest[0], reason)
                    continue
            if len(rest) == 1:
                alone.append((rest[0], reason))
                if len(alone) >= GIVE_UP_ALONE and self.scored == scored_before:
                    break  # item after item fails and none scores: not the items' fault
            elif rest:
                half = (len(rest) + 1) // 2
                parts += [rest[half:], rest[:half]]
        if alone and self.scored == scored_before:
            raise SystemFailure(f"{message} (after {self.policy.retries} retries; then on "
                                f"{len(alone)} item(s) run alone, with none scored)")
        for index, reason in alone:
            yield self._failed_alone(index, reason)


def resilient_stream(judge, examples: Sequence, policy: RetryPolicy | None = None) -> Iterator:
    """``judge.stream(examples)`` under the rules of the module docstring: every example gets
    one result (the judge's, or a :class:`FailedItem`), each with ``index`` into ``examples``;
    raises :class:`SystemFailure` for a failure no item explains. Results that finished before
    a failure are kept, never computed twice."""
    examples = list(examples)
    return _Run(judge, examples, policy or RetryPolicy()).run(list(range(len(examples))))
