"""The holistic baseline in VQAScore mode: fastjudge against t2v_metrics' per-sample path.

Both run in this process, same dtype, on the same random-weight multimodal Qwen3.5 checkpoint
(``bench_visexmem.build_checkpoint``: at most 256 merged image tokens per image), over
``--pairs`` image-text pairs of synthetic images with ``--captions`` captions per image, one
workload per value (default: 4, then 1). Several captions of one image are the common case in
image-text evaluation sets (COCO's five references, a positive caption beside hard negatives
as in SugarCrepe or Winoground); 1 caption per image is the case with nothing to share:

* baseline: ``fastjudge.reference.holistic.VQAScoreReference``, what t2v_metrics'
  ``Qwen3VLModel.forward`` (``t2v_metrics/models/vqascore_models/qwen3vl_model.py``) does for
  each pair alone: the image
  through transformers' image processor (``Qwen2VLImageProcessorPil``, built from the
  checkpoint's preprocessor_config.json; t2v_metrics resizes with qwen-vl-utils first and then
  calls the processor without resizing -- with image sides that are multiples of 28, as here,
  neither resizes), the user turn [image, VQAScore question] through the chat template with
  thinking off, the image pad expanded to its token count, then
  ``Qwen3_5ForConditionalGeneration.generate`` at batch size 1 with ``max_new_tokens=1``,
  greedy, ``output_scores=True``; the generated token is decoded as they do, and the score is
  the softmax over the full vocabulary of the step's scores at the first token of "Yes";
* fastjudge: ``HolisticJudge(template="vqascore")`` (the default) scoring all pairs: image
  loading and crop encoding, one ``Choice(full_vocab=True)`` request per pair, batched by the
  planner, the vision tower and the prompt up to the image's end once per image, the captions'
  questions continuing from that state in batches, the fused choice head's vocabulary
  log-sum-exp. The image-embedding cache, the prefix states and the prefix-token memo are
  emptied before every run, so nothing is carried from one run to the next.

Prints pairs/s both ways (medians over ``--repeats`` turns after one warm-up turn; a turn runs
the baseline, then fastjudge), the median of the turns' ratios against the 10x target, the
largest relative difference of P("Yes") between the two paths, and whether the input ids are
identical.

    python benchmarks/bench_holistic.py --shapes tiny --pairs 16 --captions 4 1 --repeats 2
    python benchmarks/bench_holistic.py --device cuda --pairs 64   # both paths on the GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fastjudge import HolisticJudge, ImageTextExample
from fastjudge.backends.qwen.backend import DEFAULT_PREFIX_CACHE_BYTES
from fastjudge.backends.qwen.caches import ImageEmbeddingCache
from fastjudge.checkpoints import QWEN_SHAPES
from fastjudge.engine_options import EngineOptions
from fastjudge.reference.holistic import VQAScoreReference
from fastjudge.runtime.prefix_cache import PrefixCache

sys.path.insert(0, str(Path(__file__).parent))
from bench_device import DEVICES, bench_device, device_label  # noqa: E402
from bench_visexmem import CAPTIONS, COLORS, OBJECTS, build_checkpoint, synthetic_image  # noqa: E402

TARGET = 10.0


def make_pairs(n_pairs: int, captions: int, width: int, height: int) -> list[ImageTextExample]:
    """``n_pairs`` pairs over ``n_pairs // captions`` synthetic images, ``captions`` different
    captions per image, an image's pairs next to each other (as a dataset lists them)."""
    if captions < 1 or n_pairs % captions:
        raise ValueError(f"--pairs ({n_pairs}) must be a multiple of the captions per image ({captions})")
    out = []
    for i in range(n_pairs // captions):
        image = synthetic_image(i, width, height)
        for j in range(captions):
            o, o2 = OBJECTS[(i + j) % len(OBJECTS)], OBJECTS[(i + j + 3) % len(OBJECTS)]
            c = COLORS[(i + 2 * j) % len(COLORS)]
            text = CAPTIONS[(i + j) % len(CAPTIONS)].format(o=o, o2=o2, c=c)
            out.append(ImageTextExample(image, text, id=len(out)))
    return out


def fresh(backend) -> None:
    """Empty what a run could reuse: image embeddings, prefix states (an image's state is
    shared by its captions within a run, never carried over from the previous run) and the
    codec's prefix-token memo."""
    backend._image_embeds = ImageEmbeddingCache(backend._image_embeds.capacity)
    backend.prefix_cache = PrefixCache(DEFAULT_PREFIX_CACHE_BYTES)
    backend.codec._prefix_ids.clear()


def checks(judge: HolisticJudge, base: VQAScoreReference, pairs, ours, theirs) -> dict:
    """Input identity (ids, pixels) and the score difference between the two paths."""
    from PIL import Image

    same_ids, pixel_diff = 0, 0.0
    for ex in pairs:
        request = judge._request(0, ex)
        ids, pixels, _ = base.inputs(Image.fromarray(ex.image), ex.text)
        same_ids += list(request.prompt_ids) == ids[0].tolist()
        mine = torch.as_tensor(request.images[0].pixel_values).float()
        pixel_diff = max(pixel_diff, float((mine - pixels.float().cpu()).abs().max()))
    rel = [abs(a - b) / b for a, b in zip(ours, theirs)]
    return dict(same_ids=same_ids, pixel_diff=pixel_diff, max_rel=max(rel))


def bench_one(judge: HolisticJudge, base: VQAScoreReference, pairs, args) -> dict:
    """Both paths timed in turns (baseline run, then fastjudge run, ``--repeats`` times after one
    warm-up turn), so a change in machine load reaches both; the ratio is the median of the
    turns' ratios."""
    t_base, t_fast = [], []
    for turn in range(args.repeats + 1):
        fresh(judge.backend)
        t = time.perf_counter()
        theirs = [r.score for r in base.score(pairs)]
        f = time.perf_counter()
        results = judge.score(pairs)
        t, f = f - t, time.perf_counter() - f
        if turn:
            t_base.append(t)
            t_fast.append(f)
    assert all(r.error is None for r in results), [r.error for r in results]
    ours = [r.score for r in results]
    return dict(t_base=statistics.median(t_base), t_fast=statistics.median(t_fast),
                ratio=statistics.median(b / f for b, f in zip(t_base, t_fast)),
                **checks(judge, base, pairs, ours, theirs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["tiny", "mini"], choices=sorted(QWEN_SHAPES))
    ap.add_argument("--pairs", type=int, default=32, help="image-text pairs per workload")
    ap.add_argument("--captions", type=int, nargs="+", default=[4, 1],
                    help="captions per image, one workload each (default: 4, as datasets with "
                         "several captions per image, then 1)")
    ap.add_argument("--size", default="448x336", help="image WIDTHxHEIGHT (multiples of 28: no resizing)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", default="off", choices=["off", "on", "auto"],
                    help="fastjudge's compiled steps (docs/engine.md)")
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu", choices=DEVICES, help="both paths run here")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = bench_device(args.device)
    width, height = (int(v) for v in args.size.lower().split("x"))
    workloads = {k: make_pairs(args.pairs, k, width, height) for k in args.captions}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            model_dir = build_checkpoint(Path(tmp) / shape, shape)
            judge = HolisticJudge(model_dir, engine=EngineOptions(device=args.device, dtype=dtype,
                                                                  compile=args.compile))
            base = VQAScoreReference(model_dir, judge, device=device, dtype=dtype)
            for k, pairs in workloads.items():
                rows.append(dict(shape=shape, captions=k, **bench_one(judge, base, pairs, args)))
                print(f"[{shape}, {k} captions/image] baseline {rows[-1]['t_base']:.2f}s "
                      f"fastjudge {rows[-1]['t_fast']:.2f}s", file=sys.stderr)

    print(f"\nHolistic VQAScore: {args.pairs} pairs ({width}x{height}), {args.dtype}, median of "
          f"{args.repeats}, {device_label(device)}")
    print(f"{'shape':6} {'capt/img':>8} {'base pairs/s':>12} {'fast pairs/s':>12} {'ratio':>7} {'>=10x':>6} "
          f"{'max rel dP':>10} {'same ids':>8} {'max dpixel':>10}")
    n = args.pairs
    for r in rows:
        ratio = r["ratio"]
        print(f"{r['shape']:6} {r['captions']:8d} {n / r['t_base']:12.1f} {n / r['t_fast']:12.1f} {ratio:6.2f}x "
              f"{'PASS' if ratio >= TARGET else 'FAIL':>6} {r['max_rel']:10.1e} {r['same_ids']:4d}/{n:<3d} "
              f"{r['pixel_diff']:10.1e}")
    print("max rel dP: largest |P_fastjudge(Yes) - P_baseline(Yes)| / P_baseline(Yes); same ids: pairs whose "
          "input ids are identical; max dpixel: largest pixel-value difference of the two image preprocessors; "
          "capt/img: captions per image (the baseline runs every pair alone either way)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
