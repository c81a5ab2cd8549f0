"""Evaluation-harness outputs as judge input: lmms-eval sample logs and VLMEvalKit predictions.

Each harness row becomes one :class:`.jsonl.InputLine` with the LAVE item fields ``id``,
``question``, ``references`` and ``prediction``; a row that cannot be mapped becomes an
``InputLine`` with an error (one error row in the output), never a failed job.

lmms-eval (``--log_samples``: one ``*_samples_<task>.jsonl`` per task, one JSON object a line):
``doc_id`` -> id; ``filtered_resps`` (else ``resps``), its first leaf when it is a list ->
prediction. A multiple-choice (or loglikelihood) task logs ``[log-likelihood, is_greedy]`` pairs
there instead of text: such a record is an error row saying so, not a "prediction" like
``"-1.23"``. Current lmms-eval writes no ``doc`` (the writer drops it and keeps ``input``, the
prompt the model saw, and ``target``, one ``str(doc_to_target(doc))``), so a VQAv2 sample keeps
one of its ten answers. Hence :class:`References`: the task's dataset itself (JSONL or Parquet,
one row per document), joined on ``doc_id`` (its ``doc_id`` column, else the row's position,
which is how lmms-eval numbers a split's documents), whose named column gives the references.
The document of a sample is that row, else the record's ``doc`` (older writers keep it):

* references: the references file's column; else ``doc["answers"]``; else ``target`` (a list
  or a Python list literal). A ``target`` equal to a field's own name (``"answer"``: what
  lmms-eval writes when the task's ``doc_to_target`` names a column the dataset lacks) is
  refused, naming ``--references``;
* question: the document's ``question``; else the first non-blank line of ``input`` (lmms-eval's
  VQA prompts put the question first; a task's ``pre_prompt`` comes before it, so that line
  is then wrong: give the dataset as ``--references``).

VLMEvalKit (``<model>_<dataset>.xlsx``; on its main branch only, no tagged release, also
``.tsv`` or, with ``PRED_FORMAT=json``, ``.json``: an indented JSON array of row objects,
``vlmeval/smp/file.py`` ``dump_json``): ``index`` -> id,
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
from dataclasses import dataclass
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


#: Column names a task's ``doc_to_target`` names; a ``target`` equal to one is no answer.
TARGET_FIELD_NAMES = frozenset({"answer", "answers", "target", "targets", "label", "labels",
                                "gt", "gt_answer", "gt_answers", "ground_truth", "reference",
                                "references"})


@dataclass(frozen=True)
class References:
    """The references of lmms-eval samples, from the task's dataset (``--references``):
    ``path`` a JSONL or Parquet file with one row per document; ``column`` the references
    (a list, a JSON or Python list literal, or one answer); ``id_column`` the document id
    (default: ``doc_id`` when the file has it, else each row's 0-based position)."""

    path: str
    column: str = "answers"
    id_column: str | None = None

    def load(self) -> dict[Any, dict]:
        """Rows by document id (only the columns this needs are kept)."""
        if not Path(self.path).is_file():
            raise ValueError(f"--references {self.path}: no such file")
        wanted = {self.column, "question", self.id_column or "doc_id"}
        rows = _parquet_rows(self.path, wanted) if _is_parquet_name(self.path) else \
            _jsonl_rows(self.path, wanted)
        if rows and self.id_column is not None and self.id_column not in rows[0]:
            raise ValueError(f"--references {self.path}: no column {self.id_column!r}")
        if rows and self.column not in rows[0]:
            raise ValueError(f"--references {self.path}: no column {self.column!r} "
                             f"(columns: {', '.join(sorted(rows[0]))})")
        id_column = self.id_column or ("doc_id" if rows and "doc_id" in rows[0] else None)
        # ids as text: a file's "7" and a log's 7 are one document
        return {str(row.get(id_column) if id_column else position): row
                for position, row in enumerate(rows)}


def _is_parquet_name(path: str) -> bool:
    return path.lower().endswith((".parquet", ".pq"))


def _jsonl_rows(path: str, wanted: set) -> list[dict]:
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError as bad:
                raise ValueError(f"--references {path}: line {line_no}: {bad}") from None
            if not isinstance(row, dict):
                raise ValueError(f"--references {path}: line {line_no} is not a JSON object")
            rows.append({k: v for k, v in row.items() if k in wanted})
    return rows


def _parquet_rows(path: str, wanted: set) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("--references in Parquet needs pyarrow (pip install 'fastjudge[ray]')") from None
    table = pq.ParquetFile(path)
    names = [n for n in table.schema_arrow.names if n in wanted]  # no image columns read
    return table.read(columns=names).to_pylist()


def _target_references(target: Any, doc: dict, column: str | None) -> list[str]:
    """References from the record's ``target``, refusing a field's own name."""
    references = _as_references(target)
    names = TARGET_FIELD_NAMES | set(doc) | ({column} if column else set())
    if len(references) == 1 and references[0].strip() in names:
        raise ValueError(f"target is {references[0]!r}, the name of a field rather than an "
                         "answer (the task's doc_to_target names a column its dataset lacks): "
                         "give the dataset as --references FILE --references-column NAME")
    return references


def lmms_eval_item(record: Any, references: dict | None = None,
                   column: str | None = None) -> dict:
    """The LAVE item of one lmms-eval sample record; raises ValueError naming what is missing.
    ``references``: the rows of a :class:`References` file by document id, whose ``column``
    holds the references."""
    if not isinstance(record, dict):
        raise ValueError("the line is not a JSON object")
    doc = record.get("doc") if isinstance(record.get("doc"), dict) else {}
    prediction = _flatten(record.get("filtered_resps"))
    if prediction is None:
        prediction = _flatten(record.get("resps"))
    if prediction is None:
        raise ValueError("no response: filtered_resps and resps are empty or missing")
    if not isinstance(prediction, str):
        # a loglikelihood / multiple_choice task logs (log-likelihood, is_greedy) per choice
        raise ValueError("the responses are log-likelihood scores, not generated text (a "
                         "multiple-choice or loglikelihood task logs [log-likelihood, is_greedy] "
                         "per choice): there is no answer to judge; judge a generate_until task")
    if references is not None:
        row = references.get(str(record.get("doc_id")))
        if row is None:
            raise ValueError(f"doc_id {record.get('doc_id')!r} is not in the --references file")
        doc = {**doc, **row}
        refs = _as_references(row.get(column))
    elif doc.get("answers") is not None:
        refs = _as_references(doc["answers"])
    else:
        refs = _target_references(record.get("target"), doc, column)
    question = doc.get("question")
    if question is None:
        question = _question_from_input(record.get("input"))
    if question is None:
        raise ValueError('no question: neither doc["question"] nor a text input')
    return {"id": record.get("doc_id"), "question": str(question), "references": refs,
            "prediction": str(prediction)}


def _question_from_input(prompt: Any) -> str | None:
    """The question in an lmms-eval ``input`` (the prompt text): its first non-blank line."""
    prompt = _flatten(prompt)
    if not isinstance(prompt, str):
        return None
    return next((line.strip() for line in prompt.splitlines() if line.strip()), None)


def read_lmms_eval(path: str, references: References | None = None) -> Iterator[InputLine]:
    rows = references.load() if references is not None else None
    column = references.column if references is not None else None
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if len(raw) > MAX_ROW_CHARS:
                yield InputLine(line_no, None, f"line {line_no}: longer than {MAX_ROW_CHARS} bytes")
                continue
            try:
                yield InputLine(line_no, lmms_eval_item(orjson.loads(raw), rows, column))
            except (orjson.JSONDecodeError, ValueError, TypeError) as bad:
                yield InputLine(line_no, None, f"line {line_no}: lmms-eval record: {bad}")


# -- VLMEvalKit ------------------------------------------------------------------------------
def _as_references(answer: Any) -> list[str]:
    """References from an answer cell: a list stays a list (an ``{"answer": ...}`` element as
    its answer); a string that is a Python list or tuple literal becomes its elements
    (literal_eval only: an expression such as a call is not a literal, so it stays one plain
    string reference)."""
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
        # VQA datasets keep answers as {"answer": ..., "answer_confidence": ...} records
        answer = [a.get("answer") if isinstance(a, dict) else a for a in answer]
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
