"""verl's calls into fastjudge.rl, transcribed from verl's source (verl is not installed), on the
tiny random-weight Flan-T5 judge.

Upstream contracts (verl-project/verl v0.9.0, commit 483b8a009ba3a97563edee3a19887e4862b8094a,
unless a release is named):
- ``verl/utils/import_utils.py``, ``load_module`` / ``load_extern_object`` (from v0.7.0): a
  ``pkg://a.b`` (or ``pkg://a/b``) path is ``importlib.import_module("a.b")``, the function is
  ``getattr(module, name)``; any other path is loaded standalone from its file
  (``spec_from_file_location("custom_module_<hash>", path)``). Before v0.7.0 (v0.6.1, commit
  of the tag) ``get_custom_reward_fn`` loads only a file path, as ``custom_module``.
- ``verl/experimental/reward_loop/reward_manager/__init__.py`` (v0.7.1 on): the managers are
  ``naive``, ``dapo``, ``gdpo``, ``rate_limited``, ``remote``; ``naive.py`` ``run_single``
  takes ``extra_info = non_tensor_batch.get("extra_info", {})`` and adds ``num_turns`` and
  ``rollout_reward_scores`` to it; ``remote.py`` refuses an async function and calls the sync
  one in a Ray worker process.
- ``verl/trainer/ppo/reward.py``, ``get_custom_reward_fn``: the function is wrapped in
  ``functools.partial`` merging ``custom_reward_function.reward_kwargs`` into each call
  (``_call_with_kwargs``, or ``_call_with_kwargs_async`` when
  ``inspect.iscoroutinefunction(raw_fn)``).
- ``verl/experimental/reward_loop/reward_manager/naive.py``, ``NaiveRewardManager.__init__`` /
  ``run_single``: ``inspect.iscoroutinefunction(compute_score)`` (of that partial) chooses
  between awaiting it and ``loop.run_in_executor(None, ...)`` (the default thread pool); the call
  is ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)``; a dict result
  gives the reward as ``result["score"]`` and every key to ``reward_extra_info``.
- ``verl/experimental/reward_loop/reward_loop.py``, ``RewardLoopWorker.compute_score_batch``:
  one asyncio task per item, gathered; ``RewardLoopManager.compute_rm_score``: the keys of the
  first item's ``reward_extra_info``, ``np.array`` of each key over the items, the scores
  through ``torch.tensor(..., dtype=torch.float32)``.
- ``verl/workers/reward_manager/batch.py``, ``BatchRewardManager.verify`` / ``__call__``:
  ``compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=,
  **reward_kwargs)`` with ``data_sources`` a numpy array and each extra info given a
  ``rollout_reward_scores`` key; ``score["score"]`` per item, ``reward_extra_info[key]``
  appended per item.
- ``verl/trainer/ppo/metric_utils.py``, ``process_validation_metrics``: ``np.mean`` /
  ``np.std`` of each non-string extra key.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from fastjudge import rl
from fastjudge.judges.base import Judge
from fastjudge.judges.lave import VQAExample

NUMBERS = ["score", "rating", "soft_score", "prob_1", "prob_2", "prob_3", "acc", "error"]
KEYS = NUMBERS + ["error_reason"]
FORMS = ("compute_score", "compute_score_async", "compute_score_batch", "compute_score_float")


def rows(n: int) -> list[dict]:
    lines = resources.files("fastjudge.data").joinpath("sample_vqa.jsonl").read_text().splitlines()
    data = [json.loads(line) for line in lines if line.strip()]
    return [data[i % len(data)] for i in range(n)]


def one_by_one(judge, items: list[dict]) -> list:
    return [judge.score([VQAExample(r["question"], r["references"], r["prediction"])])[0]
            for r in items]


# -- verl, transcribed -------------------------------------------------------------------------
def verl_load_extern_object(module_path: str, object_name: str):
    """``load_module`` + ``load_extern_object`` for a ``pkg://`` path."""
    assert module_path.startswith("pkg://")
    module = importlib.import_module(module_path[len("pkg://"):].replace("/", "."))
    if not hasattr(module, object_name):
        raise AttributeError(f"Object not found in module: {object_name=}, {module_path=}.")
    return getattr(module, object_name)


def _call_with_kwargs(raw_fn, extra_kwargs, *args, **kwargs):
    return raw_fn(*args, **{**kwargs, **extra_kwargs})


async def _call_with_kwargs_async(raw_fn, extra_kwargs, *args, **kwargs):
    return await raw_fn(*args, **{**kwargs, **extra_kwargs})


def verl_custom_reward_fn(name: str, reward_kwargs: dict | None = None,
                          path: str = "pkg://fastjudge.rl"):
    """``get_custom_reward_fn`` with ``custom_reward_function.path/name/reward_kwargs``."""
    raw_fn = verl_load_extern_object(path, name)
    wrap = _call_with_kwargs_async if inspect.iscoroutinefunction(raw_fn) else _call_with_kwargs
    return functools.partial(wrap, raw_fn, dict(reward_kwargs or {}))


async def naive_run_single(compute_score, row: dict) -> dict:
    """``NaiveRewardManager.run_single`` from the decoded response on."""
    loop = asyncio.get_running_loop()
    extra_info = {"question": row["question"], "num_turns": None, "rollout_reward_scores": {}}
    call = dict(data_source="vqav2", solution_str=row["prediction"],
                ground_truth=row["references"], extra_info=extra_info)
    if inspect.iscoroutinefunction(compute_score):
        result = await compute_score(**call)
    else:
        result = await loop.run_in_executor(None, lambda: compute_score(**call))
    if isinstance(result, dict):
        return {"reward_score": result["score"], "reward_extra_info": dict(result)}
    return {"reward_score": result, "reward_extra_info": {"acc": result}}


def validation_metrics(infos: dict) -> set:
    """``process_validation_metrics``: the keys it averages (``np.mean`` / ``np.std``); a key
    whose first value is a string is skipped."""
    averaged = set()
    for name, values in infos.items():
        if not len(values) or isinstance(values[0], str):
            continue
        assert np.isfinite(float(np.mean(values))) and np.isfinite(float(np.std(values)))
        averaged.add(name)
    return averaged


def load_file_v0_6(path: str, name: str):
    """v0.6.1 ``get_custom_reward_fn``: the file run as module ``custom_module``."""
    import sys

    spec = importlib.util.spec_from_file_location("custom_module", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_module"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["custom_module"]
    return getattr(module, name)


def load_file_v0_7(path: str, name: str):
    """v0.7.0+ ``load_module`` for a file path: run under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"custom_module_{hash(os.path.abspath(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def reward_loop(compute_score, items: list[dict]):
    """``RewardLoopWorker.compute_score_batch`` and ``RewardLoopManager.compute_rm_score``'s
    handling of the outputs."""
    async def compute_score_batch():
        tasks = [asyncio.create_task(naive_run_single(compute_score, r)) for r in items]
        return await asyncio.gather(*tasks)

    outputs = asyncio.run(compute_score_batch())
    scores = torch.tensor([o["reward_score"] for o in outputs], dtype=torch.float32)
    infos = [o["reward_extra_info"] for o in outputs]
    return scores, {key: np.array([info[key] for info in infos]) for key in infos[0]}


class CountingJudge(Judge):
    """``inner`` behind a record of each model call (its size and thread). The first call waits
    until the rest of the ``concurrent`` items submitted at once are queued, so that callers
    which bypass the batcher's queue show up as one model call each."""

    def __init__(self, inner, concurrent: int):
        self.inner, self.concurrent = inner, concurrent
        self.engine = inner.engine  # the inner judge's engine and its batching limits
        self.calls: list[tuple[int, str]] = []

    def stream(self, examples):
        examples = list(examples)
        self.calls.append((len(examples), threading.current_thread().name))
        if len(self.calls) == 1:
            deadline = time.monotonic() + 10  # a bound against hanging, not a measurement
            while (self.batcher().queue_depth < self.concurrent - len(examples)
                   and time.monotonic() < deadline):
                time.sleep(0.001)
        return self.inner.stream(examples)


@pytest.fixture
def counting(lave_judge):
    made = []

    def make(concurrent: int) -> CountingJudge:
        made.append(CountingJudge(lave_judge, concurrent))
        rl.configure(made[-1])
        return made[-1]

    yield make
    rl.configure(None)
    for judge in made:
        judge.batcher().close()


def assert_like(got: dict, expected) -> None:
    assert list(got) == KEYS
    assert got["score"] == expected.score and got["rating"] == expected.rating
    assert got["error"] == 0.0 and got["error_reason"] == ""
    assert [got["prob_1"], got["prob_2"], got["prob_3"]] == pytest.approx(expected.probs, abs=1e-5)


# -- tests -------------------------------------------------------------------------------------
def test_pkg_path_loads_every_form():
    for name in FORMS:
        for path in ("pkg://fastjudge.rl", "pkg://fastjudge/rl"):
            assert verl_load_extern_object(path, name) is getattr(rl, name)
        # what NaiveRewardManager checks, on get_custom_reward_fn's partial
        assert inspect.iscoroutinefunction(verl_custom_reward_fn(name)) == (name == "compute_score_async")
    # a file path is run standalone, outside its package: the package's relative imports fail,
    # hence pkg://
    init = Path(rl.__file__)
    spec = importlib.util.spec_from_file_location("custom_module_x", init)
    with pytest.raises(ImportError):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_reward_loop_awaits_the_async_form_in_shared_batches(counting, lave_judge):
    items = rows(12)
    judge = counting(len(items))
    scores, extra = reward_loop(verl_custom_reward_fn("compute_score_async"), items)
    assert len(judge.calls) < len(items)  # concurrent calls became shared batches
    assert sum(n for n, _ in judge.calls) == len(items)
    expected = one_by_one(lave_judge, items)
    assert scores.tolist() == [e.score for e in expected]
    assert list(extra) == KEYS and all(extra[k].dtype == np.float64 for k in NUMBERS)
    for k, e in enumerate(expected):
        assert_like({key: float(extra[key][k]) for key in NUMBERS} | {"error_reason": str(extra["error_reason"][k])}, e)


@pytest.mark.parametrize("where", ["reward loop executor", "thread pool"])
def test_sync_calls_from_threads_run_on_the_judge_thread(counting, lave_judge, where):
    items = rows(8)
    # threads of asyncio's default executor (run_in_executor(None)), as many for the pool
    threads = min(32, (os.cpu_count() or 1) + 4, len(items))
    judge = counting(threads)
    compute_score = verl_custom_reward_fn("compute_score", {"unrelated_option": 1})
    if where == "reward loop executor":
        scores = reward_loop(compute_score, items)[0].tolist()
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            results = list(pool.map(lambda r: compute_score(
                data_source="vqav2", solution_str=r["prediction"], ground_truth=r["references"],
                extra_info={"question": r["question"]}), items))
        scores = [r["score"] for r in results]
    # one thread owns the model: every model call ran on the batcher's worker
    assert {thread for _, thread in judge.calls} == {"fastjudge-batcher"}
    assert len(judge.calls) < len(items)
    assert scores == [e.score for e in one_by_one(lave_judge, items)]


def test_batch_reward_manager_call(lave_judge):
    items = rows(5)
    refs = [r["references"] for r in items]
    refs[1] = np.array(refs[1], dtype=object)  # a list column read through pandas
    refs[2] = json.dumps(refs[2])
    refs[4] = []  # no references: the judge rejects the item
    extras = [{"question": r["question"], "index": i} for i, r in enumerate(items)]
    for e in extras:  # BatchRewardManager.verify
        e["rollout_reward_scores"] = {}
    compute_score = verl_custom_reward_fn("compute_score_batch", {"unrelated_option": 1})
    rl.configure(lave_judge)
    try:
        scores = compute_score(data_sources=np.array(["vqav2"] * 5, dtype=object),
                               solution_strs=[r["prediction"] for r in items], ground_truths=refs,
                               extra_infos=extras)
        partial = compute_score(data_sources=np.array(["vqav2"] * 2, dtype=object),
                                solution_strs=["a", "b"], ground_truths=[["a"], ["b"]],
                                extra_infos=[{"question": "Q?"}, {}])
        assert partial[0]["error"] == 0.0 and partial[1]["error"] == 1.0
        assert "question" in partial[1]["error_reason"] and "item 1" in partial[1]["error_reason"]
    finally:
        rl.configure(None)
    # BatchRewardManager.__call__
    rewards, reward_extra_info = [], {}
    for score in scores:
        rewards.append(score["score"])
        for key, value in score.items():
            reward_extra_info.setdefault(key, []).append(value)
    acc = torch.tensor(rewards, dtype=torch.float32)
    expected = one_by_one(lave_judge, items[:4])
    for got, e in zip(scores[:4], expected):
        assert_like(got, e)
    assert {k: scores[4][k] for k in NUMBERS} == dict.fromkeys(NUMBERS, 0.0) | {"error": 1.0}
    assert scores[4]["error_reason"]
    assert acc.tolist() == [e.score for e in expected] + [0.0]
    assert validation_metrics(reward_extra_info) == set(NUMBERS)


def test_single_forms_take_verl_kwargs_and_reject_items_with_numbers(lave_judge):
    rl.configure(lave_judge)
    try:
        call = dict(data_source="vqav2", solution_str="skiing", ground_truth=["skiing"],
                    extra_info={"question": "What sport?"})
        got = rl.compute_score(**call, reward_router_address=None, reward_model_tokenizer=None)
        assert_like(got, lave_judge.score([VQAExample("What sport?", ["skiing"], "skiing")])[0])
        assert rl.compute_score_float(**call) == got["score"]
        assert isinstance(rl.compute_score_float(**call), float)
        async def inside_a_coroutine():  # the sync form where an event loop already runs
            return rl.compute_score(**call)

        assert asyncio.run(inside_a_coroutine()) == got
        bad = rl.compute_score(**{**call, "ground_truth": []})
        assert list(bad) == KEYS and bad["error"] == 1.0 and bad["score"] == 0.0
        assert bad["error_reason"]
    finally:
        rl.configure(None)


def test_device_from_reward_kwargs(t5_dir, monkeypatch):
    rl.configure(None)
    monkeypatch.delenv("FASTJUDGE_MODEL", raising=False)
    # the reward kwarg wins over the environment
    monkeypatch.setenv("FASTJUDGE_DEVICE", "cuda:7")
    options = {rl.MODEL_OPTION: str(t5_dir), rl.DEVICE_OPTION: "cpu"}
    compute_score = verl_custom_reward_fn("compute_score", options)
    try:
        got = compute_score(data_source="vqav2", solution_str="skiing", ground_truth=["skiing"],
                            extra_info={"question": "What sport?"})
        judge = rl.get_judge(**options)
        assert judge.backend.device.type == "cpu"
        assert rl.get_judge(**options) is judge  # loaded once per process
        assert got == rl.compute_score("vqav2", "skiing", ["skiing"], {"question": "What sport?"},
                                       **options)
        on_cuda = {**options, rl.DEVICE_OPTION: "cuda"}
        if torch.cuda.is_available():
            assert rl.get_judge(**on_cuda).backend.device.type == "cuda"
        else:  # as in a Ray worker that reserved no GPU
            with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
                rl.get_judge(**on_cuda)
    finally:
        rl.configure(None)


def test_entry_file_loads_by_path_in_every_release():
    import subprocess
    import sys

    printed = subprocess.run([sys.executable, "-m", "fastjudge.rl.verl_entry"], check=True,
                             capture_output=True, text=True).stdout.strip()
    assert os.path.isfile(printed) and printed.endswith("verl_entry.py")
    for load in (load_file_v0_6, load_file_v0_7):
        for name in FORMS:
            fn = load(printed, name)
            assert fn is getattr(rl, name)  # the package's own functions, not copies
    # the remote manager ships the function to its Ray workers: it pickles by reference
    import pickle

    wrapped = functools.partial(_call_with_kwargs, load_file_v0_7(printed, "compute_score"), {})
    assert pickle.loads(pickle.dumps(wrapped)).args[0] is rl.compute_score


def test_missing_extra_info_is_an_error_score_not_an_exception(lave_judge):
    """v0.7.1+ ``NaiveRewardManager.run_single`` on rows without ``extra_info`` (or without its
    question), through the reward loop's stacking and the validation metrics."""
    rl.configure(lave_judge)
    try:
        items = rows(3)
        infos = [{}, {"caption": "a man skiing"}, {"question": items[2]["question"]}]

        async def run_single(compute_score, row, extra_info):
            extra_info["num_turns"] = None  # what run_single adds to the row's extra_info
            extra_info["rollout_reward_scores"] = {}
            call = dict(data_source="vqav2", solution_str=row["prediction"],
                        ground_truth=row["references"], extra_info=extra_info)
            if inspect.iscoroutinefunction(compute_score):
                return await compute_score(**call)
            return await asyncio.get_running_loop().run_in_executor(None, lambda: compute_score(**call))

        for name in ("compute_score", "compute_score_async"):
            fn = verl_custom_reward_fn(name)

            async def batch():
                return await asyncio.gather(*[run_single(fn, r, dict(i)) for r, i in zip(items, infos)])

            results = asyncio.run(batch())
            stacked = {key: np.array([r[key] for r in results]) for key in results[0]}
            assert stacked["error"].tolist() == [1.0, 1.0, 0.0]
            assert all('extra_info["question"]' in str(r) for r in stacked["error_reason"][:2])
            assert stacked["error_reason"][2] == ""
            assert validation_metrics({k: v.tolist() for k, v in stacked.items()}) == set(NUMBERS)
    finally:
        rl.configure(None)
