"""Batch planner throughput: C++ engine vs. the pure-Python planner, same run, same input.

    python benchmarks/bench_planner.py            # 1M requests
    python benchmarks/bench_planner.py --n 100000 --repeats 9

Lengths follow a log-normal clipped to 300-1200 tokens (typical judge prompts); one run
has no groups, one has ~1000 groups (shared-prefix slots). Prints median wall time per
plan, requests planned per second and the C++/Python ratio. Both planners are checked to
return identical batches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from fastjudge import _engine
from fastjudge.runtime.planner import padded_tokens, plan_batches, plan_batches_python


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    times = []
    result = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="requests per plan")
    parser.add_argument("--groups", type=int, default=1000, help="groups in the grouped run")
    parser.add_argument("--max-batch-tokens", type=int, default=65536)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per C++ planner")
    parser.add_argument("--python-repeats", type=int, default=3, help="timed Python runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(np.log(600), 0.35, args.n), 300, 1200).astype(np.int64)
    scenarios = {
        "no groups": None,
        f"{args.groups} groups": rng.integers(0, args.groups, args.n, dtype=np.int64),
    }
    tokens, size = args.max_batch_tokens, args.max_batch_size

    print(
        f"n={args.n:,} lengths 300-1200 (median {int(np.median(lengths))}), "
        f"max_batch_tokens={tokens}, max_batch_size={size}, "
        f"medians of {args.repeats} C++ / {args.python_repeats} Python runs"
    )
    header = f"{'scenario':<13} {'planner':<32} {'median ms':>10} {'requests/s':>12} {'vs Python':>10}"
    print(header)
    print("-" * len(header))
    for name, groups in scenarios.items():
        _engine.plan_batches(lengths, tokens, size, groups)  # warm-up
        raw_s, _ = median_seconds(
            lambda: _engine.plan_batches(lengths, tokens, size, groups), args.repeats
        )
        list_s, batches = median_seconds(
            lambda: plan_batches(lengths, tokens, size, groups), args.repeats
        )
        py_s, expected = median_seconds(
            lambda: plan_batches_python(lengths, tokens, size, groups), args.python_repeats
        )
        if len(batches) != len(expected) or not all(
            np.array_equal(a, b) for a, b in zip(batches, expected)
        ):
            raise SystemExit(f"{name}: C++ and Python plans differ")
        rows = [
            ("C++ _engine.plan_batches (arrays)", raw_s),
            ("C++ plan_batches (list of arrays)", list_s),
            ("Python plan_batches_python", py_s),
        ]
        for planner, seconds in rows:
            print(
                f"{name:<13} {planner:<32} {seconds * 1e3:>10.1f} "
                f"{args.n / seconds:>12,.0f} {py_s / seconds:>9.1f}x"
            )
        useful = int(lengths.sum())
        print(
            f"{'':<13} {len(batches):,} batches, padding efficiency "
            f"{useful / padded_tokens(lengths, batches):.4f}"
        )


if __name__ == "__main__":
    main()
