"""The peer benchmarks' own logic (benchmarks/peers), without any peer installed: the export of
fastjudge's requests as the token ids a peer runs, the comparison of outputs, the table, and
the runners' parsing of their engines' results.

The runners follow the engines' documented result shapes: CTranslate2's converted vocabulary
file (``shared_vocabulary.json``, one entry per id, written by
``python/ctranslate2/converters/transformers.py`` in OpenNMT/CTranslate2 v4.8.5) and vLLM's
``RequestOutput.outputs[0]`` with ``token_ids`` and, under ``SamplingParams.logprob_token_ids``
(``vllm/sampling_params.py``, vllm 0.32), ``logprobs[step][token_id].logprob``. The engines
themselves run in ``make bench-peers``, not here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

PEERS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS_DIR))

import common  # noqa: E402
import run_ctranslate2  # noqa: E402
import run_vllm  # noqa: E402
import workloads  # noqa: E402


@pytest.fixture(scope="module")
def t5_cases(t5_dir):
    return workloads.lave_cases(t5_dir, "flan-t5 tiny", torch.float32, items=5, rationale_items=3,
                                rationale_tokens=6)


@pytest.fixture(scope="module")
def qwen_cases(tmp_path_factory):
    from fastjudge.checkpoints import build_random_qwen
    from fastjudge.demo import tokenizer_corpus

    model_dir = build_random_qwen(tmp_path_factory.mktemp("peers-qwen3_5"), tokenizer_corpus(), seed=5)
    lave = workloads.lave_cases(model_dir, "qwen3.5 tiny", torch.float32, items=4, rationale_items=2,
                                rationale_tokens=5)
    captions = ["A red circle left of a blue square.", "Two dogs, one asleep on a green sofa."]
    return lave + workloads.visexmem_cases(model_dir, "qwen3.5 tiny", lave[0].backend, captions,
                                           json_tokens=12, max_batch_tokens=4096, max_batch_size=8)


def test_lave_export_round_trips_the_judges_ids(t5_cases, tmp_path):
    score, rationale = t5_cases
    path = tmp_path / "w.json"
    common.save_workloads(path, [c.workload for c in t5_cases], {"repeats": 1, "threads": 1})
    settings, loaded = common.load_workloads(path)
    assert settings == {"repeats": 1, "threads": 1}
    assert [w.kind for w in loaded] == ["choice", "text"]
    for case, w in zip(t5_cases, loaded):
        assert [r.prompt_ids for r in w.requests] == [list(map(int, r.prompt_ids)) for r in case.requests]
        assert w.eos_ids == sorted(case.backend.codec.eos_token_ids)
        assert w.model_dir == str(case.workload.model_dir)
    from fastjudge import LaveJudge

    assert tuple(loaded[0].choice_ids) == LaveJudge(score.backend).rating_token_ids
    assert loaded[1].max_new_tokens == 6
    assert loaded[0].prompt_tokens == sum(len(r.prompt_ids) for r in score.requests)


def test_visexmem_and_holistic_export(qwen_cases, tmp_path):
    names = [c.workload.name for c in qwen_cases]
    assert names == ["LAVE score-only", "LAVE rationale", "VisExMEM decompose (JSON)", "VisExMEM verify",
                     "holistic yes/no"]
    decompose, verify, holistic = (c.workload for c in qwen_cases[2:])
    codec = qwen_cases[0].backend.codec
    assert decompose.kind == "json" and decompose.max_new_tokens == 12
    assert json.loads(decompose.schema)["properties"]["parts"]["minItems"] == 1
    assert "root" in decompose.grammar  # an EBNF grammar a peer can take as is
    # the verification answer starts with the forced decision prefix, then yes/no is read
    assert codec.decode(verify.requests[0].response_prefix) == '{"decision": "'
    assert [codec.decode([t]) for t in verify.choice_ids] == ["yes", "no"]
    assert holistic.full_vocab and holistic.kind == "choice"
    # text parts only: no image tokens, the caption inside the prompt
    assert "A red circle left of a blue square." in codec.decode(decompose.requests[0].prompt_ids)
    # every request of a workload shares the intro (a prefix the engines can reuse)
    assert all(n > 0 for n in decompose.prefix_lens)
    path = tmp_path / "q.json"
    common.save_workloads(path, [c.workload for c in qwen_cases], {"repeats": 1, "threads": 1})
    _, loaded = common.load_workloads(path)
    assert loaded[2].grammar == decompose.grammar and loaded[3].requests == verify.requests


def test_fastjudge_runs_in_workload_order(qwen_cases):
    for case in qwen_cases:
        run = workloads.run_fastjudge(case, repeats=1)
        assert len(run.times) == 1 and len(run.outputs) == len(case.requests)
        out = run.outputs[0]
        if case.judge is not None and case.workload.kind == "choice":  # LAVE score-only: the results'
            assert len(out["probs"]) == len(case.workload.choice_ids)
        elif case.workload.kind == "choice":
            assert len(out["logits"]) == len(case.workload.choice_ids)
            assert ("logprobs" in out) == case.workload.full_vocab
        else:
            assert 0 < len(out["token_ids"]) <= case.workload.max_new_tokens


def test_lave_cases_run_the_public_judge(t5_cases):
    """The LAVE workloads are what ``LaveJudge.score`` runs on the cases' own items; the
    rationale judge rates unparsable text without a further step, as the peers decode only."""
    score, rationale = t5_cases
    assert len(score.examples) == 5 and len(rationale.examples) == 3
    assert rationale.judge.rationale and rationale.judge.on_unparsable == "official"
    assert rationale.judge.backend is score.judge.backend
    run = workloads.run_fastjudge(rationale, repeats=1)
    results = rationale.judge.score(rationale.examples)
    for case, judged in ((score, score.judge.score(score.examples)), (rationale, results)):
        # the exported prompts are the ones the public call ran
        assert [r.prompt_tokens for r in judged] == [len(r.prompt_ids) for r in case.requests]
    decode = rationale.backend.codec.decode
    assert [decode(o["token_ids"]) for o in run.outputs] == [r.rationale for r in results]
    assert all(r.rating_source in ("parsed", "official-fallback") for r in results)


def test_compare_choice():
    ours = [{"logits": [0.0, 2.0, 1.0]}, {"logits": [3.0, 0.0, 0.0]}]
    # a judge's result carries the distribution itself
    as_probs = [{"probs": list(common.candidate_probs(o))} for o in ours]
    assert common.compare("choice", as_probs, ours).max_prob_diff < 1e-12
    # log-probabilities under the whole vocabulary renormalise to the same distribution
    shifted = [{"logprobs": [x - 7.5 for x in o["logits"]]} for o in ours]
    same = common.compare("choice", ours, shifted)
    assert same.agree == 1.0 and same.max_prob_diff < 1e-12
    flipped = [ours[0], {"logits": [0.0, 3.0, 0.0]}]
    half = common.compare("choice", ours, flipped)
    assert half.agree == 0.5 and half.max_prob_diff > 0.5
    with pytest.raises(ValueError):
        common.compare("choice", ours, ours[:1])
    with pytest.raises(ValueError):
        common.candidate_probs({"logprobs": [float("-inf"), 0.0]})
    with pytest.raises(ValueError):
        common.candidate_probs({"probs": [-0.5, 1.5]})


def test_keep_best_names_the_winning_setting():
    runs = [dict(index=0, variant="float32", value=8, times=[3.0, 1.0, 2.0], outputs=["a"]),
            dict(index=0, variant="float32", value=16, times=[1.5], outputs=["b"]),
            dict(index=0, variant="int8", value=8, times=[0.5], outputs=["c"]),
            dict(index=1, variant="float32", value=8, times=[4.0], outputs=["d"])]
    best = common.keep_best(runs, "batch")
    assert [(r["index"], r["variant"], r["outputs"]) for r in best] == [
        (0, "float32 (batch 16)", ["b"]), (0, "int8 (batch 8)", ["c"]), (1, "float32 (batch 8)", ["d"])]
    assert best[0]["tried"] == {"8": 2.0, "16": 1.5}


def test_settings_to_try():
    # limits at or above the item count all run one batch: only the smallest of them is run
    assert common.settings_to_try([8, 16, 32, 64], 32) == [8, 16, 32]
    assert common.settings_to_try([8, 16, 32, 64], 16) == [8, 16]
    assert common.settings_to_try([64, 8, 8], 4) == [8]
    assert common.settings_to_try([8, 64], 40) == [8, 64]
    with pytest.raises(ValueError):
        common.settings_to_try([0, 8], 4)


def test_compare_text_and_json():
    assert common.compare("text", [{"token_ids": [1, 2]}, {"token_ids": [3]}],
                          [{"token_ids": [1, 2]}, {"token_ids": [3, 4]}]).agree == 0.5
    texts = {(1,): '{"a": 1}', (2, 3): '{"a": 1}', (4,): '{"a'}
    decode = lambda ids: texts[tuple(ids)]  # noqa: E731
    a = common.compare("json", [{"token_ids": [1]}, {"token_ids": [4]}],
                       [{"token_ids": [2, 3]}, {"token_ids": [4]}], decode=decode)
    assert a.agree == 0.5  # the second items share their tokens
    assert a.json_agree == 1.0  # the first share their value, the second their (unfinished) text
    assert a.json_complete == 0.5
    assert a.describe() == "50%, 100% same JSON; 50% whole JSON within the budget"
    with pytest.raises(ValueError):
        common.compare("json", [{"token_ids": [1]}], [{"token_ids": [1]}])


def test_table():
    fast = common.RunResult("fastjudge", "", "LAVE score-only", [1.0, 2.0, 3.0], [{"logits": [0, 1]}] * 4)
    peer = common.RunResult("ctranslate2", "float32", "LAVE score-only", [4.0], [{"logits": [0, 1]}] * 4)
    gen_fast = common.RunResult("fastjudge", "", "LAVE rationale", [0.5], [{"token_ids": [1] * 10}] * 2)
    gen_peer = common.RunResult("vllm", "eager", "LAVE rationale", [1.0], [{"token_ids": [1] * 10}] * 2)
    rows = [common.Row("LAVE score-only", "t5", 4, 400, "ctranslate2 float32", fast, peer,
                       common.compare("choice", fast.outputs, peer.outputs)),
            common.Row("LAVE rationale", "qwen", 2, 100, "vllm eager", gen_fast, gen_peer, None)]
    assert rows[0].ratio == 2.0  # median 2 s vs 4 s
    lines = common.format_table(rows).splitlines()
    assert len(lines) == 4 and len({line.count("|") for line in lines}) == 1
    assert "| 2.0 | 1.0 | 200 | 100 | 2.00x | 100% (max Δp 0.0e+00) |" in lines[2]
    assert "| 40.0 gen | 20.0 gen | 2.00x | - |" in lines[3]


def test_workload_validation():
    with pytest.raises(ValueError):
        common.Workload("w", "choice", "m", [], [1])
    with pytest.raises(ValueError):
        common.Workload("w", "json", "m", [], [1], max_new_tokens=4)
    with pytest.raises(ValueError):
        common.Workload("w", "beam", "m", [], [1])


def test_vllm_shape_check():
    workloads.check_vllm_shape("mini")
    with pytest.raises(SystemExit):
        workloads.check_vllm_shape("tiny")


def test_ctranslate2_vocabulary(tmp_path):
    (tmp_path / "shared_vocabulary.json").write_text(json.dumps(["<pad>", "</s>", "<unk>", "▁a"]))
    vocab = run_ctranslate2.Vocab(run_ctranslate2.vocabulary(tmp_path))
    assert vocab.to_tokens([3, 1]) == ["▁a", "</s>"] and vocab.to_ids(["▁a", "</s>"]) == [3, 1]
    with pytest.raises(ValueError):
        run_ctranslate2.Vocab(["<pad>", "▁a", "▁a"])
    # the converter names the rows past the tokenizer with names already taken: renamed, each
    # id then round-trips and the tokenizer's own rows keep their names
    rows = ["<pad>", "</s>", "<extra_id_1>", "<extra_id_0>", "<extra_id_0>", "<extra_id_1>", "<row_5>"]
    (tmp_path / "shared_vocabulary.json").write_text(json.dumps(rows))
    run_ctranslate2.unique_vocabulary(tmp_path)
    renamed = run_ctranslate2.vocabulary(tmp_path)
    assert renamed[:4] == rows[:4] and renamed[6] == "<row_5>"
    assert len(set(renamed)) == len(rows) == len(renamed)
    vocab = run_ctranslate2.Vocab(renamed)
    assert vocab.to_ids(vocab.to_tokens(range(len(rows)))) == list(range(len(rows)))


def test_vllm_outputs_parsing():
    logprob = lambda x: SimpleNamespace(logprob=x)  # noqa: E731
    choice = {"kind": "choice", "choice_ids": [7, 9], "eos_ids": [2]}
    results = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=[{5: logprob(-0.1),
                                                                                  7: logprob(-3.0),
                                                                                  9: logprob(-4.0)}])])]
    assert run_vllm.outputs_of(choice, results) == [{"logprobs": [-3.0, -4.0]}]
    text = {"kind": "text", "eos_ids": [2], "max_new_tokens": 4}
    results = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids)]) for ids in ([4, 5, 2], [4, 5, 6, 7])]
    assert run_vllm.outputs_of(text, results) == [{"token_ids": [4, 5]}, {"token_ids": [4, 5, 6, 7]}]


def test_probabilities_match_the_backend(t5_cases):
    """The score-only outputs (the judge's ratings' probabilities) are the softmax of the
    backend's own logits for the same requests, in request order."""
    case = t5_cases[0]
    run = workloads.run_fastjudge(case, repeats=1)
    direct = {o.index: o for o in case.backend.run(case.requests)}
    for request, out in zip(case.requests, run.outputs):
        expected = common.candidate_probs({"logits": list(direct[request.index].logits)})
        np.testing.assert_allclose(out["probs"], expected, rtol=1e-5, atol=1e-6)


def test_bf16_rows_reuse_the_float32_workloads(t5_cases, t5_dir):
    """fastjudge's bfloat16 LAVE judges export the float32 judges' token ids, so their rows can
    be paired with the peer's runs of the float32 workloads; other ids are refused."""
    import dataclasses

    import bench_peers

    bf16 = workloads.lave_cases(t5_dir, "flan-t5 tiny bf16", torch.bfloat16, items=5, rationale_items=3,
                                rationale_tokens=6)
    bench_peers.check_same_workloads(t5_cases, bf16)
    requests = bf16[0].workload.requests
    shifted = dataclasses.replace(bf16[0].workload, requests=requests[1:] + requests[:1])
    with pytest.raises(RuntimeError, match="other token ids"):
        bench_peers.check_same_workloads(t5_cases, [dataclasses.replace(bf16[0], workload=shifted), bf16[1]])
