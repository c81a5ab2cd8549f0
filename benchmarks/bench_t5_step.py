"""The T5 decoder step on the CPU engine, piece by piece: its projections, its reassociated
cross-attention and the whole engine call, at a decoding step's rows.

On a random-weight checkpoint of ``--shape`` (Flan-T5-small's by default), with every decoder
layer's own weights, so they stream from memory as in a real step:

* projections: each layer's fused q/k/v, o, cross q, cross o, gated feed-forward and down
  projection through ``_engine.dense_product`` / ``gated_dense_product`` on the model's panels;
* cross-attention: each layer's ``_engine.reassociated_attention`` (queries mapped into model
  space, attention over ``--encoder-tokens`` states a row, contexts mapped back; a bfloat16
  model's key weights paired once, ``_engine.pair_key_weights``, as the step binds them), with
  a layer's worth of other data read between layers (not timed), as a step's projections pass
  through the cache;
* the step: ``T5Decoder.step`` alone (no LM head), one new token a row, positions cycling
  from 8 to 24.

Each line gives the median ms of ``--repeats`` timed rounds (after a warm-up), the GFLOP/s and
the share of this machine's best measured GEMM rate for the dtype (``bench.roofline``).

    python benchmarks/bench_t5_step.py
    python benchmarks/bench_t5_step.py --rows 16 --dtype bfloat16 --encoder-tokens 1100
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fastjudge import _engine
from fastjudge.backends.dense import ENGINE_ACTIVATIONS, engine_array
from fastjudge.backends.t5.backend import TorchT5Backend
from fastjudge.backends.t5.engine_step import engine_step
from fastjudge.backends.t5.pool import T5Pool
from fastjudge.bench import roofline as rl
from fastjudge.checkpoints import T5_SHAPES, build_random_t5
from fastjudge.demo import tokenizer_corpus

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def median_ms(fn, repeats: int) -> float:
    """Median ms of ``fn()`` over ``repeats`` calls after a warm-up; a call that returns a number
    reports its own seconds (the time of what it measures, not of what it does between)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        own = fn()
        times.append(own if own is not None else time.perf_counter() - start)
    return statistics.median(times) * 1e3


def projections(model, rows: int, threads: int):
    """Every decoder layer's projections of ``rows`` rows, and their FLOPs."""
    s, dtype = model.s, model.embed.dtype
    inner, ff = s.num_heads * s.d_kv, model.decoder[0].wi.out_features // 2
    width = {n: engine_array(torch.randn(rows, n).to(dtype)) for n in {s.d_model, inner, ff}}
    outs = {n: engine_array(torch.empty(rows, n, dtype=dtype)) for n in {s.d_model, inner, ff, 3 * inner}}
    activation = ENGINE_ACTIVATIONS[model.decoder[0].wi.gate]

    def run():
        for layer in model.decoder:
            _engine.dense_product(width[s.d_model], layer.qkv.panels, outs[3 * inner], threads)
            _engine.dense_product(width[inner], layer.o.panels, outs[s.d_model], threads)
            _engine.dense_product(width[s.d_model], layer.x_q.panels, outs[inner], threads)
            _engine.dense_product(width[inner], layer.x_o.panels, outs[s.d_model], threads)
            gate, up = layer.wi.panels
            _engine.gated_dense_product(width[s.d_model], gate, up, outs[ff], activation, threads)
            _engine.dense_product(width[ff], layer.wo.panels, outs[s.d_model], threads)

    params = 6 * s.d_model * inner + 3 * s.d_model * ff
    return run, 2.0 * rows * params * len(model.decoder)


def cross_attention(model, rows: int, tokens: int, threads: int):
    """Every decoder layer's reassociated cross-attention of ``rows`` rows over ``tokens`` states
    a row, and its FLOPs."""
    s, dtype = model.s, model.embed.dtype
    H, dk, d = s.num_heads, s.d_kv, s.d_model
    states = engine_array(torch.randn(rows, tokens, 1, d).to(dtype))
    lengths = np.full(rows, tokens, dtype=np.int64)
    xq = engine_array(torch.randn(rows, 1, H, dk).to(dtype))
    out = engine_array(torch.empty(rows, 1, H, dk, dtype=dtype))
    weights = [(engine_array(layer.x_k.detach().view(H, dk, d)), engine_array(layer.x_v.detach().view(H, dk, d)))
               for layer in model.decoder]
    paired = dtype == torch.bfloat16 and _engine.bf16_dot_products() and dk % 2 == 0 and d % 32 == 0
    pairs = [_engine.pair_key_weights(w_k) if paired else None for w_k, _ in weights]
    ff = model.decoder[0].wi.out_features // 2
    other = torch.ones(6 * d * H * dk + 3 * d * ff)  # as many floats as a layer's other weights

    def run() -> float:
        seconds = 0.0
        for i, ((w_k, w_v), w_k_pairs) in enumerate(zip(weights, pairs)):
            other.sum()
            start = time.perf_counter()
            _engine.reassociated_attention(xq, w_k, w_v, states, lengths, out, 1.0, i % 2 == 1, threads, w_k_pairs)
            seconds += time.perf_counter() - start
        return seconds

    return run, len(weights) * rows * H * (2 * 2 * dk * d + 2 * 2 * tokens * d)


def whole_step(model, rows: int, tokens: int):
    """The engine's decoder step of ``rows`` rows over ``tokens`` encoder states a row."""
    pool = T5Pool(model.s, rows, tokens, 64, "cpu", model.embed.dtype, cross_slots=0)
    model.decoder_bias(65)
    with torch.inference_mode():
        pool.load(0, [torch.randn(tokens, model.s.d_model).to(model.embed.dtype) for _ in range(rows)])
    view, new = pool.view(0, rows), torch.randint(5, 100, (rows, 1))
    counts = torch.ones(rows, dtype=torch.long)
    step = engine_step(model, view, new)
    if step is None:
        raise SystemExit("this model and machine do not take the engine's step (see backends/t5/engine_step.py)")

    def run():
        pool.dec_lengths[:rows] = 8
        for _ in range(16):
            step(new, counts, view, False)

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", choices=sorted(T5_SHAPES))
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--encoder-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_t5(Path(tmp) / "t5", tokenizer_corpus(), shape=args.shape)
        model = TorchT5Backend(model_dir, device="cpu", dtype=args.dtype).model
    s = model.s
    peak = rl.peak_gemm_rate(2048, s.d_model, 2048, DTYPES[args.dtype], torch.device("cpu"))
    print(f"{args.shape} ({s.d_model} x {len(model.decoder)} decoder layers), {args.dtype}, {threads} threads, "
          f"{args.encoder_tokens} encoder tokens a row; GEMM peak {peak / 1e9:.0f} GFLOP/s")
    print(f"{'piece':<20} {'rows':>5} {'ms/step':>9} {'GFLOP/s':>8} {'of peak':>8}")
    for rows in args.rows:
        for name, (run, flops) in (("projections", projections(model, rows, threads)),
                                   ("cross-attention", cross_attention(model, rows, args.encoder_tokens, threads))):
            ms = median_ms(run, args.repeats)
            print(f"{name:<20} {rows:>5} {ms:>9.3f} {flops / ms / 1e6:>8.1f} {flops / ms / 1e6 / (peak / 1e9):>7.0%}")
        ms = median_ms(whole_step(model, rows, args.encoder_tokens), max(args.repeats // 4, 3)) / 16
        print(f"{'engine step':<20} {rows:>5} {ms:>9.3f} {'-':>8} {'-':>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
