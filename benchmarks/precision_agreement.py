"""bf16 against float32: how often each judge's ratings and decisions agree on the bundled samples.

On CUDA the judges default to bfloat16 (``EngineOptions(dtype=None)``); faithfulness to the
reference implementations is tested in float32. This script runs every judge twice on the same
items, once per dtype, and prints the agreement of the discrete outputs and the largest
probability gap:

* LAVE on a Flan-T5-small-shaped checkpoint (the demo judge) and on a tiny Qwen3.5 text
  checkpoint: the 40 bundled VQA items; rating agreement;
* holistic VQAScore on a tiny Qwen3.5 vision-language checkpoint: the bundled captions over
  drawn pictures; yes/no decision agreement;
* VisExMEM on the same checkpoint, each caption given as its one claim (so claims line up):
  claim decision agreement (evidence selection runs in each dtype, as it would).

The checkpoints have RANDOM weights (nothing can be downloaded here): their probabilities sit
near ties far more often than a trained judge's, so the figures are a floor-ish stress test of
bf16 rounding, not a statement about trained judges.

    .venv/bin/python benchmarks/precision_agreement.py [--items 40] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from fastjudge import EngineOptions, HolisticJudge, ImageTextExample, LaveJudge, VisExJudge
from fastjudge.bench.items import image_text_items, lave_items
from fastjudge.checkpoints import build_random_qwen, build_random_qwen_vl
from fastjudge.demo import demo_model, tokenizer_corpus

DTYPES = ("float32", "bfloat16")


def _agreement(pairs: list[tuple[object, object]]) -> float:
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def _max_gap(pairs: list[tuple[list, list]]) -> float:
    gaps = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs if a and b]
    return max(gaps, default=float("nan"))


def lave(model_dir, items, device: str) -> dict:
    runs = {d: LaveJudge(model_dir, engine=EngineOptions(device=device, dtype=d)).score(items)
            for d in DTYPES}
    f32, bf16 = (runs[d] for d in DTYPES)
    ok = [(a, b) for a, b in zip(f32, bf16) if a.error is None and b.error is None]
    return {"items": len(ok), "agreement": _agreement([(a.rating, b.rating) for a, b in ok]),
            "max_prob_gap": _max_gap([(a.probs, b.probs) for a, b in ok])}


def holistic(model_dir, items, device: str) -> dict:
    runs = {d: HolisticJudge(model_dir, engine=EngineOptions(device=device, dtype=d)).score(items)
            for d in DTYPES}
    f32, bf16 = (runs[d] for d in DTYPES)
    ok = [(a, b) for a, b in zip(f32, bf16) if a.error is None and b.error is None]
    return {"items": len(ok), "agreement": _agreement([(a.decision, b.decision) for a, b in ok]),
            "max_prob_gap": _max_gap([(a.probs, b.probs) for a, b in ok])}


def visexmem(model_dir, items, device: str) -> dict:
    given = [ImageTextExample(ex.image, ex.text, id=ex.id, claims=[ex.text]) for ex in items]
    runs = {d: VisExJudge(model_dir, explain=False, max_claim_chars=200,
                          engine=EngineOptions(device=device, dtype=d)).score(given)
            for d in DTYPES}
    f32, bf16 = (runs[d] for d in DTYPES)
    claims = [(ca, cb) for a, b in zip(f32, bf16) if a.error is None and b.error is None
              for ca, cb in zip(a.claims, b.claims)]
    return {"items": len(claims), "agreement": _agreement([(a.decision, b.decision) for a, b in claims]),
            "max_prob_gap": max((abs(a.support - b.support) for a, b in claims), default=float("nan")),
            "same_evidence": _agreement([(a.evidence_ids, b.evidence_ids) for a, b in claims])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=40, help="items per judge (40: the bundled file)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--image-size", type=int, nargs=2, default=(320, 240), metavar=("W", "H"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    corpus = tokenizer_corpus()
    vqa = lave_items(args.items, "bundled")
    pictures = image_text_items(args.items, "bundled", size=tuple(args.image_size))
    with tempfile.TemporaryDirectory() as tmp:
        qwen = build_random_qwen(Path(tmp) / "qwen", corpus, shape="tiny")
        vl = build_random_qwen_vl(Path(tmp) / "vl", corpus, seed=11)
        report = {
            "lave (Flan-T5-small shape, random weights)": lave(demo_model(), vqa, args.device),
            "lave (Qwen3.5 tiny, random weights)": lave(qwen, vqa, args.device),
            "holistic VQAScore (Qwen3.5-VL tiny, random weights)": holistic(vl, pictures, args.device),
            "visexmem (Qwen3.5-VL tiny, random weights)": visexmem(vl, pictures, args.device),
        }
    print(f"{'judge':55} {'n':>4} {'agree':>7} {'max |dp|':>9}")
    for name, r in report.items():
        print(f"{name:55} {r['items']:4d} {r['agreement']:7.1%} {r['max_prob_gap']:9.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
