"""The ``fastjudge`` command in-process: JSONL jobs, malformed input, resumption, checkpoint
errors and the demo, on the tiny random-weight Flan-T5 checkpoint."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import read_rows, write_lines

from fastjudge.cli import main
from fastjudge.judges.registry import LAVE_RESULT_FIELDS

RESULT_KEYS = {"score", "soft_score", "rating", "probs", "rationale", "error"}

VALID = [
    {"id": "q1", "question": "What color is the kite?", "references": ["red", "red", "orange"],
     "prediction": "red"},
    {"id": "q2", "question": "Is the kite flying?",
     "references": [{"answer": "yes", "answer_id": 1}, {"answer": "yes", "answer_id": 2},
                    {"answer": "no", "answer_id": 3}],
     "prediction": "no", "extra": {"keep": [1, 2]}},
    {"id": "q3", "question": "How many dogs are there?", "references": ["2", "two"], "prediction": "3"},
    {"id": 4, "question": "What is on the table?", "references": [{"answer": "cake"}], "prediction": "pie"},
]


def lave(t5_dir, inp, out, *extra):
    return main(["lave", "--model", str(t5_dir), "--input", str(inp), "--output", str(out),
                 "--dtype", "float32", "--device", "cpu", "--no-progress", *extra])


@pytest.fixture
def mixed_input(tmp_path):
    lines = [json.dumps(VALID[0]), json.dumps(VALID[1]),
             '{"id": "broken", "question": "Is it',  # line 3: malformed JSON
             '["an", "array"]',  # line 4: not an object
             "",  # blank lines are skipped
             json.dumps({"id": "empty", "question": "What?", "references": [], "prediction": "x"}),  # line 6
             json.dumps(VALID[2]), json.dumps(VALID[3])]
    return write_lines(tmp_path / "in.jsonl", lines)


def test_lave_mixed_input(t5_dir, mixed_input, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert lave(t5_dir, mixed_input, out) == 3  # exit 3: some rows are item errors
    rows = read_rows(out)
    assert len(rows) == 7  # one per non-blank input line
    by_id = {str(r["id"]): r for r in rows}
    assert len(by_id) == 7
    assert set(by_id) == {"q1", "q2", "q3", "4", "line-3", "line-4", "empty"}

    assert "line 3" in by_id["line-3"]["error"] and "invalid JSON" in by_id["line-3"]["error"]
    assert "line 4" in by_id["line-4"]["error"] and "JSON object" in by_id["line-4"]["error"]
    assert by_id["empty"]["error"].startswith("line 6:")
    assert "references are empty" in by_id["empty"]["error"]
    for key in ("line-3", "line-4", "empty"):
        row = by_id[key]
        assert RESULT_KEYS <= set(row)
        assert row["score"] is None and row["rating"] is None and row["probs"] is None
    assert by_id["empty"]["question"] == "What?"  # invalid items keep their input fields

    scores = []
    for item in VALID:
        row = by_id[str(item["id"])]
        assert RESULT_KEYS <= set(row) and set(LAVE_RESULT_FIELDS) <= set(row)
        for k, v in item.items():
            assert row[k] == v  # input fields carried through unchanged (id type too)
        assert row["error"] is None
        assert row["rating"] in (1, 2, 3)
        assert row["score"] == (row["rating"] - 1) / 2
        assert len(row["probs"]) == 3 and sum(row["probs"]) == pytest.approx(1.0)
        assert row["soft_score"] == pytest.approx(sum(p * s for p, s in zip(row["probs"], (0, 0.5, 1))))
        assert row["rationale"] is None and row["rating_source"] == "choice"
        assert row["prompt_tokens"] > 0
        scores.append(row["score"])

    err = capsys.readouterr().err
    summary = [line for line in err.splitlines() if line.startswith("fastjudge lave:")]
    assert len(summary) == 1, err
    assert "7 items (0 already done)" in summary[0]
    assert "3 errors" in summary[0]
    assert f"mean score {sum(scores) / len(scores):.4f}" in summary[0]
    assert str(out) in summary[0]


def test_lave_matches_library(t5_dir, t5_backend, mixed_input, tmp_path):
    """The CLI scores what LaveJudge scores for the same items."""
    from fastjudge import LaveJudge, VQAExample

    out = tmp_path / "out.jsonl"
    assert lave(t5_dir, mixed_input, out) == 3  # exit 3: some rows are item errors
    by_id = {str(r["id"]): r for r in read_rows(out)}
    results = LaveJudge(t5_backend).score(
        [VQAExample(v["question"], v["references"], v["prediction"]) for v in VALID])
    for item, result in zip(VALID, results):
        row = by_id[str(item["id"])]
        assert row["rating"] == result.rating
        assert row["probs"] == pytest.approx(result.probs, abs=1e-6)


def test_resume(t5_dir, mixed_input, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert lave(t5_dir, mixed_input, out) == 3  # exit 3: some rows are item errors
    first = out.read_bytes()
    rows = read_rows(out)

    # Rerun: nothing to do, file unchanged.
    assert lave(t5_dir, mixed_input, out, "--chunk-size", "2") == 0
    assert out.read_bytes() == first
    assert "0 items (7 already done)" in capsys.readouterr().err

    # Simulate a crash: rows lost, and a partial last line without newline.
    kept = [r for r in rows if str(r["id"]) not in ("q2", "line-4", "4")]
    partial = json.dumps(rows[-1])[:25]
    out.write_text("".join(json.dumps(r) + "\n" for r in kept) + partial, encoding="utf-8")
    capsys.readouterr()
    assert lave(t5_dir, mixed_input, out, "--chunk-size", "2") == 3  # exit 3: some rows are item errors
    err = capsys.readouterr().err
    assert "partial" in err
    assert "3 items (4 already done)" in err

    final = read_rows(out)
    ids = [str(r["id"]) for r in final]
    assert len(ids) == len(set(ids)) == 7
    assert final[:4] == kept  # existing rows untouched, new rows appended
    before = {str(r["id"]): r for r in rows}
    for r in final:
        if r["error"] is None:
            assert r["rating"] == before[str(r["id"])]["rating"]
            assert r["probs"] == pytest.approx(before[str(r["id"])]["probs"], abs=1e-6)
        else:
            assert r["error"] == before[str(r["id"])]["error"]

    # And once more: still nothing new.
    assert lave(t5_dir, mixed_input, out) == 0
    assert [str(r["id"]) for r in read_rows(out)] == ids


def test_items_without_id(t5_dir, tmp_path):
    items = [{k: v for k, v in item.items() if k != "id"} for item in VALID[:3]]
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps(i) for i in items])
    out = tmp_path / "out.jsonl"
    assert lave(t5_dir, inp, out) == 0
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == ["line-1", "line-2", "line-3"]
    by_id = {r["id"]: r for r in rows}
    assert by_id["line-2"]["question"] == items[1]["question"]
    assert lave(t5_dir, inp, out) == 0
    assert len(read_rows(out)) == 3


def test_items_with_null_id_not_duplicated(t5_dir, tmp_path):
    item = dict(VALID[0], id=None)
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps(item)])
    out = tmp_path / "out.jsonl"
    assert lave(t5_dir, inp, out) == 0
    assert lave(t5_dir, inp, out) == 0
    assert len(read_rows(out)) == 1


def test_bad_model_path(tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps(VALID[0])])
    missing = tmp_path / "no-such-model"
    assert lave(missing, inp, tmp_path / "out.jsonl") == 2
    err = capsys.readouterr().err
    assert err.startswith("fastjudge: error:")
    assert str(missing) in err and "not a directory" in err
    assert "Traceback" not in err


def test_model_dir_without_config(tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps(VALID[0])])
    empty = tmp_path / "empty-model"
    empty.mkdir()
    assert lave(empty, inp, tmp_path / "out.jsonl") == 2
    assert "config.json" in capsys.readouterr().err


def test_pickle_checkpoint_refused(t5_dir, tmp_path, capsys):
    model = tmp_path / "pickle-model"
    model.mkdir()
    shutil.copy(t5_dir / "config.json", model / "config.json")
    (model / "pytorch_model.bin").write_bytes(b"not really a pickle, never to be loaded")
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps(VALID[0])])
    assert lave(model, inp, tmp_path / "out.jsonl") == 2
    err = capsys.readouterr().err
    assert "pytorch_model.bin" in err
    assert "pickle" in err and "allow_pickle" in err


def test_bad_demo_file(t5_dir, tmp_path, capsys):
    demos = tmp_path / "demos.json"
    demos.write_text(json.dumps([{"question": "q", "references": ["a"], "prediction": "a",
                                  "output": "7", "explanation": "e"}]))
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps(VALID[0])])
    assert lave(t5_dir, inp, tmp_path / "out.jsonl", "--demos", str(demos)) == 2
    assert "output must be" in capsys.readouterr().err


def test_missing_input_file(t5_dir, tmp_path, capsys):
    assert lave(t5_dir, tmp_path / "absent.jsonl", tmp_path / "out.jsonl") == 2
    assert "absent.jsonl" in capsys.readouterr().err


def test_demo(t5_dir, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FASTJUDGE_CACHE", str(cache))
    assert main(["demo", "--model", str(t5_dir), "--dtype", "float32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert re.match(r"id\s+question\s+prediction\s+rating\s+score\s+P\(1/2/3\)", lines[0])
    rows = [line for line in lines if line.startswith("sample-")]
    assert len(rows) == 40
    for row in rows:
        assert re.search(r"\s[123]\s+(0\.00|0\.50|1\.00)\s+\d\.\d\d/\d\.\d\d/\d\.\d\d$", row), row
    summary = [line for line in lines if "items/s" in line]
    assert len(summary) == 1
    assert re.match(r"40 items, 0 errors, mean score \d\.\d{3}; [\d.]+ items/s, \d+ prompt tokens/s", summary[0])
    assert "score-only" in summary[0] and "float32" in summary[0]
    assert "RANDOM weights" not in out  # a user model was given
    assert not (cache / "random-flan-t5-small-v1").exists()  # no demo model was built


def test_error_rows_have_null_result_fields():
    """docs/jobs.md: an item error's row has its result fields null -- not the empty lists a
    judge's result object carries (VisExMEM's ``claims``, holistic ``probs``); what the judge
    did record (warnings) stays."""
    from fastjudge.io.jobs import result_fields
    from fastjudge.judges.holistic import HolisticResult
    from fastjudge.judges.registry import get_judge
    from fastjudge.judges.visexmem import VisExResult

    row = result_fields(get_judge("visexmem"), VisExResult(index=0, error="bad image", warnings=["box 1 dropped"]))
    assert row == {"score": None, "claims": None, "explanation": None, "warnings": ["box 1 dropped"],
                   "prompt_tokens": None, "error": "bad image"}
    row = result_fields(get_judge("holistic"), HolisticResult(index=0, error="bad image"))
    assert row["probs"] is None and row["error"] == "bad image"
    scored = result_fields(get_judge("visexmem"), VisExResult(index=0, score=0.5))
    assert scored["claims"] == [] and scored["warnings"] == []  # a scored row keeps its fields as they are
