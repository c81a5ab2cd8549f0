"""``fastjudge build qwen3.5``: a Qwen3.5 judge (text or vision-language; Qwen3 too) for
TensorRT-LLM's LLM API.

Output directory::

    fastjudge-engine.json   the manifest (manifest.py)
    checkpoint/             Hugging Face checkpoint, FP8 (or BF16 with ``--dtype bf16``): what
                            TensorRT-LLM's LLM API loads (``LLM(model="OUT/checkpoint")``) and the
                            torch backend loads too
    llm_api_options.yaml    the LLM-API options (``llm_options.py``)
    vision.onnx, .json      the vision tower in ONNX and its input description (VL checkpoints)

The checkpoint is ModelOpt's Hugging Face FP8 format (``fp8_export.py``): TensorRT-LLM reads the
``hf_quant_config.json`` (``quant_algo: FP8``, ``kv_cache_quant_algo: FP8``) and per layer
``weight`` (E4M3), ``weight_scale``, ``input_scale``, and ``k_scale``/``v_scale`` on the K/V
projections of the full-attention layers; it fuses q/k/v and gate/up itself, taking the largest
scale. Left in the checkpoint dtype: embeddings, LM head, the vision tower, and in the Gated
DeltaNet layers ``conv1d``, ``in_proj_a``/``in_proj_b`` (ModelOpt's FP8 config) and
``in_proj_qkv``/``in_proj_z``: TensorRT-LLM's Qwen3.5 weight mapper packs these two into one
grouped ``in_proj_qkvz`` tensor and splits scale tensors by rows, which a per-tensor scalar scale
does not survive (NVIDIA/TensorRT-LLM
``tensorrt_llm/_torch/models/checkpoints/hf/qwen3_5_weight_mapper.py``, v1.3.0rc22 to v1.4.0rc1).

``exclude_modules`` names the checkpoint's modules, which is what ModelOpt writes and what
TensorRT-LLM's newer Qwen3.5 loaders translate (``_normalize_qwen35_exclude_modules`` in
``tensorrt_llm/_torch/models/modeling_qwen3_5.py``: the language-model prefix dropped, split
projections mapped to the packed ``in_proj_qkvz`` / ``in_proj_ba``). Releases without that
translation match none of them, and in every release read the Gated DeltaNet's ``conv1d`` (an
``nn.Conv1d`` in the checkpoint, so never a quantized linear layer here) is built as a ``Linear``
under the global FP8 config (``modeling_qwen3_next.py``). So ``hf_quant_config.json`` also lists
the same exclusions in TensorRT-LLM's own names (:func:`trtllm_exclude_modules`), ``conv1d``
included; the additions name no module of the checkpoint, so they change nothing for loaders
that read the checkpoint's names.
The vision tower is left out of the quantization (it keeps the checkpoint's dtype). No
engine is built: the LLM API compiles the model (torch.compile, CUDA graphs) when it loads the
checkpoint with the options file.

Calibration runs LAVE prompts through the chat template (as the torch backend formats them)
and, for VL checkpoints with ``--images``, image-caption prompts with their images.
"""

from __future__ import annotations

import logging
import re

import torch

from . import agreement as agr
from .calibration import image_prompts, load_image_captions
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
from .quantize import BuildError

log = logging.getLogger("fastjudge")

MODEL_KIND = "qwen3.5"
QWEN_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3")
# Beyond ModelOpt's own FP8 exclusions (see the module docstring).
EXCLUDE = ("*linear_attn.in_proj_qkv", "*linear_attn.in_proj_z")


def trtllm_exclude_modules(hf_excluded: list[str], linear_attn_blocks: list[str]) -> list[str]:
    """The FP8 exclusions of the Gated DeltaNet layers in TensorRT-LLM's module names.

    ``linear_attn_blocks``: the checkpoint's linear-attention modules (``...layers.N.linear_attn``,
    with or without the VL ``model.language_model.`` prefix); ``hf_excluded``: the checkpoint
    names left unquantized. For each block, upstream's ``model.layers.N.linear_attn``: ``conv1d``
    always; ``in_proj_qkvz`` where ``in_proj_qkv`` or ``in_proj_z`` is excluded (upstream packs
    them into one GEMM); ``in_proj_ba`` where ``in_proj_a`` or ``in_proj_b`` is."""
    excluded = set(hf_excluded)
    out = []
    for block in linear_attn_blocks:
        m = re.search(r"layers\.(\d+)\.linear_attn$", block)
        if m is None:
            continue
        base = f"model.layers.{m.group(1)}.linear_attn"
        out.append(f"{base}.conv1d")
        if excluded & {f"{block}.in_proj_qkv", f"{block}.in_proj_z"}:
            out.append(f"{base}.in_proj_qkvz")
        if excluded & {f"{block}.in_proj_a", f"{block}.in_proj_b"}:
            out.append(f"{base}.in_proj_ba")
    return out


def hf_model(model_dir: str, model_type: str, dtype: torch.dtype):
    if model_type == "qwen3_5":
        from transformers import Qwen3_5ForConditionalGeneration as cls
    elif model_type == "qwen3_5_text":
        from transformers import Qwen3_5ForCausalLM as cls
    else:
        from transformers import Qwen3ForCausalLM as cls
    return cls.from_pretrained(model_dir, dtype=dtype)


def calibration_loop(prompts, images, image_token_id: int | None):
    """ModelOpt's forward loop: each prompt alone (padding would widen activation ranges), then
    each image-caption prompt with its image."""
    def forward_loop(model):
        device = next(model.parameters()).device
        with torch.inference_mode():
            for ids in prompts:
                model(input_ids=torch.as_tensor(ids, device=device)[None])
            for p in images:
                t = torch.as_tensor(p.ids, device=device)[None]
                model(input_ids=t, pixel_values=p.pixel_values.to(device), image_grid_thw=p.grid_thw.to(device),
                      mm_token_type_ids=(t == image_token_id).int())
    return forward_loop


def fused_groups(model) -> list[list[str]]:
    """Layers TensorRT-LLM runs as one GEMM (taking the largest scale when it loads them):
    q/k/v of the full-attention layers, gate/up of the MLPs."""
    groups = []
    for name, module in model.named_modules():
        if name.endswith("self_attn") and hasattr(module, "q_proj"):
            groups.append([f"{name}.{p}_proj" for p in "qkv"])
        elif name.endswith("mlp") and hasattr(module, "gate_proj"):
            groups.append([f"{name}.gate_proj", f"{name}.up_proj"])
    return groups


def limits(opts: BuildOptions, longest_prompt: int, backend) -> dict:
    """Prompts up to the longest calibration/held-out prompt plus headroom (rounded to 256, at
    most the model's limit); room for ``--max-new-tokens`` generated tokens even for a
    score-only LAVE judge, since the same model serves generating judges (rationales,
    VisExMEM's JSON stages)."""
    max_input = opts.max_input_len or min(backend.max_input_tokens, int(-(-(longest_prompt + 256) // 256) * 256))
    return llm_limits(max_input, opts.max_new_tokens, opts.max_batch_size, longest_prompt)


def build(opts: BuildOptions) -> dict:
    """Run the whole build; returns the manifest."""
    from fastjudge.backends.qwen.backend import TorchQwenBackend

    cfg = checked_config(opts, QWEN_TYPES, "Qwen3.5 / Qwen3")
    model_type = cfg.get("model_type")
    multimodal = bool(cfg.get("vision_config"))
    if opts.images and not multimodal:
        raise BuildError("--images needs a vision-language (Qwen3_5ForConditionalGeneration) checkpoint")
    out, device, dtype, base, judge, prompts = open_source(opts, TorchQwenBackend)
    pairs = load_image_captions(opts.images) if opts.images and opts.precision == "fp8" else []
    images = image_prompts(base, opts.model, pairs) if pairs else []
    ref_results = agr.score(judge, prompts.data.heldout)
    report, exclude = {}, []
    if opts.precision == "fp8":
        model = hf_model(opts.model, model_type, dtype).to(device).eval()
        linears, kv, report["fp8"] = quantize_and_compare(
            judge, model, prompts.data.heldout,
            calibration_loop(prompts.calibration, images, cfg.get("image_token_id")), opts, encoder_decoder=False,
            exclude=EXCLUDE if model_type != "qwen3" else (), fused=fused_groups(model), device_label=str(device))
        exclude = excluded_linears(model, linears, collapse=("model.visual.",))
        engine_exclude = trtllm_exclude_modules(
            exclude, [name for name, _ in model.named_modules() if name.endswith(".linear_attn")])
        del model
        source = read_checkpoint(opts.model)
        kv_names = {attn: (f"{attn}.k_proj", f"{attn}.v_proj", k, v) for attn, (k, v) in kv.items()}
        ckpt_dir = write_fp8_checkpoint(opts.model, out / "checkpoint", fp8_state(source, linears, kv_names),
                                        opts.kv_fp8, exclude, producer(), engine_exclude)
        del source
    else:
        ckpt_dir = write_bf16(opts, out)
    key, report[key] = compare_checkpoint(ref_results, TorchQwenBackend, ckpt_dir, prompts.data.heldout, opts,
                                          device, dtype)
    print("fastjudge build: agreement on held-out items\n" + agr.format_report(report))

    stages = {"quantize": "done" if opts.precision == "fp8" else "not requested (--dtype bf16)",
              "export": "done", "agreement": "done"}
    onnx_info, onnx_path = None, None
    if multimodal and opts.onnx:
        from .vision_onnx import export_vision_onnx

        onnx_path = out / "vision.onnx"
        onnx_info = export_vision_onnx(opts.model, onnx_path, opset=opts.onnx_opset)
        stages["vision_onnx"] = "done"
    return finish(
        out, opts, MODEL_KIND,
        model={"kind": MODEL_KIND, "model_type": model_type,
               "architecture": (cfg.get("architectures") or [type(base).__name__])[0],
               "source": str(opts.model), "multimodal": multimodal,
               "eos_token_ids": sorted(base.codec.eos_token_ids), "pad_token_id": base.codec.pad_token_id},
        quantization=quantization_section(opts, exclude), judge={**lave_template(judge), **judge_token_ids(base.codec)},
        lim=limits(opts, prompts.longest, base),
        calibration=calibration_section(prompts, opts, [p.key for p in images], images=len(images)), report=report,
        artifacts={"checkpoint": rel(ckpt_dir, out), "tokenizer": rel(ckpt_dir, out),
                   "vision_onnx": rel(onnx_path, out), "vision_onnx_info": onnx_info},
        stages=stages)
