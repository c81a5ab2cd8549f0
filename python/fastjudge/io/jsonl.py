"""JSONL input and resumable JSONL output.

Resumption is by item id: the writer reads the ids already in the output file, and each row
is written as one ``write`` of a complete line followed by a flush. A process killed mid-write
can leave at most one partial last line; the next run cuts it off before appending, so a crash
or Ctrl-C never loses or duplicates a row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson


@dataclass
class InputLine:
    line_no: int  # 1-based
    item: dict | None
    error: str | None = None

    @property
    def id(self) -> str:
        """The item's id, or one derived from its line number when it has none."""
        if self.item is not None and self.item.get("id") is not None:
            return str(self.item["id"])
        return f"line-{self.line_no}"

    def output_row(self) -> dict:
        """The input fields to copy into the output row, with the id resolved (an item without
        an id, or with "id": null, is known by its line number)."""
        item = self.item or {}
        return {**item, "id": item["id"] if item.get("id") is not None else self.id}


def read_jsonl(path: str | os.PathLike) -> Iterator[InputLine]:
    """Every non-blank line; a malformed one comes back with ``error`` set, not raised."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                item = orjson.loads(raw)
            except orjson.JSONDecodeError as bad:
                yield InputLine(line_no, None, f"line {line_no}: invalid JSON ({bad})")
                continue
            if not isinstance(item, dict):
                yield InputLine(line_no, None, f"line {line_no}: expected a JSON object, "
                                               f"got {type(item).__name__}")
                continue
            yield InputLine(line_no, item)


class ResumableWriter:
    """Appends JSON rows to ``path``, skipping ids it already holds."""

    def __init__(self, path: str | os.PathLike, id_field: str = "id"):
        self.path = Path(path)
        self.id_field = id_field
        self.done: set[str] = set()
        self.truncated_partial_line = False
        if self.path.exists():
            self._recover()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")

    def _recover(self) -> None:
        data = self.path.read_bytes()
        good_end = 0
        pos = 0
        while pos < len(data):
            end = data.find(b"\n", pos)
            if end < 0:
                break  # no newline: the write of this line never completed
            line = data[pos:end]
            try:
                row = orjson.loads(line) if line.strip() else None
            except orjson.JSONDecodeError:
                break
            if isinstance(row, dict):
                self.done.add(str(row.get(self.id_field)))
            pos = good_end = end + 1
        if good_end < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
            self.truncated_partial_line = True

    def write(self, row: dict) -> None:
        self._file.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._file.flush()
        self.done.add(str(row.get(self.id_field)))

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self) -> "ResumableWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
