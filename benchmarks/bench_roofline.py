"""The roofline: each stage's achieved FLOP/s (or bytes/s) against this machine's measured peaks.

In one run: the peak GEMM rate per dtype (float32, bfloat16) by every path the device offers
(CPU: ``F.linear``, oneDNN on a prepacked weight, oneDNN on mkldnn tensors; CUDA: cuBLAS
``torch.mm`` and ``F.linear``), on large square shapes and on the models' own projection shapes,
the best of them the dtype's peak; the memory bandwidth (a large copy and a large sum); then the
stages, each timed as a median over ``--repeats`` runs through the backends' public ``run``
(the vision tower and the crop encoder through their own entry points), with its FLOPs and bytes
from the checkpoint's shape (``fastjudge.bench.roofline``) and the share of its bound achieved:

* T5 encoder: score-only requests (encoder and one decoder position per row, whose
  cross-attention the bound counts in its cheaper form for one step: reassociated, no keys and
  values projected);
* T5 decode step at 1/16/64 rows: greedy text requests; a step's time is the wall time of the
  requests at ``decode_tokens`` new tokens less that at one (the two run in turns), over the
  steps between (counted by ``fastjudge.bench.step_profile``), timed without the profiler (whose per-op cost is printed
  beside it as "profiled ms"); the bound counts the cross-attention in its cheaper form for a
  call of ``decode_tokens`` steps (``roofline.t5_reassociates``);
* Qwen prefill: whole prompts with no cached prefix (one score-only position each);
* Qwen score-only suffix step: rows of a few tokens after a cached shared prefix;
* Qwen decode step at 1/16/64 rows: as T5's, after a cached prefix (suffix prefill left out);
* vision tower: images of crop-encoded pixels;
* crop encode: crops of an image resized and patchified (memory-bound).

The machine's pace is measured beside every stage too: after each timed repeat of a stage, one
call of the dtype's peak GEMM (its best path and shape) and a copy and a sum of 64 MiB
(``Pace``); "of pace" is the stage's share of the bound these give, medians over its repeats.
A shared machine's speed moves by a fifth or more from one minute to the next (the same step
timed minutes apart here differed by 2x), so a share of a peak measured minutes away says as
much about the machine as about the stage; "of pace" compares the two at the same moment. The
pace's GEMM is one call's median rate, a little under the best of many: on a quiet machine "of
pace" reads a few points above "of bound".

Random-weight checkpoints built here (``fastjudge.checkpoints``): ``--size tiny`` (the test
shapes) or ``mini`` (Flan-T5-small's shape; the ``mini`` Qwen3.5 with its vision tower).
``--dense plain prepared`` runs the stages twice: projections on ``F.linear``, then prepared by
``backends.dense.prepare_dense`` (on the CPU the engine's panels for few rows, oneDNN prepacked
weights for many). ``--stages t5`` runs the T5 stages alone (no Qwen checkpoint is built; the
peaks leave out the Qwen shape).

    python benchmarks/bench_roofline.py --size mini
    python benchmarks/bench_roofline.py --size mini --stages t5 --dense prepared
    python benchmarks/bench_roofline.py --quick --device cuda --json roofline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fastjudge.bench import roofline as rl
from fastjudge.bench.step_profile import profile_decoding
from fastjudge.checkpoints import build_random_qwen_vl, build_random_t5
from fastjudge.demo import tokenizer_corpus

sys.path.insert(0, str(Path(__file__).parent))
from bench_device import DEVICES, bench_device, device_label  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
T5_SHAPE = {"tiny": "tiny", "mini": "small"}


# -- stage adapters: the only places this script reaches into the engine ------------------------
def open_backend(model_dir: Path, device: torch.device, dtype: str):
    """A checkpoint opened as a judge opens it (eager steps: compile time is not a stage)."""
    from fastjudge.backends import load_backend
    from fastjudge.engine_options import EngineOptions

    return load_backend(model_dir, EngineOptions(device=str(device), dtype=dtype, compile="off"))


def set_dense(backend, prepared: bool) -> None:
    """Every projection of the backend's models on ``F.linear`` or on its prepared GEMM."""
    from fastjudge.backends.dense import prepare_dense

    for value in vars(backend).values():
        if isinstance(value, torch.nn.Module):
            prepare_dense(value, enabled=prepared)


def encode_images(backend, images: list) -> object:
    """The vision tower over ``(pixel_values, grid_thw)`` pairs."""
    return backend.vision.encode_images(images)


def crop_encode(image: torch.Tensor, boxes: torch.Tensor, model_dir: Path):
    from fastjudge.kernels.crop_encode import CropEncodeConfig
    from fastjudge.kernels.crop_encode import crop_encode as encode

    cfg = json.loads((model_dir / "preprocessor_config.json").read_text())
    keys = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels")
    config = CropEncodeConfig(**{k: cfg[k] for k in keys if k in cfg})
    return encode(image, boxes, config)


# -- workloads ------------------------------------------------------------------------------------
class Ids:
    """Random prompt ids in [5, vocab) (no special tokens), never the same twice."""

    def __init__(self, vocab: int, seed: int = 0):
        self.rng, self.vocab = np.random.default_rng(seed), vocab

    def __call__(self, n: int) -> np.ndarray:
        return self.rng.integers(5, self.vocab - 8, size=n).astype(np.int64)


def requests(prompts: list[np.ndarray], spec, prefix_len: int = 0) -> list:
    from fastjudge.runtime.requests import Request

    return [Request(i, p, spec, prefix_len=prefix_len) for i, p in enumerate(prompts)]


class Pace:
    """The machine's speed at the moment of a stage: its peak GEMM for the stages' dtype (the
    best path and shape of ``peaks``) and a copy and a sum of ``nbytes``, each timed once per
    :meth:`sample`; :meth:`take` gives the medians since the last take."""

    def __init__(self, device: torch.device, dtype: str, peaks: list[dict], nbytes: int = 1 << 26):
        best = max((r for r in peaks if r["dtype"] == dtype and r["flops_per_s"]), key=lambda r: r["flops_per_s"])
        tdt, m, k, n = DTYPES[dtype], best["m"], best["k"], best["n"]
        g = torch.Generator().manual_seed(7)
        x = torch.randn(m, k, generator=g).to(device, tdt)
        product = rl.gemm_paths(device, tdt)[best["path"]]((torch.randn(n, k, generator=g) / k ** 0.5).to(device, tdt))
        a = torch.ones(nbytes // 4, device=device)
        b = torch.empty_like(a)
        self.device, self.gemm_flops, self.nbytes = device, 2 * m * k * n, nbytes
        self._gemm, self._copy, self._sum = (lambda: product(x)), (lambda: b.copy_(a)), (lambda: a.sum())
        self._samples: list[tuple[float, float]] = []
        self._gemm()  # warm-up

    def _seconds(self, fn) -> float:
        rl.sync(self.device)
        start = time.perf_counter()
        fn()
        rl.sync(self.device)
        return time.perf_counter() - start

    def sample(self) -> None:
        rate = self.gemm_flops / self._seconds(self._gemm)
        copy, total = 2 * self.nbytes / self._seconds(self._copy), self.nbytes / self._seconds(self._sum)
        self._samples.append((rate, max(copy, total)))

    def take(self) -> dict:
        rates, bandwidths = zip(*self._samples)
        self._samples = []
        return {"flops_per_s": statistics.median(rates), "bytes_per_s": statistics.median(bandwidths)}


def timed(fn, device: torch.device, repeats: int, pace: Pace | None = None) -> tuple[float, object]:
    """Median wall seconds of ``fn()`` over ``repeats`` after a warm-up, and its last output;
    ``pace`` sampled after each repeat."""
    out = fn()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        rl.sync(device)
        seconds.append(time.perf_counter() - start)
        if pace is not None:
            pace.sample()
    return statistics.median(seconds), out


def per_step(run_for, device, repeats: int, pace: Pace | None = None) -> tuple[float, float, int]:
    """Seconds per decode step of ``run_for(n)()`` (the same prompts decoding ``n`` new tokens)
    at ``n = tokens``: the wall time of ``run_for(tokens)`` less that of ``run_for(1)``, the two
    run in turns (the median of ``repeats`` differences after a warm-up: the prompts' work, a
    T5 encoder's hundreds of milliseconds, moves with the machine as much as the steps do and
    must cancel at the same moment), over the steps between them, which ``bench.step_profile``
    counts in one profiled run of each. The timed runs leave the profiler off: its per-op cost
    (~10 us an op) is a large share of a small step. Also returns the profiler's own per-step
    time (the decode loop's wall time under the profiler) and the steps of the full run."""
    full, one = run_for(None), run_for(1)
    profiled_full, profiled_one = profile_decoding(full), profile_decoding(one)
    steps = profiled_full["steps"] - (profiled_one["steps"] if profiled_one["ms"] > 0 else 0)
    full(), one()  # warm-up
    differences = []
    for _ in range(repeats):
        seconds = []
        for run in (full, one):
            start = time.perf_counter()
            run()
            rl.sync(device)
            seconds.append(time.perf_counter() - start)
        differences.append(seconds[0] - seconds[1])
        if pace is not None:
            pace.sample()
    return max(statistics.median(differences), 0.0) / max(steps, 1), profiled_full["ms"] / 1e3, \
        profiled_full["steps"]


def t5_stages(model_dir: Path, device, dtype: str, args) -> list[dict]:
    from fastjudge.runtime.requests import Choice, Text

    cfg = json.loads((model_dir / "config.json").read_text())
    dims, tdt = rl.T5Dims.from_config(cfg), DTYPES[dtype]
    backend = open_backend(model_dir, device, dtype)
    ids = Ids(cfg["vocab_size"])
    out = []
    for prepared in args.dense_modes:
        set_dense(backend, prepared)
        rows, length = args.t5_encoder
        prompts = [ids(length) for _ in range(rows)]
        seconds, _ = timed(lambda: backend.run(requests(prompts, Choice((3, 4, 5)))), device, args.repeats,
                           args.pace)
        cost = rl.t5_encoder_cost(dims, [length] * rows, tdt) + \
            rl.t5_decode_step_cost(dims, rows, length, 0, tdt, logits=False, steps=1)
        out.append(dict(stage="T5 encoder", work=f"{rows}x{length} tok", prepared=prepared,
                        seconds=seconds, cost=cost, dtype=dtype, pace=args.pace.take()))
        enc_len = args.t5_decode_prompt
        for rows in args.decode_rows:
            prompts = [ids(enc_len) for _ in range(rows)]
            s, profiled, steps = per_step(
                lambda n: lambda: backend.run(requests(prompts, Text(n or args.decode_tokens))), device, args.repeats,
                args.pace)
            mid = args.decode_tokens // 2
            out.append(dict(stage=f"T5 decode step, {rows} rows", work=f"enc {enc_len}, {steps} steps",
                            prepared=prepared, seconds=s, profiled_seconds=profiled,
                            cost=rl.t5_decode_step_cost(dims, rows, enc_len, mid, tdt, steps=args.decode_tokens),
                            dtype=dtype, pace=args.pace.take()))
    return out


def qwen_stages(model_dir: Path, device, dtype: str, args) -> list[dict]:
    from fastjudge.runtime.requests import Choice, Text

    cfg = json.loads((model_dir / "config.json").read_text())
    dims, tdt = rl.QwenDims.from_config(cfg), DTYPES[dtype]
    backend = open_backend(model_dir, device, dtype)
    ids = Ids(dims.vocab, seed=1)
    out = []
    for prepared in args.dense_modes:
        set_dense(backend, prepared)
        rows, length = args.qwen_prefill
        # new prompts every call: nothing of a prompt is cached
        seconds, _ = timed(lambda: backend.run(requests([ids(length) for _ in range(rows)], Choice((7, 8)))),
                           device, args.repeats, args.pace)
        out.append(dict(stage="Qwen prefill", work=f"{rows}x{length} tok", prepared=prepared, seconds=seconds,
                        cost=rl.qwen_forward_cost(dims, rows, length, 0, tdt, logits_rows=0), dtype=dtype,
                        pace=args.pace.take()))
        prefix, (rows, suffix) = ids(args.qwen_prefix), args.qwen_suffix
        prompts = [np.concatenate([prefix, ids(suffix)]) for _ in range(rows)]
        # the prefix is computed in the warm-up call and cached for the timed ones
        seconds, _ = timed(lambda: backend.run(requests(prompts, Choice((7, 8)), len(prefix))), device, args.repeats,
                           args.pace)
        out.append(dict(stage="Qwen score-only suffix step", work=f"{rows}x{suffix} after {len(prefix)}",
                        prepared=prepared, seconds=seconds,
                        cost=rl.qwen_forward_cost(dims, rows, suffix, len(prefix), tdt, logits_rows=0,
                                                  shared=len(prefix)),
                        dtype=dtype, pace=args.pace.take()))
        for rows in args.decode_rows:
            prompts = [np.concatenate([prefix, ids(8)]) for _ in range(rows)]
            s, profiled, steps = per_step(
                lambda n: lambda: backend.run(requests(prompts, Text(n or args.decode_tokens), len(prefix))),
                device, args.repeats, args.pace)
            ctx = len(prefix) + 8 + args.decode_tokens // 2
            out.append(dict(stage=f"Qwen decode step, {rows} rows", work=f"ctx {ctx}, {steps} steps",
                            prepared=prepared, seconds=s, profiled_seconds=profiled,
                            cost=rl.qwen_forward_cost(dims, rows, 1, ctx, tdt, shared=len(prefix)), dtype=dtype,
                            pace=args.pace.take()))
        out += vision_stages(backend, model_dir, cfg, device, tdt, dtype, prepared, args)
    return out


def vision_stages(backend, model_dir, cfg, device, tdt, dtype, prepared, args) -> list[dict]:
    vdims = rl.VisionDims.from_config(cfg)
    g = torch.Generator().manual_seed(5)
    side, count = args.image
    image = torch.randint(0, 256, (3, side, side), dtype=torch.uint8, generator=g)
    whole = torch.tensor([[0, 0, side, side]] * count)
    pixels, grids = crop_encode(image, whole, model_dir)
    per = [int(t * h * w) for t, h, w in grids.tolist()]
    images = list(zip(torch.split(pixels.to(device, tdt), per), [tuple(r) for r in grids.tolist()]))
    seconds, _ = timed(lambda: encode_images(backend, images), device, args.repeats, args.pace)
    out = [dict(stage="vision tower", work=f"{count} images x {per[0]} patches", prepared=prepared,
                seconds=seconds, cost=rl.vision_cost(vdims, per, tdt), dtype=dtype, pace=args.pace.take())]
    if prepared == args.dense_modes[0]:  # no projections: once
        boxes = torch.tensor([[0, (i * 37) % (side // 2), (i * 53) % (side // 2), side // 2 + (i * 37) % (side // 2),
                               side // 2 + (i * 53) % (side // 2)] for i in range(args.crops)])
        seconds, (pv, _) = timed(lambda: crop_encode(image, boxes, model_dir), torch.device("cpu"), args.repeats,
                                 args.pace)
        crop_pixels = int(((boxes[:, 3] - boxes[:, 1]) * (boxes[:, 4] - boxes[:, 2])).sum())
        out.append(dict(stage="crop encode", work=f"{args.crops} crops of {side // 2}px", prepared=None,
                        seconds=seconds, cost=rl.crop_encode_cost(crop_pixels, 3, pv.shape[0], pv.shape[1]),
                        dtype="uint8->float32", pace=args.pace.take()))
    return out


# -- peaks ----------------------------------------------------------------------------------------
def gemm_shapes(t5_cfg: dict, qwen_cfg: dict | None, quick: bool) -> list[tuple[str, int, int, int]]:
    t5 = rl.T5Dims.from_config(t5_cfg)
    square = 1024 if quick else 2048
    rows = 512 if quick else 4096
    shapes = [("square", square, square, square),
              ("T5 q/k/v", rows, t5.d_model, 3 * t5.inner),
              ("T5 wi", rows, t5.d_model, (2 if t5.gated else 1) * t5.d_ff)]
    if qwen_cfg is not None:
        qw = rl.QwenDims.from_config(qwen_cfg)
        shapes.append(("Qwen gate/up", rows, qw.hidden, 2 * qw.ff))
    return shapes[:2] if quick else shapes


def measure_peaks(device, shapes, repeats: int) -> list[dict]:
    rows = []
    for name, dtype in DTYPES.items():
        for path, make in rl.gemm_paths(device, dtype).items():
            for label, m, k, n in shapes:
                try:
                    rate = rl.gemm_rate(m, k, n, dtype, device, make, repeats)
                except RuntimeError as e:  # a path this build lacks for this dtype
                    rate = None
                    print(f"  {path} {name} {m}x{k}x{n}: {str(e).splitlines()[0]}", file=sys.stderr)
                rows.append(dict(dtype=name, path=path, shape=label, m=m, k=k, n=n, flops_per_s=rate))
    return rows


def best_peak(peaks: list[dict], dtype: str) -> float:
    return max(r["flops_per_s"] for r in peaks if r["dtype"] == dtype and r["flops_per_s"])


# -- report ---------------------------------------------------------------------------------------
def finish(stage: dict, peak: float, bw: float) -> dict:
    cost = stage.pop("cost")
    bound, kind = rl.bound_seconds(cost, peak, bw)
    # a differenced decode step can come out at zero or below on a noisy machine: no rate then
    s = stage["seconds"] if stage["seconds"] > 0 else None
    at_pace, _ = rl.bound_seconds(cost, stage["pace"]["flops_per_s"], stage["pace"]["bytes_per_s"])
    return {**stage, "flops": cost.flops, "bytes": cost.bytes, "bound": kind, "bound_seconds": bound,
            "flops_per_s": s and cost.flops / s, "bytes_per_s": s and cost.bytes / s, "of_bound": s and bound / s,
            "of_pace": s and at_pace / s}


def _num(value, scale: float, fmt: str) -> str:
    return "-" if value is None else format(value * scale, fmt)


def print_tables(report: dict) -> None:
    print(f"{report['device_label']}, torch {report['torch']}; {report['size']} checkpoints, stages in "
          f"{report['dtype']}; medians of {report['repeats']}")
    print(f"{'dtype':<9} {'path':<22} {'shape':<13} {'m x k x n':>18} {'GFLOP/s':>9}")
    for r in report["peaks"]:
        rate = "-" if r["flops_per_s"] is None else f"{r['flops_per_s'] / 1e9:.0f}"
        print(f"{r['dtype']:<9} {r['path']:<22} {r['shape']:<13} {r['m']:>6}x{r['k']}x{r['n']:<6} {rate:>9}")
    peaks = ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in report["peak"].items())
    bw = report["bandwidth"]
    print(f"peak: {peaks}; bandwidth: copy {bw['copy'] / 1e9:.1f} GB/s, sum {bw['sum'] / 1e9:.1f} GB/s")
    print(f"{'stage':<30} {'work':<24} {'GEMMs':<9} {'ms':>9} {'profiled ms':>12} {'GFLOP':>8} {'GFLOP/s':>8} "
          f"{'GB/s':>7} {'bound':>8} {'of bound':>9} {'of pace':>8}")
    for s in report["stages"]:
        gemms = {None: "-", True: "prepared", False: "plain"}[s["prepared"]]
        profiled = _num(s.get("profiled_seconds"), 1e3, ".2f")
        print(f"{s['stage']:<30} {s['work']:<24} {gemms:<9} {s['seconds'] * 1e3:>9.2f} {profiled:>12} "
              f"{s['flops'] / 1e9:>8.2f} {_num(s['flops_per_s'], 1e-9, '.1f'):>8} "
              f"{_num(s['bytes_per_s'], 1e-9, '.1f'):>7} {s['bound']:>8} {_num(s['of_bound'], 100, '.0f'):>8}% "
              f"{_num(s['of_pace'], 100, '.0f'):>7}%")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=DEVICES)
    ap.add_argument("--size", default="mini", choices=sorted(T5_SHAPE))
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the stages' dtype (float32)")
    ap.add_argument("--dense", nargs="+", default=["plain", "prepared"], choices=["plain", "prepared"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stages", nargs="+", default=["t5", "qwen"], choices=["t5", "qwen"],
                    help="which model's stages run (Qwen's include the vision tower and crop encode)")
    ap.add_argument("--quick", action="store_true", help="tiny checkpoints, small shapes, one repeat")
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args(argv)
    device = bench_device(args.device)
    if args.quick:
        args.size, args.repeats, args.dense = "tiny", 1, ["prepared"]
    small = args.size == "tiny"
    args.dense_modes = [d == "prepared" for d in args.dense]
    args.t5_encoder = (4, 64) if small else (8, 490)
    args.t5_decode_prompt = 32 if small else 128
    args.decode_rows = [1, 16, 64]
    args.decode_tokens = 6 if small else 16
    args.qwen_prefill = (2, 64) if small else (4, 512)
    args.qwen_prefix, args.qwen_suffix = (32, (16, 4)) if small else (448, (64, 16))
    args.image = (112, 2) if small else (448, 4)
    args.crops = 4 if small else 16
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = tokenizer_corpus()
        t5_dir = build_random_t5(Path(tmp) / "t5", corpus, shape=T5_SHAPE[args.size])
        t5_cfg = json.loads((t5_dir / "config.json").read_text())
        qwen_dir = qwen_cfg = None
        if "qwen" in args.stages:
            qwen_dir = build_random_qwen_vl(Path(tmp) / "qwen", corpus, seed=3, shape=args.size)
            qwen_cfg = json.loads((qwen_dir / "config.json").read_text())
        shapes, nbytes = gemm_shapes(t5_cfg, qwen_cfg, args.quick), (1 << 26) if args.quick else (1 << 28)
        peaks = measure_peaks(device, shapes, max(args.repeats, 2))
        bw = rl.bandwidth(device, nbytes, max(args.repeats, 2))
        args.pace = Pace(device, args.dtype, peaks, nbytes // 4)
        stages = t5_stages(t5_dir, device, args.dtype, args) if "t5" in args.stages else []
        if qwen_dir is not None:
            stages += qwen_stages(qwen_dir, device, args.dtype, args)
        if not args.quick:
            # peaks measured again after the stages, the better of the two kept: a machine
            # shared with other work can be slow through one measurement
            peaks = [max(a, b, key=lambda r: r["flops_per_s"] or 0)
                     for a, b in zip(peaks, measure_peaks(device, shapes, max(args.repeats, 2)))]
            bw = {k: max(v, rl.bandwidth(device, nbytes, max(args.repeats, 2))[k]) for k, v in bw.items()}
    peak = {name: best_peak(peaks, name) for name in DTYPES}
    best_bw = max(bw.values())
    report = dict(device=str(device), device_label=device_label(device), torch=torch.__version__, size=args.size,
                  dtype=args.dtype, repeats=args.repeats, peaks=peaks, peak=peak, bandwidth=bw,
                  stages=[finish(s, peak[args.dtype], best_bw) for s in stages])
    print_tables(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
