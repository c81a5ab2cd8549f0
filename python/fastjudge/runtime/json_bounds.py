"""Hard length bounds of the JSON text constrained decoding can produce under a schema.

Constrained decoding writes JSON without free whitespace, with the fixed separators
:data:`SEPARATORS`, and every allowed token but the stop token decodes to at least one byte. So
where every string, array and number of a schema is bounded, the bytes of its longest valid text
bound the tokens any model can emit: :func:`json_token_bound`, which sizes a ``Json`` spec's
token budget. Covers the keywords the schema helpers of ``grammar`` use; anything unbounded or
unsupported raises ValueError.
"""

from __future__ import annotations

import json
import re
from typing import Mapping, Union

#: Item and key separators of every compiled grammar (``json.dumps``'s defaults).
SEPARATORS = (", ", ": ")


def _pattern_max_chars(pattern: str) -> int:
    """Longest string (in code points) a simple anchored pattern matches: literals, escapes and
    character classes with ``?``/``{n}``/``{m,n}`` quantifiers. Anything else is unbounded or
    unsupported here and raises."""
    p = pattern
    if p.startswith("^"):
        p = p[1:]
    if p.endswith("$") and not p.endswith("\\$"):
        p = p[:-1]
    total, i = 0, 0
    while i < len(p):
        c = p[i]
        if c == "[":
            j = i + 1
            if j < len(p) and p[j] == "^":
                j += 1
            if j < len(p) and p[j] == "]":
                j += 1
            while j < len(p) and p[j] != "]":
                j += 2 if p[j] == "\\" else 1
            if j >= len(p):
                raise ValueError(f"unterminated class in pattern {pattern!r}")
            i = j + 1
        elif c == "\\":
            m = re.match(r"\\(x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|.)", p[i:])
            i += len(m.group(0))
        elif c in "()|*+^$":
            raise ValueError(f"cannot bound the length of pattern {pattern!r}")
        else:
            i += 1
        reps = 1
        if i < len(p) and p[i] in "?*+{":
            if p[i] == "?":
                i += 1
            elif p[i] == "{":
                m = re.match(r"\{(\d+)(?:,(\d+))?\}", p[i:])
                if m is None:
                    raise ValueError(f"cannot bound the length of pattern {pattern!r}")
                reps = int(m.group(2) if m.group(2) is not None else m.group(1))
                i += len(m.group(0))
            else:
                raise ValueError(f"cannot bound the length of pattern {pattern!r}")
        total += reps
    return total


def _literal_bytes(value) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(SEPARATORS[0], SEPARATORS[1]))
               .encode("utf-8"))


def max_json_bytes(schema: Mapping) -> int:
    """Bytes of the longest JSON text valid under ``schema`` as the grammar writes it. Covers the
    keywords the schema helpers use; raises ValueError when the length is unbounded."""
    if "const" in schema:
        return _literal_bytes(schema["const"])
    if "enum" in schema:
        return max(_literal_bytes(v) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return max(max_json_bytes(s) for s in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return max(max_json_bytes({**schema, "type": k}) for k in kind)
    comma, colon = SEPARATORS
    if kind == "object":
        props = schema.get("properties", {})
        if not props:
            return 2
        body = sum(_literal_bytes(k) + len(colon) + max_json_bytes(v) for k, v in props.items())
        return 2 + body + len(comma) * (len(props) - 1)
    if kind == "array":
        if "maxItems" not in schema:
            raise ValueError("unbounded array: set maxItems")
        n = int(schema["maxItems"])
        if n == 0:
            return 2
        return 2 + n * max_json_bytes(schema.get("items", {})) + len(comma) * (n - 1)
    if kind == "string":
        if "pattern" in schema:  # per code point, at most 4 UTF-8 bytes
            return 2 + 4 * _pattern_max_chars(schema["pattern"])
        if "maxLength" in schema:  # an escaped character takes up to 6 bytes ("\uXXXX")
            return 2 + 6 * int(schema["maxLength"])
        raise ValueError("unbounded string: set a bounded pattern or maxLength")
    if kind == "integer":
        if "minimum" not in schema or "maximum" not in schema:
            raise ValueError("unbounded integer: set minimum and maximum")
        return max(len(str(int(schema["minimum"]))), len(str(int(schema["maximum"]))))
    if kind == "boolean":
        return 5
    if kind == "null":
        return 4
    raise ValueError(f"cannot bound the length of schema {schema!r}")


def json_token_bound(schema: Union[Mapping, str]) -> int:
    """Most tokens constrained decoding can emit under ``schema``, the stop token included.
    Every allowed token but the stop token decodes to at least one byte (special tokens are
    never allowed), so the longest text's bytes plus one bound any model's output."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    return max_json_bytes(schema) + 1
