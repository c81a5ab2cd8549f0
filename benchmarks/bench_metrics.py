"""Metrics throughput: VQA Accuracy over 1M items, bootstrap of correlations over 22k items.

    python benchmarks/bench_metrics.py                      # 1M items, 5000 x 22,100 bootstrap
    python benchmarks/bench_metrics.py --items 200000 --repeats 5
    python benchmarks/bench_metrics.py --only bootstrap

VQA Accuracy: VQA-v2-shaped items (10 references drawn around a true answer with varying
agreement, case/punctuation/article/number-word variants, a few thousand distinct answers; the
prediction is right, a variant, or another answer). Times ``vqa_accuracy_many`` with its
normalization caches cleared before every run ("cold") and kept ("warm"), per-item
``vqa_accuracy`` calls, and a plain implementation that follows vqaEval.py's loop literally
(answer dicts, normalization of every answer on every item, leave-one-out by list filtering) on
a subset; all return identical values.

Bootstrap: 22,100 items (the LAVE test set's size), human scores in {0, 0.5, 1}; metrics shaped
like LAVE's score (3 values), VQA Accuracy (5 values) and a continuous soft score. Times 5000
resamples of Spearman (and Kendall) per metric, the three metrics together (shared resamples, as
``meta-eval`` runs them), and extrapolates a per-resample loop (draw, rank, correlate).

Prints median wall times and rates; single process, single thread (set OPENBLAS_NUM_THREADS /
OMP_NUM_THREADS=1 for steadier numbers on a busy machine).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from fastjudge.metrics import stats, vqa
from fastjudge.testing.vqa_eval_script import script_accuracy

BASE_ANSWERS = (
    ["yes", "no"] + [str(i) for i in range(0, 21)]
    + ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    + ["red", "blue", "green", "white", "black", "brown", "yellow", "orange", "gray", "pink"]
    + ["dog", "cat", "man", "woman", "tennis", "baseball", "frisbee", "pizza", "kite", "bus",
       "train", "table", "grass", "snow", "water", "sky", "tree", "wood", "metal", "plastic",
       "skiing", "surfing", "skateboarding", "t-shirt", "hot dog", "teddy bear", "cell phone",
       "stop sign", "fire hydrant", "left", "right", "daytime", "night", "sunny", "cloudy"]
)


def variants(answer: str) -> list[str]:
    return [answer, answer.capitalize(), answer + ".", "the " + answer, "a " + answer,
            answer.upper(), " " + answer + " ", answer + "!"]


def make_items(n: int, seed: int) -> tuple[list[str], list[list[str]]]:
    rng = random.Random(seed)
    vocab = list(BASE_ANSWERS)
    for i in range(3000):  # a long tail of rarer answers
        vocab.append(f"{rng.choice(BASE_ANSWERS)} {rng.choice(BASE_ANSWERS)}" if i % 2
                     else f"{rng.choice(BASE_ANSWERS)}{i}")
    preds, refs = [], []
    for _ in range(n):
        truth = rng.choice(vocab) if rng.random() < 0.5 else rng.choice(BASE_ANSWERS)
        agree = rng.random()
        other = rng.choice(vocab)
        r = []
        for _ in range(10):
            u = rng.random()
            if u < agree:
                r.append(truth)
            elif u < agree + (1 - agree) / 3:
                r.append(rng.choice(variants(truth)))
            elif u < agree + 2 * (1 - agree) / 3:
                r.append(other)
            else:
                r.append(rng.choice(vocab))
        u = rng.random()
        pred = truth if u < 0.5 else rng.choice(variants(truth)) if u < 0.7 else rng.choice(vocab)
        preds.append(pred)
        refs.append(r)
    return preds, refs


def script_loop(preds, refs) -> list[float]:
    """vqaEval.py's evaluate() loop, literally: no caching, dicts, list filtering."""
    return [script_accuracy(pred, answers) for pred, answers in zip(preds, refs)]


def timed(fn, repeats: int, before=None) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        if before:
            before()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def bench_vqa(args) -> None:
    t0 = time.perf_counter()
    preds, refs = make_items(args.items, args.seed)
    print(f"VQA Accuracy: {args.items:,} items x 10 references "
          f"(generated in {time.perf_counter() - t0:.1f} s), medians of {args.repeats} runs")
    sub = min(args.items, args.script_items)
    header = f"{'implementation':<44} {'items':>9} {'median s':>9} {'items/s':>11}"
    print(header)
    print("-" * len(header))

    def row(name, n, seconds):
        print(f"{name:<44} {n:>9,} {seconds:>9.3f} {n / seconds:>11,.0f}")
        return n / seconds

    cold_s, fast = timed(lambda: vqa.vqa_accuracy_many(preds, refs), args.repeats,
                          vqa.clear_caches)
    cold = row("vqa_accuracy_many, caches cleared (cold)", args.items, cold_s)
    warm_s, fast2 = timed(lambda: vqa.vqa_accuracy_many(preds, refs), args.repeats)
    row("vqa_accuracy_many, caches warm", args.items, warm_s)
    single_s, single = timed(lambda: [vqa.vqa_accuracy(p, r) for p, r in zip(preds, refs)],
                             args.repeats)
    row("vqa_accuracy per item (warm)", args.items, single_s)
    script_s, script = timed(lambda: script_loop(preds[:sub], refs[:sub]), 1)
    base = row("vqaEval.py loop, literal (1 run)", sub, script_s)
    assert fast == fast2 == single and script == fast[:sub], "implementations disagree"
    print(f"cold fast path vs literal loop: {cold / base:.1f}x; identical values on the "
          f"{sub:,}-item subset. Target >= 200,000 items/s cold: "
          f"{'met' if cold >= 200_000 else 'NOT met'}")
    print()


def bench_bootstrap(args) -> None:
    rng = np.random.default_rng(args.seed)
    n, boot = args.boot_items, args.boot
    h = rng.choice([0.0, 0.5, 1.0], n, p=[0.25, 0.15, 0.6])
    lave = np.clip(np.round(h * 2 + rng.normal(scale=0.7, size=n)) / 2, 0, 1)
    acc = np.clip(np.round((h + rng.normal(scale=0.4, size=n)) * 3) / 3, 0, 1).round(1)
    soft = h + rng.normal(scale=0.5, size=n)
    metrics = {"lave (3 values)": lave, "vqa_acc (5 values)": acc, "soft (continuous)": soft}
    print(f"Bootstrap: {boot:,} resamples x {n:,} items, medians of {args.boot_repeats} runs")
    header = f"{'what':<44} {'median s':>9} {'resamples/s':>12}"
    print(header)
    print("-" * len(header))

    def row(name, seconds):
        print(f"{name:<44} {seconds:>9.2f} {boot / seconds:>12,.0f}")

    for stat in stats.STATS:
        for name, m in metrics.items():
            s, _ = timed(lambda: stats.bootstrap_replicates(m, h, (stat,), boot, 0),
                         args.boot_repeats)
            row(f"{stat}, {name}", s)
    allm = np.stack(list(metrics.values()))
    s, _ = timed(lambda: stats.bootstrap_replicates(allm, h, stats.STATS, boot, 0),
                 args.boot_repeats)
    row("spearman + kendall, 3 metrics (meta-eval)", s)

    # per-resample loop for reference: draw, rank with numpy, correlate (extrapolated)
    k = 50
    loop_rng = np.random.default_rng(0)
    start = time.perf_counter()
    for _ in range(k):
        idx = loop_rng.integers(0, n, n)
        stats.spearman(soft[idx], h[idx])
    per = (time.perf_counter() - start) / k
    print(f"{'spearman, per-resample loop (extrapolated)':<44} {per * boot:>9.2f} "
          f"{1 / per:>12,.0f}")
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("vqa", "bootstrap"), default=None)
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--script-items", type=int, default=100_000,
                   help="items for the literal vqaEval.py loop (slow)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--boot", type=int, default=5000)
    p.add_argument("--boot-items", type=int, default=22_100)
    p.add_argument("--boot-repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.only in (None, "vqa"):
        bench_vqa(args)
    if args.only in (None, "bootstrap"):
        bench_bootstrap(args)


if __name__ == "__main__":
    main()
