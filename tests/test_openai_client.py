"""The OpenAI-compatible routes through the real ``openai`` Python client, on the tiny
random-weight Qwen3.5 vision-language checkpoint.

The client (openai-python, the release the test extra installs; its ``_base_client.py`` maps
each error status to a class: 400 ``BadRequestError``, 401 ``AuthenticationError``, 5xx
``InternalServerError``) is what lmms-eval's OpenAI judge provider and VLMEvalKit's
``vlmeval/api/gpt.py`` (``--judge-base-url``) speak to a judge: ``image_url`` content parts with
``data:image/...;base64`` URLs when a judge task has images. Answers with an image are checked
against transformers' greedy ``generate`` on the ids and pixels the Qwen3-VL processor makes
(``Qwen3VLProcessor``, the image part), so the route's image path is the model's own.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
from typing import Literal

import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("xgrammar")

import httpx  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from fastjudge.engine_options import EngineOptions  # noqa: E402
from fastjudge.judges.holistic import HolisticJudge  # noqa: E402
from fastjudge.serve import create_app  # noqa: E402

CAP = 24
MODEL = "gpt-4o-mini"  # what harnesses send; any name is answered by the served model


def png(seed: int, size=(80, 64)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(text: str, url: str) -> list[dict]:
    """A judge turn as VLMEvalKit's ``OpenAIWrapper.prepare_itlist`` builds it: text parts and
    ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``."""
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url",
                                          "image_url": {"url": url, "detail": "low"}}]}]


@pytest.fixture(scope="module")
def judge(vl_dir):
    return HolisticJudge(vl_dir, max_image_pixels=200 * 200, engine=EngineOptions(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def app(judge):
    return create_app(judge, "holistic", max_completion_tokens=CAP, timeout_s=60)


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                            http_client=http)


@pytest.fixture(scope="module")
def hf_greedy(vl_dir):
    """transformers' greedy continuation of a user turn holding text and one image, the ids and
    pixels made by the Qwen3-VL processor (the video processor needs torchvision: left out)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None
    try:
        processor = Qwen3VLProcessor(
            image_processor=AutoImageProcessor.from_pretrained(str(vl_dir), backend="pil"),
            tokenizer=tokenizer, video_processor=None)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32).eval()
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}

    @torch.inference_mode()
    def run(text: str, image: bytes, max_new: int = CAP) -> tuple[str, int, int]:
        from PIL import Image

        # the tiny checkpoint's template takes string content: the image slot written out as
        # Qwen's templates write an image part (no separator after the text)
        turn = text + "<|vision_start|><|image_pad|><|vision_end|>"
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": turn}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=False)
        inputs = processor(text=[prompt], images=[Image.open(io.BytesIO(image)).convert("RGB")],
                           add_special_tokens=False, return_tensors="pt")
        n = inputs["input_ids"].shape[1]
        out = hf.generate(**inputs, max_new_tokens=max_new, do_sample=False, num_beams=1,
                          eos_token_id=sorted(eos))[0, n:].tolist()
        stop = next((i for i, t in enumerate(out) if t in eos), len(out))
        return tokenizer.decode(out[:stop], skip_special_tokens=True), n, stop

    return run


def test_models_list(client, vl_dir):
    models = client.models.list()
    assert [m.id for m in models.data] == [vl_dir.name]


def test_image_parts_answer_as_the_model_with_the_processors_pixels(client, hf_greedy):
    image = png(1)
    done = client.chat.completions.create(model=MODEL, messages=image_message("Describe:", data_url(image)))
    text, prompt_tokens, completion_tokens = hf_greedy("Describe:", image)
    assert done.choices[0].message.content == text
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    # text parts alone, in the same turn shape
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
    assert plain.choices[0].message.role == "assistant" and plain.usage.prompt_tokens > 0


def test_stream_with_usage(client):
    messages = image_message("Describe:", data_url(png(2)))
    whole = client.chat.completions.create(model=MODEL, messages=messages)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


def test_parse_with_a_json_schema(client):
    done = client.chat.completions.parse(
        model=MODEL, response_format=Verdict,
        messages=image_message("Does the image show a dog? Answer in JSON.", data_url(png(3))))
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and parsed.answer in ("yes", "no")
    assert Verdict.model_validate_json(done.choices[0].message.content) == parsed


def test_async_client_concurrency(app, client):
    """Concurrent requests of ``AsyncOpenAI`` share the judge's batches and get the answers
    they get one at a time."""
    prompts = [image_message(f"Picture {k}:", data_url(png(10 + k % 3))) for k in range(6)]
    alone = [client.chat.completions.create(model=MODEL, messages=m).choices[0].message.content
             for m in prompts]

    async def together():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            aclient = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused",
                                         max_retries=0, http_client=http)
            answers = await asyncio.gather(*[aclient.chat.completions.create(model=MODEL, messages=m)
                                             for m in prompts])
        return [a.choices[0].message.content for a in answers]

    assert asyncio.run(together()) == alone


def test_error_classes(judge, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=image_message("x", "data:image/png;base64,@@"))
    assert bad.value.status_code == 400 and bad.value.body["param"] == "messages[0].content[1]"
    # the judges' pixel budget (--max-image-pixels) holds for chat images too
    with pytest.raises(openai.BadRequestError) as big:
        client.chat.completions.create(model=MODEL, messages=image_message("x", data_url(png(4, (400, 300)))))
    assert big.value.code == "invalid_image" and "pixel budget" in big.value.message
    keyed = create_app(judge, "holistic", api_key="right", max_completion_tokens=CAP)
    with TestClient(keyed) as http:
        wrong = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", max_retries=0,
                              http_client=http)
        with pytest.raises(openai.AuthenticationError) as denied:
            wrong.models.list()
        assert denied.value.status_code == 401
    closing = create_app(judge, "holistic", max_completion_tokens=CAP)
    with TestClient(closing) as http:
        closing.state.batcher.close()  # as on shutdown
        gone = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                             http_client=http)
        with pytest.raises(openai.InternalServerError) as unavailable:
            gone.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert unavailable.value.status_code == 503
        assert unavailable.value.response.headers["retry-after"] == "1"


class _Images(http.server.BaseHTTPRequestHandler):
    image = b""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/ok/moved.png":
            self.send_response(302)
            self.send_header("Location", "/elsewhere/a.png")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.image)))
        self.end_headers()
        self.wfile.write(self.image)

    def log_message(self, *args):
        pass


def test_remote_urls_only_under_the_allow_list(judge, client):
    _Images.image = png(5)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        allowing = create_app(judge, "holistic", max_completion_tokens=CAP,
                              image_url_prefixes=(f"{base}/ok/",))
        with TestClient(allowing) as http_client:
            remote = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                                   max_retries=0, http_client=http_client)
            fetched = remote.chat.completions.create(
                model=MODEL, messages=image_message("Describe:", f"{base}/ok/a.png"))
            inline = client.chat.completions.create(
                model=MODEL, messages=image_message("Describe:", data_url(_Images.image)))
            assert fetched.choices[0].message.content == inline.choices[0].message.content
            for url, words in ((f"{base}/elsewhere/a.png", "remote image URLs are refused"),
                               (f"{base}/ok/moved.png", "redirects")):
                with pytest.raises(openai.BadRequestError) as refused:
                    remote.chat.completions.create(model=MODEL, messages=image_message("x", url))
                assert words in refused.value.message
        # the default server takes no remote URL at all
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=image_message("x", f"{base}/ok/a.png"))
    finally:
        server.shutdown()
