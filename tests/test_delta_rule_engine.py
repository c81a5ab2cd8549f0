"""The engine's one-token gated delta rule (``fastjudge._engine.recurrent_delta_rule``,
engine/delta_rule.cpp): against the tensor-op form (``gated_delta.recurrent_gated_delta_rule_ops``,
itself held against transformers' ``torch_recurrent_gated_delta_rule`` in
tests/test_gated_delta.py) on the layouts a layer hands it (strided views, bfloat16 betas), one
thread and several, and the arrays it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastjudge import _engine
from fastjudge.backends.qwen.gated_delta import recurrent_gated_delta_rule_, recurrent_gated_delta_rule_ops


def step_inputs(B, S, Hk, Hv, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qk = F.normalize(torch.randn(B, S, 2, Hk, dk, generator=gen), dim=-1)
    q, k = (qk * torch.tensor([dk ** -0.5, 1.0]).view(2, 1, 1)).unbind(2)  # strided views, as in a layer
    conv = torch.randn(B, S, Hv * dv + 8, generator=gen)
    v = conv[..., 8:].reshape(B, S, Hv, dv)  # a view into a wider tensor
    g = -F.softplus(torch.randn(B, S, Hv, generator=gen))
    beta = torch.sigmoid(torch.randn(B, S, Hv, generator=gen))
    memory = torch.randn(B, Hv, dk, dv, generator=gen)
    return memory, q, k, v, g, beta


@pytest.mark.parametrize("B,S,Hk,Hv,dk,dv", [(1, 1, 1, 1, 4, 4), (3, 2, 2, 4, 16, 24), (16, 1, 2, 4, 64, 64),
                                            (2, 3, 4, 8, 32, 48)])
def test_matches_the_tensor_ops(B, S, Hk, Hv, dk, dv):
    memory, q, k, v, g, beta = step_inputs(B, S, Hk, Hv, dk, dv, seed=B * S + dv)
    theirs_memory = memory.clone()
    theirs = recurrent_gated_delta_rule_ops(theirs_memory, q, k, v, g, beta)
    ours = recurrent_gated_delta_rule_(memory, q, k, v, g, beta)
    scale = theirs.abs().max()
    assert float((ours - theirs).abs().max() / scale) <= 1e-5
    assert float((memory - theirs_memory).abs().max() / theirs_memory.abs().max()) <= 1e-5
    # a bfloat16 beta (a bfloat16 model's) is read as float32
    again, again_ops = theirs_memory.clone(), theirs_memory.clone()
    half = beta.bfloat16()
    torch.testing.assert_close(recurrent_gated_delta_rule_(again, q, k, v, g, half),
                               recurrent_gated_delta_rule_ops(again_ops, q, k, v, g, half),
                               rtol=1e-5, atol=1e-5 * scale)


def test_strided_views_are_read_in_place():
    """query, key and value as a layer hands them (strided views, not copies) give the values of
    their contiguous copies."""
    memory, q, k, v, g, beta = step_inputs(4, 2, 2, 4, 8, 16, seed=5)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    results = []
    for views in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous())):
        state, out = memory.clone(), torch.empty(4, 2, 4, 16)
        _engine.recurrent_delta_rule(state.numpy(), *(t.numpy() for t in views), g.exp().numpy(), beta.numpy(),
                                     out.numpy())
        results.append((state, out))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_threads_split_heads_without_changing_a_value():
    """A state large enough for several threads (64 rows x 8 heads x 64 x 64 floats: 8 MB):
    the same bits on one thread and on four."""
    memory, q, k, v, g, beta = step_inputs(64, 1, 4, 8, 64, 64, seed=3)
    arrays = [t.contiguous().numpy() for t in (q, k, v, g.exp(), beta)]
    results = []
    for threads in (1, 4):
        state = memory.clone()
        out = torch.empty(64, 1, 8, 64)
        _engine.recurrent_delta_rule(state.numpy(), *arrays, out.numpy(), threads)
        results.append((state, out))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_refuses_what_it_would_misread():
    B, S, Hk, Hv, dk, dv = 2, 1, 2, 4, 8, 8
    ok = dict(memory=np.zeros((B, Hv, dk, dv), np.float32), query=np.zeros((B, S, Hk, dk), np.float32),
              key=np.zeros((B, S, Hk, dk), np.float32), value=np.zeros((B, S, Hv, dv), np.float32),
              decay=np.ones((B, S, Hv), np.float32), beta=np.zeros((B, S, Hv), np.float32),
              out=np.zeros((B, S, Hv, dv), np.float32))
    _engine.recurrent_delta_rule(**ok)
    for name, bad, message in [
        ("memory", ok["memory"].astype(np.float64), "memory must be"),
        ("query", np.zeros((B, S, Hk, dk + 1), np.float32), "query must be"),
        ("value", np.zeros((B, S, 3, dv), np.float32), "multiple of key heads"),
        ("out", np.zeros((B, S, Hv, dv), np.float32)[..., ::-1], "out must be"),
        ("beta", np.zeros((B, S, Hv), np.float32).T.copy().T, "beta must be"),
        ("value", np.zeros((B, S, Hv, 2 * dv), np.float32)[..., ::2], "contiguous rows"),  # strided rows
        ("key", ok["key"].tolist(), "key must be"),  # not an array: nothing to read in place
    ]:
        with pytest.raises(ValueError, match=message):
            _engine.recurrent_delta_rule(**{**ok, name: bad})
    frozen = ok["memory"].copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        _engine.recurrent_delta_rule(**{**ok, "memory": frozen})
