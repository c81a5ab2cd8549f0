"""The reward server (``fastjudge.serve``): endpoints, limits, errors, concurrency, and one run
on a real loopback socket, on the tiny random-weight Flan-T5 judge."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402
from test_async import GatedJudge, assert_same, sample_examples  # noqa: E402

from fastjudge.cli import build_parser  # noqa: E402
from fastjudge.serve import create_app  # noqa: E402


def item_dicts(examples):
    return [{"question": e.question, "references": list(e.references),
             "prediction": e.prediction, "caption": e.caption, "id": e.id} for e in examples]


@pytest.fixture(scope="module")
def client(lave_judge):
    app = create_app(lave_judge, max_body_bytes=64 * 1024, max_queue=200, timeout_s=30)
    with TestClient(app) as c:
        yield c


def test_score_returns_results_in_input_order(client, lave_judge):
    items = sample_examples(6, tag="s")
    r = client.post("/v1/score", json={"items": item_dicts(items)})
    assert r.status_code == 200, r.text
    assert_same(r.json()["results"], lave_judge.score(items))
    # per-item errors are results, not request failures
    r = client.post("/v1/score", json={"items": [{"question": "Q?", "references": [],
                                                  "prediction": "a", "id": "empty"}]})
    assert r.status_code == 200 and "references are empty" in r.json()["results"][0]["error"]
    assert client.post("/v1/score", json={"items": []}).json() == {"results": []}


def test_score_stream_is_ndjson_one_line_per_item(client, lave_judge):
    items = sample_examples(9, tag="n")
    with client.stream("POST", "/v1/score?stream=1", json={"items": item_dicts(items)}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert sorted(x["index"] for x in lines) == list(range(9))
    assert_same(sorted(lines, key=lambda x: x["index"]), lave_judge.score(items))


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "malformed JSON"),
    (b"[1, 2]", 422, "body: expected an object"),
    (b'{"items": {"question": "q"}}', 422, "items: expected a list"),
    (b'{"items": [3]}', 422, "items[0]: expected an object"),
    (b'{"items": [{"question": "q", "prediction": "a"}]}', 422,
     "items[0].references: field required"),
    (b'{"items": [{"question": "q", "references": "a", "prediction": "a"}]}', 422,
     "items[0].references: expected a list"),
    (b'{"items": [{"question": "q", "references": ["a", 7], "prediction": "a"}]}', 422,
     'items[0].references[1]: a reference is a string or {"answer": string}'),
    (b'{"items": [{"question": "q", "references": ["a"], "prediction": 1}]}', 422,
     "items[0].prediction: expected a string"),
    (b'{"items": [{"question": 2, "references": ["a"], "prediction": "a"}]}', 422,
     "items[0].question: expected a string"),
    (b'{"items": [{"question": "q", "references": ["a"], "prediction": "a", "caption": 5}]}',
     422, "items[0].caption: expected a string"),
    (b'{"items": [{"question": "q", "references": ["a"], "prediction": "a", "id": [1]}]}',
     422, "items[0].id: expected a string or an integer or a number or a boolean"),
])
def test_malformed_requests_get_4xx_with_a_message(client, body, status, message):
    r = client.post("/v1/score", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    assert message in r.json()["error"]


def test_oversize_body_gets_413(client):
    big = {"items": [{"question": "q" * 70000, "references": ["a"], "prediction": "a"}]}
    r = client.post("/v1/score", json=big)
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def chunks():  # no Content-Length: counted while reading
        for _ in range(20):
            yield b" " * 8192

    r = client.post("/v1/score", content=chunks())
    assert r.status_code == 413


def test_get_reward_openrlhf_protocol(client, lave_judge):
    items = sample_examples(4, tag="g")
    queries = [json.dumps({"question": e.question, "references": list(e.references),
                           "prediction": e.prediction}) for e in items]
    r = client.post("/get_reward", json={"query": queries})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["rewards"] == [x.score for x in lave_judge.score(items)]
    assert body["errors"] == [None] * 4
    bad = json.dumps({"question": "q", "references": [], "prediction": "a"})
    rejected = client.post("/get_reward", json={"query": [bad]}).json()
    assert rejected["rewards"] == [0.0] and rejected["errors"][0]  # a number, and why
    assert rejected["extra_logs"] == {"error": [1.0], "rating": [0.0]}
    r = client.post("/get_reward", json={"query": [queries[0], "Question: q\nAnswer: a"]})
    assert r.status_code == 422 and "query[1]: not a JSON object string" in r.json()["error"]
    r = client.post("/get_reward", json={"query": "x"})
    assert r.status_code == 422


def test_health_and_metrics(client):
    assert client.get("/health").json()["status"] == "ok"
    client.post("/v1/score", json={"items": item_dicts(sample_examples(2))})
    text = client.get("/metrics").text
    for name in ("fastjudge_queue_depth ", "fastjudge_items_total ",
                 "fastjudge_items_per_second ", 'fastjudge_request_latency_seconds_bucket{le="+Inf"}',
                 'fastjudge_requests_total{path="/v1/score",status="200"}'):
        assert name in text
    items_total = int(next(line.split()[-1] for line in text.splitlines()
                           if line.startswith("fastjudge_items_total ")))
    assert items_total >= 2


def test_queue_full_gets_429_and_timeout_gets_504(lave_judge):
    gated = GatedJudge(lave_judge)
    # the deadline also bounds the last request, scored after the held one: room for a loaded machine
    app = create_app(gated, max_queue=2, timeout_s=1.5, max_wait_ms=0)
    with TestClient(app) as c:
        r = c.post("/v1/score", json={"items": item_dicts(sample_examples(3))})
        assert r.status_code == 429 and "queue full" in r.json()["error"]
        # the worker is held at the gate: the request times out
        r = c.post("/v1/score", json={"items": item_dicts(sample_examples(1))})
        assert r.status_code == 504 and "1.5" in r.json()["error"]
        gated.gate.set()
        r = c.post("/v1/score", json={"items": item_dicts(sample_examples(2))})
        assert r.status_code == 200 and len(r.json()["results"]) == 2


def test_concurrent_clients_no_lost_or_duplicated_results(lave_judge):
    app = create_app(lave_judge, max_queue=1000)
    groups = [sample_examples(n, tag=f"k{k}-") for k, n in enumerate([1, 2, 5, 8, 3, 13, 4, 6] * 2)]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as ac:
            responses = await asyncio.gather(
                *(ac.post("/v1/score", json={"items": item_dicts(g)}) for g in groups))
        return [r.json()["results"] for r in responses]

    try:
        got = asyncio.run(main())
    finally:
        app.state.batcher.close()
    for g, results in zip(groups, got):
        assert [x["id"] for x in results] == [e.id for e in g]
        assert_same(results, lave_judge.score(g))
    assert app.state.batcher.batches_done < len(groups)  # callers shared batches


@contextlib.contextmanager
def serving(config):
    """``uvicorn.Server(config)`` on a free loopback port, in a thread; yields the port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_real_socket_server(lave_judge):
    import uvicorn

    app = create_app(lave_judge)
    with serving(uvicorn.Config(app, log_level="warning", lifespan="on")) as port:
        base = f"http://127.0.0.1:{port}"
        groups = [sample_examples(n, tag=f"r{k}-") for k, n in enumerate([3, 1, 7, 4, 2, 5])]
        with httpx.Client(base_url=base, timeout=30) as hc:
            assert hc.get("/health").status_code == 200
            with ThreadPoolExecutor(6) as pool:
                responses = list(pool.map(
                    lambda g: hc.post("/v1/score", json={"items": item_dicts(g)}), groups))
            for g, r in zip(groups, responses):
                assert r.status_code == 200
                assert_same(r.json()["results"], lave_judge.score(g))
            with hc.stream("POST", "/v1/score?stream=1",
                           json={"items": item_dicts(groups[2])}) as r:
                lines = [json.loads(x) for x in r.iter_lines() if x]
            assert sorted(x["id"] for x in lines) == sorted(e.id for e in groups[2])


def test_cli_has_serve_subcommand():
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert (args.judge, args.host, args.port) == ("lave", "127.0.0.1", 8000)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--judge", "nope", "--model", "m"])
