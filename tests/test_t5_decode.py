"""T5 greedy decoding with early exit and refill (``fastjudge.backends.t5.decode``) against one
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
from fastjudge.backends.t5 import decode as t5_decode
from fastjudge.backends.t5.backend import TorchT5Backend
from fastjudge.backends.t5.model import DecoderStep
from fastjudge.backends.t5.pool import T5Pool, row_bytes
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


def live_rows_per_step(monkeypatch) -> list[int]:
    """The rows of every decoder step taken from now on (``decode.run_step`` and the steps of
    ``decode.run_pick_steps``' runs logged)."""
    live = []
    step, run = t5_decode.run_step, t5_decode.run_pick_steps

    def logged(model, pool, tokens, counts, compiled=None):
        live.append(len(counts))
        return step(model, pool, tokens, counts, compiled)

    def logged_run(model, pool, tokens, *args):
        picked = run(model, pool, tokens, *args)
        if picked is not None:
            live.extend([tokens.shape[0]] * picked[0].shape[1])
        return picked

    monkeypatch.setattr(t5_decode, "run_step", logged)
    monkeypatch.setattr(t5_decode, "run_pick_steps", logged_run)
    return live


def test_rows_join_as_others_leave(varied, prompts, monkeypatch):
    """With two decode slots, rows enter only as others finish (batched moves), and never more
    than two run."""
    loads, moves = [], []
    load, move = T5Pool.load, T5Pool.move

    def logged_load(self, first, states):
        loads.append((first, len(states)))
        load(self, first, states)

    def logged_move(self, src, dst):
        moves.append((src, dst))
        move(self, src, dst)

    monkeypatch.setattr(T5Pool, "load", logged_load)
    monkeypatch.setattr(T5Pool, "move", logged_move)
    live = live_rows_per_step(monkeypatch)
    backend = TorchT5Backend(varied, device="cpu", dtype="float32", max_decode_rows=2)
    run_text(backend, prompts)
    assert max(live) == 2 and min(live) >= 1
    assert len(loads) > 1 and all(first + n <= 2 for first, n in loads)  # refilled, within two slots
    assert sum(n for _, n in loads) == len(prompts)
    assert all(len(src) == len(dst) and max(src) < 2 for src, dst in moves)


def test_decode_state_budget_sets_the_rows(varied, prompts, monkeypatch):
    """``decode_cache_bytes`` of two and a half slots of the pool: two rows decode at once, and
    the tokens stay those of one padded batch."""
    probe = TorchT5Backend(varied, device="cpu", dtype="float32")
    outs = run_text(probe, prompts)
    pool = probe.pool
    per_row = row_bytes(probe.shape, pool.enc_capacity, pool.capacity, 4)
    backend = TorchT5Backend(varied, device="cpu", dtype="float32", decode_cache_bytes=2 * per_row + per_row // 2)
    live = live_rows_per_step(monkeypatch)
    assert [o.token_ids for o in run_text(backend, prompts)] == [o.token_ids for o in outs]
    assert backend.pool.slots == 2 and max(live) == 2
    assert backend.pool_allocations == 1  # allocated once for the whole run


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


@pytest.mark.parametrize("form", ["states", "few-token", "sdpa"])
@pytest.mark.parametrize("positions", [1, 4])
def test_reassociated_cross_attention_equals_projected_kv(t5_backend, positions, form):
    """``T5Model.cross_attention`` (no K/V: queries mapped to model space over the encoder
    states) against softmax(q K^T) V over K = m W_k^T, V = m W_v^T per head, on rows of
    different lengths, in each of its forms: one engine call (``_engine.reassociated_attention``:
    the maps into and out of model space around attention over states that are keys and values
    alike, each row's length), the engine's few-token attention (for queries the one call does
    not take; both with the padded states poisoned with NaN), SDPA under the key mask."""
    model = t5_backend.model
    s, layer = model.s, model.decoder[0]
    h, dk, d = s.num_heads, s.d_kv, s.d_model
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 5]
    enc = torch.randn(sum(lengths), d, generator=g)
    xq = torch.randn(len(lengths), positions, h, dk, generator=g)
    mem = torch.zeros(len(lengths), max(lengths), d)
    for b, (n, start) in enumerate(zip(lengths, np.cumsum([0] + lengths[:-1]))):
        mem[b, :n] = enc[start:start + n]
    keys = torch.arange(max(lengths))[None, :] >= torch.tensor(lengths)[:, None]
    if form == "states":
        mem[keys] = float("nan")
        step = DecoderStep(None, None, None, None, enc_lengths=torch.tensor(lengths))
    elif form == "few-token":  # queries not contiguous: not the one call's
        mem[keys] = float("nan")
        xq = torch.empty(*xq.shape[:-1], 2 * dk)[..., :dk].copy_(xq)
        step = DecoderStep(None, None, None, None, enc_lengths=torch.tensor(lengths))
    else:
        bias = torch.zeros(len(lengths), max(lengths)).masked_fill(keys, float("-inf")).view(len(lengths), 1, 1, -1)
        step = DecoderStep(None, None, None, bias)
    got = layer.cross_attention(xq, mem, step)
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
    assert isinstance(model, torch.nn.Module) and isinstance(model.decoder[0], torch.nn.Module)
    names = dict(model.named_parameters())
    s = model.s
    assert names["encoder.0.qkv.weight"].shape == (3 * s.num_heads * s.d_kv, s.d_model)
    assert names["decoder.0.wi.weight"].shape[0] == 2 * names["decoder.0.wo.weight"].shape[1]  # gated FF: one GEMM
    assert not any(p.requires_grad for p in model.parameters())
    assert not any(k.startswith("_") for k in model.state_dict())  # bias caches are not state
    tied = TorchT5Backend(t5_tied_dir, device="cpu", dtype="float32").model
    assert tied.lm_head is tied.embed

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


def test_text_needs_room_for_a_token():
    """A text request with no room for a token is refused where it is made: a decoding run counts
    each row's room (``decode.run_pick_steps``), and no row decodes nothing."""
    from fastjudge.runtime.requests import Text

    for budget in (0, -3):
        with pytest.raises(ValueError, match="max_new_tokens"):
            Text(budget)
    assert Text(1).max_new_tokens == 1
