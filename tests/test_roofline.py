"""``bench.roofline``: the FLOP and byte arithmetic against the checkpoints' real tensors, and
every GEMM path the peak table times computing ``F.linear``'s product.

The projection counts are checked against the shapes the random-weight checkpoints store (the
Hugging Face layouts of T5ForConditionalGeneration and Qwen3_5ForConditionalGeneration that
``fastjudge.checkpoints`` writes), so a formula that forgets a projection or a gate fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from fastjudge.bench import roofline as rl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_roofline  # noqa: E402


def shapes(model_dir) -> dict[str, list[int]]:
    out = {}
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            out.update({k: s.get_slice(k).get_shape() for k in s.keys()})
    return out


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def matrix_params(named: dict, prefix: str, skip: tuple[str, ...] = ()) -> int:
    """Elements of the 2-D weights under ``prefix`` (the projections), ``skip`` names left out."""
    return sum(numel(s) for k, s in named.items()
               if k.startswith(prefix) and k.endswith(".weight") and len(s) == 2 and not any(x in k for x in skip))


def test_t5_projection_counts(t5_dir):
    named = shapes(t5_dir)
    d = rl.T5Dims.from_config(json.loads((t5_dir / "config.json").read_text()))
    assert d.encoder_layers * d.encoder_layer_params == matrix_params(named, "encoder.", ("relative_attention_bias",))
    decoder = matrix_params(named, "decoder.", ("relative_attention_bias",))
    assert d.decoder_layers * d.decoder_layer_params + d.cross_kv_params == decoder


def test_qwen_and_vision_projection_counts(vl_dir):
    named = shapes(vl_dir)
    cfg = json.loads((vl_dir / "config.json").read_text())
    d = rl.QwenDims.from_config(cfg)
    assert d.layer_params == matrix_params(named, "model.language_model.layers.")
    assert d.hidden * d.vocab == numel(named["lm_head.weight"])
    v = rl.VisionDims.from_config(cfg)
    patch = numel(named["model.visual.patch_embed.proj.weight"])
    blocks = matrix_params(named, "model.visual.blocks.")
    merger = matrix_params(named, "model.visual.merger.")
    # one image of 16 patches (4 merged tokens), no attention: projections alone
    n = 16
    expected = 2 * ((patch + blocks) * n + merger * n // v.merge ** 2)
    assert rl.vision_cost(v, [n], torch.float32).flops - v.depth * 4 * n * n * v.hidden == expected


def test_costs_scale_as_the_algorithms():
    d = rl.T5Dims(d_model=512, heads=6, inner=384, d_ff=1024, gated=True, encoder_layers=8, decoder_layers=8,
                  vocab=32128)
    one = rl.t5_decode_step_cost(d, 1, 100, 5, torch.float32)
    many = rl.t5_decode_step_cost(d, 16, 100, 5, torch.float32)
    assert many.flops == 16 * one.flops  # FLOPs per row
    weights = (8 * d.decoder_layer_params + 512 * 32128) * 4
    assert one.bytes - weights == 8 * 2 * 106 * 384 * 4  # cached keys/values of one row
    assert many.bytes - weights == 16 * (one.bytes - weights)  # weights read once a step
    # attention grows with the square of the length, projections linearly
    a, b = rl.t5_encoder_cost(d, [100], torch.float32), rl.t5_encoder_cost(d, [200], torch.float32)
    assert b.flops - 2 * a.flops == 8 * 4 * (200 ** 2 - 2 * 100 ** 2) * 384
    # a generation: the rows' steps, with the weights read once per step of the longest row
    gen = rl.t5_generation_cost(d, [100, 100, 50], [6, 6, 2], torch.float32)
    steps = [rl.t5_decode_step_cost(d, 2, 100, p, torch.float32, steps=6) for p in range(6)]
    steps += [rl.t5_decode_step_cost(d, 1, 50, p, torch.float32, steps=2) for p in range(2)]
    assert gen.flops == pytest.approx(sum(c.flops for c in steps))
    cross_weights = 8 * 2 * 512 * 384 * 4  # short rows reassociate: the k/v weights read each step
    assert gen.bytes == pytest.approx(sum(c.bytes for c in steps) - 2 * (weights + cross_weights))
    assert rl.t5_encoder_cost(d, [100], torch.float32, cross_kv=True).flops - a.flops == 2 * d.cross_kv_params * 100
    # a shared prefix's keys and values are read once a step, each row's own after them once a row
    q = rl.QwenDims(hidden=256, ff=768, heads=4, kv_heads=2, head_dim=64, full_layers=3, linear_layers=3,
                    key_heads=2, value_heads=4, key_dim=64, value_dim=64, conv_kernel=4, vocab=1000,
                    gated_attention=True)
    own, shared = (rl.qwen_forward_cost(q, 16, 1, 460, torch.float32, shared=s) for s in (0, 448))
    column = 3 * 2 * 2 * 64 * 4  # a token's keys and values in every attention layer
    assert own.flops == shared.flops and own.bytes - shared.bytes == 15 * 448 * column
    assert rl.bound_seconds(rl.Cost(1e9, 1e6), 1e9, 1e9) == (1.0, "compute")
    assert rl.bound_seconds(rl.Cost(1e6, 1e9), 1e9, 1e9) == (1.0, "memory")


def test_t5_cross_attention_counts_its_cheaper_form():
    """The two exact forms of T5's cross-attention (``backends/t5/decode.py``): per head over
    keys and values projected from the encoder states (their projection spread over the call's
    steps), or reassociated over the encoder states, each head's query mapped into model space
    and its context back (``engine/encoder_attention.cpp``)."""
    d = rl.T5Dims(d_model=512, heads=6, inner=384, d_ff=1024, gated=True, encoder_layers=8, decoder_layers=8,
                  vocab=32128)
    f32 = torch.float32
    projected = rl.t5_decode_step_cost(d, 16, 128, 8, f32)  # keys and values there already
    base = 16 * (2 * (8 * d.decoder_layer_params + 512 * 32128) + 8 * 4 * 9 * 384)
    assert projected.flops == base + 16 * 8 * 4 * 128 * 384
    # a call of 16 steps: projecting 128 states a row costs more than reassociating every step
    assert rl.t5_reassociates(d, 128, 16) and not rl.t5_reassociates(d, 128, None)
    short = rl.t5_decode_step_cost(d, 16, 128, 8, f32, steps=16)
    assert short.flops == base + 16 * 8 * (4 * 512 * 384 + 4 * 6 * 128 * 512)
    one_row = rl.t5_decode_step_cost(d, 1, 128, 8, f32, steps=16)
    assert short.bytes - one_row.bytes == 15 * (8 * 2 * 9 * 384 + 128 * 512) * 4  # the states once a row
    assert one_row.bytes - rl.t5_decode_step_cost(d, 1, 128, 8, f32).bytes == \
        d.cross_kv_params * 4 + 128 * 512 * 4 - 8 * 2 * 128 * 384 * 4
    # a long call: the projection, spread over its steps, pays
    long = rl.t5_decode_step_cost(d, 1, 128, 8, f32, steps=4000)
    assert not rl.t5_reassociates(d, 128, 4000)
    assert long.flops == pytest.approx(rl.t5_decode_step_cost(d, 1, 128, 8, f32).flops + 8 * 4 * 128 * 512 * 384 / 4000)
    # the cheaper form is never more FLOPs than either
    for n, steps in ((1, 1), (128, 16), (1100, 30), (1100, 100), (1100, 1000)):
        chosen = rl.t5_decode_step_cost(d, 1, n, 0, f32, steps=steps).flops
        per_head = rl.t5_decode_step_cost(d, 1, n, 0, f32).flops + 8 * 4 * n * 512 * 384 / steps
        reassociated = rl.t5_decode_step_cost(d, 1, n, 0, f32).flops - 8 * 4 * n * 384 + \
            8 * (4 * 512 * 384 + 4 * 6 * n * 512)
        assert chosen == pytest.approx(min(per_head, reassociated))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_paths_compute_the_product(dtype):
    """Every path of the peak table computes ``x @ w.T``; its rate is a positive number."""
    device = torch.device("cpu")
    x, w = torch.randn(33, 256, dtype=dtype), (torch.randn(640, 256) / 16).to(dtype)
    ref = F.linear(x.float(), w.float())
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for name, make in rl.gemm_paths(device, dtype).items():
        y = make(w)(x)
        assert ((y.float() - ref).abs().max() / ref.abs().max()).item() <= tol, name
        assert rl.gemm_rate(8, 64, 48, dtype, device, make, repeats=1) > 0
    assert all(v > 0 for v in rl.bandwidth(device, 1 << 20, repeats=1).values())


def test_quick_run_reports_every_stage(tmp_path, capsys):
    """``bench_roofline.py --quick`` on the CPU (about 10 s on a quiet 2-core machine): every
    stage is timed through the backends and gets its FLOPs, bytes and bound, and the machine's
    pace measured between its repeats; both dtypes get a peak. No figure is checked against a
    threshold."""
    out = tmp_path / "roofline.json"
    assert bench_roofline.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    stages = {s["stage"] for s in report["stages"]}
    assert stages == {"T5 encoder", "Qwen prefill", "Qwen score-only suffix step", "vision tower", "crop encode",
                      *(f"{m} decode step, {n} rows" for m in ("T5", "Qwen") for n in (1, 16, 64))}
    assert set(report["peak"]) == {"float32", "bfloat16"} and all(v > 0 for v in report["peak"].values())
    for s in report["stages"]:
        assert s["bytes"] > 0 and s["bound"] in ("compute", "memory") and s["bound_seconds"] > 0
        assert s["flops"] > 0 or s["stage"] == "crop encode"
        # the pace measured beside the stage's own repeats, and its share of the bound that gives
        assert s["pace"]["flops_per_s"] > 0 and s["pace"]["bytes_per_s"] > 0
        assert s["of_pace"] is None or s["of_pace"] > 0
    printed = capsys.readouterr().out
    assert "of bound" in printed and "of pace" in printed
