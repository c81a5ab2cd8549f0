"""OpenRLHF's remote reward model against ``/get_reward``, with the payload its executor posts.

Contract transcribed from OpenRLHF ``openrlhf/utils/agent.py``,
``SingleTurnAgentExecutor._fetch_rewards_via_http`` (``--reward.remote_url``): one sample per
request, ``{"query": [prompt + response], "prompts": [prompt], "labels": [label]}`` with the
text decoded with special tokens kept; it reads ``rewards`` (else ``scores``) and the optional
``extra_logs``, and passes the rewards to ``torch.tensor``.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from fastjudge.judges.lave import VQAExample  # noqa: E402
from fastjudge.serve import create_app  # noqa: E402
from fastjudge.serve.openrlhf import prompt_question  # noqa: E402

CHAT_PROMPT = ("<|im_start|>system\nYou answer briefly.<|im_end|>\n"
               "<|im_start|>user\nWhat sport is this?<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def client(lave_judge):
    app = create_app(lave_judge, max_body_bytes=64 * 1024, max_queue=200, timeout_s=30,
                     reward_on_error=-1.0)
    with TestClient(app) as c:
        yield c


def executor_request(client, prompt: str, response: str, label):
    """What the executor sends and does with the answer: one sample, rewards to a tensor."""
    r = client.post("/get_reward", json={"query": [prompt + response], "prompts": [prompt],
                                         "labels": [label]})
    assert r.status_code == 200, r.text
    body = r.json()
    rewards = torch.tensor(body.get("rewards", body.get("scores")))
    extra = {k: torch.tensor(v) for k, v in body.get("extra_logs", {}).items()}
    return body, rewards, extra


def test_stock_payload_with_each_label_form(client, lave_judge):
    expected = lave_judge.score([VQAExample("What sport is this?", ["skiing", "ski"], "skiing")])[0]
    object_label = json.dumps({"question": "What sport is this?", "references": ["skiing", "ski"]})
    for label in (object_label, json.dumps(["skiing", "ski"]), ["skiing", "ski"]):
        body, rewards, extra = executor_request(client, CHAT_PROMPT, "skiing<|im_end|>", label)
        assert rewards.tolist() == [pytest.approx(expected.score)]
        assert extra["error"].tolist() == [0.0]
        assert extra["rating"].tolist() == [float(expected.rating)]
    one = lave_judge.score([VQAExample("What sport is this?", ["skiing"], "skiing")])[0]
    _, rewards, _ = executor_request(client, CHAT_PROMPT, " skiing</s>", "skiing")  # plain string
    assert rewards.tolist() == [pytest.approx(one.score)]


def test_rejected_samples_are_numbers(client):
    # a query that does not start with its prompt, and a sample without references
    r = client.post("/get_reward", json={"query": ["something else"], "prompts": [CHAT_PROMPT],
                                         "labels": ["skiing"]})
    assert r.status_code == 200
    assert torch.tensor(r.json()["rewards"]).tolist() == [-1.0]
    assert "does not start with its prompt" in r.json()["errors"][0]
    body, rewards, extra = executor_request(client, CHAT_PROMPT, "skiing", "[]")
    assert rewards.tolist() == [-1.0] and extra["error"].tolist() == [1.0]
    r = client.post("/get_reward", json={"query": ["a", "b"], "prompts": ["a"], "labels": ["x"]})
    assert r.status_code == 422


def test_question_is_the_last_user_turn():
    assert prompt_question(CHAT_PROMPT) == "What sport is this?"
    assert prompt_question("Question: why?\nAnswer:") == "Question: why?\nAnswer:"
