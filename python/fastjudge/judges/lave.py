"""LAVE: LLM-assisted VQA evaluation (Mañas et al.).

A judge model rates a candidate answer against human reference answers on a 1-3 scale from
in-context demonstrations; the score is ``(rating - 1) / 2``. This module turns examples into
prompts and requests and outputs into results; it knows no model code.

Modes:

* score-only (default): demonstrations show just the rating; one model step restricted to the
  three rating tokens gives ``probs`` over ratings 1, 2, 3.
* rationale: demonstrations show "<explanation> So rating=<r>"; the model decodes greedily and
  the rating is the last character of its text, as in the paper.

Both modes use fastjudge's own wording and demonstrations, and the authors' data handling:
reference answers as given (no stripping), filtered with their repetitions kept, sorted and
quoted; the yes/no demonstrations when the most common raw reference is yes or no.
``official_repo=PATH`` instead runs the authors' own prompt builder and rating rule from the
user's checkout of their repository (:mod:`.lave_official`).

Over 400 lines: the examples, the demonstrations, fastjudge's own prompting and rating
(:class:`FastjudgeLave`) and the judge that runs it or the authors' (:class:`LaveJudge`) are
one metric's data handling, read together when comparing it with the authors' code.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, replace
from importlib import resources
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..engine_options import EngineOptions
from ..runtime.requests import Choice, Output, Request, Text, choice_probs
from .base import Judge
from .lave_official import OfficialLave, Rating

RATINGS = (1, 2, 3)
RATING_CUE = " So rating="
ON_UNPARSABLE = ("constrain", "official")

TASK_DESCRIPTION = (
    "Definition: You are shown a question about an image, a list of reference answers written "
    "by human annotators, and a candidate answer. Rate how accurate the candidate answer is for "
    "the question, treating the reference answers as the gold standard; an answer worded "
    "differently from the references can still be right. Use a scale of 1 to 3: 1 means the "
    "candidate answer is incorrect or irrelevant, 2 means it is ambiguous or incomplete, and 3 "
    "means it is correct."
)
RATIONALE_INSTRUCTION = " Give the rationale before rating."
BINARY_RULE = (
    "IMPORTANT: A binary question can only be answered with 'yes' or 'no'; any other candidate "
    "answer to a binary question is incorrect."
)


@dataclass
class VQAExample:
    """One item to judge. ``references`` are the human answers, repetitions included (they
    drive the outlier filter); VQA-style ``{"answer": ...}`` objects are accepted too."""

    question: str
    references: Sequence
    prediction: str
    caption: str | None = None
    id: object = None


@dataclass
class LaveResult:
    """One example's LAVE judgment.

    ``index``: the example's position in the input; ``id``: its ``id``. ``rating``: 1, 2 or 3
    (incorrect, ambiguous or incomplete, correct); ``score = (rating - 1) / 2``. ``probs``: the
    distribution over ratings 1, 2, 3 at the step that produced the rating (None when the
    rating was not read from such a step); ``soft_score``: the expected score under ``probs``
    (with fastjudge's prompts, the score itself when there are no ``probs``). ``rationale``:
    the decoded explanation in rationale mode. ``prompt_tokens``: the prompt's length.
    ``error``: why the item was not judged (all judgment fields then None); ``rating_source``:
    how the rating was obtained (below)."""

    index: int
    id: object = None
    score: float | None = None
    soft_score: float | None = None
    rating: int | None = None
    probs: list[float] | None = None
    rationale: str | None = None
    prompt_tokens: int = 0
    error: str | None = None
    # How the rating was obtained: "choice" (score-only step), "parsed" (last character of the
    # rationale; with official_repo, the token before EOS), "constrained" (rationale unparsable:
    # rating cue appended and a constrained step taken), "official-fallback" (unparsable:
    # rating 2, as the LAVE authors' code does).
    rating_source: str | None = None


@dataclass(frozen=True)
class Demonstration:
    question: str
    references: tuple[str, ...]
    prediction: str
    output: str
    explanation: str
    caption: str | None = None

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> "Demonstration":
        if not isinstance(d, dict):
            raise ValueError(f"demonstration {where}: expected a JSON object, got {type(d).__name__}")
        try:
            output = str(d["output"]).strip()
            if output not in ("1", "2", "3"):
                raise ValueError(f"output must be '1', '2' or '3', got {d['output']!r}")
            refs = d["references"]
            if isinstance(refs, str) or not refs:
                raise ValueError("references must be a non-empty list of strings")
            return cls(question=str(d["question"]), references=tuple(str(r) for r in refs),
                       prediction=str(d["prediction"]), output=output,
                       explanation=str(d.get("explanation", "")).strip(), caption=d.get("caption"))
        except KeyError as missing:
            raise ValueError(f"demonstration {where}: missing field {missing}") from None
        except ValueError as bad:
            raise ValueError(f"demonstration {where}: {bad}") from None


def load_demonstrations(source: str | os.PathLike | Iterable | None, default: str) -> list[Demonstration]:
    """Demonstrations from a JSON file (a list of objects with question, references, prediction,
    output, explanation, optional caption), a list of dicts/Demonstrations, or the built-in set
    ``default`` ("general" or "binary")."""
    if source is None:
        text = resources.files("fastjudge.data").joinpath(f"lave_demos_{default}.json").read_text()
        items = json.loads(text)
    elif isinstance(source, (str, os.PathLike)):
        with open(source, encoding="utf-8") as f:
            items = json.load(f)
        if not isinstance(items, list):
            raise ValueError(f"{source}: expected a JSON list of demonstrations")
    else:
        items = list(source)
    return [d if isinstance(d, Demonstration) else Demonstration.from_dict(d, f"#{i}")
            for i, d in enumerate(items)]


def reference_answers(references: Sequence) -> list[str]:
    """Reference answers as given (spacing kept, as the authors' code keeps it); accepts
    strings or VQA-style answer objects."""
    answers = []
    for r in references:
        if isinstance(r, dict):
            r = r.get("answer")
        if not isinstance(r, str):
            raise ValueError(f"reference answers must be strings, got {type(r).__name__}")
        answers.append(r)
    return answers


def filter_references(answers: Sequence[str], p: float = 0.25) -> list[str]:
    """The answers whose count is above ``p`` times the most frequent answer's (annotation
    noise filter from the paper), each repetition kept, sorted: how the authors show them."""
    counts = Counter(answers)
    top = max(counts.values())
    return sorted(a for a in answers if counts[a] > p * top)


def is_binary_question(answers: Sequence[str]) -> bool:
    """Binary when the most common raw reference, lowercased and without trailing periods, is
    yes or no (so " no " is not). Ties go to the answer seen first."""
    most_common = Counter(answers).most_common(1)[0][0]
    return most_common.lower().rstrip(".") in ("yes", "no")


def _quote(answers: Iterable[str]) -> str:
    return ", ".join(f"'{a}'" for a in answers)


class FastjudgeLave:
    """fastjudge's own LAVE prompts (its wording and demonstrations, the authors' data handling)
    and rating reading: one step over the three rating tokens in score-only mode; in rationale
    mode the last character of the rationale, else ``on_unparsable``'s rule."""

    def __init__(self, codec, *, rationale: bool, num_shots: int, demos, binary_demos,
                 filter_refs: bool, filter_p: float, use_caption: bool, max_new_tokens: int,
                 on_unparsable: str, answer_ids: tuple[int, ...], cue_rating_ids: tuple[int, ...]):
        self.codec = codec
        self.rationale, self.filter_refs, self.filter_p = rationale, filter_refs, filter_p
        self.use_caption, self.on_unparsable = use_caption, on_unparsable
        self.cue_rating_ids = cue_rating_ids
        self.cue_ids = codec.response_ids(RATING_CUE)
        self.spec = Text(max_new_tokens, track_ids=cue_rating_ids) if rationale else Choice(answer_ids)
        self.general_demos = load_demonstrations(demos, "general")[:num_shots]
        self.binary_demos = load_demonstrations(binary_demos, "binary")[:num_shots]
        if use_caption:
            for d in self.general_demos + self.binary_demos:
                if not d.caption:
                    raise ValueError("use_caption=True needs a caption in every demonstration")
        self.prefixes = {binary: self._prefix(binary) for binary in (False, True)}

    def _block(self, question: str, refs: Sequence[str], prediction: str, caption: str | None) -> str:
        lines = []
        if self.use_caption:
            lines.append(f"Image description: {caption}")
        lines += [f"Question: {question}", f"Reference answers: {_quote(refs)}",
                  f"Candidate answer: {prediction}", "Output:"]
        return "\n".join(lines)

    def _demo_output(self, d: Demonstration) -> str:
        if self.rationale:
            return f"{d.explanation}{RATING_CUE}{d.output}"
        return d.output

    def _prefix(self, binary: bool) -> str:
        """Task description and demonstrations: the part of every prompt of one question type
        that does not depend on the test example."""
        header = TASK_DESCRIPTION + (RATIONALE_INSTRUCTION if self.rationale else "")
        parts = [header, BINARY_RULE]
        for d in self.binary_demos if binary else self.general_demos:
            parts.append(self._block(d.question, sorted(d.references), d.prediction, d.caption)
                         + " " + self._demo_output(d))
        return "\n\n".join(parts) + "\n\n"

    def prompt_parts(self, question: str, answers: list[str], prediction: str,
                     caption: str | None) -> tuple[str, str]:
        refs = filter_references(answers, self.filter_p) if self.filter_refs else sorted(answers)
        return self.prefixes[is_binary_question(answers)], self._block(question, refs, prediction, caption)

    def read(self, out: Output) -> Rating | None:
        """The rating of a rationale; None when it has none and a constrained step should
        follow (:meth:`followup`)."""
        last = self.codec.decode(out.token_ids).rstrip()[-1:]
        if last in ("1", "2", "3"):
            probs = None
            if out.token_ids and out.token_ids[-1] in self.cue_rating_ids and out.tracked_logits is not None:
                probs = choice_probs(out.tracked_logits[-1])
            return Rating(int(last), probs, "parsed")
        if self.on_unparsable == "official":
            return Rating(2, None, "official-fallback")
        return None

    def followup(self, out: Output, request: Request) -> Request:
        """The rationale, the rating cue, and one step restricted to the three ratings."""
        return replace(request, spec=Choice(self.cue_rating_ids),
                       response_prefix=tuple(out.token_ids) + tuple(self.cue_ids))


class LaveJudge(Judge):
    """Rates VQA answers with LAVE. See the module docstring for the two modes.

    ``model`` is a local Hugging Face checkpoint directory, opened as ``engine``
    (:class:`~fastjudge.engine_options.EngineOptions`) says, or an already opened backend, to
    share one model between judges. The other arguments are the metric's.

    ``official_repo``: a checkout of the LAVE authors' repository, whose ``lave.py`` is run
    (as a plugin is) to build every prompt, with their demonstration files unless ``demos`` /
    ``binary_demos`` name others; ``rationale`` then defaults to on, ``filter_p`` must stay at
    their 0.25, and ratings follow their rule (free generation; the token before EOS; rating 2
    when it is not a digit 1-3), whatever ``on_unparsable`` says. ``probs`` / ``soft_score``
    are then the distribution over the rating tokens at the step that produced the rating, or
    null when no rating token was produced. The two ways of prompting and rating are two
    objects behind this one judge: :class:`FastjudgeLave` and
    :class:`~fastjudge.judges.lave_official.OfficialLave` (``self.style``).

    Prompt-length policy: a prompt longer than the backend's ``max_input_tokens`` is never
    truncated (truncation would cut the test example or silently change the demonstrations);
    the item gets an ``error`` naming its length and the limit, and the job goes on.
    """

    def __init__(self, model, rationale: bool | None = None, num_shots: int = 8, demos=None,
                 binary_demos=None, filter_refs: bool = True, filter_p: float = 0.25,
                 use_caption: bool = False, max_new_tokens: int = 100,
                 on_unparsable: str = "constrain", official_repo: str | os.PathLike | None = None,
                 *, engine: EngineOptions | None = None):
        if on_unparsable not in ON_UNPARSABLE:
            raise ValueError(f"on_unparsable must be one of {ON_UNPARSABLE}, got {on_unparsable!r}")
        if num_shots < 0:
            raise ValueError("num_shots must be >= 0")
        if not 0 <= filter_p < 1:
            raise ValueError("filter_p must be in [0, 1)")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self._open(model, engine)
        # off by default; on by default with the authors' code, as in their code
        self.rationale = (official_repo is not None) if rationale is None else bool(rationale)
        self.num_shots = num_shots
        self.filter_refs = filter_refs
        self.filter_p = filter_p
        self.use_caption = use_caption
        self.max_new_tokens = max_new_tokens
        self.on_unparsable = on_unparsable
        self._answer_ids = self._rating_ids("")
        self._cue_rating_ids = self._rating_ids(RATING_CUE)
        shared = dict(rationale=self.rationale, num_shots=num_shots, demos=demos,
                      binary_demos=binary_demos, filter_refs=filter_refs, filter_p=filter_p,
                      use_caption=use_caption, max_new_tokens=max_new_tokens)
        if official_repo is not None:
            # a rating may be written word-initial or glued to "=": read the one produced
            families = tuple(dict.fromkeys((self._answer_ids, self._cue_rating_ids)))
            self.style = OfficialLave(official_repo, self.codec, rating_families=families, **shared)
        else:
            self.style = FastjudgeLave(self.codec, on_unparsable=on_unparsable,
                                       answer_ids=self._answer_ids,
                                       cue_rating_ids=self._cue_rating_ids, **shared)

    @property
    def general_demos(self) -> list[Demonstration]:
        """fastjudge's general-question demonstrations (not with ``official_repo``)."""
        return self.style.general_demos

    @property
    def binary_demos(self) -> list[Demonstration]:
        """fastjudge's yes/no-question demonstrations (not with ``official_repo``)."""
        return self.style.binary_demos

    # -- prompt ----------------------------------------------------------------------------------
    def _answers(self, example: VQAExample) -> list[str]:
        """The validated reference answers, as given; ValueError names what is wrong."""
        if not isinstance(example.question, str) or not example.question.strip():
            raise ValueError("question must be a non-empty string")
        if not isinstance(example.prediction, str):
            raise ValueError(f"prediction must be a string, got {type(example.prediction).__name__}")
        if isinstance(example.references, (str, bytes)) or not isinstance(example.references, Sequence):
            raise ValueError("references must be a list of answers")
        answers = reference_answers(example.references)
        if not any(a.strip() for a in answers):
            raise ValueError("references are empty")
        if self.use_caption and not (isinstance(example.caption, str) and example.caption.strip()):
            raise ValueError("use_caption=True but the example has no caption")
        return answers

    def _prompt_parts(self, example: VQAExample) -> tuple[str, str]:
        """(shared prefix, example-specific rest) of the prompt text. Question and prediction
        as given; the caption stripped (what the authors' code does)."""
        answers = self._answers(example)
        caption = example.caption.strip() if self.use_caption else None
        return self.style.prompt_parts(example.question, answers, example.prediction, caption)

    def build_prompt(self, example: VQAExample) -> str:
        """The judge's prompt text for ``example`` (decoder-only backends wrap it in the
        checkpoint's chat template)."""
        return "".join(self._prompt_parts(example))

    # -- rating tokens -----------------------------------------------------------------------------
    def _rating_ids(self, context: str) -> tuple[int, ...]:
        """Token id of each rating as the model would write it right after ``context`` in its
        response. Fails loudly where a rating would not be a single token there."""
        return self.codec.answer_ids([str(r) for r in RATINGS], after=context, single_token=True).ids

    @property
    def rating_token_ids(self) -> tuple[int, ...]:
        """The three token ids read for ratings 1, 2, 3: at the start of the response in
        score-only mode, after the rating cue in rationale mode."""
        return self._cue_rating_ids if self.rationale else self._answer_ids

    # -- running -----------------------------------------------------------------------------------
    def _request(self, index: int, example: VQAExample) -> tuple[Request | None, LaveResult]:
        result = LaveResult(index=index, id=getattr(example, "id", None))
        try:
            prefix, rest = self._prompt_parts(example)
            # an item's text too long to fit is refused before tokenizing, at a cost independent
            # of its size (a prompt merely over the limit gets its token count below)
            self.codec.check_text_length(rest, self.backend.max_input_tokens)
            encoded = self.codec.encode(prefix, rest)
        except (ValueError, TypeError, AttributeError) as bad:
            result.error = f"invalid example: {bad}"
            return None, result
        result.prompt_tokens = len(encoded.ids)
        if len(encoded.ids) > self.backend.max_input_tokens:
            result.error = (f"prompt is {len(encoded.ids)} tokens, above the model limit of "
                            f"{self.backend.max_input_tokens}; not truncated (use fewer shots, "
                            "shorter references, or raise max_input_tokens)")
            return None, result
        # the demonstrations are every item's prefix, in this call and the next: keep them cached
        return encoded.request(index, self.style.spec, keep_prefix=True), result

    def _set_rating(self, result: LaveResult, rating: Rating) -> None:
        result.rating = rating.rating
        result.score = (rating.rating - 1) / 2
        result.rating_source = rating.source
        if rating.probs is not None:
            result.probs = [float(p) for p in rating.probs]
            result.soft_score = float(np.dot(rating.probs, [0.0, 0.5, 1.0]))
        elif isinstance(self.style, FastjudgeLave):
            # fastjudge's rule: a rating without a distribution is its own soft score; the
            # authors' code gives none
            result.soft_score = result.score

    def stream(self, examples: Iterable[VQAExample]) -> Iterator[LaveResult]:
        """Results as soon as their batch finishes (not in input order; each has ``.index``).
        Invalid items come first, with ``error`` set."""
        requests, results = [], {}
        for i, example in enumerate(examples):
            request, result = self._request(i, example)
            if request is None:
                yield result
            else:
                requests.append(request)
                results[i] = result
        by_index = {r.index: r for r in requests}
        followups = []
        for outputs in self._run(requests):
            for out in outputs:
                result = results[out.index]
                if out.probs is not None:  # score-only
                    self._set_rating(result, _chosen(out, "choice"))
                    yield result
                    continue
                if self.rationale:
                    result.rationale = self.codec.decode(out.token_ids)
                rating = self.style.read(out)
                if rating is None:
                    followups.append(self.style.followup(out, by_index[out.index]))
                    continue
                self._set_rating(result, rating)
                yield result
        for outputs in self._run(followups):
            for out in outputs:
                result = results[out.index]
                self._set_rating(result, _chosen(out, "constrained"))
                yield result

    def _run(self, requests: Sequence[Request]) -> Iterator[list[Output]]:
        return self.engine.run(requests)


def _chosen(out: Output, source: str) -> Rating:
    """The most probable rating of a step restricted to the three rating tokens."""
    return Rating(RATINGS[int(np.argmax(out.probs))], out.probs, source)
