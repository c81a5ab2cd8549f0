"""``fastjudge rescore``: score a dataset with a registered judge, in one process or on a Ray
cluster, resumably.

    fastjudge rescore --judge lave --model /models/flan-t5-xl \\
        --input data.parquet --output scored.jsonl [--ray --num-workers 8]

Input: JSONL (the ``fastjudge lave`` layout) or Parquet (``*.parquet`` / ``*.pq``; columns are
the JSONL fields, see :mod:`fastjudge.io.parquet`). Output: JSONL, or, for a name ending in
``.parquet`` / ``.pq``, a directory of Parquet part files.

Rows: every input line/row gives exactly one output row, the same as ``fastjudge lave`` writes
(the input fields, the id resolved — ``line-N`` when absent — and the judge's result fields).
An item the judge cannot score (malformed JSON, missing or wrong fields, a prompt above the
model limit, a model failure on its batch) gets an error row: result fields null and
``error`` naming its line. A job never fails because of an item.

Resume: rerunning the same command skips every id already in the output and appends the rest
(JSONL: a partial last line of a killed run is cut off first; Parquet: new part files, see
:mod:`fastjudge.io.parquet`). Done ids are filtered out before any work is dispatched.

With ``--ray`` the driver (this process) reads the input, filters done ids and writes the
output; the scoring runs in a Ray Data ``map_batches`` over an actor pool of ``--num-workers``
actors, each of which builds ONE judge when it starts and scores batches of up to
``--chunk-size`` items. The driver hands the examples to Ray with ``ray.data.from_items``
(rather than ``read_json``/``read_parquet``) so that malformed lines, line-numbered ids and the
exact input fields behave as in one process; the input must therefore fit in the driver's
memory. ``--model`` must be a path every Ray node can read. Rows arrive, and are written, in
the order batches finish; as a set they equal the single-process output (probabilities agree
to float rounding: batch composition changes the summation order).
"""

from __future__ import annotations

import math
import os
import pickle
import sys
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from .io.jsonl import InputLine, read_jsonl
from .judges.registry import JUDGES, JudgeSpec, add_judge_options, get_judge


# -- rows ------------------------------------------------------------------------------------
def read_input(path: str) -> list[InputLine]:
    """Every input line (JSONL) or row (Parquet), before the output is touched."""
    if Path(path).is_dir():
        raise ValueError(f"{path} is a directory; --input takes one JSONL or Parquet file")
    from .io.parquet import is_parquet, read_parquet

    if is_parquet(path):
        return list(read_parquet(path))
    return list(read_jsonl(path))


def error_row(spec: JudgeSpec, line: InputLine) -> dict:
    """The row of a line that is not an item at all (malformed JSON, not an object)."""
    return {"id": line.id, **dict.fromkeys(spec.result_fields), "error": line.error}


def make_row(spec: JudgeSpec, line: InputLine, fields: dict) -> dict:
    """Input fields (id resolved) + result fields; an error names the line."""
    row = line.output_row()
    row.update({k: fields.get(k) for k in spec.result_fields})
    if fields.get("error"):
        row["error"] = f"line {line.line_no}: {fields['error']}"
    return row


def _failed(spec: JudgeSpec, message: str) -> dict:
    return {**dict.fromkeys(spec.result_fields), "error": message}


def prepare(spec: JudgeSpec, lines: Iterable[InputLine]):
    """Split lines into finished error rows and (line, example) pairs to score."""
    rows, todo = [], []
    for line in lines:
        if line.error:
            rows.append(error_row(spec, line))
            continue
        try:
            example = spec.example(line.item, line.id)
        except Exception as bad:  # noqa: BLE001 - any rejection of one item is that item's error
            rows.append(make_row(spec, line, _failed(spec, str(bad))))
            continue
        todo.append((line, example))
    return rows, todo


def score_examples(judge, spec: JudgeSpec, examples: Sequence) -> Iterator[tuple[int, dict]]:
    """(index into ``examples``, result fields) for every example, as results finish. If the
    judge fails (e.g. out of memory), the examples it had not finished get that error."""
    finished = set()
    try:
        for r in judge.stream(examples):
            finished.add(r.index)
            yield r.index, spec.fields_of(r)
    except Exception as bad:  # noqa: BLE001
        message = f"{type(bad).__name__}: {bad}"
        for i in range(len(examples)):
            if i not in finished:
                yield i, _failed(spec, message)


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def local_rows(judge, spec: JudgeSpec, todo: Sequence, chunk_size: int) -> Iterator[dict]:
    for chunk in _chunks(todo, max(1, chunk_size)):
        for i, fields in score_examples(judge, spec, [ex for _, ex in chunk]):
            yield make_row(spec, chunk[i][0], fields)


# -- Ray -------------------------------------------------------------------------------------
class WorkerFailure(RuntimeError):
    """The Ray job itself failed (an actor could not start, a node died, ...)."""


class RayScorer:
    """Ray Data ``map_batches`` callable: one judge per actor, built in ``__init__``. Batches
    are Arrow tables of ``pos`` (int) and ``example`` (pickled example); the answer holds
    ``pos`` and ``result`` (pickled result fields)."""

    def __init__(self, spec: JudgeSpec, args, threads: int | None = None):
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        self.spec = spec
        self.judge = spec.factory(args)

    def __call__(self, batch):
        import pyarrow as pa

        pos = batch.column("pos").to_pylist()
        examples = [pickle.loads(b) for b in batch.column("example").to_pylist()]
        out_pos, out = [], []
        for i, fields in score_examples(self.judge, self.spec, examples):
            out_pos.append(pos[i])
            out.append(pickle.dumps(fields))
        return pa.table({"pos": pa.array(out_pos, pa.int64()),
                         "result": pa.array(out, pa.binary())})


def _worker_resources(args, ray) -> tuple[int, float, float]:
    """(workers, CPUs per worker, GPUs per worker) for the cluster ``ray`` is connected to."""
    total = ray.cluster_resources()
    gpus = args.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if total.get("GPU", 0) >= 1 and args.device != "cpu" else 0.0
    workers = args.num_workers
    if workers is None:
        workers = (int(total.get("GPU", 0) // gpus) if gpus
                   else int(total.get("CPU", 1) // 8)) or 1
    cpus = args.cpus_per_worker
    if cpus is None:
        if gpus:
            cpus = 1.0
        else:  # the largest whole number of CPUs with which `workers` actors fit on the nodes
            nodes = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
            cpus = 1.0
            for c in range(int(max(nodes, default=1)), 0, -1):
                if sum(int(n // c) for n in nodes) >= workers:
                    cpus = float(c)
                    break
    return workers, cpus, gpus


def ray_rows(args, spec: JudgeSpec, todo: Sequence, chunk_size: int) -> Iterator[dict]:
    try:
        import ray
        import ray.data
    except ImportError:
        raise ValueError('--ray needs Ray Data: pip install "fastjudge[ray]"') from None
    if not todo:
        return
    started = False
    if not ray.is_initialized():
        ray.init(address=args.ray_address)
        started = True
    try:
        workers, cpus, gpus = _worker_resources(args, ray)
        total = ray.cluster_resources()
        if workers * cpus > total.get("CPU", 0) or workers * gpus > total.get("GPU", 0):
            print(f"fastjudge rescore: warning: {workers} workers x ({cpus:g} CPUs, {gpus:g} "
                  f"GPUs) exceed the cluster's {total.get('CPU', 0):g} CPUs, "
                  f"{total.get('GPU', 0):g} GPUs; only the workers that fit start",
                  file=sys.stderr)
        ray.data.DataContext.get_current().enable_progress_bars = False  # the job has its own
        n = len(todo)
        batch_size = max(1, min(chunk_size, math.ceil(n / workers)))
        ds = ray.data.from_items(
            [{"pos": i, "example": pickle.dumps(ex)} for i, (_, ex) in enumerate(todo)],
            override_num_blocks=math.ceil(n / batch_size))
        threads = int(cpus) if not gpus else None
        scored = ds.map_batches(
            RayScorer, fn_constructor_args=(spec, args, threads), batch_size=batch_size,
            batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=workers),
            num_cpus=cpus, num_gpus=gpus or None)
        print(f"fastjudge rescore: {n} items on {workers} Ray workers ({cpus:g} CPUs"
              f"{f', {gpus:g} GPUs' if gpus else ''} each), batches of {batch_size}",
              file=sys.stderr)
        batches = iter(scored.iter_batches(batch_format="pyarrow", batch_size=None))
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except Exception as bad:  # noqa: BLE001 - items never raise; the workers failed
                lines = [x for x in str(bad).strip().splitlines() if x.strip()]
                raise WorkerFailure(f"{type(bad).__name__}: {lines[-1] if lines else ''}") \
                    from bad
            for pos, result in zip(batch.column("pos").to_pylist(),
                                   batch.column("result").to_pylist()):
                yield make_row(spec, todo[pos][0], pickle.loads(result))
    finally:
        if started:
            ray.shutdown()


# -- the command -----------------------------------------------------------------------------
def _open_writer(args, spec: JudgeSpec, lines: Sequence[InputLine]):
    from .io.parquet import is_parquet

    if not is_parquet(args.output):
        return None  # the job's default: a resumable JSONL file
    from .io.parquet import ParquetPartWriter, output_schema

    schema, as_json = output_schema((line.output_row() for line in lines if line.item is not None),
                                    spec.result_fields, spec.result_types)
    writer = ParquetPartWriter(args.output, schema, as_json, rows_per_part=args.rows_per_part)
    if writer.removed_temporary:
        print(f"fastjudge: removed {writer.removed_temporary} unfinished part file(s) from "
              f"{args.output} (interrupted run)", file=sys.stderr)
    return writer


def run_rescore(args) -> int:
    from .io.jobs import JsonlJob

    spec = get_judge(args.judge)
    args.input = os.path.abspath(args.input)  # Ray actors get these arguments too
    if args.num_workers is not None and args.num_workers < 1:
        raise ValueError("--num-workers must be >= 1")
    judge = None if args.ray else spec.factory(args)  # a bad checkpoint fails before any output
    lines = read_input(args.input)
    writer = _open_writer(args, spec, lines)
    job = JsonlJob("rescore", args.output, means=spec.means, progress=not args.no_progress,
                   writer=writer)
    pending = [line for line in lines if line.id not in job.done]
    job.set_total(len(pending))
    failure = None
    try:
        rows, todo = prepare(spec, pending)
        for row in rows:
            job.emit(row)
        if args.ray:
            stream = ray_rows(args, spec, todo, args.chunk_size)
        else:
            stream = local_rows(judge, spec, todo, args.chunk_size)
        try:
            for row in stream:
                job.emit(row)
        except WorkerFailure as bad:
            failure = bad
    except KeyboardInterrupt:
        return job.interrupted()
    code = job.finish()
    if failure is not None:
        print(f"fastjudge rescore: error: the Ray workers failed ({failure}); the rows written "
              "so far are kept: rerun the same command to resume", file=sys.stderr)
        return 1
    return code


def add_rescore_parser(sub) -> None:
    """The ``fastjudge rescore`` subcommand."""
    from .cli import _add_lave_args, _add_model_args

    p = sub.add_parser(
        "rescore", help="score a JSONL or Parquet dataset with a judge, resumably, in one "
                        "process or on a Ray cluster (--ray)",
        description="Score a dataset with a registered judge (available: "
                    f"{', '.join(sorted(JUDGES))}). For lave, the rows are those of "
                    "`fastjudge lave`; rerunning the same command skips ids already in the "
                    "output.")
    p.add_argument("--judge", default="lave", choices=sorted(JUDGES),
                   help="judge (registry: fastjudge.judges.registry; default lave)")
    p.add_argument("--model", required=True,
                   help="local Hugging Face checkpoint directory (with --ray: readable on "
                        "every node)")
    p.add_argument("--input", required=True,
                   help="JSONL, or Parquet (*.parquet, *.pq) with the same fields as columns")
    p.add_argument("--output", required=True,
                   help="JSONL file, or for *.parquet / *.pq a directory of part files; "
                        "rerunning resumes, skipping ids already written")
    _add_model_args(p)
    _add_lave_args(p)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--rows-per-part", type=int, default=10000,
                   help="Parquet output: rows per part file (a killed run loses at most the "
                        "rows of its unwritten part; default 10000)")
    add_judge_options(p)
    ray = p.add_argument_group("Ray (--ray)")
    ray.add_argument("--ray", action="store_true",
                     help="score on a Ray cluster: an actor pool, one judge per actor")
    ray.add_argument("--num-workers", type=int, default=None,
                     help="actors (default: one per GPU when workers use GPUs, else one per "
                          "8 CPUs of the cluster, at least 1)")
    ray.add_argument("--cpus-per-worker", type=float, default=None,
                     help="CPUs per actor, also its torch threads (default: 1 with GPUs, else "
                          "the most that lets all actors fit on the nodes)")
    ray.add_argument("--gpus-per-worker", type=float, default=None,
                     help="GPUs per actor (default: 1 when the cluster has GPUs and --device "
                          "is not cpu, else 0)")
    ray.add_argument("--ray-address", default=None,
                     help="cluster to join (default: RAY_ADDRESS, else a local cluster)")
