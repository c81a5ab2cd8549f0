"""CPU timings of fastjudge's gated delta rule (``backends/gated_delta.py``) against transformers'
reference functions (``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` in
transformers/models/qwen3_5/modeling_qwen3_5.py), same inputs, float32, same run.

    python benchmarks/bench_gated_delta.py
    python benchmarks/bench_gated_delta.py --repeats 20 --threads 1

Shapes: the tiny test checkpoint's linear-attention heads (2 key heads, 4 value heads, head dim
16) and Qwen3.5-0.8B-like heads (16 key and value heads, head dim 128): a prefill (chunked), a
multi-token decoding step (one chunk) and one-token decoding steps of several rows (recurrent),
each continuing from a state. Both results are checked to agree within 1e-5 (relative).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fastjudge.backends import gated_delta as ours

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import median_ms  # noqa: E402

# (label, batch, tokens, key heads, value heads, key dim, value dim, chunk; None: recurrent)
CASES = [
    ("tiny prefill", 1, 300, 2, 4, 16, 16, 32),
    ("tiny step x8", 8, 1, 2, 4, 16, 16, None),
    ("0.8B-like prefill", 1, 1024, 16, 16, 128, 128, 32),
    ("0.8B-like prefill", 1, 1024, 16, 16, 128, 128, 64),
    ("0.8B-like 4-token step x8", 8, 4, 16, 16, 128, 128, 4),
    ("0.8B-like step x1", 1, 1, 16, 16, 128, 128, None),
    ("0.8B-like step x64", 64, 1, 16, 16, 128, 128, None),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.models.qwen3_5 import modeling_qwen3_5 as reference

    g = torch.Generator().manual_seed(0)
    print(f"{'case':<28} {'shape':<30} {'transformers ms':>16} {'fastjudge ms':>13} {'speed-up':>9}")
    for label, B, S, Hk, Hv, dk, dv, chunk in CASES:
        x = dict(query=torch.randn(B, S, Hk, dk, generator=g), key=torch.randn(B, S, Hk, dk, generator=g),
                 value=torch.randn(B, S, Hv, dv, generator=g),
                 g=-F.softplus(torch.randn(B, S, Hv, generator=g)),
                 beta=torch.sigmoid(torch.randn(B, S, Hv, generator=g)),
                 initial_state=torch.randn(B, Hv, dk, dv, generator=g),
                 output_final_state=True, use_qk_l2norm_in_kernel=True)
        if chunk is None:
            theirs_fn, ours_fn = reference.torch_recurrent_gated_delta_rule, ours.recurrent_gated_delta_rule
        else:
            x["chunk_size"] = chunk
            theirs_fn, ours_fn = reference.torch_chunk_gated_delta_rule, ours.chunk_gated_delta_rule
        with torch.inference_mode():
            a, b = ours_fn(**x), theirs_fn(**x)
            for mine, ref in zip(a, b):
                err = float((mine - ref).abs().max() / ref.abs().max())
                assert err <= 1e-5, f"{label}: relative error {err:.2e}"
            t_theirs = median_ms(lambda: theirs_fn(**x), args.repeats)
            t_ours = median_ms(lambda: ours_fn(**x), args.repeats)
        shape = f"B{B} S{S} H{Hk}/{Hv} d{dk}/{dv}" + (f" C{chunk}" if chunk else " rec")
        print(f"{label:<28} {shape:<30} {t_theirs:>16.3f} {t_ours:>13.3f} {t_theirs / t_ours:>8.2f}x")


if __name__ == "__main__":
    main()
