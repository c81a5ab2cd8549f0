"""Our gated delta rule (``backends/qwen/gated_delta.py``) against transformers' reference
implementation: ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule`` in
transformers/models/qwen3_5/modeling_qwen3_5.py (transformers 5.x, the version this project
pins for Qwen3.5), on random float32 inputs, to 1e-5 relative error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastjudge.backends.qwen.gated_delta import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_,
    chunk_gated_delta_rule_ops,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_,
    recurrent_gated_delta_rule_ops,
    unit_lower_inverse,
    unit_lower_inverse_blocks,
)

reference = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

TOLERANCE = 1e-5


def inputs(B=2, S=37, Hk=2, Hv=4, dk=16, dv=24, seed=0, state=True):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(query=rand(B, S, Hk, dk), key=rand(B, S, Hk, dk), value=rand(B, S, Hv, dv),
                g=-F.softplus(rand(B, S, Hv)), beta=torch.sigmoid(rand(B, S, Hv)),
                initial_state=rand(B, Hv, dk, dv) if state else None)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    return float((ours - theirs).abs().max() / theirs.abs().max())


def assert_same(ours, theirs, want_state: bool):
    assert relative_error(ours[0], theirs[0]) <= TOLERANCE
    if want_state:
        assert relative_error(ours[1], theirs[1]) <= TOLERANCE
    else:
        assert ours[1] is None and theirs[1] is None


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("S", [1, 37, 64, 100])
@pytest.mark.parametrize("state", [False, True])
def test_chunked_matches_reference(chunk, S, state):
    x = inputs(S=S, state=state, seed=S + chunk)
    for final in (False, True):
        kw = dict(chunk_size=chunk, output_final_state=final, use_qk_l2norm_in_kernel=True)
        ours = chunk_gated_delta_rule(**x, **kw)
        theirs = reference.torch_chunk_gated_delta_rule(**x, **kw)
        assert_same(ours, theirs, final)


@pytest.mark.parametrize("S", [1, 3])
@pytest.mark.parametrize("state", [False, True])
def test_recurrent_matches_reference(S, state):
    x = inputs(S=S, state=state, seed=S)
    for final in (False, True):
        kw = dict(output_final_state=final, use_qk_l2norm_in_kernel=True)
        ours = recurrent_gated_delta_rule(**x, **kw)
        theirs = reference.torch_recurrent_gated_delta_rule(**x, **kw)
        assert_same(ours, theirs, final)


@pytest.mark.parametrize("B,Hk,Hv,dk,dv", [(1, 2, 2, 32, 16), (3, 1, 3, 8, 40), (4, 2, 4, 16, 16)])
def test_head_layouts(B, Hk, Hv, dk, dv):
    """B > 1, grouped value heads, key and value head dims that differ (both ways)."""
    x = inputs(B=B, S=45, Hk=Hk, Hv=Hv, dk=dk, dv=dv, seed=dk + dv)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_same(chunk_gated_delta_rule(**x, chunk_size=16, **kw),
                reference.torch_chunk_gated_delta_rule(**x, chunk_size=16, **kw), True)
    one = {k: (v[:, :1] if k != "initial_state" else v) for k, v in x.items()}
    assert_same(recurrent_gated_delta_rule(**one, **kw),
                reference.torch_recurrent_gated_delta_rule(**one, **kw), True)


def test_without_l2_norm():
    x = inputs(S=20, seed=5)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=False)
    x["query"], x["key"] = x["query"] * 0.1, x["key"] * 0.1  # keep the raw keys' system tame
    assert_same(chunk_gated_delta_rule(**x, chunk_size=16, **kw),
                reference.torch_chunk_gated_delta_rule(**x, chunk_size=16, **kw), True)
    assert_same(recurrent_gated_delta_rule(**x, **kw),
                reference.torch_recurrent_gated_delta_rule(**x, **kw), True)


@pytest.mark.parametrize("rule", ["chunk", "recurrent"])
def test_padded_steps_leave_the_state_unchanged(rule):
    """Rows right-padded with beta = 0, g = 0 steps (the engine's multi-token decoding steps)
    end in the state of their real tokens alone; the real tokens' outputs are untouched."""
    x = inputs(B=3, S=12, seed=7)
    counts = torch.tensor([12, 5, 1])
    real = torch.arange(12)[None, :] < counts[:, None]
    padded = dict(x, g=x["g"] * real[..., None], beta=x["beta"] * real[..., None])
    run = ((lambda **a: chunk_gated_delta_rule(**a, chunk_size=8)) if rule == "chunk"
           else recurrent_gated_delta_rule)
    out, state = run(**padded, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for b, n in enumerate(counts.tolist()):
        row = {k: v[b:b + 1, :n] if k != "initial_state" else v[b:b + 1] for k, v in x.items()}
        alone_out, alone_state = run(**row, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert relative_error(state[b:b + 1], alone_state) <= TOLERANCE
        assert relative_error(out[b:b + 1, :n], alone_out) <= TOLERANCE


def test_chunked_equals_recurrent():
    x = inputs(S=29, seed=3)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_same(chunk_gated_delta_rule(**x, chunk_size=8, **kw), recurrent_gated_delta_rule(**x, **kw), True)


def test_low_precision_inputs_keep_their_dtype():
    x = {k: (v.bfloat16() if k in ("query", "key", "value") else v) for k, v in inputs(S=10).items()}
    out, state = chunk_gated_delta_rule(**x, chunk_size=16, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32


def test_traces_without_graph_breaks():
    """No host read of a tensor value, no data-dependent Python branch: the whole rule traces as
    one graph (the eager backend checks the tracing only, not a compiler's code)."""
    x = inputs(S=21, seed=9)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch._dynamo.reset()
    chunked = torch.compile(chunk_gated_delta_rule, backend="eager", fullgraph=True)
    step = torch.compile(recurrent_gated_delta_rule, backend="eager", fullgraph=True)
    assert_same(chunked(**x, chunk_size=8, **kw), chunk_gated_delta_rule(**x, chunk_size=8, **kw), True)
    one = {k: (v[:, :1] if k != "initial_state" else v) for k, v in x.items()}
    assert_same(step(**one, **kw), recurrent_gated_delta_rule(**one, **kw), True)


STEP_FORMS = {"engine": recurrent_gated_delta_rule_, "ops": recurrent_gated_delta_rule_ops}


@pytest.mark.parametrize("how", sorted(STEP_FORMS))
@pytest.mark.parametrize("S", [1, 2, 3])
@pytest.mark.parametrize("B,Hk,Hv,dk,dv", [(2, 2, 4, 16, 24), (3, 1, 3, 8, 40), (1, 2, 2, 32, 16)])
def test_in_place_recurrent_matches_reference(S, B, Hk, Hv, dk, dv, how):
    """The decoding steps' in-place rule (grouped value heads, the state updated where it lies),
    by the engine (what a CPU state takes) and as tensor ops (elsewhere), against
    ``torch_recurrent_gated_delta_rule`` (transformers/models/qwen3_5/modeling_qwen3_5.py,
    transformers 5.x), which normalises the queries and keys itself; a step with beta = 0 and
    g = 0 (the engine's padding) leaves the state as it was."""
    rule = STEP_FORMS[how]
    x = inputs(B=B, S=S, Hk=Hk, Hv=Hv, dk=dk, dv=dv, seed=10 * S + dv)
    x["beta"][0, -1] = 0.0
    x["g"][0, -1] = 0.0
    out, final = reference.torch_recurrent_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    memory = x["initial_state"].clone()
    q = x["query"] * torch.rsqrt(x["query"].square().sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
    k = x["key"] * torch.rsqrt(x["key"].square().sum(-1, keepdim=True) + 1e-6)
    ours = rule(memory, q, k, x["value"], x["g"], x["beta"])
    assert relative_error(ours, out) <= TOLERANCE
    assert relative_error(memory, final) <= TOLERANCE
    if S > 1:  # row 0's padded last step changed nothing: its state is the one after S - 1 steps
        before = x["initial_state"].clone()
        rule(before, q[:, :-1], k[:, :-1], x["value"][:, :-1], x["g"][:, :-1], x["beta"][:, :-1])
        assert torch.equal(memory[0], before[0])


INVERSES = {"engine": unit_lower_inverse, "blocks": unit_lower_inverse_blocks}


@pytest.mark.parametrize("how", sorted(INVERSES))
@pytest.mark.parametrize("C", [1, 2, 3, 5, 16, 17, 32, 64])
def test_unit_lower_inverse_matches_a_triangular_solve(C, how):
    """The inverse of the chunk's unit lower-triangular system, by the engine's forward
    substitution (what a float32 CPU system takes) and by block inversion (elsewhere), against
    ``torch.linalg.solve_triangular(..., upper=False, unitriangular=True)`` with the identity
    as right-hand side (torch's documented contract: the diagonal and upper triangle of the
    matrix are not read), on batches of random systems shaped as the delta rule builds them
    (|L_ij| <= 1), with garbage on and above the diagonal."""
    gen = torch.Generator().manual_seed(C)
    system = torch.rand(3, 2, C, C, generator=gen) * 2 - 1
    ours = INVERSES[how](system)
    theirs = torch.linalg.solve_triangular(system, torch.eye(C).expand(3, 2, C, C), upper=False,
                                           unitriangular=True)
    assert ours.shape == theirs.shape
    assert relative_error(ours, theirs) <= TOLERANCE
    assert torch.equal(ours.triu(1), torch.zeros_like(ours))
    assert torch.equal(ours.diagonal(0, -2, -1), torch.ones(3, 2, C))


@pytest.mark.parametrize("how", sorted(INVERSES))
def test_unit_lower_inverse_of_repeated_keys_is_exact(how):
    """Identical keys with beta = 1 and no decay give L = all ones below the diagonal, whose
    inverse is ``I`` minus the subdiagonal (each correction cancels the one before): entries of
    powers of L grow like binomial coefficients (C(30, 15) ~ 1.6e8 at C = 32), so a power-series
    inverse would lose everything in float32; neither form may."""
    for C in (8, 32, 64):
        ones = torch.ones(C, C).tril(-1)
        want = torch.eye(C) - torch.diag(torch.ones(C - 1), -1)
        assert torch.equal(INVERSES[how](ones[None]), want[None])


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_chunked_with_repeated_keys_matches_reference(chunk):
    """Near-identical keys and beta near 1 (the worst-conditioned chunk systems) against
    transformers' ``torch_chunk_gated_delta_rule`` (transformers/models/qwen3_5/
    modeling_qwen3_5.py, transformers 5.x)."""
    x = inputs(S=2 * chunk + 7, seed=chunk)
    x["key"] = x["key"][:, :1] + 1e-3 * x["key"]  # every token's key almost the first one's
    x["beta"] = 0.999 + 0.001 * x["beta"]
    x["g"] = 0.01 * x["g"]
    kw = dict(chunk_size=chunk, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_same(chunk_gated_delta_rule(**x, **kw), reference.torch_chunk_gated_delta_rule(**x, **kw), True)


# the layers' in-place chunked rule by the engine (what a CPU state takes; value heads of a
# multiple of 16) and as tensor ops (elsewhere)
CHUNK_FORMS = {"engine": chunk_gated_delta_rule_, "ops": chunk_gated_delta_rule_ops}


@pytest.mark.parametrize("how", sorted(CHUNK_FORMS))
@pytest.mark.parametrize("S,chunk", [(16, 16), (37, 16), (64, 32), (130, 32)])
@pytest.mark.parametrize("fresh", [False, True])
def test_in_place_chunked_matches_reference(S, chunk, fresh, how):
    """The layers' in-place chunked rule (the state updated where it lies, one chunk or several),
    by the engine and as tensor ops, against transformers' ``torch_chunk_gated_delta_rule``
    (transformers/models/qwen3_5/modeling_qwen3_5.py, transformers 5.x). A fresh start does not
    read the state buffer at all: filled with NaN, it still gives the zero-state result."""
    x = inputs(S=S, dv=32, seed=S + chunk, state=not fresh)
    out, final = reference.torch_chunk_gated_delta_rule(**x, chunk_size=chunk, output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
    memory = torch.full_like(final, float("nan")) if fresh else x["initial_state"].clone()
    ours = CHUNK_FORMS[how](memory, x["query"], x["key"], x["value"], x["g"], x["beta"], chunk, fresh=fresh)
    assert relative_error(ours, out) <= TOLERANCE
    assert relative_error(memory, final) <= TOLERANCE


@pytest.mark.parametrize("how", sorted(CHUNK_FORMS))
@pytest.mark.parametrize("fresh", [False, True])
def test_strong_decays_match_reference(fresh, how):
    """Heads that forget fast: log-decays of -5 to -15 a token, so the decays inside a chunk of
    32 fall far below exp(-87), where float32 has only denormals and 0 and the chunked rule
    clamps its exponents (``EXP_FLOOR``). Against transformers' ``torch_chunk_gated_delta_rule``
    (transformers/models/qwen3_5/modeling_qwen3_5.py): the same outputs and final state."""
    from fastjudge.backends.qwen.gated_delta import EXP_FLOOR

    x = inputs(S=64, dv=16, seed=11, state=not fresh)
    x["g"] = -5.0 - 10.0 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(3))
    assert float(x["g"][:, :32].sum(1).min()) < 2 * EXP_FLOOR  # the clamp binds
    out, final = reference.torch_chunk_gated_delta_rule(**x, chunk_size=32, output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
    memory = torch.zeros_like(final) if fresh else x["initial_state"].clone()
    ours = CHUNK_FORMS[how](memory, x["query"], x["key"], x["value"], x["g"], x["beta"], 32, fresh=fresh)
    assert relative_error(ours, out) <= TOLERANCE
    assert relative_error(memory, final) <= TOLERANCE
