"""The steps every judge build takes, in order; ``flan_t5.py`` and ``qwen3_5.py`` call them.

1. open the source judge (torch backend, calibration dtype) and build calibration and held-out
   prompts with it;
2. score the held-out items with it;
3. FP8 (the default): load the transformers model, score the held-out items (reference),
   calibrate FP8 with ModelOpt on the calibration prompts, score them again fake-quantized
   (``agreement.py``), write the FP8 checkpoint from the calibrated ranges; BF16 (``--dtype
   bf16``): write the source tensors in bfloat16;
4. score the held-out items with the torch backend on the written checkpoint;
5. the model-specific stages (ONNX), then the LLM-API options file (``llm_options.py``) and the
   manifest (:func:`finish`).
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
from .llm_options import DEFAULT_KV_CACHE_FRACTION, llm_options, write_llm_options
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
    precision: str = "fp8"  # the checkpoint written: "fp8" (ModelOpt) or "bf16" (no quantization)
    calib_dtype: str = "bfloat16"  # reference judge and calibration compute dtype
    kv_fp8: bool = True
    min_agreement: float = DEFAULT_MIN_AGREEMENT
    max_batch_size: int = 64
    max_input_len: int | None = None
    kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION
    torch_compile: bool = False  # torch_compile_config in the LLM-API options (llm_options.py)
    onnx: bool = True
    onnx_opset: int = DEFAULT_ONNX_OPSET


def resolve(opts: BuildOptions) -> tuple[torch.device, torch.dtype]:
    from fastjudge.backends.loading import resolve_device, resolve_dtype

    device = resolve_device(opts.device)
    return device, resolve_dtype(opts.calib_dtype, device)


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
        {"reference": f"transformers {type(model).__name__}, {opts.calib_dtype}, {device_label}",
         "candidate": "same model with ModelOpt FP8 fake quantization (E4M3 weights and activations"
                      + (", FP8 K/V" if opts.kv_fp8 else "") + ")"})
    return linears, kv, entry


def compare_checkpoint(reference_results, backend_cls, ckpt_dir: Path, heldout, opts: BuildOptions,
                       device, dtype) -> tuple[str, dict]:
    """The torch backend on the written checkpoint against the torch backend on the source.
    Returns the report's key and entry; a BF16 build's entry carries the threshold (it has no
    fake-quantization entry)."""
    backend = backend_cls(ckpt_dir, device=str(device), dtype=dtype)
    results = agr.score(open_judge(backend, opts), heldout)
    fp8 = opts.precision == "fp8"
    entry = agr.agreement_entry(
        reference_results, results, None if fp8 else opts.min_agreement,
        f"{opts.precision.upper()} checkpoint through the torch backend",
        {"reference": f"fastjudge torch backend, source checkpoint, {opts.calib_dtype}",
         "candidate": (f"fastjudge torch backend, FP8 checkpoint (weights dequantized to {opts.calib_dtype}, "
                       "activations unquantized)" if fp8 else
                       f"fastjudge torch backend, BF16 checkpoint computed in {opts.calib_dtype}")})
    return f"{opts.precision}_checkpoint_torch", entry


def gating_entry(agreement: dict) -> dict:
    """The agreement entry the threshold applies to: FP8 fake quantization, else the BF16
    checkpoint."""
    return agreement.get("fp8") or agreement["bf16_checkpoint_torch"]


def producer() -> dict:
    from fastjudge import __version__

    return {"name": "fastjudge", "version": __version__, "calibrated_with": {"nvidia-modelopt": modelopt_version()}}


def rel(path: Path | None, root: Path) -> str | None:
    return None if path is None else os.path.relpath(path, root)


def trtllm_here(kind: str, model_type: str | None = None) -> str | None:
    """None when this machine can run the build in TensorRT-LLM, else why not (the installed
    release is checked by ``backends.trtllm.trtllm_mismatch``)."""
    from ..backends.trtllm import trtllm_mismatch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return trtllm_mismatch(kind, model_type)


def finish(out: Path, opts: BuildOptions, kind: str, model: dict, quantization: dict, judge: dict, lim: dict,
           calibration: dict, report: dict, artifacts: dict, stages: dict) -> dict:
    """Write the LLM-API options file and the manifest; returns the manifest."""
    from .manifest import new_manifest, write_manifest

    options_path = write_llm_options(out, llm_options(kind, model.get("model_type"), lim, opts.kv_cache_fraction,
                                                          opts.torch_compile))
    why = trtllm_here(kind, model.get("model_type"))
    stages["trtllm"] = ({"status": "not run at build time",
                         "reason": "the LLM API loads the checkpoint with the options file and compiles at load"}
                        if why is None else {"status": "skipped", "reason": why})
    if why:
        print(f"fastjudge build: TensorRT-LLM not available here ({why}); {out} loads in TensorRT-LLM's LLM API "
              "on a CUDA machine (backend='trtllm'), its checkpoint in the torch backend anywhere.")
    manifest = new_manifest(model=model, quantization=quantization, judge=judge, limits=lim,
                            calibration=calibration, agreement=report,
                            artifacts={**artifacts, "llm_options": rel(options_path, out)}, stages=stages)
    path = write_manifest(out, manifest)
    print(f"fastjudge build: wrote {path}")
    return manifest


def quantization_section(opts: BuildOptions, exclude: Sequence[str] = ()) -> dict:
    if opts.precision == "bf16":
        return {"algo": None, "dtype": "bfloat16", "calibration_dtype": opts.calib_dtype, "tool": producer()}
    return {"algo": "FP8", "weights": "float8_e4m3fn, per-tensor scale",
            "activations": "float8_e4m3fn, static per-tensor scale",
            "kv_cache": "FP8" if opts.kv_fp8 else None, "excluded_modules": list(exclude),
            "calibration_dtype": opts.calib_dtype, "tool": producer()}


def write_bf16(opts: BuildOptions, out: Path) -> Path:
    """A BF16 build's checkpoint: the source tensors in bfloat16, no quantization."""
    from .fp8_export import bf16_state, read_checkpoint, write_bf16_checkpoint

    return write_bf16_checkpoint(opts.model, out / "checkpoint", bf16_state(read_checkpoint(opts.model)))
