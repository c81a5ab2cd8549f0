"""VisExMEM's given claims and the paper's controls on a tiny random-weight Qwen3.5
vision-language checkpoint: claims given with an example replace the decomposition (validated
and bounded); ``mode="single-response"`` (the "Dec." control, the paper's Fig. 9) answers in one
constrained response mapped onto the pipeline's result fields; ``mode="holistic-score"`` (the
"Hol." control) reads a 0..100 score as its expected value, checked against transformers; the
``claims`` field of an input row and the ``--mode`` option.

Random weights write every string to its length limit, so the budgets are tight."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE, read_rows, write_lines

from fastjudge import ImageTextExample, VisExJudge
from fastjudge.engine_options import EngineOptions
from fastjudge.judges.items import ItemError, image_text_from_row, parse_image_text_item
from fastjudge.judges.visexmem import PART_TYPES, SCORE_MAX, IntegerReading
from fastjudge.judges.visexmem.prompts import HOLISTIC_SCORE_TASK
from fastjudge.runtime.requests import Choice

TOL = 1e-4
BUDGETS = dict(max_claims=2, max_claim_chars=16, max_explanation_chars=16)


@pytest.fixture(scope="module")
def judge(vl_dir):
    return VisExJudge(vl_dir, explain=False, **BUDGETS, engine=EngineOptions(device=TEST_DEVICE, dtype="float32"))


def image(seed: int, h: int = 56, w: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def fresh(judge, **options) -> VisExJudge:
    """A judge on the same backend (fresh stage timers)."""
    return VisExJudge(judge.backend, **{"explain": False, **BUDGETS, **options})


# -- given claims ------------------------------------------------------------------------------
def test_given_claims_replace_the_decomposition(judge):
    j = fresh(judge)
    claims = ["A red bus.", {"part_id": "X7", "text": " It is   parked. ", "type": "action",
                             "head_part_id": "X9", "parent_part_id": "P1"}]
    [r] = j.score([ImageTextExample(image(0), "A red bus is parked.", boxes=[[0, 0, 30, 30]], claims=claims)])
    assert r.error is None, r.error
    assert j.stage_seconds["decompose"] == 0 and j.stage_seconds["verify"] > 0
    assert [(c.part_id, c.text, c.type) for c in r.claims] == [("P1", "A red bus.", None),
                                                              ("X7", "It is parked.", "action")]
    x7 = r.claims[1]
    assert x7.parent_part_id == "P1" and x7.head_part_id is None  # unknown id repaired, and said so
    assert any("X7.head_part_id" in w for w in r.warnings)
    assert all(0 <= c.support <= 1 and c.evidence_ids in ([], ["E1"]) for c in r.claims)
    assert r.score == pytest.approx(np.mean([c.support for c in r.claims]))


@pytest.mark.parametrize("claims, message", [
    ([], "claims is empty"),
    (["a", "b", "c"], "3 claims given; at most max_claims=2"),
    (["x" * 17], "claim 1 is 17 characters; at most max_claim_chars=16"),
    (["ok", "   "], "claim 2 needs a non-empty text"),
    ([{"part_id": "P1", "text": "a"}, {"part_id": "P1", "text": "b"}], "part_id P1 repeated"),
    ([{"text": "a", "score": 1}], "unknown field(s) score"),
    ([{"text": "a", "type": 3}], "type must be a string or null"),
    ([{"text": "a", "part_id": "x" * 17}], "part_id is over max_claim_chars=16"),
    ("A bus.", "must be a list"),
])
def test_given_claims_are_validated_and_bounded(judge, claims, message):
    [r] = judge.score([ImageTextExample(image(1), "A bus.", claims=claims)])
    assert r.error and message in r.error and r.claims == [] and r.score is None


def test_given_claims_links_strict(judge):
    claims = [{"text": "A bus.", "head_part_id": "P2"}, {"text": "It is red.", "parent_part_id": "P2"}]
    [r] = fresh(judge, strict=True).score([ImageTextExample(image(2), "A red bus.", claims=claims)])
    assert "invalid decomposition" in r.error and "P2.parent_part_id links to itself" in r.error


def test_claims_field_of_rows_and_requests():
    row = {"image": "a.png", "text": "A cup.", "claims": ["A cup.", {"text": "It is blue.", "type": "attribute"}]}
    assert image_text_from_row(row, "r1").claims == row["claims"]
    assert image_text_from_row({"image": "a.png", "text": "A cup."}).claims is None
    for bad, problem in (("A cup.", "items[0].claims: expected a list"),
                         ([], "items[0].claims: List should have at least 1 item"),
                         ([3], 'items[0].claims[0]: a claim is a string or an object with a "text"'),
                         ([{"type": "object"}], "items[0].claims[0].text: field required")):
        with pytest.raises(ItemError) as refused:
            parse_image_text_item({"image_b64": "", "text": "A cup.", "claims": bad}, "items[0]")
        assert str(refused.value).startswith(problem)
    given = parse_image_text_item({"image_b64": "", "text": "A cup.", "claims": row["claims"]}, "x")
    assert given.claims == row["claims"]  # objects pass through whole: the judge checks their fields


# -- "Dec.": one constrained response ------------------------------------------------------------
def _is_score(value) -> bool:
    """An integer 0..SCORE_MAX read as value / SCORE_MAX."""
    return 0 <= value <= 1 and abs(value * SCORE_MAX - round(value * SCORE_MAX)) < 1e-9


def _assert_rated(claim, candidates):
    assert claim.support is not None and _is_score(claim.support)
    assert 0 <= claim.support <= 1 and claim.decision == ("yes" if claim.support >= 0.5 else "no")
    assert claim.evidence_ids == sorted(set(claim.evidence_ids), key=lambda e: int(e[1:]))
    assert all(e in candidates for e in claim.evidence_ids) and len(claim.evidence_boxes) == len(claim.evidence_ids)


def test_single_response_decomposes_rates_and_explains(judge):
    j = fresh(judge, mode="single-response", explain=True)
    [r] = j.score([ImageTextExample(image(3), "Two dogs play on the grass.", id="dogs")])
    assert r.error is None, r.error
    assert j.stage_seconds["single-response"] > 0
    assert all(j.stage_seconds[s] == 0 for s in ("decompose", "propose", "select", "verify", "explain"))
    assert 1 <= len(r.claims) <= BUDGETS["max_claims"]
    ids = [c.part_id for c in r.claims]
    for c in r.claims:
        assert re.fullmatch(r"P[0-9]{1,3}", c.part_id) and c.type in PART_TYPES
        assert 0 < len(c.text) <= BUDGETS["max_claim_chars"]
        assert all(link is None or (link in ids and link != c.part_id)
                   for link in (c.parent_part_id, c.head_part_id, c.target_part_id))
        _assert_rated(c, {"E1", "E2", "E3", "E4"})  # no boxes given: the quadrants
        assert isinstance(c.explanation, str) and 0 < len(c.explanation) <= BUDGETS["max_explanation_chars"]
    assert _is_score(r.score)  # the model's overall score
    assert isinstance(r.explanation, str)


def test_single_response_rates_given_claims(judge):
    j = fresh(judge, mode="single-response")
    claims = ["A cat.", {"part_id": "Q", "text": "It sleeps.", "type": "action"}]
    [r] = j.score([ImageTextExample(image(4), "A cat sleeps.", boxes=[[0, 0, 20, 20], [10, 10, 40, 50]],
                                    claims=claims)])
    assert r.error is None, r.error
    assert [(c.part_id, c.text) for c in r.claims] == [("P1", "A cat."), ("Q", "It sleeps.")]
    for c in r.claims:
        _assert_rated(c, {"E1", "E2"})
        assert all(b in ([0, 0, 20, 20], [10, 10, 40, 50]) for b in c.evidence_boxes)
        assert c.explanation is None
    assert r.explanation is None and _is_score(r.score)


# -- "Hol.": one score, its expected value ----------------------------------------------------------
class CharCodec:
    """A tokenizer stand-in writing one token per character (as Qwen writes digits)."""

    def response_ids(self, text):
        return [ord(ch) for ch in text]


class WholeNumberCodec:
    """A tokenizer stand-in with one token per number 0..100, other characters one each."""

    def response_ids(self, text):
        m = re.fullmatch(r'(\{"score": )(\d+)(\})', text)
        return [ord(ch) for ch in m.group(1)] + [1000 + int(m.group(2)), ord("}")]


def test_integer_reading_is_the_expectation_over_the_token_tree():
    reading = IntegerReading.build(CharCodec(), 100, '{"score": ', "}")
    assert bytes(reading.forced).decode() == '{"score": '
    paths = [bytes(p).decode() for p, _ in reading.branches]
    assert sorted(paths) == sorted(["", *"123456789", "10"])  # first digit, second after 1..9, third after 10
    rng = np.random.default_rng(0)
    probs = {p: rng.dirichlet(np.ones(len(kids))) for p, kids in reading.branches}
    cond = {p: dict(zip(kids, probs[p])) for p, kids in reading.branches}
    expected = 0.0
    for n in range(101):  # the value's probability: the product of its choices at branch points
        text, p = f"{n}}}", 1.0
        for i in range(len(text)):
            step = cond.get(tuple(map(ord, text[:i])))
            p *= step[ord(text[i])] if step else 1.0
        expected += n * p
    assert reading.expectation(probs) == pytest.approx(expected, rel=1e-12)
    whole = IntegerReading.build(WholeNumberCodec(), 100, '{"score": ', "}")
    assert [(p, len(kids)) for p, kids in whole.branches] == [((), 101)]  # one step over all values
    uniform = {(): np.full(101, 1 / 101)}
    assert whole.expectation(uniform) == pytest.approx(50.0)


@torch.inference_mode()
def _hf_next_logits(hf, request):
    ids = torch.tensor([list(request.prompt_ids) + list(request.response_prefix)])
    pixel_values = torch.cat([im.pixel_values for im in request.images])
    grid = torch.tensor([im.grid_thw for im in request.images])
    return hf(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid,
              mm_token_type_ids=(ids == hf.config.image_token_id).int()).logits[0, -1].double()


def test_holistic_score_matches_transformers(vl_dir, judge):
    """The expected score from transformers' next-token logits at each branch point of the
    answer's token tree, renormalised over the branches, against the judge's Choice steps."""
    from transformers import Qwen3_5ForConditionalGeneration

    hf = Qwen3_5ForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32).eval()
    j = fresh(judge, mode="holistic-score")
    reading = j.score_reading
    assert j.codec.decode(reading.forced + reading.values[42]) == '{"score": 42}'
    examples = [ImageTextExample(image(5), "A red bus.", claims=["A bus."]),
                ImageTextExample(image(6, 40, 72), "Two dogs.")]
    results = j.score(examples)
    assert j.stage_seconds["holistic-score"] > 0 and j.stage_seconds["decompose"] == 0
    assert any("not used" in w for w in results[0].warnings) and results[0].claims == []
    items, _ = j.prepare(examples)
    for item, r in zip(items, results):
        assert r.error is None and r.claims == [] and r.explanation is None
        probs = {}
        for path, kids in reading.branches:
            request = j._request(item, 0, j.holistic_prefix(item), HOLISTIC_SCORE_TASK, Choice(kids),
                                 reading.forced + path)
            probs[path] = torch.softmax(_hf_next_logits(hf, request)[list(kids)], 0).numpy()
        assert r.score == pytest.approx(reading.expectation(probs) / SCORE_MAX, abs=TOL)
        assert 0 <= r.score <= 1


def test_modes_are_checked(judge):
    with pytest.raises(ValueError, match="mode must be one of"):
        fresh(judge, mode="holistic")
    with pytest.raises(ValueError, match="pipeline"):
        fresh(judge, mode="single-response", propose_boxes=True)
    with pytest.raises(ValueError, match="pipeline"):
        fresh(judge, mode="holistic-score", evidence_layout="shared")


def test_mode_option_and_claims_field_in_a_file_job(tmp_path, vl_dir):
    from PIL import Image as PILImage

    from fastjudge.cli import main
    from fastjudge.judges.registry import VISEXMEM_OPTIONS

    assert [o.default for o in VISEXMEM_OPTIONS if o.name == "mode"] == ["pipeline"]
    PILImage.fromarray(image(7)).save(tmp_path / "a.png")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, [json.dumps({"id": "a", "image": "a.png", "text": "A cup.", "claims": ["A cup."]}),
                      json.dumps({"id": "b", "image": "a.png", "text": "A cup.", "claims": "A cup."})])
    assert main(["visexmem", "--model", str(vl_dir), "--input", str(src), "--output", str(out),
                 "--device", "cpu", "--dtype", "float32", "--no-progress", "--mode", "holistic-score"]) == 3
    rows = {r["id"]: r for r in read_rows(out)}
    assert rows["a"]["error"] is None and 0 <= rows["a"]["score"] <= 1 and rows["a"]["claims"] == []
    assert "claims must be" in rows["b"]["error"]
