"""The engine's causal attention (``_engine.causal_attention``) against SDPA on the CPU: prompts
(``attention.attend_causal`` against ``attend_causal_sdpa``, SDPA in query blocks), suffix
passes (``attention.attend_cached`` with each row's cached key count against SDPA under the
model's additive mask) and decoding steps of one to three tokens a row (the engine's few-token
kernel, whatever the row count, against SDPA with grouped query heads folded into query rows),
one layer of the mini Qwen's heads (4 query heads on 2 key heads, head
size 64) by default, in float32 and bfloat16; with each path's GFLOP/s (the two products over
each query's visible keys), its share of the same run's GEMM peak for the dtype
(``roofline.peak_gemm_rate``) and the rate at which it reads the keys and values (each once:
what bounds a decoding step's attention).

    python benchmarks/bench_attention.py
    python benchmarks/bench_attention.py --heads 16 --kv-heads 4 --head-dim 128 --repeats 20

Every pair of paths is checked to agree (float32 within 1e-5, bfloat16 within 2e-2).

A last table times a decoding step's attention over a prefix its rows share (one token a row,
bfloat16): SDPA over each row's own copy against ``attend_shared_prefix`` (the prefix read once
for all rows), with the caches warm from the previous call and flushed before each (as a model's
step finds them): the measurement behind ``SHARED_PREFIX_MIN_ROWS``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from fastjudge.backends.qwen import attention
from fastjudge.backends.qwen.pool import SharedPrefix
from fastjudge.bench.roofline import peak_gemm_rate

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import median_ms  # noqa: E402

# (rows, new tokens a row, cached keys a row): prompts (no cache), suffix passes, then decoding
# and jump-forward steps (the engine's few-token kernel against SDPA with folded query heads)
PROMPTS = [(16, 233, 0), (4, 512, 0), (1, 1000, 0)]
SUFFIXES = [(16, 130, 94), (64, 40, 450), (16, 30, 800)]
DECODES = [(1, 1, 464), (16, 1, 464), (64, 1, 464), (16, 3, 464), (16, 1, 1200)]


def visible_flops(rows: int, new: int, cached: int, heads: int, head_dim: int) -> float:
    """Two products (scores, weighted values) of every query over its visible keys."""
    keys_seen = new * cached + new * (new + 1) / 2
    return 4.0 * rows * heads * head_dim * keys_seen


def inputs(rows, new, cached, args, dtype):
    gen = torch.Generator().manual_seed(rows * new + cached)
    H, Hkv, hd = args.heads, args.kv_heads, args.head_dim
    q = torch.randn(rows, new, H, hd, generator=gen).to(dtype)
    pool = torch.randn(2, rows, Hkv, cached + new + 8, hd, generator=gen).to(dtype)  # the pool's layout
    keys, values = pool[0, :, :, :cached + new], pool[1, :, :, :cached + new]
    return q, keys, values


def paths(rows, new, cached, args, dtype):
    """The compared paths of one case, each returning [B, H, S, hd]."""
    q, keys, values = inputs(rows, new, cached, args, dtype)
    gqa = args.heads != args.kv_heads
    if not cached:
        qt = q.transpose(1, 2)
        return {"engine": lambda: attention.attend_causal(qt, keys, values, gqa),
                "SDPA (query blocks)": lambda: attention.attend_causal_sdpa(qt, keys, values, gqa)}
    offsets = torch.full((rows,), cached)
    width = cached + new
    hidden = torch.arange(width)[None, None, :] > (offsets[:, None] + torch.arange(new))[..., None]
    mask = torch.zeros(rows, 1, new, width, dtype=dtype).masked_fill_(hidden[:, None], float("-inf"))
    return {"engine": lambda: attention.attend_in_engine(q, keys, values, offsets),
            "SDPA (mask)": lambda: attention.attend_cached(q, keys, values, mask)}


def shared_prefix_table(args) -> None:
    """Decoding over a shared prefix: each row's copy against the prefix read once, warm and cold."""
    flush = torch.empty(64 << 20, dtype=torch.uint8)  # larger than the last-level cache
    H, Hkv, hd = args.heads, args.kv_heads, args.head_dim
    print("| rows | shared / keys | caches | own copies ms | read once ms | ratio |")
    print("|---:|---|---|---:|---:|---:|")
    for rows in (4, 8, 16):
        P, W = 700, 900
        gen = torch.Generator().manual_seed(rows)
        pool = torch.randn(2, rows, Hkv, W + 8, hd, generator=gen).to(torch.bfloat16)
        pool[:, :, :, :P] = pool[:, :1, :, :P].clone()  # every row holds the same prefix
        keys, values = pool[0][:, :, :W], pool[1][:, :, :W]
        q = torch.randn(rows, 1, H, hd, generator=gen).to(torch.bfloat16)
        mask = torch.zeros(rows, 1, 1, W, dtype=torch.bfloat16)
        shared = SharedPrefix(P, [(0, None)])
        for cold in (False, True):
            def timed(fn):
                fn()
                times = []
                for _ in range(args.repeats):
                    if cold:
                        flush.add_(1)
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
                return 1e3 * statistics.median(times)

            own = timed(lambda: attention.attend_cached(q, keys, values, mask))
            once = timed(lambda: attention.attend_cached(q, keys, values, mask, shared))
            caches = "flushed" if cold else "warm"
            print(f"| {rows} | {P} / {W} | {caches} | {own:.3f} | {once:.3f} | {own / once:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    print(f"threads {torch.get_num_threads()}, heads {args.heads} on {args.kv_heads}, head size {args.head_dim}")
    print("| case | dtype | path | ms | GFLOP/s | of GEMM peak | K/V GB/s | vs SDPA |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        peak = peak_gemm_rate(2048, 1024, 1024, dtype, cpu)
        for rows, new, cached in PROMPTS + SUFFIXES + DECODES:
            case = f"{rows} x {new} tokens" + (f" after {cached}" if cached else "")
            runs = paths(rows, new, cached, args, dtype)
            results = {name: fn() for name, fn in runs.items()}
            first, *others = results.values()
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            for other in others:
                torch.testing.assert_close(other.float(), first.float(), rtol=tol, atol=tol)
            times = {name: median_ms(fn, args.repeats) for name, fn in runs.items()}
            sdpa = next(t for name, t in times.items() if name != "engine")
            flops = visible_flops(rows, new, cached, args.heads, args.head_dim)
            kv_bytes = 2 * rows * args.kv_heads * (cached + new) * args.head_dim * torch.finfo(dtype).bits / 8
            for name, ms in times.items():
                rate = flops / (ms / 1e3)
                print(f"| {case} | {str(dtype).replace('torch.', '')} | {name} | {ms:.3f} | {rate / 1e9:.0f} | "
                      f"{rate / peak:.0%} | {kv_bytes / ms / 1e6:.1f} | {sdpa / ms:.2f}x |")
        print(f"(GEMM peak, {str(dtype).replace('torch.', '')}: {peak / 1e9:.0f} GFLOP/s)")
    shared_prefix_table(args)


if __name__ == "__main__":
    main()
