"""Assembling the report: one streaming pass over the input (summary over every row, drawing
only the first ``limit``), the optional meta-evaluation against human scores, CSS and JS."""

from __future__ import annotations

import sys
from collections import Counter
from html import escape

from .html import _num, iter_rows, lave_row, safe_json, visex_row
from .svg import histogram, scatter, score_bins

CSS = """body{font-family:sans-serif;margin:16px;max-width:1200px}.row{border:1px solid #ccc;
padding:8px;margin:8px 0}.figure{position:relative;display:inline-block;line-height:0}
.figure img{display:block;max-width:480px}.box{position:absolute;border:2px solid #e33;
box-sizing:border-box}.box span{background:#e33;color:#fff;font-size:11px;line-height:12px;
position:absolute;top:0;left:0;padding:1px}.box.hi{border-color:#0c0;background:rgba(0,200,0,.2)}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:2px 4px;font-size:13px}
.chart{margin:4px 24px 8px 0;vertical-align:top}.bar{display:inline-block;width:60px;height:8px;
background:#eee}.bar span{display:block;height:8px;background:#4a7bd0}.warn{color:#a60}
.err{color:#c00}tr.claim:hover{background:#efe}"""

JS = """function applyFilters(){var r=document.getElementById('f-rating').value,
e=document.getElementById('f-err').checked,
g=parseFloat(document.getElementById('f-gap').value||'0');document.querySelectorAll('.row').forEach(function(s){
var ok=(!r||s.dataset.rating===r)&&(!e||s.dataset.error==='1')&&(!g||parseFloat(s.dataset.gap||'0')>=g);
s.style.display=ok?'':'none';});}
document.querySelectorAll('tr.claim').forEach(function(tr){var ids=tr.dataset.eids.split(' ');
function set(on){tr.closest('.row').querySelectorAll('.box').forEach(function(b){
if(ids.indexOf(b.dataset.eid)>=0)b.classList.toggle('hi',on);});}
tr.addEventListener('mouseenter',function(){set(true)});tr.addEventListener('mouseleave',function(){set(false)});
tr.addEventListener('click',function(){set(true)});});
['f-rating','f-err','f-gap'].forEach(function(id){document.getElementById(id).addEventListener('input',applyFilters);});"""


MAX_SCATTER_POINTS = 2000  # the correlations use every pair; the plot draws at most these


def _read_scores(path, field: str | None = None) -> dict:
    """``--scores``: id -> score, read at ``field`` or, by default, at the file's own score
    field (``score``, else ``vqa-acc``'s ``vqa_accuracy``: ``meta_eval.score_field_of``).
    A file without a usable value there is refused, never silently ignored."""
    from ..metrics.meta_eval import SCORE_FIELDS, score_field_of

    field = field or score_field_of(path)
    if field is None:
        raise ValueError(f"{path}: --scores rows have none of the fields {', '.join(SCORE_FIELDS)} "
                         "(name the field with --scores-field)")
    found = {}
    for row, _ in iter_rows(path):
        if row is not None and _num(row.get(field)) is not None and row.get("id") is not None:
            found[str(row["id"])] = float(row[field])
    if not found:
        raise ValueError(f"{path}: no usable {field!r} values with an id (is --scores-field right?)")
    return found


def _meta(human_path, scores: dict) -> str:
    from ..metrics.meta_eval import meta_evaluate, read_human

    human = read_human(human_path)
    try:
        result = meta_evaluate(human.scores, {"judge": scores}, n_boot=1000)
    except ValueError as bad:
        return f'<p class="err">meta-eval: {escape(str(bad))}</p>'
    common = sorted(set(human.scores) & set(scores))
    pts = [(human.scores[i], scores[i]) for i in common[:MAX_SCATTER_POINTS]]  # bounded page

    def cell(m, stat):
        value, ci = m.get(stat), m.get(f"{stat}_ci")
        if value is None:
            return "n/a"
        return f"{value:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")

    rows = "".join(f"<tr><td>{escape(str(g['label']))}</td><td>{g['n']}</td>"
                   f"<td>{cell(g['metrics']['judge'], 'spearman')}</td>"
                   f"<td>{cell(g['metrics']['judge'], 'kendall')}</td></tr>"
                   for g in result["groups"])
    return (f"<h2>Agreement with human scores</h2><table id=\"meta\"><tr><th>group</th><th>n</th>"
            f"<th>Spearman ρ [95% CI]</th><th>Kendall τ-b [95% CI]</th></tr>{rows}</table>"
            f"<p>{len(set(human.scores) - set(scores))} human rows without a score, "
            f"{len(human.problems)} unreadable human rows.</p>" + scatter(pts, "human", "judge"))


def _score_histogram(scores: list[float]) -> str:
    if not scores:
        return histogram([], "Scores", "score")
    bars, edges = score_bins(scores)
    return histogram(bars, f"Scores of {len(scores)} rows", "score", edges=edges)


def build_report(input_path, human=None, image_root=None, limit=2000, sort="score",
                 scores_path=None, scores_field=None) -> str:
    if limit < 0:
        raise ValueError(f"--limit must be >= 0, got {limit}")
    if sort == "disagreement" and not scores_path:
        raise ValueError("--sort disagreement needs --scores (the other score file)")
    other = _read_scores(scores_path, scores_field) if scores_path else {}
    kept, problems, scores, ratings, all_scores = [], [], [], Counter(), {}
    total = errors = 0
    for row, problem in iter_rows(input_path):
        if problem:
            problems.append(problem)
            continue
        total += 1
        errors += bool(row.get("error"))
        s = _num(row.get("score"))
        if s is not None:
            scores.append(s)
            if row.get("id") is not None:
                all_scores[str(row["id"])] = s
        if row.get("rating") is not None:
            ratings[str(row["rating"])] += 1
        if len(kept) < limit:  # rows kept in input order; the sort applies to those shown
            kept.append((total, row))
    if sort == "disagreement" and other:
        kept.sort(key=lambda t: -abs((_num(t[1].get("score")) or 0) - other.get(str(t[1].get("id")), 0)))
    else:
        kept.sort(key=lambda t: _num(t[1].get("score")) if _num(t[1].get("score")) is not None else -1e9)
    body = []
    for n, row in kept:
        o = other.get(str(row.get("id"))) if other else None
        body.append(lave_row(row, n, o) if "prediction" in row or "rating" in row
                    else visex_row(row, n, image_root))
    omitted = total - len(kept)
    head = (f"<h1>fastjudge report</h1><p id=\"counts\" data-total=\"{total}\" data-shown=\"{len(kept)}\">"
            f"{total} rows, {errors} errors, {len(problems)} unreadable lines; showing {len(kept)}"
            + (f" ({omitted} omitted by --limit)" if omitted else "") + "</p>"
            + _score_histogram(scores)
            + (histogram(sorted(ratings.items()), "Ratings", "rating") if ratings else "")
            + "".join(f'<p class="err">{escape(p)}</p>' for p in problems[:20]))
    if human:
        head += _meta(human, all_scores)
    filters = ('<p>rating <select id="f-rating"><option value="">any</option>'
               + "".join(f'<option value="{escape(r)}">{escape(r)}</option>' for r in sorted(ratings))
               + '</select> <label><input type="checkbox" id="f-err"> errors only</label> '
               'min |score − other| <input id="f-gap" type="number" step="0.1" value="0"></p>')
    meta = safe_json({"total": total, "shown": len(kept), "omitted": omitted})
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>fastjudge report</title>"
            f"<style>{CSS}</style></head><body>{head}{filters}{''.join(body)}"
            f"<script type=\"application/json\" id=\"summary\">{meta}</script>"
            f"<script>{JS}</script></body></html>")


def run_report(args) -> int:
    if args.sample:
        from .sample import write_sample

        folder = args.sample_dir or "fastjudge_report_sample"
        args.input, args.image_root = str(write_sample(folder)), folder
        print(f"sample data written to {folder}", file=sys.stderr)
    if not args.input:
        raise ValueError("report needs --input (or --sample)")
    page = build_report(args.input, human=args.human, image_root=args.image_root, limit=args.limit,
                        sort=args.sort, scores_path=args.scores, scores_field=args.scores_field)
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="self-contained HTML report of judge outputs")
    p.add_argument("--input", default=None, help="JSONL output of fastjudge lave/visexmem")
    p.add_argument("--sample", action="store_true", help="report on generated VisExMEM sample rows")
    p.add_argument("--sample-dir", default=None, help="where --sample writes its rows and images")
    p.add_argument("--human", default=None, help="human scores JSONL (as meta-eval)")
    p.add_argument("--output", default="report.html")
    p.add_argument("--image-root", default=None, help="folder the rows' image paths are relative to")
    p.add_argument("--limit", type=int, default=2000, help="rows drawn (summary covers all)")
    p.add_argument("--sort", choices=("score", "disagreement"), default="score")
    p.add_argument("--scores", default=None,
                   help="other score JSONL to compare: the output of lave/visexmem (score) or vqa-acc "
                        "(vqa_accuracy)")
    p.add_argument("--scores-field", default=None,
                   help="the --scores field (default: score, else vqa_accuracy; a file with neither is refused)")
