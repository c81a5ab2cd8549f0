"""Chat completions on the served judge's own decoder-only (Qwen) model.

The server's batcher thread owns the model, so chat completions run there too:
:class:`ChatJudge` stands in front of the judge in the batcher and runs the
:class:`~.openai_protocol.ChatExample` items of a batch as greedy ``Text`` requests (``Json``
under a response format's schema) through the backend, beside the judge's own items. Chats of
concurrent requests that ask for the same output spec share decoding batches. The tokenizer is
used on that thread only (a fast tokenizer must not be called from two threads at once).

Prompts: the messages through the checkpoint's chat template with thinking disabled, as the
judges' own prompts (``codec.ChatCodec``); a template-less checkpoint gets Qwen's turn markup.
Images (``image_url`` parts) take the judges' path: decoded under the judge's pixel budget
(:func:`fastjudge.io.images.read_image`), preprocessed for the vision tower
(:func:`~fastjudge.io.images.encode_region` on the whole image), written into the prompt as the
codec's image slot (vision start, image token, vision end) and expanded to the image's token
run, so the model sees what the image judges give it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from ..engine_options import DEFAULT_MAX_BATCH_SIZE
from ..runtime.requests import Request, Text
from ..runtime.scheduler import run_requests
from .openai_protocol import ChatExample, ImagePart

DEFAULT_MAX_COMPLETION_TOKENS = 1024


@dataclass
class ChatResult:
    """One chat completion, or why its prompt was refused (``error``, ``code``: a 400)."""

    index: int
    id: Any = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    content: str = ""
    pieces: list[str] = field(default_factory=list)  # each token's text, for a stream
    token_ids: list[int] = field(default_factory=list)  # what the model generated
    finish_reason: str = "stop"
    error: str | None = None
    code: str | None = None


class PromptError(ValueError):
    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


def chat_backend(judge):
    """The judge's backend when it can serve chat completions (a decoder-only model)."""
    backend = getattr(judge, "backend", None)
    return backend if getattr(backend, "kind", None) == "decoder-only" else None


def served_model_id(judge, judge_name: str) -> str | None:
    """The name ``/v1/models`` lists: the checkpoint folder's name (None: no chat model)."""
    backend = chat_backend(judge)
    if backend is None:
        return None
    path = str(getattr(backend.codec.tokenizer, "name_or_path", "") or "").rstrip("/\\")
    return os.path.basename(path) or f"fastjudge-{judge_name}"


def render_messages(tokenizer, messages: list[dict]) -> str:
    if getattr(tokenizer, "chat_template", None):
        from jinja2.exceptions import TemplateError

        try:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True,
                                                 enable_thinking=False)
        except TemplateError as bad:  # e.g. a system turn that is not first
            raise PromptError(f"the model's chat template refuses these messages: {bad}") from None
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def token_pieces(decode, tokens: Sequence[int], text: str) -> list[str]:
    """The text each token adds, joining to ``text`` (the decoded whole). A token that ends
    inside a multi-byte character adds nothing until the character is whole."""
    pieces, shown = [], ""
    for n in range(1, len(tokens)):
        now = decode(tokens[:n])
        if now.startswith(shown) and not now.endswith("\ufffd"):
            pieces.append(now[len(shown):])
            shown = now
        else:
            pieces.append("")
    if not text.startswith(shown):  # a decoder that rewrites earlier text: one piece
        return [text]
    return pieces + [text[len(shown):]]


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


def trim_pieces(pieces: list[str], length: int) -> list[str]:
    out, used = [], 0
    for piece in pieces:
        take = piece[: max(length - used, 0)]
        out.append(take)
        used += len(take)
    return out


class ChatJudge:
    """``judge`` behind its own ``stream`` interface, also running chat completions.
    ``max_completion_tokens``: the most tokens one completion gets."""

    def __init__(self, judge, max_completion_tokens: int = DEFAULT_MAX_COMPLETION_TOKENS):
        self.judge = judge
        self.backend = chat_backend(judge)
        self.max_completion_tokens = int(max_completion_tokens)
        self.max_batch_tokens = getattr(judge, "max_batch_tokens", None)
        self.max_batch_size = getattr(judge, "max_batch_size", DEFAULT_MAX_BATCH_SIZE)

    def stream(self, examples: Sequence) -> Iterator:
        examples = list(examples)
        chats = [i for i, e in enumerate(examples) if isinstance(e, ChatExample)]
        if not chats:
            yield from self.judge.stream(examples)
            return
        others = [i for i, e in enumerate(examples) if not isinstance(e, ChatExample)]
        if others:
            for r in self.judge.stream([examples[i] for i in others]):
                yield dataclasses.replace(r, index=others[r.index])
        yield from self._chats({i: examples[i] for i in chats})

    def _chats(self, chats: dict[int, ChatExample]) -> Iterator[ChatResult]:
        if self.backend is None:
            raise ValueError("this judge's model is not a decoder-only chat model")
        requests = []
        for i, example in chats.items():
            try:
                requests.append(self._request(i, example))
            except PromptError as bad:
                yield ChatResult(i, error=str(bad), code=bad.code)
        budget = self.max_batch_tokens or self.backend.default_batch_tokens
        by_index = {r.index: r for r in requests}
        for outputs in run_requests(self.backend, requests, budget, self.max_batch_size):
            for out in outputs:
                yield self._result(chats[out.index], by_index[out.index], out)

    def _images(self, example: ChatExample) -> tuple[list[dict], tuple]:
        """The messages with each image as the codec's image slot text, and the images encoded
        for the vision tower, in order (a :class:`PromptError` for an image that cannot be)."""
        from ..io.images import MAX_IMAGE_PIXELS, ImageError, LoadedImage, encode_region, image_tensor, read_image

        codec = self.backend.codec
        if not any(isinstance(m["content"], list) for m in example.messages):
            return example.messages, ()
        if codec.image_tokens is None or codec.image_config is None:
            raise PromptError("this server's model has no vision tower (or no image "
                              "preprocessor config); send text only", "image_not_supported")
        budget = getattr(self.judge, "max_image_pixels", None) or MAX_IMAGE_PIXELS
        messages, images = [], []
        for m in example.messages:
            if not isinstance(m["content"], list):
                messages.append(m)
                continue
            parts = []
            for part in m["content"]:
                if not isinstance(part, ImagePart):
                    parts.append(part)
                    continue
                try:
                    array, key = read_image(part.data, None, budget)
                    loaded = LoadedImage(image_tensor(array), key)
                    image = encode_region(loaded, (0, 0, loaded.width, loaded.height),
                                          codec.image_config)
                except ImageError as bad:
                    raise PromptError(f"{part.where}: {bad}", "invalid_image") from None
                parts.append(image)
                images.append(image)
            text, _ = codec._text(tuple(parts))  # each image as the codec's slot text
            messages.append({"role": m["role"], "content": text})
        return messages, tuple(images)

    def _request(self, index: int, example: ChatExample) -> Request:
        backend = self.backend
        codec, limit = backend.codec, backend.max_input_tokens
        messages, images = self._images(example)
        text = render_messages(codec.tokenizer, messages)
        too_long = "context_length_exceeded"
        try:
            codec.check_text_length(text, limit)
        except ValueError as bad:
            raise PromptError(f"the prompt {bad}", too_long) from None
        ids = np.asarray(codec.tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)
        slots = codec.image_tokens
        if slots is not None:
            # the only vision tokens are the slots written for the images
            counts = [int(np.count_nonzero(ids == t)) for t in
                      (slots.image_token_id, slots.vision_start_id, slots.vision_end_id)]
            if counts != [len(images)] * 3:
                raise PromptError("the messages' text holds the model's image tokens; send "
                                  "images as image_url parts")
            ids = codec._expand(ids, images)
        if len(ids) > limit:
            raise PromptError(f"the prompt is {len(ids)} tokens, above this server's limit of "
                              f"{limit}", too_long)
        new = min(example.max_tokens or self.max_completion_tokens, self.max_completion_tokens)
        context = getattr(getattr(backend, "shape", None), "max_positions", None)
        if context:
            new = min(new, context - len(ids))
        if new < 1:
            raise PromptError(f"the prompt ({len(ids)} tokens) leaves no room for a completion "
                              f"in the model's context of {context}", too_long)
        if example.schema is None:
            spec = Text(new)
        else:
            from ..runtime.grammar import Json

            spec = Json.from_schema(example.schema, new)
        return Request(index=index, prompt_ids=ids, spec=spec, images=images)

    def _result(self, example: ChatExample, request: Request, out) -> ChatResult:
        decode = self.backend.codec.decode
        text = decode(out.token_ids)
        content, stopped = cut_at_stop(text, example.stop)
        pieces = []
        if example.pieces:
            pieces = trim_pieces(token_pieces(decode, out.token_ids, text), len(content))
        return ChatResult(request.index, example.id, prompt_tokens=len(request.prompt_ids),
                          completion_tokens=len(out.token_ids), content=content, pieces=pieces,
                          token_ids=list(out.token_ids),
                          finish_reason="stop" if out.finished or stopped else "length")
