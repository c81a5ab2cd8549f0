"""OpenAI chat-completions requests read into :class:`ChatExample`, and the answer bodies.

What a request may hold, and why (the clients are the evaluation harnesses that call a judge
through an OpenAI-compatible server):

* ``messages``: ``system`` / ``developer`` (read as system) / ``user`` / ``assistant`` turns;
  content a string, ``null`` (an assistant turn: empty) or a list of ``{"type": "text"}``
  and ``{"type": "image_url", "image_url": {"url": ...}}`` parts, text parts joined with
  newlines. An image is a ``data:image/...;base64,`` URL; a remote ``http(s)`` URL only when
  it starts with one of the server's allowed prefixes (``--image-url-prefix``; none by
  default), and it is then fetched by the route, bounded in size and time. The images go
  through the judge's own image path (pixel budget, preprocessing, vision tower) on a
  vision-language checkpoint; a text-only model answers 400. Audio, files, video, tools and
  tool turns are refused with 400.
* Decoding is greedy, always. ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``seed`` are
  accepted and ignored: harness tasks send temperatures above 0 and would fail after their
  retries on a 400, and a judge's answer should not depend on a draw anyway. Options that would
  change even a greedy answer (``presence_penalty``, ``frequency_penalty``,
  ``repetition_penalty``, ``logit_bias``), or ask for what greedy decoding cannot give
  (``n`` > 1, ``logprobs``), are refused with 400 unless they hold their neutral value.
* ``max_tokens`` / ``max_completion_tokens`` ask for at most that many tokens; the server
  gives ``min(asked, its own limit, the context left)``.
* ``response_format``: ``text``; ``json_object`` (any JSON object); ``json_schema`` with
  ``json_schema.schema`` (the output is JSON valid under it, see ``runtime.grammar``).
* ``stop``: up to 4 strings; the text ends before the first one found.
* Any other field is ignored (harnesses pass their own extra arguments through).

Errors are OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from pydantic import ValidationError

from ..io.validation import describe, problems
from . import openai_schemas as api

# the chat template's role of each request role
TEMPLATE_ROLES = {role: "system" if role == "developer" else role for role in api.ROLES}


class OpenAIRefusal(Exception):
    """A request answered with an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_error",
               504: "timeout_error"}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return api.OpenAIError(error=api.OpenAIErrorDetail(message=message, type=kind, param=param,
                                                       code=code)).model_dump()


@dataclass(eq=False)
class ImagePart:
    """An image of a message: its encoded bytes (a ``data:`` URL's), or, until the route has
    fetched it, the allowed remote ``url``. ``where`` names the content part in errors."""

    data: bytes | None = None
    url: str | None = None
    where: str = ""


_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[^;,]*)*)"
                       r"(?P<b64>;base64)?,(?P<data>.*)", re.S)


def image_part(part: api.ImageUrlPart, at: str, url_prefixes: Sequence[str] = ()) -> ImagePart:
    """The image of an ``image_url`` content part (400 for a URL that is not taken)."""
    url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
    if not url:
        raise _bad(f'{at}: expected {{"type": "image_url", "image_url": {{"url": "data:..."}}}}',
                   at)
    if url.startswith("data:"):
        found = _DATA_URL.fullmatch(url)
        if found is None or not found["b64"]:
            raise _bad(f"{at}: a data URL image must be base64 (data:image/png;base64,...)", at)
        if found["type"] and not found["type"].startswith("image/"):
            raise _bad(f"{at}: the data URL holds {found['type']}, not an image", at)
        try:
            data = base64.b64decode(re.sub(r"\s+", "", found["data"]), validate=True)
        except (binascii.Error, ValueError):
            raise _bad(f"{at}: the data URL's base64 does not decode", at) from None
        return ImagePart(data=data, where=at)
    if url.lower().startswith(("http://", "https://")):
        if any(url.startswith(prefix) for prefix in url_prefixes):
            return ImagePart(url=url, where=at)
        raise _bad(f"{at}: remote image URLs are refused (this server fetches only URLs under "
                   "its --image-url-prefix list); send the image as a data: URL", at)
    raise _bad(f"{at}: an image_url must be a data: URL (data:image/png;base64,...)", at)


@dataclass
class ChatExample:
    """One chat completion for the judge's model. ``messages``: ``{"role", "content"}`` with
    string content, or for a turn with images a list of strings and :class:`ImagePart`;
    ``max_tokens``: what the client asked (None: the server's limit);
    ``schema``: JSON-schema text the output must satisfy (None: free text); ``pieces``: keep
    the text of each token for a stream."""

    messages: list[dict]
    max_tokens: int | None = None
    schema: str | None = None
    stop: tuple[str, ...] = ()
    pieces: bool = False
    id: Any = None


def _bad(message: str, param: str) -> OpenAIRefusal:
    return OpenAIRefusal(400, message, param)


def _content(content: Any, where: str, url_prefixes: Sequence[str] = ()):
    """A validated turn's content: a string, or (with images) a list of strings and
    :class:`ImagePart`; adjacent text parts are joined with newlines."""
    if content is None:  # an assistant turn (the model allows null nowhere else)
        return ""
    if isinstance(content, str):
        return content
    parts: list = []
    for j, part in enumerate(content):
        if isinstance(part, api.TextPart):
            if parts and isinstance(parts[-1], str):
                parts[-1] += "\n" + part.text
            else:
                parts.append(part.text)
        else:
            parts.append(image_part(part, f"{where}.content[{j}]", url_prefixes))
    if all(isinstance(p, str) for p in parts):
        return "\n".join(parts)
    return parts


def images_of(example: "ChatExample") -> list[ImagePart]:
    """The example's images, in message order."""
    return [p for m in example.messages if isinstance(m["content"], list)
            for p in m["content"] if isinstance(p, ImagePart)]


def _schema(fmt: Any) -> str | None:
    """The JSON-schema text a response format asks the output to satisfy (None: free text)."""
    if isinstance(fmt, api.JsonObjectFormat):
        return json.dumps({"type": "object"})
    if isinstance(fmt, api.JsonSchemaFormat):
        return json.dumps(fmt.json_schema.json_schema)
    return None


def parse_chat_request(body: Any, url_prefixes: Sequence[str] = ()) -> tuple[ChatExample, bool, bool]:
    """The example of a ``/v1/chat/completions`` body (validated by
    :class:`~.openai_schemas.ChatCompletionRequest`), whether to stream, and whether a stream
    ends with a usage chunk. Raises :class:`OpenAIRefusal` (400) naming the field.
    ``url_prefixes``: the remote image URLs taken (the route fetches them)."""
    try:
        request = api.ChatCompletionRequest.model_validate(body)
    except ValidationError as bad:
        place = problems(bad, body)[0][0]
        raise _bad(describe(bad, body), None if place == "body" else place) from None
    messages = [{"role": TEMPLATE_ROLES[m.role], "content": _content(m.content, f"messages[{i}]",
                                                            url_prefixes)}
                for i, m in enumerate(request.messages)]
    stop = request.stop or ()
    stream = bool(request.stream)
    example = ChatExample(messages, request.max_completion_tokens or request.max_tokens,
                          _schema(request.response_format),
                          (stop,) if isinstance(stop, str) else tuple(stop), pieces=stream)
    include_usage = request.stream_options is not None and bool(request.stream_options.include_usage)
    return example, stream, include_usage


# -- answers -----------------------------------------------------------------------------------
def usage(result) -> api.Usage:
    return api.Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                     total_tokens=result.prompt_tokens + result.completion_tokens)


def completion_body(result, ident: str, created: int, model: str) -> dict:
    return api.ChatCompletion(
        id=ident, created=created, model=model, usage=usage(result),
        choices=[api.Choice(message=api.AssistantMessage(content=result.content),
                            finish_reason=result.finish_reason)]).model_dump()


def chunk_bodies(result, ident: str, created: int, model: str, include_usage: bool):
    """The ``chat.completion.chunk`` objects of a stream: the role, one chunk per token that
    adds text, the finish reason, and (when asked) the usage with no choices."""

    def chunk(delta: api.Delta, finish: str | None = None, **more) -> dict:
        choices = [] if "usage" in more else [api.ChunkChoice(delta=delta, finish_reason=finish)]
        return api.ChatCompletionChunk(id=ident, created=created, model=model, choices=choices,
                                       **more).model_dump(exclude={"usage"} if not more else None)

    yield chunk(api.Delta(role="assistant", content=""))
    for piece in result.pieces:
        if piece:
            yield chunk(api.Delta(content=piece))
    yield chunk(api.Delta(), result.finish_reason)
    if include_usage:
        yield chunk(api.Delta(), usage=usage(result))


def models_body(model: str | None, created: int) -> dict:
    data = [api.ModelCard(id=model, created=created)] if model else []
    return api.ModelList(data=data).model_dump()
