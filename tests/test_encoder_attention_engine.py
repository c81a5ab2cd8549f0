"""The engine's attention over encoder states that are both keys and values
(``engine/encoder_attention.cpp``, ``_engine.encoder_attention``): what T5's reassociated
cross-attention runs on the CPU (``backends/t5/model.py: T5Block.cross_attention``).

The reference is the softmax attention transformers' ``T5Attention.forward``
(transformers/models/t5/modeling_t5.py) computes for cross-attention, ``softmax(q k^T + mask) v``
with T5's scale of 1, here with the keys and values the states themselves (the reassociated
form, whose equality with per-head K/V ``tests/test_t5_decode.py`` checks), in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastjudge import _engine
from fastjudge.backends.cpu_engine import attend_over_states, engine_array


def reference(q: torch.Tensor, states: torch.Tensor, lengths: list[int], scale: float) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lengths):
        if n:
            s = states[b, :n].double()
            out[b] = torch.softmax(scale * q[b].double() @ s.T, dim=-1) @ s
    return out


def inputs(B: int, R: int, L: int, dim: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, R, dim, generator=g) / dim ** 0.25).to(dtype)
    states = (torch.randn(B, L, dim, generator=g) / dim ** 0.25).to(dtype)
    return q, states


@pytest.mark.parametrize("R", [1, 6, 17, 24])
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_float32_against_reference(R, scale):
    """Rows of 1 to 200 states (one block of keys and several, a last block of 1 to 3 keys), 1 to
    24 query rows (a group of 16 and a second), the states past each row's length poisoned with
    NaN: within float32 rounding of the float64 reference."""
    lengths = [1, 3, 63, 64, 65, 200]
    q, states = inputs(len(lengths), R, 200, 64)
    for b, n in enumerate(lengths):
        states[b, n:] = float("nan")
    got = attend_over_states(q, states, torch.tensor(lengths), scale)
    torch.testing.assert_close(got.double(), reference(q, states, lengths, scale), rtol=1e-5, atol=1e-6)


def test_large_scores_and_a_growing_maximum():
    """Scores in the hundreds that rise block after block (each block's maximum above the last,
    so the running sums are rescaled at every block): the online softmax stays within float32
    rounding of the reference."""
    q, states = inputs(2, 6, 300, 32)
    ramp = torch.linspace(0.0, 4.0, 300)[None, :, None]
    states = states + ramp
    q = q.abs() * 8
    got = attend_over_states(q, states, torch.tensor([300, 250]), 1.0)
    torch.testing.assert_close(got.double(), reference(q, states, [300, 250], 1.0), rtol=1e-5, atol=1e-5)


def test_bfloat16_within_its_rounding():
    """bfloat16 inputs (arithmetic in float32, the output rounded once): within bfloat16 rounding
    of the float64 reference on the same bfloat16 values."""
    lengths = [5, 70, 130]
    q, states = inputs(3, 6, 130, 64, torch.bfloat16)
    got = attend_over_states(q, states, torch.tensor(lengths), 1.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), reference(q, states, lengths, 1.0), rtol=1e-2, atol=4e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_states_and_threads_give_the_same_bits(dtype):
    """States read in place from a slice of a larger buffer (the pool's ``mem[:B, :L]``) give the
    bits of a contiguous copy; 1, 2 and 4 threads, the rows in either order, give the same
    bits."""
    q, pool = inputs(5, 6, 160, 64, dtype)
    states, lengths = pool[:, :100], torch.tensor([100, 1, 37, 64, 99])
    assert not states.is_contiguous()
    want = attend_over_states(q, states.contiguous(), lengths, 1.0)
    for threads in (1, 2, 4):
        for reverse in (False, True):
            out = torch.empty_like(q)
            _engine.encoder_attention(engine_array(q.unsqueeze(2)), engine_array(states.unsqueeze(2)),
                                      lengths.numpy(), engine_array(out), 1.0, reverse=reverse, threads=threads)
            assert torch.equal(out, want)


def test_a_row_with_no_states_gets_zeros():
    q, states = inputs(2, 6, 8, 16)
    got = attend_over_states(q, states, torch.tensor([0, 8]), 1.0)
    assert torch.equal(got[0], torch.zeros(6, 16))
    torch.testing.assert_close(got[1].double(), reference(q[1:], states[1:], [8], 1.0)[0], rtol=1e-5, atol=1e-6)


def test_refusals():
    """Arrays it refuses, before writing anything."""
    q, states = inputs(2, 6, 8, 16)
    out = torch.full_like(q, 7.0)

    def call(q=q, states=states, lengths=None, out=out, scale=1.0):
        lengths = np.array([8, 8]) if lengths is None else lengths
        _engine.encoder_attention(engine_array(q.unsqueeze(2)), engine_array(states.unsqueeze(2)), lengths,
                                  engine_array(out), scale)

    with pytest.raises(ValueError, match="lengths must lie"):
        call(lengths=np.array([9, 8]))
    with pytest.raises(ValueError, match="one entry per row"):
        call(lengths=np.array([8]))
    with pytest.raises(ValueError, match="multiple of 16"):
        q2, s2 = inputs(2, 6, 8, 24)
        call(q=q2, states=s2, out=torch.empty_like(q2))
    with pytest.raises(ValueError, match="states must be"):
        call(states=states.bfloat16())
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.empty(2, 5, 16))
    with pytest.raises(ValueError, match="scale must be positive"):
        call(scale=0.0)
    assert torch.equal(out, torch.full_like(q, 7.0))
