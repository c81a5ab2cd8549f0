"""The TensorRT-LLM backend: judges built by ``fastjudge build``, run through TensorRT-LLM's LLM API
on its PyTorch backend, behind the backend interface.

``TrtllmBackend(build_dir)`` opens a build directory. Before TensorRT-LLM is imported it reads
``fastjudge-engine.json`` and checks it against the tokenizer shipped in the build: model kind,
and the token ids judges read (rating tokens, rationale rating tokens, yes/no), derived here
exactly as the judges derive them. A mismatch raises ``ManifestError``; a machine without
TensorRT-LLM, or with a release outside the supported range (:func:`trtllm_mismatch`), gets
``TensorRTLLMUnavailable`` naming the extra (and that the build's checkpoint also loads in the
torch backend).

Over 400 lines: one backend for both judge families behind one external API, whose release
contract (the manifest check, the options file, the request mapping for three output specs and
the T5 behaviours read from the installed release) must be read in one place.

Both judges load the same way: ``tensorrt_llm.LLM(model=OUT/checkpoint, **options)``, the
options being the build's LLM-API options file (:data:`OPTIONS_FILE`, written by
``builders/llm_options.py``). Flan-T5 is ``T5ForConditionalGeneration`` on the PyTorch backend
(NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/models/modeling_t5.py``, v1.3.0rc22 to v1.4.0rc1:
``attn_backend="TRTLLM"`` for the relative attention bias, a cross-attention KV pool sized by
``kv_cache_config.cross_kv_cache_fraction``, prompts given as encoder token ids, the decoder
started by the checkpoint's ``decoder_start_token_id``); what that file does is read from the
installed release's source at load: its unconditional d_model**-0.5 logit scaling, undone
exactly (:func:`t5_logit_scale`); FP8 builds refused where its weight conversion drops the
scales (:func:`release_loads_t5_fp8`); any release refused whose T5 computes another model than
the checkpoint's (:func:`t5_release_defects`: LM head tied over the checkpoint's own, attention
scores scaled, relative bias dropped once a KV cache exists); and its 512-token ``max_seq_len``
(:func:`t5_length_plan`: lifted through ``TLLM_ALLOW_LONG_MAX_MODEL_LEN`` where the release reads
it, else prompts capped at the release's limit and longer ones refused). Qwen3.5 / Qwen3 are
decoder-only. :meth:`TrtllmBackend.close` shuts the LLM down (its GPU memory, KV cache included,
is released only then).

The request mapping (:func:`sampling_kwargs`; ``tensorrt_llm/sampling_params.py``,
``SamplingParams`` and ``GuidedDecodingParams``, same tags):

* ``Choice``: one generated token, ``logprobs`` for the K candidate ids, read exactly:
  :class:`CandidateLogits` (a ``LogitsProcessor``) keeps only the K candidate logits in the
  row, in place on the device, so the K returned log-probabilities are the candidates'
  log-softmax among themselves: the ``probs`` a judge reads. A ``full_vocab`` Choice keeps one
  more entry, a "rest" token whose logit is the log-sum-exp of every other logit, so the K
  log-probabilities are those under the whole vocabulary. Nothing of vocabulary width leaves
  the device; the sampled token itself is discarded. One more log-probability than can be finite
  is asked for, and the returned ones are checked (:func:`checked_choice_logprobs`): exactly the
  K candidates (and the rest entry) finite, their log-sum-exp 0. A row the processor did not
  restrict fails that, however high the candidates rank (upstream lists the logits
  post-processor as untested for ``Qwen3_5ForConditionalGeneration`` and
  ``Qwen3NextForCausalLM``, ``docs/source/models/supported-models.md``); the backend then says
  so once and reads Choices from ``return_generation_logits`` instead.
* ``Text``: greedy (``top_k=1``) up to EOS (``end_id``; the other EOS ids as
  ``stop_token_ids``); ``track_ids`` read from ``return_generation_logits`` (the one place a
  vocabulary-wide row per step comes back, only for judges that track rating tokens while
  generating).
* ``Json``: greedy under ``guided_decoding=GuidedDecodingParams(grammar=...)`` with the
  xgrammar backend, given the same grammar the torch path compiles (no free whitespace, fixed
  separators) as EBNF, so both paths constrain identically.

Tokenization is the torch backends' (prompt formatting, chat template with thinking off), so
prompts, candidate ids and the planner's costs are identical across backends. TensorRT-LLM
batches and schedules requests itself; for Qwen3.5 it keeps no KV blocks across requests
(KV-cache reuse is unsupported for ``Qwen3_5ForConditionalGeneration`` in
``docs/source/models/supported-models.md``), so a shared LAVE prefix is recomputed per request.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..codec import open_codec
from ..runtime.grammar import Json
from ..runtime.requests import Choice, Output, Request, Text, choice_probs
from .manifest import ManifestError, check_token_ids, read_manifest

log = logging.getLogger("fastjudge")

ENGINE_KINDS = ("flan-t5", "qwen3.5")
OPTIONS_FILE = "llm_api_options.yaml"  # JSON text, which YAML readers (trtllm-serve --config) read too

# The releases whose PyTorch backend runs both judges (docs/gpu.md, "Version matrix"): T5 on the
# PyTorch backend arrived in v1.3.0rc19 (upstream #13919; rc16 to rc21 are not on the package
# index, so rc22 is the first installable), Qwen3.5 in rc9 with a transformers that has qwen3_5
# from rc15. 1.4.0rc1 is the newest release read.
TRTLLM_EXTRA = "trtllm"
TRTLLM_SINCE = "1.3.0rc22"
TRTLLM_BELOW = "1.5"

# Options the build writes that only later releases of the range declare (encoder CUDA graphs,
# upstream #16158): left out, with a log line, where the installed LlmArgs lacks them.
NEWER_OPTIONS = ("encoder_cuda_graph_config", "encoder_max_batch_size")


class TensorRTLLMUnavailable(ImportError):
    """TensorRT-LLM is not importable here, or the installed release cannot serve the judge."""


def _install_hint() -> str:
    return (f"pip install 'fastjudge[{TRTLLM_EXTRA}]' (TensorRT-LLM {TRTLLM_SINCE} to below "
            f"{TRTLLM_BELOW}, Linux with an NVIDIA GPU)")


def import_tensorrt_llm():
    try:
        import tensorrt_llm
    except ImportError as missing:
        raise TensorRTLLMUnavailable(
            f"the trtllm backend needs TensorRT-LLM, which is not installed ({missing}): {_install_hint()}. "
            "Without it, the same judge runs in the torch backend: LaveJudge('<build dir>/checkpoint').") from None
    return tensorrt_llm


def _is_qwen3_5(model_type: str | None) -> bool:
    return "qwen3_5" in (model_type or "")  # qwen3_5 (VL) and qwen3_5_text: Gated DeltaNet hybrids


def trtllm_mismatch(kind: str, model_type: str | None = None, installed: str | None = None) -> str | None:
    """None when the installed TensorRT-LLM (``installed``: its version; default the installed
    distribution's) can serve a ``kind`` judge, else why not and what to install."""
    import importlib.util
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    if installed is None:
        try:
            installed = metadata.version("tensorrt_llm")
        except metadata.PackageNotFoundError:
            return f"TensorRT-LLM is not installed ({_install_hint()})"
    # the extra's own specifier: "<1.5" also refuses 1.5's pre-releases (PEP 440)
    if not SpecifierSet(f">={TRTLLM_SINCE},<{TRTLLM_BELOW}").contains(installed, prereleases=True):
        return (f"TensorRT-LLM {installed} is outside the range fastjudge runs on its PyTorch backend "
                f"({_install_hint()})")
    if kind == "qwen3.5" and _is_qwen3_5(model_type) \
            and importlib.util.find_spec("transformers.models.qwen3_5") is None:
        return (f"the transformers installed beside TensorRT-LLM {installed} has no qwen3_5 model "
                f"({_install_hint()})")
    return None


# ---------------------------------------------------------------------------------------------
# the options file

def read_llm_options(build_dir: str | os.PathLike) -> dict:
    path = Path(build_dir) / OPTIONS_FILE
    if not path.is_file():
        raise ManifestError(f"{build_dir}: no {OPTIONS_FILE} (rebuild with this fastjudge's `fastjudge build`)")
    return json.loads(path.read_text())


def llm_kwargs(options: dict, declared: set[str]) -> tuple[dict, list[str]]:
    """The ``LLM(...)`` keyword arguments of an options file, given the argument names the
    installed release declares (``TorchLlmArgs.model_fields``). Returns them and the
    :data:`NEWER_OPTIONS` left out; any other undeclared name raises (a misspelt or removed
    option fails at load instead of being dropped)."""
    left_out = [k for k in options if k not in declared and k in NEWER_OPTIONS]
    unknown = sorted(k for k in options if k not in declared and k not in NEWER_OPTIONS)
    if unknown:
        raise ManifestError(f"{OPTIONS_FILE}: the installed TensorRT-LLM has no LLM argument {unknown}")
    return {k: v for k, v in options.items() if k in declared}, left_out


# ---------------------------------------------------------------------------------------------
# requests

class CandidateLogits:
    """A ``tensorrt_llm.sampling_params.LogitsProcessor`` (called as ``(req_id, logits,
    token_ids, stream_ptr, client_id)``, modifying ``logits`` in place) that leaves only the
    candidate logits of the row: every other entry becomes -inf. With ``rest`` (a token id that
    is not a candidate), that entry becomes the log-sum-exp of all non-candidate logits, so the
    candidates' log-softmax is their log-probability under the whole vocabulary.

    ``scale``: a factor applied to the row first, undoing a scaling the release's model applies
    and the checkpoint's own model does not (:func:`t5_logit_scale`).

    Plain attributes only: the LLM API pickles it to its worker processes."""

    def __init__(self, token_ids: Sequence[int], rest: int | None = None, scale: float = 1.0):
        self.token_ids = [int(t) for t in token_ids]
        self.rest = None if rest is None else int(rest)
        self.scale = float(scale)
        if self.rest in self.token_ids:
            raise ValueError("the rest token must not be a candidate")

    def __call__(self, req_id, logits, token_ids, stream_ptr, client_id) -> None:
        import torch

        if self.scale != 1.0:
            logits.mul_(self.scale)
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[self.token_ids] = True
        if self.rest is not None:
            others = torch.logsumexp(logits.float().masked_fill(keep, float("-inf")), dim=-1)
            logits[..., self.rest] = others.to(logits.dtype)
            keep[self.rest] = True
        logits.masked_fill_(~keep, float("-inf"))


def rest_token(candidates: Sequence[int]) -> int:
    """The smallest token id that is not a candidate (the ``rest`` entry of a full-vocabulary
    Choice)."""
    taken = set(candidates)
    return next(t for t in range(len(taken) + 1) if t not in taken)


def sampling_kwargs(spec, eos_token_ids: Sequence[int], logit_scale: float = 1.0,
                    choice_from_logits: bool = False) -> dict:
    """The ``SamplingParams`` keyword arguments of one output spec (``logit_scale``: see
    :func:`t5_logit_scale`; greedy decoding does not depend on it). ``choice_from_logits``: a
    Choice reads the step's generation logits instead (the fallback for a release whose
    log-probabilities do not follow the logits processor)."""
    eos = sorted(int(t) for t in eos_token_ids)
    if isinstance(spec, Choice) and choice_from_logits:
        return {"max_tokens": 1, "return_generation_logits": True, "detokenize": False}
    if isinstance(spec, Choice):
        # No sampling settings: the one token drawn is never read, only the log-probabilities.
        rest = rest_token(spec.token_ids) if spec.full_vocab else None
        # one more than can be finite: an unrestricted row shows itself by a finite extra entry
        return {"max_tokens": 1, "logprobs": len(spec.token_ids) + (rest is not None) + 1,
                "logits_processor": CandidateLogits(spec.token_ids, rest, logit_scale), "detokenize": False}
    greedy = {"top_k": 1, "end_id": eos[0], "stop_token_ids": eos[1:] or None, "detokenize": False}
    if isinstance(spec, Text):
        return {"max_tokens": spec.max_new_tokens, **greedy, "return_generation_logits": bool(spec.track_ids)}
    if isinstance(spec, Json):
        return {"max_tokens": spec.max_new_tokens, **greedy,
                "guided_decoding": {"grammar": json_grammar_ebnf(spec.schema)}}
    raise NotImplementedError(f"{type(spec).__name__} requests are not supported by the trtllm backend")


def json_grammar_ebnf(schema: str) -> str:
    """The JSON-schema grammar the torch path compiles (``runtime.grammar``: no free whitespace,
    fixed separators, strict mode), as EBNF text for TensorRT-LLM's xgrammar backend."""
    import xgrammar as xgr

    from ..runtime.grammar import SEPARATORS

    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=SEPARATORS, strict_mode=True))


class CandidatesMissing(RuntimeError):
    """The returned log-probabilities were not taken after the logits processor: a candidate
    missing, another token finite, or a log-sum-exp away from 0."""


# How far from 0 the candidates' log-sum-exp may be: float32 log-softmax rounding is ~1e-6 and a
# bf16 one ~4e-3; a restricted row's candidates hold all the mass, so anything further is a row
# the processor did not restrict (where the count check has not already caught it).
LOGSUMEXP_TOL = 1e-2


def checked_choice_logprobs(request: Request, step_logprobs) -> np.ndarray:
    """The K candidates' log-probabilities from one generated step's returned log-probabilities
    (``{token id: Logprob(logprob, rank)}``), after checking that they came from the row the
    logits processor restricted: exactly the candidates (and, for a full-vocabulary Choice, the
    rest entry) are finite, and their log-sum-exp is 0 within :data:`LOGSUMEXP_TOL`. Raises
    :class:`CandidatesMissing` otherwise."""
    ids = list(request.spec.token_ids)
    missing = [t for t in ids if t not in step_logprobs]
    if missing:
        raise CandidatesMissing(f"TensorRT-LLM returned no log-probability for candidate ids {missing}: "
                                "the logits processor did not restrict the row the log-probabilities came from")
    values = {int(t): float(getattr(v, "logprob", v)) for t, v in step_logprobs.items()}
    finite = {t for t, v in values.items() if np.isfinite(v)}
    expected = set(ids) | ({rest_token(ids)} if request.spec.full_vocab else set())
    if finite != expected:
        raise CandidatesMissing(
            f"TensorRT-LLM returned {len(finite)} finite log-probabilities where the logits processor leaves "
            f"exactly {len(expected)} (ids {sorted(expected)}; got {sorted(finite)[:8]}): the row was not restricted")
    kept = np.array([values[t] for t in sorted(expected)], dtype=np.float64)
    lse = float(kept.max() + np.log(np.exp(kept - kept.max()).sum()))
    if abs(lse) > LOGSUMEXP_TOL:
        raise CandidatesMissing(f"the returned candidate log-probabilities sum to log-probability {lse:.4g}, not 0: "
                                "they are not the log-softmax of the restricted row")
    return np.array([values[t] for t in ids], dtype=np.float64)


def choice_output(request: Request, step_logprobs) -> Output:
    """A Choice from the one generated step's returned log-probabilities, checked by
    :func:`checked_choice_logprobs`."""
    z = checked_choice_logprobs(request, step_logprobs)
    return Output(index=request.index, logits=z, probs=choice_probs(z),
                  logprobs=z.copy() if request.spec.full_vocab else None)


def choice_from_logits(request: Request, logits, logit_scale: float = 1.0) -> Output:
    """A Choice from the step's generation logits (the fallback mode): the candidates' logits,
    and for ``full_vocab`` their log-softmax over the row."""
    row = _as_steps(logits)[0] * logit_scale
    z = row[list(request.spec.token_ids)]
    logprobs = None
    if request.spec.full_vocab:
        top = row.max()
        logprobs = z - (top + np.log(np.exp(row - top).sum()))
    return Output(index=request.index, logits=z, probs=choice_probs(z), logprobs=logprobs)


def text_output(request: Request, tokens: list[int], logits, eos: set[int], stopped: bool = False,
                logit_scale: float = 1.0) -> Output:
    finished = stopped
    for k, t in enumerate(tokens):
        if t in eos:
            tokens, finished = tokens[:k], True
            break
    track = getattr(request.spec, "track_ids", ())
    tracked = None
    if track:
        steps = _as_steps(logits) if logits is not None else None
        tracked = (steps[: len(tokens)][:, list(track)] * logit_scale if steps is not None and len(tokens)
                   else np.zeros((0, len(track))))
    return Output(index=request.index, token_ids=[int(t) for t in tokens], finished=finished, tracked_logits=tracked)


def _as_steps(logits) -> np.ndarray:
    """Generation logits of one sequence as ``[steps, vocab]`` float64 (beam 1)."""
    import torch

    t = logits if isinstance(logits, torch.Tensor) else torch.as_tensor(np.asarray(logits))
    return t.float().cpu().reshape(-1, t.shape[-1]).numpy().astype(np.float64)


# ---------------------------------------------------------------------------------------------
# T5 on the release's PyTorch backend (tensorrt_llm/_torch/models/modeling_t5.py, v1.3.0rc22 to
# v1.4.0rc1), read from the installed release's source so that a release that changes either
# behaviour is followed, not assumed.

def release_rescales_t5_logits(source: str) -> bool:
    """Whether the release's ``T5ForConditionalGeneration.__init__`` (``source``) scales the
    decoder output by d_model**-0.5 before the LM head unconditionally (it does in the releases
    read: ``self.rescale_before_lm_head = True``)."""
    return "rescale_before_lm_head = True" in source


def t5_logit_scale(config: dict, release_rescales: bool) -> float:
    """The factor that turns the release's T5 logits into the checkpoint's own. Transformers
    scales the decoder output by d_model**-0.5 only for checkpoints saved with tied embeddings
    (``scale_decoder_outputs``, else ``tie_word_embeddings`` not false: transformers
    ``models/t5/configuration_t5.py``); Flan-T5 is saved untied, so where the release scales
    anyway its logits are the checkpoint's times d_model**-0.5, exactly (the LM head is linear),
    and multiplying by sqrt(d_model) restores them."""
    own = config.get("scale_decoder_outputs", config.get("tie_word_embeddings", True) is not False)
    return float(config["d_model"]) ** 0.5 if release_rescales and not own else 1.0


def release_loads_t5_fp8(source: str) -> bool:
    """Whether the release's T5 weight conversion (``_convert_hf_t5_weights``, ``source``)
    carries FP8 scales. In the releases read it maps the ``.weight`` tensors only and casts
    them to the model dtype, which would load an FP8 checkpoint's E4M3 values without their
    scales."""
    return "weight_scale" in source


# The first-merge T5 (upstream #13919, the file as shipped from 1.3.0rc19) against the checkpoint's
# model, as read in that file (commit 289b3768) and in upstream's later version of it (commit
# e18ea371, defining ``_t5_q_scaling``): each check below finds the first-merge form in the
# installed source. Which release first ships the later file could not be read.
T5_FIX = ("a TensorRT-LLM whose tensorrt_llm/_torch/models/modeling_t5.py carries upstream's T5 fixes "
          "(the file as of upstream commit e18ea371, defining _t5_q_scaling: q_scaling 1/sqrt(d_kv), lm_head "
          "untied in load_weights, the relative attention bias passed with the KV cache); the first-merge "
          "file of #13919 has none of them")


def t5_release_defects(sources: dict, config_ties: bool) -> list[str]:
    """What makes the release's T5 compute another model than the checkpoint's, read from its
    source (``sources``: ``init`` and ``load_weights`` of ``T5ForConditionalGeneration``,
    ``self_attention_init``, ``self_attention_forward`` of ``T5Attention`` and
    ``cross_attention_init`` of ``T5CrossAttention``); ``config_ties``: whether the installed
    transformers' ``T5Config`` of the checkpoint says ``tie_word_embeddings`` (transformers 5
    forces it on for T5 configs, whatever the checkpoint says)."""
    import re

    out = []
    ties = "lm_head.weight = self.model.shared_embedding.weight" in sources.get("init", "")
    if config_ties and ties and "lm_head.weight" not in sources.get("load_weights", ""):
        out.append("it ties lm_head to the embedding and never unties it when the checkpoint has its own "
                   "lm_head.weight, so loading one overwrites the other")
    unscaled = re.compile(r"q_scaling\s*=\s*1(\.0*)?\s*[,)]")
    if any(unscaled.search(sources.get(k, "")) for k in ("self_attention_init", "cross_attention_init")):
        out.append("its attention uses q_scaling=1.0, scaling scores by d_kv**-0.5 where T5 scales none")
    forward = sources.get("self_attention_forward", "")
    if "kv_cache_manager is not None" in forward and "relative_attention_bias" not in forward:
        out.append("its self-attention drops the relative position bias once a KV cache exists")
    return out


def release_t5_max_seq_len(source: str) -> int | None:
    """The sequence limit the release's ``T5ForConditionalGeneration.infer_max_seq_len`` reports
    (512 in the files read), or None where it has none."""
    import re

    m = re.search(r"def infer_max_seq_len\(self\)[^:]*:\s*(?:\"\"\"[^\"]*\"\"\"\s*)?return\s+(\d+)", source)
    return int(m.group(1)) if m else None


LONG_LEN_ENV = "TLLM_ALLOW_LONG_MAX_MODEL_LEN"


def release_reads_long_len_env(source: str) -> bool:
    """Whether the release's ``PyTorchModelEngine._init_max_seq_len`` (``source``) lets
    :data:`LONG_LEN_ENV` keep a ``max_seq_len`` above the model's inferred limit
    (``tensorrt_llm/_torch/pyexecutor/model_engine.py``); releases without it clamp."""
    return LONG_LEN_ENV in source


def t5_length_plan(options: dict, release_limit: int | None, reads_env: bool) -> tuple[bool, dict]:
    """How the build's T5 lengths meet the release's ``max_seq_len`` limit: (set
    :data:`LONG_LEN_ENV`, the options to load with). Within the limit, or where the release
    reads the variable, the options stay; otherwise ``max_seq_len`` becomes the limit and
    ``max_input_len`` the limit less the decoder tokens (encoder graph lengths cut to match), so
    the backend refuses longer prompts itself instead of the release clamping under them."""
    seq = int(options["max_seq_len"])
    if release_limit is None or seq <= release_limit:
        return False, options
    if reads_env:
        return True, options
    decoder = seq - int(options["max_input_len"])
    cap = release_limit - decoder
    if cap < 1:
        raise TensorRTLLMUnavailable(f"this TensorRT-LLM limits T5 to {release_limit} tokens, fewer than the "
                                     f"{decoder} decoder tokens the build needs")
    capped = {**options, "max_seq_len": release_limit, "max_input_len": cap}
    graphs = options.get("encoder_cuda_graph_config")
    if graphs and graphs.get("seq_lens"):
        capped["encoder_cuda_graph_config"] = {**graphs, "seq_lens": [n for n in graphs["seq_lens"] if n < cap] + [cap]}
    return False, capped


# ---------------------------------------------------------------------------------------------

class TrtllmBackend:
    """Runs :class:`Request` batches on a ``fastjudge build`` output directory."""

    def __init__(self, build_dir: str | os.PathLike, max_input_tokens: int | None = None, load_engine: bool = True):
        """``load_engine=False``: manifest checks and tokenization only (no TensorRT-LLM needed;
        ``run`` is then unavailable)."""
        self.build_dir = Path(build_dir)
        self.manifest = manifest = read_manifest(self.build_dir)
        model = manifest["model"]
        self.engine_kind = model.get("kind")
        if self.engine_kind not in ENGINE_KINDS:
            raise ManifestError(f"{build_dir}: model kind {self.engine_kind!r} is not one of {ENGINE_KINDS}")
        self.kind = "encoder-decoder" if self.engine_kind == "flan-t5" else "decoder-only"
        artifacts = manifest["artifacts"]
        self.checkpoint_dir = self.build_dir / artifacts["checkpoint"]
        tokenizer_dir = self.build_dir / artifacts.get("tokenizer", artifacts["checkpoint"])
        limits = manifest["limits"]
        self.max_input_tokens = min(max_input_tokens or limits["max_input_len"], limits["max_input_len"])
        self.max_batch_size = int(limits["max_batch_size"])
        self.default_batch_tokens = self.max_batch_size * self.max_input_tokens
        # No image slots: the LLM API runs text prompts here. It schedules and batches requests
        # itself, so requests carry no shared-prefix split.
        self.codec = open_codec(tokenizer_dir, {}, self.kind, eos_token_id=model.get("eos_token_id"),
                                exact_prefix=False)
        self.pad_token_id = (int(model.get("pad_token_id") or 0) if self.kind == "encoder-decoder"
                             else self.codec.pad_token_id)
        self.eos_token_ids = self.codec.eos_token_ids
        check_token_ids(manifest, self.codec)  # before anything heavy is loaded
        self.options = read_llm_options(self.build_dir)
        self.logit_scale = 1.0  # see t5_logit_scale
        self.choice_from_logits = False  # set if the release's log-probabilities ignore the processor
        self._llm = None
        if load_engine:
            self._load()

    def _load(self) -> None:
        import_tensorrt_llm()
        why = trtllm_mismatch(self.engine_kind, self.manifest["model"].get("model_type"))
        if why:
            raise TensorRTLLMUnavailable(f"{self.build_dir}: {why}")
        from tensorrt_llm import LLM
        from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

        if self.kind == "encoder-decoder":
            self._t5_compat()
            self._t5_lengths()
        kwargs, left_out = llm_kwargs(self.options, set(TorchLlmArgs.model_fields))
        if left_out:
            log.info("fastjudge: this TensorRT-LLM has no %s; running without them", ", ".join(left_out))
        self._llm = LLM(model=str(self.checkpoint_dir), tokenizer=str(self.checkpoint_dir), **kwargs)
        log.info("fastjudge: loaded TensorRT-LLM %s judge %s", self.engine_kind, self.build_dir)

    def _t5_compat(self) -> None:
        import inspect

        from tensorrt_llm._torch.models import modeling_t5

        if (self.manifest.get("quantization") or {}).get("algo") == "FP8" and not release_loads_t5_fp8(
                inspect.getsource(modeling_t5._convert_hf_t5_weights)):
            raise TensorRTLLMUnavailable(
                f"{self.build_dir}: this TensorRT-LLM loads T5 checkpoints' weights without FP8 scales "
                "(tensorrt_llm/_torch/models/modeling_t5.py, _convert_hf_t5_weights); build the Flan-T5 judge "
                "with --dtype bf16 for TensorRT-LLM (this FP8 checkpoint runs in the torch backend)")
        config = json.loads((self.checkpoint_dir / "config.json").read_text())
        from transformers import T5Config

        model, attn = modeling_t5.T5ForConditionalGeneration, modeling_t5.T5Attention
        cross = modeling_t5.T5CrossAttention
        sources = {"init": inspect.getsource(model.__init__), "load_weights": inspect.getsource(model.load_weights),
                   "self_attention_init": inspect.getsource(attn.__init__),
                   "self_attention_forward": inspect.getsource(attn.forward),
                   "cross_attention_init": inspect.getsource(cross.__init__)}
        defects = t5_release_defects(sources, bool(getattr(T5Config.from_dict(config), "tie_word_embeddings", True)))
        if defects:
            from importlib import metadata

            raise TensorRTLLMUnavailable(
                f"{self.build_dir}: TensorRT-LLM {metadata.version('tensorrt_llm')} would not compute this Flan-T5 "
                f"as the checkpoint does (tensorrt_llm/_torch/models/modeling_t5.py): {'; '.join(defects)}. "
                f"Install {T5_FIX}; until then this judge runs in the torch backend "
                f"(LaveJudge('{self.checkpoint_dir}')).")
        self.logit_scale = t5_logit_scale(config, release_rescales_t5_logits(sources["init"]))
        if self.logit_scale != 1.0:
            log.info("fastjudge: this TensorRT-LLM scales T5 logits by d_model**-0.5 where the checkpoint does "
                     "not; the backend multiplies them by %.3f", self.logit_scale)

    def _t5_lengths(self) -> None:
        """The release's T5 ``max_seq_len`` limit (:func:`t5_length_plan`)."""
        import inspect

        from tensorrt_llm._torch.models import modeling_t5

        try:
            from tensorrt_llm._torch.pyexecutor import model_engine

            engine = inspect.getsource(model_engine.PyTorchModelEngine._init_max_seq_len)
        except (ImportError, AttributeError, OSError, TypeError):
            engine = ""  # no such method to read: assume the release clamps
        limit = release_t5_max_seq_len(inspect.getsource(modeling_t5.T5ForConditionalGeneration))
        set_env, self.options = t5_length_plan(self.options, limit, release_reads_long_len_env(engine))
        if set_env:  # read by the engine when it loads, in this process or its workers (inherited)
            os.environ[LONG_LEN_ENV] = "1"
            log.info("fastjudge: %s=1 so that this TensorRT-LLM keeps max_seq_len %d above its T5 limit %d",
                     LONG_LEN_ENV, self.options["max_seq_len"], limit)
        elif self.options["max_input_len"] < self.max_input_tokens:
            self.max_input_tokens = int(self.options["max_input_len"])
            log.warning("fastjudge: this TensorRT-LLM limits T5 to %d tokens and does not read %s: prompts are "
                        "capped at %d tokens and longer ones refused (the torch backend takes them)",
                        limit, LONG_LEN_ENV, self.max_input_tokens)

    def close(self) -> None:
        """Shut the LLM down (``LLM.shutdown``: its workers, model and KV cache); safe to call
        twice. Without it the GPU memory stays held until the process exits."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cost(self, request: Request) -> int:
        return request.num_tokens

    def group_key(self, request: Request) -> None:
        """One group: TensorRT-LLM schedules the batch itself."""
        return None

    def run(self, batch: Sequence[Request]) -> list[Output]:
        if self._llm is None:
            raise RuntimeError("this TrtllmBackend was opened with load_engine=False")
        try:
            return self._run(batch)
        except CandidatesMissing as why:
            if self.choice_from_logits:
                raise
            log.warning("fastjudge: %s; Choice requests read the generation logits from now on "
                        "(a vocabulary-wide row per item)", why)
            self.choice_from_logits = True
            return self._run(batch)

    def _run(self, batch: Sequence[Request]) -> list[Output]:
        from tensorrt_llm import SamplingParams
        from tensorrt_llm.llmapi import GuidedDecodingParams

        prompts, params = [], []
        for r in batch:
            if self.kind == "encoder-decoder" and len(r.prompt_ids) > self.max_input_tokens:
                # the judges refuse these first; here for callers that build requests themselves
                raise ValueError(f"a prompt of {len(r.prompt_ids)} tokens is longer than this judge's "
                                 f"{self.max_input_tokens} on this TensorRT-LLM (not truncated; the torch backend "
                                 "takes longer prompts)")
            if self.kind == "encoder-decoder" and r.response_prefix:
                # the LLM API starts T5's decoder from its start token; it takes no decoder prefix
                raise NotImplementedError("the trtllm backend cannot continue a Flan-T5 decoder prefix "
                                          "(a rationale's follow-up rating step); use the torch backend")
            kw = sampling_kwargs(r.spec, self.eos_token_ids, self.logit_scale, self.choice_from_logits)
            if "guided_decoding" in kw:
                kw["guided_decoding"] = GuidedDecodingParams(**kw["guided_decoding"])
            prompts.append({"prompt_token_ids": [int(t) for t in (*r.prompt_ids, *r.response_prefix)]})
            params.append(SamplingParams(**kw))
        results = self._llm.generate(prompts, params, use_tqdm=False)
        outputs = []
        for r, res in zip(batch, results):
            o = res.outputs[0]
            if isinstance(r.spec, Choice):
                outputs.append(choice_from_logits(r, o.generation_logits, self.logit_scale) if self.choice_from_logits
                               else choice_output(r, o.logprobs[0]))
            else:  # a stop token may or may not be in token_ids; finish_reason says it was reached
                outputs.append(text_output(r, list(o.token_ids), o.generation_logits, self.eos_token_ids,
                                           stopped=o.finish_reason == "stop", logit_scale=self.logit_scale))
        return outputs
