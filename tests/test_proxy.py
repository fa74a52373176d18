"""Unit tests of the P/D proxy (kvbridge.proxy).

The prefill and decode engines here are small stand-in Starlette apps served by real uvicorn
servers on 127.0.0.1 ephemeral ports; they record what they receive. The end-to-end tests with
the real kvbridge engines live elsewhere.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbridge.errors import ConfigError
from kvbridge.proxy import build_proxy_app
from kvbridge.tools.testing.certs import issue, new_ca
from tests import raw_engine
from tests.helpers import RawServer, read_request, wait_until
from tests.raw_engine import RawEngine

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

Serve = Callable[..., str]


class FakeEngine:
    """A stand-in engine: records each request, answers like a vLLM prefill or decode."""

    def __init__(self, name: str, role: str) -> None:
        self.name = name
        self.role = role
        self.url = ""
        self.calls: list[dict[str, Any]] = []
        self.fail: tuple[int, Any] | None = None  # (status, JSON body or text) to answer with
        self.hold: threading.Event | None = None  # prefill answers only once this is set
        self.gate: threading.Event | None = None  # decode stream pauses after chunk 0 until set
        self.endless = False  # decode stream never ends after chunk 0
        self.stream_closed = threading.Event()
        self.releases: list[Any] = []  # bodies of POST /v1/kv/release
        self.n_chunks = 5
        # What a vLLM prefill returns for its decode to pull the KV cache.
        self.kv_params: dict[str, Any] | None = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{name}",
            "remote_block_ids": [1, 2, 3],
            "remote_host": "10.0.0.7",
            "remote_port": 5600,
            "tp_size": 1,
        }

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(
            {"path": request.url.path, "headers": dict(request.headers), "body": body}
        )
        if self.fail is not None:
            status, payload = self.fail
            if isinstance(payload, str):
                return PlainTextResponse(payload, status_code=status)
            return JSONResponse(payload, status_code=status)
        if self.hold is not None:
            await anyio.to_thread.run_sync(self.hold.wait, 10)
        if self.role == "prefill":
            out: dict[str, Any] = {"id": f"cmpl-{self.name}", "choices": [{"text": "x"}]}
            if self.kv_params is not None:
                out["kv_transfer_params"] = self.kv_params
            return JSONResponse(out)
        if body.get("stream"):
            return StreamingResponse(self._sse(), media_type="text/event-stream")
        return JSONResponse({"id": f"cmpl-{self.name}", "served_by": self.name})

    async def _sse(self) -> Any:
        try:
            for i in range(self.n_chunks):
                yield f"data: {json.dumps({'by': self.name, 'i': i})}\n\n"
                if i == 0 and self.endless:
                    await anyio.sleep_forever()
                if i == 0 and self.gate is not None:
                    # If the proxy buffered, the client never sees chunk 0 before this times out.
                    if not await anyio.to_thread.run_sync(self.gate.wait, 5):
                        yield 'data: "gate-timeout"\n\n'
            yield "data: [DONE]\n\n"
        finally:
            self.stream_closed.set()

    async def _models(self, request: Request) -> Response:
        self.calls.append({"path": request.url.path, "headers": dict(request.headers)})
        return JSONResponse({"object": "list", "data": [{"id": "m", "owned_by": self.name}]})

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _release(self, request: Request) -> Response:
        self.releases.append(await request.json())
        return JSONResponse({"released": True})

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/kv/release", self._release, methods=["POST"]),
            ]
        )


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Serve an ASGI app with a real uvicorn in a thread; returns its base URL."""
    servers: list[tuple[uvicorn.Server, threading.Thread, socket.socket]] = []

    def start(app: Any, **config: Any) -> str:
        # Bound and listening before uvicorn starts: early connections wait in the backlog,
        # so nobody has to wait for start-up.
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        server = uvicorn.Server(
            uvicorn.Config(
                app, log_config=None, log_level="warning", timeout_graceful_shutdown=2, **config
            )
        )
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread, sock))
        scheme = "https" if "ssl_certfile" in config else "http"
        return f"{scheme}://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, _, _ in servers:
        server.should_exit = True
    for _, thread, sock in servers:
        thread.join(10)
        sock.close()


def _engines(serve: Serve, role: str, n: int, **config: Any) -> list[FakeEngine]:
    engines = [FakeEngine(f"{role[0]}{i}", role) for i in range(n)]
    for e in engines:
        e.url = serve(e.app(), **config)
    return engines


def _proxy(
    serve: Serve, prefills: list[FakeEngine], decodes: list[FakeEngine], **kwargs: Any
) -> httpx.Client:
    kwargs.setdefault("timeout", 5.0)
    kwargs.setdefault("connect_timeout", 2.0)
    # The fakes have no /v1/kv/info: a prewarm would warm them up with a request of its
    # own, which the tests would count among the client's (prewarm has tests of its own).
    kwargs.setdefault("prewarm", False)
    kwargs.setdefault("admin_routes", "open")  # the tests read /v1/fleet, /metrics, ...
    app = build_proxy_app([p.url for p in prefills], [d.url for d in decodes], **kwargs)
    return httpx.Client(base_url=serve(app), timeout=10.0, trust_env=False)


@pytest.fixture
def pd(serve: Serve) -> Iterator[tuple[httpx.Client, FakeEngine, FakeEngine]]:
    """One prefill, one decode, a proxy in front, and a client of the proxy."""
    (prefill,) = _engines(serve, "prefill", 1)
    (decode,) = _engines(serve, "decode", 1)
    with _proxy(serve, [prefill], [decode]) as client:
        yield client, prefill, decode


def test_prefill_then_decode_protocol(pd: tuple[httpx.Client, FakeEngine, FakeEngine]) -> None:
    client, prefill, decode = pd
    request = {
        "model": "m",
        "prompt": "Hello",
        "max_tokens": 64,
        "temperature": 0.0,
        "stream": False,
        "stream_options": {"include_usage": True},
    }
    r = client.post("/v1/completions", json=request)
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "cmpl-d0", "served_by": "d0"}

    (pcall,) = prefill.calls
    assert pcall["path"] == "/v1/completions"
    assert pcall["body"]["max_tokens"] == 1
    assert pcall["body"]["stream"] is False
    assert pcall["body"]["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert "stream_options" not in pcall["body"]
    assert {k: pcall["body"][k] for k in ("model", "prompt", "temperature")} == {
        "model": "m",
        "prompt": "Hello",
        "temperature": 0.0,
    }

    # The decode gets the client's request untouched, plus exactly the prefill's KV params.
    (dcall,) = decode.calls
    assert dcall["path"] == "/v1/completions"
    assert dcall["body"] == {**request, "kv_transfer_params": prefill.kv_params}

    rid = pcall["headers"]["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    assert dcall["headers"]["x-request-id"] == rid
    assert r.headers["x-request-id"] == rid


def test_chat_request_id_and_authorization_forwarded(
    pd: tuple[httpx.Client, FakeEngine, FakeEngine],
) -> None:
    client, prefill, decode = pd
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "max_completion_tokens": 50,
    }
    headers = {"X-Request-Id": "client-rid-42", "Authorization": "Bearer sk-test"}
    r = client.post("/v1/chat/completions", json=request, headers=headers)
    assert r.status_code == 200, r.text

    (pcall,) = prefill.calls
    (dcall,) = decode.calls
    assert pcall["path"] == dcall["path"] == "/v1/chat/completions"
    assert pcall["body"]["max_tokens"] == 1
    assert pcall["body"]["max_completion_tokens"] == 1
    assert dcall["body"]["max_completion_tokens"] == 50
    for call in (pcall, dcall):
        assert call["headers"]["x-request-id"] == "client-rid-42"
        assert call["headers"]["authorization"] == "Bearer sk-test"
    assert r.headers["x-request-id"] == "client-rid-42"


@pytest.mark.parametrize("given", ["r" * 300, "caf\u00e9".encode(), b"two words", b"a/b"])
def test_a_client_request_id_that_is_not_plain_is_replaced(
    pd: tuple[httpx.Client, FakeEngine, FakeEngine], given: str | bytes
) -> None:
    """Too long, non-ASCII or with characters outside [A-Za-z0-9._:@+=-]: the engines get
    an id of the proxy's own (the client's would be refused or break a header later)."""
    client, prefill, decode = pd
    r = client.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 2},
                    headers={"x-request-id": given})
    assert r.status_code == 200, r.text
    (pcall,), (dcall,) = prefill.calls, decode.calls
    rid = pcall["headers"]["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    assert dcall["headers"]["x-request-id"] == rid == r.headers["x-request-id"]


def test_streaming_passthrough_in_order(pd: tuple[httpx.Client, FakeEngine, FakeEngine]) -> None:
    client, prefill, decode = pd
    decode.gate = threading.Event()
    events: list[str] = []
    try:
        request = {"model": "m", "prompt": "Hello", "max_tokens": 8, "stream": True}
        with client.stream("POST", "/v1/completions", json=request) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                # Chunk 0 got here while the decode is still paused: it is relayed as it comes.
                decode.gate.set()
    finally:
        decode.gate.set()

    expected = [f"data: {json.dumps({'by': 'd0', 'i': i})}" for i in range(decode.n_chunks)]
    assert events == expected + ["data: [DONE]"]
    assert prefill.calls[0]["body"]["stream"] is False
    assert decode.calls[0]["body"]["stream"] is True


def test_client_disconnect_closes_decode_stream(
    pd: tuple[httpx.Client, FakeEngine, FakeEngine],
) -> None:
    client, _, decode = pd
    decode.endless = True
    request = {"model": "m", "prompt": "Hello", "stream": True}
    with client.stream("POST", "/v1/completions", json=request) as r:
        first = next(line for line in r.iter_lines() if line)
        assert first == f"data: {json.dumps({'by': 'd0', 'i': 0})}"
    # Leaving the block drops the client connection; the proxy must hang up on the decode.
    assert decode.stream_closed.wait(5)


def test_rotation_and_prefill_failover(serve: Serve) -> None:
    prefills = _engines(serve, "prefill", 2)
    decodes = _engines(serve, "decode", 2)
    with _proxy(serve, prefills, decodes) as client:
        served_by = []
        for _ in range(4):
            r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200, r.text
            served_by.append(r.json()["served_by"])
        assert served_by == ["d0", "d1", "d0", "d1"]
        assert [len(p.calls) for p in prefills] == [2, 2]
        # A failing prefill: the request is retried once on the other, invisibly.
        prefills[0].fail = (503, {"error": {"message": "busy"}})
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200, r.text
        assert [len(p.calls) for p in prefills] == [3, 3]
        # ... and the failed one is avoided for a while: no more calls to it.
        for _ in range(3):
            assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert [len(p.calls) for p in prefills] == [3, 6]
        fleet = client.get("/v1/fleet").json()
        failing = {b["url"]: b["cooling_down"] for b in fleet["prefill"]}
        assert failing == {prefills[0].url: True, prefills[1].url: False}
        assert 'kvbridge_proxy_failovers_total{stage="prefill"} 1.0' in client.get("/metrics").text
    # Each decode was told about the prefill that served the same request.
    for d in decodes:
        for call in d.calls[2:]:
            assert call["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-p1"


def test_dead_prefill_fails_over(serve: Serve) -> None:
    (alive,) = _engines(serve, "prefill", 1)
    (decode,) = _engines(serve, "decode", 1)
    dead = _closed_port_url()
    app = build_proxy_app([dead, alive.url], [decode.url], timeout=5.0, connect_timeout=2.0,
                          prewarm=False, admin_routes="open")
    with httpx.Client(base_url=serve(app), timeout=10.0, trust_env=False) as client:
        for _ in range(4):
            r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200, r.text
    assert len(alive.calls) == 4 and len(decode.calls) == 4


def test_dead_decode_fails_over_and_releases_the_hold(serve: Serve) -> None:
    (prefill,) = _engines(serve, "prefill", 1)
    (decode,) = _engines(serve, "decode", 1)
    dead = _closed_port_url()
    app = build_proxy_app([prefill.url], [dead, decode.url], timeout=5.0, connect_timeout=2.0,
                          prewarm=False, admin_routes="open")
    with httpx.Client(base_url=serve(app), timeout=10.0, trust_env=False) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 200, r.text
        assert r.json()["served_by"] == "d0"
        # the first prefill's blocks were released, and the prefill ran again for d0
        wait_until(lambda: prefill.releases, 5, "a /v1/kv/release reached the prefill")
        assert prefill.releases == [prefill.kv_params]
        assert [c["path"] for c in prefill.calls] == ["/v1/completions"] * 2
        # the retry runs under an id of its own (the prefill may still hold the first);
        # the client keeps its own
        first, second = (c["headers"]["x-request-id"] for c in prefill.calls)
        assert second == first + "-retry" and r.headers["x-request-id"] == first
        assert 'kvbridge_proxy_failovers_total{stage="decode"} 1.0' in client.get("/metrics").text


def _dies_after_headers(conn: socket.socket) -> None:
    """A decode that accepts the request, sends a 200 head, and dies before any token."""
    read_request(conn)
    conn.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    conn.shutdown(socket.SHUT_RDWR)
    conn.close()


@pytest.mark.parametrize("stream", [False, True])
def test_decode_dead_before_first_token_fails_over(serve: Serve, stream: bool) -> None:
    (prefill,) = _engines(serve, "prefill", 1)
    (decode,) = _engines(serve, "decode", 1)
    with RawServer(_dies_after_headers) as dying:
        dead = f"http://127.0.0.1:{dying.port}"
        app = build_proxy_app([prefill.url], [dead, decode.url], timeout=5.0, connect_timeout=2.0,
                              prewarm=False, admin_routes="open")
        with httpx.Client(base_url=serve(app), timeout=10.0, trust_env=False) as client:
            r = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
            assert r.status_code == 200, r.text
            assert "d0" in r.text  # the whole answer came from the live decode
            wait_until(lambda: prefill.releases, 5, "the first prefill's hold released")
            assert len(prefill.calls) == 2 and len(decode.calls) == 1
            view = client.get("/v1/fleet").json()
            assert {b["url"]: b["failures"] for b in view["decode"]} == {dead: 1, decode.url: 0}


def test_no_failover_without_another_instance(serve: Serve) -> None:
    (prefill,) = _engines(serve, "prefill", 1)
    (decode,) = _engines(serve, "decode", 1)
    prefill.fail = (503, {"error": {"message": "busy"}})
    with _proxy(serve, [prefill], [decode]) as client:
        r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "busy" in r.json()["error"]["message"]
    assert len(prefill.calls) == 1 and decode.calls == []


@pytest.mark.parametrize("routing", ["least-outstanding", "round-robin"])
def test_least_outstanding_avoids_a_busy_prefill(serve: Serve, routing: str) -> None:
    prefills = _engines(serve, "prefill", 2)
    (decode,) = _engines(serve, "decode", 1)
    prefills[0].hold = threading.Event()
    with _proxy(serve, prefills, [decode], routing=routing) as client:
        with ThreadPoolExecutor(3) as pool:
            futures = []
            for _ in range(3):  # one at a time: each ends on p1, or waits held on p0
                held = len(prefills[0].calls)
                fut = pool.submit(client.post, "/v1/completions", json={"prompt": "x"})
                futures.append(fut)
                wait_until(lambda f=fut, n=held: f.done() or len(prefills[0].calls) != n, 5,
                           "the request answered or held on p0", every=0.01)
            prefills[0].hold.set()
            assert [f.result(10).status_code for f in futures] == [200, 200, 200]
    # least outstanding: both went to the idle p1; round robin: the second went to p0
    expected = [1, 2] if routing == "least-outstanding" else [2, 1]
    assert [len(p.calls) for p in prefills] == expected


@pytest.mark.parametrize(
    ("status", "payload", "reason"),
    [
        (
            400,
            {
                "error": {
                    "message": "prompt is too long: 9000 > 8192 tokens",
                    "type": "BadRequestError",
                    "param": "prompt",
                    "code": 400,
                }
            },
            "prompt is too long: 9000 > 8192 tokens",
        ),
        (
            404,
            {
                "error": {
                    "message": "the model 'x' does not exist",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            },
            "does not exist",
        ),
        (503, "engine is draining", "engine is draining"),
        (500, {"detail": "CUDA out of memory"}, "CUDA out of memory"),
    ],
)
def test_prefill_error_reaches_client(
    pd: tuple[httpx.Client, FakeEngine, FakeEngine], status: int, payload: Any, reason: str
) -> None:
    client, prefill, decode = pd
    prefill.fail = (status, payload)
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x" * 10})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert reason in err["message"]
    assert prefill.url in err["message"]
    # code is always a string: the engine's own when it gave one, else the HTTP status
    engine_code = payload["error"]["code"] if isinstance(payload, dict) and "error" in payload \
        else None
    assert err["code"] == (engine_code if isinstance(engine_code, str) else str(status))
    if isinstance(payload, dict) and "error" in payload:
        assert err["type"] == payload["error"]["type"]
        assert err["param"] == payload["error"]["param"]
    assert len(prefill.calls) == 1
    assert decode.calls == []


def _closed_port_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def test_dead_prefill_is_502_naming_it(serve: Serve) -> None:
    (decode,) = _engines(serve, "decode", 1)
    dead = FakeEngine("p0", "prefill")
    dead.url = _closed_port_url()
    # a refused connection is reported at once, not after the connect timeout
    with _proxy(serve, [dead], [decode], connect_timeout=30.0) as client:
        start = time.monotonic()
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        elapsed = time.monotonic() - start
    assert r.status_code == 502
    assert dead.url in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "502"  # a string, as every kvbridge server's
    assert elapsed < 5.0
    assert decode.calls == []


def test_slow_prefill_times_out_with_504(serve: Serve) -> None:
    (prefill,) = _engines(serve, "prefill", 1)
    (decode,) = _engines(serve, "decode", 1)
    prefill.hold = threading.Event()
    try:
        with _proxy(serve, [prefill], [decode], timeout=0.5) as client:
            start = time.monotonic()
            r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            elapsed = time.monotonic() - start
    finally:
        prefill.hold.set()
    assert r.status_code == 504
    assert prefill.url in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "504"
    assert elapsed < 0.5 + 3.0  # the timeout plus a margin for a loaded machine
    assert decode.calls == []


def test_missing_kv_params_still_decodes(
    pd: tuple[httpx.Client, FakeEngine, FakeEngine], caplog: pytest.LogCaptureFixture
) -> None:
    client, prefill, decode = pd
    prefill.kv_params = None
    caplog.set_level(logging.WARNING, logger="kvbridge.proxy")
    # A stale kv_transfer_params from the client must not reach the decode either.
    request = {"model": "m", "prompt": "x", "kv_transfer_params": {"remote_host": "stale"}}
    r = client.post("/v1/completions", json=request)
    assert r.status_code == 200, r.text
    (dcall,) = decode.calls
    assert dcall["body"] == {"model": "m", "prompt": "x"}
    assert any("kv_transfer_params" in rec.getMessage() for rec in caplog.records)


def test_decode_status_and_body_passed_through(
    pd: tuple[httpx.Client, FakeEngine, FakeEngine],
) -> None:
    client, _, decode = pd
    error = {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 422}}
    decode.fail = (422, error)
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 422
    assert r.json() == error


def test_bad_json_is_400_without_calling_engines(
    pd: tuple[httpx.Client, FakeEngine, FakeEngine],
) -> None:
    client, prefill, decode = pd
    r = client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["code"] == "400"
    r = client.post("/v1/completions", json=["a", "list"])
    assert r.status_code == 400
    assert prefill.calls == [] and decode.calls == []


def test_models_and_health(serve: Serve) -> None:
    (prefill,) = _engines(serve, "prefill", 1)
    decodes = _engines(serve, "decode", 2)
    with _proxy(serve, [prefill], decodes) as client:
        r = client.get("/v1/models", headers={"Authorization": "Bearer sk-test"})
        assert r.status_code == 200
        assert r.json()["data"][0]["owned_by"] == "d0"
        assert decodes[0].calls[0]["headers"]["authorization"] == "Bearer sk-test"
        assert decodes[1].calls == []

        assert client.get("/health").json() == {"status": "ok"}
        r = client.get("/healthz/backends")
        assert r.status_code == 200
        body = r.json()
        assert [b["url"] for b in body["prefill"]] == [prefill.url]
        assert [b["url"] for b in body["decode"]] == [d.url for d in decodes]
        assert all(b["ok"] and b["status"] == 200 for b in body["prefill"] + body["decode"])

    dead = _closed_port_url()
    app = build_proxy_app([prefill.url], [dead], connect_timeout=2.0, admin_routes="open")
    with httpx.Client(base_url=serve(app), timeout=10.0, trust_env=False) as client:
        r = client.get("/healthz/backends")
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "degraded"
        assert body["prefill"][0]["ok"] is True
        assert body["decode"][0] == {
            "url": dead,
            "ok": False,
            "status": None,
            "error": body["decode"][0]["error"],
        }
        assert body["decode"][0]["error"]
        assert client.get("/v1/models").status_code == 502


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        build_proxy_app([], ["http://127.0.0.1:1"])
    with pytest.raises(ConfigError):
        build_proxy_app(["127.0.0.1:1"], ["http://127.0.0.1:1"])
    with pytest.raises(ConfigError):
        build_proxy_app(
            ["http://127.0.0.1:1"], ["http://127.0.0.1:1"], ca_certs=str(tmp_path / "nope.pem")
        )


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tls")
    ca = new_ca(d)
    new_ca(d, "other-ca")
    issue(ca, d, "server", "127.0.0.1", "localhost", combined=True)
    issue(ca, d, "client", "proxy.kvbridge.test", cert_suffix=".crt")
    return {
        name: str(d / name)
        for name in ("ca.pem", "other-ca.pem", "server.pem", "client.crt", "client.key")
    }


def test_tls_to_engines(serve: Serve, tls_files: dict[str, str]) -> None:
    (prefill,) = _engines(serve, "prefill", 1, ssl_certfile=tls_files["server.pem"])
    (decode,) = _engines(serve, "decode", 1, ssl_certfile=tls_files["server.pem"])
    assert prefill.url.startswith("https://") and decode.url.startswith("https://")
    request = {"model": "m", "prompt": "x"}

    with _proxy(serve, [prefill], [decode], ca_certs=tls_files["ca.pem"]) as client:
        r = client.post("/v1/completions", json=request)
    assert r.status_code == 200, r.text
    assert r.json()["served_by"] == "d0"
    assert decode.calls[0]["body"]["kv_transfer_params"] == prefill.kv_params

    # A CA that did not sign the engine's certificate: refused, and said so.
    with _proxy(serve, [prefill], [decode], ca_certs=tls_files["other-ca.pem"]) as client:
        r = client.post("/v1/completions", json=request)
    assert r.status_code == 502
    message = r.json()["error"]["message"]
    assert prefill.url in message
    assert "CERTIFICATE_VERIFY_FAILED" in message
    assert len(prefill.calls) == 1 and len(decode.calls) == 1


def test_mtls_to_engines(serve: Serve, tls_files: dict[str, str]) -> None:
    mtls = {
        "ssl_certfile": tls_files["server.pem"],
        "ssl_ca_certs": tls_files["ca.pem"],
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }
    (prefill,) = _engines(serve, "prefill", 1, **mtls)
    (decode,) = _engines(serve, "decode", 1, **mtls)
    request = {"model": "m", "prompt": "x"}

    client_cert = (tls_files["client.crt"], tls_files["client.key"])
    kwargs = {"ca_certs": tls_files["ca.pem"], "client_cert": client_cert}
    with _proxy(serve, [prefill], [decode], **kwargs) as client:
        r = client.post("/v1/completions", json=request)
    assert r.status_code == 200, r.text
    assert len(prefill.calls) == 1 and len(decode.calls) == 1

    # Without a client certificate the engine hangs up.
    with _proxy(serve, [prefill], [decode], ca_certs=tls_files["ca.pem"]) as client:
        r = client.post("/v1/completions", json=request)
    assert r.status_code == 502
    assert prefill.url in r.json()["error"]["message"]
    assert len(prefill.calls) == 1 and len(decode.calls) == 1


def test_deep_and_huge_bodies_are_400_and_413_without_calling_engines(
    pd: tuple[httpx.Client, FakeEngine, FakeEngine],
) -> None:
    client, prefill, decode = pd
    r = client.post("/v1/completions", content=b"[" * 100_000)
    assert r.status_code == 400, r.text
    assert "nests" in r.json()["error"]["message"]
    deep = b'{"model": "m", "prompt": "x", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = client.post("/v1/completions", content=deep)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/completions", content=b'{"prompt": "' + b"x" * (9 << 20) + b'"}')
    assert r.status_code == 413, r.text
    assert prefill.calls == [] and decode.calls == []


def test_prefill_timeout_is_a_504_naming_the_flag(serve: Serve) -> None:
    (prefill,) = _engines(serve, "prefill", 1)
    (decode,) = _engines(serve, "decode", 1)
    prefill.hold = threading.Event()
    try:
        with _proxy(serve, [prefill], [decode], timeout=60.0, prefill_timeout=0.5) as client:
            r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    finally:
        prefill.hold.set()
    assert r.status_code == 504
    message = r.json()["error"]["message"]
    assert prefill.url in message and "--prefill-timeout" in message
    assert decode.calls == []


# Each way an engine can close a reused connection without answering (tests/raw_engine.py),
# with the request body that provokes it: the close after the head needs a body larger
# than the buffers, so that it lands while the body is being written.
UNANSWERED = {
    "close-before-the-head-is-read": (raw_engine.close_before_head, "x"),
    "close-after-the-head-while-the-body-is-sent": (raw_engine.close_in_body, " " * (6 << 20)),
    "reset-before-the-status-line": (raw_engine.reset_unanswered, "x"),
    "eof-before-the-status-line": (raw_engine.eof_before_status, "x"),
}


@pytest.mark.parametrize("hop", ["prefill", "decode"])
@pytest.mark.parametrize("variant", list(UNANSWERED))
def test_request_closed_unanswered_is_sent_once_more(serve: Serve, variant: str,
                                                     hop: str) -> None:
    """The engine answers a first request on a connection, then closes that kept-alive
    connection without answering the second: the second is sent once more, on a new
    connection, to the same engine (no failover: there is no other)."""
    misbehave, prompt = UNANSWERED[variant]
    (fake,) = _engines(serve, hop, 1)
    with RawEngine(misbehave) as raw:
        fake.url = raw.url
        prefill, decode = (fake, _engines(serve, "decode", 1)[0]) if hop == "prefill" else (
            _engines(serve, "prefill", 1)[0], fake)
        with _proxy(serve, [prefill], [decode]) as client:
            for body in ({"model": "m", "prompt": "x"}, {"model": "m", "prompt": prompt}):
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
            metrics = client.get("/metrics").text
        assert (raw.connections, raw.answered) == (2, 2)
    assert "kvbridge_proxy_failovers_total{" not in metrics
    assert f'upstream_errors_total{{stage="{hop}"}}' not in metrics


def test_a_release_closed_unanswered_is_sent_once_more() -> None:
    """A release on a reused connection the prefill closes unanswered reaches it after
    all (the lease would otherwise hold the blocks)."""
    from kvbridge.proxy.background_tasks import TaskSet
    from kvbridge.proxy.engine_client import EngineClient
    from kvbridge.proxy.metrics import ProxyMetrics
    from kvbridge.proxy.release import Releaser

    async def main(url: str) -> bytes:
        engines = EngineClient(True, httpx.Timeout(5.0))
        metrics = ProxyMetrics()
        releaser = Releaser(engines, metrics, TaskSet(), None)
        try:
            assert (await engines.http.get(url + "/v1/models")).status_code == 200
            await releaser.release(url, {"remote_block_ids": [1]}, "r1")
        finally:
            await engines.aclose()
        return metrics.render()

    with RawEngine(raw_engine.eof_before_status) as raw:
        assert b'kvbridge_proxy_kv_releases_total{outcome="ok"} 1.0' in anyio.run(main, raw.url)
        assert (raw.connections, raw.answered) == (2, 2)


def test_prewarm_refused_for_want_of_the_token_is_counted_and_logged(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    async def info(request: Request) -> Response:
        return JSONResponse(
            {"side_channel_host": "127.0.0.1", "side_channel_port": 1, "handshake_method": "http"}
        )

    async def prewarm(request: Request) -> Response:
        return JSONResponse(
            {"error": {"message": "missing or invalid bearer token"}}, status_code=401
        )

    prefill_url = serve(Starlette(routes=[Route("/v1/kv/info", info)]))
    decode_url = serve(Starlette(routes=[Route("/v1/kv/prewarm", prewarm, methods=["POST"])]))
    app = build_proxy_app([prefill_url], [decode_url], admin_routes="open")
    with (
        caplog.at_level(logging.ERROR, logger="kvbridge.proxy"),
        httpx.Client(base_url=serve(app), timeout=10, trust_env=False) as client,
    ):
        wait_until(lambda: client.get("/v1/kv/prewarm").json()["done"], 30, "prewarm done",
                   every=0.05)
        metrics = client.get("/metrics").text
    assert 'kvbridge_proxy_prewarm_failures_total{reason="unauthorized"} 1.0' in metrics
    assert any("--kv-token-file" in r.message for r in caplog.records)


def test_prefill_timeout_fails_over_to_another_prefill(serve: Serve) -> None:
    slow, fast = _engines(serve, "prefill", 2)
    (decode,) = _engines(serve, "decode", 1)
    slow.hold = threading.Event()
    try:
        with _proxy(serve, [slow, fast], [decode], timeout=60.0, prefill_timeout=1.0) as client:
            for _ in range(2):
                r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
                assert r.status_code == 200, r.text
    finally:
        slow.hold.set()
    assert len(slow.calls) >= 1 and len(fast.calls) == 2
    assert all(
        c["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-p1" for c in decode.calls
    )


# -- the first token straight from the prefill ------------------------------------------------

def _first_token_prefill(serve: Serve) -> FakeEngine:
    (prefill,) = _engines(serve, "prefill", 1)
    assert prefill.kv_params is not None
    prefill.kv_params = {**prefill.kv_params, "remote_output_token_ids": [7]}
    return prefill


def test_first_token_from_the_prefill_then_a_live_decode(serve: Serve) -> None:
    """The prefill's token is the stream's first chunk; a decode that dies before its first
    byte is replaced by another one, which gets ``sent_token_ids``; the prefill is asked
    once (its token is already with the client)."""
    prefill = _first_token_prefill(serve)
    (decode,) = _engines(serve, "decode", 1)
    with RawServer(_dies_after_headers) as dying:
        dead = f"http://127.0.0.1:{dying.port}"
        app = build_proxy_app([prefill.url], [dead, decode.url], timeout=5.0,
                              connect_timeout=2.0, prewarm=False, admin_routes="open")
        with httpx.Client(base_url=serve(app), timeout=10.0, trust_env=False) as client:
            r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
            assert r.status_code == 200, r.text
            events = [e for e in r.text.split("\n\n") if e]
            assert json.loads(events[0][6:])["choices"][0]["text"] == "x"
            assert "d0" in r.text and events[-1] == "data: [DONE]"
            assert 'kvbridge_proxy_first_token_from_total{source="prefill"} 1.0' in client.get(
                "/metrics").text
    assert len(prefill.calls) == 1 and len(decode.calls) == 1
    sent = decode.calls[0]["body"]["kv_transfer_params"]
    assert sent["sent_token_ids"] == [7] and sent["remote_engine_id"] == "engine-p0"
    assert prefill.releases == []  # the live decode reads the hold


def test_first_token_from_the_prefill_without_a_decode_ends_with_an_error(serve: Serve) -> None:
    prefill = _first_token_prefill(serve)
    with RawServer(_dies_after_headers) as dying:
        app = build_proxy_app([prefill.url], [f"http://127.0.0.1:{dying.port}"], timeout=5.0,
                              connect_timeout=2.0, prewarm=False)
        with httpx.Client(base_url=serve(app), timeout=10.0, trust_env=False) as client:
            r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200  # committed with the first token
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    assert events[0]["choices"][0]["text"] == "x"
    assert "no decode instance could continue" in events[-1]["error"]["message"]
    wait_until(lambda: prefill.releases, 5, "the prefill's hold released")


@pytest.mark.parametrize("body", [{"stream": False}, {"stream": True, "logprobs": 1},
                                  {"stream": True, "stop": ["."]}])
def test_the_first_token_waits_for_the_decode_when_the_prefill_cannot_stand_in(
        serve: Serve, body: dict[str, Any]) -> None:
    prefill = _first_token_prefill(serve)
    (decode,) = _engines(serve, "decode", 1)
    with _proxy(serve, [prefill], [decode]) as client:
        r = client.post("/v1/completions", json={"prompt": "x", **body})
        assert r.status_code == 200, r.text
    assert "sent_token_ids" not in decode.calls[0]["body"]["kv_transfer_params"]


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": "m", "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/models", None)])
def test_an_authorization_header_that_is_not_ascii_is_a_400(
    pd: tuple[httpx.Client, FakeEngine, FakeEngine], caplog: pytest.LogCaptureFixture,
    method: str, path: str, body: dict | None,
) -> None:
    """A Latin-1 byte in the client's ``Authorization`` (which the proxy passes on to the
    engines) is refused as an invalid header: 400 naming it, no engine called, no
    traceback; the proxy goes on serving."""
    client, prefill, decode = pd
    with caplog.at_level(logging.WARNING):
        r = client.request(method, path, json=body, headers={"authorization": b"Bearer caf\xe9"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "Authorization" in error["message"]
    assert not prefill.calls and not decode.calls
    assert not [rec for rec in caplog.records if rec.exc_info], caplog.text
    ok = client.request(method, path, json=body, headers={"authorization": "Bearer sk-test"})
    assert ok.status_code == 200, ok.text
