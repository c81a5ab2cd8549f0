"""The trtllm stage of the GPU check: both judges built tiny, run through TensorRT-LLM's LLM API,
compared with the torch backend and timed.

    python benchmarks/gpu_check_trtllm.py OUT_DIR [--items 128] [--kinds flan-t5,qwen3.5]

For Flan-T5 (random ``small`` shape: d_kv 64, which TensorRT-LLM's attention kernels take) and
Qwen3.5 (random ``mini`` shape, head_dim 64), twice each: ``fastjudge build --dtype bf16`` and
``--dtype fp8`` (calibrated on the GPU). Each build's LAVE judge scores the same items through
``backend="trtllm"`` (the build directory) and the torch backend (its checkpoint, bfloat16 on
CUDA). Reported per build: rating agreement and max |Δp| between the two (BF16: the ratings must
be identical and |Δp| at most 0.02, else the stage fails; FP8: printed; a build the backend
refuses, such as FP8 Flan-T5 on a release whose T5 loader drops FP8 scales, is reported as
such), the build's own calibration agreement, whether the Choice log-probabilities passed the
backend's logits-processor check (else it read generation logits), and the wall time of each
backend over the items (after one warm-up call; TensorRT-LLM's load, compile and CUDA-graph
capture timed apart). Each build's LLM takes a small KV-cache share (:data:`KV_CACHE_FRACTION`)
and is shut down (``TrtllmBackend.close``) before the next one opens. Needs
TensorRT-LLM (``fastjudge[trtllm]``) and a CUDA device; prints why it skips otherwise. Writes
OUT_DIR/gpu_check_trtllm.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

BF16_MAX_DPROB = 0.02  # bf16 kernels differ in rounding; the probabilities may not differ more
# The share of free GPU memory each build's LLM takes for its KV cache: the builds here are tiny
# and run one after another in this process, beside the torch backend's copy of the same judge,
# so a small pool leaves room for both (each LLM is shut down before the next one opens).
KV_CACHE_FRACTION = 0.1


def why_not_here() -> str | None:
    import torch

    from fastjudge.backends.trtllm import trtllm_mismatch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return trtllm_mismatch("qwen3.5", "qwen3_5")


def tiny_sources(root: Path) -> dict[str, Path]:
    from fastjudge.checkpoints import build_random_qwen, build_random_t5
    from fastjudge.demo import tokenizer_corpus

    return {"flan-t5": build_random_t5(root / "flan-t5-src", tokenizer_corpus(), shape="small"),
            "qwen3.5": build_random_qwen(root / "qwen3_5-src", tokenizer_corpus(), shape="mini", seed=3)}


def items(n: int):
    from fastjudge.builders.calibration import load_examples

    sample = load_examples()[0]
    return [sample[i % len(sample)] for i in range(n)]


def timed_score(judge, examples) -> tuple[list, float]:
    judge.score(examples[:2])  # warm-up: first-call allocations, graph replays
    t0 = time.perf_counter()
    results = judge.score(examples)
    return results, time.perf_counter() - t0


def compare(a: list, b: list) -> dict:
    pairs = [(r, s) for r, s in zip(a, b) if r.error is None and s.error is None]
    same = sum(r.rating == s.rating for r, s in pairs)
    dp = max((abs(p - q) for r, s in pairs for p, q in zip(r.probs or (), s.probs or ())), default=None)
    # a differing rating where the torch backend's top two probabilities are this close is a
    # rounding tie (random weights give near-uniform probabilities); reported, not excused
    close = sum(r.rating != s.rating and _top2_gap(s) < 0.02 for r, s in pairs)
    return {"items": len(a), "scored_both": len(pairs), "ratings_identical": same,
            "differing_at_near_ties": close,
            "rating_agreement": same / len(pairs) if pairs else None, "max_abs_dprob": dp,
            "errors": sum(r.error is not None for r in a) + sum(s.error is not None for s in b)}


def _top2_gap(result) -> float:
    p = sorted(result.probs or (0.0, 0.0))
    return p[-1] - p[-2]


def check_build(kind: str, precision: str, source: Path, out: Path, examples: list, device: str = "cuda") -> dict:
    from fastjudge.backends.qwen.backend import TorchQwenBackend
    from fastjudge.backends.t5.backend import TorchT5Backend
    from fastjudge.backends.trtllm import TensorRTLLMUnavailable, TrtllmBackend
    from fastjudge.builders.cli import main as build_main
    from fastjudge.builders.manifest import read_manifest
    from fastjudge.judges.lave import LaveJudge

    t0 = time.perf_counter()
    rc = build_main(["build", kind, "--model", str(source), "--out", str(out), "--dtype", precision,
                     "--device", device, "--num-shots", "2", "--max-calib", "32", "--max-heldout", "16",
                     "--kv-cache-fraction", str(KV_CACHE_FRACTION)])
    r = {"build_rc": rc, "build_s": time.perf_counter() - t0}
    m = read_manifest(out)
    gate = m["agreement"].get("fp8") or m["agreement"]["bf16_checkpoint_torch"]
    r["calibration_agreement"] = {k: gate.get(k) for k in ("items", "rating_agreement", "spearman_soft_score",
                                                          "max_abs_dprob", "passed")}
    t0 = time.perf_counter()
    try:
        trt = TrtllmBackend(out)
    except TensorRTLLMUnavailable as refused:  # e.g. FP8 T5 on a release whose T5 loader drops scales
        r["refused"] = str(refused)
        return r
    try:  # the LLM is shut down whatever happens, so the next build's LLM gets its memory
        r["trtllm_load_s"] = time.perf_counter() - t0
        r["t5_logit_scale"] = trt.logit_scale
        r["max_input_tokens"] = trt.max_input_tokens  # T5: capped where the release clamps at 512
        cls = TorchT5Backend if kind == "flan-t5" else TorchQwenBackend
        ref = cls(out / m["artifacts"]["checkpoint"], device=device, dtype="bfloat16")
        ours, r["trtllm_s"] = timed_score(LaveJudge(trt, num_shots=2), examples)
        r["choice_from_generation_logits"] = trt.choice_from_logits  # True: the processor check failed
        theirs, r["torch_s"] = timed_score(LaveJudge(ref, num_shots=2), examples)
        r["trtllm_vs_torch"] = compare(ours, theirs)
        r["items_per_s"] = {"trtllm": len(examples) / r["trtllm_s"], "torch": len(examples) / r["torch_s"]}
        del ref
    finally:
        trt.close()
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--items", type=int, default=128)
    ap.add_argument("--kinds", default="flan-t5,qwen3.5")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    why = why_not_here()
    if why:
        report["skipped"] = why
        print(f"gpu_check_trtllm: skipped: {why}")
        (out / "gpu_check_trtllm.json").write_text(json.dumps(report, indent=2))
        return 0
    from importlib import metadata

    report["tensorrt_llm"] = metadata.version("tensorrt_llm")
    sources = tiny_sources(out)
    examples = items(args.items)
    failures = []
    for kind in args.kinds.split(","):
        for precision in ("bf16", "fp8"):
            name = f"{kind} {precision}"
            try:
                r = check_build(kind, precision, sources[kind], out / f"{kind}-{precision}", examples)
                c = r.get("trtllm_vs_torch")
                if c and precision == "bf16" and (c["ratings_identical"] != len(examples)
                                                   or (c["max_abs_dprob"] or 0) > BF16_MAX_DPROB):
                    failures.append(f"{name}: differs from the torch backend")
                if c and c["errors"]:
                    failures.append(f"{name}: error rows")
            except Exception:
                r = {"error": traceback.format_exc()[-3000:]}
                failures.append(f"{name}: {r['error'].strip().splitlines()[-1][:200]}")
            report[name] = r
            c = r.get("trtllm_vs_torch")
            if c:
                line = (f"ratings identical {c['ratings_identical']}/{c['items']}, max|dp| {c['max_abs_dprob']}, "
                        f"calibration agreement {r['calibration_agreement']['rating_agreement']}, "
                        f"trtllm {r['trtllm_s']:.2f} s vs torch {r['torch_s']:.2f} s over {len(examples)} items "
                        f"(load+compile {r['trtllm_load_s']:.0f} s)")
            else:
                line = "refused: " + r["refused"] if "refused" in r else "ERROR " + r["error"].splitlines()[-1]
            print(f"gpu_check_trtllm: {name}: {line}")
    report["failures"] = failures
    (out / "gpu_check_trtllm.json").write_text(json.dumps(report, indent=2, default=str))
    print("gpu_check_trtllm: " + ("FAILURES: " + "; ".join(failures) if failures else "all checks passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
