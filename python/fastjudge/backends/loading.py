"""Reading Hugging Face checkpoint directories safely, and picking a device and dtype."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("fastjudge")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked."""


def read_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: not a directory. Pass a local Hugging Face checkpoint directory "
            "(config.json, *.safetensors, tokenizer files)."
        )
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path}: no config.json; is this a Hugging Face checkpoint directory?")
    return json.loads(config.read_text())


def load_state_dict(model_dir: str | os.PathLike, allow_pickle: bool = False,
                    keep_fp8: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, from safetensors; pickle files only when the user opts in.

    Pickle-based weights can run arbitrary code when loaded, so they are refused by default.
    FP8 checkpoints load dequantized unless ``keep_fp8`` (for backends that run FP8 GEMMs).
    """
    path = Path(model_dir)
    safetensors_files = sorted(path.glob("*.safetensors"))
    if safetensors_files:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for file in safetensors_files:
            state.update(load_file(str(file)))
        return _dequantize_if_fp8(path, state, keep_fp8)
    pickle_files = sorted(f for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES and f.is_file())
    if not pickle_files:
        raise CheckpointError(f"{path}: no *.safetensors weights found.")
    if not allow_pickle:
        names = ", ".join(f.name for f in pickle_files)
        raise CheckpointError(
            f"{path}: only pickle-based weights found ({names}). Loading pickle can execute "
            "arbitrary code; convert the checkpoint to safetensors, or pass allow_pickle=True "
            "if you trust its source."
        )
    state = {}
    for file in pickle_files:
        state.update(torch.load(str(file), map_location="cpu", weights_only=True))
    return state


def _dequantize_if_fp8(path: Path, state: dict[str, torch.Tensor], keep: bool = False) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint (``fastjudge build``; see ``backends/fp8.py``) loads dequantized, so every
    backend reads it unchanged: ``weight * weight_scale`` in the checkpoint's dtype."""
    from .fp8 import FP8_DTYPE, dequantize_state, fp8_quant_algo

    algo = fp8_quant_algo(path)
    has_fp8 = any(t.dtype == FP8_DTYPE for t in state.values())
    if algo is None and not has_fp8:
        return state
    if algo != "FP8":
        found = f"quantization {algo!r}" if algo else "float8 tensors without an FP8 declaration"
        raise CheckpointError(f"{path}: {found} is not supported; the torch backend loads per-tensor "
                              "FP8 checkpoints declared in hf_quant_config.json (fastjudge build)")
    if keep:
        return state
    try:
        return dequantize_state(state)
    except ValueError as bad:
        raise CheckpointError(f"{path}: {bad}") from None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX), where bf16 GEMMs
    run 2-3x faster than float32; elsewhere bf16 is emulated and slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        try:
            return DTYPES[str(dtype).lower()]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}") from None
    if device.type == "cuda":
        chosen = torch.bfloat16
        reason = "CUDA device"
    elif cpu_has_native_bf16():
        chosen, reason = torch.bfloat16, "CPU has native bf16 matrix support"
    else:
        chosen, reason = torch.float32, "CPU lacks native bf16 matrix support"
    log.info("fastjudge: dtype %s (%s)", str(chosen).replace("torch.", ""), reason)
    return chosen
