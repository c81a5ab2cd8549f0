"""A decoding step is shaped for the GPU: at most two host synchronisations and the same aten
ops whatever the row count (within 10 %), counted with ``torch.profiler`` through
``bench.step_profile`` -- the Qwen JSON path (grammar masks, jump-forward) and the T5 rationale
path (tracked logits)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("xgrammar")

from conftest import TEST_DEVICE  # noqa: E402
from test_jump_forward import adversarial_biases, biased, json_spec, requests_for  # noqa: E402

from fastjudge.backends.qwen.backend import TorchQwenBackend  # noqa: E402
from fastjudge.bench.step_profile import profile_decoding  # noqa: E402
from fastjudge.checkpoints import build_random_qwen  # noqa: E402
from fastjudge.demo import tokenizer_corpus  # noqa: E402
from fastjudge.runtime.requests import Request, Text  # noqa: E402


@pytest.fixture(scope="module")
def qwen_backend(tmp_path_factory):
    model_dir = build_random_qwen(tmp_path_factory.mktemp("steps-qwen"), tokenizer_corpus(), arch="qwen3_5", seed=7)
    return TorchQwenBackend(model_dir, device=TEST_DEVICE, dtype="float32")

def qwen_profile(backend, rows: int, jump_forward: bool) -> dict:
    reqs = requests_for(json_spec("boxes"), n=rows, seed=5)
    backend.jump_forward = jump_forward
    try:
        backend.run(reqs)  # warm-up: the grammar compiled
        with biased(backend, adversarial_biases(backend)["noise"]):
            return profile_decoding(lambda: backend.run(reqs))
    finally:
        backend.jump_forward = True


def test_qwen_json_step_costs_the_same_at_any_row_count(qwen_backend):
    """One-token steps (jump-forward off) issue the same ops at 1 and 6 rows; with jump-forward
    a step is as wide as its longest forced run (more rows, wider steps on average), and still
    syncs once."""
    one, many = qwen_profile(qwen_backend, 1, False), qwen_profile(qwen_backend, 6, False)
    assert one["syncs"] <= 2 and many["syncs"] <= 2
    assert abs(many["ops"] - one["ops"]) <= 0.1 * one["ops"]
    assert qwen_profile(qwen_backend, 6, True)["syncs"] <= 2


def t5_profile(t5_backend, rows: int) -> dict:
    rng = np.random.default_rng(rows)
    reqs = [Request(i, rng.integers(5, 200, size=20 + i), Text(12, track_ids=(3, 10, 11))) for i in range(rows)]
    return profile_decoding(lambda: t5_backend.run(reqs))


def test_t5_rationale_step_costs_the_same_at_any_row_count(t5_backend):
    one, many = t5_profile(t5_backend, 1), t5_profile(t5_backend, 6)
    assert one["syncs"] <= 2 and many["syncs"] <= 2
    assert abs(many["ops"] - one["ops"]) <= 0.1 * one["ops"]
