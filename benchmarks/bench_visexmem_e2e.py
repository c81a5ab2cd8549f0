"""VisExMEM end to end: fastjudge's ``VisExJudge`` against the same pipeline written with
transformers, N image-caption pairs through all five stages (decompose, select evidence,
verify, aggregate, explain).

Both run in this process, same dtype, on the same random-weight multimodal Qwen3.5 checkpoint
(``bench_visexmem.build_checkpoint``). The images are drawn with PIL at run time (two coloured
objects the caption names); the candidates are the quadrants. 448x336 (the default) and its
quadrants are multiples of the patch grid (28 px) inside the processor's pixel limits, so
neither side resizes and both see the same pixels.

* fastjudge: ``VisExJudge.score`` (jump-forward on and/or off, ``--jump-forward``): shared
  image + caption prefixes, grammar-constrained batched decoding, batched verification.
* transformers: the judge's own stage logic -- its prompt builders, JSON schemas, parsing,
  part-link repair and aggregation (``fastjudge.reference.visexmem.TransformersPipeline``
  subclasses ``VisExJudge`` and replaces only the model calls), so both sides run exactly the
  same prompts and schemas -- with every model call the way a transformers user writes it:
  the prompt text with one ``<|vision_start|><|image_pad|><|vision_end|>`` per image through the
  chat template (thinking off), the images and crops (PIL) through ``Qwen2VLImageProcessorPil``,
  each pad expanded to its image's token count, batches of ``--batch-size`` prompts
  left-padded; each JSON stage
  through ``Qwen3_5ForConditionalGeneration.generate`` (greedy) with
  ``xgrammar.contrib.hf.LogitsProcessor`` on the schema compiled in fastjudge's documented
  output format (no free whitespace, ``", "`` / ``": "`` separators, strict mode) and the special
  tokens other than the stop tokens suppressed (``suppress_tokens``; else xgrammar writes chat
  markers as text inside strings); verification one forward pass per batch
  (``logits_to_keep=1``) after the answer start's tokens, P(yes) renormalised over {yes, no}.
  Checking the examples and encoding fastjudge's crops (the judge's prompt structures carry
  them) happen before this side's clock starts.

Outputs must be identical -- every item's error and warnings, its claims (ids, text, type,
links), evidence ids, decisions and explanations -- and supports and scores within 1e-3, or the
script prints MISMATCH and exits 1. float32 is the default: two implementations' greedy
decoding agrees token for token only while no two candidate logits are closer than their
rounding; in bfloat16 a near-tie can flip a token.

Random weights: greedy outputs run to the schemas' limits, so the generation budgets are small
and the same on both sides (``--max-claims 3 --max-claim-chars 40 --max-explanation-chars 60``
by default: the judge's options, hence the schemas and token bounds both sides decode under).
They also write random bytes inside strings, and xgrammar 0.2.9 lets a few invalid UTF-8 forms
through (a surrogate after ``ED``, overlong forms after ``E0``/``F0``), which fastjudge masks
(``runtime/grammar.py``) and the HF processor does not: the built checkpoint's LM-head rows of
the tokens ending in one of those narrow lead bytes (``E0``, ``ED``, ``F0``, ``F4``) are zeroed,
so their logit is 0 and never the greedy choice where free text is allowed (both sides run that
same checkpoint).

Prints seconds per stage both ways (medians over ``--repeats`` runs after a warm-up run), the
items/s and decomposition-stage ratios, and per JSON stage the tokens written, the tokens
fastjudge computed (chosen from logits) and forced (jump-forward: no model step of their own)
and its decode steps, against transformers' decode steps and padded row-steps.

    python benchmarks/bench_visexmem_e2e.py --shapes tiny --items 4 --repeats 3 --jump-forward both
    python benchmarks/bench_visexmem_e2e.py --device cuda --items 16   # both sides on the GPU
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from PIL import Image as PILImage
from PIL import ImageDraw

from fastjudge import ImageTextExample, VisExJudge
from fastjudge.checkpoints import QWEN_SHAPES
from fastjudge.engine_options import EngineOptions
from fastjudge.judges.visexmem.judge import STAGES

sys.path.insert(0, str(Path(__file__).parent))
from bench_device import DEVICES, bench_device, device_label  # noqa: E402
from bench_visexmem import COLORS, OBJECTS, build_checkpoint, fresh  # noqa: E402

from fastjudge.reference.visexmem import TransformersPipeline, zero_unmasked_utf8_rows

SHOWN = ("decompose", "select", "verify", "explain")  # aggregation runs inside the pipeline's rest
TARGET = 5.0  # items/s against transformers
TOL = 1e-3  # supports and scores
JF_TARGET = 2.0  # decomposition stage, jump-forward on against off
RGB = {"red": (200, 40, 40), "blue": (40, 70, 200), "green": (40, 150, 60), "white": (235, 235, 235),
       "black": (25, 25, 25), "yellow": (230, 200, 40)}
CAPTIONS = ["A {c} {o} stands next to a {o2} on a sunny street.",
            "A {c} {o} and a small {o2} in front of a grey wall.",
            "Two people walk past a {c} {o} near a {o2}.",
            "A {o2} behind a large {c} {o} in a green park."]


# -- inputs -------------------------------------------------------------------------------------
def draw_object(d: ImageDraw.ImageDraw, kind: str, box, color) -> None:
    """A rough silhouette of ``kind`` inside ``box``."""
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    if kind == "tree":
        d.rectangle((x0 + w * 0.4, y0 + h * 0.55, x0 + w * 0.6, y1), fill=(110, 70, 30))
        d.ellipse((x0, y0, x1, y0 + h * 0.7), fill=color)
    elif kind in ("dog", "person"):
        d.ellipse((x0 + w * 0.2, y0 + h * 0.35, x1 - w * 0.2, y1), fill=color)
        d.ellipse((x0 + w * 0.35, y0, x1 - w * 0.35, y0 + h * 0.35), fill=color)
    elif kind == "kite":
        d.polygon([(x0 + w / 2, y0), (x1, y0 + h / 2), (x0 + w / 2, y1), (x0, y0 + h / 2)], fill=color)
    else:  # bus, car, bench, boat: a body on wheels
        d.rounded_rectangle((x0, y0 + h * 0.2, x1, y1 - h * 0.2), radius=max(2, int(h * 0.1)), fill=color)
        for cx in (x0 + w * 0.25, x1 - w * 0.25):
            d.ellipse((cx - h * 0.15, y1 - h * 0.3, cx + h * 0.15, y1), fill=(30, 30, 30))


def make_examples(n: int, width: int, height: int) -> list[ImageTextExample]:
    """``n`` pairs: a PIL scene with two objects and a caption naming them (deterministic)."""
    out = []
    for i in range(n):
        rng = random.Random(i)
        o, o2, c = OBJECTS[i % len(OBJECTS)], OBJECTS[(i + 3) % len(OBJECTS)], COLORS[i % len(COLORS)]
        img = PILImage.new("RGB", (width, height), (120 + rng.randrange(60), 170, 230))
        d = ImageDraw.Draw(img)
        d.rectangle((0, height * 2 // 3, width, height), fill=(90, 140 + rng.randrange(40), 70))
        d.ellipse((width - 70, 10, width - 20, 60), fill=(250, 230, 120))
        draw_object(d, o, (width * 0.08, height * 0.3, width * 0.5, height * 0.9), RGB[c])
        draw_object(d, o2, (width * 0.58, height * 0.35, width * 0.9, height * 0.85),
                    RGB[COLORS[(i + 2) % len(COLORS)]])
        out.append(ImageTextExample(img, CAPTIONS[i % len(CAPTIONS)].format(o=o, o2=o2, c=c), id=f"pair{i}"))
    return out


def build_biased(out: Path, shape: str) -> Path:
    """``build_checkpoint`` with the LM-head rows of tokens ending in a narrow UTF-8 lead byte
    zeroed (module docstring; ``fastjudge.reference.visexmem.zero_unmasked_utf8_rows``)."""
    model_dir = build_checkpoint(out, shape)
    zero_unmasked_utf8_rows(model_dir)
    return model_dir


# -- fastjudge ------------------------------------------------------------------------------------
def count_decode_stats(judge: VisExJudge) -> dict:
    """Per stage, what the backend's ``decode_stats`` counters grew by (none without them)."""
    per, run = defaultdict(Counter), judge._run

    def counted(stage, requests):
        before = dict(getattr(judge.backend, "decode_stats", None) or {})
        out = run(stage, requests)
        for k, v in (getattr(judge.backend, "decode_stats", None) or {}).items():
            per[stage][k] += v - before.get(k, 0)
        return out

    judge._run = counted
    return per


def fast_run(judge: VisExJudge, per_stage: dict, examples) -> list:
    """``score`` from empty caches (prefix states, image embeddings, prefix tokens)."""
    fresh(judge.backend)
    getattr(judge.backend, "reset_decode_stats", lambda: None)()
    judge.stage_seconds = {s: 0.0 for s in STAGES}
    per_stage.clear()
    start = time.perf_counter()
    results = judge.score(examples)
    judge.stage_seconds["total"] = time.perf_counter() - start
    return results


def timed_runs(run, seconds, stats, repeats: int):
    """Median seconds per stage over ``repeats`` runs after a warm-up run; the last run's
    results and counters."""
    runs, results = [], None
    for i in range(repeats + 1):
        results = run()
        if i:  # the rest per run, so that its median is of whole runs
            d = dict(seconds())
            runs.append({**d, "other": d["total"] - sum(d[s] for s in SHOWN)})
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return medians, results, {k: dict(v) for k, v in stats().items()}


# -- comparing ------------------------------------------------------------------------------------
def outcome(results) -> list[dict]:
    """What must be identical on both sides."""
    return [dict(error=r.error, warnings=list(r.warnings), explanation=r.explanation,
                 claims=[dict(part_id=c.part_id, text=c.text, type=c.type, parent=c.parent_part_id,
                              head=c.head_part_id, target=c.target_part_id, evidence=list(c.evidence_ids),
                              decision=c.decision, explanation=c.explanation) for c in r.claims])
            for r in results]


def differences(ours, theirs) -> list[str]:
    out = []
    for r, (a, b) in enumerate(zip(outcome(ours), outcome(theirs))):
        for key in ("error", "warnings", "explanation"):
            if a[key] != b[key]:
                out.append(f"item {r} {key}: fastjudge {a[key]!r} / transformers {b[key]!r}")
        if len(a["claims"]) != len(b["claims"]):
            out.append(f"item {r}: {len(a['claims'])} claims / {len(b['claims'])}")
        for k, (x, y) in enumerate(zip(a["claims"], b["claims"])):
            out += [f"item {r} claim {k} {f}: fastjudge {x[f]!r} / transformers {y[f]!r}" for f in x if x[f] != y[f]]
    if len(ours) != len(theirs):
        out.append(f"{len(ours)} results / {len(theirs)}")
    return out


def value_gap(ours, theirs) -> float:
    """Largest |difference| of supports and scores (NaN where there is none)."""
    gaps = [abs(a.score - b.score) for a, b in zip(ours, theirs) if a.score is not None and b.score is not None]
    gaps += [abs(x.support - y.support) for a, b in zip(ours, theirs) for x, y in zip(a.claims, b.claims)
             if x.support is not None and y.support is not None]
    return max(gaps) if gaps else float("nan")


# -- running --------------------------------------------------------------------------------------
def bench_shape(shape: str, model_dir: Path, examples, args, dtype) -> dict:
    budgets = dict(max_claims=args.max_claims, max_claim_chars=args.max_claim_chars,
                   max_explanation_chars=args.max_explanation_chars)
    settings = {"both": [True, False], "on": [True], "off": [False]}[args.jump_forward]
    judges = {}
    for jf in settings:
        engine = EngineOptions(device=args.device, dtype=dtype, jump_forward=jf, compile=args.compile)
        judges[jf] = VisExJudge(model_dir, **budgets, engine=engine)
    base = TransformersPipeline(next(iter(judges.values())).backend, model_dir, dtype, args.batch_size,
                                device=args.device, **budgets)
    row = dict(shape=shape, fast={}, problems=[])
    row["base_seconds"], theirs, row["base_stats"] = timed_runs(lambda: base.run(examples), lambda: base.stage_seconds,
                                                                lambda: base.stats, args.repeats)
    for jf, judge in judges.items():
        per_stage = count_decode_stats(judge)
        seconds, ours, stats = timed_runs(lambda: fast_run(judge, per_stage, examples), lambda: judge.stage_seconds,
                                          lambda: per_stage, args.repeats)
        name = {True: "on", False: "off", None: "n/a"}[jf]
        gap = value_gap(ours, theirs)
        row["fast"][name] = dict(seconds=seconds, stats=stats, gap=None if math.isnan(gap) else gap)
        row["problems"] += [f"jump-forward {name}: {d}" for d in differences(ours, theirs)]
        if gap > TOL:
            row["problems"].append(f"jump-forward {name}: supports or scores differ by {gap:.1e}")
    row["outputs"] = outcome(theirs)
    row["claims"] = sum(len(r.claims) for r in theirs)
    row["errors"] = sum(r.error is not None for r in theirs)
    return row


def report(rows, args, n: int) -> None:
    print(f"\nVisExMEM end to end: {n} image-caption pairs ({args.size}, quadrant candidates), {args.dtype}, "
          f"median of {args.repeats}, {device_label(torch.device(args.device))}; "
          f"transformers batch size {args.batch_size}; "
          f"budgets max_claims={args.max_claims} max_claim_chars={args.max_claim_chars} "
          f"max_explanation_chars={args.max_explanation_chars}")
    for r in rows:
        fast, b = r["fast"], r["base_seconds"]
        names = list(fast)
        print(f"\n[{r['shape']}] {r['claims']} claims, {r['errors']} item errors; outputs "
              + ("IDENTICAL" if not r["problems"] else "MISMATCH")
              + "; max |support or score difference| "
              + ", ".join(f"JF {k} " + ("n/a" if v["gap"] is None else f"{v['gap']:.1e}") for k, v in fast.items()))
        print(f"  {'stage (seconds)':24} {'transformers':>12} "
              + " ".join(f"{'fastjudge JF ' + k:>16} {'ratio':>7}" for k in names))
        for stage in SHOWN + ("other", "total"):
            def ratio(d):  # the rest is not the same work on both sides: no ratio
                return f"{'-':>7}" if stage == "other" else f"{b[stage] / max(d[stage], 1e-9):6.2f}x"
            cells = " ".join(f"{fast[k]['seconds'][stage]:16.3f} {ratio(fast[k]['seconds'])}" for k in names)
            label = "prepare, aggregate, rest" if stage == "other" else stage
            print(f"  {label:24} {b[stage]:12.3f} {cells}")
        print(f"  {'items/s':24} {n / b['total']:12.2f} " + " ".join(
            f"{n / fast[k]['seconds']['total']:16.2f} {b['total'] / fast[k]['seconds']['total']:6.2f}x" for k in names))
        verdicts = [f"items/s >= {TARGET:g}x (JF {k}): "
                    f"{'PASS' if b['total'] / fast[k]['seconds']['total'] >= TARGET else 'FAIL'}"
                    for k in names]
        if "on" in fast and "off" in fast:
            on, off = fast["on"]["seconds"], fast["off"]["seconds"]
            jf = off["decompose"] / on["decompose"]
            print(f"  jump-forward alone (fastjudge off / on): decompose {jf:.2f}x, "
                  f"total {off['total'] / on['total']:.2f}x")
            verdicts.append(f"decompose from jump-forward alone >= {JF_TARGET:g}x: "
                            f"{'PASS' if jf >= JF_TARGET else 'FAIL'}")
        print("  targets: " + "; ".join(verdicts))
        print(f"  {'tokens (stop incl.)':24} {'written':>8} {'hf steps':>9} {'hf row-steps':>12} "
              + " ".join(f"{'JF ' + k + ' computed/forced/steps':>30}" for k in names))
        for stage in ("decompose", "select", "explain"):
            bs = r["base_stats"].get(stage, {})
            cells = []
            for k in names:
                s = fast[k]["stats"].get(stage)
                cells.append(f"{s['tokens_computed']} / {s['tokens_forced']} / {s['decode_steps']}" if s else "n/a")
            print(f"  {stage:24} {bs.get('tokens', 0):8d} {bs.get('steps', 0):9d} {bs.get('row_steps', 0):12d} "
                  + " ".join(f"{c:>30}" for c in cells))
        for p in r["problems"][:20]:
            print(f"  MISMATCH {p}")
    print("\nratio: transformers seconds / fastjudge seconds. written: tokens in the outputs; hf steps / row-steps: "
          "generate's decode steps and steps x rows (padded rows included); computed: tokens fastjudge chose "
          "from logits; forced: tokens jump-forward accepted without a model step; steps: fastjudge's decode steps")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["tiny", "mini"], choices=sorted(QWEN_SHAPES))
    ap.add_argument("--model", type=Path, default=None,
                    help="an existing multimodal Qwen3.5 checkpoint instead of building --shapes")
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--size", default="448x336", help="image WIDTHxHEIGHT")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--jump-forward", default="both", choices=["on", "off", "both"])
    ap.add_argument("--compile", default="off", choices=["off", "on", "auto"],
                    help="fastjudge's compiled steps (docs/engine.md); compile time is outside the timed runs")
    ap.add_argument("--batch-size", type=int, default=8, help="transformers batch size")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=DEVICES, help="both sides run here")
    ap.add_argument("--max-claims", type=int, default=3)
    ap.add_argument("--max-claim-chars", type=int, default=40)
    ap.add_argument("--max-explanation-chars", type=int, default=60)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:  # a caller in the same process (a test) keeps its own setting
        torch.set_num_threads(threads)


def run(args) -> int:
    dtype = getattr(torch, args.dtype)
    bench_device(args.device)
    width, height = (int(v) for v in args.size.lower().split("x"))
    examples = make_examples(args.items, width, height)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        targets = [(args.model.name, args.model)] if args.model else [
            (s, None) for s in args.shapes]
        for shape, model_dir in targets:
            model_dir = model_dir or build_biased(Path(tmp) / shape, shape)
            rows.append(bench_shape(shape, model_dir, examples, args, dtype))
            print(f"[{shape}] done", file=sys.stderr)
    report(rows, args, args.items)
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, rows=rows), indent=2))
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
