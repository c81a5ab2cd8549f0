"""OpenRLHF's remote reward model against ``/get_reward``, with the payload its executor posts.

Contract transcribed from OpenRLHF v0.11.0 (commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7),
``openrlhf/utils/agent.py``, ``SingleTurnAgentExecutor.execute`` and
``_fetch_rewards_via_http`` (``--reward.remote_url``; ``--remote_rm_url`` before v0.10.2): one
sample per request, ``{"query": [query], "prompts": [prompt], "labels": [label]}`` where
``query = hf_tokenizer.decode(prompt_token_ids + action_token_ids, skip_special_tokens=False)``;
``prompt_token_ids`` come from the processor for a vision-language policy
(``openrlhf/utils/vlm_utils.py``, ``process_prompt_with_images``: each image placeholder
expanded to one ``<|image_pad|>`` per merged patch), else from the tokenizer, and are cut to
their last ``max_length - max_tokens`` when longer. The label is ``data[label_key]``, or ``""``
without a label key (``openrlhf/datasets/prompts_dataset.py``, ``preprocess_data``). The
executor reads ``rewards`` (else ``scores``) and the optional ``extra_logs``, and passes the
rewards to ``torch.tensor``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from fastjudge.engine_options import EngineOptions
from fastjudge.judges.lave import VQAExample  # noqa: E402
from fastjudge.serve import create_app  # noqa: E402
from fastjudge.serve.openrlhf import prompt_question, split_response  # noqa: E402

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
    assert "cannot tell the response from the prompt" in r.json()["errors"][0]
    body, rewards, extra = executor_request(client, CHAT_PROMPT, "skiing", "[]")
    assert rewards.tolist() == [-1.0] and extra["error"].tolist() == [1.0]
    r = client.post("/get_reward", json={"query": ["a", "b"], "prompts": ["a"], "labels": ["x"]})
    assert r.status_code == 422


def test_question_is_the_last_user_turn():
    assert prompt_question(CHAT_PROMPT) == "What sport is this?"
    assert prompt_question("Question: why?\nAnswer:") == "Question: why?\nAnswer:"


# -- queries as the executor builds them --------------------------------------------------------
# What Qwen3.5's chat template writes for OpenRLHF's "<image>What sport is this?" input
# (prompts_dataset._str_to_content_list -> [{"type": "image"}, {"type": "text", ...}]), with
# thinking off; the tiny checkpoint's template takes string content only, so it is written out.
VLM_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What sport is this?"
              "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def qwen_processor(vl_dir):
    """The Qwen3-VL processor of the tiny checkpoint (image part only: the video processor
    needs torchvision, which the test environment does not have, and no video is used)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    images = AutoImageProcessor.from_pretrained(str(vl_dir), backend="pil")
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None
    try:
        return Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=None)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def executor_query(tokenizer, prompt_ids: list, response: str) -> str:
    """``SingleTurnAgentExecutor.execute``: the prompt's and the action's ids decoded with
    special tokens kept."""
    action_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(prompt_ids + action_ids, skip_special_tokens=False)


def vlm_prompt_ids(processor, prompt: str, size=(80, 64)) -> list:
    """``vlm_utils.process_prompt_with_images``: the processor's ids of the prompt and its image."""
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (*size[::-1], 3), dtype=np.uint8))
    out = processor(text=[prompt], images=[image], add_special_tokens=False, return_tensors="pt")
    return out["input_ids"][0].tolist()


def test_vlm_query_with_expanded_image_tokens(client, lave_judge, qwen_processor):
    tokenizer = qwen_processor.tokenizer
    query = executor_query(tokenizer, vlm_prompt_ids(qwen_processor, VLM_PROMPT), "skiing<|im_end|>")
    assert query.count("<|image_pad|>") > 1 and not query.startswith(VLM_PROMPT)
    assert split_response(query, VLM_PROMPT) == "skiing<|im_end|>"
    r = client.post("/get_reward", json={"query": [query], "prompts": [VLM_PROMPT],
                                         "labels": [json.dumps(["skiing", "ski"])]})
    expected = lave_judge.score([VQAExample("What sport is this?", ["skiing", "ski"], "skiing")])[0]
    assert r.json()["errors"] == [None]
    assert r.json()["rewards"] == [pytest.approx(expected.score)]


def test_left_truncated_prompts(qwen_processor):
    """``execute`` keeps ``prompt_token_ids[-max_prompt_length:]``: the query starts inside the
    prompt, with a chat template and without one."""
    tokenizer = qwen_processor.tokenizer
    context = " ".join(f"fact {i} about the picture." for i in range(60))
    chat = ("<|im_start|>system\nYou answer briefly.<|im_end|>\n<|im_start|>user\n" + context
            + " What sport is this?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = context + " Question: what sport is this? Answer:"
    for prompt in (chat, plain):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        max_prompt_length = len(ids) // 3
        query = executor_query(tokenizer, ids[-max_prompt_length:], " skiing<|im_end|>")
        assert not query.startswith(prompt)
        assert split_response(query, prompt).strip() == "skiing<|im_end|>"


def test_template_that_rewrites_the_image_placeholder():
    """Gemma 3's processor writes each ``<start_of_image>`` as a block of soft tokens
    (``transformers`` ``Gemma3Processor``): the response is the text after the last assistant
    header (``<start_of_turn>model``)."""
    prompt = ("<bos><start_of_turn>user\n<start_of_image>What sport is this?<end_of_turn>\n"
              "<start_of_turn>model\n")
    query = prompt.replace("<start_of_image>", "\n\n<start_of_image>" + "<image_soft_token>" * 256
                           + "<end_of_image>\n\n") + "skiing<end_of_turn>"
    assert split_response(query, prompt) == "skiing<end_of_turn>"
    assert prompt_question(prompt) == "What sport is this?"
    llama = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat sport is this ?"
             "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # a tokenizer that decodes with clean_up_tokenization_spaces (" ?" -> "?"): the prompt
    # text is no prefix of the query, its assistant header is
    query = llama.replace("this ?", "this?") + "skiing<|eot_id|>"
    assert split_response(query, llama) == "skiing<|eot_id|>"
    assert prompt_question(llama) == "What sport is this ?"


def test_failed_split_and_empty_label_are_error_rows(client):
    prompt = "<|im_start|>user\nWhat sport is this?<|im_end|>\n<|im_start|>assistant\n"
    r = client.post("/get_reward", json={
        "query": ["an unrelated text that shares nothing", prompt + "skiing<|im_end|>"],
        "prompts": ["Question: what sport? Answer:", prompt], "labels": ["skiing", ""]}).json()
    assert r["rewards"] == [-1.0, -1.0] and r["extra_logs"]["error"] == [1.0, 1.0]
    assert "query[0]: cannot tell the response from the prompt" in r["errors"][0]
    assert "query[1]: the label is empty" in r["errors"][1] and "label_key" in r["errors"][1]


@contextlib.contextmanager
def image_host(folder):
    """A loopback HTTP server of ``folder``'s files; yields its base URL."""
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_image_judge_reads_the_labels_image_as_openrlhfs_image_column(vl_dir, tmp_path, qwen_processor):
    """OpenRLHF sends no image bytes: the label names the image as the dataset's image column
    holds it (``openrlhf/datasets/prompts_dataset.py``: ``data.get(image_key)``;
    ``openrlhf/utils/vlm_utils.py`` ``load_images``, v0.11.0: a path, an http(s) URL, a
    base64 / ``data:`` string, or a list of these). Paths are read only under the image root,
    URLs fetched only under an allowed prefix."""
    from PIL import Image

    from fastjudge.judges.holistic import HolisticJudge
    from fastjudge.judges.visexmem import ImageTextExample

    (tmp_path / "coco").mkdir()
    picture = tmp_path / "coco" / "1.png"
    Image.new("RGB", (48, 40), (200, 30, 30)).save(picture)
    (tmp_path.parent / "outside.png").write_bytes(picture.read_bytes())
    data_url = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    tokenizer = qwen_processor.tokenizer
    query = executor_query(tokenizer, vlm_prompt_ids(qwen_processor, VLM_PROMPT), "a red square<|im_end|>")
    judge = HolisticJudge(vl_dir, image_root=str(tmp_path), engine=EngineOptions(device="cpu", dtype="float32"))
    expected = judge.score([ImageTextExample(image=str(picture), text="a red square")])[0].score
    with image_host(tmp_path) as base:
        images = ["coco/1.png", str(picture), [str(picture)], data_url, base + "coco/1.png",
                  "../outside.png", str(tmp_path.parent / "outside.png"), [str(picture)] * 2,
                  "http://127.0.0.2:9/coco/1.png", base + "missing.png"]
        labels = [json.dumps({"image": image}) for image in images]
        app = create_app(judge, "holistic", reward_on_error=-1.0, image_url_prefixes=(base,))
        with TestClient(app) as c:
            r = c.post("/get_reward", json={"query": [query] * len(labels),
                                            "prompts": [VLM_PROMPT] * len(labels),
                                            "labels": labels}).json()
    assert r["rewards"][:5] == [pytest.approx(expected)] * 5 and r["errors"][:5] == [None] * 5
    assert "outside --image-root" in r["errors"][5] and "outside --image-root" in r["errors"][6]
    assert "holds 2 images" in r["errors"][7]
    assert "not under an allowed prefix" in r["errors"][8]
    assert "could not be fetched" in r["errors"][9]
    assert r["rewards"][5:] == [-1.0] * 5
    judge.image_root = None  # a server started without --image-root reads no files
    with TestClient(create_app(judge, "holistic", reward_on_error=-1.0)) as c:
        r = c.post("/get_reward", json={"query": [query], "prompts": [VLM_PROMPT],
                                        "labels": labels[:1]}).json()
    assert r["rewards"] == [-1.0] and "--image-root" in r["errors"][0]
