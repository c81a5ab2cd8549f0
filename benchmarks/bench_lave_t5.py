"""LAVE score-only throughput on Flan-T5-shaped judges: fastjudge vs a transformers baseline.

Both run in this process on the same random-weight checkpoint and the same 64 LAVE prompts
(8 demonstrations each, built by ``LaveJudge.build_prompt``):

* baseline: ``fastjudge.reference.lave.TransformersLave``: ``T5ForConditionalGeneration``,
  pad-longest batches in input order, one decoder step, argmax over the three rating-token
  logits (its prompt building and tokenization timed with it, as fastjudge's are);
* fastjudge: ``LaveJudge.score`` (C++-planned length-sorted packing, fused projections,
  SDPA attention, reassociated cross-attention, K-row LM head).

Prints items/s, prompt tokens/s, ratios, and the encoder's FLOP rate against this machine's
GEMM rate measured here. Medians over ``--repeats`` runs.

    python benchmarks/bench_lave_t5.py --shapes small base --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

from fastjudge import LaveJudge, VQAExample
from fastjudge.checkpoints import T5_SHAPES, build_random_t5
from fastjudge.demo import tokenizer_corpus
from fastjudge.engine_options import EngineOptions
from fastjudge.reference.lave import TransformersLave

sys.path.insert(0, str(Path(__file__).parent))
from bench_device import DEVICES, bench_device, device_label  # noqa: E402


def sample_examples(n: int) -> list[VQAExample]:
    rows = [json.loads(line) for line in
            resources.files("fastjudge.data").joinpath("sample_vqa.jsonl").read_text().splitlines()
            if line.strip()]
    return [VQAExample(r["question"], r["references"], r["prediction"], r.get("caption"), f"{i}")
            for i, r in enumerate(rows[j % len(rows)] for j in range(n))]


def gemm_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 10, device="cpu") -> float:
    """Dense GEMM FLOP/s at ``dtype`` on ``device``, best of ``repeats``: the ceiling the encoder
    is compared with (the best run, since a shared machine only ever slows a run down)."""
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times)


def encoder_flops(shape: dict, lengths: list[int]) -> float:
    """Multiply-adds x2 of the encoder over unpadded prompts: projections, gated FF, attention."""
    d, ff, inner = shape["d_model"], shape["d_ff"], shape["num_heads"] * shape["d_kv"]
    per_token = 2 * (4 * d * inner + 3 * d * ff)
    attention = sum(4 * n * n * inner for n in lengths)
    return shape["num_layers"] * (per_token * sum(lengths) + attention)


def timed(fn, repeats: int, before=None) -> tuple[float, object]:
    """Median wall time of ``fn`` after one warm-up run (allocator, oneDNN kernels, position-bias
    tables); ``before`` runs untimed ahead of every call (e.g. to empty a cache)."""
    times, out = [], None
    for i in range(repeats + 1):
        if before:
            before()
        t = time.perf_counter()
        out = fn()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["small", "base"], choices=sorted(T5_SHAPES))
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16, help="baseline batch size")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu", choices=DEVICES, help="both paths run here (%(default)s)")
    args = ap.parse_args(argv)
    device = bench_device(args.device)

    examples = sample_examples(args.items)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            model_dir = build_random_t5(Path(tmp) / shape, tokenizer_corpus(), shape=shape,
                                        model_vocab_size=32128)
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                judge = LaveJudge(model_dir, engine=EngineOptions(dtype=dtype, device=str(device)))
                prompts = [judge.build_prompt(e) for e in examples]
                lengths = [len(judge.backend.codec.encode_prompt(p)) for p in prompts]
                base = TransformersLave(model_dir, judge, dtype=dtype, batch_size=args.batch_size,
                                        device=device)
                t_base, base_results = timed(lambda: base.score(examples), args.repeats)
                base_ratings = [r.rating for r in base_results]
                t_fast, results = timed(lambda: judge.score(examples), args.repeats)
                agree = sum(r.rating == b for r, b in zip(results, base_ratings)) / len(results)
                peak = gemm_rate(dtype, device=device)
                enc_rate = encoder_flops(T5_SHAPES[shape], lengths) / t_fast
                rows.append(dict(shape=shape, dtype=dtype_name, items=len(examples),
                                 tokens=sum(lengths), t_base=t_base, t_fast=t_fast, agree=agree,
                                 peak=peak, enc_rate=enc_rate))
                print(f"[{shape} {dtype_name}] baseline {t_base:.2f}s  fastjudge {t_fast:.2f}s  "
                      f"speed-up {t_base / t_fast:.2f}x  rating agreement {agree:.0%}", file=sys.stderr)
                del judge, base

    print(f"\nLAVE score-only, {args.items} prompts x 8 demos, median of {args.repeats}, "
          f"{device_label(device)}")
    print(f"{'shape':6} {'dtype':9} {'base it/s':>9} {'fast it/s':>9} {'fast tok/s':>10} "
          f"{'ratio':>6} {'vs fp32 base':>12} {'enc TFLOP/s':>11} {'GEMM peak':>9} {'util':>5}")
    fp32_base = {r["shape"]: r["t_base"] for r in rows if r["dtype"] == "float32"}
    for r in rows:
        vs32 = f"{fp32_base[r['shape']] / r['t_fast']:.2f}x" if r["shape"] in fp32_base else "-"
        print(f"{r['shape']:6} {r['dtype']:9} {r['items'] / r['t_base']:9.1f} "
              f"{r['items'] / r['t_fast']:9.1f} {r['tokens'] / r['t_fast']:10.0f} "
              f"{r['t_base'] / r['t_fast']:5.2f}x {vs32:>12} {r['enc_rate'] / 1e12:11.3f} "
              f"{r['peak'] / 1e12:9.3f} {r['enc_rate'] / r['peak']:5.0%}")
    print("util = encoder FLOPs / end-to-end fastjudge time / measured GEMM rate "
          "(a lower bound on encoder utilization).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
