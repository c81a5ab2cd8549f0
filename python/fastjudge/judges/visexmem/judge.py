"""VisExMEM: reference-free image-text evaluation by decomposed, evidence-grounded verification.

For each image-caption pair, in stages over a whole batch of examples:

1. **Decomposition** -- the model writes ``{"parts": [...]}`` (the paper's Table 5 format; each
   part has ``part_id, text, type, parent_part_id, head_part_id, target_part_id``), decoded under
   a JSON-schema grammar so it always parses. Links to unknown ids, self-links, links that close
   a cycle and repeated ids are then repaired (the link set to null, the repeated part dropped)
   and reported in ``warnings``; with ``strict=True`` they make the item an error.
2. **Evidence** -- candidate boxes ``E1..En``: the example's boxes, else (``propose_boxes=True``)
   the model's grounding output (``{"boxes": [{"bbox_2d": [...]}]}``, 0..1000 coordinates),
   else the image's four quadrants. Per claim the model selects
   ``{"selected_evidence_ids": [...]}``, constrained to existing ids.
3. **Verification** -- per claim, the image + caption (shared prefix, computed once per example
   and reused by every claim and stage), the claim, and its selected regions cropped and encoded
   for the vision tower; the answer ``{"decision": "yes"|"no"}`` is read in one step as a
   ``Choice`` over the two words: ``support`` = P(yes) renormalised over {yes, no},
   ``decision`` = yes when support >= 0.5.

   Evidence layout: ``"per-claim"`` (default) puts each claim's selected crops in that claim's
   part of the prompt, so the model sees exactly the image, the claim and its selected regions.
   ``"shared"`` puts every candidate region with its crop into the example's shared prefix (so
   each crop runs once per example, not once per claim) and names the selected ids in the
   claim's part; the model then also sees the unselected candidates. It is faster by the crops'
   share of the prompt; which one a trained VisExMEM model expects is unknown (its prompts are
   not public).
4. **Aggregation** -- the global score is the arithmetic mean of claim support (default), or
   the geometric or harmonic mean, or the minimum (the paper's Table 9).
5. **Explanation** (``explain=True``) -- after the decisions are fixed, from the same evidence
   and decisions: one ``{"explanation": "..."}`` per claim and one overall.

Claims given with an example (``ImageTextExample.claims``) replace the decomposition: the
other stages check exactly those. ``mode`` runs one of the paper's controls for untuned judges
instead of the pipeline: ``"single-response"`` ("Dec.") or ``"holistic-score"`` ("Hol."), see
``controls.py``.

Prompts are this project's own wording; the output formats follow the paper. The pipeline runs
on any Qwen3.5 vision-language checkpoint and on trained VisExMEM weights.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Sequence

from ...engine_options import EngineOptions
from ...io.images import (
    MAX_IMAGE_PIXELS,
    ImageError,
    LoadedImage,
    check_boxes,
    encode_region,
    grid_boxes,
    load_image,
    relative_to_pixels,
)
from ...runtime.grammar import Json
from ...runtime.requests import Choice, Image, Output, Request
from ..base import Judge
from . import prompts
from .claims import AGGREGATES, LINK_FIELDS, aggregate, given_parts, validate_parts
from .controls import ControlModes, check_mode, score_reading
from .prompts import (
    DECISION_PREFIX,
    DECOMPOSE_TASK,
    EXPLAIN_CLAIM_TASK,
    EXPLAIN_OVERALL_TASK,
    PROPOSE_TASK,
    SELECT_TASK,
)
from .records import ClaimResult, ImageTextExample, VisExResult
from .schemas import boxes_schema, evidence_schema, explanation_schema, parts_schema

EVIDENCE_LAYOUTS = ("per-claim", "shared")
STAGES = ("decompose", "propose", "select", "verify", "explain", "single-response", "holistic-score")


@dataclass
class _Item:
    """One example's state through the stages."""

    index: int
    result: VisExResult
    image: LoadedImage
    caption: str
    full_image: Image
    boxes: list[tuple[int, int, int, int]] = field(default_factory=list)
    box_images: list[Image] = field(default_factory=list)
    claims: list[ClaimResult] = field(default_factory=list)


class VisExJudge(ControlModes, Judge):
    """The VisExMEM evaluator over a multimodal Qwen3.5 checkpoint. See the module docstring.

    Bad input never stops a job: an unreadable image, malformed boxes, an empty caption or a
    caption that yields no claims give that item an ``error``; clipped or dropped boxes and
    repaired part links are listed in its ``warnings``.

    Options beyond the issue's: ``propose_boxes`` (model-proposed candidates for examples
    without boxes, instead of the quadrants); ``max_claims``, ``max_claim_chars``,
    ``max_explanation_chars`` (grammar bounds, hence token budgets, of the written stages);
    ``evidence_layout`` (``"per-claim"`` or ``"shared"``, see the module docstring);
    ``strict`` (repaired part links become an item error); ``mode`` (``"pipeline"``, or a
    control: ``"single-response"``, ``"holistic-score"``; see ``controls.py``); ``image_root``
    (for relative image paths); ``crop_max_pixels`` (resize evidence crops to at most this many pixels, fewer image
    tokens per claim; default: the checkpoint's processor limit); ``max_image_pixels`` (the pixel
    budget of an image, see :mod:`fastjudge.io.images`; a larger one is that item's error).
    ``engine``: how the model runs (:class:`~fastjudge.engine_options.EngineOptions`, e.g. its
    jump-forward JSON decoding, exact, so it only changes speed; ignored when ``model`` is an
    open backend)."""

    def __init__(self, model, mode: str = "pipeline", aggregate: str = "mean", explain: bool = True,
                 propose_boxes: bool = False, evidence_layout: str = "per-claim",
                 max_claims: int = 12, max_claim_chars: int = 120, max_explanation_chars: int = 300,
                 strict: bool = False, image_root: str | os.PathLike | None = None,
                 crop_max_pixels: int | None = None, max_image_pixels: int | None = None,
                 *, engine: EngineOptions | None = None):
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
        if evidence_layout not in EVIDENCE_LAYOUTS:
            raise ValueError(f"evidence_layout must be one of {EVIDENCE_LAYOUTS}, got {evidence_layout!r}")
        if min(max_claims, max_claim_chars, max_explanation_chars) < 1:
            raise ValueError("max_claims, max_claim_chars and max_explanation_chars must be >= 1")
        check_mode(mode, propose_boxes, evidence_layout)
        self._open(model, engine, image="VisExMEM")
        self.aggregate = aggregate
        self.explain = explain
        self.propose_boxes = propose_boxes
        self.max_claims = max_claims
        self.max_claim_chars = max_claim_chars
        self.max_explanation_chars = max_explanation_chars
        self.evidence_layout = evidence_layout
        self.strict = strict
        self.image_root = image_root
        self.max_image_pixels = max_image_pixels or MAX_IMAGE_PIXELS
        self.image_config = self.codec.image_config
        self.crop_config = self.image_config
        if crop_max_pixels is not None:
            self.crop_config = replace(self.image_config, max_pixels=int(crop_max_pixels),
                                       min_pixels=min(self.image_config.min_pixels, int(crop_max_pixels)))
        self.decision_prefix, self.yes_no_ids = self._decision_tokens()
        self.mode = mode
        self.score_reading = score_reading(self.codec) if mode == "holistic-score" else None
        self.stage_seconds = {s: 0.0 for s in STAGES}

    # -- tokens -----------------------------------------------------------------------------------
    def _decision_tokens(self) -> tuple[tuple[int, ...], tuple[int, int]]:
        """The forced response start and the (yes, no) token ids read after it: the tokens the
        two full answers share, then each answer's next token (the word's first token, should a
        word take more than one)."""
        answers = self.codec.answer_ids(["yes", "no"], after=DECISION_PREFIX)
        return answers.forced, answers.ids

    # -- preparing examples -------------------------------------------------------------------------
    def _prepare(self, index: int, example: ImageTextExample) -> _Item | VisExResult:
        result = VisExResult(index=index, id=getattr(example, "id", None))
        try:
            text = example.text
            if not isinstance(text, str) or not text.strip():
                raise ValueError("text (the caption) must be a non-empty string")
            self.codec.check_text_length(text, self.backend.max_input_tokens)
            claims = getattr(example, "claims", None)
            if claims is None and not any(ch.isalnum() for ch in text):  # given claims need no words here
                raise ValueError("the caption yielded no claims (it has no words)")
            loaded = load_image(example.image, self.image_root, self.max_image_pixels)
            boxes, warnings = check_boxes(example.boxes, loaded.width, loaded.height)
            result.warnings += warnings
            full = encode_region(loaded, (0, 0, loaded.width, loaded.height), self.image_config)
            parts = None if claims is None else given_parts(claims, self.max_claims, self.max_claim_chars)
        except (ImageError, ValueError, TypeError) as bad:
            result.error = f"invalid example: {bad}"
            return result
        item = _Item(index, result, loaded, " ".join(text.split()), full)
        if parts is not None and self._set_parts(item, parts) is None:
            return result
        if example.boxes is not None and not boxes:
            result.warnings.append("no usable boxes given; candidates come from the fallback")
        if boxes:
            self._set_boxes(item, boxes)
        return item

    def _set_boxes(self, item: _Item, boxes: Sequence[tuple[int, int, int, int]]) -> None:
        kept, images = [], []
        for box in boxes:
            try:
                images.append(encode_region(item.image, box, self.crop_config))
                kept.append(box)
            except ValueError as bad:  # e.g. an aspect ratio the processor refuses
                item.result.warnings.append(f"box {list(box)} cannot be encoded ({bad}); dropped")
        item.boxes, item.box_images = kept, images

    # -- prompts ----------------------------------------------------------------------------------
    # Every prompt is a shared prefix + a task, each a sequence of text and image slots.
    def base_prefix(self, item: _Item) -> prompts.Prompt:
        """Intro, the whole image and the caption: shared by every stage of an example."""
        return prompts.base_prefix(item.full_image, item.caption)

    def evidence_prefix(self, item: _Item) -> prompts.Prompt:
        """``base_prefix`` + the candidate regions, each with its crop: the shared prefix of the
        evidence stages in the ``"shared"`` layout."""
        return prompts.evidence_prefix(self.base_prefix(item), item.image.width, item.image.height,
                                       item.boxes, item.box_images)

    def _request(self, item: _Item, key: int, prefix: prompts.Prompt, task: prompts.Prompt | str, spec,
                 response_prefix: tuple[int, ...] = ()) -> Request:
        encoded = self.codec.encode(prefix, task)
        if len(encoded.ids) + len(response_prefix) > self.backend.max_input_tokens:
            raise ValueError(f"prompt is {len(encoded.ids)} tokens, above the model limit of "
                             f"{self.backend.max_input_tokens}")
        item.result.prompt_tokens = max(item.result.prompt_tokens or 0, len(encoded.ids))
        # the image and caption (and the candidates' crops) are the prefix of every later stage
        return encoded.request(key, spec, response_prefix, keep_prefix=True)

    def _evidence_request(self, item: _Item, key: int, task: prompts.Prompt | str, spec,
                          response_prefix: tuple[int, ...] = ()) -> Request:
        """A request of an evidence stage (select, verify, explain): behind the candidate crops
        in the shared layout, behind the base prefix in the per-claim layout."""
        prefix = self.evidence_prefix(item) if self.evidence_layout == "shared" else self.base_prefix(item)
        return self._request(item, key, prefix, task, spec, response_prefix)

    def _run(self, stage: str, requests: Sequence[Request]) -> dict[int, Output]:
        if not requests:  # a stage with nothing to do takes no time (e.g. all claims given)
            return {}
        start = time.perf_counter()
        outputs = {o.index: o for batch in self.engine.run(requests) for o in batch}
        self.stage_seconds[stage] += time.perf_counter() - start
        return outputs

    def _json(self, out: Output) -> dict | None:
        try:
            return json.loads(self.codec.decode(out.token_ids))
        except json.JSONDecodeError:
            return None

    def _stage(self, stage: str, jobs: Iterable[tuple[_Item, object]], make) -> list[tuple[_Item, object, Output]]:
        """Run one stage: a request per ``(item, payload)`` job from ``make(item, payload, key)``.
        An item whose prompt is over the model limit gets an error and drops out."""
        requests, kept = [], []
        for it, payload in jobs:
            if it.result.error:
                continue
            try:
                requests.append(make(it, payload, len(requests)))
                kept.append((it, payload))
            except ValueError as bad:
                it.result.error = f"invalid example: {bad}"
        outputs = self._run(stage, requests)
        return [(it, payload, outputs[k]) for k, (it, payload) in enumerate(kept) if not it.result.error]

    # -- stages -----------------------------------------------------------------------------------
    def _decompose(self, items: list[_Item]) -> None:
        schema = parts_schema(self.max_claims, self.max_claim_chars)
        schema["properties"]["parts"]["minItems"] = 1  # a caption with words has a claim
        spec = Json.from_schema(schema)
        done = self._stage("decompose", ((it, None) for it in items),
                           lambda it, _, key: self._request(it, key, self.base_prefix(it), DECOMPOSE_TASK, spec))
        for it, _, out in done:
            parsed = self._json(out)
            if parsed is None:
                it.result.error = "decomposition did not finish within its token budget"
                continue
            self._set_parts(it, parsed["parts"])

    def _set_parts(self, it: _Item, parts: Sequence[dict]) -> list[dict] | None:
        """The item's claims from parts (decomposed or given), links repaired (an item error
        with ``strict``): the parts kept, or None when the item failed."""
        kept, problems = validate_parts(parts)
        if problems and self.strict:
            it.result.error = "invalid decomposition: " + "; ".join(problems)
            return None
        it.result.warnings += problems
        if not kept:
            it.result.error = "the caption yielded no claims"
            return None
        it.claims = [ClaimResult(**{k: p.get(k) for k in ("part_id", "text", "type") + LINK_FIELDS}) for p in kept]
        return kept

    def _propose(self, items: list[_Item]) -> None:
        """Candidate boxes for items without usable ones: the model's grounding output when
        ``propose_boxes``, then the quadrant grid for any still without."""
        if self.propose_boxes:
            spec = Json.from_schema(boxes_schema())
            done = self._stage("propose", ((it, None) for it in items if not it.boxes),
                               lambda it, _, key: self._request(it, key, self.base_prefix(it), PROPOSE_TASK, spec))
            for it, _, out in done:
                parsed = self._json(out) or {"boxes": []}
                rel = [relative_to_pixels(b["bbox_2d"], it.image.width, it.image.height) for b in parsed["boxes"]]
                boxes, _ = check_boxes(rel, it.image.width, it.image.height)
                if len(boxes) < len(rel):
                    it.result.warnings.append(f"{len(rel) - len(boxes)} proposed box(es) had no area; dropped")
                self._set_boxes(it, list(dict.fromkeys(boxes)))
        for it in items:
            if not it.boxes and not it.result.error:
                if self.propose_boxes:
                    it.result.warnings.append("no usable proposed boxes; candidates are the image quadrants")
                self._set_boxes(it, grid_boxes(it.image.width, it.image.height))

    def _select(self, items: list[_Item]) -> None:
        specs: dict[int, Json] = {}  # by candidate count: the schema is built once, not per claim

        def make(it: _Item, c: ClaimResult, key: int) -> Request:
            n = len(it.boxes)
            if n not in specs:
                specs[n] = Json.from_schema(evidence_schema([f"E{i}" for i in range(1, n + 1)]))
            spec = specs[n]
            if self.evidence_layout == "shared":  # the candidates and their crops are in the prefix
                return self._evidence_request(it, key, f"Claim: {c.text}\n{SELECT_TASK}", spec)
            head = prompts.candidates_head(it.image.width, it.image.height)
            task = f"{head}\n{prompts.box_listing(it.boxes)}\nClaim: {c.text}\n{SELECT_TASK}"
            return self._evidence_request(it, key, task, spec)

        for it, c, out in self._stage("select", ((item, c) for item in items for c in item.claims), make):
            parsed = self._json(out)
            if parsed is None:
                it.result.warnings.append(f"{c.part_id}: evidence selection did not finish; no regions used")
            self._set_evidence(it, c, parsed["selected_evidence_ids"] if parsed else ())

    @staticmethod
    def _set_evidence(it: _Item, c: ClaimResult, selected: Iterable[str]) -> None:
        c.evidence_ids = sorted(set(selected), key=lambda e: int(e[1:]))
        c.evidence_boxes = [list(it.boxes[int(e[1:]) - 1]) for e in c.evidence_ids]

    def verification_task(self, item: _Item, claim: ClaimResult) -> prompts.Prompt:
        """The claim's part of its verification prompt. Per-claim layout: the selected regions,
        each with its crop; shared layout: the selected ids (their crops are in the prefix)."""
        if self.evidence_layout == "shared":
            return prompts.verification_task(claim.text, claim.evidence_ids)
        crops = [item.box_images[int(e[1:]) - 1] for e in claim.evidence_ids]
        return prompts.verification_task(claim.text, claim.evidence_ids, claim.evidence_boxes, crops)

    def verification_request(self, item: _Item, claim: ClaimResult, key: int = 0) -> Request:
        """One claim's verification request, with the forced ``{"decision": "`` answer start."""
        return self._evidence_request(item, key, self.verification_task(item, claim), Choice(self.yes_no_ids),
                                      self.decision_prefix)

    def _verify(self, items: list[_Item]) -> None:
        for it, c, out in self._stage("verify", ((item, c) for item in items for c in item.claims),
                                      self.verification_request):
            c.support = float(out.probs[0])
            c.decision = "yes" if c.support >= 0.5 else "no"

    def _explain(self, items: list[_Item]) -> None:
        spec = Json.from_schema(explanation_schema(self.max_explanation_chars))

        def make(it: _Item, target, key: int) -> Request:
            if isinstance(target, ClaimResult):
                c = target
                evidence = ", ".join(f"{e} {b}" for e, b in zip(c.evidence_ids, c.evidence_boxes)) or "none"
                task = (f"Claim: {c.text}\nEvidence regions: {evidence}\nDecision: {c.decision} "
                        f"(support {c.support:.2f})\n{EXPLAIN_CLAIM_TASK}")
                return self._evidence_request(it, key, task, spec)
            listing = "\n".join(f"- {c.part_id} ({c.type or 'claim'}): {c.text} -> {c.decision} "
                                f"(support {c.support:.2f}; "
                                f"evidence {', '.join(c.evidence_ids) or 'none'})" for c in it.claims)
            task = f"Claims and decisions:\n{listing}\nOverall score: {it.result.score:.2f}\n{EXPLAIN_OVERALL_TASK}"
            return self._evidence_request(it, key, task, spec)

        jobs = ((it, t) for it in items for t in it.claims + [it.result])
        for it, target, out in self._stage("explain", jobs, make):
            parsed = self._json(out)
            target.explanation = parsed["explanation"] if parsed else None

    # -- running ----------------------------------------------------------------------------------
    def prepare(self, examples: Iterable[ImageTextExample]) -> tuple[list[_Item], list[VisExResult]]:
        """Examples loaded and checked: items ready for the stages, and results of invalid ones."""
        items, invalid = [], []
        for i, example in enumerate(examples):
            prepared = self._prepare(i, example)
            (invalid if isinstance(prepared, VisExResult) else items).append(prepared)
        return items, invalid

    def stream(self, examples: Iterable[ImageTextExample]) -> Iterator[VisExResult]:
        """Results of ``examples``: invalid items at once, the others when their batch has been
        through every stage (each result has ``.index``)."""
        items, invalid = self.prepare(examples)
        yield from invalid
        run = {"single-response": self._single_response, "holistic-score": self._holistic_score}
        run.get(self.mode, self._pipeline)(items)
        for it in items:
            if it.result.error:  # a stage failed it: no partial claims or score
                it.result.claims, it.result.score, it.result.explanation = [], None, None
            else:
                it.result.claims = it.claims
            yield it.result

    def _pipeline(self, items: list[_Item]) -> None:
        self._decompose([it for it in items if not it.claims])  # given claims replace it
        self._propose(items)
        self._select(items)
        self._verify(items)
        for it in items:
            if not it.result.error:
                it.result.score = aggregate([c.support for c in it.claims], self.aggregate)
        if self.explain:
            self._explain([it for it in items if not it.result.error])
