"""``GET /v1/models`` and ``POST /v1/chat/completions``: the judge's model behind the OpenAI
chat API, for evaluation harnesses that call their judge through one (lmms-eval's local
judge provider, VLMEvalKit's ``--judge-base-url``).

The body limits (size, arrival time, JSON depth, lone surrogates), the queue (429), the
timeout (504), a system failure (503 with ``Retry-After``, which the openai client library
retries) and the API key are the server's, as on its other routes; errors are OpenAI error
objects. The model name a request gives is not checked: the server has one model, and
harnesses send the name they were configured with (an OpenAI model name by default); answers
name the served model.

Images: ``image_url`` parts with ``data:`` URLs, decoded and preprocessed on the model's thread
as the image judges do (see :mod:`.chat_generation`); a remote URL only under one of
``image_url_prefixes`` (the server's ``--image-url-prefix``), fetched here before queueing,
without following redirects, within the body limits (size and time).

A request arriving while the server shuts down (its batcher closed) answers 503 with
``Retry-After``: a system state, not the request's fault.

Streaming (``"stream": true``) answers server-sent events, ``data: {chat.completion.chunk}``
and a final ``data: [DONE]``. The chunks are sent once the completion is decoded (the model
decodes a batch to its end), one chunk per token that adds text; an error before that is an
ordinary HTTP error answer.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time

from ..runtime.async_batcher import QueueFullError
from ..runtime.failures import SystemFailure
from . import openai_schemas as api
from .bodies import RequestError, read_json
from .openai_protocol import (
    OpenAIRefusal,
    chunk_bodies,
    completion_body,
    error_body,
    images_of,
    models_body,
    parse_chat_request,
)

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"

# What the chat route's statuses mean (bodies: OpenAI error objects).
REFUSALS = {
    "400": "malformed JSON or an invalid request (the field is named in param); a prompt too "
           "long for the model (code context_length_exceeded); an image that does not decode or "
           "is above the pixel budget (code invalid_image), or images for a text-only model "
           "(code image_not_supported)",
    "404": "the judge's model is not a decoder-only chat model (code model_not_found)",
    "408": "the body did not arrive in time after the request head",
    "413": "body above the server's size limit",
    "422": "a string that is not valid Unicode (a lone surrogate)",
    "429": "the queue is full; retry later",
    "500": "an internal error (logged by the server)",
    "503": "a system failure after the server's retries (code service_unavailable; retry "
           "after the Retry-After seconds), or the server is shutting down (retry on another "
           "instance)",
    "504": "not finished within the server's timeout",
}


def check_schema(schema: str) -> None:
    """400 for a response-format schema the grammar cannot be built from (checked before the
    request is queued, so it never fails on the model's thread)."""
    import xgrammar as xgr

    from ..runtime.json_bounds import SEPARATORS

    try:
        xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=SEPARATORS,
                                     strict_mode=True)
    except Exception as bad:  # xgrammar raises several kinds for schemas it cannot convert
        # its messages start with "[time] source.cc:line: "; the reason is the rest
        reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(bad).strip()) or repr(bad)
        raise OpenAIRefusal(400, f"response_format.json_schema.schema is not usable: {reason}",
                          "response_format.json_schema.schema") from None


def _opener_without_redirects():
    """A urllib opener that refuses every redirect: an allowed URL must not lead the server to
    another host."""
    import urllib.request

    class Refuse(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            raise OpenAIRefusal(400, f"the image URL redirects ({code}); give the final URL")

    return urllib.request.build_opener(Refuse)


def fetch_image(url: str, where: str, max_bytes: int, timeout_s: float) -> bytes:
    """The bytes at an allowed image URL: 400 when it cannot be had within the limits."""
    import urllib.error

    try:
        with _opener_without_redirects().open(url, timeout=timeout_s) as answer:
            data = answer.read(max_bytes + 1)
    except OpenAIRefusal:
        raise
    except (urllib.error.URLError, OSError, ValueError) as bad:
        raise OpenAIRefusal(400, f"{where}: the image URL could not be fetched: {bad}", where) from None
    if len(data) > max_bytes:
        raise OpenAIRefusal(400, f"{where}: the image at the URL is above {max_bytes} bytes", where)
    return data


def openai_operations(batcher, metrics, model_id: str | None, max_body_bytes: int,
                      body_timeout_s: float, timeout_s: float,
                      unavailable: dict | None = None,
                      image_url_prefixes: tuple[str, ...] = ()) -> list:
    """The two routes (:class:`~.openapi.Operation`) for an app whose ``batcher`` runs a
    ``ChatJudge``; ``model_id``: the
    served model's name (None: the judge has no chat model, and completions answer 404);
    ``unavailable``: the headers of a 503 (``Retry-After``); ``image_url_prefixes``: the remote
    image URLs fetched (none: only ``data:`` URLs)."""
    from starlette.responses import JSONResponse, StreamingResponse

    from .openapi import Operation, Refusal

    started = int(time.time())

    def error(bad: OpenAIRefusal) -> JSONResponse:
        return JSONResponse(error_body(bad.status, bad.message, bad.param, bad.code),
                            status_code=bad.status, headers=bad.headers)

    async def complete(request):
        body = await read_json(request, max_body_bytes, body_timeout_s)
        if model_id is None:
            raise OpenAIRefusal(404, "this server's judge model is not a decoder-only chat model; "
                                   "chat completions need a Qwen judge", "model",
                              "model_not_found")
        example, stream, include_usage = parse_chat_request(body, image_url_prefixes)
        if example.schema is not None:
            await asyncio.to_thread(check_schema, example.schema)
        for image in images_of(example):
            if image.data is None:  # an allowed remote URL: fetched off the event loop
                image.data = await asyncio.to_thread(fetch_image, image.url, image.where,
                                                     max_body_bytes, body_timeout_s)
        if batcher.closed:
            raise OpenAIRefusal(503, "the server is shutting down; retry on another instance",
                              headers={"retry-after": "1"})
        try:
            result = (await asyncio.wait_for(batcher.score([example]), timeout_s))[0]
        except QueueFullError as full:
            raise OpenAIRefusal(429, str(full), code="rate_limit_exceeded") from None
        except asyncio.TimeoutError:
            raise OpenAIRefusal(504, f"request not finished within {timeout_s} s") from None
        except SystemFailure as failure:
            raise OpenAIRefusal(503, f"the judge failed on this request's batch ({failure}); "
                                   "retry the request", code="service_unavailable",
                              headers=unavailable) from None
        if result.error is not None:
            status = 400 if hasattr(result, "code") else 500  # a refused prompt, or a failure
            raise OpenAIRefusal(status, result.error, "messages" if status == 400 else None,
                              getattr(result, "code", None))
        ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if not stream:
            return JSONResponse(completion_body(result, ident, created, model_id))

        async def events():
            for chunk in chunk_bodies(result, ident, created, model_id, include_usage):
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def chat(request):
        start, status = time.monotonic(), 500
        try:
            response = await complete(request)
            status = response.status_code
            return response
        except RequestError as bad:  # the body limits every route shares
            status = bad.status
            return error(OpenAIRefusal(bad.status, bad.message, headers=bad.headers))
        except OpenAIRefusal as bad:
            status = bad.status
            return error(bad)
        finally:
            metrics.observe(CHAT_PATH, status, time.monotonic() - start, 1)

    async def models(request):
        return JSONResponse(models_body(model_id, started))

    refusals = {status: Refusal(text, api.OpenAIError) for status, text in REFUSALS.items()}
    return [
        Operation(MODELS_PATH, "get", models, "OpenAI-compatible: the served model (none for a "
                  "judge that has no chat model)", "the model list",
                  {"application/json": api.ModelList}, refusals={"500": refusals["500"]}),
        Operation(CHAT_PATH, "post", chat, "OpenAI-compatible chat completion on the judge's "
                  "model (greedy)", "the completion, or with stream: true server-sent events",
                  {"application/json": api.ChatCompletion,
                   "text/event-stream": api.ChatCompletionChunk},
                  api.ChatCompletionRequest, refusals),
    ]
