"""The trtllm backend's calls into TensorRT-LLM's LLM API, checked against the release's argument
names (TensorRT-LLM cannot be installed beside the CPU torch this suite runs on).

``tests/fixtures/trtllm_api.json`` transcribes, from NVIDIA/TensorRT-LLM for the pinned range
v1.3.0rc22 to v1.4.0rc1, the fields of ``TorchLlmArgs`` and its nested configs
(``tensorrt_llm/llmapi/llm_args.py``), of ``SamplingParams`` / ``GuidedDecodingParams`` and the
``LogitsProcessor.__call__`` parameters (``tensorrt_llm/sampling_params.py``), and of
``CompletionOutput`` / ``Logprob`` (``tensorrt_llm/executor/result.py``); the file names the
snapshots read. Upstream's configs are pydantic models that forbid unknown fields
(``StrictBaseModel``) and ``SamplingParams`` is a keyword-only dataclass, so any name outside
these lists fails there; here it fails first.

What is exercised for real: the options file of real builds, the request mapping of real judge
specs, and :class:`CandidateLogits` on real logits tensors (its arithmetic is what makes the
returned log-probabilities exact).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fastjudge.backends.trtllm import (
    NEWER_OPTIONS,
    CandidateLogits,
    ManifestError,
    choice_output,
    llm_kwargs,
    rest_token,
    sampling_kwargs,
    text_output,
)
from fastjudge.builders.llm_options import cross_kv_fraction, graph_batch_sizes, limits, llm_options
from fastjudge.runtime.grammar import Json
from fastjudge.runtime.requests import Choice, Request, Text, choice_probs

API = json.loads((Path(__file__).parent / "fixtures" / "trtllm_api.json").read_text())
NESTED = {"cuda_graph_config": "CudaGraphConfig", "encoder_cuda_graph_config": "EncodeCudaGraphConfig",
          "torch_compile_config": "TorchCompileConfig", "kv_cache_config": "KvCacheConfig"}


def _check_options(options: dict) -> None:
    fields = set(API["TorchLlmArgs"]["fields"])
    assert set(options) <= fields, set(options) - fields
    for name, cls in NESTED.items():
        if name in options:
            assert set(options[name]) <= set(API[cls]), (name, set(options[name]) - set(API[cls]))
    assert options["attn_backend"] in API["TorchLlmArgs"]["attn_backend"]
    if "guided_decoding_backend" in options:
        assert options["guided_decoding_backend"] in API["TorchLlmArgs"]["guided_decoding_backend"]


@pytest.mark.parametrize("kind, model_type", [("flan-t5", "t5"), ("qwen3.5", "qwen3_5_text"), ("qwen3.5", "qwen3")])
@pytest.mark.parametrize("rationale", [False, True])
def test_options_use_only_release_argument_names(kind, model_type, rationale):
    lim = limits(700, 100 if rationale else 1, 64, 600, decoder_prefix=1 if kind == "flan-t5" else 0)
    options = llm_options(kind, model_type, lim)
    _check_options(options)
    assert options["max_seq_len"] == lim["max_seq_len"] >= lim["max_input_len"] + lim["max_new_tokens"]
    assert options["max_num_tokens"] >= options["max_input_len"]  # a whole prompt fits one batch
    assert options["cuda_graph_config"]["batch_sizes"][-1] == options["max_batch_size"]
    assert "torch_compile_config" not in options  # opt-in (test_torch_compile_is_opt_in)
    kv = options["kv_cache_config"]
    if kind == "flan-t5":
        assert options["attn_backend"] == "TRTLLM" and options["enable_chunked_prefill"] is False
        assert 0.5 < kv["cross_kv_cache_fraction"] < 1 and kv["enable_block_reuse"] is False
        graphs = options["encoder_cuda_graph_config"]
        assert graphs["seq_lens"][-1] == 700
        assert graphs["num_tokens"] and graphs["num_tokens"][-1] == options["max_num_tokens"]
    else:
        assert "cross_kv_cache_fraction" not in kv and options["guided_decoding_backend"] == "xgrammar"
        # Qwen3.5: KV-cache reuse is listed unsupported (docs/source/models/supported-models.md)
        assert kv["enable_block_reuse"] is (model_type == "qwen3")


def test_the_options_of_real_builds_use_release_names(tmp_path):
    """The options files ``fastjudge build`` writes (tests/test_builders.py checks the builds;
    here a written file is read back as the backend reads it)."""
    from fastjudge.backends.trtllm import read_llm_options
    from fastjudge.builders.llm_options import write_llm_options

    write_llm_options(tmp_path, llm_options("flan-t5", "t5", limits(256, 1, 8, 100, decoder_prefix=1)))
    _check_options(read_llm_options(tmp_path))


@pytest.mark.parametrize("max_input, batch", [(256, 8), (700, 64), (1536, 16)])
def test_t5_encoder_graph_config_has_token_and_length_buckets(max_input, batch):
    """NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/pyexecutor/engine/runners/encoder.py`` (commit
    a13147e7), ``EncoderConfigMixin.create``: for a model without a feature-mode graph spec (T5)
    the encoder graph config goes through ``validate_token_encoder_bucket_config(num_tokens,
    seq_lens, stays_eager=not is_encoder_decoder)`` (``tensorrt_llm/llmapi/llm_args.py``, commit
    00043967: a complaint when either list is empty), raised as a ``ValueError`` for an
    encoder-decoder model; graphs are built only when both the ``num_tokens`` and the
    ``seq_lens`` buckets survive filtering (``_filter_cuda_graph_num_tokens``: values up to
    ``max_num_tokens``; ``_filter_cuda_graph_seq_lens``: up to ``max_seq_len``; with padding one
    larger value is clamped to the limit). ``EncodeCudaGraphConfig`` (same llm_args.py) takes
    both as lists of positive ints and sorts them. The options give both, ascending, every
    bucket within its limit, the last at it, so nothing is dropped or clamped; without
    ``num_tokens`` (the options before this was fixed) the validator complains."""

    def upstream_complaint(graphs: dict) -> str | None:  # validate_token_encoder_bucket_config's rule
        missing = [k for k in ("num_tokens", "seq_lens") if not graphs.get(k)]
        return f"encoder CUDA graph configuration has {missing} unset" if missing else None

    options = llm_options("flan-t5", "t5", limits(max_input, 1, batch, max_input - 100, decoder_prefix=1))
    graphs = options["encoder_cuda_graph_config"]
    _check_options(options)
    assert upstream_complaint(graphs) is None
    assert upstream_complaint({k: v for k, v in graphs.items() if k != "num_tokens"}) is not None
    assert all(isinstance(n, int) and n > 0 for n in graphs["num_tokens"] + graphs["seq_lens"])
    for key, limit in (("num_tokens", options["max_num_tokens"]), ("seq_lens", options["max_seq_len"])):
        values = graphs[key]
        assert values and values == sorted(set(values)) and values[0] > 0 and values[-1] <= limit, key
    assert graphs["num_tokens"][-1] == options["max_num_tokens"]
    assert graphs["seq_lens"][-1] == options["max_input_len"]
    assert graphs["num_tokens"][0] <= graphs["seq_lens"][0]  # one shortest sequence fits the smallest bucket
    assert "encoder_cuda_graph_config" not in llm_options("qwen3.5", "qwen3_5_text", limits(700, 1, 8, 600))


@pytest.mark.parametrize("kind, model_type", [("flan-t5", "t5"), ("qwen3.5", "qwen3_5_text")])
def test_torch_compile_is_opt_in(kind, model_type):
    """Upstream's encoder-decoder examples set no ``torch_compile_config``
    (``docs/source/models/encoder-decoder.md``) and ``docs/source/models/supported-models.md``
    does not list torch.compile for the hybrid Qwen3.5 rows: off unless asked for, and then with
    full graphs, no inductor, no piecewise CUDA graphs."""
    lim = limits(700, 1, 8, 600, decoder_prefix=1 if kind == "flan-t5" else 0)
    assert "torch_compile_config" not in llm_options(kind, model_type, lim)
    on = llm_options(kind, model_type, lim, torch_compile=True)
    _check_options(on)
    assert on["torch_compile_config"] == {"enable_fullgraph": True, "enable_inductor": False,
                                          "enable_piecewise_cuda_graph": False}


def test_cross_pool_share_follows_the_token_budgets():
    """Cross pool: the encoder tokens of a request; self pool: its decoder tokens; both in
    32-token blocks."""
    assert cross_kv_fraction(640, 2) == pytest.approx(640 / 672, abs=1e-4)
    assert cross_kv_fraction(512, 101) == pytest.approx(512 / 640, abs=1e-4)
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64] and graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


def test_llm_kwargs_refuses_unknown_names_and_leaves_out_newer_ones():
    declared = set(API["TorchLlmArgs"]["fields"]) - set(API["TorchLlmArgs"]["newer"])
    options = llm_options("flan-t5", "t5", limits(256, 1, 8, 100, decoder_prefix=1))
    kwargs, left_out = llm_kwargs(options, declared)
    assert set(left_out) == {"encoder_cuda_graph_config", "encoder_max_batch_size"} <= set(NEWER_OPTIONS)
    assert set(kwargs) == set(options) - set(left_out)
    kwargs, left_out = llm_kwargs(options, set(API["TorchLlmArgs"]["fields"]))
    assert kwargs == options and not left_out
    with pytest.raises(ManifestError, match="max_batch_sise"):
        llm_kwargs({**options, "max_batch_sise": 8}, declared)


# --------------------------------------------------------------------------------------------
# requests

EOS = {1, 7}


@pytest.mark.parametrize("spec", [Choice((5, 9, 11)), Choice((5, 9, 11), full_vocab=True), Text(20),
                                  Text(20, track_ids=(5, 9)),
                                  Json.from_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                    "required": ["ok"]}, 40)])
def test_sampling_kwargs_use_only_release_argument_names(spec):
    kw = sampling_kwargs(spec, EOS)
    assert set(kw) <= set(API["SamplingParams"]), set(kw) - set(API["SamplingParams"])
    if isinstance(spec, Choice):
        # K (+ the rest entry) finite, plus one probe slot (test_trtllm_release_checks.py)
        assert kw["max_tokens"] == 1 and kw["logprobs"] == len(spec.token_ids) + spec.full_vocab + 1
        assert "top_k" not in kw and "return_generation_logits" not in kw  # nothing vocabulary-wide comes back
        params = [p for p in inspect.signature(kw["logits_processor"].__call__).parameters]
        assert params == API["LogitsProcessor.__call__"]
    else:
        assert kw["top_k"] == 1 and kw["end_id"] == 1 and kw["stop_token_ids"] == [7]
        assert kw["max_tokens"] == spec.max_new_tokens
    if isinstance(spec, Text):
        assert kw["return_generation_logits"] is bool(spec.track_ids)
    if isinstance(spec, Json):
        assert set(kw["guided_decoding"]) <= set(API["GuidedDecodingParams"])


def test_json_maps_to_the_torch_paths_grammar():
    """Guided decoding gets the grammar the torch path compiles (runtime.grammar), as EBNF."""
    xgr = pytest.importorskip("xgrammar")
    from fastjudge.runtime.grammar import SEPARATORS

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = Json.from_schema(schema, 40)
    ebnf = sampling_kwargs(spec, EOS)["guided_decoding"]["grammar"]
    assert ebnf == str(xgr.Grammar.from_json_schema(spec.schema, any_whitespace=False, separators=SEPARATORS,
                                                    strict_mode=True))
    assert "root ::=" in ebnf


def test_unknown_spec_is_refused():
    with pytest.raises(NotImplementedError):
        sampling_kwargs(object(), EOS)


def _processed(logits: torch.Tensor, processor: CandidateLogits) -> torch.Tensor:
    row = logits.clone()
    processor(0, row, [[3, 4]], None, None)
    return torch.log_softmax(row.double(), dim=-1)


@pytest.mark.parametrize("shape", [(50,), (1, 50), (1, 1, 50)])
def test_candidate_logits_give_the_choice_probabilities(shape):
    """Restricted to the K ids, the row's log-softmax at them is the log of the Choice's
    renormalised probabilities, and nothing else keeps any mass."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(shape, generator=g) * 4
    ids = (5, 9, 11)
    out = _processed(logits, CandidateLogits(ids)).reshape(-1)
    z = logits.reshape(-1)[list(ids)].numpy()
    assert np.allclose(out[list(ids)].exp().numpy(), choice_probs(z), atol=1e-12)
    assert torch.isinf(out[[i for i in range(50) if i not in ids]]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidate_logits_with_rest_give_full_vocabulary_logprobs(dtype):
    """With the rest entry, the K log-probabilities equal those under the whole vocabulary (to
    the logits' precision)."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(1, 1, 300, generator=g) * 3).to(dtype)
    ids = (0, 2, 17)
    rest = rest_token(ids)
    assert rest == 1
    out = _processed(logits, CandidateLogits(ids, rest)).reshape(-1)
    exact = torch.log_softmax(logits.double(), dim=-1).reshape(-1)
    tol = 1e-9 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out[list(ids)], exact[list(ids)], atol=tol)
    with pytest.raises(ValueError):
        CandidateLogits(ids, rest=2)


class _Logprob:
    """``tensorrt_llm.executor.result.Logprob``'s fields (fixture: Logprob)."""

    def __init__(self, logprob, rank=None):
        self.logprob, self.rank = logprob, rank


def _step_logprobs(row: torch.Tensor, n: int) -> dict:
    """The ``n`` largest log-probabilities of a processed row, as the LLM API returns them."""
    lp = torch.log_softmax(row.double(), -1)
    top = torch.topk(lp, n)
    return {int(t): _Logprob(float(v), r + 1) for r, (v, t) in enumerate(zip(top.values, top.indices))}


def test_choice_output_reads_the_candidates_and_refuses_a_row_without_them():
    assert sorted(vars(_Logprob(0.0))) == sorted(API["Logprob"])
    logits = torch.randn(40, generator=torch.Generator().manual_seed(5)) * 2
    full = Choice((11, 5, 9), full_vocab=True)
    row = logits.clone()
    sampling_kwargs(full, EOS)["logits_processor"](0, row, [[3]], None, None)
    out = choice_output(Request(index=4, prompt_ids=[3], spec=full), _step_logprobs(row, 5))
    exact = torch.log_softmax(logits.double(), -1)[[11, 5, 9]].numpy()
    assert out.index == 4 and np.allclose(out.logprobs, exact, atol=1e-9)
    assert np.allclose(out.probs, choice_probs(logits[[11, 5, 9]].numpy()), atol=1e-9)
    row = logits.clone()
    CandidateLogits((5, 9))(0, row, [[3]], None, None)
    assert choice_output(Request(index=0, prompt_ids=[3], spec=Choice((5, 9))), _step_logprobs(row, 3)).logprobs \
        is None
    with pytest.raises(RuntimeError, match="candidate ids \\[12\\]"):
        choice_output(Request(index=0, prompt_ids=[3], spec=Choice((5, 12))), _step_logprobs(row, 3))


def test_text_output_stops_at_eos_and_reads_tracked_columns():
    req = Request(index=0, prompt_ids=[3], spec=Text(8, track_ids=(2, 4)))
    gen = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    out = text_output(req, [3, 5, 7, 2], gen, EOS, stopped=True)
    assert out.token_ids == [3, 5] and out.finished
    assert np.array_equal(out.tracked_logits, gen[:2][:, [2, 4]].numpy())
    out = text_output(Request(index=0, prompt_ids=[3], spec=Text(2)), [3, 5], None, EOS)
    assert out.token_ids == [3, 5] and not out.finished and out.tracked_logits is None
    assert set(API["finish_reason"]) >= {"stop", "length"}


# --------------------------------------------------------------------------------------------
# T5 on the release's PyTorch backend (tensorrt_llm/_torch/models/modeling_t5.py)

# Transcribed from the release's T5ForConditionalGeneration.__init__ and _convert_hf_t5_weights
# (the lines the backend's checks read; the rest elided).
RELEASE_T5_INIT = '''
        self.logits_processor = LogitsProcessor()

        # T5 convention: scale logits by 1/sqrt(d_model)
        self.rescale_before_lm_head = True
        self.d_model = config.d_model
'''
RELEASE_T5_CONVERT = '''
    if dtype is not None:
        hf_weights = {k: v.to(dtype) for k, v in hf_weights.items()}
    out["model.shared_embedding"] = [{"weight": _get("shared.weight")}]
'''


def test_t5_logit_scale_follows_the_checkpoint_and_the_release():
    from fastjudge.backends.trtllm import release_loads_t5_fp8, release_rescales_t5_logits, t5_logit_scale

    assert release_rescales_t5_logits(RELEASE_T5_INIT) and not release_loads_t5_fp8(RELEASE_T5_CONVERT)
    flan = {"d_model": 64, "tie_word_embeddings": False}
    assert t5_logit_scale(flan, True) == 8.0  # untied Flan-T5 under a release that rescales anyway
    assert t5_logit_scale(flan, False) == 1.0
    assert t5_logit_scale({"d_model": 64}, True) == 1.0  # original T5: both scale
    assert t5_logit_scale({"d_model": 64, "tie_word_embeddings": False, "scale_decoder_outputs": True}, True) == 1.0


def test_scaled_release_logits_give_the_checkpoints_choice_exactly(t5_dir):
    """The release's T5 logits are the checkpoint's times d_model**-0.5 (transformers'
    T5ForConditionalGeneration on the same weights, with and without that scaling); the
    processor's scale restores the checkpoint's Choice probabilities and full-vocabulary
    log-probabilities."""
    from transformers import T5ForConditionalGeneration

    from fastjudge.backends.trtllm import t5_logit_scale

    model = T5ForConditionalGeneration.from_pretrained(str(t5_dir), dtype=torch.float32).eval()
    assert model.config.scale_decoder_outputs is False  # Flan-T5 layout: untied, unscaled
    ids = torch.tensor([[5, 17, 40, 9, 1]])
    with torch.no_grad():
        own = model(input_ids=ids, decoder_input_ids=torch.zeros(1, 1, dtype=torch.long)).logits
        model.config.scale_decoder_outputs = True  # what the release computes
        release = model(input_ids=ids, decoder_input_ids=torch.zeros(1, 1, dtype=torch.long)).logits
    scale = t5_logit_scale(json.loads((t5_dir / "config.json").read_text()), release_rescales=True)
    assert torch.allclose(release * scale, own, atol=1e-5)
    cand = (4, 6, 8)
    out = _processed(release.reshape(-1), CandidateLogits(cand, rest_token(cand), scale))
    exact = torch.log_softmax(own.reshape(-1).double(), dim=-1)
    assert torch.allclose(out[list(cand)], exact[list(cand)], atol=1e-5)


def test_choice_fallback_reads_generation_logits():
    """The fallback mode: only release argument names, and the candidates read from the step's
    logits (full-vocabulary log-probabilities by log-softmax over the row)."""
    from fastjudge.backends.trtllm import choice_from_logits

    kw = sampling_kwargs(Choice((5, 9), full_vocab=True), EOS, choice_from_logits=True)
    assert set(kw) <= set(API["SamplingParams"]) and kw["return_generation_logits"] is True
    row = torch.randn(1, 20, generator=torch.Generator().manual_seed(2))
    out = choice_from_logits(Request(index=0, prompt_ids=[3], spec=Choice((5, 9), full_vocab=True)), row)
    exact = torch.log_softmax(row.double(), -1)[0, [5, 9]].numpy()
    assert np.allclose(out.logprobs, exact) and np.allclose(out.probs, choice_probs(row[0, [5, 9]].numpy()))
