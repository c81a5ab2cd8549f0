"""``fastjudge vqa-acc`` and ``fastjudge meta-eval`` end to end on files written in tmp_path."""

from __future__ import annotations

import importlib.util
import json
import random

import numpy as np
import pytest
import scipy.stats
from conftest import read_rows, write_lines

from fastjudge.cli import main
from fastjudge.metrics import exact_match, human_score, vqa_accuracy

HAS_MPL = importlib.util.find_spec("matplotlib") is not None

VALID = [
    {"id": "q1", "question": "What color is the kite?", "references": ["red"] * 9 + ["Red"],
     "prediction": "Red."},
    {"id": "q2", "question": "Is the kite flying?",
     "references": [{"answer": "yes", "answer_id": i} for i in range(1, 10)]
     + [{"answer": "no", "answer_id": 10}], "prediction": "no", "extra": {"keep": [1, 2]}},
    {"id": "q3", "question": "How many dogs?", "references": ["two"] * 10, "prediction": "2"},
    {"id": 4, "question": "What is on the table?", "references": ["cake"], "prediction": "cake"},
]


def vqa_acc(inp, out, *extra):
    return main(["vqa-acc", "--input", str(inp), "--output", str(out), "--no-progress", *extra])


@pytest.fixture
def mixed_input(tmp_path):
    lines = [json.dumps(VALID[0]), json.dumps(VALID[1]),
             '{"id": "broken", "question": "Is it',  # line 3: malformed JSON
             '["an", "array"]',  # line 4: not an object
             "",  # blank: skipped
             json.dumps({"id": "empty", "question": "What?", "references": [], "prediction": "x"}),
             json.dumps({"id": "nopred", "question": "What?", "references": ["a"]}),  # line 7
             json.dumps(VALID[2]), json.dumps(VALID[3]),
             json.dumps({"question": "No id?", "references": ["x", "y"], "prediction": "x"})]
    return write_lines(tmp_path / "in.jsonl", lines)


def test_vqa_acc_mixed_input(mixed_input, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert vqa_acc(mixed_input, out) == 3  # exit 3: some rows are item errors
    rows = read_rows(out)
    by_id = {str(r["id"]): r for r in rows}
    assert len(rows) == len(by_id) == 9
    assert "line 3" in by_id["line-3"]["error"] and "invalid JSON" in by_id["line-3"]["error"]
    assert "line 4" in by_id["line-4"]["error"] and "JSON object" in by_id["line-4"]["error"]
    assert by_id["empty"]["error"].startswith("line 6:") and "empty" in by_id["empty"]["error"]
    assert by_id["nopred"]["error"].startswith("line 7:") and "prediction" in by_id["nopred"]["error"]
    assert by_id["empty"]["question"] == "What?"  # invalid items keep their input fields
    for key in ("line-3", "line-4", "empty", "nopred"):
        assert by_id[key]["vqa_accuracy"] is None and by_id[key]["exact_match"] is None

    for item in VALID:
        row = by_id[str(item["id"])]
        for k, v in item.items():
            assert row[k] == v  # input fields carried through (id type too)
        assert row["error"] is None
        assert row["vqa_accuracy"] == vqa_accuracy(item["prediction"], item["references"])
        assert row["exact_match"] == exact_match(item["prediction"], item["references"])
    assert by_id["q1"]["vqa_accuracy"] == 1.0       # two distinct refs: normalized
    assert by_id["q2"]["vqa_accuracy"] == pytest.approx(0.3)
    assert by_id["q3"]["vqa_accuracy"] == 0.0       # one distinct ref: "2" != "two"
    assert by_id["q3"]["exact_match"] == 1.0        # exact match always normalizes
    assert by_id["4"]["vqa_accuracy"] == pytest.approx(1 / 3)  # single reference, "vqa" mode
    assert by_id["line-10"]["vqa_accuracy"] == pytest.approx(1 / 6)

    err = capsys.readouterr().err
    summary = [line for line in err.splitlines() if line.startswith("fastjudge vqa-acc:")]
    assert len(summary) == 1, err
    assert "9 items (0 already done), 4 errors" in summary[0]
    accs = [r["vqa_accuracy"] for r in rows if r["error"] is None]
    assert f"mean VQA accuracy {sum(accs) / len(accs):.4f}" in summary[0]
    assert "items/s" in summary[0] and str(out) in summary[0]


def test_vqa_acc_options(mixed_input, tmp_path):
    out = tmp_path / "out.jsonl"
    assert vqa_acc(mixed_input, out, "--normalize", "always", "--single-reference", "exact") == 3
    by_id = {str(r["id"]): r for r in read_rows(out)}
    assert by_id["q3"]["vqa_accuracy"] == 1.0
    assert by_id["4"]["vqa_accuracy"] == 1.0


def test_vqa_acc_resume(mixed_input, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert vqa_acc(mixed_input, out) == 3
    first = out.read_bytes()
    rows = read_rows(out)
    assert vqa_acc(mixed_input, out) == 0
    assert out.read_bytes() == first
    assert "0 items (9 already done)" in capsys.readouterr().err

    kept = [r for r in rows if str(r["id"]) not in ("q2", "line-4", "4")]
    partial = json.dumps(rows[-1])[:20]
    out.write_text("".join(json.dumps(r) + "\n" for r in kept) + partial, encoding="utf-8")
    assert vqa_acc(mixed_input, out) == 3  # line-4 is written again: an item error
    err = capsys.readouterr().err
    assert "partial" in err and "3 items (6 already done)" in err
    final = read_rows(out)
    assert final[:len(kept)] == kept
    assert sorted(str(r["id"]) for r in final) == sorted(str(r["id"]) for r in rows)
    before = {str(r["id"]): r for r in rows}
    for r in final:
        assert r == before[str(r["id"])]


def test_vqa_acc_missing_input(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert vqa_acc(tmp_path / "absent.jsonl", out) == 2
    assert "absent.jsonl" in capsys.readouterr().err
    assert not out.exists()


# --- meta-eval ---------------------------------------------------------------------------------
MODELS, DATASETS = ("blip2", "blip"), ("vqav2", "okvqa")


@pytest.fixture
def meta_files(tmp_path):
    """120 items, 4 model/dataset groups; human file with ratings or human_score; a LAVE-like
    score file (with error rows and an extra id) and a vqa-acc-like one (vqa_accuracy field)."""
    rng = random.Random(0)
    human_lines, lave_rows, vqa_rows, truth = [], [], [], {}
    for i in range(120):
        quality = rng.random()
        ratings = [int(rng.random() < quality) for _ in range(5)]
        row = {"id": f"q{i}", "model": MODELS[i % 2], "dataset": DATASETS[(i // 2) % 2]}
        if i % 3:
            row["ratings"] = ratings
            truth[f"q{i}"] = human_score(ratings)
        else:
            row["human_score"] = human_score(ratings)
            truth[f"q{i}"] = row["human_score"]
        human_lines.append(json.dumps(row))
        lave_rows.append({"id": f"q{i}", "score": round(quality * 2) / 2, "error": None,
                          "rating": 1})
        vqa_rows.append({"id": f"q{i}", "vqa_accuracy": min(1.0, round(rng.random() * quality * 10) / 3),
                         "error": None})
    human_lines.insert(5, "{not json")  # line 6
    human_lines.append(json.dumps({"id": "q1", "human_score": 1.0}))  # duplicate id, line 122
    human_lines.append(json.dumps({"id": "bad", "ratings": [1, 1, 1]}))  # line 123
    human_lines.append(json.dumps({"id": "nojudge"}))  # line 124
    human_lines.append(json.dumps({"id": "h-only", "human_score": 0.5, "model": "blip"}))
    lave_rows[7] = {"id": "q7", "score": None, "error": "line 8: prompt too long"}
    lave_rows.append({"id": "s-only", "score": 0.5, "error": None})
    human = write_lines(tmp_path / "human.jsonl", human_lines)
    lave = write_lines(tmp_path / "lave_ft5.jsonl", [json.dumps(r) for r in lave_rows])
    vqa = write_lines(tmp_path / "vqa.jsonl", [json.dumps(r) for r in vqa_rows])
    return human, lave, vqa, truth, {r["id"]: r for r in lave_rows}, {r["id"]: r for r in vqa_rows}


def meta(*args):
    return main(["meta-eval", *map(str, args)])


def test_meta_eval_end_to_end(meta_files, tmp_path, capsys):
    human, lave, vqa, truth, lave_by_id, vqa_by_id = meta_files
    out_json = tmp_path / "res" / "meta.json"
    rc = meta("--human", human, "--scores", lave, f"vqa_acc={vqa}", "--field", "score,vqa_accuracy",
              "--by", "model,dataset", "--bootstrap", "300", "--json", out_json)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    err, out = captured.err, captured.out

    # diagnostics: skipped lines by number, unmatched ids on both sides
    assert "line 6" in err and "invalid JSON" in err
    assert "line 122" in err and "duplicate id 'q1'" in err
    assert "line 123" in err and "5 binary ratings" in err
    assert "line 124" in err and "human_score or ratings" in err
    assert "1 row(s) with an error" in err
    assert "lave_ft5: 2 human-judged id(s) have no score" in err and "'h-only'" in err
    assert "lave_ft5: 1 scored id(s) have no human judgment" in err and "'s-only'" in err

    # markdown: one table per statistic, metric x group, bold best-significant
    assert "### Spearman's ρ with human judgments (95% bootstrap CI)" in out
    assert "### Kendall's τ-b with human judgments" in out
    header = [line for line in out.splitlines() if line.startswith("| metric |")]
    assert len(header) == 2
    assert "all (n=119)" in header[0] and "model=blip2, dataset=vqav2" in header[0]
    table_rows = [line for line in out.splitlines() if line.startswith("| lave_ft5 |")]
    assert len(table_rows) == 2 and table_rows[0].count("[") == 5  # value [CI] in 5 columns
    assert "Krippendorff's α" in out

    res = json.loads(out_json.read_text())
    assert res["n_items"] == 119 and res["metrics"] == ["lave_ft5", "vqa_acc"]
    assert res["by"] == ["model", "dataset"] and len(res["groups"]) == 5
    assert res["unmatched"]["lave_ft5"]["human_without_score"] == 2
    assert res["files"]["scores"]["vqa_acc"]["field"] == "vqa_accuracy"
    ids = sorted(set(truth) - {"q7"})
    h = [truth[i] for i in ids]
    m = [lave_by_id[i]["score"] for i in ids]
    v = [vqa_by_id[i]["vqa_accuracy"] for i in ids]
    overall = res["groups"][0]
    assert overall["label"] == "all" and overall["n"] == 119
    assert overall["metrics"]["lave_ft5"]["spearman"] == pytest.approx(
        scipy.stats.spearmanr(m, h).statistic, abs=1e-12)
    assert overall["metrics"]["vqa_acc"]["kendall"] == pytest.approx(
        scipy.stats.kendalltau(v, h).statistic, abs=1e-12)
    lo, hi = overall["metrics"]["lave_ft5"]["spearman_ci"]
    assert lo < overall["metrics"]["lave_ft5"]["spearman"] < hi
    # groups: blip2 / vqav2 holds ids with i % 2 == 0 and (i // 2) % 2 == 0
    g = next(g for g in res["groups"] if g["fields"] == {"model": "blip2", "dataset": "vqav2"})
    gids = [i for i in ids if int(i[1:]) % 4 == 0]
    assert g["n"] == len(gids)
    assert g["metrics"]["vqa_acc"]["spearman"] == pytest.approx(scipy.stats.spearmanr(
        [vqa_by_id[i]["vqa_accuracy"] for i in gids], [truth[i] for i in gids]).statistic, abs=1e-12)
    comps = [c for c in overall["comparisons"] if c["stat"] == "spearman"]
    assert len(comps) == 1 and {"p_value", "p_bootstrap", "diff_ci", "significant"} <= set(comps[0])
    best = overall["best"]["spearman"]
    assert best["metric"] in res["metrics"] and best["significant"] == comps[0]["significant"]
    if best["significant"]:
        assert f"| {best['metric']} | **" in out

    # deterministic: same command, same JSON
    out2 = tmp_path / "meta2.json"
    assert meta("--human", human, "--scores", lave, f"vqa_acc={vqa}", "--field",
                "score,vqa_accuracy", "--by", "model,dataset", "--bootstrap", "300",
                "--json", out2) == 0
    res2 = json.loads(out2.read_text())
    res2["files"] = res["files"]
    assert res2 == res


def test_meta_eval_no_bootstrap(meta_files, tmp_path, capsys):
    human, lave, vqa, *_ = meta_files
    out_json = tmp_path / "m.json"
    assert meta("--human", human, "--scores", lave, "--bootstrap", "0", "--json", out_json,
                "--stats", "spearman") == 0
    out = capsys.readouterr().out
    assert "bootstrap CI" not in out and "**" not in out and "[" not in out.split("###")[1]
    assert "Kendall" not in out
    res = json.loads(out_json.read_text())
    assert "spearman_ci" not in res["groups"][0]["metrics"]["lave_ft5"]
    assert "kendall" not in res["groups"][0]["metrics"]["lave_ft5"]
    assert res["groups"][0]["comparisons"] == [] and res["stats"] == ["spearman"]


@pytest.mark.skipif(HAS_MPL, reason="matplotlib is installed")
def test_meta_eval_plot_without_matplotlib(meta_files, tmp_path, capsys):
    human, lave, *_ = meta_files
    out_json = tmp_path / "m.json"
    assert meta("--human", human, "--scores", lave, "--plot", tmp_path / "p.png",
                "--json", out_json) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "fastjudge[plot]" in err and "Traceback" not in err
    assert not out_json.exists()  # failed before doing any work


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_meta_eval_plot(meta_files, tmp_path):
    human, lave, vqa, *_ = meta_files
    png = tmp_path / "plots" / "corr.png"
    assert meta("--human", human, "--scores", lave, f"vqa={vqa}", "--field", "score,vqa_accuracy",
                "--by", "model", "--bootstrap", "100", "--plot", png) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("extra, message", [
    (["--field", "a,b,c"], "--field takes one field or one per score file"),
    (["--field", "nope"], "no usable 'nope' values"),
    (["--bootstrap", "-1"], "--bootstrap must be >= 0"),
    (["--stats", "pearson"], "--stats takes"),
])
def test_meta_eval_bad_arguments(meta_files, capsys, extra, message):
    human, lave, vqa, *_ = meta_files
    assert meta("--human", human, "--scores", lave, vqa, *extra) == 2
    err = capsys.readouterr().err
    assert "fastjudge: error:" in err and message in err and "Traceback" not in err


def test_meta_eval_name_clash_and_no_overlap(meta_files, tmp_path, capsys):
    human, lave, *_ = meta_files
    assert meta("--human", human, "--scores", lave, lave) == 2
    assert "metric names must differ" in capsys.readouterr().err
    other = write_lines(tmp_path / "other.jsonl", [json.dumps({"id": "zzz", "score": 1.0})])
    assert meta("--human", human, "--scores", other) == 2
    assert "no item has a human score" in capsys.readouterr().err
    assert meta("--human", tmp_path / "absent.jsonl", "--scores", lave) == 2
    assert "absent.jsonl" in capsys.readouterr().err


def test_vqa_acc_output_feeds_meta_eval(tmp_path, capsys):
    """The two commands chain: vqa-acc output is a score file with --field vqa_accuracy."""
    rng = np.random.default_rng(0)
    items, human = [], []
    for i in range(60):
        refs = list(rng.choice(["red", "blue", "dark red"], 10))
        pred = str(rng.choice(["red", "blue", "green"]))
        items.append(json.dumps({"id": i, "question": "Color?", "references": refs,
                                 "prediction": pred}))
        human.append(json.dumps({"id": i, "ratings": [int(pred in refs)] * 4 + [0]}))
    inp = write_lines(tmp_path / "in.jsonl", items)
    hum = write_lines(tmp_path / "h.jsonl", human)
    out = tmp_path / "vqa.jsonl"
    assert vqa_acc(inp, out) == 0
    assert meta("--human", hum, "--scores", f"acc={out}", f"em={out}", "--field",
                "vqa_accuracy,exact_match", "--bootstrap", "50") == 0
    text = capsys.readouterr().out
    assert "| acc |" in text and "| em |" in text and "all (n=60)" in text


def test_meta_eval_reads_each_file_its_own_field(tmp_path, capsys):
    """Without --field, a judge's output is read at ``score`` and vqa-acc's at ``vqa_accuracy``
    (the README's pipeline: ``meta-eval --scores lave.jsonl acc.jsonl``); a file with neither
    field is refused, naming the field it looked for."""
    rng = np.random.default_rng(1)
    items, human, judged = [], [], []
    for i in range(40):
        refs = list(rng.choice(["red", "blue"], 10))
        pred = str(rng.choice(["red", "blue", "green"]))
        items.append(json.dumps({"id": i, "question": "Color?", "references": refs, "prediction": pred}))
        human.append(json.dumps({"id": i, "human_score": float(pred in refs)}))
        judged.append(json.dumps({"id": i, "score": float(rng.random()), "error": None}))
    inp = write_lines(tmp_path / "in.jsonl", items)
    hum = write_lines(tmp_path / "h.jsonl", human)
    lave = write_lines(tmp_path / "lave.jsonl", judged)
    acc = tmp_path / "acc.jsonl"
    assert vqa_acc(inp, acc) == 0
    capsys.readouterr()
    assert meta("--human", hum, "--scores", lave, acc, "--bootstrap", "0", "--json", tmp_path / "m.json") == 0
    result = json.loads((tmp_path / "m.json").read_text())
    rho = result["groups"][0]["metrics"]
    expected = scipy.stats.spearmanr([float(json.loads(h)["human_score"]) for h in human],
                                     [r["vqa_accuracy"] for r in read_rows(acc)]).statistic
    assert rho["acc"]["spearman"] == pytest.approx(expected)
    other = write_lines(tmp_path / "other.jsonl", [json.dumps({"id": i, "value": 0.5}) for i in range(40)])
    assert meta("--human", hum, "--scores", other, "--bootstrap", "0") == 2
    assert "no usable 'score' values" in capsys.readouterr().err
