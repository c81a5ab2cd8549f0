"""One item's failure stays that item's: the judge as the server's batcher runs it.

The batcher merges the items of concurrent requests into one ``judge.stream`` call, so an
exception there (an image the decoder refuses, a bug a strange input reaches) would fail every
request that shared the batch. :class:`IsolatingJudge` runs the batch; when the judge raises, the
items it had not finished run again in halves, down to single items, and only an item that
fails alone gets an error result (:class:`FailedItem`). Items that finished keep their results.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterator, Sequence

log = logging.getLogger("fastjudge")


@dataclasses.dataclass
class FailedItem:
    """The result of an item the judge raised on when run alone."""

    index: int
    id: Any
    error: str


class IsolatingJudge:
    """``judge`` behind the same ``stream`` interface, confining each failure to its item."""

    def __init__(self, judge):
        self.judge = judge
        self.max_batch_tokens = getattr(judge, "max_batch_tokens", None)

    def stream(self, examples: Sequence) -> Iterator:
        examples = list(examples)
        yield from self._stream(examples, list(range(len(examples))))

    def _stream(self, examples: list, indices: list[int]) -> Iterator:
        finished = set()
        try:
            for r in self.judge.stream([examples[i] for i in indices]):
                finished.add(r.index)
                original = indices[r.index]
                yield r if original == r.index else dataclasses.replace(r, index=original)
            return
        except Exception as bad:  # noqa: BLE001 - narrowed below to the item that fails alone
            failure = bad
        if len(indices) == 1:
            ident = getattr(examples[indices[0]], "id", None)
            log.warning("item %r failed alone: %s: %s", ident, type(failure).__name__, failure)
            yield FailedItem(indices[0], ident, f"{type(failure).__name__}: {failure}")
            return
        rest = [i for position, i in enumerate(indices) if position not in finished]
        half = (len(rest) + 1) // 2
        for part in (rest[:half], rest[half:]):
            if part:
                yield from self._stream(examples, part)
