"""Host-side engine throughput: C++ vs. the plain-Python versions, same run, same input.

    python benchmarks/bench_planner.py            # 1M requests, 100k cached prefixes
    python benchmarks/bench_planner.py --n 100000 --repeats 9
    python benchmarks/bench_planner.py --only prefix-index --prefix-python-repeats 3

Batch planner: lengths follow a log-normal clipped to 300-1200 tokens (typical judge
prompts); one run has no groups, one has ~1000 groups (shared-prefix slots). Prints median
wall time per plan, requests planned per second and the C++/Python ratio. Both planners are
checked to return identical batches.

Prefix index: LAVE-shaped prompts, two demonstration blocks shared by a few hundred heads
(demonstrations + question), each extended by its own tail to ~600 tokens. Times inserting
every prefix into an empty index (with room for all, and with room for a tenth so that most
inserts evict), then matching one query per prefix (the prefix plus a continuation; one in
ten has an uncached tail and misses) one call at a time and in one ``match_many`` call.
Prints median wall time, operations per second and the C++/Python ratio; both indexes are
checked to return identical slots, evictions and matches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from fastjudge import _engine
from fastjudge.runtime.planner import padded_tokens, plan_batches
from fastjudge.runtime.prefix_index import PrefixIndex
from fastjudge.testing import PrefixIndexPython, plan_batches_python


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    times = []
    result = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def bench_planner(args: argparse.Namespace) -> None:
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



# ---------------------------------------------------------------------------------------
# prefix index
# ---------------------------------------------------------------------------------------

VOCAB = 32_000
BYTES_PER_TOKEN = 1 << 17  # KV state of a ~1B-parameter decoder; only ratios matter here


def lave_like_prompts(
    rng: np.random.Generator, n: int, heads: int, length: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """n cached prefixes and one query per prefix, as int64 views into two flat buffers.

    Two demonstration blocks (70% of ``length``) are shared by ``heads`` heads (block +
    question, 15%), and every prefix adds its own tail (~15%). A query is its prefix plus
    a 40-token continuation; every tenth query swaps the tail for an uncached one (a miss).
    """
    demo_len, question_len = int(0.70 * length), int(0.15 * length)
    tail_mean = max(1, length - demo_len - question_len)
    demos = [rng.integers(0, VOCAB, demo_len) for _ in range(2)]
    head_list = [
        np.concatenate([demos[h % 2], rng.integers(0, VOCAB, question_len)]) for h in range(heads)
    ]
    head_of = rng.integers(0, heads, n)
    tail_lens = rng.integers(tail_mean // 2 + 1, tail_mean * 3 // 2 + 1, n)
    prefix_parts, query_parts = [], []
    for i in range(n):
        head = head_list[head_of[i]]
        tail = rng.integers(0, VOCAB, tail_lens[i])
        prefix_parts.append(np.concatenate([head, tail]))
        if i % 10 == 9:
            tail = rng.integers(0, VOCAB, tail_lens[i])
        query_parts.append(np.concatenate([head, tail, rng.integers(0, VOCAB, 40)]))

    def views(parts: list[np.ndarray]) -> list[np.ndarray]:
        flat = np.concatenate(parts).astype(np.int64)
        bounds = np.cumsum([0] + [len(p) for p in parts]).tolist()
        return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    return views(prefix_parts), views(query_parts)


def median_op_seconds(setup, op, repeats: int) -> tuple[float, object]:
    """Median time of op(setup()); setup and the teardown of its state are not timed."""
    times = []
    result = None
    for _ in range(repeats):
        state = setup()
        start = time.perf_counter()
        result = op(state)
        times.append(time.perf_counter() - start)
        del state
    return statistics.median(times), result


def insert_all(index, prefixes: list[np.ndarray]) -> tuple[list[int], list[int]]:
    """Insert every prefix, draining evictions every 1000 inserts (as an owner would)."""
    slots, evicted = [], []
    for i, tokens in enumerate(prefixes):
        slots.append(index.insert(tokens, len(tokens) * BYTES_PER_TOKEN))
        if i % 1000 == 999:
            evicted.extend(index.take_evicted().tolist())
    evicted.extend(index.take_evicted().tolist())
    return slots, evicted


def bench_prefix_index(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    n = args.prefixes
    prefixes, queries = lave_like_prompts(rng, n, args.heads, args.prefix_len)
    flat_queries = np.concatenate(queries)
    offsets = np.cumsum([0] + [len(q) for q in queries])
    total_bytes = sum(len(p) for p in prefixes) * BYTES_PER_TOKEN
    tenth = total_bytes // 10
    print(
        f"\nprefix index: {n:,} prefixes of ~{args.prefix_len} tokens "
        f"(2 demonstration blocks, {args.heads} heads, median length "
        f"{int(np.median([len(p) for p in prefixes]))}), queries 90% hits, "
        f"medians of {args.repeats} C++ / {args.prefix_python_repeats} Python runs"
    )
    header = f"{'operation':<24} {'index':<18} {'median ms':>10} {'ops/s':>12} {'vs Python':>10}"
    print(header)
    print("-" * len(header))

    def report(operation: str, timings: dict[str, float]) -> None:
        py_s = timings["Python"]
        for name, seconds in timings.items():
            print(
                f"{operation:<24} {name:<18} {seconds * 1e3:>10.1f} "
                f"{n / seconds:>12,.0f} {py_s / seconds:>9.1f}x"
            )

    py_repeats = args.prefix_python_repeats
    impls = {"C++": (PrefixIndex, args.repeats), "Python": (PrefixIndexPython, py_repeats)}
    full: dict[str, object] = {}
    for capacity, operation in [(total_bytes, "insert"), (tenth, "insert (evicting 90%)")]:
        timings, results = {}, {}
        for name, (make, repeats) in impls.items():
            timings[name], results[name] = median_op_seconds(
                lambda: make(capacity), lambda index: insert_all(index, prefixes), repeats
            )
        if results["C++"] != results["Python"]:
            raise SystemExit(f"{operation}: C++ and Python slots or evictions differ")
        report(operation, timings)
        evictions = len(results["C++"][1])
    for name, (make, _) in impls.items():
        full[name] = make(total_bytes)
        insert_all(full[name], prefixes)

    matched = {}
    timings = {}
    for name, (_, repeats) in impls.items():
        index = full[name]
        timings[name], matched[name] = median_op_seconds(
            lambda: index, lambda ix: [ix.match(q) for q in queries], repeats
        )
    if matched["C++"] != matched["Python"]:
        raise SystemExit("match: C++ and Python results differ")
    report("match", timings)

    timings, many = {}, {}
    variants = {
        "C++ (list)": (full["C++"], lambda ix: ix.match_many(queries), args.repeats),
        "C++ (flat+offsets)": (
            full["C++"], lambda ix: ix.match_many(flat_queries, offsets), args.repeats),
        "Python": (full["Python"], lambda ix: ix.match_many(queries), py_repeats),
    }
    for name, (index, op, repeats) in variants.items():
        timings[name], result = median_op_seconds(lambda: index, op, repeats)
        many[name] = [r.tolist() for r in result]
    expected = [[s for s, _ in matched["C++"]], [length for _, length in matched["C++"]]]
    if any(result != expected for result in many.values()):
        raise SystemExit("match_many: results differ from match")
    report("match_many", timings)
    hits = sum(slot >= 0 for slot, _ in matched["C++"])
    reused = sum(length for _, length in matched["C++"])
    print(
        f"{'':<24} {hits:,} of {n:,} queries hit ({reused / len(flat_queries):.1%} of query "
        f"tokens reused); the evicting run evicted {evictions:,} entries"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["planner", "prefix-index"], help="run one part")
    parser.add_argument("--n", type=int, default=1_000_000, help="requests per plan")
    parser.add_argument("--groups", type=int, default=1000, help="groups in the grouped run")
    parser.add_argument("--max-batch-tokens", type=int, default=65536)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--prefixes", type=int, default=100_000, help="cached prefixes")
    parser.add_argument("--prefix-len", type=int, default=600, help="tokens per prefix")
    parser.add_argument("--heads", type=int, default=300, help="distinct prefix heads")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per C++ case")
    parser.add_argument("--python-repeats", type=int, default=3, help="timed Python plans")
    parser.add_argument(
        "--prefix-python-repeats", type=int, default=1,
        help="timed Python prefix-index runs (each takes seconds at 100k prefixes)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.only != "prefix-index":
        bench_planner(args)
    if args.only != "planner":
        bench_prefix_index(args)


if __name__ == "__main__":
    main()
