"""Reward-server throughput and latency on loopback (``fastjudge.serve``).

Starts the server in-process on 127.0.0.1 (a free port) with a judge — the tiny random-weight
Flan-T5 test model unless ``--model`` is given — and sends ``--requests`` POST /v1/score
requests of ``--items`` items at each concurrency level (bounded also by ``--max-seconds`` per
level). Prints items/s, requests/s and p50/p99 request latency.

    python benchmarks/bench_serve.py --concurrency 1 4 16 --requests 64 --items 4
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import httpx
import uvicorn

from fastjudge import LaveJudge
from fastjudge.checkpoints import build_random_t5
from fastjudge.demo import tokenizer_corpus
from fastjudge.serve import create_app


def sample_items(n: int, offset: int = 0) -> list[dict]:
    rows = [json.loads(line) for line in
            resources.files("fastjudge.data").joinpath("sample_vqa.jsonl").read_text().splitlines()
            if line.strip()]
    return [dict(rows[(offset + j) % len(rows)], id=f"{offset}-{j}") for j in range(n)]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: tiny random T5)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=48, help="requests per concurrency level")
    ap.add_argument("--items", type=int, default=4, help="items per request")
    ap.add_argument("--max-seconds", type=float, default=20.0, help="cap per level")
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    args = ap.parse_args()

    model = args.model or build_random_t5(tempfile.mkdtemp(), tokenizer_corpus(), shape="tiny")
    judge = LaveJudge(model, device=args.device)
    app = create_app(judge, max_wait_ms=args.max_wait_ms)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    rows = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                      limits=httpx.Limits(max_connections=64)) as client:
        client.post("/v1/score", json={"items": sample_items(args.items)})  # warm-up
        for conc in args.concurrency:
            latencies: list[float] = []
            stop = time.perf_counter() + args.max_seconds

            def one(k: int) -> None:
                if time.perf_counter() > stop:
                    return
                t = time.perf_counter()
                r = client.post("/v1/score", json={"items": sample_items(args.items, k)})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t)

            start = time.perf_counter()
            with ThreadPoolExecutor(conc) as pool:
                list(pool.map(one, range(args.requests)))
            elapsed = time.perf_counter() - start
            n = len(latencies)
            rows.append((conc, n, n * args.items / elapsed, n / elapsed,
                         1000 * statistics.median(latencies), 1000 * percentile(latencies, 0.99)))
    server.should_exit = True
    thread.join(10)

    print(f"{'conc':>5} {'requests':>9} {'items/s':>9} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for conc, n, ips, rps, p50, p99 in rows:
        print(f"{conc:>5} {n:>9} {ips:>9.1f} {rps:>8.1f} {p50:>8.1f} {p99:>8.1f}")


if __name__ == "__main__":
    main()
