"""The engine's triangular inverse (``fastjudge._engine.unit_lower_inverse``, engine/triangular.cpp):
every batch size around its 16-matrix groups and thread split, odd and even C, the inputs it
refuses, and the dispatch in ``gated_delta.unit_lower_inverse`` that uses it. Its values are held
against ``torch.linalg.solve_triangular`` here and in tests/test_gated_delta.py, and the chunked
rule built on it against transformers' ``torch_chunk_gated_delta_rule`` there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastjudge import _engine
from fastjudge.backends.qwen.gated_delta import unit_lower_inverse, unit_lower_inverse_blocks


def systems(n: int, C: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, C, C, generator=gen) * 2 - 1


def engine_inverse(system: torch.Tensor, threads: int = 1) -> torch.Tensor:
    out = torch.full_like(system, float("nan"))  # every entry must be written
    _engine.unit_lower_inverse(system.numpy(), out.numpy(), threads)
    return out


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 64, 100])
@pytest.mark.parametrize("C", [1, 2, 4, 7, 16, 31, 64, 65])
def test_every_matrix_of_every_group_is_inverted(n, C):
    """Batches that fill 16-matrix groups partly, exactly and over, on one thread and split over
    several (the same values: each matrix is computed alone), against a triangular solve."""
    system = systems(n, C, seed=n * 100 + C)
    ours = engine_inverse(system)
    theirs = torch.linalg.solve_triangular(system, torch.eye(C).expand(n, C, C), upper=False, unitriangular=True)
    assert float((ours - theirs).abs().max() / theirs.abs().max()) <= 1e-5
    assert torch.equal(ours.triu(1), torch.zeros_like(ours))
    assert torch.equal(ours.diagonal(0, -2, -1), torch.ones(n, C))
    for threads in (2, 3, 8):
        assert torch.equal(engine_inverse(system, threads), ours)


def test_the_upper_triangle_is_never_read():
    """NaN on and above the diagonal changes nothing."""
    system = systems(20, 12)
    upper = torch.ones(12, 12, dtype=torch.bool).triu()
    poisoned = system.masked_fill(upper, float("nan"))
    assert torch.equal(engine_inverse(poisoned), engine_inverse(system.tril(-1)))


def test_refuses_what_it_cannot_write_exactly():
    good = np.zeros((2, 4, 4), dtype=np.float32)
    out = np.zeros_like(good)
    for bad_system, bad_out, message in [
        (good.astype(np.float64), out, "float32"),
        (good.transpose(0, 2, 1), out, "C-contiguous"),
        (np.zeros((2, 4, 5), dtype=np.float32), out, "square"),
        (good, np.zeros((3, 4, 4), dtype=np.float32), "shape"),
        (good, good, "not be system"),
    ]:
        with pytest.raises(ValueError, match=message):
            _engine.unit_lower_inverse(bad_system, bad_out)
    readonly = np.zeros_like(good)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        _engine.unit_lower_inverse(good, readonly)
    big = _engine.unit_lower_inverse_max_size + 1
    with pytest.raises(ValueError, match="over"):
        _engine.unit_lower_inverse(np.zeros((1, big, big), np.float32), np.zeros((1, big, big), np.float32))


def test_dispatch_takes_the_engine_for_float32_cpu_systems_only():
    """``unit_lower_inverse``: the engine's values for a float32 CPU system (any layout: a
    transposed view is made contiguous first), the block inversion's for float64 (close to the
    engine's); both equal a float64 solve to float32 precision."""
    system = systems(5, 33, seed=7).view(5, 1, 33, 33)
    assert torch.equal(unit_lower_inverse(system), engine_inverse(system.view(5, 33, 33)).view(5, 1, 33, 33))
    flipped = system.transpose(-1, -2)
    want = engine_inverse(flipped.contiguous().view(5, 33, 33)).view(5, 1, 33, 33)
    assert torch.equal(unit_lower_inverse(flipped), want)
    wide = unit_lower_inverse(system.double())
    assert wide.dtype == torch.float64
    assert torch.equal(wide, unit_lower_inverse_blocks(system.double()))
    assert float((wide.float() - unit_lower_inverse(system)).abs().max() / wide.abs().max()) <= 1e-5
