"""Resumable file jobs: ``fastjudge lave``, ``visexmem``, ``vqa-acc`` and ``rescore`` all run
:func:`run_job`.

Input: JSONL, or Parquet (``*.parquet`` / ``*.pq``; columns are the JSONL fields, see
:mod:`.parquet`). Output: JSONL, or, for a name ending in ``.parquet`` / ``.pq``, a directory
of Parquet part files.

Rows: every input line/row gives exactly one output row: the input fields (the id resolved,
``line-N`` when absent) and the result fields. An item that cannot be scored (malformed JSON,
not an object, rejected when made an example or by the judge, or failing alone where the items
around it score) gets an error row: result fields null and ``error`` naming its line. A job
never fails because of an item.

Failures of the system are never rows (:mod:`fastjudge.runtime.failures`): out of memory splits
the batch down to single items (one that still runs out of memory alone is an item error naming
its size); any other failure is retried ``retries`` times with a short pause, and then stops the
job: the rows finished so far are written, the unfinished items are not, and the same command
resumes them. Exit codes (docs/jobs.md): :data:`EXIT_OK`, :data:`EXIT_ITEM_ERRORS`,
:data:`EXIT_TOO_MANY_ERRORS`, :data:`EXIT_SYSTEM_FAILURE`, :data:`EXIT_INTERRUPTED`.
``max_errors`` stops a job whose item errors pass it. ``retry_errors`` first removes the rows
of an existing output whose item has an error (:mod:`.retry_errors`), so that the job scores
them again.

Repeated ids: each id is scored once, at its first line; every later line with the same id
gets an error row naming that first line (``line 7: id 'a' repeats line 3; each id is scored
once``). A repeat's row is written after its first line's row, so the rows of each id in the
output of a killed run are those of its first lines, and resuming adds exactly the rows an
uninterrupted run would have written after them.

Resume: rerunning the same command skips the lines whose rows are already in the output and
appends the rest: an id with ``k`` rows there has its first ``k`` lines done (JSONL: a partial
last line of a killed run is cut off and corrupt lines are removed first; Parquet: new part
files). Done lines are filtered out before any work is dispatched. Output to standard output
(``--output -``), a pipe or a device is a stream and is not resumed (:mod:`.jsonl`).

Scoring: in this process, ``chunk_size`` items at a time, each row written as soon as the
judge's batch holding it finishes; or on a Ray actor pool (:mod:`.ray_pool`). A progress bar
and a summary go to stderr; on Ctrl-C the job says that rerunning resumes.

What a job scores with is duck-typed (:class:`fastjudge.judges.registry.JudgeSpec` and the
judges fit): a *spec* with ``example(item, id)`` (may raise: an error row), ``fields_of(result)``,
``result_fields``, ``result_types`` (Parquet column types) and ``means`` (summary labels), and
a *judge* whose ``stream(examples)`` yields results carrying ``index`` (into ``examples``).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from functools import partial
from itertools import chain, islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..runtime.failures import FailedItem, RetryPolicy, SystemFailure, resilient_stream
from .job_output import (  # noqa: F401 (re-exported)
    EXIT_INTERRUPTED,
    EXIT_ITEM_ERRORS,
    EXIT_OK,
    EXIT_SYSTEM_FAILURE,
    EXIT_TOO_MANY_ERRORS,
    JobOutput,
    TooManyErrors,
)
from .jsonl import STDOUT, InputLine, read_jsonl
from .parquet import is_parquet
from .ray_pool import WorkerFailure, score_on_ray
from .retry_errors import drop_error_rows, finish_dropping


# -- input -----------------------------------------------------------------------------------
def read_input(path: str, input_format: str = "auto", references=None) -> Iterator[InputLine]:
    """Every input line (JSONL) or row (Parquet, or a harness output: see
    :mod:`.harness_formats`). Opens the file, and reads its first item, before returning, so a
    bad path fails before any output is touched. ``references``: an lmms-eval sample log's
    :class:`.harness_formats.References`."""
    if Path(path).is_dir():
        raise ValueError(f"{path} is a directory; --input takes one JSONL or Parquet file")
    from . import harness_formats

    if input_format == "auto":
        input_format = harness_formats.detect_format(path)
    if references is not None and input_format != "lmms-eval":
        raise ValueError(f"--references applies to lmms-eval sample logs; {path} is read as "
                         f"{input_format}")
    if input_format == "lmms-eval":
        lines = harness_formats.read_lmms_eval(path, references)
    elif input_format == "vlmevalkit":
        lines = harness_formats.read_vlmevalkit(path)
    elif input_format == "parquet" or (input_format != "jsonl" and is_parquet(path)):
        from .parquet import read_parquet

        lines = read_parquet(path)
    else:
        lines = read_jsonl(path)
    first = list(islice(lines, 1))
    return chain(first, lines)


# -- rows ------------------------------------------------------------------------------------
def error_row(spec, line: InputLine) -> dict:
    """The row of a line that is not an item at all (malformed JSON, not an object)."""
    return {"id": line.id, **dict.fromkeys(spec.result_fields), "error": line.error}


def make_row(spec, line: InputLine, fields: dict) -> dict:
    """Input fields (id resolved) + result fields; an error names the line."""
    row = line.output_row()
    row.update({k: fields.get(k) for k in spec.result_fields})
    if fields.get("error"):
        row["error"] = f"line {line.line_no}: {fields['error']}"
    return row


def _failed(spec, message: str) -> dict:
    return {**dict.fromkeys(spec.result_fields), "error": message}


def repeat_row(spec, line: InputLine, first_line_no: int) -> dict:
    """The error row of a line whose id an earlier line has (see the module docstring)."""
    return make_row(spec, line, _failed(spec, f"id {line.id!r} repeats line {first_line_no}; "
                                              "each id is scored once"))


def fresh_lines(lines: Iterable[InputLine], done: Counter) -> Iterator[tuple[InputLine, int | None]]:
    """The lines whose rows are not in the output yet (``done``: rows per id there), each with
    the line number of the first line of its id when it repeats one, else ``None``."""
    seen: dict[str, list[int]] = {}  # id -> [its first line number, lines read with it]
    for line in lines:
        entry = seen.setdefault(line.id, [line.line_no, 0])
        entry[1] += 1
        if entry[1] > done[line.id]:
            yield line, entry[0] if entry[1] > 1 else None


def _prepare_line(spec, line: InputLine) -> tuple[dict | None, Any]:
    """(its error row, None) for a line that is no valid example, else (None, the example)."""
    if line.error:
        return error_row(spec, line), None
    try:
        return None, spec.example(line.item, line.id)
    except Exception as bad:  # noqa: BLE001 - any rejection of one item is that item's error
        return make_row(spec, line, _failed(spec, str(bad))), None


def prepare(spec, lines: Iterable[InputLine]) -> tuple[list[dict], list[tuple[InputLine, Any]]]:
    """Split lines into finished error rows and (line, example) pairs to score."""
    rows, todo = [], []
    for line in lines:
        row, example = _prepare_line(spec, line)
        if row is None:
            todo.append((line, example))
        else:
            rows.append(row)
    return rows, todo


def score_examples(judge, spec, examples: Sequence,
                   policy: RetryPolicy | None = None) -> Iterator[tuple[int, dict]]:
    """(index into ``examples``, result fields) for every example, as results finish, the judge
    run by :func:`fastjudge.runtime.failures.resilient_stream`: raises
    :class:`~fastjudge.runtime.failures.SystemFailure` (never an item's row) when retrying
    does not help."""
    for r in resilient_stream(judge, examples, policy):
        if isinstance(r, FailedItem):
            yield r.index, _failed(spec, r.error)
        else:
            yield r.index, result_fields(spec, r)


def result_fields(spec, result) -> dict:
    """The row fields of one result. An item error's row has its result fields null: a judge's
    empty containers (VisExMEM's ``claims: []``, holistic ``probs: []``) become null, what it
    did record (warnings, prompt tokens) stays."""
    fields = spec.fields_of(result)
    if fields.get("error") is None:
        return fields
    return {k: None if isinstance(v, (list, dict)) and not v else v for k, v in fields.items()}


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def local_rows(judge, spec, todo: Sequence, chunk_size: int,
               policy: RetryPolicy | None = None) -> Iterator[dict]:
    """Rows of prepared (line, example) pairs, scored in this process ``chunk_size`` at a
    time."""
    for chunk in _chunks(todo, max(1, chunk_size)):
        for i, fields in score_examples(judge, spec, [ex for _, ex in chunk], policy):
            yield make_row(spec, chunk[i][0], fields)


def _rows_as_read(judge, spec, fresh: Iterable[tuple[InputLine, int | None]],
                  chunk_size: int, policy: RetryPolicy | None = None) -> Iterator[dict]:
    """Rows of the ``fresh_lines``, read as the job goes: an error row as soon as its line is
    read (a repeat's once its first line's row is out), the items scored ``chunk_size`` at a
    time."""
    chunk_size = max(1, chunk_size)
    todo, pending, waiting = [], set(), []  # waiting: repeats of ids pending in todo
    for line, first in fresh:
        if first is not None:
            row = repeat_row(spec, line, first)
            if line.id in pending:
                waiting.append(row)
            else:
                yield row
            continue
        row, example = _prepare_line(spec, line)
        if row is not None:
            yield row
            continue
        todo.append((line, example))
        pending.add(line.id)
        if len(todo) == chunk_size:
            yield from local_rows(judge, spec, todo, chunk_size, policy)
            yield from waiting
            todo, pending, waiting = [], set(), []
    yield from local_rows(judge, spec, todo, chunk_size, policy)
    yield from waiting


def _rows_on_ray(pool, spec, build_judge, fresh: Sequence[tuple[InputLine, int | None]],
                 chunk_size: int, label: str, policy: RetryPolicy | None = None) -> Iterator[dict]:
    """Rows of the ``fresh_lines``, the items scored on Ray; repeats last, after every first
    line's row."""
    done_rows, todo = prepare(spec, [line for line, first in fresh if first is None])
    scored = score_on_ray(pool, partial(_judge_scorer, spec, build_judge, policy),
                          [ex for _, ex in todo], chunk_size, label)
    yield from done_rows
    yield from (make_row(spec, todo[i][0], fields) for i, fields in scored)
    yield from (repeat_row(spec, line, first) for line, first in fresh if first is not None)


def _judge_scorer(spec, build_judge: Callable[[], Any], policy: RetryPolicy | None = None):
    """A Ray actor's scorer: the judge is built once, in the actor. A system failure there
    fails the actor's batch, and so the Ray job (:class:`.ray_pool.WorkerFailure`)."""
    return partial(score_examples, build_judge(), spec, policy=policy)


def open_writer(spec, output: str, lines: Sequence[InputLine], rows_per_part: int):
    """The Parquet part writer for a ``*.parquet`` / ``*.pq`` output (its schema from all
    input ``lines``), else ``None``: the job's resumable JSONL file."""
    if not is_parquet(output):
        return None
    from .parquet import ParquetPartWriter, output_schema

    schema, as_json = output_schema(
        (line.output_row() for line in lines if line.item is not None), spec.result_fields,
        spec.result_types)
    return ParquetPartWriter(output, schema, as_json, rows_per_part=rows_per_part)


# -- the job ---------------------------------------------------------------------------------
def max_errors_value(text: str) -> float:
    """``--max-errors``: a count (``20``) or a fraction of the job's items (``0.05``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0 or (value >= 1 and value != int(value)):
        raise argparse.ArgumentTypeError("a count (0, 1, 2, ...) or a fraction below 1 (0.05)")
    return int(value) if value >= 1 or value == 0 else value


def error_ceiling(max_errors: float | None, items: int) -> int | None:
    """The most item errors a job of ``items`` items takes (``max_errors``: a count, or a
    fraction in (0, 1) of the items)."""
    if max_errors is None:
        return None
    if 0 < max_errors < 1:
        return int(max_errors * items)
    return int(max_errors)


def job_options(args) -> dict:
    """The keyword arguments of :func:`run_job` that :func:`add_job_arguments` adds."""
    return {"retries": args.retries, "max_errors": args.max_errors,
            "retry_errors": args.retry_errors}


def add_job_arguments(parser, input_help: str, output_help: str, chunk_size: int | None = None,
                      chunk_help: str | None = None) -> None:
    """A file job's command-line arguments: ``--input``, ``--output``, ``--chunk-size`` (when
    the command has a ``chunk_size`` default), ``--no-progress`` and the failure handling
    (``--retries``, ``--max-errors``, ``--retry-errors``; see :func:`job_options`)."""
    parser.add_argument("--input", required=True, help=input_help)
    parser.add_argument("--output", required=True,
                        help=f"{output_help}. '{STDOUT}': standard output, as are pipes and "
                             "devices: streamed, never resumed")
    if chunk_size is not None:
        parser.add_argument("--chunk-size", type=int, default=chunk_size, help=chunk_help)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--retries", type=int, default=2,
                        help="times a batch that failed (a CUDA error, a backend exception) runs "
                             "again after a short pause before the job stops with exit 75 "
                             "(out of memory instead splits the batch; default 2)")
    parser.add_argument("--max-errors", type=max_errors_value, default=None, metavar="N",
                        help="stop with exit 4 once more than N items (or, for N below 1, that "
                             "fraction of the items) are error rows (default: no limit; "
                             "exit 3 says some rows are errors)")
    parser.add_argument("--retry-errors", action="store_true",
                        help="score again the items whose rows in the existing output are "
                             "errors, replacing those rows")


def run_job(name: str, spec, build_judge: Callable[[], Any], input_path: str,
            output_path: str, *, chunk_size: int, progress: bool = True,
            rows_per_part: int = 10000, pool=None, stream: bool = False,
            input_format: str = "auto", retries: int = 2, backoff_s: float = 0.5,
            max_errors: float | None = None, retry_errors: bool = False, references=None) -> int:
    """Score the file ``input_path`` into ``output_path`` (see the module docstring); returns
    the exit status (``EXIT_*``: 0 all scored, 3 some item errors, 4 ``max_errors`` passed,
    75 a system failure stopped it, 130 Ctrl-C).

    ``retries`` / ``backoff_s``: how a failed batch is retried
    (:class:`fastjudge.runtime.failures.RetryPolicy`). ``max_errors``: a count, or a fraction
    in (0, 1) of the job's items. ``retry_errors``: score again the items whose rows in the
    existing output are errors.

    ``build_judge()`` makes the judge: here before the input is read (a bad checkpoint fails
    before any output exists), or, with ``pool`` (a :class:`.ray_pool.RayPool`), once in each
    Ray actor. ``stream``: read the input as the job goes (for cheap items in large files; the
    progress bar then has no total); Parquet output and Ray read it all first anyway.
    """
    policy = RetryPolicy(retries=retries, backoff_s=backoff_s)
    judge = None if pool is not None else build_judge()
    lines: Iterable[InputLine] = read_input(input_path, input_format, references)
    fraction = max_errors is not None and 0 < max_errors < 1  # of a total known up front
    if not stream or pool is not None or is_parquet(output_path) or fraction:
        lines = list(lines)
    repaired = finish_dropping(output_path)
    if retry_errors:
        repaired.extend(drop_error_rows(output_path))
    job = JobOutput(name, output_path, spec.means, progress,
                    open_writer(spec, output_path, lines, rows_per_part))
    for note in repaired:
        print(f"fastjudge: {note}", file=sys.stderr)
    # a snapshot: the rows this run writes must not count as done for the lines still to come
    fresh: Iterable = fresh_lines(lines, Counter(job.done))
    if isinstance(lines, list):
        fresh = list(fresh)
        job.set_total(len(fresh))
    job.max_errors = error_ceiling(max_errors, len(fresh) if isinstance(fresh, list) else 0)
    try:
        if pool is None:
            rows = _rows_as_read(judge, spec, fresh, chunk_size, policy)
        else:
            rows = _rows_on_ray(pool, spec, build_judge, fresh, chunk_size, f"fastjudge {name}",
                                policy)
        for row in rows:
            job.emit(row)
    except KeyboardInterrupt:
        return job.interrupted()
    except (SystemFailure, WorkerFailure) as failure:
        return job.stopped(failure)
    except TooManyErrors:
        return job.too_many_errors()
    return job.finish()
