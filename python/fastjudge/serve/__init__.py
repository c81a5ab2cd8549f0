"""Reward server: a judge behind HTTP, with dynamic batching across concurrent requests.

    pip install "fastjudge[serve]"
    fastjudge serve --judge lave --model /models/flan-t5-xl --port 8000

Endpoints:

* ``POST /v1/score`` — ``{"items": [{"question", "references", "prediction", "caption"?,
  "id"?}, ...]}`` → ``{"results": [{"index", "id", "score", "soft_score", "rating", "probs",
  "rationale", "prompt_tokens", "error", "rating_source"}, ...]}`` in input order. With
  ``?stream=1`` the answer is NDJSON, one result per line as each finishes (a line
  ``{"error": "timeout ..."}`` ends a stream that ran past the timeout, and a line
  ``{"error": ...}`` one whose batch had a system failure).
* ``POST /get_reward`` — OpenRLHF remote reward-model protocol: OpenRLHF's own payload
  ``{"query": [prompt + response], "prompts": [...], "labels": [...]}`` (see
  :mod:`.openrlhf`), or queries that are JSON object strings ``{"question": ...,
  "references": [...], "prediction": ..., "caption"?: ...}`` →
  ``{"rewards": [float, ...], "scores": [...], "errors": [...], "extra_logs": {...}}``. An
  item the judge rejects gets ``reward_on_error`` (rewards are always numbers) and its message
  in ``errors``; a query string that is no item object fails the request with 422.
* ``GET /health`` — ``{"status": "ok", "judge": ..., "queue_depth": ..., "system_failures":
  ..., "last_system_failure": {"at", "error"} | null}``.
* ``GET /metrics`` — Prometheus text format.
* ``GET /openapi.json`` — the API as an OpenAPI 3.1 document.
* ``GET /v1/models``, ``POST /v1/chat/completions`` — an OpenAI-compatible chat server on the
  judge's own model (Qwen judges; greedy, streaming, ``response_format`` JSON schemas through
  the grammar), for harnesses that call an LLM judge by URL (see :mod:`.openai_routes`).

Limits: bodies above ``max_body_bytes`` → 413; a body not received ``body_timeout_s`` after its
head → 408; more items than the queue can take → 429; a request not finished within
``timeout_s`` → 504; malformed JSON or JSON nested deeper than 400 levels → 400; wrong shapes or
types, or a string that is not valid Unicode (a lone surrogate) → 422; an unexpected error →
500, with the connection kept open; a system failure (:mod:`fastjudge.runtime.failures`: out
of memory that splitting the batch did not cure, a CUDA error, a backend failure no item
explains, after ``retries``) → 503 with ``Retry-After``, never a result or a
``reward_on_error``; the next requests are served as usual. Each error body is ``{"error":
message}``. An item the judge fails on alone gets its own error result; the items batched with
it are unaffected. With an
API key every route but ``/health`` needs ``Authorization: Bearer <key>`` (401 otherwise).

Judges come from a registry (:mod:`fastjudge.judges.registry`, shared with
``fastjudge rescore``): ``lave``, ``visexmem`` and ``holistic``, each with the command-line
options its declaration lists; ``register_judge(name, factory, parse_item)`` adds one, where
``factory(args)`` builds a judge from the parsed command-line arguments.
"""

from ..judges.registry import JUDGES, ItemError, add_judge_options, register_judge  # noqa: F401 (re-exported)
from .app import create_app
from .command import add_serve_parser, run_serve

__all__ = ["create_app", "add_serve_parser", "run_serve", "JUDGES", "ItemError",
           "register_judge", "add_judge_options"]
