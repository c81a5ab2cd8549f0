"""The engine's rotary embedding (``_engine.rotate_halves``, engine/rotary.cpp: what the vision
tower's ``rotate`` runs on the CPU) against transformers' ``apply_rotary_pos_emb_vision``
(``(q * cos) + (rotate_half(q) * sin)`` in float32, back to the input's dtype;
transformers/models/qwen3_5/modeling_qwen3_5.py), bit for bit: float32 and bfloat16, head dims
whose half is no multiple of the vector width, queries and keys read in place from a fused qkv
projection's output, several frames over one position table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastjudge import _engine
from fastjudge.backends.cpu_engine import rotate_halves_in_engine
from fastjudge.backends.qwen.vision import rotate


def tables(n: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, dim] of angles whose two halves repeat (the tower's layout)."""
    angles = torch.rand(n, dim // 2, generator=torch.Generator().manual_seed(seed)) * 40
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frames,n,heads,dim", [(1, 12, 2, 16), (3, 64, 4, 32), (2, 37, 16, 72), (1, 5, 1, 2)])
def test_same_bits_as_transformers(dtype, frames, n, heads, dim):
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb_vision

    gen = torch.Generator().manual_seed(frames * 100 + dim)
    qkv = (torch.randn(frames, n, 3, heads, dim, generator=gen) * 3).to(dtype)
    pair = qkv[:, :, :2]  # queries and keys, in place in the fused output
    cos, sin = tables(n, dim, dim)
    got = rotate_halves_in_engine(pair, cos[:, None, None], sin[:, None, None])
    assert got is not None and got.dtype == dtype and got.shape == pair.shape
    q, k = (pair[:, :, i].reshape(frames * n, heads, dim) for i in (0, 1))
    want_q, want_k = apply_rotary_pos_emb_vision(q, k, cos.repeat(frames, 1), sin.repeat(frames, 1))
    assert torch.equal(got[:, :, 0].reshape(frames * n, heads, dim), want_q)
    assert torch.equal(got[:, :, 1].reshape(frames * n, heads, dim), want_k)
    # the tower's rotate takes the engine on the CPU: the same bits as its tensor-op form
    assert torch.equal(rotate(pair, cos[:, None, None], sin[:, None, None]), got)


def test_tensor_ops_where_the_engine_does_not_take_it():
    """float16 and an odd head dim stay on the tensor ops (None from the engine's route)."""
    cos, sin = tables(4, 8, 1)
    x = torch.randn(2, 4, 3, 8).half()
    assert rotate_halves_in_engine(x, cos[:, None], sin[:, None]) is None
    assert rotate(x, cos[:, None], sin[:, None]).dtype == torch.float16
    assert rotate_halves_in_engine(torch.randn(2, 4, 3, 7), *tables(4, 7, 1)) is None


def test_same_bits_on_any_thread_count():
    x = torch.randn(600, 4, 72).numpy()
    cos, sin = (t.numpy() for t in tables(200, 72, 2))
    one = np.empty_like(x)
    _engine.rotate_halves(x, cos, sin, one, 1)
    for threads in (2, 3, 8):
        many = np.empty_like(x)
        _engine.rotate_halves(x, cos, sin, many, threads)
        assert np.array_equal(many, one)


def test_refuses_what_it_cannot_take():
    x = np.zeros((4, 2, 8), np.float32)
    cos = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="3-D"):
        _engine.rotate_halves(np.zeros((4, 8), np.float32), cos, cos, np.zeros((4, 8), np.float32))
    with pytest.raises(ValueError, match="float32"):
        _engine.rotate_halves(x.astype(np.float64), cos, cos, x.copy())
    with pytest.raises(ValueError, match="even"):
        _engine.rotate_halves(np.zeros((4, 2, 7), np.float32), cos[:, :7], cos[:, :7], np.zeros((4, 2, 7), np.float32))
    with pytest.raises(ValueError, match="whole runs"):
        _engine.rotate_halves(x, np.ones((3, 8), np.float32), np.ones((3, 8), np.float32), x.copy())
    with pytest.raises(ValueError, match="sin"):
        _engine.rotate_halves(x, cos, np.ones((2, 6), np.float32), x.copy())
    with pytest.raises(ValueError, match="out"):
        _engine.rotate_halves(x, cos, cos, np.zeros((4, 2, 9), np.float32))
    with pytest.raises(ValueError, match="contiguous rows"):
        _engine.rotate_halves(np.zeros((4, 2, 16), np.float32)[:, :, ::2], cos, cos, x.copy())


def test_traced_graphs_keep_the_tensor_ops():
    """Under ``torch.jit.trace`` (the vision ONNX export's exporter) the engine is not called: a
    kernel writing through numpy would not be in the graph, whose output would then be the
    traced input's, whatever the input."""
    cos, sin = tables(6, 16, 3)
    first, second = torch.randn(2, 6, 3, 16), torch.randn(2, 6, 3, 16)
    traced = torch.jit.trace(lambda x: rotate(x, cos[:, None], sin[:, None]), first)
    assert torch.equal(traced(second), rotate(second, cos[:, None], sin[:, None]))
