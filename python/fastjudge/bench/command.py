"""``fastjudge bench``: the command line, the measured runs, the printed table and the JSON.

One judge is loaded once; after ``--warmup`` untimed runs on items of their own, each
``--batch-tokens`` budget gets one measured run over the same ``--items`` items, fed to the
judge ``--chunk-size`` at a time as the file jobs feed it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import islice

from ..judges.registry import add_judge_options, engine_options, get_judge
from .items import SOURCES, bench_items
from .meter import MeteredBackend, counter_change, device_name, is_cuda, peak_memory, percentile_ms, reset_peak_memory

BENCH_JUDGES = ("lave", "visexmem", "holistic")
# items per run and per chunk when not given: what a CPU run finishes in about a minute on a
# small judge, and the file jobs' chunk sizes
DEFAULT_ITEMS = {"lave": 256, "holistic": 64, "visexmem": 16}
DEFAULT_CHUNK = {"lave": 1024, "holistic": 64, "visexmem": 64}
POSTFIX_EVERY_S = 0.5  # batch count on the progress bar at most this often


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}") from None
    if w < 1 or h < 1:
        raise argparse.ArgumentTypeError(f"image size must be positive, got {text!r}")
    return w, h


def add_bench_parser(sub) -> None:
    """The ``fastjudge bench`` subcommand."""
    p = sub.add_parser(
        "bench", help="measure a judge on this machine: tokens/s, items/s, batch latency, memory",
        description="Run a judge on bundled or synthetic items and print prompt tokens/s, "
                    "generated tokens/s, items/s, p50/p99 batch latency, peak memory, the device "
                    "and the dtype. Measures fastjudge alone (benchmarks/ compares it with "
                    "baselines).")
    p.add_argument("--judge", required=True, choices=BENCH_JUDGES)
    p.add_argument("--model", required=True, help="local Hugging Face checkpoint directory "
                                                  "(with --backend trtllm: a `fastjudge build` output)")
    p.add_argument("--items", type=int, default=None,
                   help="items per measured run (default: 256 for lave, 64 for holistic, 16 for "
                        "visexmem)")
    p.add_argument("--data", choices=SOURCES, default="bundled",
                   help="bundled: the sample VQA file cycled to --items (image judges: its "
                        "captions, over drawn pictures; default); synthetic: items made from "
                        "--seed")
    p.add_argument("--seed", type=int, default=0, help="seed of synthetic items and pictures (0)")
    p.add_argument("--image-size", type=_size, default=(640, 480), metavar="WxH",
                   help="size of the drawn pictures (image judges; default 640x480)")
    p.add_argument("--batch-tokens", type=int, nargs="+", default=None, metavar="N",
                   help="token budgets of one batch: one measured run each (default: "
                        "--max-batch-tokens, else the backend's)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="items handed to the judge together (default: as the file jobs, 1024 "
                        "for lave, 64 for the image judges)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs before measuring (default 1), on --warmup-items items "
                        "other than the measured ones")
    p.add_argument("--warmup-items", type=int, default=8, help="items per warm-up run (8)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.add_argument("--no-progress", action="store_true")
    add_judge_options(p)


def _check(args) -> None:
    for name in ("items", "chunk_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0 or args.warmup_items < 0:
        raise ValueError("--warmup and --warmup-items must be >= 0")
    if args.batch_tokens and min(args.batch_tokens) < 1:
        raise ValueError(f"--batch-tokens must be >= 1, got {min(args.batch_tokens)}")


def open_judge(args, metered: MeteredBackend):
    """The judge of ``args.judge`` on the metered backend: the registry's own factory, given
    the backend object as its model (a judge takes an open backend in place of a directory,
    and then ignores the engine options that open a model), so bench builds the judge the other commands build."""
    spec = get_judge(args.judge)
    return spec.factory(argparse.Namespace(**{**vars(args), "model": metered}))


def _chunks(items: list, size: int):
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def bench_device(backend):
    """The torch device the backend runs on; TensorRT-LLM (no torch device) runs on CUDA."""
    import torch

    device = getattr(backend, "device", None)
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda")
    return device


def _torch_memory(backend) -> bool:
    """Whether the backend's memory is torch's (the torch backends, which carry a torch dtype);
    TensorRT-LLM allocates its own."""
    return hasattr(backend, "dtype")


class _Progress:
    """The progress bar on stderr: items judged, and the batches run so far."""

    def __init__(self, total: int, desc: str, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="item", desc=desc, file=sys.stderr, disable=not enabled,
                        mininterval=0.5)
        self._shown = 0.0

    def on_batch(self, counts) -> None:
        # the image judges yield results only once a chunk is through every stage; the batch
        # count shows the run is moving meanwhile
        now = time.perf_counter()
        if now - self._shown >= POSTFIX_EVERY_S:
            self._shown = now
            self.bar.set_postfix(batches=counts.batches)

    def finish(self, counts) -> None:
        self.bar.set_postfix(batches=counts.batches, refresh=False)

    def close(self) -> None:
        self.bar.close()


def measure(judge, metered: MeteredBackend, examples: list, chunk_size: int,
            progress: _Progress | None = None) -> dict:
    """One timed run over ``examples``: the figures of one row of the table."""
    device = bench_device(metered.backend)
    reset_peak_memory(device)
    computed_before, stats_before = metered.computed_tokens(), metered.decode_stats()
    metered.reset()
    metered.on_batch = progress.on_batch if progress else None
    judged = errors = 0
    start = time.perf_counter()
    for chunk in _chunks(examples, chunk_size):
        for result in judge.stream(chunk):
            judged += 1
            errors += result.error is not None
            if progress:
                progress.bar.update(1)
    seconds = time.perf_counter() - start
    metered.on_batch = None
    counts = metered.reset()
    if progress:
        progress.finish(counts)
    computed_after, stats_after = metered.computed_tokens(), metered.decode_stats()
    peak, _ = peak_memory(device, torch_allocated=_torch_memory(metered.backend))
    rate = (lambda n: n / seconds) if seconds > 0 else (lambda n: 0.0)
    return {
        "batch_tokens": judge.max_batch_tokens,
        "items": judged,
        "errors": errors,
        "seconds": seconds,
        "items_per_s": rate(judged),
        "prompt_tokens": counts.prompt_tokens,
        "prompt_tokens_per_s": rate(counts.prompt_tokens),
        "generated_tokens": counts.generated_tokens,
        "generated_tokens_per_s": rate(counts.generated_tokens),
        "tokens_computed": (None if computed_before is None
                            else computed_after - computed_before),
        "decode_stats": counter_change(stats_before, stats_after),
        "batches": counts.batches,
        "model_seconds": sum(counts.latencies),
        "batch_latency_p50_ms": percentile_ms(counts.latencies, 50),
        "batch_latency_p99_ms": percentile_ms(counts.latencies, 99),
        "peak_memory_bytes": peak,
    }


def describe(args, backend, items: int) -> dict:
    """What was measured and on what: the fields of the report beside its runs."""
    import torch

    from .. import __version__

    device = bench_device(backend)
    if _torch_memory(backend):
        dtype = str(backend.dtype).replace("torch.", "")
    else:
        dtype = str(backend.manifest["quantization"].get("quant_algo", "unknown")).lower()
    return {
        "judge": args.judge,
        "model": str(args.model),
        "backend": args.backend,
        "device": str(device) if device is not None else "cpu",
        "device_name": device_name(device),
        "dtype": dtype,
        "threads": None if is_cuda(device) else torch.get_num_threads(),
        "data": args.data,
        "seed": args.seed,
        "image_size": list(args.image_size) if args.judge != "lave" else None,
        "items": items,
        "chunk_size": args.chunk_size or DEFAULT_CHUNK[args.judge],
        "warmup_runs": args.warmup,
        "warmup_items": args.warmup_items if args.warmup else 0,
        "peak_memory_kind": peak_memory(device, torch_allocated=_torch_memory(backend))[1],
        "fastjudge_version": __version__,
        "torch_version": torch.__version__,
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _rate(value: float) -> str:
    # three significant figures or more: a slow judge's 0.03 items/s must not print as 0.0
    if value >= 100 or value == 0:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 1 else f"{value:.3f}"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_report(report: dict, out=None) -> None:
    out = out or sys.stdout
    r = report
    where = r["device_name"] + (f", {r['threads']} threads" if r["threads"] else "")
    source = "the bundled sample cycled" if r["data"] == "bundled" else f"synthetic, seed {r['seed']}"
    if r["image_size"]:
        source += f"; pictures {r['image_size'][0]}x{r['image_size'][1]}"
    print(f"fastjudge bench {r['judge']}: {r['model']} ({r['backend']} backend)", file=out)
    print(f"  device {r['device']} ({where}), {r['dtype']}; fastjudge {r['fastjudge_version']}, "
          f"torch {r['torch_version']}", file=out)
    print(f"  {r['items']} items ({source}), chunks of {r['chunk_size']}; warm-up "
          f"{r['warmup_runs']} x {r['warmup_items']} items", file=out)
    head = ("batch tokens", "items", "errors", "seconds", "items/s", "prompt tok/s", "gen tok/s",
            "batches", "p50 ms", "p99 ms", "peak memory")
    print("  ".join(head), file=out)
    kind = {"cpu_peak_rss": "peak RSS", "cuda_max_allocated": "max allocated",
            "cuda_device_used": "device used"}[r["peak_memory_kind"]]
    for run in r["runs"]:
        cells = (run["batch_tokens"], run["items"], run["errors"], f"{run['seconds']:.2f}",
                 _rate(run["items_per_s"]), _rate(run["prompt_tokens_per_s"]),
                 _rate(run["generated_tokens_per_s"]), run["batches"],
                 _ms(run["batch_latency_p50_ms"]), _ms(run["batch_latency_p99_ms"]),
                 f"{_mib(run['peak_memory_bytes'])} {kind}")
        print("  ".join(str(c).rjust(len(h)) for c, h in zip(cells, head)), file=out)
    if r.get("compile_seconds"):
        print(f"  compiled steps: {r['compile_seconds']:.1f} s spent compiling (first call of each shape)",
              file=out)
    for run in r["runs"]:
        if run["errors"]:
            print(f"  note: {run['errors']} of {run['items']} items were errors at "
                  f"{run['batch_tokens']} batch tokens; their rows cost less than judged ones",
                  file=out)
            break


def run_bench(args) -> int:
    """``fastjudge bench``: returns the exit status."""
    from ..backends import load_backend

    _check(args)
    n = args.items or DEFAULT_ITEMS[args.judge]
    chunk = args.chunk_size or DEFAULT_CHUNK[args.judge]
    backend = load_backend(args.model, engine_options(args))
    metered = MeteredBackend(backend)
    judge = open_judge(args, metered)
    def make(count: int, start: int = 0, picture_round: int = 0) -> list:
        return bench_items(args.judge, count, args.data, args.seed, start, args.image_size,
                           picture_round)

    # warm-up items come after the measured ones, and each measured run draws its own round of
    # pictures: no image or image prefix state left in a cache by one run is asked for by another
    warm = make(args.warmup_items, n) if args.warmup and args.warmup_items else []
    for _ in range(args.warmup if warm else 0):
        measure(judge, metered, warm, chunk)
    report = describe(args, backend, n)
    report["runs"] = []
    for picture_round, budget in enumerate(args.batch_tokens or [judge.max_batch_tokens]):
        examples = make(n, picture_round=picture_round)
        judge.engine.max_batch_tokens = budget
        progress = _Progress(n, f"bench {args.judge} @{budget}", not args.no_progress)
        try:
            report["runs"].append(measure(judge, metered, examples, chunk, progress))
        finally:
            progress.close()
    # compiling (and recording CUDA graphs) happens in the first call of each shape, warm-up
    # included: reported apart from the runs' times
    report["compile_seconds"] = getattr(backend, "compile_seconds", None)
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0
