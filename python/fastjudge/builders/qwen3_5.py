"""``fastjudge build qwen3.5``: an FP8 Qwen3.5 judge (text or vision-language; Qwen3 too) for
TensorRT-LLM's LLM API.

Output directory::

    fastjudge-engine.json   the manifest (manifest.py)
    checkpoint/             FP8 checkpoint, Hugging Face layout: what TensorRT-LLM's LLM API loads
                            (``LLM(model="OUT/checkpoint")``) and the torch backend loads too
    vision.onnx, .json      the vision tower in ONNX and its input description (VL checkpoints)

The checkpoint is ModelOpt's Hugging Face FP8 format (``fp8_export.py``): TensorRT-LLM reads the
``hf_quant_config.json`` (``quant_algo: FP8``, ``kv_cache_quant_algo: FP8``) and per layer
``weight`` (E4M3), ``weight_scale``, ``input_scale``, and ``k_scale``/``v_scale`` on the K/V
projections of the full-attention layers; it fuses q/k/v and gate/up itself, taking the largest
scale. Left in the checkpoint dtype: embeddings, LM head, the vision tower, and in the Gated
DeltaNet layers ``conv1d``, ``in_proj_a``/``in_proj_b`` (ModelOpt's FP8 config) and
``in_proj_qkv``/``in_proj_z``: TensorRT-LLM's Qwen3.5 weight mapper packs these two into one
grouped ``in_proj_qkvz`` tensor and splits scale tensors by rows, which a per-tensor scalar scale
does not survive. No engine is built: the LLM API compiles the model when it loads the
checkpoint.

Calibration runs LAVE prompts through the chat template (as the torch backend formats them)
and, for VL checkpoints with ``--images``, image-caption prompts with their images.
"""

from __future__ import annotations

import logging

import torch

from . import agreement as agr
from .calibration import image_prompts, load_image_captions
from .fp8_export import excluded_linears, fp8_state, read_checkpoint, write_fp8_checkpoint
from .manifest import judge_token_ids, lave_template, new_manifest, write_manifest
from .pipeline import (
    BuildOptions,
    calibration_section,
    checked_config,
    compare_checkpoint,
    cuda_and_trtllm,
    open_source,
    producer,
    quantize_and_compare,
    rel,
)
from .quantize import BuildError

log = logging.getLogger("fastjudge")

MODEL_KIND = "qwen3.5"
QWEN_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3")
# Beyond ModelOpt's own FP8 exclusions (see the module docstring).
EXCLUDE = ("*linear_attn.in_proj_qkv", "*linear_attn.in_proj_z")


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
    max_input = opts.max_input_len or min(backend.max_input_tokens, int(-(-(longest_prompt + 256) // 256) * 256))
    new = opts.max_new_tokens if opts.rationale else 1
    return {"max_input_len": max_input, "max_batch_size": opts.max_batch_size,
            "max_seq_len": max_input + max(new, opts.max_new_tokens), "max_new_tokens": new,
            "longest_calibration_prompt": longest_prompt}


def build(opts: BuildOptions) -> dict:
    """Run the whole build; returns the manifest."""
    from fastjudge.backends.torch_qwen import TorchQwenBackend

    cfg = checked_config(opts, QWEN_TYPES, "Qwen3.5 / Qwen3")
    model_type = cfg.get("model_type")
    multimodal = bool(cfg.get("vision_config"))
    if opts.images and not multimodal:
        raise BuildError("--images needs a vision-language (Qwen3_5ForConditionalGeneration) checkpoint")
    out, device, dtype, base, judge, prompts = open_source(opts, TorchQwenBackend)
    pairs = load_image_captions(opts.images) if opts.images else []
    images = image_prompts(base, opts.model, pairs) if pairs else []
    ref_results = agr.score(judge, prompts.data.heldout)

    model = hf_model(opts.model, model_type, dtype).to(device).eval()
    linears, kv, fp8_entry = quantize_and_compare(
        judge, model, prompts.data.heldout, calibration_loop(prompts.calibration, images, cfg.get("image_token_id")),
        opts, encoder_decoder=False, exclude=EXCLUDE if model_type != "qwen3" else (), fused=fused_groups(model),
        device_label=str(device))
    exclude = excluded_linears(model, linears, collapse=("model.visual.",))
    del model

    source = read_checkpoint(opts.model)
    kv_names = {attn: (f"{attn}.k_proj", f"{attn}.v_proj", k, v) for attn, (k, v) in kv.items()}
    ckpt_dir = write_fp8_checkpoint(opts.model, out / "checkpoint", fp8_state(source, linears, kv_names),
                                    opts.kv_fp8, exclude, producer())
    del source
    ckpt_entry = compare_checkpoint(ref_results, TorchQwenBackend, ckpt_dir, prompts.data.heldout, opts, device, dtype)
    report = {"fp8": fp8_entry, "fp8_checkpoint_torch": ckpt_entry}
    print("fastjudge build: agreement on held-out items\n" + agr.format_report(report))

    stages = {"quantize": "done", "export": "done", "agreement": "done"}
    onnx_info, onnx_path = None, None
    if multimodal and opts.onnx:
        from .vision_onnx import export_vision_onnx

        onnx_path = out / "vision.onnx"
        onnx_info = export_vision_onnx(opts.model, onnx_path, opset=opts.onnx_opset)
        stages["vision_onnx"] = "done"
    why = cuda_and_trtllm(kind=MODEL_KIND, model_type=model_type)
    stages["trtllm"] = ({"status": "not run at build time",
                         "reason": "the LLM API loads OUT/checkpoint directly and compiles at load time"}
                        if why is None else {"status": "skipped", "reason": why})
    if why:
        print(f"fastjudge build: TensorRT-LLM stages skipped: {why}. {ckpt_dir} loads in TensorRT-LLM's LLM API "
              "on a CUDA machine (fastjudge backend='trtllm').")
    manifest = new_manifest(
        model={"kind": MODEL_KIND, "model_type": model_type,
               "architecture": (cfg.get("architectures") or [type(base).__name__])[0],
               "source": str(opts.model), "multimodal": multimodal,
               "eos_token_ids": sorted(base.codec.eos_token_ids), "pad_token_id": base.codec.pad_token_id},
        quantization={"algo": "FP8", "weights": "float8_e4m3fn, per-tensor scale",
                      "activations": "float8_e4m3fn, static per-tensor scale",
                      "kv_cache": "FP8" if opts.kv_fp8 else None, "excluded_modules": exclude,
                      "calibration_dtype": opts.dtype, "tool": producer()},
        judge={**lave_template(judge), **judge_token_ids(base.codec)},
        limits=limits(opts, prompts.longest, base),
        calibration=calibration_section(prompts, opts, [p.key for p in images], images=len(images)),
        agreement=report,
        artifacts={"checkpoint": rel(ckpt_dir, out), "tokenizer": rel(ckpt_dir, out),
                   "vision_onnx": rel(onnx_path, out), "vision_onnx_info": onnx_info},
        stages=stages)
    path = write_manifest(out, manifest)
    print(f"fastjudge build: wrote {path}")
    return manifest
