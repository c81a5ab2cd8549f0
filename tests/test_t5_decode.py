"""T5 greedy decoding with early exit and refill (``fastjudge.backends.t5_decode``) against one
padded batch through transformers' ``generate`` (transformers
``generation/utils.py``, ``GenerationMixin.generate`` greedy search: ``do_sample=False``,
``num_beams=1``, all rows padded along until the longest stops): the same tokens, the same
end (EOS or budget) and the same logits at the tracked ids, whatever the decode batch limit, on
a checkpoint whose outputs end at varied lengths; the reassociated cross-attention against
attention over projected K/V (transformers ``models/t5/modeling_t5.py``, ``T5Attention.forward``
with ``key_value_states``)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from fastjudge import LaveJudge, VQAExample
from fastjudge.backends import t5_decode
from fastjudge.backends.t5_model import pad_rows
from fastjudge.backends.torch_t5 import TorchT5Backend
from fastjudge.checkpoints import scale_output_rows
from fastjudge.demo import sample_rows
from fastjudge.runtime.requests import Request, Text

MAX_NEW = 40
SHORT = 3  # the fixture has rows that end before this many tokens


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
    assert any(eos and len(ids) < SHORT for ids, eos, _ in padded), lengths  # some end at once
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


def test_decode_state_budget_sets_the_rows(varied, prompts, monkeypatch):
    """``decode_cache_bytes`` of two rows' encoder states and self-attention K/V: two rows
    decode at once, and the tokens stay those of one padded batch."""
    live = []
    step = t5_decode.step

    def logged_step(model, slots, mask, compiled=None):
        live.append(slots.live)
        return step(model, slots, mask, compiled)

    monkeypatch.setattr(t5_decode, "step", logged_step)
    probe = TorchT5Backend(varied, device="cpu", dtype="float32")
    longest = max(len(probe.codec.encode_prompt(p)) for p in prompts)
    per_row = t5_decode.row_bytes(probe.model, longest, MAX_NEW)
    backend = TorchT5Backend(varied, device="cpu", dtype="float32", decode_cache_bytes=2 * per_row + per_row // 2)
    assert backend.decode_rows(longest, MAX_NEW) == 2
    outs = run_text(backend, prompts)
    assert max(live) == 2
    assert [o.token_ids for o in outs] == [o.token_ids for o in run_text(probe, prompts)]


def test_budget_shorter_than_outputs(varied, prompts, padded):
    backend = TorchT5Backend(varied, device="cpu", dtype="float32")
    for out, (ids, eos, _) in zip(run_text(backend, prompts, max_new=SHORT), padded):
        assert out.token_ids == ids[:SHORT]
        assert out.finished == (eos and len(ids) < SHORT)


def test_repeated_requests_run_once(varied, prompts, padded, monkeypatch):
    """Identical requests of a batch are encoded and decoded once; each gets the output (its
    own index) that it gets alone."""
    encoded = []
    backend = TorchT5Backend(varied, device="cpu", dtype="float32")
    real_encode = backend.model.encode

    def logged_encode(ids, lengths):
        encoded.extend(lengths)
        return real_encode(ids, lengths)

    monkeypatch.setattr(backend.model, "encode", logged_encode)
    order = [3, 0, 3, 5, 0, 3]
    outs = run_text(backend, [prompts[i] for i in order])
    assert sorted(encoded) == sorted(len(backend.codec.encode_prompt(prompts[i])) for i in {0, 3, 5})
    for k, (out, i) in enumerate(zip(outs, order)):
        assert out.index == k and out.token_ids == padded[i][0] and out.finished == padded[i][1]


@pytest.mark.parametrize("positions", [1, 4])
def test_reassociated_cross_attention_equals_projected_kv(t5_backend, positions):
    """``T5Model.cross_attention`` (no K/V: queries mapped to model space over the encoder
    states) against softmax(q K^T) V over K = m W_k^T, V = m W_v^T per head, on rows of
    different lengths (padded keys masked)."""
    model = t5_backend.model
    s, layer = model.s, model.w.decoder[0]
    h, dk, d = s.num_heads, s.d_kv, s.d_model
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 5]
    enc = torch.randn(sum(lengths), d, generator=g)
    xq = torch.randn(len(lengths), positions, h, dk, generator=g)
    mem, bias = pad_rows(enc, lengths)
    got = model.cross_attention(xq, layer, mem, bias)
    start = 0
    for b, n in enumerate(lengths):
        m = enc[start:start + n]
        start += n
        k = (m @ layer.x_k.T).view(n, h, dk).transpose(0, 1)  # [h, n, dk]
        v = (m @ layer.x_v.T).view(n, h, dk).transpose(0, 1)
        q = xq[b].transpose(0, 1)  # [h, P, dk]
        want = (torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v).transpose(0, 1).reshape(positions, h * dk)
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


def test_no_tracking(varied, prompts, padded):
    backend = TorchT5Backend(varied, device="cpu", dtype="float32", max_decode_rows=3)
    for out, (ids, _, _) in zip(run_text(backend, prompts), padded):
        assert out.token_ids == ids and out.tracked_logits is None


def test_model_is_a_module_with_registered_weights(t5_backend, t5_tied_dir):
    """The fused layout's weights are registered (state dict, ``.to``), one entry per fused
    projection, a tied head shares the embedding parameter, and the model's outputs follow a
    copy of its state dict into a fresh model."""
    model = t5_backend.model
    assert isinstance(model, torch.nn.Module) and isinstance(model.w, torch.nn.Module)
    names = dict(model.named_parameters())
    s = model.s
    assert names["w.encoder.0.qkv"].shape == (3 * s.num_heads * s.d_kv, s.d_model)
    assert names["w.decoder.0.wi"].shape[0] == 2 * names["w.decoder.0.wo"].shape[1]  # gated FF: one GEMM
    assert not any(p.requires_grad for p in model.parameters())
    assert not any(k.startswith("_") for k in model.state_dict())  # bias caches are not state
    tied = TorchT5Backend(t5_tied_dir, device="cpu", dtype="float32").model
    assert tied.w.lm_head is tied.w.embed

    twin = copy_of(model)
    ids = torch.arange(10, 30)
    torch.testing.assert_close(twin.encode(ids, [12, 8]), model.encode(ids, [12, 8]), rtol=0, atol=0)


def copy_of(model):
    """A deep copy of ``model`` with zeroed weights, then loaded from its state dict."""
    import copy

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    twin.load_state_dict(model.state_dict())
    return twin
