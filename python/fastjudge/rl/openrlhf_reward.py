"""OpenRLHF's in-process reward function: ``reward_func(queries, prompts, labels)``.

``--reward.remote_url`` (``--remote_rm_url`` before v0.10.2) takes either server URLs or the
path of a Python file ending in ``.py``, which OpenRLHF loads standalone
(``importlib.util.spec_from_file_location``) and whose ``reward_func`` it calls on a thread,
one sample per call (``openrlhf/utils/agent.py``, ``SingleTurnAgentExecutor``,
``_fetch_rewards_via_func``). This is such a file; ``python -m fastjudge.rl.openrlhf_reward``
prints its path::

    export FASTJUDGE_JUDGE=lave FASTJUDGE_MODEL=/models/flan-t5-xl
    export FASTJUDGE_POLICY_TEMPLATE=/models/Qwen3.5-4B      # the policy's tokenizer directory
    python -m openrlhf.cli.train_ppo_ray ... \\
        --reward.remote_url $(python -m fastjudge.rl.openrlhf_reward) --data.label_key label

The judge is loaded once per process and shared by every call: its dynamic batcher merges the
concurrent calls' samples into batches. The queries are read exactly as ``/get_reward`` reads
them (:mod:`fastjudge.serve.openrlhf`). Settings (environment, read at the first call):

* ``FASTJUDGE_JUDGE``: ``lave`` (default), ``visexmem`` or ``holistic``;
* ``FASTJUDGE_MODEL``, ``FASTJUDGE_DEVICE`` (default ``auto``): the judge's checkpoint;
* ``FASTJUDGE_POLICY_TEMPLATE``: the policy's tokenizer directory or chat template file, whose
  markers split the queries (unset: tables of common templates);
* ``FASTJUDGE_REASONING``: ``strip`` (default) or ``keep``;
* ``FASTJUDGE_REWARD_ON_ERROR``: the reward of a sample that cannot be judged (default 0.0);
* ``FASTJUDGE_IMAGE_ROOT``: image paths in labels are read only under it;
* ``FASTJUDGE_IMAGE_URL_PREFIXES``: image URLs in labels are fetched only under these
  (space-separated) prefixes.

It returns ``{"rewards", "scores", "extra_logs": {"error", "rating"}}`` as tensors, what the
executor reads; a sample that cannot be judged gets the error reward, ``extra_logs.error`` 1.0,
and its reason logged (the ``fastjudge`` logger, warning level).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from fastjudge.judges.registry import get_judge as judge_spec
from fastjudge.rl.answers import check_reasoning_mode
from fastjudge.serve import openrlhf

__all__ = ["reward_func", "configure"]

log = logging.getLogger("fastjudge")

_lock = threading.Lock()
_state: dict[str, Any] = {}


def configure(judge=None, judge_name: str = "lave", markers=None, reasoning: str = "strip",
              reward_on_error: float = 0.0, image_root: str | None = None,
              image_url_prefixes: tuple[str, ...] = ()) -> None:
    """Set what :func:`reward_func` uses instead of reading the environment (``judge=None``:
    read it again at the next call)."""
    check_reasoning_mode(reasoning)
    with _lock:
        _state.clear()
        if judge is not None:
            _state.update(judge=judge, name=judge_name, markers=markers, reasoning=reasoning,
                          reward_on_error=float(reward_on_error), image_root=image_root,
                          prefixes=tuple(image_url_prefixes))


def _settings() -> dict:
    with _lock:
        if not _state:
            from fastjudge import HolisticJudge, LaveJudge, VisExJudge
            from fastjudge.engine_options import EngineOptions
            from fastjudge.rl.chat_markers import load_markers

            name = os.environ.get("FASTJUDGE_JUDGE", "lave")
            kinds = {"lave": LaveJudge, "visexmem": VisExJudge, "holistic": HolisticJudge}
            if name not in kinds:
                raise ValueError(f"FASTJUDGE_JUDGE={name!r}: one of {', '.join(kinds)}")
            model = os.environ.get("FASTJUDGE_MODEL")
            if not model:
                raise RuntimeError("the fastjudge reward_func needs FASTJUDGE_MODEL (the judge's "
                                   "checkpoint directory)")
            reasoning = os.environ.get("FASTJUDGE_REASONING", "strip")
            check_reasoning_mode(reasoning)
            device = os.environ.get("FASTJUDGE_DEVICE", "auto")
            template = os.environ.get("FASTJUDGE_POLICY_TEMPLATE")
            _state.update(judge=kinds[name](model, engine=EngineOptions(device=device)), name=name,
                          markers=load_markers(template) if template else None,
                          reasoning=reasoning,
                          reward_on_error=float(os.environ.get("FASTJUDGE_REWARD_ON_ERROR", 0.0)),
                          image_root=os.environ.get("FASTJUDGE_IMAGE_ROOT") or None,
                          prefixes=tuple(os.environ.get("FASTJUDGE_IMAGE_URL_PREFIXES", "").split()))
        return dict(_state)


def reward_func(queries, prompts, labels, **kwargs) -> dict:
    """The rewards of ``queries`` (the prompt and the response decoded together), one per
    sample, as OpenRLHF's executor reads them (see the module docstring)."""
    import torch

    from fastjudge.rl.verl import _score_blocking

    s = _settings()
    spec = judge_spec(s["name"])
    fetch = openrlhf.fetch_label_image(64 * 1024 * 1024)
    labels = list(labels) if labels is not None else [None] * len(queries)
    items: list = []
    for i, (query, prompt, label) in enumerate(zip(queries, prompts, labels)):
        try:
            items.append(openrlhf.stock_example(spec, query, prompt, label, f"sample {i}",
                                                s["name"] == "lave", s["image_root"], s["markers"],
                                                s["reasoning"], s["prefixes"], fetch))
        except ValueError as bad:  # ItemError, or an image that does not decode
            items.append(bad)
    examples = [x for x in items if not isinstance(x, Exception)]
    scored = iter(_score_blocking(s["judge"], examples) if examples else [])
    rewards, errors, ratings = [], [], []
    for x in items:
        r = None if isinstance(x, Exception) else next(scored)
        problem = str(x) if r is None else r.error
        if problem:
            log.warning("fastjudge reward_func: %s; reward %s", problem, s["reward_on_error"])
        rewards.append(s["reward_on_error"] if problem else float(r.score))
        errors.append(1.0 if problem else 0.0)
        rating = getattr(r, "rating", None)
        ratings.append(float(rating) if not problem and rating is not None else 0.0)
    tensor = torch.tensor(rewards, dtype=torch.float32)
    return {"rewards": tensor, "scores": tensor.clone(),
            "extra_logs": {"error": torch.tensor(errors), "rating": torch.tensor(ratings)}}


if __name__ == "__main__":
    print(os.path.abspath(__file__))
