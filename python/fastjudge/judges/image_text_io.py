"""Image-text items in and results out, for the VisExMEM and holistic judges: the
``fastjudge visexmem`` job, and the pieces the server and re-scoring registry use.

Input rows (JSONL): ``id``, ``image`` (a path, relative paths resolved against the image root,
which defaults to the input file's folder), or ``image_b64`` (base64 of the encoded image),
``text`` (or ``caption``), optional ``boxes`` ``[[x0, y0, x1, y1], ...]`` in pixels.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
from typing import Any

VISEXMEM_RESULT_FIELDS = ("score", "claims", "explanation", "warnings", "prompt_tokens", "error")
VISEXMEM_RESULT_TYPES = {"score": "float", "explanation": "str", "prompt_tokens": "int", "error": "str"}
HOLISTIC_RESULT_FIELDS = ("score", "decision", "probs", "prompt_tokens", "error")
HOLISTIC_RESULT_TYPES = {"score": "float", "decision": "str", "probs": "list[float]",
                         "prompt_tokens": "int", "error": "str"}


class RowError(ValueError):
    """An input row that is not an image-text item."""


def example_from_row(row: Any, ident: Any = None, where: str = "item"):
    """One input row as an example; ``RowError`` names what is wrong. Whether the image opens
    and the boxes fit is checked by the judge (a per-item error there)."""
    if not isinstance(row, dict):
        raise RowError(f"{where}: expected a JSON object, got {type(row).__name__}")
    text = row.get("text", row.get("caption"))
    if not isinstance(text, str):
        raise RowError(f"{where}: text (or caption) must be a string")
    if "image_b64" in row:
        try:
            image = base64.b64decode(row["image_b64"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise RowError(f"{where}: image_b64 is not valid base64") from None
    elif isinstance(row.get("image"), str):
        image = row["image"]
    else:
        raise RowError(f"{where}: needs image (a path) or image_b64")
    boxes = row.get("boxes")
    if boxes is not None and not isinstance(boxes, list):
        raise RowError(f"{where}: boxes must be a list of [x0, y0, x1, y1]")
    from .visexmem import ImageTextExample  # (the judge module imports torch: only when used)

    return ImageTextExample(image=image, text=text, boxes=boxes, id=ident if ident is not None else row.get("id"))


def result_fields(result, fields: tuple[str, ...]) -> dict:
    """JSON-ready output fields of a result (claims as plain objects)."""
    out = {}
    for k in fields:
        v = getattr(result, k, None)
        out[k] = [dataclasses.asdict(c) for c in v] if k == "claims" else v
    return out


def judge_options(args, name: str) -> dict:
    """Judge options from parsed command-line arguments (absent options keep the defaults)."""
    opts = dict(device=getattr(args, "device", "auto"), dtype=getattr(args, "dtype", None),
                image_root=getattr(args, "image_root", None),
                max_batch_tokens=getattr(args, "max_batch_tokens", None),
                allow_pickle=getattr(args, "allow_pickle", False))
    if name == "visexmem":
        opts.update(aggregate=getattr(args, "aggregate", "mean"),
                    explain=not getattr(args, "no_explain", False),
                    propose_boxes=getattr(args, "propose_boxes", False),
                    max_claims=getattr(args, "max_claims", 12),
                    max_claim_chars=getattr(args, "max_claim_chars", 120),
                    max_explanation_chars=getattr(args, "max_explanation_chars", 300),
                    evidence_layout=getattr(args, "evidence_layout", "per-claim"))
    return opts


def make_judge(args, name: str):
    if name == "visexmem":
        from .visexmem import VisExJudge

        return VisExJudge(args.model, **judge_options(args, name))
    from .holistic import HolisticJudge

    return HolisticJudge(args.model, **judge_options(args, name))


def add_image_text_args(p) -> None:
    """Options of the image-text judges (``visexmem``, ``serve``/``rescore --judge visexmem``)."""
    p.add_argument("--image-root", default=None,
                   help="folder for relative image paths (default: the input file's folder)")
    p.add_argument("--aggregate", choices=("mean", "geometric", "harmonic", "min"), default="mean",
                   help="claim supports -> global score (default: mean, as the paper)")
    p.add_argument("--no-explain", action="store_true", help="skip the explanation stage")
    p.add_argument("--propose-boxes", action="store_true",
                   help="items without boxes: let the model propose candidate regions "
                        "(default: the image quadrants)")
    p.add_argument("--evidence-layout", choices=("per-claim", "shared"), default="per-claim",
                   help="per-claim: each claim's selected crops in its own prompt part (default); "
                        "shared: all candidate crops once in the example's shared prefix (faster)")
    p.add_argument("--max-claims", type=int, default=12, help="most claims per caption (12)")
    p.add_argument("--max-claim-chars", type=int, default=120, help="longest claim text (120)")
    p.add_argument("--max-explanation-chars", type=int, default=300, help="longest explanation (300)")


def make_factory(name: str):
    """Registry factory: the judge from parsed arguments; relative image paths resolve against
    ``--image-root``, else the input file's folder when there is one (file jobs)."""

    def factory(args):
        if getattr(args, "image_root", None) is None and getattr(args, "input", None):
            args.image_root = os.path.dirname(os.path.abspath(args.input))
        return make_judge(args, name)

    return factory


def parse_http_item(d: Any, where: str):
    """One item of an HTTP request. The server reads no files on a client's behalf: images come
    as ``image_b64``; a path is refused."""
    from .registry import ItemError

    if isinstance(d, dict) and "image_b64" not in d and "image" in d:
        raise ItemError(f"{where}: the server does not read image paths; send the encoded image "
                        "as image_b64 (base64)")
    try:
        return example_from_row(d, None, where)
    except RowError as bad:
        raise ItemError(str(bad)) from None


def add_visexmem_parser(sub) -> None:
    p = sub.add_parser("visexmem", help="evaluate image-caption pairs with VisExMEM (JSONL in and out)")
    p.add_argument("--model", required=True, help="Qwen3.5 vision-language checkpoint directory")
    p.add_argument("--input", required=True,
                   help="JSONL: id, image (path) or image_b64, text, optional boxes [[x0,y0,x1,y1], ...]")
    p.add_argument("--output", required=True, help="JSONL; rerunning resumes, skipping ids already written")
    add_image_text_args(p)
    p.add_argument("--holistic", action="store_true",
                   help="the holistic yes/no baseline instead (one P(yes) per pair)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: per device)")
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--chunk-size", type=int, default=64,
                   help="pairs taken through the stages together; results are written per chunk")
    p.add_argument("--allow-pickle", action="store_true",
                   help="allow pickle-based weights (*.bin); only for trusted checkpoints")
    p.add_argument("--no-progress", action="store_true")


def run_visexmem(args) -> int:
    from itertools import islice

    from ..io.jobs import JsonlJob
    from ..io.jsonl import read_jsonl

    name = "holistic" if args.holistic else "visexmem"
    fields = HOLISTIC_RESULT_FIELDS if args.holistic else VISEXMEM_RESULT_FIELDS
    judge = make_factory(name)(args)
    lines = list(read_jsonl(args.input))  # before the output is touched: a bad path leaves none
    job = JsonlJob(name, args.output, means={"score": "mean score"}, progress=not args.no_progress)
    todo = iter([line for line in lines if line.id not in job.done])
    job.set_total(len(lines) - len(job.done))
    try:
        while chunk := list(islice(todo, max(1, args.chunk_size))):
            examples, valid = [], []
            for line in chunk:
                try:
                    if line.error:
                        raise RowError(line.error)
                    examples.append(example_from_row(line.item, line.id, f"line {line.line_no}"))
                    valid.append(line)
                except RowError as bad:
                    job.emit({"id": line.id, **dict.fromkeys(fields), "error": str(bad)})
            for result in judge.stream(examples):
                line = valid[result.index]
                row = {**line.output_row(), **result_fields(result, fields)}
                if result.error:
                    row["error"] = f"line {line.line_no}: {result.error}"
                job.emit(row)
    except KeyboardInterrupt:
        return job.interrupted()
    return job.finish()
