"""``fastjudge serve``: its command-line options and the uvicorn server they configure."""

from __future__ import annotations

import ipaddress
import os

from ..judges.registry import JUDGES, add_judge_options
from .bodies import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from .chat_generation import DEFAULT_MAX_COMPLETION_TOKENS

API_KEY_VARIABLE = "FASTJUDGE_API_KEY"
DEFAULT_HEADER_TIMEOUT_S = 10.0


def add_serve_parser(sub) -> None:
    """The ``fastjudge serve`` subcommand."""
    p = sub.add_parser(
        "serve", help="serve a judge over HTTP (rewards for RL, dynamic batching)",
        description="Serve a judge over HTTP: POST /v1/score, POST /get_reward (OpenRLHF), "
                    "GET /health, GET /metrics, GET /openapi.json, and for Qwen judges "
                    "GET /v1/models and POST /v1/chat/completions (OpenAI-compatible). Needs `pip install "
                    "fastjudge[serve]`. Judges come from an extensible registry "
                    "(fastjudge.serve.register_judge); "
                    f"available now: {', '.join(sorted(JUDGES))}.")
    p.add_argument("--judge", default="lave", choices=sorted(JUDGES),
                   help="judge to serve (registry: fastjudge.serve.JUDGES; default lave)")
    p.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default 127.0.0.1); any other than a loopback address "
                        "needs an API key or --insecure")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health "
                        f"(default: ${API_KEY_VARIABLE}, which keeps the key out of the "
                        "process list)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without an API key")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default 8 MiB)")
    p.add_argument("--max-queue", type=int, default=10000,
                   help="queued items; a request that does not fit gets 429 (default 10000)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="per-request timeout; 504 after it (default 60)")
    p.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="a connection that has not sent a whole request head this long after "
                        "connecting or after its last response is closed (default %(default)g)")
    p.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="a request body not received this long after its head gets 408 "
                        "(default %(default)g)")
    p.add_argument("--reward-on-error", type=float, default=0.0,
                   help="/get_reward: the reward of an item the judge rejects (default 0.0; "
                        "OpenRLHF needs a number for every sample); a system failure answers 503 "
                        "instead, never this")
    p.add_argument("--max-completion-tokens", type=int, default=DEFAULT_MAX_COMPLETION_TOKENS,
                   help="/v1/chat/completions: the most tokens one answer gets (default "
                        f"{DEFAULT_MAX_COMPLETION_TOKENS}; a request's max_tokens is capped by it)")
    p.add_argument("--image-url-prefix", action="append", default=[], metavar="PREFIX",
                   help="/v1/chat/completions and /get_reward labels: fetch remote images whose "
                        "URL starts with PREFIX (repeatable; e.g. https://images.example.org/); "
                        "without it only data: URLs are taken")
    p.add_argument("--policy-template", default=None, metavar="PATH",
                   help="/get_reward: the trained policy's tokenizer directory (or its chat "
                        "template file); the response is told from the prompt by the markers "
                        "learned from its chat template (default: tables of common templates)")
    p.add_argument("--reasoning", default="strip", choices=("strip", "keep"),
                   help="/get_reward: strip (default) judges the answer after a completed "
                        "reasoning block (<think>...</think> and the like) and refuses one that "
                        "never closes; keep judges the response as is")
    p.add_argument("--max-wait-ms", type=float, default=5.0,
                   help="how long the batcher waits to fill a batch (default 5)")
    p.add_argument("--retries", type=int, default=2,
                   help="times a batch that failed (a CUDA error, a backend exception) runs "
                        "again after a short pause before its requests get 503 with "
                        "Retry-After (out of memory instead splits the batch; default 2)")
    add_judge_options(p)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def api_key_of(args) -> str | None:
    return args.api_key or os.environ.get(API_KEY_VARIABLE) or None


def check_exposure(host: str, api_key: str | None, insecure: bool) -> None:
    """Refuse to open the judge to a network without a key, unless told to."""
    if not (api_key or insecure or is_loopback(host)):
        raise ValueError(f"refusing to serve on {host} without an API key: set "
                         f"{API_KEY_VARIABLE} (or --api-key), bind a loopback address, or pass "
                         "--insecure")


def policy_markers_of(args):
    """The markers of ``--policy-template`` (None without it)."""
    if not getattr(args, "policy_template", None):
        return None
    from ..rl.chat_markers import load_markers

    return load_markers(args.policy_template)


def server_config(args):
    """The ``uvicorn.Config`` of a ``fastjudge serve`` command line (the judge is loaded)."""
    api_key = api_key_of(args)
    check_exposure(args.host, api_key, args.insecure)
    try:
        import uvicorn
    except ImportError:
        raise ValueError('fastjudge serve needs starlette and uvicorn: '
                         'pip install "fastjudge[serve]"') from None
    from .app import create_app
    from .protocol import client_deadline_protocol

    judge = JUDGES[args.judge].factory(args)
    app = create_app(judge, args.judge, max_body_bytes=args.max_body_bytes,
                     max_queue=args.max_queue, timeout_s=args.timeout_s,
                     max_wait_ms=args.max_wait_ms, body_timeout_s=args.body_timeout_s,
                     api_key=api_key, reward_on_error=args.reward_on_error,
                     max_completion_tokens=args.max_completion_tokens, retries=args.retries,
                     image_url_prefixes=tuple(args.image_url_prefix),
                     policy_markers=policy_markers_of(args), reasoning=args.reasoning)
    return uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                          http=client_deadline_protocol(args.header_timeout_s))


def run_serve(args) -> int:
    config = server_config(args)
    import uvicorn

    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # the server has shut down already
        pass
    return 0
