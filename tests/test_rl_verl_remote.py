"""One shared judge for a verl job: ``fastjudge.rl.verl_remote``'s forms against a real
fastjudge server on loopback (tiny random-weight judges), called as verl calls them.

Upstream contracts (verl v0.9.0, commit 483b8a009ba3a97563edee3a19887e4862b8094a; transcribed
in ``tests/test_rl_verl.py``, whose helpers are reused):
- ``verl/experimental/reward_loop/reward_manager/naive.py`` ``run_single``: an ``async def``
  ``compute_score`` is awaited, one task per item, all items of a batch at once
  (``reward_loop.py`` ``RewardLoopWorker.compute_score_batch``); a sync one runs on the default
  thread pool; every key of the dict goes to ``reward_extra_info``.
- ``verl/experimental/reward_loop/reward_loop.py`` ``RewardLoopWorker._post_request`` (verl's
  own reward client): a 4xx is not retried, a 5xx, a timeout or a lost connection is, up to 16
  posts with a ``min(2**attempt, 30)`` s pause.
- ``recipe/dapo`` / ``algorithm.filter_groups.metric`` (default ``acc``): the group filter reads
  ``reward_extra_info["acc"]``.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from test_rl_verl import naive_run_single, one_by_one, rows, verl_custom_reward_fn  # noqa: E402
from test_serve import serving  # noqa: E402

from fastjudge.judges.base import Judge  # noqa: E402
from fastjudge.judges.lave import VQAExample  # noqa: E402
from fastjudge.rl import verl_remote  # noqa: E402
from fastjudge.serve import create_app  # noqa: E402


@contextlib.contextmanager
def served(app):
    """``app`` on a free loopback port (``test_serve.serving``); yields its URL."""
    import uvicorn

    with serving(uvicorn.Config(app, log_level="warning", lifespan="on")) as port:
        yield f"http://127.0.0.1:{port}"


class FlakyJudge(Judge):
    """``inner`` whose first ``failures`` model calls fail as a CUDA error does (a system
    failure: the server answers 503)."""

    def __init__(self, inner, failures: int):
        self.inner, self.failures, self.calls = inner, failures, 0
        self.engine = inner.engine  # the inner judge's engine and its batching limits

    def stream(self, examples):
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return self.inner.stream(list(examples))


def reward_loop(compute_score, items):
    async def batch():
        return await asyncio.gather(*[naive_run_single(compute_score, r) for r in items])
    return asyncio.run(batch())


def test_reward_loop_workers_share_one_server(lave_judge):
    items = rows(12)
    expected = [e.score for e in one_by_one(lave_judge, items)]
    app = create_app(lave_judge, max_wait_ms=50)
    with served(app) as url:
        options = {verl_remote.URL_OPTION: url}
        for name in ("compute_score_async", "compute_score"):
            fn = verl_custom_reward_fn(name, options, path="pkg://fastjudge.rl.verl_remote")
            before = app.state.batcher.batches_done
            outputs = reward_loop(fn, items)
            assert [o["reward_score"] for o in outputs] == expected
            infos = [o["reward_extra_info"] for o in outputs]
            assert [i["acc"] for i in infos] == expected and all(i["error"] == 0.0 for i in infos)
            assert list(infos[0]) == list(verl_remote.error_dict("lave", ""))
            if name == "compute_score_async":  # concurrent items became shared batches
                assert app.state.batcher.batches_done - before < len(items)
        batch = verl_remote.compute_score_batch(
            np.array(["vqav2"] * 3, dtype=object), [r["prediction"] for r in items[:2]] + ["  "],
            [r["references"] for r in items[:3]], [{"question": r["question"]} for r in items[:3]],
            **options)
        assert [b["score"] for b in batch[:2]] == expected[:2]
        assert batch[2]["error"] == 1.0 and "empty" in batch[2]["error_reason"]
        # no answer, no question: error dicts, nothing posted for them
        assert verl_remote.compute_score("vqav2", "", ["a"], {"question": "Q?"}, **options)["error"] == 1.0
        assert "question" in verl_remote.compute_score("vqav2", "a", ["a"], {}, **options)["error_reason"]
        # the server of another judge is refused once, by name
        with pytest.raises(RuntimeError, match="serves the 'lave' judge"):
            verl_remote.compute_score_holistic("x", "a cat", None, {"image": b"..."}, **options)


def test_503_is_retried_and_a_judge_that_stays_down_stops_the_run(lave_judge):
    flaky = FlakyJudge(lave_judge, failures=2)
    app = create_app(flaky, retries=0, retry_after_s=0)
    item = rows(1)[0]
    expected = lave_judge.score([VQAExample(item["question"], item["references"], item["prediction"])])[0]
    with served(app) as url:
        got = asyncio.run(verl_remote.compute_score_async(
            "vqav2", item["prediction"], item["references"], {"question": item["question"]},
            fastjudge_url=url))
        assert got["score"] == expected.score and flaky.calls == 3  # two 503s, then scored
        flaky.calls, flaky.failures = 0, 100
        with pytest.raises(RuntimeError, match="3 posts failed, the last with HTTP 503"):
            verl_remote.compute_score("vqav2", item["prediction"], item["references"],
                                      {"question": item["question"]}, fastjudge_url=url,
                                      fastjudge_max_attempts=3)
    keyed = create_app(lave_judge, api_key="secret")
    with served(keyed) as url:
        with pytest.raises(RuntimeError, match="HTTP 401"):
            verl_remote.compute_score("vqav2", "a", ["a"], {"question": "Q?"}, fastjudge_url=url)
        ok = verl_remote.compute_score("vqav2", "a", ["a"], {"question": "Q?"}, fastjudge_url=url,
                                       fastjudge_api_key="secret")
        assert ok["error"] == 0.0


def test_holistic_and_visexmem_entries(vl_dir, tmp_path):
    from PIL import Image

    from fastjudge import rl
    from fastjudge.engine_options import EngineOptions
    from fastjudge.judges.holistic import HolisticJudge
    from fastjudge.judges.visexmem import ImageTextExample

    picture = tmp_path / "1.png"
    Image.new("RGB", (48, 40), (200, 30, 30)).save(picture)
    judge = HolisticJudge(vl_dir, engine=EngineOptions(device="cpu", dtype="float32"))
    expected = judge.score([ImageTextExample(image=str(picture), text="a red square")])[0]
    with served(create_app(judge, "holistic")) as url:
        got = verl_remote.compute_score_holistic("coco", "<think>hm</think>a red square", None,
                                                 {"images": [str(picture)]}, fastjudge_url=url)
        missing = asyncio.run(verl_remote.compute_score_holistic_async(
            "coco", "a red square", None, {}, fastjudge_url=url))
    assert got["score"] == pytest.approx(expected.score, abs=1e-6) and got["error"] == 0.0
    assert got["yes"] == got["acc"] == (1.0 if expected.decision == "yes" else 0.0)
    assert missing["error"] == 1.0 and 'extra_info["image"]' in missing["error_reason"]
    # the per-process forms give the same dict
    rl.configure(judge)
    try:
        local = rl.compute_score_holistic("coco", "a red square", None, {"image": str(picture)})
        assert list(local) == list(got) and local["score"] == pytest.approx(got["score"], abs=1e-6)
        assert (local["yes"], local["acc"], local["error"]) == (got["yes"], got["acc"], 0.0)
        assert list(rl.compute_score_visexmem("coco", "", None, {"image": str(picture)})) == \
            ["score", "claims", "acc", "error", "error_reason"]
    finally:
        rl.configure(None)
