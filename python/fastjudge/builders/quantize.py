"""FP8 post-training quantization with NVIDIA ModelOpt.

``mtq.quantize`` with ModelOpt's ``FP8_DEFAULT_CFG`` (E4M3 weights and E4M3 activations, one
static per-tensor scale each, max calibration) plus, where the target keeps an FP8 KV cache,
E4M3 quantizers on the attention K and V (``*[kv]_bmm_quantizer``). The config's own exclusions
stay (LM head, embeddings, vision tower, Gated DeltaNet conv1d and the tiny ``in_proj_a/b``);
builders add theirs.

ModelOpt's quantizers are fake-quantizing modules: after calibration the model still runs in
its own dtype on any device, CPU included, with every quantized tensor rounded to E4M3 and back.
That is what the agreement report runs; the amax each quantizer calibrated is what the FP8
checkpoints store (scale = amax / 448).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

log = logging.getLogger("fastjudge")


class BuildError(RuntimeError):
    """A build that cannot go on (missing tool, unusable checkpoint)."""


def import_modelopt():
    """``modelopt.torch.quantization``, or a BuildError saying how to install it."""
    try:
        with warnings.catch_warnings():  # its import warns about untested transformers versions
            warnings.simplefilter("ignore")
            import modelopt.torch.quantization as mtq
    except ImportError as missing:
        raise BuildError(f"FP8 quantization needs NVIDIA ModelOpt ({missing}); install it with "
                         "pip install 'fastjudge[build]' (or pip install nvidia-modelopt)") from None
    return mtq


def fp8_config(mtq, kv_cache: bool = True, exclude: Sequence[str] = ()) -> dict:
    """ModelOpt's FP8 config, FP8 K/V quantizers when ``kv_cache``, and ``exclude`` (module-name
    wildcards) left unquantized.

    ``quant_cfg`` changed shape between ModelOpt releases: up to 0.43 it maps a wildcard to its
    quantizer attributes (later keys win), from 0.44 it is a list of ``{"quantizer_name", "cfg" |
    "enable"}`` entries (later entries win). The form is read from the config itself, so one
    build runs under either."""
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    rules = [("*[kv]_bmm_quantizer", {"num_bits": (4, 3), "axis": None})] if kv_cache else []
    rules += [(f"{pattern}*", None) for pattern in exclude]  # None: disable
    entries = cfg["quant_cfg"]
    if isinstance(entries, dict):
        for name, attrs in rules:
            entries[name] = {"enable": False} if attrs is None else dict(attrs)
    elif isinstance(entries, list):
        for name, attrs in rules:
            entries.append({"quantizer_name": name, "enable": False} if attrs is None
                           else {"quantizer_name": name, "cfg": dict(attrs)})
    else:
        raise BuildError(f"unrecognised ModelOpt quant_cfg ({type(entries).__name__}); "
                         f"nvidia-modelopt {modelopt_version()} is not supported")
    return cfg


def quantize_fp8(model, forward_loop: Callable, kv_cache: bool = True, exclude: Sequence[str] = ()):
    """Calibrate and insert FP8 fake quantizers in place; returns the model."""
    mtq = import_modelopt()
    chatter = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(chatter):
        warnings.simplefilter("ignore")
        model = mtq.quantize(model, fp8_config(mtq, kv_cache, exclude), forward_loop)
    for line in chatter.getvalue().splitlines():
        log.info("modelopt: %s", line)
    return model


def tie_fused_ranges(model, groups: Sequence[Sequence[str]]) -> None:
    """Give the layers TensorRT-LLM fuses into one GEMM (q/k/v, gate/up) one weight range and
    one input range, the largest of the group, as TensorRT-LLM does when it loads them: the fake
    quantization then computes what the engine computes."""
    modules = dict(model.named_modules())
    for group in groups:
        members = [modules[name] for name in group if name in modules]
        for kind in ("weight_quantizer", "input_quantizer"):
            quantizers = [getattr(m, kind, None) for m in members]
            if len(quantizers) < 2 or any(_amax(q) is None for q in quantizers):
                continue
            top = max(q.amax.detach().float().abs().max() for q in quantizers)
            for q in quantizers:
                q.amax = top.to(q.amax.device, q.amax.dtype).expand_as(q.amax).clone()


@dataclass(frozen=True)
class LinearAmax:
    """Calibrated ranges of one quantized linear layer."""

    weight: float
    input: float | None


def _amax(quantizer) -> float | None:
    if quantizer is None or not getattr(quantizer, "is_enabled", False):
        return None
    amax = getattr(quantizer, "amax", None)
    if amax is None:
        return None
    return float(amax.detach().float().abs().max())


def collect_amax(model) -> tuple[dict[str, LinearAmax], dict[str, tuple[float, float]]]:
    """``{linear module name: LinearAmax}`` of every layer with an enabled weight quantizer, and
    ``{attention module name: (k amax, v amax)}`` of every attention with K/V quantizers."""
    linears: dict[str, LinearAmax] = {}
    kv: dict[str, tuple[float, float]] = {}
    for name, module in model.named_modules():
        w = _amax(getattr(module, "weight_quantizer", None))
        if w is not None and getattr(module, "weight", None) is not None:
            linears[name] = LinearAmax(weight=w, input=_amax(getattr(module, "input_quantizer", None)))
        k, v = _amax(getattr(module, "k_bmm_quantizer", None)), _amax(getattr(module, "v_bmm_quantizer", None))
        if k is not None and v is not None:
            kv[name] = (k, v)
    if not linears:
        raise BuildError("no layer was quantized (ModelOpt found no linear layers to calibrate)")
    return linears, kv


def modelopt_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("nvidia-modelopt")
    except Exception:
        return None
