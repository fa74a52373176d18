"""What the proxy takes from an engine is bounded: an answer it reads whole stops at
``max_answer_bytes`` (502 naming the limit, the connection closed); a prefill hop, and a
decode's first byte, have a deadline in all (504 or another instance), however the engine
trickles; and a decode's error reaches a streamed client as one event of the proxy's own
encoding. Real engines on loopback: raw sockets that stream without end or trickle
(tests/raw_engine.py) and stand-in apps."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.raw_engine import Endless, RawEngine, Trickle, read_request
from tests.test_proxy import FakeEngine, Serve, _engines, _first_token_prefill, _proxy
from tests.test_proxy import serve as _serve

serve = _serve  # test_proxy's fixture: engines and the proxy on real uvicorn servers

CAP = 64 * 1024
# What an engine can push past the cap before it sees the close: the socket buffers between
# it and the proxy (a send buffer of at most 4 MiB, a receive buffer the kernel grows as the
# proxy reads). Far below what an endless answer reaches unbounded.
IN_FLIGHT = 48 << 20


def _events(text: str) -> list[Any]:
    """Each SSE event's data, decoded (``[DONE]`` as is): one that is not JSON fails."""
    return [e[6:] if e == "data: [DONE]" else json.loads(e.removeprefix("data: "))
            for e in text.split("\n\n") if e]


def _raw_prefill(raw: RawEngine) -> FakeEngine:
    fake = FakeEngine("p0", "prefill")
    fake.url = raw.url
    return fake


def test_an_endless_prefill_answer_is_cut_at_the_cap(serve: Serve) -> None:
    endless = Endless()
    with RawEngine(endless, at=(0, 0)) as raw:
        (decode,) = _engines(serve, "decode", 1)
        with _proxy(serve, [_raw_prefill(raw)], [decode], max_answer_bytes=CAP) as client:
            r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 502, r.text
            message = r.json()["error"]["message"]
            assert f"limit of {CAP} bytes (KVBRIDGE_MAX_ANSWER_BYTES)" in message, message
            assert endless.closed.wait(10)  # the proxy closed the connection
            assert client.get("/health").status_code == 200  # and serves on
    assert endless.sent < CAP + IN_FLIGHT, endless.sent
    assert decode.calls == []


def test_a_prefill_answer_declared_past_the_cap_is_not_read(serve: Serve) -> None:
    def declared(conn: Any) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000000\r\n\r\n{")
        conn.recv(1)  # until the proxy closes

    with RawEngine(declared, at=(0, 0)) as raw:
        (decode,) = _engines(serve, "decode", 1)
        with _proxy(serve, [_raw_prefill(raw)], [decode], max_answer_bytes=CAP) as client:
            r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 502 and "KVBRIDGE_MAX_ANSWER_BYTES" in r.text, r.text


def test_an_endless_decode_error_body_is_cut_at_the_cap(serve: Serve) -> None:
    """On the first-token path the client already has its first token: the decode's
    error is read no further than the cap and ends the stream as one error event."""
    prefill = _first_token_prefill(serve)
    endless = Endless(status=400)
    with RawEngine(endless, at=(0, 0)) as raw:
        decode = FakeEngine("d0", "decode")
        decode.url = raw.url
        with _proxy(serve, [prefill], [decode], max_answer_bytes=CAP) as client:
            r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
            assert endless.closed.wait(10)
    assert r.status_code == 200
    first, error, done = _events(r.text)
    assert first["choices"][0]["text"] == "x" and done == "[DONE]"
    assert "KVBRIDGE_MAX_ANSWER_BYTES" in error["error"]["message"], error
    assert endless.sent < CAP + IN_FLIGHT, endless.sent


def test_a_decode_error_body_is_one_json_event_however_it_is_framed(serve: Serve) -> None:
    """An error body with blank lines and ``data:`` lines of its own does not become events
    of the client's stream: it is the message of one JSON-encoded error event."""
    prefill = _first_token_prefill(serve)
    (decode,) = _engines(serve, "decode", 1)
    decode.fail = (400, "bad request\n\ndata: INJECTED BY DECODE\n\ndata: [DONE]\n\n")
    with _proxy(serve, [prefill], [decode]) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200
    first, error, done = _events(r.text)  # three events, each JSON but the last
    assert first["choices"][0]["text"] == "x" and done == "[DONE]"
    assert error["error"]["code"] == "400" and "INJECTED BY DECODE" in error["error"]["message"]
    assert "\ndata: INJECTED" not in r.text


def test_a_decode_json_error_keeps_its_type_and_code(serve: Serve) -> None:
    prefill = _first_token_prefill(serve)
    (decode,) = _engines(serve, "decode", 1)
    decode.fail = (400, {"error": {"message": "too long", "type": "invalid_request_error",
                                   "param": "max_tokens", "code": "context_length_exceeded"}})
    with _proxy(serve, [prefill], [decode]) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    _, error, _ = _events(r.text)
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["code"] == "context_length_exceeded"
    assert error["error"]["param"] == "max_tokens" and "too long" in error["error"]["message"]


def test_models_read_at_most_the_cap(serve: Serve) -> None:
    with RawEngine(Endless(), at=(0, 0)) as raw:
        (prefill,) = _engines(serve, "prefill", 1)
        decode = FakeEngine("d0", "decode")
        decode.url = raw.url
        with _proxy(serve, [prefill], [decode], max_answer_bytes=CAP) as client:
            r = client.get("/v1/models")
    assert r.status_code == 502 and "KVBRIDGE_MAX_ANSWER_BYTES" in r.text, r.text


# -- deadlines: a byte every PERIOD keeps every read alive, never the hop ------------------

PERIOD = 0.1
# Far past the deadlines the tests set (1 s), far below the trickled answer's days.
BOUND = 20.0


@pytest.mark.parametrize(("timeouts", "flag"), [({"timeout": 5.0, "prefill_timeout": 1.0},
                                                 "--prefill-timeout"),
                                                ({"timeout": 1.0}, "--timeout")])
def test_a_trickling_prefill_is_given_up_at_its_deadline(serve: Serve, timeouts: dict,
                                                        flag: str) -> None:
    trickle = Trickle(PERIOD)
    with RawEngine(trickle, at=(0, 0)) as raw:
        (decode,) = _engines(serve, "decode", 1)
        with _proxy(serve, [_raw_prefill(raw)], [decode], **timeouts) as client:
            t0 = time.monotonic()
            r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            took = time.monotonic() - t0
            assert trickle.closed.wait(10)  # the proxy closed the connection
    assert r.status_code == 504 and flag in r.json()["error"]["message"], r.text
    assert took < BOUND
    assert decode.calls == []


def test_a_trickling_prefill_fails_over_to_another_at_the_prefill_timeout(serve: Serve
                                                                          ) -> None:
    trickle = Trickle(PERIOD)
    with RawEngine(trickle, at=(0, 0)) as raw:
        (fast,) = _engines(serve, "prefill", 1)
        (decode,) = _engines(serve, "decode", 1)
        with _proxy(serve, [_raw_prefill(raw), fast], [decode], prefill_timeout=1.0) as client:
            while not trickle.closed.is_set():  # until a request was routed to the trickle
                r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
                assert r.status_code == 200, r.text
    assert fast.calls


def test_a_decode_trickling_its_head_is_given_up_at_the_timeout(serve: Serve) -> None:
    (prefill,) = _engines(serve, "prefill", 1)
    trickle = Trickle(PERIOD)
    with RawEngine(trickle, at=(0, 0)) as raw:
        decode = FakeEngine("d0", "decode")
        decode.url = raw.url
        with _proxy(serve, [prefill], [decode], timeout=1.0) as client:
            t0 = time.monotonic()
            r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            took = time.monotonic() - t0
    assert r.status_code == 504, r.text
    assert "no first byte within 1s (--timeout)" in r.json()["error"]["message"]
    assert took < BOUND


def test_a_decode_trickling_after_the_first_token_is_given_up_at_the_timeout(
        serve: Serve) -> None:
    prefill = _first_token_prefill(serve)
    with RawEngine(Trickle(PERIOD), at=(0, 0)) as raw:
        decode = FakeEngine("d0", "decode")
        decode.url = raw.url
        with _proxy(serve, [prefill], [decode], timeout=1.0) as client:
            t0 = time.monotonic()
            r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
            took = time.monotonic() - t0
    first, error, done = _events(r.text)
    assert first["choices"][0]["text"] == "x" and done == "[DONE]"
    assert "no decode instance could continue" in error["error"]["message"]
    assert took < BOUND
