"""Scoring on a Ray cluster: a Ray Data ``map_batches`` over an actor pool, each actor building
ONE scorer when it starts (``fastjudge rescore --ray``; needs ``pip install "fastjudge[ray]"``).

The driver hands the examples to Ray with ``ray.data.from_items`` (rather than
``read_json``/``read_parquet``) so that malformed lines, line-numbered ids and the exact input
fields behave as in one process; the examples must therefore fit in the driver's memory.
Results arrive in the order batches finish.

Failures: each actor's scorer handles out of memory and retries itself
(:func:`fastjudge.runtime.failures.resilient_stream`); a failure it cannot cure, or an actor that
dies, fails the Ray job, raised here as :class:`WorkerFailure`, a system failure: the job stops
and is resumed by rerunning it, and no item gets an error row for it.
"""

from __future__ import annotations

import math
import pickle
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

# make_scorer() -> score(examples) -> (index into examples, result fields) for each example
Scorer = Callable[[Sequence], Iterator[tuple[int, dict]]]


class WorkerFailure(RuntimeError):
    """The Ray job itself failed (an actor could not start, a node died, a batch had a system
    failure its actor's retries did not cure, ...)."""


@dataclass(frozen=True)
class RayPool:
    """The actor pool; ``None`` picks the default described at each field.

    * ``workers``: one per GPU when workers use GPUs, else one per 8 CPUs of the cluster.
    * ``cpus_per_worker`` (also the actor's torch threads): 1 with GPUs, else the most that
      lets all actors fit on the nodes.
    * ``gpus_per_worker``: 1 when the cluster has GPUs and ``use_gpus``, else 0.
    * ``address``: the cluster to join (default: ``RAY_ADDRESS``, else a local cluster).
    """

    workers: int | None = None
    cpus_per_worker: float | None = None
    gpus_per_worker: float | None = None
    address: str | None = None
    use_gpus: bool = True

    def resources(self, ray) -> tuple[int, float, float]:
        """(workers, CPUs per worker, GPUs per worker) for the cluster ``ray`` is connected to."""
        total = ray.cluster_resources()
        gpus = self.gpus_per_worker
        if gpus is None:
            gpus = 1.0 if total.get("GPU", 0) >= 1 and self.use_gpus else 0.0
        workers = self.workers
        if workers is None:
            workers = (int(total.get("GPU", 0) // gpus) if gpus
                       else int(total.get("CPU", 1) // 8)) or 1
        cpus = self.cpus_per_worker
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


class ActorScorer:
    """Ray Data ``map_batches`` callable: one scorer per actor, made in ``__init__``. Batches
    are Arrow tables of ``pos`` (int) and ``example`` (pickled example); the answer holds
    ``pos`` and ``result`` (pickled result fields)."""

    def __init__(self, make_scorer: Callable[[], Scorer], threads: int | None = None):
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        self.score = make_scorer()

    def __call__(self, batch):
        import pyarrow as pa

        pos = batch.column("pos").to_pylist()
        examples = [pickle.loads(b) for b in batch.column("example").to_pylist()]
        out_pos, out = [], []
        for i, fields in self.score(examples):
            out_pos.append(pos[i])
            out.append(pickle.dumps(fields))
        return pa.table({"pos": pa.array(out_pos, pa.int64()),
                         "result": pa.array(out, pa.binary())})


def score_on_ray(pool: RayPool, make_scorer: Callable[[], Scorer], examples: Sequence,
                 batch_size: int, label: str) -> Iterator[tuple[int, dict]]:
    """(index into ``examples``, result fields) for every example, as Ray batches finish;
    batches hold at most ``batch_size`` examples. ``label`` starts the lines printed on
    stderr. Raises :class:`WorkerFailure` when the Ray job fails."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise ValueError('--ray needs Ray Data: pip install "fastjudge[ray]"') from None
    if not examples:
        return
    started = False
    if not ray.is_initialized():
        ray.init(address=pool.address)
        started = True
    try:
        workers, cpus, gpus = pool.resources(ray)
        total = ray.cluster_resources()
        if workers * cpus > total.get("CPU", 0) or workers * gpus > total.get("GPU", 0):
            print(f"{label}: warning: {workers} workers x ({cpus:g} CPUs, {gpus:g} GPUs) exceed "
                  f"the cluster's {total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs; "
                  "only the workers that fit start", file=sys.stderr)
        ray.data.DataContext.get_current().enable_progress_bars = False  # the job has its own
        n = len(examples)
        batch_size = max(1, min(batch_size, math.ceil(n / workers)))
        ds = ray.data.from_items([{"pos": i, "example": pickle.dumps(ex)}
                                  for i, ex in enumerate(examples)],
                                 override_num_blocks=math.ceil(n / batch_size))
        threads = int(cpus) if not gpus else None
        scored = ds.map_batches(
            ActorScorer, fn_constructor_args=(make_scorer, threads), batch_size=batch_size,
            batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=workers),
            num_cpus=cpus, num_gpus=gpus or None)
        print(f"{label}: {n} items on {workers} Ray workers ({cpus:g} CPUs"
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
                yield pos, pickle.loads(result)
    finally:
        if started:
            ray.shutdown()
