"""The engine's chunked gated delta rule (``_engine.chunked_delta_rule``, engine/chunked_delta_rule.cpp:
what a prompt's DeltaNet layers run on the CPU) against transformers' reference,
``torch_chunk_gated_delta_rule`` in transformers/models/qwen3_5/modeling_qwen3_5.py (transformers
5.x), and against its own contract: strided inputs read in place, the same bits on any number of
threads, padding steps that leave the state alone, and every refused array."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastjudge import _engine
from fastjudge.backends.qwen.gated_delta import EXP_FLOOR, L2_EPS, chunk_gated_delta_rule_

reference = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

TOLERANCE = 1e-5


def inputs(B=2, S=70, Hk=2, Hv=4, dk=24, dv=32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(query=rand(B, S, Hk, dk), key=rand(B, S, Hk, dk), value=rand(B, S, Hv, dv),
                g=-F.softplus(rand(B, S, Hv)), beta=torch.sigmoid(rand(B, S, Hv)),
                initial_state=rand(B, Hv, dk, dv))


def engine(x, chunk, fresh=False, normalise=True, threads=2, memory=None, **views):
    """The engine's rule on ``x`` (the start state copied unless ``memory`` is given); ``views``
    replace query, key or value by other arrays of the same values."""
    memory = x["initial_state"].clone() if memory is None else memory
    arrays = {name: views.get(name, x[name]) for name in ("query", "key", "value")}
    out = torch.empty_like(x["value"])
    _engine.chunked_delta_rule(memory.numpy(), *(a.numpy() for a in arrays.values()), x["g"].numpy(),
                               x["beta"].numpy(), out.numpy(), chunk, fresh, normalise, L2_EPS, EXP_FLOOR, threads)
    return out, memory


def theirs(x, fresh=False, normalise=True):
    state = None if fresh else x["initial_state"]
    args = {k: v for k, v in x.items() if k != "initial_state"}
    return reference.torch_chunk_gated_delta_rule(**args, initial_state=state, chunk_size=64, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=normalise)


def relative_error(ours: torch.Tensor, want: torch.Tensor) -> float:
    return float((ours - want).abs().max() / want.abs().max())


def assert_close(ours, want):
    assert relative_error(ours[0], want[0]) <= TOLERANCE
    assert relative_error(ours[1], want[1]) <= TOLERANCE


@pytest.mark.parametrize("chunk", [1, 7, 16, 32, 64, 256])
@pytest.mark.parametrize("S", [1, 5, 64, 200])
@pytest.mark.parametrize("fresh", [False, True])
def test_matches_reference(chunk, S, fresh):
    """Any chunk size gives the reference's result (its own chunks are 64 tokens): one chunk,
    several, a last chunk cut short; grouped value heads; a key head size that is not a multiple
    of the vector width. A fresh start reads nothing of the state buffer (NaN there changes
    nothing)."""
    x = inputs(S=S, seed=S + chunk)
    memory = torch.full_like(x["initial_state"], float("nan")) if fresh else None
    assert_close(engine(x, chunk, fresh=fresh, memory=memory), theirs(x, fresh=fresh))


@pytest.mark.parametrize("B,Hk,Hv,dk,dv", [(1, 1, 1, 8, 16), (3, 1, 3, 40, 16), (2, 2, 2, 64, 64),
                                            (1, 2, 4, 128, 128), (2, 4, 8, 16, 80)])
def test_head_layouts(B, Hk, Hv, dk, dv):
    """One head, grouped value heads, key and value sizes that differ both ways, column blocks of
    more than 64 values (80, 128)."""
    x = inputs(B=B, S=45, Hk=Hk, Hv=Hv, dk=dk, dv=dv, seed=dk + dv)
    assert_close(engine(x, 16), theirs(x))


def test_without_l2_norm():
    x = inputs(S=40, seed=5)
    x["query"], x["key"] = x["query"] * 0.1, x["key"] * 0.1  # keep the raw keys' system tame
    assert_close(engine(x, 16, normalise=False), theirs(x, normalise=False))


def test_repeated_keys_and_strong_decays():
    """The worst-conditioned chunk systems (keys all near the first one, beta near 1) and heads
    that forget fast (decays far below exp(-87) inside a chunk, where the exponents are clamped),
    against the reference."""
    x = inputs(S=100, seed=4)
    x["key"] = x["key"][:, :1] + 1e-3 * x["key"]
    x["beta"] = 0.999 + 0.001 * x["beta"]
    x["g"] = 0.01 * x["g"]
    assert_close(engine(x, 32), theirs(x))
    y = inputs(S=64, seed=11)
    y["g"] = -5.0 - 10.0 * torch.rand(y["g"].shape, generator=torch.Generator().manual_seed(3))
    assert_close(engine(y, 32), theirs(y))


def test_subnormals_flushed_inside_the_engine_only():
    """Heads that forget fast put the rule's products in the subnormal range, which the engine
    flushes to zero (engine/cpu_parallel.hpp: FlushSubnormals, set for each range of
    parallel_ranges: x86 takes a microcode assist for every subnormal operand). The outputs stay
    within tolerance of the reference, which keeps subnormals; and afterwards this thread and
    torch's worker threads keep them again: MXCSR is restored wherever the engine ran."""
    x = inputs(S=128, seed=5)
    x["g"] = -40.0 - 40.0 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(6))
    for threads in (1, 2):
        assert_close(engine(x, 64, threads=threads), theirs(x))
        tiny = torch.full((1 << 20,), 2e-38)  # large enough that torch splits it over its threads
        assert bool(((tiny / 4) != 0).all())
        assert float(torch.tensor(2e-38) * 0.25) > 0.0


def test_padding_steps_leave_the_state_alone():
    """Rows right-padded with beta = 0, g = 0 steps (what the layers give padding tokens) end in
    the state of their real tokens alone, and the real tokens' outputs are theirs alone."""
    x = inputs(B=3, S=50, seed=7)
    counts = [50, 33, 1]
    real = torch.arange(50)[None, :] < torch.tensor(counts)[:, None]
    padded = dict(x, g=x["g"] * real[..., None], beta=x["beta"] * real[..., None])
    out, state = engine(padded, 16)
    for b, n in enumerate(counts):
        row = {k: (v[b:b + 1, :n] if k != "initial_state" else v[b:b + 1]).contiguous() for k, v in x.items()}
        alone_out, alone_state = engine(row, 16)
        assert relative_error(state[b:b + 1], alone_state) <= TOLERANCE
        assert relative_error(out[b:b + 1, :n], alone_out) <= TOLERANCE


def test_reads_strided_views_in_place():
    """Queries, keys and values as the layers hand them over (views into one [B, S, C] tensor of
    the conv's output) give the same bits as contiguous copies."""
    x = inputs(S=40, seed=2)
    B, S, Hk, dk = x["query"].shape
    Hv, dv = x["value"].shape[2:]
    fused = torch.cat([x["query"].flatten(2), x["key"].flatten(2), x["value"].flatten(2)], dim=-1)
    q, k, v = fused.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    views = dict(query=q.view(B, S, Hk, dk), key=k.view(B, S, Hk, dk), value=v.view(B, S, Hv, dv))
    assert not views["value"].is_contiguous()
    want = engine(x, 16)
    got = engine(x, 16, **views)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_same_bits_on_any_thread_count():
    x = inputs(B=3, S=90, Hk=2, Hv=4, dk=32, dv=32, seed=8)
    one = engine(x, 32, threads=1)
    for threads in (2, 3, 8):
        many = engine(x, 32, threads=threads)
        assert torch.equal(many[0], one[0]) and torch.equal(many[1], one[1])


def test_the_layers_rule_runs_the_engine_on_the_cpu():
    """``chunk_gated_delta_rule_`` on a CPU state takes the engine: the same bits as a direct call."""
    x = inputs(S=70, seed=9)
    memory = x["initial_state"].clone()
    out = chunk_gated_delta_rule_(memory, x["query"], x["key"], x["value"], x["g"], x["beta"], 32, fresh=False)
    want = engine(x, 32, threads=torch.get_num_threads())
    assert torch.equal(out, want[0]) and torch.equal(memory, want[1])


def test_refuses_what_it_cannot_take():
    x = inputs(S=8, seed=1)
    with pytest.raises(ValueError, match="multiple of 16"):
        engine(dict(x, value=x["value"][..., :24].contiguous(),
                    initial_state=x["initial_state"][..., :24].contiguous()), 8)
    for chunk in (0, _engine.chunked_delta_rule_max_chunk + 1):
        with pytest.raises(ValueError, match="chunk"):
            engine(x, chunk)
    with pytest.raises(ValueError, match="value heads"):
        engine(dict(x, value=x["value"][:, :, :3].contiguous(), g=x["g"][..., :3].contiguous(),
                    beta=x["beta"][..., :3].contiguous(), initial_state=x["initial_state"][:, :3].contiguous()), 8)
    with pytest.raises(ValueError, match="memory"):
        engine(x, 8, memory=x["initial_state"][:1].clone())
    with pytest.raises(ValueError, match="g must"):
        engine(dict(x, g=x["g"].transpose(0, 1).contiguous().transpose(0, 1)), 8)
    with pytest.raises(ValueError, match="query"):
        engine(x, 8, query=x["query"][..., ::2].contiguous())
    with pytest.raises(ValueError, match="out"):
        _engine.chunked_delta_rule(x["initial_state"].clone().numpy(), x["query"].numpy(), x["key"].numpy(),
                                   x["value"].numpy(), x["g"].numpy(), x["beta"].numpy(),
                                   np.empty((1,), np.float32), 8, False, True, L2_EPS, EXP_FLOOR, 1)
