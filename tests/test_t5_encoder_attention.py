"""T5's encoder self-attention on the CPU engine: every query of a sequence over all of its keys,
with the relative position bias added by distance (``_engine.causal_attention`` with a bias
outside the few-token path), against transformers' ``T5Attention`` and against the tensor ops'
SDPA path of the same model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastjudge import _engine
from fastjudge.backends.cpu_engine import attend_all_in_engine
from fastjudge.backends.t5 import model as t5_model
from fastjudge.backends.t5.backend import TorchT5Backend


def t5_bias(table: torch.Tensor, n: int, bidirectional: bool) -> torch.Tensor:
    """transformers' ``T5Attention.compute_bias`` (transformers/models/t5/modeling_t5.py) of a
    bias ``table`` [buckets, heads]: [heads, n, n]."""
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    buckets, heads = table.shape
    config = T5Config(d_model=16, d_kv=4, num_heads=heads, relative_attention_num_buckets=buckets,
                      relative_attention_max_distance=64, is_decoder=not bidirectional)
    attention = T5Attention(config, has_relative_attention_bias=True)
    with torch.no_grad():
        attention.relative_attention_bias.weight.copy_(table)
        return attention.compute_bias(n, n)[0].float()


def reference(q, k, v, bias, visible) -> torch.Tensor:
    """Float64 softmax attention of q [S, H, dim] over k, v [W, H, dim] with bias [H, S, W],
    query t over keys j < visible[t] (none past them read)."""
    out = []
    for t, n in enumerate(visible):
        scores = torch.einsum("hd,jhd->hj", q[t].double(), k[:n].double()) + bias[:, t, :n].double()
        out.append(torch.einsum("hj,jhd->hd", torch.softmax(scores, -1), v[:n].double()))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,H,dim", [(1, 2, 16), (5, 2, 16), (17, 3, 64), (70, 6, 64), (130, 2, 32)])
def test_every_query_sees_every_key_with_the_bias(dtype, n, H, dim, bf16_form):
    """``attend_all_in_engine`` (one row whose queries come after its keys) against the float64
    attention with ``T5Attention.compute_bias``'s bidirectional bias."""
    g = torch.Generator().manual_seed(n)
    table = torch.randn(32, H, generator=g)
    full = t5_bias(table, n, bidirectional=True)  # [H, n, n]
    # by distance: column n - 1 + t - j holds query t's bias on key j
    by_distance = torch.cat([full[:, 0, 1:].flip(-1), full[:, :, 0]], dim=1).contiguous()
    qkv = torch.randn(n, 3, H, dim, generator=g).to(dtype)
    out = torch.empty(n, H, dim, dtype=dtype)
    attend_all_in_engine(*(qkv[:, i].unsqueeze(0) for i in range(3)), out.unsqueeze(0), 1.0, by_distance)
    want = reference(qkv[:, 0], qkv[:, 1], qkv[:, 2], full, [n] * n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_new_tokens_after_cached_keys_take_the_bias(dtype, bf16_form):
    """More new tokens a row than the few-token path takes (the packing path), after cached keys,
    with the decoder's causal bias by distance: each query sees its keys up to its own position,
    keys past a row's last poisoned with NaN."""
    g = torch.Generator().manual_seed(1)
    B, S, W, H, dim = 3, 19, 90, 2, 16
    table = torch.randn(32, H, generator=g)
    causal = t5_bias(table, W, bidirectional=False)  # [H, W, W]: query position i, key j
    by_distance = causal[:, :, 0].contiguous()  # a key i positions back
    q, k, v = (torch.randn(B, m, H, dim, generator=g).to(dtype) for m in (S, W, W))
    offsets, counts = torch.tensor([0, 30, W - S]), torch.tensor([S, 7, 12])
    for b in range(B):
        k[b, offsets[b] + counts[b]:] = float("nan")
        v[b, offsets[b] + counts[b]:] = float("nan")
    out = torch.empty(B, S, H, dim, dtype=dtype)
    arrays = [a.view(torch.int16).numpy() if dtype == torch.bfloat16 else a.numpy() for a in (q, k, v, out)]
    _engine.causal_attention(*arrays, 1.0, offsets=offsets.numpy(), counts=counts.numpy(),
                             bias=by_distance.numpy(), threads=2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(B):
        o, c = int(offsets[b]), int(counts[b])
        visible = [o + t + 1 for t in range(c)]
        want = reference(q[b, :c], k[b], v[b], causal[:, o:o + c, :], visible)
        torch.testing.assert_close(out[b, :c].double(), want, atol=tol, rtol=tol)
        assert torch.all(out[b, c:] == 0)


def test_a_bias_needs_a_distance_for_every_query_position():
    q = np.zeros((1, 5, 2, 16), np.float32)
    kv = np.zeros((1, 10, 2, 16), np.float32)
    out = np.zeros_like(q)
    with pytest.raises(ValueError, match="bias"):  # offset 7 + 5 tokens: 12 distances, 10 given
        _engine.causal_attention(q, kv, kv, out, 1.0, offsets=np.array([7]), bias=np.zeros((2, 10), np.float32))
    with pytest.raises(ValueError, match="bias"):  # no offsets
        _engine.causal_attention(q, kv[:, :5], kv[:, :5], out, 1.0, bias=np.zeros((2, 10), np.float32))
    _engine.causal_attention(q, kv, kv, out, 1.0, offsets=np.array([5]), bias=np.zeros((2, 10), np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_encoder_on_the_engine_matches_its_tensor_ops(t5_dir, dtype, monkeypatch):
    """The model's encoder over a pack of sequences of different lengths (each reads its own
    columns of the longest one's bias by distance) on the engine, against the same model's
    tensor ops (SDPA with ``encoder_bias``'s mask), and the bias by distance against that mask."""
    model = TorchT5Backend(t5_dir, device="cpu", dtype=dtype).model
    rng = np.random.default_rng(0)
    lengths = [23, 1, 64, 9, 64]
    ids = torch.tensor(rng.integers(5, model.embed.shape[0], size=sum(lengths)))
    longest = max(lengths)
    full, by_distance = model.encoder_bias(longest).float(), model.encoder_bias_by_distance(longest)
    t, j = torch.meshgrid(torch.arange(longest), torch.arange(longest), indexing="ij")
    assert torch.equal(by_distance[:, longest - 1 + t - j], full)
    with torch.inference_mode():
        engine = model.encode(ids, lengths)
        monkeypatch.setattr(t5_model, "engine_attends", lambda q, k: False)
        tensor_ops = model.encode(ids, lengths)
    tol = 1e-5 if dtype == "float32" else 3e-2
    torch.testing.assert_close(engine.float(), tensor_ops.float(), atol=tol, rtol=tol)
