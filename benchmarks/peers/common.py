"""What the peer benchmarks share: the workload file both engines read, the comparison of their
outputs, and the table.

A workload is a list of requests as token ids, exported from fastjudge's own judges, so the
peer runs exactly the ids fastjudge runs. Each peer runner (``run_ctranslate2.py``,
``run_vllm.py``) runs in the peer's own virtual environment and imports nothing from
fastjudge: it reads the workload file (plain JSON) and writes its outputs and timings (plain
JSON), the best run of each workload over the setting its users tune (:func:`keep_best`).
This module is imported by the driver (``bench_peers.py``) in the project's environment and by
the runners in theirs; it needs only the standard library and numpy.

Output kinds:

* ``choice``: one step, the candidates' logits (or full-vocabulary log-probabilities, which give
  the same renormalised distribution, or that distribution itself, as a judge's result carries
  it); compared by the argmax (the rating or decision) and the
  largest difference of the renormalised probabilities;
* ``text`` / ``json``: greedy token ids, EOS excluded; compared by exact equality of the whole
  sequence, and for ``json`` also by equality of the parsed values.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

KINDS = ("choice", "text", "json")


@dataclass
class PeerRequest:
    """One request as a peer sees it. ``prompt_ids`` is the encoder input (encoder-decoder) or
    the prompt (decoder-only); ``response_prefix`` the forced start of the response (decoder
    input after the start token, or tokens appended to the prompt)."""

    prompt_ids: list[int]
    response_prefix: list[int] = field(default_factory=list)


@dataclass
class Workload:
    """Requests of one output kind on one checkpoint.

    ``choice_ids``: candidate token ids (kind ``choice``); ``full_vocab``: the metric reads
    full-vocabulary probabilities. ``max_new_tokens``: the decoding budget (``text``, ``json``).
    ``schema``: the JSON schema text (``json``) and ``grammar``: the same schema as the EBNF
    grammar fastjudge compiles (fixed separators, no free whitespace), for peers that take a
    grammar. ``prefix_len``: the tokens each request shares with others (for the table).
    """

    name: str
    kind: str
    model_dir: str
    requests: list[PeerRequest]
    eos_ids: list[int]
    choice_ids: list[int] = field(default_factory=list)
    full_vocab: bool = False
    max_new_tokens: int = 0
    schema: str | None = None
    grammar: str | None = None
    prefix_lens: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "choice" and not self.choice_ids:
            raise ValueError(f"{self.name}: a choice workload needs choice_ids")
        if self.kind != "choice" and self.max_new_tokens < 1:
            raise ValueError(f"{self.name}: a {self.kind} workload needs max_new_tokens >= 1")
        if self.kind == "json" and not self.schema:
            raise ValueError(f"{self.name}: a json workload needs its schema")

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) + len(r.response_prefix) for r in self.requests)


def workload_from_requests(name: str, model_dir, requests, eos_ids: Sequence[int],
                           grammar: str | None = None) -> Workload:
    """A workload from fastjudge ``Request`` objects, all of one output spec kind (the specs'
    class names are read, so this module needs no fastjudge import)."""
    if not requests:
        raise ValueError(f"{name}: no requests")
    specs = {type(r.spec).__name__ for r in requests}
    if len(specs) != 1:
        raise ValueError(f"{name}: requests of mixed output kinds {sorted(specs)}")
    spec = requests[0].spec
    kind = {"Choice": "choice", "Text": "text", "Json": "json"}[type(spec).__name__]
    if any(r.spec != spec for r in requests):
        raise ValueError(f"{name}: requests with different output specs")
    peer_requests = [PeerRequest([int(t) for t in r.prompt_ids], [int(t) for t in r.response_prefix])
                     for r in requests]
    common = dict(name=name, kind=kind, model_dir=str(model_dir), requests=peer_requests,
                  eos_ids=[int(t) for t in eos_ids], prefix_lens=[int(r.prefix_len) for r in requests])
    if kind == "choice":
        return Workload(**common, choice_ids=[int(t) for t in spec.token_ids],
                        full_vocab=bool(spec.full_vocab))
    if kind == "text":
        return Workload(**common, max_new_tokens=int(spec.max_new_tokens))
    return Workload(**common, max_new_tokens=int(spec.max_new_tokens), schema=spec.schema,
                    grammar=grammar)


def save_workloads(path, workloads: Sequence[Workload], settings: dict) -> None:
    """Write the file a peer runner reads: ``settings`` (repeats, threads, dtype, ...) and the
    workloads."""
    Path(path).write_text(json.dumps({"settings": settings,
                                      "workloads": [asdict(w) for w in workloads]}))


def load_workloads(path) -> tuple[dict, list[Workload]]:
    data = json.loads(Path(path).read_text())
    workloads = []
    for w in data["workloads"]:
        w = dict(w)
        w["requests"] = [PeerRequest(**r) for r in w["requests"]]
        workloads.append(Workload(**w))
    return data["settings"], workloads


def keep_best(runs: Sequence[dict], setting: str) -> list[dict]:
    """A peer's runs of each workload at several values of one setting its users tune
    (CTranslate2's ``max_batch_size``, vLLM's ``max_num_seqs``), each run a dict with
    ``index``, ``variant``, ``value``, ``times``, ``outputs``: per workload and variant, the
    run with the lowest median, its variant labelled with the value that won (``"float32
    (batch 16)"``) and ``tried`` giving every value's median."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["index"], run["variant"]), []).append(run)
    best = []
    for (_, variant), group in groups.items():
        winner = min(group, key=lambda r: statistics.median(r["times"]))
        tried = {str(r["value"]): statistics.median(r["times"]) for r in group}
        best.append(dict(winner, variant=f"{variant} ({setting} {winner['value']})", tried=tried))
    return sorted(best, key=lambda r: r["index"])


def settings_to_try(values: Sequence[int], items: int) -> list[int]:
    """The values of a per-batch limit worth running on ``items`` requests: those below the item
    count, and the smallest at or above it (every such limit runs them as one batch)."""
    if not values or min(values) < 1:
        raise ValueError(f"batch limits must be >= 1, got {list(values)}")
    values = sorted({int(v) for v in values})
    return [v for v in values if v < items] + [v for v in values if v >= items][:1]


# ------------------------------------------------------------------------------------------------
# Outputs and their comparison


@dataclass
class RunResult:
    """One engine's measured run of one workload. ``outputs``: per request, in workload order,
    ``{"probs": [...]}``, ``{"logits": [...]}`` or ``{"logprobs": [...]}`` (choice) or
    ``{"token_ids": [...]}``. ``tried``: a peer's median seconds at each value of the setting it
    was tuned over (:func:`keep_best`), this run being the fastest."""

    engine: str
    variant: str
    workload: str
    times: list[float]
    outputs: list[dict]
    note: str = ""
    tried: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.get("token_ids", ())) for o in self.outputs)


def candidate_probs(output: dict) -> np.ndarray:
    """The distribution over the candidates: as given (``probs``, a judge's result), or the
    softmax of their logits, or of their full-vocabulary log-probabilities (the same
    distribution, renormalised)."""
    if "probs" in output:
        p = np.asarray(output["probs"], dtype=np.float64)
        if not (np.all(np.isfinite(p)) and np.all(p >= 0) and p.sum() > 0):
            raise ValueError(f"not a distribution: {output['probs']}")
        return p / p.sum()
    values = output.get("logits")
    if values is None:
        values = output["logprobs"]
    z = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(z)):
        raise ValueError(f"non-finite candidate scores {values}")
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


@dataclass
class Agreement:
    """How the peer's outputs compare with fastjudge's on one workload."""

    items: int
    agree: float  # share of items with the same rating/decision (choice) or the same tokens
    max_prob_diff: float | None = None  # choice: largest |Δp| of the renormalised candidates
    json_agree: float | None = None  # json: share of items with equal parsed values (or equal tokens)
    json_complete: float | None = None  # json: share of fastjudge's outputs that are whole JSON

    def describe(self) -> str:
        text = f"{self.agree:.0%}"
        if self.max_prob_diff is not None:
            text += f" (max Δp {self.max_prob_diff:.1e})"
        if self.json_agree is not None and self.json_agree != self.agree:
            text += f", {self.json_agree:.0%} same JSON"
        if self.json_complete is not None and self.json_complete < 1:
            text += f"; {self.json_complete:.0%} whole JSON within the budget"
        return text


def _parsed(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


def compare(kind: str, reference: Sequence[dict], peer: Sequence[dict], decode=None) -> Agreement:
    """Compare fastjudge's outputs (``reference``) with a peer's, item by item. ``decode`` turns
    token ids into text (needed for ``json``: equal JSON values written with different tokens
    still count as the same JSON)."""
    if len(reference) != len(peer):
        raise ValueError(f"{len(reference)} reference outputs but {len(peer)} from the peer")
    n = len(reference)
    if n == 0:
        raise ValueError("no outputs to compare")
    if kind == "choice":
        ours = [candidate_probs(o) for o in reference]
        theirs = [candidate_probs(o) for o in peer]
        same = sum(int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(ours, theirs))
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs))
        return Agreement(n, same / n, max_prob_diff=diff)
    same = sum(list(a["token_ids"]) == list(b["token_ids"]) for a, b in zip(reference, peer))
    agreement = Agreement(n, same / n)
    if kind == "json":
        if decode is None:
            raise ValueError("comparing json outputs needs decode")
        parsed = [(_parsed(decode(a["token_ids"])), _parsed(decode(b["token_ids"])))
                  for a, b in zip(reference, peer)]
        # text cut by the token budget is no JSON: then only the same tokens count as the same
        agreement.json_agree = sum((a is not None and a == b) or list(x["token_ids"]) == list(y["token_ids"])
                                   for (a, b), x, y in zip(parsed, reference, peer)) / n
        agreement.json_complete = sum(a is not None for a, _ in parsed) / n
    return agreement


# ------------------------------------------------------------------------------------------------
# The table


@dataclass
class Row:
    """One line of the table: a workload run by fastjudge and by one peer variant."""

    workload: str
    model: str
    items: int
    prompt_tokens: int
    peer: str  # "ctranslate2 float32", "vllm compiled", ...
    fast: RunResult
    other: RunResult
    agreement: Agreement | None
    note: str = ""

    @property
    def ratio(self) -> float:
        """fastjudge's speed over the peer's: above 1, fastjudge is faster."""
        return self.other.seconds / self.fast.seconds


def _rate(count: float, seconds: float) -> str:
    if seconds <= 0 or not math.isfinite(seconds):
        return "-"
    rate = count / seconds
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}"


def format_table(rows: Sequence[Row]) -> str:
    """A Markdown table: items/s and tokens/s of each engine (prompt tokens for score-only
    workloads, generated tokens for decoding ones), the ratio and the agreement."""
    head = ("| workload | model | items | peer | fastjudge items/s | peer items/s | fastjudge tok/s "
            "| peer tok/s | fastjudge / peer | outputs agree |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        generated = r.fast.generated_tokens or r.other.generated_tokens
        if generated:  # decoding: generated tokens per second, each engine its own count
            fast_tok = _rate(r.fast.generated_tokens, r.fast.seconds) + " gen"
            peer_tok = _rate(r.other.generated_tokens, r.other.seconds) + " gen"
        else:
            fast_tok = _rate(r.prompt_tokens, r.fast.seconds)
            peer_tok = _rate(r.prompt_tokens, r.other.seconds)
        agree = r.agreement.describe() if r.agreement else "-"
        note = f" {r.note}" if r.note else ""
        lines.append(f"| {r.workload} | {r.model} | {r.items} | {r.peer}{note} | "
                     f"{_rate(r.items, r.fast.seconds)} | {_rate(r.items, r.other.seconds)} | "
                     f"{fast_tok} | {peer_tok} | {r.ratio:.2f}x | {agree} |")
    return "\n".join(lines)
