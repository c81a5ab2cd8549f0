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
from fastjudge.backends.cpu_engine import engine_array


def attend_over_states(q: torch.Tensor, states: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    _engine.encoder_attention(engine_array(q.unsqueeze(2)), engine_array(states.unsqueeze(2)), lengths.numpy(),
                              engine_array(out), scale, threads=torch.get_num_threads())
    return out


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


def test_bfloat16_within_its_rounding(bf16_form):
    """bfloat16 inputs, each form (float32 arithmetic, or bfloat16 dot products with the softmax
    weights rounded to bfloat16 before the weighted sum), the output rounded once: within
    bfloat16 rounding of the float64 reference on the same bfloat16 values."""
    lengths = [5, 70, 130]
    q, states = inputs(3, 6, 130, 64, torch.bfloat16)
    got = attend_over_states(q, states, torch.tensor(lengths), 1.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), reference(q, states, lengths, 1.0), rtol=1e-2, atol=4e-3)


@pytest.mark.parametrize("R", [1, 4, 6, 12, 17])
@pytest.mark.parametrize("dim", [64, 96, 48])
def test_bfloat16_dot_products_against_reference(bf16_form, R, dim):
    """The dot-product kernel's cases: query rows in register blocks of six (6, 12) and of four
    (1, 4, and 17: a group of 16 and one more), dims of whole 64-wide tiles and a 32-wide tail (96),
    and 48 (not a multiple of 32: the float32 path), rows of 1 to 200 states (a last block of an
    odd count, its last pair half zero), the states past each row's length poisoned with NaN
    (never read): within bfloat16 rounding of the float64 reference."""
    lengths = [1, 3, 63, 64, 65, 200]
    q, states = inputs(len(lengths), R, 200, dim, torch.bfloat16, seed=R)
    for b, n in enumerate(lengths):
        states[b, n:] = float("nan")
    got = attend_over_states(q, states, torch.tensor(lengths), 0.5)
    torch.testing.assert_close(got.double(), reference(q, states, lengths, 0.5), rtol=1e-2, atol=4e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_states_and_threads_give_the_same_bits(dtype, bf16_form):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,R", [(1, 6), (1, 5), (2, 12), (3, 4)])
def test_fewer_rows_than_threads_split_their_queries_with_the_same_bits(dtype, B, R, bf16_form):
    """Rows fewer than the threads (a one-row decoding step over a long prompt): each row's query
    rows are split among the threads, each group reading the row's states itself; every query
    keeps the bits it has on one thread, and the reference's values."""
    q, states = inputs(B, R, 1200, 512, dtype)  # model space: work enough for several threads
    lengths = torch.tensor([1200, 777, 1100][:B])
    outs = []
    for threads in (1, 2, 4):
        out = torch.empty_like(q)
        _engine.encoder_attention(engine_array(q.unsqueeze(2)), engine_array(states.unsqueeze(2)), lengths.numpy(),
                                  engine_array(out), 1.0, threads=threads)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = reference(q, states, lengths.tolist(), 1.0)
    torch.testing.assert_close(outs[0].double(), want, rtol=tol, atol=tol)


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


def reassociated_reference(xq, w_k, w_v, states, lengths):
    """transformers' T5 cross-attention per head over K = m W_k^T, V = m W_v^T (float64)."""
    B, P, H, dk = xq.shape
    out = torch.zeros(B, P, H, dk, dtype=torch.float64)
    for b, n in enumerate(lengths):
        m = states[b, :n].double()
        for h in range(H):
            k, v = m @ w_k[h].double().T, m @ w_v[h].double().T  # [n, dk]
            out[b, :, h] = torch.softmax(xq[b, :, h].double() @ k.T, dim=-1) @ v
    return out


@pytest.mark.parametrize("P,dk", [(1, 64), (3, 64), (1, 10)])
def test_reassociated_attention_against_per_head_kv(P, dk):
    """``_engine.reassociated_attention`` (``cpu_engine.attend_reassociated``: the maps into and
    out of model space around the attention, one call) against per-head attention over projected
    K/V, as transformers' ``T5Attention.forward`` computes it: 5 rows (a block of four and one),
    1 and 3 positions, d_kv a multiple of four and not, states past each row's length poisoned
    with NaN; within float32 rounding."""
    from fastjudge.backends.cpu_engine import attend_reassociated

    g = torch.Generator().manual_seed(3)
    B, H, d, lengths = 5, 6, 48, [9, 1, 70, 64, 33]
    xq = torch.randn(B, P, H, dk, generator=g)
    w_k, w_v = torch.randn(H, dk, d, generator=g) / d ** 0.5, torch.randn(H, dk, d, generator=g) / d ** 0.5
    states = torch.randn(B, 70, d, generator=g)
    for b, n in enumerate(lengths):
        states[b, n:] = float("nan")
    got = attend_reassociated(xq, w_k, w_v, states, torch.tensor(lengths))
    torch.testing.assert_close(got.double(), reassociated_reference(xq, w_k, w_v, states, lengths),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(attend_reassociated(xq, w_k, w_v, states, torch.tensor(lengths), reverse=True), got)


def transformers_bfloat16(xq, w_k, w_v, states, lengths):
    """What transformers' ``T5Attention.forward`` computes for a bfloat16 model's cross-attention
    (transformers/models/t5/modeling_t5.py): K and V projected and rounded to bfloat16, the scores
    a bfloat16 product, the softmax in float32 rounded back to bfloat16, the weighted sum a
    bfloat16 product."""
    B, P, H, dk = xq.shape
    out = torch.zeros(B, P, H, dk, dtype=torch.float64)
    for b, n in enumerate(lengths):
        m = states[b, :n]
        for h in range(H):
            k, v = m @ w_k[h].T, m @ w_v[h].T
            weights = torch.softmax((xq[b, :, h] @ k.T).float(), dim=-1).to(torch.bfloat16)
            out[b, :, h] = (weights @ v).double()
    return out


def test_reassociated_attention_bfloat16_and_threads(bf16_form):
    """bfloat16 (queries and contexts held in float32 between the steps, the output rounded
    once): 1, 2 and 4 threads give the same bits. In float32 arithmetic, within bfloat16 rounding
    of the float64 reference on the same values; with bfloat16 dot products (the queries in
    model space and the softmax weights rounded to bfloat16), no farther from it, at most or on
    average, than transformers' own bfloat16 cross-attention (:func:`transformers_bfloat16`),
    which rounds the projected K and V and the scores instead."""
    g = torch.Generator().manual_seed(4)
    B, P, H, dk, d, lengths = 6, 1, 6, 64, 64, [3, 130, 64, 65, 1, 100]
    xq = torch.randn(B, P, H, dk, generator=g).bfloat16()
    w_k = (torch.randn(H, dk, d, generator=g) / d ** 0.5).bfloat16()
    w_v = (torch.randn(H, dk, d, generator=g) / d ** 0.5).bfloat16()
    states = torch.randn(B, 130, d, generator=g).bfloat16()
    outs = []
    for threads in (1, 2, 4):
        out = torch.empty_like(xq)
        _engine.reassociated_attention(engine_array(xq), engine_array(w_k), engine_array(w_v),
                                       engine_array(states.unsqueeze(2)), np.array(lengths), engine_array(out), 1.0,
                                       threads=threads)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
    exact = reassociated_reference(xq, w_k, w_v, states, lengths)
    if not bf16_form:
        torch.testing.assert_close(outs[0].double(), exact, rtol=1e-2, atol=1e-2)
        return
    ours = (outs[0].double() - exact).abs()
    theirs = (transformers_bfloat16(xq, w_k, w_v, states, lengths) - exact).abs()
    assert ours.max() <= theirs.max() and ours.mean() <= theirs.mean()


def test_reassociated_attention_refusals():
    """Weights of another shape, a layout it cannot read in place, mixed dtypes: refused before
    anything is written."""
    xq, w = torch.randn(2, 1, 6, 8), torch.randn(6, 8, 16)
    states, out = torch.randn(2, 4, 16), torch.full((2, 1, 6, 8), 7.0)

    def call(xq=xq, w_k=w, w_v=w, states=states, out=out):
        _engine.reassociated_attention(engine_array(xq), engine_array(w_k), engine_array(w_v),
                                       engine_array(states.unsqueeze(2)), np.array([4, 4]), engine_array(out), 1.0)

    with pytest.raises(ValueError, match="w_k must be"):
        call(w_k=torch.randn(6, 8, 32))
    with pytest.raises(ValueError, match="w_v must be"):
        call(w_v=w.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="states must be"):
        call(states=states.bfloat16())
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.empty(2, 1, 6, 4))
    assert torch.equal(out, torch.full((2, 1, 6, 8), 7.0))


def test_key_weight_pairs_made_once_give_the_bits_made_in_the_call():
    """``_engine.pair_key_weights`` (what the engine's T5 step makes once when it binds a bfloat16
    model): w_k's consecutive d_kv rows paired in 32-bit words, row 2i's bits in the low half;
    given to ``reassociated_attention`` they give the bits of the pairs it makes itself, over
    rows in blocks of four and one and a 32-wide column tail (dim 96). Refused for an odd d_kv,
    a dim not a multiple of 32 and float32 weights."""
    if not _engine.bf16_dot_products():
        pytest.skip("this CPU has no AVX512-BF16")
    g = torch.Generator().manual_seed(5)
    B, H, dk, d, lengths = 5, 6, 64, 96, [9, 1, 70, 64, 33]
    w_k = (torch.randn(H, dk, d, generator=g) / d ** 0.5).bfloat16()
    w_v = (torch.randn(H, dk, d, generator=g) / d ** 0.5).bfloat16()
    pairs = _engine.pair_key_weights(engine_array(w_k))
    bits = engine_array(w_k).view(np.uint16)
    assert pairs.shape == (H, dk // 2, d) and pairs.dtype == np.uint32
    assert np.array_equal(pairs & 0xFFFF, bits[:, 0::2]) and np.array_equal(pairs >> 16, bits[:, 1::2])
    xq = torch.randn(B, 1, H, dk, generator=g).bfloat16()
    states = torch.randn(B, 70, d, generator=g).bfloat16()
    outs = []
    for given in (None, pairs):
        out = torch.empty_like(xq)
        _engine.reassociated_attention(engine_array(xq), engine_array(w_k), engine_array(w_v),
                                       engine_array(states.unsqueeze(2)), np.array(lengths), engine_array(out), 1.0,
                                       threads=2, w_k_pairs=given)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].double(), reassociated_reference(xq, w_k, w_v, states, lengths),
                               rtol=5e-2, atol=5e-2)
    for bad in (torch.zeros(H, 5, d), torch.zeros(H, dk, 48)):
        with pytest.raises(ValueError, match="pairs need"):
            _engine.pair_key_weights(engine_array(bad.bfloat16()))
    with pytest.raises(ValueError, match="w_k must be"):
        _engine.pair_key_weights(engine_array(w_k.float()))
