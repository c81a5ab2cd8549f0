"""LAVE score-only on Qwen3.5 judges: fastjudge with shared-prefix reuse vs transformers.

Both run in this process on the same random-weight Qwen3.5 text checkpoint (hybrid Gated
DeltaNet + gated attention) and the same LAVE prompts (8 demonstrations, chat template with
thinking disabled):

* baseline: ``fastjudge.reference.lave.TransformersLave``: the transformers model, full prompts
  through the chat template in pad-longest (left-padded) batches in input order,
  ``logits_to_keep=1``, argmax over the three rating-token logits;
* fastjudge: ``LaveJudge.score``: each demonstration prefix runs once, its KV and DeltaNet
  conv/recurrent state are cached, suffixes run in length-sorted right-padded batches.

Prints items/s, the ratio, the prefix-cache hit rate and tokens computed vs tokens in the
prompts. Medians over ``--repeats`` runs; the cache is emptied before each fastjudge run, so
every run pays for its prefixes.

    python benchmarks/bench_lave_qwen.py --shapes mini small --items 256 --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from fastjudge import LaveJudge
from fastjudge.checkpoints import QWEN_SHAPES, build_random_qwen
from fastjudge.demo import tokenizer_corpus
from fastjudge.engine_options import EngineOptions
from fastjudge.reference.lave import TransformersLave
from fastjudge.runtime.prefix_cache import PrefixCache

sys.path.insert(0, str(Path(__file__).parent))
from bench_device import DEVICES, bench_device, device_label  # noqa: E402
from bench_lave_t5 import sample_examples, timed  # noqa: E402  (shared sample source and timer)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["mini", "small"], choices=sorted(QWEN_SHAPES))
    ap.add_argument("--items", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16, help="baseline batch size")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu", choices=DEVICES, help="both paths run here (%(default)s)")
    args = ap.parse_args(argv)
    device = bench_device(args.device)
    dtype = getattr(torch, args.dtype)
    examples = sample_examples(args.items)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            model_dir = build_random_qwen(Path(tmp) / shape, tokenizer_corpus(), shape=shape,
                                         vocab_size=4000)
            judge = LaveJudge(model_dir, engine=EngineOptions(device=str(device), dtype=dtype))
            backend = judge.backend
            prompt_tokens = sum(len(backend.codec.encode_prompt(judge.build_prompt(e))) for e in examples)
            base = TransformersLave(model_dir, judge, dtype=dtype, batch_size=args.batch_size, device=device)

            def fresh_cache():
                backend.prefix_cache = PrefixCache(backend.prefix_cache.index.capacity_bytes)
                backend.tokens_computed = 0

            t_base, base_results = timed(lambda: base.score(examples), args.repeats)
            base_ratings = [r.rating for r in base_results]
            t_fast, results = timed(lambda: judge.score(examples), args.repeats, fresh_cache)
            cache = backend.prefix_cache
            computed = backend.tokens_computed
            agree = sum(r.rating == b for r, b in zip(results, base_ratings)) / len(results)
            rows.append(dict(shape=shape, t_base=t_base, t_fast=t_fast, hit=cache.hit_rate,
                             prompt_tokens=prompt_tokens, computed=computed, agree=agree))
            print(f"[{shape}] baseline {t_base:.2f}s fastjudge {t_fast:.2f}s "
                  f"speed-up {t_base / t_fast:.2f}x agreement {agree:.0%}", file=sys.stderr)
            del judge, base

    print(f"\nLAVE score-only on Qwen3.5, {args.items} prompts x 8 demos, {args.dtype}, "
          f"median of {args.repeats}, {device_label(device)}")
    print(f"{'shape':6} {'base it/s':>9} {'fast it/s':>9} {'ratio':>6} {'hit rate':>8} "
          f"{'prompt tok':>10} {'computed tok':>12} {'agree':>6}")
    for r in rows:
        print(f"{r['shape']:6} {args.items / r['t_base']:9.1f} {args.items / r['t_fast']:9.1f} "
              f"{r['t_base'] / r['t_fast']:5.2f}x {r['hit']:8.1%} {r['prompt_tokens']:10d} "
              f"{r['computed']:12d} {r['agree']:6.0%}")
    print("computed tok = prefix tokens run once per distinct prefix + every suffix token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
