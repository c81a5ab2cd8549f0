"""verl custom reward functions over one LAVE judge per process.

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

* :func:`compute_score`: one item; a dict with the same keys for every item (``score``,
  ``rating``, ``soft_score``, ``prob_1``..``prob_3``, ``error`` as numbers; ``error_reason``,
  the text of why an item was not judged, empty when it was), since verl stacks each key over
  the batch (string keys are kept, not averaged). Every reward manager of v0.7.1+ calls it:
  ``naive``, ``dapo``, ``gdpo``, ``rate_limited`` on a thread pool, ``remote`` in its own Ray
  worker processes (one judge per worker).
* :func:`compute_score_async`: the same as an ``async def``; the reward loop's managers
  (``naive``, ``dapo``, ``gdpo``, ``rate_limited``; not ``remote``) await it (they check
  ``inspect.iscoroutinefunction``) instead of running it on a thread pool.
* :func:`compute_score_batch`: lists in, a list of dicts out, for ``reward_manager=batch``,
  which exists up to v0.7.0 only.
* :func:`compute_score_float`: the score alone, for ``reward_manager=prime`` (up to v0.7.0).

An item the judge cannot take (no ``extra_info["question"]``, no references, an empty answer)
scores 0.0 with ``error`` 1.0 and its reason; it never raises, since an exception would abort
the training step.

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

from .inputs import references_of, text_of

__all__ = ["compute_score", "compute_score_async", "compute_score_batch", "compute_score_float",
           "configure", "get_judge", "MODEL_OPTION", "DEVICE_OPTION"]

#: reward kwargs naming the checkpoint and the device of the judge this process loads
MODEL_OPTION = "fastjudge_model"
DEVICE_OPTION = "fastjudge_device"

_lock = threading.Lock()
_configured = None
_loaded: dict[tuple[str, str], Any] = {}


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


def get_judge(**reward_kwargs):
    """The judge the ``compute_score`` forms use when called with ``reward_kwargs``, loaded on
    first use (once per checkpoint and device)."""
    with _lock:
        if _configured is not None:
            return _configured
        model = reward_kwargs.get(MODEL_OPTION) or os.environ.get("FASTJUDGE_MODEL")
        if not model:
            raise RuntimeError(
                "fastjudge.rl.compute_score has no judge: call fastjudge.rl.configure(LaveJudge(...)), "
                f"pass the reward kwarg {MODEL_OPTION} or set FASTJUDGE_MODEL to a checkpoint directory")
        device = str(reward_kwargs.get(DEVICE_OPTION) or os.environ.get("FASTJUDGE_DEVICE") or "auto")
        key = (str(model), device)
        if key not in _loaded:  # loaded under the lock: concurrent first calls load it once
            from ..engine_options import EngineOptions
            from ..judges.lave import LaveJudge

            _loaded[key] = LaveJudge(str(model), engine=EngineOptions(device=_checked_device(device)))
        return _loaded[key]


class MissingField(ValueError):
    """An item verl handed over without a field the judge needs."""


def _example(solution_str: str, ground_truth: Any, extra_info: dict | None, where: str = ""):
    from ..judges.lave import VQAExample

    info = extra_info if isinstance(extra_info, dict) else {}
    question = info.get("question")
    if not isinstance(question, str) or not question.strip():
        raise MissingField(f'no extra_info["question"] (the VQA question){where}: the dataset '
                           "rows need it beside reward_model.ground_truth")
    return VQAExample(question, references_of(ground_truth), text_of(solution_str), info.get("caption"))


def _error_dict(reason: str) -> dict[str, Any]:
    """The dict of an item that was not judged: every number 0.0 but ``error``."""
    from ..judges.lave import RATINGS

    out: dict[str, Any] = {"score": 0.0, "rating": 0.0, "soft_score": 0.0}
    out.update({f"prob_{rating}": 0.0 for rating in RATINGS})
    return {**out, "error": 1.0, "error_reason": reason}


def _as_dict(result) -> dict[str, Any]:
    """A result as numbers plus ``error_reason``: an item the judge rejected scores 0.0 with
    ``error`` 1.0 and zero rating and probabilities, so that every item has the same keys."""
    from ..judges.lave import RATINGS

    if result.error is not None:
        return _error_dict(str(result.error))
    probs = list(result.probs) if result.probs is not None else []
    out = {"score": float(result.score), "rating": float(result.rating),
           "soft_score": float(result.soft_score) if result.soft_score is not None else 0.0}
    for k, rating in enumerate(RATINGS):
        out[f"prob_{rating}"] = float(probs[k]) if k < len(probs) else 0.0
    return {**out, "error": 0.0, "error_reason": ""}


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


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """verl custom reward: the LAVE judgement of ``solution_str`` as a dict (see the module
    docstring); ``score`` is the reward.

    ``ground_truth`` is the reference answers (a list, an array, a JSON list string, or one
    string); the question comes from ``extra_info["question"]`` (optional
    ``extra_info["caption"]``). ``data_source`` and verl's other keyword arguments
    (``reward_router_address``, ``reward_model_tokenizer``) are not used; of the reward
    kwargs, ``fastjudge_model`` and ``fastjudge_device`` choose the judge. Safe to call from
    many threads at once.

    Example::

        from fastjudge import LaveJudge
        from fastjudge import rl

        rl.configure(LaveJudge("/models/flan-t5-xl"))
        print(rl.compute_score("vqav2", "skiing", ["skiing", "ski"],
                               {"question": "What sport is this?"})["score"])
    """
    try:
        example = _example(solution_str, ground_truth, extra_info)
    except MissingField as missing:
        return _error_dict(str(missing))
    return _as_dict(_score_blocking(get_judge(**kwargs), [example])[0])


def compute_score_float(data_source: str, solution_str: str, ground_truth: Any,
                        extra_info: dict | None = None, **kwargs: Any) -> float:
    """:func:`compute_score`'s ``score`` alone."""
    return compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)["score"]


async def compute_score_async(data_source: str, solution_str: str, ground_truth: Any,
                              extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`compute_score` for verl's reward loop, which awaits it: concurrent calls share
    the judge's batches."""
    try:
        example = _example(solution_str, ground_truth, extra_info)
    except MissingField as missing:
        return _error_dict(str(missing))
    judge = await asyncio.to_thread(get_judge, **kwargs)  # a first call loads the model
    return _as_dict((await judge.ascore([example]))[0])


def compute_score_batch(data_sources: Sequence, solution_strs: Sequence, ground_truths: Sequence,
                        extra_infos: Sequence, **kwargs: Any) -> list[dict[str, Any]]:
    """verl's batched form (``reward_model.reward_manager=batch``, verl up to v0.7.0): one
    dict per item, in order, all items scored together; an item without a question gets its
    error dict, the others are still judged."""
    if not len(solution_strs) == len(ground_truths) == len(extra_infos):
        raise ValueError(f"lengths differ: {len(solution_strs)} solution_strs, "
                         f"{len(ground_truths)} ground_truths, {len(extra_infos)} extra_infos")
    out: list = [None] * len(solution_strs)
    rows, examples = [], []
    for i, (s, g, e) in enumerate(zip(solution_strs, ground_truths, extra_infos)):
        try:
            examples.append(_example(s, g, e, f" (item {i})"))
            rows.append(i)
        except MissingField as missing:
            out[i] = _error_dict(str(missing))
    if examples:
        for i, r in zip(rows, _score_blocking(get_judge(**kwargs), examples)):
            out[i] = _as_dict(r)
    return out
