"""The engine's Gated DeltaNet layer between its projections (``fastjudge._engine.deltanet_step``,
engine/delta_rule.cpp, called by ``DeltaNetLayer._engine_step``), in both forms: the few-token
step and the chunked form for prompts and suffix passes, against the layer's tensor ops
(``DeltaNetLayer.mix`` with the engine out of reach: the causal conv, gates, the query/key norms,
``recurrent_gated_delta_rule_`` or ``chunk_gated_delta_rule_``, the gated norm), run side by
side on every DeltaNet layer of a real forward: fresh rows, cached rows, one to three new tokens,
passes of one chunk and of several, padding tokens; float32 and bfloat16. The tensor ops
themselves are held against transformers in tests/test_gated_delta.py and, with this step in
the model, whole models in tests/test_qwen_faithfulness.py and tests/test_prefix_route.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import qwen_layer_steps

from fastjudge import _engine
from fastjudge.backends.qwen import layers
from fastjudge.backends.qwen.backend import TorchQwenBackend
from fastjudge.checkpoints import build_random_qwen
from fastjudge.demo import tokenizer_corpus


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    return build_random_qwen(tmp_path_factory.mktemp("qwen3_5_step"), tokenizer_corpus(), seed=9)


class SideBySide:
    """Wraps ``DeltaNetLayer.mix``: the engine on the pool's state, the tensor ops on copies of
    it; records the largest differences of outputs and states."""

    def __init__(self, monkeypatch):
        self.calls, self.out, self.conv, self.memory = 0, [], [], []
        original = layers.DeltaNetLayer.mix

        def both(layer, h, step, state):
            conv, memory = state
            copies = (conv.clone(), memory.clone())
            ours = original(layer, h, step, state)
            with monkeypatch.context() as m:
                m.setattr(layers, "engine_takes", lambda x: False)
                theirs = original(layer, h, step, copies)
            self.calls += 1
            real = step.real[..., 0]  # padding tokens' outputs are never read
            self.out.append((ours[real].float(), theirs[real].float()))
            self.conv.append(torch.equal(conv, copies[0]))
            self.memory.append((memory.clone(), copies[1]))
            return ours

        monkeypatch.setattr(layers.DeltaNetLayer, "mix", both)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_step_matches_the_tensor_ops(qwen35_dir, dtype, monkeypatch):
    backend = TorchQwenBackend(qwen35_dir, device="cpu", dtype=dtype)
    seen = SideBySide(monkeypatch)
    # the model's tensor-op step, whose DeltaNet layers call this step (the whole-step engine,
    # tests/test_qwen_engine_step.py, calls the same kernel from C++)
    pool, step = qwen_layer_steps(backend, monkeypatch, seed=0)
    pool.load_rows(0, [None] * 3)
    step([3, 2, 1], 3)             # fresh rows of up to three tokens, padded
    step([1, 1, 1], 1)             # one-token decoding steps on cached rows
    step([2, 3, 0], 3)             # jump-forward runs, a row with nothing new
    step([40, 20, 33], 40)         # a suffix pass of one chunk (the chunked form)
    step([1, 1, 1], 1)
    step([100, 2, 71], 100)        # a pass of several chunks, one row shorter than the conv
    step([1, 1, 1], 1)
    pool.load_rows(0, [None] * 3)
    step([90, 57, 3], 90)          # fresh prompts of several chunks, padded
    step([1, 1, 1], 1)
    assert seen.calls == 9 * sum(isinstance(layer, layers.DeltaNetLayer) for layer in backend.model.layers)
    assert all(seen.conv)  # the conv state holds each row's last real inputs, bit for bit
    for ours, theirs in seen.out:
        scale = float(theirs.abs().max())
        if dtype == "float32":
            assert float((ours - theirs).abs().max()) <= 1e-5 * scale
        else:  # the same roundings; a value may land one bfloat16 step away after a different sum order
            assert float((ours - theirs).abs().max()) <= 2 ** -6 * scale
            assert float((ours == theirs).float().mean()) >= 0.97
    for ours, theirs in seen.memory:
        assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


@pytest.mark.parametrize("key_dim", [16, 8, 6])  # conv channels 128, 96 and 88: whole blocks, a lone vector, a tail
@pytest.mark.parametrize("fresh", [True, False])
def test_chunked_form_matches_the_few_token_form(key_dim, fresh):
    """The chunked form (``chunk`` > 0) against the few-token form (``chunk`` = 0) on the same
    float32 inputs and states, where both compute the same values (the few-token form rounds the
    conv's products to the model's type, a no-op in float32): rows with padding and one row with
    nothing new, every chunk size from one token to the whole pass, conv channels in whole blocks
    of four vectors, with a lone vector, and with a tail of a vector."""
    rng = np.random.default_rng(key_dim)
    B, S, K, Hk, Hv, dv = 3, 21, 4, 2, 4, 16
    C = 2 * Hk * key_dim + Hv * dv
    width = C + Hv * dv + 2 * Hv
    projected = rng.standard_normal((B, S, width)).astype(np.float32)
    counts = np.array([S, 13, 0], np.int64)
    taps = (0.5 * rng.standard_normal((K, C))).astype(np.float32)
    conv0 = rng.standard_normal((B, K - 1, C)).astype(np.float32)
    memory0 = (0.1 * rng.standard_normal((B, Hv, key_dim, dv))).astype(np.float32)
    common = dict(counts=counts, dt_bias=rng.standard_normal(Hv).astype(np.float32),
                  neg_A=-rng.random(Hv).astype(np.float32), gated_norm=rng.random(dv).astype(np.float32) + 0.5,
                  key_heads=Hk, key_dim=key_dim, eps=1e-6, l2_eps=1e-6, fresh=fresh, threads=2)

    def run(chunk):
        conv, memory, out = conv0.copy(), memory0.copy(), np.zeros((B, S, Hv * dv), np.float32)
        _engine.deltanet_step(projected, conv, taps, memory, out=out, chunk=chunk, **common)
        return out, conv, memory

    want_out, want_conv, want_memory = run(0)
    real = np.arange(S)[None, :] < counts[:, None]
    for chunk in (1, 5, 16, S):
        out, conv, memory = run(chunk)
        scale = np.abs(want_out[real]).max()
        assert np.abs(out[real] - want_out[real]).max() <= 1e-5 * scale, chunk
        assert np.array_equal(conv, want_conv)  # each row's last K - 1 real inputs, bit for bit
        assert np.abs(memory - want_memory).max() <= 1e-5 * np.abs(want_memory).max(), chunk


def test_refuses_arrays_that_do_not_fit():
    B, S, K, Hk, Hv, dk, dv = 2, 1, 4, 2, 4, 8, 8
    C = 2 * Hk * dk + Hv * dv
    good = dict(projected=np.zeros((B, S, C + Hv * dv + 2 * Hv), np.float32),
                conv_state=np.zeros((B, K - 1, C), np.float32), taps=np.zeros((K, C), np.float32),
                memory=np.zeros((B, Hv, dk, dv), np.float32), counts=np.ones(B, np.int64),
                dt_bias=np.zeros(Hv, np.float32), neg_A=-np.ones(Hv, np.float32),
                gated_norm=np.ones(dv, np.float32), out=np.zeros((B, S, Hv * dv), np.float32),
                key_heads=Hk, key_dim=dk, eps=1e-6, l2_eps=1e-6)
    _engine.deltanet_step(**good)
    bad = [
        dict(projected=np.zeros((B, S, C + Hv * dv + 2 * Hv + 1), np.float32)),  # width does not fit
        dict(key_dim=dk + 1),                                                    # nor does the split of C
        dict(conv_state=np.zeros((B, K, C), np.float32)),
        dict(memory=np.zeros((B, Hv, dk, dv), np.float64)),
        dict(out=np.zeros((B, S, Hv * dv), np.int16)),                           # dtypes mixed
        dict(counts=np.array([1, 2])),                                           # more than S
        dict(counts=np.array([1])),
        dict(gated_norm=np.ones(dv + 1, np.float32)),
        dict(taps=np.zeros((K, C), np.float32).T),                               # not C-contiguous
        dict(chunk=-1),
        dict(chunk=_engine.chunked_delta_rule_max_chunk + 1),
        dict(chunk=4),                                                           # dv = 8: no chunked form
    ]
    for change in bad:
        with pytest.raises(ValueError):
            _engine.deltanet_step(**{**good, **change})
    frozen = good["memory"].copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        _engine.deltanet_step(**{**good, "memory": frozen})
