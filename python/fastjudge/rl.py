"""Reward adapters for RL trainers: a TRL reward function and a verl ``compute_score``.

Both score completions with LAVE against reference answers; the reward is the LAVE score
``(rating - 1) / 2`` in {0, 0.5, 1}. Items the judge rejects (empty references, a prompt above
the model limit) get the TRL function's ``error_value`` (default None: TRL turns a None reward
into NaN and leaves it out of the advantage), and 0.0 in verl's ``compute_score``.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable, Sequence

from .judges.lave import LaveJudge, VQAExample

__all__ = ["lave_reward_fn", "compute_score", "configure"]


def _text(x: Any) -> str:
    """Plain text of a TRL prompt/completion: a string, or a conversation (list of
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


def _references(refs: Any) -> list:
    """References as a list: a list as is; a JSON list string decoded; another string as one
    reference."""
    if isinstance(refs, str):
        try:
            decoded = json.loads(refs)
        except ValueError:
            return [refs]
        return decoded if isinstance(decoded, list) else [refs]
    if isinstance(refs, (list, tuple)):
        return list(refs)
    return [] if refs is None else [refs]


def lave_reward_fn(judge: LaveJudge, references_key: str = "references",
                   question_key: str = "question", caption_key: str = "caption",
                   error_value: float | None = None) -> Callable[..., list[float | None]]:
    """A TRL-style reward function ``f(prompts, completions, **kwargs) -> list[float]``.

    TRL passes the dataset's other columns as keyword lists: ``kwargs[references_key]`` holds
    each row's reference answers (list of strings, or a JSON list string); the question is
    ``kwargs[question_key]`` when that column exists, otherwise the prompt text (the last
    message of a conversational prompt). Completions may be strings or conversations.

    Example (runs as is with any LAVE judge checkpoint)::

        from fastjudge import LaveJudge
        from fastjudge.rl import lave_reward_fn

        judge = LaveJudge("/models/flan-t5-xl")
        reward = lave_reward_fn(judge)
        print(reward(prompts=["What sport is this?"], completions=["skiing"],
                     references=[["skiing", "ski", "skiing"]]))
        # with TRL: GRPOTrainer(model=..., reward_funcs=reward, train_dataset=ds, ...)
        # where ds has "prompt", "references" (and optionally "question") columns
    """

    def reward(prompts: Sequence, completions: Sequence, **kwargs) -> list[float]:
        n = len(completions)
        if references_key not in kwargs:
            raise ValueError(f"reward function needs the dataset column {references_key!r} "
                             f"(got columns: {', '.join(sorted(kwargs)) or 'none'})")
        refs = kwargs[references_key]
        questions = kwargs.get(question_key) or [_text(p) for p in prompts]
        captions = kwargs.get(caption_key) or [None] * n
        if not (len(refs) == len(questions) == len(captions) == n):
            raise ValueError(f"column lengths differ: {n} completions, {len(refs)} references, "
                             f"{len(questions)} questions")
        examples = [VQAExample(_text(q), _references(r), _text(c), cap)
                    for q, r, c, cap in zip(questions, refs, completions, captions)]
        return [error_value if r.error else float(r.score) for r in judge.score(examples)]

    reward.__name__ = "lave_reward"
    return reward


_judge: LaveJudge | None = None
_judge_lock = threading.Lock()


def configure(judge: LaveJudge | None) -> None:
    """Set the judge ``compute_score`` uses (``None``: load from ``$FASTJUDGE_MODEL`` again)."""
    global _judge
    with _judge_lock:
        _judge = judge


def _module_judge() -> LaveJudge:
    global _judge
    with _judge_lock:
        if _judge is None:
            model = os.environ.get("FASTJUDGE_MODEL")
            if not model:
                raise RuntimeError("fastjudge.rl.compute_score has no judge: call "
                                   "fastjudge.rl.configure(LaveJudge(...)) or set FASTJUDGE_MODEL "
                                   "to a checkpoint directory")
            _judge = LaveJudge(model, device=os.environ.get("FASTJUDGE_DEVICE", "auto"))
        return _judge


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None, **kwargs: Any) -> float:
    """verl-style custom reward: the LAVE score of ``solution_str``.

    ``ground_truth`` is the reference answers (a list, a JSON list string, or one string); the
    question comes from ``extra_info["question"]`` (optional ``extra_info["caption"]``).
    ``data_source`` and the extra keyword arguments verl passes (``reward_router_address``,
    ``reward_model_tokenizer``, config ``reward_kwargs``) are not used. The judge is
    ``configure(judge)``'s, or loaded once from ``$FASTJUDGE_MODEL`` (device
    ``$FASTJUDGE_DEVICE``, default auto). Invalid items score 0.0.

    Example::

        from fastjudge import LaveJudge
        from fastjudge import rl

        rl.configure(LaveJudge("/models/flan-t5-xl"))
        print(rl.compute_score("vqav2", "skiing", ["skiing", "ski"],
                               {"question": "What sport is this?"}))
        # verl: custom_reward_function.path=<site-packages>/fastjudge/rl.py
        #       custom_reward_function.name=compute_score   (and export FASTJUDGE_MODEL=...)
    """
    info = extra_info or {}
    question = info.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError('compute_score needs extra_info["question"] (the VQA question)')
    example = VQAExample(question, _references(ground_truth), _text(solution_str),
                         info.get("caption"))
    result = _module_judge().score([example])[0]
    return 0.0 if result.error else float(result.score)
