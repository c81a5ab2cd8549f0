"""The Starlette app: the routes, their limits and their error answers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from typing import Any

from .. import __version__
from ..judges.registry import ItemError, get_judge
from ..rl.answers import check_reasoning_mode
from ..runtime.async_batcher import AsyncBatcher, QueueFullError
from ..runtime.failures import SystemFailure
from . import openrlhf
from .bodies import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    RequestError,
    load_embedded_json,
    read_json,
    validated,
)
from .chat_generation import DEFAULT_MAX_COMPLETION_TOKENS, ChatJudge, served_model_id
from .guards import BearerAuth, JsonErrors
from .metrics import Metrics
from .openai_routes import openai_operations
from .openapi import Operation, Refusal, openapi_document
from .schemas import ExtraLogs, Health, LastSystemFailure, RewardRequest, RewardResponse, score_models

SYSTEM_FAILURE_RETRY_AFTER_S = 5  # the Retry-After of a 503: time for a device to recover


def system_failure_message(failure: SystemFailure) -> str:
    return (f"the judge failed on this request's batch ({failure}); nothing was scored, retry "
            "the request")


EXPECTED_QUERY = '\'{"question": ..., "references": [...], "prediction": ...}\''

# What the statuses of the score and reward routes mean (their bodies: {"error": message}).
REFUSALS = {
    "400": "malformed JSON, JSON nested deeper than 400 levels, invalid Content-Length",
    "408": "the body did not arrive in time after the request head",
    "413": "body above the server's size limit",
    "422": "wrong shapes or types (the message names where), or a string that is not valid "
           "Unicode (a lone surrogate)",
    "429": "more items than the queue can take; retry later",
    "500": "an internal error (logged by the server)",
    "503": "a system failure (out of memory that splitting did not cure, a CUDA error, a "
           "backend failure no item explains) after the server's retries; nothing was scored: "
           "retry after the Retry-After seconds",
    "504": "not finished within the server's timeout",
}
SCORING_REFUSALS = {status: Refusal(text) for status, text in REFUSALS.items()}
INTERNAL_ONLY = {"500": Refusal(REFUSALS["500"])}
STREAM_PARAMETER = {"name": "stream", "in": "query", "required": False,
                    "schema": {"type": "string", "enum": ["1", "true", "yes"]},
                    "description": "answer NDJSON: one result per line as each finishes; a "
                                   "line {\"error\": ...} ends a stream that ran past the "
                                   "timeout or whose batch had a system failure"}


def _json_safe(obj):
    """NaN/inf are not JSON; send null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def create_app(judge, judge_name: str = "lave", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_queue: int = 10000, timeout_s: float = 60.0, max_wait_ms: float = 5,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, api_key: str | None = None,
               reward_on_error: float = 0.0,
               max_completion_tokens: int = DEFAULT_MAX_COMPLETION_TOKENS, retries: int = 2,
               retry_after_s: int = SYSTEM_FAILURE_RETRY_AFTER_S, image_url_prefixes: tuple[str, ...] = (),
               policy_markers=None, reasoning: str = "strip"):
    """The Starlette app serving ``judge`` (a fresh batcher is made for it). ``api_key``: every
    route but ``/health`` needs ``Authorization: Bearer <api_key>``. ``reward_on_error``: the
    ``/get_reward`` reward of an item the judge rejects (rewards are always numbers; never
    given for a system failure, which answers 503). ``max_completion_tokens``: the most tokens
    one ``/v1/chat/completions`` answer gets. ``retries``: how often a failed batch runs again
    before its requests get 503 with ``Retry-After: retry_after_s``
    (:mod:`fastjudge.runtime.failures`). ``image_url_prefixes``: the remote image URLs the chat
    route and ``/get_reward`` labels fetch (none: ``data:`` URLs only). ``policy_markers``: the
    trained policy's chat-template markers (:func:`fastjudge.rl.chat_markers.load_markers`),
    which ``/get_reward`` splits its queries by (None: the tables of common templates);
    ``reasoning``: ``strip`` (judge the answer after a reasoning block) or ``keep``."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

    spec = get_judge(judge_name)
    score_request, score_result, score_response = score_models(spec)
    # /get_reward labels may name image files, read only under the judge's --image-root
    image_root = getattr(judge, "image_root", None)
    # chat completions run on the judge's model, so they queue in the judge's own batcher
    # the batcher confines each failure to its item, or answers it as the system's (503)
    batcher = AsyncBatcher(ChatJudge(judge, max_completion_tokens), max_wait_ms=max_wait_ms,
                           max_queue_items=max_queue, retries=retries)
    unavailable = {"Retry-After": str(int(retry_after_s))}
    metrics = Metrics()
    # Every result carries the judge's declared fields, also an item that failed alone.
    blank_result = dict.fromkeys(("index", "id", *spec.result_fields))

    def result_json(r) -> dict:
        fields = dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r)
        return _json_safe({**blank_result, **fields})

    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    def parse_items(body: Any) -> list:
        items = validated(score_request, body).items
        if spec.item_model is not None:
            return [item.example() for item in items]
        return [spec.parse_item(d, f"items[{i}]") for i, d in enumerate(items)]

    async def handle(path: str, request, work) -> Any:
        start = time.monotonic()
        status, n_items = 500, 0
        try:
            response, n_items = await work(request)
            status = response.status_code
            return response
        except RequestError as bad:
            status = bad.status
            return error(bad.status, bad.message, bad.headers)
        except ItemError as bad:
            status = 422
            return error(422, str(bad))
        except QueueFullError as full:
            status = 429
            return error(429, str(full))
        except asyncio.TimeoutError:
            status = 504
            return error(504, f"request not finished within {timeout_s} s")
        except SystemFailure as failure:
            status = 503
            return error(503, system_failure_message(failure), unavailable)
        finally:
            metrics.observe(path, status, time.monotonic() - start, n_items)

    async def score_work(request):
        examples = parse_items(await read_json(request, max_body_bytes, body_timeout_s))
        if request.query_params.get("stream") in ("1", "true", "yes"):
            futures = batcher.submit(examples)  # QueueFullError -> 429 before streaming
            deadline = time.monotonic() + timeout_s

            async def lines():
                agen = batcher.stream_futures(futures)
                try:
                    while True:
                        remaining = deadline - time.monotonic()
                        try:
                            r = await asyncio.wait_for(agen.__anext__(), max(remaining, 0))
                        except StopAsyncIteration:
                            return
                        except asyncio.TimeoutError:
                            yield json.dumps({"error": f"timeout: request not finished within "
                                                       f"{timeout_s} s"}) + "\n"
                            return
                        except SystemFailure as failure:  # the answer's 200 is already sent
                            yield json.dumps({"error": system_failure_message(failure)}) + "\n"
                            return
                        yield json.dumps(result_json(r)) + "\n"
                finally:
                    await agen.aclose()

            return StreamingResponse(lines(), media_type="application/x-ndjson"), len(examples)
        results = await asyncio.wait_for(batcher.score(examples), timeout_s)
        return JSONResponse({"results": [result_json(r) for r in results]}), len(examples)

    check_reasoning_mode(reasoning)
    fetch = openrlhf.fetch_label_image(max_body_bytes)

    def stock_items(body) -> list:
        """A parsed example, or the error that rejected that sample, per query."""
        items: list = []
        labels = body.labels if body.labels is not None else [None] * len(body.query)
        for i, (query, prompt, label) in enumerate(zip(body.query, body.prompts, labels)):
            where = f"query[{i}]"
            try:
                items.append(openrlhf.stock_example(
                    spec, query, prompt, label, where, judge_name == "lave", image_root,
                    policy_markers, reasoning, tuple(image_url_prefixes), fetch))
            except ValueError as bad:  # ItemError, or an image that does not decode
                items.append(bad)
        return items

    async def reward_work(request):
        body = validated(RewardRequest, await read_json(request, max_body_bytes, body_timeout_s))
        items: list = []  # a parsed example, or the error that rejected that sample
        if body.is_stock:  # labels may name image files or URLs: read off the event loop
            items = await asyncio.to_thread(stock_items, body) if judge_name != "lave" else stock_items(body)
        else:  # each query is an item as a JSON object string
            for i, q in enumerate(body.query):
                where = f"query[{i}]"
                items.append(spec.parse_item(load_embedded_json(q, where, EXPECTED_QUERY), where))
        examples = [x for x in items if not isinstance(x, Exception)]
        scored = iter(await asyncio.wait_for(batcher.score(examples), timeout_s) if examples else [])
        errors, rewards, ratings = [], [], []
        for x in items:
            r = None if isinstance(x, Exception) else next(scored)
            problem = str(x) if r is None else r.error
            errors.append(problem)
            # every reward is a number: OpenRLHF passes the list straight to torch.tensor
            rewards.append(reward_on_error if problem else float(r.score))
            rating = getattr(r, "rating", None)
            ratings.append(float(rating) if not problem and rating is not None else 0.0)
        extra_logs = ExtraLogs(error=[1.0 if e else 0.0 for e in errors], rating=ratings)
        answer = RewardResponse(rewards=rewards, scores=rewards, errors=errors,
                                extra_logs=extra_logs)
        return JSONResponse(answer.model_dump()), len(items)

    async def score(request):
        return await handle("/v1/score", request, score_work)

    async def get_reward(request):
        return await handle("/get_reward", request, reward_work)

    async def health(request):
        last = batcher.last_system_failure
        return JSONResponse(Health(
            status="ok", judge=judge_name, queue_depth=batcher.queue_depth,
            system_failures=batcher.system_failures,
            last_system_failure=None if last is None else
            LastSystemFailure(at=last[0], error=last[1])).model_dump())

    async def prom(request):
        return PlainTextResponse(metrics.render(batcher),
                                 media_type="text/plain; version=0.0.4")

    async def openapi(request):
        return JSONResponse(document)

    async def http_error(request, exc: HTTPException):
        """Unknown paths (404) and methods (405) answer JSON like every other error."""
        return error(exc.status_code, exc.detail, exc.headers)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(batcher.close)

    operations = [
        Operation("/v1/score", "post", score, "score items (results in input order, or NDJSON "
                  "as they finish)", "one result per item",
                  {"application/json": score_response, "application/x-ndjson": score_result},
                  score_request, SCORING_REFUSALS, (STREAM_PARAMETER,)),
        Operation("/get_reward", "post", get_reward, "OpenRLHF remote reward model: one reward "
                  "per query", "rewards in query order", {"application/json": RewardResponse},
                  RewardRequest, SCORING_REFUSALS),
        Operation("/health", "get", health, "liveness and queue depth (needs no key)",
                  "the server is up", {"application/json": Health}, refusals=INTERNAL_ONLY,
                  needs_key=False),
        Operation("/metrics", "get", prom, "Prometheus metrics", "Prometheus text format",
                  {"text/plain": {"type": "string"}}, refusals=INTERNAL_ONLY),
        Operation("/openapi.json", "get", openapi, "this document", "OpenAPI 3.1",
                  {"application/json": {"type": "object"}}, refusals=INTERNAL_ONLY),
        *openai_operations(batcher, metrics, served_model_id(judge, judge_name),
                           max_body_bytes, body_timeout_s, timeout_s, unavailable,
                           tuple(image_url_prefixes)),
    ]
    document = openapi_document(operations, f"fastjudge reward server ({spec.name})",
                                __version__, authenticated=bool(api_key))
    middleware = [Middleware(JsonErrors)]
    if api_key:
        middleware.append(Middleware(BearerAuth, api_key=api_key, open_paths=frozenset(
            op.path for op in operations if not op.needs_key)))
    app = Starlette(routes=[op.route() for op in operations], middleware=middleware,
                    exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    app.state.batcher = batcher
    app.state.metrics = metrics
    return app
