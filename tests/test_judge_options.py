"""Each judge's options are declared once (``fastjudge.judges.registry``): the declaration
agrees with the judge's constructor, and every command that builds the judge offers them with
the declared defaults."""

from __future__ import annotations

import importlib
import inspect

import pytest

from fastjudge.cli import build_parser
from fastjudge.judges import registry

CONSTRUCTORS = {"lave": ("fastjudge.judges.lave", "LaveJudge"),
                "visexmem": ("fastjudge.judges.visexmem", "VisExJudge"),
                "holistic": ("fastjudge.judges.holistic", "HolisticJudge")}

JOB = ["--model", "m", "--input", "i", "--output", "o"]


@pytest.mark.parametrize("name", sorted(CONSTRUCTORS))
def test_declared_options_are_constructor_keywords_with_their_defaults(name):
    module, cls = CONSTRUCTORS[name]
    params = inspect.signature(getattr(importlib.import_module(module), cls)).parameters
    for option in registry.JUDGES[name].options:
        assert option.name in params, option.name
        assert option.default == params[option.name].default, option.name


@pytest.mark.parametrize("argv, judges", [
    (["lave", *JOB], ["lave"]),
    (["visexmem", *JOB], ["visexmem", "holistic"]),
    (["rescore", *JOB], sorted(CONSTRUCTORS)),
    (["serve", "--model", "m"], sorted(CONSTRUCTORS)),
])
def test_commands_offer_the_declared_options(argv, judges):
    args = build_parser().parse_args(argv)
    for name in judges:
        for option in registry.JUDGES[name].options:
            assert getattr(args, option.name) == option.default, (argv[0], option.name)


def test_a_switch_sets_the_opposite_of_its_default():
    args = build_parser().parse_args(["rescore", *JOB, "--no-filter", "--no-explain",
                                      "--use-caption", "--max-claims", "3"])
    values = registry.option_values(args, registry.VISEXMEM_OPTIONS)
    assert values["explain"] is False and values["max_claims"] == 3
    lave = registry.option_values(args, registry.LAVE_OPTIONS)
    assert lave["filter_refs"] is False and lave["use_caption"] is True
