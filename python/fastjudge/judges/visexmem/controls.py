"""The paper's controls for untuned judges, as modes of :class:`~.judge.VisExJudge` beside the
multi-call pipeline (``mode="pipeline"``, the default):

* ``"single-response"``, the "Dec." setting (the paper's Fig. 9): one grammar-constrained
  response per example does everything: the decomposition into parts, each part's evidence
  among the candidate regions, its support as an integer 0..100, a short explanation, an overall
  explanation and an overall score 0..100. The scores are read from the decoded text (greedy):
  ``support`` = the part's integer / 100, ``decision`` = yes when support >= 0.5, the item's
  ``score`` = the overall integer / 100 (the model's own overall judgment, not an aggregate of
  the parts, so ``aggregate`` does not apply). With claims given, the response rates those
  instead of decomposing.
* ``"holistic-score"``, the "Hol." setting (Fig. 8): a prompt of its own that mentions neither
  claims nor regions asks for ``{"score": N}``, N an integer 0..100, and the score is the
  expected value of N under the model, divided by 100 (see :class:`IntegerReading`), not
  P(yes) as the holistic yes/no baseline (``judges.holistic``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ...runtime.grammar import Json
from ...runtime.requests import Choice
from . import prompts
from .schemas import SCORE_MAX, given_claims_response_schema, single_response_schema

MODES = ("pipeline", "single-response", "holistic-score")


def check_mode(mode: str, propose_boxes: bool, evidence_layout: str) -> None:
    """ValueError for an unknown mode, or a pipeline-only option set with a control mode."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "pipeline" and (propose_boxes or evidence_layout != "per-claim"):
        raise ValueError(f"propose_boxes and evidence_layout apply to mode='pipeline' only, not {mode!r}")


@dataclass(frozen=True)
class IntegerReading:
    """How an integer answer 0..``max_value``, written between two fixed texts, is read as its
    expected value under the model, for any tokenizer.

    Every value's text (``before`` + digits + ``after``) is tokenized as the model's response
    would be; the tokens all values share are ``forced``, the rest form a token tree. Where the
    tree branches, one ``Choice`` step reads the model's distribution over the branches
    (renormalised among them, as constrained decoding restricted to these texts would be); a
    value's probability is the product along its path. A tokenizer that writes every value as
    one token (then the closing text) has one branch point: a single step over all values. One
    that writes digits apart (Qwen) has 11 for 0..100: the first digit, the second after each of
    1..9, the third after 10."""

    forced: tuple[int, ...]
    values: tuple[tuple[int, ...], ...]  # each value's tokens after ``forced``
    branches: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (tokens so far, next-token candidates)

    @classmethod
    def build(cls, codec, max_value: int, before: str, after: str) -> "IntegerReading":
        full = [tuple(codec.response_ids(f"{before}{n}{after}")) for n in range(max_value + 1)]
        shared = 0
        while all(len(f) > shared for f in full) and len({f[shared] for f in full}) == 1:
            shared += 1
        values = tuple(f[shared:] for f in full)
        children: dict[tuple[int, ...], list[int]] = {}
        for tokens in values:
            for i, token in enumerate(tokens):
                kids = children.setdefault(tokens[:i], [])
                if token not in kids:
                    kids.append(token)
        if len(set(values)) < len(values) or any(v in children for v in values):
            raise ValueError(f"the tokenizer does not tell the numbers 0..{max_value} apart after {before!r}")
        branches = tuple((path, tuple(kids)) for path, kids in children.items() if len(kids) > 1)
        return cls(tuple(full[0][:shared]), values, branches)

    def expectation(self, probs: Mapping[tuple[int, ...], Sequence[float]]) -> float:
        """The expected value, from the probabilities read at each branch point (by its path)."""
        steps = {path: dict(zip(kids, probs[path])) for path, kids in self.branches}
        total = 0.0
        for value, tokens in enumerate(self.values):
            p = 1.0
            for i, token in enumerate(tokens):
                if tokens[:i] in steps:
                    p *= steps[tokens[:i]][token]
            total += value * p
        return float(total)


def score_reading(codec) -> IntegerReading:
    """The reading of the holistic-score answer ``{"score": N}``."""
    return IntegerReading.build(codec, SCORE_MAX, prompts.SCORE_PREFIX, prompts.SCORE_SUFFIX)


class ControlModes:
    """The control modes, mixed into ``VisExJudge``: they build on its request building
    (``_request``), stage runner (``_stage``), JSON parsing and claim setters, and fill the
    same result fields as the pipeline."""

    def _single_response(self, items: list) -> None:
        self._propose(items)  # the candidates: the example's boxes, else the quadrants
        specs: dict[tuple, Json] = {}  # by (candidates, given claims): built once, not per item

        def make(it, _, key: int):
            evidence_ids = [f"E{i}" for i in range(1, len(it.boxes) + 1)]
            given = [c.text for c in it.claims] or None
            shape = (len(evidence_ids), len(given) if given else 0)
            if shape not in specs:
                if given:
                    keys = [f"C{k}" for k in range(1, len(given) + 1)]
                    schema = given_claims_response_schema(keys, evidence_ids, self.max_explanation_chars,
                                                          self.explain)
                else:
                    schema = single_response_schema(evidence_ids, self.max_claims, self.max_claim_chars,
                                                    self.max_explanation_chars, self.explain)
                specs[shape] = Json.from_schema(schema)
            task = prompts.single_response_task(it.image.width, it.image.height, it.boxes, self.explain, given)
            return self._request(it, key, self.base_prefix(it), task, specs[shape])

        for it, _, out in self._stage("single-response", ((it, None) for it in items), make):
            parsed = self._json(out)
            if parsed is None:
                it.result.error = "the single response did not finish within its token budget"
                continue
            if it.claims:
                entries = [parsed["claims"][f"C{k}"] for k in range(1, len(it.claims) + 1)]
            else:
                entries = self._set_parts(it, parsed["claims"])  # the kept parts carry their ratings
                if entries is None:
                    continue
            for claim, entry in zip(it.claims, entries):
                self._set_evidence(it, claim, entry["selected_evidence_ids"])
                claim.support = entry["support"] / SCORE_MAX
                claim.decision = "yes" if claim.support >= 0.5 else "no"
                claim.explanation = entry.get("explanation")
            it.result.score = parsed["score"] / SCORE_MAX
            it.result.explanation = parsed.get("explanation")

    def holistic_prefix(self, item) -> prompts.Prompt:
        """The holistic-score intro, the whole image and the caption."""
        return prompts.base_prefix(item.full_image, item.caption, prompts.HOLISTIC_INTRO)

    def _holistic_score(self, items: list) -> None:
        reading = self.score_reading
        for it in items:
            if it.claims:
                it.result.warnings.append("claims given are not used by mode='holistic-score'")
                it.claims = []

        def make(it, branch, key: int):
            path, candidates = branch
            return self._request(it, key, self.holistic_prefix(it), prompts.HOLISTIC_SCORE_TASK,
                                 Choice(candidates), reading.forced + path)

        probs: dict[int, dict] = {}
        for it, (path, _), out in self._stage("holistic-score", ((it, b) for it in items for b in reading.branches),
                                              make):
            probs.setdefault(it.index, {})[path] = out.probs
        for it in items:
            if not it.result.error:
                it.result.score = reading.expectation(probs[it.index]) / SCORE_MAX
