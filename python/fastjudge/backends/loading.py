"""Reading Hugging Face checkpoint directories safely, and picking a device and dtype.

Every way a checkpoint can fail to load -- a missing or unparsable ``config.json``, impossible
config values, weight files that are truncated, garbage or refused pickles, tensors whose shapes
do not match the config -- is a :class:`CheckpointError` naming the file and the problem."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Mapping, NamedTuple

import torch

log = logging.getLogger("fastjudge")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# Above any size a real checkpoint declares (vocabularies ~250k, widths ~30k, contexts ~1M), far
# below one that would overflow an index: a larger config value is a broken config.
MAX_CONFIG_SIZE = 1 << 24


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
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as bad:
        raise CheckpointError(f"{config}: not valid JSON ({bad})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{config}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


class Placement(NamedTuple):
    """A checkpoint's config and where and how its model runs."""

    cfg: dict
    device: torch.device
    dtype: torch.dtype
    keep_fp8: bool  # run FP8 projections as FP8 GEMMs (else dequantized at load)


def place_checkpoint(model_dir: str | os.PathLike, model_types: tuple[str, ...], family: str,
                     device: str = "auto", dtype=None, fp8_gemm: bool | None = None) -> Placement:
    """The config (refused unless its model_type is one of ``model_types``), device and dtype
    for a torch backend; ``fp8_gemm`` defaults to devices with FP8 tensor cores."""
    from .fp8 import fp8_gemm_supported

    cfg = read_config(model_dir)
    if cfg.get("model_type") not in model_types:
        raise CheckpointError(f"{model_dir}: model_type {cfg.get('model_type')!r} is not {family}")
    device = resolve_device(device)
    keep_fp8 = fp8_gemm_supported(device) if fp8_gemm is None else fp8_gemm
    return Placement(cfg, device, resolve_dtype(dtype, device), keep_fp8)


def shape_from_config(shape_class, cfg: dict):
    """``shape_class._read(cfg)`` checked by its ``_validate()``: a missing key or a value of
    the wrong kind becomes a CheckpointError naming config.json, like an impossible value."""
    try:
        shape = shape_class._read(cfg)
    except CheckpointError:
        raise
    except KeyError as missing:
        raise CheckpointError(f"config.json lacks {missing}") from None
    except (AttributeError, TypeError, ValueError) as bad:
        raise CheckpointError(f"config.json: unusable value ({bad})") from None
    shape._validate()
    return shape


def require_ints(values: Mapping[str, object], minimum: int = 1, maximum: int = MAX_CONFIG_SIZE) -> None:
    """CheckpointError naming the first config value that is not an integer in
    ``[minimum, maximum]``."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise CheckpointError(f"config.json: {name} must be an integer from {minimum} to "
                                  f"{maximum}, got {value!r}")


def require_positive(values: Mapping[str, object]) -> None:
    """CheckpointError naming the first config value that is not a finite number above 0."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0):
            raise CheckpointError(f"config.json: {name} must be a finite number above 0, got {value!r}")


def check_shapes(state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple]) -> None:
    """CheckpointError for a tensor whose shape is not the one the config implies (``None`` in
    ``expected``: any size). Tensors absent from ``state`` are left to the loader, which names
    them."""
    for name, want in expected.items():
        tensor = state.get(name)
        if tensor is None:
            continue
        got = tuple(tensor.shape)
        if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
            implied = ["*" if w is None else w for w in want]
            raise CheckpointError(f"tensor {name!r} has shape {list(got)}, but config.json implies "
                                  f"{implied}")


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
            try:
                state.update(load_file(str(file)))
            except Exception as bad:  # noqa: BLE001 - the reader's errors are of its own types
                raise CheckpointError(f"{file}: not a readable safetensors file "
                                      f"({one_line(bad)})") from None
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
        try:
            loaded = torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as bad:  # noqa: BLE001 - refused globals, truncated or garbage files
            raise CheckpointError(f"{file}: pickle refused or unreadable under weights_only "
                                  f"({one_line(bad)})") from None
        if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
            raise CheckpointError(f"{file}: not a state dict of tensors")
        state.update(loaded)
    return state


def one_line(bad: Exception) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = [x.strip() for x in str(bad).splitlines() if x.strip()]
    return f"{type(bad).__name__}: {lines[0]}" if lines else type(bad).__name__


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
