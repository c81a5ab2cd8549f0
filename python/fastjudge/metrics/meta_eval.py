"""Meta-evaluation: how well do metrics agree with human judgments? (``fastjudge meta-eval``)

File layouts (JSONL, one object per line):

* human file: ``{"id": ..., "human_score": 0.5}`` or ``{"id": ..., "ratings": [1, 1, 0, 1, 1]}``
  (5 binary ratings -> :func:`fastjudge.metrics.human_ratings.human_score`: 1.0 if >= 4
  correct, 0.5 if 2-3, else 0.0; when both are given ``human_score`` is used and ``ratings`` only
  feed Krippendorff's alpha), plus any group fields (``model``, ``dataset``, ...) for ``--by``.
* score files: ``{"id": ..., "score": 0.5}``; the field is ``--field``, by default the first of
  :data:`SCORE_FIELDS` the file's rows carry: ``score`` (``fastjudge lave`` / ``visexmem``
  output), else ``vqa_accuracy`` (``fastjudge vqa-acc`` output), so the outputs of fastjudge's
  own commands work as written.
  Rows with a non-null ``error`` or a null score are skipped (counted). A metric is named after
  its file stem, or ``NAME=PATH``.

Ids are compared as strings (``4`` and ``"4"`` are the same item). Correlations are computed on
the items present in the human file and in *every* score file, so all metrics are compared on
the same items; ids missing on either side are reported. For each group (all items, then every
combination of the ``--by`` fields' values) and metric: Spearman's rho and Kendall's tau-b with
percentile bootstrap CIs, and, between every two metrics, the LAVE paper's significance test (the
same bootstrap resamples for all metrics, t-test at the 5% level on the bootstrap correlations).
The best metric of a column is marked when it is significantly better than the second best.

This module reads the files, computes the result and runs the command; the table and the chart
are drawn by :mod:`.meta_eval_report`.
"""

from __future__ import annotations

import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .human_ratings import human_score, krippendorff_alpha
from .meta_eval_report import PlotUnavailable, format_markdown, plot_meta_eval, require_matplotlib
from .significance import TESTS, compare_replicates
from .stats import STAT_FUNCTIONS, STATS, bootstrap_replicates, percentile_ci

__all__ = ["HumanData", "read_human", "read_scores", "parse_score_spec", "meta_evaluate", "SCORE_FIELDS",
           "score_field_of", "run_meta_eval"]

_MAX_EXAMPLES = 5  # ids or problems quoted per message


@dataclass
class HumanData:
    scores: dict[str, float] = field(default_factory=dict)
    ratings: dict[str, list] = field(default_factory=dict)
    groups: dict[str, tuple] = field(default_factory=dict)  # id -> values of the --by fields
    problems: list[str] = field(default_factory=list)
    rows: int = 0


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _rows_with_ids(path, data):
    """Parsed rows of a JSONL file with their id (as a string) and location; counts rows in
    ``data.rows`` and records malformed lines and rows without an id in ``data.problems``."""
    from ..io.jsonl import read_jsonl

    for line in read_jsonl(path):
        data.rows += 1
        where = f"{path}: line {line.line_no}"
        if line.error:
            data.problems.append(f"{path}: {line.error}")
        elif line.item.get("id") is None:
            data.problems.append(f"{where}: missing id")
        else:
            yield line, str(line.item["id"]), where


def read_human(path, by: tuple[str, ...] = ()) -> HumanData:
    """Human judgments; malformed rows become ``problems`` naming their line, not exceptions."""
    data = HumanData()
    first_line: dict[str, int] = {}
    for line, key, where in _rows_with_ids(path, data):
        item = line.item
        if key in first_line:
            data.problems.append(f"{where}: duplicate id {key!r} (first on line "
                                 f"{first_line[key]}); skipped")
            continue
        ratings = item.get("ratings")
        try:
            if item.get("human_score") is not None:
                score = item["human_score"]
                if not _is_number(score):
                    raise ValueError(f"human_score must be a number, got {score!r}")
                score = float(score)
                if ratings is not None:
                    human_score(ratings)  # validate
            elif ratings is not None:
                score = human_score(ratings)
            else:
                raise ValueError("needs human_score or ratings")
        except ValueError as bad:
            data.problems.append(f"{where}: {bad}")
            continue
        first_line[key] = line.line_no
        data.scores[key] = score
        if ratings is not None:
            data.ratings[key] = [int(r) for r in ratings]
        if by:
            data.groups[key] = tuple(None if item.get(f) is None else str(item.get(f)) for f in by)
    return data


@dataclass
class ScoreData:
    name: str
    path: str
    field: str
    scores: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    error_rows: int = 0  # rows with an error or a null score
    rows: int = 0


# The score fields of fastjudge's own outputs, in the order a score file is searched for them:
# the judges' ``score``, then ``vqa-acc``'s ``vqa_accuracy``.
SCORE_FIELDS = ("score", "vqa_accuracy")


def score_field_of(path) -> str | None:
    """The first of :data:`SCORE_FIELDS` that a row of the JSONL file ``path`` has (the first
    row with any of them decides), None when no row has one."""
    from ..io.jsonl import read_jsonl

    for line in read_jsonl(path):
        if not line.error and isinstance(line.item, dict):
            found = [f for f in SCORE_FIELDS if f in line.item]
            if found:
                return found[0]
    return None


def parse_score_spec(spec: str, field: str | None = "score") -> tuple[str, str, str | None]:
    """``PATH`` or ``NAME=PATH`` -> (name, path, field); the name defaults to the file stem."""
    name, sep, path = spec.partition("=")
    if not sep or not name or os.path.exists(spec):
        name, path = Path(spec).stem, spec
    return name, path, field


def read_scores(path, field: str | None = "score", name: str | None = None) -> ScoreData:
    """One metric's scores by id (rows with an ``error`` or a null score are skipped);
    ``field=None``: the file's own score field (:func:`score_field_of`, ``score`` when it has
    none of them)."""
    if field is None:
        field = score_field_of(path) or SCORE_FIELDS[0]
    data = ScoreData(name or Path(path).stem, str(path), field)
    first_line: dict[str, int] = {}
    for line, key, where in _rows_with_ids(path, data):
        item = line.item
        value = item.get(field)
        if item.get("error") is not None or value is None:
            data.error_rows += 1
            continue
        if not _is_number(value):
            data.problems.append(f"{where}: {field} must be a number, got {value!r}")
            continue
        if key in first_line:
            data.problems.append(f"{where}: duplicate id {key!r} (first on line "
                                 f"{first_line[key]}); skipped")
            continue
        first_line[key] = line.line_no
        data.scores[key] = float(value)
    return data


def _examples(ids) -> str:
    ids = sorted(ids)
    shown = ", ".join(repr(i) for i in ids[:_MAX_EXAMPLES])
    return shown + (", ..." if len(ids) > _MAX_EXAMPLES else "")


def _group_label(by: tuple[str, ...], key: tuple | None) -> str:
    if key is None:
        return "all"
    return ", ".join(f"{f}={'-' if v is None else v}" for f, v in zip(by, key))


def _finite(v: float) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def meta_evaluate(human: dict[str, float], metrics: dict[str, dict[str, float]],
                  groups: dict[str, tuple] | None = None, by: tuple[str, ...] = (),
                  n_boot: int = 5000, seed: int = 0, alpha: float = 0.05,
                  confidence: float = 0.95, test: str = "paired",
                  ratings: dict[str, list] | None = None,
                  stats: tuple[str, ...] = STATS) -> dict:
    """Correlations of every metric with the human scores, overall and per group, with
    bootstrap CIs and pairwise significance (see the module docstring). Returns a JSON-ready
    dict; ``n_boot=0`` skips the bootstrap (no CIs, no significance marks)."""
    if not metrics:
        raise ValueError("no metrics to evaluate")
    if test not in TESTS:
        raise ValueError(f"test must be one of {TESTS}, got {test!r}")
    names = list(metrics)
    ids = set(human)
    unmatched = {}
    for name in names:
        have = set(metrics[name])
        unmatched[name] = {"human_without_score": len(ids - have),
                           "score_without_human": len(have - set(human)),
                           "examples_human_without_score": sorted(ids - have)[:_MAX_EXAMPLES],
                           "examples_score_without_human": sorted(have - set(human))[:_MAX_EXAMPLES]}
    common = set(human)
    for name in names:
        common &= set(metrics[name])
    if not common:
        raise ValueError("no item has a human score and a score from every metric "
                         "(are the ids the same in all files?)")
    items = sorted(common)
    h_all = np.array([human[i] for i in items])
    m_all = np.array([[metrics[name][i] for i in items] for name in names])

    selections: list[tuple[tuple | None, np.ndarray]] = [(None, np.arange(len(items)))]
    if by:
        members = defaultdict(list)
        for pos, i in enumerate(items):
            members[(groups or {}).get(i, tuple(None for _ in by))].append(pos)
        for key in sorted(members, key=lambda k: tuple("" if v is None else v for v in k)):
            selections.append((key, np.array(members[key])))

    out_groups = []
    for key, sel in selections:
        h, m = h_all[sel], m_all[:, sel]
        group = {"label": _group_label(by, key), "n": int(sel.size),
                 "fields": None if key is None else dict(zip(by, key)),
                 "human_mean": float(h.mean()), "metrics": {}, "best": {}, "comparisons": []}
        if ratings:
            rated = [ratings[items[p]] for p in sel if items[p] in ratings]
            group["krippendorff_alpha"] = _finite(krippendorff_alpha(rated)) if rated else None
        reps = (bootstrap_replicates(m, h, stats, n_boot, seed)
                if n_boot > 0 and sel.size >= 2 else None)
        for j, name in enumerate(names):
            entry = {"mean": float(m[j].mean())}
            for stat in stats:
                entry[stat] = _finite(STAT_FUNCTIONS[stat](m[j], h))
                if reps is not None:
                    lo, hi = percentile_ci(reps[stat][j], confidence)
                    entry[f"{stat}_ci"] = [_finite(lo), _finite(hi)]
            group["metrics"][name] = entry
        for stat in stats:
            ranked = sorted((name for name in names if group["metrics"][name][stat] is not None),
                            key=lambda nm: -group["metrics"][nm][stat])
            best = {"metric": ranked[0] if ranked else None, "significant": False,
                    "second": ranked[1] if len(ranked) > 1 else None}
            if reps is not None:
                for a in range(len(names)):
                    for b in range(a + 1, len(names)):
                        ra, rb = group["metrics"][names[a]][stat], group["metrics"][names[b]][stat]
                        if ra is None or rb is None:
                            continue
                        c = compare_replicates(reps[stat][a], reps[stat][b], ra, rb, stat,
                                               alpha, test, confidence)
                        group["comparisons"].append({
                            "stat": stat, "a": names[a], "b": names[b], "a_value": ra,
                            "b_value": rb, "mean_diff": _finite(c.mean_diff),
                            "diff_ci": [_finite(c.diff_low), _finite(c.diff_high)],
                            "t": _finite(c.t),
                            "p_value": _finite(c.p_value), "p_bootstrap": _finite(c.p_bootstrap),
                            "significant": c.significant,
                            "better": {"a": names[a], "b": names[b]}.get(c.better)})
                        if best["second"] and {names[a], names[b]} == {best["metric"], best["second"]}:
                            best["significant"] = c.significant and c.better is not None and (
                                (c.better == "a") == (names[a] == best["metric"]))
            group["best"][stat] = best
        out_groups.append(group)

    return {"n_items": len(items), "metrics": names, "by": list(by), "stats": list(stats),
            "bootstrap": {"n": n_boot, "seed": seed, "confidence": confidence,
                          "test": _TEST_TEXT[test], "alpha": alpha},
            "unmatched": unmatched, "groups": out_groups}


_TEST_TEXT = {"paired": "paired t-test on the bootstrap correlations",
              "independent": "two-sample t-test on the bootstrap correlations",
              "bootstrap": "bootstrap p-value of the difference"}


def _report_problems(problems: list[str], what: str) -> None:
    if not problems:
        return
    print(f"fastjudge meta-eval: {len(problems)} {what} row(s) skipped:", file=sys.stderr)
    for p in problems[:20]:
        print(f"  {p}", file=sys.stderr)
    if len(problems) > 20:
        print(f"  ... and {len(problems) - 20} more", file=sys.stderr)


def run_meta_eval(args) -> int:
    """``fastjudge meta-eval``: table on stdout, diagnostics on stderr, optional JSON and PNG."""
    import json

    if args.plot:
        try:
            require_matplotlib()  # fail before any work
        except PlotUnavailable as missing:
            print(f"fastjudge: error: {missing}", file=sys.stderr)
            return 2
    if args.bootstrap < 0:
        raise ValueError("--bootstrap must be >= 0")
    by = tuple(f.strip() for f in (args.by or "").split(",") if f.strip())
    wanted = tuple(f.strip() for f in getattr(args, "stats", ",".join(STATS)).split(",")
                   if f.strip())
    if not wanted or any(w not in STATS for w in wanted):
        raise ValueError(f"--stats takes a comma-separated subset of {', '.join(STATS)}")
    fields = [None] if args.field is None else [f.strip() for f in args.field.split(",")]
    if len(fields) not in (1, len(args.scores)):
        raise ValueError(f"--field takes one field or one per score file ({len(args.scores)}), "
                         f"got {len(fields)}")
    if len(fields) == 1:
        fields = fields * len(args.scores)
    specs = [parse_score_spec(spec, f) for spec, f in zip(args.scores, fields)]
    names = [s[0] for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"metric names must differ, got {names}; name them with NAME=PATH")

    human = read_human(args.human, by)
    _report_problems(human.problems, args.human)
    metrics = {}
    for name, path, f in specs:
        data = read_scores(path, f, name)
        f = data.field
        _report_problems(data.problems, path)
        if data.error_rows:
            print(f"fastjudge meta-eval: {path}: {data.error_rows} row(s) with an error or no "
                  f"{f!r} value skipped", file=sys.stderr)
        if not data.scores:
            raise ValueError(f"{path}: no usable {f!r} values (is --field right?)")
        metrics[name] = data.scores
    if not human.scores:
        raise ValueError(f"{args.human}: no usable human judgments")

    result = meta_evaluate(human.scores, metrics, human.groups, by, n_boot=args.bootstrap,
                           seed=args.seed, alpha=args.alpha, test=args.test,
                           ratings=human.ratings or None, stats=wanted)
    for name, u in result["unmatched"].items():
        if u["human_without_score"]:
            print(f"fastjudge meta-eval: {name}: {u['human_without_score']} human-judged id(s) "
                  f"have no score (e.g. {_examples(u['examples_human_without_score'])})",
                  file=sys.stderr)
        if u["score_without_human"]:
            print(f"fastjudge meta-eval: {name}: {u['score_without_human']} scored id(s) have "
                  f"no human judgment (e.g. {_examples(u['examples_score_without_human'])})",
                  file=sys.stderr)
    result["files"] = {"human": str(args.human),
                       "scores": {n: {"path": p, "field": f} for n, p, f in specs}}
    sys.stdout.write(format_markdown(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fjson:
            json.dump(result, fjson, indent=2, ensure_ascii=False)
            fjson.write("\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_meta_eval(result, args.plot)
    print(f"fastjudge meta-eval: {result['n_items']} items, {len(names)} metric(s), "
          f"{len(result['groups'])} group(s), {args.bootstrap} bootstrap resamples"
          + (f" -> {args.json}" if args.json else "") + (f", {args.plot}" if args.plot else ""),
          file=sys.stderr)
    return 0
