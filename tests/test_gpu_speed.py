"""The GPU check's speed stage (benchmarks/gpu_speed.py) in its dry run on the CPU: it runs the
side-by-side benchmarks as separate processes with ``--device cpu``, keeps their result lines,
writes their logs, and skips the official-LAVE benchmark where no checkout of the authors'
repository is given; and the benchmarks' ``--device`` refuses CUDA where there is none."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_speed  # noqa: E402
from bench_device import bench_device  # noqa: E402


def test_dry_run_runs_the_benchmarks_and_skips_lave_without_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("FASTJUDGE_LAVE_REPO", raising=False)
    # the holistic benchmark (the quickest) and the official-LAVE one, which must be skipped
    monkeypatch.setattr(gpu_speed, "BENCHMARKS", tuple(b for b in gpu_speed.BENCHMARKS if b[0] != "visexmem_e2e"))
    rows, report = [], {}
    gpu_speed.run_speed(True, 240.0, tmp_path, None, rows, report)
    holistic = report["speed"]["holistic"]
    assert holistic["returncode"] == 0, (tmp_path / "speed_holistic.log").read_text()[-3000:]
    assert "--device cpu" in holistic["command"]
    shown = "\n".join(holistic["results"])
    assert "capt/img" in shown and "x " in shown and "max rel dP:" not in shown
    assert (tmp_path / "speed_holistic.log").stat().st_size > 0
    assert "checkout" in report["speed"]["lave_official"]["skipped"]
    assert [r[0] for r in rows if r[0]] == ["speed compiled", "speed holistic", "speed lave_official"]


def test_result_lines_keep_results_and_drop_legends():
    out = ("loading...\n  decompose   0.7   0.3   2.68x\nratio: transformers seconds / fastjudge seconds\n"
           "ratio 2.20x (target 4x); identical scores 16/16\nmax rel dP: largest difference\n")
    assert gpu_speed.result_lines(out) == ["  decompose   0.7   0.3   2.68x",
                                           "ratio 2.20x (target 4x); identical scores 16/16"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_device_cuda_without_cuda_is_a_clear_exit():
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench_device("cuda")
    assert bench_device("cpu").type == "cpu"


ROOT = Path(__file__).resolve().parents[1]
QUICK_STAGES = ["setup", "verify", "kernels", "compiled", "speed", "roofline", "trtllm"]


def _caps(mode: str, stage: str) -> tuple[int, int]:
    """gpu_check.sh's own ``caps`` function, run by bash."""
    import subprocess

    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    body = script[script.index("caps() {"):]
    body = body[:body.index("\n}\n") + 3]
    out = subprocess.run(["bash", "-c", body + f'caps {mode} {stage}'], capture_output=True, text=True, check=True)
    cap, est = out.stdout.split()
    return int(cap), int(est)


def test_quick_gpu_check_fits_seven_minutes_in_the_order_of_what_it_proves():
    """Every stage of a quick GPU run has a cap, the caps add up to at most 7 minutes (420 s,
    installs included), every estimate is within its cap, and the script runs the stages in the
    documented order."""
    caps = {s: _caps("quick", s) for s in QUICK_STAGES}
    assert all(cap > 0 and 0 < est <= cap for cap, est in caps.values()), caps
    assert sum(cap for cap, _ in caps.values()) <= 420
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    import re

    order = [m.group(1) for m in re.finditer(r"^\s*(?:\S+=\S+ )*(?:stage|skip) (\w+)", script, re.M)]
    seen = [s for i, s in enumerate(order) if s in QUICK_STAGES and s not in order[:i]]
    assert seen == QUICK_STAGES


def test_graph_watch_sees_a_skipped_cuda_graph():
    """bench_compiled's ``--cuda-graph-report`` fails a run in which inductor skipped a CUDA graph:
    the message inductor logs (``torch/_inductor/cudagraph_utils.py``,
    ``log_cudagraph_skip_and_bump_counter``) is caught, and its counter read."""
    import bench_compiled
    import torch._logging
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_utils

    original = torch.cuda.CUDAGraph.replay
    counters["inductor"].pop("cudagraph_skips", None)
    try:
        watch = bench_compiled.GraphWatch()
        assert watch.skipped() == 0 and watch.replays == 0
        cudagraph_utils.log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (test)")
        assert watch.skipped() == 1 and "mutated inputs" in watch.skip_messages[0]
    finally:
        torch.cuda.CUDAGraph.replay = original
        torch._logging.set_logs()
        counters["inductor"].pop("cudagraph_skips", None)
