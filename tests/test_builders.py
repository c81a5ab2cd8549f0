"""Builders on tiny random-weight checkpoints, on the CPU: calibration prompts, ModelOpt
quantization, the FP8 checkpoints (Hugging Face layout, checked against ModelOpt's own exporter),
the BF16 checkpoints (``--dtype bf16``), the LLM-API options file, the manifest, the agreement
report, the torch backend and transformers on the written checkpoints, the vision tower's ONNX
export, ``fastjudge build`` end to end, and the trtllm backend's manifest checks and
missing-TensorRT-LLM error. Tests that need TensorRT-LLM and a GPU skip here
(``benchmarks/gpu_check.sh`` runs them).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("modelopt")

from fastjudge.backends.fp8 import (
    FP8_DTYPE,
    dequantize_e4m3,
    dequantize_state,
    e4m3_scale,
    fp8_linear,
    fp8_linear_reference,
    quantize_e4m3,
)
from fastjudge.builders import agreement as agr
from fastjudge.builders.calibration import judge_prompts, load_examples, prompts_sha256, split_examples
from fastjudge.builders.cli import main as build_main
from fastjudge.builders.manifest import MANIFEST_NAME, ManifestError, read_manifest
from fastjudge.checkpoints import build_random_qwen, build_random_qwen_vl
from fastjudge.cli import main
from fastjudge.demo import tokenizer_corpus
from fastjudge.engine_options import EngineOptions
from fastjudge.judges.lave import LaveJudge, LaveResult

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
GPU_TRTLLM = HAVE_TRTLLM and torch.cuda.is_available()
# Small builds: few shots (short prompts) and few items keep the file fast on two cores.
SMALL = ["--calib-dtype", "float32", "--num-shots", "2", "--max-calib", "8", "--max-heldout", "6"]


def run_build(kind, model, out, *extra):
    return build_main(["build", kind, "--model", str(model), "--out", str(out), *SMALL, *extra])


@pytest.fixture(scope="module")
def t5_cli_run(t5_dir, tmp_path_factory):
    """``fastjudge build flan-t5`` end to end through the top-level command, with a threshold no
    build can meet (agreement is at most 100%) and --strict: the loud warning and exit status 1
    come with a complete build."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("t5-fp8")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["build", "flan-t5", "--model", str(t5_dir), "--out", str(out), *SMALL,
                   "--min-agreement", "1.01", "--strict"])
    return out, rc, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def t5_build(t5_cli_run):
    return t5_cli_run[0]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_random_qwen(tmp_path_factory.mktemp("qwen3_5-tiny"), tokenizer_corpus(), seed=3)


@pytest.fixture(scope="module")
def qwen_build(qwen_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen-fp8")
    assert run_build("qwen3.5", qwen_dir, out, "--num-shots", "1", "--max-calib", "4", "--max-heldout", "3") == 0
    return out


@pytest.fixture(scope="module")
def image_pairs(tmp_path_factory):
    from PIL import Image

    d = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    rows = []
    for i, (h, w) in enumerate([(80, 120), (56, 84)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / f"img{i}.png")
        rows.append({"image": f"img{i}.png", "caption": f"A photo of object {i} on a table."})
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "pairs.jsonl"


@pytest.fixture(scope="module")
def qwen_vl_build(tmp_path_factory, image_pairs):
    model = build_random_qwen_vl(tmp_path_factory.mktemp("qwen3_5-vl-tiny"), tokenizer_corpus(), seed=5)
    out = tmp_path_factory.mktemp("qwen-vl-fp8")
    assert run_build("qwen3.5", model, out, "--num-shots", "1", "--max-calib", "2", "--max-heldout", "2",
                     "--images", str(image_pairs)) == 0
    return model, out


# --------------------------------------------------------------------------------------------
# calibration prompts

def test_calibration_split_and_prompts(lave_judge, tmp_path):
    examples, source = load_examples()
    assert len(examples) == 40 and "sample" in source
    data = split_examples(examples, source, heldout_fraction=0.25, seed=0)
    assert (len(data.calibration), len(data.heldout)) == (30, 10)
    assert not {e.id for e in data.calibration} & {e.id for e in data.heldout}
    again = split_examples(examples, source, heldout_fraction=0.25, seed=0)
    assert [e.id for e in again.heldout] == [e.id for e in data.heldout]
    prompts = judge_prompts(lave_judge, data.calibration[:3])
    for p, e in zip(prompts, data.calibration[:3]):  # exactly the judge's model input
        assert np.array_equal(p, lave_judge.backend.codec.encode_prompt(lave_judge.build_prompt(e)))
    assert prompts_sha256(prompts) == prompts_sha256([p.copy() for p in prompts])
    assert prompts_sha256(prompts) != prompts_sha256(prompts[:2])
    # user JSONL: malformed lines skipped, items the judge rejects left out of the prompts
    f = tmp_path / "items.jsonl"
    f.write_text('{"id": "a", "question": "Is it red?", "references": ["yes"], "prediction": "yes"}\n'
                 "not json\n"
                 '{"id": "b", "question": "What?", "references": [], "prediction": "x"}\n')
    items, _ = load_examples(f)
    assert [e.id for e in items] == ["a", "b"]
    assert len(judge_prompts(lave_judge, items)) == 1


# --------------------------------------------------------------------------------------------
# FP8 math

def test_fp8_quantize_dequantize_and_scaled_mm():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * 0.05
    s = e4m3_scale(w.abs().max())
    assert s.dtype == torch.float32 and s.shape == ()
    w8 = quantize_e4m3(w, s)
    assert w8.dtype == FP8_DTYPE and float(w8.float().abs().max()) == 448.0
    assert torch.allclose(dequantize_e4m3(w8, s), w, rtol=2 ** -3, atol=float(s) * 2 ** -6)
    x = torch.randn(5, 7, 64, generator=g)
    sx = e4m3_scale(x.abs().max())
    # torch._scaled_mm: PyTorch's CPU kernel here, FP8 tensor cores on Hopper (gpu_check.py)
    y = fp8_linear(x, w8, s, sx, out_dtype=torch.float32)
    assert y.shape == (5, 7, 48)
    assert torch.allclose(y, fp8_linear_reference(x, w8, s, sx), rtol=1e-5, atol=1e-5)
    state = {"a.weight": w8, "a.weight_scale": s, "a.input_scale": sx, "b.weight": torch.ones(2, 2)}
    deq = dequantize_state(state)
    assert set(deq) == {"a.weight", "b.weight"} and deq["a.weight"].dtype == torch.float32
    with pytest.raises(ValueError, match="weight_scale"):
        dequantize_state({"a.weight": w8})


def test_loading_refuses_undeclared_or_other_quantization(tmp_path):
    from safetensors.torch import save_file

    from fastjudge.backends.loading import CheckpointError, load_state_dict

    w8 = quantize_e4m3(torch.ones(4, 4), e4m3_scale(1.0))
    (tmp_path / "config.json").write_text("{}")
    save_file({"a.weight": w8, "a.weight_scale": e4m3_scale(1.0)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="without an FP8 declaration"):
        load_state_dict(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "NVFP4"}}')
    with pytest.raises(CheckpointError, match="NVFP4"):
        load_state_dict(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8"}}')
    assert torch.equal(load_state_dict(tmp_path)["a.weight"], torch.ones(4, 4))


def test_exported_weights_equal_modelopt_fake_quant(t5_dir):
    """What the checkpoints store is what ModelOpt's fake quantization simulated."""
    from transformers import T5ForConditionalGeneration

    from fastjudge.builders.flan_t5 import calibration_loop
    from fastjudge.builders.quantize import collect_amax, quantize_fp8

    model = T5ForConditionalGeneration.from_pretrained(str(t5_dir), dtype=torch.float32).eval()
    quantize_fp8(model, calibration_loop([np.arange(3, 40)], 0))
    linears, kv = collect_amax(model)
    layer = model.encoder.block[0].layer[0].SelfAttention.q
    amax = linears["encoder.block.0.layer.0.SelfAttention.q"]
    with torch.no_grad():
        fake = layer.weight_quantizer(layer.weight).float()
    s = e4m3_scale(amax.weight)
    assert torch.allclose(fake, dequantize_e4m3(quantize_e4m3(layer.weight, s), s), rtol=1e-6, atol=1e-9)
    assert amax.input is not None and "decoder.block.0.layer.1.EncDecAttention" in kv
    assert "lm_head" not in linears  # the LM head stays unquantized


# --------------------------------------------------------------------------------------------
# Flan-T5 build

def test_t5_build_manifest_and_token_ids(t5_build, t5_backend):
    m = read_manifest(t5_build)
    assert m["model"]["kind"] == "flan-t5" and m["model"]["model_type"] == "t5"
    q = m["quantization"]
    assert (q["algo"], q["kv_cache"]) == ("FP8", "FP8") and "lm_head" in q["excluded_modules"]
    judge = m["judge"]
    assert judge["rating_token_ids"] == list(LaveJudge(t5_backend, num_shots=2).rating_token_ids)
    assert judge["rationale_rating_token_ids"] == list(LaveJudge(t5_backend, rationale=True).rating_token_ids)
    assert judge["template_version"] == "lave/1" and len(judge["template_sha256"]) == 64
    lim = m["limits"]
    assert lim["max_input_len"] >= lim["longest_calibration_prompt"]
    assert lim["max_new_tokens"] == 1 and lim["max_seq_len"] == lim["max_input_len"] + 2  # start token + one step
    cal = m["calibration"]
    assert (cal["items"], cal["heldout_items"]) == (8, 6) and len(cal["sha256"]) == 64
    for name in ("fp8", "fp8_checkpoint_torch"):
        e = m["agreement"][name]
        assert e["items"] == 6 and 0 <= e["rating_agreement"] <= 1 and e["max_abs_dprob"] >= 0
        assert set(e) >= {"spearman_soft_score", "mean_abs_dprob", "reference", "candidate"}
    stage = m["stages"]["trtllm"]
    if not GPU_TRTLLM:
        assert stage["status"] == "skipped" and stage["reason"]
    # the LLM-API options: sized from the judge's prompt lengths (tests/test_trtllm_contract.py
    # checks the names against the release's)
    options = json.loads((t5_build / m["artifacts"]["llm_options"]).read_text())
    assert (options["max_input_len"], options["max_seq_len"]) == (lim["max_input_len"], lim["max_seq_len"])
    assert options["max_batch_size"] == 64 and options["kv_cache_config"]["cross_kv_cache_fraction"] > 0.9
    assert not any((t5_build / name).exists() for name in ("engines", "build_engines.sh", "trtllm-checkpoint"))
    assert m["tools"]["modelopt"] and m["tools"]["torch"]


def test_torch_backend_loads_fp8_checkpoint(t5_build, t5_dir):
    from fastjudge.backends.loading import load_state_dict
    from fastjudge.backends.t5.backend import TorchT5Backend

    ckpt = t5_build / "checkpoint"
    raw = load_file(str(ckpt / "model.safetensors"))
    q = "encoder.block.0.layer.0.SelfAttention.q"
    assert raw[f"{q}.weight"].dtype == FP8_DTYPE
    assert raw[f"{q}.weight_scale"].shape == () and raw[f"{q}.input_scale"].dtype == torch.float32
    assert raw["encoder.block.0.layer.0.SelfAttention.k.k_scale"].shape == ()
    assert raw["lm_head.weight"].dtype == torch.float32  # unquantized, as in the source
    hq = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert (hq["quant_algo"], hq["kv_cache_quant_algo"]) == ("FP8", "FP8")
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    state = load_state_dict(ckpt)
    assert not any(k.endswith(("_scale", "input_scale")) for k in state)
    assert torch.equal(state[f"{q}.weight"], dequantize_e4m3(raw[f"{q}.weight"], raw[f"{q}.weight_scale"]))
    judge = LaveJudge(TorchT5Backend(ckpt, device="cpu", dtype="float32"), num_shots=2)
    results = judge.score(load_examples()[0][:4])
    assert all(r.error is None and r.rating in (1, 2, 3) for r in results)
    # the judge from the directory path picks the torch backend and loads it the same way
    engine = EngineOptions(device="cpu", dtype="float32")
    assert LaveJudge(str(ckpt), num_shots=2, engine=engine).rating_token_ids == judge.rating_token_ids


@pytest.mark.parametrize("kind", ["flan-t5", "qwen3.5"])
def test_fp8_checkpoint_equals_weight_fake_quant(kind, request):
    """The torch backend on the FP8 checkpoint computes what transformers computes with the
    same E4M3 weights (ModelOpt's weight fake quantization, which
    test_exported_weights_equal_modelopt_fake_quant and the exporter tests hold the checkpoint
    to; activations left unquantized): probabilities within 1e-4 (float32), identical ratings."""
    from fastjudge.backends.qwen.backend import TorchQwenBackend
    from fastjudge.backends.t5.backend import TorchT5Backend

    t5 = kind == "flan-t5"
    build = request.getfixturevalue("t5_build" if t5 else "qwen_build")
    source = request.getfixturevalue("t5_dir" if t5 else "qwen_dir")
    ckpt = build / "checkpoint"
    if t5:
        from transformers import T5ForConditionalGeneration as hf_cls
    else:
        from transformers import Qwen3_5ForCausalLM as hf_cls
    fp8 = (TorchT5Backend if t5 else TorchQwenBackend)(ckpt, device="cpu", dtype="float32")
    model = hf_cls.from_pretrained(str(source), dtype=torch.float32).eval()
    state = dequantize_state(load_file(str(ckpt / "model.safetensors")))
    own = model.state_dict()
    assert sum(k in own for k in state) > len(own) // 2  # the names match: the weights really load
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    examples = load_examples()[0][:5]
    shots = 2 if t5 else 1
    ours = LaveJudge(fp8, num_shots=shots).score(examples)
    theirs = LaveJudge(agr.TransformersChoiceBackend(model, fp8, t5), num_shots=shots).score(examples)
    diff = max(abs(a - b) for r, s in zip(ours, theirs) for a, b in zip(r.probs, s.probs))
    assert diff < 1e-4 and [r.rating for r in ours] == [r.rating for r in theirs]


def test_cli_build_end_to_end_strict_below_threshold(t5_cli_run):
    out, rc, stdout, stderr = t5_cli_run
    assert rc == 1  # --strict and below --min-agreement
    assert "WARNING:" in stderr and "below 101%" in stderr and "!!!!" in stderr
    assert "agreement on held-out items" in stdout and f"wrote {out / MANIFEST_NAME}" in stdout
    assert GPU_TRTLLM or "TensorRT-LLM not available here (no CUDA device)" in stdout
    m = read_manifest(out)
    assert m["agreement"]["fp8"]["passed"] is False and "below" in m["agreement"]["fp8"]["warning"]
    assert m["agreement"]["fp8"]["threshold"] == 1.01


# --------------------------------------------------------------------------------------------
# BF16 builds (--dtype bf16)

@pytest.mark.parametrize("kind", ["flan-t5", "qwen3.5"])
def test_bf16_build_loads_in_torch_backend_and_transformers_alike(kind, request, tmp_path):
    """``--dtype bf16``: the source tensors in bfloat16, no quantization declared; the torch
    backend and transformers (``T5ForConditionalGeneration`` / ``Qwen3_5ForCausalLM`` loading
    the written directory with ``from_pretrained``) give the same probabilities on it (float32
    compute: within 1e-5, identical ratings), and the threshold applies to the checkpoint's
    agreement with the source."""
    from fastjudge.backends.qwen.backend import TorchQwenBackend
    from fastjudge.backends.t5.backend import TorchT5Backend
    from fastjudge.builders.fp8_export import read_checkpoint

    source = request.getfixturevalue("t5_dir" if kind == "flan-t5" else "qwen_dir")
    out = tmp_path / "bf16"
    assert run_build(kind, source, out, "--dtype", "bf16", "--num-shots", "1", "--max-calib", "2",
                     "--max-heldout", "3") == 0
    m = read_manifest(out)
    assert m["quantization"]["algo"] is None and m["quantization"]["dtype"] == "bfloat16"
    entry = m["agreement"]["bf16_checkpoint_torch"]
    assert "fp8" not in m["agreement"] and entry["threshold"] == 0.98 and entry["items"] == 3
    ckpt = out / m["artifacts"]["checkpoint"]
    assert not (ckpt / "hf_quant_config.json").exists()
    config = json.loads((ckpt / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    written, original = load_file(str(ckpt / "model.safetensors")), read_checkpoint(source)
    assert set(written) == set(original)
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, original[k].to(torch.bfloat16))
               for k, t in written.items() if original[k].is_floating_point())
    assert (out / m["artifacts"]["llm_options"]).is_file()

    if kind == "flan-t5":
        from transformers import T5ForConditionalGeneration as hf_cls

        ours = TorchT5Backend(ckpt, device="cpu", dtype="float32")
    else:
        from transformers import Qwen3_5ForCausalLM as hf_cls

        ours = TorchQwenBackend(ckpt, device="cpu", dtype="float32")
    model = hf_cls.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    examples = load_examples()[0][:5]
    a = LaveJudge(ours, num_shots=1).score(examples)
    b = LaveJudge(agr.TransformersChoiceBackend(model, ours, kind == "flan-t5"), num_shots=1).score(examples)
    assert all(r.error is None for r in a + b)
    assert [r.rating for r in a] == [r.rating for r in b]
    assert max(abs(p - q) for r, s in zip(a, b) for p, q in zip(r.probs, s.probs)) < 1e-5


# --------------------------------------------------------------------------------------------
# agreement report

def _result(i, probs):
    probs = np.asarray(probs, dtype=float)
    r = LaveResult(index=i, probs=list(probs), rating=int(np.argmax(probs)) + 1)
    r.soft_score = float(probs @ [0, 0.5, 1])
    return r


def test_agreement_figures_and_loud_warning(capsys):
    rng = np.random.default_rng(0)
    ref = [_result(i, rng.dirichlet([1, 1, 1])) for i in range(100)]
    same = agr.compare(ref, ref)
    assert (same.items, same.rating_agreement, same.max_abs_dprob) == (100, 1.0, 0.0)
    assert same.spearman_soft_score == pytest.approx(1.0)
    # three of 100 ratings differ: 97%, under the default 98%
    flipped = [_result(r.index, np.roll(r.probs, 1)) if r.index < 3 else r for r in ref]
    assert all(f.rating != r.rating for f, r in zip(flipped[:3], ref[:3]))
    a = agr.compare(ref, flipped)
    assert a.items == 100 and a.rating_agreement == pytest.approx(0.97)
    assert 0 < a.max_abs_dprob <= 1 and a.spearman_soft_score < 1
    entry = agr.agreement_entry(ref, flipped, agr.DEFAULT_THRESHOLD, "test judge", {})
    assert agr.DEFAULT_THRESHOLD == 0.98
    assert entry["passed"] is False and "97.0%" in entry["warning"] and "below 98%" in entry["warning"]
    assert "WARNING: test judge" in capsys.readouterr().err
    entry = agr.agreement_entry(ref, ref, 0.98, "test judge", {})
    assert entry["passed"] and entry["warning"] is None and capsys.readouterr().err == ""
    errors = [LaveResult(index=0, error="bad")]
    assert agr.compare(errors, errors).items == 0


# --------------------------------------------------------------------------------------------
# Qwen3.5 builds

def test_qwen_build_checkpoint_matches_trtllm_expectations(qwen_build, qwen_dir):
    from fastjudge.backends.qwen.backend import TorchQwenBackend

    m = read_manifest(qwen_build)
    ckpt = qwen_build / m["artifacts"]["checkpoint"]
    w = load_file(str(ckpt / "model.safetensors"))
    hq = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert (hq["quant_algo"], hq["kv_cache_quant_algo"]) == ("FP8", "FP8")
    inline = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert inline["quant_method"] == "modelopt" and inline["kv_cache_scheme"]["num_bits"] == 8
    cfg = json.loads((qwen_dir / "config.json").read_text())
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}"
        for lin in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            assert w[f"{p}.{lin}.weight"].dtype == FP8_DTYPE
            assert w[f"{p}.{lin}.weight_scale"].shape == () and w[f"{p}.{lin}.input_scale"].shape == ()
        if kind == "full_attention":
            assert w[f"{p}.self_attn.q_proj.weight"].dtype == FP8_DTYPE
            assert w[f"{p}.self_attn.k_proj.k_scale"].dtype == torch.float32
            assert w[f"{p}.self_attn.v_proj.v_scale"].shape == ()
        else:
            assert w[f"{p}.linear_attn.out_proj.weight"].dtype == FP8_DTYPE
            # packed into in_proj_qkvz by TensorRT-LLM: no per-tensor scale may ride along
            for lin in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"):
                assert w[f"{p}.linear_attn.{lin}.weight"].dtype == torch.float32
                assert f"{p}.linear_attn.{lin}.weight_scale" not in w
                assert f"{p}.linear_attn.{lin}" in hq["exclude_modules"]
            assert w[f"{p}.linear_attn.conv1d.weight"].dtype == torch.float32
            # and in TensorRT-LLM's own names, conv1d included (a Linear there)
            for mod in ("conv1d", "in_proj_qkvz", "in_proj_ba"):
                assert f"model.layers.{i}.linear_attn.{mod}" in hq["exclude_modules"]
    assert "lm_head" in hq["exclude_modules"] and w["lm_head.weight"].dtype == torch.float32
    base = TorchQwenBackend(qwen_dir, device="cpu", dtype="float32")
    judge = m["judge"]
    assert judge["rating_token_ids"] == list(LaveJudge(base, num_shots=1).rating_token_ids)
    assert judge["rationale_rating_token_ids"] == list(LaveJudge(base, rationale=True).rating_token_ids)
    assert judge["yes_no_token_ids"] == [base.codec.response_ids("yes")[0], base.codec.response_ids("no")[0]]
    assert all(len(base.codec.response_ids(x)) == 1 for x in ("yes", "no"))
    # VisExMEM reads yes/no after its decision prefix: recorded as the judge derives them
    from fastjudge.judges.visexmem import DECISION_PREFIX

    decision = base.codec.response_ids(DECISION_PREFIX + "yes"), base.codec.response_ids(DECISION_PREFIX + "no")
    forced = next(i for i, (y, n) in enumerate(zip(*decision)) if y != n)
    assert judge["decision_token_ids"] == [decision[0][forced], decision[1][forced]]
    assert judge["answer_contexts"]["decision_token_ids"]["after"] == DECISION_PREFIX
    results = LaveJudge(TorchQwenBackend(ckpt, device="cpu", dtype="float32"), num_shots=1).score(
        load_examples()[0][:3])
    assert all(r.error is None and r.rating in (1, 2, 3) for r in results)
    assert m["agreement"]["fp8"]["items"] == 3 and m["stages"]["trtllm"]["reason"]


def test_qwen_checkpoint_matches_modelopt_hf_exporter(qwen_dir, tmp_path):
    """The same calibrated model through ModelOpt's Hugging Face exporter (the format
    TensorRT-LLM's LLM API reads): identical tensor names, dtypes, FP8 bytes and scales."""
    import modelopt.torch.export as mte

    from fastjudge.builders.fp8_export import fp8_state, read_checkpoint
    from fastjudge.builders.quantize import collect_amax, quantize_fp8
    from fastjudge.builders.qwen3_5 import EXCLUDE, calibration_loop, hf_model

    model = hf_model(str(qwen_dir), "qwen3_5_text", torch.float32).eval()
    rng = np.random.default_rng(0)
    quantize_fp8(model, calibration_loop([rng.integers(3, 500, n) for n in (20, 40)], [], None), exclude=EXCLUDE)
    linears, kv = collect_amax(model)
    ours = fp8_state(read_checkpoint(qwen_dir), linears,
                     {a: (f"{a}.k_proj", f"{a}.v_proj", k, v) for a, (k, v) in kv.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mte.export_hf_checkpoint(model, export_dir=str(tmp_path))
    ref = {k.replace("model.language_model.", "model."): v
           for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    assert set(ours) == set(ref)
    for k, t in ours.items():
        assert (t.dtype, t.shape) == (ref[k].dtype, ref[k].shape), k
        if t.dtype == FP8_DTYPE:
            assert torch.equal(t.view(torch.uint8), ref[k].view(torch.uint8)), k
        else:
            assert torch.allclose(t.float(), ref[k].float(), rtol=1e-6, atol=0), k


def test_qwen_vl_build_images_and_onnx(qwen_vl_build):
    import onnx

    model, out = qwen_vl_build
    m = read_manifest(out)
    assert m["model"]["multimodal"] and m["calibration"]["images"] == 2
    ckpt = out / m["artifacts"]["checkpoint"]
    hq = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert "model.visual.*" in hq["exclude_modules"]
    w = load_file(str(ckpt / "model.safetensors"))
    assert all(t.dtype != FP8_DTYPE for k, t in w.items() if k.startswith("model.visual."))
    assert w["model.language_model.layers.1.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    onnx_path = out / m["artifacts"]["vision_onnx"]
    onnx.checker.check_model(str(onnx_path), full_check=True)
    info = m["artifacts"]["vision_onnx_info"]
    assert info["opset"] == 18 and info["onnx_checker"] == "passed"
    assert info["dynamic_axes"]["pixel_values"] == {"0": "patches"}
    graph = onnx.load(str(onnx_path)).graph
    assert [i.name for i in graph.input] == ["pixel_values", "pos_indices", "pos_weights", "rope_positions",
                                             "segment_ids"]
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "patches"
    ort = info["onnxruntime_check"]
    if importlib.util.find_spec("onnxruntime") is not None:
        # three images of different sizes in one call against QwenVision.encode
        assert len(ort["grids"]) == 3 and ort["max_abs_diff"] < 1e-5
    from fastjudge.backends.qwen.vision import QwenVision

    assert QwenVision.from_pretrained(ckpt, device="cpu", dtype="float32") is not None


# --------------------------------------------------------------------------------------------
# trtllm backend

def test_trtllm_backend_manifest_checks(t5_build, qwen_build, tmp_path):
    from fastjudge.backends.protocol import Backend
    from fastjudge.backends.qwen.backend import TorchQwenBackend
    from fastjudge.backends.trtllm import TrtllmBackend

    for build in (t5_build, qwen_build):
        b = TrtllmBackend(build, load_engine=False)  # manifest + tokenizer, no TensorRT-LLM
        assert isinstance(b, Backend)
        assert b.max_input_tokens == read_manifest(build)["limits"]["max_input_len"]
        with pytest.raises(RuntimeError, match="load_engine=False"):
            b.run([])
    # tokenization is the torch backend's
    tq = TrtllmBackend(qwen_build, load_engine=False)
    torch_q = TorchQwenBackend(qwen_build / "checkpoint", device="cpu", dtype="float32")
    assert isinstance(torch_q, Backend)
    judge = LaveJudge(torch_q, num_shots=1)
    text = judge.build_prompt(load_examples()[0][0])
    assert np.array_equal(tq.codec.encode_prompt(text), torch_q.codec.encode_prompt(text))
    assert LaveJudge(tq, num_shots=1).rating_token_ids == judge.rating_token_ids
    # a manifest that disagrees with the tokenizer is refused before anything loads
    bad = tmp_path / "bad"
    shutil.copytree(t5_build, bad)
    m = json.loads((bad / MANIFEST_NAME).read_text())
    m["judge"]["rating_token_ids"] = [7, 8, 9]
    (bad / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="rating_token_ids"):
        TrtllmBackend(bad)
    m["judge"]["rating_token_ids"] = read_manifest(t5_build)["judge"]["rating_token_ids"]
    m["model"]["kind"] = "llama"
    (bad / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="kind"):
        TrtllmBackend(bad)
    m["format_version"] = 99
    (bad / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="version"):
        TrtllmBackend(bad)
    with pytest.raises(ManifestError, match="fastjudge build"):
        TrtllmBackend(tmp_path)


@pytest.mark.skipif(HAVE_TRTLLM, reason="TensorRT-LLM is installed")
def test_trtllm_backend_clear_error_without_tensorrt_llm(t5_build, qwen_build):
    from fastjudge.backends import load_backend
    from fastjudge.backends.trtllm import TensorRTLLMUnavailable

    for build in (t5_build, qwen_build):
        with pytest.raises(TensorRTLLMUnavailable, match=r"pip install 'fastjudge\[trtllm\]'"):
            load_backend(build, EngineOptions(backend="trtllm"))
    with pytest.raises(ImportError, match="torch backend"):
        LaveJudge(str(t5_build), engine=EngineOptions(backend="trtllm"))


def test_json_grammar_ebnf_for_guided_decoding():
    pytest.importorskip("xgrammar")
    from fastjudge.backends.trtllm import json_grammar_ebnf

    ebnf = json_grammar_ebnf('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}')
    assert "root ::=" in ebnf and "true" in ebnf


# --------------------------------------------------------------------------------------------
# TensorRT-LLM on a GPU (benchmarks/gpu_check.sh)

@pytest.mark.skipif(not GPU_TRTLLM, reason="needs TensorRT-LLM and a CUDA device")
@pytest.mark.parametrize("kind", ["flan-t5", "qwen3.5"])
def test_trtllm_llm_api_faithful_to_fake_quant(kind, request):
    """The FP8 judge through TensorRT-LLM's LLM API against the FP8 judge it was built from
    (ModelOpt fake quantization of the same calibration), on the held-out items."""
    from fastjudge.backends.trtllm import TrtllmBackend, trtllm_mismatch

    build = request.getfixturevalue("t5_build" if kind == "flan-t5" else "qwen_build")
    source = request.getfixturevalue("t5_dir" if kind == "flan-t5" else "qwen_dir")
    why = trtllm_mismatch(kind, read_manifest(build)["model"].get("model_type"))
    if why:
        pytest.skip(why)
    _faithfulness(TrtllmBackend(build), source, build, encoder_decoder=kind == "flan-t5")


def _faithfulness(backend, source, build, encoder_decoder):
    """TensorRT-LLM against transformers with ModelOpt's fake quantization calibrated exactly
    as the build was (same prompts, same dtype), on the build's held-out items: probabilities
    within 0.02; a rating may differ only where the reference's top two are within 0.04."""
    from fastjudge.builders.pipeline import BuildOptions, open_judge

    m = read_manifest(build)
    cal = m["calibration"]
    opts = BuildOptions(model=str(source), out=str(build), num_shots=m["judge"]["num_shots"],
                        calib_dtype=m["quantization"]["calibration_dtype"], max_calib=cal["items"],
                        max_heldout=cal["heldout_items"], heldout_fraction=cal["heldout_fraction"], seed=cal["seed"])
    reference, heldout = _fake_quant_backend(source, opts, encoder_decoder)
    ref = agr.score(open_judge(reference, opts), heldout)
    trt = agr.score(open_judge(backend, opts), heldout)
    assert len(trt) == len(ref) == cal["heldout_items"]
    for r, t in zip(ref, trt):
        assert t.error is None and r.error is None
        assert max(abs(a - b) for a, b in zip(r.probs, t.probs)) < 0.02, (r, t)
        top = sorted(r.probs)
        assert t.rating == r.rating or top[-1] - top[-2] < 0.04, (r, t)


def _fake_quant_backend(source, opts, encoder_decoder):
    import fastjudge.builders.flan_t5 as ft5
    import fastjudge.builders.qwen3_5 as q35
    from fastjudge.backends.qwen.backend import TorchQwenBackend
    from fastjudge.backends.t5.backend import TorchT5Backend
    from fastjudge.builders.pipeline import open_judge, prepare_prompts
    from fastjudge.builders.quantize import quantize_fp8

    dtype = getattr(torch, opts.calib_dtype)
    base = (TorchT5Backend if encoder_decoder else TorchQwenBackend)(source, device="cuda", dtype=dtype)
    prompts = prepare_prompts(open_judge(base, opts), opts)
    if encoder_decoder:
        from transformers import T5ForConditionalGeneration

        model = T5ForConditionalGeneration.from_pretrained(str(source), dtype=dtype).cuda().eval()
        quantize_fp8(model, ft5.calibration_loop(prompts.calibration, base.shape.decoder_start_token_id))
    else:
        model_type = json.loads((source / "config.json").read_text())["model_type"]
        model = q35.hf_model(str(source), model_type, dtype).cuda().eval()
        quantize_fp8(model, q35.calibration_loop(prompts.calibration, [], None), exclude=q35.EXCLUDE)
    return agr.TransformersChoiceBackend(model, base, encoder_decoder), prompts.data.heldout


def test_fp8_weight_is_a_module_that_keeps_its_dtypes():
    """``Fp8Weight`` registers its FP8 data and scales as buffers: a model holding it lists them
    in its state dict and moves them with it, and a dtype conversion of the model leaves them
    FP8 and float32 (what the FP8 GEMM reads)."""
    from fastjudge.backends.fp8 import Fp8Weight

    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=g)
    s, sx = e4m3_scale(w.abs().max()), torch.tensor(0.01)
    model = torch.nn.Sequential(Fp8Weight(quantize_e4m3(w, s), s, sx))
    assert set(model.state_dict()) == {"0.weight", "0.weight_scale", "0.input_scale"}
    model.to(torch.bfloat16)
    layer = model[0]
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.dtype == torch.float32
    assert layer.shape == (16, 32)
    x = torch.randn(3, 32, generator=g)
    assert torch.allclose(layer(x), fp8_linear_reference(x, layer.weight, s, sx), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 GEMMs need an Ada or Hopper GPU")
def test_scaled_mm_on_gpu():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 512, generator=g) * 0.05)
    s = e4m3_scale(w.abs().max())
    w8 = quantize_e4m3(w, s).cuda()
    x = torch.randn(64, 512, generator=g).cuda().to(torch.bfloat16)
    y = fp8_linear(x, w8, s.cuda(), out_dtype=torch.float32)
    ref = fp8_linear_reference(x.float(), w8, s.cuda())
    assert torch.allclose(y, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["flan-t5", "qwen3.5"])
def test_fp8_gemm_path_on_the_fp8_checkpoint(kind, request):
    """``fp8_gemm=True`` keeps the quantized projections FP8 and runs them through
    ``torch._scaled_mm`` (PyTorch's CPU kernel here; FP8 tensor cores on Hopper): each such
    projection equals the float32 reference of the same FP8 math, and the judge agrees with the
    dequantized load up to the activation quantization it adds."""
    from fastjudge.backends.fp8 import Fp8Weight
    from fastjudge.backends.qwen.backend import TorchQwenBackend
    from fastjudge.backends.t5.backend import TorchT5Backend

    build = request.getfixturevalue("t5_build" if kind == "flan-t5" else "qwen_build")
    ckpt = build / read_manifest(build)["artifacts"]["checkpoint"]
    cls = TorchT5Backend if kind == "flan-t5" else TorchQwenBackend
    gemm = cls(ckpt, device="cpu", dtype="float32", fp8_gemm=True)
    plain = cls(ckpt, device="cpu", dtype="float32", fp8_gemm=False)

    def fp8_weights(backend):
        return [m for m in backend.model.modules() if isinstance(m, Fp8Weight)]

    fp8 = fp8_weights(gemm)
    assert fp8 and not fp8_weights(plain)
    w = fp8[0]
    x = torch.randn(5, w.shape[1])
    assert torch.allclose(w(x), fp8_linear_reference(x, w.weight, w.weight_scale, w.input_scale),
                          rtol=1e-5, atol=1e-5)
    examples = load_examples()[0][:6]
    a = LaveJudge(gemm, num_shots=1).score(examples)
    b = LaveJudge(plain, num_shots=1).score(examples)
    assert all(r.error is None for r in a)
    assert max(abs(p - q) for r, s in zip(a, b) for p, q in zip(r.probs, s.probs)) < 0.05


def test_fp8_config_accepts_both_modelopt_quant_cfg_forms():
    """ModelOpt's ``FP8_DEFAULT_CFG["quant_cfg"]`` (modelopt/torch/quantization/config.py): a
    wildcard -> attributes dict up to 0.43, a list of ``{"quantizer_name", "cfg" | "enable"}``
    entries from 0.44. fp8_config adds the K/V quantizers and exclusions in either form."""
    from types import SimpleNamespace

    from fastjudge.builders.quantize import BuildError, fp8_config

    fp8 = {"num_bits": (4, 3), "axis": None}
    old = SimpleNamespace(FP8_DEFAULT_CFG={"quant_cfg": {"*weight_quantizer": fp8, "*input_quantizer": fp8,
                                                         "default": {"enable": False}}, "algorithm": "max"})
    cfg = fp8_config(old, kv_cache=True, exclude=["model.vision"])
    assert cfg["quant_cfg"]["*[kv]_bmm_quantizer"] == fp8
    assert cfg["quant_cfg"]["model.vision*"] == {"enable": False}
    assert "*[kv]_bmm_quantizer" not in old.FP8_DEFAULT_CFG["quant_cfg"]  # the library's copy untouched
    new = SimpleNamespace(FP8_DEFAULT_CFG={"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": fp8}],
                                           "algorithm": "max"})
    entries = fp8_config(new, kv_cache=False, exclude=["lm_head"])["quant_cfg"]
    assert entries[-1] == {"quantizer_name": "lm_head*", "enable": False}
    assert not any(e["quantizer_name"] == "*[kv]_bmm_quantizer" for e in entries)
    with pytest.raises(BuildError):
        fp8_config(SimpleNamespace(FP8_DEFAULT_CFG={"quant_cfg": "?"}))


def test_fp8_config_of_installed_modelopt_quantizes():
    """The installed ModelOpt's own config form, through mtq.quantize on a small module:
    excluded layers stay unquantized, the others get calibrated E4M3 ranges."""
    from fastjudge.builders.quantize import collect_amax, quantize_fp8

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    data = torch.randn(4, 8)
    quantize_fp8(model, lambda m: m(data), kv_cache=True, exclude=["2"])
    linears, _ = collect_amax(model)
    assert set(linears) == {"0"}
    assert linears["0"].input == pytest.approx(float(data.abs().max()), rel=1e-3)


def test_vision_index_inputs_without_transformers_vision_utils(vl_dir, monkeypatch):
    """transformers 5.5 has no ``transformers.vision_utils``: the export's own index helpers
    give what transformers' get_vision_cu_seqlens, get_vision_position_ids and
    get_vision_interpolation_indices_and_weights (transformers/vision_utils.py) give."""
    import sys

    from fastjudge.backends.qwen.vision import QwenVision
    from fastjudge.builders import vision_onnx

    visual = QwenVision.from_pretrained(vl_dir, device="cpu", dtype=torch.float32).model
    grids = torch.tensor([[1, 4, 6], [2, 2, 4]])
    with_library = vision_onnx.vision_inputs(visual, grids)
    monkeypatch.setitem(sys.modules, "transformers.vision_utils", None)  # import now fails
    assert vision_onnx._grid_index_helpers()[0] is vision_onnx._cu_seqlens
    without = vision_onnx.vision_inputs(visual, grids)
    for name, value in with_library.items():
        assert torch.allclose(without[name].float(), value.float()), name
