"""CPU timings of fastjudge's gated delta rule (``backends/qwen/gated_delta.py``) against
transformers' reference functions (``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` in transformers/models/qwen3_5/modeling_qwen3_5.py), same
inputs, float32, same run; then the decoding steps' in-place rule and the chunks' triangular
inverse, each by its forms.

    python benchmarks/bench_gated_delta.py
    python benchmarks/bench_gated_delta.py --repeats 20 --threads 1

Shapes: the tiny test checkpoint's linear-attention heads (2 key heads, 4 value heads, head dim
16) and Qwen3.5-0.8B-like heads (16 key and value heads, head dim 128): a prefill (chunked), a
multi-token decoding step (one chunk) and one-token decoding steps of several rows (recurrent),
each continuing from a state. Both results are checked to agree within 1e-5 (relative).

The in-place one-token rule (``recurrent_gated_delta_rule_``, what a decoding step runs on the
pool's state) by the engine (``_engine.recurrent_delta_rule``, each head's state read and written
once) and as tensor ops (``recurrent_gated_delta_rule_ops``, four passes over the state), at 1,
16 and 64 rows of 0.8B-like heads; both within 1e-5 of each other.

The inverse ``(I + L)^-1`` of the chunk systems the rule builds (``unit_lower_inverse``): the
engine's forward substitution (``_engine.unit_lower_inverse``, what a float32 CPU system takes),
the block inversion (``unit_lower_inverse_blocks``, elsewhere) and LAPACK's triangular solve
(``torch.linalg.solve_triangular``), on the systems of a 16-row batch of one 56-token chunk
(64 systems, mini's 2 x 2 heads), of 16 rows of 230 tokens in 32-token chunks, and of a
0.8B-like 1,024-token prefill (16 value heads); all three within 1e-5 of each other.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fastjudge.backends.qwen import gated_delta as ours

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
    bench_chunks(args.repeats)
    bench_steps(args.repeats)
    bench_inverse(args.repeats)


def bench_chunks(repeats: int) -> None:
    """The layers' in-place chunked rule (prompts and suffix passes): the engine's kernel against
    the tensor-op form it replaced on the CPU, 32-token chunks, from a cached state."""
    forms = {"engine": ours.chunk_gated_delta_rule_, "ops": ours.chunk_gated_delta_rule_ops}
    g = torch.Generator().manual_seed(3)
    print(f"\n{'in-place chunked rule':<28} {'shape':<30} " + " ".join(f"{f + ' ms':>13}" for f in forms))
    for label, B, S, Hk, Hv, d in (("mini prefill", 4, 512, 2, 4, 64), ("mini verify suffix", 16, 233, 2, 4, 64),
                                   ("0.8B-like prefill", 2, 512, 16, 16, 128)):
        x = dict(query=torch.randn(B, S, Hk, d, generator=g), key=torch.randn(B, S, Hk, d, generator=g),
                 value=torch.randn(B, S, Hv, d, generator=g), g=-F.softplus(torch.randn(B, S, Hv, generator=g)),
                 beta=torch.sigmoid(torch.randn(B, S, Hv, generator=g)))
        start = torch.randn(B, Hv, d, d, generator=g)
        with torch.inference_mode():
            results = {f: fn(start.clone(), **x, chunk_size=32, fresh=False) for f, fn in forms.items()}
            err = float((results["engine"] - results["ops"]).abs().max() / results["ops"].abs().max())
            assert err <= 1e-5, f"{label}: forms differ by {err:.2e}"
            times = [median_ms(lambda fn=fn: fn(start.clone(), **x, chunk_size=32, fresh=False), repeats)
                     for fn in forms.values()]
        shape = f"B{B} S{S} H{Hk}/{Hv} d{d}/{d} C32"
        print(f"{label:<28} {shape:<30} " + " ".join(f"{t:>13.3f}" for t in times))


def bench_steps(repeats: int) -> None:
    forms = {"engine": ours.recurrent_gated_delta_rule_, "ops": ours.recurrent_gated_delta_rule_ops}
    g = torch.Generator().manual_seed(2)
    print(f"\n{'in-place one-token step':<28} {'shape':<30} " + " ".join(f"{f + ' ms':>13}" for f in forms))
    for B in (1, 16, 64):
        Hk = Hv = 16
        dk = dv = 128
        q, k = (F.normalize(torch.randn(B, 1, Hk, dk, generator=g), dim=-1) for _ in range(2))
        x = dict(query=q * dk ** -0.5, key=k, value=torch.randn(B, 1, Hv, dv, generator=g),
                 g=-F.softplus(torch.randn(B, 1, Hv, generator=g)),
                 beta=torch.sigmoid(torch.randn(B, 1, Hv, generator=g)))
        start = torch.randn(B, Hv, dk, dv, generator=g)
        with torch.inference_mode():
            results = {f: fn(start.clone(), **x) for f, fn in forms.items()}
            err = float((results["engine"] - results["ops"]).abs().max() / results["ops"].abs().max())
            assert err <= 1e-5, f"{B} rows: forms differ by {err:.2e}"
            state = start.clone()  # updated in place run after run: the decays keep it bounded
            times = [median_ms(lambda fn=fn: fn(state, **x), repeats) for fn in forms.values()]
        shape = f"B{B} S1 H{Hk}/{Hv} d{dk}/{dv}"
        print(f"{'0.8B-like step x' + str(B):<28} {shape:<30} " + " ".join(f"{t:>13.3f}" for t in times))


# (label, systems, C) of the chunked rule's triangular inverse
INVERSE_CASES = [("16 x 56 tokens, mini", 64, 56), ("16 x 230 tokens, mini", 16 * 8 * 4, 32),
                 ("0.8B-like prefill", 32 * 16, 32), ("0.8B-like prefill", 16 * 16, 64)]


def bench_inverse(repeats: int) -> None:
    forms = {"engine": ours.unit_lower_inverse, "blocks": ours.unit_lower_inverse_blocks,
             "LAPACK": lambda s: torch.linalg.solve_triangular(s, torch.eye(s.shape[-1]).expand_as(s),
                                                               upper=False, unitriangular=True)}
    g = torch.Generator().manual_seed(1)
    print(f"\n{'triangular inverse':<28} {'systems':<30} " + " ".join(f"{f + ' ms':>13}" for f in forms))
    for label, n, C in INVERSE_CASES:
        system = (torch.rand(n, C, C, generator=g) * 2 - 1).tril(-1)
        with torch.inference_mode():
            results = {f: fn(system) for f, fn in forms.items()}
            for f, r in results.items():
                err = float((r - results["LAPACK"]).abs().max() / results["LAPACK"].abs().max())
                assert err <= 1e-5, f"{label}: {f} off by {err:.2e}"
            times = [median_ms(lambda fn=fn: fn(system), repeats) for fn in forms.values()]
        print(f"{label:<28} {f'{n} x {C} x {C}':<30} " + " ".join(f"{t:>13.3f}" for t in times))


if __name__ == "__main__":
    main()
