"""Parquet input and resumable Parquet output (needs ``pyarrow``).

Input: one file; every row is an item, its columns the fields of a JSONL line (``references``
as ``list<string>`` or ``list<struct<answer: string, ...>>``). Row N (1-based) plays the part
of line N: a row without an ``id`` (column absent or null) is known as ``line-N``.

Output: a directory of part files ``part-NNNNN.parquet``. Each part is written to a hidden
temporary file and renamed into place when complete, so a part either holds all its rows or
does not exist. Rows are buffered and a part is written every ``rows_per_part`` rows and at the
end; an interrupted run loses the rows of its unwritten part (the next run scores them again)
and never leaves a partial or duplicated row. Resumption is by id: the rows of each id in the
parts already in the directory are counted (as :class:`fastjudge.io.jsonl.ResumableWriter`
does), and new rows go to new parts.

Columns: ``id`` first, always a string (the id resumption compares); then the input fields in
order of first appearance, each with the Arrow type its values share over the whole input (a
field whose values share none, e.g. numbers in some rows and strings in others, is stored as
JSON text); then the judge's result fields with their declared types. The schema depends only
on the input, so every part of a resumed job has the same one.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import orjson

from .jsonl import InputLine

PART_RE = re.compile(r"^part-(\d+)\.parquet$")
TYPES = {"float": "float64", "int": "int64", "str": "string", "bool": "bool_"}


def _pa():
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ValueError('Parquet input/output needs pyarrow: pip install "fastjudge[ray]" '
                         "(or pip install pyarrow)") from None
    return pyarrow


def is_parquet(path: str | os.PathLike) -> bool:
    """Parquet by name: ``*.parquet`` or ``*.pq`` (a directory too, for output)."""
    return Path(path).suffix.lower() in (".parquet", ".pq")


def read_parquet(path: str | os.PathLike, batch_rows: int = 65536) -> Iterator[InputLine]:
    """Every row as an :class:`InputLine` (``line_no`` = 1-based row number)."""
    pa = _pa()
    f = pa.parquet.ParquetFile(path)
    row_no = 0
    for batch in f.iter_batches(batch_size=batch_rows):
        for item in batch.to_pylist():
            row_no += 1
            yield InputLine(row_no, item)


def _result_type(pa, kind: str | None):
    if kind == "list[float]":
        return pa.list_(pa.float64())
    if kind in TYPES:
        return getattr(pa, TYPES[kind])()
    return None  # JSON text


def output_schema(rows: Iterable[dict], result_fields: Sequence[str],
                  result_types: dict[str, str]):
    """(Arrow schema, names of the columns stored as JSON text) for output rows made of the
    input ``rows`` (their fields, id resolved) and the result fields."""
    pa = _pa()
    columns: dict[str, list] = {"id": []}
    n = 0
    for row in rows:
        for k in row:
            if k not in columns:
                columns[k] = [None] * n
        for k, values in columns.items():
            values.append(row.get(k))
        n += 1
    fields, as_json = [pa.field("id", pa.string())], set()
    for name, values in columns.items():
        if name == "id" or name in result_fields:
            continue
        try:
            fields.append(pa.field(name, pa.array(values).type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError,
                TypeError, ValueError):
            fields.append(pa.field(name, pa.string()))
            as_json.add(name)
    for name in result_fields:
        if name == "id":
            continue
        t = _result_type(pa, result_types.get(name))
        if t is None:
            t = pa.string()
            as_json.add(name)
        fields.append(pa.field(name, t))
    return pa.schema(fields), as_json


class ParquetPartWriter:
    """Appends rows to the part-file directory ``path`` (see the module docstring); the same
    interface as :class:`fastjudge.io.jsonl.ResumableWriter` (``done``, ``notes``, ``write``,
    ``close``)."""

    def __init__(self, path: str | os.PathLike, schema, as_json: Iterable[str] = (),
                 rows_per_part: int = 10000, id_field: str = "id"):
        pa = _pa()
        if rows_per_part < 1:
            raise ValueError("rows_per_part must be >= 1")
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"{self.path} exists and is not a directory (Parquet output is a "
                             "directory of part files)")
        self.schema = schema
        self.as_json = set(as_json)
        self.rows_per_part = rows_per_part
        self.id_field = id_field
        self.done: Counter[str] = Counter()
        self.notes: list[str] = []
        removed = 0
        self._buffer: list[dict] = []
        self.path.mkdir(parents=True, exist_ok=True)
        last = -1
        for p in sorted(self.path.iterdir()):
            if p.name.startswith(".part-") and p.name.endswith(".tmp"):
                p.unlink()  # a part whose write never completed
                removed += 1
                continue
            m = PART_RE.match(p.name)
            if not m:
                continue
            last = max(last, int(m.group(1)))
            existing = pa.parquet.read_schema(p)
            if not existing.equals(schema):
                raise ValueError(
                    f"{p} has a different schema than this job's rows ({existing} vs {schema}); "
                    "was it written from another input? Use a new output directory")
            ids = pa.parquet.read_table(p, columns=[id_field]).column(id_field).to_pylist()
            self.done.update(str(i) for i in ids)
        self._next = last + 1
        if removed:
            self.notes.append(f"removed {removed} unfinished part file(s) from {self.path} "
                              "(interrupted run)")

    def _cell(self, name: str, value):
        if value is None:
            return None
        if name == self.id_field:
            return str(value)
        if name in self.as_json:
            return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode()
        return value

    def write(self, row: dict) -> None:
        self._buffer.append({f.name: self._cell(f.name, row.get(f.name)) for f in self.schema})
        self.done[str(row.get(self.id_field))] += 1
        if len(self._buffer) >= self.rows_per_part:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        pa = _pa()
        table = pa.Table.from_pylist(self._buffer, schema=self.schema)
        name = f"part-{self._next:05d}.parquet"
        tmp = self.path / f".{name}.tmp"
        pa.parquet.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path / name)
        self._next += 1
        self._buffer = []

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "ParquetPartWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_parquet_rows(path: str | os.PathLike) -> list[dict]:
    """All rows of a Parquet file or of a part-file directory (parts in order)."""
    pa = _pa()
    path = Path(path)
    files = ([p for p in sorted(path.iterdir()) if PART_RE.match(p.name)] if path.is_dir()
             else [path])
    rows: list[dict] = []
    for p in files:
        rows.extend(pa.parquet.read_table(p).to_pylist())
    return rows
