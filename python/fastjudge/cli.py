"""The ``fastjudge`` command."""

from __future__ import annotations

import argparse
import logging
import sys

from .io.jobs import add_job_arguments
from .judges.registry import (
    ENGINE_OPTIONS,
    HOLISTIC_OPTIONS,
    LAVE_OPTIONS,
    VISEXMEM_OPTIONS,
    add_options,
    engine_options,
    get_judge,
    option_values,
)

RESUMABLE_OUTPUT = ("JSONL, or for *.parquet / *.pq a directory of Parquet part files; rerunning "
                    "resumes, skipping ids already written")

# `fastjudge demo` takes these engine and LAVE options (the sample job itself is fixed).
DEMO_ENGINE_OPTIONS = tuple(o for o in ENGINE_OPTIONS if o.name in ("device", "dtype"))
DEMO_OPTIONS = tuple(o for o in LAVE_OPTIONS if o.name in ("rationale", "max_new_tokens"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastjudge", description="Fast model-as-judge metrics.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log model loading details")
    sub = parser.add_subparsers(dest="command", required=True)

    lave = sub.add_parser("lave", help="score VQA answers with LAVE (JSONL or Parquet in and out)")
    lave.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    add_job_arguments(
        lave, input_help="JSONL (or Parquet: *.parquet, *.pq): id, question, references (list "
                         "of str or of {'answer': ...}), prediction, optional caption",
        output_help=RESUMABLE_OUTPUT, chunk_size=1024,
        chunk_help="items planned together; results are written as batches finish")
    add_options(lave, ENGINE_OPTIONS + LAVE_OPTIONS)

    visexmem = sub.add_parser("visexmem", help="evaluate image-caption pairs with VisExMEM "
                                               "(JSONL or Parquet in and out)")
    visexmem.add_argument("--model", required=True,
                          help="Qwen3.5 vision-language checkpoint directory")
    add_job_arguments(
        visexmem, input_help="JSONL (or Parquet: *.parquet, *.pq): id, image (path) or "
                             "image_b64, text, optional boxes [[x0,y0,x1,y1], ...] and claims (strings "
                             "or part objects: verified instead of decomposing)",
        output_help=RESUMABLE_OUTPUT, chunk_size=64,
        chunk_help="pairs taken through the stages together; results are written per chunk")
    visexmem.add_argument("--holistic", action="store_true",
                          help="the holistic baseline instead (VQAScore by default: one P(\"Yes\") per pair)")
    add_options(visexmem, ENGINE_OPTIONS + VISEXMEM_OPTIONS + HOLISTIC_OPTIONS)

    demo = sub.add_parser("demo", help="run LAVE on bundled sample data (no download needed)")
    demo.add_argument("--model", default=None,
                      help="checkpoint directory (default: a cached random-weight Flan-T5-small-"
                           "shaped judge, built on first use)")
    add_options(demo, DEMO_ENGINE_OPTIONS + DEMO_OPTIONS)

    vqa = sub.add_parser("vqa-acc", help="VQA Accuracy (official vqaEval.py rules) and exact "
                                         "match of the predictions in a JSONL file")
    add_job_arguments(vqa, input_help="JSONL (or Parquet: *.parquet, *.pq) in the `fastjudge "
                                      "lave` layout",
                      output_help="input fields + vqa_accuracy, exact_match, error. "
                                  + RESUMABLE_OUTPUT)
    vqa.add_argument("--normalize", choices=("official", "always", "none"), default="official",
                     help="official: normalize only when the references differ (vqaEval.py); "
                          "always: normalize every answer; none: whitespace only")
    vqa.add_argument("--single-reference", choices=("vqa", "official", "exact"), default="vqa",
                     help="score for one reference: vqa = min(1, match/3) (default), "
                          "official = 0 (what vqaEval.py gives), exact = match")

    meta = sub.add_parser("meta-eval", help="correlate metric scores with human judgments")
    meta.add_argument("--human", required=True,
                      help='JSONL: {"id", "human_score"} or {"id", "ratings": [5 binary]}, '
                           "optional group fields")
    meta.add_argument("--scores", required=True, nargs="+", metavar="[NAME=]PATH",
                      help='JSONL score files ({"id", "score"}; the outputs of lave, visexmem and '
                           "vqa-acc work directly)")
    meta.add_argument("--field", default=None,
                      help="score field, or one per score file comma-separated (default: per file, "
                           "score, else vqa_accuracy: the field fastjudge's commands write)")
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

    from .report import add_report_parser

    add_report_parser(sub)

    from .builders.cli import add_build_parser

    add_build_parser(sub)

    from .bench import add_bench_parser

    add_bench_parser(sub)

    from .verification.run import add_verify_parser

    add_verify_parser(sub)
    return parser


def run_judge_job(args, judge_name: str) -> int:
    """``fastjudge lave`` / ``visexmem``: the shared file job with a registered judge."""
    from .io.jobs import job_options, run_job

    spec = get_judge(judge_name)
    return run_job(judge_name, spec, lambda: spec.factory(args), args.input, args.output,
                   chunk_size=args.chunk_size, progress=not args.no_progress,
                   **job_options(args))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    try:
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args.model, engine=engine_options(args),
                            **option_values(args, DEMO_OPTIONS))
        if args.command == "lave":
            return run_judge_job(args, "lave")
        if args.command == "visexmem":
            return run_judge_job(args, "holistic" if args.holistic else "visexmem")
        if args.command == "vqa-acc":
            from .metrics.vqa import run_vqa_acc

            return run_vqa_acc(args)
        if args.command == "meta-eval":
            from .metrics.meta_eval import run_meta_eval

            return run_meta_eval(args)
        if args.command == "serve":
            from .serve import run_serve

            return run_serve(args)
        if args.command == "report":
            from .report import run_report

            return run_report(args)
        if args.command == "rescore":
            from .rescore import run_rescore

            return run_rescore(args)
        if args.command == "verify":
            from .verification.run import run_verify_command

            return run_verify_command(args)
        if args.command == "bench":
            from .bench import run_bench

            return run_bench(args)
        from .builders.cli import run_build

        return run_build(args)
    except (OSError, ValueError) as bad:  # bad paths, checkpoints (CheckpointError), demo files
        # one line: a checkpoint's problem can arrive as a multi-line message from its reader
        lines = [line.strip() for line in str(bad).splitlines() if line.strip()]
        print(f"fastjudge: error: {' '.join(lines)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
