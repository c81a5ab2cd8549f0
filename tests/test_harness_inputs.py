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
    assert rescore(t5_dir, path, out) == 3  # exit 3: a row is an item error
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
    assert rescore(t5_dir, path, out) == 3  # exit 3: a row is an item error
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


# -- VLMEvalKit .json predictions (PRED_FORMAT=json) and one index type ----------------------------
class NumpyEncoder(json.JSONEncoder):
    """``vlmeval/smp/file.py`` ``NumpyEncoder``: numpy scalars as Python numbers."""

    def default(self, obj):
        import numpy as np

        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        if isinstance(obj, np.ndarray):
            return obj.tolist()
        return json.JSONEncoder.default(self, obj)


def test_vlmevalkit_json_and_index_type_across_formats(t5_dir, tmp_path):
    """The prediction file as VLMEvalKit writes it (open-compass/VLMEvalKit commit
    e8e78f05f3080fe28154f2130321f17951c3be94, ``vlmeval/smp/file.py``): ``dump`` picks the
    writer by suffix (``get_pred_file_path`` with ``PRED_FORMAT``): ``dump_json`` is
    ``json.dump(df.to_dict('records'), indent=4, ensure_ascii=False, cls=NumpyEncoder)``,
    ``dump_tsv`` ``df.to_csv(sep='\\t', index=False, quoting=csv.QUOTE_ALL)``, ``dump_xlsx``
    ``df.to_excel(index=False)``. A missing answer is pandas' NaN."""
    pd = pytest.importorskip("pandas")
    pytest.importorskip("openpyxl")
    frame = pd.DataFrame({"index": [3, 4, 5],
                          "question": ["What sport?", "What color?", "How many?"],
                          "answer": ["['tennis', 'tennis match']", "red", float("nan")],
                          "prediction": ["tennis", "red", "two"]})
    paths = {"json": tmp_path / "M_OK-VQA.json", "tsv": tmp_path / "M_OK-VQA.tsv",
             "xlsx": tmp_path / "M_OK-VQA.xlsx"}
    with open(paths["json"], "w") as f:
        json.dump(frame.to_dict("records"), f, indent=4, ensure_ascii=False, cls=NumpyEncoder)
    frame.to_csv(paths["tsv"], sep="\t", index=False, encoding="utf-8", quoting=csv.QUOTE_ALL)
    frame.to_excel(paths["xlsx"], index=False)
    assert "NaN" in paths["json"].read_text() and paths["json"].read_text().startswith("[\n    {")
    outputs = {}
    for kind, path in paths.items():
        assert detect_format(str(path)) == "vlmevalkit"
        out = tmp_path / f"{kind}.jsonl"
        assert rescore(t5_dir, path, out) == 3  # finished, one row an item error (below)
        outputs[kind] = sorted(read_rows(out), key=lambda r: r["id"])
    for kind, rows in outputs.items():
        assert [r["id"] for r in rows] == [3, 4, 5], kind  # ints in every format
        assert rows[0]["references"] == ["tennis", "tennis match"]
        assert rows[1]["references"] == ["red"]
        assert rows[2]["references"] == [] and rows[2]["error"]  # NaN answer: no references
        assert rows[0]["error"] is None and rows[0]["score"] is not None
    same = {kind: [{k: v for k, v in r.items() if k != "error"} for r in rows]
            for kind, rows in outputs.items()}  # errors name the line: a header row counts
    assert same["json"] == same["tsv"] == same["xlsx"]
    # a non-numeric index stays text
    (tmp_path / "M_X.json").write_text(json.dumps([{"index": "a-1", "question": "Q?",
                                                    "answer": "x", "prediction": "x"}, 7]))
    out = tmp_path / "x.jsonl"
    assert rescore(t5_dir, tmp_path / "M_X.json", out) == 3  # a row is an item error
    rows = read_rows(out)
    assert {r["id"] for r in rows} >= {"a-1"}
    assert any("record 2: not a JSON object" in (r["error"] or "") for r in rows)


# -- lmms-eval references from the task's dataset -----------------------------------------------
def lmms_eval_written(doc_id: int, doc: dict, target, context: str, response: str) -> dict:
    """A ``generate_until`` sample as lmms-eval writes it (EvolvingLMMs-Lab/lmms-eval commit
    75571cfe0fa36ca5ec2e6aa2bb268f9d38295af3): ``lmms_eval/evaluator.py`` ``evaluate`` builds
    ``{"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", ...}`` (arguments:
    the request's serializable args, the context first); ``lmms_eval/loggers/
    evaluation_tracker.py`` ``save_results_samples`` sets ``input = arguments[0]``, unwraps the
    single-request lists, drops ``resps`` equal to ``filtered_resps``, writes ``str(target)``
    and drops ``arguments`` and ``doc``."""
    sample = {"doc_id": doc_id, "doc": doc, "target": target,
              "arguments": [context, {"max_new_tokens": 16}, doc_id, "vqav2_val", "validation"],
              "resps": [[response]], "filtered_resps": [response], "exact_match": 0.0}
    sample["input"] = sample["arguments"][0]
    sample["resps"] = sample["resps"][0] if len(sample["resps"]) == 1 else sample["resps"]
    sample["filtered_resps"] = (sample["filtered_resps"][0] if len(sample["filtered_resps"]) == 1
                                else sample["filtered_resps"])
    if sample["resps"] == sample["filtered_resps"]:
        sample.pop("resps")
    elif isinstance(sample["resps"], list) and len(sample["resps"]) == 1 \
            and sample["resps"][0] == sample["filtered_resps"]:
        sample.pop("resps")
    sample["target"] = str(sample["target"])
    sample.pop("arguments")
    sample.pop("doc")
    return sample


def vqav2_doc_to_target(doc: dict):
    """``lmms_eval/api/task.py`` ``ConfigurableTask.doc_to_target`` for vqav2's YAML
    ``doc_to_target: "answer"`` on a dataset without that column: the string is rendered as a
    template of the doc, giving ``"answer"`` itself."""
    return doc["answer"] if "answer" in doc else "answer"


def test_lmms_eval_references_from_the_dataset(t5_dir, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = [{"question_id": 100 + i, "question": q,
             "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": k + 1}
                         for k, a in enumerate(answers)], "image": b"\x89PNG..."}
            for i, (q, answers) in enumerate([("What color is the bus?", ["red"] * 7 + ["orange"] * 3),
                                              ("How many dogs?", ["2"] * 9 + ["two"])])]
    pre_prompt = "Look at the picture carefully.\n"  # a task's pre_prompt: line 1 is not the question
    samples = [lmms_eval_written(i, {k: v for k, v in d.items() if k != "image"},
                                 vqav2_doc_to_target(d),
                                 f"{pre_prompt}{d['question']}\nAnswer the question using a single "
                                 "word or phrase.", resp) for i, (d, resp) in enumerate(zip(docs, ["red", "2"]))]
    assert samples[0]["target"] == "answer" and "doc" not in samples[0]
    log = tmp_path / "20261204_samples_vqav2_val.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in samples))
    # without the dataset, the literal field name is refused, not judged as the answer
    out = tmp_path / "plain.jsonl"
    assert rescore(t5_dir, log, out) == 3  # every row an item error
    assert all("name of a field" in r["error"] and "--references" in r["error"]
               for r in read_rows(out))
    # the dataset as Parquet (rows in split order: doc_id is the position) and as JSONL with ids
    parquet = tmp_path / "vqav2_val.parquet"
    pq.write_table(pa.Table.from_pylist(docs), parquet)
    jsonl = tmp_path / "vqav2_val.jsonl"
    jsonl.write_text("".join(json.dumps({"doc_id": i, **{k: v for k, v in d.items() if k != "image"}})
                             + "\n" for i, d in reversed(list(enumerate(docs)))))
    for refs in (parquet, jsonl):
        out = tmp_path / f"{refs.suffix[1:]}.jsonl"
        assert rescore(t5_dir, log, out, "--references", str(refs)) == 0
        by_id = {r["id"]: r for r in read_rows(out)}
        assert by_id[0]["references"] == ["red"] * 7 + ["orange"] * 3
        assert by_id[0]["question"] == "What color is the bus?"  # from the dataset, not input
        assert by_id[1]["references"] == ["2"] * 9 + ["two"] and by_id[1]["error"] is None
    # a document missing from the file, and a column that does not exist
    pq.write_table(pa.Table.from_pylist(docs[:1]), parquet)
    out = tmp_path / "missing.jsonl"
    assert rescore(t5_dir, log, out, "--references", str(parquet)) == 3  # line 2 an item error
    by_id = {r["id"]: r for r in read_rows(out)}
    assert by_id[0]["error"] is None
    assert "doc_id 1 is not in the --references file" in by_id["line-2"]["error"]
    assert rescore(t5_dir, log, tmp_path / "nope.jsonl", "--references", str(parquet),
                   "--references-column", "answer") != 0
    assert not (tmp_path / "nope.jsonl").exists()


def test_lmms_eval_multiple_choice_logs_are_error_rows():
    """A ``multiple_choice`` sample as lmms-eval logs it (EvolvingLMMs-Lab/lmms-eval commit
    75571cfe0fa36ca5ec2e6aa2bb268f9d38295af3): ``lmms_eval/api/task.py``
    ``ConfigurableTask.process_results`` reads each request's result as a
    ``(loglikelihood, is_greedy)`` pair (``lls, is_greedy = zip(*results)``), so ``resps`` holds
    one ``[[ll, is_greedy]]`` per choice and ``filtered_resps`` one ``[ll, is_greedy]``; the
    ``loglikelihood`` output type logs a single pair. None of them is text to judge."""
    from fastjudge.io.harness_formats import lmms_eval_item

    choices = [(-1.23, False), (-0.45, True), (-3.5, False)]
    multiple_choice = {"doc_id": 3, "doc": {"question": "Which animal is shown?"},
                       "target": "1", "resps": [[list(c)] for c in choices],
                       "filtered_resps": [list(c) for c in choices], "acc": 1.0}
    single = {"doc_id": 4, "doc": {"question": "Is it a cat?"}, "target": "yes",
              "filtered_resps": [-0.7, True]}
    for record in (multiple_choice, single, {**multiple_choice, "filtered_resps": None}):
        with pytest.raises(ValueError, match="log-likelihood scores, not generated text"):
            lmms_eval_item(record)
    # text responses are read as before
    text = {**multiple_choice, "resps": [["a cat"]], "filtered_resps": ["a cat"], "target": "cat"}
    assert lmms_eval_item(text)["prediction"] == "a cat"
