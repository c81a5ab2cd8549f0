"""The one interface between judges (and the runtime) and a model backend.

Judges build requests with the backend's :attr:`Backend.codec` and hand them to
``runtime.scheduler.run_requests``; nothing else of a backend is theirs to touch. The torch
backends (Flan-T5, Qwen3/3.5) and the TensorRT-LLM backend all satisfy it (tests check).
"""

from __future__ import annotations

from typing import Hashable, Protocol, Sequence, runtime_checkable

from ..codec import PromptCodec
from ..runtime.requests import Output, Request


@runtime_checkable
class Backend(Protocol):
    #: text and images <-> ids for this checkpoint (prompt format, image slots, EOS, answer ids)
    codec: PromptCodec
    #: "encoder-decoder" or "decoder-only"
    kind: str
    #: the longest prompt (in tokens) the judge may send; longer items are errors, never cut
    max_input_tokens: int
    #: the planner's token budget per batch when the judge names none
    default_batch_tokens: int

    def cost(self, request: Request) -> int:
        """Tokens ``request`` occupies in a batch (what the planner packs)."""

    def group_key(self, request: Request) -> Hashable:
        """Requests with different keys never share a batch (e.g. different cached prefixes)."""

    def run(self, batch: Sequence[Request]) -> list[Output]:
        """Execute one planned batch; one output per request, in any order, by ``index``."""

    # Optional: ``route(requests) -> list[Request]``, the requests as the backend will run them,
    # called once per call before planning (the Qwen backend drops a shared prefix where running
    # the whole prompt is cheaper; ``backends.qwen.routing``).


def check_backend(backend) -> None:
    """Raise TypeError naming what ``backend`` lacks of :class:`Backend`."""
    missing = [name for name in (*Backend.__annotations__, "cost", "group_key", "run")
               if not hasattr(backend, name)]
    if missing:
        raise TypeError(f"{type(backend).__name__} is not a fastjudge backend: it lacks {', '.join(missing)}")
