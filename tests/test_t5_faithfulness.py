"""The T5 backend against transformers' T5ForConditionalGeneration on the same checkpoint,
prompts and token ids: float32, probabilities within 1e-4, identical ratings and text."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE

from fastjudge import LaveJudge, VQAExample
from fastjudge.backends.loading import CheckpointError
from fastjudge.backends.t5.backend import TorchT5Backend
from fastjudge.demo import sample_rows
from fastjudge.engine_options import EngineOptions
from fastjudge.runtime.requests import Choice, Request, Text


def hf_model(model_dir):
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def examples(n=None):
    rows = sample_rows()[:n]
    return [VQAExample(r["question"], r["references"], r["prediction"], r.get("caption"), r["id"])
            for r in rows]


@torch.inference_mode()
def hf_rating_probs(model, tokenizer, prompt: str, rating_ids, response_prefix=()):
    ids = torch.tensor([tokenizer(prompt).input_ids])
    dec = torch.tensor([[model.config.decoder_start_token_id, *response_prefix]])
    logits = model(input_ids=ids, decoder_input_ids=dec).logits[0, -1, list(rating_ids)]
    return torch.softmax(logits.double(), -1).numpy()


@pytest.mark.parametrize("layout", ["flan", "tied"])
def test_score_only_matches_transformers(layout, t5_dir, t5_tied_dir):
    model_dir = t5_dir if layout == "flan" else t5_tied_dir
    judge = LaveJudge(model_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="float32"))
    hf = hf_model(model_dir)
    items = examples()
    results = judge.score(items)  # mixed lengths, general and binary prompts, planned batches
    assert len(results) == len(items)
    worst = 0.0
    for ex, res in zip(items, results):
        assert res.error is None
        ref = hf_rating_probs(hf, judge.backend.codec.tokenizer, judge.build_prompt(ex), judge.rating_token_ids)
        np.testing.assert_allclose(res.probs, ref, rtol=1e-4, atol=1e-6)
        assert res.rating == int(np.argmax(ref)) + 1
        worst = max(worst, float(np.max(np.abs(np.asarray(res.probs) - ref) / ref)))
    assert worst < 1e-4


def test_batching_does_not_change_results(t5_backend):
    items = examples()
    batched = LaveJudge(t5_backend, engine=EngineOptions(max_batch_tokens=8192)).score(items)
    tight = LaveJudge(t5_backend, engine=EngineOptions(max_batch_tokens=2500, max_batch_size=3)).score(items)
    alone = [LaveJudge(t5_backend).score([ex])[0] for ex in items[:6]]
    for a, b in zip(batched, tight):
        np.testing.assert_allclose(a.probs, b.probs, rtol=1e-5)
        assert a.rating == b.rating
    for a, b in zip(batched, alone):
        np.testing.assert_allclose(a.probs, b.probs, rtol=1e-5)


def test_greedy_text_matches_generate(t5_backend, t5_dir):
    hf = hf_model(t5_dir)
    tok = t5_backend.codec.tokenizer
    judge = LaveJudge(t5_backend, rationale=True)
    prompts = [judge.build_prompt(ex) for ex in examples(7)]
    prompts.append("Question: short one? Output:")  # very different lengths in one batch
    max_new = 24
    requests = [Request(i, t5_backend.codec.encode_prompt(p), Text(max_new)) for i, p in enumerate(prompts)]
    outputs = t5_backend.run(requests)
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([tok(prompt).input_ids])
        gen = hf.generate(ids, max_new_tokens=max_new, do_sample=False, num_beams=1)[0, 1:].tolist()
        eos = t5_backend.shape.eos_token_id
        expected = gen[: gen.index(eos)] if eos in gen else gen
        assert out.token_ids == expected
        assert out.finished == (eos in gen)


def test_rationale_fallback_step_matches_transformers(t5_backend, t5_dir):
    """The constrained rating step after an unparsable rationale reads the same distribution
    transformers gives for the generated text followed by the rating cue."""
    hf = hf_model(t5_dir)
    judge = LaveJudge(t5_backend, rationale=True, max_new_tokens=10)
    items = examples(4)
    results = judge.score(items)
    constrained = [r for r in results if r.rating_source == "constrained"]
    assert constrained, "random weights should produce rationales without a final digit"
    cue = t5_backend.codec.response_ids(" So rating=")
    for res in constrained:
        prompt = judge.build_prompt(items[res.index])
        # the generated ids themselves (re-tokenizing the text need not give the same ids)
        requests = [Request(0, t5_backend.codec.encode_prompt(prompt), Text(10))]
        generated = t5_backend.run(requests)[0].token_ids
        ref = hf_rating_probs(hf, t5_backend.codec.tokenizer, prompt, judge.rating_token_ids,
                              response_prefix=[*generated, *cue])
        np.testing.assert_allclose(res.probs, ref, rtol=1e-4, atol=1e-6)


def test_choice_rows_with_different_candidates_share_a_batch(t5_backend):
    p = t5_backend.codec.encode_prompt("Question: what? Output:")
    a = Request(0, p, Choice((3, 4, 5)))
    b = Request(1, p, Choice((5, 4)))
    out = t5_backend.run([a, b])
    assert out[0].probs.shape == (3,) and out[1].probs.shape == (2,)
    # same logits for the shared candidates
    assert out[0].logits[2] == pytest.approx(out[1].logits[0], rel=1e-6)


def test_pickle_weights_refused_unless_allowed(tmp_path, t5_dir):
    from safetensors.torch import load_file

    target = tmp_path / "pickled"
    shutil.copytree(t5_dir, target)
    state = load_file(str(target / "model.safetensors"))
    (target / "model.safetensors").unlink()
    torch.save(state, target / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="allow_pickle"):
        TorchT5Backend(target, device=TEST_DEVICE, dtype="float32")
    backend = TorchT5Backend(target, device=TEST_DEVICE, dtype="float32", allow_pickle=True)
    reference = TorchT5Backend(t5_dir, device=TEST_DEVICE, dtype="float32")
    req = [Request(0, reference.codec.encode_prompt("Question: a? Output:"), Choice((3, 4, 5)))]
    np.testing.assert_array_equal(backend.run(req)[0].logits, reference.run(req)[0].logits)


def test_not_a_t5_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match="not supported|not a T5"):
        LaveJudge(tmp_path)
    with pytest.raises(CheckpointError, match="config.json"):
        LaveJudge(tmp_path / "missing")


def test_bfloat16_close_to_float32(t5_dir):
    """bf16 is a speed mode, not a faithfulness mode: it stays close, and says so."""
    items = examples(8)
    f32 = LaveJudge(t5_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="float32")).score(items)
    bf16_judge = LaveJudge(t5_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="bfloat16"))
    assert bf16_judge.backend.dtype == torch.bfloat16
    bf16 = bf16_judge.score(items)
    diff = max(float(np.max(np.abs(np.subtract(a.probs, b.probs)))) for a, b in zip(f32, bf16))
    assert diff < 0.05
