"""VisExMEM verification stage: fastjudge vs a transformers baseline, N images x M claims.

Both run in this process, same dtype, on the same random-weight multimodal Qwen3.5 checkpoint
(``build_random_qwen_vl``; the benchmark's preprocessor config allows up to 256 merged image
tokens, so a 500x375 image keeps 234 image tokens and each quadrant crop 63). Every image gets
a caption and ``--claims`` claims, each with one or two evidence regions from the quadrant grid
(deterministic). The claims are given, so only the verification stage is timed:

* baseline: what a transformers user writes -- for every claim independently, the full image
  and the claim's evidence crops (PIL crops) through ``Qwen2VLImageProcessorPil`` (the
  slow/PIL processor built from the checkpoint's preprocessor_config.json), the judge's prompt
  text with one ``<|vision_start|><|image_pad|><|vision_end|>`` per image through the chat
  template, each image's pad expanded to its token count (what ``Qwen3VLProcessor`` does; that
  class cannot be built without torchvision, for its video processor), then
  ``Qwen3_5ForConditionalGeneration`` at batch size 1 with ``logits_to_keep=1`` and P(yes)
  renormalised over {yes, no};
* fastjudge: ``VisExJudge.prepare`` + ``_propose`` (image loading, crop encoding of the full
  image and the quadrant boxes), one ``verification_request`` per claim, all through
  the judge's engine: each image + caption prefix runs once, each image or crop goes through
  the vision tower once, the claim suffixes run in batches behind their prefix. The prefix
  cache, the image-embedding cache and the prefix-token memo are emptied before every run.

Prints claims/s both ways (medians over ``--repeats`` after one warm-up run), the ratio against
the 5x target, per-claim support agreement, fastjudge's time per stage inside the verification
run (the model stages from the engine's profiler labels: vision tower, prefix prefill, claim
suffixes), the prefix-cache hit rate, tokens computed vs those in the full inputs,
and one whole ``VisExJudge.score`` pipeline run (decompose/select/verify/explain times; random
weights write to the length limits).

Agreement has two parts, printed apart: the model path on identical ids and pixels, and the
pixels themselves. With Pillow 13, a resize that widens and shortens an image (500x375 ->
504x364 here) runs the vertical pass first, where ``crop_encode``'s "pil" mode always runs the
horizontal pass first; the intermediate uint8 rounding then differs (up to 9 uint8 steps on 1 %
of the full image's values here; quadrant crops, enlarged on both axes, within 1 step).

    python benchmarks/bench_visexmem.py --shapes tiny mini --images 8 --claims 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from fastjudge import ImageTextExample, VisExJudge
from fastjudge.backends.profiling import PREFILL_LABEL, PREFIX_LABEL, VISION_LABEL
from fastjudge.backends.qwen.caches import ImageEmbeddingCache
from fastjudge.bench.step_profile import stage_seconds
from fastjudge.checkpoints import QWEN_SHAPES, build_random_qwen_vl
from fastjudge.demo import tokenizer_corpus
from fastjudge.engine_options import EngineOptions
from fastjudge.judges import visexmem as vx
from fastjudge.judges.visexmem import ClaimResult
from fastjudge.reference.models import PLACEHOLDER
from fastjudge.reference.visexmem import ClaimSupportReference
from fastjudge.runtime.prefix_cache import PrefixCache
from fastjudge.runtime.requests import Image

sys.path.insert(0, str(Path(__file__).parent))
from bench_device import DEVICES, bench_device  # noqa: E402
from bench_lave_t5 import timed  # noqa: E402  (shared timer: median after one warm-up run)

TARGET = 5.0
MAX_IMAGE_TOKENS = 256  # merged tokens per image allowed by the benchmark's preprocessor config
PIPELINE_BUDGETS = dict(max_claims=3, max_claim_chars=40, max_explanation_chars=60)

OBJECTS = ["bus", "dog", "tree", "car", "person", "bench", "kite", "boat"]
COLORS = ["red", "blue", "green", "white", "black", "yellow"]
CAPTIONS = ["A {c} {o} stands beside a tall {o2} on a sunny street.",
            "Two people look at a {c} {o} near a small {o2}.",
            "A {o} and a {c} {o2} are in the middle of a park.",
            "A large {c} {o} is parked in front of a {o2}."]
CLAIMS = ["The {o} in region {e} is {c}.", "There is a {o} in region {e}.",
          "The {o} is next to the {o2}.", "The {o2} in region {e} is {c}.",
          "The {o} is larger than the {o2}.", "There are two {o}s in the image."]


# -- inputs -------------------------------------------------------------------------------------
def synthetic_image(seed: int, width: int, height: int) -> np.ndarray:
    """A smooth H x W x 3 uint8 picture: per-channel gradients and low-frequency waves with a
    few filled rectangles (objects) on top. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    chans = []
    for _ in range(3):
        fx, fy = rng.uniform(0.5, 3.0, 2) * 2 * np.pi
        phase = rng.uniform(0, 2 * np.pi)
        v = 128 + 60 * np.sin(fx * x / width + fy * y / height + phase) + 40 * (x / width - y / height)
        chans.append(v)
    img = np.stack(chans, -1)
    for _ in range(4):
        x0, y0 = rng.integers(0, width * 3 // 4), rng.integers(0, height * 3 // 4)
        w, h = rng.integers(width // 10, width // 3), rng.integers(height // 10, height // 3)
        img[y0:y0 + h, x0:x0 + w] = rng.uniform(0, 255, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_inputs(n_images: int, n_claims: int, width: int, height: int):
    """``n_images`` examples and, per image, ``n_claims`` claim specs ``(text, evidence ids)``:
    one or two quadrant regions (E1..E4) per claim."""
    examples, claims = [], []
    for i in range(n_images):
        o, o2, c = OBJECTS[i % len(OBJECTS)], OBJECTS[(i + 3) % len(OBJECTS)], COLORS[i % len(COLORS)]
        caption = CAPTIONS[i % len(CAPTIONS)].format(o=o, o2=o2, c=c)
        examples.append(ImageTextExample(synthetic_image(i, width, height), caption, id=f"img{i}"))
        per = []
        for j in range(n_claims):
            first = (i + j) % 4 + 1
            ev = [f"E{first}"] if j % 2 == 0 else sorted({f"E{first}", f"E{first % 4 + 1}"})
            text = CLAIMS[j % len(CLAIMS)].format(o=OBJECTS[(i + j) % len(OBJECTS)], o2=o2,
                                                  c=COLORS[(i + 2 * j) % len(COLORS)], e=ev[0])
            per.append((text, sorted(ev, key=lambda e: int(e[1:]))))
        claims.append(per)
    return examples, claims


def corpus() -> list[str]:
    """The demo tokenizer corpus plus VisExMEM's prompt wording and the benchmark's vocabulary,
    so prompts tokenize to realistic lengths."""
    words = [vx.INTRO, vx.DECOMPOSE_TASK, vx.PROPOSE_TASK, vx.SELECT_TASK, vx.VERIFY_TASK,
             vx.EXPLAIN_CLAIM_TASK, vx.EXPLAIN_OVERALL_TASK, "Caption: Claim: Evidence regions: E1 E2 E3 E4",
             " ".join(OBJECTS + COLORS)]
    return tokenizer_corpus() + words + CAPTIONS + CLAIMS


def build_checkpoint(out: Path, shape: str) -> Path:
    model_dir = build_random_qwen_vl(out, corpus(), seed=0, vocab_size=4000, shape=shape)
    pre_file = model_dir / "preprocessor_config.json"
    pre = json.loads(pre_file.read_text())
    factor = pre["patch_size"] * pre["merge_size"]
    pre["size"]["longest_edge"] = MAX_IMAGE_TOKENS * factor * factor
    pre_file.write_text(json.dumps(pre, indent=2))
    return model_dir


# -- baseline ------------------------------------------------------------------------------------
class Baseline(ClaimSupportReference):
    """Every claim's full input independently through transformers
    (``fastjudge.reference.visexmem.ClaimSupportReference``), timed."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, yes_no_ids, device: str | torch.device = "cpu"):
        super().__init__(model_dir, dtype, yes_no_ids, device)
        self.seconds = defaultdict(float)

    def run(self, examples, prompts) -> list[float]:
        """``prompts[i]``: per claim of example i, ``(user text, crop boxes)``."""
        from PIL import Image

        self.seconds = defaultdict(float)
        out = []
        for ex, per_claim in zip(examples, prompts):
            t = time.perf_counter()
            image = Image.fromarray(ex.image)
            self.seconds["prepare"] += time.perf_counter() - t
            for user, boxes in per_claim:
                t = time.perf_counter()
                ids, pixels, grid = self.inputs(image, user, boxes)
                t2 = time.perf_counter()
                out.append(self.support(ids, pixels, grid))
                self.seconds["prepare"] += t2 - t
                self.seconds["model"] += time.perf_counter() - t2
        return out


def claim_results(it, specs) -> list[ClaimResult]:
    out = []
    for text, ev in specs:
        c = ClaimResult(part_id=f"P{len(out) + 1}", text=text, type="attribute")
        c.evidence_ids = list(ev)
        c.evidence_boxes = [list(it.boxes[int(e[1:]) - 1]) for e in ev]
        out.append(c)
    return out


def baseline_prompts(judge: VisExJudge, examples, claims):
    """The judge's verification prompts written with the processor's one-token image
    placeholder (built untimed: the text is the same string either way), and each prompt's
    crop boxes in order."""
    items, _ = judge.prepare(examples)
    judge._propose(items)

    def text(prompt) -> str:  # image slots as the processor's placeholder
        return "".join(PLACEHOLDER if isinstance(part, Image) else part for part in prompt)

    prompts = []
    for it, specs in zip(items, claims):
        shared = judge.evidence_layout == "shared"
        prefix = text(judge.evidence_prefix(it) if shared else judge.base_prefix(it))
        per_claim = []
        for c in claim_results(it, specs):
            task = text(judge.verification_task(it, c))
            per_claim.append((prefix + task, [list(b) for b in it.boxes] if shared else c.evidence_boxes))
        prompts.append(per_claim)
    return prompts


# -- fastjudge -----------------------------------------------------------------------------------
class Stages:
    """Seconds per stage of fastjudge's verification run: host stages timed here, model stages
    read from the engine's own profiler labels (``backends.profiling``) in one profiled run."""

    LABELS = {VISION_LABEL: "vision encode", PREFIX_LABEL: "prefix prefill", PREFILL_LABEL: "claim suffixes"}

    def __init__(self):
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)

    @contextmanager
    def stage(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t
            self.calls[name] += 1

    def profiled(self, run) -> dict[str, float]:
        """``run()`` under the profiler: seconds in each labelled model stage, the rest of the
        requests' run (heads, planning, moves) as "other"."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            run()
            total = time.perf_counter() - start
        events = prof.events()
        seconds = {self.LABELS[k]: v for k, v in stage_seconds(events, self.LABELS).items()}
        seconds["other"] = max(total - sum(seconds.values()), 0.0)
        seconds["vision calls"] = sum(e.name == VISION_LABEL for e in events)
        return seconds

    def reset(self):
        self.seconds.clear()
        self.calls.clear()


def fresh(backend) -> None:
    """Empty every cache a run could reuse: prefix states, image embeddings, prefix tokens."""
    backend.prefix_cache = PrefixCache(backend.prefix_cache.index.capacity_bytes)
    backend._image_embeds = ImageEmbeddingCache(backend._image_embeds.capacity)
    backend.codec._prefix_ids.clear()
    backend.tokens_computed = 0


def fast_requests(judge: VisExJudge, examples, claims, stages: Stages):
    with stages.stage("prepare (load, crop encode)"):
        items, invalid = judge.prepare(examples)
        judge._propose(items)
    assert not invalid and all(not it.result.error for it in items)
    with stages.stage("build requests (tokenize)"):
        requests = []
        for it, specs in zip(items, claims):
            for c in claim_results(it, specs):
                requests.append(judge.verification_request(it, c, key=len(requests)))
    return items, requests


def fast_run(judge: VisExJudge, examples, claims, stages: Stages) -> list[float]:
    stages.reset()
    start = time.perf_counter()
    _, requests = fast_requests(judge, examples, claims, stages)
    with stages.stage("run_requests"):
        outputs = {o.index: o for batch in judge.engine.run(requests) for o in batch}
    stages.seconds["total"] = time.perf_counter() - start
    return [float(outputs[k].probs[0]) for k in range(len(requests))]


# -- checks --------------------------------------------------------------------------------------
@torch.inference_mode()
def checks(judge: VisExJudge, base: Baseline, stages: Stages, examples, claims, prompts, ours, theirs,
           same_pixel_claims: int):
    """Input identity and the two sources of support differences: the image processor's pixels
    vs crop_encode's, and the model path on identical inputs."""
    from PIL import Image

    fresh(judge.backend)
    items, requests = fast_requests(judge, examples, claims, stages)
    # pixel differences in uint8 steps (one step = rescale_factor / std after normalisation)
    cfg = judge.image_config
    step = cfg.rescale_factor / min(cfg.image_std)
    same_ids, k = 0, 0
    steps = {"full": [0.0, []], "crops": [0.0, []]}
    for it, ex, per_claim in zip(items, examples, prompts):
        image = Image.fromarray(ex.image)
        for kind, crops, ours_px in (("full", [image], [it.full_image]),
                                     ("crops", [image.crop(b) for b in it.boxes], it.box_images)):
            enc = base.processor(images=crops, return_tensors="pt")
            mine = torch.cat([im.pixel_values for im in ours_px])
            diff = (enc["pixel_values"].float() - mine.float()).abs() / step
            steps[kind][0] = max(steps[kind][0], float(diff.max()))
            steps[kind][1].append(float((diff >= 0.5).float().mean()))
        for user, boxes in per_claim:
            ids, _, _ = base.inputs(image, user, boxes)
            r = requests[k]
            same_ids += ids[0].tolist() == list(r.prompt_ids) + list(r.response_prefix)
            k += 1
    model_path = []
    for r in requests[:same_pixel_claims]:  # transformers on fastjudge's own pixels and ids
        ids = torch.tensor([list(r.prompt_ids) + list(r.response_prefix)])
        pixels = torch.cat([im.pixel_values for im in r.images])
        grid = torch.tensor([im.grid_thw for im in r.images])
        model_path.append(abs(base.support(ids, pixels, grid) - ours[r.index]))
    d = np.abs(np.asarray(ours) - np.asarray(theirs))
    agree = np.mean((np.asarray(ours) >= 0.5) == (np.asarray(theirs) >= 0.5))
    return dict(same_ids=same_ids, n=len(requests),
                pixel_steps={kind: (v[0], float(np.mean(v[1]))) for kind, v in steps.items()},
                full_size=tuple(v * cfg.patch_size for v in items[0].full_image.grid_thw[1:]),
                image_size=(items[0].image.width, items[0].image.height),
                max_diff=float(d.max()), mean_diff=float(d.mean()), agree=float(agree),
                model_path=max(model_path) if model_path else float("nan"), model_path_n=len(model_path),
                full_tokens=sum(len(r.prompt_ids) + len(r.response_prefix) for r in requests),
                full_patches=sum(int(im.pixel_values.shape[0]) for r in requests for im in r.images))


def pipeline_once(judge: VisExJudge, examples) -> dict:
    """The whole VisExJudge pipeline (decompose -> select -> verify -> explain) on a few items."""
    full = VisExJudge(judge.backend, **PIPELINE_BUDGETS)
    fresh(full.backend)
    start = time.perf_counter()
    results = full.score(examples)
    total = time.perf_counter() - start
    return dict(stages=dict(full.stage_seconds), total=total, items=len(results),
                claims=sum(len(r.claims) for r in results), errors=sum(r.error is not None for r in results))


def bench_one(judge: VisExJudge, base: Baseline, examples, claims, args) -> dict:
    """Baseline and fastjudge on the same claims in the judge's evidence layout."""
    backend = judge.backend
    stages = Stages()
    prompts = baseline_prompts(judge, examples, claims)
    base_runs = []

    def run_base():
        out = base.run(examples, prompts)
        base_runs.append(dict(base.seconds))
        return out

    t_base, theirs = timed(run_base, args.repeats)
    base_seconds = {k: statistics.median(r[k] for r in base_runs[1:]) for k in base_runs[-1]}
    per_run = []

    def run_fast():
        out = fast_run(judge, examples, claims, stages)
        per_run.append((dict(stages.seconds), dict(stages.calls), backend.tokens_computed,
                        backend.prefix_cache.hit_rate))
        return out

    t_fast, ours = timed(run_fast, args.repeats, lambda: fresh(backend))
    timed_runs = per_run[1:]
    stage_median = {k: statistics.median(r[0].get(k, 0.0) for r in timed_runs) for k in timed_runs[0][0]}
    _, calls, computed, hit = timed_runs[-1]
    fresh(backend)
    _, requests = fast_requests(judge, examples, claims, stages)
    model_stages = stages.profiled(lambda: [o for batch in judge.engine.run(requests) for o in batch])
    check = checks(judge, base, stages, examples, claims, prompts, ours, theirs, args.same_pixel_claims)
    pipe = pipeline_once(judge, examples[: args.pipeline_items]) if args.pipeline_items else None
    return dict(t_base=t_base, t_fast=t_fast, stages=stage_median, model_stages=model_stages, calls=calls,
                computed=computed, hit=hit, base_seconds=base_seconds, pipe=pipe, **check)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["tiny", "mini"], choices=sorted(QWEN_SHAPES))
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--claims", type=int, default=8, help="claims per image")
    ap.add_argument("--size", default="500x375", help="image WIDTHxHEIGHT")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--same-pixel-claims", type=int, default=8,
                    help="claims re-run through transformers on fastjudge's own pixel values")
    ap.add_argument("--pipeline-items", type=int, default=2, help="items for the whole-pipeline run (0: skip)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--device", default="cpu", choices=DEVICES, help="both paths run here (%(default)s)")
    ap.add_argument("--layouts", nargs="+", default=["per-claim", "shared"], choices=["per-claim", "shared"],
                    help="VisExJudge evidence layouts to measure (default: both)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = bench_device(args.device)
    dtype = getattr(torch, args.dtype)
    width, height = (int(v) for v in args.size.lower().split("x"))
    examples, claims = make_inputs(args.images, args.claims, width, height)
    n = args.images * args.claims
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            model_dir = build_checkpoint(Path(tmp) / shape, shape)
            backend = VisExJudge(model_dir, engine=EngineOptions(device=str(device), dtype=dtype)).backend
            base = None
            for layout in args.layouts:
                judge = VisExJudge(backend, evidence_layout=layout)
                base = base or Baseline(model_dir, dtype, judge.yes_no_ids, device)
                rows.append(bench_one(judge, base, examples, claims, args))
                rows[-1]["shape"] = f"{shape}/{layout}"
                print(f"[{shape} {layout}] baseline {rows[-1]['t_base']:.2f}s fastjudge {rows[-1]['t_fast']:.2f}s "
                      f"speed-up {rows[-1]['t_base'] / rows[-1]['t_fast']:.2f}x", file=sys.stderr)

    print(f"\nVisExMEM verification: {args.images} images ({width}x{height}) x {args.claims} claims "
          f"(1-2 quadrant crops each), {args.dtype}, median of {args.repeats}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'shape':6} {'base cl/s':>9} {'fast cl/s':>9} {'ratio':>7} {'>=5x':>5} "
          f"{'full tok':>8} {'computed':>8} {'full patches':>12} {'vis calls':>9} {'max|dS|':>8} {'agree':>6}")
    for r in rows:
        ratio = r["t_base"] / r["t_fast"]
        print(f"{r['shape']:6} {n / r['t_base']:9.1f} {n / r['t_fast']:9.1f} {ratio:6.2f}x "
              f"{'PASS' if ratio >= TARGET else 'FAIL':>5} {r['full_tokens']:8d} {r['computed']:8d} "
              f"{r['full_patches']:12d} {r['model_stages']['vision calls']:9d} {r['max_diff']:8.1e} {r['agree']:6.0%}")
    print("full tok / full patches: in every claim's full input (the baseline computes all of them); computed: "
          "tokens fastjudge ran; vis calls: vision-tower calls (images not cached are encoded together); "
          "max|dS|: largest per-claim support difference; agree: same yes/no decision")
    for r in rows:
        print(f"\n[{r['shape']}] fastjudge verification run, seconds per stage (median):")
        total = r["stages"]["total"]
        for name in ("prepare (load, crop encode)", "build requests (tokenize)", "run_requests"):
            print(f"  {name:30} {r['stages'].get(name, 0.0):7.3f}s {r['stages'].get(name, 0.0) / total:6.1%}")
        m = r["model_stages"]
        print("  run_requests by the engine's profiler labels (one profiled run, cold caches):")
        for sub in ("vision encode", "prefix prefill", "claim suffixes", "other"):
            print(f"    {sub:28} {m[sub]:7.3f}s")
        print(f"  {'total':30} {total:7.3f}s   prefix-cache hit rate {r['hit']:.1%} (one lookup per batch; "
              f"a prefix's claims share its batch, so a hit needs a prefix split over batches)")
        b = r["base_seconds"]
        print(f"  baseline per run: processor + template + tokenize {b.get('prepare', 0.0):.3f}s, "
              f"model forward {b.get('model', 0.0):.3f}s")
        px = r["pixel_steps"]
        w, h = r["image_size"]
        rh, rw = r["full_size"]
        print(f"  input ids identical to the baseline's: {r['same_ids']}/{r['n']} claims; crop_encode vs "
              f"Qwen2VLImageProcessorPil pixels, in uint8 steps: full image ({w}x{h} -> {rw}x{rh}) "
              f"max {px['full'][0]:.0f} ({px['full'][1]:.2%} of values off by >= 1), quadrant crops "
              f"max {px['crops'][0]:.0f} ({px['crops'][1]:.3%})")
        print(f"  support |fastjudge - baseline|: max {r['max_diff']:.2e}, mean {r['mean_diff']:.2e}; "
              f"on identical pixels and ids (first {r['model_path_n']} claims): max {r['model_path']:.2e}; "
              f"decisions agree {r['agree']:.1%}")
        if r["pipe"]:
            p = r["pipe"]
            st = "  ".join(f"{k} {v:.2f}s" for k, v in p["stages"].items() if v)
            print(f"  whole pipeline (VisExJudge.score, {p['items']} items, {p['claims']} claims, budgets "
                  f"{PIPELINE_BUDGETS}; random weights, so generation runs to the length limits): "
                  f"{st}  total {p['total']:.2f}s, {p['errors']} item errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
