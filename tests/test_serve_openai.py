"""The OpenAI-compatible routes of the reward server (``GET /v1/models``, ``POST
/v1/chat/completions``) on the tiny random-weight Qwen3.5 checkpoint: greedy answers equal
transformers' greedy ``generate`` on the same chat-template prompt, streams carry the same text,
JSON response formats hold to their schema, and the requests the evaluation harnesses send get
the answers they read."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("xgrammar")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st
from starlette.testclient import TestClient  # noqa: E402
from test_async import sample_examples  # noqa: E402
from test_serve import item_dicts  # noqa: E402

from fastjudge import LaveJudge  # noqa: E402
from fastjudge.backends.qwen.backend import TorchQwenBackend  # noqa: E402
from fastjudge.engine_options import EngineOptions
from fastjudge.serve import create_app  # noqa: E402
from fastjudge.serve.chat_generation import ChatJudge  # noqa: E402
from fastjudge.serve.openai_protocol import ChatExample  # noqa: E402

CAP = 32  # the server's max_completion_tokens in these tests
CHAT = "/v1/chat/completions"
QUESTION = ("Question: what sport is shown? Reference answers: skiing, ski. Candidate "
            "answer: snowboarding. Is the candidate correct? Answer yes or no.")


@pytest.fixture(scope="module")
def judge(vl_dir):
    return LaveJudge(vl_dir, engine=EngineOptions(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def client(judge):
    app = create_app(judge, max_body_bytes=64 * 1024, max_completion_tokens=CAP, timeout_s=60)
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def hf(vl_dir):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy(judge, hf):
    """transformers' greedy continuation of messages through the checkpoint's chat template:
    (prompt ids, generated ids without EOS, whether EOS ended it)."""
    tokenizer = judge.backend.codec.tokenizer
    eos = sorted(judge.backend.codec.eos_token_ids)

    @torch.inference_mode()
    def run(messages, max_new=CAP):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                          num_beams=1, eos_token_id=eos)[0, len(ids):].tolist()
        stop = next((i for i, t in enumerate(out) if t in eos), len(out))
        return ids, out[:stop], stop < len(out)

    return run


def decode(judge, ids):
    return judge.backend.codec.tokenizer.decode(ids, skip_special_tokens=True)


def assert_greedy(judge, greedy, body, messages, max_new=CAP):
    """The answer ``body`` is transformers' greedy continuation of ``messages``."""
    ids, gen, ended = greedy(messages, max_new)
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": decode(judge, gen)}
    assert choice["finish_reason"] == ("stop" if ended else "length")
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(gen),
                             "total_tokens": len(ids) + len(gen)}


def sse_chunks(text: str) -> list:
    """The JSON chunks of a server-sent event stream that ends with ``data: [DONE]``."""
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


# -- the generation path itself ---------------------------------------------------------------
def test_chat_tokens_equal_transformers_greedy_generate(judge, greedy):
    """Token for token, several prompts decoded in one batch (system, multi-turn)."""
    conversations = [
        [{"role": "system", "content": "You are a strict grader."},
         {"role": "user", "content": QUESTION}],
        [{"role": "user", "content": "Is ski a sport?"}, {"role": "assistant", "content": "Yes."},
         {"role": "user", "content": QUESTION}],
        [{"role": "user", "content": "Rate: skiing vs snowboarding."}],
    ]
    chat = ChatJudge(judge, max_completion_tokens=CAP)
    results = sorted(chat.stream([ChatExample(m, max_tokens=16) for m in conversations]),
                     key=lambda r: r.index)
    for messages, result in zip(conversations, results):
        ids, gen, ended = greedy(messages, 16)
        assert result.error is None
        assert (result.token_ids, result.prompt_tokens) == (gen, len(ids))
        assert result.finish_reason == ("stop" if ended else "length")


# -- the harnesses' requests ------------------------------------------------------------------
def test_lmms_eval_local_provider(client, judge, greedy, vl_dir):
    """lmms_eval/llm_judge/providers/local.py, LocalProvider.is_available and .evaluate:
    GET LLM_JUDGE_URL with /chat/completions replaced by /models must answer 200; evaluate
    posts {"model": config.model_name, "messages", "temperature": config.temperature,
    "max_tokens": config.max_tokens} (ServerConfig defaults 0.0 and 1024; "top_p" only when
    set; the system prompt inserted first by ServerInterface.prepare_messages in
    lmms_eval/llm_judge/base.py) and reads data["choices"][0]["message"]["content"].strip(),
    data.get("usage") and data.get("model", config.model_name). Tasks also send temperatures
    above 0 (lmms_eval/tasks/voicebench/utils.py: ServerConfig(temperature=0.5, max_tokens=10)):
    they get the same greedy answer."""
    url = "http://localhost:8000/v1/chat/completions"
    assert client.get(url.replace("/chat/completions", "/models")).status_code == 200
    messages = [{"role": "system", "content": "You are a helpful judge."},
                {"role": "user", "content": QUESTION}]
    payload = {"model": "gpt-4o-2024-11-20", "messages": messages, "temperature": 0.0,
               "max_tokens": 1024}
    r = client.post(url, json=payload)
    assert r.status_code == 200, r.text
    data = r.json()
    assert_greedy(judge, greedy, data, messages)  # 1024 asked, the server's CAP given
    assert isinstance(data["choices"][0]["message"]["content"].strip(), str)
    assert data.get("model") == vl_dir.name  # the served checkpoint, whatever was asked
    hot = client.post(url, json={**payload, "temperature": 0.5, "top_p": 0.9, "max_tokens": 10})
    ids, gen, ended = greedy(messages, 10)
    assert hot.json()["choices"][0]["message"]["content"] == decode(judge, gen)


def vlmevalkit_stream_text(lines) -> str:
    """What vlmeval/api/gpt.py, _collect_streaming_content (with _parse_stream_chunk) makes of
    a streamed answer: lines that start with "data:", up to "[DONE]", each chunk's
    choices[0].delta.content joined, then stripped."""
    parts = []
    for line in lines:
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        choices = json.loads(data).get("choices", [])
        if choices and isinstance(choices[0].get("delta"), dict):
            parts.append(choices[0]["delta"].get("content") or "")
    return "".join(parts).strip()


def test_vlmevalkit_openai_wrapper(judge, greedy):
    """vlmeval/api/gpt.py, OpenAIWrapper.generate_inner, with run.py's --judge-base-url URL
    (api_base = base URL + "/chat/completions") and --judge-key: it posts
    json.dumps({"model", "messages", "temperature": 0, "max_tokens": 2048}) with
    "Authorization: Bearer <key>" ("n": 1 is dropped for a base URL not at openai.com); every
    content is a list of {"type": "text", "text"} parts (prepare_itlist), a system prompt a
    plain string (prepare_inputs). It reads json.loads(response.text)["choices"][0]["message"]
    ["content"].strip() for a 2xx status; with stream=True, the server-sent events."""
    app = create_app(judge, api_key="sk-fastjudge", max_completion_tokens=CAP)
    api_base = "http://127.0.0.1:8000/v1".rstrip("/") + "/chat/completions"
    messages = [{"role": "system", "content": "Grade strictly."},
                {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    payload = {"model": "gpt-4o-mini-2024-07-18", "messages": messages, "temperature": 0,
               "max_tokens": 2048}
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-fastjudge"}
    plain = [messages[0], {"role": "user", "content": QUESTION}]
    with TestClient(app) as c:
        r = c.post(api_base, headers=headers, content=json.dumps(payload))
        assert 200 <= r.status_code < 300, r.text
        assert_greedy(judge, greedy, json.loads(r.text), plain)
        answer = json.loads(r.text)["choices"][0]["message"]["content"].strip()
        with c.stream("POST", api_base, headers=headers,
                      content=json.dumps({**payload, "stream": True})) as s:
            assert s.status_code == 200
            assert vlmevalkit_stream_text(s.iter_lines()) == answer
        unkeyed = c.post(api_base, content=json.dumps(payload))
        assert unkeyed.status_code == 401


# -- streaming, formats, stop strings -----------------------------------------------------------
def test_stream_chunks_concatenate_to_the_completion(client, judge, greedy):
    messages = [{"role": "user", "content": QUESTION}]
    body = {"messages": messages, "max_tokens": 16}
    whole = client.post(CHAT, json=body).json()
    assert_greedy(judge, greedy, whole, messages, 16)
    r = client.post(CHAT, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    texts = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2]]
    assert len(texts) > 1  # token by token, not one block
    assert "".join(texts) == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    plain = sse_chunks(client.post(CHAT, json={**body, "stream": True}).text)
    assert "usage" not in plain[-1] and plain[-1]["choices"][0]["finish_reason"]


def test_json_schema_output_parses_and_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {
        "ok": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "grade", "schema": schema,
                                                  "strict": True}}
    for question in (QUESTION, "Grade: ski.", "Is skiing right?"):
        r = client.post(CHAT, json={"messages": [{"role": "user", "content": question}],
                                    "response_format": fmt})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": QUESTION}],
                                "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    bad = client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "b", "schema": {"type": "nonsense"}}}})
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" and "nonsense" in error["message"]


def test_stop_strings_end_the_text(client):
    messages = [{"role": "user", "content": QUESTION}]
    full = client.post(CHAT, json={"messages": messages}).json()["choices"][0]["message"]["content"]
    stop = full[4:7]
    assert len(stop) == 3
    for stream in (False, True):
        r = client.post(CHAT, json={"messages": messages, "stop": [stop, "\u2603"],
                                    "stream": stream})
        if stream:
            chunks = sse_chunks(r.text)
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text = r.json()["choices"][0]["message"]["content"]
            finish = r.json()["choices"][0]["finish_reason"]
        assert (text, finish) == (full[: full.find(stop)], "stop")


def test_concurrent_chats_and_scores_share_the_model(client, judge, greedy):
    """Chats and /v1/score items of concurrent requests go through one batcher (one thread owns
    the model); every answer is what it is alone."""
    prompts = [f"Judge answer {i}: ski." for i in range(4)]
    items = sample_examples(3, tag="oa")
    with ThreadPoolExecutor(6) as pool:
        chats = [pool.submit(client.post, CHAT, json={"messages": [{"role": "user",
                                                                   "content": p}]})
                 for p in prompts]
        scored = pool.submit(client.post, "/v1/score", json={"items": item_dicts(items)})
        for p, f in zip(prompts, chats):
            assert_greedy(judge, greedy, f.result().json(), [{"role": "user", "content": p}])
        results = scored.result().json()["results"]
    assert [r["score"] for r in results] == [r.score for r in judge.score(items)]


# -- errors -------------------------------------------------------------------------------------
def test_models_and_unknown_model_names(client, vl_dir):
    """One model, named after the checkpoint folder; any name a request gives is answered by
    it (harnesses send the OpenAI model name they were configured with)."""
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [vl_dir.name]
    for name in ("gpt-4o-mini", "no-such-model", None):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        if name:
            body["model"] = name
        r = client.post(CHAT, json=body)
        assert r.status_code == 200 and r.json()["model"] == vl_dir.name


def test_encoder_decoder_judge_has_no_chat_model(lave_judge):
    with TestClient(create_app(lave_judge)) as c:
        assert c.get("/v1/models").json() == {"object": "list", "data": []}
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def user(content):
    return {"messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("body, param, words", [
    ({}, "messages", "field required"),
    ({"messages": "hi"}, "messages", "expected a list"),
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "not supported"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string or a list"),
    (user([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]),
     "messages[0].content[0]", "does not decode"),
    (user([{"type": "image_url", "image_url": {"url": "https://example.org/a.png"}}]),
     "messages[0].content[0]", "remote image URLs are refused"),
    (user([{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}]),
     "messages[0].content[0]", "not an image"),
    (user([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]),
     "messages[0].content[0]", "not supported"),
    ({**user("x"), "n": 2}, "n", "greedy"),
    ({**user("x"), "frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
    ({**user("x"), "logprobs": True}, "logprobs", "not supported"),
    ({**user("x"), "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({**user("x"), "max_completion_tokens": "8"}, "max_completion_tokens", "expected an integer"),
    ({**user("x"), "temperature": "hot"}, "temperature", "number"),
    ({**user("x"), "response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({**user("x"), "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({**user("x"), "tools": [{"type": "function"}]}, "tools", "not supported"),
])
def test_invalid_requests_get_openai_400s(client, body, param, words):
    r = client.post(CHAT, json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert words in error["message"]


def test_body_limits_answer_openai_errors(client):
    big = json.dumps(user("x" * (70 * 1024))).encode()
    r = client.post(CHAT, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.headers["connection"] == "close"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "above the limit" in r.json()["error"]["message"]
    r = client.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = client.post(CHAT, content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 422 and "lone surrogate" in r.json()["error"]["message"]


def test_prompts_the_model_cannot_take(vl_dir):
    backend = TorchQwenBackend(vl_dir, device="cpu", dtype="float32", max_input_tokens=40)
    with TestClient(create_app(LaveJudge(backend), max_completion_tokens=4)) as c:
        r = c.post(CHAT, json=user(QUESTION * 3))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "above this server's limit of 40" in r.json()["error"]["message"]
        r = c.post(CHAT, json=user("look: <|vision_start|><|image_pad|><|vision_end|>"))
        assert r.status_code == 400 and "image tokens" in r.json()["error"]["message"]
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


def test_openapi_document_matches_the_answers(client):
    jsonschema = pytest.importorskip("jsonschema")
    document = client.get("/openapi.json").json()
    served = {(route.path, method.lower()) for route in client.app.routes
              for method in route.methods if method != "HEAD"}
    assert {(path, method) for path, ops in document["paths"].items() for method in ops} == served

    def check(name, value):
        jsonschema.validate(value, {"$ref": f"#/components/schemas/{name}", **document},
                            cls=jsonschema.Draft202012Validator)

    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text",
                                                                     "text": "hi"}]}],
            "max_tokens": 3, "stream_options": {"include_usage": True}}
    check("ChatCompletionRequest", body)
    check("ChatCompletion", client.post(CHAT, json=body).json())
    for chunk in sse_chunks(client.post(CHAT, json={**body, "stream": True}).text):
        check("ChatCompletionChunk", chunk)
    check("ModelList", client.get("/v1/models").json())
    check("OpenAIError", client.post(CHAT, json={"messages": []}).json())


_text = st.text(max_size=6) | st.sampled_from(["\ud800", "<|im_end|>", "<|image_pad|>"])
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", 3])},
    optional={"content": st.none() | _text | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": _text}), max_size=2)})
_scalars = st.none() | st.booleans() | st.integers(-2, 3) | st.floats(allow_nan=True) | _text
_bodies = st.fixed_dictionaries({"messages": st.lists(_message, max_size=3) | _scalars}, optional={
    "max_tokens": _scalars, "stream": _scalars, "n": _scalars, "temperature": _scalars,
    "stop": _scalars | st.lists(_text, max_size=5), "model": _scalars,
    "response_format": _scalars | st.fixed_dictionaries({"type": _text | st.sampled_from(
        ["json_object", "json_schema", "text"])})})


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=_bodies)
def test_fuzzed_chat_bodies_never_get_500(client, body):
    """Hypothesis-made chat bodies (wrong types, lone surrogates, special tokens, image
    parts): each answer is below 500 and each error an OpenAI error object."""
    text = json.dumps(body).encode("utf-8", "surrogatepass")
    r = client.post(CHAT, content=text, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
