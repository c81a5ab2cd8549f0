"""Request bodies read within the server's limits (size, time) and parsed within the JSON limits
of :mod:`.json_limits`; every refusal is a :class:`RequestError` with its status."""

from __future__ import annotations

import asyncio
from typing import Any

from .json_limits import JsonTooDeep, UnencodableString, decode_body, load_json

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0


class RequestError(Exception):
    """A request the server refuses: ``status`` and the ``{"error": message}`` body. ``close``:
    the body was not read to its end, so the connection cannot carry another request."""

    def __init__(self, status: int, message: str, close: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = {"connection": "close"} if close else None


async def read_body(request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body: 413 above ``max_bytes`` (declared or counted), 408 when it has not all
    arrived ``timeout_s`` after the request head (a client that stalls keeps no slot)."""
    from starlette.requests import ClientDisconnect

    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise RequestError(400, "invalid Content-Length") from None
        if declared > max_bytes:
            raise RequestError(413, f"body is {length} bytes, above the limit of {max_bytes}",
                               close=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunks, size = [], 0
    stream = request.stream()
    try:
        while True:
            chunk = await asyncio.wait_for(stream.__anext__(), deadline - loop.time())
            size += len(chunk)
            if size > max_bytes:
                raise RequestError(413, f"body is above the limit of {max_bytes} bytes",
                                   close=True)
            chunks.append(chunk)
    except StopAsyncIteration:
        return b"".join(chunks)
    except asyncio.TimeoutError:
        raise RequestError(408, f"request body not received within {timeout_s:g} s",
                           close=True) from None
    except ClientDisconnect:
        raise RequestError(400, "client disconnected") from None
    finally:
        await stream.aclose()


async def read_json(request, max_bytes: int, timeout_s: float) -> Any:
    """The body's JSON value: 400 for text that is not JSON or nests too deep, 422 for a string
    no encoding can carry (naming where it is)."""
    body = await read_body(request, max_bytes, timeout_s)
    try:
        return load_json(decode_body(body))
    except JsonTooDeep as bad:
        raise RequestError(400, str(bad)) from None
    except UnencodableString as bad:
        raise RequestError(422, str(bad)) from None
    except ValueError as bad:  # UnicodeDecodeError included
        raise RequestError(400, f"malformed JSON: {bad}") from None


def validated(model, value: Any):
    """``value`` as an instance of the pydantic ``model``: 422 naming where each problem is."""
    from pydantic import ValidationError

    from ..io.validation import describe

    try:
        return model.model_validate(value)
    except ValidationError as bad:
        raise RequestError(422, describe(bad, value)) from None


def load_embedded_json(text: str, where: str, expected: str) -> Any:
    """A JSON value carried as a string inside the body (``/get_reward`` queries): every refusal
    is 422 naming ``where``; ``expected`` describes the wanted value for text that is no JSON."""
    try:
        return load_json(text, where)
    except (JsonTooDeep, UnencodableString) as bad:
        raise RequestError(422, str(bad)) from None
    except ValueError:
        raise RequestError(422, f"{where}: not a JSON object string; expected {expected}") from None
