"""What a judge asks of a backend, and what comes back.

A judge turns each example into a :class:`Request`: prompt token ids plus an output spec. The
spec says how little the model needs to do. :class:`Choice` is the fast path: one forward step
whose next-token distribution is read only at K candidate tokens. :class:`Text` is greedy
decoding, used only when the metric reads the text (a rationale).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np


@dataclass(frozen=True)
class Choice:
    """Score-only: the probability of each candidate token at the next position.

    ``probs`` in the output are the softmax over the K candidate logits (renormalised among the
    candidates, as a judge that must pick one of them would). ``full_vocab``: the output also
    carries ``logprobs``, the candidates' log-probabilities under the softmax over the whole
    vocabulary (a metric defined as one token's probability, such as VQAScore's P("Yes")).
    """

    token_ids: tuple[int, ...]
    full_vocab: bool = False


@dataclass(frozen=True)
class Text:
    """Greedy decoding until EOS or ``max_new_tokens``.

    ``track_ids``: candidate tokens whose logits are kept at every step, so the judge can read a
    distribution over them at the step that produced its answer without decoding again.
    """

    max_new_tokens: int
    track_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:  # a row with no room for a token has nothing to decode
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")


OutputSpec = Union[Choice, Text]  # and runtime.grammar.Json (constrained decoding)


@dataclass(frozen=True, eq=False)
class Image:
    """One image in a prompt: the vision-tower input behind one run of image tokens.

    ``pixel_values`` ``[patches, patch_dim]`` and ``grid_thw`` as the Qwen image processor (or
    ``kernels.crop_encode``) gives them for this image alone. ``key`` identifies the content
    (source image, crop box, preprocessing): image tokens are the same ids for every image, so
    prefix states and cached embeddings are keyed by it, never by the tokens alone."""

    pixel_values: object  # torch.Tensor; typed loosely so this module needs no torch
    grid_thw: tuple[int, int, int]
    key: bytes


@dataclass
class Request:
    """One model call.

    ``prompt_ids`` is the full model input (encoder input for encoder-decoder models).
    ``response_prefix`` are tokens the response is forced to start with (decoder input after the
    start token for encoder-decoder models; appended to the prompt for decoder-only models).
    ``prefix_len``: the first ``prefix_len`` prompt tokens are shared with other requests
    (instructions, demonstrations); backends that reuse prefix state run them once.
    ``images``: one :class:`Image` per run of image tokens in ``prompt_ids``, in order;
    ``prefix_images``: how many of them lie inside the shared prefix. ``keep_prefix``: the prefix
    will be asked for again after this call (a judge's later stages, every item's demonstrations):
    a backend that reuses prefixes runs it once and caches it even when no other request of the
    call shares it.
    """

    index: int
    prompt_ids: np.ndarray
    spec: OutputSpec
    response_prefix: tuple[int, ...] = ()
    prefix_len: int = 0
    images: tuple[Image, ...] = ()
    prefix_images: int = 0
    keep_prefix: bool = False

    @property
    def num_tokens(self) -> int:
        return int(len(self.prompt_ids)) + len(self.response_prefix)


@dataclass
class Output:
    """What the backend computed for one request.

    For :class:`Choice`: ``probs`` (K,) and ``logits`` (K,); with ``full_vocab``, ``logprobs``
    (K,) over the whole vocabulary.
    For :class:`Text`: ``token_ids`` (generated, without EOS), ``finished`` (EOS seen) and, when
    ``track_ids`` were given, ``tracked_logits`` (steps, K).
    """

    index: int
    probs: np.ndarray | None = None
    logits: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    tracked_logits: np.ndarray | None = None


def choice_probs(logits: Sequence[float]) -> np.ndarray:
    """Softmax over a handful of candidate logits, in float64 for stable comparisons."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()
