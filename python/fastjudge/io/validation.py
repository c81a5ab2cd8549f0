"""Inputs checked against pydantic models, with one message that names where each problem is.

The models (:mod:`fastjudge.judges.items`, :mod:`fastjudge.serve.schemas`,
:mod:`fastjudge.serve.openai_schemas`) validate already parsed JSON in strict mode: a number is
not a string, ``true`` is not ``1``. A pydantic error's location mixes the input's keys with
the tags of union members (``id.str``); :func:`problems` keeps only the steps that lead into the
input, so a message reads ``items[2].references[0]: ...`` whatever the model's shape.
"""

from __future__ import annotations

from typing import Any

# What a value of the wrong type should have been (several: a union's members).
_EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
             "bool_type": "a boolean", "dict_type": "an object", "model_type": "an object",
             "list_type": "a list", "none_required": "null"}
MAX_PROBLEMS_SHOWN = 3


def input_path(loc: tuple, value: Any, where: str = "") -> str:
    """``where`` followed by the steps of ``loc`` that index into ``value`` (a missing key at
    the end counts: it names the absent field)."""
    text, node = where, value
    for i, key in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        elif isinstance(node, dict) and isinstance(key, str) and (key in node or last):
            node = node.get(key)
        else:
            continue  # a union member's tag, not part of the input
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else key)
    return text


def problems(error, value: Any, where: str = "") -> list[tuple[str, str]]:
    """``(path, message)`` per place the input is wrong, in the order pydantic found them; the
    refusals of one union's members at one place become one message."""
    grouped: dict[str, list[dict]] = {}
    for e in error.errors(include_url=False):
        grouped.setdefault(input_path(e["loc"], value, where), []).append(e)
    found = []
    for path, errors in grouped.items():
        if len(errors) == 1 and errors[0]["type"] == "missing":
            message = "field required"
        elif all(_EXPECTED.get(e["type"]) for e in errors):
            message = "expected " + " or ".join(dict.fromkeys(_EXPECTED[e["type"]] for e in errors))
        else:
            message = "; ".join(dict.fromkeys(e["msg"] for e in errors))
        found.append((path or "body", message))
    return found


def describe(error, value: Any, where: str = "") -> str:
    """One message for a validation error: its first few problems, each with its place."""
    found = problems(error, value, where)
    text = "; ".join(f"{path}: {message}" for path, message in found[:MAX_PROBLEMS_SHOWN])
    more = len(found) - MAX_PROBLEMS_SHOWN
    return text + (f" (and {more} more)" if more > 0 else "")


def tagged_union(members: dict[str, Any], tag_of, message: str) -> Any:
    """A union whose member is chosen by ``tag_of(value)`` (a key of ``members``, or None: the
    value is refused with ``message``), so that an error speaks of the member the value was
    meant to be rather than of every member."""
    from typing import Annotated, Union

    from pydantic import Discriminator, Tag

    options = tuple(Annotated[kind, Tag(tag)] for tag, kind in members.items())
    return Annotated[Union[options], Discriminator(tag_of, custom_error_type="union_member",
                                                   custom_error_message=message)]
