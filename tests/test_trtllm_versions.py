"""Which TensorRT-LLM releases serve the judges: one range, both judges on the PyTorch backend.

Versions are faked through ``importlib.metadata.version`` (TensorRT-LLM cannot be installed beside
the CPU torch this suite runs on). The range is the ``trtllm`` extra's (pyproject.toml): from
1.3.0rc22, the first release on the package index whose PyTorch backend runs
``T5ForConditionalGeneration`` (NVIDIA/TensorRT-LLM #13919, first in v1.3.0rc19; rc16 to rc21
are not on the index), to 1.4.0rc1, the newest read.
"""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata
from pathlib import Path

import pytest

from fastjudge.backends import trtllm
from fastjudge.backends.trtllm import TRTLLM_BELOW, TRTLLM_SINCE, trtllm_mismatch


def fake_version(monkeypatch, version):
    def lookup(name):
        if name.replace("-", "_") == "tensorrt_llm":
            if version is None:
                raise metadata.PackageNotFoundError(name)
            return version
        return metadata.version(name)
    monkeypatch.setattr(metadata, "version", lookup)


def fake_qwen3_5_in_transformers(monkeypatch, present: bool):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if present else None) if name == "transformers.models.qwen3_5"
                        else real(name, *a))


def test_the_extra_pins_the_range_the_backend_checks():
    """pyproject.toml's single ``trtllm`` extra and ``backends.trtllm`` name the same range."""
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    extras = re.findall(r"^(trtllm[\w-]*) = \[(.*)\]$", text, re.M)
    assert [name for name, _ in extras] == ["trtllm"]
    assert f'"tensorrt_llm>={TRTLLM_SINCE},<{TRTLLM_BELOW}; sys_platform == \'linux\'"' in extras[0][1]


@pytest.mark.parametrize("version, ok", [("1.3.0rc15", False), ("1.3.0rc22", True), ("1.3.0rc22.post1", True),
                                         ("1.3.0rc29", True), ("1.4.0rc1", True), ("1.5.0rc0", False)])
@pytest.mark.parametrize("kind, model_type", [("flan-t5", "t5"), ("qwen3.5", "qwen3_5"), ("qwen3.5", "qwen3")])
def test_one_range_serves_both_judges(monkeypatch, version, ok, kind, model_type):
    fake_version(monkeypatch, version)
    fake_qwen3_5_in_transformers(monkeypatch, True)
    why = trtllm_mismatch(kind, model_type)
    assert (why is None) == ok
    if not ok:
        assert "fastjudge[trtllm]" in why and version in why


def test_qwen3_5_needs_transformers_with_its_model(monkeypatch):
    fake_version(monkeypatch, "1.4.0rc1")
    fake_qwen3_5_in_transformers(monkeypatch, False)
    assert "qwen3_5" in trtllm_mismatch("qwen3.5", "qwen3_5")
    assert trtllm_mismatch("qwen3.5", "qwen3") is None  # plain Qwen3 needs nothing more


def test_not_installed_names_the_extra(monkeypatch):
    fake_version(monkeypatch, None)
    assert "fastjudge[trtllm]" in trtllm_mismatch("flan-t5")


def test_backend_refuses_a_release_outside_the_range(monkeypatch, tmp_path):
    """``TrtllmBackend`` checks the release right after the import, before loading anything."""
    backend = object.__new__(trtllm.TrtllmBackend)
    backend.build_dir, backend.engine_kind = tmp_path, "flan-t5"
    backend.manifest = {"model": {"kind": "flan-t5", "model_type": "t5"}}
    monkeypatch.setattr(trtllm, "import_tensorrt_llm", lambda: None)
    fake_version(monkeypatch, "1.3.0rc15")
    with pytest.raises(trtllm.TensorRTLLMUnavailable, match=r"fastjudge\[trtllm\]"):
        backend._load()
