"""The OpenAI-compatible API, over HTTP against a real uvicorn server and engine."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from kvbridge.connector.base import ConnectorUpdate
from kvbridge.engine import AsyncEngine, build_engine
from kvbridge.errors import FailureKind, LoadFailure
from kvbridge.server.api import build_app
from kvbridge.tools.testing.api_server import BackgroundServer

MODEL = "tiny-test"


REMOTE = {"do_remote_prefill": True, "remote_block_ids": [0], "remote_engine_id": "p",
          "remote_host": "127.0.0.1", "remote_port": 1}


class EchoOrFailConnector:
    """Requests that ask for a remote prefill wait for remote KV, whose load always fails;
    any request with ``kv_transfer_params`` gets them back, marked, when it finishes."""

    def __init__(self) -> None:
        self.allocated: list[str] = []
        self.refused: list = []
        self.added: dict[str, Any] = {}  # request id -> its kv_transfer_params

    def num_remote_tokens(self, request_id, prompt_ids, kv_transfer_params) -> int:
        self.added[request_id] = kv_transfer_params
        return len(prompt_ids) if kv_transfer_params and kv_transfer_params.loads_remote_kv \
            else 0

    def on_blocks_allocated(self, request_id, block_ids) -> None:
        self.allocated.append(request_id)

    def build_worker_meta(self) -> None:
        return None

    def on_refused(self, kv_transfer_params) -> None:
        self.refused.append(kv_transfer_params)

    def has_pending(self) -> bool:
        return False

    def update(self, worker_outputs) -> ConnectorUpdate:
        loaded = {r: LoadFailure(FailureKind.HANDSHAKE, "remote prefill instance unreachable")
                  for r in self.allocated}
        self.allocated = []
        return ConnectorUpdate(loaded=loaded)

    def on_finished(self, request_id, block_ids, kv_transfer_params, num_computed_tokens):
        if kv_transfer_params is None:
            return False, None
        return False, msgspec.structs.replace(kv_transfer_params, remote_request_id="echo")


CONNECTOR = EchoOrFailConnector()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, AsyncEngine]]:
    engine = AsyncEngine(build_engine(num_blocks=128, connector=CONNECTOR,
                                      kv_load_failure_policy="fail"))
    with BackgroundServer(build_app(engine, MODEL, shutdown_engine_on_exit=True)) as srv:
        yield srv.url, engine
    assert not engine.is_running


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=30) as c:
        yield c


def sse_events(resp: httpx.Response) -> list[Any]:
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in resp.text.split("\n\n"):
        if block:
            assert block.startswith("data: ")
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    return events[:-1]


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert err["code"] is None or isinstance(err["code"], str)  # one type, as the proxy's
    return err


GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


# -- happy paths ---------------------------------------------------------------------------

@pytest.mark.parametrize("given", ["r" * 300, "caf\u00e9".encode(), b"a b"])
def test_a_request_id_that_is_not_plain_is_replaced(client, given):
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", **GREEDY},
                       headers={"X-Request-Id": given})
    assert resp.status_code == 200, resp.text
    rid = resp.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and resp.json()["id"] == f"cmpl-{rid}"


def test_models_and_health(client, server):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == server[1].max_model_len
    assert client.get("/health").status_code == 200


def test_completion(client, server):
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", **GREEDY},
                       headers={"X-Request-Id": "req-1"})
    assert resp.status_code == 200
    body = resp.json()
    assert body["id"] == "cmpl-req-1" and resp.headers["x-request-id"] == "req-1"
    assert body["object"] == "text_completion" and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["text"]
    ids = server[1].tokenizer.encode("Hello")
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12,
                             "total_tokens": len(ids) + 12}
    assert "kv_transfer_params" not in body
    # The same prompt as token ids gives the same text.
    by_ids = client.post("/v1/completions", json={"prompt": ids, **GREEDY}).json()
    assert by_ids["choices"][0]["text"] == choice["text"]


def test_streamed_completion_matches_non_streamed(client):
    req = {"prompt": "The quick brown fox", **GREEDY}
    full = client.post("/v1/completions", json=req).json()
    resp = client.post("/v1/completions", json={
        **req, "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    events = sse_events(resp)
    *chunks, usage = events
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len(chunks) > 2  # really incremental
    assert usage["choices"] == [] and usage["usage"] == full["usage"]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_sent_token_ids_text_is_not_sent_again_when_not_streamed(client, server, chat):
    """protocol.md 11: the decode counts the tokens the client already has (usage) and does
    not send their text again, streamed or not."""
    sent = server[1].tokenizer.encode("Hello there")[:2]
    assert server[1].tokenizer.decode(sent)
    path, req = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}) \
        if chat else ("/v1/completions", {"prompt": "The quick brown fox"})
    req = {**req, **GREEDY, "kv_transfer_params": {"sent_token_ids": sent}}
    full = client.post(path, json=req).json()
    text = full["choices"][0]["message"]["content"] if chat else full["choices"][0]["text"]
    chunks = sse_events(client.post(path, json={**req, "stream": True}))
    streamed = "".join((c["choices"][0]["delta"].get("content") or "") if chat
                       else c["choices"][0]["text"] for c in chunks)
    assert text == streamed
    assert full["usage"]["completion_tokens"] == GREEDY["max_tokens"]


def test_chat_completion_streamed_and_not(client, server):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hi!"}]
    req = {"model": MODEL, "messages": messages, "temperature": 0, "max_completion_tokens": 10,
           "ignore_eos": True}
    full = client.post("/v1/chat/completions", json=req).json()
    assert full["object"] == "chat.completion"
    msg = full["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"]
    prompt_ids = server[1].tokenizer.encode_chat(messages)
    assert full["usage"]["prompt_tokens"] == len(prompt_ids)
    assert full["usage"]["completion_tokens"] == 10
    events = sse_events(client.post("/v1/chat/completions", json={**req, "stream": True}))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == msg["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_kv_transfer_params_round_trip(client):
    params = {"do_remote_decode": True, "remote_block_ids": None}
    echo = {"do_remote_decode": True, "do_remote_prefill": False, "remote_request_id": "echo"}
    body = client.post("/v1/completions", json={
        "prompt": "abc", "max_tokens": 1, "kv_transfer_params": params}).json()
    assert body["kv_transfer_params"] == echo
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "kv_transfer_params": params}).json()
    assert chat["kv_transfer_params"] == echo
    events = sse_events(client.post("/v1/completions", json={
        "prompt": "abc", "max_tokens": 3, "stream": True, "kv_transfer_params": params}))
    assert events[-1]["kv_transfer_params"] == echo


def test_concurrent_requests_match_sequential(server):
    prompts = [f"prompt number {i}: " + "x" * i for i in range(8)]

    async def run() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(base_url=server[0], timeout=30) as c:
            async def one(p: str) -> str:
                r = await c.post("/v1/completions", json={"prompt": p, **GREEDY})
                return r.json()["choices"][0]["text"]
            sequential = [await one(p) for p in prompts]
            concurrent = await asyncio.gather(*(one(p) for p in prompts))
            return sequential, list(concurrent)

    sequential, concurrent = asyncio.run(run())
    assert concurrent == sequential


def test_seeded_sampling_is_reproducible(client):
    req = {"prompt": "Once upon a time", "temperature": 1.0, "seed": 5, "max_tokens": 16,
           "ignore_eos": True}
    a = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    assert a == b


# -- errors --------------------------------------------------------------------------------

def test_malformed_json(client):
    resp = client.post("/v1/completions", content=b'{"prompt": ',
                       headers={"content-type": "application/json"})
    assert_error(resp, 400)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": 5}, "prompt"),
    ({}, None),  # prompt missing
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "kv_transfer_params": [1]}, "kv_transfer_params"),
    ({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": "false"}}, "kv_transfer_params"),
    ({"prompt": "x", "kv_transfer_params": {**REMOTE, "remote_port": "25600"}},
     "kv_transfer_params"),
    ({"prompt": "x", "kv_transfer_params": {**REMOTE, "remote_block_ids": [0, 1]}},
     "kv_transfer_params"),  # two blocks for a one-block prompt
    ({"prompt": "x", "kv_transfer_params": {**REMOTE, "remote_host": None}},
     "kv_transfer_params"),
])
def test_bad_completion_requests(client, body, param):
    assert_error(client.post("/v1/completions", json=body), 400, param)


def test_a_refused_request_releases_nobody_s_kv(client):
    """The params of a refused request are unproven (any client can name another request's
    hold): the decode tells no prefill to release them (the proxy does, with the token)."""
    before = len(CONNECTOR.refused)
    for body in ({"prompt": "x", "max_tokens": -1}, {"prompt": "x", "model": "other"},
                 {"prompt": "x" * 5000}):
        assert client.post("/v1/completions", json={**body, "kv_transfer_params": REMOTE}
                           ).status_code in (400, 404)
    # the engine loop takes commands in order; a request after them has seen every one
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}
                       ).status_code == 200
    assert CONNECTOR.refused[before:] == []


def test_prompt_too_long(client, server):
    max_len = server[1].max_model_len
    err = assert_error(client.post("/v1/completions", json={
        "prompt": [65] * max_len, "max_tokens": 1}), 400, "prompt")
    assert "context length" in err["message"]
    assert_error(client.post("/v1/completions", json={
        "prompt": [65] * 10, "max_tokens": max_len}), 400, "prompt")


def test_bad_chat_requests(client):
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"content": "x"}]}),
                 400, "messages")
    assert_error(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}),
        400, "max_completion_tokens")


def test_vllm_params_without_remote_request_id_name_the_label(client):
    """vLLM's protocol may leave ``remote_request_id`` out: the prefill's request then went
    by the x-request-id the proxy gave both hops, the decode's label, not its own id."""
    req = {"prompt": "Hello there", "max_tokens": 4, "kv_transfer_params": REMOTE}
    assert_error(client.post("/v1/completions", json=req,
                             headers={"x-request-id": "vllm-rid"}), 502)
    (own,) = [rid for rid, params in CONNECTOR.added.items()
              if params is not None and params.remote_request_id == "vllm-rid"]
    assert own.startswith("vllm-rid-") and own != "vllm-rid"  # the engine's own, unique
    given = {**REMOTE, "remote_request_id": "prefill-rid"}
    assert_error(client.post("/v1/completions", json={**req, "kv_transfer_params": given},
                             headers={"x-request-id": "vllm-rid"}), 502)
    assert [p.remote_request_id for p in CONNECTOR.added.values()
            if p is not None].count("prefill-rid") == 1


def test_unknown_model(client):
    err = assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}),
                       404, "model")
    assert err["code"] == "model_not_found"


def test_failed_kv_load_returns_502_not_a_hang(client):
    req = {"prompt": "Hello there", "max_tokens": 4, "kv_transfer_params": REMOTE}
    err = assert_error(client.post("/v1/completions", json=req), 502)
    assert "remote prefill instance unreachable" in err["message"]
    err = assert_error(client.post("/v1/completions", json={**req, "stream": True}), 502)
    assert "unreachable" in err["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "kv_transfer_params": REMOTE}
    assert_error(client.post("/v1/chat/completions", json=chat), 502)
    # The engine is fine afterwards, with every block back.
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code \
        == 200


def test_one_request_id_from_two_clients_in_flight_is_two_requests(client):
    """Client ids are labels: a second request naming a running one's x-request-id is
    served too (it was a 400 "already in use": one client could fail another's request)."""
    req = {"prompt": "same id", "max_tokens": 500, "ignore_eos": True, "stream": True}
    hdr = {"X-Request-Id": "dup"}
    with client.stream("POST", "/v1/completions", json=req, headers=hdr) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: dropping it would close the connection
        assert next(lines).startswith("data: ")  # the first request is now running
        second = client.post("/v1/completions", json={**req, "stream": False, "max_tokens": 3},
                             headers=hdr)
        assert second.status_code == 200, second.text
        assert second.headers["x-request-id"] == "dup" and second.json()["id"] == "cmpl-dup"
        assert second.json()["choices"][0]["finish_reason"] == "length"


def test_request_id_reused_right_after_a_disconnect_gets_its_own_outputs(client):
    """A client disconnect aborts the request; a new request with the same id, sent at once,
    must not receive the old request's final "abort" output."""
    req = {"prompt": "reuse", "max_tokens": 300, "ignore_eos": True, "stream": True}
    hdr = {"X-Request-Id": "reused"}
    for _ in range(5):
        with client.stream("POST", "/v1/completions", json=req, headers=hdr) as first:
            next(first.iter_lines())  # dropping the iterator closes the connection
        again = client.post("/v1/completions", json={**req, "stream": False, "max_tokens": 3},
                            headers=hdr)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["finish_reason"] == "length"


def test_a_dead_engine_fails_requests_instead_of_hanging():
    """Kill the worker process mid-stream: the stream ends with an error event, and later
    requests and the health check answer 503."""
    engine = AsyncEngine(build_engine(num_blocks=64, worker_processes=True, num_threads=1))
    (pid,) = engine.engine.worker_pids
    with BackgroundServer(build_app(engine, MODEL, shutdown_engine_on_exit=True)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        req = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=req) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(pid, signal.SIGKILL)
            events = [json.loads(line[6:]) for line in lines
                      if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "engine_not_running"
        err = assert_error(c.post("/v1/completions", json={"prompt": "x"}), 503)
        assert err["code"] == "engine_not_running"
        assert_error(c.get("/health"), 503)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_body_is_400_not_500(client, path):
    r = client.post(path, content=b"[" * 100_000)
    assert r.status_code == 400, r.text
    assert "nests 100000 levels" in r.json()["error"]["message"]
    body = {"model": MODEL, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
            "kv_transfer_params": {"x": 1}}
    nested = json.dumps(body).replace('{"x": 1}', "[" * 3000 + "]" * 3000)
    r = client.post(path, content=nested)
    assert r.status_code == 400, r.text


def test_json_depth_ignores_brackets_in_strings():
    from kvbridge.limits import json_depth

    assert json_depth(b'{"a": "[[[[{{{", "b": [1, [2]]}') == 3
    assert json_depth(rb'["\"[[[", [[]]]') == 3
    assert json_depth(b"42") == 0
