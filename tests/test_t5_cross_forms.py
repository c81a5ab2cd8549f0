"""The T5 decoder's two exact forms of cross-attention in greedy decoding: reassociated over the
encoder states, and per head over K/V projected once per row, switched to at a step
(``backends.t5.decode``, ``projection_step``). Each, and a switch mid-decode, against
transformers' greedy ``generate`` on one padded batch
(transformers v5.25.0 ``generation/utils.py``, ``GenerationMixin.generate`` with
``do_sample=False, num_beams=1``, whose cross-attention is ``models/t5/modeling_t5.py``,
``T5Attention.forward`` with ``key_value_states``: K/V projected from the encoder states at the
first step and read from the cache at every later one): the same tokens, the same end and the
same logits at the tracked ids, on rows that end at varied lengths (rows leave and others join
the pool); and the two forms against each other within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
from test_t5_decode import MAX_NEW, SHORT, padded, prompts, rating_ids, run_text, varied  # noqa: F401

from fastjudge.backends.t5 import decode as t5_decode
from fastjudge.backends.t5.backend import TorchT5Backend
from fastjudge.backends.t5.decode import break_even_steps, projection_step
from fastjudge.backends.t5.model import DecoderStep, T5Model


def spy_projections(monkeypatch) -> list[int]:
    """The row count of every ``T5Model.project_cross`` call from now on."""
    calls = []
    project = T5Model.project_cross

    def logged(self, pool, start, stop):
        calls.append(stop - start)
        return project(self, pool, start, stop)

    monkeypatch.setattr(T5Model, "project_cross", logged)
    return calls


@pytest.mark.parametrize("project_at", [0, 4, None])
@pytest.mark.parametrize("rows", [2, 12])
def test_each_form_gives_generates_tokens(varied, prompts, padded, project_at, rows, monkeypatch):  # noqa: F811
    """Projected from the first step, from the fifth (rows live then, and rows joining later),
    never; all rows at once, or two at a time (rows leave and join, their K/V moved along)."""
    calls = spy_projections(monkeypatch)
    backend = TorchT5Backend(varied, device="cpu", dtype="float32", max_decode_rows=rows)
    backend.project_at = project_at
    track = rating_ids(backend.codec)
    outs = run_text(backend, prompts, track=track)
    ends = [len(ids) + eos for ids, eos, _ in padded]  # steps each row runs
    if project_at is None:
        assert calls == [] and backend.pool.cross_slots == 0
    elif project_at == 0:
        assert sum(calls) == len(prompts)  # every row once
    elif rows == len(prompts):  # all rows from the start: those still running at the switch
        assert calls == [sum(n > project_at for n in ends)]
    else:
        assert 0 < sum(calls) < len(prompts)
    for out, (ids, eos, logits) in zip(outs, padded):
        assert out.token_ids == ids
        assert out.finished == eos
        np.testing.assert_allclose(out.tracked_logits, logits[:, track].double().numpy(), rtol=1e-4, atol=1e-4)


def test_forms_agree_within_float32_rounding(varied, prompts):  # noqa: F811
    """The same steps in both forms: logits at a quarter of the vocabulary within 1e-5."""
    backend = TorchT5Backend(varied, device="cpu", dtype="float32", max_decode_rows=5)
    track = range(0, backend.shape.vocab_size, 4)
    runs = {}
    for project_at in (0, None):
        backend.project_at = project_at
        runs[project_at] = run_text(backend, prompts, track=track)
    for a, b in zip(runs[0], runs[None]):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.tracked_logits, b.tracked_logits, rtol=0, atol=1e-5)


def test_the_budget_of_steps_picks_the_step(varied, prompts, padded, monkeypatch):  # noqa: F811
    """By default a call projects after the break-even number of steps when its budget leaves as
    many again (rows that stopped before are never projected), and not at all for a shorter
    budget; a K/V pool that does not fit the state budget falls back to the reassociated form,
    with the same tokens. (The tiny shape's d_model is only 4 x d_kv, where the measured costs
    never make a projection pay; the costs measured with SDPA for both forms, 4x and 14x the
    GEMM rate, give it a break-even of 32 steps.)"""
    monkeypatch.setattr(t5_decode, "REASSOCIATED_SLOWDOWN", 4.0)
    monkeypatch.setattr(t5_decode, "PER_HEAD_SLOWDOWN", 14.0)
    backend = TorchT5Backend(varied, device="cpu", dtype="float32")
    steps = break_even_steps(backend.shape)
    assert steps == 32
    assert projection_step(backend.shape, 2 * steps - 1) is None and projection_step(backend.shape, 2 * steps) == steps
    calls = spy_projections(monkeypatch)
    short = run_text(backend, prompts, max_new=MAX_NEW)
    assert calls == [] and backend.pool.cross_slots == 0
    long = run_text(backend, prompts, max_new=2 * steps)
    running = sum(len(ids) + eos > steps for ids, eos, _ in padded)  # still running at the switch
    assert 0 < running < len(prompts) and calls == [running]
    backend.project_at = None
    assert [o.token_ids for o in run_text(backend, prompts, max_new=2 * steps)] == [o.token_ids for o in long]

    tight = TorchT5Backend(varied, device="cpu", dtype="float32", decode_cache_bytes=backend.pool.mem.nbytes // 4)
    tight.project_at = 0
    calls.clear()
    assert [o.token_ids for o in run_text(tight, prompts)] == [o.token_ids for o in short]
    assert calls == [] and tight.pool.cross_slots == 0
    assert [o.token_ids for o in run_text(tight, prompts, max_new=SHORT)] == [o.token_ids[:SHORT] for o in short]


def test_projected_kv_in_float32_on_the_cpu(varied, prompts):  # noqa: F811
    """A bfloat16 model on the CPU keeps its decoder's attention K/V, self-attention and projected
    cross-attention, in float32 (``pool.attention_dtype``: SDPA's one-query attention per head is
    several times slower in bfloat16 there, slower even than the reassociated cross-attention it
    replaces), and the per-head cross-attention runs in float32, rounded to bfloat16 once: the
    same values as float32 SDPA over those K/V."""
    import torch
    import torch.nn.functional as F

    backend = TorchT5Backend(varied, device="cpu", dtype="bfloat16", max_decode_rows=5)
    backend.project_at = 0
    run_text(backend, prompts)
    pool = backend.pool
    assert pool.xkv.dtype == pool.kv.dtype == torch.float32 and pool.mem.dtype == torch.bfloat16
    assert pool.cross_slots > 0
    s = backend.shape
    xq = torch.randn(3, 1, s.num_heads, s.d_kv).bfloat16()
    xkv = pool.xkv[:3, 0, :, :, :16]
    mask = torch.zeros(3, 1, 1, 16)
    mask[1, ..., 9:] = float("-inf")
    layer = backend.model.decoder[0]
    want = F.scaled_dot_product_attention(xq.float().transpose(1, 2), xkv[:, 0], xkv[:, 1], attn_mask=mask, scale=1.0)
    want = want.transpose(1, 2).reshape(3, 1, -1)
    got = layer.cross_attention_heads(xq, xkv, DecoderStep(None, None, None, mask))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())
    # the engine's attention (what eager CPU steps take): float32 too, within float32 rounding of SDPA
    step = DecoderStep(None, None, None, None, enc_lengths=torch.tensor([16, 9, 16]))
    got = layer.cross_attention_heads(xq.float(), xkv, step)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("positions", [1, 3])
def test_per_head_cross_attention_engine_equals_sdpa(varied, prompts, positions):  # noqa: F811
    """The per-head cross-attention over projected K/V (``T5Block.cross_attention_heads``)
    through the engine's few-token attention (each head's positions as its query rows, each
    row's keys up to its own prompt, padded keys poisoned with NaN) against SDPA under the key
    mask (torch.nn.functional.scaled_dot_product_attention)."""
    import torch

    backend = TorchT5Backend(varied, device="cpu", dtype="float32", max_decode_rows=5)
    s, layer = backend.shape, backend.model.decoder[0]
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([16, 9, 1])
    xkv = torch.randn(3, 2, s.num_heads, 16, s.d_kv, generator=g)
    xq = torch.randn(3, positions, s.num_heads, s.d_kv, generator=g)
    mask = torch.zeros(3, 1, 1, 16).masked_fill(torch.arange(16) >= lengths[:, None, None, None], float("-inf"))
    want = layer.cross_attention_heads(xq, xkv, DecoderStep(None, None, None, mask))
    poisoned = xkv.masked_fill(torch.arange(16)[:, None] >= lengths[:, None, None, None, None], float("nan"))
    got = layer.cross_attention_heads(xq, poisoned, DecoderStep(None, None, None, None, enc_lengths=lengths))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_break_even_of_the_flan_t5_shapes():
    """With both forms in the engine, Flan-T5-small's shape (d_model 8 x d_kv) projects after
    61 steps, wider models sooner (base 12x, large 16x); a model whose d_model is at most about
    4.35 x d_kv never pays for a projection."""
    from fastjudge.backends.t5.shape import T5Shape
    from fastjudge.checkpoints import T5_SHAPES

    def shape(name: str) -> T5Shape:
        s = T5_SHAPES[name]
        return T5Shape(vocab_size=100, d_model=s["d_model"], d_kv=s["d_kv"], num_heads=s["num_heads"],
                       num_layers=s["num_layers"], num_decoder_layers=s["num_layers"], num_buckets=32,
                       max_distance=128, eps=1e-6, gated=True, act="gelu_new", scale_decoder_outputs=False,
                       decoder_start_token_id=0, eos_token_id=1)

    assert break_even_steps(shape("small")) == 61
    assert break_even_steps(shape("base")) < 61
    assert break_even_steps(shape("tiny")) is None and projection_step(shape("tiny"), 10_000) is None
