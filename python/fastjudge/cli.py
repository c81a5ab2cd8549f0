"""The ``fastjudge`` command."""

from __future__ import annotations

import argparse
import logging
import sys
from itertools import islice
from typing import Iterable, Iterator

from .judges.registry import LAVE_RESULT_FIELDS  # noqa: F401 (the output row's result fields)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default=None,
                   help="float32 or bfloat16 (default: bfloat16 on CUDA and on CPUs with native "
                        "bf16 support, else float32)")
    p.add_argument("--rationale", action="store_true",
                   help="decode a rationale before the rating (slower; the paper's setting)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="rationale length cap (100)")


def _add_lave_args(p: argparse.ArgumentParser) -> None:
    """LAVE options and job batching (``fastjudge lave``, ``fastjudge rescore``)."""
    p.add_argument("--num-shots", type=int, default=8)
    p.add_argument("--demos", help="JSON file of general-question demonstrations")
    p.add_argument("--binary-demos", help="JSON file of yes/no-question demonstrations")
    p.add_argument("--no-filter", action="store_true", help="keep outlier reference answers")
    p.add_argument("--filter-p", type=float, default=0.25)
    p.add_argument("--use-caption", action="store_true", help="add the image caption to prompts")
    p.add_argument("--on-unparsable", choices=("constrain", "official"), default="constrain")
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--max-input-tokens", type=int, default=None)
    p.add_argument("--chunk-size", type=int, default=1024,
                   help="items planned together; results are written as batches finish")
    p.add_argument("--allow-pickle", action="store_true",
                   help="allow pickle-based weights (*.bin); only for trusted checkpoints")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastjudge", description="Fast model-as-judge metrics.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log model loading details")
    sub = parser.add_subparsers(dest="command", required=True)

    lave = sub.add_parser("lave", help="score VQA answers with LAVE (JSONL in, JSONL out)")
    lave.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    lave.add_argument("--input", required=True,
                      help="JSONL: id, question, references (list of str or of {'answer': ...}), "
                           "prediction, optional caption")
    lave.add_argument("--output", required=True,
                      help="JSONL; rerunning resumes, skipping ids already written")
    _add_model_args(lave)
    _add_lave_args(lave)
    lave.add_argument("--no-progress", action="store_true")

    demo = sub.add_parser("demo", help="run LAVE on bundled sample data (no download needed)")
    demo.add_argument("--model", default=None,
                      help="checkpoint directory (default: a cached random-weight Flan-T5-small-"
                           "shaped judge, built on first use)")
    _add_model_args(demo)

    vqa = sub.add_parser("vqa-acc", help="VQA Accuracy (official vqaEval.py rules) and exact "
                                         "match of the predictions in a JSONL file")
    vqa.add_argument("--input", required=True, help="JSONL in the `fastjudge lave` layout")
    vqa.add_argument("--output", required=True,
                     help="JSONL: input fields + vqa_accuracy, exact_match, error; resumable")
    vqa.add_argument("--normalize", choices=("official", "always", "none"), default="official",
                     help="official: normalize only when the references differ (vqaEval.py); "
                          "always: normalize every answer; none: whitespace only")
    vqa.add_argument("--single-reference", choices=("vqa", "official", "exact"), default="vqa",
                     help="score for one reference: vqa = min(1, match/3) (default), "
                          "official = 0 (what vqaEval.py gives), exact = match")
    vqa.add_argument("--no-progress", action="store_true")

    meta = sub.add_parser("meta-eval", help="correlate metric scores with human judgments")
    meta.add_argument("--human", required=True,
                      help='JSONL: {"id", "human_score"} or {"id", "ratings": [5 binary]}, '
                           "optional group fields")
    meta.add_argument("--scores", required=True, nargs="+", metavar="[NAME=]PATH",
                      help='JSONL score files ({"id", "score"}; LAVE output works directly)')
    meta.add_argument("--field", default="score",
                      help="score field, or one per score file comma-separated (default score)")
    meta.add_argument("--by", default=None, help="group fields of the human file, e.g. model,dataset")
    meta.add_argument("--bootstrap", type=int, default=5000, help="resamples (0: no CIs/tests)")
    meta.add_argument("--stats", default="spearman,kendall",
                      help="correlations to report (default spearman,kendall)")
    meta.add_argument("--seed", type=int, default=0)
    meta.add_argument("--alpha", type=float, default=0.05, help="significance level (0.05)")
    meta.add_argument("--test", choices=("paired", "independent", "bootstrap"), default="paired",
                      help="significance between metrics: paired (default, as the LAVE paper: "
                           "t-test on the bootstrap correlations), independent t-test, or the "
                           "bootstrap p-value of the difference")
    meta.add_argument("--json", default=None, help="write all results as JSON")
    meta.add_argument("--plot", default=None, help="PNG bar chart with CIs (needs matplotlib)")

    from .serve import add_serve_parser

    add_serve_parser(sub)

    from .rescore import add_rescore_parser

    add_rescore_parser(sub)

    from .judges.image_text_io import add_visexmem_parser

    add_visexmem_parser(sub)

    from .builders.cli import add_build_parser

    add_build_parser(sub)
    return parser


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def run_lave(args) -> int:
    from .io.jobs import JsonlJob
    from .io.jsonl import read_jsonl
    from .judges.lave import LaveJudge, VQAExample

    judge = LaveJudge(
        args.model, device=args.device, dtype=args.dtype, rationale=args.rationale,
        num_shots=args.num_shots, demos=args.demos, binary_demos=args.binary_demos,
        filter_refs=not args.no_filter, filter_p=args.filter_p, use_caption=args.use_caption,
        max_batch_tokens=args.max_batch_tokens, max_new_tokens=args.max_new_tokens,
        on_unparsable=args.on_unparsable, allow_pickle=args.allow_pickle,
        max_input_tokens=args.max_input_tokens)
    lines = list(read_jsonl(args.input))  # before the output is touched: a bad path leaves none
    job = JsonlJob("lave", args.output, means={"score": "mean score"}, progress=not args.no_progress)
    todo = [line for line in lines if line.id not in job.done]
    job.set_total(len(todo))
    try:
        for chunk in _chunks(todo, max(1, args.chunk_size)):
            examples, valid = [], []
            for line in chunk:
                if line.error:
                    job.emit({"id": line.id, **dict.fromkeys(LAVE_RESULT_FIELDS), "error": line.error})
                    continue
                item = line.item
                examples.append(VQAExample(
                    question=item.get("question"), references=item.get("references"),
                    prediction=item.get("prediction"), caption=item.get("caption"), id=line.id))
                valid.append(line)
            for result in judge.stream(examples):
                line = valid[result.index]
                row = line.output_row()
                row.update({k: getattr(result, k) for k in LAVE_RESULT_FIELDS})
                if result.error:
                    row["error"] = f"line {line.line_no}: {result.error}"
                job.emit(row)
    except KeyboardInterrupt:
        return job.interrupted()
    return job.finish()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(model=args.model, device=args.device, dtype=args.dtype,
                        rationale=args.rationale, max_new_tokens=args.max_new_tokens)
    try:
        if args.command == "vqa-acc":
            from .metrics.vqa import run_vqa_acc

            return run_vqa_acc(args)
        if args.command == "meta-eval":
            from .metrics.meta_eval import run_meta_eval

            return run_meta_eval(args)
        if args.command == "serve":
            from .serve import run_serve

            return run_serve(args)
        if args.command == "visexmem":
            from .judges.image_text_io import run_visexmem

            return run_visexmem(args)
        if args.command == "rescore":
            from .rescore import run_rescore

            return run_rescore(args)
        if args.command == "build":
            from .builders.cli import run_build

            return run_build(args)
        return run_lave(args)
    except (OSError, ValueError) as bad:  # bad paths, checkpoints, demonstration files
        print(f"fastjudge: error: {bad}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
