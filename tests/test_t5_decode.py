"""T5 greedy decoding with early exit and refill (``fastjudge.backends.t5_decode``) against one
padded batch through transformers' ``generate`` (transformers
``generation/utils.py``, ``GenerationMixin.generate`` greedy search: ``do_sample=False``,
``num_beams=1``, all rows padded along until the longest stops): the same tokens, the same
end (EOS or budget) and the same logits at the tracked ids, whatever the decode batch limit, on
a checkpoint whose outputs end at varied lengths."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from fastjudge import LaveJudge, VQAExample
from fastjudge.backends import t5_decode
from fastjudge.backends.torch_t5 import TorchT5Backend
from fastjudge.checkpoints import scale_output_rows
from fastjudge.demo import sample_rows
from fastjudge.runtime.requests import Request, Text

MAX_NEW = 40


def rating_ids(codec) -> list[int]:
    """Rating tokens word-initial ("Output: 3") and glued to the cue ("So rating=3")."""
    return [*codec.answer_ids(["1", "2", "3"]).ids,
            *codec.answer_ids(["1", "2", "3"], after=" So rating=").ids]


@pytest.fixture(scope="module")
def varied(t5_dir, t5_backend, tmp_path_factory):
    """The tiny Flan-T5 checkpoint with EOS and rating rows of its LM head scaled up, so that
    greedy outputs end at varied lengths (some at once, some at the budget)."""
    target = tmp_path_factory.mktemp("flan-t5-varied-decode") / "model"
    shutil.copytree(t5_dir, target)
    scale_output_rows(target, {**{t: 6.0 for t in rating_ids(t5_backend.codec)},
                               t5_backend.shape.eos_token_id: 10.0})
    return target


@pytest.fixture(scope="module")
def prompts(t5_backend):
    judge = LaveJudge(t5_backend, rationale=True, num_shots=2)
    rows = sample_rows()[:10]
    texts = [judge.build_prompt(VQAExample(r["question"], r["references"], r["prediction"]))
             for r in rows]
    return texts + ["Question: short one? Output:", "Is it? Output:"]


@pytest.fixture(scope="module")
def padded(varied, prompts):
    """One padded batch through ``generate``: per row (generated ids without EOS, EOS met,
    step logits [steps, vocab])."""
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(str(varied), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(varied))
    enc = tok(prompts, padding="longest", return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                             max_new_tokens=MAX_NEW, do_sample=False, num_beams=1,
                             return_dict_in_generate=True, output_logits=True)
    logits = torch.stack(out.logits, dim=1)
    rows = []
    for i, seq in enumerate(out.sequences[:, 1:].tolist()):
        ids = seq[: seq.index(tok.eos_token_id)] if tok.eos_token_id in seq else seq
        rows.append((ids, tok.eos_token_id in seq, logits[i, : len(ids)]))
    return rows


def run_text(backend, prompts, max_new=MAX_NEW, track=()):
    requests = [Request(i, backend.codec.encode_prompt(p), Text(max_new, track_ids=tuple(track)))
                for i, p in enumerate(prompts)]
    return backend.run(requests)


def test_fixture_ends_at_varied_lengths(padded):
    lengths = [len(ids) for ids, _, _ in padded]
    # some end within the reassociated first steps
    assert any(eos and len(ids) < t5_decode.FAST_STEPS for ids, eos, _ in padded), lengths
    assert MAX_NEW in lengths  # at the budget
    assert len(set(lengths)) >= 4, lengths


@pytest.mark.parametrize("rows, encode_tokens", [(None, 8192), (1, 8192), (2, 300), (3, 1)],
                         ids=["one-batch", "one-row", "refill", "refill-row-packs"])
def test_same_tokens_as_one_padded_batch(varied, prompts, padded, rows, encode_tokens):
    backend = TorchT5Backend(varied, device="cpu", dtype="float32", max_decode_rows=rows)
    backend.encode_tokens = encode_tokens
    track = rating_ids(backend.codec)
    for out, (ids, eos, logits) in zip(run_text(backend, prompts, track=track), padded):
        assert out.token_ids == ids
        assert out.finished == eos
        assert out.tracked_logits.shape == (len(ids), len(track))
        np.testing.assert_allclose(out.tracked_logits, logits[:, track].double().numpy(),
                                   rtol=1e-4, atol=1e-4)


def test_rows_join_as_others_leave(varied, prompts, monkeypatch):
    """With two decode slots, rows enter only as others finish, and never more than two run."""
    events = []
    add, remove = t5_decode.Slots.add, t5_decode.Slots.remove

    def logged_add(self, model, rows, states, start):
        add(self, model, rows, states, start)
        events.extend(("add", row, self.live) for row in rows)

    def logged_remove(self, j):
        events.append(("remove", self.rows[j], self.live))
        remove(self, j)

    monkeypatch.setattr(t5_decode.Slots, "add", logged_add)
    monkeypatch.setattr(t5_decode.Slots, "remove", logged_remove)
    backend = TorchT5Backend(varied, device="cpu", dtype="float32", max_decode_rows=2)
    run_text(backend, prompts)
    assert max(live for _, _, live in events) == 2
    adds = [i for i, e in enumerate(events) if e[0] == "add"]
    first_remove = next(i for i, e in enumerate(events) if e[0] == "remove")
    assert len(adds) > 2 and adds[-1] > first_remove  # refilled
    # every row that entered left exactly once
    assert sorted(r for k, r, _ in events if k == "add") == sorted(r for k, r, _ in events if k == "remove")


def test_short_rows_settle_without_cross_attention_kv(varied, prompts, padded, monkeypatch):
    """Rows ending within the first steps never get cross-attention K/V; within a budget of
    those steps no row does."""
    entered = []
    add = t5_decode.Slots.add

    def logged_add(self, model, rows, states, start):
        entered.extend(rows)
        add(self, model, rows, states, start)

    monkeypatch.setattr(t5_decode.Slots, "add", logged_add)
    backend = TorchT5Backend(varied, device="cpu", dtype="float32")
    run_text(backend, prompts)
    short = {i for i, (ids, eos, _) in enumerate(padded) if eos and len(ids) < t5_decode.FAST_STEPS}
    assert short and not short & set(entered) and len(entered) == len(padded) - len(short)
    entered.clear()
    outs = run_text(backend, prompts, max_new=t5_decode.FAST_STEPS)
    assert entered == []
    for out, (ids, eos, _) in zip(outs, padded):
        assert out.token_ids == ids[: t5_decode.FAST_STEPS]
        assert out.finished == (eos and len(ids) < t5_decode.FAST_STEPS)


def test_no_tracking(varied, prompts, padded):
    backend = TorchT5Backend(varied, device="cpu", dtype="float32", max_decode_rows=3)
    for out, (ids, _, _) in zip(run_text(backend, prompts), padded):
        assert out.token_ids == ids and out.tracked_logits is None
