"""Writing the checkpoint of a build in the Hugging Face layout: FP8 (ModelOpt) or BF16.

The layout is ModelOpt's unified Hugging Face FP8 checkpoint, which TensorRT-LLM's LLM API loads
(its ``hf_quant_config.json`` reader, ``FP8QDQLinearMethod``) and which fastjudge's torch
backend loads dequantized (``fastjudge/backends/fp8.py``): for every quantized linear layer
``<m>.weight`` in ``float8_e4m3fn`` with float32 scalars ``<m>.weight_scale`` and
``<m>.input_scale`` (amax / 448), ``<k>.k_scale`` / ``<v>.v_scale`` on the K and V projections of
attention layers with an FP8 KV cache, every other tensor as in the source checkpoint, and the
quantization declared in ``hf_quant_config.json`` and in ``config.json`` ``quantization_config``.
Tensor names are the source checkpoint's own, so the result loads wherever the source did. A BF16
build (``--dtype bf16``) writes the source tensors in bfloat16 and no quantization.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Mapping, Sequence

import torch

from fastjudge.backends.fp8 import e4m3_scale, quantize_e4m3

from .quantize import BuildError, LinearAmax

WEIGHT_FILE = "model.safetensors"
# Files of a checkpoint directory that are not weights and travel with it unchanged.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "spiece.model",
              "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
              "chat_template.json", "generation_config.json", "preprocessor_config.json",
              "video_preprocessor_config.json", "processor_config.json")


def read_checkpoint(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The source checkpoint's tensors under their stored names (safetensors only)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise BuildError(f"{model_dir}: no *.safetensors weights (builders read safetensors only)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def quantize_linear(weight: torch.Tensor, amax: LinearAmax) -> dict[str, torch.Tensor]:
    """``weight``/``weight_scale``/``input_scale`` of one FP8 linear layer."""
    w_scale = e4m3_scale(amax.weight)
    out = {"weight": quantize_e4m3(weight, w_scale), "weight_scale": w_scale}
    if amax.input is not None:
        out["input_scale"] = e4m3_scale(amax.input)
    return out


def fp8_state(source: Mapping[str, torch.Tensor], linears: Mapping[str, LinearAmax],
              kv: Mapping[str, tuple[str, str, float, float]] = {}) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint's tensors. ``linears``: quantized module name -> calibrated amax (names
    as in the checkpoint, without ``.weight``). ``kv``: attention name -> (K projection module,
    V projection module, K amax, V amax)."""
    out = dict(source)
    for module, amax in linears.items():
        key = f"{module}.weight"
        if key not in source:
            raise BuildError(f"quantized layer {module!r} has no tensor {key!r} in the checkpoint "
                             "(module and checkpoint names differ)")
        for suffix, tensor in quantize_linear(source[key], amax).items():
            out[f"{module}.{suffix}"] = tensor
    for attn, (k_proj, v_proj, k_amax, v_amax) in kv.items():
        out[f"{k_proj}.k_scale"] = e4m3_scale(k_amax)
        out[f"{v_proj}.v_scale"] = e4m3_scale(v_amax)
    return {k: v.contiguous() for k, v in out.items()}


def quant_declarations(kv_cache: bool, exclude_modules: Sequence[str], producer: dict,
                       engine_exclude: Sequence[str] = ()) -> tuple[dict, dict]:
    """(``hf_quant_config.json`` content, ``config.json`` ``quantization_config``).
    ``engine_exclude``: the same exclusions in TensorRT-LLM's own module names, listed in
    ``hf_quant_config.json`` after the checkpoint's names (which TensorRT-LLM reads) for releases
    that do not translate the checkpoint's names themselves (``qwen3_5.trtllm_exclude_modules``)."""
    names = list(exclude_modules) + [e for e in engine_exclude if e not in exclude_modules]
    hf_quant = {"producer": producer,
                "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if kv_cache else None,
                                 "exclude_modules": names}}
    scheme = {"dynamic": False, "num_bits": 8, "type": "float"}
    inline = {"quant_method": "modelopt", "quant_algo": "FP8", "producer": producer,
              "config_groups": {"group_0": {"input_activations": scheme, "weights": scheme, "targets": ["Linear"]}},
              "ignore": list(exclude_modules)}
    if kv_cache:
        inline["kv_cache_scheme"] = scheme
    return hf_quant, inline


def write_fp8_checkpoint(source_dir: str | os.PathLike, out_dir: str | os.PathLike, state: Mapping[str, torch.Tensor],
                         kv_cache: bool, exclude_modules: Sequence[str], producer: dict,
                         engine_exclude: Sequence[str] = ()) -> Path:
    """Write ``state`` (from :func:`fp8_state`) as a checkpoint directory next to the source's
    config, tokenizer and preprocessing files, its quantization declared (``engine_exclude``:
    see :func:`quant_declarations`)."""
    hf_quant, inline = quant_declarations(kv_cache, exclude_modules, producer, engine_exclude)
    out = _write(source_dir, out_dir, state, {"quantization_config": inline})
    (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    return out


def bf16_state(source: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The source checkpoint's tensors with every floating-point one in bfloat16."""
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in source.items()}


def write_bf16_checkpoint(source_dir: str | os.PathLike, out_dir: str | os.PathLike,
                          state: Mapping[str, torch.Tensor]) -> Path:
    """Write ``state`` (from :func:`bf16_state`): no quantization, ``torch_dtype`` bfloat16."""
    return _write(source_dir, out_dir, state, {"torch_dtype": "bfloat16"})


def _write(source_dir, out_dir, state: Mapping[str, torch.Tensor], config_updates: dict) -> Path:
    from safetensors.torch import save_file

    src, out = Path(source_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    for stale in [*out.glob("*.safetensors*"), out / "hf_quant_config.json"]:
        stale.unlink(missing_ok=True)
    save_file(dict(state), str(out / WEIGHT_FILE), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if "dtype" in config and "torch_dtype" in config_updates:  # transformers 5 names it dtype
        config["dtype"] = config_updates["torch_dtype"]
    config.update(config_updates)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def excluded_linears(model, linears: Mapping[str, LinearAmax], collapse: Sequence[str] = ()) -> list[str]:
    """Names of the model's linear layers left unquantized (the checkpoint's ``exclude_modules``);
    layers under a ``collapse`` prefix (e.g. a vision tower) are listed once as ``prefix*``."""
    names: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not name or name in linears:
            continue
        prefix = next((p for p in collapse if name.startswith(p)), None)
        entry = f"{prefix}*" if prefix else name
        if entry not in names:
            names.append(entry)
    return names
