"""The engine's options are one object, :class:`fastjudge.engine_options.EngineOptions`: declared
once, offered as flags by every command that builds a judge, carried unchanged to the judge and
from it to the backend."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from conftest import TEST_DEVICE

from fastjudge.cli import build_parser
from fastjudge.engine_options import EngineOptions
from fastjudge.judges import registry
from fastjudge.runtime.engine import Engine

JOB = ["--model", "m", "--input", "i", "--output", "o"]
COMMANDS = [["lave", *JOB], ["visexmem", *JOB], ["rescore", *JOB], ["serve", "--model", "m"],
            ["bench", "--judge", "lave", "--model", "m"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_every_command_offers_every_engine_option_with_its_default(argv):
    args = build_parser().parse_args(argv)
    assert registry.engine_options(args) == EngineOptions()


def test_flags_are_generated_from_the_declaration():
    names = [f.name for f in dataclasses.fields(EngineOptions)]
    assert [o.name for o in registry.ENGINE_OPTIONS] == names
    argv = ["rescore", *JOB, "--backend", "trtllm", "--device", "cpu", "--dtype", "float32",
            "--compile", "off", "--max-batch-tokens", "4096", "--max-batch-size", "3",
            "--max-decode-rows", "5", "--max-input-tokens", "900", "--allow-pickle",
            "--no-jump-forward", "--prefix-cache-bytes", "1024", "--decode-cache-bytes", "2048",
            "--no-fp8-gemm", "--gpu-memory-fraction", "0.5"]
    engine = registry.engine_options(build_parser().parse_args(argv))
    assert engine == EngineOptions(
        backend="trtllm", device="cpu", dtype="float32", compile="off", max_batch_tokens=4096,
        max_batch_size=3, max_decode_rows=5, max_input_tokens=900, allow_pickle=True,
        jump_forward=False, prefix_cache_bytes=1024, decode_cache_bytes=2048, fp8_gemm=False,
        gpu_memory_fraction=0.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rescore", *JOB, "--compile", "sometimes"])


def test_the_object_is_frozen_and_checked():
    engine = EngineOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.device = "cpu"
    assert engine.with_(device="cpu").device == "cpu" and engine.device == "auto"
    for bad in (dict(backend="vllm"), dict(compile="yes"), dict(max_batch_size=0),
                dict(max_batch_tokens=0), dict(gpu_memory_fraction=1.5)):
        with pytest.raises(ValueError):
            EngineOptions(**bad)


@pytest.mark.parametrize("name", ["LaveJudge", "VisExJudge", "HolisticJudge"])
def test_judges_take_their_metric_options_plus_engine(name):
    import fastjudge

    params = inspect.signature(getattr(fastjudge, name)).parameters
    assert params["engine"].kind is inspect.Parameter.KEYWORD_ONLY
    engine_names = {f.name for f in dataclasses.fields(EngineOptions)}
    assert not engine_names & set(params), "an engine option is still a judge argument"


def test_engine_reaches_the_judge_and_the_backend(t5_dir):
    from fastjudge.judges.lave import FastjudgeLave, LaveJudge

    engine = EngineOptions(device=TEST_DEVICE, dtype="float32", compile="off", max_batch_size=3,
                           max_batch_tokens=2000, max_decode_rows=2, max_input_tokens=700)
    judge = LaveJudge(t5_dir, num_shots=1, engine=engine)
    assert isinstance(judge.engine, Engine) and judge.options is engine
    assert (judge.max_batch_size, judge.max_batch_tokens) == (3, 2000)
    backend = judge.backend
    assert backend.options is engine  # the options reach the backend whole, never unpacked
    assert (backend.compile, backend.max_decode_rows, backend.max_input_tokens) == ("off", 2, 700)
    assert str(backend.dtype) == "torch.float32"
    assert isinstance(judge.style, FastjudgeLave)
    # an open backend keeps its own settings; the batching limits still come from the engine
    shared = LaveJudge(backend, engine=EngineOptions(max_batch_size=5))
    assert shared.backend is backend and shared.max_batch_size == 5


def test_a_failure_retry_shrinks_the_engine_not_the_judge(t5_backend):
    """``runtime.failures.scaled_budget`` (the retry with smaller batches after an out-of-memory)
    scales the limits of the judge's Engine, which the judge reads, and restores them."""
    from fastjudge.judges.lave import LaveJudge
    from fastjudge.runtime.failures import scaled_budget

    judge = LaveJudge(t5_backend, num_shots=1, engine=EngineOptions(max_batch_size=8, max_batch_tokens=4000))
    with scaled_budget(judge, 0.5):
        assert (judge.engine.max_batch_size, judge.max_batch_tokens) == (4, 2000)
        assert "max_batch_size" not in vars(judge)
    assert (judge.max_batch_size, judge.max_batch_tokens) == (8, 4000)


def test_engine_must_be_the_options_object(t5_backend):
    from fastjudge.judges.lave import LaveJudge

    with pytest.raises(TypeError, match="EngineOptions"):
        LaveJudge(t5_backend, engine={"device": "cpu"})
