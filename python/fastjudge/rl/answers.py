"""The answer a policy gave, as the judge should see it: its reasoning removed, and an answer
that is not there refused.

Reasoning policies write a thinking block before the answer; the judge must score the answer
alone, since the trace is long (it can exceed the judge's input limit) and says everything on
the way. The block forms written by the thinking chat templates:

* ``<think>…</think>`` (Qwen3, Qwen3.5, DeepSeek-R1, QwQ and most others); a template whose
  generation prompt already opens the block (Qwen3.5 with thinking on writes ``<think>\\n``
  after the assistant header) leaves only ``…</think>answer`` in the completion;
* ``<|channel>thought\\n…<channel|>`` (Gemma 4);
* ``<thinking>…</thinking>``, ``<reasoning>…</reasoning>``, ``<seed:think>…</seed:think>``,
  ``◁think▷…◁/think▷`` (Kimi-VL).

Everything up to the last closing marker is reasoning. An opened block that never closes (the
completion ran out of tokens while thinking) leaves no answer: that is an :class:`AnswerError`
saying so, and so is an answer that is empty or only whitespace (a tool-call turn's ``None``
content included). A policy that learns to answer nothing, or to think until the budget runs
out, must never be paid for it.

``reasoning="keep"`` takes the text as is (only the emptiness check remains), for policies
whose block is part of what should be judged.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AnswerError", "check_reasoning_mode", "REASONING_BLOCKS", "REASONING_MODES", "answer_of", "opens_reasoning"]

#: (opening, closing) markers of a reasoning block, as the thinking chat templates write them
REASONING_BLOCKS = (("<think>", "</think>"),
                    ("<|channel>thought", "<channel|>"),
                    ("<thinking>", "</thinking>"),
                    ("<reasoning>", "</reasoning>"),
                    ("<seed:think>", "</seed:think>"),
                    ("\u25c1think\u25b7", "\u25c1/think\u25b7"))
#: ``strip``: remove a completed block, refuse an unterminated one; ``keep``: judge the text as is
REASONING_MODES = ("strip", "keep")


class AnswerError(ValueError):
    """A completion with no answer to judge; the message says why."""


def check_reasoning_mode(reasoning: str) -> None:
    """Refuse an unknown ``reasoning`` mode when a reward is built, not at its first call."""
    if reasoning not in REASONING_MODES:
        raise ValueError(f"reasoning must be one of {', '.join(REASONING_MODES)}, got {reasoning!r}")


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether text written after the assistant header (a generation prompt's tail) leaves a
    reasoning block open, so that the completion starts inside it."""
    for opening, closing in REASONING_BLOCKS:
        at = prompt_tail.rfind(opening)
        if at >= 0 and prompt_tail.find(closing, at) < 0:
            return True
    return False


def answer_of(text: Any, reasoning: str = "strip", opened: bool = False) -> str:
    """The answer in a completion's text, stripped of surrounding whitespace.

    ``opened``: the prompt already opened a reasoning block (see :func:`opens_reasoning`), so
    the completion must close it before it answers. :class:`AnswerError` when there is no
    answer (see the module docstring)."""
    check_reasoning_mode(reasoning)
    if text is None:
        raise AnswerError("the answer is empty (no text: a tool-call turn, or no completion)")
    text = str(text)
    if reasoning == "strip":
        closed = False
        for opening, closing in REASONING_BLOCKS:
            end = text.rfind(closing)
            if end >= 0:
                text, closed = text[end + len(closing):], True
            elif opening in text:
                raise AnswerError(f"the reasoning block opened by {opening!r} never closes with "
                                  f"{closing!r}: the completion ended while thinking (raise the "
                                  "generation budget, or judge the text as is with reasoning=keep)")
        if opened and not closed:
            raise AnswerError("the prompt opened a reasoning block that the completion never "
                              "closes: it ended while thinking (raise the generation budget, or "
                              "judge the text as is with reasoning=keep)")
        if closed and not text.strip():
            raise AnswerError("the answer is empty: nothing follows the reasoning block")
    if not text.strip():
        raise AnswerError("the answer is empty" + (" (only whitespace)" if text else ""))
    return text.strip()
