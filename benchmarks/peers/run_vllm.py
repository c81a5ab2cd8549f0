"""vLLM (CPU build) side of the peer benchmark: run a workload file on Qwen3 / Qwen3.5.

Runs in vLLM's own environment (``install_vllm.sh``) and imports nothing from fastjudge. Each
checkpoint is loaded once per mode, ``compiled`` (vLLM's default, torch.compile) and ``eager``
(``enforce_eager=True``), and per value of ``--max-num-seqs`` (the setting vLLM's users tune; it
is fixed when the engine is built, so each value is one more engine build, and every workload
runs on it), in bfloat16 (its CPU Gated DeltaNet kernel needs it) with prefix caching on. Per
mode and workload the value with the lowest median is kept (``common.keep_best``), the others'
medians listed with it. Prompts go in as token ids (``TokensPrompt``), the response prefix appended, so
vLLM runs exactly the ids fastjudge runs; its prefix cache is reset before every timed run, as
fastjudge's is.

* ``choice``: one step, ``logprob_token_ids`` = the candidates (top-k logprobs would miss the
  rating tokens of a random-weight model): their full-vocabulary log-probabilities;
* ``text``: greedy (``temperature=0``), stop at the EOS ids, ``max_new_tokens``;
* ``json``: greedy under ``structured_outputs`` with the EBNF grammar fastjudge compiles from the
  schema (same separators, no free whitespace); the schema itself when no grammar is given.

Writes ``{"engine", "version", "runs": [...]}`` as JSON.

    python run_vllm.py WORKLOADS.json OUT.json --modes compiled eager --max-num-seqs 8 16 32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from common import keep_best, settings_to_try  # the script's directory: stdlib and numpy only


def sampling_params(workload: dict):
    from vllm import SamplingParams

    eos = workload["eos_ids"]
    if workload["kind"] == "choice":
        return SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=list(workload["choice_ids"]),
                              detokenize=False)
    common = dict(max_tokens=workload["max_new_tokens"], temperature=0.0, stop_token_ids=list(eos),
                  detokenize=False)
    if workload["kind"] == "text":
        return SamplingParams(**common)
    from vllm.sampling_params import StructuredOutputsParams

    if workload.get("grammar"):
        structured = StructuredOutputsParams(grammar=workload["grammar"])
    else:
        structured = StructuredOutputsParams(json=json.loads(workload["schema"]))
    return SamplingParams(**common, structured_outputs=structured)


def prompts(workload: dict) -> list:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(r["prompt_ids"]) + list(r["response_prefix"]))
            for r in workload["requests"]]


def outputs_of(workload: dict, results) -> list[dict]:
    eos = set(workload["eos_ids"])
    out = []
    for result in results:
        completion = result.outputs[0]
        if workload["kind"] == "choice":
            step = completion.logprobs[0]  # {token id: Logprob} at the one generated position
            out.append({"logprobs": [float(step[t].logprob) for t in workload["choice_ids"]]})
        else:
            ids = [int(t) for t in completion.token_ids]
            if ids and ids[-1] in eos:  # fastjudge's outputs leave the stop token out
                ids = ids[:-1]
            out.append({"token_ids": ids})
    return out


def package_versions(*names: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads")
    ap.add_argument("out")
    ap.add_argument("--modes", nargs="+", default=["compiled", "eager"], choices=["compiled", "eager"])
    ap.add_argument("--max-num-seqs", nargs="+", type=int, default=[8, 16, 32],
                    help="values to try (one engine build each); per workload the fastest is kept")
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    args = ap.parse_args(argv)

    data = json.loads(Path(args.workloads).read_text())
    settings = data["settings"]
    threads, repeats = int(settings["threads"]), int(settings["repeats"])
    # vLLM's CPU backend takes its thread count and KV cache size from the environment.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))

    import torch
    import vllm
    from vllm import LLM

    torch.set_num_threads(threads)
    by_model: dict[str, list[tuple[int, dict]]] = {}
    for index, workload in enumerate(data["workloads"]):
        by_model.setdefault(workload["model_dir"], []).append((index, workload))
    longest = max(len(r["prompt_ids"]) + len(r["response_prefix"]) + w.get("max_new_tokens", 1) + 1
                  for w in data["workloads"] for r in w["requests"])
    runs = []
    for mode in args.modes:
        for model_dir, workloads in by_model.items():
            most = max(len(w["requests"]) for _, w in workloads)
            values = settings_to_try(args.max_num_seqs, most)
            for max_num_seqs in values:
                llm = LLM(model=model_dir, dtype=settings.get("dtype", "bfloat16"),
                          enforce_eager=mode == "eager", enable_prefix_caching=True,
                          max_model_len=max(2048, longest), max_num_seqs=max_num_seqs, seed=0)
                for index, workload in workloads:
                    if max_num_seqs not in settings_to_try(values, len(workload["requests"])):
                        continue  # a smaller value already ran this workload as one batch
                    params, inputs = sampling_params(workload), prompts(workload)
                    times, results = [], None
                    for i in range(repeats + 1):  # the first run warms up, untimed
                        llm.reset_prefix_cache()
                        start = time.perf_counter()
                        results = llm.generate(inputs, params, use_tqdm=False)
                        if i:
                            times.append(time.perf_counter() - start)
                    runs.append({"index": index, "variant": mode, "value": max_num_seqs,
                                 "workload": workload["name"], "times": times,
                                 "outputs": outputs_of(workload, results)})
                    print(f"[vllm {mode} max_num_seqs {max_num_seqs}] {Path(model_dir).name} "
                          f"{workload['name']}: median {statistics.median(times):.3f}s", file=sys.stderr)
                del llm
                gc.collect()
    versions = package_versions("torch", "transformers", "xgrammar")
    Path(args.out).write_text(json.dumps({"engine": "vllm", "version": vllm.__version__,
                                          "versions": versions, "runs": keep_best(runs, "max_num_seqs")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
