"""The steps every FP8 judge build takes, in order; ``flan_t5.py`` and ``qwen3_5.py`` call them.

1. open the source judge (torch backend, reference dtype) and build calibration and held-out
   prompts with it;
2. score the held-out items with it;
3. load the transformers model, score the held-out items (reference), calibrate FP8 with
   ModelOpt on the calibration prompts, score them again fake-quantized (``agreement.py``);
4. write the FP8 checkpoint(s) from the calibrated ranges;
5. score the held-out items with the torch backend on the written FP8 checkpoint;
6. the model-specific stages (TensorRT-LLM engines, ONNX), then the manifest.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from . import DEFAULT_HELDOUT_FRACTION, DEFAULT_MIN_AGREEMENT, DEFAULT_ONNX_OPSET
from . import agreement as agr
from .calibration import CalibrationSet, judge_prompts, load_examples, prompts_sha256, split_examples
from .quantize import BuildError, collect_amax, modelopt_version, quantize_fp8, tie_fused_ranges

log = logging.getLogger("fastjudge")


@dataclass
class BuildOptions:
    model: str
    out: str
    calib: str | None = None  # LAVE JSONL; None: the bundled sample
    images: str | None = None  # image-caption JSONL (Qwen3.5-VL)
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION
    max_calib: int = 512
    max_heldout: int = 256
    seed: int = 0
    num_shots: int = 8
    rationale: bool = False
    max_new_tokens: int = 100
    device: str = "auto"
    dtype: str = "bfloat16"  # reference judge and calibration compute dtype
    kv_fp8: bool = True
    min_agreement: float = DEFAULT_MIN_AGREEMENT
    max_batch_size: int = 64
    max_input_len: int | None = None
    engine_dtype: str = "bfloat16"
    skip_engines: bool = False
    onnx: bool = True
    onnx_opset: int = DEFAULT_ONNX_OPSET


def resolve(opts: BuildOptions) -> tuple[torch.device, torch.dtype]:
    from fastjudge.backends.loading import resolve_device, resolve_dtype

    device = resolve_device(opts.device)
    return device, resolve_dtype(opts.dtype, device)


def open_judge(backend, opts: BuildOptions):
    from fastjudge.judges.lave import LaveJudge

    return LaveJudge(backend, rationale=opts.rationale, num_shots=opts.num_shots,
                     max_new_tokens=opts.max_new_tokens)


@dataclass
class Prompts:
    data: CalibrationSet
    calibration: list[np.ndarray]
    heldout: list[np.ndarray]

    @property
    def longest(self) -> int:
        return max(len(p) for p in self.calibration + self.heldout)


def prepare_prompts(judge, opts: BuildOptions) -> Prompts:
    examples, source = load_examples(opts.calib)
    data = split_examples(examples, source, opts.heldout_fraction, opts.max_calib, opts.max_heldout, opts.seed)
    calib = judge_prompts(judge, data.calibration)
    if not calib:
        raise BuildError(f"{source}: none of the calibration items gives a valid judge prompt")
    held = judge_prompts(judge, data.heldout)
    log.info("fastjudge build: %d calibration prompts, %d held-out prompts (%s)", len(calib), len(held), source)
    return Prompts(data=data, calibration=calib, heldout=held)


def checked_config(opts: BuildOptions, model_types: Sequence[str], family: str) -> dict:
    """The source checkpoint's config, refused unless its model_type is one of ``model_types``."""
    from fastjudge.backends.loading import read_config

    cfg = read_config(opts.model)
    if cfg.get("model_type") not in model_types:
        raise BuildError(f"{opts.model}: model_type {cfg.get('model_type')!r} is not a {family} checkpoint")
    return cfg


class Source(NamedTuple):
    """Step 1: the output directory, compute device and dtype, the source judge on its torch
    backend, and the prompts it builds."""

    out: Path
    device: torch.device
    dtype: torch.dtype
    base: object  # the torch backend of the source checkpoint
    judge: object  # LaveJudge on it
    prompts: Prompts


def open_source(opts: BuildOptions, backend_class) -> Source:
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    device, dtype = resolve(opts)
    base = backend_class(opts.model, device=str(device), dtype=dtype)
    judge = open_judge(base, opts)
    return Source(out, device, dtype, base, judge, prepare_prompts(judge, opts))


def calibration_section(prompts: Prompts, opts: BuildOptions, extra_hashes: Sequence[bytes] = (),
                        images: int = 0) -> dict:
    return {"source": prompts.data.source, "items": len(prompts.data.calibration),
            "prompts": len(prompts.calibration), "images": images,
            "heldout_items": len(prompts.data.heldout), "heldout_prompts": len(prompts.heldout),
            "heldout_fraction": opts.heldout_fraction, "seed": opts.seed,
            "sha256": prompts_sha256(prompts.calibration, extra_hashes),
            "heldout_sha256": prompts_sha256(prompts.heldout)}


def quantize_and_compare(judge, model, heldout, forward_loop: Callable, opts: BuildOptions, encoder_decoder: bool,
                         exclude: Sequence[str], fused: Sequence[Sequence[str]],
                         device_label: str) -> tuple[dict, dict, dict]:
    """Reference and fake-quantized transformers judges on the held-out items, with FP8
    calibration in between (``fused``: layer groups the engine runs as one GEMM, given one
    range). Returns (linear amax, kv amax, the report's ``fp8`` entry)."""
    adapter = agr.TransformersChoiceBackend(model, judge.backend, encoder_decoder)
    ref_judge = open_judge(adapter, opts)
    reference = agr.score(ref_judge, heldout)
    quantize_fp8(model, forward_loop, kv_cache=opts.kv_fp8, exclude=exclude)
    tie_fused_ranges(model, fused)
    fp8 = agr.score(ref_judge, heldout)
    linears, kv = collect_amax(model)
    entry = agr.agreement_entry(
        reference, fp8, opts.min_agreement, "FP8 judge (ModelOpt fake quantization) vs reference",
        {"reference": f"transformers {type(model).__name__}, {opts.dtype}, {device_label}",
         "candidate": "same model with ModelOpt FP8 fake quantization (E4M3 weights and activations"
                      + (", FP8 K/V" if opts.kv_fp8 else "") + ")"})
    return linears, kv, entry


def compare_checkpoint(reference_results, backend_cls, fp8_dir: Path, heldout, opts: BuildOptions,
                       device, dtype) -> dict:
    """The torch backend on the written FP8 checkpoint against the torch backend on the source."""
    backend = backend_cls(fp8_dir, device=str(device), dtype=dtype)
    results = agr.score(open_judge(backend, opts), heldout)
    return agr.agreement_entry(
        reference_results, results, None, "FP8 checkpoint through the torch backend",
        {"reference": f"fastjudge torch backend, source checkpoint, {opts.dtype}",
         "candidate": "fastjudge torch backend, FP8 checkpoint (weights dequantized, activations unquantized)"})


def producer() -> dict:
    from fastjudge import __version__

    return {"name": "fastjudge", "version": __version__, "calibrated_with": {"nvidia-modelopt": modelopt_version()}}


def rel(path: Path | None, root: Path) -> str | None:
    return None if path is None else os.path.relpath(path, root)


def cuda_and_trtllm(needs_trtllm_build: bool = False, kind: str | None = None,
                    model_type: str | None = None) -> str | None:
    """None when TensorRT-LLM stages can run here, else why not. Only the TensorRT-backend
    engines (Flan-T5) are built with the ``trtllm-build`` command; the Qwen3.5 path goes through
    the LLM API, which needs the importable package alone. With ``kind``, the installed release
    must also serve that judge (``backends.trtllm.trtllm_mismatch``, which names the extra)."""
    import importlib.util
    import shutil

    from ..backends.trtllm import _install_hint, trtllm_mismatch

    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("tensorrt_llm") is None:
        return f"TensorRT-LLM is not installed ({_install_hint(kind)})"
    if kind is not None:
        why = trtllm_mismatch(kind, model_type)
        if why:
            return why
    if needs_trtllm_build and shutil.which("trtllm-build") is None:
        return "trtllm-build is not on PATH"
    return None
