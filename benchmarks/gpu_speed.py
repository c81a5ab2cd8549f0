"""The speed targets of the side-by-side benchmarks, run on the GPU by ``gpu_check.py``.

Each benchmark runs fastjudge and its baseline in one process on the same device
(``--device cuda``; float32 without TF32) and checks that both give the same outputs:

* ``bench_compiled.py``: the Qwen decoding step compiled (CUDA graphs per shape bucket) against
  eager: tokens/s, host syncs and aten ops per step, compile time, identical outputs;
* ``bench_visexmem_e2e.py``: all five VisExMEM stages against transformers + xgrammar
  (targets: >= 5x items/s; >= 2x on decomposition from jump-forward alone);
* ``bench_holistic.py``: VQAScore against t2v_metrics' per-sample path (target: >= 10x pairs/s);
* ``bench_lave_official.py``: the authors' LAVE, rationale mode, against their ``generate``
  path (target: >= 4x), only where a checkout of the authors' repository is given
  (``--lave-repo`` or ``$FASTJUDGE_LAVE_REPO``): its code and demonstrations are the user's.

Sizes are chosen to finish within the stage's share of the check's budget on one GPU; a dry
run does the same on the CPU with the smallest sizes. Each benchmark's whole output goes to
``OUT_DIR/speed_NAME.log``; the table and the JSON report keep its result lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name, script, arguments on the GPU, arguments in a dry run (CPU); the quickest first, so the
# end-to-end benchmark, last, gets the time they leave
BENCHMARKS = (
    ("compiled", "bench_compiled.py",
     ["--shape", "mini", "--rows", "1", "16", "64", "--repeats", "3"],
     ["--shape", "tiny", "--rows", "2", "--max-new-tokens", "12", "--repeats", "1"]),
    ("holistic", "bench_holistic.py",
     ["--shapes", "mini", "--pairs", "32", "--captions", "4", "1", "--repeats", "2"],
     ["--shapes", "tiny", "--pairs", "4", "--captions", "4", "1", "--repeats", "1"]),
    ("lave_official", "bench_lave_official.py",
     ["--items", "32", "--repeats", "2"],
     ["--shape", "tiny", "--items", "2", "--repeats", "1"]),
    ("visexmem_e2e", "bench_visexmem_e2e.py",
     ["--shapes", "mini", "--items", "8", "--repeats", "2", "--jump-forward", "both"],
     ["--shapes", "tiny", "--items", "1", "--repeats", "1", "--jump-forward", "both"]),
)
# The quick GPU check (``gpu_check.sh`` without ``--full``): the compiled steps have a stage of
# their own there, so only these run, at sizes for about a minute in all on one GPU (estimates:
# no GPU has run them yet).
QUICK_GPU_ARGS = {
    "holistic": ["--shapes", "mini", "--pairs", "16", "--captions", "4", "--repeats", "1"],
    "visexmem_e2e": ["--shapes", "mini", "--items", "4", "--repeats", "1", "--jump-forward", "both"],
}
# ... and on the CPU, for its dry run: the smallest inputs that still run every stage.
QUICK_DRY_ARGS = {
    "holistic": ["--shapes", "tiny", "--pairs", "2", "--captions", "1", "--repeats", "1", "--size", "224x168"],
    "visexmem_e2e": ["--shapes", "tiny", "--items", "1", "--repeats", "1", "--jump-forward", "on",
                     "--size", "224x168", "--max-claims", "2", "--max-claim-chars", "12",
                     "--max-explanation-chars", "12"],
}
# the lines of a benchmark's output that carry its result
RESULT_LINE = re.compile(r"^(json|text) |ratio|PASS|FAIL|IDENTICAL|MISMATCH|identical|jump-forward alone|items/s"
                         r"|^\s*(tiny|mini|small|decompose|total)\s")
LEGEND = re.compile(r"^(ratio|max rel dP):")  # the tables' explanations, not results


def result_lines(output: str, limit: int = 30) -> list[str]:
    return [line.rstrip() for line in output.splitlines()
            if RESULT_LINE.search(line) and not LEGEND.match(line)][:limit]


def _text(out) -> str:
    """A timed-out run's captured output (bytes even under ``text=True`` on some Pythons)."""
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def run_speed(dry: bool, seconds: float, out_dir: Path, lave_repo: str | None, rows: list, report: dict,
              quick: bool = False) -> None:
    """Run the benchmarks in turn within ``seconds`` in all; each gets an equal share of what
    is left when it starts. ``quick``: only :data:`QUICK_GPU_ARGS`' benchmarks, at those sizes
    on the GPU (the dry run's sizes on the CPU)."""
    lave_repo = lave_repo or os.environ.get("FASTJUDGE_LAVE_REPO")
    device = ["--device", "cpu" if dry else "cuda"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    deadline = time.perf_counter() + seconds
    results = report.setdefault("speed", {})
    todo = [b for b in BENCHMARKS if not quick or b[0] in QUICK_GPU_ARGS]
    while todo:
        name, script, gpu_args, dry_args = todo.pop(0)
        if quick:
            gpu_args, dry_args = QUICK_GPU_ARGS[name], QUICK_DRY_ARGS[name]
        args = [*(dry_args if dry else gpu_args), *device]
        if name == "lave_official":
            if not lave_repo:
                results[name] = {"skipped": "no checkout of the LAVE authors' repository "
                                            "(--lave-repo or $FASTJUDGE_LAVE_REPO)"}
                rows.append((f"speed {name}", "skipped", results[name]["skipped"]))
                continue
            args += ["--official-repo", lave_repo]
        share = (deadline - time.perf_counter()) / (len(todo) + 1)
        cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(20.0, share))
            output, code = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:  # what it printed so far, stderr too
            output, code = _text(e.stdout) + _text(e.stderr), None
        (out_dir / f"speed_{name}.log").write_text(output)
        lines = result_lines(output)
        r = {"command": " ".join(["python", f"benchmarks/{script}", *args]), "returncode": code,
             "seconds": time.perf_counter() - t0, "results": lines}
        if code is None:
            r["timed_out"] = f"after {max(20.0, share):.0f} s"
        results[name] = r
        summary = "timed out" if code is None else ("ok" if code == 0 else f"exit {code}")
        rows.append((f"speed {name}", f"{summary} ({r['seconds']:.0f} s)", "" if lines else "(no result line)"))
        rows += [("", "", line.strip()) for line in lines[:12]]
