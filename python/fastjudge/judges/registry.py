"""The judges that ``fastjudge serve`` and ``fastjudge rescore`` know by name.

One :class:`JudgeSpec` per judge says how to build it from the parsed command-line arguments,
how to turn one input item into an example (strictly for HTTP requests, as the JSONL jobs do
for files), and which result fields its output rows carry. A new judge is one
:func:`register_judge` call (or one entry in :data:`JUDGES`).

This module imports nothing heavy; factories import their judge when called.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ItemError", "JudgeSpec", "JUDGES", "register_judge", "get_judge",
           "LAVE_RESULT_FIELDS"]

# Result fields of a LAVE output row (``fastjudge lave``, ``fastjudge rescore --judge lave``).
LAVE_RESULT_FIELDS = ("score", "soft_score", "rating", "probs", "rationale", "rating_source",
                      "prompt_tokens", "error")
LAVE_RESULT_TYPES = {"score": "float", "soft_score": "float", "rating": "int",
                     "probs": "list[float]", "rationale": "str", "rating_source": "str",
                     "prompt_tokens": "int", "error": "str"}


class ItemError(ValueError):
    """An input item that is not a valid example for the judge (the server answers 422)."""


@dataclass(frozen=True)
class JudgeSpec:
    """How to build and feed one judge.

    * ``factory(args)``: the judge, from parsed command-line arguments (options a command does
      not define fall back to the judge's defaults). The judge has ``stream(examples)``
      yielding results with ``index`` (into ``examples``), ``error`` and the result fields.
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
    * ``add_args(parser)``: adds the judge's own options to ``fastjudge rescore`` (an option
      that another judge already defines is kept as that judge defined it).

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

    def fields_of(self, result: Any) -> dict:
        if self.result_row is not None:
            return self.result_row(result)
        return {k: getattr(result, k, None) for k in self.result_fields}

    def example(self, item: dict, ident: Any) -> Any:
        if self.from_row is not None:
            return self.from_row(item, ident)
        return self.parse_item({**item, "id": ident}, "item")


# -- LAVE ------------------------------------------------------------------------------------
def _lave_factory(args) -> Any:
    from .lave import LaveJudge

    def opt(name, default=None):
        return getattr(args, name, default)

    return LaveJudge(args.model, device=opt("device", "auto"), dtype=opt("dtype"),
                     rationale=opt("rationale", False), max_new_tokens=opt("max_new_tokens", 100),
                     num_shots=opt("num_shots", 8), demos=opt("demos"),
                     binary_demos=opt("binary_demos"), filter_refs=not opt("no_filter", False),
                     filter_p=opt("filter_p", 0.25), use_caption=opt("use_caption", False),
                     max_batch_tokens=opt("max_batch_tokens"),
                     on_unparsable=opt("on_unparsable", "constrain"),
                     allow_pickle=opt("allow_pickle", False),
                     max_input_tokens=opt("max_input_tokens"))


def _lave_item(d: Any, where: str):
    from .lave import VQAExample

    if not isinstance(d, dict):
        raise ItemError(f"{where}: expected a JSON object, got {type(d).__name__}")
    missing = [k for k in ("question", "references", "prediction") if k not in d]
    if missing:
        raise ItemError(f"{where}: missing field(s) {', '.join(missing)}")
    if not isinstance(d["question"], str):
        raise ItemError(f"{where}: question must be a string")
    if not isinstance(d["prediction"], str):
        raise ItemError(f"{where}: prediction must be a string")
    refs = d["references"]
    if not isinstance(refs, list) or not all(
            isinstance(r, str) or (isinstance(r, dict) and isinstance(r.get("answer"), str))
            for r in refs):
        raise ItemError(f"{where}: references must be a list of strings "
                        "(or of {\"answer\": str} objects)")
    caption = d.get("caption")
    if caption is not None and not isinstance(caption, str):
        raise ItemError(f"{where}: caption must be a string or null")
    ident = d.get("id")
    if ident is not None and not isinstance(ident, (str, int, float, bool)):
        raise ItemError(f"{where}: id must be a string or a number")
    return VQAExample(d["question"], refs, d["prediction"], caption, ident)


def _lave_row(item: dict, ident: Any):
    """As ``fastjudge lave`` reads a line: fields as given, the judge validates them."""
    from .lave import VQAExample

    return VQAExample(question=item.get("question"), references=item.get("references"),
                      prediction=item.get("prediction"), caption=item.get("caption"), id=ident)


JUDGES: dict[str, JudgeSpec] = {
    "lave": JudgeSpec("lave", _lave_factory, _lave_item, _lave_row, LAVE_RESULT_FIELDS,
                      LAVE_RESULT_TYPES, {"score": "mean score"}),
}


# -- image-text judges (VisExMEM, holistic yes/no) ------------------------------------------
def _image_text_spec(name: str) -> JudgeSpec:
    from . import image_text_io as io

    visex = name == "visexmem"
    return JudgeSpec(
        name, io.make_factory(name), io.parse_http_item,
        lambda item, ident: io.example_from_row(item, ident),
        io.VISEXMEM_RESULT_FIELDS if visex else io.HOLISTIC_RESULT_FIELDS,
        io.VISEXMEM_RESULT_TYPES if visex else io.HOLISTIC_RESULT_TYPES,
        {"score": "mean score"},
        result_row=lambda r: io.result_fields(r, io.VISEXMEM_RESULT_FIELDS if visex else io.HOLISTIC_RESULT_FIELDS),
        add_args=io.add_image_text_args)


JUDGES["visexmem"] = _image_text_spec("visexmem")
JUDGES["holistic"] = _image_text_spec("holistic")


def register_judge(name: str, factory: Callable, parse_item: Callable, **spec: Any) -> JudgeSpec:
    """Make ``--judge NAME`` available to ``fastjudge serve`` and ``fastjudge rescore``.
    Keyword arguments are the other :class:`JudgeSpec` fields (``from_row``,
    ``result_fields``, ``result_types``, ``means``, ``result_row``, ``add_args``). Register
    before the command line is parsed (the ``--judge`` choices are read then)."""
    JUDGES[name] = JudgeSpec(name, factory, parse_item, **spec)
    return JUDGES[name]


class _NewOptionsOnly:
    """A parser (group) on which adding an option that exists already is a no-op."""

    def __init__(self, group):
        self.group = group

    def add_argument(self, *names, **kwargs):
        import argparse

        try:
            return self.group.add_argument(*names, **kwargs)
        except argparse.ArgumentError:
            return None


def add_judge_options(parser) -> None:
    """Every registered judge's own options (``JudgeSpec.add_args``), each in a group named
    after its judge; an option defined already is kept as first defined."""
    for spec in JUDGES.values():
        if spec.add_args is not None:
            spec.add_args(_NewOptionsOnly(parser.add_argument_group(f"--judge {spec.name}")))


def get_judge(name: str) -> JudgeSpec:
    try:
        return JUDGES[name]
    except KeyError:
        raise ValueError(f"unknown judge {name!r}; available: "
                         f"{', '.join(sorted(JUDGES))}") from None
