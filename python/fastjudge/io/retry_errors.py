"""``--retry-errors``: remove from an existing job output the rows of the items that have an
error, so that the job (which resumes by id) scores them again.

Which rows: every row of each id whose *first* row is an error. The later rows of an id are
the error rows of lines repeating it (see :mod:`.jobs`); they go too, so that the rows of an id
stay those of its first lines and the resumed job writes them again after the new first row.
The re-scored rows are appended, as a resumed job's rows are.

Nothing is lost or duplicated on interruption:

* JSONL: the file without those rows is written beside it and renamed over it, so a crash
  leaves the old file or the new one; either way the job resumes from it.
* Parquet (a directory of part files): the ids go first to a journal file in the directory
  (written and renamed into place), then each part holding their rows is rewritten the same
  way (or deleted when none of its rows stay), then the journal is removed. A job finds a
  journal left by an interrupted run and finishes removing those ids before it opens the
  output (:func:`finish_dropping`), whether or not ``--retry-errors`` is given again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import orjson

from .jsonl import is_stream
from .parquet import PART_RE, _pa, is_parquet

JOURNAL = ".retry-errors.json"


def _first_errors(rows) -> set[str]:
    """Ids whose first row (in ``rows``: (id, error) pairs in output order) has an error."""
    seen: set[str] = set()
    failed: set[str] = set()
    for ident, error in rows:
        if ident not in seen:
            seen.add(ident)
            if error:
                failed.add(ident)
    return failed


def _replace(tmp: Path, path: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- JSONL -----------------------------------------------------------------------------------
def _jsonl_rows(path: Path):
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                return  # a partial last line: the writer cuts it off
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if isinstance(row, dict):
                yield str(row.get("id")), row.get("error")


def _drop_jsonl(path: Path) -> list[str]:
    ids = _first_errors(_jsonl_rows(path))
    if not ids:
        return []
    tmp = path.with_name(f".{path.name}.retry")
    removed = 0
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for raw in src:
            if not raw.endswith(b"\n"):
                break
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError:
                row = None
            if isinstance(row, dict) and str(row.get("id")) in ids:
                removed += 1
                continue
            dst.write(raw)
    _replace(tmp, path)
    return [f"removed {removed} row(s) of {len(ids)} item(s) with errors from {path}; they "
            "are scored again"]


# -- Parquet ---------------------------------------------------------------------------------
def _parts(path: Path) -> list[Path]:
    return [p for p in sorted(path.iterdir()) if PART_RE.match(p.name)]


def _drop_from_parts(path: Path, ids: set[str]) -> int:
    """Rewrite the parts of ``path`` without the rows of ``ids``; the rows removed."""
    pa = _pa()
    import pyarrow.compute as pc

    wanted = pa.array(sorted(ids), pa.string())
    removed = 0
    for part in _parts(path):
        table = pa.parquet.read_table(part)
        keep = pc.invert(pc.is_in(table.column("id"), value_set=wanted))
        kept = table.filter(keep)
        if kept.num_rows == table.num_rows:
            continue
        removed += table.num_rows - kept.num_rows
        if kept.num_rows == 0:
            part.unlink()
            continue
        tmp = path / f".{part.name}.tmp"
        pa.parquet.write_table(kept, tmp)
        _replace(tmp, part)
    return removed


def _drop_parquet(path: Path) -> list[str]:
    pa = _pa()
    pairs = []
    for part in _parts(path):
        names = pa.parquet.read_schema(part).names
        columns = ["id"] + (["error"] if "error" in names else [])
        table = pa.parquet.read_table(part, columns=columns)
        errors = (table.column("error").to_pylist() if "error" in names
                  else [None] * table.num_rows)
        pairs.extend(zip(map(str, table.column("id").to_pylist()), errors))
    ids = _first_errors(pairs)
    if not ids:
        return []
    journal, tmp = path / JOURNAL, path / f"{JOURNAL}.tmp"
    tmp.write_text(json.dumps(sorted(ids)), encoding="utf-8")
    _replace(tmp, journal)
    removed = _drop_from_parts(path, ids)
    journal.unlink()
    return [f"removed {removed} row(s) of {len(ids)} item(s) with errors from {path}; they "
            "are scored again"]


# -- entry points ----------------------------------------------------------------------------
def drop_error_rows(output: str | os.PathLike) -> list[str]:
    """Remove the rows of the items with errors from the job output ``output`` (see the module
    docstring); notes on what was removed. Nothing to do for a stream or a missing output."""
    path = Path(output)
    if str(output) == "-" or is_stream(output) or not path.exists():
        return []
    if is_parquet(output):
        return _drop_parquet(path) if path.is_dir() else []
    return _drop_jsonl(path)


def finish_dropping(output: str | os.PathLike) -> list[str]:
    """Finish what an interrupted :func:`drop_error_rows` began on a Parquet output (the
    journal it left); notes on what was done."""
    path = Path(output)
    journal = path / JOURNAL
    if not (is_parquet(output) and path.is_dir() and journal.exists()):
        return []
    ids = set(json.loads(journal.read_text(encoding="utf-8")))
    removed = _drop_from_parts(path, ids)
    journal.unlink()
    return [f"finished removing the rows of {len(ids)} item(s) with errors from {path} "
            f"(an interrupted --retry-errors; {removed} more row(s) removed)"]
