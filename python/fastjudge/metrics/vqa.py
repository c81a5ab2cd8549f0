"""VQA Accuracy and exact match, computed as the official VQA evaluation script does.

Reference: ``vqaEval.py`` of the VQA API (github.com/GT-Vision-Lab/VQA,
``PythonEvaluationTools/vqaEvaluation/vqaEval.py``, master at commit a013f00, "Fixed processing
answers bug", 2021 -- the version used for VQA v2 evaluation). Its rules, all reproduced here:

1. Every answer (prediction and references) has ``'\\n'`` and ``'\\t'`` replaced by a space and is
   ``strip()``-ed.
2. Only when the stripped references hold **more than one distinct string**
   (``if len(set(gtAnswers)) > 1``, case- and punctuation-sensitive) are the references *and the
   prediction* normalized (punctuation, then digits/articles/contractions). When all references
   are the same string nothing is normalized: ``"Yes"`` against ten ``"yes"`` scores 0.
3. Punctuation (``processPunctuation``): for each of ``; / [ ] " { } ( ) = + \\ _ - > < @ ` , ? !``
   (not ``'``, ``:`` or ``.``), the character is deleted when it is followed or preceded by a
   space in the *original* text, or when the original text contains a comma between two digits
   (``commaStrip``); otherwise it becomes a space. Then periods not followed by a digit are
   deleted (``periodStrip``; its pattern ``(?!<=\\d)`` is a look-*ahead* typo, so a period after a
   digit is deleted too: ``"5."`` -> ``"5"``, ``"2.5"`` kept) -- at most 32 of them, because the
   script passes ``re.UNICODE`` (= 32) as ``sub``'s ``count``. ``\\d`` is ASCII-only, as in the
   Python 2 script.
4. Digits/articles (``processDigitArticle``): lowercase, split on whitespace, map number words
   (``none``/``zero`` -> ``0``, ``one``..``ten`` -> ``1``..``10``), drop ``a``/``an``/``the``,
   expand the contractions map (``dont`` -> ``don't``, ...; its capitalized keys such as ``Im``
   can never match a lowercased word, and ``somebody'd`` maps to ``somebodyd``, both as in the
   script), join with single spaces.
5. Accuracy: for each annotator ``i``, ``min(1, #{other annotators whose answer equals the
   prediction} / 3)``; the item's accuracy is the mean over annotators, summed in annotator
   order as the script does (so results are bit-identical to it). With ``k`` matching answers
   among 10 that is 0, 0.3, 0.6, 0.9, 1.0 for ``k`` = 0, 1, 2, 3, >= 4.

6. Rounding (``setEvalQA``, ``setAccuracy``): the script reports each question's accuracy as
   ``round(100 * acc, 2)`` (a percent with two decimals) and the overall accuracy as
   ``round(100 * float(sum(accs)) / len(accs), 2)``, the sum taken over the *unrounded* per-question
   accuracies in question order. The script is Python 2.7 code, whose ``round`` is correctly
   rounded from the exact binary value with exact ties going away from zero (Python 3's goes to
   even: ``round(0.125, 2)`` is 0.13 there, 0.12 here). ``vqa_accuracy_many(...,
   official_rounding=True)`` returns the per-question figures, :func:`vqa_overall_accuracy` the
   overall one, :func:`official_round` is the rounding.

Each reference is one annotator. (The script removes "the same" answer by comparing answer
dicts, which carry a unique ``answer_id`` in the VQA annotations, so exactly one answer is left
out; answers given here as plain strings are left out one at a time the same way.)

Fewer than 10 references: the same leave-one-out mean over however many there are (``n``
references, ``k`` matches: ``(k * min(1, (k - 1) / 3) + (n - k) * min(1, k / 3)) / n``) -- what
the script computes for any ``n``. A **single reference** leaves no other annotator, so the
script gives 0.0 to every answer; ``single_reference`` picks what is returned instead:

* ``"vqa"`` (default): ``min(1, matches / 3)`` against that reference, i.e. the VQA paper's
  ``min(#humans that said ans / 3, 1)`` without leave-one-out: 1/3 for a match, else 0.
* ``"official"``: 0.0, exactly what ``vqaEval.py`` outputs.
* ``"exact"``: 1.0 for a match, else 0.0.

``normalize``: ``"official"`` (rule 2), ``"always"`` (normalize references and prediction
whatever the references are; fixes the ``"Yes"`` vs ``"yes"`` case), ``"none"`` (rule 1 only).

Over 400 lines: one transcription of the script (its tables, normalization, accuracy and
rounding), kept in one file to be read side by side with it, and the ``fastjudge vqa-acc`` job
that applies it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from functools import lru_cache
from typing import Iterable, Iterator, NamedTuple, Sequence

__all__ = ["normalize_answer", "process_punctuation", "process_digit_article", "vqa_accuracy",
           "vqa_accuracy_many", "vqa_overall_accuracy", "official_round", "exact_match",
           "vqa_scores", "clear_caches", "run_vqa_acc", "NORMALIZE_MODES", "SINGLE_REFERENCE_MODES"]

NORMALIZE_MODES = ("official", "always", "none")
SINGLE_REFERENCE_MODES = ("vqa", "official", "exact")

# --- the official script's tables (vqaEval.py, master) ----------------------------------------
_PUNCT = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@",
          "`", ",", "?", "!")
_PUNCT_CHARS = frozenset(_PUNCT)
_COMMA_STRIP = re.compile(r"(\d)(,)(\d)", re.ASCII)
# Verbatim pattern of the script, typo included: "(?!<=\d)" is a negative look-ahead for the
# text "<=digit", which never follows a "." at that position, so it is a no-op.
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)", re.ASCII)
_PERIOD_STRIP_COUNT = int(re.UNICODE)  # 32: the script passes re.UNICODE as sub()'s count

_MANUAL_MAP = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4",
               "five": "5", "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = frozenset(("a", "an", "the"))
# key value pairs, whitespace-separated
_CONTRACTION_PAIRS = """
aint ain't  arent aren't  cant can't  couldve could've  couldnt couldn't
couldn'tve couldn't've  couldnt've couldn't've  didnt didn't  doesnt doesn't  dont don't
hadnt hadn't  hadnt've hadn't've  hadn'tve hadn't've  hasnt hasn't  havent haven't  hed he'd
hed've he'd've  he'dve he'd've  hes he's  howd how'd  howll how'll  hows how's  Id've I'd've
I'dve I'd've  Im I'm  Ive I've  isnt isn't  itd it'd  itd've it'd've  it'dve it'd've
itll it'll  let's let's  maam ma'am  mightnt mightn't  mightnt've mightn't've
mightn'tve mightn't've  mightve might've  mustnt mustn't  mustve must've  neednt needn't
notve not've  oclock o'clock  oughtnt oughtn't  ow's'at 'ow's'at  'ows'at 'ow's'at
'ow'sat 'ow's'at  shant shan't  shed've she'd've  she'dve she'd've  she's she's
shouldve should've  shouldnt shouldn't  shouldnt've shouldn't've  shouldn'tve shouldn't've
somebody'd somebodyd  somebodyd've somebody'd've  somebody'dve somebody'd've
somebodyll somebody'll  somebodys somebody's  someoned someone'd  someoned've someone'd've
someone'dve someone'd've  someonell someone'll  someones someone's  somethingd something'd
somethingd've something'd've  something'dve something'd've  somethingll something'll
thats that's  thered there'd  thered've there'd've  there'dve there'd've  therere there're
theres there's  theyd they'd  theyd've they'd've  they'dve they'd've  theyll they'll
theyre they're  theyve they've  twas 'twas  wasnt wasn't  wed've we'd've  we'dve we'd've
weve we've  werent weren't  whatll what'll  whatre what're  whats what's  whatve what've
whens when's  whered where'd  wheres where's  whereve where've  whod who'd  whod've who'd've
who'dve who'd've  wholl who'll  whos who's  whove who've  whyll why'll  whyre why're
whys why's  wont won't  wouldve would've  wouldnt wouldn't  wouldnt've wouldn't've
wouldn'tve wouldn't've  yall y'all  yall'll y'all'll  y'allll y'all'll  yall'd've y'all'd've
y'alld've y'all'd've  y'all'dve y'all'd've  youd you'd  youd've you'd've  you'dve you'd've
youll you'll  youre you're  youve you've
"""
_CONTRACTIONS = dict(zip(*[iter(_CONTRACTION_PAIRS.split())] * 2))

_CACHE_SIZE = 1 << 20


def process_punctuation(text: str) -> str:
    """``processPunctuation`` of the official script (see the module docstring, rule 3)."""
    out = text
    if not _PUNCT_CHARS.isdisjoint(text):
        digit_comma = _COMMA_STRIP.search(text) is not None
        for p in _PUNCT:
            if p not in out:
                continue  # replacing an absent character changes nothing
            if digit_comma or (p + " ") in text or (" " + p) in text:
                out = out.replace(p, "")
            else:
                out = out.replace(p, " ")
    if "." in out:
        out = _PERIOD_STRIP.sub("", out, count=_PERIOD_STRIP_COUNT)
    return out


def process_digit_article(text: str) -> str:
    """``processDigitArticle`` of the official script (rule 4)."""
    words = []
    for word in text.lower().split():
        word = _MANUAL_MAP.get(word, word)
        if word not in _ARTICLES:
            words.append(_CONTRACTIONS.get(word, word))
    return " ".join(words)


# Caches of the cleaned form of each raw answer string and the normalized form of each cleaned
# one: VQA answers repeat a lot, so most items need only dictionary look-ups. Each holds at most
# _CACHE_SIZE entries (cleared when full).
_CLEANED: dict[str, str] = {}
_NORMALIZED: dict[str, str] = {}


def clear_caches() -> None:
    """Empty the answer caches (they only ever speed things up)."""
    _CLEANED.clear()
    _NORMALIZED.clear()


def _clean(text: str) -> str:
    out = _CLEANED.get(text)
    if out is None:
        if type(text) is not str:
            raise ValueError(f"answers must be strings, got {type(text).__name__}")
        out = text.replace("\n", " ").replace("\t", " ").strip()
        if len(_CLEANED) >= _CACHE_SIZE:
            _CLEANED.clear()
        _CLEANED[text] = out
    return out


def _normalize_clean(text: str) -> str:
    out = _NORMALIZED.get(text)
    if out is None:
        out = process_digit_article(process_punctuation(text))
        if len(_NORMALIZED) >= _CACHE_SIZE:
            _NORMALIZED.clear()
        _NORMALIZED[text] = out
    return out


def _normalize_all(refs: list) -> list:
    try:
        return list(map(_NORMALIZED.__getitem__, refs))
    except KeyError:
        return list(map(_normalize_clean, refs))


def normalize_answer(text: str) -> str:
    """The full normalization the official script applies to an answer: whitespace cleanup,
    punctuation, digits/articles/contractions. (Applied by :func:`vqa_accuracy` only under the
    conditions of ``normalize``.)"""
    return _normalize_clean(_clean(text))


def _answers(references) -> list:
    """Raw reference strings from strings or VQA-style ``{"answer": ...}`` objects."""
    if isinstance(references, (str, bytes)) or not isinstance(references, (list, tuple)):
        raise ValueError("references must be a list of strings or of {'answer': ...} objects")
    out = []
    for r in references:
        if type(r) is not str:
            if isinstance(r, dict):
                r = r.get("answer")
            if not isinstance(r, str):
                raise ValueError(f"reference answers must be strings, got {type(r).__name__}")
        out.append(r)
    if not out:
        raise ValueError("references are empty")
    return out


def _clean_refs(references) -> list:
    """Cleaned reference strings (rule 1). Lists of already seen strings are pure look-ups;
    anything else goes through :func:`_answers`, which accepts answer dicts and raises for the
    rest."""
    if type(references) is list or type(references) is tuple:
        try:
            refs = list(map(_CLEANED.__getitem__, references))
        except (KeyError, TypeError):  # unseen strings, or dicts (unhashable)
            refs = list(map(_clean, _answers(references)))
    else:
        refs = list(map(_clean, _answers(references)))
    if not refs:
        raise ValueError("references are empty")
    return refs


@lru_cache(maxsize=4096)
def _ordered_mean(n: int, positions: tuple[int, ...]) -> float:
    """Mean over annotators summed in annotator order, as the script does: matching annotators
    (``positions``) see ``k - 1`` other matches, the others ``k``."""
    k = len(positions)
    total = 0
    for i in range(n):
        total += min(1, float(k - (i in positions)) / 3)
    return float(total) / n


def _loo_accuracy(pred: str, refs: list, single_reference: str) -> float:
    n = len(refs)
    k = refs.count(pred)
    if n == 1:
        if single_reference == "vqa":
            return min(1.0, k / 3.0)
        if single_reference == "exact":
            return float(k)
        return 0.0
    if k == 0:
        return 0.0
    if k >= 4:
        return 1.0
    if k == 1:  # the matching annotator adds 0.0; the sum of n-1 thirds is order-free
        return _ordered_mean(n, (0,))
    # k = 2 or 3: the float sum depends on where the matches are (last bit); follow the script
    return _ordered_mean(n, tuple(i for i, r in enumerate(refs) if r == pred))


def _check_modes(normalize: str, single_reference: str = "vqa") -> None:
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")
    if single_reference not in SINGLE_REFERENCE_MODES:
        raise ValueError(f"single_reference must be one of {SINGLE_REFERENCE_MODES}, "
                         f"got {single_reference!r}")


def _prepare(prediction, references, normalize: str) -> tuple[str, list]:
    if not isinstance(prediction, str):
        raise ValueError(f"prediction must be a string, got {type(prediction).__name__}")
    refs = _clean_refs(references)
    pred = _clean(prediction)
    if normalize == "always" or (normalize == "official" and refs.count(refs[0]) != len(refs)):
        refs = _normalize_all(refs)
        pred = _normalize_clean(pred)
    return pred, refs


def vqa_accuracy(prediction: str, references: Sequence, normalize: str = "official",
                 single_reference: str = "vqa") -> float:
    """VQA Accuracy of ``prediction`` against the human ``references`` (strings or VQA-style
    ``{"answer": ...}`` objects, repetitions included: each is one annotator), as ``vqaEval.py``
    computes it. See the module docstring for the rules, ``normalize`` and ``single_reference``.
    Raises ``ValueError`` for empty references or non-string answers."""
    _check_modes(normalize, single_reference)
    pred, refs = _prepare(prediction, references, normalize)
    return _loo_accuracy(pred, refs, single_reference)


def exact_match(prediction: str, references: Sequence, normalize: str = "always") -> float:
    """1.0 when the prediction equals at least one reference, else 0.0. Answers are compared
    after the official normalization (``normalize="always"``, default), under the official
    script's condition (``"official"``), or only whitespace-cleaned (``"none"``)."""
    _check_modes(normalize)
    pred, refs = _prepare(prediction, references, normalize)
    return 1.0 if pred in refs else 0.0


def vqa_scores(prediction: str, references: Sequence, normalize: str = "official",
               single_reference: str = "vqa") -> tuple[float, float]:
    """``(vqa_accuracy, exact_match)`` in one pass (exact match always normalized)."""
    _check_modes(normalize, single_reference)
    if not isinstance(prediction, str):
        raise ValueError(f"prediction must be a string, got {type(prediction).__name__}")
    raw = _clean_refs(references)
    pred = _clean(prediction)
    npred = _normalize_clean(pred)
    nrefs = _normalize_all(raw)
    if normalize == "always" or (normalize == "official" and raw.count(raw[0]) != len(raw)):
        acc = _loo_accuracy(npred, nrefs, single_reference)
    else:
        acc = _loo_accuracy(pred, raw, single_reference)
    return acc, (1.0 if npred in nrefs else 0.0)


def vqa_accuracy_many(predictions: Iterable[str], references: Iterable[Sequence],
                      normalize: str = "official", single_reference: str = "vqa",
                      official_rounding: bool = False) -> list[float]:
    """:func:`vqa_accuracy` over parallel sequences, the fast path for large jobs (same values;
    the cleaned and normalized form of each distinct answer string is computed once).

    ``official_rounding``: each value as the script reports it per question (``evalQA``): a
    percent rounded to two decimals, ``official_round(100 * acc)`` (``2 / 3`` -> ``66.67``). Their
    mean is not the script's overall accuracy, which rounds once at the end: pass the unrounded
    values to :func:`vqa_overall_accuracy`."""
    _check_modes(normalize, single_reference)
    clean, norm, norm_all, clean_refs = _clean, _normalize_clean, _normalize_all, _clean_refs
    official, always = normalize == "official", normalize == "always"
    out = []
    append = out.append
    for prediction, refs in zip(predictions, references, strict=True):
        if type(prediction) is not str:
            raise ValueError(f"prediction must be a string, got {type(prediction).__name__}")
        refs = clean_refs(refs)
        n = len(refs)
        pred = clean(prediction)
        # equal cleaned strings are the same cached object, so count() mostly compares pointers
        if always or (official and refs.count(refs[0]) != n):
            refs = norm_all(refs)
            pred = norm(pred)
        k = refs.count(pred)
        if n == 1 or k == 1 or 2 <= k <= 3:
            append(_loo_accuracy(pred, refs, single_reference))
        else:
            append(0.0 if k == 0 else 1.0)
    if official_rounding:
        return [official_round(100 * acc) for acc in out]
    return out


# --- the script's rounding --------------------------------------------------------------------
_HUNDREDTH = Decimal("0.01")


def official_round(x: float) -> float:
    """``round(x, 2)`` as the script's Python 2.7 computes it: to the nearest hundredth of the
    exact binary value of ``x``, an exact tie away from zero (``Decimal(x)`` is exact, and its
    ``ROUND_HALF_UP`` is half away from zero)."""
    return float(Decimal(x).quantize(_HUNDREDTH, rounding=ROUND_HALF_UP))


@dataclass
class _Overall:
    """``setAccuracy``'s overall figure, item by item: the unrounded accuracies summed in order
    (a plain left-to-right sum, as Python 2's ``sum()``: no compensation), rounded once."""

    total: float = 0.0
    count: int = 0

    def add(self, accuracy: float) -> None:
        self.total += accuracy
        self.count += 1

    def percent(self) -> float | None:
        return official_round(100 * float(self.total) / self.count) if self.count else None


def vqa_overall_accuracy(accuracies: Iterable[float]) -> float:
    """The script's overall accuracy (``setAccuracy``): the unrounded per-question accuracies
    (fractions, e.g. from :func:`vqa_accuracy_many`) summed in order, as a percent rounded to
    two decimals. Raises ``ValueError`` when there are none."""
    overall = _Overall()
    for accuracy in accuracies:
        overall.add(accuracy)
    if not overall.count:
        raise ValueError("no accuracies to average")
    return overall.percent()


# --- the ``fastjudge vqa-acc`` command --------------------------------------------------------
VQA_RESULT_FIELDS = ("vqa_accuracy", "exact_match", "error")


class VqaScore(NamedTuple):
    index: int
    vqa_accuracy: float | None
    exact_match: float | None
    error: str | None


@dataclass(frozen=True)
class VqaAccJob:
    """``fastjudge vqa-acc`` for the shared file-job loop (:func:`fastjudge.io.jobs.run_job`):
    the rows' result fields, and a scorer with a judge's ``stream`` (results in input order)."""

    normalize: str = "official"
    single_reference: str = "vqa"
    # the script's overall accuracy of the items scored so far
    overall: _Overall = field(default_factory=_Overall, compare=False)
    result_fields = VQA_RESULT_FIELDS
    result_types = {"vqa_accuracy": "float", "exact_match": "float", "error": "str"}
    means = {"vqa_accuracy": "mean VQA accuracy", "exact_match": "mean exact match"}

    def __post_init__(self):
        _check_modes(self.normalize, self.single_reference)

    def example(self, item: dict, ident) -> dict:
        return item

    def fields_of(self, score: VqaScore) -> dict:
        return {"vqa_accuracy": score.vqa_accuracy, "exact_match": score.exact_match,
                "error": score.error}

    def stream(self, items: Iterable[dict]) -> Iterator[VqaScore]:
        for i, item in enumerate(items):
            try:
                acc, em = vqa_scores(item.get("prediction"), item.get("references"),
                                     self.normalize, self.single_reference)
            except ValueError as bad:
                yield VqaScore(i, None, None, f"invalid item: {bad}")
                continue
            self.overall.add(acc)
            yield VqaScore(i, acc, em, None)


# Items per chunk of the job: cheap to score, so only the memory held at once matters.
VQA_CHUNK_SIZE = 64


def run_vqa_acc(args) -> int:
    """``fastjudge vqa-acc``: the ``fastjudge lave`` input layout in, the input fields plus
    ``vqa_accuracy``, ``exact_match``, ``error`` out; resumable by id; summary on stderr, with
    the script's overall accuracy of the items scored in this run. The input is read as the job
    goes (no torch, no model)."""
    from ..io.jobs import EXIT_ITEM_ERRORS, EXIT_OK, job_options, run_job

    job = VqaAccJob(args.normalize, args.single_reference)
    code = run_job("vqa-acc", job, lambda: job, args.input, args.output,
                   chunk_size=VQA_CHUNK_SIZE, progress=not args.no_progress, stream=True,
                   **job_options(args))
    overall = job.overall.percent()
    if code in (EXIT_OK, EXIT_ITEM_ERRORS) and overall is not None:
        print(f"fastjudge vqa-acc overall accuracy (vqaEval.py rounding): {overall:.2f} "
              f"over the {job.overall.count} items scored in this run", file=sys.stderr)
    return code
