"""`fastjudge demo`: LAVE end to end on a fresh machine, with no downloaded model.

Builds once (cached) a random-weight judge shaped like Flan-T5-small with a SentencePiece
tokenizer trained on the bundled texts, scores the bundled sample VQA file, and prints the
results and throughput. Random weights make the ratings meaningless; everything else (prompt,
tokenizer, planner, batching, model code) is the real path a Flan-T5 checkpoint takes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from importlib import resources
from pathlib import Path

from .paths import cache_dir

DEMO_MODEL_NAME = "random-flan-t5-small-v1"


def bundled_text(name: str) -> str:
    return resources.files("fastjudge.data").joinpath(name).read_text(encoding="utf-8")


def sample_rows() -> list[dict]:
    return [json.loads(line) for line in bundled_text("sample_vqa.jsonl").splitlines() if line.strip()]


def tokenizer_corpus() -> list[str]:
    """Sentences to train the demo tokenizer on: the judge's own prompt text, demonstrations
    and sample items, so LAVE prompts tokenize into realistic lengths."""
    from .judges import lave

    lines = [lave.TASK_DESCRIPTION, lave.RATIONALE_INSTRUCTION, lave.BINARY_RULE,
             "Question: Reference answers: Candidate answer: Output: Image description:",
             "1 2 3"] + [f"{lave.RATING_CUE.strip()}{r}" for r in "123"]
    for name in ("lave_demos_general.json", "lave_demos_binary.json"):
        for d in json.loads(bundled_text(name)):
            lines += [d["question"], d["prediction"], d["explanation"], d.get("caption", ""),
                      " ".join(d["references"])]
    for row in sample_rows():
        refs = [r["answer"] if isinstance(r, dict) else r for r in row["references"]]
        lines += [row["question"], row["prediction"], row.get("caption", ""), " ".join(refs)]
    return [line for line in lines if line]


def demo_model(rebuild: bool = False) -> Path:
    """The cached random-weight demo judge, built on first use."""
    from .checkpoints import build_random_t5

    path = cache_dir() / DEMO_MODEL_NAME
    if rebuild or not (path / "model.safetensors").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        print(f"fastjudge demo: building a random-weight Flan-T5-small-shaped judge in {path} "
              "(once)...", file=sys.stderr)
        build_random_t5(tmp, tokenizer_corpus(), shape="small", vocab_size=2000)
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)  # atomic: a half-built model is never picked up as cached
    return path


def run_demo(model: str | None = None, engine=None, **judge_options) -> int:
    """Score the bundled sample with ``LaveJudge(model, engine=engine, **judge_options)``;
    ``model=None``: the cached random-weight demo judge."""
    from .judges.lave import LaveJudge, VQAExample

    random_model = model is None
    model_dir = demo_model() if random_model else Path(model)
    rows = sample_rows()
    examples = [VQAExample(r["question"], r["references"], r["prediction"], r.get("caption"), r["id"])
                for r in rows]
    judge = LaveJudge(model_dir, engine=engine, **judge_options)
    start = time.perf_counter()
    results = judge.score(examples)
    elapsed = time.perf_counter() - start

    print(f"{'id':11} {'question':38} {'prediction':22} {'rating':>6} {'score':>5} {'P(1/2/3)':>16}")
    for r, row in zip(results, rows):
        probs = "/".join(f"{p:.2f}" for p in r.probs) if r.probs else "-"
        rating = r.rating if r.rating is not None else "err"
        score = f"{r.score:.2f}" if r.score is not None else "-"
        print(f"{row['id']:11} {row['question'][:38]:38} {row['prediction'][:22]:22} "
              f"{rating:>6} {score:>5} {probs:>16}")
    ok = [r for r in results if r.error is None]
    tokens = sum(r.prompt_tokens for r in ok)
    mean = sum(r.score for r in ok) / max(len(ok), 1)
    backend = judge.backend
    print(f"\n{len(results)} items, {len(results) - len(ok)} errors, mean score {mean:.3f}; "
          f"{len(results) / elapsed:.1f} items/s, {tokens / elapsed:.0f} prompt tokens/s "
          f"({elapsed:.2f}s on {backend.device}, {str(backend.dtype).replace('torch.', '')}, "
          f"{'rationale' if judge.rationale else 'score-only'})")
    if random_model:
        print("\nNOTE: this judge has RANDOM weights, so its ratings are meaningless; the demo "
              "shows the pipeline and its speed.\nFor real scores point it at a Flan-T5 "
              "checkpoint directory, e.g.:\n  fastjudge demo --model /path/to/flan-t5-xl\n"
              "  fastjudge lave --model /path/to/flan-t5-xl --input items.jsonl --output scores.jsonl")
    return 0
