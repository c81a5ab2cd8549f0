"""TRL's calls into fastjudge.rl's reward functions, on tiny random-weight judges: transcribed
from TRL's source, and (the last test) TRL's own ``_calculate_rewards`` from the installed
release (the test extra pins TRL 1.x up to 1.9, the source read).

Upstream contracts (``trl/trainer/grpo_trainer.py``):
- ``GRPOTrainer._calculate_rewards``: a custom reward function is called as
  ``reward_func(prompts=, completions=, completion_ids=, **reward_kwargs)``, where
  ``reward_kwargs`` holds every dataset column but ``prompt`` / ``completion`` /
  ``completion_ids`` as a list over the batch, plus ``trainer_state``, ``log_extra`` and
  ``log_metric``; each ``None`` reward becomes ``torch.nan`` in
  ``torch.tensor(..., dtype=torch.float32)``. Completions of a conversational dataset are
  message lists; a tool-call assistant turn carries ``content: None``.
- ``GRPOTrainer._log_completion_extra(column, values)`` extends a pending column (one value per
  sample) and ``GRPOTrainer._log_metric(name, value)`` appends a scalar; at the end of the step
  ``_generate_and_score_completions`` flushes both in sorted-name order, each metric as
  ``torch.tensor(sum(values) / len(values))`` gathered across processes.
- ``GRPOTrainer._calculate_rewards`` (TRL v1.9.0, commit
  f2cd57710ae345ea6428ae95363267fcf38a3dc8; async rewards since v0.27.0): a reward function
  for which ``inspect.iscoroutinefunction`` holds is awaited, with the other async ones, in
  ``asyncio.gather`` on ``self.async_loop`` (an event loop running in its own thread), through
  ``asyncio.run_coroutine_threadsafe(...).result()``; the sync ones run before, in turn.
- ``GRPOTrainer._generate_and_score_completions``: VLM rows carry ``images`` (a list per row)
  or ``image`` (one per row), ``images`` taking precedence; the prompts get the images as
  ``{"type": "image", "image": ...}`` content parts (``trl/data_utils.py``,
  ``prepare_multimodal_messages``).
"""

from __future__ import annotations

import io
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from fastjudge.engine_options import EngineOptions


class TrlLogs:
    """``GRPOTrainer._log_completion_extra`` / ``_log_metric`` and their flush."""

    def __init__(self):
        self.extra: dict[str, list] = defaultdict(list)
        self.metrics: dict[str, list] = defaultdict(list)

    def log_extra(self, column: str, values: list) -> None:
        self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(value)

    def flushed_metrics(self) -> dict[str, float]:
        return {name: torch.tensor(sum(v) / len(v)).item() for name, v in sorted(self.metrics.items())}


def trl_calculate_rewards(reward_func, inputs: list[dict], completions: list, logs: TrlLogs | None):
    """``GRPOTrainer._calculate_rewards`` for one synchronous custom reward function."""
    prompts = [x["prompt"] for x in inputs]
    keys = [key for key in inputs[0] if key not in ["prompt", "completion", "completion_ids"]]
    reward_kwargs = {key: [example[key] for example in inputs] for key in keys}
    reward_kwargs["trainer_state"] = object()
    if logs is not None:
        reward_kwargs["log_extra"] = logs.log_extra
        reward_kwargs["log_metric"] = logs.log_metric
    output = reward_func(prompts=prompts, completions=completions,
                         completion_ids=[[0]] * len(completions), **reward_kwargs)
    output = [reward if reward is not None else torch.nan for reward in output]
    return torch.tensor(output, dtype=torch.float32)


def trl_calculate_rewards_async(reward_funcs: list, inputs: list[dict], completions: list,
                                logs: TrlLogs | None) -> torch.Tensor:
    """``_calculate_rewards`` for async reward functions: gathered on a loop in its own thread."""
    import asyncio
    import inspect
    import threading

    assert all(inspect.iscoroutinefunction(f) for f in reward_funcs)
    prompts = [x["prompt"] for x in inputs]
    keys = [key for key in inputs[0] if key not in ["prompt", "completion", "completion_ids"]]
    reward_kwargs = {key: [example[key] for example in inputs] for key in keys}
    reward_kwargs["trainer_state"] = object()
    if logs is not None:
        reward_kwargs["log_extra"] = logs.log_extra
        reward_kwargs["log_metric"] = logs.log_metric
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="trl-async-loop", daemon=True)
    thread.start()

    async def invoke(index, func):
        output = await func(prompts=prompts, completions=completions,
                            completion_ids=[[0]] * len(completions), **reward_kwargs)
        return index, [r if r is not None else torch.nan for r in output]

    async def run_all():
        return await asyncio.gather(*[invoke(i, f) for i, f in enumerate(reward_funcs)])

    try:
        results = asyncio.run_coroutine_threadsafe(run_all(), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
    rewards = torch.zeros(len(prompts), len(reward_funcs))
    for i, output in results:
        rewards[:, i] = torch.tensor(output, dtype=torch.float32)
    return rewards


def assert_rewards(tensor: torch.Tensor, expected: list) -> None:
    assert len(tensor) == len(expected)
    for got, want in zip(tensor.tolist(), expected):
        assert math.isnan(got) if want is None else got == pytest.approx(want, rel=1e-6)


def said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# -- LAVE --------------------------------------------------------------------------------------
def test_answers_without_text_are_error_rows(lave_judge):
    """A tool-call turn (``content: None``, as ``_calculate_rewards`` receives it), an empty and
    a whitespace-only completion are never judged: NaN for TRL (``error_value`` None), the
    reason in the ``lave_error`` column. TRL v1.9.0 ``trl/trainer/grpo_trainer.py``,
    ``_calculate_rewards``."""
    from fastjudge.judges.lave import VQAExample
    from fastjudge.rl import _text, lave_reward_fn

    # the prompt text of a tool-call turn: empty, not the string "None"
    assert _text([{"role": "assistant", "content": None}]) == ""
    inputs = [{"prompt": [{"role": "user", "content": "What sport is this?"}],
               "references": ["skiing"]} for _ in range(4)]
    completions = [[{"role": "assistant", "content": None}], said(""), said(" \n\t "),
                   said("skiing")]
    logs = TrlLogs()
    rewards = trl_calculate_rewards(lave_reward_fn(lave_judge), inputs, completions, logs)
    expected = lave_judge.score([VQAExample("What sport is this?", ["skiing"], "skiing")])[0]
    assert_rewards(rewards, [None, None, None, expected.score])
    errors = logs.extra["lave_error"]
    assert "tool-call" in errors[0] and "empty" in errors[1] and "whitespace" in errors[2]
    assert errors[3] == "" and logs.extra["lave_rating"][3] == expected.rating
    assert logs.flushed_metrics()["lave/error_rate"] == pytest.approx(0.75)
    # the reward the user configured for errors
    fixed = trl_calculate_rewards(lave_reward_fn(lave_judge, error_value=-1.0), inputs[:2],
                                  completions[:2], None)
    assert fixed.tolist() == [-1.0, -1.0]


def test_rejected_item_is_nan_for_trl_and_lave_logs(lave_judge):
    from fastjudge.judges.lave import VQAExample
    from fastjudge.rl import lave_reward_fn

    reward = lave_reward_fn(lave_judge)
    inputs = [{"prompt": [{"role": "user", "content": "What sport?"}], "references": refs}
              for refs in (["skiing"], [])]  # no references: the judge rejects the item
    logs = TrlLogs()
    rewards = trl_calculate_rewards(reward, inputs, [said("skiing")] * 2, logs)
    expected = lave_judge.score([VQAExample("What sport?", ["skiing"], "skiing")])[0]
    assert_rewards(rewards, [expected.score, None])
    assert dict(logs.extra) == {"lave_rating": [expected.rating, None],
                                "lave_error": ["", logs.extra["lave_error"][1]]}
    assert "references" in logs.extra["lave_error"][1]
    assert logs.flushed_metrics() == {"lave/error_rate": 0.5}
    assert lave_reward_fn(lave_judge, error_value=0.0)(
        prompts=["What sport?"], completions=["skiing"], references=[[]]) == [0.0]


# -- image-text judges -------------------------------------------------------------------------
def pixels(seed: int, h: int = 64, w: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def png(array: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def vlm_prompt(image) -> list[dict]:
    """A conversational prompt after ``prepare_multimodal_messages``."""
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "Describe the image."}]}]


class Recording:
    """A judge whose ``score`` calls are kept, to check what the reward function sent and what
    it made of the results."""

    def __init__(self, judge):
        self.judge, self.sent, self.results = judge, [], []

    def score(self, examples):
        self.sent = list(examples)
        self.results = self.judge.score(self.sent)
        return self.results


@pytest.fixture(scope="module")
def visex(vl_dir):
    from fastjudge import VisExJudge

    # the "Hol." control: one short constrained answer per item, where random weights make the
    # pipeline's decomposition write to its limits for seconds; the reward function calls
    # VisExJudge.score either way (the pipeline's results are tests/test_visexmem.py's)
    return VisExJudge(vl_dir, mode="holistic-score", engine=EngineOptions(device="cpu", dtype="float32"))


def test_visexmem_reward_fn_takes_the_image_column(visex):
    from PIL import Image

    from fastjudge.rl import visexmem_reward_fn

    first, second = Image.fromarray(pixels(0)), pixels(1, 48, 80)
    images = [first, None, {"bytes": png(second), "path": None}]  # PIL, missing, datasets dict
    inputs = [{"prompt": vlm_prompt(im), "image": im} for im in images]
    judge = Recording(visex)
    logs = TrlLogs()
    rewards = trl_calculate_rewards(visexmem_reward_fn(judge), inputs,
                                    [said("A red bus."), said("A cat."), said("Two dogs.")], logs)
    # the row without an image never reaches the judge; the others keep their order
    assert [e.text for e in judge.sent] == ["A red bus.", "Two dogs."]
    assert judge.sent[0].image is first and judge.sent[1].image == png(second)
    ok = judge.results
    assert all(r.error is None for r in ok)
    assert_rewards(rewards, [ok[0].score, None, ok[1].score])
    assert sorted(logs.extra) == ["visexmem_claims", "visexmem_error", "visexmem_explanation"]
    assert logs.extra["visexmem_claims"] == [len(ok[0].claims), 0, len(ok[1].claims)]
    assert logs.extra["visexmem_error"][0] == "" and "no image" in logs.extra["visexmem_error"][1]
    assert all(len(v) == 3 for v in logs.extra.values())
    assert logs.flushed_metrics() == pytest.approx({
        "visexmem/claims": (len(ok[0].claims) + len(ok[1].claims)) / 2,
        "visexmem/error_rate": 1 / 3})


def test_holistic_reward_fn_takes_the_images_column(visex):
    from fastjudge import HolisticJudge, ImageTextExample
    from fastjudge.rl import holistic_reward_fn

    holistic = HolisticJudge(visex.backend)
    a, b = pixels(2), pixels(3, 56, 72)
    rows = [{"prompt": vlm_prompt(None), "images": [a], "image": b},  # images wins, as in TRL
            {"prompt": vlm_prompt(None), "images": [a, b], "image": b},  # two images
            {"prompt": vlm_prompt(None), "images": [b], "image": a}]
    completions = [said("A red bus."), said("Two dogs."), said("")]  # an empty caption: rejected
    expected = holistic.score([ImageTextExample(a, "A red bus.")])[0]
    reward = holistic_reward_fn(holistic)
    logs = TrlLogs()
    assert_rewards(trl_calculate_rewards(reward, rows, completions, logs),
                   [expected.score, None, None])
    assert logs.extra["holistic_decision"] == [expected.decision, "", ""]
    assert "2 images" in logs.extra["holistic_error"][1] and logs.extra["holistic_error"][2]
    assert logs.flushed_metrics() == pytest.approx({
        "holistic/error_rate": 2 / 3, "holistic/yes_rate": float(expected.decision == "yes")})
    # a batch without errors logs the same names (TRL gathers them name by name)
    again = TrlLogs()
    assert_rewards(trl_calculate_rewards(reward, rows[:1], completions[:1], again), [expected.score])
    assert sorted(again.extra) == sorted(logs.extra) and list(again.metrics) == list(logs.metrics)
    # without the logging callables (older TRL), the rewards alone
    assert_rewards(trl_calculate_rewards(reward, rows[:1], completions[:1], None), [expected.score])
    with pytest.raises(ValueError, match="image"):
        reward(prompts=["p"], completions=["A bus."], caption=["x"])


# -- async reward functions --------------------------------------------------------------------
def test_async_reward_functions_are_awaited_together(lave_judge, visex):
    """Two async rewards on one TRL step, gathered on TRL's loop thread: the same rewards and
    logs as the sync functions, the model run on the judge's batcher thread."""
    import threading

    from fastjudge.rl import (
        holistic_reward_fn_async,
        lave_reward_fn,
        lave_reward_fn_async,
        visexmem_reward_fn,
        visexmem_reward_fn_async,
    )

    threads = []
    inner_stream = lave_judge.stream

    def stream(examples):
        threads.append(threading.current_thread().name)
        return inner_stream(examples)

    inputs = [{"prompt": [{"role": "user", "content": "What sport?"}], "references": refs,
               "image": png(pixels(k))} for k, refs in enumerate((["skiing"], [], ["ski"]))]
    completions = [said("skiing"), said("skiing"), said("a ski slope")]
    sync_logs, async_logs = TrlLogs(), TrlLogs()
    expected = torch.stack([trl_calculate_rewards(f, inputs, completions, sync_logs)
                            for f in (lave_reward_fn(lave_judge), visexmem_reward_fn(visex))], 1)
    lave_judge.stream = stream
    try:
        got = trl_calculate_rewards_async([lave_reward_fn_async(lave_judge),
                                           visexmem_reward_fn_async(visex)], inputs, completions,
                                          async_logs)
    finally:
        del lave_judge.stream
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    assert torch.allclose(got.nan_to_num(-9), expected.nan_to_num(-9), rtol=1e-6)
    assert dict(async_logs.extra) == dict(sync_logs.extra)
    assert async_logs.flushed_metrics() == sync_logs.flushed_metrics()
    assert threads and set(threads) == {"fastjudge-batcher"}  # not TRL's loop thread
    assert holistic_reward_fn_async(visex).__name__ == "holistic_reward"


def test_trl_itself_calculates_the_rewards(lave_judge):
    """TRL's own ``GRPOTrainer._calculate_rewards`` (the installed release), run on a stand-in
    trainer holding only what it reads: the sync and the async LAVE rewards give one column
    each, equal, and log through TRL's own ``_log_completion_extra`` / ``_log_metric``."""
    trl = pytest.importorskip("trl")
    import asyncio
    import threading
    from collections import defaultdict
    from types import MethodType, SimpleNamespace

    from accelerate import Accelerator

    from fastjudge.rl import lave_reward_fn, lave_reward_fn_async

    trainer = SimpleNamespace(accelerator=Accelerator(cpu=True), args=SimpleNamespace(report_to=[]),
                              state=SimpleNamespace(global_step=0), environments=None,
                              _pending_extra_logs=defaultdict(list),
                              _pending_metrics=defaultdict(list))
    for name in ("_log_completion_extra", "_log_metric"):
        setattr(trainer, name, MethodType(getattr(trl.GRPOTrainer, name), trainer))
    trainer.reward_funcs = [lave_reward_fn(lave_judge), lave_reward_fn_async(lave_judge)]
    trainer.reward_processing_classes = [None, None]
    trainer.reward_func_names = [f.__name__ for f in trainer.reward_funcs]
    trainer.async_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=trainer.async_loop.run_forever, daemon=True)
    thread.start()
    inputs = [{"prompt": [{"role": "user", "content": "What sport?"}], "references": refs}
              for refs in (["skiing"], [], ["ski", "skiing"])]
    completions = [said("skiing")] * 3
    try:
        rewards = trl.GRPOTrainer._calculate_rewards(
            trainer, inputs, [x["prompt"] for x in inputs], completions, [[0]] * 3)
    finally:
        trainer.async_loop.call_soon_threadsafe(trainer.async_loop.stop)
        thread.join()
        trainer.async_loop.close()
    assert rewards.shape == (3, 2)
    assert torch.equal(torch.isnan(rewards[:, 0]), torch.isnan(rewards[:, 1]))
    assert torch.isnan(rewards[1]).all() and torch.equal(rewards[[0, 2], 0], rewards[[0, 2], 1])
    assert len(trainer._pending_extra_logs["lave_error"]) == 6  # both functions logged
    assert trainer._pending_metrics["lave/error_rate"] == [pytest.approx(1 / 3)] * 2


def test_image_rewards_judge_the_answer_and_refuse_none(visex):
    """The image judges' TRL rewards read completions as the LAVE one does: a Gemma 4 thought
    channel or a ``<think>`` block removed, an empty, whitespace-only or tool-call answer never
    sent to the judge (``_calculate_rewards`` as above)."""
    from PIL import Image

    from fastjudge import HolisticJudge
    from fastjudge.rl import holistic_reward_fn, visexmem_reward_fn

    image = Image.fromarray(pixels(2))
    completions = [said("<|channel>thought\nRed and round.<channel|>A red bus."),
                   said("<think>\nRed.\n</think>\n\nA red bus."), said(""), said(" \n "),
                   [{"role": "assistant", "content": None}], said("<think>\nRed and")]
    inputs = [{"prompt": vlm_prompt(image), "images": [image]} for _ in completions]
    for build, name, inner in ((visexmem_reward_fn, "visexmem", visex),
                               (holistic_reward_fn, "holistic", HolisticJudge(visex.backend))):
        judge, logs = Recording(inner), TrlLogs()
        rewards = trl_calculate_rewards(build(judge), inputs, completions, logs)
        assert [e.text for e in judge.sent] == ["A red bus.", "A red bus."]
        assert_rewards(rewards, [judge.results[0].score, judge.results[1].score] + [None] * 4)
        errors = logs.extra[f"{name}_error"]
        assert errors[:2] == ["", ""] and all("empty" in e for e in errors[2:5])
        assert "never closes" in errors[5]
