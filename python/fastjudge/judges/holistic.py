"""The holistic yes/no baseline: one probability that the image shows the text, read at the
first answer token, for the paper's holistic-vs-decomposed comparison.

Two prompt templates:

* ``"vqascore"`` (default): VQAScore as t2v_metrics computes it for Qwen3-VL / Qwen3.5
  (``t2v_metrics/models/vqascore_models/qwen3vl_model.py``, ``Qwen3VLModel.forward``): one user
  turn holding the image, then the metric's question about the text verbatim; the chat template
  with thinking off; the score is the probability of the first token of ``"Yes"`` at the first
  answer position, under the softmax over the full vocabulary.
* ``"fastjudge"``: fastjudge's own instruction, then the image and a question whose answer words
  are ``yes``/``no`` (each one token, or the judge refuses).

``normalize``: ``"vocab"`` (the full-vocabulary probability, VQAScore's definition; read through
the fused choice head's log-sum-exp, never ``[batch, vocab]`` logits) or ``"yes-no"`` (P(yes)
renormalised over the two answer tokens).

Both prompts end their shared prefix with the image: an image with several captions is
preprocessed once and its prompt state computed once, each caption's question continuing from
it (exact: the backend's prefix reuse).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from ..engine_options import EngineOptions
from ..io.images import MAX_IMAGE_PIXELS, ImageError, LoadedImage, RecentImages, encode_region, image_tensor
from ..runtime.requests import Choice, Image, Request
from .base import Judge

TEMPLATES = ("vqascore", "fastjudge")
NORMALIZATIONS = ("vocab", "yes-no")

INTRO = "You are an image-text evaluator. Look at the image and answer the question with yes or no."

# VQAScore's question: the metric's definition (t2v_metrics,
# t2v_metrics/models/vqascore_models/qwen3vl_model.py, the default question template of
# Qwen3VLModel.forward). Its score is read at the first token of "Yes".
VQASCORE_QUESTION = 'Does this figure show "{}"? Please answer Yes or No.'


def holistic_prompt(image: Image, caption: str) -> tuple[tuple, str]:
    """fastjudge's own prompt, as (shared prefix, rest): the instruction and the image, then the
    question. The prefix ends with the image, so an image's captions share its prompt state."""
    question = f'Does this image show "{" ".join(caption.split())}"? Answer yes or no.'
    return (INTRO + "\n\n", image), "\n" + question


def vqascore_prompt(image: Image, text: str) -> tuple[tuple, str]:
    """VQAScore's user turn, as (shared prefix, rest): the image, then the question with the
    text as given. The prefix (the turn's opening and the image) is the same for every
    caption of one image."""
    return (image,), VQASCORE_QUESTION.format(text)


@dataclass
class HolisticResult:
    """One image-text pair's holistic yes/no judgment (VQAScore by default).

    ``index``: the example's position in the input; ``id``: its ``id``. ``score``: P(yes),
    over the vocabulary (``normalize="vocab"``) or renormalised over {yes, no}; ``probs``:
    ``[P(yes), P(no)]`` under the same normalization; ``decision``: "yes" when P(yes) >= P(no).
    ``prompt_tokens``: the prompt's length; ``error``: why the item was not judged."""

    index: int
    id: object = None
    score: float | None = None  # P(yes): over the vocabulary or renormalised over {yes, no}
    decision: str | None = None  # "yes" when P(yes) >= P(no)
    probs: list[float] = field(default_factory=list)  # [P(yes), P(no)], normalised as score
    error: str | None = None
    prompt_tokens: int | None = None


class HolisticJudge(Judge):
    """One ``Choice`` step per image-text pair. ``examples`` are ``ImageTextExample`` (boxes are
    ignored). ``template`` and ``normalize``: see the module docstring (``normalize`` defaults
    to ``"vocab"`` for ``"vqascore"`` and to ``"yes-no"`` for ``"fastjudge"``).
    ``max_image_pixels``: the pixel budget of an image (see :mod:`fastjudge.io.images`); a
    larger one is that item's error. ``engine``: how the model runs
    (:class:`~fastjudge.engine_options.EngineOptions`; ignored when ``model`` is an open
    backend)."""

    def __init__(self, model, template: str = "vqascore", normalize: str | None = None,
                 image_root: str | os.PathLike | None = None, max_image_pixels: int | None = None,
                 *, engine: EngineOptions | None = None):
        if template not in TEMPLATES:
            raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
        normalize = normalize or ("vocab" if template == "vqascore" else "yes-no")
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
        self.template, self.normalize = template, normalize
        self._open(model, engine, image="the holistic judge")
        self.image_root = image_root
        self.max_image_pixels = max_image_pixels or MAX_IMAGE_PIXELS
        self.yes_no_ids = self._answer_ids()
        self._prompt = vqascore_prompt if template == "vqascore" else holistic_prompt

    def _answer_ids(self) -> tuple[int, int]:
        """The (yes, no) token ids read at the first answer position."""
        if self.template == "fastjudge":
            return self.codec.answer_ids(["yes", "no"], single_token=True).ids
        # VQAScore reads the first token of "Yes" as the response starts with it; "No" likewise
        # (for the decision and ``probs``)
        yes, no = (self.codec.response_ids(word)[0] for word in ("Yes", "No"))
        if yes == no:
            raise ValueError(f'"Yes" and "No" start with the same token ({yes}) for this tokenizer')
        return yes, no

    def _request(self, index: int, example, encoded_images: dict | None = None,
                 images: RecentImages | None = None) -> Request:
        """``encoded_images``: vision inputs by image content key, so an image with several
        captions is preprocessed once; ``images``: the call's recent image sources, so such an
        image is not read (decoded, hashed) again either."""
        text = example.text
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text (the caption) must be a non-empty string")
        self.codec.check_text_length(text, self.backend.max_input_tokens)
        images = images or RecentImages(self.image_root, self.max_image_pixels)
        array, key = images.read(example.image)
        memo = {} if encoded_images is None else encoded_images
        image = memo.get(key)
        if image is None:  # the pixel tensor only for an image not encoded yet
            loaded = LoadedImage(image_tensor(array), key)
            image = memo[key] = encode_region(loaded, (0, 0, loaded.width, loaded.height),
                                              self.codec.image_config)
        encoded = self.codec.encode(*self._prompt(image, text))
        if len(encoded.ids) > self.backend.max_input_tokens:
            raise ValueError(f"prompt is {len(encoded.ids)} tokens, above the model limit of "
                             f"{self.backend.max_input_tokens}")
        return encoded.request(index, Choice(self.yes_no_ids, full_vocab=self.normalize == "vocab"))

    def _probs(self, out) -> list[float]:
        if self.normalize == "vocab":
            return [float(p) for p in np.exp(out.logprobs)]
        return [float(p) for p in out.probs]

    def stream(self, examples: Iterable) -> Iterator[HolisticResult]:
        requests, results, encoded_images = [], {}, {}
        images = RecentImages(self.image_root, self.max_image_pixels)
        for i, example in enumerate(examples):
            result = HolisticResult(index=i, id=getattr(example, "id", None))
            try:
                request = self._request(i, example, encoded_images, images)
            except (ImageError, ValueError, TypeError, AttributeError) as bad:
                result.error = f"invalid example: {bad}"
                yield result
                continue
            result.prompt_tokens = len(request.prompt_ids)
            requests.append(request)
            results[i] = result
        for batch in self.engine.run(requests):
            for out in batch:
                result = results[out.index]
                result.probs = self._probs(out)
                result.score = result.probs[0]
                result.decision = "yes" if result.probs[0] >= result.probs[1] else "no"
                yield result
