"""`fastjudge rescore` on evaluation-harness outputs (python/fastjudge/io/harness_formats.py).

Layouts, transcribed from the upstream writers:
- lmms-eval: the sample is built in ``lmms_eval/evaluator.py`` ``evaluate`` (``doc_id``, ``doc``
  without multimodal values, ``target``, ``arguments``, ``resps``, ``filtered_resps``, metrics)
  and written by ``lmms_eval/loggers/evaluation_tracker.py``
  ``EvaluationTracker.save_results_samples`` to one ``*_samples_<task>.jsonl`` per task. The
  current writer sets ``input = arguments[0]`` (the prompt text), unwraps single-request
  ``resps`` / ``filtered_resps``, drops ``resps`` when equal to ``filtered_resps``, writes
  ``target`` as ``str(target)`` and drops ``arguments`` and ``doc``; older files keep ``doc``.
- VLMEvalKit inference: ``<model>_<dataset>.tsv`` / ``.xlsx`` with columns ``index``,
  ``question``, ``answer``, ``prediction``; a VQA ``answer`` may be a Python list literal,
  parsed upstream in ``vlmeval/dataset/utils/vqa_eval.py`` ``process_line`` (when the cell's
  type test says it is a list: ``ast.literal_eval`` in current versions, ``eval`` in older
  ones; otherwise ``[answer]``). We parse with ``ast.literal_eval`` only.
"""

from __future__ import annotations

import csv
import json

import pytest
from test_cli import read_rows

from fastjudge.cli import main
from fastjudge.io.harness_formats import detect_format

MODEL = ("--dtype", "float32", "--device", "cpu", "--no-progress")


def rescore(model, inp, out, *extra):
    return main(["rescore", "--judge", "lave", "--model", str(model), "--input", str(inp),
                 "--output", str(out), *MODEL, *extra])


def lmms_record(doc_id, question, answers, resp):
    return {"doc_id": doc_id, "doc": {"question": question, "answers": answers},
            "target": answers[0] if answers else "", "arguments": [[question, {}]],
            "resps": [[resp]], "filtered_resps": [resp], "exact_match": 0.0}


def test_lmms_eval_samples_end_to_end(t5_dir, tmp_path):
    path = tmp_path / "20240101_samples_vqav2.jsonl"
    recs = [lmms_record(0, "What color is the bus?", ["red", "red", "orange"], "red"),
            lmms_record(1, "How many dogs?", ["2"], ["two"]),  # nested response: flattened
            {"doc_id": 2, "doc": {"question": "Why?"}, "resps": [], "filtered_resps": []}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n{not json\n")
    assert detect_format(str(path)) == "lmms-eval"
    plain = tmp_path / "logged.jsonl"  # detected by its first record, whatever the name
    plain.write_text(path.read_text())
    assert detect_format(str(plain)) == "lmms-eval"
    ours = tmp_path / "my_samples_1.jsonl"  # our own layout under such a name stays ours
    ours.write_text(json.dumps({"id": "a", "question": "q", "references": ["x"],
                                "prediction": "x"}) + "\n")
    assert detect_format(str(ours)) == "jsonl"
    out = tmp_path / "out.jsonl"
    assert rescore(t5_dir, path, out) == 0
    by_id = {str(r["id"]): r for r in read_rows(out)}
    assert by_id["0"]["question"] == "What color is the bus?"
    assert by_id["0"]["references"] == ["red", "red", "orange"]
    assert by_id["0"]["prediction"] == "red"
    assert by_id["0"]["error"] is None and by_id["0"]["soft_score"] is not None
    assert by_id["1"]["prediction"] == "two"
    assert "no response" in by_id["line-3"]["error"]
    assert "line 4" in by_id["line-4"]["error"]


def test_lmms_eval_current_writer_layout(t5_dir, tmp_path):
    """A line as today's ``save_results_samples`` writes it: no ``doc``, no ``resps`` (equal to
    ``filtered_resps``, which is unwrapped to a string), ``target`` stringified from a list."""
    path = tmp_path / "20261201_samples_textvqa_val.jsonl"
    recs = [{"doc_id": 7, "target": str(["red", "red", "orange"]), "filtered_resps": "red",
             "doc_hash": "ab", "exact_match": 1.0,
             "input": "What color is the bus?\nReply with a short phrase."},
            {"doc_id": 8, "target": "2", "filtered_resps": "two", "input": ""}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert detect_format(str(path)) == "lmms-eval"
    out = tmp_path / "out.jsonl"
    assert rescore(t5_dir, path, out) == 0
    by_id = {str(r["id"]): r for r in read_rows(out)}
    assert by_id["7"]["question"] == "What color is the bus?"
    assert by_id["7"]["references"] == ["red", "red", "orange"]
    assert by_id["7"]["prediction"] == "red" and by_id["7"]["error"] is None
    assert "no question" in by_id["line-2"]["error"]


def write_tsv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["index", "question", "answer", "prediction", "category"])
        w.writerows(rows)


def test_vlmevalkit_tsv_references_and_literal_safety(t5_dir, tmp_path):
    path = tmp_path / "Model_TextVQA_VAL.tsv"
    marker = tmp_path / "pwned"
    write_tsv(path, [
        [10, "What brand?", "['nike', 'Nike shoes']", "nike", "vqa"],
        [11, "What year?", "1999", "1999", "vqa"],
        [12, "Evil?", f"__import__('os').system('touch {marker}')", "no", "vqa"],
        [13, "Evil list?", f"[__import__('os').system('touch {marker}')]", "no", "vqa"],
        [14, "No prediction?", "x", "", "vqa"],
    ])
    assert detect_format(str(path)) == "vlmevalkit"
    out = tmp_path / "out.jsonl"
    assert rescore(t5_dir, path, out) == 0
    by_id = {str(r["id"]): r for r in read_rows(out)}
    assert by_id["10"]["references"] == ["nike", "Nike shoes"]
    assert by_id["10"]["question"] == "What brand?" and by_id["10"]["prediction"] == "nike"
    assert by_id["11"]["references"] == ["1999"]
    assert by_id["12"]["references"] == [f"__import__('os').system('touch {marker}')"]
    assert by_id["13"]["references"] == [f"[__import__('os').system('touch {marker}')]"]
    assert not marker.exists()
    assert len(by_id) == 5


def test_vlmevalkit_xlsx(t5_dir, tmp_path):
    openpyxl = pytest.importorskip("openpyxl")
    path = tmp_path / "Model_OK-VQA.xlsx"
    book = openpyxl.Workbook()
    sheet = book.active
    sheet.append(["index", "question", "answer", "prediction"])
    sheet.append([1, "What sport?", "['tennis', 'tennis match']", "tennis"])
    book.save(path)
    out = tmp_path / "out.jsonl"
    assert rescore(t5_dir, path, out) == 0
    (row,) = read_rows(out)
    assert str(row["id"]) == "1" and row["references"] == ["tennis", "tennis match"]
