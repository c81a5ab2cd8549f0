"""GPU check of the Triton kernels and the backends, in one run of a few minutes.

    python benchmarks/gpu_check.py OUT_DIR            # on a CUDA machine (via gpu_check.sh)
    python benchmarks/gpu_check.py OUT_DIR --dry-run  # same code on CPU, torch reference, tiny shapes

1. choice head (fastjudge/kernels/choice_head.py): Triton vs its torch reference and vs the materializing
   full-vocabulary oracle (max |diff|, float32 and bf16); time of the kernel vs torch eager (the
   backends' current ``F.linear(rms(h), W[ids])`` for the K candidates; ``[B, V]`` logits +
   log-softmax for the full vocabulary); peak extra device memory of both full-vocabulary paths.
2. crop encode (fastjudge/kernels/crop_encode.py): Triton vs the torch reference (on the CPU, the
   PIL-compatible two-pass uint8 math, and on the GPU); vs transformers' fast Qwen2-VL image
   processor on CUDA when torchvision is installed; time of the kernel vs the torch reference
   run eagerly on the GPU and vs the processor.
3. the backends' faithfulness tests on CUDA (FASTJUDGE_TEST_DEVICE=cuda).
4. FP8 GEMM (``fastjudge.backends.fp8.fp8_linear``, ``torch._scaled_mm``; Ada/Hopper): against the
   dequantized float32 reference, and its time against a bf16 GEMM of the same shape.
5. the speed targets (``gpu_speed.py``): the end-to-end VisExMEM, holistic VQAScore and (given
   a checkout of the authors' repository) official-LAVE benchmarks, fastjudge against its
   baseline on the GPU, with their output checks.
6. the trtllm backend: ``gpu_check_trtllm.py`` (both tiny judges built in BF16 and FP8, run
   through TensorRT-LLM's LLM API against the torch backend, timed) and the TensorRT-LLM tests
   of tests/test_builders.py (the FP8 judges in the LLM API against transformers with ModelOpt
   fake quantization). Skipped, saying why, where TensorRT-LLM is not installed.

Times are medians over many runs, measured with CUDA events, inputs rotated over several copies so
that caches do not flatter. Prints one table and writes OUT_DIR/gpu_check.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from gpu_speed import run_speed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def import_kernels():
    """fastjudge.kernels when fastjudge is installed; else the package's kernels folder in this
    checkout (loaded on its own: fastjudge's compiled core is not needed for the kernels)."""
    try:
        from fastjudge.kernels import choice_head, crop_encode
    except ImportError:
        folder = ROOT / "python" / "fastjudge" / "kernels"
        spec = importlib.util.spec_from_file_location("fastjudge_kernels", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["fastjudge_kernels"] = mod
        spec.loader.exec_module(mod)
        from fastjudge_kernels import choice_head, crop_encode  # type: ignore
    return choice_head, crop_encode


class Timer:
    """Median wall time of ``fn(inputs[i % len(inputs)])`` over ``runs`` calls after ``warmup``."""

    def __init__(self, device: torch.device, runs: int, warmup: int):
        self.device, self.runs, self.warmup = device, runs, warmup

    def __call__(self, fn, inputs: list) -> float:
        for i in range(self.warmup):
            fn(inputs[i % len(inputs)])
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            for i in range(self.runs):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(inputs[i % len(inputs)])
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        else:
            for i in range(self.runs):
                t0 = time.perf_counter()
                fn(inputs[i % len(inputs)])
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def peak_extra_bytes(fn, device: torch.device) -> int | None:
    """Peak device memory allocated by ``fn`` beyond what was allocated before it."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max())


# ----------------------------------------------------------------------------------------------
def check_choice_head(ch, device, dry: bool, timer: Timer, rows: list, report: dict) -> None:
    impl = "torch" if dry else "triton"
    # T5 cases run the T5 roundings (t5_norm) and its tied-embedding scale
    cases = ([("bf16 Qwen-like", torch.bfloat16, 8, 64, 1000, 3, False),
              ("fp32 T5-like", torch.float32, 4, 64, 500, 3, True),
              ("bf16 T5-like", torch.bfloat16, 4, 64, 500, 3, True)] if dry else
             [("bf16 Qwen3-4B B=8", torch.bfloat16, 8, 2560, 151_936, 3, False),
              ("bf16 Qwen3-4B B=256", torch.bfloat16, 256, 2560, 151_936, 3, False),
              ("bf16 Qwen3-4B B=256 per-row K=2", torch.bfloat16, 256, 2560, 151_936, 2, False),
              ("fp32 Flan-T5-base B=64", torch.float32, 64, 768, 32_128, 3, True),
              ("bf16 Flan-T5-base B=64", torch.bfloat16, 64, 768, 32_128, 3, True)])
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, dtype, B, H, V, K, t5 in cases:
        per_row = "per-row" in name
        scale = H ** -0.5 if t5 else 1.0
        W = (torch.randn(V, H, generator=g) * 0.02).to(device=device, dtype=dtype)
        w = (1 + 0.1 * torch.randn(H, generator=g)).to(device)
        sets = []
        for _ in range(4):  # rotated inputs
            h = (torch.randn(B, H, generator=g) * 2).to(device=device, dtype=dtype)
            ids = torch.randint(0, V, (B, K) if per_row else (K,), generator=g).to(device)
            sets.append((h, ids))
        h, ids = sets[0]
        r = {"dtype": str(dtype).replace("torch.", ""), "B": B, "H": H, "V": V, "K": K, "per_row": per_row}
        ref = ch.choice_head_reference(h, w, W, ids, full_vocab=False, scale=scale, t5_norm=t5)
        ref_full = ch.choice_head_reference(h, w, W, ids, full_vocab=True, scale=scale, t5_norm=t5)
        got = ch.choice_head(h, w, W, ids, full_vocab=False, scale=scale, impl=impl, t5_norm=t5)
        got_full = ch.choice_head(h, w, W, ids, full_vocab=True, scale=scale, impl=impl, t5_norm=t5)
        naive = ch.full_vocab_logprobs_naive(h, w, W, ids, scale=scale, t5_norm=t5)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        r["maxdiff_logits"] = maxdiff(got.logits, ref.logits)
        r["maxdiff_logprobs_K"] = maxdiff(got.logprobs, ref.logprobs)
        r["maxdiff_logprobs_full"] = maxdiff(got_full.logprobs, ref_full.logprobs)
        r["maxdiff_logprobs_full_vs_naive"] = maxdiff(got_full.logprobs, naive)
        r["ok"] = all(r[k] <= tol for k in ("maxdiff_logits", "maxdiff_logprobs_K", "maxdiff_logprobs_full",
                                              "maxdiff_logprobs_full_vs_naive"))

        def eager_k(s, W=W, w=w, scale=scale):
            x = F.rms_norm(s[0].float(), (s[0].shape[-1],), w, 1e-6)
            x = (x * scale).to(W.dtype)
            rows = W[s[1]]
            lg = (F.linear(x, rows) if s[1].dim() == 1 else torch.bmm(rows, x[:, :, None])[..., 0]).float()
            return lg.log_softmax(-1)

        def eager_full(s, W=W, w=w, scale=scale):
            x = (F.rms_norm(s[0].float(), (s[0].shape[-1],), w, 1e-6) * scale).to(W.dtype)
            lp = F.linear(x, W).float().log_softmax(-1)
            return lp.gather(1, s[1] if s[1].dim() == 2 else s[1].expand(x.shape[0], -1))

        r["ms_eager_K"] = 1e3 * timer(eager_k, sets)
        r["ms_kernel_K"] = 1e3 * timer(lambda s: ch.choice_logprobs(s[0], w, W, s[1], scale=scale, impl=impl), sets)
        r["ms_eager_full"] = 1e3 * timer(eager_full, sets)
        r["ms_kernel_full"] = 1e3 * timer(
            lambda s: ch.choice_logprobs(s[0], w, W, s[1], full_vocab=True, scale=scale, impl=impl), sets)
        r["peak_extra_bytes_eager_full"] = peak_extra_bytes(lambda: eager_full(sets[0]), device)
        r["peak_extra_bytes_kernel_full"] = peak_extra_bytes(
            lambda: ch.choice_logprobs(h, w, W, ids, full_vocab=True, scale=scale, impl=impl), device)
        report.setdefault("choice_head", {})[name] = r
        rows.append((f"choice {name}", "max|diff| logits / K / full / vs naive",
                     f"{r['maxdiff_logits']:.2e} / {r['maxdiff_logprobs_K']:.2e} / {r['maxdiff_logprobs_full']:.2e} / "
                     f"{r['maxdiff_logprobs_full_vs_naive']:.2e} (tol {tol:g}) {'OK' if r['ok'] else 'FAIL'}"))
        rows.append((f"choice {name}", "ms eager vs kernel: K / full",
                     f"{r['ms_eager_K']:.3f} vs {r['ms_kernel_K']:.3f} / {r['ms_eager_full']:.3f} vs "
                     f"{r['ms_kernel_full']:.3f}"))
        if r["peak_extra_bytes_eager_full"] is not None:
            rows.append((f"choice {name}", "peak extra MiB full: eager vs kernel",
                         f"{r['peak_extra_bytes_eager_full'] / 2**20:.2f} vs "
                         f"{r['peak_extra_bytes_kernel_full'] / 2**20:.3f}"))
        del W, sets, h, ids


# ----------------------------------------------------------------------------------------------
def _images(g, n, H, W, device):
    """Half noise (worst case for resampling ties), half smooth gradients with flat blocks."""
    imgs = torch.randint(0, 256, (n, 3, H, W), dtype=torch.uint8, generator=g)
    yy, xx = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    for i in range(n // 2):
        smooth = torch.stack([xx * 255.0 / W, yy * 255.0 / H, ((xx + yy + 37 * i) % 64) * 4.0])
        imgs[i] = smooth.clamp(0, 255).round().to(torch.uint8)
    return imgs.to(device)


def _boxes(g, n_img, H, W, n, min_side):
    out = []
    for k in range(n):
        w = int(torch.randint(min_side, W + 1, (1,), generator=g))
        h = int(torch.randint(min_side, H + 1, (1,), generator=g))
        x0 = int(torch.randint(0, W - w + 1, (1,), generator=g))
        y0 = int(torch.randint(0, H - h + 1, (1,), generator=g))
        out.append([k % n_img, x0, y0, x0 + w, y0 + h])
    out[0] = [0, 0, 0, W, H]  # whole image
    out[1] = [0, W - 1, H - 1, W, H]  # 1-pixel box in the corner
    return out


def check_crop_encode(ce, device, dry: bool, timer: Timer, rows: list, report: dict) -> None:
    impl = "torch" if dry else "triton"
    base = {"size": {"longest_edge": 1048576 if not dry else 16384, "shortest_edge": 65536 if not dry else 1024},
            "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3, "resample": 3}
    cfg = ce.CropEncodeConfig.from_preprocessor_config(base)
    cfg_float = ce.CropEncodeConfig.from_preprocessor_config(base, uint8_mode="float")
    g = torch.Generator().manual_seed(1)
    n_img, H, W, n_box = (2, 60, 80, 4) if dry else (8, 1080, 1920, 32)
    imgs = _images(g, n_img, H, W, device)
    boxes = _boxes(g, n_img, H, W, n_box, 1 if dry else 16)  # sides >= 16: aspect <= 120
    r = {"images": [n_img, 3, H, W], "boxes": n_box, "config": {k: base[k] for k in base}}

    got, grid = ce.crop_encode(imgs, boxes, cfg, impl=impl)
    r["patches"] = int(got.shape[0])
    ref_cpu, grid_cpu = ce.crop_encode_reference(imgs.cpu(), boxes, cfg)
    d = (got.cpu() - ref_cpu).abs()
    step = cfg.rescale_factor / cfg.image_std[0]
    r["pil_mode_maxdiff_vs_cpu_reference"] = float(d.max())
    r["pil_mode_frac_one_step"] = float((d > 1e-5).float().mean())
    r["pil_mode_frac_over_one_step"] = float((d > step + 1e-5).float().mean())
    r["grid_equal"] = bool(torch.equal(grid, grid_cpu))
    got_f, _ = ce.crop_encode(imgs, boxes, cfg_float, impl=impl)
    ref_f_dev, _ = ce.crop_encode_reference(imgs, boxes, cfg_float)
    d = (got_f.cpu() - ref_f_dev.cpu()).abs()
    r["float_mode_maxdiff_vs_device_reference"] = float(d.max())
    r["float_mode_frac_one_step"] = float((d > 1e-5).float().mean())
    fimgs = imgs.float() + 0.25
    got32, _ = ce.crop_encode(fimgs, boxes, cfg, impl=impl)
    ref32, _ = ce.crop_encode_reference(fimgs, boxes, cfg)
    r["float32_images_maxdiff_vs_device_reference"] = maxdiff(got32, ref32)
    r["ok"] = (r["grid_equal"] and r["float32_images_maxdiff_vs_device_reference"] <= 1e-5
               and r["pil_mode_frac_one_step"] <= 1e-3 and r["pil_mode_frac_over_one_step"] == 0.0)

    sets = [(imgs, boxes), (_images(g, n_img, H, W, device), _boxes(g, n_img, H, W, n_box, 1 if dry else 16))]
    r["ms_torch_eager"] = 1e3 * timer(lambda s: ce.crop_encode_reference(s[0], s[1], cfg), sets)
    r["ms_kernel"] = 1e3 * timer(lambda s: ce.crop_encode(s[0], s[1], cfg, impl=impl), sets)

    # transformers' fast processor on the device (float resample, one rounding)
    if device.type == "cuda" and importlib.util.find_spec("torchvision") is not None:
        try:
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

            proc = Qwen2VLImageProcessor(**{k: v for k, v in base.items() if k != "resample"})
            crops = [imgs[n, :, y0:y1, x0:x1] for n, x0, y0, x1, y1 in boxes]
            out = proc(images=crops, return_tensors="pt", device="cuda", input_data_format="channels_first")
            d = (out["pixel_values"].float().cpu() - got_f.cpu()).abs()
            r["hf_fast_processor_maxdiff_vs_kernel_float_mode"] = float(d.max())
            r["hf_fast_processor_frac_diff"] = float((d > 1e-5).float().mean())
            d = (out["pixel_values"].float().cpu() - got.cpu()).abs()
            r["hf_fast_processor_maxdiff_vs_kernel_pil_mode"] = float(d.max())
            r["ms_hf_fast_processor"] = 1e3 * timer(
                lambda s: proc(images=s, return_tensors="pt", device="cuda", input_data_format="channels_first"),
                [crops])
        except Exception as e:  # report, do not fail the whole check
            r["hf_fast_processor_error"] = repr(e)[:300]
    else:
        r["hf_fast_processor_error"] = "not run (needs CUDA and torchvision)"
    report["crop_encode"] = r
    rows.append(("crop_encode", f"{n_box} boxes, {r['patches']} patches: grid equal", str(r["grid_equal"])))
    rows.append(("crop_encode", "uint8 pil-mode vs CPU reference: max / frac 1-step / frac >1-step",
                 f"{r['pil_mode_maxdiff_vs_cpu_reference']:.2e} / {r['pil_mode_frac_one_step']:.1e} / "
                 f"{r['pil_mode_frac_over_one_step']:.1e}"))
    rows.append(("crop_encode", "uint8 float-mode vs device reference: max / frac",
                 f"{r['float_mode_maxdiff_vs_device_reference']:.2e} / {r['float_mode_frac_one_step']:.1e}"))
    rows.append(("crop_encode", "float32 images vs device reference: max",
                 f"{r['float32_images_maxdiff_vs_device_reference']:.2e} {'OK' if r['ok'] else 'FAIL'}"))
    rows.append(("crop_encode", "ms torch eager vs kernel", f"{r['ms_torch_eager']:.3f} vs {r['ms_kernel']:.3f}"))
    if "ms_hf_fast_processor" in r:
        rows.append(("crop_encode", "HF fast processor (cuda): ms / max|diff| vs kernel float / pil mode",
                     f"{r['ms_hf_fast_processor']:.3f} / {r['hf_fast_processor_maxdiff_vs_kernel_float_mode']:.2e} / "
                     f"{r['hf_fast_processor_maxdiff_vs_kernel_pil_mode']:.2e}"))
    else:
        rows.append(("crop_encode", "HF fast processor", r["hf_fast_processor_error"]))


# ----------------------------------------------------------------------------------------------
def run_faithfulness(dry: bool, seconds: float, rows: list, report: dict) -> None:
    files = ["tests/test_t5_faithfulness.py", "tests/test_qwen_faithfulness.py", "tests/test_visexmem.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if dry:
        cmd.append("--collect-only")
    env = dict(os.environ, FASTJUDGE_TEST_DEVICE="cpu" if dry else "cuda")
    env.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(30.0, seconds))
        tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
        r = {"returncode": p.returncode, "summary": tail[0], "seconds": time.perf_counter() - t0,
             "output_tail": (p.stdout + p.stderr)[-4000:]}
    except subprocess.TimeoutExpired:
        r = {"returncode": None, "summary": f"timed out after {seconds:.0f} s", "seconds": seconds}
    report["faithfulness_tests"] = r
    rows.append(("faithfulness tests", "collect-only (dry run)" if dry else "FASTJUDGE_TEST_DEVICE=cuda",
                 f"{r['summary']} ({r['seconds']:.0f} s)"))


def check_scaled_mm(device, dry: bool, timer: Timer, rows: list, report: dict) -> None:
    try:
        from fastjudge.backends.fp8 import e4m3_scale, fp8_linear, fp8_linear_reference, quantize_e4m3
    except ImportError as e:
        report["scaled_mm"] = {"skipped": f"fastjudge not importable ({e})"}
        rows.append(("scaled_mm", "FP8 GEMM", report["scaled_mm"]["skipped"]))
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        report["scaled_mm"] = {"skipped": "FP8 GEMMs need compute capability 8.9+ (Ada, Hopper)"}
        rows.append(("scaled_mm", "FP8 GEMM", report["scaled_mm"]["skipped"]))
        return
    g = torch.Generator().manual_seed(2)
    out = {}
    for M, K, N in ([(16, 64, 48)] if dry else [(64, 4096, 4096), (2048, 4096, 11008)]):
        w = torch.randn(N, K, generator=g) * 0.02
        sw = e4m3_scale(w.abs().max())
        w8, sw = quantize_e4m3(w, sw).to(device), sw.to(device)
        xs = [(torch.randn(M, K, generator=g) * 2).to(device=device, dtype=torch.bfloat16) for _ in range(4)]
        sx = e4m3_scale(xs[0].float().abs().max()).to(device)
        y = fp8_linear(xs[0], w8, sw, sx, out_dtype=torch.float32)
        ref = fp8_linear_reference(xs[0].float(), w8, sw, sx)
        rel = maxdiff(y, ref) / float(ref.abs().max())
        w16 = (w8.float() * sw).to(torch.bfloat16)
        r = {"rel_maxdiff_vs_reference": rel, "ok": rel <= 1e-4,
             "ms_fp8": 1e3 * timer(lambda x: fp8_linear(x, w8, sw, sx), xs),
             "ms_bf16": 1e3 * timer(lambda x: F.linear(x, w16), xs)}
        out[f"{M}x{K}x{N}"] = r
        rows.append((f"scaled_mm {M}x{K}x{N}", "rel max|diff| vs reference / ms fp8 vs bf16",
                     f"{rel:.1e} {'OK' if r['ok'] else 'FAIL'} / {r['ms_fp8']:.3f} vs {r['ms_bf16']:.3f}"))
    report["scaled_mm"] = out


def run_trtllm_checks(dry: bool, seconds: float, out: Path, rows: list, report: dict) -> None:
    """The trtllm stage (gpu_check_trtllm.py, then the TensorRT-LLM tests) where TensorRT-LLM is
    installed; skipped, with the reason in the table, where it is not."""
    reason = None
    if importlib.util.find_spec("tensorrt_llm") is None:
        reason = "TensorRT-LLM is not installed (pip install 'fastjudge[trtllm]')"
    elif dry:
        reason = "dry run (no CUDA device)"
    if reason:
        report["trtllm_tests"] = {"skipped": reason}
        rows.append(("trtllm backend", "vs torch backend, vs FP8 fake quant", f"skipped: {reason}"))
        return
    stage = [sys.executable, str(ROOT / "benchmarks" / "gpu_check_trtllm.py"), str(out / "trtllm")]
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_builders.py",
             "-k", "trtllm_llm_api or scaled_mm_on_gpu"]
    r = {}
    t0 = time.perf_counter()
    for name, cmd, share in (("stage", stage, 0.6), ("tests", tests, 1.0)):
        left = max(30.0, (seconds - (time.perf_counter() - t0)) * share)
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left)
            lines = (p.stdout + p.stderr).strip().splitlines()
            r[name] = {"returncode": p.returncode, "summary": (lines or [""])[-1],
                       "output_tail": (p.stdout + p.stderr)[-4000:]}
            if name == "stage":
                for line in lines:
                    if line.startswith("gpu_check_trtllm: ") and ": " in line[18:]:
                        what, value = line[18:].split(": ", 1)
                        rows.append((f"trtllm {what}", "vs torch backend", value[:160]))
        except subprocess.TimeoutExpired:
            r[name] = {"returncode": None, "summary": f"timed out after {left:.0f} s"}
    r["seconds"] = time.perf_counter() - t0
    r["returncode"] = max((x["returncode"] if x["returncode"] is not None else 124) for x in
                          (r["stage"], r["tests"]))
    report["trtllm_tests"] = r
    rows.append(("trtllm backend", "vs FP8 fake quant (tests)", f"{r['tests']['summary']} ({r['seconds']:.0f} s)"))


def print_table(rows: list) -> None:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"{'what':<{w0}}  {'figure':<{w1}}  value")
    print("-" * (w0 + w1 + 40))
    for a, b, c in rows:
        print(f"{a:<{w0}}  {b:<{w1}}  {c}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="CPU, torch reference, tiny shapes")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per figure (default 50, dry run 3)")
    ap.add_argument("--skip-tests", action="store_true", help="skip the backends' faithfulness tests")
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of the whole check")
    ap.add_argument("--speed-s", type=float, default=150.0, help="share of the budget for the speed benchmarks")
    ap.add_argument("--skip-speed", action="store_true", help="skip the speed benchmarks")
    ap.add_argument("--only", choices=("kernels", "speed", "tests"), default=None,
                    help="one part of the check (gpu_check.sh runs them as separate stages): kernels = 1, 2 "
                         "and 4 above; speed = 5; tests = 3 and 6")
    ap.add_argument("--quick", action="store_true",
                    help="with --only speed: the quick GPU check's sizes, without the compiled-step benchmark")
    ap.add_argument("--lave-repo", default=None,
                    help="checkout of the LAVE authors' repository for the official-LAVE benchmark "
                         "(default: $FASTJUDGE_LAVE_REPO; skipped without one)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    ch, ce = import_kernels()
    runs = args.runs or (3 if dry else 50)
    timer = Timer(device, runs=runs, warmup=1 if dry else 5)
    report: dict = {"dry_run": dry, "torch": torch.__version__, "python": platform.python_version(),
                    "device": torch.cuda.get_device_name(0) if not dry else "cpu", "runs_per_timing": runs}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    rows: list = [("environment", "device / torch / triton",
                   f"{report['device']} / {report['torch']} / {report['triton']}")]
    failures = []
    kernels = args.only in (None, "kernels")
    if args.only in ("kernels", "tests"):
        args.skip_speed = True
    if args.only in ("kernels", "speed"):
        args.skip_tests = True
    report["seconds"] = {}
    for name, fn in (("choice_head", check_choice_head), ("crop_encode", check_crop_encode))[:2 if kernels else 0]:
        t0 = time.perf_counter()
        try:
            fn(ch if name == "choice_head" else ce, device, dry, timer, rows, report)
        except Exception as e:
            import traceback

            failures.append(name)
            report[f"{name}_error"] = traceback.format_exc()[-3000:]
            rows.append((name, "ERROR", repr(e)[:200]))
        report.setdefault("seconds", {})[name] = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.empty_cache()
    t0 = time.perf_counter()
    try:
        if kernels:
            check_scaled_mm(device, dry, timer, rows, report)
            if any(not v.get("ok", True) for v in report["scaled_mm"].values() if isinstance(v, dict)):
                failures.append("scaled_mm (accuracy)")
    except Exception as e:
        import traceback

        failures.append("scaled_mm")
        report["scaled_mm_error"] = traceback.format_exc()[-3000:]
        rows.append(("scaled_mm", "ERROR", repr(e)[:200]))
    report["seconds"]["scaled_mm"] = time.perf_counter() - t0
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not args.skip_speed:
        t0 = time.perf_counter()
        left = args.budget_s - (t0 - t_start)
        share = left if args.only == "speed" else left / 2
        run_speed(dry, min(args.speed_s, share), out, args.lave_repo, rows, report, quick=args.quick)
        for name, r in report["speed"].items():
            if "timed_out" in r:
                failures.append(f"speed {name} (timed out)")
            elif "skipped" not in r and r["returncode"] != 0:
                failures.append(f"speed {name}")
        report["seconds"]["speed"] = time.perf_counter() - t0
    if not args.skip_tests:
        trtllm_here = importlib.util.find_spec("tensorrt_llm") is not None and not dry
        left = args.budget_s - (time.perf_counter() - t_start)
        run_faithfulness(dry, left - 10 - (240 if trtllm_here else 0), rows, report)
        if report["faithfulness_tests"].get("returncode") not in (0,):
            failures.append("faithfulness_tests")
        run_trtllm_checks(dry, args.budget_s - (time.perf_counter() - t_start) - 10, out, rows, report)
        if "skipped" not in report["trtllm_tests"] and report["trtllm_tests"].get("returncode") != 0:
            failures.append("trtllm_tests")
    for part in ("choice_head", "crop_encode")[:2 if kernels else 0]:
        vals = report.get(part, {})
        vals = vals.values() if part == "choice_head" else [vals]
        if any(not v.get("ok", False) for v in vals):
            failures.append(f"{part} (accuracy)")
    report["failures"] = failures
    report["seconds"]["total"] = time.perf_counter() - t_start
    print_table(rows)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {out / 'gpu_check.json'}; {report['seconds']['total']:.0f} s; "
          f"{'FAILURES: ' + ', '.join(failures) if failures else 'all checks passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
