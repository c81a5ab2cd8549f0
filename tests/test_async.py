"""Async dynamic batching (``LaveJudge.ascore`` / ``astream``, ``AsyncBatcher``) and the RL
reward adapters, on the tiny random-weight Flan-T5 judge."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from importlib import resources

import pytest

from fastjudge import VQAExample
from fastjudge.runtime.async_batcher import AsyncBatcher, QueueFullError


def sample_examples(n: int, tag: str = "") -> list[VQAExample]:
    rows = [json.loads(line) for line in
            resources.files("fastjudge.data").joinpath("sample_vqa.jsonl").read_text().splitlines()
            if line.strip()]
    return [VQAExample(r["question"], r["references"], r["prediction"], r.get("caption"),
                       f"{tag}{i}") for i, r in enumerate(rows[j % len(rows)] for j in range(n))]


def as_dicts(results):
    return [dataclasses.asdict(r) for r in results]


def assert_same(got, expected):
    """Same items, same ratings; probabilities equal up to batch-composition float noise
    (a batch's padding and GEMM shapes depend on which items share it)."""
    got = [r if isinstance(r, dict) else dataclasses.asdict(r) for r in got]
    expected = [r if isinstance(r, dict) else dataclasses.asdict(r) for r in expected]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        g, e = dict(g), dict(e)
        gp, ep = g.pop("probs"), e.pop("probs")
        gs, es = g.pop("soft_score"), e.pop("soft_score")
        assert g == e
        assert (gp is None) == (ep is None) and (gs is None) == (es is None)
        if gp is not None:
            assert gp == pytest.approx(ep, abs=1e-5)
            assert gs == pytest.approx(es, abs=1e-5)


class GatedJudge:
    """Wraps a judge; each ``stream`` call records its examples and waits for ``gate``."""

    def __init__(self, judge):
        self.judge = judge
        self.max_batch_tokens = judge.max_batch_tokens
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[list] = []

    def stream(self, examples):
        examples = list(examples)
        self.calls.append(examples)
        self.entered.set()
        assert self.gate.wait(10)
        return self.judge.stream(examples)


def test_concurrent_ascore_callers_get_exactly_their_results(lave_judge):
    groups = [sample_examples(n, tag=f"c{k}-") for k, n in enumerate((1, 3, 7, 12, 5, 40))]
    bad = [VQAExample("", [], "x", id="bad"), VQAExample("Q?", ["a"], 3, id="bad2")]
    groups.append(bad + sample_examples(4, tag="mixed-"))
    expected = [as_dicts(lave_judge.score(g)) for g in groups]

    async def main():
        return await asyncio.gather(*(lave_judge.ascore(g) for g in groups))

    got = asyncio.run(main())
    for g, e in zip(got, expected):
        assert_same(g, e)
    assert got[-1][0].error and got[-1][1].error and got[-1][2].error is None


def test_astream_yields_each_item_once_with_caller_indices(lave_judge):
    items = sample_examples(25, tag="s")
    expected = {r.index: dataclasses.asdict(r) for r in lave_judge.score(items)}

    async def main():
        other = asyncio.ensure_future(lave_judge.ascore(sample_examples(9, tag="o")))
        streamed = [r async for r in lave_judge.astream(items)]
        await other
        return streamed

    streamed = asyncio.run(main())
    assert sorted(r.index for r in streamed) == list(range(25))
    assert_same(sorted(streamed, key=lambda r: r.index), [expected[i] for i in range(25)])


def test_requests_of_callers_share_batches(lave_judge):
    gated = GatedJudge(lave_judge)
    batcher = AsyncBatcher(gated, max_wait_ms=50)

    async def main():
        first = asyncio.ensure_future(batcher.score(sample_examples(2, tag="a")))
        await asyncio.sleep(0)  # all three submit within the wait window
        rest = [asyncio.ensure_future(batcher.score(sample_examples(3, tag=t))) for t in "bc"]
        gated.gate.set()
        return await asyncio.gather(first, *rest)

    try:
        results = asyncio.run(main())
    finally:
        batcher.close()
    assert [len(r) for r in results] == [2, 3, 3]
    assert len(gated.calls) == 1 and len(gated.calls[0]) == 8


def test_cancelling_one_caller_leaves_others_intact(lave_judge):
    gated = GatedJudge(lave_judge)
    batcher = AsyncBatcher(gated, max_wait_ms=0)
    a, b, c = (sample_examples(n, tag=t) for n, t in ((4, "a"), (5, "b"), (6, "c")))

    async def main():
        task_a = asyncio.ensure_future(batcher.score(a))
        await asyncio.sleep(0)
        assert await asyncio.to_thread(gated.entered.wait, 5)  # a's batch is running
        task_b = asyncio.ensure_future(batcher.score(b))  # queued behind it
        task_c = asyncio.ensure_future(batcher.score(c))
        await asyncio.sleep(0.01)
        task_b.cancel()  # b is dropped from the queue
        task_a.cancel()  # a's running batch finishes; its results are discarded
        gated.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task_b
        with pytest.raises(asyncio.CancelledError):
            await task_a
        return await task_c

    try:
        got_c = asyncio.run(main())
    finally:
        batcher.close()
    assert_same(got_c, lave_judge.score(c))
    ran_ids = [e.id for call in gated.calls for e in call]
    assert not any(str(i).startswith("b") for i in ran_ids)  # b never reached the model
    assert sorted(i for i in ran_ids if str(i).startswith("c")) == sorted(e.id for e in c)
    assert batcher.queue_depth == 0


def test_breaking_out_of_astream_cancels_the_rest(lave_judge):
    items = sample_examples(30, tag="x")

    async def main():
        async for r in lave_judge.astream(items):
            break
        # the judge keeps serving other callers afterwards
        return await lave_judge.ascore(items[:3])

    got = asyncio.run(main())
    assert_same(got, lave_judge.score(items[:3]))


def test_bounded_queue_raises_queue_full(lave_judge):
    gated = GatedJudge(lave_judge)
    batcher = AsyncBatcher(gated, max_wait_ms=0, max_queue_items=3)

    async def main():
        running = asyncio.ensure_future(batcher.score(sample_examples(1, tag="r")))
        await asyncio.sleep(0)
        assert await asyncio.to_thread(gated.entered.wait, 5)
        queued = asyncio.ensure_future(batcher.score(sample_examples(2, tag="q")))
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError, match="queue full"):
            await batcher.score(sample_examples(2, tag="z"))  # 1 slot free: all or nothing
        assert batcher.queue_depth == 2
        gated.gate.set()
        return await running, await queued

    try:
        r, q = asyncio.run(main())
    finally:
        batcher.close()
    assert len(r) == 1 and len(q) == 2
    with pytest.raises(ValueError):
        AsyncBatcher(lave_judge, max_queue_items=0)


def test_model_failure_fails_only_that_batch(lave_judge):
    """A failure that outlasts the retries fails that batch's callers with SystemFailure (never
    a result); a transient one is retried; the worker serves the next batch either way."""
    from fastjudge.runtime.failures import SystemFailure

    class Flaky:
        max_batch_tokens = lave_judge.max_batch_tokens
        fail = 2

        def stream(self, examples):
            if self.fail:
                self.fail -= 1
                raise RuntimeError("CUDA error: boom")
            return lave_judge.stream(examples)

    flaky = Flaky()
    batcher = AsyncBatcher(flaky, max_wait_ms=0, retries=1, backoff_s=0.01)

    async def main():
        with pytest.raises(SystemFailure, match="boom"):
            await batcher.score(sample_examples(2))
        after_failure = await batcher.score(sample_examples(2))
        flaky.fail = 1  # once: the retry cures it
        return after_failure, await batcher.score(sample_examples(2))

    try:
        after_failure, retried = asyncio.run(main())
    finally:
        batcher.close()
    assert len(after_failure) == len(retried) == 2
    assert all(r.error is None for r in after_failure + retried)
    assert batcher.system_failures == 1


# -- RL adapters -------------------------------------------------------------------------------
def test_trl_reward_fn_matches_judge_scores(lave_judge):
    from fastjudge.rl import lave_reward_fn

    items = sample_examples(6)
    expected = [r.score for r in lave_judge.score(items)]
    reward = lave_reward_fn(lave_judge)
    # conversational prompts and completions, question taken from the prompt
    got = reward(prompts=[[{"role": "user", "content": e.question}] for e in items],
                 completions=[[{"role": "assistant", "content": e.prediction}] for e in items],
                 references=[list(e.references) for e in items])
    assert got == expected and all(isinstance(x, float) for x in got)
    # plain strings, explicit question column, JSON-string references, an invalid row
    got = reward(prompts=["ignored"] * 7, completions=[e.prediction for e in items] + ["x"],
                 question=[e.question for e in items] + ["Q?"],
                 references=[json.dumps(list(e.references)) for e in items] + [[]])
    assert got == expected + [None]  # TRL convention: ignored, not 0
    with pytest.raises(ValueError, match="references"):
        reward(prompts=["q"], completions=["a"])


def test_verl_compute_score_matches_judge_scores(lave_judge, monkeypatch):
    from fastjudge import rl

    items = sample_examples(3)
    expected = [r.score for r in lave_judge.score(items)]
    rl.configure(lave_judge)
    try:
        got = [rl.compute_score_float("vqav2", e.prediction, list(e.references),
                                      {"question": e.question}) for e in items]
        assert got == expected and all(isinstance(x, float) for x in got)
        assert rl.compute_score("vqav2", items[0].prediction, json.dumps(items[0].references),
                                {"question": items[0].question})["score"] == expected[0]
        missing = rl.compute_score("vqav2", "a", ["a"], None)  # an error score, not an exception
        assert missing["error"] == 1.0 and "question" in missing["error_reason"]
        rl.configure(None)
        monkeypatch.delenv("FASTJUDGE_MODEL", raising=False)
        with pytest.raises(RuntimeError, match="FASTJUDGE_MODEL"):
            rl.compute_score("vqav2", "a", ["a"], {"question": "Q?"})
    finally:
        rl.configure(None)
