"""CPU timings of the kernels' torch reference paths (the CPU fallback), same run, same inputs.

    python benchmarks/bench_kernels.py
    python benchmarks/bench_kernels.py --batch 64 --vocab 151936 --hidden 1024 --repeats 5 --threads 1

Choice head: the fused-head reference (final RMSNorm + K gathered LM-head rows) against the
full-vocabulary paths -- the tiled online log-sum-exp reference and the eager one that
materializes ``[B, V]`` float32 logits -- with the bytes each holds besides its inputs
(analytic: the reference tiles, the eager logits, the Triton launcher's ``[2, S, B]`` partials).
All paths are checked to agree within 1e-4.

Crop encode: the torch reference (two antialiased passes per box + normalize + patchify) for a
batch of boxes over a few camera-sized images, Qwen3-VL preprocessing (patch 16, merge 2).
The GPU figures (Triton vs torch eager on CUDA) come from benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastjudge.kernels import choice_head as ch
from fastjudge.kernels import crop_encode as ce


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_choice(args) -> None:
    g = torch.Generator().manual_seed(0)
    B, H, V, K = args.batch, args.hidden, args.vocab, 3
    dtype = getattr(torch, args.dtype)
    hidden = (torch.randn(B, H, generator=g) * 2).to(dtype)
    w = 1 + 0.1 * torch.randn(H, generator=g)
    W = (torch.randn(V, H, generator=g) * 0.02).to(dtype)
    ids = torch.randint(0, V, (K,), generator=g)
    cand = ch.choice_logprobs(hidden, w, W, ids, impl="torch")
    tiled = ch.choice_logprobs(hidden, w, W, ids, full_vocab=True, impl="torch")
    naive = ch.full_vocab_logprobs_naive(hidden, w, W, ids)
    assert torch.allclose(tiled, naive, atol=1e-4), float((tiled - naive).abs().max())
    assert torch.allclose(cand, tiled.log_softmax(-1), atol=1e-4)
    tile = ch.REFERENCE_VOCAB_TILE
    esize = torch.finfo(dtype).bits // 8
    rows = [
        ("choice head, K candidates (reference)",
         median_ms(lambda: ch.choice_logprobs(hidden, w, W, ids, impl="torch"), args.repeats), 4 * K * H),
        ("full vocab, tiled online LSE (reference)",
         median_ms(lambda: ch.choice_logprobs(hidden, w, W, ids, full_vocab=True, impl="torch"), args.repeats),
         4 * B * tile + (4 * tile * H if dtype != torch.float32 else 0)),
        ("full vocab, eager [B, V] logits", median_ms(lambda: ch.full_vocab_logprobs_naive(hidden, w, W, ids),
                                                      args.repeats),
         4 * B * V * 2 + (4 * V * H if dtype != torch.float32 else 0)),
    ]
    print(f"choice head on CPU: B={B} H={H} V={V} K={K} {args.dtype}, LM head {V * H * esize / 2**20:.0f} MiB, "
          f"median of {args.repeats}")
    print(f"  {'path':<44} {'ms':>10} {'extra MiB':>10}")
    for name, ms, extra in rows:
        print(f"  {name:<44} {ms:>10.2f} {extra / 2**20:>10.2f}")
    print(f"  Triton full-vocab workspace [2, S, B] float32 at S=264: "
          f"{ch.workspace_bytes(B, 264, True) / 2**20:.3f} MiB")
    print(f"  K candidates vs eager full vocab: {rows[2][1] / rows[0][1]:.0f}x faster")


def bench_crop(args) -> None:
    g = torch.Generator().manual_seed(1)
    cfg = ce.CropEncodeConfig.from_preprocessor_config(
        {"size": {"longest_edge": 1048576, "shortest_edge": 65536}, "patch_size": 16, "merge_size": 2,
         "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 3})
    N, H, W = 2, 480, 640
    imgs = torch.randint(0, 256, (N, 3, H, W), dtype=torch.uint8, generator=g)
    boxes = []
    for k in range(args.boxes):
        w = int(torch.randint(8, W + 1, (1,), generator=g))
        h = int(torch.randint(8, H + 1, (1,), generator=g))
        x0 = int(torch.randint(0, W - w + 1, (1,), generator=g))
        y0 = int(torch.randint(0, H - h + 1, (1,), generator=g))
        boxes.append([k % N, x0, y0, x0 + w, y0 + h])
    pv, grid = ce.crop_encode_reference(imgs, boxes, cfg)
    ms = median_ms(lambda: ce.crop_encode_reference(imgs, boxes, cfg), args.repeats)
    print(f"\ncrop encode reference on CPU: {len(boxes)} boxes over {N}x3x{H}x{W} uint8 -> {pv.shape[0]} patches "
          f"of {pv.shape[1]}: {ms:.1f} ms ({ms / len(boxes):.2f} ms per box)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--boxes", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 gives stable figures on a busy machine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bench_choice(args)
    bench_crop(args)


if __name__ == "__main__":
    main()
