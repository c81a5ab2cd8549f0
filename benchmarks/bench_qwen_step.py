"""The Qwen3.5 decoding step on the CPU engine against its bound, and where its time goes.

On a random-weight checkpoint of ``--shape`` (the ``mini`` Qwen3.5 by default), for each of
``--rows``:

* engine step: one ``_engine.QwenDecoder`` call (``backends.qwen.engine_step``), one new token a
  row after ``--cached`` tokens in every row, on a state pool of the rows' own keys, values and
  recurrent states (so they stream from memory as in a real step);
* the same call after only 8 cached tokens, alternating with the first in one process (this
  machine's speed drifts between processes): the difference is what the full-attention layers'
  reading of the longer context costs the step, its cache effects included;
* whole step: a decoding step as a judge runs it (``backend.run`` of the rows decoding
  ``--new-tokens`` against one token, after a cached prefix that every row shares, which the
  engine reads once a step: this can be shorter than the engine step above, whose rows hold keys
  of their own), the time inside its engine calls
  counted apart (greedy text rows: runs of steps with their final norm, LM head and pick,
  ``EngineStep.run_picks``): the rest (``host``) is the loop's bookkeeping.

The bound of the engine step is ``bench.roofline``'s (its FLOPs at the machine's measured GEMM
peak, its bytes at the measured read bandwidth, the larger of the two; the LM head left out),
both measured in the same run; ``of bound`` is the bound over the time (above 100 % where the
working set stays in the last-level cache between steps, which DRAM bandwidth does not bound).

    python benchmarks/bench_qwen_step.py
    python benchmarks/bench_qwen_step.py --rows 16 --dtype bfloat16 --cached 1100
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from fastjudge.backends import load_backend
from fastjudge.backends.dense import prepare_dense
from fastjudge.backends.qwen.engine_step import EngineStep
from fastjudge.backends.qwen.pool import StatePool
from fastjudge.bench import roofline as rl
from fastjudge.checkpoints import QWEN_SHAPES, build_random_qwen_vl
from fastjudge.demo import tokenizer_corpus
from fastjudge.engine_options import EngineOptions
from fastjudge.runtime.requests import Request, Text

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHORT_CONTEXT = 8


def engine_steps(backend, rows: int, contexts: tuple[int, ...], calls: int) -> list[float]:
    """Median seconds of one engine step of ``rows`` rows after each of ``contexts`` cached
    tokens, the contexts taking turns call by call."""
    model = backend.model
    pool = StatePool(backend.shape, rows, max(contexts) + 64, "cpu", model.embed.dtype)
    with torch.inference_mode():
        for t in pool.buffers():
            if t.is_floating_point():
                t.normal_(0.0, 0.5)
    step = EngineStep(model, pool)
    tokens = torch.randint(5, model.embed.shape[0], (rows, 1))
    counts = np.ones(rows, dtype=np.int64)
    lengths, positions = pool.lengths.numpy(), pool.positions.numpy()
    times = [[] for _ in contexts]
    for call in range(calls + len(contexts)):  # the first call of each context is a warm-up
        i = call % len(contexts)
        lengths[:] = positions[:] = contexts[i]
        start = time.perf_counter()
        step(tokens, counts, 0, contexts[i] + 1)
        if call >= len(contexts):
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


@contextmanager
def engine_time():
    """Seconds spent inside engine steps (``EngineStep`` calls and runs of picking steps) while
    the block runs: a list whose one entry grows."""
    spent = [0.0]
    originals = {name: getattr(EngineStep, name) for name in ("__call__", "run_picks")}

    def timing(run):
        def timed(self, *args, **kwargs):
            start = time.perf_counter()
            out = run(self, *args, **kwargs)
            spent[0] += time.perf_counter() - start
            return out
        return timed

    for name, run in originals.items():
        setattr(EngineStep, name, timing(run))
    try:
        yield spent
    finally:
        for name, run in originals.items():
            setattr(EngineStep, name, run)


def whole_step(backend, rows: int, cached: int, new_tokens: int, repeats: int) -> tuple[float, float]:
    """Seconds per decoding step of ``rows`` rows as a judge runs them, and of it the host's
    (outside the engine step): runs of ``new_tokens`` against runs of one, after a cached
    prefix of ``cached - 8`` tokens and 8 of each row's own (random weights rarely stop early;
    the steps are counted)."""
    rng = np.random.default_rng(1)
    vocab = backend.model.embed.shape[0]
    prefix = rng.integers(5, vocab - 8, size=cached - 8)
    prompts = [np.concatenate([prefix, rng.integers(5, vocab - 8, size=8)]) for _ in range(rows)]

    def run(n: int):
        return backend.run([Request(i, p, Text(n), prefix_len=len(prefix)) for i, p in enumerate(prompts)])

    def medians(n: int) -> tuple[float, float]:
        run(n)
        wall, host = [], []
        for _ in range(repeats):
            with engine_time() as engine:
                start = time.perf_counter()
                run(n)
                wall.append(time.perf_counter() - start)
            host.append(wall[-1] - engine[0])
        return statistics.median(wall), statistics.median(host)

    steps = max(max(len(o.token_ids) for o in run(new_tokens)) - 1, 1)
    (wall_n, host_n), (wall_1, host_1) = medians(new_tokens), medians(1)
    # differences of medians: a noisy machine can make a short difference come out below zero,
    # which no step takes (read as 0)
    return max(wall_n - wall_1, 0.0) / steps, max(host_n - host_1, 0.0) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="mini", choices=sorted(QWEN_SHAPES))
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--cached", type=int, default=460, help="cached tokens a row before the step")
    ap.add_argument("--calls", type=int, default=200, help="engine calls timed for each context")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens a row in the whole-step runs")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each whole-step length")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_qwen_vl(Path(tmp) / "qwen", tokenizer_corpus(), seed=3, shape=args.shape)
        backend = load_backend(model_dir, EngineOptions(device="cpu", dtype=args.dtype, compile="off"))
        prepare_dense(backend.model, enabled=True)
        dims = rl.QwenDims.from_config(json.loads((model_dir / "config.json").read_text()))
        peak = rl.peak_gemm_rate(2048, dims.hidden, 2048, dtype, torch.device("cpu"))
        read = rl.bandwidth(torch.device("cpu"))["sum"]
        print(f"Qwen3.5 {args.shape} (hidden {dims.hidden}, {dims.full_layers} attention + {dims.linear_layers} "
              f"DeltaNet layers), {args.dtype}, {torch.get_num_threads()} threads, {args.cached} cached tokens; "
              f"GEMM peak {peak / 1e9:.0f} GFLOP/s, read {read / 1e9:.1f} GB/s")
        print(f"{'rows':>4} {'engine ms':>10} {'bound ms':>9} {'bound':>7} {'of bound':>9} "
              f"{f'ctx {SHORT_CONTEXT} ms':>9} {'context':>8} {'whole ms':>9} {'host':>6}")
        for rows in args.rows:
            full, short = engine_steps(backend, rows, (args.cached, SHORT_CONTEXT), args.calls)
            cost = rl.qwen_forward_cost(dims, rows, 1, args.cached, dtype, logits_rows=0)
            bound, kind = rl.bound_seconds(cost, peak, read)
            whole, host = whole_step(backend, rows, args.cached, args.new_tokens, args.repeats)
            host_share = host / whole if whole else 0.0
            print(f"{rows:>4} {full * 1e3:>10.3f} {bound * 1e3:>9.3f} {kind:>7} {bound / full:>8.0%} "
                  f"{short * 1e3:>9.3f} {(full - short) / full:>7.0%} {whole * 1e3:>9.3f} {host_share:>5.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
