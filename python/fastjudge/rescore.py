"""``fastjudge rescore``: score a dataset with a registered judge, in one process or on a Ray
cluster, resumably.

    fastjudge rescore --judge lave --model /models/flan-t5-xl \\
        --input data.parquet --output scored.jsonl [--ray --num-workers 8]

The job is :func:`fastjudge.io.jobs.run_job`, as for ``fastjudge lave``: JSONL or Parquet in
and out, one output row per input line/row (for lave the rows ``fastjudge lave`` writes),
per-item error rows, resumption by id, the same failure handling and exit codes (``--retries``,
``--max-errors``, ``--retry-errors``; docs/jobs.md). The judge's options come from its
declaration in :mod:`fastjudge.judges.registry`.

With ``--ray`` this process reads the input, filters done ids and writes the output; the
scoring runs in a Ray Data ``map_batches`` over an actor pool of ``--num-workers`` actors
(:mod:`fastjudge.io.ray_pool`), each of which builds ONE judge when it starts and scores
batches of up to ``--chunk-size`` items. The input must fit in this process's memory, and
``--model`` must be a path every Ray node can read. Rows arrive, and are written, in the order
batches finish; as a set they equal the single-process output (probabilities agree to float
rounding: batch composition changes the summation order). Each actor handles out of memory and
retries as one process does; a system failure it cannot cure fails its batch, and the job then
stops as one process does (exit 75; rerunning resumes).
"""

from __future__ import annotations

import os
from functools import partial

from .io.harness_formats import FORMATS, References
from .io.jobs import add_job_arguments, job_options, run_job
from .io.ray_pool import RayPool
from .judges.registry import JUDGES, add_judge_options, get_judge


def run_rescore(args) -> int:
    spec = get_judge(args.judge)
    args.input = os.path.abspath(args.input)  # Ray actors get these arguments too
    if args.num_workers is not None and args.num_workers < 1:
        raise ValueError("--num-workers must be >= 1")
    pool = RayPool(workers=args.num_workers, cpus_per_worker=args.cpus_per_worker,
                   gpus_per_worker=args.gpus_per_worker, address=args.ray_address,
                   use_gpus=args.device != "cpu") if args.ray else None
    return run_job("rescore", spec, partial(spec.factory, args), args.input, args.output,
                   chunk_size=args.chunk_size, progress=not args.no_progress,
                   rows_per_part=args.rows_per_part, pool=pool,
                   input_format=getattr(args, "input_format", "auto"),
                   references=references_of(args), **job_options(args))


def references_of(args) -> References | None:
    """``--references``: an lmms-eval sample log's references from its task's dataset."""
    path = getattr(args, "references", None)
    if path is None:
        return None
    return References(os.path.abspath(path), args.references_column, args.references_id_column)


def add_rescore_parser(sub) -> None:
    """The ``fastjudge rescore`` subcommand."""
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
    add_job_arguments(
        p, input_help="JSONL, or Parquet (*.parquet, *.pq) with the same fields as columns",
        output_help="JSONL file, or for *.parquet / *.pq a directory of part files; rerunning "
                    "resumes, skipping ids already written", chunk_size=1024,
        chunk_help="items planned together (with --ray: the most per batch); results are "
                   "written as batches finish")
    p.add_argument("--input-format", default="auto", choices=FORMATS,
                   help="auto (default): JSONL whose first record has doc_id and resps is "
                        "an lmms-eval sample log, .tsv/.xlsx (or a .json array) is a VLMEvalKit "
                        "prediction file, else JSONL or Parquet by extension (docs/jobs.md)")
    p.add_argument("--references", default=None, metavar="FILE",
                   help="lmms-eval sample logs: take the references from the task's dataset, a "
                        "JSONL or Parquet file with one row per document, joined on doc_id "
                        "(the log keeps one target per sample; docs/jobs.md)")
    p.add_argument("--references-column", default="answers", metavar="NAME",
                   help="--references: the column holding the references (default answers)")
    p.add_argument("--references-id-column", default=None, metavar="NAME",
                   help="--references: the document id column (default: doc_id when the file "
                        "has it, else the row's 0-based position, as lmms-eval numbers docs)")
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
