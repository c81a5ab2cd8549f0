"""bfloat16 projections on AMX tiles (``engine/amx_product.cpp``), where the CPU has AMX-BF16.

The reference is oneDNN's bfloat16 GEMM as torch 2.13.0 runs it on such a CPU: ``F.linear`` and
the prepacked ``torch.ops.mkldnn._linear_pointwise`` (on a ``mkldnn._reorder_linear_weight``
weight), whose brgemm kernels multiply on the tiles (oneDNN src/cpu/x64/brgemm, AMX kernels) at
every row count here. Each output of the engine's tile product is its row's float32 sum over the
inputs in increasing order, each pair of products added in the tile's fused step: the bits
oneDNN gives up to 32 rows (one row group), and the same bits whatever other rows share the call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastjudge import _engine
from fastjudge.backends import dense

pytestmark = pytest.mark.skipif(not _engine.amx_products(), reason="this CPU has no AMX-BF16 tiles")


@pytest.fixture
def dot_products():
    """Runs the test's engine products on AVX512-BF16 dot products, then the tiles again."""
    assert not _engine.amx_products(False)
    yield
    assert _engine.amx_products(True)


def weights(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).bfloat16()


@pytest.mark.parametrize("out_features,in_features", [(1152, 512), (512, 1024), (100, 256), (64, 32)])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 32])
def test_tiles_give_onednn_bits(out_features, in_features, rows):
    """Up to 32 rows, the engine's tile product is oneDNN's bfloat16 GEMM bit for bit, through
    both of torch's entry points (a panel cut short included: 100 outputs)."""
    w = weights(out_features, in_features, rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7)).bfloat16()
    got = dense.engine_linear(x, dense.pack_panels(w), out_features)
    assert torch.equal(got, dense.packed_linear(x, dense.pack(w)))
    assert torch.equal(got, F.linear(x, w))


@pytest.mark.parametrize("activation", ["silu", "relu"])
@pytest.mark.parametrize("rows", [1, 5, 16, 32])
def test_gated_tiles_give_onednn_bits(activation, rows):
    """A gated product on the tiles (``act(gate)`` rounded to bfloat16, times the up projection's
    float32 sum, rounded once) is oneDNN's pair of fused linears bit for bit (the tanh GELU is
    left out: oneDNN's own tanh differs from the engine's in the last bit of a few outputs)."""
    gate, up = weights(1024, 512, rows), weights(1024, 512, rows + 1)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = dense.engine_gated_product(x, dense.pack_panels(gate), dense.pack_panels(up), activation, 1024)
    assert torch.equal(got, dense.packed_gated_product(x, dense.pack(gate), dense.pack(up), activation))


@pytest.mark.parametrize("rows", [1, 4, 16, 48, 64, 200])
@pytest.mark.parametrize("gated", [False, True])
def test_tiles_and_dot_products_differ_by_rounding_alone(rows, gated):
    """The tiles against the AVX512-BF16 dot products they replace (the same sums in float32, the
    pairs added in another order): within one bfloat16 step of the output's largest value."""
    w, up = weights(300, 512, 1), weights(300, 512, 2)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    panels, up_panels = dense.pack_panels(w), dense.pack_panels(up)

    def run() -> torch.Tensor:
        if gated:
            return dense.engine_gated_product(x, panels, up_panels, "silu", 300)
        return dense.engine_linear(x, panels, 300)

    tiles = run()
    assert _engine.amx_products(False) is False
    try:
        dots = run()
    finally:
        _engine.amx_products(True)
    scale = dots.float().abs().max()
    assert ((tiles.float() - dots.float()).abs().max() / scale).item() <= 2 ** -8


def test_switch_reports_what_runs(dot_products):
    """``amx_products(False)`` turns the tiles off for the process (the fixture turns them on
    again and checks the answer)."""
    assert _engine.amx_products() is False
