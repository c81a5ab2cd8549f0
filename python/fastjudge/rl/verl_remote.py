"""verl custom reward functions that post to one running ``fastjudge serve``: one judge for the
whole job.

With :mod:`fastjudge.rl.verl`, every verl reward worker loads a judge of its own (8 per job by
default; the ``remote`` manager's Ray workers each load one more). Here each call posts its
item to ``/v1/score`` of one server instead, and the server's dynamic batcher merges the items
of every worker, thread and coroutine into shared batches: start one server on the GPU you
give the judge, and point every worker at it::

    fastjudge serve --judge lave --model /models/flan-t5-xl --host 0.0.0.0 --port 8000
    python -m verl.trainer.main_ppo ... \\
        reward.custom_reward_function.path=pkg://fastjudge.rl.verl_remote \\
        reward.custom_reward_function.name=compute_score_async \\
        +reward.custom_reward_function.reward_kwargs.fastjudge_url=http://judge-host:8000

(``custom_reward_function.*`` before verl v0.7.1. Releases before v0.7.0 take only a file
path: ``$(python -m fastjudge.rl.verl_entry)`` with the name ``remote_compute_score``, and so
on for every form, ``remote_`` before its name.)

The forms and their dicts are those of :mod:`fastjudge.rl.verl` (``compute_score``,
``compute_score_async``, ``compute_score_batch``, ``compute_score_visexmem[_async]``,
``compute_score_holistic[_async]``), with the same keys, ``acc`` included, and the same
answer extraction; the server must serve the judge of the form (checked once per URL on
``/health``).

Reward kwargs (else the environment): ``fastjudge_url`` (``$FASTJUDGE_URL``), ``fastjudge_api_key``
(``$FASTJUDGE_API_KEY``, when the server has ``--api-key``), ``fastjudge_timeout_s`` (300),
``fastjudge_max_attempts`` (16), ``fastjudge_reasoning``.

Failures, as verl's own reward-loop client treats them (``RewardLoopWorker._post_request``,
``verl/experimental/reward_loop/reward_loop.py``): a 5xx answer (503: the server's judge failed
and nothing was scored), a 429 (its queue is full), a lost connection or a timeout is retried,
up to ``fastjudge_max_attempts`` posts, waiting the answer's ``Retry-After`` or else
``min(2**attempt, 30)`` seconds; when every attempt failed the call raises, since a judge that
is gone must stop the run rather than hand out error rewards. So does a 401, 403 or 404 (a
wrong key or URL). Another 4xx answer (an item the server refuses) is the item's error dict,
not retried.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from fastjudge.rl.answers import AnswerError
from fastjudge.rl.verl import MissingField, _reasoning, error_dict, item_fields, result_dict

__all__ = ["compute_score", "compute_score_async", "compute_score_batch",
           "compute_score_visexmem", "compute_score_visexmem_async", "compute_score_holistic",
           "compute_score_holistic_async", "URL_OPTION"]

log = logging.getLogger("fastjudge")

URL_OPTION = "fastjudge_url"
API_KEY_OPTION = "fastjudge_api_key"
TIMEOUT_OPTION = "fastjudge_timeout_s"
ATTEMPTS_OPTION = "fastjudge_max_attempts"
#: as verl's reward-loop client: 16 posts, the pause doubling up to 30 s
DEFAULT_MAX_ATTEMPTS = 16
MAX_BACKOFF_S = 30.0

_checked: dict[str, str] = {}  # server URL -> the judge it serves


class _Retry(Exception):
    """A failed post worth repeating, with the pause the server asked for (None: back off)."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class Refused(Exception):
    """A 4xx answer: the server refuses this item; the message is its reason."""


def _option(kwargs: dict, name: str, env: str, default: Any = None) -> Any:
    value = kwargs.get(name)
    return value if value not in (None, "") else os.environ.get(env, default)


def _settings(kwargs: dict) -> tuple[str, str | None, float, int]:
    url = _option(kwargs, URL_OPTION, "FASTJUDGE_URL")
    if not url:
        raise RuntimeError(f"fastjudge.rl.verl_remote needs the server's URL: pass the reward kwarg "
                           f"{URL_OPTION} (e.g. http://judge-host:8000) or set FASTJUDGE_URL")
    key = _option(kwargs, API_KEY_OPTION, "FASTJUDGE_API_KEY")
    timeout = float(_option(kwargs, TIMEOUT_OPTION, "FASTJUDGE_TIMEOUT_S", 300))
    attempts = int(_option(kwargs, ATTEMPTS_OPTION, "FASTJUDGE_MAX_ATTEMPTS", DEFAULT_MAX_ATTEMPTS))
    return str(url).rstrip("/"), key, timeout, max(1, attempts)


def _attempt(method: str, url: str, body: Any, key: str | None, timeout: float) -> Any:
    """One request: its JSON answer, :class:`_Retry` or :class:`Refused`."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as bad:
        text = bad.read().decode("utf-8", "replace")
        try:
            message = json.loads(text).get("error", text)
        except (ValueError, AttributeError):
            message = text
        if bad.code >= 500 or bad.code == 429:
            after = bad.headers.get("Retry-After")
            raise _Retry(f"HTTP {bad.code}: {message}",
                         float(after) if after and after.strip().isdigit() else None) from None
        if bad.code in (401, 403, 404, 405):  # a wrong key or URL: no item is to blame
            raise RuntimeError(f"fastjudge server {url}: HTTP {bad.code}: {message}") from None
        raise Refused(f"the judge server refused the item (HTTP {bad.code}): {message}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as bad:  # lost connection, timeout
        raise _Retry(f"{type(bad).__name__}: {bad}") from None


def _pause(attempt: int, failure: _Retry) -> float:
    return failure.retry_after if failure.retry_after is not None else min(2.0 ** attempt, MAX_BACKOFF_S)


def _gave_up(url: str, attempts: int, failure: Exception) -> RuntimeError:
    return RuntimeError(f"fastjudge server {url}: {attempts} posts failed, the last with {failure}")


def _request(method: str, url: str, body: Any, key: str | None, timeout: float, attempts: int):
    for attempt in range(attempts):
        try:
            return _attempt(method, url, body, key, timeout)
        except _Retry as failure:
            log.warning("fastjudge server %s: attempt %d/%d failed (%s)", url, attempt + 1,
                        attempts, failure)
            if attempt == attempts - 1:
                raise _gave_up(url, attempts, failure) from None
            time.sleep(_pause(attempt, failure))


async def _arequest(method: str, url: str, body: Any, key: str | None, timeout: float, attempts: int):
    """:func:`_request` for verl's reward loop: the post runs on a thread, the pauses are the
    event loop's, so a coroutine waiting out a 503 holds no thread."""
    for attempt in range(attempts):
        try:
            return await asyncio.to_thread(_attempt, method, url, body, key, timeout)
        except _Retry as failure:
            log.warning("fastjudge server %s: attempt %d/%d failed (%s)", url, attempt + 1,
                        attempts, failure)
            if attempt == attempts - 1:
                raise _gave_up(url, attempts, failure) from None
            await asyncio.sleep(_pause(attempt, failure))


def _check_judge(kind: str, served: Any, url: str) -> None:
    judge = served.get("judge") if isinstance(served, dict) else None
    if judge != kind:
        raise RuntimeError(f"fastjudge server {url} serves the {judge!r} judge; this reward function "
                           f"needs {kind!r} (start the server with --judge {kind}, or use the "
                           f"{judge} form)")
    _checked[url] = kind


def encoded_image(image: Any) -> str:
    """An image as base64 of its encoded bytes (the server reads no files): a path, encoded
    bytes, a PIL image or an array."""
    if isinstance(image, (bytes, bytearray)):
        data = bytes(image)
    elif isinstance(image, (str, os.PathLike)):
        if str(image).startswith(("http://", "https://")):
            raise MissingField("the image is a URL; this form sends the image's bytes: give the "
                               "row a path or the image itself")
        try:
            with open(image, "rb") as f:
                data = f.read()
        except OSError as bad:
            raise MissingField(f"the image {str(image)!r} cannot be read: {bad}") from None
    else:
        from PIL import Image

        picture = image if isinstance(image, Image.Image) else Image.fromarray(image)
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        data = buffer.getvalue()
    return base64.b64encode(data).decode("ascii")


def _item(kind: str, fields: dict) -> dict:
    """The ``/v1/score`` item of one verl item's judge fields."""
    if kind == "lave":
        refs = [r if isinstance(r, (str, dict)) else str(r) for r in fields["references"]]
        item = {"question": fields["question"], "references": refs, "prediction": fields["prediction"]}
        if isinstance(fields.get("caption"), str):
            item["caption"] = fields["caption"]
        return item
    return {"image_b64": encoded_image(fields["image"]), "text": fields["text"]}


def _items(kind: str, calls: Sequence[tuple], kwargs: dict) -> tuple[list, list]:
    """``(out, items)``: ``out[i]`` an error dict or None (to be scored), ``items`` the
    ``/v1/score`` items of the rest, in order."""
    reasoning = _reasoning(kwargs)
    out, items = [], []
    for i, (solution_str, ground_truth, extra_info) in enumerate(calls):
        where = f" (item {i})" if len(calls) > 1 else ""
        try:
            items.append(_item(kind, item_fields(kind, solution_str, ground_truth, extra_info,
                                                 where, reasoning)))
            out.append(None)
        except (MissingField, AnswerError) as missing:
            out.append(error_dict(kind, str(missing)))
    return out, items


def _merge(kind: str, out: list, answer: Any, refused: str | None) -> list[dict]:
    results = iter(answer["results"] if answer is not None else [])
    return [o if o is not None else
            (error_dict(kind, refused) if refused else result_dict(kind, next(results)))
            for o in out]


def _score(kind: str, calls: Sequence[tuple], kwargs: dict) -> list[dict]:
    url, key, timeout, attempts = _settings(kwargs)
    if _checked.get(url) != kind:
        _check_judge(kind, _request("GET", f"{url}/health", None, key, timeout, attempts), url)
    out, items = _items(kind, calls, kwargs)
    answer, refused = None, None
    if items:
        try:
            answer = _request("POST", f"{url}/v1/score", {"items": items}, key, timeout, attempts)
        except Refused as bad:
            refused = str(bad)
    return _merge(kind, out, answer, refused)


async def _ascore(kind: str, calls: Sequence[tuple], kwargs: dict) -> list[dict]:
    url, key, timeout, attempts = _settings(kwargs)
    if _checked.get(url) != kind:
        _check_judge(kind, await _arequest("GET", f"{url}/health", None, key, timeout, attempts), url)
    out, items = await asyncio.to_thread(_items, kind, calls, kwargs)  # may read image files
    answer, refused = None, None
    if items:
        try:
            answer = await _arequest("POST", f"{url}/v1/score", {"items": items}, key, timeout, attempts)
        except Refused as bad:
            refused = str(bad)
    return _merge(kind, out, answer, refused)


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`fastjudge.rl.verl.compute_score` (LAVE), judged by the server at ``fastjudge_url``."""
    return _score("lave", [(solution_str, ground_truth, extra_info)], kwargs)[0]


async def compute_score_async(data_source: str, solution_str: str, ground_truth: Any,
                              extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`compute_score` for verl's reward loop, which awaits it."""
    return (await _ascore("lave", [(solution_str, ground_truth, extra_info)], kwargs))[0]


def compute_score_batch(data_sources: Sequence, solution_strs: Sequence, ground_truths: Sequence,
                        extra_infos: Sequence, **kwargs: Any) -> list[dict[str, Any]]:
    """verl's batched form (``reward_manager=batch``, up to v0.7.0): all items in one post."""
    if not len(solution_strs) == len(ground_truths) == len(extra_infos):
        raise ValueError(f"lengths differ: {len(solution_strs)} solution_strs, "
                         f"{len(ground_truths)} ground_truths, {len(extra_infos)} extra_infos")
    return _score("lave", list(zip(solution_strs, ground_truths, extra_infos)), kwargs)


def compute_score_visexmem(data_source: str, solution_str: str, ground_truth: Any,
                           extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`fastjudge.rl.verl.compute_score_visexmem`, judged by the server (``--judge visexmem``)."""
    return _score("visexmem", [(solution_str, ground_truth, extra_info)], kwargs)[0]


async def compute_score_visexmem_async(data_source: str, solution_str: str, ground_truth: Any,
                                       extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`compute_score_visexmem`, awaited by verl's reward loop."""
    return (await _ascore("visexmem", [(solution_str, ground_truth, extra_info)], kwargs))[0]


def compute_score_holistic(data_source: str, solution_str: str, ground_truth: Any,
                           extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`fastjudge.rl.verl.compute_score_holistic`, judged by the server (``--judge holistic``)."""
    return _score("holistic", [(solution_str, ground_truth, extra_info)], kwargs)[0]


async def compute_score_holistic_async(data_source: str, solution_str: str, ground_truth: Any,
                                       extra_info: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    """:func:`compute_score_holistic`, awaited by verl's reward loop."""
    return (await _ascore("holistic", [(solution_str, ground_truth, extra_info)], kwargs))[0]
