"""LAVE as its authors' code computes it: ``LaveJudge(model, official_repo=PATH)``.

fastjudge ships none of the authors' text. Their prompts come from the user's checkout of the
authors' repository: ``PATH/lave.py`` is imported by path and run, as a plugin is (point it only
at a checkout you trust), and its ``LaveBase`` builds every prompt, reading the checkout's
demonstration files ``data/lave_demos.json`` and ``data/lave_demos_binary.json`` unless the
judge is given others. That module needs only the Python standard library.

Scoring is the rule of the authors' Flan-T5 scorer (``LaveFT5.batch_compute``, ``lave_ft5.py``):
free greedy generation of up to 100 new tokens; the rating is the one token just before the
first EOS (the last generated token when no EOS comes), decoded on its own; anything but
exactly "1", "2" or "3" is rating 2. An EOS as the very first token leaves the decoder start
token in that place, which is never a rating. The score is ``(rating - 1) / 2``.

:class:`OfficialLave` is this way of prompting and rating behind the one
:class:`~fastjudge.judges.lave.LaveJudge` face (``LaveJudge.style``): it gives prompts, the
request's output spec and the :class:`Rating` of a generation; it knows no result class.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np

from ..runtime.requests import Output, Text, choice_probs

BUILDER_FILE = "lave.py"
BUILDER_CLASS = "LaveBase"
DEMOS_FILE = os.path.join("data", "lave_demos.json")
BINARY_DEMOS_FILE = os.path.join("data", "lave_demos_binary.json")
RATING_TEXTS = ("1", "2", "3")
# The authors filter reference answers at this fraction of the top count; their builder takes
# no other.
AUTHORS_FILTER_P = 0.25
# Their prompt is blocks separated by blank lines, the test example last.
BLOCK_SEPARATOR = "\n\n"


def _load_module(path: Path):
    """Execute ``path`` as a fresh module of its own (not entered in ``sys.modules``: two
    checkouts, or two judges on one, never share module state)."""
    spec = importlib.util.spec_from_file_location("lave_checkout", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_prompt_builder(repo: str | os.PathLike, *, num_shots: int, rationalize: bool,
                        filter_refs: bool, use_caption: bool, filter_p: float = AUTHORS_FILTER_P,
                        demos: str | os.PathLike | None = None,
                        binary_demos: str | os.PathLike | None = None):
    """The authors' prompt builder (their ``LaveBase``) from the checkout at ``repo``, set up
    with these options and demonstration files (default: the checkout's own). ValueError for
    options their builder cannot follow and for a path that is no checkout."""
    if filter_p != AUTHORS_FILTER_P:
        raise ValueError(f"official_repo: the authors' code filters references at "
                         f"{AUTHORS_FILTER_P}; filter_p cannot change it")
    for name, value in (("demos", demos), ("binary_demos", binary_demos)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ValueError(f"official_repo: {name} must be a file path (the authors' code reads "
                             "demonstrations from files)")
    root = Path(repo).expanduser().resolve()
    source = root / BUILDER_FILE
    if not source.is_file():
        raise ValueError(f"{root} is not a checkout of the LAVE authors' repository: "
                         f"{BUILDER_FILE} is missing")
    files = {"demos_file": Path(demos) if demos is not None else root / DEMOS_FILE,
             "binary_demos_file": Path(binary_demos) if binary_demos is not None
             else root / BINARY_DEMOS_FILE}
    for path in files.values():
        if not path.is_file():
            raise ValueError(f"LAVE demonstrations file {path} is missing")
    builder_class = getattr(_load_module(source), BUILDER_CLASS, None)
    if not isinstance(builder_class, type):
        raise ValueError(f"{source} defines no class {BUILDER_CLASS}")
    # keyword arguments by their names in the authors' constructor
    return builder_class(num_shots=num_shots, rationalize=rationalize, filter_refs=filter_refs,
                         use_caption=use_caption, **{k: str(v) for k, v in files.items()})


def split_prompt(prompt: str) -> tuple[str, str]:
    """(task definition and demonstrations, test example): the prompt cut after its last blank
    line. The cut only decides what decoder-only backends may share between prompts; a cut
    inside an example (a question holding a blank line) shares less, never wrongly."""
    cut = prompt.rfind(BLOCK_SEPARATOR)
    cut = 0 if cut < 0 else cut + len(BLOCK_SEPARATOR)
    return prompt[:cut], prompt[cut:]


def rating_token(token_ids: Sequence[int]) -> int | None:
    """The token the authors read the rating from, given a generation without its EOS (as
    backends return it): the last generated token, whether EOS followed it or the length limit
    stopped it. None when EOS came first (the decoder start token sits there)."""
    return int(token_ids[-1]) if len(token_ids) else None


def official_rating(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int | None:
    """1, 2 or 3 when the rating token decodes, on its own, to exactly that digit; None when the
    authors' rule falls back to rating 2."""
    token = rating_token(token_ids)
    if token is None:
        return None
    text = decode([token])
    return int(text) if text in RATING_TEXTS else None


def rating_probs(families: Sequence[tuple[int, ...]], tracked: np.ndarray | None,
                 token_ids: Sequence[int]) -> np.ndarray | None:
    """Distribution over the three rating tokens at the step that produced the rating.

    ``families``: each a (1, 2, 3) triple of token ids a rating may be written with (e.g. a
    word-initial digit and one glued to "="); ``tracked``: the logits of all families'
    ids, concatenated in that order, at every generated step. The family holding the produced
    token is read; None when no family holds it (or nothing was tracked)."""
    token = rating_token(token_ids)
    if token is None or tracked is None or len(tracked) < len(token_ids):
        return None
    step = tracked[len(token_ids) - 1]
    offset = 0
    for family in families:
        if token in family:
            return choice_probs(step[offset: offset + len(family)])
        offset += len(family)
    return None


def tracked_ids(families: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The ids whose logits a generation keeps for :func:`rating_probs`."""
    return tuple(t for family in families for t in family)


class Rating(NamedTuple):
    """A rating as read from a model output: 1-3, the distribution over the three rating
    tokens behind it (None when there is none) and how it was obtained (``rating_source``)."""

    rating: int
    probs: np.ndarray | None
    source: str


class OfficialLave:
    """LAVE prompted and rated by the authors' code: prompts from their ``LaveBase`` in the
    checkout at ``repo`` (:func:`load_prompt_builder`), free greedy generation of up to
    ``max_new_tokens`` tokens, and their rating rule (:func:`official_rating`), whose
    distribution is read from whichever of ``rating_families`` holds the rating token."""

    def __init__(self, repo: str | os.PathLike, codec, *, rationale: bool, num_shots: int,
                 demos, binary_demos, filter_refs: bool, filter_p: float, use_caption: bool,
                 max_new_tokens: int, rating_families: Sequence[tuple[int, ...]]):
        self.builder = load_prompt_builder(
            repo, num_shots=num_shots, rationalize=rationale, filter_refs=filter_refs,
            filter_p=filter_p, use_caption=use_caption, demos=demos, binary_demos=binary_demos)
        self.decode = codec.decode
        self.rating_families = tuple(rating_families)
        self.spec = Text(max_new_tokens, track_ids=tracked_ids(self.rating_families))

    def prompt_parts(self, question: str, answers: list[str], prediction: str,
                     caption: str | None) -> tuple[str, str]:
        return split_prompt(self.builder.build_prompt(prediction, answers, question, caption))

    def read(self, out: Output) -> Rating:
        """The authors' rating of a free generation: rating 2 when theirs falls back."""
        rating = official_rating(out.token_ids, self.decode)
        if rating is None:
            return Rating(2, None, "official-fallback")
        return Rating(rating, rating_probs(self.rating_families, out.tracked_logits, out.token_ids),
                      "parsed")

