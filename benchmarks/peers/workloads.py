"""fastjudge's side of the peer benchmarks: the checkpoints, the workloads as fastjudge's own
judges build them, and fastjudge's timed runs of them.

The LAVE workloads are timed as users call the judge: ``LaveJudge(...).score(examples)``, prompt
building and tokenizing included. Their outputs for the comparison are the ratings'
probabilities of the judge's own results (score-only) and, since a result carries its
rationale as text and not as token ids, the greedy ids of one untimed run of the same requests
on the judge's engine (rationale), checked against the results' text. The VisExMEM and holistic
workloads are text-only cuts of those judges' prompts (below), which no public call takes: they
are timed at the request level (``runtime.scheduler.run_requests``), as the engine runs them.

Every request comes from the library's own prompt code (``LaveJudge``'s requests; VisExMEM's
and the holistic judge's prompt texts, schemas and answer tokens), so the peers get the ids
fastjudge runs. VisExMEM and holistic prompts are their text parts: the image slot is left out,
since an image would reach each engine through its own preprocessing and image tokens (the
comparison would no longer be of identical ids); what remains is the prompt shape those stages
have (an intro and the caption shared, then a task; a JSON answer, a forced decision prefix, a
full-vocabulary yes/no read).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import RunResult, Workload, workload_from_requests  # noqa: E402  (run as a script dir)


@dataclass
class Case:
    """One workload and how fastjudge runs it: through ``judge.score(examples)`` when the
    workload is a judge's public call, else ``requests`` at the request level."""

    workload: Workload
    model: str  # for the table: "flan-t5 small", "qwen3.5 mini", ...
    backend: object
    requests: list
    max_batch_tokens: int
    max_batch_size: int
    judge: object = None
    examples: list | None = None


def build_checkpoints(work: Path, t5_shape: str, qwen_shape: str, which=("t5", "qwen3", "qwen3_5")) -> dict:
    """Random-weight checkpoints built as the other benchmarks build them (real architectures,
    trained tokenizers); Flan-T5 with the real model's 32128-row vocabulary."""
    from fastjudge.checkpoints import build_random_qwen, build_random_t5
    from fastjudge.demo import tokenizer_corpus

    dirs = {}
    if "t5" in which:
        dirs["t5"] = build_random_t5(work / f"flan-t5-{t5_shape}", tokenizer_corpus(), shape=t5_shape,
                                     model_vocab_size=32128)
    for arch in ("qwen3", "qwen3_5"):
        if arch in which:
            dirs[arch] = build_random_qwen(work / f"{arch}-{qwen_shape}", tokenizer_corpus(), arch=arch,
                                           shape=qwen_shape, vocab_size=4000)
    return dirs


def check_vllm_shape(qwen_shape: str) -> None:
    """vLLM's CPU Gated DeltaNet kernel takes linear head dimensions that are multiples of 32
    other than 32 (64 and 128 work)."""
    from fastjudge.checkpoints import QWEN_SHAPES

    dims = QWEN_SHAPES[qwen_shape]
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        d = dims[key]
        if d % 32 or d == 32:
            raise SystemExit(f"Qwen shape {qwen_shape!r}: {key}={d}; vLLM's CPU Gated DeltaNet "
                             "kernel needs a multiple of 32 other than 32 (use mini, small or medium)")


def _lave_requests(judge, examples) -> list:
    """The requests ``judge.score(examples)`` runs, for the peers' workload file."""
    requests = []
    for i, example in enumerate(examples):
        request, result = judge._request(i, example)
        if request is None:
            raise RuntimeError(f"LAVE item {i}: {result.error}")
        requests.append(request)
    return requests


def lave_cases(model_dir: Path, model: str, dtype, items: int, rationale_items: int,
               rationale_tokens: int, device: str = "cpu") -> list[Case]:
    """LAVE score-only (a ``Choice`` over the rating tokens) and rationale (greedy text) judges
    on one backend (the bundled VQA items, 8 demonstrations: the judge's defaults), with the
    requests they run.

    The rationale judge rates an unparsable rationale by the authors' rule
    (``on_unparsable="official"``: rating 2), not by the default one more constrained step: a
    random-weight model's text never ends in a rating, and the peers run the greedy decode only."""
    from fastjudge import EngineOptions, LaveJudge
    from fastjudge.bench.items import lave_items

    score = LaveJudge(model_dir, engine=EngineOptions(device=device, dtype=dtype))
    backend = score.backend
    rationale = LaveJudge(backend, rationale=True, max_new_tokens=rationale_tokens, on_unparsable="official")
    eos = sorted(backend.codec.eos_token_ids)
    cases = []
    for name, judge, n in (("LAVE score-only", score, items), ("LAVE rationale", rationale, rationale_items)):
        if n <= 0:
            continue
        examples = lave_items(n)
        requests = _lave_requests(judge, examples)
        cases.append(Case(workload_from_requests(name, model_dir, requests, eos), model, backend,
                          requests, judge.max_batch_tokens, judge.max_batch_size, judge, examples))
    return cases


def text_only(parts) -> tuple[str, ...]:
    """A prompt's text segments, its image slots left out (see the module docstring)."""
    return tuple(p for p in parts if isinstance(p, str))


def visexmem_cases(model_dir: Path, model: str, backend, captions: list[str], json_tokens: int,
                   max_batch_tokens: int, max_batch_size: int) -> list[Case]:
    """VisExMEM's decomposition (JSON under the parts schema) and verification (the forced
    decision prefix, then a ``Choice`` over yes/no) on each caption; the holistic VQAScore
    question (``Choice`` over Yes/No read under the full vocabulary)."""
    from fastjudge.judges.holistic import VQASCORE_QUESTION
    from fastjudge.judges.visexmem import prompts
    from fastjudge.judges.visexmem.schemas import parts_schema
    from fastjudge.runtime.grammar import Json
    from fastjudge.runtime.requests import Choice

    codec = backend.codec
    eos = sorted(codec.eos_token_ids)
    bases = [text_only(prompts.base_prefix(None, " ".join(c.split()))) for c in captions]

    schema = parts_schema()
    schema["properties"]["parts"]["minItems"] = 1  # as the judge asks: a caption has a claim
    spec = Json.from_schema(schema, max_new_tokens=json_tokens)
    decompose = [codec.encode(base, prompts.DECOMPOSE_TASK).request(i, spec) for i, base in enumerate(bases)]

    answers = codec.answer_ids(["yes", "no"], after=prompts.DECISION_PREFIX)
    verify = []
    for i, (base, caption) in enumerate(zip(bases, captions)):
        claim = caption.split(",")[0].strip().rstrip(".")  # a claim the caption makes
        task = text_only(prompts.verification_task(claim, ["E1"], [(0, 0, 10, 10)], crops=None))
        verify.append(codec.encode(base, task).request(i, Choice(answers.ids), tuple(answers.forced)))

    yes_no = codec.answer_ids(["Yes", "No"])
    holistic = [codec.encode((), VQASCORE_QUESTION.format(c)).request(
        i, Choice(yes_no.ids, full_vocab=True), tuple(yes_no.forced)) for i, c in enumerate(captions)]

    grammar = json_grammar(spec.schema)
    return [
        Case(workload_from_requests("VisExMEM decompose (JSON)", model_dir, decompose, eos, grammar),
             model, backend, decompose, max_batch_tokens, max_batch_size),
        Case(workload_from_requests("VisExMEM verify", model_dir, verify, eos), model, backend, verify,
             max_batch_tokens, max_batch_size),
        Case(workload_from_requests("holistic yes/no", model_dir, holistic, eos), model, backend,
             holistic, max_batch_tokens, max_batch_size),
    ]


def json_grammar(schema: str) -> str:
    """The schema as the EBNF grammar fastjudge compiles: no free whitespace, the fixed
    separators, strict mode (so a peer taking a grammar decodes the same language)."""
    import xgrammar as xgr

    from fastjudge.runtime.json_bounds import SEPARATORS

    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=SEPARATORS,
                                            strict_mode=True))


def _fresh_prefix_cache(backend) -> None:
    """Empty the prefix cache, so every timed run pays for its prefixes (the peer's cache is
    reset the same way)."""
    cache = getattr(backend, "prefix_cache", None)
    if cache is not None:
        from fastjudge.runtime.prefix_cache import PrefixCache

        backend.prefix_cache = PrefixCache(cache.index.capacity_bytes)


def _output(kind: str, out) -> dict:
    if kind == "choice":
        o = {"logits": [float(x) for x in out.logits]}
        if out.logprobs is not None:
            o["logprobs"] = [float(x) for x in out.logprobs]
        return o
    return {"token_ids": [int(t) for t in out.token_ids]}


def _run_requests(case: Case) -> dict:
    """Every request's output, by index, at the request level (the judge's engine when there
    is a judge, so its batching limits)."""
    from fastjudge.runtime.scheduler import run_requests

    if case.judge is not None:
        batches = case.judge.engine.run(case.requests)
    else:
        batches = run_requests(case.backend, case.requests, case.max_batch_tokens, case.max_batch_size)
    return {o.index: o for batch in batches for o in batch}


def _judge_outputs(case: Case, results: list) -> list[dict]:
    """The comparison's outputs of a judge's run: the ratings' probabilities from the results
    (score-only); the greedy ids of one untimed request-level run (rationale), whose text must
    be the results' rationales."""
    bad = [r for r in results if r.error]
    if bad:
        raise RuntimeError(f"{case.workload.name}: item {bad[0].index}: {bad[0].error}")
    if case.workload.kind == "choice":
        return [{"probs": list(r.probs)} for r in results]
    by_index = _run_requests(case)
    outputs = [_output(case.workload.kind, by_index[r.index]) for r in case.requests]
    decode = case.backend.codec.decode
    differ = sum(decode(o["token_ids"]) != r.rationale for o, r in zip(outputs, results))
    if differ:
        print(f"warning: {case.workload.name}: {differ} of {len(results)} rationales differ from the "
              "request-level run's text", file=sys.stderr)
    return outputs


def run_fastjudge(case: Case, repeats: int) -> RunResult:
    """Median over ``repeats`` runs after one warm-up, the prefix cache emptied before each; a
    judge's workload through ``judge.score`` (the public call), another at the request level.
    Outputs in workload order."""
    times, results, by_index = [], None, None
    for i in range(repeats + 1):
        _fresh_prefix_cache(case.backend)
        start = time.perf_counter()
        if case.judge is not None:
            results = case.judge.score(case.examples)
        else:
            by_index = _run_requests(case)
        if i:
            times.append(time.perf_counter() - start)
    if case.judge is not None:
        outputs = _judge_outputs(case, results)
        how = "judge.score"
    else:
        outputs = [_output(case.workload.kind, by_index[r.index]) for r in case.requests]
        how = "requests"
    print(f"[fastjudge {how}] {case.model} {case.workload.name}: median {statistics.median(times):.3f}s",
          file=sys.stderr)
    return RunResult("fastjudge", "", case.workload.name, times, outputs)
