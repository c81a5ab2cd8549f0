"""JSON text parsed within the server's limits: nesting depth and encodable strings.

Python's parser recurses once per nesting level, so a body of ten thousand ``[`` raises
``RecursionError`` deep inside it; the depth is therefore measured on the text, before parsing.
JSON escapes can spell strings that are not Unicode text (a lone surrogate such as
``"\\ud800"``); such a string parses, then fails wherever it is encoded (a tokenizer, the
response that echoes an ``id``), so it is refused with the place it was found.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_JSON_DEPTH = 400

# A raw surrogate code point, or a JSON escape that may spell one (confirmed on the parsed value).
_MAYBE_SURROGATE = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class JsonTooDeep(ValueError):
    """Arrays and objects nested deeper than :data:`MAX_JSON_DEPTH`."""


class UnencodableString(ValueError):
    """A string (or object key) holding a lone surrogate."""


def nesting_exceeds(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays and objects in JSON ``text`` nest deeper than ``limit`` (brackets inside
    strings do not count). Vectorized: a hostile body is megabytes of brackets."""
    if text.count("[") + text.count("{") <= limit:
        return False
    import numpy as np  # only for bodies with that many brackets

    data = np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)
    quotes = data == ord('"')
    if "\\" in text:  # a quote is escaped when an odd run of backslashes ends just before it
        index = np.arange(len(data), dtype=np.int32)
        last_plain = np.maximum.accumulate(np.where(data == ord("\\"), -1, index))
        backslash_run = index - last_plain
        quotes[1:] &= backslash_run[:-1] % 2 == 0
    outside_strings = np.cumsum(quotes, dtype=np.int32) % 2 == 0
    opens = (data == ord("[")) | (data == ord("{"))
    closes = (data == ord("]")) | (data == ord("}"))
    steps = (opens & outside_strings).astype(np.int32) - (closes & outside_strings)
    return int(np.cumsum(steps, dtype=np.int32).max()) > limit


def _label(path: tuple, where: str) -> str:
    """``items[0].id`` from the linked path ``((((), "items"), 0), "id")``."""
    keys = []
    while path:
        path, key = path
        keys.append(key)
    text = where
    for key in reversed(keys):
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else key)
    return text or "body"


def _first_lone_surrogate(value: Any, where: str) -> str | None:
    """A message for the first string or key (in document order) holding a lone surrogate."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            found = _SURROGATE.search(node)
            if found:
                return (f"{_label(path, where)}: U+{ord(found.group()):04X} is a lone surrogate, "
                        "which no Unicode encoding can carry; send valid Unicode text")
        elif isinstance(node, list):
            stack.extend((item, (path, i)) for i, item in reversed(list(enumerate(node))))
        elif isinstance(node, dict):
            for key in node:
                found = _SURROGATE.search(key)
                if found:
                    return (f"{_label(path, where)}: a key holds U+{ord(found.group()):04X}, a "
                            "lone surrogate, which no Unicode encoding can carry")
            stack.extend((item, (path, key)) for key, item in reversed(list(node.items())))
    return None


def load_json(text: str, where: str = "") -> Any:
    """The value of JSON ``text``. Raises :class:`JsonTooDeep` or :class:`UnencodableString`
    (their messages name ``where``, or the place inside the value), or ``ValueError`` for text
    that is not JSON."""
    too_deep = JsonTooDeep(f"{where or 'body'}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if nesting_exceeds(text):
        raise too_deep
    try:
        value = json.loads(text)
    except RecursionError:  # a recursion limit set below the depth limit
        raise too_deep from None
    if _MAYBE_SURROGATE.search(text):
        problem = _first_lone_surrogate(value, where)
        if problem:
            raise UnencodableString(problem)
    return value


def decode_body(body: bytes) -> str:
    """Body bytes as text, in the encoding JSON's rules detect (UTF-8 unless a UTF-16/32 byte
    pattern says otherwise); bytes that are not valid text raise ``UnicodeDecodeError``."""
    return body.decode(json.detect_encoding(body))
