"""The device a side-by-side benchmark runs both of its paths on (``--device``).

On CUDA, float32 stays float32: TF32 is turned off for matrix products and convolutions (cuDNN
allows it for convolutions by default, which would round the HF vision tower's patch
convolution differently from fastjudge's matmul form), so the two paths' greedy tokens can
agree as they do on the CPU. Each benchmark's clock stops after results reach the host (token
lists, Python floats), which waits for the device."""

from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda")


def bench_device(name: str) -> torch.device:
    """``name`` as a device, with CUDA set up for exact float32 comparisons; a clear exit where
    CUDA was asked for and there is none."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def device_label(device: torch.device) -> str:
    """What the results table says the numbers ran on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu, {torch.get_num_threads()} threads"
