"""Reward server: a judge behind HTTP, with dynamic batching across concurrent requests.

    pip install "fastjudge[serve]"
    fastjudge serve --judge lave --model /models/flan-t5-xl --port 8000

Endpoints:

* ``POST /v1/score`` — ``{"items": [{"question", "references", "prediction", "caption"?,
  "id"?}, ...]}`` → ``{"results": [{"index", "id", "score", "soft_score", "rating", "probs",
  "rationale", "prompt_tokens", "error", "rating_source"}, ...]}`` in input order. With
  ``?stream=1`` the answer is NDJSON, one result per line as each finishes (a line
  ``{"error": "timeout ..."}`` ends a stream that ran past the timeout).
* ``POST /get_reward`` — OpenRLHF remote reward-model protocol: ``{"query": [str, ...]}`` →
  ``{"rewards": [float, ...], "scores": [...], "errors": [...]}``. Each query string must be a
  JSON object string ``{"question": ..., "references": [...], "prediction": ...,
  "caption"?: ...}``; the reward is the LAVE score in [0, 1]. A query that is not such an
  object fails the whole request with 422 naming the query; an item the judge rejects (e.g. a
  prompt above the model limit) gets reward ``null`` and its message in ``errors``.
* ``GET /health`` — ``{"status": "ok", "judge": ..., "queue_depth": ...}``.
* ``GET /metrics`` — Prometheus text format.

Limits: bodies above ``max_body_bytes`` → 413; more items than the queue can take → 429;
a request not finished within ``timeout_s`` → 504; malformed JSON → 400; wrong shapes or
types → 422. Each error body is ``{"error": message}``.

Judges come from a registry (:mod:`fastjudge.judges.registry`, shared with
``fastjudge rescore``): ``lave``, ``visexmem`` and ``holistic``, each with the command-line
options its declaration lists; ``register_judge(name, factory, parse_item)`` adds one, where
``factory(args)`` builds a judge from the parsed command-line arguments.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
from typing import Any

from .judges.registry import JUDGES, ItemError, add_judge_options, register_judge  # noqa: F401 (re-exported)
from .runtime.async_batcher import AsyncBatcher, QueueFullError

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _result_dict(r) -> dict:
    return dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r)


# -- metrics ---------------------------------------------------------------------------------
class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.start = time.monotonic()
        self.items_total = 0
        self.requests: dict[tuple[str, int], int] = {}
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.latency_count = 0
        self.recent: list[tuple[float, int]] = []  # (time, items) over the last minute

    def observe(self, path: str, status: int, seconds: float, items: int = 0) -> None:
        now = time.monotonic()
        with self.lock:
            self.requests[(path, status)] = self.requests.get((path, status), 0) + 1
            self.items_total += items
            if items:
                self.recent.append((now, items))
            self.recent = [(t, n) for t, n in self.recent if now - t <= 60.0]
            if status < 400:
                for i, b in enumerate(LATENCY_BUCKETS):
                    if seconds <= b:
                        self.buckets[i] += 1
                        break
                else:
                    self.buckets[-1] += 1
                self.latency_sum += seconds
                self.latency_count += 1

    def render(self, batcher: AsyncBatcher) -> str:
        now = time.monotonic()
        with self.lock:
            recent = [(t, n) for t, n in self.recent if now - t <= 60.0]
            window = min(60.0, max(now - self.start, 1e-9))
            rate = sum(n for _, n in recent) / window
            out = [
                "# HELP fastjudge_queue_depth Items waiting for a batch.",
                "# TYPE fastjudge_queue_depth gauge",
                f"fastjudge_queue_depth {batcher.queue_depth}",
                "# HELP fastjudge_items_running Items in the batch being run.",
                "# TYPE fastjudge_items_running gauge",
                f"fastjudge_items_running {batcher.running}",
                "# HELP fastjudge_items_total Items scored (answered requests).",
                "# TYPE fastjudge_items_total counter",
                f"fastjudge_items_total {self.items_total}",
                "# HELP fastjudge_batches_total Batches run by the batcher.",
                "# TYPE fastjudge_batches_total counter",
                f"fastjudge_batches_total {batcher.batches_done}",
                "# HELP fastjudge_items_per_second Items scored per second over the last minute.",
                "# TYPE fastjudge_items_per_second gauge",
                f"fastjudge_items_per_second {rate:.6g}",
                "# HELP fastjudge_requests_total HTTP requests by path and status.",
                "# TYPE fastjudge_requests_total counter",
            ]
            for (path, status), n in sorted(self.requests.items()):
                out.append(f'fastjudge_requests_total{{path="{path}",status="{status}"}} {n}')
            out += ["# HELP fastjudge_request_latency_seconds Latency of successful scoring "
                    "requests (streams: until the response starts).",
                    "# TYPE fastjudge_request_latency_seconds histogram"]
            cumulative = 0
            for b, n in zip(LATENCY_BUCKETS, self.buckets):
                cumulative += n
                out.append(f'fastjudge_request_latency_seconds_bucket{{le="{b}"}} {cumulative}')
            cumulative += self.buckets[-1]
            out.append(f'fastjudge_request_latency_seconds_bucket{{le="+Inf"}} {cumulative}')
            out.append(f"fastjudge_request_latency_seconds_sum {self.latency_sum:.6f}")
            out.append(f"fastjudge_request_latency_seconds_count {self.latency_count}")
        return "\n".join(out) + "\n"


# -- app -------------------------------------------------------------------------------------
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
               max_queue: int = 10000, timeout_s: float = 60.0, max_wait_ms: float = 5):
    """The Starlette app serving ``judge`` (a fresh batcher is made for it)."""
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    if judge_name not in JUDGES:
        raise ValueError(f"unknown judge {judge_name!r}; available: {', '.join(sorted(JUDGES))}")
    parse_item = JUDGES[judge_name].parse_item
    batcher = AsyncBatcher(judge, max_wait_ms=max_wait_ms, max_queue_items=max_queue)
    metrics = Metrics()

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    async def read_json(request) -> Any:
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > max_body_bytes:
                    raise RequestError(413, f"body is {length} bytes, above the limit of "
                                            f"{max_body_bytes}")
            except ValueError:
                raise RequestError(400, "invalid Content-Length") from None
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise RequestError(413, f"body is above the limit of {max_body_bytes} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise RequestError(400, "client disconnected") from None
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as bad:
            raise RequestError(400, f"malformed JSON: {bad}") from None

    def parse_items(body: Any) -> list:
        if not isinstance(body, dict):
            raise RequestError(422, 'body must be a JSON object {"items": [...]}')
        items = body.get("items")
        if not isinstance(items, list):
            raise RequestError(422, '"items" must be a list of objects')
        return [parse_item(d, f"items[{i}]") for i, d in enumerate(items)]

    async def handle(path: str, request, work) -> Any:
        start = time.monotonic()
        status, n_items = 500, 0
        try:
            response, n_items = await work(request)
            status = response.status_code
            return response
        except RequestError as bad:
            status = bad.status
            return error(bad.status, bad.message)
        except ItemError as bad:
            status = 422
            return error(422, str(bad))
        except QueueFullError as full:
            status = 429
            return error(429, str(full))
        except asyncio.TimeoutError:
            status = 504
            return error(504, f"request not finished within {timeout_s} s")
        finally:
            metrics.observe(path, status, time.monotonic() - start, n_items)

    async def score_work(request):
        examples = parse_items(await read_json(request))
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
                        yield json.dumps(_json_safe(_result_dict(r))) + "\n"
                finally:
                    await agen.aclose()

            return StreamingResponse(lines(), media_type="application/x-ndjson"), len(examples)
        results = await asyncio.wait_for(batcher.score(examples), timeout_s)
        return JSONResponse({"results": _json_safe([_result_dict(r) for r in results])}), \
            len(examples)

    async def reward_work(request):
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("query"), list):
            raise RequestError(422, 'body must be a JSON object {"query": [str, ...]}')
        examples = []
        for i, q in enumerate(body["query"]):
            where = f"query[{i}]"
            if not isinstance(q, str):
                raise RequestError(422, f"{where}: must be a string")
            try:
                obj = json.loads(q)
            except ValueError:
                raise RequestError(422, f"{where}: not a JSON object string; expected "
                                        '\'{"question": ..., "references": [...], '
                                        '"prediction": ...}\'') from None
            examples.append(parse_item(obj, where))
        results = await asyncio.wait_for(batcher.score(examples), timeout_s)
        rewards = [None if r.error else r.score for r in results]
        return JSONResponse({"rewards": rewards, "scores": rewards,
                             "errors": [r.error for r in results]}), len(examples)

    async def score(request):
        return await handle("/v1/score", request, score_work)

    async def get_reward(request):
        return await handle("/get_reward", request, reward_work)

    async def health(request):
        return JSONResponse({"status": "ok", "judge": judge_name,
                             "queue_depth": batcher.queue_depth})

    async def prom(request):
        return PlainTextResponse(metrics.render(batcher),
                                 media_type="text/plain; version=0.0.4")

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(batcher.close)

    app = Starlette(routes=[Route("/v1/score", score, methods=["POST"]),
                            Route("/get_reward", get_reward, methods=["POST"]),
                            Route("/health", health, methods=["GET"]),
                            Route("/metrics", prom, methods=["GET"])],
                    lifespan=lifespan)
    app.state.batcher = batcher
    app.state.metrics = metrics
    return app


def add_serve_parser(sub) -> None:
    """The ``fastjudge serve`` subcommand."""
    p = sub.add_parser(
        "serve", help="serve a judge over HTTP (rewards for RL, dynamic batching)",
        description="Serve a judge over HTTP: POST /v1/score, POST /get_reward (OpenRLHF), "
                    "GET /health, GET /metrics. Needs `pip install fastjudge[serve]`. "
                    "Judges come from an extensible registry (fastjudge.serve.register_judge); "
                    f"available now: {', '.join(sorted(JUDGES))}.")
    p.add_argument("--judge", default="lave", choices=sorted(JUDGES),
                   help="judge to serve (registry: fastjudge.serve.JUDGES; default lave)")
    p.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default 8 MiB)")
    p.add_argument("--max-queue", type=int, default=10000,
                   help="queued items; a request that does not fit gets 429 (default 10000)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="per-request timeout; 504 after it (default 60)")
    p.add_argument("--max-wait-ms", type=float, default=5.0,
                   help="how long the batcher waits to fill a batch (default 5)")
    add_judge_options(p)


def run_serve(args) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ValueError('fastjudge serve needs starlette and uvicorn: '
                         'pip install "fastjudge[serve]"') from None
    judge = JUDGES[args.judge].factory(args)
    app = create_app(judge, args.judge, max_body_bytes=args.max_body_bytes,
                     max_queue=args.max_queue, timeout_s=args.timeout_s,
                     max_wait_ms=args.max_wait_ms)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
