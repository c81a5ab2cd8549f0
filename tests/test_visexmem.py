"""VisExMEM and the holistic judge on a tiny random-weight Qwen3.5 vision-language checkpoint:
the pipeline end to end with schema-valid stage outputs, claim support against transformers'
P(yes) on the same full input, prefix reuse exactness, aggregation, part validation, and every
bad-input case."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE

from fastjudge import HolisticJudge, ImageTextExample, VisExJudge
from fastjudge.backends.qwen.caches import prefix_cache_key
from fastjudge.engine_options import EngineOptions
from fastjudge.judges.visexmem import AGGREGATES, PART_TYPES, ClaimResult, aggregate, validate_parts
from fastjudge.runtime.scheduler import run_requests

TOL = 1e-4
BUDGETS = dict(max_claims=3, max_claim_chars=40, max_explanation_chars=60)


@pytest.fixture(scope="module")
def judge(vl_dir):
    # small text budgets: random weights write to the limit, and every step is a model call
    return VisExJudge(vl_dir, **BUDGETS, engine=EngineOptions(device=TEST_DEVICE, dtype="float32"))


@pytest.fixture(scope="module")
def hf(vl_dir):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32).eval()


def image(seed: int, h: int = 72, w: int = 96) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def results(judge):
    examples = [ImageTextExample(image(0), "A red bus is parked beside a tall tree.", id="bus"),
                ImageTextExample(image(1, 64, 64), "Two dogs play on the grass.",
                                 boxes=[[0, 0, 32, 40], [16, 8, 64, 64]], id="dogs")]
    return judge.score(examples)


def test_pipeline_outputs_are_schema_valid(judge, results):
    assert [r.id for r in results] == ["bus", "dogs"]
    for r in results:
        assert r.error is None, r.error
        assert r.claims and 0.0 <= r.score <= 1.0
        ids = [c.part_id for c in r.claims]
        assert len(set(ids)) == len(ids)
        for c in r.claims:
            assert re.fullmatch(r"P[0-9]{1,3}", c.part_id) and c.type in PART_TYPES
            assert isinstance(c.text, str) and c.text
            for link in (c.parent_part_id, c.head_part_id, c.target_part_id):
                assert link is None or (link in ids and link != c.part_id)
            assert 0.0 <= c.support <= 1.0 and c.decision == ("yes" if c.support >= 0.5 else "no")
            assert len(c.evidence_ids) == len(set(c.evidence_ids)) == len(c.evidence_boxes)
            assert all(re.fullmatch(r"E[1-9][0-9]*", e) for e in c.evidence_ids)
            assert isinstance(c.explanation, str)
        assert r.score == pytest.approx(aggregate([c.support for c in r.claims], "mean"))
        assert isinstance(r.explanation, str)
    dogs = results[1]
    for c in dogs.claims:  # the example's own boxes are the candidates
        assert all(b in ([0, 0, 32, 40], [16, 8, 64, 64]) for b in c.evidence_boxes)
    assert judge.stage_seconds["verify"] > 0 and judge.stage_seconds["decompose"] > 0


@pytest.fixture(scope="module")
def shared_judge(judge):
    return VisExJudge(judge.backend, evidence_layout="shared", **BUDGETS)


def _item_with_evidence(judge, seed, caption, evidence):
    items, _ = judge.prepare([ImageTextExample(image(seed), caption)])
    item = items[0]
    judge._propose([item])  # quadrant grid: E1..E4
    claim = ClaimResult(part_id="P1", text="The bus is red.", type="attribute")
    claim.evidence_ids = list(evidence)
    claim.evidence_boxes = [list(item.boxes[int(e[1:]) - 1]) for e in evidence]
    return item, claim


@torch.inference_mode()
def hf_support(hf, judge, request) -> float:
    ids = torch.tensor([list(request.prompt_ids) + list(request.response_prefix)])
    pixel_values = torch.cat([im.pixel_values for im in request.images])
    grid = torch.tensor([im.grid_thw for im in request.images])
    logits = hf(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid,
                mm_token_type_ids=(ids == hf.config.image_token_id).int()).logits[0, -1]
    return float(torch.softmax(logits[list(judge.yes_no_ids)].double(), 0)[0])


@pytest.mark.parametrize("layout", ["per-claim", "shared"])
def test_claim_support_matches_transformers(layout, judge, shared_judge, hf):
    """Claims with zero, one and two evidence crops, of two images, run together (batched
    behind each image's prefix state), against transformers on each full input alone (both
    evidence layouts)."""
    judge = shared_judge if layout == "shared" else judge
    cases = [(0, "A red bus.", ()), (0, "A red bus.", ("E2",)), (0, "A red bus.", ("E1", "E4")),
             (3, "A red bus.", ("E3",))]
    requests = []
    for k, (seed, caption, evidence) in enumerate(cases):
        item, claim = _item_with_evidence(judge, seed, caption, evidence)
        requests.append(judge.verification_request(item, claim, key=k))
    outputs = {o.index: o for b in run_requests(judge.backend, requests, 1 << 16) for o in b}
    for k, request in enumerate(requests):
        ours = float(outputs[k].probs[0])
        assert abs(ours - hf_support(hf, judge, request)) < TOL, cases[k]


def test_prefix_reuse_is_exact_and_keyed_by_image(judge):
    """The same caption over two different images: their prefixes are the same tokens but must
    not share a state; each claim's support equals a run with no prefix reuse at all."""
    a, ca = _item_with_evidence(judge, 5, "Same caption.", ("E1",))
    b, cb = _item_with_evidence(judge, 6, "Same caption.", ("E1",))
    reqs = [judge.verification_request(a, ca, 0), judge.verification_request(b, cb, 1)]
    assert np.array_equal(reqs[0].prompt_ids[: reqs[0].prefix_len], reqs[1].prompt_ids[: reqs[1].prefix_len])
    # score-only rows of both may share a batch, each continuing from its own image's state
    keys = [prefix_cache_key(r.prompt_ids[: r.prefix_len], r.images[: r.prefix_images]) for r in reqs]
    assert not np.array_equal(keys[0], keys[1])
    reused = {o.index: o.probs for bt in run_requests(judge.backend, reqs, 1 << 16) for o in bt}
    for r in reqs:
        r.prefix_len = r.prefix_images = 0
    plain = {o.index: o.probs for bt in run_requests(judge.backend, reqs, 1 << 16) for o in bt}
    for k in (0, 1):
        np.testing.assert_allclose(reused[k], plain[k], atol=1e-6)
    assert abs(reused[0][0] - reused[1][0]) > 1e-9  # different images, different support


def test_aggregation_math():
    s = [0.9, 0.5, 0.2]
    assert aggregate(s, "mean") == pytest.approx(1.6 / 3)
    assert aggregate(s, "min") == 0.2
    assert aggregate(s, "geometric") == pytest.approx((0.9 * 0.5 * 0.2) ** (1 / 3))
    assert aggregate(s, "harmonic") == pytest.approx(3 / (1 / 0.9 + 1 / 0.5 + 1 / 0.2))
    assert aggregate([0.0, 1.0], "geometric") == 0.0 and aggregate([0.0, 1.0], "harmonic") == 0.0
    assert set(AGGREGATES) == {"mean", "geometric", "harmonic", "min"}
    with pytest.raises(ValueError):
        aggregate(s, "median")
    with pytest.raises(ValueError):
        aggregate([], "mean")


def part(pid, parent=None, head=None, target=None):
    return {"part_id": pid, "text": pid, "type": "object", "parent_part_id": parent,
            "head_part_id": head, "target_part_id": target}


def test_validate_parts_repairs_links():
    parts, problems = validate_parts([part("P1", head="P9"), part("P2", parent="P2"),
                                      part("P3", parent="P1"), part("P1"),
                                      part("P4", target="P5"), part("P5", head="P4")])
    assert [p["part_id"] for p in parts] == ["P1", "P2", "P3", "P4", "P5"]
    by = {p["part_id"]: p for p in parts}
    assert by["P1"]["head_part_id"] is None and by["P2"]["parent_part_id"] is None
    assert by["P3"]["parent_part_id"] == "P1"
    assert by["P4"]["target_part_id"] == "P5" and by["P5"]["head_part_id"] is None  # cycle cut
    assert len(problems) == 4 and any("cycle" in p for p in problems)
    assert validate_parts([part("P1"), part("P2", head="P1")])[1] == []


def test_shared_layout_pipeline(shared_judge):
    [r] = shared_judge.score([ImageTextExample(image(12), "A green lamp on a desk.", boxes=[[0, 0, 40, 30]])])
    assert r.error is None and r.claims and isinstance(r.explanation, str)
    assert all(c.evidence_ids in ([], ["E1"]) and 0 <= c.support <= 1 for c in r.claims)
    # every claim's verification shares one prefix holding the whole image and all crops
    item, a = _item_with_evidence(shared_judge, 13, "A lamp.", ("E1",))
    _, b = _item_with_evidence(shared_judge, 13, "A lamp.", ("E2", "E3"))
    ra, rb = (shared_judge.verification_request(item, c) for c in (a, b))
    n = ra.prefix_len
    assert n == rb.prefix_len and np.array_equal(ra.prompt_ids[:n], rb.prompt_ids[:n])
    assert [im.key for im in ra.images[:ra.prefix_images]] == [im.key for im in rb.images[:rb.prefix_images]]
    assert ra.prefix_images == 1 + len(item.boxes) == len(ra.images)


def test_other_aggregates_and_no_explain(vl_dir, judge):
    j = VisExJudge(judge.backend, aggregate="min", explain=False, **BUDGETS)
    [r] = j.score([ImageTextExample(image(7), "A cat sleeps on a sofa.")])
    assert r.error is None and r.explanation is None
    assert all(c.explanation is None for c in r.claims)
    assert r.score == pytest.approx(min(c.support for c in r.claims))


def test_bad_inputs_give_item_errors(tmp_path, judge):
    from PIL import Image as PILImage

    png = io.BytesIO()
    PILImage.fromarray(image(2, 40, 40)).save(png, format="PNG")
    good = tmp_path / "ok.png"
    good.write_bytes(png.getvalue())
    (tmp_path / "corrupt.png").write_bytes(png.getvalue()[:60])
    examples = [
        ImageTextExample(str(tmp_path / "missing.png"), "A dog.", id="missing"),
        ImageTextExample(str(tmp_path / "corrupt.png"), "A dog.", id="corrupt"),
        ImageTextExample(b"not an image", "A dog.", id="bytes"),
        ImageTextExample(np.zeros((8, 8), dtype=np.uint8), "A dog.", id="shape"),
        ImageTextExample(str(good), "   ", id="empty"),
        ImageTextExample(str(good), "A dog.", boxes=[[0, 0, "x", 3]], id="malformed"),
        ImageTextExample(str(good), "A dog.", boxes=[[-5, -5, 20, 60], [3, 3, 3, 10]], id="clipped"),
        ImageTextExample(png.getvalue(), "A dog.", boxes=[[50, 50, 60, 60]], id="outside"),
    ]
    results = {r.id: r for r in judge.score(examples)}
    assert "not found" in results["missing"].error
    assert "corrupt" in results["corrupt"].error or "unreadable" in results["corrupt"].error
    assert "unreadable" in results["bytes"].error
    assert "H x W x 3" in results["shape"].error
    assert "non-empty" in results["empty"].error
    assert "box 1" in results["malformed"].error
    clipped = results["clipped"]
    assert clipped.error is None
    assert any("clipped to [0, 0, 20, 40]" in w for w in clipped.warnings)
    assert any("box 2" in w and "dropped" in w for w in clipped.warnings)
    for c in clipped.claims:
        assert all(b == [0, 0, 20, 40] for b in c.evidence_boxes)
    outside = results["outside"]  # every box dropped: the quadrant fallback, said so
    assert outside.error is None and any("fallback" in w for w in outside.warnings)


def test_caption_without_claims_is_an_item_error(judge):
    [r] = judge.score([ImageTextExample(image(4), " ... !? ", id="x")])
    assert "yielded no claims" in r.error and r.claims == [] and r.score is None
    # claims given replace the decomposition: the caption then needs no words of its own
    [r] = judge.score([ImageTextExample(image(4), "...", id="y", claims=["The bus is red."])])
    assert r.error is None and [c.text for c in r.claims] == ["The bus is red."] and r.score is not None


def test_holistic_matches_transformers(judge, hf):
    h = HolisticJudge(judge.backend, template="fastjudge")  # renormalised over {yes, no}
    examples = [ImageTextExample(image(8), "A red bus."), ImageTextExample(image(9, 64, 80), "Two dogs."),
                ImageTextExample(image(8), "   ")]
    results = h.score(examples)
    assert "non-empty" in results[2].error
    for ex, r in zip(examples[:2], results[:2]):
        request = h._request(0, ex)
        assert r.score == pytest.approx(hf_support(hf, h, request), abs=TOL)
        assert r.decision == ("yes" if r.score >= 0.5 else "no") and sum(r.probs) == pytest.approx(1)


def test_visexmem_cli_resumable(tmp_path, vl_dir):
    from PIL import Image as PILImage

    from fastjudge.cli import main

    for k in range(2):
        PILImage.fromarray(image(20 + k, 48, 64)).save(tmp_path / f"img{k}.png")
    rows = [{"id": "a", "image": "img0.png", "text": "A small boat on a lake."},
            {"id": "b", "image": "img1.png", "text": "A boat.", "boxes": [[0, 0, 30, 30]]},
            {"id": "c", "image": "nope.png", "text": "A boat."}]
    src, out = tmp_path / "pairs.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n")
    argv = ["visexmem", "--model", str(vl_dir), "--input", str(src), "--output", str(out),
            "--device", "cpu", "--dtype", "float32", "--no-explain", "--no-progress",
            "--aggregate", "harmonic", "--max-claims", "3", "--max-claim-chars", "40"]
    assert main(argv) == 0
    first = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in first] == ["a", "b"] and all(r["error"] is None for r in first)
    assert all(r["claims"] and r["explanation"] is None for r in first)
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(argv) == 3  # exit 3: a row is an item error
    second = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in second] == ["a", "b", "c"] and second[:2] == first
    assert "not found" in second[2]["error"]


def test_served_over_http_and_rescored(tmp_path, judge, vl_dir):
    """``fastjudge serve --judge visexmem``'s app: base64 images in, claims out; a path is
    refused (the server reads no files for clients); and ``rescore --judge holistic``."""
    import base64

    from PIL import Image as PILImage
    from starlette.testclient import TestClient

    from fastjudge.cli import main
    from fastjudge.serve import create_app

    png = io.BytesIO()
    PILImage.fromarray(image(30, 48, 48)).save(png, format="PNG")
    b64 = base64.b64encode(png.getvalue()).decode()
    with TestClient(create_app(VisExJudge(judge.backend, explain=False, **BUDGETS), "visexmem")) as c:
        ok = c.post("/v1/score", json={"items": [{"id": "x", "image_b64": b64, "text": "A cup."}]})
        assert ok.status_code == 200, ok.text
        [r] = ok.json()["results"]
        assert r["id"] == "x" and r["error"] is None and r["claims"] and 0 <= r["score"] <= 1
        refused = c.post("/v1/score", json={"items": [{"image": "/etc/passwd", "text": "A cup."}]})
        assert refused.status_code == 422 and "image_b64" in refused.json()["error"]
    PILImage.fromarray(image(31, 48, 48)).save(tmp_path / "a.png")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "image": "a.png", "text": "A cup."}) + "\n"
                   + json.dumps({"id": "b", "image": "missing.png", "text": "A cup."}) + "\n")
    assert main(["rescore", "--judge", "holistic", "--model", str(vl_dir), "--input", str(src),
                 "--output", str(out), "--device", "cpu", "--dtype", "float32", "--no-progress"]) == 3
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert 0 <= rows["a"]["score"] <= 1 and rows["a"]["decision"] in ("yes", "no")
    assert "not found" in rows["b"]["error"]
