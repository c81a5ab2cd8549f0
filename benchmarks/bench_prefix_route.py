"""Prefix route against whole prompts: where sharing a prefix starts to pay, measured.

``backends.qwen.routing`` runs a request's shared prefix once (prefix pass, cached state, suffix
pass) only when ``(n - 1) * P >= pass_tokens`` for ``n`` requests sharing a ``P``-token prefix;
otherwise the prompts run whole, batched across prefixes. This times both routes, forced, on
score-only workloads of ``--groups`` prefixes x ``n`` requests (``P`` prefix tokens, ``--suffix``
tokens each) through the scheduler, and prints which was faster next to the rule's pick: the
``P`` where the prefix route starts winning at ``n = 2`` is the device's ``pass_tokens``.

    python benchmarks/bench_prefix_route.py --shape mini
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fastjudge.checkpoints import build_random_qwen
from fastjudge.demo import tokenizer_corpus

sys.path.insert(0, str(Path(__file__).parent))
from bench_device import DEVICES, bench_device, device_label  # noqa: E402


def workload(rng, groups: int, sharing: int, prefix: int, suffix: int, vocab: int) -> list:
    from fastjudge.runtime.requests import Choice, Request

    out = []
    for _ in range(groups):
        head = rng.integers(5, vocab - 8, size=prefix)
        for _ in range(sharing):
            ids = np.concatenate([head, rng.integers(5, vocab - 8, size=suffix)])
            out.append(Request(len(out), ids, Choice((10, 11, 12)), prefix_len=prefix))
    return out


def seconds(backend, requests, pass_tokens: int, repeats: int, device) -> float:
    """Median wall time of the workload with the route forced by ``pass_tokens`` (0: prefix
    route; above any saving: whole), the prefix cache (and its memory of prefixes) emptied first."""
    from fastjudge.runtime.prefix_cache import PrefixCache
    from fastjudge.runtime.scheduler import run_requests

    backend.pass_tokens = pass_tokens
    times = []
    for i in range(repeats + 1):
        backend.prefix_cache = PrefixCache(backend.prefix_cache.index.capacity_bytes)
        start = time.perf_counter()
        for _ in run_requests(backend, requests, backend.default_batch_tokens):
            pass
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first run warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="mini")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", choices=DEVICES)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--sharing", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--prefix", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from fastjudge.backends import load_backend
    from fastjudge.engine_options import EngineOptions

    device = bench_device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_qwen(Path(tmp) / "qwen", tokenizer_corpus(), shape=args.shape, vocab_size=4000)
        backend = load_backend(model_dir, EngineOptions(device=str(device), dtype=args.dtype, compile="off"))
        rule, vocab = backend.pass_tokens, backend.shape.vocab_size
        rng = np.random.default_rng(0)
        print(f"Qwen3.5 {args.shape} {args.dtype}, {device_label(device)}, {torch.get_num_threads()} threads; "
              f"{args.groups} prefixes x n requests, {args.suffix}-token suffixes; pass_tokens = {rule}")
        print("| n | P | prefix route s | whole s | prefix / whole | faster | rule picks |")
        print("|---:|---:|---:|---:|---:|---|---|")
        for n in args.sharing:
            for p in args.prefix:
                reqs = workload(rng, args.groups, n, p, args.suffix, min(vocab, 1000))
                via_prefix = seconds(backend, reqs, 0, args.repeats, device)
                whole = seconds(backend, reqs, 1 << 40, args.repeats, device)
                pick = "whole" if (n - 1) * p < rule else "prefix"
                print(f"| {n} | {p} | {via_prefix:.3f} | {whole:.3f} | {via_prefix / whole:.2f} | "
                      f"{'whole' if whole < via_prefix else 'prefix'} | {pick} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
