"""Which TensorRT-LLM release serves which judge, and Qwen3.5's prefix-reuse settings per release.

Versions are faked through ``importlib.metadata.version`` (TensorRT-LLM cannot be installed beside
the CPU torch this suite runs on). The KV cache fakes transcribe NVIDIA/TensorRT-LLM
``tensorrt_llm/llmapi/llm_args.py``, ``KvCacheConfig`` (a pydantic model that forbids unknown
fields, as upstream's ``StrictBaseModel`` does) in its three shapes: with the nested
``mamba_state_config`` (``MambaStateConfig``: ``periodic_snapshot_interval``,
``additional_snapshot_offsets_from_start`` / ``_from_end``; upstream PR #16598, which disables
block reuse for hybrid models without a snapshot policy), with the flat
``mamba_state_cache_interval`` (upstream PR #12896), and with neither (older releases).
"""

from __future__ import annotations

import importlib.util
from importlib import metadata
from typing import List, Optional

import pytest
from pydantic import BaseModel, ConfigDict

from fastjudge.backends import trtllm
from fastjudge.backends.trtllm import kv_cache_config, trtllm_mismatch


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FakeMambaStateConfig(_Strict):
    periodic_snapshot_interval: int = 0
    additional_snapshot_offsets_from_start: List[int] = []
    additional_snapshot_offsets_from_end: List[int] = []


class _KvBase(_Strict):
    enable_block_reuse: bool = True
    free_gpu_memory_fraction: Optional[float] = 0.9
    tokens_per_block: int = 32


class KvCacheConfigNested(_KvBase):
    mamba_state_config: FakeMambaStateConfig = FakeMambaStateConfig()


class KvCacheConfigFlat(_KvBase):
    mamba_state_cache_interval: int = 256


class KvCacheConfigOld(_KvBase):
    pass


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


@pytest.mark.parametrize("version, ok", [("1.2.1", True), ("1.3.0rc8", True), ("1.3.0rc15", True),
                                         ("1.3.0rc22", False), ("1.4.0rc1", False)])
def test_flan_t5_needs_the_tensorrt_backend(monkeypatch, version, ok):
    fake_version(monkeypatch, version)
    why = trtllm_mismatch("flan-t5", "t5")
    assert (why is None) == ok
    if not ok:
        assert "fastjudge[trtllm-t5]" in why and version in why


@pytest.mark.parametrize("version, has_qwen3_5, ok", [
    ("1.3.0rc8", True, False),     # no Qwen3.5 model in the PyTorch backend yet
    ("1.3.0rc12", False, False),   # the model, but transformers 4.57.3 (no qwen3_5)
    ("1.3.0rc15", True, True),
    ("1.4.0rc1", True, True),
])
def test_qwen3_5_needs_its_model_and_transformers(monkeypatch, version, has_qwen3_5, ok):
    fake_version(monkeypatch, version)
    fake_qwen3_5_in_transformers(monkeypatch, has_qwen3_5)
    why = trtllm_mismatch("qwen3.5", "qwen3_5")
    assert (why is None) == ok
    if not ok:
        assert "fastjudge[trtllm-qwen]" in why
    assert trtllm_mismatch("qwen3.5", "qwen3") is None  # plain Qwen3 runs on any release


def test_not_installed_names_the_extra(monkeypatch):
    fake_version(monkeypatch, None)
    assert "fastjudge[trtllm-t5]" in trtllm_mismatch("flan-t5")
    assert "fastjudge[trtllm-qwen]" in trtllm_mismatch("qwen3.5", "qwen3_5")


def test_build_skips_engines_naming_the_environment(monkeypatch):
    """``fastjudge build``'s TensorRT-LLM stages say which environment the judge needs."""
    from fastjudge.builders import pipeline

    monkeypatch.setattr(pipeline.torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "tensorrt_llm" else real(name, *a))
    monkeypatch.setattr("shutil.which", lambda name: "/bin/" + name)
    fake_version(monkeypatch, "1.4.0rc1")
    assert "fastjudge[trtllm-t5]" in pipeline.cuda_and_trtllm(needs_trtllm_build=True, kind="flan-t5")
    fake_version(monkeypatch, "1.3.0rc15")
    assert pipeline.cuda_and_trtllm(needs_trtllm_build=True, kind="flan-t5") is None


def test_backend_refuses_a_release_that_cannot_serve_the_judge(monkeypatch, tmp_path):
    """``TrtllmBackend`` checks the release right after the import, before loading anything."""
    backend = object.__new__(trtllm.TrtllmBackend)
    backend.build_dir, backend.engine_kind = tmp_path, "flan-t5"
    backend.manifest = {"model": {"kind": "flan-t5", "model_type": "t5"}}
    monkeypatch.setattr(trtllm, "import_tensorrt_llm", lambda kind=None: None)
    fake_version(monkeypatch, "1.3.0rc23")
    with pytest.raises(trtllm.TensorRTLLMUnavailable, match=r"fastjudge\[trtllm-t5\]"):
        backend._load_engine({}, {}, 0.5)


@pytest.mark.parametrize("cls", [KvCacheConfigNested, KvCacheConfigFlat, KvCacheConfigOld])
def test_qwen3_5_prefix_reuse_per_release(cls):
    config, reuse = kv_cache_config(cls, "qwen3_5", 0.8)
    assert isinstance(config, cls) and config.free_gpu_memory_fraction == 0.8
    assert config.enable_block_reuse == reuse == (cls is not KvCacheConfigOld)
    if cls is KvCacheConfigNested:
        assert config.mamba_state_config.periodic_snapshot_interval == trtllm.SNAPSHOT_INTERVAL
    if cls is KvCacheConfigFlat:
        assert config.mamba_state_cache_interval == trtllm.SNAPSHOT_INTERVAL
    assert trtllm.SNAPSHOT_INTERVAL % config.tokens_per_block == 0  # snapshots fall on block edges


@pytest.mark.parametrize("cls", [KvCacheConfigNested, KvCacheConfigFlat, KvCacheConfigOld])
def test_plain_qwen3_reuses_blocks_without_snapshots(cls):
    config, reuse = kv_cache_config(cls, "qwen3", 0.8)
    assert reuse and config.enable_block_reuse
    assert config.model_fields_set == {"enable_block_reuse", "free_gpu_memory_fraction"}
