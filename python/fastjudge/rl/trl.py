"""TRL reward functions ``f(prompts, completions, **columns) -> list[float | None]``.

TRL's ``GRPOTrainer._calculate_rewards`` (``trl/trainer/grpo_trainer.py``) calls a reward
function with the dataset's other columns as keyword lists (one value per completion), plus
``trainer_state`` and two logging callables: ``log_extra(column, values)`` adds a column to the
completions table (one value per completion) and ``log_metric(name, value)`` records a scalar
averaged over the logging step. A ``None`` reward becomes NaN, which TRL leaves out of the
advantage.

Each completion is judged on its answer (:mod:`fastjudge.rl.answers`): a completed reasoning
block is removed (``reasoning="keep"`` judges the text as is); an empty, whitespace-only or
tool-call answer, or one that ends inside its reasoning block, is never sent to the judge and
gets ``error_value``, with the reason in the ``<name>_error`` column.

When the logging callables are passed, each function here logs the same columns and metrics on
every call, whatever its batch holds: TRL gathers them across processes name by name, so every
process must log the same names.

Each builder has an async twin (``lave_reward_fn_async``, ...): an ``async def`` reward that
awaits the judge's dynamic batcher (``judge.ascore``) instead of blocking. TRL (v0.27 on)
runs the ``async def`` reward functions of a step together with ``asyncio.gather`` on its
event-loop thread, beside the synchronous ones, so the judge's batches overlap the other
rewards; concurrent callers of one judge share its batches.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Sequence

from .answers import AnswerError, check_reasoning_mode
from .inputs import completion_answer, image_of, references_of, text_of

__all__ = ["lave_reward_fn", "visexmem_reward_fn", "holistic_reward_fn", "lave_reward_fn_async",
           "visexmem_reward_fn_async", "holistic_reward_fn_async"]

Columns = dict[str, Callable[[Any], Any]]
Metrics = dict[str, Callable[[list], float]]


def _error_rate(results: list) -> float:
    return sum(r.error is not None for r in results) / max(len(results), 1)


def _mean_over_scored(value: Callable[[Any], float]) -> Callable[[list], float]:
    """Mean of ``value`` over the items without an error; 0.0 when there are none (a NaN would
    turn TRL's mean over the logging step into NaN)."""
    def mean(results: list) -> float:
        scored = [value(r) for r in results if r.error is None]
        return sum(scored) / len(scored) if scored else 0.0
    return mean


def _log(kwargs: dict, name: str, results: list, columns: Columns, metrics: Metrics) -> None:
    log_extra, log_metric = kwargs.get("log_extra"), kwargs.get("log_metric")
    if callable(log_extra):
        for column, get in {**columns, "error": lambda r: r.error or ""}.items():
            log_extra(f"{name}_{column}", [get(r) for r in results])
    if callable(log_metric):
        for metric, reduce in {"error_rate": _error_rate, **metrics}.items():
            log_metric(f"{name}/{metric}", float(reduce(results)))


def lave_reward_fn(judge, references_key: str = "references", question_key: str = "question",
                   caption_key: str = "caption", error_value: float | None = None,
                   asynchronous: bool = False,
                   reasoning: str = "strip") -> Callable[..., list[float | None]]:
    """A TRL reward function scoring completions with a :class:`~fastjudge.LaveJudge`.

    ``kwargs[references_key]`` holds each row's reference answers (a list of strings, or a JSON
    list string); the question is ``kwargs[question_key]`` when that column exists, otherwise
    the prompt text (the last message of a conversational prompt). Completions may be strings
    or conversations. The reward is the LAVE score (0, 0.5, 1); a rejected item gets
    ``error_value``, and so does a completion without an answer (see the module docstring;
    ``reasoning``: ``strip`` or ``keep``). Logged: columns ``lave_rating``, ``lave_error``;
    metric ``lave/error_rate``. ``asynchronous``: an ``async def`` reward (see
    :func:`lave_reward_fn_async`).

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
    from ..judges.lave import VQAExample

    check_reasoning_mode(reasoning)

    def prepare(prompts: Sequence, completions: Sequence, kwargs: dict):
        n = len(completions)
        if references_key not in kwargs:
            raise ValueError(f"reward function needs the dataset column {references_key!r} "
                             f"(got columns: {', '.join(sorted(kwargs)) or 'none'})")
        refs = kwargs[references_key]
        questions = kwargs.get(question_key) or [text_of(p) for p in prompts]
        captions = kwargs.get(caption_key) or [None] * n
        if not (len(refs) == len(questions) == len(captions) == n):
            raise ValueError(f"column lengths differ: {n} completions, {len(refs)} references, "
                             f"{len(questions)} questions")
        results: list = [None] * n
        rows, examples = [], []
        for i, (q, r, c, cap) in enumerate(zip(questions, refs, completions, captions)):
            try:
                answer = completion_answer(c, reasoning)
            except AnswerError as none:  # never judged: this row's error
                results[i] = _unjudged(str(none))
                continue
            rows.append(i)
            examples.append(VQAExample(text_of(q), references_of(r), answer, cap))

        def finish(scored: list) -> list[float | None]:
            for r in scored:
                results[rows[r.index]] = r
            _log(kwargs, "lave", results, {"rating": lambda r: r.rating}, {})
            return [error_value if r.error else float(r.score) for r in results]

        return examples, finish

    return _reward(judge, "lave", prepare, asynchronous)


def _unjudged(reason: str) -> SimpleNamespace:
    """The result of a row the judge never saw: no score, every logged field empty."""
    return SimpleNamespace(score=None, error=reason, rating=None, decision=None, claims=None,
                           explanation=None)


def _reward(judge, name: str, prepare: Callable, asynchronous: bool) -> Callable:
    """The reward function of ``prepare(prompts, completions, kwargs) -> (examples, finish)``:
    a plain function scoring with ``judge.score``, or an ``async def`` awaiting
    ``judge.ascore`` (TRL awaits those: ``inspect.iscoroutinefunction``)."""
    if asynchronous:
        async def reward(prompts: Sequence, completions: Sequence, **kwargs) -> list[float | None]:
            examples, finish = prepare(prompts, completions, kwargs)
            return finish(await judge.ascore(examples) if examples else [])
    else:
        def reward(prompts: Sequence, completions: Sequence, **kwargs) -> list[float | None]:
            examples, finish = prepare(prompts, completions, kwargs)
            return finish(judge.score(examples) if examples else [])

    reward.__name__ = f"{name}_reward"  # TRL's name for the reward in its logs
    return reward


def _row_image(kwargs: dict, i: int, image_key: str, images_key: str):
    """Row ``i``'s image, or a ``str`` saying why it has none. Like TRL, a list-of-images column
    wins over a single-image one."""
    if images_key in kwargs:
        images = kwargs[images_key][i]
        if not images or images[0] is None:
            return f"row {i} has no image in column {images_key!r}"
        if len(images) != 1:  # the judges score a text against one image
            return f"row {i} has {len(images)} images in column {images_key!r}; the judge takes one"
        return image_of(images[0])
    image = kwargs[image_key][i]
    return f"row {i} has no image in column {image_key!r}" if image is None else image_of(image)


def _image_text_reward(judge, name: str, image_key: str, images_key: str,
                       error_value: float | None, columns: Columns, metrics: Metrics,
                       asynchronous: bool, reasoning: str):
    from ..judges.visexmem import ImageTextExample

    check_reasoning_mode(reasoning)

    def prepare(prompts: Sequence, completions: Sequence, kwargs: dict):
        if image_key not in kwargs and images_key not in kwargs:
            raise ValueError(f"reward function needs the dataset column {image_key!r} or "
                             f"{images_key!r} (got columns: {', '.join(sorted(kwargs)) or 'none'})")
        results: list = [None] * len(completions)
        rows, examples = [], []
        for i, completion in enumerate(completions):
            image = _row_image(kwargs, i, image_key, images_key)
            if isinstance(image, str):  # no usable image: this row's error, the judge never sees it
                results[i] = _unjudged(image)
                continue
            try:
                answer = completion_answer(completion, reasoning)
            except AnswerError as none:
                results[i] = _unjudged(str(none))
                continue
            rows.append(i)
            examples.append(ImageTextExample(image=image, text=answer))

        def finish(scored: list) -> list[float | None]:
            for r in scored:
                results[rows[r.index]] = r
            _log(kwargs, name, results, columns, metrics)
            return [error_value if r.error else float(r.score) for r in results]

        return examples, finish

    return _reward(judge, name, prepare, asynchronous)


def visexmem_reward_fn(judge, image_key: str = "image", images_key: str = "images",
                       error_value: float | None = None, asynchronous: bool = False,
                       reasoning: str = "strip") -> Callable[..., list[float | None]]:
    """A TRL reward function scoring each completion, as a caption, against its row's image
    with a :class:`~fastjudge.VisExJudge`; the reward is the VisExMEM score.

    The image comes from TRL's VLM columns: ``images`` (a list per row, which must hold one
    image) or else ``image`` (one per row); a PIL image, an array, encoded bytes, a path, or a
    ``datasets.Image(decode=False)`` dict. A row without a usable image, or an item the judge
    rejects (an unreadable image), and a completion without an answer (see the module
    docstring), gets ``error_value`` (default None: NaN
    in TRL). Logged: columns ``visexmem_explanation``, ``visexmem_claims`` (claims checked),
    ``visexmem_error``; metrics ``visexmem/error_rate``, ``visexmem/claims`` (mean over scored
    items).

        from fastjudge import VisExJudge
        from fastjudge.rl import visexmem_reward_fn

        reward = visexmem_reward_fn(VisExJudge("/models/Qwen3.5-2B"))
        # GRPOTrainer(model=<a VLM>, reward_funcs=reward, train_dataset=ds) with "prompt" and
        # "image" (or "images") columns
    """
    columns = {"explanation": lambda r: getattr(r, "explanation", None) or "",
               "claims": lambda r: len(getattr(r, "claims", None) or [])}
    metrics = {"claims": _mean_over_scored(lambda r: len(r.claims))}
    return _image_text_reward(judge, "visexmem", image_key, images_key, error_value, columns,
                              metrics, asynchronous, reasoning)


def holistic_reward_fn(judge, image_key: str = "image", images_key: str = "images",
                       error_value: float | None = None, asynchronous: bool = False,
                       reasoning: str = "strip") -> Callable[..., list[float | None]]:
    """As :func:`visexmem_reward_fn`, with a :class:`~fastjudge.HolisticJudge`: the reward is
    P(yes) that the image shows the completion. Logged: columns ``holistic_decision``,
    ``holistic_error``; metrics ``holistic/error_rate``, ``holistic/yes_rate`` (share of scored
    items decided "yes")."""
    columns = {"decision": lambda r: getattr(r, "decision", None) or ""}
    metrics = {"yes_rate": _mean_over_scored(lambda r: float(r.decision == "yes"))}
    return _image_text_reward(judge, "holistic", image_key, images_key, error_value, columns,
                              metrics, asynchronous, reasoning)


def lave_reward_fn_async(judge, **options) -> Callable[..., Any]:
    """:func:`lave_reward_fn` as an ``async def`` reward: TRL awaits it with its other async
    rewards, and the judge's batcher merges concurrent calls into shared batches::

        reward = lave_reward_fn_async(LaveJudge("/models/flan-t5-xl"))
        GRPOTrainer(model=..., reward_funcs=[reward, other_reward], train_dataset=ds)
    """
    return lave_reward_fn(judge, **options, asynchronous=True)


def visexmem_reward_fn_async(judge, **options) -> Callable[..., Any]:
    """:func:`visexmem_reward_fn` as an ``async def`` reward (see :func:`lave_reward_fn_async`)."""
    return visexmem_reward_fn(judge, **options, asynchronous=True)


def holistic_reward_fn_async(judge, **options) -> Callable[..., Any]:
    """:func:`holistic_reward_fn` as an ``async def`` reward (see :func:`lave_reward_fn_async`)."""
    return holistic_reward_fn(judge, **options, asynchronous=True)
