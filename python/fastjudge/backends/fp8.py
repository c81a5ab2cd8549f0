"""FP8 (E4M3) per-tensor weights: the checkpoint format, dequantization, and FP8 GEMMs.

An FP8 checkpoint (what ``fastjudge build`` writes for the torch backend and for TensorRT-LLM's
LLM API) stores each quantized linear layer as

* ``<module>.weight``: ``float8_e4m3fn``, ``round(W / weight_scale)`` clamped to +-448;
* ``<module>.weight_scale``: float32 scalar, ``amax(W) / 448``;
* ``<module>.input_scale``: float32 scalar, ``amax(input) / 448`` from calibration (static
  activation quantization);
* ``k_proj.k_scale`` / ``v_proj.v_scale`` on attention layers with an FP8 KV cache,

and declares it in ``hf_quant_config.json`` (``{"quantization": {"quant_algo": "FP8", ...}}``)
and in ``config.json`` ``quantization_config`` (``quant_method: "modelopt"``).

The torch backends load such a checkpoint through :func:`dequantize_state`: each FP8 weight
becomes ``weight * weight_scale`` (computed in float32, one rounding to the checkpoint's dtype),
the scale tensors are dropped, and the model code is unchanged. :func:`fp8_linear` is the FP8
GEMM of the same layer (``torch._scaled_mm``: FP8 tensor cores on Hopper and later; PyTorch's
CPU kernel elsewhere); ``benchmarks/gpu_check.py`` checks it against the dequantized reference on
CUDA.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".k_scale", ".v_scale")


def fp8_quant_algo(model_dir: str | Path, config: dict | None = None) -> str | None:
    """``"FP8"`` when the checkpoint declares per-tensor FP8 quantization (``hf_quant_config.json``
    or ``config.json`` ``quantization_config``), else the declared algorithm or None."""
    path = Path(model_dir)
    hf_quant = path / "hf_quant_config.json"
    if hf_quant.is_file():
        algo = (json.loads(hf_quant.read_text()).get("quantization") or {}).get("quant_algo")
        if algo:
            return str(algo)
    if config is None:
        cfg_file = path / "config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    qc = config.get("quantization_config") or {}
    if str(qc.get("quant_method", "")).lower().startswith("modelopt") and qc.get("quant_algo"):
        return str(qc["quant_algo"])
    return None


def e4m3_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor scale ``amax / 448`` as a float32 scalar (a zero amax gets a tiny positive
    scale so that dequantization stays finite)."""
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(())
    return torch.clamp(amax, min=torch.finfo(torch.float32).tiny) / E4M3_MAX


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to E4M3 (saturating at +-448)."""
    return (x.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def dequantize_e4m3(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x8 * scale`` computed in float32, then rounded once to ``dtype``."""
    return (x8.float() * scale.float().reshape(())).to(dtype)


def dequantize_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The state dict with every FP8 ``<m>.weight`` replaced by ``weight * weight_scale`` and
    the scale tensors removed. ``dtype`` defaults to the most common floating dtype of the
    unquantized tensors (the dtype the checkpoint was written in)."""
    if dtype is None:
        counts = Counter(t.dtype for name, t in state.items()
                         if t.is_floating_point() and t.dtype != FP8_DTYPE and not any_suffix(name, SCALE_SUFFIXES))
        dtype = counts.most_common(1)[0][0] if counts else torch.float32
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if any_suffix(name, SCALE_SUFFIXES):
            continue
        if tensor.dtype == FP8_DTYPE:
            if not name.endswith(".weight"):
                raise ValueError(f"FP8 tensor {name!r} is not a weight; cannot dequantize it")
            scale_name = name[: -len("weight")] + "weight_scale"
            if scale_name not in state:
                raise ValueError(f"FP8 weight {name!r} has no {scale_name!r}")
            tensor = dequantize_e4m3(tensor, state[scale_name], dtype)
        out[name] = tensor
    return out


def any_suffix(name: str, suffixes) -> bool:
    return name.endswith(tuple(suffixes))


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ (weight_fp8 * weight_scale).T`` as one FP8 GEMM (``torch._scaled_mm``).

    ``x`` is quantized per tensor to E4M3 with ``input_scale`` (static, from calibration) or,
    when None, with its own ``amax / 448`` (dynamic). ``weight_fp8`` is ``[out, in]`` row-major,
    as stored in the checkpoint; its transpose is the column-major operand ``_scaled_mm`` wants.
    Leading dimensions of ``x`` are flattened. On Hopper/Ada GPUs this runs on FP8 tensor cores
    (inner and outer dimensions must be multiples of 16); PyTorch also has a CPU kernel.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    sx = e4m3_scale(x2.detach().abs().max()) if input_scale is None else input_scale.float().reshape(())
    x8 = quantize_e4m3(x2, sx.to(x2.device))
    sw = weight_scale.float().reshape(()).to(x2.device)
    y = torch._scaled_mm(x8, weight_fp8.t(), scale_a=sx.to(x2.device), scale_b=sw,
                         out_dtype=out_dtype or (x.dtype if x.dtype != FP8_DTYPE else torch.bfloat16))
    return y.reshape(*shape[:-1], weight_fp8.shape[0])


def fp8_linear_reference(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The math :func:`fp8_linear` computes, in float32: the E4M3-rounded input times the
    dequantized weight."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    sx = e4m3_scale(x2.abs().max()) if input_scale is None else input_scale.float().reshape(())
    xq = dequantize_e4m3(quantize_e4m3(x2, sx), sx)
    y = xq @ dequantize_e4m3(weight_fp8, weight_scale).t()
    return y.reshape(*x.shape[:-1], weight_fp8.shape[0])


def fp8_gemm_supported(device: torch.device) -> bool:
    """FP8 tensor-core GEMMs: CUDA devices of compute capability 8.9 (Ada) or 9.0+ (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Weight(torch.nn.Module):
    """A linear layer's FP8 weight ``[out, in]`` with its per-tensor scales, applied by
    :func:`fp8_linear` (a ``dense.Dense`` holding it calls it for its projection). The weight and
    scales are buffers, so a model holding this module moves them with ``.to(device)`` and lists
    them in its ``state_dict``; a dtype conversion of the model leaves them alone (FP8 data and
    float32 scales are what the FP8 GEMM reads)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float().reshape(()))
        self.register_buffer("input_scale", input_scale)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, out_dtype=x.dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_e4m3(self.weight, self.weight_scale, dtype)

    def _apply(self, fn, recurse=True):
        # Module.to / .cuda / .half convert every floating buffer, FP8 included: keep only the
        # move to another device, never a change of dtype.
        for name, buf in self._buffers.items():
            if buf is not None:
                self._buffers[name] = buf.to(fn(buf).device)
        return self


def projection_weight(state: dict[str, torch.Tensor], key: str, device, dtype):
    """A linear layer's weight from a (possibly FP8) state: an :class:`Fp8Weight` with its
    scales for an FP8 tensor, else the tensor in ``dtype`` on ``device``. KeyError if absent."""
    w = state[key]
    if w.dtype != FP8_DTYPE:
        return w.to(device=device, dtype=dtype)
    base = key[: -len("weight")]
    input_scale = state.get(base + "input_scale")
    return Fp8Weight(w.to(device), state[base + "weight_scale"].to(device),
                     None if input_scale is None else input_scale.to(device))


def fuse(weights: list, dtype: torch.dtype):
    """Projections that read the same input, stacked into one GEMM. FP8 weights stay FP8 when
    they share one weight scale (the builders calibrate fused groups to one scale, as
    TensorRT-LLM runs them); otherwise, or when some are not FP8, all are dequantized."""
    if all(isinstance(w, Fp8Weight) for w in weights) and len({float(w.weight_scale) for w in weights}) == 1:
        scales = [w.input_scale for w in weights if w.input_scale is not None]
        input_scale = (torch.stack([s.float().reshape(()) for s in scales]).max()
                       if len(scales) == len(weights) else None)
        return Fp8Weight(torch.cat([w.weight for w in weights]), weights[0].weight_scale, input_scale)
    return torch.cat([w.dequantize(dtype) if isinstance(w, Fp8Weight) else w for w in weights])
