"""What one decoding step costs the host, at 1, 8 and 64 rows: host synchronisations, aten ops and
wall time per decode step, under ``torch.profiler``.

A GPU runs a step as fast as the host can issue it: every ``int(tensor)`` / ``.item()`` (an
``aten::_local_scalar_dense`` event) and every device-to-host copy stalls its pipeline, and
every aten op is a kernel launch. A step shaped for the GPU costs the same few launches and one
copy whatever its row count. Two paths:

* **Qwen JSON** -- VisExMEM decomposition (JSON-constrained) on the tiny random-weight
  multimodal Qwen3.5 checkpoint: ``VisExJudge`` decomposition of N image-caption pairs, all rows
  decoding together; jump-forward on (a step is as wide as its rows' longest forced run, so wider
  on average with more rows) and off (every step one token a row).
* **T5 rationale** -- LAVE with a rationale on the tiny Flan-T5-shaped checkpoint: greedy text
  decoding of N items.

Only the decoding loop is counted (``fastjudge.bench.step_profile``): host syncs (scalar reads
and the engine's labelled copies to the host), top-level aten ops (and of them the views, which
run no kernel) and wall time per decode step, the prompts' own work (prefill, encoder, vision
tower) left out.

Steps run eagerly by default (``--compile off``, what ``auto`` gives on the CPU; on CUDA
``auto`` compiles, and its steps would count compile time); ``benchmarks/bench_compiled.py``
measures compiled steps.

Target for a GPU-shaped step: at most 2 syncs per step whatever the row count, and aten ops per
step independent of the row count (within 10 %).

    python benchmarks/bench_step_overhead.py                 # both paths, 1/8/64 rows
    python benchmarks/bench_step_overhead.py --rows 1 8 --paths qwen
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from fastjudge.bench.step_profile import profile_decoding
from fastjudge.engine_options import EngineOptions

sys.path.insert(0, str(Path(__file__).parent))


# -- Qwen JSON: VisExMEM decomposition ----------------------------------------------------------
def qwen_path(model_dir: Path, rows: int, jump_forward: bool, compile: str = "off") -> dict:
    from bench_visexmem_e2e import make_examples

    from fastjudge import VisExJudge

    judge = VisExJudge(model_dir, max_claims=3, max_claim_chars=40,
                       engine=EngineOptions(device="cpu", dtype="float32", max_batch_size=rows,
                                            max_batch_tokens=1 << 20, jump_forward=jump_forward,
                                            compile=compile))
    items, _ = judge.prepare(make_examples(rows, 448, 336))
    judge._decompose(list(items))  # warm-up: grammar compiled, image embeddings cached
    items, _ = judge.prepare(make_examples(rows, 448, 336))
    return profile_decoding(lambda: judge._decompose(list(items)))


# -- T5 rationale -------------------------------------------------------------------------------
def t5_path(model_dir: Path, rows: int, compile: str = "off") -> dict:
    from fastjudge import LaveJudge, VQAExample
    from fastjudge.demo import sample_rows

    judge = LaveJudge(model_dir, rationale=True, max_new_tokens=24,
                      engine=EngineOptions(device="cpu", dtype="float32", compile=compile))
    sample = sample_rows()
    examples = [VQAExample(r["question"], r["references"], r["prediction"], r.get("caption"), f"{r['id']}-{i}")
                for i, r in enumerate((sample * (rows // len(sample) + 1))[:rows])]
    judge.score(examples)  # warm-up
    return profile_decoding(lambda: judge.score(examples))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--paths", nargs="+", choices=["qwen", "t5"], default=["qwen", "t5"])
    p.add_argument("--jump-forward", nargs="+", choices=["on", "off"], default=["on", "off"])
    p.add_argument("--compile", choices=["off", "auto", "on"], default="off",
                   help="EngineOptions.compile (default off: the eager step)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "qwen" in args.paths:
            from bench_visexmem_e2e import build_biased

            qwen_dir = build_biased(tmp / "qwen", "tiny")
            for jf in args.jump_forward:
                for n in args.rows:
                    table.append((f"Qwen JSON (decompose, jump-forward {jf})", n,
                                  qwen_path(qwen_dir, n, jf == "on", args.compile)))
        if "t5" in args.paths:
            from fastjudge.checkpoints import build_random_t5
            from fastjudge.demo import tokenizer_corpus

            t5_dir = build_random_t5(tmp / "t5", tokenizer_corpus(), shape="tiny")
            for n in args.rows:
                table.append(("T5 rationale", n, t5_path(t5_dir, n, args.compile)))
    print(f"torch {torch.__version__}, cpu, {torch.get_num_threads()} threads, compile {args.compile}; "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"{'path':<38} {'rows':>5} {'steps':>6} {'syncs/step':>11} {'aten ops/step':>14} {'of them views':>14} "
          f"{'ms/step':>8}")
    for name, n, r in table:
        print(f"{name:<38} {n:>5} {r['steps']:>6} {r['syncs']:>11.1f} {r['ops']:>14.1f} {r['views']:>14.1f} "
              f"{r['ms']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
