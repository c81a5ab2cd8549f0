"""The engine's pass over a Qwen attention layer's inputs and its output gate
(``fastjudge._engine.attention_inputs`` / ``output_gate``, engine/attention_inputs.cpp, called by
``AttentionLayer.mix`` through ``cpu_engine.attention_inputs_in_engine`` /
``output_gate_in_engine``) against the layer's tensor ops with the engine out of reach (the
per-head RMSNorm, ``layers.rotate``, the scattered K/V writes, ``o * torch.sigmoid(gate)``), run
side by side on every attention layer of real forwards: fresh prompts, suffix passes over cached
rows, padding; float32 and bfloat16. The tensor ops themselves are held against transformers'
``Qwen3_5Attention.forward`` (transformers/models/qwen3_5/modeling_qwen3_5.py) in
tests/test_qwen_faithfulness.py, whole models with this pass in them too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import qwen_layer_steps

from fastjudge import _engine
from fastjudge.backends import cpu_engine
from fastjudge.backends.qwen import layers
from fastjudge.backends.qwen.backend import TorchQwenBackend
from fastjudge.checkpoints import build_random_qwen
from fastjudge.demo import tokenizer_corpus


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    return build_random_qwen(tmp_path_factory.mktemp("qwen3_5_inputs"), tokenizer_corpus(), seed=11)


class SideBySide:
    """Wraps ``AttentionLayer.mix``: the engine's pass on the pool's buffers, the tensor ops on
    copies of them; records outputs and the pools after each call."""

    def __init__(self, monkeypatch):
        self.out, self.pools, self.engine_calls, self.gate_calls = [], [], 0, 0
        original = layers.AttentionLayer.mix
        inputs, gate = layers.attention_inputs_in_engine, layers.output_gate_in_engine

        def counted(*args):
            result = inputs(*args)
            self.engine_calls += result is not None
            return result

        def gate_counted(*args):
            result = gate(*args)
            self.gate_calls += result is not None
            return result

        def both(layer, h, step, state):
            copies = tuple(t.clone() for t in state)
            with monkeypatch.context() as m:
                m.setattr(layers, "attention_inputs_in_engine", counted)
                m.setattr(layers, "output_gate_in_engine", gate_counted)
                ours = original(layer, h, step, state)
            with monkeypatch.context() as m:
                m.setattr(layers, "attention_inputs_in_engine", lambda *args: None)
                m.setattr(layers, "output_gate_in_engine", lambda *args: None)
                theirs = original(layer, h, step, copies)
            real = step.real[..., 0]  # padding tokens' outputs are never read
            self.out.append((ours[real].float(), theirs[real].float()))
            self.pools.append((tuple(t.clone() for t in state), copies))
            return ours

        monkeypatch.setattr(layers.AttentionLayer, "mix", both)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_pass_matches_the_tensor_ops(qwen35_dir, dtype, monkeypatch):
    backend = TorchQwenBackend(qwen35_dir, device="cpu", dtype=dtype)
    seen = SideBySide(monkeypatch)
    pool, step = qwen_layer_steps(backend, monkeypatch, seed=1)
    pool.load_rows(0, [None] * 3)
    step([70, 33, 5], 70)          # fresh prompts, padded
    step([20, 9, 1], 20)           # suffix passes over cached rows
    step([2, 1, 3], 3)             # a few tokens
    attention_layers = sum(isinstance(layer, layers.AttentionLayer) for layer in backend.model.layers)
    assert seen.engine_calls == seen.gate_calls == 3 * attention_layers > 0
    for ours, theirs in seen.out:
        scale = float(theirs.abs().max())
        if dtype == "float32":  # the engine's sigmoid against torch's: within a few float32 ulps
            assert float((ours - theirs).abs().max()) <= 1e-5 * scale
        else:
            assert float((ours - theirs).abs().max()) <= 2 ** -6 * scale
            assert float((ours == theirs).float().mean()) >= 0.97
    # the keys and values written (not the last column: padding's scratch, never read); the
    # values copied as they are, the keys normalised and rotated with the same roundings, but
    # torch's rotary may fuse a product into its sum where the engine rounds both
    for ours, theirs in seen.pools:
        keys, values = ((a[..., :-1, :].float(), b[..., :-1, :].float()) for a, b in zip(ours, theirs))
        assert torch.equal(*values)
        scale = float(keys[1].abs().max())
        if dtype == "float32":
            assert float((keys[0] - keys[1]).abs().max()) <= 1e-6 * scale
        else:
            assert float((keys[0] - keys[1]).abs().max()) <= 2 ** -7 * scale
            assert float((keys[0] == keys[1]).float().mean()) >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd, half", [(16, 4), (64, 16), (64, 24), (128, 32), (128, 64)])
def test_pass_matches_the_tensor_ops_at_every_rotary_width(dtype, hd, half):
    """``_engine.attention_inputs`` against ``layers.rms`` then ``layers.rotate`` and the K/V
    writes, on random rows, for rotary halves in whole vectors, in a vector and a tail, and in a
    tail alone (the model's test checkpoint has one head size): keys and queries identical in
    bfloat16, within 1e-6 in float32; values copied; padding's scratch column left alone."""
    gen = torch.Generator().manual_seed(hd + half)
    B, S, H, Hkv, columns, eps = 2, 7, 4, 2, 12, 1e-6
    width = (2 * H + 2 * Hkv) * hd  # queries, keys, a gate, values
    qkv = torch.randn(B, S, width, generator=gen).to(dtype)
    qk_norm = torch.rand(H + Hkv, hd, generator=gen) + 0.5
    angle = torch.randn(B, S, 1, hd, generator=gen)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    where = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 11, 11, 11]])  # row 1: three padding tokens
    keys, values = (torch.zeros(B, Hkv, columns, hd, dtype=dtype) for _ in range(2))
    got = cpu_engine.attention_inputs_in_engine(qkv, qk_norm, (cos, sin, half), keys, values, where, H, Hkv,
                                                width - Hkv * hd, eps)
    want = layers.rotate(layers.rms(qkv[..., :(H + Hkv) * hd].reshape(B, S, H + Hkv, hd), qk_norm, eps),
                         (cos, sin, half))
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
    v = qkv[..., width - Hkv * hd:].reshape(B, S, Hkv, hd)
    for b in range(B):
        for t in range(S):
            column = int(where[b, t])
            if column == columns - 1:
                continue
            assert torch.equal(values[b, :, column], v[b, t])
            assert torch.equal(keys[b, :, column], got[b, t, H:])
    assert not keys[:, :, -1].any() and not values[:, :, -1].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [16, 48, 64, 80, 256])
def test_output_gate_matches_the_tensor_ops(dtype, n):
    """``output_gate_in_engine`` against ``o * torch.sigmoid(gate)`` for rows of four vectors and
    more, fewer, and both, the gate read in place from a slice of wider rows: float32 within
    1e-6 (the engine's exponential against torch's), bfloat16 at least 99 % identical and none
    more than one rounding step away."""
    gen = torch.Generator().manual_seed(n)
    o = torch.randn(5, 3, n, generator=gen).to(dtype)
    rows = torch.randn(5, 3, 3 * n, generator=gen).to(dtype)
    gate = rows[..., n:2 * n]  # a slice, as the fused projection's gate columns
    want = o * torch.sigmoid(gate)
    got = cpu_engine.output_gate_in_engine(o.clone(), gate)
    if dtype == torch.float32:
        assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
    else:
        assert float((got == want).float().mean()) >= 0.99
        assert float(((got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-30)).max()) <= 2 ** -7


def test_refuses_arrays_that_do_not_fit():
    B, S, H, Hkv, hd, columns = 2, 3, 4, 2, 16, 8
    width = (2 * H + 2 * Hkv) * hd
    good = dict(qkv=np.zeros((B, S, width), np.float32), qk_norm=np.ones((H + Hkv, hd), np.float32),
                cos=np.ones((B, S, hd), np.float32), sin=np.zeros((B, S, hd), np.float32),
                rotated=np.zeros((B, S, H + Hkv, hd), np.float32),
                keys=np.zeros((B, Hkv, columns, hd), np.float32), values=np.zeros((B, Hkv, columns, hd), np.float32),
                where=np.arange(B * S, dtype=np.int64) % columns, heads=H, kv_heads=Hkv,
                values_at=width - Hkv * hd, half=4, eps=1e-6)
    _engine.attention_inputs(**good)
    bad = [
        dict(qkv=np.zeros((B, S, width), np.float64)),
        dict(rotated=np.zeros((B, S, H + Hkv, hd), np.int16)),                 # dtypes mixed
        dict(values_at=width - Hkv * hd + 1),                                  # values past the row
        dict(values_at=hd),                                                    # values over the queries
        dict(half=hd // 2 + 1),                                                # rotary dims past the head
        dict(where=np.full(B * S, columns, np.int64)),                         # past the pool
        dict(where=np.zeros(B * S - 1, np.int64)),
        dict(keys=np.zeros((B, Hkv, columns, hd), np.float32)[:, :, ::-1]),    # not C-contiguous
        dict(cos=np.ones((B, S, hd + 1), np.float32)),
    ]
    for change in bad:
        with pytest.raises(ValueError):
            _engine.attention_inputs(**{**good, **change})
    frozen = good["keys"].copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        _engine.attention_inputs(**{**good, "keys": frozen})
    o = np.zeros((6, 32), np.float32)
    _engine.output_gate(o, np.zeros((6, 1, 32), np.float32))
    assert np.all(o == 0)
    for gate in (np.zeros((6, 1, 24), np.float32), np.zeros((6, 1, 32), np.int16), np.zeros((5, 1, 32), np.float32)):
        with pytest.raises(ValueError):
            _engine.output_gate(o, gate)
