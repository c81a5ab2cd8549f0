"""The end-to-end VisExMEM benchmark (benchmarks/bench_visexmem_e2e.py) on one pair and the
tiny checkpoint: fastjudge's outputs equal those of the transformers pipeline -- transformers
``generation/utils.py``, ``GenerationMixin.generate`` (greedy) with xgrammar
``contrib/hf.py``, ``LogitsProcessor.__call__`` on the same prompts and schemas -- and the
benchmark's comparison does flag a difference."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_visexmem_e2e as bench  # noqa: E402

from fastjudge.judges.visexmem import ClaimResult, VisExResult  # noqa: E402


def test_one_pair_identical_outputs(vl_dir, tmp_path, capsys):
    out = tmp_path / "e2e.json"
    # 224x168 and its quadrants fit the tiny checkpoint's pixel limits without resizing
    rc = bench.main(["--model", str(vl_dir), "--items", "1", "--repeats", "1", "--size", "224x168",
                     "--jump-forward", "on", "--max-claims", "1", "--max-claim-chars", "8",
                     "--max-explanation-chars", "8", "--threads", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and "outputs IDENTICAL" in printed and "MISMATCH" not in printed
    row = json.loads(out.read_text())["rows"][0]
    assert row["problems"] == [] and row["errors"] == 0 and row["claims"] >= 1
    claim = row["outputs"][0]["claims"][0]
    assert claim["decision"] in ("yes", "no") and claim["explanation"] and claim["evidence"] is not None
    fast = row["fast"]["on"]
    assert fast["gap"] < 1e-3  # supports and score
    for stage in ("decompose", "select", "explain"):  # the same tokens written on both sides
        stats = fast["stats"][stage]
        assert stats["tokens_computed"] + stats["tokens_forced"] == row["base_stats"][stage]["tokens"]
    assert fast["stats"]["decompose"]["tokens_forced"] > 0


def test_comparison_flags_differences():
    claim = ClaimResult(part_id="P1", text="a red bus", type="object", decision="yes", support=0.7,
                        evidence_ids=["E1"], explanation="it is red")
    ours = [VisExResult(index=0, score=0.7, claims=[claim], explanation="fine")]
    assert bench.differences(ours, copy.deepcopy(ours)) == []
    for field, value in [("decision", "no"), ("evidence_ids", ["E2"]), ("explanation", "no bus"),
                         ("text", "a bus"), ("head_part_id", "P1")]:
        theirs = copy.deepcopy(ours)
        setattr(theirs[0].claims[0], field, value)
        assert len(bench.differences(ours, theirs)) == 1
    theirs = copy.deepcopy(ours)
    theirs[0].explanation = "other"
    theirs[0].claims.append(copy.deepcopy(claim))
    assert len(bench.differences(ours, theirs)) == 2
