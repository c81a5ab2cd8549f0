"""The holistic yes/no baseline (VQAScore-style): P(yes) that the image shows the text, read in
one step over the answer words "yes" and "no" (renormalised over the two), for the paper's
holistic-vs-decomposed comparison."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..io.images import ImageError, encode_region, load_image
from ..runtime.requests import Choice, Image, Request
from ..runtime.scheduler import DEFAULT_MAX_BATCH_SIZE, run_requests
from .base import Judge, open_backend

INTRO = "You are an image-text evaluator. Look at the image and answer the question with yes or no."


def holistic_prompt(image: Image, caption: str) -> tuple[str, tuple]:
    """(shared prefix, rest) of the prompt: the instruction, then the image and the question."""
    question = f'Does this image show "{" ".join(caption.split())}"? Answer yes or no.'
    return INTRO + "\n\n", (image, "\n" + question)


@dataclass
class HolisticResult:
    index: int
    id: object = None
    score: float | None = None  # P(yes) renormalised over {yes, no}
    decision: str | None = None
    probs: list[float] = field(default_factory=list)  # [P(yes), P(no)]
    error: str | None = None
    prompt_tokens: int | None = None


class HolisticJudge(Judge):
    """One ``Choice`` step per image-text pair. ``examples`` are ``ImageTextExample`` (boxes are
    ignored). The question text precedes the image, so every prompt shares the instruction
    prefix and carries its own image."""

    def __init__(self, model, backend: str = "torch", device: str = "auto", dtype=None,
                 image_root: str | os.PathLike | None = None, max_batch_tokens: int | None = None,
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, allow_pickle: bool = False,
                 max_input_tokens: int | None = None):
        self.backend = open_backend(model, backend, device, dtype, allow_pickle, max_input_tokens, image="the holistic judge")
        self.image_root = image_root
        self.max_batch_tokens = max_batch_tokens or self.backend.default_batch_tokens
        self.max_batch_size = max_batch_size
        self.codec = self.backend.codec
        # each word as the first token of the response (one token each, or the judge refuses)
        self.yes_no_ids = self.codec.answer_ids(["yes", "no"], single_token=True).ids

    def _request(self, index: int, example) -> Request:
        text = example.text
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text (the caption) must be a non-empty string")
        loaded = load_image(example.image, self.image_root)
        image = encode_region(loaded, (0, 0, loaded.width, loaded.height), self.codec.image_config)
        encoded = self.codec.encode(*holistic_prompt(image, text))
        if len(encoded.ids) > self.backend.max_input_tokens:
            raise ValueError(f"prompt is {len(encoded.ids)} tokens, above the model limit of "
                             f"{self.backend.max_input_tokens}")
        return encoded.request(index, Choice(self.yes_no_ids))

    def stream(self, examples: Iterable) -> Iterator[HolisticResult]:
        requests, results = [], {}
        for i, example in enumerate(examples):
            result = HolisticResult(index=i, id=getattr(example, "id", None))
            try:
                request = self._request(i, example)
            except (ImageError, ValueError, TypeError, AttributeError) as bad:
                result.error = f"invalid example: {bad}"
                yield result
                continue
            result.prompt_tokens = len(request.prompt_ids)
            requests.append(request)
            results[i] = result
        for batch in run_requests(self.backend, requests, self.max_batch_tokens, self.max_batch_size):
            for out in batch:
                result = results[out.index]
                result.probs = [float(p) for p in out.probs]
                result.score = result.probs[0]
                result.decision = "yes" if result.score >= 0.5 else "no"
                yield result
