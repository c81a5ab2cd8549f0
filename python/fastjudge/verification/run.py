"""``fastjudge verify``: a seeded sample of the user's items scored by fastjudge, exactly as
``fastjudge lave`` / ``visexmem`` would score them, and by the reference path of that judge
and mode (:mod:`fastjudge.reference`) on the same checkpoint, device and dtype; then what
agrees and by how much the rest differs (:mod:`.compare`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..judges.lave_official import OfficialLave
from ..judges.registry import get_judge
from .compare import Tolerance, as_dict, compare, default_tolerance

JUDGE_NAMES = ("lave", "visexmem", "holistic")
# items a `fastjudge lave` / `visexmem` job plans together (their --chunk-size defaults)
CHUNK_SIZE = {"lave": 1024, "visexmem": 64, "holistic": 64}


def build_judge(name: str, args, model=None, backend: str = "torch"):
    """The judge ``fastjudge <name>`` builds from the parsed options ``args`` -- the one place
    verify builds a fastjudge judge. ``model`` replaces ``args.model`` (a build's checkpoint);
    ``backend="trtllm"`` opens a ``fastjudge build`` output directory on TensorRT-LLM."""
    spec = get_judge(name)
    return spec.factory(argparse.Namespace(**{**vars(args), "model": str(model or args.model),
                                              "backend": backend}))


def mode_of(name: str, judge) -> str:
    if name == "lave":
        return "official" if isinstance(judge.style, OfficialLave) else "rationale" if judge.rationale else "score-only"
    if name == "holistic":
        return f"template {judge.template}, normalize {judge.normalize}"
    return judge.mode


def sample_examples(name: str, input_path: str, sample: int, seed: int) -> tuple[list, list]:
    """(ids, examples): ``sample`` input items drawn with ``random.Random(seed)`` (all of them
    when there are no more), in file order. Lines that are no item at all (bad JSON, a row the
    judge's reader refuses) are left out: they are the job's business, not the model's."""
    from ..io.jobs import read_input

    spec = get_judge(name)
    pairs = []
    for line in read_input(input_path):
        if line.error:
            continue
        try:
            pairs.append((line.id, spec.example(line.item, line.id)))
        except Exception:  # noqa: BLE001 - an unreadable row is not a faithfulness question
            continue
    if not pairs:
        raise ValueError(f"{input_path}: no items to verify")
    if sample < len(pairs):
        keep = sorted(random.Random(seed).sample(range(len(pairs)), sample))
        pairs = [pairs[i] for i in keep]
    return [p[0] for p in pairs], [p[1] for p in pairs]


class Progress:
    """A progress bar for one path, and after its first batch a line with the time estimate.
    ``batched``: each call reports a whole batch (the reference paths); otherwise items arrive
    one call each, a batch's items together (fastjudge's ``stream``), and the first batch ends
    when a call comes after a pause."""

    BATCH_GAP_S = 0.05

    def __init__(self, label: str, total: int, enabled: bool = True, batched: bool = True):
        from tqdm import tqdm

        self.label, self.total, self.enabled, self.batched = label, total, enabled, batched
        self.bar = tqdm(total=total, desc=label, unit="item", file=sys.stderr, disable=not enabled)
        self.start = self.last = time.perf_counter()
        self.done, self.estimated = 0, False

    def __call__(self, n: int) -> None:
        now = time.perf_counter()
        if not self.estimated and self.done and (self.batched or now - self.last > self.BATCH_GAP_S):
            self._estimate(self.last - self.start)
        self.done += n
        self.bar.update(n)
        self.last = now
        if self.batched and n and not self.estimated:
            self._estimate(now - self.start)

    def _estimate(self, spent: float) -> None:
        self.estimated = True
        if self.enabled and 0 < self.done < self.total:
            left = spent / self.done * (self.total - self.done)
            self.bar.write(f"verify: {self.label}: first {self.done} of {self.total} items in {spent:.1f}s; "
                           f"about {left:.0f}s to go on this path", file=sys.stderr)

    def close(self) -> float:
        self.bar.close()
        return time.perf_counter() - self.start


def score_fastjudge(name: str, judge, examples, progress: Progress) -> list:
    """The judge's results in input order, run in the chunks a file job plans together."""
    out, size = [], CHUNK_SIZE[name]
    for start in range(0, len(examples), size):
        for r in judge.stream(examples[start: start + size]):
            r.index += start
            out.append(r)
            progress(1)
    return sorted(out, key=lambda r: r.index)


@dataclass
class VerifyReport:
    judge: str
    mode: str
    model: str
    device: str
    dtype: str
    items: int
    sample_seed: int
    tolerance: dict
    seconds: dict = field(default_factory=dict)
    comparisons: list = field(default_factory=list)  # {"fastjudge", "reference", "passed", "outputs"}
    passed: bool = True

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _where(judge) -> tuple[str, str]:
    backend = judge.backend
    return str(getattr(backend, "device", "cpu")), str(getattr(backend, "dtype", "float32")).replace("torch.", "")


def run_verify(name: str, args, *, progress: bool = True) -> VerifyReport:
    """Everything ``fastjudge verify`` does but printing: ``args`` holds ``model``, ``input``,
    ``sample``, ``seed``, ``tolerance``, ``min_agreement``, ``build``, ``reference_batch_size``
    and the judge's options."""
    from ..reference import reference_for

    if name not in JUDGE_NAMES:
        raise ValueError(f"--judge must be one of {', '.join(JUDGE_NAMES)}")
    if args.sample < 1:
        raise ValueError("--sample must be >= 1")
    ids, examples = sample_examples(name, args.input, args.sample, args.seed)
    paths = {}  # label -> judge or reference
    fast = build_judge(name, args)
    device, dtype = _where(fast)
    build = getattr(args, "build", None)
    if build:
        trt = importlib.util.find_spec("tensorrt_llm") is not None
        candidate = build_judge(name, args, model=build, backend="trtllm") if trt else \
            build_judge(name, args, model=Path(build) / "checkpoint")
        paths["fastjudge build (" + ("trtllm" if trt else "torch, FP8 checkpoint") + ")"] = candidate
        paths["fastjudge torch"] = fast
    else:
        paths["fastjudge"] = fast
    paths["reference"] = reference_for(fast, args.model, device=device, dtype=dtype,
                                       batch_size=args.reference_batch_size)
    tol = default_tolerance(dtype, build=bool(build))
    tol = Tolerance(args.tolerance if args.tolerance is not None else tol.max_abs,
                    args.min_agreement if args.min_agreement is not None else tol.min_agreement,
                    tol.basis if args.tolerance is None and args.min_agreement is None else "given",
                    tol.generated)
    report = VerifyReport(name, mode_of(name, fast), str(args.model), device, dtype, len(examples), args.seed,
                          dict(max_abs=tol.max_abs, min_agreement=tol.min_agreement, generated=tol.generated,
                               basis=tol.basis))
    results = {}
    for label, path in paths.items():
        bar = Progress(label, len(examples), progress, batched=label == "reference")
        if label == "reference":
            results[label] = path.score(examples, progress=bar)
        else:
            results[label] = score_fastjudge(name, path, examples, bar)
        report.seconds[label] = round(bar.close(), 3)
    candidate = next(iter(paths))
    for other in list(paths)[1:]:
        _add_comparison(report, name, ids, results[candidate], results[other], tol, candidate, other)
    given = given_claims_examples(examples, results["reference"]) if report.mode == "pipeline" else []
    if given:
        # the generated decomposition may diverge (bfloat16); the verification stage is then
        # compared on the same claims: the reference's own, given to both paths
        label = "claims given (the reference's decomposition)"
        sub = [ids[i] for i, _ in given]
        again = {}
        for path_label, path in paths.items():
            bar = Progress(f"{path_label}, {label}", len(given), progress, batched=path_label == "reference")
            chosen = [e for _, e in given]
            again[path_label] = path.score(chosen, progress=bar) if path_label == "reference" else \
                score_fastjudge(name, path, chosen, bar)
            report.seconds[f"{path_label}, claims given"] = round(bar.close(), 3)
        for other in list(paths)[1:]:
            _add_comparison(report, name, sub, again[candidate], again[other], tol, candidate, other, label)
    return report


def _add_comparison(report: VerifyReport, name, ids, ours, theirs, tol, candidate, other, given=None) -> None:
    outputs = compare(name, ids, ours, theirs, tol, report.mode)
    passed = all(o.passed for o in outputs)
    report.comparisons.append(dict(fastjudge=candidate, reference=other, passed=passed, outputs=as_dict(outputs),
                                   **({"claims_given": given} if given else {})))
    report.passed &= passed


def given_claims_examples(examples, reference_results) -> list[tuple[int, object]]:
    """(position, example) of the VisExMEM examples whose claims the reference decomposed,
    each with those claims given (text, type and links as the reference wrote them)."""
    from dataclasses import replace

    from ..judges.visexmem.claims import LINK_FIELDS

    out = []
    for i, (example, r) in enumerate(zip(examples, reference_results)):
        if getattr(example, "claims", None) is None and r.error is None and r.claims:
            claims = [{"part_id": c.part_id, "text": c.text, **({"type": c.type} if c.type else {}),
                       **{f: getattr(c, f) for f in LINK_FIELDS if getattr(c, f)}} for c in r.claims]
            out.append((i, replace(example, claims=claims)))
    return out


# -- printing ------------------------------------------------------------------------------------
def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def format_report(report: VerifyReport) -> str:
    tol = report.tolerance
    lines = [f"fastjudge verify: {report.judge} ({report.mode}) on {Path(report.model).name}, "
             f"{report.items} items, {report.device}, "
             f"{report.dtype}; seconds " + ", ".join(f"{k} {v:.1f}" for k, v in report.seconds.items()),
             "tolerance: " + ("probabilities and scores reported, not checked" if tol["max_abs"] is None else
                              f"|diff| <= {_fmt(tol['max_abs'])} on probabilities and scores")
             + f", >= {tol['min_agreement']:.0%} identical ratings/decisions ({tol['basis']})"]
    generated = [o for c in report.comparisons for o in c["outputs"] if o["kind"] == "generated" and o["units"]]
    if generated:
        lines.append("generated stages (" + ", ".join(dict.fromkeys(o["name"] for o in generated)) + "): "
                     + ("reported with their first divergence, not checked; what follows them is compared "
                        "where they agree" if tol.get("generated") is None else
                        f">= {tol['generated']:.0%} identical"))
    for comp in report.comparisons:
        given = f", {comp['claims_given']}" if comp.get("claims_given") else ""
        lines.append(f"\n{comp['fastjudge']} vs {comp['reference']}{given}: {'PASS' if comp['passed'] else 'FAIL'}")
        for o in comp["outputs"]:
            skipped = f", {o['skipped']} left out: their claim's text or evidence differ" if o.get("skipped") else ""
            if not o["units"]:
                if skipped:
                    lines.append(f"  {o['name']:12} none compared{skipped}")
                continue
            flag = "" if o["passed"] else "   <- outside tolerance"
            note = "" if o.get("checked", True) or o["kind"] == "text" else "  (reported, not checked)"
            if o["kind"] in ("match", "generated", "text"):
                ties = f" (+{o['near_ties']} near-ties)" if o["near_ties"] else ""
                lines.append(f"  {o['name']:12} identical {o['identical']}/{o['units']} "
                             f"({o['identical'] / o['units']:.1%}){ties}{skipped}{note}{flag}")
            else:
                rho = f"  Spearman {_fmt(o['spearman'])}" if o["kind"] == "score" else ""
                lines.append(f"  {o['name']:12} max |diff| {_fmt(o['max_abs'])}  median |diff| "
                             f"{_fmt(o['median_abs'])}{rho}  ({o['units']} compared{skipped}){flag}")
            for w in o["worst"]:
                if "first_divergence" in w:
                    lines.append(f"      {w['id']}: first divergence at {w['first_divergence']}")
                    continue
                diff = f"  |diff| {w['diff']:.3g}" if "diff" in w else ""
                tie = "  (near-tie)" if w.get("near_tie") else ""
                lines.append(f"      {w['id']}: fastjudge {w['fastjudge']!r}  reference {w['reference']!r}{diff}{tie}")
    lines.append(f"\n{'PASS' if report.passed else 'FAIL'}: fastjudge "
                 + ("agrees with the reference within" if report.passed else "differs from the reference outside")
                 + " tolerance")
    return "\n".join(lines)


def add_verify_parser(sub) -> None:
    from ..judges.registry import add_judge_options

    p = sub.add_parser("verify", help="check fastjudge against the reference implementation on a "
                                      "sample of your own items, checkpoint and hardware")
    p.add_argument("--judge", required=True, choices=JUDGE_NAMES)
    p.add_argument("--model", required=True, help="the checkpoint directory (as given to the judge's command)")
    p.add_argument("--input", required=True, help="your items: the judge command's JSONL or Parquet input")
    p.add_argument("--sample", type=int, default=64, help="items drawn from --input (%(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw (%(default)s)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest |difference| of probabilities and scores (default per dtype: "
                        "docs/verification.md)")
    p.add_argument("--min-agreement", type=float, default=None,
                   help="share of ratings/decisions that must be identical (default 1.0; 0.98 with --build)")
    p.add_argument("--build", default=None, help="a `fastjudge build` output: verify it against the "
                                                 "--model checkpoint on the torch backend and the reference")
    p.add_argument("--reference-batch-size", type=int, default=8,
                   help="batch size of the reference path (%(default)s)")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_judge_options(p)


def run_verify_command(args) -> int:
    report = run_verify(args.judge, args, progress=not args.no_progress)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2, default=str))
    return 0 if report.passed else 1
