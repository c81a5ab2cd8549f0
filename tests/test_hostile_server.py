"""The reward server against hostile and careless clients: deep JSON, strings no encoding can
carry, unexpected errors, stalled connections, missing keys, an item the judge fails on, and
fuzzed bodies on every route. On the tiny random-weight Flan-T5 judge."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading

import numpy as np
import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from test_async import assert_same, sample_examples  # noqa: E402
from test_serve import item_dicts, serving  # noqa: E402

from fastjudge.cli import build_parser, main  # noqa: E402
from fastjudge.judges.registry import LAVE_RESULT_FIELDS  # noqa: E402
from fastjudge.serve import create_app  # noqa: E402

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client(lave_judge):
    app = create_app(lave_judge, max_body_bytes=64 * 1024, max_queue=200, timeout_s=30)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def read_until_closed(sock: socket.socket) -> bytes:
    """All the server sends until it closes the connection (the socket timeout only guards
    against a server that never does)."""
    return b"".join(iter(lambda: sock.recv(65536), b""))


def test_json_nested_deeper_than_400_levels_is_400_before_parsing(client):
    """CPython's parser recurses once per level (Modules/_json.c, ``scan_once_unicode``), so
    5,000 levels raised RecursionError and answered 500; the limit is 400 levels, counted on
    the text (brackets inside strings do not count)."""
    too_deep = {"error": "body: JSON nested deeper than 400 levels"}
    for depth in (5000, 401):  # the body object is one level, the items value the rest
        r = client.post("/v1/score", content='{"items": %s}' % nested(depth - 1), headers=JSON)
        assert (r.status_code, r.json()) == (400, too_deep)
    r = client.post("/v1/score", content='{"items": %s}' % nested(399), headers=JSON)
    assert (r.status_code, r.json()) == (422, {"error": "items[0]: expected an object"})
    brackets_in_strings = {"question": "[" * 5000, "references": ["{" * 500], "prediction": "a",
                           "id": "s"}
    r = client.post("/v1/score", json={"items": [brackets_in_strings]})
    assert r.status_code == 200 and r.json()["results"][0]["id"] == "s"


def test_json_nested_too_deep_inside_a_get_reward_query_is_422_naming_it(client):
    """A /get_reward query is JSON text inside a string: the same limit, answered 422 like any
    other query that is not an item."""
    good = json.dumps({"question": "q?", "references": ["a"], "prediction": "a"})
    for depth in (5000, 401):
        r = client.post("/get_reward", json={"query": [good, nested(depth)]})
        assert (r.status_code, r.json()) == (
            422, {"error": "query[1]: JSON nested deeper than 400 levels"})


def test_strings_no_encoding_can_carry_are_422_naming_the_field(client):
    """A JSON escape can spell a lone surrogate; the server echoed it as the result's id and
    failed encoding its own answer (500). Valid surrogate pairs are ordinary text."""
    item = '{"question": "q?", "references": ["a"], "prediction": "a", "id": %s}'
    r = client.post("/v1/score", content='{"items": [%s]}' % (item % '"\\ud800"'), headers=JSON)
    assert (r.status_code, r.json()) == (422, {"error": (
        "items[0].id: U+D800 is a lone surrogate, which no Unicode encoding can carry; send "
        "valid Unicode text")})
    r = client.post("/v1/score", headers=JSON, content=(
        '{"items": [{"question": "q?", "references": ["a", "b\\udfffc"], "prediction": "a"}]}'))
    assert (r.status_code, r.json()) == (422, {"error": (
        "items[0].references[1]: U+DFFF is a lone surrogate, which no Unicode encoding can "
        "carry; send valid Unicode text")})
    r = client.post("/v1/score", content='{"items": [], "\\udbff": 1}', headers=JSON)
    assert (r.status_code, r.json()) == (422, {"error": (
        "body: a key holds U+DBFF, a lone surrogate, which no Unicode encoding can carry")})
    # the surrogate's UTF-8-style bytes are no valid UTF-8: malformed, as any invalid byte
    raw = ('{"items": [%s]}' % (item % '"X"')).encode().replace(b"X", b"\xed\xa0\x80")
    with pytest.raises(UnicodeDecodeError) as invalid:
        raw.decode("utf-8")
    r = client.post("/v1/score", content=raw, headers=JSON)
    assert (r.status_code, r.json()) == (400, {"error": f"malformed JSON: {invalid.value}"})
    query = json.dumps({"question": "q?", "references": ["a"], "prediction": "\ud800"})
    r = client.post("/get_reward", json={"query": [query]})
    assert (r.status_code, r.json()) == (422, {"error": (
        "query[0].prediction: U+D800 is a lone surrogate, which no Unicode encoding can carry; "
        "send valid Unicode text")})
    r = client.post("/v1/score", content='{"items": [%s]}' % (item % '"\\ud83d\\ude00"'),
                    headers=JSON)
    assert r.status_code == 200 and r.json()["results"][0]["id"] == "\U0001f600"


class Float32Scores:
    """A judge that returns numpy float32 scores, which JSON cannot encode: a stand-in for any
    bug that surfaces while a route answers."""

    def __init__(self, judge):
        self.judge = judge
        self.max_batch_tokens = judge.max_batch_tokens

    def stream(self, examples):
        for r in self.judge.stream(examples):
            yield dataclasses.replace(r, score=np.float32(r.score))


def test_unexpected_error_is_a_json_500_and_the_connection_stays_usable(lave_judge):
    """Starlette's error layer sends its text 500 and re-raises (starlette/middleware/errors.py,
    ``ServerErrorMiddleware.__call__``); uvicorn then closes the connection of an app that
    raised after starting its answer (uvicorn/protocols/http/h11_impl.py,
    ``RequestResponseCycle.run_asgi``), breaking the client's pooled connection. One httpx
    client on one connection: a 500, then 4xx answers, then /health, all on that connection."""
    app = create_app(Float32Scores(lave_judge))
    with serving(uvicorn.Config(app, log_level="critical")) as port, \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as hc:
        connections = set()

        def answer(method, path, **kwargs):
            r = hc.request(method, path, **kwargs)
            connections.add(r.extensions["network_stream"].get_extra_info("client_addr"))
            return r.status_code, r.json()

        assert answer("POST", "/v1/score", json={"items": item_dicts(sample_examples(2))}) == (
            500, {"error": "internal server error; the server log has the details"})
        assert answer("POST", "/v1/score", content=b"{", headers=JSON) == (400, {
            "error": "malformed JSON: Expecting property name enclosed in double quotes: "
                     "line 1 column 2 (char 1)"})
        assert answer("POST", "/v1/score", content=nested(600), headers=JSON) == (
            400, {"error": "body: JSON nested deeper than 400 levels"})
        assert answer("GET", "/nowhere") == (404, {"error": "Not Found"})
        assert answer("GET", "/health")[0] == 200
        assert len(connections) == 1, "the server closed the connection after an error"
        metrics = hc.get("/metrics").text
    assert 'fastjudge_requests_total{path="/v1/score",status="500"} 1' in metrics


POISON = "an answer whose preparation raises"


class PoisonedPreparation:
    """The LAVE judge, except that preparing a batch holding the POISON prediction raises before
    anything runs, as PIL's DecompressionBombError escaped an image judge's preprocessing. Each
    ``stream`` call waits for ``gate`` and records its batch size."""

    def __init__(self, judge):
        self.judge = judge
        self.max_batch_tokens = 1 << 20  # room for every queued item in one batch
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batch_sizes: list[int] = []

    def stream(self, examples):
        examples = list(examples)
        self.batch_sizes.append(len(examples))
        self.entered.set()
        assert self.gate.wait(10)
        if any(e.prediction == POISON for e in examples):
            from PIL.Image import DecompressionBombError

            raise DecompressionBombError("Image size (196000000 pixels) exceeds limit")
        return self.judge.stream(examples)


def test_an_item_the_judge_fails_on_fails_alone_in_a_shared_batch(lave_judge):
    """Two requests share one batch; one holds an item whose preparation raises. Before, the
    batcher failed every item of the batch (runtime/async_batcher.py ``AsyncBatcher._run``) and
    both requests answered 500; now that item alone gets an error result."""
    judge = PoisonedPreparation(lave_judge)
    app = create_app(judge, max_wait_ms=0)
    clean, mixed = sample_examples(3, tag="clean-"), sample_examples(3, tag="mixed-")
    mixed_items = item_dicts(mixed)
    mixed_items[1]["prediction"] = POISON

    async def until(condition):
        for _ in range(1000):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the batcher never got there")

    async def main_():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as ac:
            first = asyncio.create_task(
                ac.post("/v1/score", json={"items": item_dicts(sample_examples(1))}))
            await until(judge.entered.is_set)  # the worker holds the first request at the gate
            both = [asyncio.create_task(ac.post("/v1/score", json={"items": items}))
                    for items in (item_dicts(clean), mixed_items)]
            await until(lambda: app.state.batcher.queue_depth == 6)
            judge.gate.set()
            return await asyncio.gather(first, *both)

    try:
        _, clean_r, mixed_r = asyncio.run(main_())
    finally:
        app.state.batcher.close()
    assert judge.batch_sizes[:2] == [1, 6]  # the two requests shared one batch
    assert clean_r.status_code == 200 and mixed_r.status_code == 200
    assert_same(clean_r.json()["results"], lave_judge.score(clean))
    results = mixed_r.json()["results"]
    assert results[1] == {**dict.fromkeys(LAVE_RESULT_FIELDS), "index": 1, "id": "mixed-1",
                          "error": "DecompressionBombError: Image size (196000000 pixels) "
                                   "exceeds limit"}
    alone = lave_judge.score([mixed[0], mixed[2]])
    assert_same([results[0], results[2]], [alone[0], dataclasses.replace(alone[1], index=2)])


def test_api_key_guards_every_route_but_health(lave_judge):
    app = create_app(lave_judge, api_key="k3y")
    items = {"items": item_dicts(sample_examples(2))}
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/health").status_code == 200
        missing = {"error": "this server needs an API key: send the header Authorization: "
                            "Bearer <key>"}
        for method, path in (("POST", "/v1/score"), ("POST", "/get_reward"), ("GET", "/metrics"),
                             ("GET", "/openapi.json"), ("GET", "/nowhere")):
            r = c.request(method, path, json=items)
            assert (r.status_code, r.json(), r.headers["www-authenticate"]) == (
                401, missing, "Bearer")
        r = c.post("/v1/score", json=items, headers={"Authorization": "Bearer k3yy"})
        assert (r.status_code, r.json(), r.headers["www-authenticate"]) == (
            401, {"error": "wrong API key"}, 'Bearer error="invalid_token"')
        r = c.post("/v1/score", json=items, headers={"Authorization": "Bearer k3y"})
        assert r.status_code == 200 and len(r.json()["results"]) == 2
        r = c.get("/openapi.json", headers={"Authorization": "bearer k3y"})
        assert r.json()["security"] == [{"bearer": []}]


def test_binding_beyond_loopback_needs_a_key_or_insecure(tmp_path, capsys, monkeypatch):
    """Refused in one line with exit status 2 before the model loads; with a key (flag or
    variable) or --insecure, or on loopback, the command goes on (here to a missing model)."""
    monkeypatch.delenv("FASTJUDGE_API_KEY", raising=False)

    def serve(host, *extra):
        status = main(["serve", "--model", str(tmp_path / "missing"), "--host", host, *extra])
        return status, capsys.readouterr().err

    exposed = ("0.0.0.0", "::", "192.168.1.7", "judge.example")
    for host in exposed:
        assert serve(host) == (2, f"fastjudge: error: refusing to serve on {host} without an "
                                  "API key: set FASTJUDGE_API_KEY (or --api-key), bind a "
                                  "loopback address, or pass --insecure\n")
    allowed = [(host,) for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost")] + [
        (host, *extra) for host in exposed for extra in (("--api-key", "k"), ("--insecure",))]
    for args in allowed:
        status, err = serve(*args)
        assert status == 2 and "refusing" not in err
    monkeypatch.setenv("FASTJUDGE_API_KEY", "k")
    status, err = serve("0.0.0.0")
    assert status == 2 and "refusing" not in err


def test_stalled_heads_and_bodies_lose_their_connection(t5_dir):
    """The server a `fastjudge serve` command line builds, on a real socket. uvicorn's only
    timer is the keep-alive one, armed after a response and stopped by any byte
    (uvicorn/protocols/http/h11_impl.py ``H11Protocol.data_received``): a silent connection, a
    request head sent in part, or the unread rest of an early-answered body held a connection
    forever; a body that stops arriving held the request."""
    from fastjudge.serve.command import server_config

    args = build_parser().parse_args([
        "serve", "--model", str(t5_dir), "--device", "cpu", "--dtype", "float32",
        "--api-key", "k3y", "--header-timeout-s", "0.3", "--body-timeout-s", "0.3"])
    config = server_config(args)
    head = (b"POST /v1/score HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n")
    with serving(config) as port:
        def connect() -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.settimeout(30)
            return sock

        with connect() as silent:
            assert read_until_closed(silent) == b""
        with connect() as partial_head:
            partial_head.sendall(head)
            assert read_until_closed(partial_head) == b""
        with connect() as stalled_body:
            stalled_body.sendall(head + b"Authorization: Bearer k3y\r\n\r\n" + b'{"items": [')
            answer = read_until_closed(stalled_body)
        status, _, rest = answer.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        assert status == b"HTTP/1.1 408 Request Timeout"
        assert b"connection: close" in headers.lower().split(b"\r\n")
        assert json.loads(body) == {"error": "request body not received within 0.3 s"}
        with connect() as unread_rest:  # answered 401 without its body; the rest never comes
            unread_rest.sendall(head + b"\r\n" + b'{"items": [')
            assert read_until_closed(unread_rest).startswith(b"HTTP/1.1 401 ")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                          headers={"Authorization": "Bearer k3y"}) as hc:
            r = hc.post("/v1/score", json={"items": item_dicts(sample_examples(2))})
            assert r.status_code == 200 and len(r.json()["results"]) == 2


def test_openapi_document_describes_the_served_routes(client, lave_judge):
    """Every route the app serves is in /openapi.json with its methods, every schema is valid
    JSON Schema 2020-12 (what OpenAPI 3.1 uses), and real answers match their schemas."""
    jsonschema = pytest.importorskip("jsonschema")
    document = client.get("/openapi.json").json()
    assert document["openapi"] == "3.1.0" and "security" not in document
    served = {(route.path, method.lower()) for route in client.app.routes
              for method in route.methods if method != "HEAD"}
    assert {(path, method) for path, ops in document["paths"].items() for method in ops} == served
    schemas = document["components"]["schemas"]
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)

    def check(name: str, value) -> None:
        jsonschema.validate(value, {"$ref": f"#/components/schemas/{name}", **document},
                            cls=jsonschema.Draft202012Validator)

    items = item_dicts(sample_examples(3))
    items.append({"question": "Q?", "references": [], "prediction": "a", "id": "empty"})
    check("ScoreRequest", {"items": items})
    check("ScoreResponse", client.post("/v1/score", json={"items": items}).json())
    queries = [json.dumps(item) for item in items]
    check("RewardRequest", {"query": queries})
    check("RewardResponse", client.post("/get_reward", json={"query": queries}).json())
    check("Health", client.get("/health").json())
    check("Error", client.post("/v1/score", json={"items": [1]}).json())
    with pytest.raises(jsonschema.ValidationError):
        check("LaveItem", {"question": "q", "prediction": "a"})
    keyed = TestClient(create_app(lave_judge, api_key="k")).get(
        "/openapi.json", headers={"Authorization": "Bearer k"}).json()
    assert keyed["paths"]["/health"]["get"]["security"] == []
    assert keyed["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


# -- fuzzing -----------------------------------------------------------------------------------
_texts = st.text(st.characters(exclude_categories=()) | st.sampled_from(
    ["\ud800", "\udfff", '"', "\\", "[", "{", "\x00"]), max_size=8)
_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_texts, inner, max_size=3),
    max_leaves=10)
_lave_items = st.fixed_dictionaries(
    {"question": _texts, "prediction": _texts,
     "references": st.lists(_texts | st.fixed_dictionaries({"answer": _texts}), max_size=3)},
    optional={"caption": st.none() | _texts, "id": _values})
_deep = st.integers(1, 3000).map(nested)
_bodies = st.one_of(
    st.lists(_lave_items | _values, max_size=3).map(lambda items: json.dumps({"items": items})),
    st.lists(_lave_items.map(json.dumps) | _texts | _deep | _values, max_size=3).map(
        lambda queries: json.dumps({"query": queries})),
    _values.map(json.dumps), _deep,
    _deep.map(lambda deep: '{"items": [%s]}' % deep),
).map(lambda text: text.encode("utf-8", "surrogatepass")) | st.binary(max_size=64)
_ROUTES = [(method, path) for method in ("GET", "POST")
           for path in ("/v1/score", "/v1/score?stream=1", "/get_reward", "/health", "/metrics",
                        "/openapi.json", "/nowhere")]


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(route=st.sampled_from(_ROUTES), body=_bodies)
def test_fuzzed_bodies_on_every_route_never_get_500(client, route, body):
    """Hypothesis-made bodies (deep nesting, lone surrogates, raw bytes, wrong shapes, valid
    items) on every route and method: each answer is below 500, each error is {"error": ...},
    and the server stays healthy."""
    method, path = route
    r = client.request(method, path, content=body, headers=JSON)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert list(r.json()) == ["error"]
    elif path.endswith("stream=1"):
        assert all("index" in json.loads(line) for line in r.text.splitlines())
    assert client.get("/health").json()["status"] == "ok"
