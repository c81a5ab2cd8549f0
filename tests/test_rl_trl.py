"""TRL and verl call-shape checks for fastjudge.rl (real tiny judge, no trainer installed).

Contracts transcribed from upstream source:
- TRL ``trl/trainer/grpo_trainer.py`` ``GRPOTrainer._calculate_rewards``: completions of a
  conversational dataset are message lists; a tool-call assistant turn carries
  ``content: None``.
- TRL ``GRPOTrainer._calculate_rewards`` turns each ``None`` reward into ``torch.nan`` and
  builds ``torch.tensor(..., dtype=torch.float32)``; NaN rewards are left out of the advantage.
- verl ``verl/workers/reward_manager/naive.py`` ``NaiveRewardManager.__call__``: calls
  ``compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
  **reward_kwargs)`` with extra keyword arguments.
"""

from __future__ import annotations



def test_tool_call_turn_is_an_empty_answer(lave_judge):
    from fastjudge.rl import lave_reward_fn
    from fastjudge.judges.lave import VQAExample

    from fastjudge.rl import _text

    # the answer text the judge sees: empty, not the string "None"
    assert _text([{"role": "assistant", "content": None}]) == ""
    reward = lave_reward_fn(lave_judge)
    expected = lave_judge.score([VQAExample("What sport is this?", ["skiing"], "")])[0].score
    got = reward(prompts=[[{"role": "user", "content": "What sport is this?"}]],
                 completions=[[{"role": "assistant", "content": None}]],
                 references=[["skiing"]])
    assert got == [float(expected)]


def test_verl_compute_score_takes_reward_kwargs(lave_judge):
    from fastjudge import rl

    rl.configure(lave_judge)
    try:
        score = rl.compute_score("vqav2", "skiing", ["skiing"], {"question": "What sport?"},
                                 reward_router_address=None, reward_model_tokenizer=None)
        assert isinstance(score, float)
    finally:
        rl.configure(None)


def test_rejected_item_is_none_for_trl(lave_judge):
    import math

    import torch

    from fastjudge.rl import lave_reward_fn

    reward = lave_reward_fn(lave_judge)
    got = reward(prompts=["What sport?", "What sport?"], completions=["skiing", "skiing"],
                 references=[["skiing"], []])  # no references: the judge rejects the item
    assert got[0] is not None and got[1] is None
    # what GRPOTrainer._calculate_rewards does with the list
    tensor = torch.tensor([r if r is not None else torch.nan for r in got], dtype=torch.float32)
    assert tensor[0] == got[0] and math.isnan(tensor[1])
    assert lave_reward_fn(lave_judge, error_value=0.0)(
        prompts=["What sport?"], completions=["skiing"], references=[[]]) == [0.0]
