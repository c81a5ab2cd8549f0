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
import numbers
import re
from dataclasses import dataclass
from typing import Any, Sequence

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
IGNORED_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed")
# option -> its neutral value; any other value would change a greedy answer
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}
MAX_STOP_STRINGS = 4


class OpenAIError(Exception):
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
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(eq=False)
class ImagePart:
    """An image of a message: its encoded bytes (a ``data:`` URL's), or, until the route has
    fetched it, the allowed remote ``url``. ``where`` names the content part in errors."""

    data: bytes | None = None
    url: str | None = None
    where: str = ""


_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[^;,]*)*)"
                       r"(?P<b64>;base64)?,(?P<data>.*)", re.S)


def image_part(part: dict, at: str, url_prefixes: Sequence[str] = ()) -> ImagePart:
    """The image of an ``image_url`` content part (400 for a URL that is not taken)."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
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


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, param)


def _content(content: Any, where: str, role: str, url_prefixes: Sequence[str] = ()):
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", where)
    parts: list = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            if parts and isinstance(parts[-1], str):
                parts[-1] += "\n" + part["text"]
            else:
                parts.append(part["text"])
        elif kind == "image_url":
            parts.append(image_part(part, at, url_prefixes))
        elif kind in ("input_image", "image", "input_audio", "file", "video_url"):
            raise _bad(f"{at}: {kind} content is not supported; send text parts and images as "
                       '{"type": "image_url", "image_url": {"url": "data:..."}}', at)
        else:
            raise _bad(f'{at}: expected {{"type": "text", "text": "..."}}', at)
    if all(isinstance(p, str) for p in parts):
        return "\n".join(parts)
    return parts


def parse_messages(messages: Any, url_prefixes: Sequence[str] = ()) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role {role!r} is not supported; use system, user or "
                       "assistant (tools are not served)", f"{where}.role")
        if m.get("tool_calls") or m.get("function_call"):
            raise _bad(f"{where}: tool calls are not supported", where)
        out.append({"role": ROLES[role],
                    "content": _content(m.get("content"), where, role, url_prefixes)})
    return out


def images_of(example: "ChatExample") -> list[ImagePart]:
    """The example's images, in message order."""
    return [p for m in example.messages if isinstance(m["content"], list)
            for p in m["content"] if isinstance(p, ImagePart)]


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad(f"{name} must be a number", name)
    return float(value)


def _max_tokens(body: dict) -> int | None:
    asked = None
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _bad(f"{name} must be a positive integer", name)
        asked = value if asked is None else asked
    return asked


def _schema(fmt: Any) -> str | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad("response_format.json_schema.schema must be a JSON schema object",
                       "response_format.json_schema.schema")
        return json.dumps(schema)
    raise _bad('response_format.type must be "text", "json_object" or "json_schema"',
               "response_format.type")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS}",
                   "stop")
    return tuple(stops)


def _refuse_unsupported(body: dict) -> None:
    for name in IGNORED_SAMPLING:
        _number(body, name)  # ignored, but a wrong type is still the client's error
    for name, neutral in NEUTRAL.items():
        value = _number(body, name)
        if value is not None and value != neutral:
            raise _bad(f"{name} is not supported (greedy decoding only); omit it or send "
                       f"{neutral}", name)
    if body.get("logit_bias"):
        raise _bad("logit_bias is not supported", "logit_bias")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise _bad("n must be 1: greedy decoding gives one answer", "n")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _bad("logprobs are not supported", "logprobs")
    if body.get("tools") or body.get("functions"):
        raise _bad("tools are not supported", "tools")


def parse_chat_request(body: Any, url_prefixes: Sequence[str] = ()) -> tuple[ChatExample, bool, bool]:
    """The example of a ``/v1/chat/completions`` body, whether to stream, and whether a stream
    ends with a usage chunk. Raises :class:`OpenAIError` (400) naming the field.
    ``url_prefixes``: the remote image URLs taken (the route fetches them)."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object", None)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model must be a string", "model")
    _refuse_unsupported(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise _bad("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    example = ChatExample(parse_messages(body.get("messages"), url_prefixes), _max_tokens(body),
                          _schema(body.get("response_format")), _stop(body.get("stop")),
                          pieces=bool(stream))
    return example, bool(stream), options.get("include_usage") is True


# -- answers -----------------------------------------------------------------------------------
def usage(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def completion_body(result, ident: str, created: int, model: str) -> dict:
    return {"id": ident, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.content},
                         "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": usage(result)}


def chunk_bodies(result, ident: str, created: int, model: str, include_usage: bool):
    """The ``chat.completion.chunk`` objects of a stream: the role, one chunk per token that
    adds text, the finish reason, and (when asked) the usage with no choices."""
    head = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    for piece in result.pieces:
        if piece:
            yield chunk({"content": piece})
    yield chunk({}, result.finish_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": usage(result)}


def models_body(model: str | None, created: int) -> dict:
    data = [{"id": model, "object": "model", "created": created, "owned_by": "fastjudge"}]
    return {"object": "list", "data": data if model else []}
