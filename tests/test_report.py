"""``fastjudge report``: escaping, the --limit bound, the summary over every row, the charts, and
the page as a real headless Chromium renders it (box pixel positions, no injected element, no JS
error), measured by this test from the rendered DOM: the page itself carries no test code."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from fastjudge.cli import main
from fastjudge.report import build_report
from fastjudge.report.html import safe_json
from fastjudge.report.sample import write_sample

HOSTILE = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_safe_json_escapes_markup():
    text = safe_json({"a": "</script><b>&"})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"a": "</script><b>&"}


def test_hostile_text_is_escaped(tmp_path):
    src = _write(tmp_path / "o.jsonl", [{"id": "x", "text": HOSTILE, "score": 1.0, "claims": [
        {"part_id": "P1", "text": HOSTILE, "explanation": HOSTILE}]},
        {"id": "q", "question": HOSTILE, "references": [HOSTILE], "prediction": HOSTILE,
         "rating": 3, "rationale": HOSTILE, "score": 1.0}])
    page = build_report(src)
    assert "window.__pwned" in page  # the text is there ...
    assert "<script>window.__pwned" not in page and "<img src=x" not in page  # ... as text


def test_limit_bounds_page_and_summary_counts_all(tmp_path):
    rows = [{"id": f"q{i}", "question": "what?", "references": ["a"] * 10, "prediction": "a",
             "rating": 1 + i % 3, "probs": {"1": 0.1, "2": 0.2, "3": 0.7}, "score": (i % 3) / 2}
            for i in range(20000)]
    src = _write(tmp_path / "big.jsonl", rows)
    small = build_report(src, limit=10)
    assert small.count('<section class="row') == 10
    assert 'data-total="20000"' in small and "19990 omitted" in small
    # ratings histogram covers every row, not only the 10 drawn
    assert "rating 1: 6667 rows</title>" in small and "rating 3: 6666 rows</title>" in small
    assert len(small) < 40_000  # size follows --limit, not the input


def test_score_histogram_has_axes_and_even_bins(tmp_path):
    scores = [0.0, 0.05, 0.5, 0.5, 0.99, 1.0, 1.0]
    src = _write(tmp_path / "o.jsonl", [{"id": f"i{k}", "text": "t", "score": s, "claims": []}
                                        for k, s in enumerate(scores)])
    page = build_report(src)
    chart = page[page.index('<svg class="chart"'):page.index("</svg>")]
    assert "Scores of 7 rows" in chart
    assert ">score</text>" in chart and ">rows</text>" in chart  # both axes labelled
    # ten bins of 0.1 over [0, 1], empty ones drawn too; edges as ticks
    assert chart.count("<rect") == 10
    assert [t for t in re.findall(r'text-anchor="middle">([0-9.]+)</text>', chart)][-11:] == \
        ["0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1"]
    assert "score [0, 0.1): 2 rows</title>" in chart and "score [0.9, 1]: 3 rows</title>" in chart
    assert "score [0.5, 0.6): 2 rows</title>" in chart and "score [0.1, 0.2): 0 rows</title>" in chart
    # scores outside [0, 1] (e.g. a 0-100 scale): bins over their range
    wide = build_report(_write(tmp_path / "w.jsonl", [{"id": str(k), "text": "t", "score": float(k),
                                                       "claims": []} for k in range(0, 101, 5)]))
    assert "score [90, 100]: 3 rows</title>" in wide


def test_page_carries_no_test_scaffolding(tmp_path):
    page = build_report(write_sample(tmp_path / "s"), image_root=tmp_path / "s")
    assert "selftest" not in page and "<pre" not in page and "__errors" not in page
    assert page.count("<script") == 2  # the summary JSON and the page's own script


def test_bad_lines_and_human_meta_eval(tmp_path):
    src = tmp_path / "o.jsonl"
    src.write_text("".join(json.dumps({"id": f"i{k}", "rating": 1 + k % 3, "prediction": "p",
                                       "score": (k % 3) / 2}) + "\n" for k in range(30)) + "{oops\n")
    human = _write(tmp_path / "h.jsonl", [{"id": f"i{k}", "human_score": (k % 3) + (k % 2) * 0.1}
                                          for k in range(30)])
    page = build_report(src, human=human)
    assert "1 unreadable lines" in page and "line 31: not JSON" in page
    assert re.search(r"<td>all</td><td>30</td><td>0\.\d{3} \[0\.\d{3}, [01]\.\d{3}\]", page)
    assert "Kendall" in page and page.count("<circle") == 30


CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--no-first-run"]


def _chromium():
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("no chromium binary (install the Debian package 'chromium')")
    return binary


# Added to a copy of the page by this test only: count script errors from the start, and on load
# write what the rendered DOM says (rows, scripts, each box's position relative to its picture).
PROBE_HEAD = ("<script>window.__probeErrors=0;window.addEventListener('error',"
              "function(){window.__probeErrors++;});</script>")
PROBE_BODY = """<script>window.addEventListener('load',function(){
var out={rows:document.querySelectorAll('.row').length,boxes:[],errors:window.__probeErrors,
scripts:document.scripts.length-2};
document.querySelectorAll('.figure').forEach(function(f,i){var img=f.querySelector('img').getBoundingClientRect();
f.querySelectorAll('.box').forEach(function(b){var r=b.getBoundingClientRect();out.boxes.push({figure:i,
eid:b.dataset.eid,x:r.left-img.left,y:r.top-img.top,w:r.width,h:r.height,img_w:img.width,img_h:img.height});});});
var pre=document.createElement('pre');pre.id='probe';pre.textContent=JSON.stringify(out);
document.body.appendChild(pre);});</script>"""


def _measure(binary, page, tmp_path) -> tuple[dict, str]:
    """The rendered page's geometry, read from the DOM by the probe, and the DOM itself."""
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text(encoding="utf-8").replace("<head>", "<head>" + PROBE_HEAD, 1)
                      .replace("</body>", PROBE_BODY + "</body>", 1), encoding="utf-8")
    dom = subprocess.run([binary, *CHROME_FLAGS, f"--user-data-dir={tmp_path / 'p1'}",
                          "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    found = re.search(r'<pre id="probe">([^<]*)</pre>', dom)
    assert found, dom[-2000:]
    return json.loads(found.group(1)), dom


def test_page_in_headless_chromium(tmp_path):
    binary = _chromium()
    folder = tmp_path / "sample"
    rows_path = write_sample(folder)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    rows[1]["text"] = HOSTILE
    _write(rows_path, rows)
    out = tmp_path / "r.html"
    assert main(["report", "--input", str(rows_path), "--image-root", str(folder),
                 "--output", str(out)]) == 0
    measured, dom = _measure(binary, out, tmp_path)
    assert measured["rows"] == 3 and measured["errors"] == 0
    assert measured["scripts"] == 2  # the summary JSON and the page script: nothing injected
    assert "__pwned" in dom and "<img src=\"x\"" not in dom
    # the ball picture is 400 x 300, drawn at its size: boxes land on their pixel coordinates
    by_id = {b["eid"]: b for b in measured["boxes"] if b["figure"] == 0}
    for eid, (x0, y0, x1, y1) in {"E1": (40, 120, 160, 240), "E2": (250, 60, 370, 230),
                                  "E3": (0, 220, 400, 300)}.items():
        b = by_id[eid]
        scale = b["img_w"] / 400
        assert b["x"] == pytest.approx(x0 * scale, abs=1) and b["y"] == pytest.approx(y0 * scale, abs=1)
        assert b["w"] == pytest.approx((x1 - x0) * scale, abs=1)
        assert b["h"] == pytest.approx((y1 - y0) * scale, abs=1)
    shot = tmp_path / "report.png"
    subprocess.run([binary, *CHROME_FLAGS, f"--user-data-dir={tmp_path / 'p2'}",
                    f"--screenshot={shot}", "--window-size=1280,1600", out.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000


def test_image_b64_rows_and_bad_images(tmp_path):
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (50, 40), (10, 200, 10)).save(buf, format="PNG")
    src = _write(tmp_path / "o.jsonl", [
        {"id": "b64", "image_b64": base64.b64encode(buf.getvalue()).decode(), "text": "green",
         "score": 1.0, "claims": []},
        {"id": "bad", "image_b64": "bm90IGFuIGltYWdl", "text": "x", "score": 0.0, "claims": []}])
    page = build_report(src)
    assert page.count("data:image/jpeg;base64,") == 1 and 'data-w="50" data-h="40"' in page
    assert "image image_b64:" in page  # the undecodable picture is one message, not a crash


def test_sort_by_disagreement_with_other_scores(tmp_path):
    src = _write(tmp_path / "o.jsonl", [{"id": f"q{i}", "prediction": "a", "rating": 3,
                                         "score": 1.0} for i in range(4)])
    other = _write(tmp_path / "acc.jsonl", [{"id": f"q{i}", "score": s}
                                            for i, s in enumerate([1.0, 0.0, 0.6, 0.3])])
    page = build_report(src, sort="disagreement", scores_path=other)
    order = re.findall(r'<h3>#\d+ (q\d)', page)
    assert order == ["q1", "q3", "q2", "q0"]
    assert 'data-gap="1.000"' in page


def test_lave_output_probabilities_and_vqa_acc_scores(tmp_path, capsys):
    """LAVE rows as ``fastjudge lave`` writes them (``probs``: a list over ratings 1-3) get their
    probability bars; ``--scores`` takes ``vqa-acc`` output at its own field (``vqa_accuracy``)
    and refuses a file with no score field instead of drawing empty gaps."""
    src = _write(tmp_path / "lave.jsonl", [
        {"id": f"q{i}", "question": "Q?", "references": ["a"], "prediction": "a", "rating": 3,
         "score": 1.0, "probs": [0.1, 0.2, 0.7]} for i in range(3)])
    acc = _write(tmp_path / "acc.jsonl", [{"id": f"q{i}", "vqa_accuracy": v, "exact_match": 1.0, "error": None}
                                          for i, v in enumerate([1.0, 0.0, 0.3])])
    page = build_report(src, sort="disagreement", scores_path=acc)
    assert page.count('class="probs"') == 3 and "3: " in page and "width:70%" in page
    assert re.findall(r'<h3>#\d+ (q\d)', page) == ["q1", "q2", "q0"]
    assert 'data-gap="1.000"' in page and 'data-gap="0.700"' in page
    bad = _write(tmp_path / "bad.jsonl", [{"id": "q0", "accuracy": 1.0}])
    out = tmp_path / "r.html"
    assert main(["report", "--input", str(src), "--scores", str(bad), "--output", str(out)]) == 2
    assert "none of the fields score, vqa_accuracy" in capsys.readouterr().err and not out.exists()
    assert main(["report", "--input", str(src), "--scores", str(bad), "--scores-field", "accuracy",
                 "--output", str(out)]) == 0
    assert main(["report", "--input", str(src), "--sort", "disagreement", "--output", str(out)]) == 2
