"""fastjudge against the engines a user would pick instead, one after the other on identical
inputs: CTranslate2 (Flan-T5) and vLLM's CPU build (Qwen3, Qwen3.5).

For each peer: build the random-weight checkpoints, export fastjudge's own requests as token
ids (``workloads.py``), time fastjudge on them, then run the peer's runner in the peer's own
virtual environment on the same ids (``run_ctranslate2.py``, ``run_vllm.py``), compare the
outputs and print one table: items/s and tokens/s of both, the ratio (above 1: fastjudge
faster) and the output agreement. Medians over ``--repeats`` runs after a warm-up. fastjudge's
LAVE rows are its public call, ``LaveJudge(...).score(examples)``; each peer runs at several
values of the batch setting its users tune (``--ct2-batch-sizes``, ``--vllm-max-num-seqs``) and
its fastest is kept, the row naming the value that won. fastjudge also runs the CTranslate2
workloads in bfloat16 (``--t5-extra-dtypes``; its default on the CPU, which CTranslate2 does
not offer there): those rows pair fastjudge bf16 with the same float32 and int8 peer runs.

A peer whose environment is missing is installed first (``install_*.sh``), unless
``--no-install``: then it is skipped with a note. ``--peers`` picks them.

    python benchmarks/peers/bench_peers.py --repeats 3
    python benchmarks/peers/bench_peers.py --peers ctranslate2 --t5-shape small --items 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # bench_device, shared with the other benchmarks

from common import Row, RunResult, compare, format_table, save_workloads  # noqa: E402

PEERS = ("ctranslate2", "vllm")


def peer_python(peer: str, envs: Path, install: bool) -> Path | None:
    """The peer environment's interpreter, installing the environment first when asked."""
    env = envs / peer
    python = env / "bin" / "python"
    if not (env / ".installed").exists():
        if not install:
            return None
        print(f"installing {peer} into {env} (once)", file=sys.stderr)
        subprocess.run(["bash", str(HERE / f"install_{peer}.sh"), str(env)], check=True)
    return python


def run_peer(python: Path, peer: str, workload_file: Path, out_file: Path, extra: list[str]) -> dict:
    cmd = [str(python), str(HERE / f"run_{peer}.py"), str(workload_file), str(out_file), *extra]
    subprocess.run(cmd, check=True)
    return json.loads(out_file.read_text())


def rows_for(cases, fast_runs, peer_data: dict, decode_for) -> list[Row]:
    """Pair each peer run with fastjudge's run of the same workload (by its position in the
    workload file) and compare their outputs."""
    rows = []
    for run in peer_data["runs"]:
        case, fast = cases[run["index"]], fast_runs[run["index"]]
        other = RunResult(peer_data["engine"], run["variant"], run["workload"], run["times"],
                          run["outputs"], run.get("note", ""), run.get("tried", {}))
        agreement = compare(case.workload.kind, fast.outputs, other.outputs, decode=decode_for(case))
        rows.append(Row(case.workload.name, case.model, len(case.requests), case.workload.prompt_tokens,
                        f"{peer_data['engine']} {run['variant']}".strip(), fast, other, agreement,
                        note=run.get("note", "")))
    return rows


SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def check_same_workloads(cases, extra_cases) -> None:
    """fastjudge in another dtype is paired with the peer's runs of the float32 workloads: the
    same judges must have asked for the same token ids."""
    for a, b in zip(cases, extra_cases, strict=True):
        if a.workload.requests != b.workload.requests:
            raise RuntimeError(f"{a.workload.name}: the {b.model} judge exported other token ids than {a.model}")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.machine()}, {os.cpu_count()} cores"


def fastjudge_versions() -> str:
    from importlib.metadata import version

    import fastjudge

    return (f"fastjudge {fastjudge.__version__}, torch {version('torch')}, transformers "
            f"{version('transformers')}, xgrammar {version('xgrammar')}")


def versions(peer_data: dict) -> str:
    extra = peer_data.get("versions", {})
    text = f"{peer_data['engine']} {peer_data['version']}"
    return text + "".join(f", {k} {v}" for k, v in extra.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--items", type=int, default=32, help="score-only items per workload")
    ap.add_argument("--gen-items", type=int, default=16,
                    help="items of the decoding workloads (and of VisExMEM, holistic)")
    ap.add_argument("--gen-tokens", type=int, default=30, help="greedy budget of the rationale workloads")
    ap.add_argument("--json-tokens", type=int, default=48, help="budget of the JSON workload")
    ap.add_argument("--t5-shape", default="small")
    ap.add_argument("--qwen-shape", default="mini", help="linear head dim 64 or 128 for vLLM's CPU kernel")
    ap.add_argument("--qwen-archs", nargs="+", default=["qwen3", "qwen3_5"], choices=["qwen3", "qwen3_5"])
    ap.add_argument("--ct2-compute-types", nargs="+", default=["float32", "int8"])
    ap.add_argument("--t5-extra-dtypes", nargs="*", default=["bfloat16"], choices=["bfloat16"],
                    help="fastjudge also runs the CTranslate2 workloads in these dtypes (same token ids; "
                         "rows against the same peer runs)")
    ap.add_argument("--ct2-batch-sizes", nargs="+", type=int, default=[8, 16, 32, 64],
                    help="CTranslate2 max_batch_size values tried per workload; the fastest is kept")
    ap.add_argument("--vllm-modes", nargs="+", default=["compiled", "eager"], choices=["compiled", "eager"])
    ap.add_argument("--vllm-max-num-seqs", nargs="+", type=int, default=[8, 16, 32],
                    help="vLLM max_num_seqs values tried (one engine build each); per workload the fastest is kept")
    ap.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    ap.add_argument("--envs", default=str(HERE / ".envs"), help="where the peers' environments live")
    ap.add_argument("--no-install", action="store_true", help="skip peers whose environment is missing")
    for peer in PEERS:
        ap.add_argument(f"--{peer}-python", default=None, metavar="PYTHON",
                        help=f"run {peer} with this interpreter instead of its environment "
                             "(e.g. a CUDA machine's own python with the peer installed)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--work-dir", default=None,
                    help="keep checkpoints, workload files and peer outputs here (default: a temporary directory)")
    args = ap.parse_args(argv)

    import torch
    from bench_device import bench_device, device_label
    from workloads import build_checkpoints, check_vllm_shape, lave_cases, run_fastjudge, visexmem_cases

    from fastjudge.bench.items import image_text_items

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    device = bench_device(args.device)
    envs = Path(args.envs)
    rows, notes, engine_versions = [], [], [fastjudge_versions()]
    settings = dict(repeats=args.repeats, threads=threads, device=args.device)
    with tempfile.TemporaryDirectory(prefix="fastjudge-peers-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for peer in args.peers:
            python = getattr(args, f"{peer}_python") or peer_python(peer, envs, not args.no_install)
            if python is None:
                notes.append(f"{peer}: no environment in {envs / peer} (run install_{peer}.sh); skipped")
                continue
            if peer == "ctranslate2":
                dirs = build_checkpoints(work, args.t5_shape, args.qwen_shape, which=("t5",))
                cases = lave_cases(dirs["t5"], f"flan-t5 {args.t5_shape} fp32", torch.float32,
                                   args.items, args.gen_items, args.gen_tokens, args.device)
                extra = ["--compute-types", *args.ct2_compute_types, "--device", args.device,
                         "--batch-sizes", *map(str, args.ct2_batch_sizes)]
                peer_settings = dict(settings, dtype="float32")
                also = [lave_cases(dirs["t5"], f"flan-t5 {args.t5_shape} {SHORT[dtype]}", getattr(torch, dtype),
                                   args.items, args.gen_items, args.gen_tokens, args.device)
                        for dtype in args.t5_extra_dtypes]
                for extra_cases in also:
                    check_same_workloads(cases, extra_cases)
            else:
                also = []
                check_vllm_shape(args.qwen_shape)
                dirs = build_checkpoints(work, args.t5_shape, args.qwen_shape, which=tuple(args.qwen_archs))
                captions = [e.text for e in image_text_items(args.gen_items)]
                cases = []
                for arch in args.qwen_archs:
                    label = f"{'qwen3.5' if arch == 'qwen3_5' else 'qwen3'} {args.qwen_shape} bf16"
                    lave = lave_cases(dirs[arch], label, torch.bfloat16, args.items, args.gen_items,
                                      args.gen_tokens, args.device)
                    backend = lave[0].backend
                    cases += lave + visexmem_cases(dirs[arch], label, backend, captions, args.json_tokens,
                                                   lave[0].max_batch_tokens, lave[0].max_batch_size)
                extra = ["--modes", *args.vllm_modes, "--max-num-seqs", *map(str, args.vllm_max_num_seqs)]
                peer_settings = dict(settings, dtype="bfloat16")
            # fastjudge first, then the peer, on the same exported ids
            fast_runs = [run_fastjudge(c, args.repeats) for c in cases]
            also_runs = [[run_fastjudge(c, args.repeats) for c in extra_cases] for extra_cases in also]
            workload_file = work / f"{peer}-workloads.json"
            save_workloads(workload_file, [c.workload for c in cases], peer_settings)
            every = cases + [c for extra_cases in also for c in extra_cases]
            decoders = {id(c): c.backend.codec.decode for c in every}
            for c in every:  # free fastjudge's models before the peer loads its own
                c.backend = c.judge = None
            lave = backend = None
            try:
                data = run_peer(python, peer, workload_file, work / f"{peer}-out.json", extra)
            except subprocess.CalledProcessError as failed:
                notes.append(f"{peer}: runner failed (exit {failed.returncode}); see its output above")
                continue
            peer_rows = rows_for(cases, fast_runs, data, lambda c: decoders[id(c)])
            for extra_cases, extra_runs in zip(also, also_runs):
                peer_rows += rows_for(extra_cases, extra_runs, data, lambda c: decoders[id(c)])
            print(f"\n{versions(data)}\n{format_table(peer_rows)}\n", file=sys.stderr)  # kept if a later peer fails
            rows += peer_rows
            engine_versions.append(versions(data))

    print()
    print(f"fastjudge vs peers, same token ids; {device_label(device)} ({cpu_name()}), median of "
          f"{args.repeats} after a warm-up; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("versions: " + "; ".join(engine_versions))
    print(format_table(rows))
    print("fastjudge / peer: the peer's time over fastjudge's (above 1: fastjudge is faster). "
          "tok/s: prompt tokens per second for one-step workloads, generated tokens ('gen') for decoding.")
    for note in notes:
        print("note: " + note)
    if args.json:
        Path(args.json).write_text(json.dumps([dict(workload=r.workload, model=r.model, items=r.items,
                                                    peer=r.peer, fastjudge_s=r.fast.seconds,
                                                    peer_s=r.other.seconds, ratio=r.ratio,
                                                    peer_tried_s=r.other.tried,
                                                    agreement=r.agreement.describe() if r.agreement else None)
                                               for r in rows], indent=2))
    return 1 if notes and not rows else 0


if __name__ == "__main__":
    sys.exit(main())
