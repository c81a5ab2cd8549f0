"""``fastjudge verify`` on tiny random-weight checkpoints, every judge and mode, in float32 and
bfloat16 (what ``benchmarks/gpu_check.sh`` runs on CUDA; ``--device cpu`` anywhere).

Items: the bundled LAVE sample (``fastjudge/data/sample_vqa.jsonl``) and the pictures of
``fastjudge report --sample`` as image-caption pairs. Checkpoints: Flan-T5-shaped, Qwen3.5
text and Qwen3.5-VL (its LM-head rows of narrow UTF-8 lead bytes zeroed for the xgrammar
reference: ``fastjudge.reference.visexmem.zero_unmasked_utf8_rows``). The official LAVE mode
runs when ``--lave-repo`` names a checkout of the authors' repository.

Prints each report and a summary table (with, per run, what was compared for the generated
stages: identical generated claims, evidence and rationales, and the decisions compared on the
reference's claims given to both paths); writes OUT_DIR/verify_tiny.json. Exit 1 when any
check fails.

    python benchmarks/verify_tiny.py OUT_DIR --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources
from pathlib import Path

VISEXMEM_BUDGETS = dict(max_claims=2, max_claim_chars=12, max_explanation_chars=12)


def pairs_file(folder: Path) -> Path:
    """The report sample's pictures and captions as a VisExMEM / holistic input file."""
    from fastjudge.report.sample import write_sample

    rows = [json.loads(line) for line in write_sample(folder).read_text().splitlines()]
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps({k: r[k] for k in ("id", "image", "text")}) + "\n" for r in rows))
    return path


def checkpoints(folder: Path) -> dict:
    from fastjudge.checkpoints import build_random_qwen, build_random_qwen_vl, build_random_t5
    from fastjudge.demo import tokenizer_corpus
    from fastjudge.reference.visexmem import zero_unmasked_utf8_rows

    corpus = tokenizer_corpus()
    vl = build_random_qwen_vl(folder / "qwen3_5-vl", corpus, seed=11)
    zero_unmasked_utf8_rows(vl)
    return dict(t5=build_random_t5(folder / "flan-t5", corpus, shape="tiny"),
                qwen=build_random_qwen(folder / "qwen3_5", corpus, seed=3), vl=vl)


def runs(models: dict, vqa: str, pairs: Path, lave_repo: str | None) -> list[tuple]:
    out = [("lave", models["t5"], vqa, {}),
           ("lave", models["t5"], vqa, dict(rationale=True, max_new_tokens=20)),
           ("lave", models["qwen"], vqa, {}),
           ("holistic", models["vl"], pairs, {}),
           ("holistic", models["vl"], pairs, dict(template="fastjudge")),
           ("visexmem", models["vl"], pairs, dict(VISEXMEM_BUDGETS)),
           ("visexmem", models["vl"], pairs, dict(VISEXMEM_BUDGETS, mode="single-response")),
           ("visexmem", models["vl"], pairs, dict(VISEXMEM_BUDGETS, mode="holistic-score"))]
    if lave_repo:
        out.append(("lave", models["t5"], vqa, dict(official_repo=lave_repo, max_new_tokens=30)))
    return out


def generated_summary(report) -> str:
    """What was compared for the generated stages: identical counts of the generated outputs
    (VisExMEM's claims and evidence, LAVE's rationales) and, where the claims were given again,
    the decisions compared on them."""
    parts = []
    for comp in report.comparisons:
        outs = {o["name"]: o for o in comp["outputs"]}
        if comp.get("claims_given"):
            d = outs.get("decision")
            if d and d["units"]:
                parts.append(f"decisions on given claims {d['identical']}/{d['units']}")
            continue
        for o in comp["outputs"]:
            if o["kind"] == "generated" or (o["kind"] == "text" and o["name"] == "rationale"):
                if o["units"]:
                    checked = "" if o.get("checked", True) else " (reported)"
                    parts.append(f"{o['name']} {o['identical']}/{o['units']} identical{checked}")
    return "; ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--sample", type=int, default=16, help="items per LAVE run (the pair files hold 3)")
    ap.add_argument("--lave-repo", default=None, help="checkout of the LAVE authors' repository")
    ap.add_argument("--quick", action="store_true",
                    help="only the runs without generation (LAVE score-only, holistic, VisExMEM "
                         "holistic-score): for a CPU dry run")
    args = ap.parse_args(argv)

    import torch

    import fastjudge
    from fastjudge.verification import format_report

    if args.device.startswith("cuda"):  # float32 must mean float32: no TF32 on either path
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    vqa = str(resources.files("fastjudge.data").joinpath("sample_vqa.jsonl"))
    models = checkpoints(args.out / "checkpoints")
    pairs = pairs_file(args.out / "pairs")
    rows = []
    for dtype in args.dtypes:
        for judge, model, items, options in runs(models, vqa, pairs, args.lave_repo):
            if args.quick and (options.get("rationale") or options.get("official_repo")
                               or (judge == "visexmem" and options.get("mode") != "holistic-score")):
                continue
            start = time.perf_counter()
            try:
                report = fastjudge.verify(judge, model, items, sample=args.sample, device=args.device, dtype=dtype,
                                          progress=False, **options)
            except Exception as bad:  # noqa: BLE001 - one failed run is a row, the others still run
                rows.append(dict(judge=judge, mode=str(options), dtype=dtype, passed=False, error=repr(bad)))
                print(f"[{judge} {options} {dtype}] ERROR {bad!r}", flush=True)
                continue
            print(format_report(report) + "\n", flush=True)
            outs = [o for c in report.comparisons for o in c["outputs"]]
            values = [o["max_abs"] for o in outs if o["max_abs"] is not None]
            matches = [o for o in outs if o["kind"] == "match" and o["units"]]
            rows.append(dict(judge=judge, mode=report.mode, dtype=dtype, items=report.items, passed=report.passed,
                             max_abs=max(values, default=None),
                             agreement=min((o["identical"] / o["units"] for o in matches), default=None),
                             generated=generated_summary(report), seconds=round(time.perf_counter() - start, 1)))
    print(f"{'judge':9} {'mode':38} {'dtype':9} {'items':>5} {'max |diff|':>10} {'agree':>6} {'s':>6}  result"
          "  generated stages")
    for r in rows:
        diff = "-" if r.get("max_abs") is None else f"{r['max_abs']:.2e}"
        agree = "-" if r.get("agreement") is None else f"{r['agreement']:.0%}"
        print(f"{r['judge']:9} {r['mode'][:38]:38} {r['dtype']:9} {r.get('items', 0):5d} {diff:>10} {agree:>6} "
              f"{r.get('seconds', 0):6.1f}  {'PASS' if r['passed'] else 'FAIL'}  {r.get('generated') or '-'}")
    (args.out / "verify_tiny.json").write_text(json.dumps(rows, indent=2))
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
