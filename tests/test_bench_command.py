"""``fastjudge bench`` in-process on the tiny random-weight checkpoints: the JSON report's
fields and counts for each judge, token counts checked against the judges' own, the items it
makes, and bad arguments and checkpoints as one error line with exit status 2."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from fastjudge import LaveJudge
from fastjudge.bench.items import bench_items
from fastjudge.bench.meter import counter_change
from fastjudge.cli import main

TOP_FIELDS = {"judge", "model", "backend", "device", "device_name", "dtype", "threads", "data",
              "seed", "image_size", "items", "chunk_size", "warmup_runs", "warmup_items",
              "peak_memory_kind", "fastjudge_version", "torch_version", "compile_seconds", "runs"}
RUN_FIELDS = {"batch_tokens", "items", "errors", "seconds", "items_per_s", "prompt_tokens",
              "prompt_tokens_per_s", "generated_tokens", "generated_tokens_per_s",
              "tokens_computed", "decode_stats", "batches", "model_seconds", "batch_latency_p50_ms",
              "batch_latency_p99_ms", "peak_memory_bytes"}
# text budgets of the image judges' written stages: random weights write to the limit
SHORT = ["--max-claims", "1", "--max-claim-chars", "4", "--no-explain"]


def bench(model, judge, tmp_path, *extra):
    """Run the command; (exit status, the JSON report or None)."""
    out = tmp_path / f"{judge}.json"
    status = main(["bench", "--judge", judge, "--model", str(model), "--device", "cpu",
                   "--dtype", "float32", "--no-progress", "--json", str(out), *extra])
    return status, (json.loads(out.read_text()) if out.exists() else None)


def check_report(report, judge, items):
    assert set(report) == TOP_FIELDS
    assert report["judge"] == judge and report["items"] == items
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["device_name"] and report["threads"] >= 1
    assert report["peak_memory_kind"] == "cpu_peak_rss"
    for run in report["runs"]:
        assert set(run) == RUN_FIELDS
        assert run["items"] == items and run["errors"] == 0
        assert run["batches"] >= 1 and run["prompt_tokens"] > 0
        for rate in ("items_per_s", "prompt_tokens_per_s"):
            assert run[rate] > 0
        assert 0 < run["model_seconds"] <= run["seconds"]
        assert 0 < run["batch_latency_p50_ms"] <= run["batch_latency_p99_ms"]
        assert run["peak_memory_bytes"] > 0


def test_lave_runs_each_budget_and_counts_prompt_tokens(t5_dir, t5_backend, tmp_path, capsys):
    status, report = bench(t5_dir, "lave", tmp_path, "--items", "6", "--num-shots", "1",
                           "--batch-tokens", "256", "4096", "--warmup", "1", "--warmup-items", "2")
    assert status == 0
    check_report(report, "lave", 6)
    assert report["data"] == "bundled" and report["image_size"] is None
    small, large = report["runs"]
    assert (small["batch_tokens"], large["batch_tokens"]) == (256, 4096)
    # the judge's own per-item counts of the same items (score-only: nothing is generated)
    judged = LaveJudge(t5_backend, num_shots=1).score(bench_items("lave", 6, "bundled", 0))
    for run in (small, large):
        assert run["prompt_tokens"] == sum(r.prompt_tokens for r in judged)
        assert run["generated_tokens"] == 0 and run["generated_tokens_per_s"] == 0
        assert run["tokens_computed"] is None  # the T5 backend keeps no counter
    # every prompt is longer than 256 tokens, so that budget runs each request alone
    assert min(r.prompt_tokens for r in judged) > 256
    assert small["batches"] == 6 and large["batches"] < 6
    printed = capsys.readouterr().out
    assert "items/s" in printed and "prompt tok/s" in printed and "p99 ms" in printed
    assert printed.count("\n") == 3 + 1 + 2  # 3 header lines, the column heads, 2 runs


def test_lave_rationale_counts_generated_tokens(t5_dir, tmp_path):
    status, report = bench(t5_dir, "lave", tmp_path, "--items", "3", "--num-shots", "1", "--rationale",
                           "--max-new-tokens", "4", "--warmup", "0", "--data", "synthetic")
    assert status == 0
    check_report(report, "lave", 3)
    [run] = report["runs"]
    assert 0 < run["generated_tokens"] <= 3 * 4
    assert run["generated_tokens_per_s"] > 0


def test_lave_on_qwen_reads_the_backend_counter(vl_dir, tmp_path):
    status, report = bench(vl_dir, "lave", tmp_path, "--items", "4", "--num-shots", "1",
                           "--warmup", "0")
    assert status == 0
    check_report(report, "lave", 4)
    [run] = report["runs"]
    # the demonstrations prefix runs once for all items, so fewer tokens are computed than the
    # prompts hold
    assert 0 < run["tokens_computed"] < run["prompt_tokens"]


def test_holistic_runs_find_nothing_cached(vl_dir, tmp_path):
    status, report = bench(vl_dir, "holistic", tmp_path, "--items", "3", "--image-size", "48x40",
                           "--warmup", "1", "--warmup-items", "1", "--batch-tokens", "4096", "8192")
    assert status == 0
    check_report(report, "holistic", 3)
    assert report["image_size"] == [48, 40]
    first, second = report["runs"]
    assert first["generated_tokens"] == 0 and first["tokens_computed"] > 0
    # the second run judges the same captions over new pictures: the same prompts, and every
    # token computed again (a cached image prefix state would have spared some)
    assert second["prompt_tokens"] == first["prompt_tokens"]
    assert second["tokens_computed"] == first["tokens_computed"]


def test_visexmem_generates(vl_dir, tmp_path):
    status, report = bench(vl_dir, "visexmem", tmp_path, "--items", "1", "--image-size", "48x40",
                           "--warmup", "0", "--data", "synthetic", *SHORT)
    assert status == 0
    check_report(report, "visexmem", 1)
    [run] = report["runs"]
    # decomposition (JSON under its grammar) writes; the evidence and verify stages read
    assert run["generated_tokens"] > 0 and run["generated_tokens_per_s"] > 0
    assert run["batches"] >= 3 and run["tokens_computed"] > run["generated_tokens"]
    assert run["decode_stats"] is None or min(run["decode_stats"].values()) >= 0


def test_counter_change():
    assert counter_change(None, None) is None
    assert counter_change({"a": 5, "b": 1}, {"a": 9, "b": 1, "new": 2, "name": "x"}) == \
        {"a": 4, "b": 0, "new": 2}
    assert counter_change(None, {"a": 3}) == {"a": 3}


@pytest.mark.parametrize("judge, model, message", [
    ("lave", "missing", "not a directory"),
    ("lave", "empty", "no config.json"),
    ("holistic", "t5", "vision-language"),
])
def test_bad_model_is_one_error_line(judge, model, message, t5_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    path = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "t5": t5_dir}[model]
    status, report = bench(path, judge, tmp_path, "--items", "2")
    assert status == 2 and report is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fastjudge: error:") and message in err[0]


@pytest.mark.parametrize("extra, message", [(["--items", "0"], "--items must be >= 1"),
                                            (["--batch-tokens", "0"], "--batch-tokens must be >= 1"),
                                            (["--warmup", "-1"], "--warmup")])
def test_bad_numbers_are_refused_before_loading(extra, message, tmp_path, capsys):
    status, report = bench(tmp_path / "never-opened", "lave", tmp_path, *extra)
    assert status == 2 and report is None
    assert message in capsys.readouterr().err


def test_items_cycle_and_are_distinct():
    items = bench_items("lave", 85, "bundled", 0)
    assert len(items) == 85 and len({e.id for e in items}) == 85
    assert items[0].question == items[40].question == items[80].question
    synthetic = bench_items("lave", 5, "synthetic", 3)
    assert [e.question for e in synthetic] == [e.question for e in bench_items("lave", 5, "synthetic", 3)]
    assert [e.id for e in bench_items("lave", 2, "synthetic", 3, start=5)] == ["syn-5", "syn-6"]


@pytest.mark.parametrize("source", ["bundled", "synthetic"])
def test_pictures_are_drawn_per_item(source):
    first = bench_items("holistic", 3, source, 0, size=(40, 30))
    again = bench_items("holistic", 3, source, 0, size=(40, 30))
    later = bench_items("visexmem", 2, source, 0, start=3, size=(40, 30))
    pictures = [e.image for e in first + later]
    assert len(set(pictures)) == 5  # no two items share an image (no cache hits between them)
    assert pictures[:3] == [e.image for e in again]  # deterministic
    assert bench_items("holistic", 1, source, 1, size=(40, 30))[0].image != pictures[0]
    redrawn = bench_items("holistic", 3, source, 0, size=(40, 30), picture_round=1)
    assert [e.text for e in redrawn] == [e.text for e in first]
    assert not {e.image for e in redrawn} & set(pictures)
    for e in first:
        with Image.open(io.BytesIO(e.image)) as im:
            assert im.format == "PNG" and im.size == (40, 30)
        assert e.text.strip()
    if source == "synthetic":
        assert all(e.text.startswith("A ") for e in first)
