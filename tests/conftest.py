"""Shared fixtures: tiny random-weight checkpoints of the real architectures, saved as real
Hugging Face directories with tokenizers trained here, loaded through the user's code path."""

from __future__ import annotations

import json
import os

# Triton reads TRITON_INTERPRET when it is imported (its own @triton.jit helpers are built then),
# and transformers or torch.compile may import it before the kernel tests do: on the CPU, set it
# before anything else is imported, so the kernels always run in the interpreter here.
if not os.environ.get("FASTJUDGE_TEST_DEVICE", "cpu").startswith("cuda"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from fastjudge import _engine
from fastjudge.checkpoints import build_random_qwen_vl, build_random_t5
from fastjudge.demo import tokenizer_corpus

#: Where the faithfulness tests run our backends (transformers stays on the CPU in float32):
#: "cpu" here; ``benchmarks/gpu_check.py`` sets FASTJUDGE_TEST_DEVICE=cuda on a GPU machine.
TEST_DEVICE = os.environ.get("FASTJUDGE_TEST_DEVICE", "cpu")
if TEST_DEVICE.startswith("cuda"):
    # float32 must mean float32 for 1e-4 comparisons: no TF32 in matmuls or cuDNN convolutions
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(params=[False, "dots", "tiles"],
                ids=["float32 weights", "bfloat16 dot products", "bfloat16 AMX tiles"])
def bf16_form(request):
    """Each form of the engine's bfloat16 attention (the dot products where the CPU has
    AVX512-BF16; a prompt's products on AMX tiles where it has AMX-BF16 too), the defaults
    restored after. Truthy for both bfloat16 forms."""
    if request.param and not _engine.bf16_dot_products(True):
        pytest.skip("this CPU has no AVX512-BF16")
    if request.param == "tiles" and not _engine.amx_products(True):
        pytest.skip("this CPU has no AMX-BF16 tiles")
    _engine.bf16_dot_products(bool(request.param))
    _engine.amx_products(request.param == "tiles")
    yield request.param
    _engine.bf16_dot_products(True)
    _engine.amx_products(True)


def record_runs(monkeypatch, owner, name: str) -> list[int]:
    """The steps of every run of picking steps from now on: ``owner.name`` (the Qwen
    ``EngineStep.run_picks``, whose picks are [B, n], or T5's ``decode.run_pick_steps``, whose
    picks come first in a pair) wrapped to record each call's n; calls that ran nothing (None)
    record nothing."""
    runs = []
    real = getattr(owner, name)

    def recorded(*args):
        out = real(*args)
        if out is not None:
            runs.append((out[0] if isinstance(out, tuple) else out).shape[1])
        return out

    monkeypatch.setattr(owner, name, recorded)
    return runs


def qwen_layer_steps(backend, monkeypatch, seed: int):
    """A state pool of three rows (256 columns) on a Qwen ``backend`` whose forwards all run the
    layers' own code (the whole-step engine kept out, ``model.engine_step``), and
    ``step(counts, width)``: one forward of random token ids [3, width], row b's first
    ``counts[b]`` real. Returns (pool, step); ``pool.load_rows(0, [None] * 3)`` empties it."""
    from fastjudge.backends.qwen import model as qwen_model

    pool = backend._pool(256)
    monkeypatch.setattr(qwen_model, "engine_step", lambda *args: None)
    rng = np.random.default_rng(seed)

    def step(counts, width):
        tokens = torch.from_numpy(rng.integers(5, 900, size=(len(counts), width)))
        qwen_model.run_step(backend.model, pool, 0, tokens, counts)

    return pool, step


def write_lines(path, lines):
    """A JSONL input file of ``lines`` (each already JSON, or deliberately not)."""
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_rows(path):
    """The rows of a JSONL output file, which must end with a complete line."""
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="session")
def t5_dir(tmp_path_factory):
    """Flan-T5 layout: gated-gelu, separate (untied) LM head, no output rescaling."""
    return build_random_t5(tmp_path_factory.mktemp("flan-t5-tiny"), tokenizer_corpus(), shape="tiny")


@pytest.fixture(scope="session")
def t5_tied_dir(tmp_path_factory):
    """Original-T5 layout: ReLU feed-forward, tied LM head with d_model**-0.5 rescaling."""
    return build_random_t5(tmp_path_factory.mktemp("t5-tied-tiny"), tokenizer_corpus(), shape="tiny",
                           tie_word_embeddings=True, feed_forward_proj="relu", seed=1)


@pytest.fixture(scope="session")
def vl_dir(tmp_path_factory):
    """Multimodal Qwen3.5 (vision tower + preprocessor config) for the image-text judges."""
    return build_random_qwen_vl(tmp_path_factory.mktemp("qwen3_5-vl-tiny"), tokenizer_corpus(), seed=11)


@pytest.fixture(scope="session")
def t5_backend(t5_dir):
    from fastjudge.backends.t5.backend import TorchT5Backend

    return TorchT5Backend(t5_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def lave_judge(t5_backend):
    from fastjudge import LaveJudge

    return LaveJudge(t5_backend)
