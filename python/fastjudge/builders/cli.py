"""``fastjudge build {flan-t5,qwen3.5}``: argument wiring (registered by ``fastjudge.cli``)."""

from __future__ import annotations

import argparse
import sys

from . import DEFAULT_HELDOUT_FRACTION
from . import DEFAULT_MIN_AGREEMENT as DEFAULT_THRESHOLD
from . import DEFAULT_ONNX_OPSET as DEFAULT_OPSET

DEFAULT_KV_CACHE_FRACTION = 0.85  # builders.llm_options.DEFAULT_KV_CACHE_FRACTION (not imported: keeps the CLI light)

KINDS = ("flan-t5", "qwen3.5")


def add_build_parser(sub) -> None:
    p = sub.add_parser("build", help="a judge for TensorRT-LLM's LLM API: FP8 (or BF16) checkpoint, options, manifest",
                       description="FP8 post-training quantization (NVIDIA ModelOpt) of a judge checkpoint on "
                                   "judge prompts (or, with --dtype bf16, none), the checkpoint in the Hugging Face "
                                   "layout that TensorRT-LLM's LLM API and the torch backend load, the LLM-API "
                                   "options file sized for the judge, an agreement report against the source "
                                   "judge, and fastjudge-engine.json.")
    p.add_argument("kind", choices=KINDS, help="flan-t5 (T5 v1.1 family) or qwen3.5 (Qwen3.5 text/VL, Qwen3)")
    p.add_argument("--model", required=True, help="local Hugging Face checkpoint directory (safetensors)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--calib", default=None,
                   help="LAVE items (JSONL, `fastjudge lave` input layout) for calibration and the "
                        "agreement report (default: the bundled sample)")
    p.add_argument("--images", default=None,
                   help="qwen3.5 VL: JSONL of {\"image\": path, \"caption\": text} pairs added to calibration")
    p.add_argument("--heldout-fraction", type=float, default=DEFAULT_HELDOUT_FRACTION,
                   help=f"items held out of calibration for the agreement report ({DEFAULT_HELDOUT_FRACTION})")
    p.add_argument("--max-calib", type=int, default=512, help="calibration items at most (512)")
    p.add_argument("--max-heldout", type=int, default=256, help="held-out items at most (256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration/held-out split")
    p.add_argument("--num-shots", type=int, default=8)
    p.add_argument("--rationale", action="store_true", help="size the limits for rationale decoding")
    p.add_argument("--max-new-tokens", type=int, default=100, help="rationale length cap (100)")
    p.add_argument("--device", default="auto", help="calibration device: cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="fp8", choices=("fp8", "bf16"),
                   help="the checkpoint written: fp8 (ModelOpt, the default) or bf16 (no quantization)")
    p.add_argument("--calib-dtype", default="bfloat16",
                   help="dtype of the reference judge and of calibration (bfloat16; float32 on CPUs "
                        "without native bf16 is faster)")
    p.add_argument("--no-fp8-kv", action="store_true", help="keep the KV cache in the model dtype")
    p.add_argument("--min-agreement", type=float, default=DEFAULT_THRESHOLD,
                   help=f"rating agreement below which the build warns loudly ({DEFAULT_THRESHOLD})")
    p.add_argument("--strict", action="store_true", help="exit with status 1 below --min-agreement")
    p.add_argument("--max-batch-size", type=int, default=64, help="LLM-API max_batch_size (64)")
    p.add_argument("--max-input-len", type=int, default=None,
                   help="LLM-API max_input_len (default: longest calibration prompt plus headroom)")
    p.add_argument("--kv-cache-fraction", type=float, default=DEFAULT_KV_CACHE_FRACTION,
                   help=f"share of free GPU memory for the KV cache ({DEFAULT_KV_CACHE_FRACTION})")
    p.add_argument("--torch-compile", action="store_true",
                   help="add torch_compile_config to the LLM-API options (off: upstream's encoder-decoder "
                        "and Qwen3.5 configurations run without it)")
    p.add_argument("--no-onnx", action="store_true", help="qwen3.5 VL: skip the vision tower's ONNX export")
    p.add_argument("--onnx-opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset ({DEFAULT_OPSET})")


def options(args):
    from .pipeline import BuildOptions

    return BuildOptions(model=args.model, out=args.out, calib=args.calib, images=args.images,
                        heldout_fraction=args.heldout_fraction, max_calib=args.max_calib,
                        max_heldout=args.max_heldout, seed=args.seed, num_shots=args.num_shots,
                        rationale=args.rationale, max_new_tokens=args.max_new_tokens, device=args.device,
                        precision=args.dtype, calib_dtype=args.calib_dtype, kv_fp8=not args.no_fp8_kv,
                        min_agreement=args.min_agreement, max_batch_size=args.max_batch_size,
                        max_input_len=args.max_input_len, kv_cache_fraction=args.kv_cache_fraction,
                        torch_compile=args.torch_compile, onnx=not args.no_onnx, onnx_opset=args.onnx_opset)


def run_build(args) -> int:
    """0 when the build finished (even below the agreement threshold, after the warning);
    1 below it with --strict; 2 when the build could not run."""
    from .pipeline import gating_entry
    from .quantize import BuildError

    opts = options(args)
    try:
        if args.kind == "flan-t5":
            from .flan_t5 import build
        else:
            from .qwen3_5 import build
        manifest = build(opts)
    except BuildError as bad:
        print(f"fastjudge build: error: {bad}", file=sys.stderr)
        return 2
    passed = gating_entry(manifest["agreement"]).get("passed", False)
    return 1 if args.strict and not passed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastjudge")
    add_build_parser(parser.add_subparsers(dest="command", required=True))
    return run_build(parser.parse_args(argv))
