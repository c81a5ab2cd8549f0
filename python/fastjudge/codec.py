"""Prompt codecs: text and images to model input ids and back, one codec per checkpoint.

Judges speak to a codec, never to a backend's tokenizer. A codec owns everything that depends
on the checkpoint's tokenizer and prompt format:

* the prompt format: :class:`TextCodec` (encoder-decoder judges such as Flan-T5: the text as
  it is, with the tokenizer's EOS) or :class:`ChatCodec` (decoder-only judges such as
  Qwen3/3.5: one user turn and an open assistant turn through the checkpoint's chat template,
  thinking disabled);
* :meth:`~PromptCodec.encode`: a prompt given as a shared prefix and an example-specific rest,
  each a string or a sequence of strings and :class:`~fastjudge.runtime.requests.Image` slots,
  to ids, the images in order and the exact shared-prefix length;
* image slots: an image is a typed slot, expanded by the codec to its token run (vision start,
  one image token per merged patch, vision end) in id space; never placeholder text;
* :meth:`~PromptCodec.check_text_length`: a text too long for a token limit refused before it
  is tokenized;
* :meth:`~PromptCodec.decode`, the EOS ids, and :meth:`~PromptCodec.answer_ids`: the token ids
  of answer strings written right after a response prefix, the one rule every judge and the
  engine manifest use.

The torch backends and the trtllm backend build their codec with :func:`open_codec`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence, Union

import numpy as np

from .runtime.requests import Image, Request

PREFIX_TOKENS_MEMO = 4096  # formatted prefixes whose tokens are remembered

Segment = Union[str, Image]
Segments = Union[str, Sequence[Segment]]


@dataclass(frozen=True)
class ImageTokens:
    """How a multimodal checkpoint writes an image into a prompt: vision start, one image token
    per merged patch of the image's grid, vision end."""

    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    spatial_merge_size: int

    @classmethod
    def from_config(cls, cfg: dict) -> "ImageTokens | None":
        if not cfg.get("vision_config"):
            return None
        return cls(cfg["image_token_id"], cfg["vision_start_token_id"], cfg["vision_end_token_id"],
                   cfg["vision_config"].get("spatial_merge_size", 2))

    def count(self, grid_thw: Sequence[int]) -> int:
        """Image tokens of one image of this (t, h, w) patch grid."""
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // self.spatial_merge_size ** 2


@dataclass(frozen=True)
class AnswerIds:
    """Token ids of answers written after a response prefix: ``forced``, the tokens every
    answer shares (the response is forced to start with them), and ``ids``, each answer's next
    token there, in the order the answers were given."""

    forced: tuple[int, ...]
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Encoded:
    """An encoded prompt: model input ids, the images of its image slots in order, and how many
    leading ids (holding ``prefix_images`` of the images) are the exact shared prefix."""

    ids: np.ndarray
    images: tuple[Image, ...] = ()
    prefix_len: int = 0
    prefix_images: int = 0

    def request(self, index: int, spec, response_prefix: Sequence[int] = (), keep_prefix: bool = False) -> Request:
        return Request(index=index, prompt_ids=self.ids, spec=spec, response_prefix=tuple(response_prefix),
                       prefix_len=self.prefix_len, images=self.images, prefix_images=self.prefix_images,
                       keep_prefix=keep_prefix)


def _segments(parts: Segments) -> tuple[Segment, ...]:
    return (parts,) if isinstance(parts, str) else tuple(parts)


class PromptCodec:
    """What both prompt formats share: response tokenization, decoding, answer ids."""

    kind = ""
    image_tokens: ImageTokens | None = None
    image_config = None  # kernels.crop_encode.CropEncodeConfig of a multimodal checkpoint

    def __init__(self, tokenizer, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.pad_token_id = tokenizer.pad_token_id or 0

    # -- implemented per format ----------------------------------------------------------------
    def encode(self, prefix: Segments, rest: Segments = ()) -> Encoded:
        raise NotImplementedError

    def format_prompt(self, text: str) -> str:
        """The model input text for a prompt text."""
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------------
    def encode_prompt(self, text: str) -> np.ndarray:
        """Model input ids of a text-only prompt (no shared prefix)."""
        return self.encode(text).ids

    def response_ids(self, text: str) -> list[int]:
        """Ids of ``text`` as the start of the model's response."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @cached_property
    def longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry as the tokenizer stores it (added tokens
        included). No token stands for more characters of the text than its entry has: a
        byte-level entry has one character per byte, a SentencePiece entry one per character."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)

    def max_text_chars(self, max_tokens: int) -> int:
        """The most characters a prompt of ``max_tokens`` tokens can hold."""
        return max_tokens * self.longest_token_chars

    def check_text_length(self, parts: Segments, max_tokens: int) -> None:
        """ValueError, before any tokenizing, when the text of ``parts`` (a string, or a
        sequence of strings and image slots) has more characters than ``max_tokens`` tokens can
        hold (:meth:`max_text_chars`), so an over-long text costs time independent of its size.
        Text that the tokenizer's normalizer would shrink (runs of spaces it collapses, marks it
        composes) is counted as given, and so refused as well past that length."""
        chars = sum(len(p) for p in _segments(parts) if isinstance(p, str))
        limit = self.max_text_chars(max_tokens)
        if chars > limit:
            raise ValueError(f"text is {chars} characters, more than a prompt of {max_tokens} "
                             f"tokens can hold ({limit} characters with this tokenizer); not "
                             "tokenized")

    def answer_ids(self, answers: Sequence[str], after: str = "", single_token: bool = False) -> AnswerIds:
        """Token ids of ``answers`` as the model writes them right after ``after`` in its
        response: the longest token prefix all answers share is forced, and each answer is read
        at its next token (a word of several tokens is read at its first).

        ``single_token``: each answer must be exactly one token after a forced prefix that is
        ``after`` tokenized alone (so the prefix can be forced as its own tokens) and must decode
        back to itself; ValueError otherwise, naming the answer and its tokens."""
        full = [self.response_ids(after + a) for a in answers]
        n = 0
        while all(len(f) > n for f in full) and len({f[n] for f in full}) == 1:
            n += 1
        if any(len(f) <= n for f in full) or len({f[n] for f in full}) < len(full):
            raise ValueError(f"the tokenizer does not tell the answers {list(answers)} apart after {after!r}")
        forced = tuple(full[0][:n])
        if single_token:
            alone = tuple(self.response_ids(after)) if after else ()
            for a, f in zip(answers, full):
                if forced != alone or len(f) != n + 1:
                    pieces = f[len(alone):] if tuple(f[: len(alone)]) == alone else f
                    raise ValueError(f"answer {a!r} after {after!r} is not a single token for this tokenizer "
                                     f"(got ids {pieces}); a one-step answer needs one token per answer")
                if self.decode(f[-1:]).strip() != a.strip():
                    raise ValueError(f"answer {a!r} after {after!r} maps to token {f[-1]}, which decodes to "
                                     f"{self.decode(f[-1:])!r} (unknown token?)")
        return AnswerIds(forced, tuple(f[n] for f in full))


class TextCodec(PromptCodec):
    """Encoder-decoder judges (Flan-T5): the prompt is the encoder input as transformers'
    tokenizer gives it (with EOS). The bidirectional encoder allows no exact prefix reuse, so
    the shared-prefix length is always 0. No image slots."""

    kind = "encoder-decoder"

    def format_prompt(self, text: str) -> str:
        return text

    def encode(self, prefix: Segments, rest: Segments = ()) -> Encoded:
        parts = _segments(prefix) + _segments(rest)
        if not all(isinstance(p, str) for p in parts):
            raise ValueError("this judge model takes no images")
        return Encoded(np.asarray(self.tokenizer("".join(parts)).input_ids, dtype=np.int64))


class ChatCodec(PromptCodec):
    """Decoder-only chat judges (Qwen3/3.5): one user turn and an open assistant turn.

    ``exact_prefix``: report the shared prefix (a backend that reuses prefix states runs it
    once); off for backends that find shared prefixes themselves.

    Images: each image slot is written as vision start + one image token + vision end, the whole
    text goes through the chat template and the tokenizer, and each image token is then
    expanded to the image's token count. Special tokens are never split or merged by the
    tokenizer, so this gives the ids the expanded text would give (what the Qwen processor
    does). A prompt whose text holds image tokens of its own is refused."""

    kind = "decoder-only"

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], image_tokens: ImageTokens | None = None,
                 image_config=None, exact_prefix: bool = True):
        super().__init__(tokenizer, eos_token_ids)
        self.image_tokens = image_tokens
        self.image_config = image_config
        self.exact_prefix = exact_prefix
        # formatted-prefix tokens by prefix text; bounded, since image-text judges have one prefix
        # per example
        self._prefix_ids: OrderedDict[str, np.ndarray] = OrderedDict()
        self._slot_text: str | None = None

    def format_prompt(self, text: str) -> str:
        """The user turn and an open assistant turn, through the checkpoint's chat template with
        thinking disabled (Qwen3/3.5 templates then open the answer with an empty
        <think></think> block). Without a template: the same turn structure written out."""
        messages = [{"role": "user", "content": text}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=False)
        return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"

    def _text(self, parts: tuple[Segment, ...]) -> tuple[str, tuple[Image, ...]]:
        """Prompt text with one image token per slot, and the slots' images in order."""
        images = tuple(p for p in parts if isinstance(p, Image))
        if images and self._slot_text is None:
            self._slot_text = self._image_slot_text()
        return "".join(self._slot_text if isinstance(p, Image) else p for p in parts), images

    def _image_slot_text(self) -> str:
        if self.image_tokens is None:
            raise ValueError("this judge model has no vision tower; it takes no images")
        t = self.image_tokens
        tokens = self.tokenizer.convert_ids_to_tokens([t.vision_start_id, t.image_token_id, t.vision_end_id])
        if None in tokens:
            raise ValueError("the tokenizer lacks the checkpoint's vision tokens; it takes no images")
        return "".join(tokens)

    def _ids(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)

    def _expand(self, ids: np.ndarray, images: Sequence[Image]) -> np.ndarray:
        """Each image token of ``ids`` expanded to its image's token run."""
        if self.image_tokens is None:
            return ids
        at = np.flatnonzero(ids == self.image_tokens.image_token_id)
        if len(at) != len(images):
            raise ValueError(f"the prompt holds {len(at)} image tokens for {len(images)} images "
                             "(image tokens in the text?)")
        if not len(at):
            return ids
        counts = np.ones(len(ids), dtype=np.int64)
        counts[at] = [self.image_tokens.count(im.grid_thw) for im in images]
        return np.repeat(ids, counts)

    def _prefix_tokens(self, prefix_text: str) -> np.ndarray:
        """Tokens of the formatted prompt up to the end of ``prefix_text`` (image slots not yet
        expanded), remembered by prefix text."""
        cached = self._prefix_ids.get(prefix_text)
        if cached is None:
            formatted = self.format_prompt(prefix_text)
            cut = formatted.rfind(prefix_text)
            cached = self._ids(formatted[: cut + len(prefix_text)])
            self._prefix_ids[prefix_text] = cached
            if len(self._prefix_ids) > PREFIX_TOKENS_MEMO:
                self._prefix_ids.popitem(last=False)
        return cached

    def encode(self, prefix: Segments, rest: Segments = ()) -> Encoded:
        prefix_text, prefix_images = self._text(_segments(prefix))
        rest_text, rest_images = self._text(_segments(rest))
        images = prefix_images + rest_images
        ids = self._expand(self._ids(self.format_prompt(prefix_text + rest_text)), images)
        if not (self.exact_prefix and prefix_text):
            return Encoded(ids, images)
        # every slot of the prefix lies inside the formatted prefix, cut at the prefix text's end
        head = self._expand(self._prefix_tokens(prefix_text), prefix_images)
        n = min(len(head), len(ids) - 1)
        mismatch = np.nonzero(head[:n] != ids[:n])[0]
        # Exact by construction: the shared part is this prompt's own leading tokens. A prompt
        # whose tokens diverge early at the boundary gets a shorter prefix (another group).
        prefix_len = int(mismatch[0] if len(mismatch) else n)
        return Encoded(ids, images, prefix_len, self._images_before(ids, prefix_len))

    def _images_before(self, ids: np.ndarray, end: int) -> int:
        """Images whose token runs lie inside ``ids[:end]``; an end inside a run is refused."""
        if self.image_tokens is None:
            return 0
        is_image = np.concatenate([[False], ids == self.image_tokens.image_token_id, [False]])
        edges = np.flatnonzero(is_image[1:] != is_image[:-1])
        runs = list(zip(edges[::2].tolist(), edges[1::2].tolist()))
        if any(start < end < stop for start, stop in runs):
            raise ValueError("the shared prefix ends inside an image")
        return sum(1 for _, stop in runs if stop <= end)


def open_codec(model_dir: str | os.PathLike, cfg: dict, kind: str, eos_token_id: int | None = None,
               exact_prefix: bool = True) -> PromptCodec:
    """The codec of a checkpoint (or engine build) directory: ``kind`` "encoder-decoder" or
    "decoder-only"; ``eos_token_id``: the encoder-decoder model's EOS (from its config)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if kind == "encoder-decoder":
        return TextCodec(tokenizer, [eos_token_id if eos_token_id is not None else tokenizer.eos_token_id])
    eos = [t for t in (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id)
           if isinstance(t, int) and t >= 0]
    image_tokens = ImageTokens.from_config(cfg)
    image_config = None
    if image_tokens is not None and os.path.exists(os.path.join(model_dir, "preprocessor_config.json")):
        # Image preprocessing (crop_encode) follows the checkpoint's preprocessor config; a
        # checkpoint without one can still run images given as ready pixel values.
        from .kernels.crop_encode import CropEncodeConfig

        image_config = CropEncodeConfig.from_preprocessor_config(model_dir)
    return ChatCodec(tokenizer, eos, image_tokens, image_config, exact_prefix)
