"""The answer of a completion, on every RL path: reasoning blocks removed, answers that are not
there (empty, whitespace, a tool call, a block that never closes) error items with the reward
the user configured for errors.

Completions are shaped as the thinking chat templates have the policy write them (templates in
``tests/fixtures/chat_templates``): Qwen3 and QwQ/DeepSeek-R1 generate ``<think>\\n…\\n</think>\\n\\n
answer`` after ``<|im_start|>assistant\\n``; Qwen3.5 with thinking on opens the block in its
generation prompt, so the completion is ``…\\n</think>\\n\\nanswer``; Gemma 4 writes its
thought channel ``<|channel>thought\\n…<channel|>answer``.

Upstream contracts, per path:
- TRL v1.9.0 (commit f2cd57710ae345ea6428ae95363267fcf38a3dc8) ``trl/trainer/grpo_trainer.py``
  ``_calculate_rewards``: raw completions (strings or message lists, a tool-call turn's
  ``content`` None), a ``None`` reward becomes NaN.
- verl v0.9.0 (commit 483b8a009ba3a97563edee3a19887e4862b8094a)
  ``verl/experimental/reward_loop/reward_manager/naive.py`` ``run_single``: ``solution_str =
  tokenizer.decode(response_ids, skip_special_tokens=True)``, which keeps ``<think>`` (an added,
  non-special token in Qwen's tokenizers); the dict result's keys go to ``reward_extra_info``.
- OpenRLHF v0.11.0 (commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7) ``openrlhf/utils/agent.py``
  ``SingleTurnAgentExecutor``: a ``--reward.remote_url`` ending in ``.py`` is loaded with
  ``spec_from_file_location("reward_func", path)`` and ``reward_func(queries, prompts, labels)``
  called through ``asyncio.to_thread``, one sample per call; the executor reads ``rewards``,
  ``scores`` and ``extra_logs`` of the first answer.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys

import pytest

from fastjudge import rl
from fastjudge.judges.lave import VQAExample
from fastjudge.rl.answers import AnswerError, answer_of, opens_reasoning

QUESTION = "What sport is this?"
REASONING = "The person wears skis and holds poles on a snowy slope."
QWEN3 = f"<think>\n{REASONING}\n</think>\n\nskiing"
QWEN3_5_THINKING = f"{REASONING}\n</think>\n\nskiing"  # the prompt opened <think>\n
GEMMA4 = f"<|channel>thought\n{REASONING}<channel|>skiing"
UNFINISHED = f"<think>\n{REASONING[:30]}"
EMPTY = ["", "   \n\t ", None]


def test_answer_of_each_thinking_template():
    assert answer_of(QWEN3) == "skiing"
    assert answer_of(QWEN3_5_THINKING, opened=True) == "skiing"
    assert answer_of(GEMMA4) == "skiing"
    assert answer_of("<think>\n\n</think>\n\nskiing") == "skiing"  # thinking off: empty block
    assert answer_of("\u25c1think\u25b7hm\u25c1/think\u25b7skiing") == "skiing"
    assert answer_of(" skiing ") == "skiing"
    assert answer_of(QWEN3, "keep") == QWEN3
    for text, opened in ((UNFINISHED, False), (REASONING, True), ("<|channel>thought\nSnow", False)):
        with pytest.raises(AnswerError, match="never closes"):
            answer_of(text, opened=opened)
    for text in EMPTY + [f"<think>{REASONING}</think>\n\n"]:
        with pytest.raises(AnswerError, match="empty"):
            answer_of(text)
    with pytest.raises(AnswerError, match="empty"):
        answer_of("  ", "keep")
    with pytest.raises(ValueError, match="reasoning must be"):
        answer_of("x", "drop")
    assert opens_reasoning("<think>\n") and not opens_reasoning("<think>\n\n</think>\n\n")
    assert opens_reasoning("<|channel>thought\n") and not opens_reasoning("<|channel>thought\n<channel|>")


def expected_skiing(judge) -> float:
    return judge.score([VQAExample(QUESTION, ["skiing", "ski"], "skiing")])[0].score


# -- TRL -----------------------------------------------------------------------------------------
def test_trl_reward_judges_the_answer_and_refuses_none(lave_judge):
    from fastjudge.rl import lave_reward_fn

    completions = [QWEN3, [{"role": "assistant", "content": GEMMA4}], UNFINISHED, "", "  \n",
                   [{"role": "assistant", "content": None,
                     "tool_calls": [{"type": "function", "function": {"name": "search"}}]}]]
    logged = {}
    reward = lave_reward_fn(lave_judge, error_value=-1.0)
    got = reward(prompts=[QUESTION] * 6, completions=completions,
                 references=[["skiing", "ski"]] * 6,
                 log_extra=lambda column, values: logged.setdefault(column, values),
                 log_metric=lambda name, value: None)
    assert got == [pytest.approx(expected_skiing(lave_judge))] * 2 + [-1.0] * 4
    errors = logged["lave_error"]
    assert errors[:2] == ["", ""] and "never closes" in errors[2]
    assert all("empty" in e for e in errors[3:])
    kept = lave_reward_fn(lave_judge, reasoning="keep")(prompts=[QUESTION], completions=[QWEN3],
                                                         references=[["skiing", "ski"]])
    assert kept == [pytest.approx(lave_judge.score([VQAExample(QUESTION, ["skiing", "ski"], QWEN3)])[0].score)]


# -- verl ----------------------------------------------------------------------------------------
def test_verl_compute_score_judges_the_answer_and_refuses_none(lave_judge):
    rl.configure(lave_judge)
    try:
        info = {"question": QUESTION}
        for form in (rl.compute_score, lambda *a: asyncio.run(rl.compute_score_async(*a))):
            good = form("vqav2", QWEN3, ["skiing", "ski"], info)
            assert good["score"] == pytest.approx(expected_skiing(lave_judge)) and good["error"] == 0.0
            assert good["acc"] == good["score"]
            for text in ["", "   ", UNFINISHED]:
                bad = form("vqav2", text, ["skiing", "ski"], info)
                assert (bad["score"], bad["acc"], bad["error"]) == (0.0, 0.0, 1.0)
                assert bad["error_reason"]
        batch = rl.compute_score_batch(["vqav2"] * 2, ["", "skiing"], [["skiing"]] * 2, [info] * 2)
        assert [b["error"] for b in batch] == [1.0, 0.0] and "item 0" in batch[0]["error_reason"]
        kept = rl.compute_score("vqav2", QWEN3, ["skiing"], info, fastjudge_reasoning="keep")
        assert kept["error"] == 0.0
        assert kept["score"] == lave_judge.score([VQAExample(QUESTION, ["skiing"], QWEN3)])[0].score
    finally:
        rl.configure(None)


# -- OpenRLHF ------------------------------------------------------------------------------------
PROMPT = "<|im_start|>user\nWhat sport is this?<|im_end|>\n<|im_start|>assistant\n"


def test_openrlhf_route_judges_the_answer_and_refuses_none(lave_judge):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from fastjudge.serve import create_app

    responses = [QWEN3 + "<|im_end|>", "<|im_end|>", "  \n<|im_end|>", UNFINISHED]
    with TestClient(create_app(lave_judge, reward_on_error=-2.0)) as c:
        r = c.post("/get_reward", json={"query": [PROMPT + x for x in responses],
                                        "prompts": [PROMPT] * 4,
                                        "labels": [json.dumps(["skiing", "ski"])] * 4}).json()
        # OpenRLHF's URL sharding posts an empty payload to every server after the first
        empty = c.post("/get_reward", json={"query": [], "prompts": [], "labels": []})
    assert r["rewards"] == [pytest.approx(expected_skiing(lave_judge))] + [-2.0] * 3
    assert r["extra_logs"]["error"] == [0.0, 1.0, 1.0, 1.0]
    assert "empty" in r["errors"][1] and "empty" in r["errors"][2] and "never closes" in r["errors"][3]
    assert empty.status_code == 200 and empty.json()["rewards"] == []


def load_reward_func():
    """``SingleTurnAgentExecutor.__init__``: the file given as ``--reward.remote_url``."""
    path = subprocess.run([sys.executable, "-m", "fastjudge.rl.openrlhf_reward"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert path.endswith(".py")
    spec = importlib.util.spec_from_file_location("reward_func", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_openrlhf_reward_func_file(lave_judge):
    import torch

    module = load_reward_func()
    module.configure(lave_judge, reward_on_error=-1.0)
    try:
        samples = [(PROMPT + QWEN3 + "<|im_end|>", json.dumps(["skiing", "ski"])),
                   (PROMPT + "<|im_end|>", json.dumps(["skiing"])),
                   (PROMPT + " \n <|im_end|>", json.dumps(["skiing"])),
                   (PROMPT + UNFINISHED, json.dumps(["skiing"])),
                   ("unrelated", json.dumps(["skiing"])),
                   (PROMPT + "skiing<|im_end|>", "")]

        async def executor():  # _fetch_rewards_via_func: one sample per call, on threads
            return await asyncio.gather(*[asyncio.to_thread(module.reward_func, [q], [PROMPT], [label])
                                          for q, label in samples])

        answers = asyncio.run(executor())
    finally:
        module.configure(None)
    rewards = torch.cat([a["rewards"] for a in answers])
    assert all(a["rewards"].dtype == torch.float32 and a["scores"].shape == (1,) for a in answers)
    assert rewards.tolist() == [pytest.approx(expected_skiing(lave_judge))] + [-1.0] * 5
    assert torch.cat([a["extra_logs"]["error"] for a in answers]).tolist() == [0.0] + [1.0] * 5
