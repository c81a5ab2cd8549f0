"""``fastjudge build flan-t5``: a Flan-T5 (T5 v1.1 family) LAVE judge for TensorRT-LLM's LLM API.

Output directory::

    fastjudge-engine.json     the manifest (manifest.py)
    checkpoint/               Hugging Face checkpoint (``fp8_export.py``): FP8 in ModelOpt's layout
                              (``hf_quant_config.json`` + ``quantization_config``), or BF16 with
                              ``--dtype bf16``; the LLM API loads it as ``T5ForConditionalGeneration``
                              on its PyTorch backend, and fastjudge's torch backend loads it too
    llm_api_options.yaml      the LLM-API options (``llm_options.py``)

No engine is built: TensorRT-LLM's PyTorch backend reads the Hugging Face checkpoint itself
(NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/models/modeling_t5.py``, v1.3.0rc22 to v1.4.0rc1: fused
q/k/v and gate/up projections made from the checkpoint's ``q``/``k``/``v`` and ``wi_0``/``wi_1``,
so calibration gives each group one range, the largest, as a fused GEMM takes it). Upstream
recommends BF16 for encoder-decoder models and leaves other precisions to be validated by the
user; in the releases read its T5 weight conversion drops FP8 scales, so the trtllm backend
refuses FP8 Flan-T5 builds there (``backends/trtllm.release_loads_t5_fp8``) and ``--dtype bf16``
is the build for TensorRT-LLM; the FP8 checkpoint serves the torch backend.

Limits are judge-tuned: the encoder takes prompts up to ``max_input_len`` (the longest
calibration/held-out prompt plus headroom, by default); the decoder runs one step in score-only
mode and, with ``--rationale``, the rationale's tokens.
"""

from __future__ import annotations

import logging
import math

import torch

from . import agreement as agr
from .fp8_export import excluded_linears, fp8_state, read_checkpoint, write_fp8_checkpoint
from .llm_options import limits as llm_limits
from .manifest import judge_token_ids, lave_template
from .pipeline import (
    BuildOptions,
    calibration_section,
    checked_config,
    compare_checkpoint,
    finish,
    open_source,
    producer,
    quantization_section,
    quantize_and_compare,
    rel,
    write_bf16,
)

log = logging.getLogger("fastjudge")

MODEL_KIND = "flan-t5"
T5_TYPES = ("t5",)


def limits(opts: BuildOptions, longest_prompt: int) -> dict:
    """Encoder inputs up to the longest prompt plus headroom (rounded to 128); decoder: the
    start token, then one step (score-only) or the rationale."""
    max_input = opts.max_input_len or int(math.ceil((longest_prompt + 128) / 128) * 128)
    new = opts.max_new_tokens if opts.rationale else 1
    return llm_limits(max_input, new, opts.max_batch_size, longest_prompt, decoder_prefix=1)


def calibration_loop(prompts, start_id: int):
    """ModelOpt's forward loop: each calibration prompt alone (no padding, whose positions
    would widen the activation ranges with values the judge never computes), decoder input the
    start token (the step score-only judging reads)."""
    def forward_loop(model):
        device = next(model.parameters()).device
        with torch.inference_mode():
            for ids in prompts:
                model(input_ids=torch.as_tensor(ids, device=device)[None],
                      decoder_input_ids=torch.full((1, 1), start_id, dtype=torch.long, device=device))
    return forward_loop


def fused_groups(model) -> list[list[str]]:
    """Layers TensorRT-LLM's T5 runs as one GEMM: q/k/v of every attention, wi_0/wi_1."""
    groups = []
    for name, _ in model.named_modules():
        if name.endswith(("SelfAttention", "EncDecAttention")):
            groups.append([f"{name}.{p}" for p in "qkv"])
        elif name.endswith("DenseReluDense"):
            groups.append([f"{name}.wi_0", f"{name}.wi_1"])
    return groups


def build(opts: BuildOptions) -> dict:
    """Run the whole build; returns the manifest."""
    from transformers import T5ForConditionalGeneration

    from fastjudge.backends.t5.backend import TorchT5Backend

    cfg = checked_config(opts, T5_TYPES, "T5 / Flan-T5")
    out, device, dtype, base, judge, prompts = open_source(opts, TorchT5Backend)
    ref_results = agr.score(judge, prompts.data.heldout)
    start_id = base.shape.decoder_start_token_id
    report, exclude = {}, []
    if opts.precision == "fp8":
        model = T5ForConditionalGeneration.from_pretrained(opts.model, dtype=dtype).to(device).eval()
        linears, kv, report["fp8"] = quantize_and_compare(
            judge, model, prompts.data.heldout, calibration_loop(prompts.calibration, start_id),
            opts, encoder_decoder=True, exclude=(), fused=fused_groups(model), device_label=str(device))
        exclude = excluded_linears(model, linears)
        del model
        source = read_checkpoint(opts.model)
        kv_names = {attn: (f"{attn}.k", f"{attn}.v", k, v) for attn, (k, v) in kv.items()}
        ckpt_dir = write_fp8_checkpoint(opts.model, out / "checkpoint", fp8_state(source, linears, kv_names),
                                        opts.kv_fp8, exclude, producer())
        del source
    else:
        ckpt_dir = write_bf16(opts, out)
    key, report[key] = compare_checkpoint(ref_results, TorchT5Backend, ckpt_dir, prompts.data.heldout, opts,
                                          device, dtype)
    print("fastjudge build: agreement on held-out items\n" + agr.format_report(report))
    manifest = finish(
        out, opts, MODEL_KIND,
        model={"kind": MODEL_KIND, "model_type": cfg.get("model_type"),
               "architecture": (cfg.get("architectures") or ["T5ForConditionalGeneration"])[0],
               "source": str(opts.model), "decoder_start_token_id": start_id,
               "eos_token_id": base.shape.eos_token_id, "pad_token_id": base.codec.pad_token_id},
        quantization=quantization_section(opts, exclude),
        judge={**lave_template(judge), **judge_token_ids(base.codec)},
        lim=limits(opts, prompts.longest), calibration=calibration_section(prompts, opts), report=report,
        artifacts={"checkpoint": rel(ckpt_dir, out), "tokenizer": rel(ckpt_dir, out)},
        stages={"quantize": "done" if opts.precision == "fp8" else "not requested (--dtype bf16)",
                "export": "done", "agreement": "done"})
    return manifest
