"""LAVE as the authors compute it, rationale mode: fastjudge against the authors' scoring path.

Both run in this process on the same random-weight Flan-T5-shaped checkpoint, dtype and items,
with the prompts of the authors' own builder (``lave.py`` of the checkout given with
``--official-repo``, its demonstration files, their defaults: rationale, 8 shots, filter):

* authors' path (``fastjudge.reference.lave.AuthorsLave``: ``LaveFT5.batch_compute`` in their
  ``lave_ft5.py``): transformers
  ``T5ForConditionalGeneration.generate`` on one pad-longest batch of all items,
  ``max_new_tokens=100``; the rating is the token before each row's first EOS, decoded alone;
* fastjudge: ``LaveJudge(model, official_repo=...)``: packed encoder; greedy decoding with
  reassociated cross-attention (no cross-attention K/V), rows leaving the decode batch at their
  EOS or budget and waiting rows joining as they leave (``--max-decode-rows`` caps the decode
  batch).

The checkpoint's EOS and rating rows of the LM head are scaled up
(``fastjudge.checkpoints.scale_output_rows``) so that outputs end at varied lengths, as a real
judge's rationales do, some running to the 100-token limit. Prints items/s of both, the ratio,
whether every score is identical, the spread of output lengths, and the machine's bound for the
job (the encoder and the decoding each at its roofline bound, ``fastjudge.bench.roofline``, with
the GEMM peak and bandwidth measured in the same run): the most any engine could gain over the
authors' path here.

    python benchmarks/bench_lave_official.py --official-repo PATH/TO/lave --items 16
    python benchmarks/bench_lave_official.py --official-repo PATH/TO/lave --device cuda --items 64

``--device cuda`` runs both paths on the GPU (float32 without TF32, ``bench_device``).
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

sys.path.insert(0, str(Path(__file__).parent))
from bench_device import DEVICES, bench_device, device_label  # noqa: E402

from fastjudge import LaveJudge, VQAExample
from fastjudge.backends.t5.backend import TorchT5Backend
from fastjudge.bench import roofline as rl
from fastjudge.checkpoints import T5_SHAPES, build_random_t5, scale_output_rows
from fastjudge.demo import tokenizer_corpus
from fastjudge.engine_options import EngineOptions
from fastjudge.reference.lave import AuthorsLave

MAX_NEW_TOKENS = 100  # the authors' generation limit


def sample_examples(n: int) -> list[VQAExample]:
    rows = [json.loads(line) for line in
            resources.files("fastjudge.data").joinpath("sample_vqa.jsonl").read_text().splitlines()
            if line.strip()]
    return [VQAExample(r["question"], r["references"], r["prediction"], None, f"{i}")
            for i, r in enumerate(rows[j % len(rows)] for j in range(n))]


def varied_length_checkpoint(out_dir: Path, shape: str, eos_scale: float, rating_scale: float) -> Path:
    model_dir = build_random_t5(out_dir, tokenizer_corpus(), shape=shape, model_vocab_size=32128)
    codec = LaveJudge(model_dir, num_shots=0, engine=EngineOptions(device="cpu", dtype="float32")).codec
    ratings = {*codec.answer_ids(["1", "2", "3"]).ids,
               *codec.answer_ids(["1", "2", "3"], after=" So rating=").ids}
    eos = min(codec.eos_token_ids)
    scale_output_rows(model_dir, {**{t: rating_scale for t in ratings}, eos: eos_scale})
    return model_dir


def machine_bound(model_dir: Path, prompt_lengths: list[int], generated: list[int], dtype: torch.dtype,
                  device: torch.device) -> dict:
    """The fastest this machine could run the job: the encoder over every prompt and greedy
    decoding of the tokens generated, each at its roofline bound (``fastjudge.bench.roofline``:
    FLOPs at the best GEMM rate measured now on the encoder's feed-forward shape, bytes at the
    measured copy bandwidth)."""
    d = rl.T5Dims.from_config(json.loads((model_dir / "config.json").read_text()))
    peak = rl.peak_gemm_rate(4096, d.d_model, (2 if d.gated else 1) * d.d_ff, dtype, device)
    bw = max(rl.bandwidth(device).values())
    encoder = rl.t5_encoder_cost(d, prompt_lengths, dtype)
    decode = rl.t5_generation_cost(d, prompt_lengths, generated, dtype)
    seconds = rl.bound_seconds(encoder, peak, bw)[0] + rl.bound_seconds(decode, peak, bw)[0]
    return dict(seconds=seconds, peak=peak, bandwidth=bw, encoder=encoder, decode=decode)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--official-repo", required=True, help="checkout of the LAVE authors' repository")
    ap.add_argument("--shape", default="small", choices=sorted(T5_SHAPES))
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="cpu", choices=DEVICES, help="both paths run here")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of each (median)")
    ap.add_argument("--compile", default="off", choices=["off", "on", "auto"],
                    help="fastjudge's compiled steps (docs/engine.md)")
    ap.add_argument("--eos-scale", type=float, default=2.5)
    ap.add_argument("--rating-scale", type=float, default=2.5)
    ap.add_argument("--max-batch-tokens", type=int, default=None,
                    help="fastjudge's batch budget (default: the backend's)")
    ap.add_argument("--max-decode-rows", type=int, default=None,
                    help="rows fastjudge decodes at once (default: its K/V memory budget)")
    args = ap.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    device = bench_device(args.device)
    examples = sample_examples(args.items)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = varied_length_checkpoint(Path(tmp) / args.shape, args.shape, args.eos_scale,
                                             args.rating_scale)
        backend = TorchT5Backend(model_dir, device=args.device, dtype=dtype,
                                 max_decode_rows=args.max_decode_rows, compile=args.compile)
        judge = LaveJudge(backend, official_repo=args.official_repo,
                          engine=EngineOptions(max_batch_tokens=args.max_batch_tokens))
        # their batch_compute: every item in one batch
        authors = AuthorsLave(model_dir, judge, device=device, dtype=dtype, batch_size=len(examples))
        authors.score(examples[:2])  # warm-up: allocator, kernels, position-bias tables
        judge.score(examples[:2])
        t_authors, t_fast = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            authors_scores = [r.score for r in authors.score(examples)]
            lengths = authors.generated_lengths
            t_authors.append(time.perf_counter() - start)
            start = time.perf_counter()
            results = judge.score(examples)
            t_fast.append(time.perf_counter() - start)
        prompt_tokens = [r.prompt_tokens for r in results]

        steps = [min(n + 1, MAX_NEW_TOKENS) for n in lengths]  # the EOS takes a step
        bound = machine_bound(model_dir, prompt_tokens, steps, dtype, device)

    same = sum(r.score == s for r, s in zip(results, authors_scores))
    base, fast = statistics.median(t_authors), statistics.median(t_fast)
    print(f"LAVE with the authors' code, rationale mode: {args.items} items, {args.shape}, "
          f"{args.dtype}, {device_label(device)}, median of {args.repeats}")
    print(f"prompt tokens {min(prompt_tokens)}-{max(prompt_tokens)}; generated tokens "
          f"min {min(lengths)} median {statistics.median(lengths):.0f} max {max(lengths)} "
          f"({sum(n >= MAX_NEW_TOKENS for n in lengths)} at the limit)")
    print(f"{'path':16} {'seconds':>8} {'items/s':>8}")
    print(f"{'authors (HF)':16} {base:8.2f} {args.items / base:8.2f}")
    print(f"{'fastjudge':16} {fast:8.2f} {args.items / fast:8.2f}")
    print(f"ratio {base / fast:.2f}x (target 4x); identical scores {same}/{len(results)}")
    b = bound
    print(f"machine bound {b['seconds']:.2f} s: encoder {b['encoder'].flops / 1e9:.0f} GFLOP and decoding "
          f"{b['decode'].flops / 1e9:.1f} GFLOP / {b['decode'].bytes / 1e9:.2f} GB at {b['peak'] / 1e9:.0f} GFLOP/s "
          f"and {b['bandwidth'] / 1e9:.1f} GB/s; fastjudge at {b['seconds'] / fast:.0%} of it; no engine can "
          f"beat the authors' path by more than {base / b['seconds']:.2f}x here")
    return 0 if same == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
