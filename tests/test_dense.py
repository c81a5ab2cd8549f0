"""``backends.dense``: every GEMM path it chooses computes ``F.linear``'s product, exactly in
float32 (1e-5 of the output's largest value) and to bfloat16 rounding in bfloat16; the FP8 path
is the one ``Fp8Weight`` runs; ``state_dict``, ``load_state_dict`` and ``.to()`` keep working.

The reference is ``torch.nn.functional.linear`` itself (``y = x @ W.T``, torch 2.13.0): the
float32 path is the engine's ``dense_product`` on panel-packed weights; the bfloat16 path is
oneDNN's ``mkldnn._linear_pointwise`` on a ``mkldnn._reorder_linear_weight`` weight, the pair
that inductor's CPU weight prepacking emits (torch/_inductor/fx_passes/mkldnn_fusion.py, v2.13.0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastjudge import _engine
from fastjudge.backends import dense
from fastjudge.backends.dense import Dense, prepare_dense
from fastjudge.backends.fp8 import Fp8Weight, e4m3_scale, fp8_linear, quantize_e4m3

ROWS = (1, 7, 64, 513)
SHAPES = ((1152, 512), (48, 64), (512, 1152))  # [out, in]
PACKS = dense.packing_available()
# oneDNN's bfloat16 reorder needs AVX-512 (or AVX-NE-CONVERT): without it bfloat16 weights are not packed
PACKS_BF16 = dense.packing_available(torch.bfloat16)
BF16_ENGINE = _engine.bf16_dense_available()  # AVX512-BF16: bfloat16 weights get the engine's panels too


def expected_path(engine: bool, packs: bool) -> str:
    """The copies ``Dense.prepare`` should report: the engine's panels and/or oneDNN's, or none."""
    return "+".join([name for name, has in (("engine", engine), ("onednn-packed", packs)) if has]) or "linear"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max()).item()


def prepared(weight: torch.Tensor) -> Dense:
    d = Dense(weight)
    d.prepare()
    return d


@pytest.mark.parametrize("out_in", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_float32_matches_linear(out_in, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_in, generator=g) / out_in[1] ** 0.5
    x = torch.randn(rows, out_in[1], generator=g)
    d = prepared(w)
    big = w.numel() >= dense.PACK_MANY_ROWS_MIN_ELEMENTS and PACKS
    assert d.path == ("engine+onednn-packed" if big else "engine")
    with torch.no_grad():
        y = d(x)
    assert y.shape == (rows, out_in[0]) and y.dtype == torch.float32
    assert rel_err(y, F.linear(x, w)) <= 1e-5


@pytest.mark.skipif(not PACKS_BF16, reason="oneDNN packs no bfloat16 weight on this CPU")
def test_mid_size_weights_take_the_packed_gemm_for_many_rows():
    """A 256 x 256 bfloat16 weight (below PACK_MIN_ELEMENTS) is packed, but runs F.linear itself
    at a decode step's few rows and the packed GEMM from MANY_ROWS rows on."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(256, 256, generator=g) / 16).bfloat16()
    d = prepared(w)
    assert d.path == ("engine+onednn-packed" if BF16_ENGINE else "onednn-packed")
    with torch.no_grad():
        for rows in (1, 16, dense.MANY_ROWS - 1):
            x = torch.randn(rows, 256, generator=g).bfloat16()
            if rows > dense.ENGINE_MAX_ROWS[torch.bfloat16] or not BF16_ENGINE:
                assert torch.equal(d(x), F.linear(x, w))
            else:
                assert rel_err(d(x), F.linear(x, w)) <= 2 ** -8
        for rows in (dense.MANY_ROWS, 600):
            x = torch.randn(2, rows // 2, 256, generator=g).bfloat16()  # rows counted over every leading dim
            assert torch.equal(d(x), dense.packed_linear(x, d._packed))
            assert rel_err(d(x), F.linear(x, w)) <= 2 ** -8


@pytest.mark.parametrize("rows", ROWS)
def test_bfloat16_within_rounding(rows):
    g = torch.Generator().manual_seed(100 + rows)
    w = (torch.randn(1152, 512, generator=g) / 512 ** 0.5).bfloat16()
    x = torch.randn(rows, 512, generator=g).bfloat16()
    d = prepared(w)
    with torch.no_grad():
        y = d(x)
    assert y.dtype == torch.bfloat16
    # two bfloat16 GEMMs may round the float32 sum differently: within one bfloat16 step
    # (2**-8 relative) of the output's largest value
    assert rel_err(y, F.linear(x, w)) <= 2 ** -8
    assert rel_err(y, F.linear(x.float(), w.float())) <= 2 ** -7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", (1, 16, 300))
@pytest.mark.parametrize("activation", sorted(dense.ACTIVATIONS))
def test_gated_product_is_activation_of_gate_times_up(dtype, rows, activation):
    """``Dense(w, gate=act).gated_product(x)`` against the gated MLPs of transformers: Qwen3's
    ``Qwen3MLP.forward`` (``act_fn(gate_proj(x)) * up_proj(x)``, silu; transformers/models/
    qwen3/modeling_qwen3.py) and T5's ``T5DenseGatedActDense.forward`` (``act(wi_0(x)) *
    wi_1(x)``, gelu_new for Flan-T5; transformers/models/t5/modeling_t5.py), the activations
    from transformers' ``ACT2FN`` (activations.py) on the gate rows and the up rows of one
    weight: prepared (its halves apart; the engine's panels in float32, its activation applied to
    each panel of both halves at every row count, or after them for the erf GELU, which takes
    oneDNN's fused epilogues from ``ENGINE_MAX_ROWS`` rows as bfloat16 does) within 1e-5 in
    float32 and to bfloat16 rounding; ``forward`` stays the plain product with the whole weight."""
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(2 * 768, 256, generator=g) / 16).to(dtype)
    x = (torch.randn(2, rows, 256, generator=g) * 2).to(dtype)
    d = Dense(w, gate=activation)
    engine = dtype == torch.float32 or BF16_ENGINE
    # a float32 gated product the engine activates keeps only its panels, at every row count
    panels_only = dtype == torch.float32 and activation in dense.ENGINE_ACTIVATIONS
    packs = dense.packing_available(dtype) and not panels_only
    assert d.prepare() == expected_path(engine, packs)
    if panels_only:
        assert d._prepared_for_input(x) == "engine"
    gate, up = w.float().chunk(2)
    want = ACT2FN[activation](F.linear(x.float(), gate)) * F.linear(x.float(), up)
    with torch.no_grad():
        got = d.gated_product(x)
        assert got.shape == (2, rows, 768) and got.dtype == dtype
        assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 2 ** -7)
        assert rel_err(d(x), F.linear(x.float(), w.float())) <= (1e-5 if dtype == torch.float32 else 2 ** -7)
    for halves in (d._panels, d._packed):
        assert halves is None or (isinstance(halves, tuple) and len(halves) == 2)
    with pytest.raises(ValueError, match="gate=<activation>"):
        Dense(w).gated_product(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", (1, 16, 300))
@pytest.mark.parametrize("activation", [None, *sorted(dense.ACTIVATIONS)])
def test_bias_and_activation_on_every_path(dtype, rows, activation):
    """``Dense(w, bias=b, activation=act)`` against the biased linear layers of transformers'
    vision MLPs (``Qwen3_5VisionMLP.forward``: ``linear_fc2(act_fn(linear_fc1(x)))``, each an
    ``nn.Linear`` with a bias; transformers/models/qwen3_5/modeling_qwen3_5.py), the activation
    from ``ACT2FN``: ``F.linear`` (unprepared), the engine's panels (few rows; in float32 every
    row count where the engine applies the activation, bias and activation on each panel in its
    call) and oneDNN's packed GEMM with the bias and activation in its epilogue (many rows) within
    1e-5 in float32 and to bfloat16 rounding; a weight of more dimensions (a Conv3d's, kernel ==
    stride) read flattened."""
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(576, 3, 2, 8, 8, generator=g) / 20).to(dtype)  # 384 inputs, flattened
    b = torch.randn(576, generator=g).to(dtype)
    x = torch.randn(rows, 384, generator=g).to(dtype)
    want = F.linear(x.float(), w.float().flatten(1), b.float())
    want = want if activation is None else ACT2FN[activation](want)
    d = Dense(w, bias=b, activation=activation)
    assert d.in_features == 384 and d.out_features == 576
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    with torch.no_grad():
        assert rel_err(d(x), want) <= tol  # F.linear
        d.prepare()
        how = d._prepared_for_input(x)
        engine = dtype == torch.float32 or BF16_ENGINE
        panels_only = dtype == torch.float32 and activation in dense.ENGINE_ACTIVATIONS
        assert d.path == ("engine" if panels_only else expected_path(engine, dense.packing_available(dtype)))
        assert how == ("engine" if engine and (rows <= dense.ENGINE_MAX_ROWS[dtype] or panels_only) else
                       "onednn-packed" if dense.packing_available(dtype) else "engine" if engine else None)
        got = d(x)
        assert got.shape == (rows, 576) and got.dtype == dtype
        assert rel_err(got, want) <= tol
    assert [k for k, _ in d.state_dict().items()] == ["weight", "bias"]
    assert d.state_dict()["weight"].shape == (576, 3, 2, 8, 8)


@pytest.mark.parametrize("outputs", (64, 100, 7))
@pytest.mark.parametrize("activation", [None, *sorted(dense.ENGINE_ACTIVATIONS)])
def test_engine_epilogue_bias_then_activation(outputs, activation):
    """``_engine.dense_product``'s float32 epilogue: the bias added to the product's own bits (as
    a separate ``add_`` after the plain engine product), then the activation (transformers'
    ``ACT2FN``, activations.py) within 1e-6, panels cut short (100, 7 outputs) included; refused
    for bfloat16 bits."""
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(outputs)
    w, b = torch.randn(outputs, 96, generator=g) / 10, torch.randn(outputs, generator=g)
    x = torch.randn(70, 96, generator=g)
    panels = dense.pack_panels(w)
    plain = dense.engine_linear(x, panels, outputs)
    biased = dense.engine_linear(x, panels, outputs, b)
    assert torch.equal(biased, plain + b)
    got = dense.engine_linear(x, panels, outputs, b, activation)
    want = plain + b if activation is None else ACT2FN[activation](plain + b)
    assert (got - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item())
    if activation is not None:
        unbiased = dense.engine_linear(x, panels, outputs, None, activation)
        want = ACT2FN[activation](plain)
        assert (unbiased - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item())
    with pytest.raises(ValueError, match="float32"):
        _engine.dense_product(x.bfloat16().view(torch.int16).numpy(), panels, plain.numpy(), 1, b.numpy(), None)


def test_bias_and_activation_refusals():
    w = torch.randn(64, 32)
    with pytest.raises(ValueError, match="no activation"):
        Dense(w, activation="tanh")
    with pytest.raises(ValueError, match="gated projection"):
        Dense(w, gate="silu", bias=torch.zeros(64))
    with pytest.raises(ValueError, match="bias of shape"):
        Dense(w, bias=torch.zeros(32))
    with pytest.raises(ValueError, match="weight"):
        Dense(torch.zeros(64))


def test_leading_dimensions_and_strides():
    """``x`` of shape [B, S, in], and a transposed (non-contiguous) ``x``."""
    w = torch.randn(1152, 512) / 512 ** 0.5
    d = prepared(w)
    x3 = torch.randn(3, 5, 512)
    xt = torch.randn(512, 9).t()
    with torch.no_grad():
        assert d(x3).shape == (3, 5, 1152)
        assert rel_err(d(x3), F.linear(x3, w)) <= 1e-5
        assert rel_err(d(xt), F.linear(xt, w)) <= 1e-5
    with torch.inference_mode():  # as the backends run
        assert rel_err(d(x3), F.linear(x3, w)) <= 1e-5


def test_fp8_weight_runs_as_before():
    """A Dense over an Fp8Weight is that module: the same FP8 GEMM, its buffers under
    ``weight.``; prepare leaves it alone."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32, generator=g)
    x = torch.randn(5, 32, generator=g)
    s, sx = e4m3_scale(w.abs().max()), e4m3_scale(x.abs().max())
    fp8 = Fp8Weight(quantize_e4m3(w, s), s, sx)
    d = Dense(fp8)
    assert prepare_dense(torch.nn.Sequential(d)) == {"fp8": 1}
    assert d.weight is fp8 and d.path == "fp8"
    assert sorted(d.state_dict()) == ["weight.input_scale", "weight.weight", "weight.weight_scale"]
    try:
        expected = fp8_linear(x, fp8.weight, s, sx, out_dtype=x.dtype)
    except (RuntimeError, NotImplementedError) as e:  # no FP8 GEMM on this build
        pytest.skip(f"torch._scaled_mm unavailable here: {e}")
    assert torch.equal(d(x), expected)
    assert torch.equal(d(x), fp8(x))


def test_state_dict_and_load():
    """``state_dict`` holds the weight alone; loading new values into it (in place, same
    storage) is what the packed path computes with next."""
    model = torch.nn.Sequential(Dense(torch.randn(1152, 512)))
    prepare_dense(model)
    assert list(model.state_dict()) == ["0.weight"]
    new = torch.randn(1152, 512) / 512 ** 0.5
    model.load_state_dict({"0.weight": new})
    x = torch.randn(4, 512)
    with torch.no_grad():
        assert rel_err(model(x), F.linear(x, new)) <= 1e-5
    # values swapped under the packed copy without load_state_dict: new storage, so F.linear
    model[0].weight.data = torch.randn(1152, 512)
    with torch.no_grad():
        assert rel_err(model(x), F.linear(x, model[0].weight)) <= 1e-5


def test_to_dtype_prepares_again():
    """``.to(dtype)`` chooses again for the new dtype; a dtype without a packed path (float16)
    falls back to F.linear."""
    d = prepared(torch.randn(1152, 512) / 512 ** 0.5)
    x = torch.randn(7, 512)
    assert d.path == ("engine+onednn-packed" if PACKS else "engine")
    d.to(torch.bfloat16)
    assert d.weight.dtype == torch.bfloat16 and not d.weight.requires_grad
    assert d.path == expected_path(BF16_ENGINE, PACKS_BF16)
    with torch.no_grad():
        assert rel_err(d(x.bfloat16()), F.linear(x.bfloat16(), d.weight)) <= 2 ** -8
    d.to(torch.float16)
    assert d.path == "linear"
    d.float()
    with torch.no_grad():
        assert rel_err(d(x), F.linear(x, d.weight)) <= 1e-5


def test_gradient_falls_back():
    """The packed op has no autograd formula: an input that needs a gradient gets F.linear."""
    w = torch.randn(1152, 512) / 512 ** 0.5
    d = prepared(w)
    x = torch.randn(3, 512, requires_grad=True)
    d(x).sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)


def test_compiled_matches():
    """Inside torch.compile the packed op is bypassed (inductor cannot lower it on an opaque
    oneDNN tensor): the compiled module computes F.linear's product."""
    w = torch.randn(1152, 512) / 512 ** 0.5
    d = prepared(w)
    x = torch.randn(4, 512)
    with torch.no_grad():
        y = torch.compile(d)(x)
    assert rel_err(y, F.linear(x, w)) <= 1e-5


def test_dense_compiles_in_one_graph():
    """A prepared ``Dense`` traces without a graph break (the models' compiled forwards call one
    for every projection) and computes F.linear's product."""
    w = torch.randn(1152, 512) / 512 ** 0.5
    d = prepared(w)
    x = torch.randn(4, 512)
    with torch.no_grad():
        y = torch.compile(d, fullgraph=True)(x)
    assert rel_err(y, F.linear(x, w)) <= 1e-5


def test_backends_prepare_their_projections(t5_dir, vl_dir):
    """Both torch backends hold every projection as a ``Dense`` and choose its GEMM at load
    (float32 on the CPU: the engine's panels)."""
    from fastjudge.backends.qwen.backend import TorchQwenBackend
    from fastjudge.backends.t5.backend import TorchT5Backend

    for backend in (TorchT5Backend(t5_dir, device="cpu", dtype="float32"),
                    TorchQwenBackend(vl_dir, device="cpu", dtype="float32")):
        dense = [m for m in backend.model.modules() if isinstance(m, Dense)]
        assert dense and all(m.path == "engine" for m in dense)  # below oneDNN's sizes
        assert prepare_dense(backend.model) == {"engine": len(dense)}
        assert prepare_dense(backend.model, enabled=False) == {"linear": len(dense)}


def engine_product(x: np.ndarray, w: torch.Tensor, threads: int = 2) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0])
    _engine.dense_product(x, dense.pack_panels(w), out.numpy(), threads)
    return out


@pytest.mark.parametrize("out_features", [1, 16, 48, 64, 100, 200])
@pytest.mark.parametrize("rows", [0, 1, 5, 64, 130])
def test_engine_product_any_shape(out_features, rows):
    """The engine's projection kernel on outputs that fill no panel, part of one or several, and
    row counts across its 64-row groups, against ``F.linear``; the inputs read with a row stride
    of their own (a slice of wider rows)."""
    g = torch.Generator().manual_seed(out_features + rows)
    w = torch.randn(out_features, 37, generator=g)
    wide = torch.randn(rows, 50, generator=g)
    x = wide[:, 5:42]
    assert rows <= 1 or not x.is_contiguous()
    got = engine_product(x.numpy(), w)
    assert got.shape == (rows, out_features)
    if rows:
        assert rel_err(got, F.linear(x, w)) <= 1e-5


def assert_each_row_alone(x: torch.Tensor, panels, up_panels, outputs: int, activation: str, threads) -> None:
    """The engine's projection of ``x`` (gated where ``up_panels`` is given) on each of
    ``threads``: every row the bits of that row projected alone on one thread."""
    def project(rows: torch.Tensor, workers: int) -> torch.Tensor:
        out = torch.empty(rows.shape[0], outputs, dtype=rows.dtype)
        xa, oa = dense.engine_array(rows), dense.engine_array(out)
        if up_panels is None:
            _engine.dense_product(xa, panels, oa, workers)
        else:
            _engine.gated_dense_product(xa, panels, up_panels, oa, activation, workers)
        return out

    alone = torch.cat([project(x[r:r + 1], 1) for r in range(x.shape[0])])
    for workers in threads:
        assert torch.equal(project(x, workers), alone)


@pytest.mark.parametrize("gated", [False, True])
def test_bfloat16_runs_of_panels_give_each_rows_own_bits(gated):
    """A bfloat16 call of several row groups and more panels than fit one run (engine/dense.cpp:
    UnitOrder: runs of panels whose weights fit 1 MiB, each run's groups in turn; 512 inputs make
    a panel of 128 KiB, so 600 outputs are a run of eight panels and one of two, and a gated
    weight's runs half as long), split over one thread and three: every row the bits of that row
    projected alone."""
    if not BF16_ENGINE:
        pytest.skip("this CPU has no AVX512-BF16 dot products")
    g = torch.Generator().manual_seed(11)
    w, up = ((torch.randn(600, 512, generator=g) / 512 ** 0.5).bfloat16() for _ in range(2))
    panels, up_panels = dense.pack_panels(w), dense.pack_panels(up)
    x = torch.randn(150, 512, generator=g).bfloat16()
    assert_each_row_alone(x, panels, up_panels if gated else None, 600, "silu", threads=(1, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 16, 32, 48, 100, 130, 131])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("inputs", [301, 288])
def test_few_rows_read_in_slices_give_each_rows_own_bits(dtype, rows, gated, inputs):
    """A call of one group of rows (a decoding step's; float32 at any size, bfloat16 up to 32
    rows) reads each panel in slices of inputs, keeping partial sums between them, while one row
    reads it whole; a call of more groups (100 rows: 64, then 36; 130 and 131: a last group of two
    and three) reads, under AVX2, each thread's copy of the panel split into 16-column sub-panels,
    block of six rows by block (and under AVX-512 the panel whole); bfloat16 on AMX tiles (288
    inputs: whole tiles of 16 pairs) reads a whole group's rows in place (here at an odd column
    offset) and a last partial group through a copy padded to blocks of 16 rows, the rows past it
    holding an earlier group's inputs: every row's outputs must be the same bits as that row
    projected alone (each output sums its inputs in the same order), over input widths that end
    mid-slice, several panels and one cut short, on one thread and two."""
    if dtype == torch.bfloat16 and not BF16_ENGINE:
        pytest.skip("this CPU has no AVX512-BF16 dot products")
    g = torch.Generator().manual_seed(rows)
    w, up = (torch.randn(200, inputs, generator=g) / inputs ** 0.5 for _ in range(2))
    wide = torch.randn(rows, 320, generator=g)
    panels, up_panels = (dense.pack_panels(m.to(dtype)) for m in (w, up))

    x = wide.to(dtype)[:, 7:7 + inputs]
    assert_each_row_alone(x, panels, up_panels if gated else None, 200, "gelu_tanh", threads=(1, 2))


def test_decoding_only_projections_keep_one_copy():
    """``Dense(w, prompts=False)`` (a full-vocabulary head) keeps the engine's panels alone where
    the engine takes the weight, and runs them at every row count; oneDNN's copy where it does
    not (float16: none; bfloat16 without AVX512-BF16)."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(1152, 512, generator=g) / 512 ** 0.5
    d = Dense(w, prompts=False)
    assert d.prepare() == "engine" and d._packed is None
    x = torch.randn(600, 512, generator=g)
    with torch.no_grad():
        assert rel_err(d(x), F.linear(x, w)) <= 1e-5
    b = Dense(w.bfloat16(), prompts=False)
    assert b.prepare() == ("engine" if BF16_ENGINE else "onednn-packed" if PACKS_BF16 else "linear")


@pytest.mark.skipif(not PACKS, reason="oneDNN's packed linear is not in this build")
def test_float32_rows_choose_the_engine_or_onednn():
    """A float32 weight with both copies runs the engine's panels up to ENGINE_MAX_ROWS input
    rows (counted over every leading dim) and oneDNN's packed GEMM above; both F.linear's
    product within 1e-5."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(768, 256, generator=g) / 16
    d = prepared(w)
    assert d.path == "engine+onednn-packed"
    with torch.no_grad():
        limit = dense.ENGINE_MAX_ROWS[torch.float32]
        for rows, how in ((1, "engine"), (limit, "engine"), (limit + 2, "onednn")):
            x = torch.randn(2, rows // 2 or 1, 256, generator=g)
            want = (engine_product(x.reshape(-1, 256).numpy(), w, torch.get_num_threads()).view(*x.shape[:-1], 768)
                    if how == "engine" else dense.packed_linear(x, d._packed))
            assert torch.equal(d(x), want)
            assert rel_err(d(x), F.linear(x, w)) <= 1e-5


@pytest.mark.skipif(not BF16_ENGINE, reason="bfloat16 projections in the engine need AVX512-BF16")
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (48, 37), (200, 64), (1536, 256)])
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
def test_engine_product_bfloat16(out_features, in_features, rows):
    """The engine's bfloat16 projection (pairs of inputs as bfloat16 dot products; an odd input
    count padded with a zero) against ``F.linear`` in bfloat16 (one rounding of the float32 sum:
    within one bfloat16 step of the output's largest value) and in float32 (within two), and
    gated with silu against the unfused product of ``F.linear``'s halves."""
    g = torch.Generator().manual_seed(out_features + in_features + rows)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    got = dense.engine_linear(x, dense.pack_panels(w), out_features)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert rel_err(got, F.linear(x, w)) <= 2 ** -8
    assert rel_err(got, F.linear(x.float(), w.float())) <= 2 ** -7
    up = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).bfloat16()
    gated = dense.engine_gated_product(x, dense.pack_panels(w), dense.pack_panels(up), "silu", out_features)
    want = F.silu(F.linear(x.float(), w.float())) * F.linear(x.float(), up.float())
    assert rel_err(gated, want) <= 2 ** -7


def test_engine_product_same_bits_on_any_thread_count():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 96, generator=g)
    x = torch.randn(200, 96, generator=g).numpy()
    one = engine_product(x, w, threads=1)
    for threads in (2, 3, 8):
        assert torch.equal(engine_product(x, w, threads=threads), one)


def test_engine_product_refuses_what_it_cannot_take():
    w = dense.pack_panels(torch.randn(70, 8))
    x = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="x must be"):
        _engine.dense_product(np.zeros((3, 9), np.float32), w, np.zeros((3, 70), np.float32))
    with pytest.raises(ValueError, match="x must be"):
        _engine.dense_product(np.zeros((3, 8), np.float64), w, np.zeros((3, 70), np.float32))
    with pytest.raises(ValueError, match="same rows"):
        _engine.dense_product(x, w, np.zeros((4, 70), np.float32))
    with pytest.raises(ValueError, match="panels"):
        _engine.dense_product(x, w[:1], np.zeros((3, 70), np.float32))
    with pytest.raises(ValueError, match="panels"):
        _engine.dense_product(x, np.zeros((2, 8, 32), np.float32), np.zeros((3, 70), np.float32))
    with pytest.raises(ValueError, match="activation"):
        _engine.gated_dense_product(x, w, w, np.zeros((3, 70), np.float32), "tanh")
    with pytest.raises(ValueError, match="out"):
        _engine.dense_product(x, w, np.zeros((3, 140), np.float32)[:, ::2])


def test_traced_graphs_take_f_linear():
    """Under ``torch.jit.trace`` (an ONNX export's exporter) a prepared projection runs
    ``F.linear``: the engine's output, written through numpy, would be a constant of the graph."""
    w, b = torch.randn(64, 32), torch.randn(64)
    d = Dense(w, bias=b, activation="gelu_new")
    d.prepare()
    first, second = torch.randn(5, 32), torch.randn(5, 32)
    with torch.no_grad():
        traced = torch.jit.trace(d, first)
        assert torch.equal(traced(second), F.gelu(F.linear(second, w, b), approximate="tanh"))


@pytest.mark.skipif(not PACKS, reason="oneDNN's packed linear is not in this build")
def test_projections_no_step_runs_keep_one_copy():
    """``steps=False`` (the vision tower's projections): a weight oneDNN packs keeps no engine
    panels, and its few-row inputs take the packed GEMM; one too small to pack keeps the panels;
    a projection for neither prompts nor steps is refused."""
    g = torch.Generator().manual_seed(11)
    big = Dense(torch.randn(576, 384, generator=g) / 20, bias=torch.randn(576, generator=g), steps=False)
    small = Dense(torch.randn(48, 64, generator=g), steps=False)
    assert big.prepare() == "onednn-packed" and big.panels is None
    assert small.prepare() == "engine"
    x = torch.randn(3, 384, generator=g)
    with torch.no_grad():
        assert big._prepared_for_input(x) == "onednn-packed"
        assert rel_err(big(x), F.linear(x, big.weight, big.bias)) <= 1e-5
    with pytest.raises(ValueError, match="prompts, decoding steps or both"):
        Dense(torch.randn(8, 8), prompts=False, steps=False)
