"""Compiled step functions (``compile="on"``) give what the eager steps give: the Qwen decoding
step (one-token and multi-token, on shape buckets over the static cache) and the score-only
forward, on the tiny random-weight checkpoints. Tokens identical, logits and probabilities
within 1e-5 (float32). The compile option's resolution and the bucket sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("xgrammar")

from conftest import TEST_DEVICE  # noqa: E402
from test_jump_forward import adversarial_biases, assert_same, biased, json_spec, requests_for  # noqa: E402

from fastjudge.backends.compiled import compile_enabled, row_bucket, width_bucket  # noqa: E402
from fastjudge.backends.qwen.backend import TorchQwenBackend  # noqa: E402
from fastjudge.runtime.requests import Choice, Request, Text  # noqa: E402


def test_compile_option_and_buckets():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not compile_enabled("auto", cpu) and compile_enabled("auto", cuda)
    assert compile_enabled("on", cpu) and not compile_enabled("off", cuda)
    with pytest.raises(ValueError):
        compile_enabled("fast", cpu)
    assert [row_bucket(n) for n in (1, 3, 8, 9, 600)] == [1, 4, 8, 16, 600]
    assert [width_bucket(k) for k in (1, 2, 3, 5, 16)] == [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fastjudge.checkpoints import build_random_qwen
    from fastjudge.demo import tokenizer_corpus

    return build_random_qwen(tmp_path_factory.mktemp("compiled-qwen"), tokenizer_corpus(), arch="qwen3_5", seed=7)


@pytest.fixture(scope="module")
def backends(model_dir):
    return (TorchQwenBackend(model_dir, device=TEST_DEVICE, dtype="float32", compile="off"),
            TorchQwenBackend(model_dir, device=TEST_DEVICE, dtype="float32", compile="on"))


def test_compiled_decoding_equals_eager(backends):
    """Json rows with jump-forward (multi-token steps of several widths), then Text rows with
    tracked logits (LAVE's rationale spec), three rows (padded to a bucket of four)."""
    eager, compiled = backends
    for spec in (json_spec("boxes"), Text(10, track_ids=(3, 10, 11))):
        reqs = requests_for(spec, n=3, seed=3)
        outs = []
        for backend in backends:
            with biased(backend, adversarial_biases(backend)["noise"]):
                outs.append(backend.run(reqs))
        assert_same(*outs)
    assert compiled.compile_seconds > 0 and eager.compile_seconds == 0


def test_compiled_choice_equals_eager(backends):
    rng = np.random.default_rng(4)
    prefix = rng.integers(5, 900, size=10)
    reqs = [Request(i, np.concatenate([prefix, rng.integers(5, 900, size=3 + 2 * i)]), Choice((3, 10, 11)),
                    prefix_len=10) for i in range(3)]
    a, b = (backend.run(reqs) for backend in backends)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.logits, y.logits, atol=1e-5, rtol=0)


def test_compiled_t5_equals_eager(t5_dir):
    """The T5 decoder step (rationale rows with tracked logits, three rows padded to four) and
    the score-only step, compiled against eager."""
    from fastjudge.backends.t5.backend import TorchT5Backend

    eager = TorchT5Backend(t5_dir, device=TEST_DEVICE, dtype="float32", compile="off")
    compiled = TorchT5Backend(t5_dir, device=TEST_DEVICE, dtype="float32", compile="on")
    rng = np.random.default_rng(6)
    prompts = [rng.integers(5, 200, size=12 + 3 * i) for i in range(3)]
    text = [Request(i, p, Text(8, track_ids=(3, 10, 11))) for i, p in enumerate(prompts)]
    assert_same(eager.run(text), compiled.run(text))
    choice = [Request(i, p, Choice((3, 10, 11))) for i, p in enumerate(prompts)]
    for x, y in zip(eager.run(choice), compiled.run(choice)):
        np.testing.assert_allclose(x.logits, y.logits, atol=1e-5, rtol=0)
    assert compiled.compile_seconds > 0


def pool_workloads(rows: int):
    """Batches of ``rows`` rows of two kinds: score-only rows behind a shared prefix, and Text
    rows with tracked logits (prefilled suffixes, then one-token steps)."""
    rng = np.random.default_rng(rows)
    prefix = rng.integers(5, 900, size=10)
    return [[Request(i, np.concatenate([prefix, rng.integers(5, 900, size=3 + i)]), Choice((3, 10, 11)), prefix_len=10)
             for i in range(rows)],
            requests_for(Text(6, track_ids=(3, 10, 11)), n=rows, seed=rows)]


def test_compiled_forward_gets_the_pool_at_static_addresses(backends):
    """What CUDA graphs need of the compiled forward (torch ``_inductor/cudagraph_trees.py``:
    a graph is skipped when it mutates an input whose address is not static; gpt-fast's
    ``model.py`` keeps its KV cache in module buffers for this reason): the state pool is
    allocated once, its buffers are marked static, and every call -- batches of different
    sizes and kinds -- receives the very same tensors (``data_ptr``); a second round of
    batches on the same shape buckets compiles nothing (dynamo's counters, and no new shape)."""
    _, backend = backends
    for batch in pool_workloads(2) + pool_workloads(3):  # warm-up: the pool and these batches' buckets
        backend.run(batch)
    pool, allocations = backend.pool, backend.pool_allocations
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in pool.buffers())
    compiled = backend._compiled.fn
    seen = []

    def spy(tokens, counts, state, width, **kw):
        seen.append((id(state), {name: t.data_ptr() for name, t in state.named_buffers()}))
        return compiled(tokens, counts, state, width, **kw)

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    shapes = set(backend._compiled._seen)
    backend._compiled.fn = spy
    try:
        for batch in pool_workloads(3) + pool_workloads(2):  # rows buckets 4 and 2, shapes seen
            backend.run(batch)
    finally:
        backend._compiled.fn = compiled
    assert len(seen) > 10 and all(s == seen[0] for s in seen)
    assert seen[0][1] == {name: t.data_ptr() for name, t in pool.named_buffers()}
    assert backend.pool is pool and backend.pool_allocations == allocations
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert set(backend._compiled._seen) == shapes


def test_compiled_function_keeps_every_shape_compiled():
    """A compiled step meets more shapes than dynamo's default recompile limit (8): past it,
    dynamo would run each new shape eagerly (on CUDA without its graph). ``CompiledFunction``
    raises the limit, so twelve shapes give twelve graphs, and calling them all again compiles
    nothing (``set_stance("fail_on_recompile")`` raises on any compilation)."""
    from torch._dynamo.utils import counters

    from fastjudge.backends.compiled import CompiledFunction

    fn = CompiledFunction(lambda x: (x * 2).sin() + 1, torch.device("cpu"), "a test step")
    before = counters["stats"]["unique_graphs"]
    shapes = [(rows, width) for rows in (1, 2, 4, 8) for width in (1, 2, 4)]
    for shape in shapes:
        x = torch.randn(*shape)
        torch.testing.assert_close(fn(shape, x), (x * 2).sin() + 1)
    assert counters["stats"]["unique_graphs"] - before == len(shapes)
    with torch.compiler.set_stance("fail_on_recompile"):
        for shape in shapes:
            fn(shape, torch.randn(*shape))
