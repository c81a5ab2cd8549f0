"""What trainers hand a reward function, as the judges' fields: the text of a prompt or
completion (a string or a conversation), reference answers (a list, a JSON list string, an array
from a dataset column), and an image column's value."""

from __future__ import annotations

import json
from typing import Any

from .answers import answer_of


def text_of(x: Any) -> str:
    """Plain text of a prompt/completion: a string, or a conversation (list of
    ``{"role", "content"}`` messages; the last message's content is used)."""
    if isinstance(x, str):
        return x
    if isinstance(x, (list, tuple)) and x and isinstance(x[-1], dict):
        content = x[-1].get("content", "")
        if isinstance(content, list):  # multimodal content parts
            return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        # a tool-call turn has content None: that is an empty answer, not the text "None"
        return "" if content is None else str(content)
    return "" if x is None else str(x)


def content_of(x: Any) -> str | None:
    """A completion's text as the policy wrote it: a string, or a conversation's last message
    content (text parts joined); ``None`` for a tool-call turn (content ``None``)."""
    if isinstance(x, (list, tuple)) and x and isinstance(x[-1], dict):
        content = x[-1].get("content")
        if content is None:
            return None
        if isinstance(content, list):
            return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        return str(content)
    return None if x is None else text_of(x)


def completion_answer(x: Any, reasoning: str = "strip") -> str:
    """The answer of a completion (a string or a conversation), reasoning removed unless
    ``reasoning="keep"``; :class:`~fastjudge.rl.answers.AnswerError` when it has none (an
    empty or whitespace-only answer, a tool-call turn, an unterminated reasoning block)."""
    return answer_of(content_of(x), reasoning)


def references_of(refs: Any) -> list:
    """References as a list: a list as is; a JSON list string decoded; another string as one
    reference; an array (a parquet list column read through pandas/numpy) as its items."""
    if isinstance(refs, str):
        try:
            decoded = json.loads(refs)
        except ValueError:
            return [refs]
        return decoded if isinstance(decoded, list) else [refs]
    if isinstance(refs, (list, tuple)):
        return list(refs)
    if hasattr(refs, "tolist") and getattr(refs, "ndim", 0) == 1:
        return refs.tolist()
    return [] if refs is None else [refs]


def image_of(x: Any):
    """An image column's value as the judges take it (a PIL image, an array, bytes or a path).
    A ``datasets.Image(decode=False)`` value is ``{"bytes", "path"}``: its bytes, else its path."""
    if isinstance(x, dict):
        return x.get("bytes") or x.get("path")
    return x
