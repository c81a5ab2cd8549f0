"""JSONL input and resumable JSONL output.

Resumption is by item id: the writer counts the rows of each id already in the output file,
and each row is written as one ``write`` of a complete line followed by a flush. A process
killed mid-write can leave at most one partial last line; the next run cuts it off before
appending, so a crash or Ctrl-C never loses or duplicates a row. A complete line that is not a
JSON object (a corrupt file) is removed, named by its line number; the rows around it are
kept, so only its item is scored again.

Output that is not a regular file -- ``-`` (standard output), a pipe, a FIFO or a device such
as ``/dev/null`` -- is written as a stream: nothing is read back (no resumption) and nothing is
synced to disk.
"""

from __future__ import annotations

import os
import stat
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson

STDOUT = "-"  # the output name that means standard output


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


def is_stream(path: str | os.PathLike) -> bool:
    """Output that is written as a stream, never read back: ``-`` (standard output), or an
    existing path that is neither a regular file nor a directory (a pipe, a FIFO, a device)."""
    if str(path) == STDOUT:
        return True
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


class ResumableWriter:
    """Appends JSON rows to ``path``. ``done`` counts the rows of each id already there (see
    the module docstring); ``notes`` says what was repaired in the file."""

    def __init__(self, path: str | os.PathLike, id_field: str = "id"):
        self.path = Path(path)
        self.id_field = id_field
        self.done: Counter[str] = Counter()
        self.notes: list[str] = []
        self.stream = is_stream(path)
        if str(path) == STDOUT:
            self._file = sys.stdout.buffer
            return
        if self.stream:
            self._file = open(self.path, "ab")
            return
        if self.path.exists():
            self._recover()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")

    def _recover(self) -> None:
        """Count the rows by id; cut a partial last line; remove corrupt lines."""
        corrupt: list[int] = []
        complete = 0  # bytes in complete lines
        with open(self.path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    break  # no newline: the write of this line never completed
                complete += len(raw)
                if not raw.strip():
                    continue
                try:
                    row = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    row = None
                if isinstance(row, dict):
                    self.done[str(row.get(self.id_field))] += 1
                else:
                    corrupt.append(line_no)
        partial = complete < self.path.stat().st_size
        if corrupt:
            self._rewrite_without(set(corrupt))
            lines = ", ".join(map(str, corrupt))
            self.notes.append(f"removed corrupt line(s) {lines} (not a JSON row) from {self.path}; "
                              "their items are scored again")
        elif partial:
            with open(self.path, "r+b") as f:
                f.truncate(complete)
        if partial:
            self.notes.append(f"removed a partial last line from {self.path} (interrupted run)")

    def _rewrite_without(self, skip: set[int]) -> None:
        """The file without the lines numbered in ``skip`` and without a partial last line,
        replaced in one rename so that a crash leaves the old file or the new one."""
        tmp = self.path.with_name(f".{self.path.name}.repair")
        with open(self.path, "rb") as src, open(tmp, "wb") as dst:
            for line_no, raw in enumerate(src, 1):
                if raw.endswith(b"\n") and line_no not in skip:
                    dst.write(raw)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        self._file.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._file.flush()
        self.done[str(row.get(self.id_field))] += 1

    def close(self) -> None:
        self._file.flush()
        if self._file is sys.stdout.buffer:
            return
        if not self.stream:
            os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self) -> "ResumableWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
