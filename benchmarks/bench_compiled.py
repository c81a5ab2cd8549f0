"""Compiled against eager decoding steps: the Qwen backend with ``compile="on"`` and ``"off"``
on the same random-weight checkpoint, requests and device.

Two workloads, each N rows sharing a prefix (its state computed once and kept, so what is timed
is the suffixes and the decoding): JSON-constrained decoding under VisExMEM's
decomposition schema (jump-forward on, so steps of one and of several tokens) and greedy text
with tracked rating logits (LAVE's rationale spec). Prints, for each: tokens/s both ways
(medians over ``--repeats`` after a warm-up run that compiles), the ratio, host
synchronisations and aten ops per decode step (``bench.step_profile``), the compile time, and
whether the outputs agree (tokens identical, tracked logits within 1e-4). On CUDA the compiled
step replays CUDA graphs (one per shape bucket), so the ratio there is what the launches cost.

    python benchmarks/bench_compiled.py --shape tiny --rows 8 --repeats 3
    python benchmarks/bench_compiled.py --device cuda --shape mini --rows 1 16 64
    python benchmarks/bench_compiled.py --device cuda --rows 1 16 --cuda-graph-report

``--cuda-graph-report`` (the GPU check's compiled-step stage): after each row of the table, a
``graphs`` line with the CUDA-graph replays of one more compiled run and its decode steps
(replays per step), and every graph inductor skipped: its "skipping cudagraphs" messages
(``perf_hints`` logging, switched on here) and its ``cudagraph_skips`` counter. Exit 1 when a
graph was skipped, or when on CUDA a compiled run replayed none.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fastjudge.backends.qwen.backend import TorchQwenBackend
from fastjudge.bench.step_profile import profile_decoding
from fastjudge.checkpoints import QWEN_SHAPES, build_random_qwen
from fastjudge.demo import tokenizer_corpus
from fastjudge.judges.visexmem.schemas import parts_schema
from fastjudge.runtime.grammar import Json
from fastjudge.runtime.requests import Request, Text

sys.path.insert(0, str(Path(__file__).parent))
from bench_device import DEVICES, bench_device, device_label  # noqa: E402


def workloads(rows: int, max_new: int) -> dict[str, list[Request]]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(5, 900, size=48)
    suffixes = [rng.integers(5, 900, size=6 + i % 5) for i in range(rows)]
    specs = {"json": Json.from_schema(parts_schema(3, 24), max_new),
             "text": Text(max_new, track_ids=(3, 10, 11))}
    return {name: [Request(i, np.concatenate([prefix, s]), spec, prefix_len=len(prefix))
                   for i, s in enumerate(suffixes)] for name, spec in specs.items()}


def timed(backend, reqs, repeats: int):
    seconds, outs = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        outs = backend.run(reqs)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), outs


def agree(a, b) -> bool:
    for x, y in zip(a, b):
        if x.token_ids != y.token_ids:
            return False
        if x.tracked_logits is not None and len(x.tracked_logits) and \
                np.abs(x.tracked_logits - y.tracked_logits).max() > 1e-4:
            return False
    return True


class GraphWatch:
    """CUDA-graph replays (every ``torch.cuda.CUDAGraph.replay``, which inductor's CUDA-graph
    trees call to run a recorded step) and the graphs inductor skipped: its "skipping
    cudagraphs" records (``torch._inductor.cudagraph_utils.log_cudagraph_skip_and_bump_counter``
    logs them to the ``cudagraphs`` artifact; ``perf_hints`` carries the other hints) and the
    ``cudagraph_skips`` counter it bumps (``torch._dynamo.utils.counters["inductor"]``). Both
    artifacts are switched on; torch's loggers do not propagate past ``torch._inductor``, so the
    handler sits there."""

    SKIP = "skipping cudagraphs"

    def __init__(self):
        import logging

        import torch._logging

        self.replays, self.skip_messages = 0, []
        torch._logging.set_logs(perf_hints=True, cudagraphs=True)
        handler = logging.Handler()
        handler.emit = self._record
        logging.getLogger("torch._inductor").addHandler(handler)
        original = torch.cuda.CUDAGraph.replay

        def replay(graph, *args, **kwargs):
            self.replays += 1
            return original(graph, *args, **kwargs)

        torch.cuda.CUDAGraph.replay = replay

    def _record(self, record) -> None:
        message = record.getMessage()
        if self.SKIP in message:
            self.skip_messages.append(message)

    @staticmethod
    def skip_counter() -> int:
        from torch._dynamo.utils import counters

        return int(counters["inductor"].get("cudagraph_skips", 0))

    def skipped(self) -> int:
        return max(len(self.skip_messages), self.skip_counter())

    def report(self, backend, reqs, device) -> tuple[str, bool]:
        """One more compiled run of ``reqs``: its replays per decode step, as a line, and whether
        it passed (no skipped graph; on CUDA at least one replay)."""
        before = self.replays
        backend.reset_decode_stats()
        backend.run(reqs)
        replays = self.replays - before
        steps = backend.decode_stats["decode_steps"]
        per = f"{replays / steps:.2f}" if steps else "?"
        ok = self.skipped() == 0 and (device.type != "cuda" or replays > 0)
        line = (f"graphs {replays} replays over {steps} decode steps ({per} per step), "
                f"{self.skipped()} skipped" + (f": {self.skip_messages[-1][:200]}" if self.skip_messages else "")
                + ("" if ok else "  FAIL"))
        return line, ok


def per_step(backend, reqs) -> dict:
    return profile_decoding(lambda: backend.run(reqs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(QWEN_SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[8])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=DEVICES)
    ap.add_argument("--cuda-graph-report", action="store_true",
                    help="count CUDA-graph replays per decode step and fail on a skipped graph (see above)")
    args = ap.parse_args(argv)
    device = bench_device(args.device)
    watch = GraphWatch() if args.cuda_graph_report else None
    bad = False
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_qwen(Path(tmp), tokenizer_corpus(), arch="qwen3_5", seed=3, shape=args.shape)
        backends = {mode: TorchQwenBackend(model_dir, device=str(device), dtype="float32", compile=mode)
                    for mode in ("off", "on")}
        print(f"{device_label(device)}, Qwen3.5 {args.shape}, float32, torch {torch.__version__}")
        print(f"{'workload':<6} {'rows':>4} {'eager tok/s':>12} {'compiled tok/s':>15} {'ratio':>6} "
              f"{'syncs/step e/c':>15} {'ops/step e/c':>14} {'compile s':>10}  outputs")
        for rows in args.rows:
            for name, reqs in workloads(rows, args.max_new_tokens).items():
                results = {}
                for mode, backend in backends.items():
                    backend.run(reqs)  # warm-up (compiles this shape)
                    seconds, outs = timed(backend, reqs, args.repeats)
                    tokens = sum(len(o.token_ids) + o.finished for o in outs)
                    results[mode] = (tokens / seconds, outs, per_step(backend, reqs))
                same = agree(results["off"][1], results["on"][1])
                bad |= not same
                (e, _, pe), (c, _, pc) = results["off"], results["on"]
                print(f"{name:<6} {rows:>4} {e:>12.1f} {c:>15.1f} {c / e:>6.2f} "
                      f"{pe['syncs']:>7.1f}/{pc['syncs']:<7.1f} {pe['ops']:>6.0f}/{pc['ops']:<7.0f} "
                      f"{backends['on'].compile_seconds:>10.1f}  {'identical' if same else 'MISMATCH'}", flush=True)
                if watch is not None:
                    line, ok = watch.report(backends["on"], reqs, device)
                    bad |= not ok
                    print(f"{'':<6} {rows:>4} {line}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
