"""A decoding step is shaped for the GPU: at most two host synchronisations and the same aten
ops whatever the row count (within 10 %), counted with ``torch.profiler`` through
``bench.step_profile`` -- the Qwen JSON path (grammar masks, jump-forward) and the T5 rationale
path (tracked logits)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("xgrammar")

from conftest import TEST_DEVICE, record_runs  # noqa: E402
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


def test_qwen_text_runs_count_every_step(qwen_backend, monkeypatch):
    """Greedy text rows on the CPU engine run their steps several to a call
    (``EngineStep.run_picks``): a profile still counts every model step (an empty step label for
    each step of a run after its first), as the backend's own counter does."""
    if TEST_DEVICE != "cpu":
        pytest.skip("the engine's steps run on the CPU")
    from fastjudge.backends.qwen.engine_step import EngineStep

    rng = np.random.default_rng(3)
    prefix = rng.integers(5, 200, size=24)
    reqs = [Request(i, np.concatenate([prefix, rng.integers(5, 200, size=3 + i)]), Text(10), prefix_len=len(prefix))
            for i in range(4)]
    runs = record_runs(monkeypatch, EngineStep, "run_picks")
    qwen_backend.run(reqs)  # warm-up
    runs.clear()
    qwen_backend.reset_decode_stats()
    counts = profile_decoding(lambda: qwen_backend.run(reqs))
    assert max(runs) > 1 and counts["steps"] == qwen_backend.decode_stats["decode_steps"] == sum(runs)


def t5_profile(t5_backend, rows: int) -> dict:
    rng = np.random.default_rng(rows)
    reqs = [Request(i, rng.integers(5, 200, size=20 + i), Text(12, track_ids=(3, 10, 11))) for i in range(rows)]
    t5_backend.run(reqs)  # warm-up: a pool that fits the call, and the engine's step bound to it
    return profile_decoding(lambda: t5_backend.run(reqs))


def test_t5_rationale_step_costs_the_same_at_any_row_count(t5_backend, monkeypatch):
    """The model's step issues the same ops at 1 and 6 rows (on the CPU one engine call and its
    way in); around it the loop's own work differs only by rows leaving at different steps. One
    step a call: the CPU engine's runs of several steps a call (which ``decode.run_pick_steps``
    makes; their first step costs what one step costs) spread a call's ops over its steps."""
    from fastjudge.backends.t5 import decode as t5_decode

    monkeypatch.setattr(t5_decode, "ENGINE_RUN_MAX_STEPS", 1)
    one, many = t5_profile(t5_backend, 1), t5_profile(t5_backend, 6)
    assert one["syncs"] <= 2 and many["syncs"] <= 2
    assert many["step_ops"] == one["step_ops"]
    assert abs(many["ops"] - one["ops"]) <= 0.2 * one["ops"]


def test_t5_runs_count_every_step(t5_backend, monkeypatch):
    """T5 rationale rows on the CPU engine run their steps several to a call
    (``decode.run_pick_steps``): a profile still counts every model step, one label each."""
    if TEST_DEVICE != "cpu":
        pytest.skip("the engine's steps run on the CPU")
    from fastjudge.backends.t5 import decode as t5_decode

    runs = record_runs(monkeypatch, t5_decode, "run_pick_steps")
    rng = np.random.default_rng(3)
    reqs = [Request(i, rng.integers(5, 200, size=20 + i), Text(12, track_ids=(3, 10, 11))) for i in range(3)]
    t5_backend.run(reqs)  # warm-up
    runs.clear()
    counts = profile_decoding(lambda: t5_backend.run(reqs))
    assert max(runs) > 1 and counts["steps"] == sum(runs)


def test_views_are_counted_apart():
    """``count_steps`` counts every top-level aten op, and apart the ones that only view memory
    (no kernel on any device): a step that adds, transposes, copies to contiguous memory and hands
    the copy to numpy (the engine's way in: ``detach``, ``resolve_conj`` and ``resolve_neg``,
    views, and an ``aten::to`` of the same dtype, which returns the tensor itself but is an op
    that may copy) has three ops besides its views."""
    import torch

    from fastjudge.backends.profiling import DECODE_LABEL, STEP_LABEL
    from fastjudge.bench.step_profile import VIEW_OPS

    x = torch.ones(4, 3)

    def step():
        with torch.profiler.record_function(DECODE_LABEL), torch.profiler.record_function(STEP_LABEL):
            y = (x + 1).t()
            y.contiguous().numpy()

    counts = profile_decoding(step)
    assert counts["steps"] == 1 and counts["syncs"] == 0
    kernels = counts["ops"] - counts["views"]
    assert counts["views"] == 4 and kernels == 3  # t, detach, resolve_conj, resolve_neg; add, contiguous, to
    assert {"aten::t", "aten::detach"} <= VIEW_OPS
