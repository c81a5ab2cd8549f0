"""The TensorRT-LLM backend: FP8 judges built by ``fastjudge build``, behind the backend interface.

``TrtllmBackend(build_dir)`` opens a build output directory. Before TensorRT-LLM is imported it
reads ``fastjudge-engine.json`` and checks it against the tokenizer shipped in the build: model
kind, and the token ids judges read (rating tokens, rationale rating tokens, yes/no), derived
here exactly as the judges derive them. A mismatch raises ``ManifestError``; a machine without
TensorRT-LLM, or with a release that cannot serve the judge (:func:`trtllm_mismatch`), gets
``TensorRTLLMUnavailable`` naming the extra to install (and that the build's FP8 checkpoint also
loads in the torch backend).

* Flan-T5: the encoder and decoder engines through TensorRT-LLM's encoder-decoder runtime
  (``tensorrt_llm.runtime.ModelRunnerCpp``, ``is_enc_dec=True``). ``Choice``: one decoder step
  from the start token (plus any forced response prefix), read from the generation logits at
  the K candidate ids (the decoder engine is built with ``--gather_generation_logits``).
* Qwen3.5 / Qwen3: the FP8 checkpoint through the LLM API (``tensorrt_llm.LLM``, PyTorch
  backend), KV-cache block reuse on: requests sharing the LAVE prefix reuse its cached blocks
  (for Qwen3.5's recurrent layers with the state snapshots the release offers, see
  :func:`kv_cache_config`). ``Choice``: ``max_tokens=1`` with
  ``return_generation_logits``, read at the K ids (and, for a ``full_vocab`` Choice, normalised
  over the whole row). ``Json``: guided decoding with the xgrammar
  backend, given the same grammar the torch path compiles (no free whitespace, fixed
  separators) as EBNF, so both paths constrain identically.
* ``Text``: greedy decoding; ``track_ids`` read from the generation logits.

Tokenization is the torch backends' (prompt formatting, chat template with thinking off), so
prompts, candidate ids and the planner's costs are identical across backends.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..codec import open_codec
from ..runtime.requests import Choice, Output, Request, Text, choice_probs
from .manifest import ManifestError, check_token_ids, read_manifest

log = logging.getLogger("fastjudge")

ENGINE_KINDS = ("flan-t5", "qwen3.5")


class TensorRTLLMUnavailable(ImportError):
    """TensorRT-LLM is not importable here, or the installed release cannot serve the judge."""


# Which TensorRT-LLM serves which judge (docs/gpu.md, "Version matrix"): Flan-T5 engines need a
# release with the TensorRT backend, Qwen3.5 one with its PyTorch-backend model and a transformers
# pin that has qwen3_5. Only 1.3.0rc15 is both, so each judge has its own extra and environment.
TRTLLM_EXTRAS = {"flan-t5": "trtllm-t5", "qwen3.5": "trtllm-qwen"}
# The TensorRT backend (trtllm-build engines, ModelRunnerCpp, the encoder-decoder runtime) is
# gone from this release on (its release notes: "tensorrt-backend-removal").
T5_ENGINES_REMOVED_IN = "1.3.0rc22"
# The PyTorch backend's Qwen3.5 model arrived in this release (its release notes, #12242).
QWEN3_5_SINCE = "1.3.0rc9"


def _install_hint(kind: str | None) -> str:
    extra = TRTLLM_EXTRAS.get(kind or "")
    if extra is None:
        return "pip install 'fastjudge[trtllm-t5]' (Flan-T5) or 'fastjudge[trtllm-qwen]' (Qwen3.5)"
    return f"pip install 'fastjudge[{extra}]' in its own environment"


def import_tensorrt_llm(kind: str | None = None):
    try:
        import tensorrt_llm
    except ImportError as missing:
        raise TensorRTLLMUnavailable(
            f"the trtllm backend needs TensorRT-LLM, which is not installed ({missing}). On a Linux machine "
            f"with an NVIDIA GPU: {_install_hint(kind)}. Without it, the same FP8 judge runs in "
            "the torch backend: LaveJudge('<build dir>/checkpoint').") from None
    return tensorrt_llm


def _is_qwen3_5(model_type: str | None) -> bool:
    return "qwen3_5" in (model_type or "")  # qwen3_5 (VL) and qwen3_5_text: Gated DeltaNet hybrids


def trtllm_mismatch(kind: str, model_type: str | None = None, installed: str | None = None) -> str | None:
    """None when the installed TensorRT-LLM (``installed``: its version; default the installed
    distribution's) can serve a ``kind`` judge, else why not and which extra to install."""
    import importlib.util
    from importlib import metadata

    from packaging.version import Version

    if installed is None:
        try:
            installed = metadata.version("tensorrt_llm")
        except metadata.PackageNotFoundError:
            return f"TensorRT-LLM is not installed ({_install_hint(kind)})"
    have = Version(installed)
    if kind == "flan-t5" and have >= Version(T5_ENGINES_REMOVED_IN):
        return (f"TensorRT-LLM {installed} has no TensorRT backend (removed in {T5_ENGINES_REMOVED_IN}); "
                f"Flan-T5 engines need the trtllm-t5 environment ({_install_hint(kind)})")
    if kind == "qwen3.5" and _is_qwen3_5(model_type):
        if have < Version(QWEN3_5_SINCE):
            return (f"TensorRT-LLM {installed} has no Qwen3.5 model (added in {QWEN3_5_SINCE}); "
                    f"Qwen3.5 needs the trtllm-qwen environment ({_install_hint(kind)})")
        if importlib.util.find_spec("transformers.models.qwen3_5") is None:
            return (f"the transformers installed beside TensorRT-LLM {installed} has no qwen3_5 model "
                    f"(1.3.0rc9 to rc14 pin 4.57.3); Qwen3.5 needs the trtllm-qwen environment "
                    f"({_install_hint(kind)})")
    return None


# Prefix reuse on Qwen3.5: its Gated DeltaNet layers carry a recurrent state, which TensorRT-LLM
# can reuse only where it kept a snapshot; the interval is a multiple of the default 32-token KV
# block, so at most this many tokens of a shared LAVE prefix are recomputed per request.
SNAPSHOT_INTERVAL = 128


def kv_cache_config(KvCacheConfig, model_type: str | None, free_gpu_memory_fraction: float):
    """The LLM API's KV cache settings with block reuse that works for this model on the installed
    release (``KvCacheConfig``: ``tensorrt_llm.llmapi.KvCacheConfig``). Returns the config and
    whether prefix reuse is on. For hybrid models: releases with ``mamba_state_config`` (which
    turn reuse off without a snapshot policy) get periodic snapshots there, releases with only
    ``mamba_state_cache_interval`` get it set, older releases cannot reuse recurrent state, so
    reuse is off."""
    kw = {"enable_block_reuse": True, "free_gpu_memory_fraction": free_gpu_memory_fraction}
    if _is_qwen3_5(model_type):
        fields = getattr(KvCacheConfig, "model_fields", {})
        if "mamba_state_config" in fields:
            kw["mamba_state_config"] = {"periodic_snapshot_interval": SNAPSHOT_INTERVAL}
        elif "mamba_state_cache_interval" in fields:
            kw["mamba_state_cache_interval"] = SNAPSHOT_INTERVAL
        else:
            kw["enable_block_reuse"] = False
    return KvCacheConfig(**kw), kw["enable_block_reuse"]


class TrtllmBackend:
    """Runs :class:`Request` batches on a ``fastjudge build`` output directory."""

    def __init__(self, build_dir: str | os.PathLike, max_input_tokens: int | None = None,
                 kv_cache_free_gpu_memory_fraction: float = 0.85, load_engine: bool = True):
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
        # No image slots: the engines run text prompts only. TensorRT-LLM finds shared prefixes
        # itself (KV-cache block reuse), so requests carry none.
        self.codec = open_codec(tokenizer_dir, {}, self.kind, eos_token_id=model.get("eos_token_id"),
                                exact_prefix=False)
        if self.kind == "encoder-decoder":
            self.pad_token_id = int(model.get("pad_token_id") or 0)
            self.decoder_start_token_id = int(model.get("decoder_start_token_id") or 0)
        else:
            self.pad_token_id = self.codec.pad_token_id
        self.eos_token_ids = self.codec.eos_token_ids
        check_token_ids(manifest, self.codec)  # before anything heavy is loaded
        self._runner = self._llm = None
        if load_engine:
            self._load_engine(artifacts, limits, kv_cache_free_gpu_memory_fraction)

    def _load_engine(self, artifacts: dict, limits: dict, kv_cache_free_gpu_memory_fraction: float) -> None:
        build_dir = self.build_dir
        import_tensorrt_llm(self.engine_kind)
        why = trtllm_mismatch(self.engine_kind, self.manifest["model"].get("model_type"))
        if why:
            raise TensorRTLLMUnavailable(f"{build_dir}: {why}")
        if self.kind == "encoder-decoder":
            engines = artifacts.get("engines")
            if not engines or not (self.build_dir / engines).is_dir():
                raise ManifestError(f"{build_dir}: no TensorRT engines (the build skipped them; run "
                                    f"{self.build_dir / 'build_engines.sh'} on a CUDA machine)")
            from tensorrt_llm.runtime import ModelRunnerCpp

            self._runner = ModelRunnerCpp.from_dir(
                engine_dir=str(self.build_dir / engines), is_enc_dec=True, max_batch_size=self.max_batch_size,
                max_input_len=limits["max_input_len"], max_output_len=limits["max_new_tokens"], max_beam_width=1,
                kv_cache_free_gpu_memory_fraction=kv_cache_free_gpu_memory_fraction, cross_kv_cache_fraction=0.5,
                gather_generation_logits=True)
        else:
            from tensorrt_llm import LLM
            from tensorrt_llm.llmapi import KvCacheConfig

            kv_config, reuse = kv_cache_config(KvCacheConfig, self.manifest["model"].get("model_type"),
                                               kv_cache_free_gpu_memory_fraction)
            if not reuse:
                log.warning("fastjudge: this TensorRT-LLM cannot snapshot Qwen3.5's recurrent state; "
                            "KV-cache block reuse is off (every prompt is computed in full)")
            self._llm = LLM(model=str(self.checkpoint_dir), tokenizer=str(self.checkpoint_dir),
                            kv_cache_config=kv_config,
                            guided_decoding_backend="xgrammar", max_batch_size=self.max_batch_size,
                            max_seq_len=int(limits["max_seq_len"]))
        log.info("fastjudge: loaded TensorRT-LLM %s judge %s", self.engine_kind, build_dir)

    def cost(self, request: Request) -> int:
        return request.num_tokens

    def group_key(self, request: Request) -> None:
        """One group: TensorRT-LLM reuses shared prefixes across any batch itself."""
        return None

    # -- execution ------------------------------------------------------------------------------
    def run(self, batch: Sequence[Request]) -> list[Output]:
        if self._runner is None and self._llm is None:
            raise RuntimeError("this TrtllmBackend was opened with load_engine=False")
        if self.kind == "encoder-decoder":
            return self._run_t5(batch)
        return self._run_llm(batch)

    def _run_t5(self, batch) -> list[Output]:
        import torch

        spec = batch[0].spec
        if any(type(r.spec) is not type(spec) for r in batch):
            raise ValueError("a batch must hold one kind of output spec")
        if not isinstance(spec, (Choice, Text)):
            raise NotImplementedError(f"{type(spec).__name__} requests are not supported by the Flan-T5 engines")
        steps = 1 if isinstance(spec, Choice) else spec.max_new_tokens
        decoder_inputs = [torch.tensor([self.decoder_start_token_id, *r.response_prefix], dtype=torch.int32)
                          for r in batch]
        encoder_inputs = [torch.tensor(r.prompt_ids, dtype=torch.int32) for r in batch]
        out = self._runner.generate(
            batch_input_ids=decoder_inputs, encoder_input_ids=encoder_inputs,
            max_new_tokens=steps, end_id=min(self.eos_token_ids), pad_id=self.pad_token_id, num_beams=1,
            output_generation_logits=True, output_sequence_lengths=True, return_dict=True)
        logits = _per_row_logits(out["generation_logits"], len(batch))
        outputs = []
        for i, r in enumerate(batch):
            if isinstance(r.spec, Choice):
                outputs.append(_choice_output(r, logits[i][0]))
                continue
            seq = out["output_ids"][i][0].tolist()
            length = int(out["sequence_lengths"][i][0])
            gen = seq[len(decoder_inputs[i]):length]
            outputs.append(_text_output(r, gen, logits[i], self.eos_token_ids))
        return outputs

    def _run_llm(self, batch) -> list[Output]:
        from tensorrt_llm import SamplingParams

        prompts, params = [], []
        for r in batch:
            prompts.append({"prompt_token_ids": [int(t) for t in r.prompt_ids] + [int(t) for t in r.response_prefix]})
            params.append(self._sampling(r.spec, SamplingParams))
        results = self._llm.generate(prompts, params, use_tqdm=False)
        outputs = []
        for r, res in zip(batch, results):
            o = res.outputs[0]
            logits = None if o.generation_logits is None else _as_steps(o.generation_logits)
            if isinstance(r.spec, Choice):
                outputs.append(_choice_output(r, logits[0]))
            else:  # a stop token may or may not be in token_ids; finish_reason says it was reached
                outputs.append(_text_output(r, list(o.token_ids), logits, self.eos_token_ids,
                                            stopped=getattr(o, "finish_reason", None) == "stop"))
        return outputs

    def _sampling(self, spec, SamplingParams):
        stop = sorted(self.eos_token_ids)
        if isinstance(spec, Choice):
            return SamplingParams(max_tokens=1, top_k=1, return_generation_logits=True, detokenize=False)
        if isinstance(spec, Text):
            return SamplingParams(max_tokens=spec.max_new_tokens, top_k=1, stop_token_ids=stop, detokenize=False,
                                  return_generation_logits=bool(spec.track_ids))
        if type(spec).__name__ == "Json":  # runtime.grammar.Json
            from tensorrt_llm.llmapi import GuidedDecodingParams

            return SamplingParams(max_tokens=spec.max_new_tokens, top_k=1, stop_token_ids=stop, detokenize=False,
                                  guided_decoding=GuidedDecodingParams(grammar=json_grammar_ebnf(spec.schema)))
        raise NotImplementedError(f"{type(spec).__name__} requests are not supported by the trtllm backend")


def json_grammar_ebnf(schema: str) -> str:
    """The JSON-schema grammar the torch path compiles (``runtime.grammar``: no free whitespace,
    fixed separators, strict mode), as EBNF text for TensorRT-LLM's xgrammar backend."""
    import xgrammar as xgr

    from ..runtime.grammar import SEPARATORS

    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=SEPARATORS, strict_mode=True))


def _as_steps(logits) -> np.ndarray:
    """Generation logits of one sequence as ``[steps, vocab]`` float64 (beam 1)."""
    import torch

    t = logits if isinstance(logits, torch.Tensor) else torch.as_tensor(np.asarray(logits))
    return t.float().cpu().reshape(-1, t.shape[-1]).numpy().astype(np.float64)


def _per_row_logits(logits, rows: int) -> list[np.ndarray]:
    """The runner's generation logits (``[batch, beam, steps, vocab]`` tensor, or one tensor per
    row) as ``[steps, vocab]`` per row."""
    if isinstance(logits, (list, tuple)):
        return [_as_steps(x) for x in logits]
    return [_as_steps(logits[i]) for i in range(rows)]


def _choice_output(request: Request, logits: np.ndarray) -> Output:
    """A Choice read from one step's generation logits, which cover the whole vocabulary
    anyway: a ``full_vocab`` request's log-probabilities cost one log-sum-exp more."""
    row = np.asarray(logits, dtype=np.float64)
    z = row[list(request.spec.token_ids)]
    logprobs = None
    if request.spec.full_vocab:
        top = row.max()
        logprobs = z - (top + np.log(np.exp(row - top).sum()))
    return Output(index=request.index, logits=z, probs=choice_probs(z), logprobs=logprobs)


def _text_output(request: Request, tokens: list[int], logits: np.ndarray | None, eos: set[int],
                 stopped: bool = False) -> Output:
    finished = stopped
    for k, t in enumerate(tokens):
        if t in eos:
            tokens, finished = tokens[:k], True
            break
    track = getattr(request.spec, "track_ids", ())
    tracked = None
    if track:
        tracked = (logits[: len(tokens)][:, list(track)] if logits is not None and len(tokens)
                   else np.zeros((0, len(track))))
    return Output(index=request.index, token_ids=[int(t) for t in tokens], finished=finished, tracked_logits=tracked)
