"""``fastjudge verify`` on the tiny random-weight checkpoints, every judge and mode: it passes
where fastjudge equals its reference, and fails -- non-zero exit, the differing items listed --
where the two truly differ (a tolerance below the bfloat16 difference; a reference that sees
different weights). The reference paths are those of ``fastjudge.reference``: transformers on
the judge's prompts (LAVE), a transcription of the LAVE authors' ``LaveFT5.batch_compute``
(``lave_ft5.py``, github.com/mair-lab/lave) on their builder's prompts, t2v_metrics' VQAScore
steps (``t2v_metrics/models/vqascore_models/qwen3vl_model.py``, ``Qwen3VLModel.forward``) and
the VisExMEM stages through transformers ``generate`` with ``xgrammar.contrib.hf.LogitsProcessor``."""

from __future__ import annotations

import json
import math
import shutil
from importlib import resources

import pytest
from conftest import TEST_DEVICE
from test_lave_official import EOS_SCALE, RATING_SCALE, rating_families, write_checkout

import fastjudge
from fastjudge.checkpoints import scale_output_rows
from fastjudge.cli import main
from fastjudge.judges.lave import LaveResult
from fastjudge.verification.compare import FLOAT32, Tolerance, compare

VQA = str(resources.files("fastjudge.data").joinpath("sample_vqa.jsonl"))
SMALL_BUDGETS = dict(max_claims=1, max_claim_chars=8, max_explanation_chars=8)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Image-caption pairs: the pictures of ``fastjudge report --sample``, one with a caption
    of our own, and a missing image (an item error on both sides)."""
    from fastjudge.report.sample import write_sample

    folder = tmp_path_factory.mktemp("pairs")
    rows = [json.loads(line) for line in write_sample(folder).read_text().splitlines()]
    rows.append({"id": "tri2", "image": "triangle.png", "text": "a green square"})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps({k: r[k] for k in ("id", "image", "text")}) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def vl_unmasked_dir(vl_dir, tmp_path_factory):
    """The tiny VL checkpoint made comparable with the xgrammar reference
    (``zero_unmasked_utf8_rows``: random weights write byte forms xgrammar's HF processor lets
    through and fastjudge masks)."""
    from fastjudge.reference.visexmem import zero_unmasked_utf8_rows

    target = tmp_path_factory.mktemp("vl-unmasked") / "model"
    shutil.copytree(vl_dir, target)
    zero_unmasked_utf8_rows(target)
    return target


def run(judge, model, input, **options):
    options.setdefault("device", TEST_DEVICE)
    options.setdefault("dtype", "float32")
    return fastjudge.verify(judge, model, input, progress=False, **options)


def outputs(report, index=0) -> dict:
    return {o["name"]: o for o in report.comparisons[index]["outputs"]}


# -- passes where fastjudge equals the reference ----------------------------------------------------
def test_lave_score_only_command(t5_dir, tmp_path, capsys):
    out = tmp_path / "verify.json"
    rc = main(["verify", "--judge", "lave", "--model", str(t5_dir), "--input", VQA, "--sample", "12",
               "--device", TEST_DEVICE, "--dtype", "float32", "--no-progress", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "lave (score-only) on flan-t5-tiny" in printed and ", 12 items," in printed
    assert "rating       identical 12/12 (100.0%)" in printed
    report = json.loads(out.read_text())
    assert report["passed"] and report["items"] == 12 and report["tolerance"]["max_abs"] == FLOAT32.max_abs
    got = {o["name"]: o for o in report["comparisons"][0]["outputs"]}
    assert got["probs"]["units"] == 12 and got["probs"]["max_abs"] < 1e-5
    assert got["soft_score"]["spearman"] > 0.99


def test_sample_is_seeded(t5_dir):
    a = run("lave", t5_dir, VQA, sample=5, seed=3)
    b = run("lave", t5_dir, VQA, sample=5, seed=3)
    c = run("lave", t5_dir, VQA, sample=5, seed=4)
    ids = [w["id"] for w in outputs(a)["probs"]["worst"]]
    assert ids == [w["id"] for w in outputs(b)["probs"]["worst"]]
    assert ids != [w["id"] for w in outputs(c)["probs"]["worst"]]


@pytest.mark.parametrize("on_unparsable", ["constrain", "official"])
def test_lave_rationale(t5_dir, on_unparsable):
    report = run("lave", t5_dir, VQA, sample=4, rationale=True, max_new_tokens=12, on_unparsable=on_unparsable)
    got = outputs(report)
    assert report.passed and report.mode == "rationale"
    assert got["rationale"]["identical"] == got["rationale"]["units"] == 4
    assert got["rating"]["identical"] == 4


@pytest.fixture(scope="module")
def varied_dir(t5_dir, t5_backend, tmp_path_factory):
    """Generations of varied lengths, many ending on a rating token (as in test_lave_official)."""
    target = tmp_path_factory.mktemp("verify-t5-varied") / "model"
    shutil.copytree(t5_dir, target)
    ratings = [t for family in rating_families(t5_backend.codec) for t in family]
    scale_output_rows(target, {**{t: RATING_SCALE for t in ratings}, t5_backend.shape.eos_token_id: EOS_SCALE})
    return target


def test_lave_official(varied_dir, tmp_path):
    checkout = write_checkout(tmp_path / "lave")
    report = run("lave", varied_dir, VQA, sample=6, official_repo=str(checkout), max_new_tokens=30)
    got = outputs(report)
    assert report.passed and report.mode == "official"
    assert got["rating"]["identical"] == 6 and got["rationale"]["identical"] == 6


@pytest.mark.parametrize("template", ["vqascore", "fastjudge"])
def test_holistic(vl_dir, pairs, template):
    report = run("holistic", vl_dir, pairs, template=template)
    got = outputs(report)
    assert report.passed, report.comparisons
    assert got["error"]["units"] == 4 and got["decision"]["units"] == 3  # the missing image: an error
    assert got["probs"]["max_abs"] < FLOAT32.max_abs


@pytest.mark.parametrize("mode", ["pipeline", "single-response", "holistic-score"])
def test_visexmem(vl_unmasked_dir, pairs, mode):
    # one pair: the reference's constrained generate steps are slow on a CPU
    report = run("visexmem", vl_unmasked_dir, pairs, sample=1, seed=1, mode=mode, **SMALL_BUDGETS)
    got = outputs(report)
    assert report.passed, report.comparisons
    assert report.mode == mode and got["score"]["units"] >= 1
    given = [c for c in report.comparisons if c.get("claims_given")]
    if mode == "pipeline":  # the verification stage again, on the reference's claims given to both
        assert len(given) == 1 and given[0]["passed"]
        assert outputs(report, 1)["decision"]["units"] >= 1 and outputs(report, 1)["claims"]["identical"] >= 1
    else:
        assert not given


# -- fails where they differ -----------------------------------------------------------------------
def test_fails_below_the_bfloat16_difference(t5_dir, capsys):
    rc = main(["verify", "--judge", "lave", "--model", str(t5_dir), "--input", VQA, "--sample", "8",
               "--device", TEST_DEVICE, "--dtype", "bfloat16", "--tolerance", "1e-7", "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 1
    assert "probs        max |diff|" in printed and "<- outside tolerance" in printed
    assert "sample-0" in printed.split("probs", 1)[1]  # the items that differ most, by id
    assert printed.rstrip().endswith("FAIL: fastjudge differs from the reference outside tolerance")


def test_bfloat16_passes_at_its_default_tolerance(t5_dir):
    report = run("lave", t5_dir, VQA, sample=8, dtype="bfloat16")
    assert report.passed and report.dtype == "bfloat16"
    assert 0 < outputs(report)["probs"]["max_abs"] < report.tolerance["max_abs"]


def test_fails_when_the_reference_sees_other_weights(t5_dir, t5_backend, monkeypatch, capsys):
    """The reference loads the checkpoint with the LM-head rows of ratings 2 and 3 swapped (as a
    loader that mapped tensors wrongly would): where fastjudge rates 2 (every item of this random
    checkpoint), the reference rates 3."""
    from fastjudge.reference import models

    load = models.load_model
    _, two, three = t5_backend.codec.answer_ids(["1", "2", "3"]).ids

    def skewed(*args, **kwargs):
        model, tok = load(*args, **kwargs)
        head = model.lm_head.weight.data
        head[[two, three]] = head[[three, two]].clone()
        return model, tok

    monkeypatch.setattr(models, "load_model", skewed)
    monkeypatch.setattr("fastjudge.reference.lave.load_model", skewed)
    rc = main(["verify", "--judge", "lave", "--model", str(t5_dir), "--input", VQA, "--sample", "6",
               "--device", TEST_DEVICE, "--dtype", "float32", "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 1
    rating = printed.split("rating", 1)[1].split("probs", 1)[0]
    assert "identical 0/6" in rating and "<- outside tolerance" in rating
    assert "reference 3" in rating and rating.count("sample-") == 5  # the first five listed


# -- the comparison itself -----------------------------------------------------------------------
def lave(rating, probs):
    return LaveResult(index=0, rating=rating, probs=probs, soft_score=probs[1] * 0.5 + probs[2])


def test_near_tie_disagreement_is_excused_and_listed():
    ours = [lave(2, [0.1, 0.45, 0.45]), lave(1, [0.8, 0.1, 0.1])]
    theirs = [lave(3, [0.1, 0.44999, 0.45001]), lave(1, [0.8, 0.1, 0.1])]
    got = {o.name: o for o in compare("lave", ["a", "b"], ours, theirs, Tolerance(1e-3))}
    assert got["rating"].passed and got["rating"].near_ties == 1
    assert got["rating"].worst == [{"id": "a", "fastjudge": 2, "reference": 3, "near_tie": True}]
    got = {o.name: o for o in compare("lave", ["a", "b"], ours, theirs, Tolerance(1e-6))}
    assert not got["rating"].passed and not got["probs"].passed
    assert math.isclose(got["probs"].max_abs, 1e-5, rel_tol=1e-6)
    assert got["probs"].worst[0]["id"] == "a"


def test_build_directory_against_torch_and_reference(t5_dir, tmp_path):
    """``--build``: the build's checkpoint (here the source checkpoint itself, where a real build
    holds its FP8 checkpoint) against the source on the torch backend and against the reference,
    under the FP8 builds' rule (98 % rating agreement, probabilities reported)."""
    build = tmp_path / "build"
    shutil.copytree(t5_dir, build / "checkpoint")
    report = run("lave", t5_dir, VQA, sample=5, build=str(build))
    assert report.passed and report.tolerance["min_agreement"] == 0.98 and report.tolerance["max_abs"] is None
    assert [(c["fastjudge"], c["reference"]) for c in report.comparisons] == [
        ("fastjudge build (torch, FP8 checkpoint)", "fastjudge torch"),
        ("fastjudge build (torch, FP8 checkpoint)", "reference")]
    assert outputs(report, 0)["probs"]["max_abs"] == 0.0  # the same weights on the same backend


@pytest.mark.parametrize("judge, options", [("holistic", dict(template="fastjudge")),
                                            ("visexmem", dict(SMALL_BUDGETS, mode="holistic-score"))])
def test_image_judges_fail_below_the_bfloat16_difference(judge, options, vl_unmasked_dir, pairs):
    report = run(judge, vl_unmasked_dir, pairs, dtype="bfloat16", tolerance=1e-9, **options)
    got = outputs(report)
    assert not report.passed and not got["score"]["passed"]
    assert got["score"]["max_abs"] > 1e-9 and got["score"]["worst"][0]["id"] in ("ball", "tri", "tri2")
    assert got["error"]["passed"]  # the same items fail on both sides: only the values differ


def visex(claims, score=None):
    from fastjudge.judges.visexmem import ClaimResult, VisExResult

    return VisExResult(index=0, score=score, claims=[ClaimResult(**c) for c in claims])


def test_generated_claims_diverging_in_bfloat16():
    """Generated claims that diverge (a link, as bfloat16 rounding makes greedy decoding write)
    are listed with their first divergence; in bfloat16 they are reported, not failed, in float32
    they fail; a claim's decision is compared wherever its own text and evidence agree, the item's
    score only where all claims do."""
    from fastjudge.verification.compare import BFLOAT16, FLOAT32

    one = dict(part_id="P1", text="a red bus", type="object", evidence_ids=["E1"], evidence_boxes=[[0, 0, 4, 4]],
               decision="yes", support=0.61)
    two = dict(part_id="P2", text="is parked", type="attribute", parent_part_id="P1", evidence_ids=["E2"],
               evidence_boxes=[[4, 4, 8, 8]], decision="no", support=0.40)
    ours = [visex([one, two], 0.505), visex([one], 0.61)]
    theirs = [visex([one, dict(two, parent_part_id=None, support=0.4002)], 0.50505),
              visex([dict(one, text="a red van")], 0.3)]
    got = {o.name: o for o in compare("visexmem", ["a", "b"], ours, theirs, BFLOAT16)}
    assert got["claims"].identical == 0 and got["claims"].units == 2 and got["claims"].passed
    assert not got["claims"].checked
    assert [w["first_divergence"] for w in got["claims"].worst] == [
        "claim 2 parent_part_id: fastjudge 'P1', reference None",
        "claim 1 text: char 6: fastjudge 'a red bus', reference 'a red van'"]
    assert got["decision"].units == 2 and got["decision"].identical == 2 and got["decision"].skipped == 1
    assert math.isclose(got["support"].max_abs, 2e-4, rel_tol=1e-6)
    assert got["score"].units == 0  # no item has all its claims in common
    got = {o.name: o for o in compare("visexmem", ["a", "b"], ours, theirs, FLOAT32)}
    assert not got["claims"].passed and got["claims"].checked and not got["support"].passed
