"""The judges the commands know by name, each declared once.

A :class:`JudgeSpec` says how to build its judge (the judge's constructor options, each an
:class:`Option`: keyword argument, type, default, help, choices), how to turn one input item
into an example (strictly for HTTP requests, as given for file rows) and which result fields
its output rows carry. ``fastjudge lave``, ``visexmem``, ``demo``, ``serve`` and ``rescore``
derive their command-line options and the judge they build from these declarations, so a new
judge option is one :class:`Option` here. The engine's options (backend, device, dtype,
batching, ...) are declared once in :class:`fastjudge.engine_options.EngineOptions`; their flags
(:data:`ENGINE_OPTIONS`) are generated from it and every factory passes the judge one
``engine=`` object. A new judge is one :func:`register_judge` call.

This module imports nothing heavy; the factories import their judge when called.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..engine_options import EngineOptions, engine_fields
from . import items
from .items import ItemError

__all__ = ["Option", "ItemError", "JudgeSpec", "JUDGES", "register_judge", "get_judge",
           "add_options", "add_judge_options", "option_values", "engine_options", "ENGINE_OPTIONS",
           "LAVE_OPTIONS",
           "VISEXMEM_OPTIONS", "IMAGE_TEXT_OPTIONS", "HOLISTIC_OPTIONS", "LAVE_RESULT_FIELDS"]


@dataclass(frozen=True)
class Option:
    """One keyword argument of a judge's constructor and its command-line flag.

    The flag is ``--name-with-dashes``, or ``flag`` when given; a ``bool`` option is a switch
    that sets the opposite of its default (``--no-name`` when the default is true), or, with
    default None (the judge decides), the pair ``--name`` / ``--no-name``. ``help`` may refer
    to the default as ``%(default)s``."""

    name: str
    type: type = str
    default: Any = None
    help: str | None = None
    choices: tuple | None = None
    flag: str | None = None

    @property
    def option_string(self) -> str:
        if self.flag:
            return self.flag
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.type is bool and self.default else f"--{dashed}"

    def add_to(self, parser) -> None:
        if self.type is bool and self.default is None:
            parser.add_argument(self.option_string, dest=self.name, default=None,
                                action=argparse.BooleanOptionalAction, help=self.help)
        elif self.type is bool:
            parser.add_argument(self.option_string, dest=self.name, default=self.default,
                                action="store_false" if self.default else "store_true",
                                help=self.help)
        else:
            parser.add_argument(self.option_string, dest=self.name, type=self.type,
                                default=self.default, choices=self.choices, help=self.help)


def add_options(parser, options: Iterable[Option], seen: set[str] | None = None) -> None:
    """Add ``options`` to an argparse parser (or group), skipping the names in ``seen`` (which
    collects the names added)."""
    seen = set() if seen is None else seen
    for option in options:
        if option.name not in seen:
            option.add_to(parser)
            seen.add(option.name)


def option_values(args, options: Iterable[Option]) -> dict:
    """Constructor keyword arguments from parsed arguments; an option the command does not
    define keeps its declared default."""
    return {o.name: getattr(args, o.name, o.default) for o in options}


@dataclass(frozen=True)
class JudgeSpec:
    """How to build and feed one judge.

    * ``factory(args)``: the judge, from parsed command-line arguments (``args.model``, the
      engine's options, :data:`ENGINE_OPTIONS`, and the judge's). The judge has
      ``stream(examples)`` yielding results with ``index``
      (into ``examples``), ``error`` and the result fields.
    * ``parse_item(obj, where)``: one JSON item of an HTTP request -> example; raises
      :class:`ItemError` naming ``where`` and what is wrong.
    * ``from_row(item, id)``: one input row (dict) of a file job -> example. Defaults to
      ``parse_item`` on the row with its resolved id; a raised error becomes an error row.
    * ``result_fields``: fields each output row gets from a result (``error`` included);
      ``result_types`` their column types for Parquet output ("float", "int", "str",
      "bool", "list[float]"; any other field is stored as JSON text).
    * ``means``: numeric result fields whose mean the job summary prints, with labels.
    * ``result_row(result)``: the result fields of one result as a dict (default: the
      attributes named in ``result_fields``).
    * ``options``: the judge's own constructor options (the metric's; the engine's are
      :data:`ENGINE_OPTIONS`), offered by every command that builds it.
    * ``add_args(parser)``: further options of a judge registered with its own factory (an
      option that another judge already defines is kept as that judge defined it).
    * ``item_model``: the pydantic model of one HTTP item (its ``example()`` gives the judge's
      example); the server validates score requests with it and documents it in its OpenAPI
      document. Without one, items are JSON objects read by ``parse_item``.

    With ``fastjudge rescore --ray`` the factory runs in every Ray actor, on the driver's
    parsed arguments (``args.input`` made absolute), and the examples are pickled to them.
    """

    name: str
    factory: Callable[[Any], Any]
    parse_item: Callable[[Any, str], Any]
    from_row: Callable[[dict, Any], Any] | None = None
    result_fields: tuple[str, ...] = ("score", "error")
    result_types: dict[str, str] = field(default_factory=lambda: {"score": "float",
                                                                 "error": "str"})
    means: dict[str, str] = field(default_factory=lambda: {"score": "mean score"})
    result_row: Callable[[Any], dict] | None = None
    add_args: Callable[[Any], None] | None = None
    options: tuple[Option, ...] = ()
    item_model: type | None = None

    def fields_of(self, result: Any) -> dict:
        if self.result_row is not None:
            return self.result_row(result)
        return {k: getattr(result, k, None) for k in self.result_fields}

    def example(self, item: dict, ident: Any) -> Any:
        if self.from_row is not None:
            return self.from_row(item, ident)
        return self.parse_item({**item, "id": ident}, "item")


# -- options ---------------------------------------------------------------------------------
def _engine_option(f) -> Option:
    return Option(f.name, f.metadata["type"], f.default, f.metadata["help"], f.metadata["choices"])


# How the model runs (every command that builds a judge offers these): generated from the one
# declaration of the engine's options, :class:`fastjudge.engine_options.EngineOptions`.
ENGINE_OPTIONS = tuple(_engine_option(f) for f in engine_fields())


def engine_options(args) -> EngineOptions:
    """The engine a command's judge runs on, from its parsed arguments."""
    return EngineOptions.from_args(args)


# The options below are the metric's: keyword arguments of the judges' constructors.
LAVE_OPTIONS = (
    Option("rationale", bool, None,
           "decode a rationale before the rating (slower; the paper's setting); default: off, "
           "on with --official-repo"),
    Option("max_new_tokens", int, 100, "generation length cap of rationale and "
                                       "--official-repo runs (%(default)s, as the authors)"),
    Option("num_shots", int, 8, "demonstrations per prompt (%(default)s)"),
    Option("demos", str, None, "JSON file of general-question demonstrations"),
    Option("binary_demos", str, None, "JSON file of yes/no-question demonstrations"),
    Option("filter_refs", bool, True, "keep outlier reference answers", flag="--no-filter"),
    Option("filter_p", float, 0.25, "the filter drops reference answers given at most this "
                                    "fraction as often as the most common one (%(default)s)"),
    Option("use_caption", bool, False, "add the image caption to prompts"),
    Option("on_unparsable", str, "constrain", "a rationale that ends without a rating: "
           "constrain (one more step restricted to 1/2/3; default) or official (rating 2, as "
           "the authors' code)", choices=("constrain", "official")),
    Option("official_repo", str, None, "a checkout of the LAVE authors' repository: its "
           "lave.py is run (as a plugin) to build the prompts from its demonstration files, "
           "and ratings follow its rule"),
)

IMAGE_ROOT = Option("image_root", str, None,
                    "folder for relative image paths (default: the input file's folder)")

# the judge's default (fastjudge.io.images.MAX_IMAGE_PIXELS) is not imported: this module stays light
MAX_IMAGE_PIXELS = Option("max_image_pixels", int, None,
                          "pixel budget: a larger image is refused from its header, before "
                          "decoding, as that item's error (default: 67108864, 8192 x 8192)")

IMAGE_TEXT_OPTIONS = (IMAGE_ROOT, MAX_IMAGE_PIXELS)

HOLISTIC_OPTIONS = IMAGE_TEXT_OPTIONS + (
    Option("template", str, "vqascore", "vqascore: VQAScore's question and answer word as "
           "t2v_metrics asks them (default); fastjudge: fastjudge's own instruction and question",
           choices=("vqascore", "fastjudge")),
    Option("normalize", str, None, "vocab: P(yes) over the whole vocabulary (VQAScore; default "
           "with --template vqascore); yes-no: renormalised over the two answer tokens (default "
           "with --template fastjudge)", choices=("vocab", "yes-no")),
)

VISEXMEM_OPTIONS = IMAGE_TEXT_OPTIONS + (
    Option("mode", str, "pipeline", "pipeline: the VisExMEM stages, one model call per step "
           "(default); single-response: the paper's Dec. control, decomposition, evidence, claim "
           "scores, explanations and an overall score in one constrained response; "
           "holistic-score: the paper's Hol. control, one 0-100 alignment score read as its "
           "expected value", choices=("pipeline", "single-response", "holistic-score")),
    Option("aggregate", str, "mean", "claim supports -> global score (default: %(default)s, as "
           "the paper)", choices=("mean", "geometric", "harmonic", "min")),
    Option("explain", bool, True, "skip the explanation stage"),
    Option("propose_boxes", bool, False, "items without boxes: let the model propose candidate "
                                         "regions (default: the image quadrants)"),
    Option("evidence_layout", str, "per-claim", "per-claim: each claim's selected crops in its "
           "own prompt part (default); shared: all candidate crops once in the example's shared "
           "prefix (faster)", choices=("per-claim", "shared")),
    Option("max_claims", int, 12, "most claims per caption (%(default)s)"),
    Option("max_claim_chars", int, 120, "longest claim text (%(default)s)"),
    Option("max_explanation_chars", int, 300, "longest explanation (%(default)s)"),
)


# -- the built-in judges ---------------------------------------------------------------------
def _build_lave(args):
    from .lave import LaveJudge

    return LaveJudge(args.model, engine=engine_options(args), **option_values(args, LAVE_OPTIONS))


def _image_text_values(args, options) -> dict:
    """Relative image paths resolve against ``--image-root``, else the input file's folder
    when there is one (file jobs)."""
    values = option_values(args, options)
    if values["image_root"] is None and getattr(args, "input", None):
        values["image_root"] = os.path.dirname(os.path.abspath(args.input))
    return values


def _build_visexmem(args):
    from .visexmem import VisExJudge

    return VisExJudge(args.model, engine=engine_options(args),
                      **_image_text_values(args, VISEXMEM_OPTIONS))


def _build_holistic(args):
    from .holistic import HolisticJudge

    return HolisticJudge(args.model, engine=engine_options(args),
                         **_image_text_values(args, HOLISTIC_OPTIONS))


# Result fields of a LAVE output row (``fastjudge lave``, ``fastjudge rescore --judge lave``).
LAVE_RESULT_FIELDS = ("score", "soft_score", "rating", "probs", "rationale", "rating_source",
                      "prompt_tokens", "error")
VISEXMEM_RESULT_FIELDS = ("score", "claims", "explanation", "warnings", "prompt_tokens", "error")
HOLISTIC_RESULT_FIELDS = ("score", "decision", "probs", "prompt_tokens", "error")


def _visexmem_row(result) -> dict:
    return items.image_text_result(result, VISEXMEM_RESULT_FIELDS)


def _holistic_row(result) -> dict:
    return items.image_text_result(result, HOLISTIC_RESULT_FIELDS)


JUDGES: dict[str, JudgeSpec] = {
    "lave": JudgeSpec(
        "lave", _build_lave, items.parse_lave_item, items.lave_from_row, LAVE_RESULT_FIELDS,
        {"score": "float", "soft_score": "float", "rating": "int", "probs": "list[float]",
         "rationale": "str", "rating_source": "str", "prompt_tokens": "int", "error": "str"},
        options=LAVE_OPTIONS, item_model=items.LaveItem),
    "visexmem": JudgeSpec(
        "visexmem", _build_visexmem, items.parse_image_text_item, items.image_text_from_row,
        VISEXMEM_RESULT_FIELDS,
        {"score": "float", "explanation": "str", "prompt_tokens": "int", "error": "str"},
        result_row=_visexmem_row, options=VISEXMEM_OPTIONS, item_model=items.ImageTextItem),
    "holistic": JudgeSpec(
        "holistic", _build_holistic, items.parse_image_text_item, items.image_text_from_row,
        HOLISTIC_RESULT_FIELDS,
        {"score": "float", "decision": "str", "probs": "list[float]", "prompt_tokens": "int",
         "error": "str"},
        result_row=_holistic_row, options=HOLISTIC_OPTIONS, item_model=items.ImageTextItem),
}


def register_judge(name: str, factory: Callable, parse_item: Callable, **spec: Any) -> JudgeSpec:
    """Make ``--judge NAME`` available to ``fastjudge serve`` and ``fastjudge rescore``.
    Keyword arguments are the other :class:`JudgeSpec` fields (``from_row``,
    ``result_fields``, ``result_types``, ``means``, ``result_row``, ``options``,
    ``add_args``, ``item_model``). Register before the command line is parsed (the ``--judge`` choices and
    the judges' options are read then)."""
    JUDGES[name] = JudgeSpec(name, factory, parse_item, **spec)
    return JUDGES[name]


def get_judge(name: str) -> JudgeSpec:
    try:
        return JUDGES[name]
    except KeyError:
        raise ValueError(f"unknown judge {name!r}; available: "
                         f"{', '.join(sorted(JUDGES))}") from None


class _NewOptionsOnly:
    """A parser (group) on which adding an option that exists already is a no-op."""

    def __init__(self, group):
        self.group = group

    def add_argument(self, *names, **kwargs):
        try:
            return self.group.add_argument(*names, **kwargs)
        except argparse.ArgumentError:
            return None


def add_judge_options(parser) -> None:
    """Every registered judge's options, each once (``fastjudge serve``, ``rescore``,
    ``bench``): the engine's options on ``parser`` itself, the others in a group named after the first judge
    that declares them, followed by that judge's ``add_args``."""
    seen: set[str] = set()
    add_options(parser, ENGINE_OPTIONS, seen)
    for spec in JUDGES.values():
        group = parser.add_argument_group(f"--judge {spec.name}")
        add_options(group, spec.options, seen)
        if spec.add_args is not None:
            spec.add_args(_NewOptionsOnly(group))
