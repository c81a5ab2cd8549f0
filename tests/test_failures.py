"""Fault injection through the public entry points: a system failure (out of memory, a CUDA
error, a backend exception no item explains) is never an item's row or result.

The model is real (the tiny random-weight Flan-T5 of conftest, run by the torch backend); the
faults come from :class:`fastjudge.testing.faults.FaultyBackend`, which raises on chosen calls of
the backend's ``run``: out of memory once, out of memory on every batch above a size, a generic
or CUDA error N times. Every test compares against a clean run of the same items.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import read_rows, write_lines

import fastjudge.backends as backends
from fastjudge import LaveJudge, VQAExample
from fastjudge.cli import main
from fastjudge.engine_options import EngineOptions
from fastjudge.io.jobs import EXIT_ITEM_ERRORS, EXIT_OK, EXIT_SYSTEM_FAILURE, EXIT_TOO_MANY_ERRORS, run_job
from fastjudge.judges.registry import get_judge
from fastjudge.runtime.failures import DEVICE, OTHER, OUT_OF_MEMORY, SystemFailure, classify, prompt_tokens
from fastjudge.testing.faults import CUDA_ERROR, FaultyBackend

BATCH_TOKENS = 1100  # about 4 items per backend call (one-shot prompts of ~265 tokens)
SHOTS = 1  # short prompts keep the tests fast
CPU = ("--device", "cpu", "--dtype", "float32", "--no-progress", "--num-shots", str(SHOTS))
SYSTEM_WORDS = ("out of memory", "cuda error", "fault injected")


def items(n: int) -> list[dict]:
    answers = ["red", "green", "blue", "two", "a cat"]
    return [{"id": f"q{i}", "question": f"What is shown in picture {i}?",
             "references": answers[i % 5: i % 5 + 1 + i % 3], "prediction": answers[(i * 2) % 5]}
            for i in range(n)]


def jsonl_input(path, rows):
    return write_lines(path, [json.dumps(r) for r in rows])


def by_id(rows):
    return {r["id"]: r for r in rows}


def assert_no_system_rows(rows):
    for r in rows:
        assert not any(w in (r.get("error") or "").lower() for w in SYSTEM_WORDS), r


def assert_same_results(got, clean):
    """Same ids, each scored exactly once, the same ratings and scores as the clean run
    (probabilities to float rounding: a split batch sums in another order)."""
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in clean)
    expected = by_id(clean)
    for r in got:
        e = expected[r["id"]]
        assert (r["rating"], r["score"], r["error"]) == (e["rating"], e["score"], e["error"])
        assert r["soft_score"] == pytest.approx(e["soft_score"], abs=1e-5)


@pytest.fixture(scope="module")
def clean_rows(t5_backend, tmp_path_factory):
    """The rows of a fault-free run over 24 items."""
    tmp = tmp_path_factory.mktemp("clean")
    inp, out = jsonl_input(tmp / "in.jsonl", items(24)), tmp / "out.jsonl"
    spec = get_judge("lave")
    code = run_job("lave", spec, lambda: LaveJudge(t5_backend, num_shots=SHOTS,
                                                   engine=EngineOptions(max_batch_tokens=BATCH_TOKENS)),
                   str(inp), str(out), chunk_size=1024, progress=False)
    assert code == EXIT_OK
    return read_rows(out)


def job(backend, inp, out, **options):
    spec = get_judge("lave")
    return run_job("lave", spec, lambda: LaveJudge(backend, num_shots=SHOTS,
                                                   engine=EngineOptions(max_batch_tokens=BATCH_TOKENS)),
                   str(inp), str(out), chunk_size=1024, progress=False, backoff_s=0.01,
                   **options)


# -- classification ----------------------------------------------------------------------------
def test_classify_failures():
    import torch

    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate")) == OUT_OF_MEMORY
    assert classify(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")) == OUT_OF_MEMORY
    assert classify(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory")) \
        == OUT_OF_MEMORY
    assert classify(MemoryError()) == OUT_OF_MEMORY
    assert classify(RuntimeError(CUDA_ERROR)) == DEVICE
    assert classify(RuntimeError("CUDA error: device-side assert triggered")) == DEVICE
    try:  # the cause counts: a wrapper around an out-of-memory error is one
        try:
            raise RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")
        except RuntimeError as inner:
            raise ValueError("batch failed") from inner
    except ValueError as outer:
        assert classify(outer) == OUT_OF_MEMORY
    assert classify(ValueError("bad image")) == OTHER


# -- run_job -------------------------------------------------------------------------------------
def test_oom_once_costs_no_row(t5_backend, clean_rows, tmp_path):
    """The issue's case: one backend call runs out of memory once. Before: every unfinished item
    of the chunk became an error row, exit 0, and a rerun never retried them."""
    faulty = FaultyBackend(t5_backend, oom_on_calls={2})
    inp, out = jsonl_input(tmp_path / "in.jsonl", items(24)), tmp_path / "out.jsonl"
    assert job(faulty, inp, out) == EXIT_OK
    rows = read_rows(out)
    assert_same_results(rows, clean_rows)
    assert faulty.log[1][2] is not None and len(faulty.log) > 2


def test_oom_above_a_size_splits_down(t5_backend, clean_rows, tmp_path):
    """Every batch of more than 2 rows runs out of memory: the batch is halved until it fits."""
    faulty = FaultyBackend(t5_backend, oom_above_rows=2)
    inp, out = jsonl_input(tmp_path / "in.jsonl", items(24)), tmp_path / "out.jsonl"
    assert job(faulty, inp, out) == EXIT_OK
    assert_same_results(read_rows(out), clean_rows)
    ran = [rows for rows, _, fault in faulty.log if fault is None]
    assert max(ran) <= 2 and sum(ran) == 24


def test_item_that_alone_runs_out_of_memory_is_an_item_error(t5_backend, clean_rows, tmp_path):
    """One item's prompt is longer than any batch may be: it alone is an item error naming
    its size; the others score as in the clean run."""
    rows = items(24)
    rows[5]["question"] = "What is shown in this long picture " + "and this " * 60 + "?"
    inp, out = jsonl_input(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    judge = LaveJudge(t5_backend, num_shots=SHOTS)
    tokens = [prompt_tokens(judge, VQAExample(r["question"], r["references"], r["prediction"]))
              for r in rows]
    size, longest_other = tokens[5], max(tokens[:5] + tokens[6:])
    assert size > longest_other
    faulty = FaultyBackend(t5_backend, oom_above_tokens=longest_other)
    assert job(faulty, inp, out) == EXIT_ITEM_ERRORS
    got = by_id(read_rows(out))
    assert len(got) == 24
    assert got["q5"]["error"].startswith(
        f"line 6: out of memory when scored alone ({size} prompt tokens)")
    clean = by_id(clean_rows)
    assert_same_results([r for i, r in got.items() if i != "q5"],
                        [r for i, r in clean.items() if i != "q5"])


def test_transient_errors_are_retried(t5_backend, clean_rows, tmp_path):
    faulty = FaultyBackend(t5_backend, errors=2, errors_from=2)  # two failures, two retries
    inp, out = jsonl_input(tmp_path / "in.jsonl", items(24)), tmp_path / "out.jsonl"
    assert job(faulty, inp, out, retries=2) == EXIT_OK
    assert_same_results(read_rows(out), clean_rows)


@pytest.mark.parametrize("message", [CUDA_ERROR, "backend lost its connection (fault injected)"])
def test_persistent_failure_stops_the_job_and_the_rerun_finishes(t5_backend, clean_rows,
                                                                 tmp_path, capsys, message):
    """A CUDA error, or a generic error on every item alone, after the retries: exit 75, the
    rows finished before it written, the rest not; the same job rerun finishes every item with
    the clean run's results."""
    faulty = FaultyBackend(t5_backend, errors=10**6, errors_from=3, message=message)
    inp, out = jsonl_input(tmp_path / "in.jsonl", items(24)), tmp_path / "out.jsonl"
    assert job(faulty, inp, out, retries=1) == EXIT_SYSTEM_FAILURE
    err = capsys.readouterr().err
    assert "stopped by a system failure" in err and "rerun the same command to resume" in err
    first = read_rows(out)
    assert 0 < len(first) < 24
    assert all(r["error"] is None for r in first)
    assert job(t5_backend, inp, out) == EXIT_OK
    rows = read_rows(out)
    assert rows[:len(first)] == first
    assert_same_results(rows, clean_rows)


class OneBadItem:
    """A judge that raises (a bug some input reaches) whenever the item ``bad`` is in its batch."""

    def __init__(self, judge, bad: str):
        self.judge, self.bad = judge, bad
        self.max_batch_tokens = judge.max_batch_tokens

    def stream(self, examples):
        if any(getattr(e, "id", None) == self.bad for e in examples):
            raise KeyError("an input this judge cannot handle")
        return self.judge.stream(examples)


def test_an_exception_one_item_explains_is_that_items_row(t5_backend, clean_rows, tmp_path):
    spec = get_judge("lave")
    inp, out = jsonl_input(tmp_path / "in.jsonl", items(24)), tmp_path / "out.jsonl"
    code = run_job("lave", spec, lambda: OneBadItem(LaveJudge(t5_backend, num_shots=SHOTS), "q7"), str(inp),
                   str(out), chunk_size=1024, progress=False, backoff_s=0.01)
    assert code == EXIT_ITEM_ERRORS
    got = by_id(read_rows(out))
    assert got["q7"]["error"] == "line 8: KeyError: 'an input this judge cannot handle'"
    assert_same_results([r for i, r in got.items() if i != "q7"],
                        [r for r in clean_rows if r["id"] != "q7"])


# -- the command line ---------------------------------------------------------------------------
@pytest.fixture
def faulty_cli(monkeypatch):
    """``fastjudge lave`` with its backend wrapped in a FaultyBackend built from ``plan``."""
    plan: dict = {}
    real = backends.load_backend

    def load(*args, **kwargs):
        plan["backend"] = FaultyBackend(real(*args, **kwargs), **plan.get("faults", {}))
        return plan["backend"]

    monkeypatch.setattr(backends, "load_backend", load)
    return plan


def lave(model, inp, out, *extra):
    return main(["lave", "--model", str(model), "--input", str(inp), "--output", str(out),
                 "--max-batch-tokens", str(BATCH_TOKENS), *CPU, *extra])


def test_cli_scenario_oom_once_then_rerun(t5_dir, faulty_cli, tmp_path, capsys):
    """The issue's scenario through ``fastjudge lave``: 40 items, one OOM; then the rerun."""
    inp, out = jsonl_input(tmp_path / "in.jsonl", items(40)), tmp_path / "out.jsonl"
    clean = tmp_path / "clean.jsonl"
    assert lave(t5_dir, inp, clean) == EXIT_OK
    faulty_cli["faults"] = {"oom_on_calls": {2}}
    assert lave(t5_dir, inp, out) == EXIT_OK
    assert faulty_cli["backend"].log[1][2] is not None
    err = capsys.readouterr().err
    assert "40 items (0 already done), 0 errors" in err
    assert_same_results(read_rows(out), read_rows(clean))
    faulty_cli["faults"] = {}
    assert lave(t5_dir, inp, out) == EXIT_OK
    assert "0 items (40 already done), 0 errors" in capsys.readouterr().err


def test_cli_exit_codes_and_max_errors(t5_dir, faulty_cli, tmp_path, capsys):
    rows = items(12)
    for r in rows[:3]:
        r["references"] = []  # an item error: no reference answers
    inp = jsonl_input(tmp_path / "in.jsonl", rows)
    assert lave(t5_dir, inp, tmp_path / "a.jsonl") == EXIT_ITEM_ERRORS
    assert "12 items (0 already done), 3 errors" in capsys.readouterr().err
    assert lave(t5_dir, inp, tmp_path / "b.jsonl", "--max-errors", "3") == EXIT_ITEM_ERRORS
    capsys.readouterr()
    assert lave(t5_dir, inp, tmp_path / "c.jsonl", "--max-errors", "2") == EXIT_TOO_MANY_ERRORS
    err = capsys.readouterr().err
    assert "stopped after 3 item errors, more than --max-errors allows (2)" in err
    assert "q0: line 1: invalid example: references are empty" in err
    assert lave(t5_dir, inp, tmp_path / "d.jsonl", "--max-errors", "0.2") == EXIT_TOO_MANY_ERRORS
    assert lave(t5_dir, inp, tmp_path / "e.jsonl", "--max-errors", "0.25") == EXIT_ITEM_ERRORS
    capsys.readouterr()
    with pytest.raises(SystemExit):
        lave(t5_dir, inp, tmp_path / "f.jsonl", "--max-errors", "1.5")
    faulty_cli["faults"] = {"errors": 10**6, "message": CUDA_ERROR}
    assert lave(t5_dir, inp, tmp_path / "g.jsonl", "--retries", "0") == EXIT_SYSTEM_FAILURE
    err = capsys.readouterr().err
    assert "CUDA error" in err and "rerun the same command to resume" in err
    written = read_rows(tmp_path / "g.jsonl")  # the item errors found before any scoring
    assert sorted(r["id"] for r in written) == ["q0", "q1", "q2"]
    assert all("references are empty" in r["error"] for r in written)


def older_output(clean_rows, bad_ids, message="RuntimeError: CUDA out of memory (older run)"):
    """The output an older version wrote: ``bad_ids`` hold error rows."""
    rows = []
    for r in clean_rows:
        if r["id"] in bad_ids:
            r = {**r, **{k: None for k in ("score", "soft_score", "rating", "probs",
                                           "rationale", "rating_source", "prompt_tokens")},
                 "error": f"line {int(r['id'][1:]) + 1}: {message}"}
        rows.append(r)
    return rows


def test_retry_errors_jsonl(t5_dir, clean_rows, tmp_path, capsys):
    inp, out = jsonl_input(tmp_path / "in.jsonl", items(24)), tmp_path / "out.jsonl"
    bad = {"q1", "q2", "q9"}
    write_lines(out, [json.dumps(r) for r in older_output(clean_rows, bad)])
    assert lave(t5_dir, inp, out) == EXIT_OK  # plain resume: all done, nothing retried
    assert sum(bool(r["error"]) for r in read_rows(out)) == 3
    assert lave(t5_dir, inp, out, "--retry-errors") == EXIT_OK
    assert "removed 3 row(s) of 3 item(s) with errors" in capsys.readouterr().err
    rows = read_rows(out)
    assert_same_results(rows, clean_rows)
    assert [r["id"] for r in rows[:21]] == [r["id"] for r in clean_rows if r["id"] not in bad]


def test_retry_errors_parquet_and_an_interrupted_removal(t5_dir, clean_rows, tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    from fastjudge.io.parquet import read_parquet_rows
    from fastjudge.io.retry_errors import JOURNAL

    inp, out = jsonl_input(tmp_path / "in.jsonl", items(24)), tmp_path / "out.parquet"
    assert lave(t5_dir, inp, out) == EXIT_OK
    # turn three rows into older error rows, in place, in a second part file
    rows = read_parquet_rows(out)
    bad = {"q1", "q2", "q9"}
    table = pa.parquet.read_table(out / "part-00000.parquet")
    broken = older_output(rows, bad)
    pa.parquet.write_table(pa.Table.from_pylist(broken[:12], schema=table.schema),
                           out / "part-00000.parquet")
    pa.parquet.write_table(pa.Table.from_pylist(broken[12:], schema=table.schema),
                           out / "part-00001.parquet")
    # an interrupted --retry-errors: the journal names q9, whose row is still there
    (out / JOURNAL).write_text(json.dumps(["q9"]), encoding="utf-8")
    assert lave(t5_dir, inp, out) == EXIT_OK  # finishes the removal, then resumes q9
    assert "finished removing the rows of 1 item(s)" in capsys.readouterr().err
    assert not (out / JOURNAL).exists()
    got = read_parquet_rows(out)
    assert sorted(r["id"] for r in got if r["error"]) == ["q1", "q2"]
    assert lave(t5_dir, inp, out, "--retry-errors") == EXIT_OK
    got = read_parquet_rows(out)
    assert_same_results(got, clean_rows)


# -- the asyncio API ----------------------------------------------------------------------------
def test_async_api_raises_system_failures_and_recovers(t5_backend):
    from fastjudge.runtime.async_batcher import AsyncBatcher

    faulty = FaultyBackend(t5_backend, errors=3, message=CUDA_ERROR)
    batcher = AsyncBatcher(LaveJudge(faulty), max_wait_ms=0, retries=1, backoff_s=0.01)
    examples = [VQAExample(r["question"], r["references"], r["prediction"]) for r in items(3)]

    async def main_():
        with pytest.raises(SystemFailure, match="CUDA error"):
            await batcher.score(examples)
        return await batcher.score(examples)  # call 3 fails, its retry works

    try:
        results = asyncio.run(main_())
    finally:
        batcher.close()
    assert [r.error for r in results] == [None] * 3
    assert batcher.system_failures == 1


# -- the server ---------------------------------------------------------------------------------
def served(judge, **options):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from fastjudge.serve import create_app

    return TestClient(create_app(judge, timeout_s=60, retries=1, **options))


def test_server_answers_503_never_a_reward_and_recovers(t5_backend):
    """A CUDA error on every call: /get_reward, /v1/score (plain and streamed) answer 503 with
    Retry-After, never 200 with reward_on_error; /health counts the failures; once the device
    works again the same requests are scored; one OOM is absorbed by splitting the batch."""
    faulty = FaultyBackend(t5_backend, errors=10**6, message=CUDA_ERROR)
    item = {"question": "What color is the kite?", "references": ["red", "red"],
            "prediction": "red"}
    with served(LaveJudge(faulty), reward_on_error=-7.0) as c:
        assert c.get("/health").json()["system_failures"] == 0
        r = c.post("/get_reward", json={"query": [json.dumps(item)] * 3})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert "CUDA error" in r.json()["error"] and "rewards" not in r.json()
        r = c.post("/v1/score", json={"items": [item, item]})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        lines = c.post("/v1/score?stream=1", json={"items": [item]}).text.splitlines()
        assert len(lines) == 1 and "CUDA error" in json.loads(lines[0])["error"]
        health = c.get("/health").json()
        assert health["status"] == "ok" and health["system_failures"] == 3
        assert "CUDA error" in health["last_system_failure"]["error"]
        assert c.get("/metrics").text.count('status="503"') >= 1

        faulty.errors = 0  # the device recovers
        r = c.post("/get_reward", json={"query": [json.dumps(item)] * 3})
        assert r.status_code == 200 and r.json()["errors"] == [None] * 3
        assert -7.0 not in r.json()["rewards"]
        expected = LaveJudge(t5_backend).score([VQAExample(item["question"], item["references"],
                                                           item["prediction"])])[0].score
        assert r.json()["rewards"] == [expected] * 3

        faulty.oom_on_calls = {faulty.calls + 1}  # the next call runs out of memory once
        r = c.post("/v1/score", json={"items": [item, item]})
        assert r.status_code == 200
        assert [x["score"] for x in r.json()["results"]] == [expected] * 2
        assert c.get("/health").json()["system_failures"] == 3


def test_openai_route_answers_an_openai_503(vl_dir):
    """/v1/chat/completions: the error object the openai client reads (``InternalServerError``
    after its retries, which wait Retry-After), then a normal completion."""
    real = backends.load_backend(str(vl_dir), EngineOptions(device="cpu", dtype="float32"))
    faulty = FaultyBackend(real, errors=10**6, message=CUDA_ERROR)
    body = {"model": "judge", "max_tokens": 3,
            "messages": [{"role": "user", "content": "Is 'ski' right for 'skiing'?"}]}
    with served(LaveJudge(faulty)) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "service_unavailable"
        assert "CUDA error" in error["message"] and error["param"] is None
        faulty.errors = 0
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


# -- Ray -----------------------------------------------------------------------------------------
def test_ray_rescore_oom_and_a_dead_device(t5_dir, clean_rows, tmp_path):
    """Each Ray actor builds its judge on a FaultyBackend (the fault plan travels with the
    judge's factory): an OOM once costs no row; a CUDA error on every call stops the job with
    exit 75 and no error row; the rerun without faults finishes with the clean run's results."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    from functools import partial

    from fastjudge.io.ray_pool import RayPool
    from fastjudge.testing.faults import faulty_lave_judge

    inp = jsonl_input(tmp_path / "in.jsonl", items(24))
    spec = get_judge("lave")
    pool = RayPool(workers=1, cpus_per_worker=1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        def rescore(out, **faults):
            build = partial(faulty_lave_judge, str(t5_dir), faults,
                            {"device": "cpu", "dtype": "float32",
                             "max_batch_tokens": BATCH_TOKENS, "num_shots": SHOTS})
            return run_job("rescore", spec, build, str(inp), str(out), chunk_size=8,
                           progress=False, pool=pool, backoff_s=0.01, retries=1)

        once = tmp_path / "once.jsonl"
        assert rescore(once, oom_on_calls={2}) == EXIT_OK
        assert_same_results(read_rows(once), clean_rows)

        dead = tmp_path / "dead.jsonl"
        assert rescore(dead, errors=10**6, errors_from=2, message=CUDA_ERROR) == \
            EXIT_SYSTEM_FAILURE
        first = read_rows(dead)
        assert_no_system_rows(first)
        assert len(first) < 24
        assert rescore(dead) == EXIT_OK
        assert_same_results(read_rows(dead), clean_rows)
    finally:
        ray.shutdown()
