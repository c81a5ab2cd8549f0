"""Evaluation-harness outputs as judge input: lmms-eval sample logs and VLMEvalKit predictions.

Each harness row becomes one :class:`.jsonl.InputLine` with the LAVE item fields ``id``,
``question``, ``references`` and ``prediction``; a row that cannot be mapped becomes an
``InputLine`` with an error (one error row in the output), never a failed job.

lmms-eval (``--log_samples``: one ``*_samples_<task>.jsonl`` per task, one JSON object a line):
``doc_id`` -> id; ``filtered_resps`` (else ``resps``), its first leaf when it is a list ->
prediction; ``doc["answers"]`` (else ``target``, a list or a Python list literal) ->
references; ``doc["question"]`` -> question. Current lmms-eval writes no ``doc`` (the writer
drops it and keeps ``input``, the prompt the model saw): the question is then the first
non-blank line of ``input``, because lmms-eval's VQA prompts put the question first and the
task's answer instructions on the lines after it.

VLMEvalKit (``<model>_<dataset>.xlsx``, ``.tsv`` or, with ``PRED_FORMAT=json``, ``.json``: an
indented JSON array of row objects, ``vlmeval/smp/file.py`` ``dump_json``): ``index`` -> id,
``question``, ``answer`` -> references, ``prediction``. An ``answer`` written as a Python list
literal such as ``"['a', 'b']"`` is parsed with :func:`ast.literal_eval` (data only: nothing
in it is run) into one reference per element; any other answer is one reference. ``index`` is
one type whatever the file: an integer when it is a whole number (``7``, ``"7"``, ``7.0``),
else its text, so the ids of one dataset's predictions agree across formats (and resumes).
An empty cell, or a JSON ``NaN`` (pandas' missing value), is a missing value.
"""

from __future__ import annotations

import ast
import csv
import json
import math
import sys
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import orjson

from .jsonl import InputLine

FORMATS = ("auto", "jsonl", "parquet", "lmms-eval", "vlmevalkit")
MAX_ROW_CHARS = 8 * 1024 * 1024  # a bigger row (line or all cells together) is an error row
# csv refuses fields over its limit; ours lets a large image cell through, the row cap does the rest
csv.field_size_limit(min(sys.maxsize, MAX_ROW_CHARS + 1))


# -- detection -------------------------------------------------------------------------------
def _starts_array(path: str) -> bool:
    """Whether the file's first non-blank character opens a JSON array."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _first_jsonl_record(path: str) -> Any:
    with open(path, "rb") as f:
        for raw in islice(f, 64):  # the first non-blank line, bounded
            if raw.strip():
                if len(raw) > MAX_ROW_CHARS:
                    return None
                try:
                    return orjson.loads(raw)
                except orjson.JSONDecodeError:
                    return None
    return None


def detect_format(path: str) -> str:
    """The format ``auto`` means for ``path``: ``lmms-eval`` for a JSONL whose first record has
    ``doc_id`` and ``filtered_resps`` or ``resps`` (the shape, not the file name, decides: a ``*_samples_*`` name in
    our own layout stays ours); ``vlmevalkit`` for ``.tsv`` / ``.xlsx``; else ``jsonl`` or
    ``parquet`` (by extension)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".tsv", ".xlsx"):
        return "vlmevalkit"
    if suffix == ".json" and p.is_file() and _starts_array(path):
        return "vlmevalkit"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if p.is_file():
        first = _first_jsonl_record(path)
        if isinstance(first, dict) and "doc_id" in first and ("filtered_resps" in first or "resps" in first):
            return "lmms-eval"
    return "jsonl"


# -- lmms-eval -------------------------------------------------------------------------------
def _flatten(value: Any) -> Any:
    """The first leaf of nested lists (a response can be ``[["text"]]``)."""
    while isinstance(value, (list, tuple)):
        if not value:
            return None
        value = value[0]
    return value


def lmms_eval_item(record: Any) -> dict:
    """The LAVE item of one lmms-eval sample record; raises ValueError naming what is missing."""
    if not isinstance(record, dict):
        raise ValueError("the line is not a JSON object")
    doc = record.get("doc") if isinstance(record.get("doc"), dict) else {}
    prediction = _flatten(record.get("filtered_resps"))
    if prediction is None:
        prediction = _flatten(record.get("resps"))
    if prediction is None:
        raise ValueError("no response: filtered_resps and resps are empty or missing")
    answers = doc.get("answers")
    if answers is None:
        answers = record.get("target")
    references = _as_references(answers)
    question = doc.get("question")
    if question is None:
        question = _question_from_input(record.get("input"))
    if question is None:
        raise ValueError('no question: neither doc["question"] nor a text input')
    item = {"id": record.get("doc_id"), "question": str(question),
            "references": references, "prediction": str(prediction)}
    return item


def _question_from_input(prompt: Any) -> str | None:
    """The question in an lmms-eval ``input`` (the prompt text): its first non-blank line."""
    prompt = _flatten(prompt)
    if not isinstance(prompt, str):
        return None
    return next((line.strip() for line in prompt.splitlines() if line.strip()), None)


def read_lmms_eval(path: str) -> Iterator[InputLine]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if len(raw) > MAX_ROW_CHARS:
                yield InputLine(line_no, None, f"line {line_no}: longer than {MAX_ROW_CHARS} bytes")
                continue
            try:
                yield InputLine(line_no, lmms_eval_item(orjson.loads(raw)))
            except (orjson.JSONDecodeError, ValueError, TypeError) as bad:
                yield InputLine(line_no, None, f"line {line_no}: lmms-eval record: {bad}")


# -- VLMEvalKit ------------------------------------------------------------------------------
def _as_references(answer: Any) -> list[str]:
    """References from an answer cell: a list stays a list; a string that is a Python list or
    tuple literal becomes its elements (literal_eval only: an expression such as a call is not
    a literal, so it stays one plain string reference)."""
    if isinstance(answer, str):
        text = answer.strip()
        if text.startswith(("[", "(")):
            try:
                parsed = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                parsed = None
            if isinstance(parsed, (list, tuple)):
                answer = list(parsed)
    if isinstance(answer, (list, tuple)):
        refs = [str(a) for a in answer if a is not None and str(a).strip()]
    elif answer is None or (isinstance(answer, str) and not answer.strip()):
        refs = []
    else:
        refs = [str(answer)]
    return refs


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def vlmevalkit_index(value: Any) -> Any:
    """``index`` as one type across .xlsx (numbers), .tsv (text) and .json (numbers or text):
    an int when it is a whole number, else its text; a missing value is None."""
    if _missing(value):
        return None
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else str(value)
    text = str(value).strip()
    try:
        return int(text)
    except ValueError:
        return text


def vlmevalkit_item(row: dict) -> dict:
    row = {k: (None if _missing(v) else v) for k, v in row.items()}
    if row.get("prediction") is None:
        raise ValueError("no prediction column value")
    if row.get("question") is None:
        raise ValueError("no question column value")
    item = {"id": vlmevalkit_index(row.get("index")), "question": str(row["question"]),
            "references": _as_references(row.get("answer")),
            "prediction": str(row["prediction"])}
    if row.get("image"):
        item["image_b64"] = str(row["image"])
    return item


def _json_rows(path: str) -> Iterator[tuple[int, dict | None, str | None]]:
    """(record number, record, error) for each element of a VLMEvalKit ``.json`` array. The
    standard library's parser: pandas writes missing values as ``NaN``, which strict JSON
    parsers refuse."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            records = json.load(f)
    except ValueError as bad:  # UnicodeDecodeError included
        raise ValueError(f"{path}: not a JSON array of prediction rows: {bad}") from None
    if not isinstance(records, list):
        raise ValueError(f"{path}: a VLMEvalKit .json prediction file is a JSON array of rows")
    for number, record in enumerate(records, 1):
        if not isinstance(record, dict):
            yield number, None, f"record {number}: not a JSON object"
        else:
            yield number, record, None


def _cells(path: str) -> Iterator[tuple[int, dict | None, str | None]]:
    """(row number, row as a dict, error) for each data row of a .tsv or .xlsx file."""
    if path.lower().endswith(".xlsx"):
        try:
            import openpyxl
        except ImportError:
            raise ValueError(f"{path}: reading .xlsx needs openpyxl "
                             "(pip install 'fastjudge[harness]')") from None
        book = openpyxl.load_workbook(path, read_only=True, data_only=True)
        rows = book.active.iter_rows(values_only=True)
    else:
        f = open(path, newline="", encoding="utf-8")
        rows = csv.reader(f, delimiter="\t")
    header = [str(h) if h is not None else "" for h in next(rows, [])]
    row_no = 1
    while True:
        row_no += 1
        try:
            values = next(rows)
        except StopIteration:
            return
        except csv.Error as bad:  # e.g. a field over the size limit: this row only
            yield row_no, None, f"row {row_no}: {bad}"
            continue
        size = sum(len(str(v)) for v in values if v is not None)
        if size > MAX_ROW_CHARS:
            yield row_no, None, f"row {row_no}: longer than {MAX_ROW_CHARS} characters"
            continue
        yield row_no, dict(zip(header, values)), None


def read_vlmevalkit(path: str) -> Iterator[InputLine]:
    rows = _json_rows(path) if path.lower().endswith(".json") else _cells(path)
    for row_no, row, error in rows:
        if error is not None:
            yield InputLine(row_no, None, error)
            continue
        try:
            yield InputLine(row_no, vlmevalkit_item(row))
        except (ValueError, TypeError) as bad:
            yield InputLine(row_no, None, f"row {row_no}: VLMEvalKit row: {bad}")
