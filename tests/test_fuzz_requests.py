"""Fuzz the parsers a client's request goes through: the body pre-scan, the request schemas
and ``kv_transfer_params`` (with ``sent_token_ids``), alone and behind a real engine API and
a real proxy. Each answer is a 4xx or the project's own refusal (``RequestError``,
``InvalidKVTransferParams``): never a 5xx, never another exception, never a hang past the
deadline.

The budget is small (a few seconds in all), for the fast loop; the strategies lean on what
broke before: lone surrogates, unterminated strings of escapes, deep nesting, wrong types.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvbridge.engine import AsyncEngine, build_engine
from kvbridge.errors import InvalidKVTransferParams, RequestError
from kvbridge.limits import check_json_body, decode_json_body, json_depth
from kvbridge.openai.schemas import check_request, parse_request
from kvbridge.params import KVTransferParams
from kvbridge.proxy import build_proxy_app
from kvbridge.server.api import build_app
from kvbridge.tools.testing.api_server import BackgroundServer

# Per example: a scan or a schema check of a body of some KiB takes milliseconds.
UNIT = settings(max_examples=60, deadline=timedelta(seconds=2), derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SERVER = settings(max_examples=25, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow, HealthCheck.data_too_large])
HTTP_DEADLINE = 5.0  # seconds one request to a server may take
# The body that stalled servers (an unterminated string of quote-backslash pairs), 64 KiB:
# every body test tries it first.
STALLER = b'"\\' * (32 << 10)

# -- strategies ----------------------------------------------------------------------------

# Text, half of it with a lone surrogate (json.dumps writes it as a \ud800 escape).
_utf8 = st.text(st.characters(codec="utf-8"), max_size=10)
text = st.one_of(_utf8, st.builds(lambda a, c, b: a + c + b, _utf8,
                                  st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                                  _utf8))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), text)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)), max_leaves=12)
token_ids = st.lists(st.integers(-2, 2**32), max_size=8)


def _field(good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value of the right type, sometimes any JSON value."""
    return st.one_of(good, good, json_values)


kv_params = st.fixed_dictionaries({}, optional={
    "do_remote_prefill": _field(st.booleans()),
    "do_remote_decode": _field(st.booleans()),
    "remote_engine_id": _field(text),
    "remote_block_ids": _field(st.lists(st.integers(-1, 2**31), max_size=8)),
    "remote_request_id": _field(text),
    "remote_host": _field(st.sampled_from(["127.0.0.1", "", "h" * 300])),
    "remote_port": _field(st.integers(-1, 70000)),
    "tp_size": _field(st.integers(-1, 5000)),
    "remote_epoch": _field(text),
    "handshake_method": _field(st.sampled_from(["zmq", "http", "etcd", "tcp"])),
    "remote_num_tokens": _field(st.integers(-1, 10**6)),
    "remote_lease_ms": _field(st.integers(-1, 10**9)),
    "remote_hold_key": _field(text),
    "remote_output_token_ids": _field(token_ids),
    "sent_token_ids": _field(token_ids),
    "unknown_field": json_values,
})

common = {
    "model": _field(st.sampled_from(["tiny", "other"])),
    "max_tokens": _field(st.integers(-1, 6)),
    "temperature": _field(st.floats(-1, 3)),
    "top_p": _field(st.floats(-0.5, 1.5)),
    "n": _field(st.integers(0, 3)),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "seed": _field(st.integers(-(2**64), 2**64)),
    "ignore_eos": _field(st.booleans()),
    "kv_transfer_params": st.one_of(kv_params, json_values),
    "user": text,
}
completions = st.fixed_dictionaries(
    {"prompt": _field(st.one_of(text, st.lists(st.integers(-1, 300), max_size=6)))},
    optional=common)
messages = st.lists(st.fixed_dictionaries(
    {"role": _field(st.sampled_from(["user", "assistant", "system"])),
     "content": _field(st.one_of(text, st.none()))}), max_size=3)
# (a chat without a limit generates until the context is full: too long for the budget)
chats = st.fixed_dictionaries({"messages": _field(messages),
                               "max_completion_tokens": _field(st.integers(-1, 6))},
                              optional=common)

# Pieces that once made a scanner or a decoder misbehave, repeated into bodies of some KiB.
# (An unterminated string of quote-backslash pairs took the old scan 6 s for 32 KiB.)
crafted = st.builds(
    lambda piece, n, head: head + piece * n,
    st.sampled_from([b'"\\', b'\\"', b'"\\', b'"', b'"[', b'[', b'{"a":', b'\\u',
                     b'"\\ud800', b'\\', b'[]', b'"\\\\']),
    st.one_of(st.sampled_from([1, 100, 4 << 10, 16 << 10]), st.integers(1, 16 << 10)),
    st.sampled_from([b"", b'{"prompt": ', b'{"prompt": "']))


def _bodies(requests: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        requests.map(lambda r: json.dumps(r).encode()),
        requests.map(lambda r: json.dumps(r).encode()),
        st.binary(max_size=300),
        crafted,
        json_values.map(lambda v: json.dumps(v).encode()),
    )


# -- the parsers alone ---------------------------------------------------------------------

def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@UNIT
@example(body=STALLER)
@given(body=crafted)
def test_a_crafted_body_is_scanned_within_the_deadline(body: bytes) -> None:
    try:
        check_json_body(body)
    except RequestError as e:  # nested too deep
        assert e.status == 400, e.status


@UNIT
@example(body=STALLER, chat=False)
@given(body=st.one_of(_bodies(completions), _bodies(chats)), chat=st.booleans())
def test_a_body_is_parsed_or_refused_with_a_4xx(body: bytes, chat: bool) -> None:
    try:
        check_json_body(body)
        decoded = decode_json_body(body)
    except RequestError as e:
        assert 400 <= e.status < 500, e.status
        return
    # Decoded: the pre-scan saw the depth the decoder went to, and what the proxy decoded
    # it can encode again for the engines.
    assert json_depth(body) == _depth(decoded)
    json.dumps(decoded, ensure_ascii=False).encode()
    if not isinstance(decoded, dict):
        return
    # The proxy checks what it decoded; what it lets through, the engine's parse of the
    # same bytes accepts too.
    try:
        check_request(decoded, chat)
    except RequestError as e:
        assert 400 <= e.status < 500, e.status
        return
    parse_request(body, chat)


@UNIT
@given(obj=st.one_of(kv_params, json_values), prompt_tokens=st.integers(0, 200),
       block_size=st.sampled_from([1, 16]))
def test_kv_transfer_params_parse_or_refuse_cleanly(obj: Any, prompt_tokens: int,
                                                    block_size: int) -> None:
    try:
        params = KVTransferParams.from_obj(obj)
        if params is None:
            return
        params.check()
        assert KVTransferParams.from_obj(params.to_json()) == params
        params.plan_load(prompt_tokens, block_size)
    except InvalidKVTransferParams as e:
        assert e.param == "kv_transfer_params" and str(e).startswith("invalid kv_transfer_params")


# -- behind real servers -------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_api() -> Iterator[httpx.Client]:
    engine = AsyncEngine(build_engine(num_blocks=64))
    with BackgroundServer(build_app(engine, "tiny", shutdown_engine_on_exit=True)) as srv, \
            httpx.Client(base_url=srv.url, timeout=HTTP_DEADLINE, trust_env=False) as c:
        yield c


def _stand_in_engine() -> Starlette:
    """A prefill and decode in one: answers every request it gets, as an engine would."""
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1],
              "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}

    async def complete(request: Request) -> Response:
        await request.body()
        return JSONResponse({"id": "cmpl-x", "choices": [{"text": "x", "index": 0}],
                             "kv_transfer_params": params})

    async def ok(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/completions", complete, methods=["POST"]),
                             Route("/v1/chat/completions", complete, methods=["POST"]),
                             Route("/v1/kv/release", ok, methods=["POST"]),
                             Route("/health", ok)])


@pytest.fixture(scope="module")
def proxy() -> Iterator[httpx.Client]:
    with BackgroundServer(_stand_in_engine()) as prefill, \
            BackgroundServer(_stand_in_engine()) as decode:
        app = build_proxy_app([prefill.url], [decode.url], prewarm=False,
                              timeout=HTTP_DEADLINE, first_token_from="decode")
        with BackgroundServer(app) as srv, \
                httpx.Client(base_url=srv.url, timeout=HTTP_DEADLINE, trust_env=False) as c:
            yield c


def _assert_answered(client: httpx.Client, path: str, body: bytes) -> None:
    start = time.monotonic()
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    # Measured too: a server in this process that holds the GIL delays the client's timeout.
    took = time.monotonic() - start
    assert took < HTTP_DEADLINE, f"{path} answered {len(body)} bytes after {took:.1f}s"
    assert r.status_code < 500, (path, body[:200], r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err


@SERVER
@example(body=STALLER)
@given(body=_bodies(completions))
def test_the_engine_api_answers_completions_with_a_4xx_or_text(engine_api, body):
    _assert_answered(engine_api, "/v1/completions", body)


@SERVER
@example(body=STALLER)
@given(body=_bodies(chats))
def test_the_engine_api_answers_chats_with_a_4xx_or_text(engine_api, body):
    _assert_answered(engine_api, "/v1/chat/completions", body)


@SERVER
@example(body=STALLER)
@given(body=_bodies(completions))
def test_the_proxy_answers_completions_with_a_4xx_or_text(proxy, body):
    _assert_answered(proxy, "/v1/completions", body)


@SERVER
@example(body=STALLER)
@given(body=_bodies(chats))
def test_the_proxy_answers_chats_with_a_4xx_or_text(proxy, body):
    _assert_answered(proxy, "/v1/chat/completions", body)
