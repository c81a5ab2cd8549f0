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
