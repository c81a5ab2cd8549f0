"""LAVE rationale decoding on a Flan-T5-shaped judge: wall time of a call and time per decode step.

The workload of the peer benchmarks' "LAVE rationale" row: ``--items`` LAVE items with the
bundled 8-shot prompts (``bench.items.lave_items``), greedy rationales of ``--new-tokens``, run
through the backend's ``run`` on a random-weight checkpoint of ``--shape`` with the real
32128-row vocabulary (random weights: every row runs its whole budget). Per run: the call's wall
time, and the decode loop's time per step (``bench.step_profile``: the encoder and each row's
one-time cross-attention projection left out), medians of ``--repeats`` after a warm-up.

``--project-at`` sets the step from which steps attend over projected cross-attention K/V
(``auto``: the backend's choice, ``decode.projection_step``; ``never``; or a step).

    python benchmarks/bench_t5_rationale.py --new-tokens 30
    python benchmarks/bench_t5_rationale.py --new-tokens 100 --project-at never
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fastjudge import EngineOptions, LaveJudge
from fastjudge.bench.items import lave_items
from fastjudge.bench.step_profile import profile_decoding
from fastjudge.checkpoints import T5_SHAPES, build_random_t5
from fastjudge.demo import tokenizer_corpus


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", choices=sorted(T5_SHAPES))
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=30)
    ap.add_argument("--project-at", default="auto", help="auto, never, or a step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_t5(Path(tmp) / args.shape, tokenizer_corpus(), shape=args.shape,
                                    model_vocab_size=32128)
        judge = LaveJudge(model_dir, engine=EngineOptions(device="cpu", dtype=args.dtype, compile="off"),
                          rationale=True, max_new_tokens=args.new_tokens)
        backend = judge.backend
        if args.project_at != "auto":
            backend.project_at = None if args.project_at == "never" else int(args.project_at)
        requests = [judge._request(i, example)[0] for i, example in enumerate(lave_items(args.items))]
        lengths = sorted(len(r.prompt_ids) for r in requests)
        backend.run(requests)  # warm-up
        walls, steps = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            backend.run(requests)
            walls.append(time.perf_counter() - start)
            steps.append(profile_decoding(lambda: backend.run(requests)))
    print(f"{args.items} items of {lengths[0]}-{lengths[-1]} prompt tokens, {args.new_tokens} new tokens, "
          f"{args.shape}, {args.dtype}, {torch.get_num_threads()} threads, project-at {args.project_at}")
    print(f"call: median {statistics.median(walls):.2f} s (min {min(walls):.2f}); "
          f"decode step: median {statistics.median(s['ms'] for s in steps):.1f} ms "
          f"(min {min(s['ms'] for s in steps):.1f}) over {steps[-1]['steps']} steps; "
          f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
