"""Reward-server latency, throughput and overload behaviour on loopback (``fastjudge.serve``).

Starts ``fastjudge.serve`` in a child process on 127.0.0.1 (so the load generator does not
share the server's interpreter lock) with a judge — the tiny random-weight Flan-T5 test model
unless ``--model`` is given — and, ``--repeats`` times, measures with POST /v1/score requests of
``--items`` items each:

1. single: ``--single-requests`` requests one after another; the median is the
   single-request latency L.
2. low load: ``--low-requests`` requests sent open-loop at fixed intervals, at
   ``--low-load`` x (1 / L) requests/s, i.e. the server is busy about that fraction of the
   time; p50 and p99 latency (measured right after 1, so that both see the same machine).
3. saturation: a closed loop of ``--saturation-concurrency`` clients sending
   ``--saturation-requests`` requests; requests/s and items/s are the saturation throughput S.
4. overload: ``--overload-requests`` requests sent open-loop at ``--overload-factor`` x S
   requests/s against a queue bounded to ``--max-queue`` items; counts of 200 / 429 / other
   statuses and of requests without a response (connection errors, client timeouts), checked
   against the server's own per-status request counters (/metrics), so that every request
   sent got exactly one response.

Every phase is also bounded by ``--max-seconds``. Targets: p99 at low load <= 1.5 x L; at
2 x saturation no status other than 200 and 429, no request without a response, and every 200
answer complete (one result per item, ids in order). The summary prints the median of each
figure over the repeats and whether each target is met. The exit status is 1 only when the
server answered wrongly (an error below saturation, a status other than 200/429 or a lost
request under overload): a benchmark reports its timings, it does not fail on them. Latency
ratios mean something only on an otherwise idle machine: each repeat line shows the load
average before and after it.

    python benchmarks/bench_serve.py --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from importlib import resources

import httpx

LOW_LOAD_P99_TARGET = 1.5  # x single-request latency


def sample_items(n: int, offset: int = 0) -> list[dict]:
    rows = [json.loads(line) for line in
            resources.files("fastjudge.data").joinpath("sample_vqa.jsonl").read_text().splitlines()
            if line.strip()]
    return [dict(rows[(offset * n + j) % len(rows)], id=f"{offset}-{j}") for j in range(n)]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, device: str, port: int, max_queue: int, max_wait_ms: float,
          threads: int | None) -> None:
    """The server process."""
    import torch
    import uvicorn

    if threads:
        torch.set_num_threads(threads)

    from fastjudge import LaveJudge
    from fastjudge.engine_options import EngineOptions
    from fastjudge.serve import create_app

    judge = LaveJudge(model, engine=EngineOptions(device=device))
    app = create_app(judge, max_queue=max_queue, max_wait_ms=max_wait_ms, timeout_s=60)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


class Client:
    def __init__(self, base: str, items: int, timeout: float = 60.0):
        self.items = items
        self.http = httpx.AsyncClient(base_url=base, timeout=timeout,
                                      limits=httpx.Limits(max_connections=512,
                                                          max_keepalive_connections=512))
        self.counter = 0
        self.inflight = self.max_inflight = 0

    async def request(self) -> tuple[object, float]:
        """(status, or the exception when no response came; seconds). A 200 whose results
        do not match the items counts as status "incomplete"."""
        k = self.counter
        self.counter += 1
        items = sample_items(self.items, k)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        t = time.perf_counter()
        try:
            r = await self.http.post("/v1/score", json={"items": items})
        except httpx.HTTPError as bad:
            return bad, time.perf_counter() - t
        finally:
            self.inflight -= 1
        elapsed = time.perf_counter() - t
        if r.status_code == 200:
            got = [x.get("id") for x in r.json().get("results", [])]
            if got != [x["id"] for x in items]:
                return "incomplete", elapsed
        return r.status_code, elapsed

    async def requests_total(self) -> dict[str, int]:
        """The server's count of answered /v1/score requests by status."""
        text = (await self.http.get("/metrics")).text
        out = {}
        for m in re.finditer(r'^fastjudge_requests_total\{path="/v1/score",status="(\d+)"\} (\d+)$',
                             text, re.M):
            out[m.group(1)] = int(m.group(2))
        return out

    async def sequential(self, n: int, stop: float) -> list[tuple[object, float]]:
        out = []
        for _ in range(n):
            if time.perf_counter() > stop:
                break
            out.append(await self.request())
        return out

    async def closed_loop(self, n: int, concurrency: int, stop: float):
        out, left = [], [n]

        async def worker():
            while left[0] > 0 and time.perf_counter() < stop:
                left[0] -= 1
                out.append(await self.request())

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return out, time.perf_counter() - t

    async def open_loop(self, n: int, rate: float, stop: float):
        """``n`` requests at fixed intervals of 1/rate (bounded by ``stop``)."""
        self.max_inflight = 0
        tasks = []
        t0 = time.perf_counter()
        for i in range(n):
            due = t0 + i / rate
            if due > stop:
                break
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.request()))
        return list(await asyncio.gather(*tasks)), time.perf_counter() - t0


async def one_repeat(client: Client, args) -> dict:
    ok = lambda rs: [dt for s, dt in rs if s == 200]  # noqa: E731
    res: dict = {"load_before": os.getloadavg()[0]}
    # 1. single-request latency
    single = await client.sequential(args.single_requests,
                                     time.perf_counter() + args.max_seconds)
    lat = ok(single)
    res["single_ms"] = 1000 * statistics.median(lat)
    res["single_p99_ms"] = 1000 * percentile(lat, 0.99)
    res["single_errors"] = len(single) - len(lat)
    # 2. low load, right after 1 (same machine conditions)
    rate = args.low_load / (res["single_ms"] / 1000)
    low, _ = await client.open_loop(args.low_requests, rate,
                                    time.perf_counter() + args.max_seconds)
    lat = ok(low)
    res["low_rps"] = rate
    res["low_n"] = len(low)
    res["low_p50_ms"] = 1000 * statistics.median(lat)
    res["low_p90_ms"] = 1000 * percentile(lat, 0.90)
    res["low_p99_ms"] = 1000 * percentile(lat, 0.99)
    res["low_max_inflight"] = client.max_inflight
    res["low_errors"] = len(low) - len(lat)
    res["low_ratio"] = res["low_p99_ms"] / res["single_ms"]
    res["low_tail_ratio"] = res["low_p99_ms"] / res["single_p99_ms"]
    # 3. saturation throughput
    sat, elapsed = await client.closed_loop(args.saturation_requests,
                                            args.saturation_concurrency,
                                            time.perf_counter() + args.max_seconds)
    lat = ok(sat)
    res["sat_rps"] = len(lat) / elapsed
    res["sat_ips"] = len(lat) * args.items / elapsed
    res["sat_p50_ms"] = 1000 * statistics.median(lat)
    res["sat_errors"] = len(sat) - len(lat)
    # 4. overload: open loop at a multiple of the saturation rate
    before = await client.requests_total()
    over_rate = args.overload_factor * res["sat_rps"]
    over, elapsed = await client.open_loop(args.overload_requests, over_rate,
                                           time.perf_counter() + args.max_seconds)
    after = await client.requests_total()
    server = {s: after.get(s, 0) - before.get(s, 0) for s in after}
    statuses = [s for s, _ in over]
    res["over_rps"] = over_rate
    res["over_sent"] = len(over)
    res["over_200"] = statuses.count(200)
    res["over_429"] = statuses.count(429)
    res["over_other"] = sum(1 for s in statuses if isinstance(s, (int, str)) and s not in (200, 429))
    res["over_no_response"] = sum(1 for s in statuses if isinstance(s, Exception))
    res["over_goodput_ips"] = res["over_200"] * args.items / elapsed
    res["over_p99_ms"] = 1000 * percentile(ok(over), 0.99) if res["over_200"] else float("nan")
    res["load_after"] = os.getloadavg()[0]
    res["over_server_answered"] = sum(server.values())
    res["over_server_match"] = (server.get("200", 0) == res["over_200"]
                                and server.get("429", 0) == res["over_429"]
                                and res["over_server_answered"] == res["over_sent"])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: tiny random T5)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--items", type=int, default=4, help="items per request (4)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--single-requests", type=int, default=30)
    ap.add_argument("--saturation-concurrency", type=int, default=16)
    ap.add_argument("--saturation-requests", type=int, default=96)
    ap.add_argument("--low-load", type=float, default=0.3,
                    help="low-load arrival rate as a fraction of 1/single-request latency (0.3)")
    ap.add_argument("--low-requests", type=int, default=60)
    ap.add_argument("--overload-factor", type=float, default=2.0,
                    help="overload arrival rate as a multiple of the saturation rate (2)")
    ap.add_argument("--overload-requests", type=int, default=240)
    ap.add_argument("--max-queue", type=int, default=64,
                    help="server queue bound in items (64: the saturation phase never fills it)")
    ap.add_argument("--max-wait-ms", type=float, default=None,
                    help="server batching wait (default: the server's own default)")
    ap.add_argument("--server-threads", type=int, default=None,
                    help="torch threads in the server (default: torch's, one per core)")
    ap.add_argument("--max-seconds", type=float, default=40.0, help="cap per phase")
    args = ap.parse_args()

    from fastjudge.serve import create_app

    if args.max_wait_ms is None:
        import inspect

        args.max_wait_ms = inspect.signature(create_app).parameters["max_wait_ms"].default
    if args.model is None:
        from fastjudge.checkpoints import build_random_t5
        from fastjudge.demo import tokenizer_corpus

        args.model = str(build_random_t5(tempfile.mkdtemp(), tokenizer_corpus(), shape="tiny"))
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(
        target=serve, args=(args.model, args.device, port, args.max_queue, args.max_wait_ms,
                            args.server_threads),
        daemon=True)
    proc.start()

    async def run() -> list[dict]:
        client = Client(f"http://127.0.0.1:{port}", args.items)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if (await client.http.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or not proc.is_alive():
                    raise RuntimeError("the server did not start")
                await asyncio.sleep(0.2)
            for k in range(5):  # warm-up
                await client.request()
            results = []
            for i in range(args.repeats):
                r = await one_repeat(client, args)
                results.append(r)
                print(f"repeat {i + 1}: single {r['single_ms']:.1f} ms (p99 "
                      f"{r['single_p99_ms']:.1f}) | saturation "
                      f"{r['sat_rps']:.1f} req/s ({r['sat_ips']:.1f} items/s) | low load "
                      f"{r['low_rps']:.2f} req/s: p50 {r['low_p50_ms']:.1f} ms, p90 "
                      f"{r['low_p90_ms']:.1f} ms, p99 "
                      f"{r['low_p99_ms']:.1f} ms (x{r['low_ratio']:.2f}), max in flight "
                      f"{r['low_max_inflight']} | overload {r['over_rps']:.1f} req/s: "
                      f"{r['over_sent']} sent, {r['over_200']} x 200, {r['over_429']} x 429, "
                      f"{r['over_other']} other, {r['over_no_response']} without response, "
                      f"server answered {r['over_server_answered']} | load average "
                      f"{r['load_before']:.1f} -> {r['load_after']:.1f}", flush=True)
            return results
        finally:
            await client.http.aclose()

    try:
        results = asyncio.run(run())
    finally:
        proc.terminate()
        proc.join(10)

    def med(key):
        return statistics.median(r[key] for r in results)

    print(f"\nmedians over {len(results)} repeats ({args.items} items/request, max_wait_ms "
          f"{args.max_wait_ms:g}, queue {args.max_queue} items, server torch threads "
          f"{args.server_threads or 'default'}):")
    print(f"  single-request latency      {med('single_ms'):8.1f} ms")
    print(f"  saturation                  {med('sat_rps'):8.1f} req/s  {med('sat_ips'):8.1f} "
          f"items/s  (p50 {med('sat_p50_ms'):.1f} ms at concurrency "
          f"{args.saturation_concurrency})")
    print(f"  low load ({args.low_load:g} x 1/L)         p50 {med('low_p50_ms'):.1f} ms  p99 "
          f"{med('low_p99_ms'):.1f} ms  = {med('low_ratio'):.2f} x single "
          f"(single p99 {med('single_p99_ms'):.1f} ms; low-load p99 / single p99 = "
          f"{med('low_tail_ratio'):.2f})")
    print(f"  overload ({args.overload_factor:g} x saturation)  "
          f"{med('over_rps'):.1f} req/s offered, goodput {med('over_goodput_ips'):.1f} items/s, "
          f"200: {med('over_200'):g}, 429: {med('over_429'):g}, other: {med('over_other'):g}, "
          f"no response: {med('over_no_response'):g}")
    p99_ok = med("low_ratio") <= LOW_LOAD_P99_TARGET
    overload_ok = all(r["over_other"] == 0 and r["over_no_response"] == 0
                      and r["over_server_match"] and r["over_sent"] > 0 for r in results)
    clean = all(r["single_errors"] == r["sat_errors"] == r["low_errors"] == 0 for r in results)
    print(f"  target p99(low) <= {LOW_LOAD_P99_TARGET} x single: "
          f"{'met' if p99_ok else 'not met'} ({med('low_ratio'):.2f}; timing: reported, not an exit status)")
    print(f"  target overload: only 200/429, every request answered once: "
          f"{'PASS' if overload_ok else 'FAIL'}")
    if not clean:
        print("  (errors below saturation: see the repeat lines)")
    return 0 if overload_ok and clean else 1  # answers, not timings, decide the exit status


if __name__ == "__main__":
    sys.exit(main())
