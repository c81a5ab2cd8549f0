"""The server's Prometheus metrics: queue, throughput, requests by path and status, latency."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..runtime.async_batcher import AsyncBatcher

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
