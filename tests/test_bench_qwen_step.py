"""``benchmarks/bench_qwen_step.py`` on the tiny Qwen3.5: it reaches the engine's decoding step (not
the tensor ops), times both contexts and the whole step, and prints a row per row count. No
figure is checked against a threshold."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_qwen_step  # noqa: E402

from fastjudge import _engine  # noqa: E402


def test_engine_time_counts_only_inside_the_step():
    """The timing hook restores ``EngineStep.__call__`` and ``EngineStep.run_picks`` and adds
    only what runs inside them."""
    step = bench_qwen_step.EngineStep
    call, run = step.__call__, step.run_picks
    with bench_qwen_step.engine_time() as spent:
        assert step.__call__ is not call and step.run_picks is not run
    assert step.__call__ is call and step.run_picks is run and spent == [0.0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quick_run_prints_each_row_count(dtype, capsys, monkeypatch):
    if dtype == "bfloat16" and not _engine.bf16_dense_available():
        pytest.skip("the engine's bfloat16 step needs AVX512-BF16")
    totals, timed = [], bench_qwen_step.engine_time

    @contextmanager
    def recorded():
        with timed() as spent:
            yield spent
        totals.append(spent[0])

    monkeypatch.setattr(bench_qwen_step, "engine_time", recorded)
    args = ["--shape", "tiny", "--dtype", dtype, "--rows", "1", "3", "--cached", "40", "--calls", "3",
            "--new-tokens", "4", "--repeats", "1"]
    assert bench_qwen_step.main(args) == 0
    assert max(totals) > 0  # the judge's own decoding steps went through the engine
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split() for line in lines if line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "3"]
    for r in rows:
        engine, bound, short, whole = float(r[1]), float(r[2]), float(r[5]), float(r[7])
        # timings, not thresholds: the whole step and its host share are differences of two
        # short runs' medians, which noise can bring to 0 at this size
        assert engine > 0 and bound > 0 and short > 0 and whole >= 0 and r[3] in ("memory", "compute")
        assert r[8].endswith("%") and float(r[8].rstrip("%")) >= 0
