"""``fastjudge build flan-t5``: an FP8 Flan-T5 (T5 v1.1 family) LAVE judge for TensorRT-LLM.

Output directory::

    fastjudge-engine.json        the manifest (manifest.py)
    checkpoint/                  FP8 checkpoint, Hugging Face layout (torch backend; fp8_export.py)
    trtllm-checkpoint/encoder/   TensorRT-LLM checkpoint: config.json + rank0.safetensors
    trtllm-checkpoint/decoder/
    build_engines.sh             the exact trtllm-build commands
    engines/encoder, decoder/    TensorRT engines (when TensorRT-LLM and a GPU are here)

TensorRT-LLM checkpoint. Tensor names, shapes and config fields follow TensorRT-LLM's own T5
converter (``examples/models/core/enc_dec/convert_checkpoint.py``); the FP8 tensors follow its
FP8 layers, as ModelOpt's TensorRT-LLM exporter writes them for T5:

* per layer, ``attention.qkv`` / ``self_attention.qkv`` / ``cross_attention.qkv`` (q, k, v rows
  fused), ``*.dense`` (o), ``mlp.fc`` (wi_0, or wi), ``mlp.gate`` (wi_1), ``mlp.proj`` (wo):
  ``weight`` float8_e4m3fn, ``weights_scaling_factor`` and ``activation_scaling_factor`` float32
  of shape [1]. Fused q/k/v take one scale, the largest of the three (weights re-quantized with
  it); ``mlp.fc`` and ``mlp.gate`` share theirs too, since TensorRT-LLM may fuse them into one
  GEMM;
* ``rel_attn_table`` per layer ([heads, buckets], the block-0 bias transposed) and, in the
  decoder, once more at the top level; layer norms, embeddings and ``lm_head`` in the engine
  dtype (``lm_head`` stays unquantized: ``exclude_modules: ["lm_head"]``);
* FP8 KV cache: ``kv_cache_scaling_factor`` [1] = max(K amax, V amax) / 448 on the decoder's
  self- and cross-attention, ``kv_cache_quant_algo: "FP8"`` in the decoder config. The encoder
  keeps no KV cache, so its config declares none.

Engine limits are judge-tuned: the encoder takes prompts up to ``max_input_len`` (the longest
calibration/held-out prompt plus headroom, by default); the decoder runs one step in score-only
mode (decoder input: the start token; ``max_seq_len`` 2) and, with ``--rationale``, the
rationale plus the constrained rating step. ``--gather_generation_logits`` lets the backend
read the rating-token logits.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
import subprocess
from pathlib import Path

import torch

from fastjudge.backends.fp8 import e4m3_scale, quantize_e4m3

from . import agreement as agr
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
from .quantize import BuildError, LinearAmax

log = logging.getLogger("fastjudge")

MODEL_KIND = "flan-t5"
T5_TYPES = ("t5",)


# ---------------------------------------------------------------------------------------------
# TensorRT-LLM checkpoint

def _fused(state, names, amax: dict[str, LinearAmax]) -> dict[str, torch.Tensor]:
    """One FP8 linear layer of TensorRT-LLM from the HF layers ``names`` (rows concatenated),
    one scale for all of them."""
    parts = [amax[n] for n in names]
    w_scale = e4m3_scale(max(p.weight for p in parts))
    inputs = [p.input for p in parts if p.input is not None]
    weight = torch.cat([state[f"{n}.weight"].float() for n in names], 0)
    out = {"weight": quantize_e4m3(weight, w_scale), "weights_scaling_factor": w_scale.reshape(1)}
    if inputs:
        out["activation_scaling_factor"] = e4m3_scale(max(inputs)).reshape(1)
    return out


def _plain(state, names, dtype):
    return {"weight": torch.cat([state[f"{n}.weight"] for n in names], 0).to(dtype)}


def _t5_config(cfg: dict, component: str, engine_dtype: str, kv_fp8: bool) -> dict:
    """The TensorRT-LLM config.json of one component, field by field as its T5 converter
    writes it, plus the FP8 quantization."""
    ff = cfg.get("feed_forward_proj", "relu")
    gated = ff.startswith("gated-")
    act = cfg.get("dense_act_fn") or (ff.split("-", 1)[1] if gated else ff)
    if gated and act == "gelu":
        act = "gelu_new"
    heads, d_kv = cfg["num_heads"], cfg["d_kv"]
    layers = cfg["num_layers"] if component == "encoder" else (cfg.get("num_decoder_layers") or cfg["num_layers"])
    out = {
        "architecture": "EncoderModel" if component == "encoder" else "DecoderModel",
        "dtype": engine_dtype, "logits_dtype": "float32",
        "num_hidden_layers": layers, "num_attention_heads": heads, "hidden_size": cfg["d_model"],
        "norm_epsilon": cfg.get("layer_norm_epsilon", 1e-6), "vocab_size": cfg["vocab_size"],
        "position_embedding_type": "relative", "hidden_act": act,
        "quantization": {"quant_algo": "FP8",
                         "kv_cache_quant_algo": "FP8" if kv_fp8 and component == "decoder" else None,
                         "exclude_modules": ["lm_head"]},
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "use_parallel_embedding": False, "embedding_sharding_dim": 0,
        "max_position_embeddings": cfg.get("n_positions", 512), "num_key_value_heads": heads,
        "head_size": d_kv, "has_position_embedding": False, "layernorm_type": 1,  # RmsNorm
        "has_attention_qkvo_bias": False, "has_mlp_bias": False, "has_model_final_layernorm": True,
        "has_embedding_layernorm": False, "has_embedding_scale": False, "intermediate_size": cfg["d_ff"],
        "q_scaling": 1 / math.sqrt(d_kv),  # cancels the 1/sqrt(d) scaling T5 attention does not have
        "layernorm_position": 0,  # pre_layernorm
        "mlp_type": 1 if gated else 0,  # GatedMLP / MLP
        "relative_attention": True, "max_distance": cfg.get("relative_attention_max_distance", 128),
        "num_buckets": cfg.get("relative_attention_num_buckets", 32), "model_type": "t5", "gated_act": gated,
    }
    if component == "decoder":
        out.update({
            "rescale_before_lm_head": cfg.get("tie_word_embeddings", True) is not False,
            "encoder_hidden_size": cfg["d_model"], "encoder_num_heads": heads, "encoder_head_size": d_kv,
            "skip_cross_kv": False, "use_implicit_relative_attention": False,
            "decoder_start_token_id": cfg.get("decoder_start_token_id", 0) or 0,
            "eos_token_id": cfg.get("eos_token_id", 1), "bos_token_id": cfg.get("bos_token_id"),
            "pad_token_id": cfg.get("pad_token_id", 0)})
    return out


def trtllm_t5_checkpoint(state: dict[str, torch.Tensor], cfg: dict, linears: dict[str, LinearAmax],
                         kv: dict[str, tuple[float, float]], engine_dtype: str = "bfloat16",
                         kv_fp8: bool = True) -> dict[str, tuple[dict, dict[str, torch.Tensor]]]:
    """``{"encoder": (config, weights), "decoder": (config, weights)}`` of the TensorRT-LLM
    checkpoint. ``linears``/``kv``: calibrated ranges by HF module name."""
    dtype = getattr(torch, engine_dtype)
    gated = cfg.get("feed_forward_proj", "relu").startswith("gated-")
    missing = [n for n in linears if f"{n}.weight" not in state]
    if missing:
        raise BuildError(f"calibrated layers missing from the checkpoint: {missing[:3]}")
    out = {}
    for comp in ("encoder", "decoder"):
        config = _t5_config(cfg, comp, engine_dtype, kv_fp8)
        w: dict[str, torch.Tensor] = {"transformer.vocab_embedding.weight": state["shared.weight"].to(dtype)}
        bias = state[f"{comp}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        table = bias.t().contiguous().to(dtype)  # [heads, buckets]
        attn_name = "attention" if comp == "encoder" else "self_attention"
        mlp_idx = 1 if comp == "encoder" else 2
        for i in range(config["num_hidden_layers"]):
            hf, trt = f"{comp}.block.{i}", f"transformer.layers.{i}"
            blocks = [(f"{hf}.layer.0.SelfAttention", f"{trt}.{attn_name}")]
            if comp == "decoder":
                blocks.append((f"{hf}.layer.1.EncDecAttention", f"{trt}.cross_attention"))
            for src, dst in blocks:
                qkv = [f"{src}.{p}" for p in "qkv"]
                quantized = all(n in linears for n in qkv + [f"{src}.o"])
                for name, tensors in (("qkv", qkv), ("dense", [f"{src}.o"])):
                    layer = _fused(state, tensors, linears) if quantized else _plain(state, tensors, dtype)
                    for k, v in layer.items():
                        w[f"{dst}.{name}.{k}"] = v
                if comp == "decoder" and kv_fp8:
                    if src not in kv:
                        raise BuildError(f"no K/V calibration for {src}")
                    w[f"{dst}.kv_cache_scaling_factor"] = e4m3_scale(max(kv[src])).reshape(1)
            w[f"{trt}.{attn_name}.rel_attn_table"] = table.clone()
            norm = "attention_layernorm" if comp == "encoder" else "self_attention_layernorm"
            w[f"{trt}.{norm}.weight"] = state[f"{hf}.layer.0.layer_norm.weight"].to(dtype)
            if comp == "decoder":
                w[f"{trt}.cross_attention_layernorm.weight"] = state[f"{hf}.layer.1.layer_norm.weight"].to(dtype)
            ffp = f"{hf}.layer.{mlp_idx}.DenseReluDense"
            pairs = [("fc", [f"{ffp}.wi_0" if gated else f"{ffp}.wi"]), ("proj", [f"{ffp}.wo"])]
            if gated:
                pairs.insert(1, ("gate", [f"{ffp}.wi_1"]))
            # fc and gate share one scale: TensorRT-LLM may fuse the two into one GEMM
            shared = {}
            if gated and all(f"{ffp}.{n}" in linears for n in ("wi_0", "wi_1")):
                a, b = linears[f"{ffp}.wi_0"], linears[f"{ffp}.wi_1"]
                ins = [x for x in (a.input, b.input) if x is not None]
                shared = {f"{ffp}.wi_0": LinearAmax(max(a.weight, b.weight), max(ins) if ins else None)}
                shared[f"{ffp}.wi_1"] = shared[f"{ffp}.wi_0"]
            for name, tensors in pairs:
                quantized = all(n in linears for n in tensors)
                layer = (_fused(state, tensors, {**linears, **shared}) if quantized
                         else _plain(state, tensors, dtype))
                for k, v in layer.items():
                    w[f"{trt}.mlp.{name}.{k}"] = v
            w[f"{trt}.mlp_layernorm.weight"] = state[f"{hf}.layer.{mlp_idx}.layer_norm.weight"].to(dtype)
        w["transformer.ln_f.weight"] = state[f"{comp}.final_layer_norm.weight"].to(dtype)
        if comp == "decoder":
            w["lm_head.weight"] = state.get("lm_head.weight", state["shared.weight"]).to(dtype)
            w["rel_attn_table"] = table.clone()
        out[comp] = (config, {k: v.contiguous() for k, v in w.items()})
    return out


def write_trtllm_checkpoint(out_dir: Path, checkpoint: dict) -> Path:
    from safetensors.torch import save_file

    for comp, (config, weights) in checkpoint.items():
        d = out_dir / comp
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config, indent=2))
        save_file(weights, str(d / "rank0.safetensors"))
    return out_dir


# ---------------------------------------------------------------------------------------------
# limits and engines

def limits(opts: BuildOptions, longest_prompt: int, cue_len: int) -> dict:
    """Engine limits for this judge. Encoder: prompts up to ``max_input_len``. Decoder input:
    the start token (score-only) or start + rationale + rating cue (the constrained rating step
    after an unparsable rationale)."""
    max_input = opts.max_input_len or int(math.ceil((longest_prompt + 128) / 128) * 128)
    if opts.rationale:
        dec_in = 1 + opts.max_new_tokens + cue_len
        dec_seq = dec_in + 1
    else:
        dec_in, dec_seq = 1, 2
    return {"max_input_len": max_input, "max_batch_size": opts.max_batch_size,
            "decoder_max_input_len": dec_in, "decoder_max_seq_len": dec_seq,
            "max_new_tokens": opts.max_new_tokens if opts.rationale else 1,
            "longest_calibration_prompt": longest_prompt}


def engine_commands(ckpt: Path, engines: Path, lim: dict) -> list[list[str]]:
    common = ["--moe_plugin", "disable", "--max_beam_width", "1", "--max_batch_size", str(lim["max_batch_size"]),
              "--gemm_plugin", "auto", "--bert_attention_plugin", "auto", "--gpt_attention_plugin", "auto",
              "--remove_input_padding", "enable", "--context_fmha", "disable"]  # no FMHA with T5's relative bias
    encoder = ["trtllm-build", "--checkpoint_dir", str(ckpt / "encoder"), "--output_dir", str(engines / "encoder"),
               "--paged_kv_cache", "disable", "--max_input_len", str(lim["max_input_len"]),
               "--max_num_tokens", str(lim["max_batch_size"] * lim["max_input_len"]), *common]
    decoder = ["trtllm-build", "--checkpoint_dir", str(ckpt / "decoder"), "--output_dir", str(engines / "decoder"),
               "--paged_kv_cache", "enable", "--max_input_len", str(lim["decoder_max_input_len"]),
               "--max_seq_len", str(lim["decoder_max_seq_len"]), "--max_encoder_input_len", str(lim["max_input_len"]),
               "--gather_generation_logits", *common]
    return [encoder, decoder]


def build_engines(out: Path, ckpt: Path, lim: dict, opts: BuildOptions) -> tuple[dict, Path | None]:
    """Run trtllm-build for both engines, or skip with the reason; the commands are always
    written to build_engines.sh."""
    engines = out / "engines"
    cmds = engine_commands(ckpt, engines, lim)
    script = out / "build_engines.sh"
    script.write_text("#!/usr/bin/env bash\n# FP8 Flan-T5 judge engines (written by fastjudge build)\n"
                      "set -euo pipefail\n" + "".join(shlex.join(c) + "\n" for c in cmds))
    script.chmod(0o755)
    why = "--skip-engines given" if opts.skip_engines else cuda_and_trtllm(needs_trtllm_build=True, kind=MODEL_KIND)
    if why:
        print(f"fastjudge build: TensorRT-LLM engine build skipped: {why}. The TensorRT-LLM checkpoint is in "
              f"{ckpt}; build the engines on a CUDA machine with TensorRT-LLM: bash {script}")
        return {"status": "skipped", "reason": why, "commands": [shlex.join(c) for c in cmds]}, None
    for cmd in cmds:
        print("fastjudge build:", shlex.join(cmd))
        subprocess.run(cmd, check=True)
    return {"status": "done", "commands": [shlex.join(c) for c in cmds]}, engines


# ---------------------------------------------------------------------------------------------

def calibration_loop(prompts, start_id: int):
    """ModelOpt's forward loop: each calibration prompt alone (no padding, whose positions
    would widen the activation ranges with values the judge never computes), decoder input the
    start token (the step score-only judging reads)."""
    def forward_loop(model):
        device = next(model.parameters()).device
        with torch.inference_mode():
            for ids in prompts:
                model(input_ids=torch.as_tensor(ids, device=device)[None],
                      decoder_input_ids=torch.full((1, 1), start_id, dtype=torch.long, device=device))
    return forward_loop


def fused_groups(model) -> list[list[str]]:
    """Layers TensorRT-LLM's T5 runs as one GEMM: q/k/v of every attention, wi_0/wi_1."""
    groups = []
    for name, _ in model.named_modules():
        if name.endswith(("SelfAttention", "EncDecAttention")):
            groups.append([f"{name}.{p}" for p in "qkv"])
        elif name.endswith("DenseReluDense"):
            groups.append([f"{name}.wi_0", f"{name}.wi_1"])
    return groups


def build(opts: BuildOptions) -> dict:
    """Run the whole build; returns the manifest."""
    from transformers import T5ForConditionalGeneration

    from fastjudge.backends.torch_t5 import TorchT5Backend
    from fastjudge.judges.lave import RATING_CUE

    cfg = checked_config(opts, T5_TYPES, "T5 / Flan-T5")
    out, device, dtype, base, judge, prompts = open_source(opts, TorchT5Backend)
    ref_results = agr.score(judge, prompts.data.heldout)

    model = T5ForConditionalGeneration.from_pretrained(opts.model, dtype=dtype).to(device).eval()
    pad_id = base.codec.pad_token_id
    start_id = base.shape.decoder_start_token_id
    linears, kv, fp8_entry = quantize_and_compare(
        judge, model, prompts.data.heldout, calibration_loop(prompts.calibration, start_id),
        opts, encoder_decoder=True, exclude=(), fused=fused_groups(model), device_label=str(device))
    exclude = excluded_linears(model, linears)
    del model

    source = read_checkpoint(opts.model)
    kv_names = {attn: (f"{attn}.k", f"{attn}.v", k, v) for attn, (k, v) in kv.items()}
    ckpt_dir = write_fp8_checkpoint(opts.model, out / "checkpoint", fp8_state(source, linears, kv_names),
                                    opts.kv_fp8, exclude, producer())
    trt_ckpt = write_trtllm_checkpoint(out / "trtllm-checkpoint", trtllm_t5_checkpoint(
        source, cfg, linears, kv, opts.engine_dtype, opts.kv_fp8))
    del source

    ckpt_entry = compare_checkpoint(ref_results, TorchT5Backend, ckpt_dir, prompts.data.heldout, opts, device, dtype)
    report = {"fp8": fp8_entry, "fp8_checkpoint_torch": ckpt_entry}
    print("fastjudge build: agreement on held-out items\n" + agr.format_report(report))

    lim = limits(opts, prompts.longest, len(base.codec.response_ids(RATING_CUE)))
    engine_stage, engines = build_engines(out, trt_ckpt, lim, opts)
    manifest = new_manifest(
        model={"kind": MODEL_KIND, "model_type": cfg.get("model_type"),
               "architecture": (cfg.get("architectures") or ["T5ForConditionalGeneration"])[0],
               "source": str(opts.model), "decoder_start_token_id": start_id,
               "eos_token_id": base.shape.eos_token_id, "pad_token_id": pad_id},
        quantization={"algo": "FP8", "weights": "float8_e4m3fn, per-tensor scale",
                      "activations": "float8_e4m3fn, static per-tensor scale",
                      "kv_cache": "FP8" if opts.kv_fp8 else None, "excluded_modules": exclude,
                      "engine_dtype": opts.engine_dtype, "calibration_dtype": opts.dtype, "tool": producer()},
        judge={**lave_template(judge), **judge_token_ids(base.codec)},
        limits=lim, calibration=calibration_section(prompts, opts), agreement=report,
        artifacts={"checkpoint": rel(ckpt_dir, out), "tokenizer": rel(ckpt_dir, out),
                   "trtllm_checkpoint": rel(trt_ckpt, out), "engines": rel(engines, out),
                   "build_script": "build_engines.sh"},
        stages={"quantize": "done", "export": "done", "agreement": "done", "engine_build": engine_stage})
    path = write_manifest(out, manifest)
    print(f"fastjudge build: wrote {path}")
    return manifest
