"""The engine's RMSNorm (``_engine.rms_norm``, engine/rms_norm.cpp: what ``layers.rms`` runs on
the CPU) against torch's own ``torch.nn.functional.rms_norm`` in float32 (the op transformers'
``Qwen3RMSNorm.forward`` computes: variance as the mean of squares, ``x * rsqrt(variance +
eps)``, times the weight; transformers/models/qwen3/modeling_qwen3.py), one weight for every row
or one per head, inputs read in place from a fused projection's slice, float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastjudge import _engine
from fastjudge.backends.qwen.layers import rms


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 RMSNorm of x's last dim, a [heads, D] weight broadcast over x's [..., heads, D]."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return normed * weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,heads", [((1, 1, 256), 0), ((3, 5, 64), 0), ((2, 7, 6, 64), 6),
                                         ((4, 33), 0), ((2, 513, 40), 0), ((1, 1, 1), 0)])
def test_matches_torch(dtype, shape, heads):
    """Decoding rows, prompts, per-head weights (Qwen's q/k norms), a dim that is no multiple of
    the vector width: float32 within 1e-6 of torch's op; bfloat16 within one bfloat16 rounding of
    the float32 result (the output rounded once)."""
    gen = torch.Generator().manual_seed(len(shape) * 7 + shape[-1])
    x = torch.randn(*shape, generator=gen).to(dtype)
    weight = torch.rand(*((heads,) if heads else ()), shape[-1], generator=gen) + 0.5
    got = rms(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    want = reference(x, weight, 1e-6)
    err = float((got.float() - want).abs().max() / want.abs().max())
    assert err <= (1e-6 if dtype == torch.float32 else 2 ** -8)


def test_reads_a_slice_in_place():
    """Queries and keys as a slice of a fused projection's output ([B, S, heads, D] with the row
    stride of the whole output): normalised where they lie, the same bits as a contiguous copy."""
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(2, 9, 10 * 32, generator=gen)
    qk = fused[..., :6 * 32].view(2, 9, 6, 32)
    weight = torch.rand(6, 32, generator=gen)
    assert not qk.is_contiguous()
    assert torch.equal(rms(qk, weight, 1e-6), rms(qk.contiguous(), weight, 1e-6))


def test_same_bits_on_any_thread_count():
    x = torch.randn(300, 4, 64).numpy()
    w = torch.rand(4, 64).numpy()
    one = np.empty_like(x)
    _engine.rms_norm(x, w, one, 1e-6, 1)
    for threads in (2, 3, 8):
        many = np.empty_like(x)
        _engine.rms_norm(x, w, many, 1e-6, threads)
        assert np.array_equal(many, one)


def test_refuses_what_it_cannot_take():
    x = np.zeros((4, 2, 8), np.float32)
    w = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="3-D"):
        _engine.rms_norm(np.zeros((4, 8), np.float32), w, np.zeros((4, 8), np.float32), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        _engine.rms_norm(x.astype(np.float64), w, x.copy(), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        _engine.rms_norm(x, np.ones((1, 8), np.float32), x.copy(), 1e-6)
    with pytest.raises(ValueError, match="out"):
        _engine.rms_norm(x, w, np.zeros((4, 2, 9), np.float32), 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        _engine.rms_norm(np.zeros((4, 2, 16), np.float32)[:, :, ::2], w, x.copy(), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 512), (3920, 512), (7, 40)])
def test_t5_form_matches_t5_layer_norm(dtype, rows, dim):
    """``round_first`` (what ``backends.t5.norm.rms_norm`` runs in bfloat16 on the CPU) against
    transformers' ``T5LayerNorm.forward`` (transformers/models/t5/modeling_t5.py: the variance
    of the float32 states, ``x * rsqrt(variance + eps)``, cast to the weight's dtype, times the
    weight): float32 within 1e-6; bfloat16 the same bits but where the two sums of squares, added
    in another order, round apart (at most one output in 10,000, by one bfloat16 step), where
    torch's fused op, which rounds once, differs in about a quarter of them."""
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    from fastjudge.backends.t5.norm import rms_norm

    gen = torch.Generator().manual_seed(rows + dim)
    x = torch.randn(rows, dim, generator=gen).to(dtype)
    norm = T5LayerNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
        want = norm(x)
    weight = norm.weight.detach()
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    engine = torch.empty_like(x)
    _engine.rms_norm(x.view(-1, 1, dim).view(torch.int16).numpy(), weight.float().view(1, dim).numpy(),
                     engine.view(-1, 1, dim).view(torch.int16).numpy(), 1e-6, 2, round_first=True)
    assert torch.equal(engine, got)
    apart = got != want
    assert float(apart.float().mean()) <= 1e-4
    step = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
    assert not apart.any() or float(step[apart].max()) <= 2 ** -7
