"""verl custom reward functions over one judge per process (LAVE, VisExMEM, holistic).

For one judge shared by the whole job (one GPU judge, batched across every reward worker), use
:mod:`fastjudge.rl.verl_remote` instead: the same forms, posting to a running ``fastjudge
serve``.

Supported verl releases: v0.5.0 to v0.9.x. How verl finds the function:

* from v0.7.0, ``custom_reward_function.path=pkg://fastjudge.rl`` imports this package by name
  (``verl/utils/import_utils.py``, ``load_module``) and takes ``custom_reward_function.name``
  from it (``load_extern_object``); from v0.7.1 the keys live under ``reward.`` (the old ones
  are still migrated);
* any release also takes a file path, which it runs standalone as its own module (before
  v0.7.0 only that): point it at :mod:`fastjudge.rl.verl_entry` (``python -m
  fastjudge.rl.verl_entry`` prints its path), whose imports are absolute. A file of this
  package itself fails there (its relative imports have no package).

``custom_reward_function.reward_kwargs`` is merged into every call
(``verl/trainer/ppo/reward.py``, ``get_custom_reward_fn``). The forms:

* :func:`compute_score`: one item, LAVE; a dict with the same keys for every item (``score``,
  ``rating``, ``soft_score``, ``prob_1``..``prob_3``, ``acc``, ``error`` as numbers;
  ``error_reason``, the text of why an item was not judged, empty when it was), since verl
  stacks each key over the batch (string keys are kept, not averaged). ``acc`` is what DAPO's
  group filter reads by default (``algorithm.filter_groups.metric=acc``).
* :func:`compute_score_visexmem` / :func:`compute_score_holistic` (and their ``_async``
  twins): the image judges, the image taken from ``extra_info["image"]``. Every reward manager of v0.7.1+ calls it:
  ``naive``, ``dapo``, ``gdpo``, ``rate_limited`` on a thread pool, ``remote`` in its own Ray
  worker processes (one judge per worker).
* :func:`compute_score_async`: the same as an ``async def``; the reward loop's managers
  (``naive``, ``dapo``, ``gdpo``, ``rate_limited``; not ``remote``) await it (they check
  ``inspect.iscoroutinefunction``) instead of running it on a thread pool.
* :func:`compute_score_batch`: lists in, a list of dicts out, for ``reward_manager=batch``,
  which exists up to v0.7.0 only.
* :func:`compute_score_float`: the score alone, for ``reward_manager=prime`` (up to v0.7.0).

``solution_str`` is decoded with ``skip_special_tokens=True``
(``reward_loop/reward_manager/naive.py``), which keeps a thinking policy's ``<think>`` block:
each form judges the answer after it (:mod:`fastjudge.rl.answers`; the reward kwarg
``fastjudge_reasoning=keep`` judges the text as is).

An item the judge cannot take (no ``extra_info["question"]``, no references, an empty or
whitespace-only answer, a reasoning block that never closes) scores 0.0 with ``error`` 1.0 and
its reason; it never raises, since an exception would abort the training step.

Every form goes through the judge's dynamic batcher (:mod:`fastjudge.runtime.async_batcher`):
one thread owns the model, and concurrent calls (the reward loop's coroutines, or threads of a
pool) are merged into shared batches.

The judge is :func:`configure`'s, or loaded once per process from the reward kwargs
``fastjudge_model`` / ``fastjudge_device``, else ``$FASTJUDGE_MODEL`` / ``$FASTJUDGE_DEVICE``.
The device defaults to ``auto``: CUDA when this process sees a GPU, else the CPU. Ray hides the
GPUs from workers that reserve none (it sets ``CUDA_VISIBLE_DEVICES`` empty), as verl's reward
workers do, so there ``auto`` means the CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, Sequence

from .answers import AnswerError, answer_of, check_reasoning_mode
from .inputs import image_of, references_of

__all__ = ["compute_score", "compute_score_async", "compute_score_batch", "compute_score_float",
           "compute_score_visexmem", "compute_score_visexmem_async", "compute_score_holistic",
           "compute_score_holistic_async", "configure", "get_judge", "MODEL_OPTION",
           "DEVICE_OPTION", "REASONING_OPTION"]

#: reward kwargs naming the checkpoint and the device of the judge this process loads
MODEL_OPTION = "fastjudge_model"
DEVICE_OPTION = "fastjudge_device"
#: reward kwarg: ``strip`` (default) removes a completed reasoning block, ``keep`` judges as is
REASONING_OPTION = "fastjudge_reasoning"
#: the judge kinds, each with its own forms (``compute_score`` is LAVE's)
JUDGE_KINDS = ("lave", "visexmem", "holistic")

_lock = threading.Lock()
_configured = None
_loaded: dict[tuple[str, str, str], Any] = {}


def configure(judge) -> None:
    """Set the judge every form uses (``None``: load from the reward kwargs or the environment
    again; judges loaded so far are released)."""
    global _configured
    with _lock:
        _configured = judge
        released = list(_loaded.values())
        _loaded.clear()
    for j in released:
        batcher = getattr(j, "_async_batcher", None)
        if batcher is not None:
            batcher.close()


def _checked_device(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{DEVICE_OPTION}={device!r}, but this process sees no GPU (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); Ray hides the GPUs from workers that "
                "reserve none, such as verl's reward workers")
    return device


def get_judge(judge_kind: str = "lave", **reward_kwargs):
    """The judge the ``compute_score`` forms of ``judge_kind`` use when called with
    ``reward_kwargs``, loaded on first use (once per kind, checkpoint and device)."""
    with _lock:
        if _configured is not None:
            return _configured
        model = reward_kwargs.get(MODEL_OPTION) or os.environ.get("FASTJUDGE_MODEL")
        if not model:
            raise RuntimeError(
                "fastjudge.rl.compute_score has no judge: call fastjudge.rl.configure(LaveJudge(...)), "
                f"pass the reward kwarg {MODEL_OPTION} or set FASTJUDGE_MODEL to a checkpoint directory")
        device = str(reward_kwargs.get(DEVICE_OPTION) or os.environ.get("FASTJUDGE_DEVICE") or "auto")
        key = (judge_kind, str(model), device)
        if key not in _loaded:  # loaded under the lock: concurrent first calls load it once
            from .. import HolisticJudge, LaveJudge, VisExJudge
            from ..engine_options import EngineOptions

            kind = {"lave": LaveJudge, "visexmem": VisExJudge, "holistic": HolisticJudge}[judge_kind]
            _loaded[key] = kind(str(model), engine=EngineOptions(device=_checked_device(device)))
        return _loaded[key]


class MissingField(ValueError):
    """An item verl handed over without a field the judge needs."""


def _reasoning(kwargs: dict) -> str:
    mode = str(kwargs.get(REASONING_OPTION) or os.environ.get("FASTJUDGE_REASONING") or "strip")
    check_reasoning_mode(mode)
    return mode


def item_fields(kind: str, solution_str: Any, ground_truth: Any, extra_info: dict | None,
                where: str = "", reasoning: str = "strip") -> dict:
    """The judge's fields of one verl item: LAVE's question (``extra_info["question"]``),
    references (``ground_truth``), prediction and optional caption; the image judges' image
    (``extra_info["image"]``, or ``extra_info["images"]`` holding one) and text. The
    prediction/text is the answer in ``solution_str`` (:mod:`fastjudge.rl.answers`).
    :class:`MissingField` or :class:`~fastjudge.rl.answers.AnswerError` says what is missing."""
    info = extra_info if isinstance(extra_info, dict) else {}
    answer = answer_of(solution_str, reasoning)
    if kind == "lave":
        question = info.get("question")
        if not isinstance(question, str) or not question.strip():
            raise MissingField(f'no extra_info["question"] (the VQA question){where}: the dataset '
                               "rows need it beside reward_model.ground_truth")
        return {"question": question, "references": references_of(ground_truth),
                "prediction": answer, "caption": info.get("caption")}
    image = info.get("image")
    if image is None and info.get("images") is not None:
        images = list(info["images"])
        if len(images) != 1:
            raise MissingField(f'extra_info["images"] holds {len(images)} images{where}; the judge '
                               "takes one")
        image = images[0]
    if image is None:
        raise MissingField(f'no extra_info["image"] (or "images"){where}: the {kind} judge checks '
                           "the text against the row's image")
    return {"image": image_of(image), "text": answer}


def _example(kind: str, fields: dict):
    if kind == "lave":
        from ..judges.lave import VQAExample

        return VQAExample(fields["question"], fields["references"], fields["prediction"],
                          fields.get("caption"))
    from ..judges.visexmem import ImageTextExample

    return ImageTextExample(image=fields["image"], text=fields["text"])


def _get(result: Any, name: str):
    """A result's field: a judge's result object, or one result of the server's JSON."""
    return result.get(name) if isinstance(result, dict) else getattr(result, name, None)


def _numbers(kind: str, result: Any) -> dict[str, float]:
    """The per-judge numbers of a judged item (all 0.0 for ``result=None``). ``acc`` is the
    judge's verdict as an accuracy, which DAPO's group filter reads
    (``algorithm.filter_groups.metric=acc``): the LAVE score, the VisExMEM score, and for the
    holistic judge 1.0 when it decided "yes"."""
    if kind == "lave":
        from ..judges.lave import RATINGS

        probs = list(_get(result, "probs") or []) if result is not None else []
        out = {"score": float(_get(result, "score") or 0.0) if result is not None else 0.0,
               "rating": float(_get(result, "rating") or 0.0) if result is not None else 0.0,
               "soft_score": float(_get(result, "soft_score") or 0.0) if result is not None else 0.0}
        out.update({f"prob_{r}": float(probs[k]) if k < len(probs) else 0.0
                    for k, r in enumerate(RATINGS)})
        return {**out, "acc": out["score"]}
    score = float(_get(result, "score") or 0.0) if result is not None else 0.0
    if kind == "visexmem":
        claims = float(len(_get(result, "claims") or [])) if result is not None else 0.0
        return {"score": score, "claims": claims, "acc": score}
    yes = 1.0 if result is not None and _get(result, "decision") == "yes" else 0.0
    return {"score": score, "yes": yes, "acc": yes}


def error_dict(kind: str, reason: str) -> dict[str, Any]:
    """The dict of an item that was not judged: every number 0.0 but ``error``."""
    return {**_numbers(kind, None), "error": 1.0, "error_reason": reason}


def result_dict(kind: str, result: Any) -> dict[str, Any]:
    """A judge's result (object or JSON) as numbers plus ``error_reason``; an item the judge
    rejected is :func:`error_dict`, so every item has the same keys."""
    if _get(result, "error") is not None:
        return error_dict(kind, str(_get(result, "error")))
    return {**_numbers(kind, result), "error": 0.0, "error_reason": ""}


def _score_blocking(judge, examples: list) -> list:
    """``judge.ascore`` from synchronous code: the items join the batcher's queue beside every
    other caller's, and this thread waits for its own results."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the usual case: a worker thread with no event loop
        return asyncio.run(judge.ascore(examples))
    # called from inside a running event loop: wait on a helper thread's loop instead
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(judge.ascore(examples))).result()


def _one(kind: str, solution_str: Any, ground_truth: Any, extra_info: Any, kwargs: dict):
    """The example of one item, or the error dict of an item that cannot be judged."""
    try:
        return _example(kind, item_fields(kind, solution_str, ground_truth, extra_info,
                                          reasoning=_reasoning(kwargs)))
    except (MissingField, AnswerError) as missing:
        return error_dict(kind, str(missing))


def _score_one(kind: str, solution_str: Any, ground_truth: Any, extra_info: Any,
               kwargs: dict) -> dict[str, Any]:
    example = _one(kind, solution_str, ground_truth, extra_info, kwargs)
    if isinstance(example, dict):
        return example
    return result_dict(kind, _score_blocking(get_judge(kind, **kwargs), [example])[0])


async def _ascore_one(kind: str, solution_str: Any, ground_truth: Any, extra_info: Any,
                      kwargs: dict) -> dict[str, Any]:
    example = _one(kind, solution_str, ground_truth, extra_info, kwargs)
    if isinstance(example, dict):
        return example
    judge = await asyncio.to_thread(get_judge, kind, **kwargs)  # a first call loads the model
    return result_dict(kind, (await judge.ascore([example]))[0])


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """verl custom reward: the LAVE judgement of ``solution_str`` as a dict (see the module
    docstring); ``score`` is the reward, ``acc`` the same value for DAPO's group filter.

    ``ground_truth`` is the reference answers (a list, an array, a JSON list string, or one
    string); the question comes from ``extra_info["question"]`` (optional
    ``extra_info["caption"]``). ``data_source`` and verl's other keyword arguments
    (``reward_router_address``, ``reward_model_tokenizer``) are not used; of the reward
    kwargs, ``fastjudge_model`` and ``fastjudge_device`` choose the judge and
    ``fastjudge_reasoning`` (``strip``/``keep``) what is judged. Safe to call from many threads
    at once.

    Example::

        from fastjudge import LaveJudge
        from fastjudge import rl

        rl.configure(LaveJudge("/models/flan-t5-xl"))
        print(rl.compute_score("vqav2", "skiing", ["skiing", "ski"],
                               {"question": "What sport is this?"})["score"])
    """
    return _score_one("lave", solution_str, ground_truth, extra_info, kwargs)


def compute_score_float(data_source: str, solution_str: str, ground_truth: Any,
                        extra_info: dict | None = None, **kwargs: Any) -> float:
    """:func:`compute_score`'s ``score`` alone."""
    return compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)["score"]


async def compute_score_async(data_source: str, solution_str: str, ground_truth: Any,
                              extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`compute_score` for verl's reward loop, which awaits it: concurrent calls share
    the judge's batches."""
    return await _ascore_one("lave", solution_str, ground_truth, extra_info, kwargs)


def compute_score_visexmem(data_source: str, solution_str: str, ground_truth: Any,
                           extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """verl custom reward with a :class:`~fastjudge.VisExJudge`: ``solution_str``'s answer,
    as a caption, checked against ``extra_info["image"]`` (a path, encoded bytes, a PIL image,
    or ``{"bytes", "path"}``; or ``extra_info["images"]`` holding one). Keys: ``score``,
    ``claims`` (claims checked), ``acc`` (= score), ``error``, ``error_reason``.
    ``ground_truth`` is not used."""
    return _score_one("visexmem", solution_str, ground_truth, extra_info, kwargs)


async def compute_score_visexmem_async(data_source: str, solution_str: str, ground_truth: Any,
                                       extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`compute_score_visexmem`, awaited by verl's reward loop."""
    return await _ascore_one("visexmem", solution_str, ground_truth, extra_info, kwargs)


def compute_score_holistic(data_source: str, solution_str: str, ground_truth: Any,
                           extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """As :func:`compute_score_visexmem` with a :class:`~fastjudge.HolisticJudge`: ``score``
    is P(yes) that the image shows the answer; ``yes`` and ``acc`` are 1.0 when the judge
    decided "yes"."""
    return _score_one("holistic", solution_str, ground_truth, extra_info, kwargs)


async def compute_score_holistic_async(data_source: str, solution_str: str, ground_truth: Any,
                                       extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`compute_score_holistic`, awaited by verl's reward loop."""
    return await _ascore_one("holistic", solution_str, ground_truth, extra_info, kwargs)


def compute_score_batch(data_sources: Sequence, solution_strs: Sequence, ground_truths: Sequence,
                        extra_infos: Sequence, **kwargs: Any) -> list[dict[str, Any]]:
    """verl's batched form (``reward_model.reward_manager=batch``, verl up to v0.7.0): one
    dict per item, in order, all items scored together; an item without a question or an
    answer gets its error dict, the others are still judged."""
    if not len(solution_strs) == len(ground_truths) == len(extra_infos):
        raise ValueError(f"lengths differ: {len(solution_strs)} solution_strs, "
                         f"{len(ground_truths)} ground_truths, {len(extra_infos)} extra_infos")
    reasoning = _reasoning(kwargs)
    out: list = [None] * len(solution_strs)
    rows, examples = [], []
    for i, (s, g, e) in enumerate(zip(solution_strs, ground_truths, extra_infos)):
        try:
            examples.append(_example("lave", item_fields("lave", s, g, e, f" (item {i})", reasoning)))
            rows.append(i)
        except (MissingField, AnswerError) as missing:
            out[i] = error_dict("lave", f"item {i}: {missing}" if isinstance(missing, AnswerError)
                                else str(missing))
    if examples:
        for i, r in zip(rows, _score_blocking(get_judge("lave", **kwargs), examples)):
            out[i] = result_dict("lave", r)
    return out
