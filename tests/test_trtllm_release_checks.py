"""What the trtllm backend reads from the installed TensorRT-LLM before it loads a judge, and how it
reads a Choice's log-probabilities: checked against upstream's source, transcribed.

TensorRT-LLM cannot be installed beside the CPU torch this suite runs on, so the release's
source is given as minimal excerpts (``tests/fixtures/trtllm_t5_sources.json``, which names the
files and commits read) and, for the backend's load path, written out as an importable package of
that source, so that the backend's own ``inspect.getsource`` calls read it as they would read an
installed release.
"""

from __future__ import annotations

import json
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

from fastjudge.backends import trtllm
from fastjudge.backends.trtllm import (
    LONG_LEN_ENV,
    CandidateLogits,
    CandidatesMissing,
    TensorRTLLMUnavailable,
    checked_choice_logprobs,
    release_reads_long_len_env,
    release_t5_max_seq_len,
    rest_token,
    sampling_kwargs,
    t5_length_plan,
    t5_release_defects,
)
from fastjudge.builders.llm_options import limits, llm_options
from fastjudge.runtime.requests import Choice, Request, choice_probs

SOURCES = json.loads((Path(__file__).parent / "fixtures" / "trtllm_t5_sources.json").read_text())
KEYS = ("init", "load_weights", "self_attention_init", "self_attention_forward", "cross_attention_init")


def _sources(version: str) -> dict:
    return {k: SOURCES[version][k] for k in KEYS}


# --------------------------------------------------------------------------------------------
# item 3: a release whose T5 computes another model than the checkpoint's is refused

def test_first_merge_t5_is_refused_for_each_defect_and_the_fixed_file_passes():
    """NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/models/modeling_t5.py``: the first-merge file
    (commit 289b3768, #13919) ties ``lm_head`` to the embedding in ``__init__`` and never unties
    it in ``load_weights``; builds ``T5Attention`` / ``T5CrossAttention`` with ``q_scaling=1.0``
    (the backends scale scores by 1/(sqrt(head_dim) * q_scaling), T5 by nothing); and returns to
    the base attention without the relative bias once ``kv_cache_manager`` is set. The later file
    (commit e18ea371: ``_t5_q_scaling`` = 1/sqrt(d_kv), ``lm_head`` re-created when the checkpoint has
    ``lm_head.weight``, the bias table passed with the cache) has none of them."""
    first = t5_release_defects(_sources("first_merge"), config_ties=True)
    assert len(first) == 3
    assert "lm_head" in first[0] and "q_scaling=1.0" in first[1] and "relative position bias" in first[2]
    # the untie only matters where the checkpoint's config ties (transformers 5 always does)
    assert len(t5_release_defects(_sources("first_merge"), config_ties=False)) == 2
    assert t5_release_defects(_sources("fixed"), config_ties=True) == []


def test_transformers_5_ties_flan_t5_configs(t5_dir):
    """The tie flag the release sees is the installed transformers' ``T5Config`` of the
    checkpoint: transformers 5 forces ``tie_word_embeddings=True`` for T5 even where the
    checkpoint (Flan-T5 layout, untied) says false; the backend passes exactly that to
    :func:`t5_release_defects`."""
    from transformers import T5Config

    config = json.loads((t5_dir / "config.json").read_text())
    assert config.get("tie_word_embeddings") is False
    ties = T5Config.from_dict(config).tie_word_embeddings
    if int(__import__("transformers").__version__.split(".")[0]) >= 5:
        assert ties is True


# --------------------------------------------------------------------------------------------
# item 2: the T5 512-token max_seq_len

def test_release_t5_limit_and_the_variable_are_read_from_the_source():
    """``T5ForConditionalGeneration.infer_max_seq_len`` returns 512 (modeling_t5.py, both
    versions); ``PyTorchModelEngine._init_max_seq_len`` (model_engine.py, commit 1a0dc5f7) keeps a
    larger ``max_seq_len`` only under ``TLLM_ALLOW_LONG_MAX_MODEL_LEN``, else clamps to it."""
    assert release_t5_max_seq_len(SOURCES["first_merge"]["infer_max_seq_len"]) == 512
    assert release_t5_max_seq_len("class X:\n    def forward(self):\n        return 3\n") is None
    assert release_reads_long_len_env(SOURCES["model_engine"]["reads_env"])
    assert not release_reads_long_len_env(SOURCES["model_engine"]["clamps"])


@pytest.mark.parametrize("rationale", [False, True])
def test_t5_lengths_above_the_limit_set_the_variable_or_are_capped(rationale):
    """A build's options above 512 (8-shot LAVE prompts are longer): kept, with the variable,
    where the release reads it; else ``max_seq_len`` 512 and the encoder input cut by the
    decoder tokens, encoder graph lengths to match, every other option unchanged."""
    new = 100 if rationale else 1
    options = llm_options("flan-t5", "t5", limits(768, new, 16, 600, decoder_prefix=1))
    assert options["max_seq_len"] == 768 + 1 + new > 512
    assert t5_length_plan(options, 512, reads_env=True) == (True, options)
    set_env, capped = t5_length_plan(options, 512, reads_env=False)
    assert not set_env and capped["max_seq_len"] == 512 and capped["max_input_len"] == 512 - 1 - new
    assert capped["encoder_cuda_graph_config"]["seq_lens"][-1] == capped["max_input_len"]
    assert all(n <= capped["max_input_len"] for n in capped["encoder_cuda_graph_config"]["seq_lens"])
    assert {k: v for k, v in capped.items() if k not in ("max_seq_len", "max_input_len",
                                                          "encoder_cuda_graph_config")} == \
        {k: v for k, v in options.items() if k not in ("max_seq_len", "max_input_len", "encoder_cuda_graph_config")}
    short = llm_options("flan-t5", "t5", limits(384, 1, 16, 200, decoder_prefix=1))
    assert t5_length_plan(short, 512, reads_env=False) == (False, short)
    assert t5_length_plan(options, None, reads_env=False) == (False, options)
    with pytest.raises(TensorRTLLMUnavailable, match="decoder tokens"):
        t5_length_plan({**options, "max_input_len": 10, "max_seq_len": 700}, 512, reads_env=False)


# --------------------------------------------------------------------------------------------
# the load path, reading a release's source as installed

def _write_release(root: Path, version: str, engine: str) -> None:
    """An importable ``tensorrt_llm`` whose T5 and model-engine methods are the fixture's
    excerpts (their bodies never run: the backend only reads their source)."""
    src = SOURCES[version]
    pkg = root / "tensorrt_llm"
    (pkg / "_torch" / "models").mkdir(parents=True)
    (pkg / "_torch" / "pyexecutor").mkdir(parents=True)
    (pkg / "llmapi").mkdir()
    (pkg / "__init__.py").write_text("class SamplingParams:\n    def __init__(self, **kw):\n        self.kw = kw\n")
    (pkg / "llmapi" / "__init__.py").write_text("class GuidedDecodingParams:\n    def __init__(self, **kw):\n"
                                                "        self.kw = kw\n")
    for sub in ("_torch", "_torch/models", "_torch/pyexecutor"):
        (pkg / sub / "__init__.py").write_text("")

    def method(text):
        return textwrap.indent(text, "    ")

    (pkg / "_torch" / "models" / "modeling_t5.py").write_text(
        "class T5Attention:\n" + method(src["self_attention_init"]) + method(src["self_attention_forward"])
        + "\n\nclass T5CrossAttention:\n" + method(src["cross_attention_init"])
        + "\n\nclass T5ForConditionalGeneration:\n" + method(src["init"]) + method(src["load_weights"])
        + method(src["infer_max_seq_len"]) + "\n\n" + src["convert"])
    (pkg / "_torch" / "pyexecutor" / "model_engine.py").write_text(
        "import os\n\n\nclass PyTorchModelEngine:\n" + method(SOURCES["model_engine"][engine]))


@pytest.fixture
def release(tmp_path, monkeypatch):
    """Install one of the fixture's releases (as version 1.4.0rc1) for the test's duration."""
    def install(version: str, engine: str = "reads_env"):
        _write_release(tmp_path / version, version, engine)
        monkeypatch.syspath_prepend(str(tmp_path / version))
        for name in [m for m in sys.modules if m.split(".")[0] == "tensorrt_llm"]:
            monkeypatch.delitem(sys.modules, name)
        real = metadata.version
        monkeypatch.setattr(metadata, "version",
                            lambda name: "1.4.0rc1" if name.replace("-", "_") == "tensorrt_llm" else real(name))
    yield install
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorrt_llm"]:
        del sys.modules[name]


def _t5_backend(t5_dir, max_input=768, new=1):
    """A T5 ``TrtllmBackend`` as ``__init__`` leaves it before ``_load`` (build options of a
    768-token judge, the checkpoint's real config)."""
    b = object.__new__(trtllm.TrtllmBackend)
    b.build_dir, b.checkpoint_dir, b.engine_kind, b.kind = t5_dir, t5_dir, "flan-t5", "encoder-decoder"
    b.manifest = {"model": {"kind": "flan-t5", "model_type": "t5"}, "quantization": {"algo": None}}
    b.options = llm_options("flan-t5", "t5", limits(max_input, new, 16, 600, decoder_prefix=1))
    b.max_input_tokens, b.logit_scale, b.choice_from_logits, b._llm = max_input, 1.0, False, None
    b.eos_token_ids = {1}
    return b


def test_backend_refuses_the_first_merge_t5_naming_the_fix(t5_dir, release):
    release("first_merge")
    with pytest.raises(TensorRTLLMUnavailable) as refused:
        _t5_backend(t5_dir)._t5_compat()
    why = str(refused.value)
    assert "TensorRT-LLM 1.4.0rc1" in why and "_t5_q_scaling" in why and "torch backend" in why
    assert why.count(";") >= 2  # all three defects named


def test_backend_accepts_the_fixed_t5_and_undoes_its_logit_scale(t5_dir, release):
    release("fixed")
    b = _t5_backend(t5_dir)
    b._t5_compat()
    d_model = json.loads((t5_dir / "config.json").read_text())["d_model"]
    assert b.logit_scale == pytest.approx(d_model ** 0.5)


def test_backend_sets_the_variable_where_the_release_reads_it(t5_dir, release, monkeypatch):
    monkeypatch.delenv(LONG_LEN_ENV, raising=False)
    release("fixed", engine="reads_env")
    b = _t5_backend(t5_dir)
    b._t5_lengths()
    import os

    assert os.environ[LONG_LEN_ENV] == "1" and b.max_input_tokens == 768 and b.options["max_seq_len"] == 770


def test_backend_caps_t5_prompts_where_the_release_clamps(t5_dir, release, monkeypatch):
    """No variable to set: prompts are capped at the release's limit and a longer one is
    refused with a message, never handed to a release that would clamp under it."""
    monkeypatch.delenv(LONG_LEN_ENV, raising=False)
    release("fixed", engine="clamps")
    b = _t5_backend(t5_dir)
    b._t5_lengths()
    import os

    assert LONG_LEN_ENV not in os.environ
    assert b.max_input_tokens == 510 and b.options["max_seq_len"] == 512

    class NoCall:
        def generate(self, *a, **k):
            raise AssertionError("a too-long prompt reached the LLM")
    b._llm = NoCall()
    with pytest.raises(ValueError, match="511 tokens is longer than this judge's 510"):
        b.run([Request(index=0, prompt_ids=list(range(3, 514)), spec=Choice((5, 9)))])


# --------------------------------------------------------------------------------------------
# item 6: the log-probabilities must come from the restricted row

def _returned(row: torch.Tensor, n: int) -> dict:
    """What the LLM API returns for one step given ``logprobs=n``: the ``n`` largest entries of
    the log-softmax of the row the sampler saw (``{token id: Logprob}``; tensorrt_llm
    ``executor/result.py``)."""
    lp = torch.log_softmax(row.double(), -1)
    top = torch.topk(lp, n)
    return {int(t): type("Logprob", (), {"logprob": float(v), "rank": r + 1})()
            for r, (v, t) in enumerate(zip(top.values, top.indices))}


@pytest.mark.parametrize("full_vocab", [False, True])
def test_restricted_rows_pass_and_give_the_choice(full_vocab):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(200, generator=g) * 3
    spec = Choice((7, 20, 41), full_vocab=full_vocab)
    kw = sampling_kwargs(spec, {1})
    assert kw["logprobs"] == 3 + full_vocab + 1  # one probe slot beyond what can be finite
    row = logits.clone()
    kw["logits_processor"](0, row, [[3]], None, None)
    z = checked_choice_logprobs(Request(index=0, prompt_ids=[3], spec=spec), _returned(row, kw["logprobs"]))
    if full_vocab:
        assert np.allclose(z, torch.log_softmax(logits.double(), -1)[[7, 20, 41]].numpy(), atol=1e-9)
    else:
        assert np.allclose(np.exp(z), choice_probs(logits[[7, 20, 41]].numpy()), atol=1e-9)


def test_unrestricted_rows_fail_even_when_the_candidates_lead():
    """A trained judge puts its candidates at the top of the raw row, so a release that took the
    log-probabilities before the processor would return them all: the probe slot comes back
    finite, and without it their log-sum-exp is below 0."""
    logits = torch.full((200,), -2.0)
    logits[[7, 20, 41]] = torch.tensor([6.0, 5.0, 4.0])  # the candidates hold ~97 % of the mass
    req = Request(index=0, prompt_ids=[3], spec=Choice((7, 20, 41)))
    with pytest.raises(CandidatesMissing, match="4 finite log-probabilities where the logits processor leaves"):
        checked_choice_logprobs(req, _returned(logits, 4))
    with pytest.raises(CandidatesMissing, match="not 0"):
        checked_choice_logprobs(req, _returned(logits, 3))
    with pytest.raises(CandidatesMissing, match=r"candidate ids \[41\]"):
        checked_choice_logprobs(req, _returned(logits, 2))
    # T5 logits without the sqrt(d_model) undo but restricted still sum to one: scale is not what
    # this check sees; t5_logit_scale does (test_trtllm_contract.py)
    row = logits.clone()
    CandidateLogits((7, 20, 41), scale=0.125)(0, row, [[3]], None, None)
    checked_choice_logprobs(req, _returned(row, 4))


def test_full_vocab_needs_the_rest_entry():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(4))
    spec = Choice((0, 2, 17), full_vocab=True)
    row = logits.clone()
    CandidateLogits(spec.token_ids, rest_token(spec.token_ids))(0, row, [[3]], None, None)
    got = _returned(row, 5)
    checked_choice_logprobs(Request(index=0, prompt_ids=[3], spec=spec), got)
    del got[rest_token(spec.token_ids)]
    with pytest.raises(CandidatesMissing, match="finite"):
        checked_choice_logprobs(Request(index=0, prompt_ids=[3], spec=spec), got)


def test_run_falls_back_to_generation_logits_when_the_processor_is_ignored(t5_dir, release):
    """A release that ignores the logits processor for the returned log-probabilities: the first
    batch is read again from the generation logits, and so is every later one."""
    release("fixed")
    logits = torch.full((1, 64), -2.0)
    logits[0, [5, 9]] = torch.tensor([4.0, 3.0])

    class Out:
        def __init__(self, kw):
            self.logprobs = [_returned(logits[0], kw["logprobs"])] if "logprobs" in kw else None
            self.generation_logits = logits if kw.get("return_generation_logits") else None

    class IgnoresProcessor:
        calls = 0

        def generate(self, prompts, params, use_tqdm=False):
            IgnoresProcessor.calls += 1
            return [type("R", (), {"outputs": [Out(p.kw)]})() for p in params]

    b = _t5_backend(t5_dir)
    b._llm = IgnoresProcessor()
    req = Request(index=0, prompt_ids=[3, 4], spec=Choice((5, 9)))
    out = b.run([req])[0]
    assert b.choice_from_logits and IgnoresProcessor.calls == 2
    assert np.allclose(out.probs, choice_probs(np.array([4.0, 3.0])))


# --------------------------------------------------------------------------------------------
# item 7: close() shuts the LLM down

def test_close_shuts_the_llm_down_once(t5_dir):
    class LLM:
        shutdowns = 0

        def shutdown(self):
            LLM.shutdowns += 1

    b = _t5_backend(t5_dir)
    b._llm = LLM()
    with b:
        pass
    b.close()
    assert LLM.shutdowns == 1 and b._llm is None
    with pytest.raises(RuntimeError, match="load_engine=False"):
        b.run([])


# --------------------------------------------------------------------------------------------
# item 4: Qwen3.5 FP8 exclusions in TensorRT-LLM's own module names

@pytest.mark.parametrize("vl", [False, True])
def test_qwen3_5_exclusions_in_upstream_names(tmp_path, vl):
    """NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/models/modeling_qwen3_next.py`` (commit b93e14ca)
    builds the Gated DeltaNet's ``conv1d`` as a ``Linear`` with the model's global quant config,
    and its Qwen3.5 weight mapper packs ``in_proj_qkv``/``in_proj_z`` into ``in_proj_qkvz`` and
    ``in_proj_a``/``in_proj_b`` into ``in_proj_ba``; ``_normalize_qwen35_exclude_modules``
    (``modeling_qwen3_5.py``, commit 2478158c) maps the checkpoint's names onto
    ``model.layers.N.linear_attn.in_proj_qkvz*`` / ``in_proj_ba*`` after dropping
    ``model.language_model.``, and passes ``conv1d`` through untranslated. So every Gated DeltaNet
    layer of a real (tiny) Qwen3.5 gets ``model.layers.N.linear_attn.conv1d`` and the packed names
    in ``hf_quant_config.json``, beside the checkpoint's own names, which stay first."""
    from fastjudge.builders import qwen3_5 as q35
    from fastjudge.builders.fp8_export import quant_declarations
    from fastjudge.checkpoints import build_random_qwen, build_random_qwen_vl
    from fastjudge.demo import tokenizer_corpus

    build = build_random_qwen_vl if vl else build_random_qwen
    model_dir = build(tmp_path / "q", tokenizer_corpus(), seed=3)
    cfg = json.loads((model_dir / "config.json").read_text())
    model = q35.hf_model(str(model_dir), cfg["model_type"], torch.float32)
    blocks = [n for n, _ in model.named_modules() if n.endswith(".linear_attn")]
    assert blocks and all(type(m.conv1d).__name__ == "Conv1d" for n, m in model.named_modules()
                          if n.endswith(".linear_attn"))
    hf = [f"{b}.{p}" for b in blocks for p in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")] + ["lm_head"]
    engine = q35.trtllm_exclude_modules(hf, blocks)
    text_cfg = cfg.get("text_config", cfg)
    gdn = [i for i, kind in enumerate(text_cfg["layer_types"]) if kind == "linear_attention"]
    packed = ("conv1d", "in_proj_qkvz", "in_proj_ba")
    assert engine == [f"model.layers.{i}.linear_attn.{p}" for i in gdn for p in packed]
    assert q35.trtllm_exclude_modules([], blocks) == [f"model.layers.{i}.linear_attn.conv1d" for i in gdn]
    hf_quant, inline = quant_declarations(True, hf, {"name": "fastjudge"}, engine)
    assert hf_quant["quantization"]["exclude_modules"] == hf + engine
    assert inline["ignore"] == hf  # the checkpoint's own declaration keeps the checkpoint's names
    # what upstream's normalizer makes of the list: every module it must exclude is matched
    import fnmatch
    import re

    def upstream_normalized(names):  # the translation rules of _normalize_qwen35_exclude_modules
        out = set()
        for name in names:
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            if name.startswith("model.visual"):
                continue
            name = re.sub(r"\.in_proj_[ab](\b|\*)", ".in_proj_ba*", name)
            name = re.sub(r"\.in_proj_(q|k|v|z|qkv)(\b|\*)", ".in_proj_qkvz*", name)
            out.add(name)
        return out

    for names in (upstream_normalized(hf_quant["quantization"]["exclude_modules"]),
                  set(hf_quant["quantization"]["exclude_modules"])):  # releases without the normalizer
        for i in gdn:
            for mod in ("conv1d", "in_proj_qkvz", "in_proj_ba"):
                assert any(fnmatch.fnmatch(f"model.layers.{i}.linear_attn.{mod}", p) for p in names), (i, mod)
